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


// Encodes the [batch, len, heads, head_dim] view at `base` (element strides batch, row, head; unit
// along head_dim) as a 4D tensor map of `element_bytes`-byte elements with boxes of
// [box_rows, 128 / element_bytes] in the 128-byte swizzle. Returns the driver's result, or -1
// without an entry point or with a stride that is not positive; `why` then says which.
int encode_row_tile_map(CUtensorMap& map, CUtensorMapDataType type, int element_bytes,
                        const void* base, const std::int64_t (&strides)[3], int batch, int len,
                        int heads, int head_dim, int box_rows, std::string& why) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = encode_function();
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
    byte_strides[axis] = static_cast<cuuint64_t>(stride * element_bytes);
  }
  const cuuint32_t box[4] = {static_cast<cuuint32_t>(128 / element_bytes),
                             static_cast<cuuint32_t>(box_rows), 1, 1};
  const cuuint32_t steps[4] = {1, 1, 1, 1};
  if (encode == nullptr) {
    why = "no cuTensorMapEncodeTiled entry point";
    return -1;
  }
  if (!positive) {
    why = "a stride is not positive";
    return -1;
  }
  const int result =
      encode(&map, type, 4, const_cast<void*>(base), dims, byte_strides, box, steps,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS) why = "driver error " + std::to_string(result);
  return result;
}

}  // namespace

bool make_row_tile_map(CUtensorMap& map, const char* name, const void* base,
                       const std::int64_t (&strides)[3], int batch, int len, int heads,
                       int head_dim, int box_rows) {
  std::string why;
  // bf16 and fp16 alike: the copies move bits.
  if (encode_row_tile_map(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, base, strides, batch, len,
                          heads, head_dim, box_rows, why) == CUDA_SUCCESS) {
    return true;
  }
  static std::once_flag reported;
  std::call_once(reported, [&] {
    std::fprintf(stderr,
                 "ringattn: the driver cannot describe %s as a tensor map (%s; address %p, "
                 "[batch %d, len %d, heads %d, head_dim %d], element strides [%lld, %lld, "
                 "%lld, 1]): the sm_80 flash kernels run instead of the Hopper ones, slower "
                 "(reported once)\n",
                 name, why.c_str(), base, batch, len, heads, head_dim,
                 static_cast<long long>(strides[0]), static_cast<long long>(strides[1]),
                 static_cast<long long>(strides[2]));
  });
  return false;
}

bool make_fp32_row_tile_map(CUtensorMap& map, void* base, const std::int64_t (&strides)[3],
                            int batch, int len, int heads, int head_dim, int box_rows) {
  std::string why;
  return encode_row_tile_map(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, base, strides, batch, len,
                             heads, head_dim, box_rows, why) == CUDA_SUCCESS;
}

}  // namespace ringattn::cuda_detail
