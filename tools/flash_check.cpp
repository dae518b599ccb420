// ringattn-flash-check: a randomized differential check of the CUDA flash block
// (cuda::flash_forward, flash_backward_prepare, flash_backward) against the streaming fp32 GPU
// reference (cuda::reference_forward, reference_backward) on the same rounded inputs.
//
//   ringattn-flash-check [--cases 200] [--seed S] [--first-case 0] [--max-len 2048]
//                        [--family both|hopper|sm80] [--json FILE] [--inject FAULT] [--verbose]
//
// Case I draws everything from std::mt19937_64(S + I): dtype, head dims, batch, lengths (often at
// tile edges), GQA, mask offsets, gain, dQ path, forward and backward modes, then the inputs; the
// kernel family alternates with I. The head dims: one head_dim of the build for Q, K and V alike,
// or one pair of detail::kCudaBlockValueDimPairs (head_dim 192 for Q, K, dQ and dK with
// v_head_dim 128 for V, O, dO and dV), each pair as often as each head_dim.
// `--seed S --first-case I --cases 1` (same --max-len, --family) replays case I. Exit status: 0
// when every case passed, 1 when one failed, 2 for bad options or errors, 77 without a CUDA GPU.
// --inject corrupts the kernel's side on purpose (every case it applies to must then fail): it
// shows what the bounds catch.
//
// Bounds. u = 2^-8 (bf16), 2^-11 (f16); e = 2^-24 (fp32); Vmax, Kmax, Qmax: max |v|, |k|, |q| of
// the (batch, head) slice; norms over a vector's width (head_dim for q and k, v_head_dim Dv for
// v, O and dO). An element passes when |out - ref| <= bound; rows that see no key (LSE -inf, O 0,
// delta 0, dQ 0) and keys no row sees (dK, dV keep their start) must match exactly; NaN never
// passes. The backward runs on identical inputs: the reference gets the O that the kernel's
// prepare gets (its dtype values; in combine mode the running O rounded to the dtype) and the
// kernel's LSE, so delta, P and dP - delta agree up to fp32 rounding; O and LSE are held to the
// reference's own by the forward check.
// Model (realistic, not worst case): each side forms an fp32 dot product a.b of length D with an
// error of a few e |a| |b|: its partial sums stay well under |a| |b|, and the tensor cores' k-steps
// truncate (one sign), so their D / 16 errors add up linearly. The scores s_ij = scale q_i.k_j,
// the row maximum, the exponent's base and LSE, and dP_ij - delta_i thus differ between the sides
// by at most (both sides; on an H100 LSE differed by up to 5 such units with 2048 keys, 9 with
// 3743: f16, head_dim 64, gain 39)
//   del_i = 24 e scale |q_i| max_j |k_j|,   eta_i = 16 e |dO_i| max_j |v_j|.
// A score error eps_ij (|eps| <= del_i) scales P_ij by exp(eps_ij - mean_P eps): LSE moves by at
// most del_i, O by about del_i times the spread of v under P (random signs), at most Vmax (under
// 0.1 of it seen at gains 32-64, where del is largest and P nearly one-hot). Rounding P to the
// dtype moves O by u sum_j P_ij |v_j| <= u Vmax (2 u Vmax below: up to 0.7 of the bound was
// seen), the stored O by u |O|. dS = P (dP - delta) and P are rounded to the dtype and carry P's
// relative error del, so dQ, dK, dV err by (u + del) relative to the sums that form them; the
// slice's max |ref| stands for those (random signs; 4 u because sum_j dS_ij = 0 makes a sum
// smaller than its terms: up to 1.8 u seen). dQ and dK also carry eta times P: scale eta_i Kmax
// (sum_j P_ij = 1) and scale max(eta) Qmax sqrt(n_j) (n_j rows see key j, their independent
// errors add as a random walk).
//   O      2 u Vmax + del_i Vmax + u |O_ref| (dtype output only) + 1e-5
//   LSE    del_i + 4 m e |LSE_ref| + 1e-5                    m merges (1 plain, chunks combine)
//   delta  2 e sqrt(Dv) sum_d |dO_id O_id|                   (flash_backward_prepare)
//   dQ     (4 u + 4 del_i) max|dQ_ref| + scale eta_i Kmax + 1e-5
//   dK     (4 u + 4 del) max|dK_ref| + scale eta Qmax sqrt(n_j) + out + 1e-5
//   dV     (4 u + 4 del) max|dV_ref| + out + 1e-5
// del, eta: their max over the slice's rows; out = u |ref| when dK and dV are written in the
// dtype, 2 e (|start| + |ref|) when they are added into a random fp32 start.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <limits>
#include <new>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/block_checks.hpp"
#include "ringattn/attention.hpp"
#include "ringattn/config.h"
#include "ringattn/dtype.hpp"
#include "ringattn/error.hpp"
#include "ringattn/runtime.hpp"
#include "tools/cli_checks.hpp"

#if RINGATTN_WITH_CUDA
#include <cuda_runtime.h>

#include "src/cuda/cuda_check.hpp"
#include "src/cuda/device_buffer.hpp"
#endif

namespace {

constexpr int kExitError = 2, kExitSkipped = 77;

struct Options {
  std::int64_t cases = 200;
  std::uint64_t seed = 0;
  std::int64_t first_case = 0;
  std::int64_t max_len = 2048;
  std::string family = "both";
  std::string json;
  std::string inject = "none";
  bool verbose = false;
};

}  // namespace

#if RINGATTN_WITH_CUDA

