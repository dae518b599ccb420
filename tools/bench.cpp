// ringattn-bench: timings of ringattn's kernels on this GPU.
//
//   ringattn-bench attention [--seqlens 512,1024,...] [--head-dims 64,128] [--json FILE]
//
// attention: the CUDA local block, forward and backward, on FlashAttention's benchmark grid
// (bf16, batch = 16384 / seq, hidden 2048 so heads = 2048 / head_dim, causal and not). FLOPs are
// counted as FlashAttention counts them: 4 b h s^2 d forward, halved when causal, backward 2.5x.
// The backward time includes zeroing the fp32 gradient buffers and the rowsum(dO * O) pass.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "ringattn/attention.hpp"
#include "ringattn/config.h"
#include "ringattn/error.hpp"
#include "ringattn/runtime.hpp"

#if RINGATTN_WITH_CUDA
#include <cuda_runtime.h>

#include "src/cuda/device_buffer.hpp"
#endif

namespace {

using ringattn::DType;
using ringattn::Memory;
using ringattn::TensorView;

struct AttentionRow {
  int seq, batch, heads, head_dim;
  bool causal;
  double forward_ms, backward_ms, forward_tflops, backward_tflops, total_tflops;
  double workspace_mib;
};

#if RINGATTN_WITH_CUDA

// Median time of `body` in milliseconds over `repeats` runs after `warmup` runs, by CUDA events.
template <typename Body>
double median_ms(Body&& body, int warmup, int repeats) {
  for (int i = 0; i < warmup; ++i) body();
  std::vector<float> times(repeats);
  ringattn::CudaEvent start(cudaEventDefault), stop(cudaEventDefault);
  for (int i = 0; i < repeats; ++i) {
    start.record(nullptr);
    body();
    stop.record(nullptr);
    RINGATTN_CUDA_CHECK(cudaEventSynchronize(stop.get()));
    RINGATTN_CUDA_CHECK(cudaEventElapsedTime(&times[i], start.get(), stop.get()));
  }
  std::nth_element(times.begin(), times.begin() + repeats / 2, times.end());
  return times[repeats / 2];
}

void fill_random_bf16(ringattn::DeviceBuffer& buffer, std::size_t count, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  std::vector<std::uint16_t> host(count);
  for (auto& value : host) value = ringattn::float_to_bf16(normal(rng));
  RINGATTN_CUDA_CHECK(cudaMemcpy(buffer.data(), host.data(), count * 2, cudaMemcpyHostToDevice));
}

AttentionRow bench_attention(int seq, int head_dim, bool causal) {
  const int batch = std::max(1, 16384 / seq), heads = 2048 / head_dim;
  const std::size_t n = static_cast<std::size_t>(batch) * seq * heads * head_dim;
  const std::size_t rows = static_cast<std::size_t>(batch) * heads * seq;
  std::mt19937 rng(seq * 131 + head_dim);
  ringattn::DeviceBuffer q(n * 2), k(n * 2), v(n * 2), o(n * 2), dout(n * 2);
  ringattn::DeviceBuffer lse(rows * 4), delta(rows * 4), dq(n * 4), dk(n * 4), dv(n * 4);
  fill_random_bf16(q, n, rng);
  fill_random_bf16(k, n, rng);
  fill_random_bf16(v, n, rng);
  fill_random_bf16(dout, n, rng);
  auto view = [&](const ringattn::DeviceBuffer& b, DType dtype) {
    return TensorView::contiguous(b.data(), dtype, {batch, seq, heads, head_dim}, Memory::device);
  };
  auto stats = [&](const ringattn::DeviceBuffer& b) {
    return TensorView::contiguous(b.data(), DType::f32, {batch, heads, seq}, Memory::device);
  };
  const double scale = ringattn::default_scale(head_dim);
  const ringattn::Mask mask{causal, 0, 0};
  const ringattn::ForwardArgs fwd{view(q, DType::bf16), view(k, DType::bf16), view(v, DType::bf16),
                                  view(o, DType::bf16), stats(lse), scale, mask, false};
  const ringattn::BackwardArgs bwd{fwd.q, fwd.k, fwd.v, view(dout, DType::bf16), fwd.lse,
                                   stats(delta), view(dq, DType::f32), view(dk, DType::f32),
                                   view(dv, DType::f32), scale, mask, false};
  const int repeats = seq >= 8192 ? 10 : 20;
  AttentionRow row{seq, batch, heads, head_dim, causal};
  row.forward_ms = median_ms([&] { ringattn::cuda::flash_forward(fwd); }, 3, repeats);
  row.backward_ms = median_ms(
      [&] {
        RINGATTN_CUDA_CHECK(cudaMemsetAsync(dq.data(), 0, dq.bytes()));
        RINGATTN_CUDA_CHECK(cudaMemsetAsync(dk.data(), 0, dk.bytes()));
        RINGATTN_CUDA_CHECK(cudaMemsetAsync(dv.data(), 0, dv.bytes()));
        ringattn::cuda::flash_backward_prepare(fwd.o, bwd.dout, bwd.delta);
        ringattn::cuda::flash_backward(bwd);
      },
      3, repeats);
  const double flop = 4.0 * batch * heads * double(seq) * seq * head_dim * (causal ? 0.5 : 1.0);
  row.forward_tflops = flop / (row.forward_ms * 1e-3) * 1e-12;
  row.backward_tflops = 2.5 * flop / (row.backward_ms * 1e-3) * 1e-12;
  row.total_tflops = 3.5 * flop / ((row.forward_ms + row.backward_ms) * 1e-3) * 1e-12;
  // Beyond inputs and outputs the block needs LSE and delta (fp32 per row); the fp32 gradient
  // accumulators are the outputs of its add-into contract.
  row.workspace_mib = double(lse.bytes() + delta.bytes()) / (1 << 20);
  return row;
}
#endif

std::vector<int> parse_list(const std::string& text) {
  std::vector<int> values;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) values.push_back(std::stoi(item));
  return values;
}

