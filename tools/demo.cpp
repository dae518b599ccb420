// ringattn-demo: the main job until the trainer lands. It runs the CPU flash block forward and
// backward on a long causal GQA sequence, checks every output against the fp64 oracle and prints
// the errors and the throughput.
#include <CLI/CLI.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <new>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "ringattn/attention.hpp"
#include "ringattn/error.hpp"
#include "ringattn/runtime.hpp"
#include "tools/cli_checks.hpp"

namespace {

using ringattn::DType;
using ringattn::TensorView;

struct Problem {
  std::int64_t batch = 1, seq = 4096, q_heads = 8, kv_heads = 2, head_dim = 64;
  bool causal = true;
};

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// max |a - b| / max |b|: the error relative to the output's own scale.
double relative_max_error(const std::vector<float>& out, const std::vector<double>& ref) {
  double diff = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    diff = std::max(diff, std::fabs(out[i] - ref[i]));
    scale = std::max(scale, std::fabs(ref[i]));
  }
  return scale > 0 ? diff / scale : diff;
}

std::string size_options(const Problem& p) {
  return ringattn::detail::concat("--seq ", p.seq, " --heads ", p.q_heads, " --kv-heads ",
                                  p.kv_heads, " --head-dim ", p.head_dim);
}

// The host memory the run needs: q, dO, O and dQ (and k, v, dK, dV) in fp32 and fp64 (48 bytes an
// element), LSE and delta in fp32 and LSE in fp64, and the oracle's scores and their gradients
// for one head (2 S^2 doubles). In double, which no product of the options overflows.
double host_bytes(const Problem& p) {
  const double tokens = static_cast<double>(p.batch) * static_cast<double>(p.seq);
  const double d = static_cast<double>(p.head_dim);
  return 48.0 * tokens * d * (static_cast<double>(p.q_heads) + static_cast<double>(p.kv_heads)) +
         16.0 * tokens * static_cast<double>(p.q_heads) +
         16.0 * static_cast<double>(p.seq) * static_cast<double>(p.seq);
}

}  // namespace