namespace {

using namespace ringattn;

constexpr int kExitFailed = 1;

// The command line that runs case `index` alone.
std::string replay_command(const Options& opt, std::int64_t index) {
  std::string command = "ringattn-flash-check --seed " + std::to_string(opt.seed) +
                        " --first-case " + std::to_string(index) + " --cases 1 --max-len " +
                        std::to_string(opt.max_len) + " --family " + opt.family;
  if (opt.inject != "none") command += " --inject " + opt.inject;
  return command;
}

constexpr double kFp32Unit = 0x1p-24;
constexpr double kFloor = 1e-5;
// The constants of the bounds (the derivation at the top of the file).
constexpr double kScoreNoise = 24.0;          // del_i in units of e scale |q_i| max |k|
constexpr double kDpNoise = 16.0;             // eta_i in units of e |dO_i| max |v|
constexpr double kProbabilityRounding = 2.0;  // O: times u Vmax
constexpr double kGradientRounding = 4.0;     // dQ, dK, dV: times u max|ref|
constexpr double kGradientScores = 4.0;       // dQ, dK, dV: times del max|ref|
// Work of one case, batch * q_heads * q_len * k_len * (head_dim + v_head_dim) (the scores' dot
// products and P V's): the reference is O(S^2) on CUDA cores. Elements of its largest tensor: the
// host draws and checks each (some 60 bytes apiece). Together they keep a case under a second or
// so.
constexpr double kMaxCaseWork = 4e9;
constexpr double kMaxCaseElements = 0x1p24;

enum class KeyGradients { added, overwritten, rounded };
enum class Inject { none, lse_inf, o_row_zero, o_row_off, key_tile, dk_double, dv_lost };

const char* key_gradients_name(KeyGradients mode) {
  switch (mode) {
    case KeyGradients::added:
      return "added into fp32";
    case KeyGradients::overwritten:
      return "overwritten fp32";
    case KeyGradients::rounded:
      return "overwritten in the dtype";
  }
  return "?";
}

Inject parse_inject(const std::string& name) {
  if (name == "lse-inf") return Inject::lse_inf;
  if (name == "o-row-zero") return Inject::o_row_zero;
  if (name == "o-row-off") return Inject::o_row_off;
  if (name == "key-tile") return Inject::key_tile;
  if (name == "dk-double") return Inject::dk_double;
  if (name == "dv-lost") return Inject::dv_lost;
  return Inject::none;
}

struct Case {
  std::int64_t index = 0;
  DType dtype = DType::bf16;
  std::int64_t head_dim = 64;    // of Q, K, dQ, dK
  std::int64_t v_head_dim = 64;  // of V, O, dO, dV: head_dim, or a pair's own
  std::int64_t batch = 1, q_len = 1, k_len = 1, kv_heads = 1, group = 1;
  bool causal = false;
  std::int64_t q_start = 0, k_start = 0;
  double gain = 1.0;       // q and k are gain * N(0, 1)
  bool hopper = false;     // RINGATTN_FLASH_FAMILY unset (Hopper kernels), else sm80
  bool atomic_dq = false;  // RINGATTN_DQ_ATOMIC=1
  std::vector<std::int64_t> chunk_bounds;  // combine mode over [b_c, b_c+1); empty: plain forward
  bool deterministic = false;
  KeyGradients key_gradients = KeyGradients::added;

  std::int64_t q_heads() const { return kv_heads * group; }
  std::int64_t shift() const { return q_start - k_start; }
  double scale() const { return default_scale(head_dim); }
  Mask mask() const { return {causal, q_start, k_start}; }
  bool combine() const { return !chunk_bounds.empty(); }
  // Row i sees key j; a row that sees key 0 sees at least one.
  bool visible(std::int64_t i, std::int64_t j) const { return !causal || j <= i + shift(); }
  std::int64_t rows_seeing_key(std::int64_t j) const {
    const std::int64_t first = causal ? std::max<std::int64_t>(0, j - shift()) : 0;
    return std::max<std::int64_t>(0, q_len - first) * group;
  }
  double unit() const { return dtype == DType::bf16 ? 0x1p-8 : 0x1p-11; }
  // "128", or "192/128" for a pair (head_dim/v_head_dim).
  std::string head_dims() const {
    return std::to_string(head_dim) +
           (v_head_dim == head_dim ? "" : "/" + std::to_string(v_head_dim));
  }

