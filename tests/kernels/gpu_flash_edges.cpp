// The CUDA flash block on scores laid out to reach every path of its online softmax by construction
// (TESTING.md's adversarial inputs), not by the luck of a random draw: score jumps placed at, just
// before and just after key-tile edges, jumps just below, at and above each threshold the forwards
// use (a maximum kept stale up to 8 log2 units, partial row sums up to 2^15, a sum scaled up to
// 2^100, exp2 overflowing at 128), jumps of 2^k log2 units for k up to 14, staircases rising or
// falling at every tile, a row whose maximum is its last tile or its last key, scores of +-1e4,
// equal scores, rows with nothing visible and rows that see one key. Each case runs 32 seeds in one
// process, at every head dim of the build and at 192/128 (V of its own width), on every kernel path
// a Hopper build has (the Hopper family with dQ by TMA reductions, then by atomics, then the sm_80
// family), forward, combine and backward (deterministic or not; dK and dV added, overwritten, or
// rounded to the input dtype), against the fp64 oracle with the FlashAttention criterion plus,
// element by element, what the algorithm itself costs where the naive baseline is exact by luck
// (algorithm_allowances below). Two ctests, each half of the cases:
// ringattn-gpu-shards: 2
//
// The scores are exact on both sides. Row i of head h has Q = a * u on 16 random columns (u = +-1)
// and noise on other columns; key j has K = b_j * u / 16 on the same 16 columns and noise on yet
// other ones, so Q K^T = a * b_j exactly in fp32 (every nonzero product is +-a b_j / 16), and with
// the softmax scale 1/2 every score a b_j / 2 is representable in the input dtype. The naive
// low-precision baseline then rounds no score, so its error, and the criterion's bound, is only
// what rounding P and O costs: a wrong tile, a lost maximum or an infinite LSE cannot hide in it.
// The row factor a is drawn from {1, -1, 2, -2, 1/2, -1/2, 1/4, 0}: a negative one turns rising
// maxima into falling ones, 0 gives a row of equal scores, and the rows of one warp differ.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "ringattn/attention.hpp"
#include "ringattn/config.h"
#include "tests/common/attention_testing.hpp"
#include "tests/common/gpu.hpp"
#include "tests/common/head_dims.hpp"
#include "tests/common/low_precision_attention.hpp"

#if RINGATTN_WITH_CUDA
#include <cuda_runtime.h>

#include "src/cuda/device_buffer.hpp"
#include "src/thread_pool.hpp"
#include "tests/common/flash_device_problem.hpp"

