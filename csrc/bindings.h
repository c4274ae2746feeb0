// Each area's Python bindings, called once from the module definition in bindings.cpp.
#pragma once
#include <pybind11/pybind11.h>

namespace vf {
void bind_advantage(pybind11::module_& m);  // advantage/bindings.cpp
void bind_schedule(pybind11::module_& m);   // schedule/bindings.cpp
void bind_reshard(pybind11::module_& m);    // reshard/bindings.cpp
}  // namespace vf