  std::string describe() const {
    std::string text = std::string(dtype_name(dtype)) + " head_dim " + head_dims() + " batch " +
                       std::to_string(batch) + " q_len " + std::to_string(q_len) + " k_len " +
                       std::to_string(k_len) + " heads " + std::to_string(q_heads()) + "/" +
                       std::to_string(kv_heads) + (causal ? " causal" : " full") + " q_start " +
                       std::to_string(q_start) + " k_start " + std::to_string(k_start);
    char gain_text[32];
    std::snprintf(gain_text, sizeof gain_text, " gain %.3f", gain);
    text += gain_text;
    text += hopper ? " family hopper" : " family sm80";
    if (combine()) {
      text += " combine [";
      for (std::size_t c = 0; c < chunk_bounds.size(); ++c) {
        text += (c ? " " : "") + std::to_string(chunk_bounds[c]);
      }
      text += "]";
    } else {
      text += " plain";
    }
    text += deterministic ? " deterministic" : atomic_dq ? " atomic-dQ" : " default-dQ";
    text += std::string(" dK/dV ") + key_gradients_name(key_gradients);
    return text;
  }
};

std::int64_t uniform(std::mt19937_64& rng, std::int64_t lo, std::int64_t hi) {
  return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
}

bool coin(std::mt19937_64& rng) {
  return uniform(rng, 0, 1) == 1;
}

// A length in [1, max_len]: 4 in 10 at a tile edge (the kernels' tiles are 32, 64, 128 and 192
// rows or keys), 3 in 10 log-uniform, 3 in 10 uniform.
std::int64_t draw_length(std::mt19937_64& rng, std::int64_t max_len) {
  const std::int64_t kind = uniform(rng, 0, 9);
  std::int64_t len = 1;
  if (kind < 4) {
    if (coin(rng)) {
      constexpr std::int64_t kEdges[] = {1, 17, 127, 128, 129};
      len = kEdges[uniform(rng, 0, 4)];
    } else {
      const std::int64_t unit = coin(rng) ? 64 : 128;
      len = unit * uniform(rng, 1, std::max<std::int64_t>(1, max_len / unit)) + uniform(rng, -1, 1);
    }
  } else if (kind < 7) {
    const double log_len =
        std::uniform_real_distribution<double>(0.0, std::log(double(max_len)))(rng);
    len = std::llround(std::exp(log_len));
  } else {
    len = uniform(rng, 1, max_len);
  }
  return std::clamp<std::int64_t>(len, 1, max_len);
}

Case draw_case(std::uint64_t seed, std::int64_t index, std::int64_t max_len, bool hopper,
               std::mt19937_64& rng) {
  rng.seed(seed + static_cast<std::uint64_t>(index));
  Case c;
  c.index = index;
  c.hopper = hopper;
  c.dtype = coin(rng) ? DType::bf16 : DType::f16;
  {
    // Every head dim of the build and every pair, alike.
    const auto& dims = detail::kCudaBlockHeadDims;
    const auto& pairs = detail::kCudaBlockValueDimPairs;
    const std::int64_t equal = static_cast<std::int64_t>(std::size(dims));
    const std::int64_t pick = uniform(rng, 0, equal + static_cast<std::int64_t>(pairs.size()) - 1);
    if (pick < equal) {
      c.head_dim = c.v_head_dim = dims[pick];
    } else {
      c.head_dim = pairs[pick - equal].head_dim;
      c.v_head_dim = pairs[pick - equal].v_head_dim;
    }
  }
  c.batch = uniform(rng, 1, 2);
  c.kv_heads = uniform(rng, 1, 2);
  c.group = std::int64_t{1} << uniform(rng, 0, 3);
  c.q_len = draw_length(rng, max_len);
  c.k_len = draw_length(rng, max_len);
  auto work = [&] {
    return double(c.batch) * c.q_heads() * c.q_len * c.k_len * (c.head_dim + c.v_head_dim);
  };
  auto elements = [&] {
    return double(c.batch) * c.q_heads() * std::max(c.q_len, c.k_len) *
           std::max(c.head_dim, c.v_head_dim);
  };
  while (work() > kMaxCaseWork || elements() > kMaxCaseElements) {
    if (c.batch > 1)
      c.batch = 1;
    else if (c.group > 1)
      c.group /= 2;
    else if (c.kv_heads > 1)
      c.kv_heads = 1;
    else if (c.q_len >= c.k_len)
      c.q_len = (c.q_len + 1) / 2;
    else
      c.k_len = (c.k_len + 1) / 2;
  }
  c.causal = coin(rng);
  // Offsets (they matter only under causal): aligned; anywhere (some rows may see no key); every
  // key before every row; the first rows before every key; every row before every key.
  const std::int64_t offsets = uniform(rng, 0, 19);
  if (offsets < 6) {
    c.q_start = c.k_start = 0;
  } else if (offsets < 11) {
    c.q_start = uniform(rng, 0, max_len);
    c.k_start = uniform(rng, 0, max_len);
  } else if (offsets < 15) {
    c.k_start = uniform(rng, 0, max_len);
    c.q_start = c.k_start + c.k_len - 1 + uniform(rng, 0, 64);
  } else if (offsets < 19) {
    c.q_start = uniform(rng, 0, max_len);
    c.k_start = c.q_start + uniform(rng, 1, c.q_len);
  } else {
    c.q_start = uniform(rng, 0, max_len);
    c.k_start = c.q_start + c.q_len + uniform(rng, 0, 64);
  }
  c.gain = std::exp(std::uniform_real_distribution<double>(0.0, std::log(64.0))(rng));
  c.atomic_dq = coin(rng);
  if (coin(rng)) {
    const std::int64_t chunks = std::min<std::int64_t>(uniform(rng, 1, 3), c.k_len);
    std::vector<std::int64_t> cuts;
    while (static_cast<std::int64_t>(cuts.size()) < chunks - 1) {
      const std::int64_t cut = uniform(rng, 1, c.k_len - 1);
      if (std::find(cuts.begin(), cuts.end(), cut) == cuts.end()) cuts.push_back(cut);
    }
    std::sort(cuts.begin(), cuts.end());
    c.chunk_bounds.push_back(0);
    c.chunk_bounds.insert(c.chunk_bounds.end(), cuts.begin(), cuts.end());
    c.chunk_bounds.push_back(c.k_len);
  }
  c.deterministic = coin(rng);
  c.key_gradients = static_cast<KeyGradients>(uniform(rng, 0, 2));
  return c;
}

// Exact widening of every 16-bit pattern.
float widen(DType dtype, std::uint16_t bits) {
  static const std::vector<float> tables[2] = {
      [] {
        std::vector<float> t(65536);
        for (std::uint32_t b = 0; b < 65536; ++b)
          t[b] = bf16_to_float(static_cast<std::uint16_t>(b));
        return t;
      }(),
      [] {
        std::vector<float> t(65536);
        for (std::uint32_t b = 0; b < 65536; ++b)
          t[b] = f16_to_float(static_cast<std::uint16_t>(b));
        return t;
      }()};
  return tables[dtype == DType::bf16 ? 0 : 1][bits];
}

std::uint16_t narrow(DType dtype, float value) {
  return dtype == DType::bf16 ? float_to_bf16(value) : float_to_f16(value);
}

// gain * N(0, 1), rounded to the dtype: the bits for the device, the values for the host.
struct Input {
  std::vector<std::uint16_t> bits;
  std::vector<float> values;
};

Input draw_input(std::mt19937_64& rng, DType dtype, std::int64_t count, double gain) {
  std::normal_distribution<double> normal;
  Input in;
  in.bits.resize(count);
  in.values.resize(count);
  for (std::int64_t i = 0; i < count; ++i) {
    in.bits[i] = narrow(dtype, static_cast<float>(gain * normal(rng)));
    in.values[i] = widen(dtype, in.bits[i]);
  }
  return in;
}

template <typename T>
DeviceBuffer upload(const std::vector<T>& host) {
  DeviceBuffer buffer(host.size() * sizeof(T));
  if (!host.empty()) {
    RINGATTN_CUDA_CHECK(
        cudaMemcpy(buffer.data(), host.data(), buffer.bytes(), cudaMemcpyHostToDevice));
  }
  return buffer;
}

template <typename T>
std::vector<T> download(const DeviceBuffer& buffer, std::int64_t count) {
  std::vector<T> host(count);
  if (count > 0) {
    RINGATTN_CUDA_CHECK(
        cudaMemcpy(host.data(), buffer.data(), count * sizeof(T), cudaMemcpyDeviceToHost));
  }
  return host;
}

std::vector<double> widen_all(DType dtype, const std::vector<std::uint16_t>& bits) {
  std::vector<double> out(bits.size());
  for (std::size_t i = 0; i < bits.size(); ++i) out[i] = widen(dtype, bits[i]);
  return out;
}

std::vector<double> widen_all(const std::vector<float>& values) {
  return {values.begin(), values.end()};
}

void poison(const DeviceBuffer& buffer) {  // NaN in every fp32, bf16 and f16 element
  RINGATTN_CUDA_CHECK(cudaMemset(buffer.data(), 0xff, buffer.bytes()));
}

TensorView device_view(const DeviceBuffer& buffer, DType dtype,
                       std::initializer_list<std::int64_t> shape) {
  return TensorView::contiguous(buffer.data(), dtype, shape, Memory::device);
}

// Names an element of a [B, S, H, W] tensor (width W > 1: head_dim, or v_head_dim for O, dO and
// dV) or of a [B, H, S] one (width 1).
struct Layout {
  const char* tensor;
  const char* row;  // "row" or "key"
  std::int64_t len, heads, width;

