// Python bindings of the advantage engine (declarations, strict scalar fields (py_scalar.h), and the
// GIL-held check that a record's tensors are still where they were assigned; the launchers check
// everything else).
#include <pybind11/pybind11.h>

#include "advantage/advantage.h"
#include "bindings.h"
#include "py_scalar.h"
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
      .value("too_few_to_whiten", kTooFewToWhiten)
      .value("bad_mask", kBadMask);
  m.attr("status_words") = kStatusWords;

  py::class_<ScanArgs> scan(m, "ScanArgs");
  scan.def(py::init<>());
#define VF_BIND(type, name, init, doc) bind_field(scan, #name, &ScanArgs::name, doc);
  VF_SCAN_ARGS_FIELDS(VF_BIND)
#undef VF_BIND
  py::class_<GroupArgs> group(m, "GroupArgs");
  group.def(py::init<>());
#define VF_BIND(type, name, init, doc) bind_field(group, #name, &GroupArgs::name, doc);
  VF_GROUP_ARGS_FIELDS(VF_BIND)
#undef VF_BIND

  m.def(
      "group_workspace_bytes", [](py::handle batch) { return group_workspace_bytes(strict_int(batch, "batch")); },
      py::arg("batch"));
  // Each launch first checks, holding the GIL, that the record's tensors still point where they did.
#define VF_CHECK_FIELD(type, name, init, doc) check_still_bound(a.name, #name);
  m.def(
      "advantage_scan",
      [](const ScanArgs& a) {
        VF_SCAN_ARGS_FIELDS(VF_CHECK_FIELD)
        py::gil_scoped_release nogil;
        advantage_scan(a);
      },
      py::arg("args"), "Reverse scan (GAE / REINFORCE++ / ReMax) over [B, T]; see ScanArgs");
  m.def(
      "group_advantage",
      [](const GroupArgs& a) {
        VF_GROUP_ARGS_FIELDS(VF_CHECK_FIELD)
        py::gil_scoped_release nogil;
        group_advantage(a);
      },
      py::arg("args"), "Group-baseline advantage (GRPO / RLOO / REINFORCE++-baseline); see GroupArgs");
#undef VF_CHECK_FIELD
}

}  // namespace vf
