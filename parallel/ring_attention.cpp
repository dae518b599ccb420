// The ring schedule, written once against Communicator and the backend switch of local_block.hpp.
//
// Forward. K and V travel together in one contiguous buffer (only the kv_heads heads, in the input
// dtype; K of d_qk and V of d_v elements a head, which may differ), double buffered: at step s a rank starts sending the shard it holds to rank + 1 while
// receiving the next one from rank - 1, computes its Q against the shard it holds, then waits. The
// running (O, LSE) stays in the accumulator dtype (the block's combine mode merges into it; LSE is
// the caller's output itself) and O is written in the input dtype once, after the last step.
//
// Backward. K/V rotate again, in the same order, and the dK/dV accumulator of each shard travels
// one step behind them in a second message (accumulator dtype). Two messages rather than one
// packed K|V|dK|dV: a shard's accumulator is complete for this rank only after its step's compute,
// whereas K/V can leave before it. So at step s a rank starts sending K/V, computes its
// contribution for the visiting shard into a zeroed step buffer, waits (the next K/V and the
// visiting shard's accumulator, sent by rank - 1 after its step s - 1, have arrived meanwhile),
// adds the step buffer into the accumulator and sends it on. Both transfers hide behind a step of
// compute. After N steps every accumulator has collected all N contributions and arrived at the
// shard's owner (N sends of dK/dV, N - 1 of K/V); dQ stays local, added into by every step.
//
// Masks. Each call plans from the layout and the mask (ring_steps, visible_pairs): the (Q chunk,
// K/V chunk) pairs with nothing visible make no block call, and the ring runs only as many steps
// as the farthest shard some rank needs, computed from what every rank knows alike, so all ranks
// run the same steps and the K/V exchanges pair up. In the forward that is all: K/V make
// steps - 1 hops. In the backward K/V also stop there, but an accumulator must get back to its
// owner, and the ring sends only forward: the accumulators keep travelling through the steps
// where nobody computes (N hops in all, as before). A plan of one step (every rank sees only its
// own shard) moves nothing at all. Document starts in device memory are copied to the host for
// the plan once per call, a synchronous copy before the first exchange.
//
// No step waits on the host for device work: the communicator orders transfers on the stream.
//
// The halves (RingWork): the loops below run either side on its own by skipping the other. With
// only the transfers, the buffers travel with whatever they hold; with only the compute, the K/V
// and dK/dV buffers never change hands, so every step runs on this rank's own shard, with the
// pairs and masks of the shard that would have visited.
#include "parallel/ring_attention.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "parallel/communicator.hpp"
#include "parallel/local_block.hpp"
#include "ringattn/attention.hpp"
#include "ringattn/error.hpp"
#include "ringattn/ring.hpp"
#include "src/attention_checks.hpp"
#include "src/mask_rule.hpp"
#include "src/owned_buffer.hpp"

