// The C API's local-block calls on device tensors of a head dim the CUDA block has no kernels for
// (32, 48, 96, 256): forward, backward prepare and backward return RINGATTN_ERROR_UNSUPPORTED with
// a message naming the head dim and the head dims the block takes, before any CUDA call. The
// descriptors hold addresses that nothing may read, so the check must come before the memory, the
// GPU or a launch is touched: this runs on any machine, with or without a GPU. (The ring's calls
// check the same on every rank first: tests/parallel/mpi_ring_head_dims.cpp.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "ringattn/config.h"
#include "ringattn/ringattn.h"

namespace {

constexpr std::int64_t kUnsupportedHeadDims[] = {32, 48, 96, 256};

// A contiguous device descriptor of `shape` at a made-up, 256-byte aligned address (tensor
// `index` of the call gets its own gigabyte, so no two overlap).
ringattn_tensor_t device_tensor(int32_t dtype, std::initializer_list<std::int64_t> shape,
                                int index) {
  ringattn_tensor_t t{};
  t.data = reinterpret_cast<void*>(std::uintptr_t{0x7f0000000000} +
                                   (static_cast<std::uintptr_t>(index) << 30));
  t.dtype = dtype;
  t.memory = RINGATTN_DEVICE;
  t.rank = static_cast<int32_t>(shape.size());
  int axis = 0;
  for (const std::int64_t extent : shape) t.shape[axis++] = extent;
  std::int64_t stride = 1;
  for (int i = t.rank - 1; i >= 0; --i) {
    t.strides[i] = stride;
    stride *= t.shape[i];
  }
  return t;
}

// Every descriptor of one call of each kind for [B, S, H, D] inputs of `dtype` (fp32 statistics
// and gradients), all else valid.
struct DeviceCall {
  static constexpr std::int64_t B = 2, S = 17, Hq = 4, Hkv = 2;
  int32_t dtype;
  std::int64_t D;

  ringattn_tensor_t queries(int index) const { return device_tensor(dtype, {B, S, Hq, D}, index); }
  ringattn_tensor_t keys(int index) const { return device_tensor(dtype, {B, S, Hkv, D}, index); }
  ringattn_tensor_t rows(int index) const { return device_tensor(RINGATTN_F32, {B, Hq, S}, index); }

  ringattn_forward_params_t forward() const {
    ringattn_forward_params_t p{};
    p.struct_size = sizeof(p);
    p.q = queries(0);
    p.k = keys(1);
    p.v = keys(2);
    p.o = queries(3);
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
    p.v = keys(2);
    p.dout = queries(3);
    p.lse = rows(4);
    p.delta = rows(5);
    p.dq = device_tensor(RINGATTN_F32, {B, S, Hq, D}, 6);
    p.dk = device_tensor(RINGATTN_F32, {B, S, Hkv, D}, 7);
    p.dv = device_tensor(RINGATTN_F32, {B, S, Hkv, D}, 8);
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
    for (const std::int64_t head_dim : kUnsupportedHeadDims) {
      for_each_call(DeviceCall{dtype, head_dim}, [&](const NamedStatus& result) {
        SCOPED_TRACE(std::string(result.name) + ", " + dtype_text(dtype) + ", head_dim " +
                     std::to_string(head_dim) + ": \"" + result.message + "\"");
        EXPECT_EQ(result.status, RINGATTN_ERROR_UNSUPPORTED);
#if RINGATTN_WITH_CUDA
        const std::string named = "head_dim " + std::to_string(head_dim) + " is not supported";
        EXPECT_NE(result.message.find(named), std::string::npos);
        EXPECT_NE(result.message.find("the CUDA block takes 64 or 128"), std::string::npos);
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
    for (const std::int64_t head_dim : {64, 128}) {
      for_each_call(DeviceCall{dtype, head_dim}, [&](const NamedStatus& result) {
        SCOPED_TRACE(std::string(result.name) + ", " + dtype_text(dtype) + ", head_dim " +
                     std::to_string(head_dim) + ": \"" + result.message + "\"");
        EXPECT_NE(result.status, RINGATTN_SUCCESS);
        EXPECT_EQ(result.message.find("is not supported; the CUDA block takes"), std::string::npos);
      });
    }
  }
}

}  // namespace