namespace ringattn::test {
namespace {

constexpr double kLog2e = 1.4426950408889634;
constexpr double kSoftmaxScale = 0.5;
constexpr int kSeeds = 32;
constexpr int kSupport = 16;  // the columns that carry the score

// How the score levels lie along the keys (in log2 units of the scaled score, for a = 1).
enum class Layout {
  kStep,       // 0 before the edge, J from the edge on
  kStaircase,  // J more at every edge of `tile` keys
  kLastTile,   // -J before the last tile of `tile` keys, 0 in it
  kLastKey,    // -J everywhere but one key near the end
  kHuge,       // uniform in [-1e4, 1e4] (natural units)
  kFlat,       // one value for every key: equal scores
};

struct Family {
  const char* name;
  Layout layout;
  std::vector<double> jumps;  // log2 units; a seed takes one
};

const std::vector<Family>& families() {
  static const std::vector<Family> list = {
      {"stale_max", Layout::kStep, {8.0 * (1 - 0x1p-5), 8.0, 8.0 * (1 + 0x1p-5)}},
      {"partial_sum", Layout::kStep, {10.0, 15.0 * (1 - 0x1p-5), 15.0, 15.0 * (1 + 0x1p-5), 16.0}},
      {"overflow", Layout::kStep, {95.0, 100.0, 127.0, 128.0, 129.0, 160.0}},
      {"powers", Layout::kStep, {}},  // 2^k, k = seed % 15
      {"staircase", Layout::kStaircase, {4.0, 9.0, 16.0, 20.0, 100.0, 130.0}},
      {"last_tile", Layout::kLastTile, {16.0, 200.0, 2000.0}},
      {"last_key", Layout::kLastKey, {16.0, 200.0, 16384.0}},
      {"huge", Layout::kHuge, {0.0}},
      {"flat", Layout::kFlat, {0.0}},
  };
  return list;
}

struct EdgeCase {
  int family;
  DType dtype;
  std::int64_t head_dim;
  std::int64_t v_head_dim;  // of V, O, dO and dV
};

std::string edge_case_name(const ::testing::TestParamInfo<EdgeCase>& info) {
  const EdgeCase& e = info.param;
  std::string name = std::string(families()[e.family].name) + "_" +
                     std::string(dtype_name(e.dtype)) + "_d" + std::to_string(e.head_dim);
  if (e.v_head_dim != e.head_dim) name += std::string("_v") + std::to_string(e.v_head_dim);
  return name;
}

// One seed's problem: its shape and mask, the inputs laid out as above, and a line that names it.
struct Drawn {
  Case c;
  std::array<std::vector<double>, 4> inputs;
  std::int64_t edge;
  std::string what;
};

Drawn draw(const EdgeCase& e, int seed) {
  const Family& family = families()[e.family];
  std::mt19937_64 rng = make_rng(static_cast<std::uint64_t>(e.family * 1000 + seed));
  const auto pick = [&](auto const& options) { return options[rng() % options.size()]; };

  const std::int64_t tile = pick(std::array<std::int64_t, 3>{32, 64, 128});
  const std::int64_t edge = tile * (1 + static_cast<std::int64_t>(rng() % 2)) +
                            pick(std::array<std::int64_t, 3>{-1, 0, 1});
  const std::int64_t k_len = edge + 1 + static_cast<std::int64_t>(rng() % 200);
  const std::int64_t q_len = pick(std::array<std::int64_t, 4>{1, 17, 64, 130});
  const bool gqa = seed % 2 == 1;
  Case c{e.dtype, 1, q_len, k_len, 2, gqa ? 1 : 2, e.head_dim, seed % 4 != 0};
  c.v_head_dim = e.v_head_dim;
  c.softmax_scale = kSoftmaxScale;
  // Causal: rows ending at the last key, rows from the first key (row 0 sees only key 0), or a
  // third of the rows before every key (nothing visible).
  if (seed % 4 == 1) c.q_start = k_len - q_len;
  if (seed % 4 == 3) c.k_start = q_len / 3 + 1;
  const double jump = family.jumps.empty() ? std::ldexp(1.0, seed % 15) : pick(family.jumps);

  // The key levels in natural units of the scaled score, each with a jitter of up to half a unit.
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::vector<double> level(k_len);
  const std::int64_t last_key = k_len - 1 - static_cast<std::int64_t>(rng() % 3);
  const double flat = 200.0 * unit(rng) - 100.0;
  for (std::int64_t j = 0; j < k_len; ++j) {
    double log2_level = 0.0;
    switch (family.layout) {
      case Layout::kStep: log2_level = j >= edge ? jump : 0.0; break;
      case Layout::kStaircase: log2_level = jump * static_cast<double>(j / tile); break;
      case Layout::kLastTile: log2_level = j >= (k_len - 1) / tile * tile ? 0.0 : -jump; break;
      case Layout::kLastKey: log2_level = j == last_key ? 0.0 : -jump; break;
      case Layout::kHuge: log2_level = (2e4 * unit(rng) - 1e4) * kLog2e; break;
      case Layout::kFlat: log2_level = flat * kLog2e; break;
    }
    const double jitter = family.layout == Layout::kFlat ? 0.0 : -0.5 * unit(rng);
    // On a grid of 1/16: b below is then 0 or at least 1/8, and b / 16 a normal number of the
    // dtype, so K holds it exactly.
    level[j] = std::round((log2_level / kLog2e + jitter) * 16.0) / 16.0;
  }

  // Columns: the 16 that carry the score, then Q's noise columns, then K's.
  const std::int64_t D = e.head_dim, Hq = c.q_heads, Hkv = c.kv_heads;
  std::vector<std::int64_t> columns(D);
  for (std::int64_t x = 0; x < D; ++x) columns[x] = x;
  std::shuffle(columns.begin(), columns.end(), rng);
  std::vector<double> sign(kSupport);
  for (double& s : sign) s = rng() % 2 ? 1.0 : -1.0;
  const std::int64_t q_noise_end = kSupport + (D - kSupport) / 2;
  std::normal_distribution<double> normal;

  Drawn d{c, {}, edge, {}};
  auto& [q, k, v, dout] = d.inputs;
  q.assign(q_len * Hq * D, 0.0);
  k.assign(k_len * Hkv * D, 0.0);
  const double factors[] = {1.0, 1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 0.25, 0.0};
  for (std::int64_t i = 0; i < q_len; ++i) {
    for (std::int64_t h = 0; h < Hq; ++h) {
      double* row = &q[(i * Hq + h) * D];
      const double a = factors[rng() % std::size(factors)];
      for (int x = 0; x < kSupport; ++x) row[columns[x]] = a * sign[x];
      for (std::int64_t x = kSupport; x < q_noise_end; ++x) {
        row[columns[x]] = round_to(e.dtype, normal(rng));
      }
    }
  }
  for (std::int64_t j = 0; j < k_len; ++j) {
    // b / 2 is the score of a row with a = 1; b is rounded to the dtype, so every a b / 2 is too.
    const double b = round_to(e.dtype, level[j] / kSoftmaxScale);
    for (std::int64_t g = 0; g < Hkv; ++g) {
      double* row = &k[(j * Hkv + g) * D];
      for (int x = 0; x < kSupport; ++x) row[columns[x]] = b * sign[x] / kSupport;
      for (std::int64_t x = q_noise_end; x < D; ++x) row[columns[x]] = round_to(e.dtype, normal(rng));
    }
  }
  v = random_rounded(e.dtype, k_len * Hkv * e.v_head_dim, rng, 1.0);
  dout = random_rounded(e.dtype, q_len * Hq * e.v_head_dim, rng, 1.0);
  d.what = std::string(family.name) + " seed " + std::to_string(seed) + ": jump " +
           std::to_string(jump) + " log2 units, edge " + std::to_string(edge) + " (tile " +
           std::to_string(tile) + "), " + case_name({c, 0}) + ", q_start " +
           std::to_string(c.q_start) + ", k_start " + std::to_string(c.k_start);
  return d;
}

// The kernel paths of this build and GPU, chosen through the environment the dispatch reads on
// every call. On a GPU without the Hopper family all three run the sm_80 one.
struct KernelPath {
  const char* name;
  const char* family;     // RINGATTN_FLASH_FAMILY, or nullptr to leave it unset
  const char* dq_atomic;  // RINGATTN_DQ_ATOMIC, or nullptr
};
constexpr KernelPath kPaths[] = {{"default family, dQ by TMA reductions", nullptr, nullptr},
                                 {"default family, dQ by atomics", nullptr, "1"},
                                 {"sm_80 family", "sm80", nullptr}};

void set_or_unset(const char* name, const char* value) {
  if (value != nullptr) {
    setenv(name, value, 1);
  } else {
    unsetenv(name);
  }
}

// Restores the variables the paths set, whatever a test's outcome.
struct PathEnvironment {
  ~PathEnvironment() {
    unsetenv("RINGATTN_FLASH_FAMILY");
    unsetenv("RINGATTN_DQ_ATOMIC");
  }
  void use(const KernelPath& path) {
    set_or_unset("RINGATTN_FLASH_FAMILY", path.family);
    set_or_unset("RINGATTN_DQ_ATOMIC", path.dq_atomic);
  }
};

// What the FlashAttention algorithm may lose beyond the naive baseline of the criterion, element
// by element, on top of its bound (2 max|low - ref| + 1e-5). The baseline subtracts each row's true
// maximum (its largest probability is exactly 1) and forms the softmax backward from its own P, so
// on rows of one key or of equal scores its error can be far below one rounding. Every kernel of
// this algorithm (u = 2^-8 for bf16, 2^-11 for f16, the unit roundoff):
// - rounds its unnormalised probabilities to the dtype for P V and divides by the fp32 sum of the
//   unrounded ones: u (P|V|) in O, and another u |O| where O is written in the dtype (plus half
//   the subnormals' spacing);
// - forms the LSE in fp32 from a maximum (shifted by logarithms where a row's maximum moved by
//   scaling) plus a logarithm: a few roundings of |LSE|, 2^-21 max|LSE| (8 of them at 2^-24);
// - recomputes P from that LSE in the backward, a relative error eps = 2^-20 (|LSE| + max|s|) that
//   reaches 2% at scores of 2e4 (every fp32-LSE backward has it): eps P |dO| in dV;
// - takes D = rowsum(dO O) from the O it wrote, off by dD = sum |dO| (O's allowance) plus its fp32
//   sum, so dS = P (dP - D) is off by P (dD + eps |dP - D|), which dQ and dK carry through
//   scale |K| and scale |Q|;
// - rounds dK and dV once more when they are written in the dtype: u |dK|, u |dV| (plus half the
//   subnormals' spacing, for values below the smallest normal).
struct Allowances {
  std::vector<double> o, combined_o, dq, dk, dv;
  double lse = 0.0;
};

Allowances algorithm_allowances(const DeviceProblem& problem, const AttentionResult& ref,
                                bool rounded_keys) {
  const Case& c = problem.c;  // batch 1
  const std::int64_t Sq = c.q_len, Sk = c.k_len, Hq = c.q_heads, Hkv = c.kv_heads, D = c.head_dim;
  const std::int64_t Dv = c.value_dim(), group = Hq / Hkv;
  const double u = c.dtype == DType::bf16 ? 0x1p-8 : 0x1p-11, scale = problem.scale();
  const Mask mask = problem.mask();
  Allowances a;
  a.o.assign(Sq * Hq * Dv, 0.0);
  a.combined_o.assign(a.o.size(), 0.0);
  a.dq.assign(Sq * Hq * D, 0.0);
  a.dk.assign(Sk * Hkv * D, 0.0);
  a.dv.assign(Sk * Hkv * Dv, 0.0);
  for (const double x : ref.lse) {
    if (std::isfinite(x)) a.lse = std::max(a.lse, 0x1p-21 * std::abs(x));
  }
  const auto dot = [](const double* x, const double* y, std::int64_t n) {
    double sum = 0.0;
    for (std::int64_t e = 0; e < n; ++e) sum += x[e] * y[e];
    return sum;
  };
  std::vector<double> p(Sk), score(Sk);
  for (std::int64_t h = 0; h < Hq; ++h) {
    const std::int64_t g = h / group;
    for (std::int64_t i = 0; i < Sq; ++i) {
      const double lse = ref.lse[h * Sq + i];
      if (!std::isfinite(lse)) continue;  // nothing visible: zeros, exactly
      // Row i of head h: at `row` in Q and dQ, at `value_row` in O and dO.
      const std::int64_t row = (i * Hq + h) * D, value_row = (i * Hq + h) * Dv;
      const double* q = &problem.q[row];
      const double* dout = &problem.dout[value_row];
      const double* o = &ref.o[value_row];
      double max_score = 0.0;
      for (std::int64_t j = 0; j < Sk; ++j) {
        p[j] = 0.0;
        if (!sees(mask, 0, i, j)) continue;
        score[j] = scale * dot(q, &problem.k[(j * Hkv + g) * D], D);
        max_score = std::max(max_score, std::abs(score[j]));
        p[j] = std::exp(score[j] - lse);
      }
      double d_error = 0.0, d_value = 0.0, d_magnitude = 0.0;
      for (std::int64_t x = 0; x < Dv; ++x) {
        double pv = 0.0;
        for (std::int64_t j = 0; j < Sk; ++j) pv += p[j] * std::abs(problem.v[(j * Hkv + g) * Dv + x]);
        a.combined_o[value_row + x] = u * pv;
        a.o[value_row + x] = u * pv + u * std::abs(o[x]) + half_subnormal_spacing(c.dtype);
        d_error += std::abs(dout[x]) * a.o[value_row + x];
        d_value += dout[x] * o[x];
        d_magnitude += std::abs(dout[x] * o[x]);
      }
      d_error += 0x1p-20 * d_magnitude;
      const double eps = 0x1p-20 * (std::abs(lse) + max_score);
      for (std::int64_t j = 0; j < Sk; ++j) {
        if (p[j] == 0.0) continue;
        const std::int64_t key = (j * Hkv + g) * D, value_key = (j * Hkv + g) * Dv;
        const double dp = dot(dout, &problem.v[value_key], Dv);
        const double ds = p[j] * (d_error + eps * std::abs(dp - d_value));
        for (std::int64_t x = 0; x < D; ++x) {
          a.dq[row + x] += scale * ds * std::abs(problem.k[key + x]);
          a.dk[key + x] += scale * ds * std::abs(q[x]);
        }
        for (std::int64_t x = 0; x < Dv; ++x) a.dv[value_key + x] += eps * p[j] * std::abs(dout[x]);
      }
    }
  }
  if (rounded_keys) {
    for (std::size_t e = 0; e < a.dk.size(); ++e) {
      a.dk[e] += u * std::abs(ref.dk[e]) + half_subnormal_spacing(c.dtype);
    }
    for (std::size_t e = 0; e < a.dv.size(); ++e) {
      a.dv[e] += u * std::abs(ref.dv[e]) + half_subnormal_spacing(c.dtype);
    }
  }
  return a;
}

// The criterion with an allowance per element: |out - ref| <= 2 max|low - ref| + 1e-5 + allowance.
// Infinities of ref must be matched exactly; NaN never passes.
::testing::AssertionResult WithinCriterionAndAllowance(const char* what,
                                                       const std::vector<double>& out,
                                                       const std::vector<double>& low,
                                                       const std::vector<double>& ref,
                                                       const std::vector<double>& allowance) {
  const double base = 2.0 * max_abs_diff(low, ref) + 1e-5;
  std::size_t wrong = 0, first = 0;
  double worst_ratio = 0.0;
  for (std::size_t e = 0; e < ref.size(); ++e) {
    const double error = std::isfinite(ref[e]) ? std::abs(out[e] - ref[e])
                         : out[e] == ref[e]    ? 0.0
                                               : INFINITY;
    const double ratio = std::isnan(error) ? INFINITY : error / (base + allowance[e]);
    if (ratio > 1.0 && wrong++ == 0) first = e;
    worst_ratio = std::max(worst_ratio, ratio);
  }
  if (wrong == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": " << wrong << " elements beyond their bound, worst error/bound " << worst_ratio
         << "; the first, element " << first << ": " << out[first] << " against " << ref[first]
         << " (bound " << base << " + allowance " << allowance[first] << ")";
}

// The forward in combine mode over two key chunks split at `split`, into fp32 (O, LSE) that start
// at (0, -inf).
void run_combine(DeviceProblem& problem, std::int64_t split, std::vector<double>& o,
                 std::vector<double>& lse) {
  const Case& c = problem.c;
  const std::int64_t B = c.batch, Sq = c.q_len, Hq = c.q_heads, D = c.value_dim();
  DeviceBuffer running_o(B * Sq * Hq * D * sizeof(float)), running_lse(B * Hq * Sq * sizeof(float));
  RINGATTN_CUDA_CHECK(cudaMemset(running_o.data(), 0, running_o.bytes()));
  const std::vector<float> neg_inf(B * Hq * Sq, -INFINITY);
  RINGATTN_CUDA_CHECK(cudaMemcpy(running_lse.data(), neg_inf.data(), running_lse.bytes(),
                                 cudaMemcpyHostToDevice));
  const TensorView o_acc =
      TensorView::contiguous(running_o.data(), DType::f32, {B, Sq, Hq, D}, Memory::device);
  const TensorView lse_acc =
      TensorView::contiguous(running_lse.data(), DType::f32, {B, Hq, Sq}, Memory::device);
  const std::int64_t bounds[] = {0, split, c.k_len};
  for (int chunk = 0; chunk < 2; ++chunk) {
    TensorView k = problem.k_view, v = problem.v_view;
    const std::int64_t first = bounds[chunk];
    k.data = static_cast<std::uint16_t*>(k.data) + first * k.strides[1];
    v.data = static_cast<std::uint16_t*>(v.data) + first * v.strides[1];
    k.shape[1] = v.shape[1] = bounds[chunk + 1] - first;
    cuda::flash_forward({problem.q_view, k, v, o_acc, lse_acc, problem.scale(),
                         {c.causal, c.q_start, c.k_start + first}, true});
  }
  RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
  o = widen(download<float>(running_o, o_acc.numel()));
  lse = widen(download<float>(running_lse, lse_acc.numel()));
}

class FlashCudaEdges : public ::testing::TestWithParam<EdgeCase> {
 protected:
  void SetUp() override { RINGATTN_REQUIRE_GPUS(1); }
};

TEST_P(FlashCudaEdges, EveryPathMeetsTheCriterionOnEverySeed) {
  SCOPED_TRACE(seed_trace());
  const EdgeCase e = GetParam();
  std::vector<Drawn> drawn;
  std::vector<std::unique_ptr<DeviceProblem>> problems;
  for (int seed = 0; seed < kSeeds; ++seed) {
    drawn.push_back(draw(e, seed));
    problems.push_back(std::make_unique<DeviceProblem>(drawn.back().c, drawn.back().inputs));
  }
  std::vector<AttentionResult> refs(kSeeds), lows(kSeeds);
  std::vector<Allowances> allowances(kSeeds);
  // dK and dV added into zeros, overwritten in fp32, or overwritten rounded to the dtype.
  const auto key_gradients = [](int seed) { return seed % 3; };
  detail::parallel_for(kSeeds, [&](std::int64_t seed) {
    refs[seed] = problems[seed]->oracle();
    lows[seed] = problems[seed]->low();
    allowances[seed] = algorithm_allowances(*problems[seed], refs[seed], key_gradients(seed) == 2);
  });

  PathEnvironment environment;
  for (int seed = 0; seed < kSeeds; ++seed) {
    SCOPED_TRACE(drawn[seed].what);
    DeviceProblem& problem = *problems[seed];
    const AttentionResult& ref = refs[seed];
    const AttentionResult& low = lows[seed];
    const Allowances& allow = allowances[seed];
    for (const KernelPath& path : kPaths) {
      SCOPED_TRACE(path.name);
      environment.use(path);
      const AttentionResult out =
          problem.run(seed % 2 == 0, key_gradients(seed) > 0, key_gradients(seed) == 2);
      EXPECT_TRUE(WithinCriterionAndAllowance("O", out.o, low.o, ref.o, allow.o));
      EXPECT_TRUE(WithinFlashCriterion("LSE", out.lse, low.lse, ref.lse, allow.lse));
      EXPECT_TRUE(WithinCriterionAndAllowance("dQ", out.dq, low.dq, ref.dq, allow.dq));
      EXPECT_TRUE(WithinCriterionAndAllowance("dK", out.dk, low.dk, ref.dk, allow.dk));
      EXPECT_TRUE(WithinCriterionAndAllowance("dV", out.dv, low.dv, ref.dv, allow.dv));
      std::vector<double> o, lse;
      run_combine(problem, drawn[seed].edge, o, lse);
      EXPECT_TRUE(WithinCriterionAndAllowance("combined O", o, low.o, ref.o, allow.combined_o));
      EXPECT_TRUE(WithinFlashCriterion("combined LSE", lse, low.lse, ref.lse, allow.lse));
    }
    if (HasFailure()) break;  // one seed's report is enough to replay it
  }
}

std::vector<EdgeCase> edge_cases() {
  std::vector<EdgeCase> cases;
  for (int family = 0; family < static_cast<int>(families().size()); ++family) {
    for (DType dtype : {DType::bf16, DType::f16}) {
      for (const CudaDims& dims : built_cuda_dims()) {
        cases.push_back({family, dtype, dims.head_dim, dims.v_head_dim});
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Layouts, FlashCudaEdges, ::testing::ValuesIn(edge_cases()), edge_case_name);

}  // namespace
}  // namespace ringattn::test

#else

TEST(FlashCudaEdges, NeedsTheCudaBackend) { RINGATTN_REQUIRE_GPUS(1); }

#endif