namespace ringattn {

// ---------------------------------------------------------------------------------------------
// The plan of a step.

namespace {

// Merges pairs that are fully visible, share one side and are adjacent on the other.
bool try_merge(BlockPair& into, const BlockPair& next) {
  if (into.causal || next.causal) return false;
  if (into.q_local_start == next.q_local_start && into.q_length == next.q_length &&
      into.k_local_start + into.k_length == next.k_local_start) {
    into.k_length += next.k_length;
    return true;
  }
  if (into.k_local_start == next.k_local_start && into.k_length == next.k_length &&
      into.q_local_start + into.q_length == next.q_local_start) {
    into.q_length += next.q_length;
    return true;
  }
  return false;
}

void merge_adjacent(std::vector<BlockPair>& pairs) {
  for (bool merged = true; merged;) {
    merged = false;
    for (std::size_t i = 0; i < pairs.size() && !merged; ++i) {
      for (std::size_t j = 0; j < pairs.size() && !merged; ++j) {
        if (i != j && try_merge(pairs[i], pairs[j])) {
          pairs.erase(pairs.begin() + static_cast<std::ptrdiff_t>(j));
          merged = true;
        }
      }
    }
  }
}

// The rules of the batch rows a plan must serve: one, or one a batch row for per-batch documents.
std::vector<detail::MaskRule> plan_rules(const RingMask& m) {
  const DocumentStarts& documents = m.mask.documents;
  const std::int64_t rows = documents.active() && documents.batch_stride != 0 ? m.batch : 1;
  std::vector<detail::MaskRule> rules;
  for (std::int64_t b = 0; b < rows; ++b) rules.push_back(detail::MaskRule::of(m.mask, b));
  return rules;
}

}  // namespace

std::vector<BlockPair> visible_pairs(const SequenceLayout& queries, const SequenceLayout& keys,
                                     const RingMask& m) {
  const Mask& mask = m.mask;
  if (!mask.causal && !mask.local()) {
    return {{0, queries.local_length(), 0, 0, keys.local_length(), 0, false}};
  }
  const std::vector<SequenceChunk> q_chunks = queries.chunks(), k_chunks = keys.chunks();
  // A rank's own shard against itself under a causal mask alone: its chunks lie in the order of
  // their positions, so a key precedes a query in the sequence exactly when it does locally, and
  // the causal mask of local indices (both starts 0) is the true one: one call, whatever the gaps
  // between the chunks. A window or documents measure true distances: those take the chunks.
  if (!mask.local() && q_chunks == k_chunks) {
    bool ordered = true;
    for (std::size_t c = 1; c < q_chunks.size(); ++c) {
      ordered = ordered && q_chunks[c].global_start > q_chunks[c - 1].global_start &&
                q_chunks[c].local_start > q_chunks[c - 1].local_start;
    }
    if (ordered) return {{0, queries.local_length(), 0, 0, keys.local_length(), 0, true}};
  }
  const std::vector<detail::MaskRule> rules = plan_rules(m);
  std::vector<BlockPair> pairs;
  for (const SequenceChunk& q : q_chunks) {
    for (const SequenceChunk& k : k_chunks) {
      if (q.length == 0 || k.length == 0) continue;
      const std::int64_t qa = q.global_start, qb = qa + q.length - 1;
      const std::int64_t ka = k.global_start, kb = ka + k.length - 1;
      bool any = false, all = true;
      for (const detail::MaskRule& rule : rules) {
        any = any || rule.any_visible(qa, qb, ka, kb);
        all = all && rule.all_visible(qa, qb, ka, kb);
      }
      if (!any) continue;
      pairs.push_back(
          {q.local_start, q.length, q.global_start, k.local_start, k.length, k.global_start, !all});
    }
  }
  merge_adjacent(pairs);
  return pairs;
}

std::vector<BlockPair> visible_pairs(const SequenceLayout& queries, const SequenceLayout& keys,
                                     bool causal) {
  return visible_pairs(queries, keys, RingMask{Mask{causal}, 1});
}

bool shard_needed(const SequenceLayout& queries, const SequenceLayout& keys, const RingMask& mask) {
  return !visible_pairs(queries, keys, mask).empty();
}

int ring_steps(const SequenceLayout& layout, const RingMask& mask) {
  const int world = layout.world();
  int farthest = 0;
  for (int rank = 0; rank < world; ++rank) {
    const SequenceLayout queries = layout.for_rank(rank);
    // From the farthest hop down: the first shard this rank needs settles its part.
    for (int hop = world - 1; hop > farthest; --hop) {
      if (shard_needed(queries, layout.for_rank((rank - hop + world) % world), mask)) {
        farthest = hop;
        break;
      }
    }
  }
  return farthest + 1;
}

// ---------------------------------------------------------------------------------------------
// Views and workspaces.

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// Rows [start, start + length) of a [batch, seq, heads, head_dim] view.
TensorView rows(const TensorView& t, std::int64_t start, std::int64_t length) {
  TensorView v = t;
  v.data = static_cast<unsigned char*>(t.data) +
           start * t.strides[1] * static_cast<std::int64_t>(dtype_size(t.dtype));
  v.shape[1] = length;
  return v;
}

// Columns [start, start + length) of a [batch, heads, seq] view (LSE, delta).
TensorView columns(const TensorView& t, std::int64_t start, std::int64_t length) {
  TensorView v = t;
  v.data = static_cast<unsigned char*>(t.data) +
           start * t.strides[2] * static_cast<std::int64_t>(dtype_size(t.dtype));
  v.shape[2] = length;
  return v;
}

// K [batch, Sl, kv_heads, head_dim] and V [batch, Sl, kv_heads, v_head_dim] back to back in one
// buffer: the message of a step (or the dK|dV accumulator of a shard). V starts at an offset of
// batch * Sl * kv_heads * head_dim elements, which keeps the alignment the CUDA block needs
// (every head_dim of its kernels is a multiple of 8).
struct PairedViews {
  TensorView k, v;
  // Every element of the buffer once, as [batch, Sl, kv_heads, head_dim + v_head_dim], for fill
  // and add, which pair the elements of two such views by position (its axes are not K's and V's).
  TensorView both;
  std::size_t bytes = 0;
};

std::size_t paired_bytes(const AttentionShape& s, DType dtype) {
  return static_cast<std::size_t>(s.batch * s.k_len * s.kv_heads * (s.head_dim + s.v_head_dim)) *
         dtype_size(dtype);
}

using NamedView = std::pair<const char*, const TensorView*>;
using NamedViews = std::initializer_list<NamedView>;

// "q [2, 96, 4, 32] f64; k [...] f64; ...; layout zigzag; causal true; window_left 0;
// window_right 0; scale 0.125": what the ranks must agree on (strides may differ), as items for
// check_same_on_all_ranks.
std::string describe_call(NamedViews views, SequenceLayoutKind layout, bool causal,
                          std::int64_t window_left, std::int64_t window_right, double scale) {
  std::string text;
  for (const auto& [name, t] : views) {
    text += std::string(name) + " [";
    const int rank = std::clamp(t->rank, 0, TensorView::kMaxRank);
    for (int i = 0; i < rank; ++i) text += (i ? ", " : "") + std::to_string(t->shape[i]);
    text += "] " + std::string(dtype_name(t->dtype)) + "; ";
  }
  char scale_text[32];
  std::snprintf(scale_text, sizeof(scale_text), "%.17g", scale);
  return text + detail::concat("layout ", sequence_layout_name(layout), "; ", "causal ",
                               causal ? "true" : "false", "; window_left ", window_left,
                               "; window_right ", window_right, "; scale ", scale_text);
}

// The local checks of a ring call beyond the block's argument checks: equal lengths of q and k,
// a dtype and layout the block of this memory runs.
void check_ring_inputs(const AttentionShape& s, const TensorView& q, Memory memory,
                       const char* where) {
  if (s.k_len != s.q_len) {
    detail::fail(where, "k has ", s.k_len, " tokens but q has ", s.q_len,
                 "; every rank holds the same tokens of q, k and v");
  }
  detail::check_block_dtype(q.dtype, s.head_dim, s.v_head_dim, memory, where);
}

// The mask of a call: the block's (documents in the tensors' memory), the planner's (the same
// starts copied to the host) and the items the ranks compare.
struct CallMask {
  Mask block;     // causal, window and documents; q_start and k_start set per block call
  RingMask plan;  // the same with plan.mask.documents in `host_starts`
  std::vector<std::int64_t> host_starts;
  std::string documents_item;  // the digest of the starts, which the ranks compare
};

// 64-bit FNV-1a over the starts: two ranks with other lists compare unequal (but for a collision,
// about 2^-64 for lists that differ by mistake rather than by design).
std::uint64_t digest(const std::vector<std::int64_t>& values) {
  std::uint64_t hash = 0xcbf29ce484222325ull;
  for (const std::int64_t value : values) {
    for (int byte = 0; byte < 8; ++byte) {
      hash ^= (static_cast<std::uint64_t>(value) >> (8 * byte)) & 0xffu;
      hash *= 0x100000001b3ull;
    }
  }
  return hash;
}

// The mask of a call of `batch` rows on more than one rank, whose window and documents
// check_mask has passed, with the starts read to the host (from device memory: queued on
// `stream`, waited for). Device lists, which check_mask cannot read, are checked here: the plan
// needs them sorted. (One rank neither plans nor compares: it passes the mask to its one block.)
CallMask read_call_mask(const Mask& call, std::int64_t batch, Memory memory, void* stream,
                        const char* where) {
  CallMask m;
  m.block = call;
  m.plan = RingMask{call, batch};
  const DocumentStarts& documents = call.documents;
  if (!documents.active()) return m;
  const std::int64_t lists = documents.batch_stride != 0 ? batch : 1;
  m.host_starts.resize(static_cast<std::size_t>(lists * documents.count));
  // One copy when the lists lie back to back (one wait on the stream), else one a list.
  const bool packed = lists == 1 || documents.batch_stride == documents.count;
  for (std::int64_t b = 0; b < (packed ? 1 : lists); ++b) {
    detail::copy_to_host(documents.data + b * documents.batch_stride, memory,
                         static_cast<std::size_t>((packed ? lists : 1) * documents.count) *
                             sizeof(std::int64_t),
                         m.host_starts.data() + b * documents.count, stream);
  }
  for (std::int64_t b = 0; b < lists; ++b) {
    const std::int64_t* list = m.host_starts.data() + b * documents.count;
    for (std::int64_t i = 1; i < documents.count; ++i) {
      if (list[i] < list[i - 1]) {
        detail::fail(where, "document start ", i, " of batch row ", b, " is ", list[i],
                     ", below start ", i - 1, " (", list[i - 1],
                     "); expected non-decreasing global positions");
      }
    }
  }
  m.plan.mask.documents = DocumentStarts{m.host_starts.data(), documents.count,
                                         documents.batch_stride != 0 ? documents.count : 0};
  char digest_text[24];
  std::snprintf(digest_text, sizeof(digest_text), "%016llx",
                static_cast<unsigned long long>(digest(m.host_starts)));
  m.documents_item = detail::concat("documents digest ", digest_text);
  return m;
}

// Runs the local checks of a call on this rank, then compares and agrees across the ranks, so
// that every rank returns or every rank throws the same Error.
template <typename LocalChecks>
void validate_collectively(const Communicator& comm, const char* where,
                           const std::string& description, LocalChecks&& local_checks) {
  std::optional<Error> local_error;
  try {
    local_checks();
  } catch (const Error& error) {
    local_error = error;
  } catch (const std::exception& error) {  // e.g. std::bad_alloc of a workspace
    local_error = Error(where, error.what(), ErrorKind::library);
  }
  check_same_on_all_ranks(comm, where, description);
  check_no_rank_failed(comm, where, local_error ? &*local_error : nullptr);
}

// The documents as the ranks compare them before the first transfer: what each knows without
// reading them (the count, one list or one a row) goes with the other arguments; the starts
// themselves, read to the host by the local checks, are compared after those passed on every
// rank, by a digest, in a second round that only calls with documents make.
std::string describe_documents(const DocumentStarts& documents) {
  if (!documents.active()) return "documents none";
  return detail::concat("documents ", documents.count, " starts ",
                        documents.batch_stride != 0 ? "a batch row" : "for every batch row");
}

void check_same_documents(const Communicator& comm, const char* where, const CallMask& mask) {
  if (comm.size() > 1 && mask.block.documents.active()) {
    check_same_on_all_ranks(comm, where, mask.documents_item);
  }
}

}  // namespace

