// The driver's cuTensorMapEncodeTiled, reached through the runtime's entry-point query so that
// the library links against the runtime only.
#include "kernels/cuda/tma_descriptor.hpp"

#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdio>
#include <mutex>
#include <string>

namespace ringattn::cuda_detail {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_function() {
  static const PFN_cuTensorMapEncodeTiled_v12000 function = [] {
    void* pointer = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &pointer, 12000,
                                         cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      pointer = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(pointer);
  }();
  return function;
}

}  // namespace

bool make_row_tile_map(CUtensorMap& map, const char* name, const void* base,
                       const std::int64_t (&strides)[3], int batch, int len, int heads,
                       int head_dim, int box_rows) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = encode_function();
  constexpr std::int64_t kBytes = 2;  // bf16 and fp16
  // Innermost first: head_dim, row, head, batch. A dimension of extent 1 is never stepped, so its
  // stride only has to be one the driver accepts.
  const std::int64_t extents[4] = {head_dim, len, heads, batch};
  const std::int64_t element_strides[3] = {strides[1], strides[2], strides[0]};
  cuuint64_t dims[4];
  cuuint64_t byte_strides[3];
  bool positive = true;
  for (int axis = 0; axis < 4; ++axis) dims[axis] = static_cast<cuuint64_t>(extents[axis]);
  for (int axis = 0; axis < 3; ++axis) {
    const std::int64_t stride =
        extents[axis + 1] == 1 ? head_dim : element_strides[axis];
    positive = positive && stride > 0;
    byte_strides[axis] = static_cast<cuuint64_t>(stride * kBytes);
  }
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(box_rows), 1, 1};
  const cuuint32_t steps[4] = {1, 1, 1, 1};
  int result = -1;  // no entry point
  if (encode != nullptr && positive) {
    result = encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, const_cast<void*>(base), dims,
                    byte_strides, box, steps, CU_TENSOR_MAP_INTERLEAVE_NONE,
                    CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  }
  if (result == CUDA_SUCCESS) return true;
  static std::once_flag reported;
  std::call_once(reported, [&] {
    std::fprintf(stderr,
                 "ringattn: the driver cannot describe %s as a tensor map (%s; address %p, "
                 "[batch %d, len %d, heads %d, head_dim %d], element strides [%lld, %lld, "
                 "%lld, 1]): the sm_80 flash kernels run instead of the Hopper ones, slower "
                 "(reported once)\n",
                 name,
                 encode == nullptr ? "no cuTensorMapEncodeTiled entry point"
                 : !positive       ? "a stride is not positive"
                                   : ("driver error " + std::to_string(result)).c_str(),
                 base, batch, len, heads, head_dim, static_cast<long long>(strides[0]),
                 static_cast<long long>(strides[1]), static_cast<long long>(strides[2]));
  });
  return false;
}

}  // namespace ringattn::cuda_detail
