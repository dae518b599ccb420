// ringattn-bench: timings of ringattn's local block on one GPU, and of ring attention across GPUs.
//
//   ringattn-bench attention [--seqlens 512,1024,...] [--head-dims 64,128] [--json FILE]
//   mpirun -np N ringattn-bench ring [--seqlens 32768,131072,524288] [--heads 16]
//       [--kv-heads 16,4] [--head-dim 128] [--causal both|on|off] [--layout zigzag]
//       [--repeats R] [--warmup W] [--max-full-seq S] [--scratch persistent|own] [--json FILE]
//   mpirun -np N ringattn-bench ring --fit [--heads 16] [--kv-heads 16] [--head-dim 128]
//       [--no-verify] [--json FILE]
//
// attention: the CUDA local block, forward and backward, on FlashAttention's benchmark grid
// (bf16, batch = 16384 / seq, hidden 2048 so heads = 2048 / head_dim, causal and not). The
// backward gives what SDPA's gives, dQ, dK and dV in bf16: its time includes the rowsum(dO * O)
// pass with zeroing the fp32 dQ accumulator, the block writing dK and dV rounded to bf16
// (overwrite_key_gradients), and rounding dQ to bf16. `bwd add ms` times the ring's contract on
// the same problem: fp32 dQ, dK and dV zeroed first and added into.
//
// ring: ring attention over the N ranks of mpirun, one GPU each, over the NCCL communicator (its
// exchanges by the copy engines where they reach: the header line and the JSON's "exchanges" say
// which; RINGATTN_EXCHANGE=nccl compares); bf16, batch 1, every
// (sequence length, K/V heads, mask). Each configuration is timed four ways, every run a forward
// then a backward (CUDA events on the default stream give the forward, the backward and the two
// together from the same runs; figures are medians over the runs):
//   ring       RingAttention::forward and backward. Every rank enters a barrier before each run,
//              and a run counts as long as its slowest rank took.
//   transfers  the ring's exchanges alone: the same messages, sizes and order, no compute
//              (RingWork::transfers, parallel/ring_attention.hpp). Timed like the ring. Over the
//              copy engines with --scratch own this includes the host opening the neighbour's
//              buffers (about 10 ms for 512 MiB, per buffer and call).
//   compute    the ring's compute alone: every step's block calls, with the pairs and masks of
//              the shard that would visit, against the local K/V, no exchange (RingWork::compute).
//   one GPU    the same local block on the whole sequence on rank 0's GPU while the other ranks
//              wait; absent when it does not fit in memory (the row says why).
// From these: TFLOP/s per GPU by FlashAttention's count of the whole problem (4 b h s^2 d forward,
// halved when causal, backward 2.5x) divided by N; efficiency = one GPU / (N x ring); hidden =
// 1 - (ring - compute) / transfers, clamped to [0, 1], the share of the transfer time that the
// ring hides behind compute (it also counts what running beside a transfer costs the compute;
// over the copy engines it understates, the buffer openings in `transfers` being host time);
// waited = how long the compute stream stood in exchange_wait for transfers in one more ring run
// (Communicator::measure_waits), the transfer time the schedule did not hide. Timed runs: 5 below 128k tokens, 3 below 512k and 2 from 512k, after
// one warm-up run below 512k and none from there (a run takes seconds, and the transfers-only runs
// that come first have allocated the ring's workspaces), unless --repeats and --warmup say. Before
// the first configuration, every configuration's kernels run once on a short sequence.
// --scratch persistent (the default) lends the ring its workspace as one buffer of persistent
// scratch, as ringattn-train does (a first ring, untimed, sizes it): over the copy engines the
// neighbours then keep their mappings of the receive buffers between calls; own leaves the
// workspace to the ring, which has them mapped and closed again in every call.
//
// ring --fit: the longest sequence whose forward + backward fits on 1 GPU (a ring of one rank on
// rank 0) and on the N GPUs; bf16, causal, zigzag, --heads, the first --kv-heads, --head-dim.
// Lengths double from 16k tokens until one fails, then bisect to 16k (a multiple of 2N). A probe
// allocates what a forward + backward allocates (the shards, and the ring's workspaces through a
// transfers-only pass) and counts running out of memory as "does not fit"; the longest length
// found then runs one real forward + backward (timed), stepping down 16k at a time if that fails
// (--no-verify skips it: it takes minutes beyond a million tokens).
//
// The table goes to stdout (rank 0), the JSON to --json (rank 0; rewritten after every
// configuration, so an interrupted run keeps what it measured).
//
// Options are checked before any GPU or MPI work: each in its range (CLI11), then their
// combinations, then --json writable where it is written. ring: every rank of mpirun checks, after
// the ranks agreed they got the same arguments (tools/mpi_session.hpp); errors print on every rank.
#include <CLI/CLI.hpp>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <limits>
#include <memory>
#include <new>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/block_checks.hpp"
#include "parallel/communicator.hpp"
#include "parallel/local_block.hpp"
#include "parallel/mpi_communicator.hpp"
#include "parallel/performance_model.hpp"
#include "parallel/ring_attention.hpp"
#include "ringattn/attention.hpp"
#include "ringattn/config.h"
#include "ringattn/error.hpp"
#include "ringattn/ring.hpp"
#include "ringattn/runtime.hpp"
#include "tools/cli_checks.hpp"
#include "tools/mpi_session.hpp"

#if RINGATTN_WITH_CUDA
#include <cuda_runtime.h>

#include "src/cuda/device_buffer.hpp"
#endif

namespace {

using ringattn::DType;
using ringattn::Memory;
using ringattn::TensorView;

// ---------------------------------------------------------------------------------------------
// Options of the ring subcommand.

// The revision for the JSON: --revision, else $RINGATTN_REVISION (bench/ring.sh sets it with
// tools/revision.sh, like bench/attention.py reads it), else "unknown".
std::string default_revision() {
  const char* revision = std::getenv("RINGATTN_REVISION");
  return revision != nullptr && *revision != '\0' ? revision : "unknown";
}

struct RingOptions {
  std::string seqlens = "32768,131072,524288", kv_heads = "16,4", causal = "both", layout = "zigzag";
  std::int64_t heads = 16, head_dim = 128, max_full_seq = 0;
  int repeats = 0;   // 0: by length (default_repeats)
  int warmup = -1;   // -1: by length (default_warmup)
  bool fit = false, verify = true;
  std::string scratch = "persistent";  // the ring's workspace: persistent scratch or its own
  std::string json, revision = default_revision();
};

std::vector<std::int64_t> parse_list(const std::string& text) {
  std::vector<std::int64_t> values;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) values.push_back(std::stoll(item));
  return values;
}

// The longest sequence an option takes: the kernels index tokens with 32-bit integers.
constexpr std::int64_t kMaxSeq = INT32_MAX;

// --head-dims of the attention subcommand: comma-separated items D (d_qk = d_v = D) or DQK:DV.
struct HeadDims {
  std::int64_t qk = 0, v = 0;
};

std::vector<HeadDims> parse_head_dims(const std::string& text) {
  std::vector<HeadDims> dims;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) {
    const std::size_t colon = item.find(':');
    const std::int64_t qk = std::stoll(item.substr(0, colon));
    dims.push_back({qk, colon == std::string::npos ? qk : std::stoll(item.substr(colon + 1))});
  }
  return dims;
}

// Items D or DQK:DV, each a whole number >= 1 (checked by CLI11 before anything else runs).
CLI::Validator head_dims_list() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        std::string_view rest = text;
        bool ok = true;
        while (ok) {
          const std::string_view item = rest.substr(0, rest.find(','));
          const std::size_t colon = item.find(':');
          ok = ringattn::tools::detail::whole_number_in(item.substr(0, colon), std::int64_t{1}, ringattn::tools::kNoLimit) &&
               (colon == std::string_view::npos ||
                ringattn::tools::detail::whole_number_in(item.substr(colon + 1), std::int64_t{1}, ringattn::tools::kNoLimit));
          if (item.size() == rest.size()) break;
          rest.remove_prefix(item.size() + 1);
        }
        if (ok) return {};
        return "got '" + text + "', expected comma-separated head dims D or DQK:DV (whole numbers >= 1)";
      },
      "LIST");
}