// One workspace buffer of a call: a stretch of the caller's scratch or one of the ring's own
// buffers.
struct Slice {
  void* data = nullptr;
  std::size_t bytes = 0;
  Memory memory = Memory::host;

  // A row-major view of `shape` from `byte_offset` on.
  TensorView view(DType dtype, std::initializer_list<std::int64_t> shape,
                  std::size_t byte_offset = 0) const {
    TensorView v = TensorView::contiguous(nullptr, dtype, shape, memory);
    if (byte_offset + static_cast<std::size_t>(v.numel()) * dtype_size(dtype) > bytes) {
      detail::fail("RingAttention", "a workspace view does not fit its buffer");
    }
    v.data = static_cast<unsigned char*>(data) + byte_offset;
    return v;
  }
};

// Places the workspace buffers of one call, largest first: each in the first scratch region with
// room left (256-byte aligned), else in the ring's own buffer for it, grown as needed; an own
// buffer that the scratch replaces is released.
class Placement {
 public:
  static constexpr std::size_t kAlignment = 256;

  Placement(const std::vector<ScratchRegion>& scratch, Memory memory)
      : free_(scratch), memory_(memory) {}

  Slice take(OwnedBuffer& own, std::size_t bytes) {
    for (ScratchRegion& region : free_) {
      const auto address = reinterpret_cast<std::uintptr_t>(region.data);
      const std::size_t skip = (kAlignment - address % kAlignment) % kAlignment;
      if (region.data == nullptr || region.bytes < skip || region.bytes - skip < bytes) continue;
      Slice slice{static_cast<unsigned char*>(region.data) + skip, bytes, memory_};
      region.data = static_cast<unsigned char*>(region.data) + skip + bytes;
      region.bytes -= skip + bytes;
      own = OwnedBuffer();
      return slice;
    }
    own.reserve(memory_, bytes);
    return {own.data(), bytes, memory_};
  }

