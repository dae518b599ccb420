// ringattn-gradcheck: checks ring attention's forward and backward on a random problem of any
// size against a reference on the whole sequence, across the ranks of mpirun.
//
//   mpirun -np 2 ringattn-gradcheck --seq 131072 --heads 16 --head-dim 128 --causal \
//       --backend cuda --dtype bf16 [--layout zigzag] [--json FILE]
//   mpirun -np 3 ringattn-gradcheck --backend cpu --seq 1002 --heads 4 --kv-heads 2 \
//       --head-dim 192 --v-head-dim 128 --causal        (V of its own head dim; on GPUs 192/128)
//   mpirun -np 4 ringattn-gradcheck --backend cpu --seq 4096 --causal --window-left 300 \
//       --documents lognormal:512:1 --layout contiguous
//
// --window-left, --window-right and --documents (as ringattn-plan takes them: lognormal:MEAN:SEED
// [:LONG] or file:PATH, one list for every batch row) give the ring, the one-device block and the
// reference the same Mask; the starts are in the memory of the tensors.
//
// The reference is the fp64 CPU oracle when the problem is small enough (--oracle auto), else
// the streaming fp32 GPU reference (cuda backend). Beside the ring, rank 0 runs the same local
// block on the whole sequence on one device. Criterion (TESTING.md "Ring"): f64 ring within 1e-12
// (relative) of the oracle; otherwise the ring's relative error ||ring - ref|| / ||ref|| on every
// output is at most 1.1x the one-device error (LSE: plus one fp32 rounding per merge, random-walk
// style). Prints a table and JSON; exits 1 when the criterion fails, 2 on errors.
//
// Before any work every rank checks the same command line (tools/mpi_session.hpp): the options'
// ranges and combinations, --json writable (rank 0), the host memory the sizes need; an error
// prints on every rank and all exit with 2.
#include <CLI/CLI.hpp>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/block_checks.hpp"
#include "parallel/communicator.hpp"
#include "parallel/host_threads.hpp"
#include "parallel/local_block.hpp"
#include "parallel/mpi_communicator.hpp"
#include "parallel/performance_model.hpp"
#include "ringattn/attention.hpp"
#include "ringattn/config.h"
#include "ringattn/error.hpp"
#include "ringattn/ring.hpp"
#include "src/element_access.hpp"
#include "src/owned_buffer.hpp"
#include "src/thread_pool.hpp"
#include "tools/cli_checks.hpp"
#include "tools/mpi_session.hpp"

#if RINGATTN_WITH_CUDA
#include <cuda_runtime.h>

#include "src/cuda/cuda_check.hpp"
#endif