int run_attention(const std::string& seqlens, const std::string& head_dims, const std::string& json) {
#if RINGATTN_WITH_CUDA
  if (ringattn::cuda_device_count() == 0) {
    std::fprintf(stderr, "ringattn-bench attention: no CUDA GPU visible\n");
    return 2;
  }
  cudaDeviceProp prop{};
  RINGATTN_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::vector<AttentionRow> rows;
  std::printf("%-5s %-6s %6s %5s %5s %10s %10s %9s %9s %9s\n", "d", "mask", "seq", "batch",
              "heads", "fwd ms", "bwd ms", "fwd TF/s", "bwd TF/s", "f+b TF/s");
  for (int d : parse_list(head_dims)) {
    for (bool causal : {false, true}) {
      for (int seq : parse_list(seqlens)) {
        const AttentionRow r = bench_attention(seq, d, causal);
        rows.push_back(r);
        std::printf("%-5d %-6s %6d %5d %5d %10.3f %10.3f %9.1f %9.1f %9.1f\n", d,
                    causal ? "causal" : "none", seq, r.batch, r.heads, r.forward_ms, r.backward_ms,
                    r.forward_tflops, r.backward_tflops, r.total_tflops);
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
      out << "    {\"head_dim\": " << r.head_dim << ", \"causal\": " << (r.causal ? "true" : "false")
          << ", \"seq\": " << r.seq << ", \"batch\": " << r.batch << ", \"heads\": " << r.heads
          << ", \"forward_ms\": " << r.forward_ms << ", \"backward_ms\": " << r.backward_ms
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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ringattn-bench: timings of ringattn's kernels"};
  app.require_subcommand(1);
  auto* attention = app.add_subcommand("attention", "the CUDA local block, forward and backward");
  std::string seqlens = "512,1024,2048,4096,8192,16384", head_dims = "64,128", json;
  attention->add_option("--seqlens", seqlens, "comma-separated sequence lengths");
  attention->add_option("--head-dims", head_dims, "comma-separated head dims (64, 128)");
  attention->add_option("--json", json, "write the rows as JSON to this file");
  CLI11_PARSE(app, argc, argv);
  try {
    if (attention->parsed()) return run_attention(seqlens, head_dims, json);
  } catch (const ringattn::Error& e) {
    std::fprintf(stderr, "ringattn-bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
