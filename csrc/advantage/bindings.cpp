// Python bindings of the advantage engine (declarations only; the launchers check their inputs).
#include <pybind11/pybind11.h>

#include "advantage/advantage.h"
#include "bindings.h"
#include "py_tensor.h"

namespace py = pybind11;

namespace vf {

void bind_advantage(py::module_& m) {
  using namespace advantage;
  py::enum_<ScanKind>(m, "ScanKind")
      .value("gae", ScanKind::gae)
      .value("reinforce_pp", ScanKind::reinforce_pp)
      .value("remax", ScanKind::remax);
  py::enum_<GroupKind>(m, "GroupKind")
      .value("grpo", GroupKind::grpo)
      .value("rloo", GroupKind::rloo)
      .value("reinforce_pp_baseline", GroupKind::reinforce_pp_baseline);
  py::enum_<Status>(m, "AdvantageStatus", py::arithmetic())
      .value("bad_rewards", kBadRewards)
      .value("bad_values", kBadValues)
      .value("too_few_to_whiten", kTooFewToWhiten);
  m.attr("status_words") = kStatusWords;

  py::class_<ScanArgs> scan(m, "ScanArgs");
  scan.def(py::init<>());
#define VF_BIND(type, name, init, doc) scan.def_readwrite(#name, &ScanArgs::name, doc);
  VF_SCAN_ARGS_FIELDS(VF_BIND)
#undef VF_BIND
  py::class_<GroupArgs> group(m, "GroupArgs");
  group.def(py::init<>());
#define VF_BIND(type, name, init, doc) group.def_readwrite(#name, &GroupArgs::name, doc);
  VF_GROUP_ARGS_FIELDS(VF_BIND)
#undef VF_BIND

  m.def("group_workspace_bytes", &group_workspace_bytes, py::arg("batch"));
  m.def("advantage_scan", &advantage_scan, py::arg("args"), py::call_guard<py::gil_scoped_release>(),
        "Reverse scan (GAE / REINFORCE++ / ReMax) over [B, T]; see ScanArgs");
  m.def("group_advantage", &group_advantage, py::arg("args"), py::call_guard<py::gil_scoped_release>(),
        "Group-baseline advantage (GRPO / RLOO / REINFORCE++-baseline); see GroupArgs");
}

}  // namespace vf