  std::string describe(std::int64_t at) const {
    const std::int64_t d = at % width, rest = at / width;
    std::int64_t b, h, i;
    if (width == 1) {
      i = rest % len, h = (rest / len) % heads, b = rest / (len * heads);
    } else {
      h = rest % heads, i = (rest / heads) % len, b = rest / (heads * len);
    }
    return std::string(tensor) + "[batch " + std::to_string(b) + ", " + row + " " +
           std::to_string(i) + ", head " + std::to_string(h) +
           (width == 1 ? "" : ", " + std::to_string(d)) + "]";
  }
};

// One output's comparison: the worst err / bound, the elements out of bounds and the first of them.
struct Tally {
  const char* name = "";
  double worst = 0.0;
  std::int64_t bad = 0, checked = 0;
  std::string first;

  void check(double got, double ref, double bound, const Layout& layout, std::int64_t at) {
    ++checked;
    const double err = std::fabs(got - ref);
    if (err <= bound) {
      if (bound > 0.0) worst = std::max(worst, err / bound);
      return;
    }
    if (got == ref && !std::isnan(got)) return;  // equal infinities
    worst = std::numeric_limits<double>::infinity();
    if (bad++ == 0) {
      char text[160];
      std::snprintf(text, sizeof text, ": %.9g against %.9g (bound %.3g)", got, ref, bound);
      first = layout.describe(at) + text;
    }
  }
  // An element that must be exactly `ref` (rows without keys, keys without rows).
  void exact(double got, double ref, const Layout& layout, std::int64_t at) {
    check(got, ref, 0.0, layout, at);
  }
};

enum Output { kO, kLse, kDelta, kDq, kDk, kDv, kOutputs };
constexpr const char* kOutputNames[kOutputs] = {"O", "LSE", "delta", "dQ", "dK", "dV"};

struct CaseResult {
  std::array<Tally, kOutputs> tallies;
  bool passed() const {
    for (const Tally& t : tallies) {
      if (t.bad > 0) return false;
    }
    return true;
  }
};

void set_environment(const Case& c) {
  if (c.hopper)
    unsetenv("RINGATTN_FLASH_FAMILY");
  else
    setenv("RINGATTN_FLASH_FAMILY", "sm80", 1);
  if (c.atomic_dq)
    setenv("RINGATTN_DQ_ATOMIC", "1", 1);
  else
    unsetenv("RINGATTN_DQ_ATOMIC");
}

CaseResult run_case(const Case& c, std::mt19937_64& rng, Inject inject) {
  const std::int64_t B = c.batch, Sq = c.q_len, Sk = c.k_len, Hq = c.q_heads(), Hkv = c.kv_heads,
                     D = c.head_dim, Dv = c.v_head_dim, G = c.group;
  const DType dtype = c.dtype;
  const double u = c.unit(), e = kFp32Unit, scale = c.scale();
  // Elements of Q and dQ, K and dK (head_dim), O and dO, V and dV (v_head_dim); rows.
  const std::int64_t nq = B * Sq * Hq * D, nk = B * Sk * Hkv * D, no = B * Sq * Hq * Dv,
                     nv = B * Sk * Hkv * Dv, rows = B * Hq * Sq;
  auto q_at = [&](std::int64_t b, std::int64_t i, std::int64_t h) {
    return ((b * Sq + i) * Hq + h) * D;
  };
  auto k_at = [&](std::int64_t b, std::int64_t j, std::int64_t h) {
    return ((b * Sk + j) * Hkv + h) * D;
  };
  auto o_at = [&](std::int64_t b, std::int64_t i, std::int64_t h) {
    return ((b * Sq + i) * Hq + h) * Dv;
  };
  auto v_at = [&](std::int64_t b, std::int64_t j, std::int64_t h) {
    return ((b * Sk + j) * Hkv + h) * Dv;
  };
  // The (batch, kv head) slice of element x of a [B, Sk, Hkv, width] tensor.
  auto key_slice = [&](std::int64_t x, std::int64_t width) {
    return (x / (width * Hkv * Sk)) * Hkv + (x / width) % Hkv;
  };
  auto row_at = [&](std::int64_t b, std::int64_t h, std::int64_t i) {
    return (b * Hq + h) * Sq + i;
  };

  const Input q = draw_input(rng, dtype, nq, c.gain), k = draw_input(rng, dtype, nk, c.gain);
  const Input v = draw_input(rng, dtype, nv, 1.0), dout = draw_input(rng, dtype, no, 1.0);
  const DeviceBuffer q_buffer = upload(q.bits), k_buffer = upload(k.bits),
                     v_buffer = upload(v.bits), dout_buffer = upload(dout.bits);
  const TensorView q_view = device_view(q_buffer, dtype, {B, Sq, Hq, D});
  const TensorView k_ref_view = device_view(k_buffer, dtype, {B, Sk, Hkv, D});
  const TensorView v_view = device_view(v_buffer, dtype, {B, Sk, Hkv, Dv});
  const TensorView dout_view = device_view(dout_buffer, dtype, {B, Sq, Hq, Dv});
  // The kernel's keys: the reference's, or (--inject key-tile) with keys 64-127 in place of the
  // last tile of 64, as a kernel that loads the wrong tile would see them.
  DeviceBuffer k_wrong;
  TensorView k_view = k_ref_view;
  if (inject == Inject::key_tile && Sk > 64) {
    std::vector<std::uint16_t> bits = k.bits;
    const std::int64_t last = (Sk - 1) / 64 * 64, source = last == 64 ? 0 : 64;
    for (std::int64_t b = 0; b < B; ++b) {
      for (std::int64_t j = last; j < Sk; ++j) {
        std::copy_n(&k.bits[k_at(b, source + j - last, 0)], Hkv * D, &bits[k_at(b, j, 0)]);
      }
    }
    k_wrong = upload(bits);
    k_view = device_view(k_wrong, dtype, {B, Sk, Hkv, D});
  }

  set_environment(c);

  // Forward: plain into the dtype, or merged chunk by chunk into a running fp32 (O, LSE) that
  // starts at (0, -inf).
  const DType o_dtype = c.combine() ? DType::f32 : dtype;
  DeviceBuffer o_buffer(no * dtype_size(o_dtype)), lse_buffer(rows * sizeof(float));
  const TensorView o_view = device_view(o_buffer, o_dtype, {B, Sq, Hq, Dv});
  const TensorView lse_view = device_view(lse_buffer, DType::f32, {B, Hq, Sq});
  if (c.combine()) {
    RINGATTN_CUDA_CHECK(cudaMemset(o_buffer.data(), 0, o_buffer.bytes()));
    const std::vector<float> empty(rows, -std::numeric_limits<float>::infinity());
    RINGATTN_CUDA_CHECK(
        cudaMemcpy(lse_buffer.data(), empty.data(), lse_buffer.bytes(), cudaMemcpyHostToDevice));
    for (std::size_t chunk = 0; chunk + 1 < c.chunk_bounds.size(); ++chunk) {
      const std::int64_t first = c.chunk_bounds[chunk], len = c.chunk_bounds[chunk + 1] - first;
      TensorView k_chunk = k_view, v_chunk = v_view;
      k_chunk.data = static_cast<std::uint16_t*>(k_chunk.data) + first * k_chunk.strides[1];
      v_chunk.data = static_cast<std::uint16_t*>(v_chunk.data) + first * v_chunk.strides[1];
      k_chunk.shape[1] = v_chunk.shape[1] = len;
      cuda::flash_forward({q_view,
                           k_chunk,
                           v_chunk,
                           o_view,
                           lse_view,
                           scale,
                           {c.causal, c.q_start, c.k_start + first},
                           true});
    }
  } else {
    poison(o_buffer);
    poison(lse_buffer);
    cuda::flash_forward({q_view, k_view, v_view, o_view, lse_view, scale, c.mask(), false});
  }
  DeviceBuffer o_ref_buffer(no * sizeof(float)), lse_ref_buffer(rows * sizeof(float));
  poison(o_ref_buffer);
  poison(lse_ref_buffer);
  cuda::reference_forward(q_view, k_ref_view, v_view, c.mask(), scale,
                          device_view(o_ref_buffer, DType::f32, {B, Sq, Hq, Dv}),
                          device_view(lse_ref_buffer, DType::f32, {B, Hq, Sq}));
  RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());