namespace {

using namespace ringattn;

struct Options {
  std::int64_t seq = 4096, batch = 1, heads = 8, kv_heads = 0, head_dim = 64;  // kv_heads 0: heads
  std::int64_t v_head_dim = 0;  // 0: head_dim
  std::int64_t value_dim() const { return v_head_dim > 0 ? v_head_dim : head_dim; }
  bool causal = false;
  std::int64_t window_left = 0, window_right = 0;
  std::string documents;  // a description for ringattn::document_starts; empty: none
  std::string layout = "zigzag", dtype = "f32", backend = "cpu", oracle = "auto", json;
  std::uint64_t seed = 1234;
  int timed = 0;  // extra forward+backward runs to time (ring and one device)
};

// Deterministic N(0, 1) from (seed, tensor, index): every rank draws the same values for the
// same global element without generating the whole tensor.
double normal_at(std::uint64_t seed, std::uint64_t tensor, std::uint64_t index) {
  auto mix = [](std::uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  };
  const std::uint64_t h = mix(seed ^ mix(tensor ^ mix(index)));
  const double u1 = (static_cast<double>(h >> 11) + 0.5) * 0x1p-53;
  const double u2 = static_cast<double>(mix(h) >> 11) * 0x1p-53;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

double round_to(DType dtype, double x) {
  switch (dtype) {
    case DType::bf16: return bf16_to_float(float_to_bf16(static_cast<float>(x)));
    case DType::f16: return f16_to_float(float_to_f16(static_cast<float>(x)));
    case DType::f32: return static_cast<float>(x);
    case DType::f64: return x;
  }
  return x;
}

// Values [B, len, H, d] of tensor `id` at the given global positions, rounded to `dtype`.
std::vector<double> draw(const Options& o, DType dtype, std::uint64_t id, std::int64_t heads,
                         std::int64_t d, const std::vector<std::int64_t>& positions) {
  const std::int64_t len = static_cast<std::int64_t>(positions.size());
  std::vector<double> out(o.batch * len * heads * d);
  detail::parallel_for(o.batch * len, [&](std::int64_t row) {
    const std::int64_t b = row / len, t = positions[row % len];
    for (std::int64_t h = 0; h < heads; ++h) {
      for (std::int64_t x = 0; x < d; ++x) {
        const std::uint64_t index = ((static_cast<std::uint64_t>(b) * o.seq + t) * heads + h) * d + x;
        out[(row * heads + h) * d + x] = round_to(dtype, normal_at(o.seed, id, index));
      }
    }
  });
  return out;
}

// A tensor in `memory` holding `values` in `dtype` (contiguous).
OwnedBuffer upload(const std::vector<double>& values, DType dtype, Memory memory) {
  OwnedBuffer host(Memory::host, values.size() * dtype_size(dtype));
  const TensorView view = host.view(dtype, {static_cast<std::int64_t>(values.size())});
  for (std::size_t i = 0; i < values.size(); ++i) detail::store_element(view, i, values[i]);
  if (memory == Memory::host) return host;
#if RINGATTN_WITH_CUDA
  OwnedBuffer device(Memory::device, host.bytes());
  RINGATTN_CUDA_CHECK(cudaMemcpy(device.data(), host.data(), host.bytes(), cudaMemcpyHostToDevice));
  return device;
#else
  detail::fail("ringattn-gradcheck", "device memory needs a build with CUDA");
#endif
}

std::vector<double> download(const OwnedBuffer& buffer, DType dtype, std::size_t count) {
  OwnedBuffer host_copy;
  const void* data = buffer.data();
  if (buffer.memory() == Memory::device) {
#if RINGATTN_WITH_CUDA
    host_copy = OwnedBuffer(Memory::host, count * dtype_size(dtype));
    RINGATTN_CUDA_CHECK(cudaMemcpy(host_copy.data(), buffer.data(), host_copy.bytes(), cudaMemcpyDeviceToHost));
    data = host_copy.data();
#endif
  }
  TensorView view = TensorView::contiguous(const_cast<void*>(data), dtype, {static_cast<std::int64_t>(count)});
  std::vector<double> out(count);
  for (std::size_t i = 0; i < count; ++i) out[i] = detail::load_element(view, i);
  return out;
}

struct Result {  // logical [B,S,H,D] / [B,H,S] order
  std::vector<double> o, lse, dq, dk, dv;
};

struct Shapes {
  std::int64_t B, S, Hq, Hkv, D, Dv;  // D: q and k, Dv: v, o and their gradients
};

// The document starts of the run in `memory` (int64, one list for every batch row).
OwnedBuffer upload_starts(const std::vector<std::int64_t>& starts, Memory memory) {
  const std::size_t bytes = starts.size() * sizeof(std::int64_t);
  OwnedBuffer buffer(memory, bytes);
  if (bytes == 0) return buffer;
  if (memory == Memory::host) {
    std::memcpy(buffer.data(), starts.data(), bytes);
    return buffer;
  }
#if RINGATTN_WITH_CUDA
  RINGATTN_CUDA_CHECK(cudaMemcpy(buffer.data(), starts.data(), bytes, cudaMemcpyHostToDevice));
  return buffer;
#else
  detail::fail("ringattn-gradcheck", "device memory needs a build with CUDA");
#endif
}

// The run's mask on the whole sequence, its document starts at `starts` (in the tensors' memory).
Mask whole_mask(const Options& opt, const OwnedBuffer& starts) {
  Mask mask{opt.causal, 0, 0, opt.window_left, opt.window_right, {}};
  const auto count = static_cast<std::int64_t>(starts.bytes() / sizeof(std::int64_t));
  if (count > 0) mask.documents = {static_cast<const std::int64_t*>(starts.data()), count, 0};
  return mask;
}

std::string mask_text(const Options& opt) {
  return detail::concat(opt.causal ? "causal" : "full",
                        opt.window_left > 0 ? detail::concat(", window_left ", opt.window_left) : "",
                        opt.window_right > 0 ? detail::concat(", window_right ", opt.window_right) : "",
                        opt.documents.empty() ? "" : ", documents " + opt.documents);
}

void synchronize(Memory memory) {
#if RINGATTN_WITH_CUDA
  if (memory == Memory::device) RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
#else
  (void)memory;
#endif
}

// The local block (or the GPU reference) on the whole sequence, in `memory`.
// With `seconds` set, also times `opt.timed` more forward+backward runs of the block.
Result one_device(const Options& opt, const Shapes& s, DType dtype, Memory memory, bool gpu_reference,
                  const std::vector<std::int64_t>& starts, const std::vector<double>& q,
                  const std::vector<double>& k, const std::vector<double>& v,
                  const std::vector<double>& g, double* seconds = nullptr) {
  const DType acc = accumulator_dtype(dtype);
  // The GPU reference writes fp32 outputs from inputs of any supported dtype.
  const DType out_dtype = gpu_reference ? DType::f32 : dtype;
  OwnedBuffer qb = upload(q, dtype, memory), kb = upload(k, dtype, memory), vb = upload(v, dtype, memory),
              gb = upload(g, dtype, memory);
  const std::size_t nq = q.size(), nk = k.size(), nv = v.size(), no = g.size(),
                    rows = s.B * s.Hq * s.S;
  OwnedBuffer ob(memory, no * dtype_size(out_dtype)), lse(memory, rows * dtype_size(acc)),
      delta(memory, rows * dtype_size(acc)), dq(memory, nq * dtype_size(acc)), dk(memory, nk * dtype_size(acc)),
      dv(memory, nv * dtype_size(acc));
  const TensorView qv = qb.view(dtype, {s.B, s.S, s.Hq, s.D}), kv = kb.view(dtype, {s.B, s.S, s.Hkv, s.D}),
                   vv = vb.view(dtype, {s.B, s.S, s.Hkv, s.Dv}), gv = gb.view(dtype, {s.B, s.S, s.Hq, s.Dv});
  const TensorView ov = ob.view(out_dtype, {s.B, s.S, s.Hq, s.Dv}), lv = lse.view(acc, {s.B, s.Hq, s.S}),
                   dl = delta.view(acc, {s.B, s.Hq, s.S}), dqv = dq.view(acc, {s.B, s.S, s.Hq, s.D}),
                   dkv = dk.view(acc, {s.B, s.S, s.Hkv, s.D}), dvv = dv.view(acc, {s.B, s.S, s.Hkv, s.Dv});
  const double scale = default_scale(s.D);
  const OwnedBuffer starts_buffer = upload_starts(starts, memory);
  const Mask mask = whole_mask(opt, starts_buffer);
  if (gpu_reference) {
    cuda::reference_forward(qv, kv, vv, mask, scale, ov, lv);
    cuda::reference_backward(qv, kv, vv, ov, lv, gv, mask, scale, dl, dqv, dkv, dvv);
  } else {
    auto run_block = [&] {
      for (OwnedBuffer* b : {&dq, &dk, &dv}) detail::fill(b->view(acc, {static_cast<std::int64_t>(b->bytes() / dtype_size(acc))}), 0.0, nullptr);
      flash_forward({qv, kv, vv, ov, lv, scale, mask, false});
      flash_backward_prepare(ov, gv, dl);
      flash_backward({qv, kv, vv, gv, lv, dl, dqv, dkv, dvv, scale, mask});
    };
    run_block();
    if (seconds != nullptr && opt.timed > 0) {
      synchronize(memory);
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < opt.timed; ++i) run_block();
      synchronize(memory);
      *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / opt.timed;
    }
  }
#if RINGATTN_WITH_CUDA
  if (memory == Memory::device) RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
#endif
  return {download(ob, out_dtype, no), download(lse, acc, rows), download(dq, acc, nq), download(dk, acc, nk),
          download(dv, acc, nv)};
}

Result fp64_oracle(const Options& opt, const Shapes& s, const std::vector<std::int64_t>& starts,
                   std::vector<double> q, std::vector<double> k, std::vector<double> v,
                   std::vector<double> g) {
  Result r;
  r.o.resize(g.size());
  r.lse.resize(s.B * s.Hq * s.S);
  r.dq.resize(q.size());
  r.dk.resize(k.size());
  r.dv.resize(v.size());
  auto view = [](std::vector<double>& d, std::initializer_list<std::int64_t> shape) {
    return TensorView::contiguous(d.data(), DType::f64, shape);
  };
  const double scale = default_scale(s.D);
  const OwnedBuffer starts_buffer = upload_starts(starts, Memory::host);
  const Mask mask = whole_mask(opt, starts_buffer);
  reference::attention_forward(view(q, {s.B, s.S, s.Hq, s.D}), view(k, {s.B, s.S, s.Hkv, s.D}),
                               view(v, {s.B, s.S, s.Hkv, s.Dv}), mask, scale, view(r.o, {s.B, s.S, s.Hq, s.Dv}),
                               view(r.lse, {s.B, s.Hq, s.S}));
  reference::attention_backward(view(q, {s.B, s.S, s.Hq, s.D}), view(k, {s.B, s.S, s.Hkv, s.D}),
                                view(v, {s.B, s.S, s.Hkv, s.Dv}), view(g, {s.B, s.S, s.Hq, s.Dv}), mask, scale,
                                view(r.dq, {s.B, s.S, s.Hq, s.D}), view(r.dk, {s.B, s.S, s.Hkv, s.D}),
                                view(r.dv, {s.B, s.S, s.Hkv, s.Dv}));
  return r;
}

struct Error2 {
  double max_abs = 0.0, relative = 0.0;
};

Error2 measure(const std::vector<double>& out, const std::vector<double>& ref) {
  Error2 e;
  double diff2 = 0.0, ref2 = 0.0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (std::isinf(ref[i]) && out[i] == ref[i]) continue;
    const double d = std::fabs(out[i] - ref[i]);
    e.max_abs = std::isnan(d) ? INFINITY : std::max(e.max_abs, d);
    diff2 += d * d;
    ref2 += std::isfinite(ref[i]) ? ref[i] * ref[i] : 0.0;
  }
  e.relative = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
  return e;
}

