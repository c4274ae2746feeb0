// verl_fast._C: the module, its build facts, the error types and the dtype codes shared by every
// area; each area binds its own functions (bindings.h).
#include "bindings.h"

#include "common/check.h"
#include "common/tensor.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "verl_fast compiled core (no libtorch: tensors cross as pointer + shape + dtype + strides)";
  m.attr("__version__") = VF_VERSION;
#if defined(VF_WITH_CUDA)
  m.attr("has_cuda") = true;
  m.attr("cuda_archs") = VF_CUDA_ARCHS;
#else
  m.attr("has_cuda") = false;
  m.attr("cuda_archs") = "";
#endif
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const vf::TypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what());
    } catch (const vf::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });
  // The dtype codes of the tables Python builds for the planner, named as torch names its dtypes.
  py::enum_<vf::DType>(m, "DType")
      .value("float32", vf::DType::f32)
      .value("float64", vf::DType::f64)
      .value("bfloat16", vf::DType::bf16)
      .value("float16", vf::DType::f16)
      .value("int64", vf::DType::i64)
      .value("int32", vf::DType::i32)
      .value("uint8", vf::DType::u8)
      .value("bool", vf::DType::boolean);
  vf::bind_advantage(m);
  vf::bind_schedule(m);
  vf::bind_reshard(m);
}
