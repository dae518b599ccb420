#include "ringattn/tensor.hpp"

#include "ringattn/error.hpp"
#include "src/checked_size.hpp"

namespace ringattn {

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                                  Memory memory) {
  if (shape.size() > static_cast<std::size_t>(kMaxRank)) {
    detail::fail("TensorView::contiguous", "rank ", shape.size(), " exceeds the maximum of ",
                 kMaxRank);
  }
  TensorView view;
  view.data = data;
  view.dtype = dtype;
  view.memory = memory;
  view.rank = static_cast<int>(shape.size());
  int axis = 0;
  for (std::int64_t extent : shape) view.shape[axis++] = extent;
  std::int64_t stride = 1;
  for (int i = view.rank - 1; i >= 0; --i) {
    view.strides[i] = stride;
    stride =
        detail::checked_mul(stride, view.shape[i], "TensorView::contiguous", "a row-major stride");
  }
  return view;
}

TensorView TensorView::with_strides(std::initializer_list<std::int64_t> new_strides) const {
  if (static_cast<int>(new_strides.size()) != rank) {
    detail::fail("TensorView::with_strides", "got ", new_strides.size(), " strides for a rank-",
                 rank, " view");
  }
  TensorView view = *this;
  int axis = 0;
  for (std::int64_t stride : new_strides) view.strides[axis++] = stride;
  return view;
}

std::int64_t TensorView::numel() const {
  return detail::checked_elements(shape.data(), rank, "the view", "TensorView::numel");
}

bool TensorView::is_contiguous() const {
  std::int64_t expected = 1;
  for (int i = rank - 1; i >= 0; --i) {
    if (shape[i] != 1 && strides[i] != expected) return false;
    expected = detail::checked_mul(expected, shape[i], "TensorView::is_contiguous",
                                   "a row-major stride of the view");
  }
  return true;
}

std::string TensorView::describe() const {
  std::string out = detail::concat(dtype_name(dtype), "[");
  for (int i = 0; i < rank; ++i) out += detail::concat(i ? ", " : "", shape[i]);
  out += "] strides [";
  for (int i = 0; i < rank; ++i) out += detail::concat(i ? ", " : "", strides[i]);
  return out + "] on " + (memory == Memory::host ? "host" : "device");
}

}  // namespace ringattn