 private:
  std::vector<ScratchRegion> free_;
  Memory memory_;
};

double ring_workspace_bytes(const RingWorkspaceShape& w) {
  constexpr double a = Placement::kAlignment;
  // A buffer's bytes rounded up to the alignment, and the worst start of it (a - 1 bytes more).
  const auto aligned = [&](double elements, DType dtype) {
    return std::ceil(elements * static_cast<double>(dtype_size(dtype)) / a) * a + a;
  };
  const DType acc = accumulator_dtype(w.dtype);
  const double rows = static_cast<double>(w.batch) * static_cast<double>(w.local_len);
  const double paired = rows * static_cast<double>(w.kv_heads) *
                        (static_cast<double>(w.head_dim) + static_cast<double>(w.v_head_dim));
  const double delta = aligned(rows * static_cast<double>(w.q_heads), acc);
  if (w.ranks <= 1) return delta;
  const double forward =
      aligned(rows * static_cast<double>(w.q_heads) * static_cast<double>(w.v_head_dim), acc) +
      2.0 * aligned(paired, w.dtype);
  const double backward =
      (w.ranks >= 3 ? 3.0 : 2.0) * aligned(paired, acc) + 2.0 * aligned(paired, w.dtype) + delta;
  return std::max(forward, backward);
}

// Names the call's persistent scratch to the communicator, which may keep what it sets up for that
// memory (receive-buffer mappings) until release_scratch.
void keep_persistent(Communicator& comm, const std::vector<ScratchRegion>& scratch) {
  for (const ScratchRegion& region : scratch) {
    if (region.persistent && region.data != nullptr && region.bytes > 0) {
      comm.keep_memory(region.data, region.bytes);
    }
  }
}

// Fails naming the region when a scratch region overlaps one of the call's tensors.
void check_scratch(const std::vector<ScratchRegion>& scratch, NamedViews views,
                   const char* where) {
  for (std::size_t i = 0; i < scratch.size(); ++i) {
    const auto first = reinterpret_cast<std::uintptr_t>(scratch[i].data);
    const std::uintptr_t end = first + scratch[i].bytes;
    for (const auto& [name, t] : views) {
      std::int64_t last = 0;  // the offset of the view's last element
      for (int axis = 0; axis < t->rank; ++axis) last += (t->shape[axis] - 1) * t->strides[axis];
      const auto begin = reinterpret_cast<std::uintptr_t>(t->data);
      const std::uintptr_t stop = begin + static_cast<std::uintptr_t>(last + 1) * dtype_size(t->dtype);
      if (t->numel() > 0 && scratch[i].bytes > 0 && begin < end && first < stop) {
        detail::fail(where, "scratch region ", i, " (", scratch[i].bytes,
                     " bytes) overlaps ", name, "; the scratch must be memory the call's tensors "
                     "do not use");
      }
    }
  }
}

PairedViews paired_views(const Slice& buffer, const AttentionShape& s, DType dtype) {
  PairedViews p;
  p.bytes = paired_bytes(s, dtype);
  p.k = buffer.view(dtype, {s.batch, s.k_len, s.kv_heads, s.head_dim});
  p.v = buffer.view(dtype, {s.batch, s.k_len, s.kv_heads, s.v_head_dim},
                    static_cast<std::size_t>(p.k.numel()) * dtype_size(dtype));
  p.both = buffer.view(dtype, {s.batch, s.k_len, s.kv_heads, s.head_dim + s.v_head_dim});
  return p;
}

// The schedule, with private access to the RingAttention it runs for.
struct RingAttentionInternals {
  static void forward(RingAttention& ring, const RingForwardArgs& args, RingWork work);
  static void backward(RingAttention& ring, const RingBackwardArgs& args, RingWork work);
  // The layout of a call on this rank: the ring's kind, or for balanced the one the call's mask
  // gives (kept in the workspace for the calls after with the same mask).
  static SequenceLayout layout_of_call(RingAttention& ring, std::int64_t total_length,
                                       const CallMask& mask);
};

struct RingAttention::Workspace {
  OwnedBuffer kv[2];      // K|V in the input dtype, double buffered
  OwnedBuffer running_o;  // forward: the running output, accumulator dtype
  OwnedBuffer dkv[2];     // backward: travelling dK|dV accumulators
  OwnedBuffer dkv_step;   // backward: this step's contribution
  OwnedBuffer delta;      // backward: rowsum(dO * O)
  // The last balanced layout and what it was made from: the next call with the same sequence
  // length and mask (every layer of a model) takes it as it is.
  struct Balanced {
    std::int64_t total_length = 0, batch = 0;
    Mask mask{};
    std::vector<std::int64_t> starts;
    std::shared_ptr<const SequenceLayout::Assignment> assignment;
  } balanced;
};

