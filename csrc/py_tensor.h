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

// Whether obj is exactly a torch.Tensor or nn.Parameter (no subclass: see the top of this file).
inline bool is_plain_tensor(pybind11::handle obj) {
  namespace py = pybind11;
  static PyObject* tensor_type = nullptr;
  static PyObject* parameter_type = nullptr;
  if (tensor_type == nullptr) {
    py::module_ torch = py::module_::import("torch");
    tensor_type = py::object(torch.attr("Tensor")).release().ptr();
    parameter_type = py::object(torch.attr("nn").attr("Parameter")).release().ptr();
  }
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr()));
  return type == tensor_type || type == parameter_type;
}

// The tensor and its untyped storage, both referenced for as long as a TensorRef holds them.
struct PyTensorOwner {
  PyObject* tensor;
  PyObject* storage;
};

inline std::string type_name(pybind11::handle obj) {
  return std::string(pybind11::str(pybind11::type::handle_of(obj).attr("__qualname__")));
}

// Attribute and method names, interned once: a tensor crossing into _C costs a handful of
// attribute lookups, not a string allocation each.
struct TensorAttrNames {
  PyObject *dtype, *get_device, *is_cpu, *is_cuda, *device, *shape, *stride, *data_ptr, *untyped_storage, *nbytes;
};
inline const TensorAttrNames& tensor_attr_names() {
  static const TensorAttrNames n{PyUnicode_InternFromString("dtype"),    PyUnicode_InternFromString("get_device"),
                                 PyUnicode_InternFromString("is_cpu"),   PyUnicode_InternFromString("is_cuda"),
                                 PyUnicode_InternFromString("device"),   PyUnicode_InternFromString("shape"),
                                 PyUnicode_InternFromString("stride"),   PyUnicode_InternFromString("data_ptr"),
                                 PyUnicode_InternFromString("untyped_storage"), PyUnicode_InternFromString("nbytes")};
  return n;
}

// obj.name and obj.name() as new references; a Python error propagates.
inline pybind11::object py_attr(pybind11::handle obj, PyObject* name) {
  PyObject* r = PyObject_GetAttr(obj.ptr(), name);
  if (r == nullptr) throw pybind11::error_already_set();
  return pybind11::reinterpret_steal<pybind11::object>(r);
}
inline pybind11::object py_call(pybind11::handle obj, PyObject* name) {
  PyObject* r = PyObject_CallMethodNoArgs(obj.ptr(), name);
  if (r == nullptr) throw pybind11::error_already_set();
  return pybind11::reinterpret_steal<pybind11::object>(r);
}

// A tuple of ints (torch.Size, a stride tuple) into `out`.
inline void int_tuple(pybind11::handle tuple, std::vector<int64_t>& out) {
  PyObject* t = tuple.ptr();
  if (!PyTuple_Check(t)) throw TypeError("expected a tuple of ints (a tensor's shape or strides)");
  const Py_ssize_t n = PyTuple_GET_SIZE(t);
  out.resize(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    out[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(t, i));
    if (out[i] == -1 && PyErr_Occurred()) throw pybind11::error_already_set();
  }
}

inline uint64_t py_uint(pybind11::handle x) {
  const unsigned long long v = PyLong_AsUnsignedLongLong(x.ptr());
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) throw pybind11::error_already_set();
  return v;
}

// The tensor's elements lie inside its storage: a storage resized to nothing (FSDP frees its
// unsharded parameters so) or shrunk under the tensor would otherwise be read out of bounds.
inline void check_inside_storage(const TensorRef& t, pybind11::handle storage) {
  if (t.numel() == 0) return;
  const auto& n = tensor_attr_names();
  int64_t last = 0;  // offset of the last element, in elements (torch strides are never negative)
  for (int d = 0; d < t.dim(); ++d) last += (t.sizes[d] - 1) * t.strides[d];
  const uint64_t base = py_uint(py_call(storage, n.data_ptr));
  const uint64_t bytes = py_uint(py_call(storage, n.nbytes));
  const auto begin = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(t.data));
  const uint64_t need = static_cast<uint64_t>(last + 1) * dtype_size(t.dtype);
  if (base == 0 || begin < base || begin - base > bytes || need > bytes - (begin - base)) {
    throw ValueError("a tensor of shape " + shape_str(t.sizes) + " lies outside its storage (" + std::to_string(bytes) +
                     " bytes): the storage was freed or resized to fewer bytes under it");
  }
}

