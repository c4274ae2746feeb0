// pybind11 conversion: any torch.Tensor (duck-typed: data_ptr(), shape, stride(), dtype, device)
// becomes a vf::TensorRef. Reading the tensor's own metadata, rather than trusting sizes passed
// beside a raw pointer, is what stops a direct _C call with inconsistent sizes from reading out
// of bounds: every launcher checks the shapes it is given against each other.
#pragma once
#include <pybind11/pybind11.h>

#include <string>

#include "common/check.h"
#include "common/tensor.h"

namespace vf {

inline DType dtype_from_name(const std::string& s) {
  if (s == "torch.float32") return DType::f32;
  if (s == "torch.float64") return DType::f64;
  if (s == "torch.bfloat16") return DType::bf16;
  if (s == "torch.float16") return DType::f16;
  if (s == "torch.int64") return DType::i64;
  if (s == "torch.int32") return DType::i32;
  if (s == "torch.uint8") return DType::u8;
  if (s == "torch.bool") return DType::boolean;
  throw TypeError("unsupported tensor dtype " + s);
}

inline TensorRef tensor_ref_from_py(pybind11::handle obj) {
  namespace py = pybind11;
  if (!py::hasattr(obj, "data_ptr") || !py::hasattr(obj, "stride") || !py::hasattr(obj, "device")) {
    throw TypeError(std::string("expected a torch.Tensor, got ") +
                    std::string(py::str(py::type::handle_of(obj).attr("__name__"))));
  }
  TensorRef t;
  t.dtype = dtype_from_name(py::str(obj.attr("dtype")));
  py::object dev = obj.attr("device");
  std::string dev_type = py::str(dev.attr("type"));
  if (dev_type == "cpu") {
    t.device = Device::cpu;
  } else if (dev_type == "cuda") {
    t.device = Device::cuda;
  } else {
    throw TypeError("unsupported device type " + dev_type + " (expected cpu or cuda)");
  }
  py::object idx = dev.attr("index");
  t.device_index = idx.is_none() ? (t.device == Device::cpu ? -1 : 0) : idx.cast<int>();
  for (auto s : py::tuple(obj.attr("shape"))) t.sizes.push_back(s.cast<int64_t>());
  for (auto s : py::tuple(obj.attr("stride")())) t.strides.push_back(s.cast<int64_t>());
  t.data = reinterpret_cast<void*>(obj.attr("data_ptr")().cast<uintptr_t>());
  t.owner = std::shared_ptr<const void>(obj.inc_ref().ptr(), [](const void* p) {
    py::gil_scoped_acquire gil;
    Py_DECREF(static_cast<PyObject*>(const_cast<void*>(p)));
  });
  return t;
}

}  // namespace vf

namespace pybind11::detail {
template <>
struct type_caster<vf::TensorRef> {
  PYBIND11_TYPE_CASTER(vf::TensorRef, const_name("torch.Tensor"));
  bool load(handle src, bool) {
    if (src.is_none()) return false;
    value = vf::tensor_ref_from_py(src);
    return true;
  }
  // Read back (argument records' fields): a description, never the memory.
  static handle cast(const vf::TensorRef& t, return_value_policy, handle) {
    pybind11::list shape;
    for (auto s : t.sizes) shape.append(s);
    return pybind11::make_tuple(vf::dtype_name(t.dtype), pybind11::tuple(shape)).release();
  }
};
}  // namespace pybind11::detail