// ---------------------------------------------------------------------------------------------
// RingAttention.

RingAttention::RingAttention(std::shared_ptr<Communicator> comm, SequenceLayoutKind layout)
    : comm_(std::move(comm)), layout_(layout), workspace_(std::make_unique<Workspace>()) {
  if (comm_ == nullptr) detail::fail("RingAttention", "the communicator is null");
  if (layout != SequenceLayoutKind::contiguous && layout != SequenceLayoutKind::zigzag &&
      layout != SequenceLayoutKind::balanced) {
    detail::fail("RingAttention", "layout kind ", static_cast<int>(layout),
                 " is none of contiguous (0), zigzag (1) and balanced (2)");
  }
}

RingAttention::~RingAttention() = default;
RingAttention::RingAttention(RingAttention&&) noexcept = default;
RingAttention& RingAttention::operator=(RingAttention&&) noexcept = default;

int RingAttention::rank() const {
  return comm_->rank();
}
int RingAttention::size() const {
  return comm_->size();
}
SequenceLayoutKind RingAttention::layout() const {
  return layout_;
}
const Communicator& RingAttention::communicator() const {
  return *comm_;
}

std::size_t RingAttention::owned_workspace_bytes() const {
  const Workspace& w = *workspace_;
  return w.kv[0].bytes() + w.kv[1].bytes() + w.running_o.bytes() + w.dkv[0].bytes() +
         w.dkv[1].bytes() + w.dkv_step.bytes() + w.delta.bytes();
}

void RingAttention::release_scratch(double timeout_s) { comm_->release_kept_memory(timeout_s); }

void RingAttention::forward(const RingForwardArgs& args) {
  RingAttentionInternals::forward(*this, args, RingWork::all);
}

void RingAttention::backward(const RingBackwardArgs& args) {
  RingAttentionInternals::backward(*this, args, RingWork::all);
}

void ring_forward(RingAttention& ring, const RingForwardArgs& args, RingWork work) {
  RingAttentionInternals::forward(ring, args, work);
}

void ring_backward(RingAttention& ring, const RingBackwardArgs& args, RingWork work) {
  RingAttentionInternals::backward(ring, args, work);
}

namespace {

// A block call's mask: the call's mask at the pair's global starts, or none for a pair that
// every query sees whole.
Mask pair_mask(const Mask& call, const BlockPair& p) {
  if (!p.causal) return Mask{};
  Mask mask = call;
  mask.q_start = p.q_global_start;
  mask.k_start = p.k_global_start;
  return mask;
}

// The plan of a call on this rank: the steps every rank runs and this rank's block calls at each.
struct CallPlan {
  int steps = 1;
  std::vector<std::vector<BlockPair>> pairs;  // [step]
};

}  // namespace

SequenceLayout RingAttentionInternals::layout_of_call(RingAttention& ring,
                                                      std::int64_t total_length,
                                                      const CallMask& mask) {
  const int ranks = ring.size(), rank = ring.rank();
  if (ring.layout() != SequenceLayoutKind::balanced) {
    return SequenceLayout(ring.layout(), ranks, rank, total_length);
  }
  if (ranks == 1) {
    return SequenceLayout(rank, total_length, balanced_assignment(1, total_length, mask.plan));
  }
  RingAttention::Workspace::Balanced& kept = ring.workspace_->balanced;
  const Mask& m = mask.plan.mask;
  const bool same = kept.assignment != nullptr && kept.total_length == total_length &&
                    kept.mask.causal == m.causal && kept.mask.window_left == m.window_left &&
                    kept.mask.window_right == m.window_right &&
                    kept.mask.documents.count == m.documents.count &&
                    kept.mask.documents.batch_stride == m.documents.batch_stride &&
                    (m.documents.batch_stride == 0 || kept.batch == mask.plan.batch) &&
                    kept.starts == mask.host_starts;
  if (!same) {
    kept.assignment = balanced_assignment(ranks, total_length, mask.plan);
    kept.total_length = total_length;
    kept.batch = mask.plan.batch;
    kept.mask = m;
    kept.mask.documents.data = nullptr;
    kept.starts = mask.host_starts;
  }
  return SequenceLayout(rank, total_length, kept.assignment);
}

namespace {

CallPlan plan_call(const SequenceLayout& layout, const RingMask& mask) {
  CallPlan plan;
  plan.steps = ring_steps(layout, mask);
  const int ranks = layout.world(), rank = layout.rank();
  for (int step = 0; step < plan.steps; ++step) {
    plan.pairs.push_back(
        visible_pairs(layout, layout.for_rank((rank - step + ranks) % ranks), mask));
  }
  return plan;
}

}  // namespace

