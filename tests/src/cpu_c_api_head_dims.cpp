// The C API's local-block calls on device tensors of a head dim the CUDA block has no kernels for
// (16, 48, 80, 160, 320), or of a v_head_dim of its own other than 192/128: forward, backward
// prepare and backward return RINGATTN_ERROR_UNSUPPORTED with a message naming the head dims and
// those the block takes, before any CUDA call. The
// descriptors hold addresses that nothing may read, so the check must come before the memory, the
// GPU or a launch is touched: this runs on any machine, with or without a GPU. (The ring's calls
// check the same on every rank first: tests/parallel/mpi_ring_head_dims.cpp.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "ringattn/config.h"
#include "ringattn/ringattn.h"
#include "tests/common/c_api_testing.hpp"
#include "tests/common/head_dims.hpp"

namespace {

using ringattn::test::built_cuda_head_dims_text;
using ringattn::test::kBuiltCudaHeadDims;
using ringattn::test::kNoCudaHeadDims;

// A contiguous device descriptor of `shape` at a made-up, 256-byte aligned address (tensor
// `index` of the call gets its own gigabyte, so no two overlap).
ringattn_tensor_t device_tensor(int32_t dtype, std::initializer_list<std::int64_t> shape,
                                int index) {
  return ringattn::test::describe_device_at(reinterpret_cast<void*>(std::uintptr_t{0x7f0000000000} +
                                                          (static_cast<std::uintptr_t>(index) << 30)),
                                  dtype, shape);
}

// Every descriptor of one call of each kind for [B, S, H, D] inputs of `dtype` (fp32 statistics
// and gradients; V, O, dO and dV of Dv, 0 meaning D), all else valid.
struct DeviceCall {
  static constexpr std::int64_t B = 2, S = 17, Hq = 4, Hkv = 2;
  int32_t dtype;
  std::int64_t D;
  std::int64_t Dv = 0;

  std::int64_t value_dim() const { return Dv > 0 ? Dv : D; }
  ringattn_tensor_t queries(int index) const { return device_tensor(dtype, {B, S, Hq, D}, index); }
  ringattn_tensor_t keys(int index) const { return device_tensor(dtype, {B, S, Hkv, D}, index); }
  ringattn_tensor_t outputs(int index) const {
    return device_tensor(dtype, {B, S, Hq, value_dim()}, index);
  }
  ringattn_tensor_t values(int index) const {
    return device_tensor(dtype, {B, S, Hkv, value_dim()}, index);
  }
  ringattn_tensor_t rows(int index) const { return device_tensor(RINGATTN_F32, {B, Hq, S}, index); }

  ringattn_forward_params_t forward() const {
    ringattn_forward_params_t p{};
    p.struct_size = sizeof(p);
    p.q = queries(0);
    p.k = keys(1);
    p.v = values(2);
    p.o = outputs(3);
    p.lse = rows(4);
    p.scale = 1.0 / std::sqrt(static_cast<double>(D));
    p.causal = 1;
    return p;
  }

