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

// torch dtype objects are singletons: compare identities against a table built on first use.
inline DType dtype_of(pybind11::handle dtype) {
  namespace py = pybind11;
  struct Entry {
    const char* name;
    DType dtype;
    PyObject* object;
  };
  static Entry table[] = {{"float32", DType::f32, nullptr}, {"bfloat16", DType::bf16, nullptr},
                          {"float16", DType::f16, nullptr}, {"float64", DType::f64, nullptr},
                          {"int64", DType::i64, nullptr},   {"int32", DType::i32, nullptr},
                          {"uint8", DType::u8, nullptr},    {"bool", DType::boolean, nullptr}};
  static bool ready = false;
  if (!ready) {
    py::module_ torch = py::module_::import("torch");
    for (auto& e : table) e.object = py::object(torch.attr(e.name)).release().ptr();
    ready = true;
  }
  for (const auto& e : table)
    if (dtype.ptr() == e.object) return e.dtype;
  throw TypeError("unsupported tensor dtype " + std::string(py::str(dtype)));
}

inline TensorRef tensor_ref_from_py(pybind11::handle obj) {
  namespace py = pybind11;
  if (!py::hasattr(obj, "data_ptr") || !py::hasattr(obj, "stride") || !py::hasattr(obj, "get_device")) {
    throw TypeError(std::string("expected a torch.Tensor, got ") +
                    std::string(py::str(py::type::handle_of(obj).attr("__name__"))));
  }
  TensorRef t;
  t.dtype = dtype_of(obj.attr("dtype"));
  const int device = obj.attr("get_device")().cast<int>();  // -1 on the CPU
  if (device < 0) {
    if (!obj.attr("is_cpu").cast<bool>()) {
      throw TypeError("unsupported device " + std::string(py::str(obj.attr("device"))) + " (expected cpu or cuda)");
    }
    t.device = Device::cpu;
  } else {
    if (!obj.attr("is_cuda").cast<bool>()) {
      throw TypeError("unsupported device " + std::string(py::str(obj.attr("device"))) + " (expected cpu or cuda)");
    }
    t.device = Device::cuda;
  }
  t.device_index = device;
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