void RingAttentionInternals::forward(RingAttention& ring, const RingForwardArgs& args,
                                     RingWork work) {
  constexpr const char* kWhere = "RingAttention::forward";
  Communicator& comm = *ring.comm_;
  const int ranks = comm.size();
  RingAttention::Workspace& w = *ring.workspace_;
  const bool transfers = work != RingWork::compute, compute = work != RingWork::transfers;
  const std::string description =
      describe_call(
          {{"q", &args.q}, {"k", &args.k}, {"v", &args.v}, {"o", &args.o}, {"lse", &args.lse}},
          ring.layout_, args.causal, args.window_left, args.window_right, args.scale) +
      "; " + describe_documents(args.documents);

  const Mask call_mask{args.causal, 0, 0, args.window_left, args.window_right, args.documents};
  AttentionShape s;
  std::optional<SequenceLayout> layout;
  CallMask mask;
  CallPlan plan;
  Slice kv_slices[2], running_slice;
  validate_collectively(comm, kWhere, description, [&] {
    ForwardArgs whole{args.q, args.k, args.v, args.o, args.lse, args.scale, call_mask, false};
    s = check_forward_args(whole, comm.memory(), kWhere);
    check_ring_inputs(s, args.q, comm.memory(), kWhere);
    for (const auto& [name, view] :
         NamedViews{{"q", &args.q}, {"k", &args.k}, {"v", &args.v}, {"o", &args.o}}) {
      detail::check_block_layout(*view, name, kWhere);
    }
    check_scratch(args.scratch,
                  {{"q", &args.q}, {"k", &args.k}, {"v", &args.v}, {"o", &args.o},
                   {"lse", &args.lse}},
                  kWhere);
    if (ranks > 1) mask = read_call_mask(call_mask, s.batch, comm.memory(), args.stream, kWhere);
    layout.emplace(layout_of_call(ring, s.q_len * ranks, mask));
    if (ranks == 1) return;  // no plan and no workspace: see below
    plan = plan_call(*layout, mask.plan);
    Placement place(args.scratch, comm.memory());
    running_slice = place.take(w.running_o, static_cast<std::size_t>(args.o.numel()) *
                                                dtype_size(accumulator_dtype(args.q.dtype)));
    for (int i = 0; i < 2; ++i) kv_slices[i] = place.take(w.kv[i], paired_bytes(s, args.q.dtype));
  });
  check_same_documents(comm, kWhere, mask);
  if (ranks > 1 && transfers) keep_persistent(comm, args.scratch);

  void* stream = args.stream;
  // One rank holds the whole sequence in order (either layout): one block call on local positions,
  // which are the global ones, writes O and LSE, with no copies and no running output.
  if (ranks == 1) {
    if (compute) {
      flash_forward({args.q, args.k, args.v, args.o, args.lse, args.scale, call_mask, false},
                    stream);
    }
    return;
  }
  const DType acc = accumulator_dtype(args.q.dtype);
  const PairedViews kv[2] = {paired_views(kv_slices[0], s, args.q.dtype),
                             paired_views(kv_slices[1], s, args.q.dtype)};
  const TensorView running = running_slice.view(acc, {s.batch, s.q_len, s.q_heads, s.v_head_dim});
  if (compute) {
    detail::copy(args.k, kv[0].k, stream);
    detail::copy(args.v, kv[0].v, stream);
    detail::fill(running, 0.0, stream);
    detail::fill(args.lse, kNegInf, stream);
  }

  // Only plan.steps steps: no rank needs a shard from farther back, so K/V stop there.
  int held = 0;  // the kv buffer holding the visiting shard
  const std::vector<BlockPair> none;
  for (int step = 0; step < plan.steps; ++step) {
    const bool more = step + 1 < plan.steps && transfers;
    if (more) {
      comm.exchange_start(kv_slices[held].data, kv[held].bytes, kv_slices[1 - held].data,
                          kv[1 - held].bytes, stream);
    }
    for (const BlockPair& p : compute ? plan.pairs[step] : none) {
      ForwardArgs block;
      block.q = rows(args.q, p.q_local_start, p.q_length);
      block.k = rows(kv[held].k, p.k_local_start, p.k_length);
      block.v = rows(kv[held].v, p.k_local_start, p.k_length);
      block.o = rows(running, p.q_local_start, p.q_length);
      block.lse = columns(args.lse, p.q_local_start, p.q_length);
      block.scale = args.scale;
      block.mask = pair_mask(mask.block, p);
      block.combine = true;
      flash_forward(block, stream);
    }
    if (more) {
      comm.exchange_wait(stream);
      held = 1 - held;
    }
  }
  if (compute) detail::copy(running, args.o, stream);
  if (transfers) comm.exchange_finish(stream);
}

