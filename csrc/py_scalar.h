// Python scalars crossing into C++, strictly. pybind11's own conversions take True for an int
// (a bool is a Python int), 2.9 for a double field and 1 / 0.5 for a bool; here an integer takes a
// Python int (or numpy integer), never a bool or a float (2.9 is not 2); a float takes a real number
// that is not a bool; a flag takes True or False (numpy's bool too). Each error names the argument.
// Range and finiteness are the launchers' checks (a finite double may still narrow to a float inf).
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include "common/check.h"

namespace vf {

inline std::string py_type_name(pybind11::handle h) { return Py_TYPE(h.ptr())->tp_name; }

inline bool is_py_bool(pybind11::handle h) {
  return PyBool_Check(h.ptr()) || py_type_name(h) == std::string("numpy.bool") ||
         py_type_name(h) == std::string("numpy.bool_");
}

inline int64_t strict_int(pybind11::handle h, const char* name) {
  VF_CHECK_TYPE(!is_py_bool(h) && !PyFloat_Check(h.ptr()) && PyIndex_Check(h.ptr()), name,
                " must be an int, got ", py_type_name(h));
  int overflow = 0;
  pybind11::object index = pybind11::reinterpret_steal<pybind11::object>(PyNumber_Index(h.ptr()));
  if (!index) throw pybind11::error_already_set();
  const long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  VF_CHECK(overflow == 0, name, " must fit in int64");
  return static_cast<int64_t>(v);
}

inline double strict_float(pybind11::handle h, const char* name) {
  // a float, an int, or what defines __float__ (numpy numbers); str and bytes define none of these
  VF_CHECK_TYPE(!is_py_bool(h) && (PyFloat_Check(h.ptr()) || PyLong_Check(h.ptr()) ||
                                   PyObject_HasAttrString(h.ptr(), "__float__")),
                name, " must be a number, got ", py_type_name(h));
  const double v = PyFloat_AsDouble(h.ptr());
  if (v == -1.0 && PyErr_Occurred()) throw pybind11::error_already_set();
  return v;
}

inline bool strict_bool(pybind11::handle h, const char* name) {
  VF_CHECK_TYPE(is_py_bool(h), name, " must be True or False, got ", py_type_name(h));
  return PyObject_IsTrue(h.ptr()) == 1;
}

// Strict conversion of one scalar to T (an integer type, a floating type or bool), range-checked
// for integers narrower than int64.
template <typename T>
T strict_scalar(pybind11::handle h, const char* name) {
  if constexpr (std::is_same_v<T, bool>) {
    return strict_bool(h, name);
  } else if constexpr (std::is_integral_v<T>) {
    const int64_t v = strict_int(h, name);
    VF_CHECK(v >= static_cast<int64_t>(std::numeric_limits<T>::min()) &&
                 v <= static_cast<int64_t>(std::numeric_limits<T>::max()),
             name, " must fit in ", sizeof(T) * 8, " bits, got ", v);
    return static_cast<T>(v);
  } else {
    static_assert(std::is_floating_point_v<T>, "strict_scalar: an integer, floating or bool type");
    return static_cast<T>(strict_float(h, name));
  }
}

// A record's field as a Python attribute: scalars (int, float, bool fields) set through
// strict_scalar; every other type as pybind11 converts it.
template <typename Cls, typename Rec, typename T>
void bind_field(Cls& cls, const char* name, T Rec::*member, const char* doc) {
  if constexpr (std::is_arithmetic_v<T>) {
    cls.def_property(
        name, [member](const Rec& r) { return r.*member; },
        [member, name](Rec& r, pybind11::handle v) { r.*member = strict_scalar<T>(v, name); }, doc);
  } else {
    cls.def_readwrite(name, member, doc);
  }
}

}  // namespace vf