// The option errors of the attention subcommand beyond each option's range, found before any GPU
// work (a head dim without kernels would otherwise reach the block after its buffers were
// allocated); empty when usable. The block's own check decides, with its message.
std::string check_attention_options(const std::string& head_dims) {
  for (const HeadDims& d : parse_head_dims(head_dims)) {
    const std::string item = "--head-dims has " + std::to_string(d.qk) +
                             (d.qk == d.v ? std::string() : ":" + std::to_string(d.v));
    try {
      ringattn::detail::check_block_dtype(DType::bf16, d.qk, d.v, ringattn::Memory::device,
                                          item.c_str());
    } catch (const ringattn::Error& error) {
      return error.what();
    }
  }
  return {};
}

// The option errors of the ring subcommand beyond each option's range, which every rank finds
// alike (so every rank returns the same status); empty when the options are usable on `ranks`
// ranks.
std::string check_ring_options(const RingOptions& opt, int ranks) {
  const std::int64_t divisor = opt.layout == "zigzag" ? 2 * std::int64_t{ranks} : ranks;
  for (const std::int64_t seq : parse_list(opt.seqlens)) {
    if (seq % divisor != 0) {
      return ringattn::detail::concat("--seqlens has ", seq, ", not a multiple of ", divisor, " (",
                                      opt.layout, " over ", ranks, " ranks)");
    }
    // The one-GPU problem's largest tensor (fp32 dQ) must have a size in bytes that 64 bits hold;
    // beyond that, a size that does not fit a GPU is an out-of-memory row.
    if (4.0 * static_cast<double>(seq) * static_cast<double>(opt.heads) *
            static_cast<double>(opt.head_dim) >
        0x1p62) {
      return ringattn::detail::concat("--seqlens has ", seq, ": with --heads ", opt.heads,
                                      " and --head-dim ", opt.head_dim,
                                      " a tensor would have more than 2^62 bytes");
    }
  }
  for (const std::int64_t kv : parse_list(opt.kv_heads)) {
    if (opt.heads % kv != 0) {
      return ringattn::detail::concat("--kv-heads ", kv, " does not divide --heads ", opt.heads);
    }
  }
  if (!ringattn::detail::cuda_block_takes_head_dim(opt.head_dim)) {
    return ringattn::detail::concat("--head-dim is ", opt.head_dim, "; the CUDA block takes ",
                                    ringattn::detail::cuda_block_head_dims_text());
  }
  return {};
}

#if RINGATTN_WITH_CUDA

using ringattn::CudaEvent;
using ringattn::DeviceBuffer;

int default_repeats(std::int64_t seq) {
  return seq < 131072 ? 5 : seq < 524288 ? 3 : 2;
}

int default_warmup(std::int64_t seq) {
  return seq < 524288 ? 1 : 0;
}

// ---------------------------------------------------------------------------------------------
// JSON pieces.

std::string json_number(double value) {
  if (!std::isfinite(value)) return "null";
  char text[32];
  std::snprintf(text, sizeof(text), "%.7g", value);
  return text;
}

std::string json_number(const std::optional<double>& value) {
  return value ? json_number(*value) : "null";
}

std::string json_string(std::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char escaped[8];
          std::snprintf(escaped, sizeof(escaped), "\\u%04x", c);
          out += escaped;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

std::string json_optional_string(const std::string& text) {
  return text.empty() ? "null" : json_string(text);
}

// Now, UTC, as bench/attention.py writes it: 2026-11-30T12:34:56+00:00.
std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char text[40];
  std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%S+00:00", &utc);
  return text;
}

// ---------------------------------------------------------------------------------------------
// Timing.

// The events of one timed run: mark() ends a phase and starts the next.
class Phases {
 public:
  explicit Phases(int count) {
    for (int i = 0; i <= count; ++i) events_.push_back(std::make_unique<CudaEvent>(cudaEventDefault));
  }

  void mark() {
    if (next_ >= events_.size()) {
      ringattn::detail::fail("ringattn-bench", "a timed run marked more than its ", events_.size() - 1,
                             " phases");
    }
    events_[next_++]->record(nullptr);
  }

  void restart() { next_ = 0; }

  // The phases of the last run and, last, the whole run, in milliseconds (waits for the run).
  std::vector<double> elapsed_ms() const {
    if (next_ != events_.size()) {
      ringattn::detail::fail("ringattn-bench", "a timed run marked ", next_ - 1, " of its ",
                             events_.size() - 1, " phases");
    }
    RINGATTN_CUDA_CHECK(cudaEventSynchronize(events_.back()->get()));
    std::vector<double> ms;
    for (std::size_t i = 1; i < events_.size(); ++i) ms.push_back(between(i - 1, i));
    ms.push_back(between(0, events_.size() - 1));
    return ms;
  }

 private:
  double between(std::size_t first, std::size_t last) const {
    float ms = 0.0f;
    RINGATTN_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[first]->get(), events_[last]->get()));
    return ms;
  }

  std::vector<std::unique_ptr<CudaEvent>> events_;
  std::size_t next_ = 0;
};

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// Runs body(phases) `warmup` times untimed, then `repeats` (>= 1) times timed by CUDA events on the
// default stream; the body calls phases.mark() between its `count` phases. Returns the median over
// the timed runs of each phase and, last, of the whole run, in milliseconds. Each timed run starts
// on an idle device. With a communicator every rank enters a barrier before each timed run, and
// each figure of a run is the largest over the ranks, so all ranks time the same runs.
template <typename Body>
std::vector<double> median_phases_ms(Body&& body, int count, int warmup, int repeats,
                                     ringattn::Communicator* comm = nullptr) {
  Phases phases(count);
  auto run = [&] {
    phases.restart();
    phases.mark();
    body(phases);
    phases.mark();
  };
  for (int i = 0; i < warmup; ++i) run();
  const std::size_t width = static_cast<std::size_t>(count) + 1;
  std::vector<double> times;  // run after run, `width` figures each
  for (int i = 0; i < repeats; ++i) {
    RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
    if (comm != nullptr) comm->barrier();
    run();
    const std::vector<double> ms = phases.elapsed_ms();
    times.insert(times.end(), ms.begin(), ms.end());
  }
  if (comm != nullptr && comm->size() > 1) {
    std::vector<double> all(times.size() * comm->size());
    comm->host_all_gather(times.data(), times.size() * sizeof(double), all.data());
    for (std::size_t r = 0; r < static_cast<std::size_t>(comm->size()); ++r) {
      for (std::size_t i = 0; i < times.size(); ++i) times[i] = std::max(times[i], all[r * times.size() + i]);
    }
  }
  std::vector<double> medians;
  for (std::size_t column = 0; column < width; ++column) {
    std::vector<double> values;
    for (int i = 0; i < repeats; ++i) values.push_back(times[i * width + column]);
    medians.push_back(median(values));
  }
  return medians;
}

// Median time of `body` in milliseconds over `repeats` runs after `warmup` runs.
template <typename Body>
double median_ms(Body&& body, int warmup, int repeats) {
  return median_phases_ms([&](Phases&) { body(); }, 1, warmup, repeats)[0];
}

// ---------------------------------------------------------------------------------------------
// Problems in device memory.

// Out of device memory: a cudaMalloc failed. cudaMalloc leaves its error as the thread's last
// error, which a later launch check would report as its own, so the caller clears it.
bool out_of_memory(const ringattn::Error& error) {
  const std::string_view text = error.what();
  return text.find("cudaErrorMemoryAllocation") != std::string_view::npos ||
         text.find("out of memory") != std::string_view::npos;
}

void clear_cuda_error() {
  (void)cudaGetLastError();
}