void RingAttentionInternals::backward(RingAttention& ring, const RingBackwardArgs& args,
                                      RingWork work) {
  constexpr const char* kWhere = "RingAttention::backward";
  Communicator& comm = *ring.comm_;
  const int ranks = comm.size();
  RingAttention::Workspace& w = *ring.workspace_;
  const bool transfers = work != RingWork::compute, compute = work != RingWork::transfers;
  const std::string description =
      describe_call({{"q", &args.q},
                     {"k", &args.k},
                     {"v", &args.v},
                     {"o", &args.o},
                     {"lse", &args.lse},
                     {"dout", &args.dout},
                     {"dq", &args.dq},
                     {"dk", &args.dk},
                     {"dv", &args.dv}},
                    ring.layout_, args.causal, args.window_left, args.window_right, args.scale) +
      "; " + describe_documents(args.documents) +
      (args.deterministic ? "; deterministic true" : "; deterministic false");

  const Mask call_mask{args.causal, 0, 0, args.window_left, args.window_right, args.documents};
  AttentionShape s;
  std::optional<SequenceLayout> layout;
  CallMask mask;
  CallPlan plan;
  Slice kv_slices[2], dkv_slices[2], step_slice, delta_slice;
  validate_collectively(comm, kWhere, description, [&] {
    ForwardArgs forward{args.q, args.k, args.v, args.o, args.lse, args.scale, call_mask, false};
    s = check_forward_args(forward, comm.memory(), kWhere);
    BackwardArgs whole{args.q,  args.k,  args.v,  args.dout,  args.lse,  args.lse,
                       args.dq, args.dk, args.dv, args.scale, call_mask, args.deterministic};
    whole.overwrite_key_gradients = ranks == 1;  // one block call: dk, dv may be rounded
    whole.key_rotation = args.key_rotation;
    if (args.key_rotation.active() && ranks > 1) {
      detail::fail(kWhere, "key_rotation is given on a ring of ", ranks,
                   " ranks; expected one rank (its dK is written by one block call)");
    }
    check_backward_args(whole, comm.memory(), kWhere);
    check_ring_inputs(s, args.q, comm.memory(), kWhere);
    for (const auto& [name, view] : NamedViews{{"q", &args.q},
                                               {"k", &args.k},
                                               {"v", &args.v},
                                               {"o", &args.o},
                                               {"dout", &args.dout},
                                               {"dq", &args.dq},
                                               {"dk", &args.dk},
                                               {"dv", &args.dv}}) {
      detail::check_block_layout(*view, name, kWhere);
    }
    if (ranks > 1) mask = read_call_mask(call_mask, s.batch, comm.memory(), args.stream, kWhere);
    layout.emplace(layout_of_call(ring, s.q_len * ranks, mask));
    check_scratch(args.scratch,
                  {{"q", &args.q}, {"k", &args.k}, {"v", &args.v}, {"o", &args.o},
                   {"lse", &args.lse}, {"dout", &args.dout}, {"dq", &args.dq}, {"dk", &args.dk},
                   {"dv", &args.dv}},
                  kWhere);
    const DType acc = accumulator_dtype(args.q.dtype);
    Placement place(args.scratch, comm.memory());
    if (ranks > 1) {  // one rank: the gradients go straight to dq, dk, dv (see below)
      plan = plan_call(*layout, mask.plan);
      // One step: every rank needs only its own shard, and nothing travels.
      if (plan.steps > 1) {
        for (int i = 0; i < 2; ++i) dkv_slices[i] = place.take(w.dkv[i], paired_bytes(s, acc));
        if (plan.steps > 2) step_slice = place.take(w.dkv_step, paired_bytes(s, acc));
        for (int i = 0; i < 2; ++i) {
          kv_slices[i] = place.take(w.kv[i], paired_bytes(s, args.q.dtype));
        }
      }
    }
    delta_slice =
        place.take(w.delta, static_cast<std::size_t>(args.lse.numel()) * dtype_size(acc));
  });

  check_same_documents(comm, kWhere, mask);
  const bool travels = ranks > 1 && plan.steps > 1;
  if (travels && transfers) keep_persistent(comm, args.scratch);
  void* stream = args.stream;
  const DType acc = accumulator_dtype(args.q.dtype);
  const TensorView delta = delta_slice.view(acc, {s.batch, s.q_heads, s.q_len});
  if (compute) {
    flash_backward_prepare(args.o, args.dout, delta, stream, &args.dq);
    if (ranks > 1) {
      detail::fill(args.dk, 0.0, stream);
      detail::fill(args.dv, 0.0, stream);
    }
  }
  // One rank: one block call on local positions (as in the forward) adds into the zeroed dq and
  // writes dk and dv.
  if (ranks == 1) {
    if (compute) {
      BackwardArgs block{args.q,  args.k,  args.v,  args.dout,  args.lse, delta,
                         args.dq, args.dk, args.dv, args.scale, call_mask, args.deterministic};
      block.overwrite_key_gradients = true;
      block.key_rotation = args.key_rotation;
      flash_backward(block, stream);
    }
    return;
  }
  // The block calls of `pairs` against the K/V views `k`, `v`, adding into dK/dV views `dk`, `dv`.
  const auto run_pairs = [&](const std::vector<BlockPair>& pairs, const TensorView& k,
                             const TensorView& v, const TensorView& dk, const TensorView& dv) {
    for (const BlockPair& p : pairs) {
      BackwardArgs block;
      block.q = rows(args.q, p.q_local_start, p.q_length);
      block.k = rows(k, p.k_local_start, p.k_length);
      block.v = rows(v, p.k_local_start, p.k_length);
      block.dout = rows(args.dout, p.q_local_start, p.q_length);
      block.lse = columns(args.lse, p.q_local_start, p.q_length);
      block.delta = columns(delta, p.q_local_start, p.q_length);
      block.dq = rows(args.dq, p.q_local_start, p.q_length);
      block.dk = rows(dk, p.k_local_start, p.k_length);
      block.dv = rows(dv, p.k_local_start, p.k_length);
      block.scale = args.scale;
      block.mask = pair_mask(mask.block, p);
      block.deterministic = args.deterministic;
      flash_backward(block, stream);
    }
  };
  // One step (no rank sees another's shard): the own shard adds straight into dk and dv.
  if (!travels) {
    if (compute) run_pairs(plan.pairs[0], args.k, args.v, args.dk, args.dv);
    return;
  }
  const PairedViews kv[2] = {paired_views(kv_slices[0], s, args.q.dtype),
                             paired_views(kv_slices[1], s, args.q.dtype)};
  const PairedViews dkv[2] = {paired_views(dkv_slices[0], s, acc),
                              paired_views(dkv_slices[1], s, acc)};
  if (compute) {
    detail::copy(args.k, kv[0].k, stream);
    detail::copy(args.v, kv[0].v, stream);
  }

  // The rank's own shard adds straight into dk and dv, in two parts by query rows: the first
  // while its K/V travel to the next rank, the second while the accumulator of its K/V, having
  // visited every other rank, travels home. A visiting shard's accumulator starts at the rank
  // after its owner (step 1): from step 2 on, a step's contribution goes to the step buffer while
  // the accumulator arrives, and joins it after.
  // K/V travel plan.steps - 1 hops, as far as the farthest rank that needs them; the accumulators
  // go on around the ring to their owners (N hops: the ring only sends forward), through steps
  // where no rank computes.
  std::vector<BlockPair> own[2];
  if (compute) {
    for (const BlockPair& p : plan.pairs[0]) {
      BlockPair first = p, second = p;
      first.q_length = p.q_length / 2;
      second.q_local_start += first.q_length;
      second.q_global_start += first.q_length;
      second.q_length -= first.q_length;
      if (first.q_length > 0) own[0].push_back(first);
      own[1].push_back(second);
    }
  }
  if (transfers) {
    comm.exchange_start(kv_slices[0].data, kv[0].bytes, kv_slices[1].data, kv[1].bytes, stream);
  }
  run_pairs(own[0], args.k, args.v, args.dk, args.dv);
  if (transfers) comm.exchange_wait(stream);

  // The kv buffer holding the visiting shard (without transfers, the compute runs on the local
  // copy), and the dkv buffer holding the visiting shard's accumulator.
  int held = transfers ? 1 : 0;
  int arrived = 0;
  const std::vector<BlockPair> none;
  for (int step = 1; step < ranks; ++step) {
    const bool more = step + 1 < plan.steps;  // K/V go on
    if (more && transfers) {
      comm.exchange_start(kv_slices[held].data, kv[held].bytes, kv_slices[1 - held].data,
                          kv[1 - held].bytes, stream);
    }
    const std::vector<BlockPair>& pairs = compute && step < plan.steps ? plan.pairs[step] : none;
    const PairedViews target =
        step == 1 || pairs.empty() ? dkv[arrived] : paired_views(step_slice, s, acc);
    if (compute && (step == 1 || !pairs.empty())) detail::fill(target.both, 0.0, stream);
    run_pairs(pairs, kv[held].k, kv[held].v, target.k, target.v);
    if (transfers) comm.exchange_wait(stream);
    if (step > 1 && !pairs.empty()) detail::add(target.both, dkv[arrived].both, stream);
    if (transfers) {
      comm.exchange_start(dkv_slices[arrived].data, dkv[arrived].bytes,
                          dkv_slices[1 - arrived].data, dkv[1 - arrived].bytes, stream);
      arrived = 1 - arrived;
      if (more) held = 1 - held;
    }
  }
  run_pairs(own[1], args.k, args.v, args.dk, args.dv);
  if (transfers) comm.exchange_wait(stream);
  if (compute) {
    detail::add(dkv[arrived].k, args.dk, stream);
    detail::add(dkv[arrived].v, args.dv, stream);
  }
  if (transfers) comm.exchange_finish(stream);
}

