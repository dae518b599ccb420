// Ring attention: exact attention over a sequence split across the ranks of a communicator.
//
// Each of N ranks holds S/N tokens of Q, K and V (its shard, laid out by a SequenceLayoutKind).
// K/V shards rotate around the ring while every rank runs the local block (ringattn/attention.hpp)
// of its Q against each visiting shard, merging partial results through the online-softmax
// statistics (LSE) in the accumulator dtype; the backward rotates K/V again together with the
// dK/dV accumulators. The result is the attention of the whole sequence, sharded like the inputs.
//
//   auto comm = ringattn::mpi_world_communicator();      // after MPI_Init
//   ringattn::RingAttention ring(comm, ringattn::SequenceLayoutKind::zigzag);
//   ring.shard(q_full, q);                               // or load this rank's tokens directly
//   ring.forward({.q = q, .k = k, .v = v, .o = o, .lse = lse, .scale = 0.125, .causal = true});
//
// Backends: host tensors (f32, f64; any head dims, V's may differ from Q's and K's) run the CPU
// block and move over MPI; device tensors (bf16, f16; head_dim 32, 64, 96, 128, 192 or 256, the
// same for Q, K and V) run the CUDA block and move over NCCL, queued on a CUDA stream. The communicator's memory must be
// the tensors' memory.
//
// Errors: every call validates its arguments on every rank and compares shapes, dtypes, layout,
// mask and scale across the ranks before the first transfer, so a mismatch or a bad argument on
// one rank throws ringattn::Error with the same message on every rank instead of hanging. A
// failure inside the ring itself (a CUDA, MPI or NCCL error) leaves transfers unfinished: the
// communicator is then unusable, as the job usually is.
//
// Masks: besides `causal`, a sliding window (window_left, window_right) and packed documents
// (DocumentStarts), all by global position exactly as in Mask. Every call plans from them which
// (Q chunk, K/V chunk) pairs of the layout have visible work and skips the others, and runs only
// as many ring steps as the farthest K/V shard some rank needs (the same count on every rank: it
// follows from the layout and the mask, which the ranks agree on first). A causal window narrower
// than a shard then moves K/V one hop instead of N - 1 with the contiguous layout, and documents
// that end at shard edges move nothing; under zigzag the chunk before a rank's second chunk lies
// on the next rank, N - 1 hops away, so any window wider than one token still needs every step.
// The backward's dK/dV accumulators still go all the way round to their owners when anything
// travels (the ring only sends forward): a shorter ring saves the backward's K/V transfers only.
// To plan, the ring reads the document starts on the host: for device tensors (on more than one
// rank) it copies them to the host once per call, synchronously on the call's stream (they are
// small), before the first transfer. The ranks compare window_left, window_right and the count of
// starts with the other arguments, then a digest of the starts (every batch row's list), so a
// rank with another mask fails like one with another shape, with the same message everywhere.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "ringattn/attention.hpp"
#include "ringattn/tensor.hpp"