// `count` bf16 values drawn from N(0, 1): a block of up to 4M values made on the host, repeated
// over the buffer by device copies, so that a billion values take no longer than a few million.
void fill_random_bf16(void* data, std::size_t count, std::uint32_t seed) {
  if (count == 0) return;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  const std::size_t block = std::min<std::size_t>(count, std::size_t{1} << 22);
  std::vector<std::uint16_t> host(block);
  for (auto& value : host) value = ringattn::float_to_bf16(normal(rng));
  auto* bytes = static_cast<unsigned char*>(data);
  RINGATTN_CUDA_CHECK(cudaMemcpy(bytes, host.data(), block * 2, cudaMemcpyHostToDevice));
  for (std::size_t filled = block; filled < count;) {
    const std::size_t n = std::min(filled, count - filled);
    RINGATTN_CUDA_CHECK(cudaMemcpy(bytes + filled * 2, bytes, n * 2, cudaMemcpyDeviceToDevice));
    filled += n;
  }
}

struct Shape {
  std::int64_t batch = 1, seq = 0, heads = 0, kv_heads = 0, head_dim = 0;
  std::int64_t v_head_dim = 0;  // d_v of V, O and dO; 0: head_dim

  std::int64_t value_dim() const { return v_head_dim > 0 ? v_head_dim : head_dim; }
};

// Elements of a [batch, seq, heads, dim] tensor (dim: head_dim unless given).
std::size_t elements(const Shape& s, std::int64_t heads, std::int64_t dim = 0) {
  return static_cast<std::size_t>(s.batch) * static_cast<std::size_t>(s.seq) * static_cast<std::size_t>(heads) *
         static_cast<std::size_t>(dim > 0 ? dim : s.head_dim);
}

// One attention problem in this GPU's memory, contiguous: bf16 q [batch, seq, heads, d], o and
// dout [batch, seq, heads, d_v], k [batch, seq, kv_heads, d] and v [batch, seq, kv_heads, d_v];
// fp32 lse and delta [batch, heads, seq], dq, dk and dv (of their inputs' widths); with
// `rounded`, bf16 dq, dk and dv too (the gradients as SDPA returns them). The inputs q, k, v and
// dout hold random values unless `fill` is false. A ring shard is the same set of tensors for S/N
// tokens, without delta (the ring makes its own).
class BlockProblem {
 public:
  BlockProblem(const Shape& s, bool causal_mask, std::uint32_t seed, bool with_delta = true, bool fill = true,
               bool rounded = false)
      : shape(s),
        causal(causal_mask),
        q(elements(s, s.heads) * 2),
        k(elements(s, s.kv_heads) * 2),
        v(elements(s, s.kv_heads, s.value_dim()) * 2),
        o(elements(s, s.heads, s.value_dim()) * 2),
        dout(elements(s, s.heads, s.value_dim()) * 2),
        lse(static_cast<std::size_t>(s.batch * s.heads * s.seq) * 4),
        delta(with_delta ? static_cast<std::size_t>(s.batch * s.heads * s.seq) * 4 : 0),
        dq(elements(s, s.heads) * 4),
        dk(elements(s, s.kv_heads) * 4),
        dv(elements(s, s.kv_heads, s.value_dim()) * 4),
        dq_bf16(rounded ? elements(s, s.heads) * 2 : 0),
        dk_bf16(rounded ? elements(s, s.kv_heads) * 2 : 0),
        dv_bf16(rounded ? elements(s, s.kv_heads, s.value_dim()) * 2 : 0) {
    if (fill) {
      fill_random_bf16(q.data(), elements(s, s.heads), seed);
      fill_random_bf16(k.data(), elements(s, s.kv_heads), seed + 1);
      fill_random_bf16(v.data(), elements(s, s.kv_heads, s.value_dim()), seed + 2);
      fill_random_bf16(dout.data(), elements(s, s.heads, s.value_dim()), seed + 3);
    }
  }

  const Shape shape;
  const bool causal;
  DeviceBuffer q, k, v, o, dout, lse, delta, dq, dk, dv;
  DeviceBuffer dq_bf16, dk_bf16, dv_bf16;  // empty unless `rounded`

  double scale() const { return ringattn::default_scale(shape.head_dim); }

  ringattn::ForwardArgs forward_args() const {
    return {tokens(q, DType::bf16, shape.heads), tokens(k, DType::bf16, shape.kv_heads),
            values(v, DType::bf16, shape.kv_heads), values(o, DType::bf16, shape.heads), rows(lse),
            scale(), ringattn::Mask{causal, 0, 0}, false};
  }

  ringattn::BackwardArgs backward_args() const {
    const ringattn::ForwardArgs f = forward_args();
    return {f.q, f.k, f.v, values(dout, DType::bf16, shape.heads), f.lse, rows(delta),
            tokens(dq, DType::f32, shape.heads), tokens(dk, DType::f32, shape.kv_heads),
            values(dv, DType::f32, shape.kv_heads), scale(), f.mask, false};
  }

  // The local block on the whole problem; the backward zeroes the gradients it adds into and
  // computes delta = rowsum(dO * O) first.
  void forward() const { ringattn::cuda::flash_forward(forward_args()); }
  void backward() const {
    const ringattn::BackwardArgs b = backward_args();
    RINGATTN_CUDA_CHECK(cudaMemsetAsync(dk.data(), 0, dk.bytes()));
    RINGATTN_CUDA_CHECK(cudaMemsetAsync(dv.data(), 0, dv.bytes()));
    ringattn::cuda::flash_backward_prepare(forward_args().o, b.dout, b.delta, nullptr, &b.dq);
    ringattn::cuda::flash_backward(b);
  }
  // The same backward with bf16 gradients, as SDPA returns them (needs `rounded`): dQ added into
  // the fp32 accumulator the delta pass zeroes, then rounded; dK and dV written rounded.
  void backward_rounded() const {
    ringattn::BackwardArgs b = backward_args();
    b.dk = tokens(dk_bf16, DType::bf16, shape.kv_heads);
    b.dv = values(dv_bf16, DType::bf16, shape.kv_heads);
    b.overwrite_key_gradients = true;
    ringattn::cuda::flash_backward_prepare(forward_args().o, b.dout, b.delta, nullptr, &b.dq);
    ringattn::cuda::flash_backward(b);
    ringattn::detail::copy(b.dq, tokens(dq_bf16, DType::bf16, shape.heads), nullptr);
  }

  // The problem as this rank's shard of a ring.
  ringattn::RingForwardArgs ring_forward_args() const {
    const ringattn::ForwardArgs f = forward_args();
    return {.q = f.q, .k = f.k, .v = f.v, .o = f.o, .lse = f.lse, .scale = f.scale, .causal = causal};
  }
  ringattn::RingBackwardArgs ring_backward_args() const {
    const ringattn::BackwardArgs b = backward_args();
    return {.q = b.q, .k = b.k, .v = b.v, .o = forward_args().o, .lse = b.lse, .dout = b.dout,
            .dq = b.dq, .dk = b.dk, .dv = b.dv, .scale = b.scale, .causal = causal};
  }

 private:
  TensorView tokens(const DeviceBuffer& b, DType dtype, std::int64_t heads) const {
    return TensorView::contiguous(b.data(), dtype, {shape.batch, shape.seq, heads, shape.head_dim}, Memory::device);
  }
  TensorView values(const DeviceBuffer& b, DType dtype, std::int64_t heads) const {  // of d_v
    return TensorView::contiguous(b.data(), dtype, {shape.batch, shape.seq, heads, shape.value_dim()},
                                  Memory::device);
  }
  TensorView rows(const DeviceBuffer& b) const {
    return TensorView::contiguous(b.data(), DType::f32, {shape.batch, shape.heads, shape.seq}, Memory::device);
  }
};

// A BlockProblem on every rank of `comm`. When it fails on any rank (out of memory, say), every
// rank frees what it allocated and throws the same Error, so that no rank goes on alone.
std::unique_ptr<BlockProblem> problem_on_every_rank(const ringattn::Communicator& comm, const Shape& s,
                                                    bool causal, std::uint32_t seed, bool with_delta,
                                                    bool fill) {
  std::unique_ptr<BlockProblem> problem;
  std::optional<ringattn::Error> failure;
  try {
    problem = std::make_unique<BlockProblem>(s, causal, seed, with_delta, fill);
  } catch (const ringattn::Error& error) {
    failure = error;
    clear_cuda_error();
  }
  ringattn::check_no_rank_failed(comm, "ringattn-bench", failure ? &*failure : nullptr);
  return problem;
}

// ---------------------------------------------------------------------------------------------
// attention