  // O as the backward gets it, in the dtype: the kernel's, or the running fp32 O rounded.
  std::vector<std::uint16_t> o_used_bits;
  std::vector<double> o_got;
  if (c.combine()) {
    const std::vector<float> running = download<float>(o_buffer, no);
    o_got = widen_all(running);
    o_used_bits.resize(no);
    for (std::int64_t x = 0; x < no; ++x) o_used_bits[x] = narrow(dtype, running[x]);
  } else {
    o_used_bits = download<std::uint16_t>(o_buffer, no);
    o_got = widen_all(dtype, o_used_bits);
  }
  std::vector<double> lse_got = widen_all(download<float>(lse_buffer, rows));
  const std::vector<double> o_ref = widen_all(download<float>(o_ref_buffer, no));
  const std::vector<double> lse_ref = widen_all(download<float>(lse_ref_buffer, rows));

  // Slice statistics: per (batch, kv head) max |v|, |k| and max row norms, per (batch, q head)
  // max |q|, per row |q_i| and |dO_i|.
  std::vector<double> v_max(B * Hkv), k_max(B * Hkv), k_norm_max(B * Hkv), v_norm_max(B * Hkv),
      q_max(B * Hq);
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t j = 0; j < Sk; ++j) {
      for (std::int64_t h = 0; h < Hkv; ++h) {
        double k2 = 0.0, v2 = 0.0;
        const std::int64_t k_first = k_at(b, j, h), v_first = v_at(b, j, h), s = b * Hkv + h;
        for (std::int64_t x = 0; x < D; ++x) {
          const double kx = k.values[k_first + x];
          k2 += kx * kx;
          k_max[s] = std::max(k_max[s], std::fabs(kx));
        }
        for (std::int64_t x = 0; x < Dv; ++x) {
          const double vx = v.values[v_first + x];
          v2 += vx * vx;
          v_max[s] = std::max(v_max[s], std::fabs(vx));
        }
        k_norm_max[s] = std::max(k_norm_max[s], std::sqrt(k2));
        v_norm_max[s] = std::max(v_norm_max[s], std::sqrt(v2));
      }
    }
  }
  std::vector<double> score_noise(rows), dp_noise(rows);  // del_i, eta_i
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < Hq; ++h) {
      const std::int64_t s = b * Hkv + h / G;
      for (std::int64_t i = 0; i < Sq; ++i) {
        double q2 = 0.0, g2 = 0.0;
        const std::int64_t q_first = q_at(b, i, h), o_first = o_at(b, i, h);
        for (std::int64_t x = 0; x < D; ++x) {
          const double qx = q.values[q_first + x];
          q2 += qx * qx;
          q_max[b * Hq + h] = std::max(q_max[b * Hq + h], std::fabs(qx));
        }
        for (std::int64_t x = 0; x < Dv; ++x) {
          const double gx = dout.values[o_first + x];
          g2 += gx * gx;
        }
        score_noise[row_at(b, h, i)] = kScoreNoise * e * scale * std::sqrt(q2) * k_norm_max[s];
        dp_noise[row_at(b, h, i)] = kDpNoise * e * std::sqrt(g2) * v_norm_max[s];
      }
    }
  }

  // A visible row to corrupt (--inject lse-inf, o-row-zero, o-row-off): the last row of the last
  // head.
  const std::int64_t victim_row = Sq - 1;
  const bool victim_sees = c.visible(victim_row, 0);
  if (victim_sees) {
    const std::int64_t at = o_at(B - 1, victim_row, Hq - 1);
    if (inject == Inject::lse_inf)
      lse_got[row_at(B - 1, Hq - 1, victim_row)] = std::numeric_limits<double>::infinity();
    if (inject == Inject::o_row_zero) std::fill_n(&o_got[at], Dv, 0.0);
    if (inject == Inject::o_row_off) {
      for (std::int64_t x = 0; x < Dv; ++x) o_got[at + x] += 0.5;
    }
  }

  CaseResult result;
  for (int out = 0; out < kOutputs; ++out) result.tallies[out].name = kOutputNames[out];
  const Layout o_layout{"O", "row", Sq, Hq, Dv}, lse_layout{"LSE", "row", Sq, Hq, 1};
  const double merges = c.combine() ? double(c.chunk_bounds.size() - 1) : 1.0;
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < Hq; ++h) {
      const std::int64_t s = b * Hkv + h / G;
      for (std::int64_t i = 0; i < Sq; ++i) {
        const std::int64_t r = row_at(b, h, i), at = o_at(b, i, h);
        if (!c.visible(i, 0)) {
          result.tallies[kLse].exact(lse_got[r], -std::numeric_limits<double>::infinity(),
                                     lse_layout, r);
          for (std::int64_t x = 0; x < Dv; ++x) {
            result.tallies[kO].exact(o_got[at + x], 0.0, o_layout, at + x);
          }
          continue;
        }
        const double del = score_noise[r];
        result.tallies[kLse].check(lse_got[r], lse_ref[r],
                                   del + 4.0 * merges * e * std::fabs(lse_ref[r]) + kFloor,
                                   lse_layout, r);
        const double o_common = (kProbabilityRounding * u + del) * v_max[s] + kFloor;
        for (std::int64_t x = 0; x < Dv; ++x) {
          const double stored = c.combine() ? 0.0 : u * std::fabs(o_ref[at + x]);
          result.tallies[kO].check(o_got[at + x], o_ref[at + x], o_common + stored, o_layout,
                                   at + x);
        }
      }
    }
  }

  // Backward. The reference on identical inputs: O as the prepare gets it (fp32 copy of its
  // dtype values) and the kernel's LSE.
  DeviceBuffer o_used_buffer = c.combine() ? upload(o_used_bits) : DeviceBuffer();
  const TensorView o_used_view =
      c.combine() ? device_view(o_used_buffer, dtype, {B, Sq, Hq, Dv}) : o_view;
  std::vector<float> o_used(no);
  for (std::int64_t x = 0; x < no; ++x) o_used[x] = widen(dtype, o_used_bits[x]);
  const DeviceBuffer o_used32_buffer = upload(o_used);
  DeviceBuffer delta_ref_buffer(rows * sizeof(float)), dq_ref_buffer(nq * sizeof(float)),
      dk_ref_buffer(nk * sizeof(float)), dv_ref_buffer(nv * sizeof(float));
  for (const DeviceBuffer* buffer :
       {&delta_ref_buffer, &dq_ref_buffer, &dk_ref_buffer, &dv_ref_buffer}) {
    poison(*buffer);
  }
  cuda::reference_backward(
      q_view, k_ref_view, v_view, device_view(o_used32_buffer, DType::f32, {B, Sq, Hq, Dv}),
      lse_view, dout_view, c.mask(), scale, device_view(delta_ref_buffer, DType::f32, {B, Hq, Sq}),
      device_view(dq_ref_buffer, DType::f32, {B, Sq, Hq, D}),
      device_view(dk_ref_buffer, DType::f32, {B, Sk, Hkv, D}),
      device_view(dv_ref_buffer, DType::f32, {B, Sk, Hkv, Dv}));
  const std::vector<double> delta_ref = widen_all(download<float>(delta_ref_buffer, rows));
  const std::vector<double> dq_ref = widen_all(download<float>(dq_ref_buffer, nq));
  const std::vector<double> dk_ref = widen_all(download<float>(dk_ref_buffer, nk));
  const std::vector<double> dv_ref = widen_all(download<float>(dv_ref_buffer, nv));

  // Scales of the gradients: max |ref| of each (batch, head) slice.
  std::vector<double> dq_scale(B * Hq), dk_scale(B * Hkv), dv_scale(B * Hkv);
  for (std::int64_t x = 0; x < nq; ++x) {
    const std::int64_t h = (x / D) % Hq, b = x / (D * Hq * Sq);
    dq_scale[b * Hq + h] = std::max(dq_scale[b * Hq + h], std::fabs(dq_ref[x]));
  }
  for (std::int64_t x = 0; x < nk; ++x) {
    const std::int64_t s = key_slice(x, D);
    dk_scale[s] = std::max(dk_scale[s], std::fabs(dk_ref[x]));
  }
  for (std::int64_t x = 0; x < nv; ++x) {
    const std::int64_t s = key_slice(x, Dv);
    dv_scale[s] = std::max(dv_scale[s], std::fabs(dv_ref[x]));
  }

  // dK and dV: added into a random fp32 start of the slice's scale (subtracted on the host), or
  // overwritten (poisoned first), in fp32 or in the dtype.
  const bool rounded = c.key_gradients == KeyGradients::rounded;
  const DType key_dtype = rounded ? dtype : DType::f32;
  std::vector<float> dk_start(nk, 0.0f), dv_start(nv, 0.0f);
  DeviceBuffer dk_buffer(nk * dtype_size(key_dtype)), dv_buffer(nv * dtype_size(key_dtype));
  if (c.key_gradients == KeyGradients::added) {
    std::normal_distribution<double> normal;
    auto start = [&](const std::vector<double>& slice_scale, std::int64_t s) {
      return static_cast<float>(normal(rng) * (slice_scale[s] > 0.0 ? slice_scale[s] : 1.0));
    };
    for (std::int64_t x = 0; x < std::max(nk, nv); ++x) {  // dK's and dV's x-th in turn
      if (x < nk) dk_start[x] = start(dk_scale, key_slice(x, D));
      if (x < nv) dv_start[x] = start(dv_scale, key_slice(x, Dv));
    }
    dk_buffer = upload(dk_start);
    dv_buffer = upload(dv_start);
  } else {
    poison(dk_buffer);
    poison(dv_buffer);
  }
  DeviceBuffer delta_buffer(rows * sizeof(float)), dq_buffer(nq * sizeof(float));
  poison(delta_buffer);
  poison(dq_buffer);  // the prepare zeroes it
  const TensorView delta_view = device_view(delta_buffer, DType::f32, {B, Hq, Sq});
  const TensorView dq_view = device_view(dq_buffer, DType::f32, {B, Sq, Hq, D});
  cuda::flash_backward_prepare(o_used_view, dout_view, delta_view, nullptr, &dq_view);
  BackwardArgs args{q_view,
                    k_view,
                    v_view,
                    dout_view,
                    lse_view,
                    delta_view,
                    dq_view,
                    device_view(dk_buffer, key_dtype, {B, Sk, Hkv, D}),
                    device_view(dv_buffer, key_dtype, {B, Sk, Hkv, Dv}),
                    scale,
                    c.mask(),
                    c.deterministic};
  args.overwrite_key_gradients = c.key_gradients != KeyGradients::added;
  cuda::flash_backward(args);
  RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<double> delta_got = widen_all(download<float>(delta_buffer, rows));
  const std::vector<double> dq_got = widen_all(download<float>(dq_buffer, nq));
  std::vector<double> dk_got, dv_got;
  if (rounded) {
    dk_got = widen_all(dtype, download<std::uint16_t>(dk_buffer, nk));
    dv_got = widen_all(dtype, download<std::uint16_t>(dv_buffer, nv));
  } else {
    dk_got = widen_all(download<float>(dk_buffer, nk));
    dv_got = widen_all(download<float>(dv_buffer, nv));
  }
  for (std::int64_t x = 0; x < nk; ++x) dk_got[x] -= dk_start[x];  // the block's own contributions
  for (std::int64_t x = 0; x < nv; ++x) dv_got[x] -= dv_start[x];
  for (std::int64_t b = 0; b < B && (inject == Inject::dk_double || inject == Inject::dv_lost);
       ++b) {
    for (std::int64_t j = 0; j < std::min<std::int64_t>(Sk, 64); ++j) {
      if (inject == Inject::dk_double) {
        for (std::int64_t x = k_at(b, j, 0); x < k_at(b, j, 0) + Hkv * D; ++x) dk_got[x] *= 2.0;
      } else {
        std::fill_n(&dv_got[v_at(b, j, 0)], Hkv * Dv, 0.0);
      }
    }
  }

  // delta and dQ, row by row.
  const Layout delta_layout{"delta", "row", Sq, Hq, 1}, dq_layout{"dQ", "row", Sq, Hq, D};
  std::vector<double> score_noise_max(B * Hkv), dp_noise_max(B * Hkv);
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < Hq; ++h) {
      const std::int64_t s = b * Hkv + h / G;
      for (std::int64_t i = 0; i < Sq; ++i) {
        const std::int64_t r = row_at(b, h, i), at = q_at(b, i, h), o_first = o_at(b, i, h);
        double products = 0.0;
        for (std::int64_t x = 0; x < Dv; ++x)
          products += std::fabs(dout.values[o_first + x] * double(o_used[o_first + x]));
        result.tallies[kDelta].check(delta_got[r], delta_ref[r],
                                     2.0 * e * std::sqrt(double(Dv)) * products, delta_layout, r);
        if (!c.visible(i, 0)) {
          for (std::int64_t x = 0; x < D; ++x) {
            result.tallies[kDq].exact(dq_got[at + x], 0.0, dq_layout, at + x);
          }
          continue;
        }
        score_noise_max[s] = std::max(score_noise_max[s], score_noise[r]);
        dp_noise_max[s] = std::max(dp_noise_max[s], dp_noise[r]);
        const double bound =
            (kGradientRounding * u + kGradientScores * score_noise[r]) * dq_scale[b * Hq + h] +
            scale * dp_noise[r] * k_max[s] + kFloor;
        for (std::int64_t x = 0; x < D; ++x) {
          result.tallies[kDq].check(dq_got[at + x], dq_ref[at + x], bound, dq_layout, at + x);
        }
      }
    }
  }

  // dK and dV, key by key.
  const Layout dk_layout{"dK", "key", Sk, Hkv, D}, dv_layout{"dV", "key", Sk, Hkv, Dv};
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t j = 0; j < Sk; ++j) {
      const std::int64_t seen_by = c.rows_seeing_key(j);
      for (std::int64_t h = 0; h < Hkv; ++h) {
        const std::int64_t s = b * Hkv + h, k_first = k_at(b, j, h), v_first = v_at(b, j, h);
        double group_q_max = 0.0;
        for (std::int64_t g = 0; g < G; ++g)
          group_q_max = std::max(group_q_max, q_max[b * Hq + h * G + g]);
        const double relative = kGradientRounding * u + kGradientScores * score_noise_max[s];
        const double dk_common =
            relative * dk_scale[s] +
            scale * dp_noise_max[s] * group_q_max * std::sqrt(double(seen_by)) + kFloor;
        const double dv_common = relative * dv_scale[s] + kFloor;
        auto stored = [&](double ref, double start) {
          return rounded ? u * std::fabs(ref) : 2.0 * e * (std::fabs(start) + std::fabs(ref));
        };
        for (std::int64_t x = k_first; x < k_first + D; ++x) {
          if (seen_by == 0) {
            result.tallies[kDk].exact(dk_got[x], 0.0, dk_layout, x);
          } else {
            result.tallies[kDk].check(dk_got[x], dk_ref[x],
                                      dk_common + stored(dk_ref[x], dk_start[x]), dk_layout, x);
          }
        }
        for (std::int64_t x = v_first; x < v_first + Dv; ++x) {
          if (seen_by == 0) {
            result.tallies[kDv].exact(dv_got[x], 0.0, dv_layout, x);
          } else {
            result.tallies[kDv].check(dv_got[x], dv_ref[x],
                                      dv_common + stored(dv_ref[x], dv_start[x]), dv_layout, x);
          }
        }
      }
    }
  }
  return result;
}