namespace ringattn {

// A group of ranks that exchange data (MPI for host memory, NCCL for device memory). Opaque here;
// made by the factories below, shared by everything that uses the group.
class Communicator;

// MPI_COMM_WORLD (duplicated), moving host memory. MPI must be initialised by the caller and
// finalised after the last communicator is gone.
std::shared_ptr<Communicator> mpi_world_communicator();
// MPI_COMM_WORLD over NCCL, moving device memory: each rank uses the GPU of its node-local rank
// (modulo the GPUs it sees) and bootstraps NCCL through MPI. MPI must be initialised. A library
// built without CUDA throws Error (unsupported).
std::shared_ptr<Communicator> nccl_world_communicator();
// The ranks of `comm` with the same color (>= 0) as a new communicator, ordered by key: a dp x cp
// mesh gives each data-parallel replica the ring of its context-parallel ranks
// (color = rank / cp, key = rank % cp). Collective over `comm`.
std::shared_ptr<Communicator> split_communicator(const Communicator& comm, int color, int key);
int communicator_rank(const Communicator& comm);
int communicator_size(const Communicator& comm);

// How a sequence of S tokens is split over N ranks.
//   contiguous: rank r holds tokens [r*S/N, (r+1)*S/N); S % N == 0. Under a causal mask rank 0
//               has almost nothing to do and rank N-1 everything.
//   zigzag:     2N chunks of S/(2N) tokens; rank r holds chunk r then chunk 2N-1-r; S % 2N == 0.
//               Under a causal mask every rank does the same work at every step.
//   balanced:   S % 2N == 0. Contiguous where that split is already even under the call's mask
//               (a sliding window); else cN equal chunks (c = 2, 4, 8, ...) given to the ranks, c
//               each, so that each rank's visible work under the mask (causal, window, packed
//               documents) is as even as the chunks allow, each rank's in the order of their
//               positions. The layout follows the mask: every rank computes the same one from
//               the same mask, and the caller shards with the mask too (global_positions, shard
//               and unshard taking a Mask). A causal mask alone gives zigzag's chunks.
enum class SequenceLayoutKind : int { contiguous = 0, zigzag = 1, balanced = 2 };
std::string_view sequence_layout_name(SequenceLayoutKind kind);
// "contiguous", "zigzag" or "balanced"
SequenceLayoutKind parse_sequence_layout(std::string_view name);

// The local shards of one forward call (Sl = S/N tokens on every rank):
//   q     [batch, Sl, q_heads, head_dim]       k  [batch, Sl, kv_heads, head_dim]
//   v     [batch, Sl, kv_heads, v_head_dim]    (v_head_dim may differ from head_dim on the host)
//   o     [batch, Sl, q_heads, v_head_dim]     input dtype, overwritten
//   lse   [batch, q_heads, Sl]                 accumulator dtype (f64 for f64, f32 otherwise),
//                                              overwritten; keep it for the backward
// Any strides (packed QKV views work). `causal` masks by global position: the token at position i
// sees the keys at positions <= i, whichever ranks hold them.
// Memory a call may use for its workspace instead of the ring's own (device memory for device
// tensors): for the duration of the call the caller leaves it alone and it overlaps none of the
// call's tensors; afterwards its contents are unspecified. A trainer lends buffers that are dead
// while attention runs, so that the ring costs no memory of its own.
// persistent: the caller keeps the memory allocated, at this address, until
// RingAttention::release_scratch has returned on every rank (and frees it only after). The ring
// may then keep what it sets up for the memory between calls: on GPUs whose neighbours exchange
// by the copy engines, the previous rank's CUDA IPC mapping of it, which otherwise costs each call
// milliseconds of host time and a wait at its end.
struct ScratchRegion {
  void* data = nullptr;
  std::size_t bytes = 0;
  bool persistent = false;
};

struct RingForwardArgs {
  TensorView q{}, k{}, v{};
  TensorView o{};
  TensorView lse{};
  double scale = 0.0;  // > 0, typically 1/sqrt(head_dim)
  bool causal = false;
  void* stream = nullptr;  // cudaStream_t for device tensors (nullptr: the default stream)
  std::vector<ScratchRegion> scratch;  // optional: see ScratchRegion
  // Sliding window and packed documents by global position, as in Mask (ringattn/attention.hpp),
  // last so that initialisers written before them still read the same. The document starts cover
  // the whole sequence and are the same list on every rank, in the memory of the tensors: host
  // memory for host tensors, device memory for device tensors (see "Masks" above).
  std::int64_t window_left = 0, window_right = 0;
  DocumentStarts documents{};
};

// The local shards of one backward call: q, k, v, scale and causal as in the forward, o and lse
// its outputs, dout the gradient of o (input dtype, o's shape). dq, dk and dv (the shapes of q, k
// and v) are in the accumulator dtype and overwritten with the gradients of this rank's q, k and
// v over the whole sequence. On one rank dk and dv may instead have the
// input dtype (both): the local block then writes them rounded once (see BackwardArgs). Also on
// one rank only, key_rotation (tables [Sl, head_dim / 2]) undoes the keys' RoPE on dk in the same
// call (see BackwardArgs); a ring of more ranks names it as an error.
struct RingBackwardArgs {
  TensorView q{}, k{}, v{};
  TensorView o{}, lse{};
  TensorView dout{};
  TensorView dq{}, dk{}, dv{};
  double scale = 0.0;
  bool causal = false;
  bool deterministic = false;  // bitwise-reproducible gradients (the CPU block always is)
  void* stream = nullptr;
  std::vector<ScratchRegion> scratch;  // optional: see ScratchRegion
  KeyRotation key_rotation{};
  std::int64_t window_left = 0, window_right = 0;  // as in the forward
  DocumentStarts documents{};
};

// The ring schedule over one communicator. Its workspace (two K/V buffers, the running output,
// the travelling dK/dV accumulators, a step buffer from three ranks on) goes, buffer by buffer,
// largest first, into the first region of the call's scratch with room; the rest it keeps
// between calls, growing each buffer to the largest call (and releasing one that a call's scratch
// holds). One rank needs none.
// Calls are collective: every rank of the communicator makes the same calls in the same order.
// One object serves one stream at a time.
class RingAttention {
 public:
  RingAttention(std::shared_ptr<Communicator> comm, SequenceLayoutKind layout);
  ~RingAttention();
  RingAttention(RingAttention&&) noexcept;
  RingAttention& operator=(RingAttention&&) noexcept;
  RingAttention(const RingAttention&) = delete;
  RingAttention& operator=(const RingAttention&) = delete;