// Every rank's shard of a logical [B, len, H, D] (or [B, H, len]) tensor, placed at its global
// positions in the whole tensor on rank 0.
std::vector<double> gather_whole(const std::vector<double>& local, const std::vector<std::int64_t>& positions,
                                 const Shapes& s, std::int64_t heads, std::int64_t inner, bool rows_last,
                                 int rank, int size) {
  const std::int64_t len = static_cast<std::int64_t>(positions.size());
  std::vector<double> all_values(rank == 0 ? local.size() * size : 0);
  std::vector<std::int64_t> all_positions(rank == 0 ? positions.size() * size : 0);
  MPI_Gather(local.data(), static_cast<int>(local.size()), MPI_DOUBLE, all_values.data(),
             static_cast<int>(local.size()), MPI_DOUBLE, 0, MPI_COMM_WORLD);
  MPI_Gather(positions.data(), static_cast<int>(len), MPI_INT64_T, all_positions.data(), static_cast<int>(len),
             MPI_INT64_T, 0, MPI_COMM_WORLD);
  if (rank != 0) return {};
  std::vector<double> whole(local.size() * size);
  for (int r = 0; r < size; ++r) {
    const double* src = all_values.data() + r * local.size();
    for (std::int64_t b = 0; b < s.B; ++b) {
      for (std::int64_t t = 0; t < len; ++t) {
        const std::int64_t global = all_positions[r * len + t];
        for (std::int64_t h = 0; h < heads; ++h) {
          for (std::int64_t x = 0; x < inner; ++x) {
            if (rows_last) {  // [B, H, len]
              whole[(b * heads + h) * s.S + global] = src[(b * heads + h) * len + t];
            } else {
              whole[((b * s.S + global) * heads + h) * inner + x] = src[((b * len + t) * heads + h) * inner + x];
            }
          }
        }
      }
    }
  }
  return whole;
}