struct Worst {
  double ratio = 0.0;
  std::int64_t case_index = -1;
  std::int64_t failed_cases = 0;
};

int run(const Options& opt) {
  if (cuda_device_count() == 0) {
    std::printf("ringattn-flash-check: no CUDA GPU visible: skipped\n");
    return kExitSkipped;
  }
  int device = 0;
  RINGATTN_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp properties{};
  RINGATTN_CUDA_CHECK(cudaGetDeviceProperties(&properties, device));
  // The Hopper family runs where the library was built for sm_90a and the GPU is compute 9.0
  // (use_hopper_family in kernels/cuda/flash_dispatch.cpp); sm80 runs everywhere.
  const bool hopper_available =
      RINGATTN_WITH_SM90A && properties.major == 9 && properties.minor == 0;
  if (opt.family == "hopper" && !hopper_available) {
    std::fprintf(
        stderr,
        "ringattn-flash-check: --family hopper: no Hopper kernels on %s (compute %d.%d)%s\n",
        properties.name, properties.major, properties.minor,
        RINGATTN_WITH_SM90A ? "" : " in a library built without sm_90a");
    return kExitError;
  }
  const Inject inject = parse_inject(opt.inject);
  std::printf(
      "ringattn-flash-check: seed %llu, cases %lld-%lld, max-len %lld, family %s%s, %s (compute "
      "%d.%d)%s%s\n",
      static_cast<unsigned long long>(opt.seed), static_cast<long long>(opt.first_case),
      static_cast<long long>(opt.first_case + opt.cases - 1), static_cast<long long>(opt.max_len),
      opt.family.c_str(), opt.family == "both" && !hopper_available ? " (sm80 only here)" : "",
      properties.name, properties.major, properties.minor,
      inject == Inject::none ? "" : ", injecting ",
      inject == Inject::none ? "" : opt.inject.c_str());
  std::fflush(stdout);

  const auto start = std::chrono::steady_clock::now();
  std::array<Worst, kOutputs> worst;
  std::vector<std::int64_t> failed;
  std::mt19937_64 rng;
  for (std::int64_t index = opt.first_case; index < opt.first_case + opt.cases; ++index) {
    const bool hopper =
        opt.family == "hopper" || (opt.family == "both" && hopper_available && index % 2 == 0);
    const Case c = draw_case(opt.seed, index, opt.max_len, hopper, rng);
    const CaseResult result = run_case(c, rng, inject);
    for (int out = 0; out < kOutputs; ++out) {
      const Tally& t = result.tallies[out];
      if (t.worst > worst[out].ratio || worst[out].case_index < 0) {
        worst[out].ratio = t.worst;
        worst[out].case_index = index;
      }
      worst[out].failed_cases += t.bad > 0;
    }
    if (opt.verbose || !result.passed()) {
      std::printf("case %lld %s: %s\n ", static_cast<long long>(index),
                  result.passed() ? "passed" : "FAILED", c.describe().c_str());
      for (const Tally& t : result.tallies) std::printf(" %s %.3g", t.name, t.worst);
      std::printf("  (worst err/bound)\n");
    }
    if (!result.passed()) {
      failed.push_back(index);
      for (const Tally& t : result.tallies) {
        if (t.bad > 0) {
          std::printf("  %s: %lld of %lld elements out of bounds, first %s\n", t.name,
                      static_cast<long long>(t.bad), static_cast<long long>(t.checked),
                      t.first.c_str());
        }
      }
      // A pair's head dims follow as a shell comment (the seed draws them).
      std::string replay = replay_command(opt, index);
      if (c.v_head_dim != c.head_dim) replay += "  # head_dim " + c.head_dims();
      std::printf("  replay: %s\n", replay.c_str());
    }
    std::fflush(stdout);
  }

  std::printf("%-6s %12s %6s %13s\n", "output", "worst ratio", "case", "failed cases");
  for (int out = 0; out < kOutputs; ++out) {
    std::printf("%-6s %12.4g %6lld %13lld\n", kOutputNames[out], worst[out].ratio,
                static_cast<long long>(worst[out].case_index),
                static_cast<long long>(worst[out].failed_cases));
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("%s: %lld of %lld cases failed (seed %llu, %.1f s)\n",
              failed.empty() ? "PASS" : "FAIL", static_cast<long long>(failed.size()),
              static_cast<long long>(opt.cases), static_cast<unsigned long long>(opt.seed),
              seconds);
  if (!opt.json.empty()) {
    std::ofstream json(opt.json);
    json << "{\n  \"tool\": \"ringattn-flash-check\", \"version\": \"" << RINGATTN_VERSION_STRING
         << "\", \"gpu\": \"" << properties.name << "\",\n  \"seed\": " << opt.seed
         << ", \"first_case\": " << opt.first_case << ", \"cases\": " << opt.cases
         << ", \"max_len\": " << opt.max_len << ", \"family\": \"" << opt.family
         << "\", \"inject\": \"" << opt.inject << "\",\n  \"failures\": " << failed.size()
         << ", \"failed_cases\": [";
    for (std::size_t f = 0; f < failed.size(); ++f) json << (f ? ", " : "") << failed[f];
    json << "],\n  \"worst\": {";
    for (int out = 0; out < kOutputs; ++out) {
      json << (out ? ", " : "") << "\"" << kOutputNames[out] << "\": {\"ratio\": "
           << (std::isfinite(worst[out].ratio) ? std::to_string(worst[out].ratio)
                                               : std::string("null"))
           << ", \"case\": " << worst[out].case_index << "}";
    }
    json << "}\n}\n";
    if (!json) {
      std::fprintf(stderr, "ringattn-flash-check: could not write %s\n", opt.json.c_str());
      return kExitError;
    }
  }
  return failed.empty() ? 0 : kExitFailed;
}

}  // namespace