inline TensorRef tensor_ref_from_py(pybind11::handle obj) {
  namespace py = pybind11;
  if (!is_plain_tensor(obj)) {
    if (PyObject_IsInstance(obj.ptr(), py::module_::import("torch").attr("Tensor").ptr()) == 1) {
      throw TypeError("expected a plain torch.Tensor, got the subclass " + type_name(obj) +
                      " (pass x.as_subclass(torch.Tensor), or a DTensor's to_local())");
    }
    throw TypeError("expected a torch.Tensor, got " + type_name(obj));
  }
  const auto& n = tensor_attr_names();
  TensorRef t;
  t.dtype = dtype_of(py_attr(obj, n.dtype));
  const long device = PyLong_AsLong(py_call(obj, n.get_device).ptr());  // -1 on the CPU
  if (device == -1 && PyErr_Occurred()) throw py::error_already_set();
  const bool ok = device < 0 ? PyObject_IsTrue(py_attr(obj, n.is_cpu).ptr()) == 1
                             : PyObject_IsTrue(py_attr(obj, n.is_cuda).ptr()) == 1;
  if (!ok) {
    throw TypeError("unsupported device " + std::string(py::str(py_attr(obj, n.device))) + " (expected cpu or cuda)");
  }
  t.device = device < 0 ? Device::cpu : Device::cuda;
  t.device_index = static_cast<int>(device);
  int_tuple(py_attr(obj, n.shape), t.sizes);
  int_tuple(py_call(obj, n.stride), t.strides);
  t.data = reinterpret_cast<void*>(static_cast<uintptr_t>(py_uint(py_call(obj, n.data_ptr))));
  py::object storage = py_call(obj, n.untyped_storage);
  check_inside_storage(t, storage);
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

// Whether the tensor behind `t` still points at the memory it was converted with (false after
// set_(), a reallocating resize_() or a storage resized to nothing). Needs the GIL.
inline bool still_bound(const TensorRef& t) {
  if (!t.owner) return true;
  const auto* o = static_cast<const PyTensorOwner*>(t.owner.get());
  PyObject* ptr = PyObject_CallMethodNoArgs(o->tensor, tensor_attr_names().data_ptr);
  if (ptr == nullptr) throw pybind11::error_already_set();
  const auto now = reinterpret_cast<char*>(PyLong_AsVoidPtr(ptr));
  Py_DECREF(ptr);
  return now + t.view_offset == t.data;
}

// Whether ints tuple `tuple` (a torch.Size or stride tuple) holds exactly `values`.
inline bool int_tuple_equals(pybind11::handle tuple, const std::vector<int64_t>& values) {
  PyObject* t = tuple.ptr();
  if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != static_cast<Py_ssize_t>(values.size())) return false;
  for (size_t i = 0; i < values.size(); ++i) {
    const long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(t, static_cast<Py_ssize_t>(i)));
    if (v == -1 && PyErr_Occurred()) throw pybind11::error_already_set();
    if (v != values[i]) return false;
  }
  return true;
}

// Whether obj, a tensor other than the one `t` was converted from, views the very elements `t`
// does: a plain tensor at the same address, with the same dtype, device, shape and strides
// (model.state_dict() gives such new objects at every call). Needs the GIL.
inline bool views_same(pybind11::handle obj, const TensorRef& t) {
  namespace py = pybind11;
  if (!is_plain_tensor(obj)) return false;
  const auto& n = tensor_attr_names();
  if (reinterpret_cast<void*>(static_cast<uintptr_t>(py_uint(py_call(obj, n.data_ptr)))) != t.data) return false;
  const long device = PyLong_AsLong(py_call(obj, n.get_device).ptr());
  if (device == -1 && PyErr_Occurred()) throw py::error_already_set();
  if (device != t.device_index || (device < 0 && PyObject_IsTrue(py_attr(obj, n.is_cpu).ptr()) != 1)) return false;
  py::object dtype = py_attr(obj, n.dtype);
  try {
    if (dtype_of(dtype) != t.dtype) return false;
  } catch (const TypeError&) {
    return false;
  }
  return int_tuple_equals(py_attr(obj, n.shape), t.sizes) && int_tuple_equals(py_call(obj, n.stride), t.strides);
}

// An argument record's field, checked before a launch (non-tensor fields pass).
template <typename T>
inline void check_still_bound(const T&, const char*) {}
inline void check_still_bound(const TensorRef& t, const char* name) {
  VF_CHECK(still_bound(t), name, ": the tensor's memory changed since it was assigned (set_, resize_ or a ",
           "freed storage); assign it again");
}

}  // namespace vf

namespace pybind11::detail {
// torch.cuda.Stream (ExternalStream included) or None -> vf::CudaStream; integers are refused.
template <>
struct type_caster<vf::CudaStream> {
  PYBIND11_TYPE_CASTER(vf::CudaStream, const_name("torch.cuda.Stream | None"));
  bool load(handle src, bool) {
    value.handle = 0;
    if (src.is_none()) return true;
    static PyObject* stream_type = nullptr;
    if (stream_type == nullptr) {
      stream_type = object(module_::import("torch.cuda").attr("Stream")).release().ptr();
    }
    if (PyObject_IsInstance(src.ptr(), stream_type) != 1) {
      throw vf::TypeError("stream must be a torch.cuda.Stream or None, got " + vf::type_name(src));
    }
    value.handle = src.attr("cuda_stream").cast<uintptr_t>();
    return true;
  }
  static handle cast(const vf::CudaStream& s, return_value_policy, handle) {
    if (s.handle == 0) return none().release();
    return PyLong_FromVoidPtr(reinterpret_cast<void*>(s.handle));
  }
};

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