namespace {

std::int64_t sequence_extent(const TensorView& full, const char* where) {
  if (full.rank == 4) return full.shape[1];
  if (full.rank == 3) return full.shape[2];
  detail::fail(where, "full has rank ", full.rank,
               "; expected 4 ([batch, S, heads, head_dim]) or 3 ([batch, heads, S])");
}

// This rank's layout of a sequence of `total_length` for calls under `mask` (host documents);
// without one (nullptr) the balanced layout is an error.
SequenceLayout ring_layout(const RingAttention& ring, std::int64_t total_length, const Mask* mask,
                           std::int64_t batch, const char* where) {
  if (ring.layout() != SequenceLayoutKind::balanced) {
    return SequenceLayout(ring.layout(), ring.size(), ring.rank(), total_length);
  }
  if (mask == nullptr) {
    detail::fail(where, "the ring's layout is balanced, which follows the mask of its calls: "
                 "pass the calls' mask (causal, window, documents in host memory)");
  }
  if (mask->documents.active() && mask->documents.data == nullptr) {
    detail::fail(where, "the mask's ", mask->documents.count,
                 " document starts are null; expected them in host memory");
  }
  return balanced_layout(ring.size(), ring.rank(), total_length, RingMask{*mask, batch});
}

}  // namespace

std::vector<std::int64_t> RingAttention::global_positions(std::int64_t total_length) const {
  return ring_layout(*this, total_length, nullptr, 1, "RingAttention::global_positions")
      .global_positions();
}

void RingAttention::shard(const TensorView& full, const TensorView& local) const {
  constexpr const char* kWhere = "RingAttention::shard";
  ring_layout(*this, sequence_extent(full, kWhere), nullptr, 1, kWhere).shard(full, local);
}

void RingAttention::unshard(const TensorView& local, const TensorView& full) const {
  constexpr const char* kWhere = "RingAttention::unshard";
  ring_layout(*this, sequence_extent(full, kWhere), nullptr, 1, kWhere).unshard(local, full);
}

std::vector<std::int64_t> RingAttention::global_positions(std::int64_t total_length,
                                                          const Mask& mask,
                                                          std::int64_t batch) const {
  return ring_layout(*this, total_length, &mask, batch, "RingAttention::global_positions")
      .global_positions();
}

void RingAttention::shard(const TensorView& full, const TensorView& local,
                          const Mask& mask) const {
  constexpr const char* kWhere = "RingAttention::shard";
  ring_layout(*this, sequence_extent(full, kWhere), &mask, full.shape[0], kWhere)
      .shard(full, local);
}

void RingAttention::unshard(const TensorView& local, const TensorView& full,
                            const Mask& mask) const {
  constexpr const char* kWhere = "RingAttention::unshard";
  ring_layout(*this, sequence_extent(full, kWhere), &mask, full.shape[0], kWhere)
      .unshard(local, full);
}

}  // namespace ringattn