struct AttentionRow {
  int seq = 0, batch = 0, heads = 0, head_dim = 0, v_head_dim = 0;
  bool causal = false;
  double forward_ms = 0, backward_ms = 0, forward_tflops = 0, backward_tflops = 0, total_tflops = 0;
  double backward_add_ms = 0;  // the ring's contract: fp32 gradients zeroed, then added into
  double workspace_mib = 0;
};

AttentionRow bench_attention(int seq, int head_dim, int v_head_dim, bool causal) {
  const int batch = std::max(1, 16384 / seq), heads = 2048 / head_dim;
  const BlockProblem p({batch, seq, heads, heads, head_dim, v_head_dim}, causal,
                       static_cast<std::uint32_t>(seq * 131 + head_dim), true, true, true);
  const int repeats = seq >= 8192 ? 10 : 20;
  AttentionRow row{};
  row.seq = seq;
  row.batch = batch;
  row.heads = heads;
  row.head_dim = head_dim;
  row.v_head_dim = v_head_dim;
  row.causal = causal;
  row.forward_ms = median_ms([&] { p.forward(); }, 3, repeats);
  row.backward_ms = median_ms([&] { p.backward_rounded(); }, 3, repeats);
  row.backward_add_ms = median_ms([&] { p.backward(); }, 3, repeats);
  // 2 b h s^2 (d_qk + d_v): S = QK^T and O = PV (4 b h s^2 d where the two agree).
  const double flop = ringattn::attention_forward_flops(batch, heads, seq, head_dim, causal) *
                      (head_dim + v_head_dim) / (2.0 * head_dim);
  row.forward_tflops = flop / (row.forward_ms * 1e-3) * 1e-12;
  row.backward_tflops = ringattn::kBackwardFlopFactor * flop / (row.backward_ms * 1e-3) * 1e-12;
  row.total_tflops =
      (1.0 + ringattn::kBackwardFlopFactor) * flop / ((row.forward_ms + row.backward_ms) * 1e-3) * 1e-12;
  // Beyond inputs and outputs the block needs LSE and delta (fp32 per row) and, for bf16
  // gradients, the fp32 dQ accumulator.
  row.workspace_mib = double(p.lse.bytes() + p.delta.bytes() + p.dq.bytes()) / (1 << 20);
  return row;
}

// ---------------------------------------------------------------------------------------------
// ring

// Forward, backward and the two together, in milliseconds.
struct Times {
  double forward = 0, backward = 0, total = 0;
};

struct RingRow {
  std::int64_t seq = 0, kv_heads = 0;
  bool causal = false;
  int repeats = 0, warmup = 0;
  std::optional<Times> ring, transfers, compute, single;
  // How long the compute stream waited for transfers in one more ring run (forward, backward;
  // the largest over the ranks): what of the transfers the schedule did not hide.
  std::optional<double> waited_forward, waited_backward;
  std::string error;        // why the ring did not run (e.g. out of memory); empty when it did
  std::string single_note;  // why there is no one-GPU time

  RingRow(std::int64_t total, std::int64_t kv, bool causal_mask, int runs, int warmup_runs)
      : seq(total), kv_heads(kv), causal(causal_mask), repeats(runs), warmup(warmup_runs) {}
};

Times times_of(const std::vector<double>& ms) {
  return {ms.at(0), ms.at(1), ms.at(2)};
}

// The ring, its halves and the one-GPU block for one configuration, into `row`. Collective.
void measure_ring(const std::shared_ptr<ringattn::Communicator>& comm, const RingOptions& opt, RingRow& row) {
  const int ranks = comm->size(), rank = comm->rank();
  const auto layout = ringattn::parse_sequence_layout(opt.layout);
  const Shape local{1, row.seq / ranks, opt.heads, row.kv_heads, opt.head_dim};
  const auto seed = static_cast<std::uint32_t>(row.seq * 7 + row.kv_heads * 3 + (row.causal ? 1 : 0));
  try {
    ringattn::RingAttention ring(comm, layout);
    const auto shard = problem_on_every_rank(*comm, local, row.causal, seed + 16 * rank, false, true);
    ringattn::RingForwardArgs fwd = shard->ring_forward_args();
    ringattn::RingBackwardArgs bwd = shard->ring_backward_args();
    // --scratch persistent: the workspace in one buffer lent to every call as persistent scratch,
    // as ringattn-train lends its own; a first ring sizes it. The guard releases it from the
    // communicator before the buffer is freed, on every way out of this block.
    DeviceBuffer scratch;
    struct ReleaseGuard {
      ringattn::RingAttention& ring;
      ~ReleaseGuard() {
        try {
          ring.release_scratch(10.0);
        } catch (const std::exception& error) {
          std::fprintf(stderr, "ringattn-bench: releasing the ring's scratch failed: %s\n", error.what());
        }
      }
    } release{ring};
    if (opt.scratch == "persistent" && ranks > 1) {
      ringattn::ring_forward(ring, fwd, ringattn::RingWork::all);
      ringattn::ring_backward(ring, bwd, ringattn::RingWork::all);
      RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
      constexpr std::size_t kAlignmentSlack = 16 * 256;  // each buffer aligned to 256 bytes
      scratch = DeviceBuffer(ring.owned_workspace_bytes() + kAlignmentSlack);
      fwd.scratch = bwd.scratch = {{scratch.data(), scratch.bytes(), true}};
    }
    auto time = [&](ringattn::RingWork work, int warmup) {
      return times_of(median_phases_ms(
          [&](Phases& phases) {
            ringattn::ring_forward(ring, fwd, work);
            phases.mark();
            ringattn::ring_backward(ring, bwd, work);
          },
          2, warmup, row.repeats, comm.get()));
    };
    // The transfers first: their warm-up also allocates the ring's workspaces.
    row.transfers = time(ringattn::RingWork::transfers, std::max(1, row.warmup));
    row.compute = time(ringattn::RingWork::compute, row.warmup);
    row.ring = time(ringattn::RingWork::all, row.warmup);
    RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
    comm->barrier();
    comm->measure_waits(true);
    ringattn::ring_forward(ring, fwd, ringattn::RingWork::all);
    double waited[2] = {comm->take_waited_ms(), 0.0};
    ringattn::ring_backward(ring, bwd, ringattn::RingWork::all);
    waited[1] = comm->take_waited_ms();
    comm->measure_waits(false);
    std::vector<double> all(2 * static_cast<std::size_t>(ranks));
    comm->host_all_gather(waited, sizeof(waited), all.data());
    for (int r = 0; r < ranks; ++r) {
      waited[0] = std::max(waited[0], all[2 * r]);
      waited[1] = std::max(waited[1], all[2 * r + 1]);
    }
    row.waited_forward = waited[0];
    row.waited_backward = waited[1];
  } catch (const ringattn::Error& error) {
    if (!out_of_memory(error)) throw;
    clear_cuda_error();
    row.error = error.what();
  }

  // The ring's memory is free again; rank 0's GPU runs the whole problem.
  comm->barrier();
  if (rank == 0) {
    try {
      const BlockProblem whole({1, row.seq, opt.heads, row.kv_heads, opt.head_dim}, row.causal, seed);
      row.single = times_of(median_phases_ms(
          [&](Phases& phases) {
            whole.forward();
            phases.mark();
            whole.backward();
          },
          2, row.warmup, row.repeats));
    } catch (const ringattn::Error& error) {
      if (!out_of_memory(error)) throw;
      clear_cuda_error();
      row.single_note = std::string("does not fit in one GPU's memory: ") + error.what();
    }
  }
  comm->barrier();
}

struct RingRun {
  std::string gpu;
  int ranks = 1;
  std::string date;
  std::vector<RingRow> rows;
  std::string transport;  // how the ring's exchanges move (Communicator::transport)
};

double flops_of(const RingOptions& opt, const RingRow& row) {
  return ringattn::attention_forward_flops(1, opt.heads, row.seq, opt.head_dim, row.causal);
}

std::optional<double> tflops(double flop, const std::optional<Times>& t, double Times::*field, int gpus) {
  if (!t) return std::nullopt;
  return flop / gpus / ((*t).*field * 1e-3) * 1e-12;
}

