// pybind11 conversion: a torch.Tensor (or nn.Parameter) becomes a vf::TensorRef. Reading the
// tensor's own metadata, rather than trusting sizes passed beside a raw pointer, is what stops a
// direct _C call with inconsistent sizes from reading out of bounds: every launcher checks the
// shapes it is given against each other. Only those two exact classes are accepted: any other
// object (a subclass included) could report a data_ptr, shape or strides of its own making.
// A TensorRef keeps the tensor and its storage alive, so memory bound into an argument record or
// a plan is never freed under it, even if the tensor is given another storage (set_) meanwhile;
// check_unchanged() tells the launch that the tensor no longer points where it did.
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

// The tensor and its untyped storage, both referenced for as long as a TensorRef holds them.
struct PyTensorOwner {
  PyObject* tensor;
  PyObject* storage;
};

inline std::string type_name(pybind11::handle obj) {
  return std::string(pybind11::str(pybind11::type::handle_of(obj).attr("__qualname__")));
}

inline TensorRef tensor_ref_from_py(pybind11::handle obj) {
  namespace py = pybind11;
  static PyObject* tensor_type = nullptr;
  static PyObject* parameter_type = nullptr;
  if (tensor_type == nullptr) {
    py::module_ torch = py::module_::import("torch");
    tensor_type = py::object(torch.attr("Tensor")).release().ptr();
    parameter_type = py::object(torch.attr("nn").attr("Parameter")).release().ptr();
  }
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr()));
  if (type != tensor_type && type != parameter_type) {
    if (PyObject_IsInstance(obj.ptr(), tensor_type) == 1) {
      throw TypeError("expected a plain torch.Tensor, got the subclass " + type_name(obj) +
                      " (pass x.as_subclass(torch.Tensor), or a DTensor's to_local())");
    }
    throw TypeError("expected a torch.Tensor, got " + type_name(obj));
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
  py::object storage = obj.attr("untyped_storage")();
  auto* owner = new PyTensorOwner{obj.inc_ref().ptr(), storage.release().ptr()};
  t.owner = std::shared_ptr<const void>(owner, [](const void* p) {
    auto* o = static_cast<PyTensorOwner*>(const_cast<void*>(p));
    py::gil_scoped_acquire gil;
    Py_DECREF(o->tensor);
    Py_DECREF(o->storage);
    delete o;
  });
  return t;
}

// Throws ValueError naming `what` when the tensor behind `t` no longer points at the memory it
// was bound with (set_(), resize_(), a storage resized). Needs the GIL.
inline void check_unchanged(const TensorRef& t, const std::string& what) {
  if (!t.owner) return;
  namespace py = pybind11;
  const auto* o = static_cast<const PyTensorOwner*>(t.owner.get());
  const auto now = py::handle(o->tensor).attr("data_ptr")().cast<uintptr_t>();
  if (now != reinterpret_cast<uintptr_t>(t.data) || (t.numel() > 0 && now == 0)) {
    throw ValueError(what + ": the tensor's memory changed since it was bound (set_, resize_ or a freed "
                     "storage); bind it again");
  }
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