#endif  // RINGATTN_WITH_CUDA

int main(int argc, char** argv) {
  namespace tools = ringattn::tools;
  CLI::App app{
      "ringattn-flash-check: random cases of the CUDA flash block against the fp32 GPU reference"};
  Options opt;
  std::random_device entropy;
  opt.seed = (std::uint64_t{entropy()} << 32) | entropy();
  app.add_option("--cases", opt.cases, "number of cases (default 200)")
      ->check(tools::whole_number(1));
  app.add_option("--seed", opt.seed, "seed of case 0 (default: random, printed)")
      ->check(tools::seed_number());
  app.add_option("--first-case", opt.first_case, "index of the first case (default 0)")
      ->check(tools::whole_number(0));
  app.add_option("--max-len", opt.max_len, "longest q_len and k_len (default 2048)")
      ->check(tools::whole_number(1, std::int64_t{1} << 20));
  app.add_option("--family", opt.family,
                 "kernel family: both (alternate), hopper or sm80 (default both)")
      ->check(CLI::IsMember({"both", "hopper", "sm80"}));
  app.add_option("--json", opt.json, "write a summary as JSON");
  app.add_option(
         "--inject", opt.inject,
         "corrupt the kernel's side to show the check fails: none, lse-inf, o-row-zero, o-row-off, "
         "key-tile, dk-double, dv-lost (default none)")
      ->check(CLI::IsMember(
          {"none", "lse-inf", "o-row-zero", "o-row-off", "key-tile", "dk-double", "dv-lost"}));
  app.add_flag("--verbose", opt.verbose, "print every case");
  const tools::CommandLine line = tools::parse_command_line(app, argc, argv);
  if (line.exit_code >= 0) {
    return tools::finish_command_line(line, "ringattn-flash-check") == 0 ? 0 : kExitError;
  }
  // The case loop counts to --first-case + --cases, which must fit in 64 bits.
  if (opt.first_case > std::numeric_limits<std::int64_t>::max() - opt.cases) {
    std::fprintf(stderr,
                 "ringattn-flash-check: --first-case %lld with --cases %lld counts past %lld\n",
                 static_cast<long long>(opt.first_case), static_cast<long long>(opt.cases),
                 static_cast<long long>(std::numeric_limits<std::int64_t>::max()));
    return kExitError;
  }
  if (const std::string problem = tools::unwritable("--json", opt.json); !problem.empty()) {
    std::fprintf(stderr, "ringattn-flash-check: %s\n", problem.c_str());
    return kExitError;
  }

#if RINGATTN_WITH_CUDA
  try {
    return run(opt);
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr,
                 "ringattn-flash-check: out of host memory (std::bad_alloc) with --max-len %lld\n",
                 static_cast<long long>(opt.max_len));
  } catch (const std::exception& error) {
    std::fprintf(stderr, "ringattn-flash-check: %s\n", error.what());
  }
  return kExitError;
#else
  std::printf("ringattn-flash-check: ringattn was built without CUDA: skipped\n");
  return kExitSkipped;
#endif
}