std::optional<double> efficiency(const RingRow& row, double Times::*field, int ranks) {
  if (!row.ring || !row.single) return std::nullopt;
  return ringattn::ring_efficiency((*row.single).*field, ranks, (*row.ring).*field);
}

std::optional<double> hidden(const RingRow& row, double Times::*field) {
  if (!row.ring || !row.compute || !row.transfers) return std::nullopt;
  const double share = ringattn::hidden_share((*row.ring).*field, (*row.compute).*field, (*row.transfers).*field);
  return std::isfinite(share) ? std::optional<double>(share) : std::nullopt;
}

constexpr double Times::*kForward = &Times::forward;
constexpr double Times::*kBackward = &Times::backward;
constexpr double Times::*kTotal = &Times::total;

std::string cell(const std::optional<double>& value, const char* format, int width) {
  char text[32];
  if (value && std::isfinite(*value)) {
    std::snprintf(text, sizeof(text), format, *value);
  } else {
    std::snprintf(text, sizeof(text), "%s", "-");
  }
  std::string out = text;
  if (static_cast<int>(out.size()) < width) out.insert(0, width - out.size(), ' ');
  return out;
}

std::optional<double> field_of(const std::optional<Times>& t, double Times::*field) {
  if (!t) return std::nullopt;
  return (*t).*field;
}

void print_ring_header(const RingOptions& opt, const RingRun& run) {
  std::printf("ringattn-bench ring: %d x %s, exchanges by %s, bf16, batch 1, %lld heads of %lld, %s, %s workspace\n",
              run.ranks, run.gpu.c_str(), run.transport.c_str(), (long long)opt.heads, (long long)opt.head_dim,
              opt.layout.c_str(), opt.scratch == "persistent" ? "persistent scratch" : "its own");
  std::printf("%8s %3s %-6s | %25s | %17s | %9s | %17s | %17s | %17s | %11s | %13s\n", "", "", "",
              "ring ms fwd/bwd/f+b", "TFLOP/s a GPU", "1 GPU ms", "efficiency", "transfers ms", "compute ms",
              "hidden", "waited ms");
  std::printf("%8s %3s %-6s | %8s %8s %7s | %5s %5s %5s | %9s | %5s %5s %5s | %8s %8s | %8s %8s | %5s %5s | %6s %6s\n",
              "seq", "kv", "mask", "fwd", "bwd", "f+b", "fwd", "bwd", "f+b", "f+b", "fwd", "bwd", "f+b", "fwd", "bwd",
              "fwd", "bwd", "fwd", "bwd", "fwd", "bwd");
  std::fflush(stdout);
}

void print_ring_row(const RingOptions& opt, const RingRun& run, const RingRow& r) {
  const double flop = flops_of(opt, r);
  const double factor = ringattn::kBackwardFlopFactor;
  std::printf("%8lld %3lld %-6s | %s %s %s | %s %s %s | %s | %s %s %s | %s %s | %s %s | %s %s | %s %s\n",
              (long long)r.seq,
              (long long)r.kv_heads, r.causal ? "causal" : "full", cell(field_of(r.ring, kForward), "%.2f", 8).c_str(),
              cell(field_of(r.ring, kBackward), "%.2f", 8).c_str(), cell(field_of(r.ring, kTotal), "%.1f", 7).c_str(),
              cell(tflops(flop, r.ring, kForward, run.ranks), "%.0f", 5).c_str(),
              cell(tflops(factor * flop, r.ring, kBackward, run.ranks), "%.0f", 5).c_str(),
              cell(tflops((1 + factor) * flop, r.ring, kTotal, run.ranks), "%.0f", 5).c_str(),
              cell(field_of(r.single, kTotal), "%.1f", 9).c_str(),
              cell(efficiency(r, kForward, run.ranks), "%.3f", 5).c_str(),
              cell(efficiency(r, kBackward, run.ranks), "%.3f", 5).c_str(),
              cell(efficiency(r, kTotal, run.ranks), "%.3f", 5).c_str(),
              cell(field_of(r.transfers, kForward), "%.2f", 8).c_str(),
              cell(field_of(r.transfers, kBackward), "%.2f", 8).c_str(),
              cell(field_of(r.compute, kForward), "%.2f", 8).c_str(),
              cell(field_of(r.compute, kBackward), "%.2f", 8).c_str(), cell(hidden(r, kForward), "%.2f", 5).c_str(),
              cell(hidden(r, kBackward), "%.2f", 5).c_str(), cell(r.waited_forward, "%.3f", 6).c_str(),
              cell(r.waited_backward, "%.3f", 6).c_str());
  if (!r.error.empty()) std::printf("    ring: %s\n", r.error.c_str());
  if (!r.single_note.empty()) std::printf("    one GPU: %s\n", r.single_note.c_str());
  std::fflush(stdout);
}

void write_ring_json(const RingOptions& opt, const RingRun& run) {
  std::ofstream out(opt.json);
  const double factor = ringattn::kBackwardFlopFactor;
  out << "{\n  \"benchmark\": \"ring\",\n  \"gpu\": " << json_string(run.gpu) << ",\n  \"gpus\": " << run.ranks
      << ",\n  \"communicator\": \"nccl\",\n  \"exchanges\": " << json_string(run.transport)
      << ",\n  \"date\": " << json_string(run.date)
      << ",\n  \"revision\": " << json_string(opt.revision) << ",\n  \"ringattn_version\": \""
      << RINGATTN_VERSION_STRING << "\",\n  \"configuration\": {\"dtype\": \"bf16\", \"batch\": 1, \"heads\": "
      << opt.heads << ", \"head_dim\": " << opt.head_dim << ", \"layout\": " << json_string(opt.layout)
      << ", \"workspace\": " << json_string(opt.scratch == "persistent" ? "persistent scratch" : "the ring's own")
      << ",\n    \"flops\": \"4*b*h*s^2*d forward over the whole sequence (half when causal), backward 2.5x; "
         "per GPU: divided by gpus\",\n"
         "    \"timing\": \"CUDA events, forward then backward in each run, median over the runs; every rank "
         "enters a barrier before each run and a run counts its slowest rank\",\n"
         "    \"single\": \"the same local block on the whole sequence on rank 0's GPU\",\n"
         "    \"efficiency\": \"single / (gpus * ring)\",\n"
         "    \"comm\": \"the ring's exchanges alone, same messages and order, no compute (over the "
         "copy engines with the host's opening of the neighbour's buffers)\",\n"
         "    \"compute\": \"the ring's block calls alone against the local K/V, no exchange\",\n"
         "    \"hidden\": \"1 - (ring - compute) / comm, clamped to [0, 1]\",\n    \"waited\": \"how long the compute "
         "stream waited for transfers in exchange_wait during one more ring run, the largest over the ranks\"},"
         "\n  \"rows\": [";
  for (std::size_t i = 0; i < run.rows.size(); ++i) {
    const RingRow& r = run.rows[i];
    const double flop = flops_of(opt, r);
    out << (i ? "," : "") << "\n    {\"seq\": " << r.seq << ", \"tokens_per_gpu\": " << r.seq / run.ranks
        << ", \"heads\": " << opt.heads << ", \"kv_heads\": " << r.kv_heads << ", \"head_dim\": " << opt.head_dim
        << ", \"causal\": " << (r.causal ? "true" : "false") << ", \"repeats\": " << r.repeats
        << ", \"warmup\": " << r.warmup;
    auto times = [&](const char* prefix, const std::optional<Times>& t) {
      out << ",\n     \"" << prefix << "_forward_ms\": " << json_number(field_of(t, kForward)) << ", \"" << prefix
          << "_backward_ms\": " << json_number(field_of(t, kBackward)) << ", \"" << prefix
          << "_total_ms\": " << json_number(field_of(t, kTotal));
    };
    times("ring", r.ring);
    out << ",\n     \"forward_tflops_per_gpu\": " << json_number(tflops(flop, r.ring, kForward, run.ranks))
        << ", \"backward_tflops_per_gpu\": " << json_number(tflops(factor * flop, r.ring, kBackward, run.ranks))
        << ", \"total_tflops_per_gpu\": " << json_number(tflops((1 + factor) * flop, r.ring, kTotal, run.ranks));
    times("single", r.single);
    out << ", \"single_total_tflops\": " << json_number(tflops((1 + factor) * flop, r.single, kTotal, 1))
        << ", \"single_note\": " << json_optional_string(r.single_note);
    out << ",\n     \"efficiency_forward\": " << json_number(efficiency(r, kForward, run.ranks))
        << ", \"efficiency_backward\": " << json_number(efficiency(r, kBackward, run.ranks))
        << ", \"efficiency_total\": " << json_number(efficiency(r, kTotal, run.ranks));
    times("comm", r.transfers);
    times("compute", r.compute);
    out << ",\n     \"hidden_forward\": " << json_number(hidden(r, kForward))
        << ", \"hidden_backward\": " << json_number(hidden(r, kBackward))
        << ", \"hidden_total\": " << json_number(hidden(r, kTotal))
        << ",\n     \"waited_forward_ms\": " << json_number(r.waited_forward)
        << ", \"waited_backward_ms\": " << json_number(r.waited_backward)
        << ", \"error\": " << json_optional_string(r.error)
        << "}";
  }
  out << "\n  ]\n}\n";
}