  int rank() const;
  int size() const;
  SequenceLayoutKind layout() const;
  const Communicator& communicator() const;

  void forward(const RingForwardArgs& args);
  void backward(const RingBackwardArgs& args);

  // The bytes of workspace this object holds now (not counting the scratch lent to calls).
  std::size_t owned_workspace_bytes() const;
  // Collective, between calls: ends what the communicator keeps for persistent scratch (lent to
  // this or any other ring over it); once it returns on a rank, that rank's persistent scratch
  // may be freed. Waits for the previous rank at most `timeout_s` seconds, then warns on stderr
  // and returns, so a rank that never comes cannot hang the others.
  void release_scratch(double timeout_s = 60.0);

  // This rank's tokens of a sequence of `total_length`: their global positions (for RoPE), and
  // copies between a whole host tensor and this rank's shard, for any dtype and strides. Rank 4:
  // [batch, S, heads, head_dim] <-> [batch, S/N, heads, head_dim]; rank 3: [batch, heads, S] <->
  // [batch, heads, S/N] (LSE). unshard writes only this rank's tokens of `full`. Throws Error
  // when S is not a multiple of N (contiguous) or 2N (zigzag, balanced).
  // The balanced layout follows the mask of the calls the shards go to: causal, window and
  // documents as in RingForwardArgs, the document starts in host memory here (batch rows of
  // their own when documents.batch_stride != 0). Without a mask it is an Error; the other
  // layouts ignore the mask.
  std::vector<std::int64_t> global_positions(std::int64_t total_length) const;
  void shard(const TensorView& full, const TensorView& local) const;
  void unshard(const TensorView& local, const TensorView& full) const;
  std::vector<std::int64_t> global_positions(std::int64_t total_length, const Mask& mask,
                                             std::int64_t batch = 1) const;
  void shard(const TensorView& full, const TensorView& local, const Mask& mask) const;
  void unshard(const TensorView& local, const TensorView& full, const Mask& mask) const;

 private:
  // The schedule itself, also run in parts for benchmarks (parallel/ring_attention.hpp).
  friend struct RingAttentionInternals;
  struct Workspace;
  std::shared_ptr<Communicator> comm_;
  SequenceLayoutKind layout_;
  std::unique_ptr<Workspace> workspace_;
};

}  // namespace ringattn