// The fp64 CPU oracle (else the fp32 GPU streaming reference, --backend cuda only).
bool uses_fp64_oracle(const Options& opt) {
  const double oracle_flop = 3.0 * opt.batch * opt.heads * double(opt.seq) * opt.seq *
                            double(opt.head_dim + opt.value_dim());
  return opt.oracle == "fp64" ||
         (opt.oracle == "auto" && (oracle_flop < 2e11 || opt.backend != "cuda"));
}

// The sizes of a run, for messages.
std::string size_options(const Options& opt) {
  return detail::concat("--seq ", opt.seq, " --batch ", opt.batch, " --heads ", opt.heads,
                        " --kv-heads ", opt.kv_heads > 0 ? opt.kv_heads : opt.heads, " --head-dim ",
                        opt.head_dim,
                        opt.value_dim() != opt.head_dim
                            ? detail::concat(" --v-head-dim ", opt.value_dim())
                            : std::string());
}

// The errors of options that every rank finds alike (every rank got the same command line), on
// `ranks` ranks; empty when the options can run. The single options' ranges are CLI11's checks.
std::string check_options(const Options& opt, int ranks) {
  if (opt.kv_heads > 0 && opt.heads % opt.kv_heads != 0) {
    return detail::concat("--kv-heads ", opt.kv_heads, " does not divide --heads ", opt.heads);
  }
  const std::int64_t parts = opt.layout == "zigzag" ? 2 * std::int64_t{ranks} : ranks;
  if (opt.seq % parts != 0) {
    return detail::concat("--seq ", opt.seq, " is not a multiple of ", parts, " (--layout ",
                          opt.layout, " over ", ranks, " rank", ranks == 1 ? "" : "s", ")");
  }
  if (opt.oracle == "gpu" && opt.backend != "cuda") return "--oracle gpu needs --backend cuda";
  if (!opt.documents.empty()) {
    try {
      document_starts(opt.documents, opt.seq);
    } catch (const Error& error) {
      return detail::concat("--documents: ", error.what());
    }
  }
  const bool cuda_backend = opt.backend == "cuda";
  try {
    detail::check_block_dtype(parse_dtype(opt.dtype), opt.head_dim, opt.value_dim(),
                              cuda_backend ? Memory::device : Memory::host,
                              cuda_backend ? "--backend cuda" : "--backend cpu");
  } catch (const Error& error) {
    return error.what();
  }
  return {};
}