int run_ring_table(const std::shared_ptr<ringattn::Communicator>& comm, const RingOptions& opt, RingRun& run) {
  const int rank = comm->rank();
  std::vector<bool> masks;
  if (opt.causal != "off") masks.push_back(true);
  if (opt.causal != "on") masks.push_back(false);
  const std::vector<std::int64_t> seqlens = parse_list(opt.seqlens), kv_list = parse_list(opt.kv_heads);

  // Every configuration's kernels and exchanges once, on a short sequence, before any timing.
  for (const std::int64_t kv : kv_list) {
    for (const bool causal : masks) {
      RingRow warm(4096 * run.ranks, kv, causal, 1, 1);
      measure_ring(comm, opt, warm);
    }
  }

  if (rank == 0) print_ring_header(opt, run);
  for (const std::int64_t seq : seqlens) {
    for (const std::int64_t kv : kv_list) {
      for (const bool causal : masks) {
        if (!causal && opt.max_full_seq > 0 && seq > opt.max_full_seq) continue;
        RingRow row(seq, kv, causal, opt.repeats > 0 ? opt.repeats : default_repeats(seq),
                    opt.warmup >= 0 ? opt.warmup : default_warmup(seq));
        measure_ring(comm, opt, row);
        run.rows.push_back(row);
        if (rank == 0) {
          print_ring_row(opt, run, row);
          if (!opt.json.empty()) write_ring_json(opt, run);
        }
      }
    }
  }
  if (rank == 0 && !opt.json.empty()) std::printf("wrote %s\n", opt.json.c_str());
  return 0;
}

// ---------------------------------------------------------------------------------------------
// ring --fit

struct FitResult {
  int gpus = 1;
  double free_gib = 0;
  std::int64_t model_longest = 0, longest = 0, first_failing = 0;
  std::vector<std::pair<std::int64_t, bool>> probes;
  std::int64_t verified_seq = 0;
  std::optional<Times> verified;
  std::string note;
};

// Whether a forward + backward of `seq` tokens fits on the ranks of `comm`: with `run` false, what
// it allocates is allocated (the shards, and the ring's workspaces through a transfers-only pass);
// with `run` true it runs, timed into `times`. Everything is freed on return. Collective.
bool fits(const std::shared_ptr<ringattn::Communicator>& comm, const RingOptions& opt, std::int64_t kv_heads,
          std::int64_t seq, bool run, std::optional<Times>* times) {
  try {
    ringattn::RingAttention ring(comm, ringattn::SequenceLayoutKind::zigzag);
    const Shape local{1, seq / comm->size(), opt.heads, kv_heads, opt.head_dim};
    const auto shard = problem_on_every_rank(*comm, local, true, 99 + 16 * comm->rank(), false, run);
    const ringattn::RingForwardArgs fwd = shard->ring_forward_args();
    const ringattn::RingBackwardArgs bwd = shard->ring_backward_args();
    const ringattn::RingWork work = run ? ringattn::RingWork::all : ringattn::RingWork::transfers;
    const std::vector<double> ms = median_phases_ms(
        [&](Phases& phases) {
          ringattn::ring_forward(ring, fwd, work);
          phases.mark();
          ringattn::ring_backward(ring, bwd, work);
        },
        2, 0, 1, comm.get());
    if (times != nullptr) *times = times_of(ms);
    return true;
  } catch (const ringattn::Error& error) {
    if (!out_of_memory(error)) throw;
    clear_cuda_error();
    return false;
  }
}

FitResult fit_on(const std::shared_ptr<ringattn::Communicator>& comm, const RingOptions& opt, std::int64_t kv_heads) {
  FitResult result;
  result.gpus = comm->size();
  const std::int64_t unit = std::lcm<std::int64_t>(16384, 2 * result.gpus);

  std::size_t free_bytes = 0, total_bytes = 0;
  RINGATTN_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  std::vector<std::size_t> all_free(comm->size());
  comm->host_all_gather(&free_bytes, sizeof(free_bytes), all_free.data());
  result.free_gib = static_cast<double>(*std::min_element(all_free.begin(), all_free.end())) / (1 << 30);
  ringattn::RingPlanInput model;
  model.ranks = result.gpus;
  model.seq = unit;
  model.heads = opt.heads;
  model.kv_heads = kv_heads;
  model.head_dim = opt.head_dim;
  model.memory_gib = result.free_gib;
  result.model_longest = ringattn::plan_ring(model).longest_seq;

  // The kernels load before memory runs short (the probes run none): one short forward + backward.
  if (!fits(comm, opt, kv_heads, 4096 * result.gpus, true, nullptr)) {
    ringattn::detail::fail("ringattn-bench ring --fit", "a forward + backward of ", 4096 * result.gpus,
                           " tokens does not fit");
  }

  auto probe = [&](std::int64_t seq) {
    const bool ok = fits(comm, opt, kv_heads, seq, false, nullptr);
    result.probes.emplace_back(seq, ok);
    if (comm->rank() == 0) {
      std::printf("fit: %d GPU%s, %lld tokens: %s\n", result.gpus, result.gpus > 1 ? "s" : "", (long long)seq,
                  ok ? "fits" : "out of memory");
      std::fflush(stdout);
    }
    return ok;
  };
  // Doubling until a length fails (or an absurd length fits), then bisection between the last
  // length that fit and the first that failed.
  std::int64_t lo = 0, hi = 0;
  for (std::int64_t seq = unit; hi == 0; seq *= 2) {
    if (probe(seq)) {
      lo = seq;
      if (seq >= (std::int64_t{1} << 30)) break;
    } else {
      hi = seq;
    }
  }
  if (hi == 0) {
    result.note = "fits at 2^30 tokens; the search stops there";
    hi = lo;
  }
  while (hi - lo > unit) {
    const std::int64_t mid = lo + (hi - lo) / unit / 2 * unit;
    (probe(mid) ? lo : hi) = mid;
  }
  result.longest = lo;
  result.first_failing = hi > lo ? hi : 0;

  if (opt.verify) {
    for (std::int64_t seq = lo; seq > 0 && result.verified_seq == 0; seq -= unit) {
      if (comm->rank() == 0) {
        std::printf("fit: %d GPU%s, forward + backward of %lld tokens...\n", result.gpus,
                    result.gpus > 1 ? "s" : "", (long long)seq);
        std::fflush(stdout);
      }
      std::optional<Times> times;
      if (fits(comm, opt, kv_heads, seq, true, &times)) {
        result.verified_seq = seq;
        result.verified = times;
      } else {
        result.note = ringattn::detail::concat("the forward + backward of ", seq,
                                               " tokens ran out of memory after its probe fit");
        if (lo - seq >= 8 * unit) break;
      }
    }
  }
  return result;
}