int main(int argc, char** argv) {
  namespace tools = ringattn::tools;
  CLI::App app{"ringattn demo: the CPU flash block against the fp64 oracle on a long sequence"};
  Problem p;
  unsigned seed = std::random_device{}();
  app.add_option("--seq", p.seq, "sequence length")->check(tools::whole_number(1));
  app.add_option("--heads", p.q_heads, "query heads")->check(tools::whole_number(1));
  app.add_option("--kv-heads", p.kv_heads, "key/value heads, dividing --heads")
      ->check(tools::whole_number(1));
  app.add_option("--head-dim", p.head_dim, "head dimension")->check(tools::whole_number(1));
  app.add_option("--seed", seed, "random seed (default: random)")
      ->check(tools::whole_number(0, std::numeric_limits<unsigned>::max()));
  const tools::CommandLine line = tools::parse_command_line(app, argc, argv);
  if (line.exit_code >= 0) return tools::finish_command_line(line, "ringattn-demo");
  if (p.q_heads % p.kv_heads != 0) {
    std::fprintf(stderr, "ringattn-demo: --kv-heads %lld does not divide --heads %lld\n",
                 static_cast<long long>(p.kv_heads), static_cast<long long>(p.q_heads));
    return 2;
  }
  if (const std::string problem = tools::host_memory_shortfall(
          size_options(p), host_bytes(p),
          "the inputs and outputs in fp32 and fp64 and the oracle's scores");
      !problem.empty()) {
    std::fprintf(stderr, "ringattn-demo: %s\n", problem.c_str());
    return 2;
  }

  try {
    const std::int64_t q_n = p.batch * p.seq * p.q_heads * p.head_dim;
    const std::int64_t kv_n = p.batch * p.seq * p.kv_heads * p.head_dim;
    const std::int64_t rows = p.batch * p.q_heads * p.seq;
    std::mt19937_64 rng(seed);
    std::normal_distribution<double> normal;
    auto random_pair = [&](std::int64_t n) {
      std::vector<float> f(n);
      std::vector<double> d(n);
      for (std::int64_t i = 0; i < n; ++i) d[i] = f[i] = static_cast<float>(normal(rng));
      return std::pair{f, d};
    };
    auto [q32, q64] = random_pair(q_n);
    auto [k32, k64] = random_pair(kv_n);
    auto [v32, v64] = random_pair(kv_n);
    auto [g32, g64] = random_pair(q_n);

    auto view = [&](auto& vec, DType dtype, std::int64_t heads) {
      return TensorView::contiguous(vec.data(), dtype, {p.batch, p.seq, heads, p.head_dim});
    };
    auto stats = [&](auto& vec, DType dtype) {
      return TensorView::contiguous(vec.data(), dtype, {p.batch, p.q_heads, p.seq});
    };
    const double scale = ringattn::default_scale(p.head_dim);
    const ringattn::Mask mask{p.causal, 0, 0};

    std::printf("ringattn demo: CPU flash block vs fp64 oracle (seed %u)\n", seed);
    std::printf("  shape   batch %lld  seq %lld  heads %lld/%lld (q/kv)  head_dim %lld  %s\n",
                static_cast<long long>(p.batch), static_cast<long long>(p.seq),
                static_cast<long long>(p.q_heads), static_cast<long long>(p.kv_heads),
                static_cast<long long>(p.head_dim), p.causal ? "causal" : "full");
    std::printf("  threads %d   CUDA GPUs visible: %d\n", ringattn::cpu::num_threads(),
                ringattn::cuda_device_count());

    std::vector<float> o32(q_n), lse32(rows), delta32(rows), dq32(q_n), dk32(kv_n), dv32(kv_n);
    ringattn::ForwardArgs fwd{view(q32, DType::f32, p.q_heads), view(k32, DType::f32, p.kv_heads),
                              view(v32, DType::f32, p.kv_heads), view(o32, DType::f32, p.q_heads),
                              stats(lse32, DType::f32), scale, mask, false};
    auto start = std::chrono::steady_clock::now();
    ringattn::cpu::flash_forward(fwd);
    const double forward_s = seconds_since(start);

    start = std::chrono::steady_clock::now();
    ringattn::cpu::flash_backward_prepare(fwd.o, view(g32, DType::f32, p.q_heads),
                                          stats(delta32, DType::f32));
    ringattn::BackwardArgs bwd{fwd.q, fwd.k, fwd.v, view(g32, DType::f32, p.q_heads), fwd.lse,
                               stats(delta32, DType::f32), view(dq32, DType::f32, p.q_heads),
                               view(dk32, DType::f32, p.kv_heads),
                               view(dv32, DType::f32, p.kv_heads), scale, mask};
    ringattn::cpu::flash_backward(bwd);
    const double backward_s = seconds_since(start);

    std::vector<double> o64(q_n), lse64(rows), dq64(q_n), dk64(kv_n), dv64(kv_n);
    start = std::chrono::steady_clock::now();
    ringattn::reference::attention_forward(
        view(q64, DType::f64, p.q_heads), view(k64, DType::f64, p.kv_heads),
        view(v64, DType::f64, p.kv_heads), mask, scale, view(o64, DType::f64, p.q_heads),
        stats(lse64, DType::f64));
    ringattn::reference::attention_backward(
        view(q64, DType::f64, p.q_heads), view(k64, DType::f64, p.kv_heads),
        view(v64, DType::f64, p.kv_heads), view(g64, DType::f64, p.q_heads), mask, scale,
        view(dq64, DType::f64, p.q_heads), view(dk64, DType::f64, p.kv_heads),
        view(dv64, DType::f64, p.kv_heads));
    const double oracle_s = seconds_since(start);

    // FlashAttention's count: 4 b h s^2 d forward, halved when causal; backward 2.5x forward.
    const double forward_flop = 4.0 * p.batch * p.q_heads * double(p.seq) * p.seq * p.head_dim *
                                (p.causal ? 0.5 : 1.0);
    const struct {
      const char* name;
      double error;
    } errors[] = {{"O", relative_max_error(o32, o64)},     {"LSE", relative_max_error(lse32, lse64)},
                  {"dQ", relative_max_error(dq32, dq64)},  {"dK", relative_max_error(dk32, dk64)},
                  {"dV", relative_max_error(dv32, dv64)}};
    std::printf("\n  %-6s %s\n", "output", "max|f32 flash - f64 oracle| / max|oracle|");
    bool ok = true;
    for (const auto& e : errors) {
      std::printf("  %-6s %.3e\n", e.name, e.error);
      ok = ok && e.error < 1e-4;
    }
    std::printf("\n  %-9s %9s %12s\n", "pass", "seconds", "GFLOP/s");
    std::printf("  %-9s %9.3f %12.1f\n", "forward", forward_s, forward_flop / forward_s * 1e-9);
    std::printf("  %-9s %9.3f %12.1f\n", "backward", backward_s,
                2.5 * forward_flop / backward_s * 1e-9);
    std::printf("  %-9s %9.3f   (fp64, materialised scores)\n", "oracle", oracle_s);
    std::printf("\n%s\n", ok ? "PASS: every output within 1e-4 of the oracle"
                             : "FAIL: an output is further than 1e-4 from the oracle");
    return ok ? 0 : 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "ringattn-demo: out of host memory (std::bad_alloc) for %s\n",
                 size_options(p).c_str());
  } catch (const std::length_error&) {
    std::fprintf(stderr,
                 "ringattn-demo: a buffer too large to allocate (std::length_error) for %s\n",
                 size_options(p).c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ringattn-demo: %s\n", e.what());
  }
  return 2;
}