// The checks of this rank alone, before any work: --json writable where it is written (rank 0);
// the host memory this rank's part needs, at least: its shard of q, k, v and dO in fp64 (q and k of
// --head-dim elements a head, v and dO of --v-head-dim), and on
// rank 0 the whole sequence's inputs, the ring's gathered outputs and the reference's outputs in
// fp64 (three times the inputs' size) and the fp64 oracle's scores and their gradients for one
// head (2 S^2 doubles); a shard that one MPI call can move.
std::string check_this_rank(const Options& opt, int rank, int ranks) {
  if (rank == 0) {
    if (std::string problem = tools::unwritable("--json", opt.json); !problem.empty()) {
      return problem;
    }
  }
  const double kv_heads = static_cast<double>(opt.kv_heads > 0 ? opt.kv_heads : opt.heads);
  const double token_bytes = 8.0 * opt.batch * static_cast<double>(opt.head_dim + opt.value_dim()) *
                             (opt.heads + kv_heads);
  double bytes = token_bytes * static_cast<double>(opt.seq) / ranks;
  if (rank == 0) {
    bytes += 3.0 * token_bytes * static_cast<double>(opt.seq);
    if (uses_fp64_oracle(opt)) {
      bytes += 16.0 * static_cast<double>(opt.seq) * static_cast<double>(opt.seq);
    }
  }
  const std::string shortfall = tools::host_memory_shortfall(
      size_options(opt), bytes,
      rank == 0 ? "the whole sequence's inputs, outputs and reference in fp64"
                : "this rank's shard of the inputs in fp64");
  if (!shortfall.empty()) return shortfall;
  // gather_whole moves a rank's shard of q or o (its largest tensors) in one MPI call, counted in
  // int.
  const double shard_elements = static_cast<double>(opt.batch) *
                                static_cast<double>(opt.seq / ranks) *
                                static_cast<double>(opt.heads) *
                                static_cast<double>(std::max(opt.head_dim, opt.value_dim()));
  if (shard_elements > std::numeric_limits<int>::max()) {
    return detail::concat(size_options(opt), " give each rank ", shard_elements,
                          " elements of q; one MPI call moves at most ",
                          std::numeric_limits<int>::max());
  }
  return {};
}