void write_fit_json(const RingOptions& opt, const RingRun& run, std::int64_t kv_heads,
                    const std::vector<FitResult>& results) {
  std::ofstream out(opt.json);
  out << "{\n  \"benchmark\": \"ring-fit\",\n  \"gpu\": " << json_string(run.gpu) << ",\n  \"gpus\": " << run.ranks
      << ",\n  \"date\": " << json_string(run.date) << ",\n  \"revision\": " << json_string(opt.revision)
      << ",\n  \"ringattn_version\": \"" << RINGATTN_VERSION_STRING
      << "\",\n  \"configuration\": {\"dtype\": \"bf16\", \"batch\": 1, \"heads\": " << opt.heads
      << ", \"kv_heads\": " << kv_heads << ", \"head_dim\": " << opt.head_dim
      << ", \"causal\": true, \"layout\": \"zigzag\",\n    \"one_gpu\": \"a ring of one rank on rank 0's GPU, "
         "its workspaces included\",\n    \"search\": \"doubling from 16k tokens, then bisection to "
         "16k (a multiple of 2 x gpus)\",\n    \"probe\": \"allocates the shards and, through a transfers-only "
         "forward + backward, the ring's workspaces; out of memory = does not fit\",\n    \"verify\": "
      << (opt.verify ? "true" : "false") << "},\n  \"results\": [";
  for (std::size_t i = 0; i < results.size(); ++i) {
    const FitResult& r = results[i];
    const double flop = (1.0 + ringattn::kBackwardFlopFactor) *
                        ringattn::attention_forward_flops(1, opt.heads, r.verified_seq, opt.head_dim, true);
    out << (i ? "," : "") << "\n    {\"gpus\": " << r.gpus << ", \"longest_seq\": " << r.longest
        << ", \"first_failing_seq\": " << (r.first_failing > 0 ? std::to_string(r.first_failing) : "null")
        << ", \"free_memory_gib\": " << json_number(r.free_gib) << ", \"model_longest_seq\": " << r.model_longest
        << ",\n     \"verified_seq\": " << (r.verified ? std::to_string(r.verified_seq) : "null")
        << ", \"verified_forward_ms\": " << json_number(field_of(r.verified, kForward))
        << ", \"verified_backward_ms\": " << json_number(field_of(r.verified, kBackward))
        << ", \"verified_total_ms\": " << json_number(field_of(r.verified, kTotal))
        << ", \"verified_tflops_per_gpu\": " << json_number(tflops(flop, r.verified, kTotal, r.gpus))
        << ", \"note\": " << json_optional_string(r.note) << ",\n     \"probes\": [";
    for (std::size_t p = 0; p < r.probes.size(); ++p) {
      out << (p ? ", " : "") << "{\"seq\": " << r.probes[p].first
          << ", \"fits\": " << (r.probes[p].second ? "true" : "false") << "}";
    }
    out << "]}";
  }
  out << "\n  ]\n}\n";
}

int run_ring_fit(const std::shared_ptr<ringattn::Communicator>& comm, const RingOptions& opt, RingRun& run) {
  const int rank = comm->rank();
  const std::int64_t kv_heads = parse_list(opt.kv_heads).front();
  std::vector<FitResult> results;
  // One GPU: a ring of one rank on rank 0 while the others wait.
  const std::shared_ptr<ringattn::Communicator> alone =
      run.ranks > 1 ? ringattn::split_communicator(*comm, rank, 0) : comm;
  if (rank == 0) {
    results.push_back(fit_on(alone, opt, kv_heads));
    if (!opt.json.empty()) write_fit_json(opt, run, kv_heads, results);  // kept if the rest stops
  }
  comm->barrier();
  if (run.ranks > 1) {
    FitResult all = fit_on(comm, opt, kv_heads);
    if (rank == 0) results.push_back(all);
  }
  if (rank == 0) {
    std::printf("\nringattn-bench ring --fit: %d x %s, bf16, batch 1, %lld heads of %lld (kv %lld), causal zigzag\n",
                run.ranks, run.gpu.c_str(), (long long)opt.heads, (long long)opt.head_dim, (long long)kv_heads);
    std::printf("%5s %12s %14s %12s %14s %16s %12s\n", "gpus", "longest", "first failing", "model", "free GiB/GPU",
                "verified f+b ms", "TFLOP/s/GPU");
    for (const FitResult& r : results) {
      const double flop = (1.0 + ringattn::kBackwardFlopFactor) *
                          ringattn::attention_forward_flops(1, opt.heads, r.verified_seq, opt.head_dim, true);
      std::printf("%5d %12lld %14s %12lld %14.1f %16s %12s\n", r.gpus, (long long)r.longest,
                  r.first_failing > 0 ? std::to_string(r.first_failing).c_str() : "-", (long long)r.model_longest,
                  r.free_gib, cell(field_of(r.verified, kTotal), "%.1f", 16).c_str(),
                  cell(tflops(flop, r.verified, kTotal, r.gpus), "%.0f", 12).c_str());
      if (r.verified && r.verified_seq != r.longest) {
        std::printf("      verified at %lld tokens\n", (long long)r.verified_seq);
      }
      if (!r.note.empty()) std::printf("      %s\n", r.note.c_str());
    }
    if (!opt.json.empty()) {
      write_fit_json(opt, run, kv_heads, results);
      std::printf("wrote %s\n", opt.json.c_str());
    }
  }
  return 0;
}

// The ring subcommand once its options passed: one GPU per rank, then the table or the fit.
// Returns the exit status, the same on every rank.
int run_ring(const RingOptions& opt, const ringattn::tools::MpiSession& session) {
  const int rank = session.rank(), ranks = session.size();

  // One GPU per rank, or a message on every rank naming the ranks without one.
  int devices = 0;
  std::string device_error;
  try {
    devices = ringattn::cuda_device_count();
  } catch (const ringattn::Error& error) {
    device_error = error.what();
  }
  const int local_ranks = ringattn::node_local_size(*ringattn::MpiCommunicator::world());
  int mine[2] = {devices, local_ranks};
  std::vector<int> all(2 * ranks);
  MPI_Allgather(mine, 2, MPI_INT, all.data(), 2, MPI_INT, MPI_COMM_WORLD);
  std::string none, short_of;  // ranks that see no GPU; ranks whose node has fewer GPUs than ranks
  for (int r = 0; r < ranks; ++r) {
    const int seen = all[2 * r], sharing = all[2 * r + 1];
    if (seen == 0) {
      none += ringattn::detail::concat(none.empty() ? "" : ", ", r);
    } else if (seen < sharing) {
      short_of += ringattn::detail::concat(short_of.empty() ? "" : "; ", "rank ", r, " sees ", seen,
                                           " for the ", sharing, " ranks of its node");
    }
  }
  if (!device_error.empty()) session.report(device_error);
  if (!none.empty()) {
    session.report(ringattn::detail::concat(
        "no CUDA GPU visible on rank", none.find(',') == std::string::npos ? "" : "s", " ", none,
        "; the ring benchmark needs one GPU per rank: run it on a GPU machine"));
    return 2;
  }
  if (!short_of.empty()) {
    session.report(
        ringattn::detail::concat("needs one CUDA GPU per rank, but ", short_of,
                                 ": start at most as many ranks per node as it has GPUs"));
    return 2;
  }

  const std::shared_ptr<ringattn::Communicator> comm = ringattn::nccl_world_communicator();
  int device = 0;
  RINGATTN_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  RINGATTN_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  RingRun run{prop.name, ranks, utc_now(), {}, comm->transport()};
  return opt.fit ? run_ring_fit(comm, opt, run) : run_ring_table(comm, opt, run);
}

#endif  // RINGATTN_WITH_CUDA