  ringattn_backward_params_t backward() const {
    ringattn_backward_params_t p{};
    p.struct_size = sizeof(p);
    p.q = queries(0);
    p.k = keys(1);
    p.v = values(2);
    p.dout = outputs(3);
    p.lse = rows(4);
    p.delta = rows(5);
    p.dq = device_tensor(RINGATTN_F32, {B, S, Hq, D}, 6);
    p.dk = device_tensor(RINGATTN_F32, {B, S, Hkv, D}, 7);
    p.dv = device_tensor(RINGATTN_F32, {B, S, Hkv, value_dim()}, 8);
    p.scale = 1.0 / std::sqrt(static_cast<double>(D));
    p.causal = 1;
    return p;
  }
};

// The three calls, each by name, on `call`'s descriptors.
struct NamedStatus {
  const char* name;
  ringattn_status_t status;
  std::string message;
};

template <typename Check>
void for_each_call(const DeviceCall& call, Check&& check) {
  const ringattn_forward_params_t forward = call.forward();
  ringattn_status_t status = ringattn_attention_forward(&forward, nullptr);
  check(NamedStatus{"ringattn_attention_forward", status, ringattn_last_error()});

  const ringattn_tensor_t o = call.queries(3), dout = call.queries(4), delta = call.rows(5);
  status = ringattn_attention_backward_prepare(&o, &dout, &delta, nullptr);
  check(NamedStatus{"ringattn_attention_backward_prepare", status, ringattn_last_error()});

  const ringattn_backward_params_t backward = call.backward();
  status = ringattn_attention_backward(&backward, nullptr);
  check(NamedStatus{"ringattn_attention_backward", status, ringattn_last_error()});
}

std::string dtype_text(int32_t dtype) {
  return dtype == RINGATTN_BF16 ? "bf16" : "f16";
}

TEST(CApiHeadDims, UnsupportedHeadDimsAreRefusedBeforeAnyCudaCall) {
  for (const int32_t dtype : {RINGATTN_BF16, RINGATTN_F16}) {
    for (const std::int64_t head_dim : kNoCudaHeadDims) {
      for_each_call(DeviceCall{dtype, head_dim}, [&](const NamedStatus& result) {
        SCOPED_TRACE(std::string(result.name) + ", " + dtype_text(dtype) + ", head_dim " +
                     std::to_string(head_dim) + ": \"" + result.message + "\"");
        EXPECT_EQ(result.status, RINGATTN_ERROR_UNSUPPORTED);
#if RINGATTN_WITH_CUDA
        const std::string named = "head_dim " + std::to_string(head_dim) + " is not supported";
        EXPECT_NE(result.message.find(named), std::string::npos);
        EXPECT_NE(result.message.find("the CUDA block takes " + built_cuda_head_dims_text()),
                  std::string::npos);
#else
        // Without the CUDA backend no device call runs, whatever its head dim: the message says so.
        EXPECT_NE(result.message.find("built without CUDA"), std::string::npos);
#endif
      });
    }
  }
}

// The head dims the block has pass that check: the same calls fail later, for the made-up
// addresses or the missing GPU (or CUDA), never for the head dim.
TEST(CApiHeadDims, SupportedHeadDimsPassTheHeadDimCheck) {
  for (const int32_t dtype : {RINGATTN_BF16, RINGATTN_F16}) {
    for (const std::int64_t head_dim : kBuiltCudaHeadDims) {
      for_each_call(DeviceCall{dtype, head_dim}, [&](const NamedStatus& result) {
        SCOPED_TRACE(std::string(result.name) + ", " + dtype_text(dtype) + ", head_dim " +
                     std::to_string(head_dim) + ": \"" + result.message + "\"");
        EXPECT_NE(result.status, RINGATTN_SUCCESS);
        EXPECT_EQ(result.message.find("is not supported; the CUDA block takes"), std::string::npos);
      });
    }
  }
}

// V of a head dim of its own (d_v != d_qk, each alone supported or not) other than the one pair
// with kernels, 192/128: forward and backward return RINGATTN_ERROR_UNSUPPORTED naming both head
// dims and the pairs taken, before any CUDA call. (The CPU block takes them:
// tests/src/cpu_c_api.cpp.)
TEST(CApiHeadDims, ValueHeadDimOfItsOwnIsRefusedBeforeAnyCudaCall) {
  const std::pair<std::int64_t, std::int64_t> dims[] = {
      {128, 192}, {192, 64}, {256, 128}, {128, 64}, {64, 128}, {128, 96}};
  for (const int32_t dtype : {RINGATTN_BF16, RINGATTN_F16}) {
    for (const auto& [d, dv] : dims) {
      const DeviceCall call{dtype, d, dv};
      const ringattn_forward_params_t forward = call.forward();
      const ringattn_backward_params_t backward = call.backward();
      for (const bool is_forward : {true, false}) {
        const ringattn_status_t status = is_forward
                                             ? ringattn_attention_forward(&forward, nullptr)
                                             : ringattn_attention_backward(&backward, nullptr);
        const std::string message = ringattn_last_error();
        SCOPED_TRACE(std::string(is_forward ? "forward" : "backward") + ", " + dtype_text(dtype) +
                     ", head_dim " + std::to_string(d) + ", v_head_dim " + std::to_string(dv) +
                     ": \"" + message + "\"");
        EXPECT_EQ(status, RINGATTN_ERROR_UNSUPPORTED);
#if RINGATTN_WITH_CUDA
        EXPECT_NE(message.find(ringattn::test::cuda_value_dim_refusal(d, dv)), std::string::npos);
#else
        EXPECT_NE(message.find("built without CUDA"), std::string::npos);
#endif
      }
    }
  }
}

// Head dim 192 with v_head_dim 128 (multi-head latent attention) passes the check where the build
// has head dim 192: forward, the prepare of an O of 128 and backward fail later, for the made-up
// addresses or the missing GPU, never for the head dims. A build without head dim 192 refuses it
// as left out (RINGATTN_ERROR_UNSUPPORTED).
TEST(CApiHeadDims, TheValueHeadDimPairPassesTheHeadDimCheck) {
  using ringattn::test::kCudaPairHeadDim;
  using ringattn::test::kCudaPairValueDim;
  for (const int32_t dtype : {RINGATTN_BF16, RINGATTN_F16}) {
    const DeviceCall call{dtype, kCudaPairHeadDim, kCudaPairValueDim};
    const ringattn_forward_params_t forward = call.forward();
    const ringattn_backward_params_t backward = call.backward();
    const ringattn_tensor_t o = call.outputs(3), dout = call.outputs(4), delta = call.rows(5);
    for (int which = 0; which < 3; ++which) {
      const ringattn_status_t status =
          which == 0   ? ringattn_attention_forward(&forward, nullptr)
          : which == 1 ? ringattn_attention_backward_prepare(&o, &dout, &delta, nullptr)
                       : ringattn_attention_backward(&backward, nullptr);
      const std::string message = ringattn_last_error();
      SCOPED_TRACE(std::string(which == 0 ? "forward" : which == 1 ? "prepare" : "backward") +
                   ", " + dtype_text(dtype) + ": \"" + message + "\"");
      EXPECT_NE(status, RINGATTN_SUCCESS);
#if RINGATTN_WITH_CUDA
      if (ringattn::test::kBuiltCudaValueDimPair) {
        EXPECT_EQ(message.find("v has head_dim"), std::string::npos);
        EXPECT_EQ(message.find("left out"), std::string::npos);
        EXPECT_EQ(message.find("CUDA block takes"), std::string::npos);
      } else if (which != 1) {  // the prepare sees O alone: head dim 128, built or not
        EXPECT_EQ(status, RINGATTN_ERROR_UNSUPPORTED);
        EXPECT_NE(message.find(ringattn::test::cuda_value_dim_pair_left_out()), std::string::npos);
      }
#else
      EXPECT_NE(message.find("built without CUDA"), std::string::npos);
#endif
    }
  }
}

}  // namespace