int run(const Options& opt) {
  const DType dtype = parse_dtype(opt.dtype);
  const bool cuda_backend = opt.backend == "cuda";
  const Memory memory = cuda_backend ? Memory::device : Memory::host;
  std::shared_ptr<Communicator> comm = cuda_backend ? nccl_world_communicator() : mpi_world_communicator();
  // The CPU backend's threads: at most this rank's part of its node.
  if (!cuda_backend) use_rank_threads(dynamic_cast<const MpiCommunicator&>(*comm));
  RingAttention ring(comm, parse_sequence_layout(opt.layout));
  const int rank = ring.rank(), size = ring.size();
  const Shapes s{opt.batch, opt.seq, opt.heads, opt.kv_heads > 0 ? opt.kv_heads : opt.heads, opt.head_dim,
                 opt.value_dim()};
  const DType acc = accumulator_dtype(dtype);
  const std::vector<std::int64_t> positions = ring.global_positions(s.S);
  const std::int64_t len = static_cast<std::int64_t>(positions.size());
  const std::vector<std::int64_t> starts =
      opt.documents.empty() ? std::vector<std::int64_t>{} : document_starts(opt.documents, s.S);
  const OwnedBuffer starts_buffer = upload_starts(starts, memory);
  const Mask mask = whole_mask(opt, starts_buffer);

  auto start = std::chrono::steady_clock::now();
  const std::vector<double> q = draw(opt, dtype, 1, s.Hq, s.D, positions),
                            k = draw(opt, dtype, 2, s.Hkv, s.D, positions),
                            v = draw(opt, dtype, 3, s.Hkv, s.Dv, positions),
                            g = draw(opt, dtype, 4, s.Hq, s.Dv, positions);
  OwnedBuffer qb = upload(q, dtype, memory), kb = upload(k, dtype, memory), vb = upload(v, dtype, memory),
              gb = upload(g, dtype, memory);
  OwnedBuffer ob(memory, g.size() * dtype_size(dtype)), lse(memory, s.B * s.Hq * len * dtype_size(acc)),
      dq(memory, q.size() * dtype_size(acc)), dk(memory, k.size() * dtype_size(acc)), dv(memory, v.size() * dtype_size(acc));
  RingForwardArgs fwd{qb.view(dtype, {s.B, len, s.Hq, s.D}), kb.view(dtype, {s.B, len, s.Hkv, s.D}),
                      vb.view(dtype, {s.B, len, s.Hkv, s.Dv}), ob.view(dtype, {s.B, len, s.Hq, s.Dv}),
                      lse.view(acc, {s.B, s.Hq, len}), default_scale(s.D), opt.causal};
  fwd.window_left = mask.window_left;
  fwd.window_right = mask.window_right;
  fwd.documents = mask.documents;
  ring.forward(fwd);
  RingBackwardArgs bwd{fwd.q, fwd.k, fwd.v, fwd.o, fwd.lse, gb.view(dtype, {s.B, len, s.Hq, s.Dv}),
                       dq.view(acc, {s.B, len, s.Hq, s.D}), dk.view(acc, {s.B, len, s.Hkv, s.D}),
                       dv.view(acc, {s.B, len, s.Hkv, s.Dv}), default_scale(s.D), opt.causal};
  bwd.window_left = mask.window_left;
  bwd.window_right = mask.window_right;
  bwd.documents = mask.documents;
  ring.backward(bwd);
#if RINGATTN_WITH_CUDA
  if (cuda_backend) RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
#endif
  const double ring_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  double ring_step_s = 0.0;
  if (opt.timed > 0) {
    comm->barrier();
    start = std::chrono::steady_clock::now();
    for (int i = 0; i < opt.timed; ++i) {
      ring.forward(fwd);
      ring.backward(bwd);
    }
    synchronize(memory);
    comm->barrier();
    ring_step_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / opt.timed;
  }

  if (rank == 0) std::fprintf(stderr, "gradcheck: ring forward+backward done (%.1f s)\n", ring_s);
  Result ring_result{
      gather_whole(download(ob, dtype, g.size()), positions, s, s.Hq, s.Dv, false, rank, size),
      gather_whole(download(lse, acc, s.B * s.Hq * len), positions, s, s.Hq, 1, true, rank, size),
      gather_whole(download(dq, acc, q.size()), positions, s, s.Hq, s.D, false, rank, size),
      gather_whole(download(dk, acc, k.size()), positions, s, s.Hkv, s.D, false, rank, size),
      gather_whole(download(dv, acc, v.size()), positions, s, s.Hkv, s.Dv, false, rank, size)};

  int verdict = 0;
  if (rank == 0) {
    std::vector<std::int64_t> all(s.S);
    for (std::int64_t t = 0; t < s.S; ++t) all[t] = t;
    const std::vector<double> fq = draw(opt, dtype, 1, s.Hq, s.D, all),
                              fk = draw(opt, dtype, 2, s.Hkv, s.D, all),
                              fv = draw(opt, dtype, 3, s.Hkv, s.Dv, all),
                              fg = draw(opt, dtype, 4, s.Hq, s.Dv, all);
    const bool use_fp64 = uses_fp64_oracle(opt);
    start = std::chrono::steady_clock::now();
    const Result ref = use_fp64 ? fp64_oracle(opt, s, starts, fq, fk, fv, fg)
                                : one_device(opt, s, DType::f32, memory, true, starts, fq, fk, fv, fg);
    const double ref_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::fprintf(stderr, "gradcheck: reference done (%.1f s)\n", ref_s);
    double single_s = 0.0;
    const Result single = one_device(opt, s, dtype, memory, false, starts, fq, fk, fv, fg, &single_s);
    if (opt.timed > 0) {
      // FlashAttention's count: 4 b h s^2 d forward (half when causal), backward 2.5x; d is the
      // mean of D (the scores) and Dv (the outputs), the count being linear in each.
      const double flop = (1.0 + kBackwardFlopFactor) *
                          (attention_forward_flops(s.B, s.Hq, s.S, s.D, opt.causal) +
                           attention_forward_flops(s.B, s.Hq, s.S, s.Dv, opt.causal)) / 2.0;
      std::printf("timing (mean of %d): ring forward+backward %.2f ms (%.0f TFLOP/s per rank), one device %.2f ms "
                  "(%.0f TFLOP/s); efficiency one-device / (%d x ring) = %.3f\n",
                  opt.timed, ring_step_s * 1e3, flop / size / ring_step_s * 1e-12, single_s * 1e3,
                  flop / single_s * 1e-12, size, ring_efficiency(single_s, size, ring_step_s));
    }

    const char* names[] = {"O", "LSE", "dQ", "dK", "dV"};
    const std::vector<double>* rings[] = {&ring_result.o, &ring_result.lse, &ring_result.dq, &ring_result.dk, &ring_result.dv};
    const std::vector<double>* singles[] = {&single.o, &single.lse, &single.dq, &single.dk, &single.dv};
    const std::vector<double>* refs[] = {&ref.o, &ref.lse, &ref.dq, &ref.dk, &ref.dv};
    const std::string v_dim = s.Dv != s.D ? detail::concat(", v_head_dim ", s.Dv) : std::string();
    std::printf("ringattn-gradcheck: %d ranks, %s layout, %s %s (exchanges by %s), seq %lld, batch %lld, "
                "heads %lld/%lld, head_dim %lld%s, %s; reference: %s (%.1f s); ring "
                "forward+backward+transfers %.1f s\n",
                size, opt.layout.c_str(), opt.backend.c_str(), opt.dtype.c_str(), comm->transport().c_str(),
                (long long)s.S, (long long)s.B,
                (long long)s.Hq, (long long)s.Hkv, (long long)s.D, v_dim.c_str(), mask_text(opt).c_str(),
                use_fp64 ? "fp64 CPU oracle" : "fp32 GPU streaming reference", ref_s, ring_s);
    std::printf("%-4s %14s %14s %14s %14s %8s  %s\n", "out", "ring max err", "1-dev max err", "ring rel err",
                "1-dev rel err", "ratio", "verdict");
    std::string rows;
    for (int i = 0; i < 5; ++i) {
      const Error2 er = measure(*rings[i], *refs[i]), es = measure(*singles[i], *refs[i]);
      const double ratio = es.relative > 0 ? er.relative / es.relative : (er.relative == 0 ? 1.0 : INFINITY);
      // The running LSE is rounded to fp32 at each of the N - 1 merges (the precision policy):
      // it may gain about one fp32 rounding per merge, random-walk style, beyond the 1.1x.
      const double lse_allowance = i == 1 ? std::sqrt(size - 1.0) * 0x1p-24 : 0.0;
      const bool ok = dtype == DType::f64 ? er.relative < 1e-12
                                          : er.relative <= 1.1 * es.relative + lse_allowance + 1e-15;
      verdict |= ok ? 0 : 1;
      std::printf("%-4s %14.4e %14.4e %14.4e %14.4e %8.3f  %s\n", names[i], er.max_abs, es.max_abs, er.relative,
                  es.relative, ratio, ok ? "ok" : "FAIL");
      rows += std::string(i ? ",\n" : "") + "    {\"output\": \"" + names[i] + "\", \"ring_max_abs\": " +
              std::to_string(er.max_abs) + ", \"single_max_abs\": " + std::to_string(es.max_abs) +
              ", \"ring_relative\": " + std::to_string(er.relative) + ", \"single_relative\": " +
              std::to_string(es.relative) + ", \"passed\": " + (ok ? "true" : "false") + "}";
    }
    std::printf("%s\n", verdict == 0 ? "PASS" : "FAIL");
    if (!opt.json.empty()) {
      std::ofstream out(opt.json);
      out << "{\n  \"tool\": \"ringattn-gradcheck\", \"version\": \"" << RINGATTN_VERSION_STRING
          << "\",\n  \"ranks\": " << size << ", \"layout\": \"" << opt.layout << "\", \"backend\": \"" << opt.backend
          << "\", \"exchanges\": \"" << comm->transport() << "\", \"dtype\": \"" << opt.dtype << "\", \"seq\": " << s.S << ", \"batch\": " << s.B
          << ", \"heads\": " << s.Hq << ", \"kv_heads\": " << s.Hkv << ", \"head_dim\": " << s.D
          << ", \"v_head_dim\": " << s.Dv
          << ", \"causal\": " << (opt.causal ? "true" : "false") << ", \"window_left\": " << opt.window_left
          << ", \"window_right\": " << opt.window_right << ", \"documents\": \"" << opt.documents
          << "\",\n  \"reference\": \""
          << (use_fp64 ? "fp64" : "gpu-fp32") << "\", \"passed\": " << (verdict == 0 ? "true" : "false")
          << ",\n  \"rows\": [\n" << rows << "\n  ]\n}\n";
      if (!out.flush()) {
        std::fprintf(stderr, "%sringattn-gradcheck: could not write --json '%s'\n",
                     size > 1 ? "rank 0: " : "", opt.json.c_str());
        verdict = 2;
      }
    }
  }
  MPI_Bcast(&verdict, 1, MPI_INT, 0, MPI_COMM_WORLD);
  return verdict;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ringattn-gradcheck: ring attention against a reference on the whole sequence"};
  Options opt;
  app.add_option("--seq", opt.seq, "total sequence length")->check(tools::whole_number(1));
  app.add_option("--batch", opt.batch, "batch")->check(tools::whole_number(1));
  app.add_option("--heads", opt.heads, "query heads")->check(tools::whole_number(1));
  app.add_option("--kv-heads", opt.kv_heads, "key/value heads, dividing --heads (default: --heads)")
      ->check(tools::whole_number(1));
  app.add_option("--head-dim", opt.head_dim, "head dimension of q and k")
      ->check(tools::whole_number(1));
  app.add_option("--v-head-dim", opt.v_head_dim,
                 "head dimension of v and o (default: --head-dim; another one on --backend cpu only)")
      ->check(tools::whole_number(1));
  app.add_flag("--causal", opt.causal, "causal mask");
  app.add_option("--window-left", opt.window_left,
                 "sliding window: a query sees keys fewer than this many positions back (0: none)")
      ->check(tools::whole_number(0));
  app.add_option("--window-right", opt.window_right,
                 "sliding window: ... and fewer than this many positions ahead (0: none)")
      ->check(tools::whole_number(0));
  app.add_option("--documents", opt.documents,
                 "packed documents: lognormal:MEAN:SEED[:LONG] (log-normal lengths of mean MEAN "
                 "tokens, sigma 1, and one of LONG tokens) or file:PATH (the starts)");
  app.add_option("--layout", opt.layout, "zigzag or contiguous")->check(CLI::IsMember({"zigzag", "contiguous"}));
  app.add_option("--dtype", opt.dtype, "f32, f64 (cpu); bf16, f16 (cuda)")->check(CLI::IsMember({"f32", "f64", "bf16", "f16"}));
  app.add_option("--backend", opt.backend, "cpu (MPI) or cuda (NCCL)")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--oracle", opt.oracle, "auto, fp64 (CPU) or gpu (fp32 streaming)")->check(CLI::IsMember({"auto", "fp64", "gpu"}));
  app.add_option("--seed", opt.seed, "random seed")->check(tools::seed_number());
  app.add_option("--json", opt.json, "write the result as JSON (rank 0)");
  app.add_option("--time", opt.timed,
                 "also time this many forward+backward runs of the ring and of one device")
      ->check(tools::whole_number(0, std::numeric_limits<int>::max()));
  // Parsed before MPI starts; the ranks then agree on it, so that none goes on alone.
  const tools::CommandLine line = tools::parse_command_line(app, argc, argv);
  tools::MpiSession session("ringattn-gradcheck");
  if (const int code = session.agree_on(line); code >= 0) return code;
  if (const std::string problem = check_options(opt, session.size()); !problem.empty()) {
    session.report(problem);
    return 2;
  }
  if (!session.no_rank_failed(check_this_rank(opt, session.rank(), session.size()))) return 2;
  try {
    return run(opt);
  } catch (const CollectiveError& e) {
    // Every rank of the world threw it alike: each says so and all end normally.
    if (e.ranks() == session.size()) {
      session.report(e.what());
      return 2;
    }
    session.fail_alone(e.what());
  } catch (const std::bad_alloc&) {
    session.fail_alone("out of host memory (std::bad_alloc) for " + size_options(opt));
  } catch (const std::length_error&) {
    session.fail_alone("a buffer too large to allocate (std::length_error) for " +
                       size_options(opt));
  } catch (const std::exception& e) {
    session.fail_alone(e.what());
  }
  return 2;
}