int run_attention(const std::string& seqlens, const std::string& head_dims, const std::string& json) {
  for (const std::string& problem :
       {check_attention_options(head_dims), ringattn::tools::unwritable("--json", json)}) {
    if (!problem.empty()) {
      std::fprintf(stderr, "ringattn-bench attention: %s\n", problem.c_str());
      return 2;
    }
  }
#if RINGATTN_WITH_CUDA
  if (ringattn::cuda_device_count() == 0) {
    std::fprintf(stderr, "ringattn-bench attention: no CUDA GPU visible\n");
    return 2;
  }
  cudaDeviceProp prop{};
  RINGATTN_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::vector<AttentionRow> rows;
  std::printf("%-7s %-6s %6s %5s %5s %10s %10s %9s %9s %9s %11s\n", "d", "mask", "seq", "batch",
              "heads", "fwd ms", "bwd ms", "fwd TF/s", "bwd TF/s", "f+b TF/s", "bwd add ms");
  for (const HeadDims& d : parse_head_dims(head_dims)) {
    for (bool causal : {false, true}) {
      for (const std::int64_t seq : parse_list(seqlens)) {
        const AttentionRow r = bench_attention(static_cast<int>(seq), static_cast<int>(d.qk),
                                               static_cast<int>(d.v), causal);
        rows.push_back(r);
        const std::string dims = r.head_dim == r.v_head_dim
                                     ? std::to_string(r.head_dim)
                                     : std::to_string(r.head_dim) + ":" + std::to_string(r.v_head_dim);
        std::printf("%-7s %-6s %6d %5d %5d %10.3f %10.3f %9.1f %9.1f %9.1f %11.3f\n",
                    dims.c_str(), causal ? "causal" : "none", r.seq, r.batch, r.heads, r.forward_ms,
                    r.backward_ms, r.forward_tflops, r.backward_tflops, r.total_tflops, r.backward_add_ms);
        std::fflush(stdout);
      }
    }
  }
  if (!json.empty()) {
    std::ofstream out(json);
    out << "{\n  \"benchmark\": \"attention\",\n  \"gpu\": \"" << prop.name << "\",\n"
        << "  \"ringattn_version\": \"" << RINGATTN_VERSION_STRING << "\",\n  \"rows\": [\n";
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const AttentionRow& r = rows[i];
      out << "    {\"head_dim\": " << r.head_dim << ", \"v_head_dim\": " << r.v_head_dim << ", \"causal\": " << (r.causal ? "true" : "false")
          << ", \"seq\": " << r.seq << ", \"batch\": " << r.batch << ", \"heads\": " << r.heads
          << ", \"forward_ms\": " << r.forward_ms << ", \"backward_ms\": " << r.backward_ms
          << ", \"backward_add_ms\": " << r.backward_add_ms
          << ", \"forward_tflops\": " << r.forward_tflops << ", \"backward_tflops\": " << r.backward_tflops
          << ", \"total_tflops\": " << r.total_tflops << ", \"workspace_mib\": " << r.workspace_mib << "}"
          << (i + 1 < rows.size() ? "," : "") << "\n";
    }
    out << "  ]\n}\n";
  }
  return 0;
#else
  (void)seqlens;
  (void)head_dims;
  (void)json;
  std::fprintf(stderr, "ringattn-bench attention: this ringattn was built without CUDA\n");
  return 2;
#endif
}

// The ring subcommand around MPI: the ranks agree on the command line and check the options
// before any GPU work; an error that reaches here afterwards may have left other ranks waiting in
// a collective, so it ends the whole job.
int main_ring(const ringattn::tools::CommandLine& line, const RingOptions& opt) {
  ringattn::tools::MpiSession session("ringattn-bench ring");
  if (const int code = session.agree_on(line); code >= 0) return code;
  if (const std::string problem = check_ring_options(opt, session.size()); !problem.empty()) {
    session.report(problem);
    return 2;
  }
  if (!session.no_rank_failed(session.rank() == 0 ? ringattn::tools::unwritable("--json", opt.json)
                                                  : "")) {
    return 2;
  }
#if RINGATTN_WITH_CUDA
  try {
    return run_ring(opt, session);
  } catch (const ringattn::CollectiveError& e) {
    // Every rank of the world threw it alike: each says so and all end normally.
    if (e.ranks() == session.size()) {
      session.report(e.what());
      return 2;
    }
    session.fail_alone(e.what());
  } catch (const std::bad_alloc&) {
    session.fail_alone("out of host memory (std::bad_alloc) with --seqlens " + opt.seqlens +
                       " --heads " + std::to_string(opt.heads) + " --head-dim " +
                       std::to_string(opt.head_dim));
  } catch (const std::exception& e) {
    session.fail_alone(e.what());
  }
  return 2;
#else
  session.report("this ringattn was built without CUDA");
  return 2;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  namespace tools = ringattn::tools;
  CLI::App app{"ringattn-bench: timings of ringattn's local block and of ring attention"};
  app.require_subcommand(1);
  auto* attention = app.add_subcommand("attention", "the CUDA local block, forward and backward");
  std::string seqlens = "512,1024,2048,4096,8192,16384", head_dims = "64,128", json;
  attention->add_option("--seqlens", seqlens, "comma-separated sequence lengths")
      ->check(tools::whole_number_list(1, kMaxSeq));
  attention->add_option("--head-dims", head_dims,
                        "comma-separated head dims D (" + ringattn::detail::cuda_block_head_dims_text() +
                            ") or DQK:DV (Q and K wider than V)")
      ->check(head_dims_list());
  attention->add_option("--json", json, "write the rows as JSON to this file");

  auto* ring = app.add_subcommand("ring", "ring attention across the ranks of mpirun, one GPU each (NCCL)");
  RingOptions ro;
  ring->add_option("--seqlens", ro.seqlens, "comma-separated total sequence lengths")
      ->check(tools::whole_number_list(1, kMaxSeq))
      ->capture_default_str();
  ring->add_option("--heads", ro.heads, "query heads")
      ->check(tools::whole_number(1))
      ->capture_default_str();
  ring->add_option("--kv-heads", ro.kv_heads,
                   "comma-separated key/value head counts, each dividing --heads "
                   "(--fit: the first)")
      ->check(tools::whole_number_list(1))
      ->capture_default_str();
  ring->add_option("--head-dim", ro.head_dim,
                   "head dimension (" + ringattn::detail::cuda_block_head_dims_text() + ")")
      ->check(tools::whole_number(1))
      ->capture_default_str();
  ring->add_option("--causal", ro.causal, "masks to time: both, on (causal) or off (full)")
      ->check(CLI::IsMember({"both", "on", "off"}))
      ->capture_default_str();
  ring->add_option("--layout", ro.layout, "zigzag or contiguous")
      ->check(CLI::IsMember({"zigzag", "contiguous"}))
      ->capture_default_str();
  ring->add_option("--repeats", ro.repeats,
                   "timed runs per measurement (default: 5 below 128k tokens, 3 below 512k, 2)")
      ->check(tools::whole_number(1, std::numeric_limits<int>::max()));
  ring->add_option("--warmup", ro.warmup,
                   "untimed runs before them (default: 1 below 512k tokens, 0)")
      ->check(tools::whole_number(0, std::numeric_limits<int>::max()));
  ring->add_option(
          "--max-full-seq", ro.max_full_seq,
          "time the full (non-causal) mask only up to this length (default 0: at every length)")
      ->check(tools::whole_number(0));
  ring->add_flag("--fit", ro.fit, "find the longest sequence whose forward + backward fits on 1 and on N GPUs");
  ring->add_flag("--verify,!--no-verify", ro.verify, "--fit: run the longest length found (default) or not");
  ring->add_option("--scratch", ro.scratch,
                   "the ring's workspace: persistent (one buffer lent to every call as persistent "
                   "scratch) or own (the ring's own buffers)")
      ->check(CLI::IsMember({"persistent", "own"}))
      ->capture_default_str();
  ring->add_option("--revision", ro.revision, "source revision for the JSON (default: $RINGATTN_REVISION)");
  ring->add_option("--json", ro.json, "write the results as JSON to this file (rank 0)");
  // Parsed before MPI or a GPU: --help works anywhere. The ring's ranks then agree on the command
  // line, its help and its errors included, so that none goes on alone.
  const tools::CommandLine line = tools::parse_command_line(app, argc, argv);
  if (ring->parsed() || (argc > 1 && std::string_view(argv[1]) == "ring")) {
    return main_ring(line, ro);
  }
  if (line.exit_code >= 0) return tools::finish_command_line(line, "ringattn-bench");
  try {
    return run_attention(seqlens, head_dims, json);
  } catch (const std::bad_alloc&) {
    std::fprintf(
        stderr, "ringattn-bench attention: out of host memory (std::bad_alloc) with --seqlens %s\n",
        seqlens.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ringattn-bench attention: %s\n", e.what());
  }
  return 1;
}
