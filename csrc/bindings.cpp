// verl_fast._C: declarations only. Each area's launchers validate their arguments themselves.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "advantage/advantage.h"
#include "py_tensor.h"
#include "schedule/schedule.h"
#include "reshard/reshard.h"

namespace py = pybind11;
using namespace vf;

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

  // ---- advantage engine ----
  py::enum_<advantage::ScanKind>(m, "ScanKind")
      .value("gae", advantage::ScanKind::gae)
      .value("reinforce_pp", advantage::ScanKind::reinforce_pp)
      .value("remax", advantage::ScanKind::remax);
  py::enum_<advantage::GroupKind>(m, "GroupKind")
      .value("grpo", advantage::GroupKind::grpo)
      .value("rloo", advantage::GroupKind::rloo)
      .value("reinforce_pp_baseline", advantage::GroupKind::reinforce_pp_baseline);
  py::class_<advantage::ScanArgs>(m, "ScanArgs")
      .def(py::init<>())
      .def_readwrite("kind", &advantage::ScanArgs::kind)
      .def_readwrite("rewards", &advantage::ScanArgs::rewards)
      .def_readwrite("values", &advantage::ScanArgs::values)
      .def_readwrite("baselines", &advantage::ScanArgs::baselines)
      .def_readwrite("mask", &advantage::ScanArgs::mask)
      .def_readwrite("advantages", &advantage::ScanArgs::advantages)
      .def_readwrite("returns", &advantage::ScanArgs::returns)
      .def_readwrite("status", &advantage::ScanArgs::status)
      .def_readwrite("gamma", &advantage::ScanArgs::gamma)
      .def_readwrite("lam", &advantage::ScanArgs::lam)
      .def_readwrite("whiten", &advantage::ScanArgs::whiten)
      .def_readwrite("num_threads", &advantage::ScanArgs::num_threads)
      .def_readwrite("stream", &advantage::ScanArgs::stream);
  py::class_<advantage::GroupArgs>(m, "GroupArgs")
      .def(py::init<>())
      .def_readwrite("kind", &advantage::GroupArgs::kind)
      .def_readwrite("rewards", &advantage::GroupArgs::rewards)
      .def_readwrite("mask", &advantage::GroupArgs::mask)
      .def_readwrite("ids", &advantage::GroupArgs::ids)
      .def_readwrite("advantages", &advantage::GroupArgs::advantages)
      .def_readwrite("workspace", &advantage::GroupArgs::workspace)
      .def_readwrite("status", &advantage::GroupArgs::status)
      .def_readwrite("epsilon", &advantage::GroupArgs::epsilon)
      .def_readwrite("norm_by_std", &advantage::GroupArgs::norm_by_std)
      .def_readwrite("whiten", &advantage::GroupArgs::whiten)
      .def_readwrite("num_threads", &advantage::GroupArgs::num_threads)
      .def_readwrite("stream", &advantage::GroupArgs::stream);
  m.attr("status_words") = advantage::kStatusWords;
  m.def("group_workspace_bytes", &advantage::group_workspace_bytes, py::arg("batch"));
  m.def("advantage_scan", &advantage::advantage_scan, py::arg("args"), py::call_guard<py::gil_scoped_release>(),
        "Reverse scan (GAE / REINFORCE++ / ReMax) over [B, T]; see ScanArgs");
  m.def("group_advantage", &advantage::group_advantage, py::arg("args"), py::call_guard<py::gil_scoped_release>(),
        "Group-baseline advantage (GRPO / RLOO / REINFORCE++-baseline); see GroupArgs");

  // ---- schedule ----
  m.def("balance_partitions", &schedule::balance_partitions, py::arg("lengths"), py::arg("k"), py::arg("equal_size"),
        py::arg("linear"), py::arg("quadratic"), py::arg("order"), py::arg("offsets"), py::arg("costs"),
        py::call_guard<py::gil_scoped_release>(),
        "Karmarkar-Karp k-way partition of int64 lengths by cost linear*L + quadratic*L^2 into order/offsets/costs");
  m.def("pack_micro_batches", &schedule::pack_micro_batches, py::arg("lengths"), py::arg("max_tokens"),
        py::arg("min_count"), py::arg("padded"), py::arg("order"), py::arg("offsets"),
        py::call_guard<py::gil_scoped_release>(),
        "Token-budget micro-batches of int64 lengths into order/offsets; returns their count");
  m.def("rollout_buckets", &schedule::rollout_buckets, py::arg("prompt_lens"), py::arg("max_new_tokens"),
        py::arg("max_num_seqs"), py::arg("max_batch_tokens"), py::arg("max_model_len"), py::arg("max_length_ratio"),
        py::arg("order"), py::arg("offsets"), py::arg("wave_max_tokens"), py::call_guard<py::gil_scoped_release>(),
        "Rollout dispatch waves by prompt length into order/offsets/wave_max_tokens; returns their count");
  // ---- resharding engine ----
  py::enum_<reshard::Phase>(m, "ReshardPhase")
      .value("pack", reshard::Phase::pack)
      .value("copy", reshard::Phase::copy)
      .value("copy_local", reshard::Phase::copy_local)
      .value("copy_received", reshard::Phase::copy_received);
  py::class_<reshard::PlanArgs>(m, "ReshardPlanArgs")
      .def(py::init<>())
      .def_readwrite("logical_shapes", &reshard::PlanArgs::logical_shapes)
      .def_readwrite("logical_names", &reshard::PlanArgs::logical_names)
      .def_readwrite("src_tensors", &reshard::PlanArgs::src_tensors)
      .def_readwrite("src_pieces", &reshard::PlanArgs::src_pieces)
      .def_readwrite("dst_tensors", &reshard::PlanArgs::dst_tensors)
      .def_readwrite("dst_pieces", &reshard::PlanArgs::dst_pieces)
      .def_readwrite("src_names", &reshard::PlanArgs::src_names)
      .def_readwrite("dst_names", &reshard::PlanArgs::dst_names)
      .def_readwrite("rank", &reshard::PlanArgs::rank)
      .def_readwrite("world_size", &reshard::PlanArgs::world_size)
      .def_readwrite("bucket_bytes", &reshard::PlanArgs::bucket_bytes)
      .def_readwrite("tile_bytes", &reshard::PlanArgs::tile_bytes);
  auto messages = [](const std::vector<reshard::Message>& ms) {
    std::vector<std::tuple<int64_t, int64_t, int64_t>> out;
    for (const auto& x : ms) out.emplace_back(x.peer, x.offset, x.bytes);
    return out;
  };
  py::class_<reshard::Plan>(m, "ReshardPlan")
      .def(py::init<const reshard::PlanArgs&>(), py::arg("args"), py::call_guard<py::gil_scoped_release>(),
           "Plans one rank's copies and messages; see csrc/reshard/reshard.h")
      .def_property_readonly("rank", &reshard::Plan::rank)
      .def_property_readonly("world_size", &reshard::Plan::world_size)
      .def_property_readonly("num_buckets", &reshard::Plan::num_buckets)
      .def_property_readonly("local_sources", &reshard::Plan::local_sources)
      .def_property_readonly("local_destinations", &reshard::Plan::local_destinations)
      .def_property_readonly("max_send_bytes", &reshard::Plan::max_send_bytes)
      .def_property_readonly("max_recv_bytes", &reshard::Plan::max_recv_bytes)
      .def_property_readonly("local_bytes", &reshard::Plan::local_bytes)
      .def_property_readonly("received_bytes", &reshard::Plan::received_bytes)
      .def_property_readonly("zero_bytes", &reshard::Plan::zero_bytes)
      .def_property_readonly("num_segments", [](const reshard::Plan& p) { return p.segments().size(); })
      .def_property_readonly("num_tiles", [](const reshard::Plan& p) { return p.tiles().size(); })
      .def("sends", [messages](const reshard::Plan& p, int64_t b) { return messages(p.bucket(b).sends); },
           py::arg("bucket"), "(peer, byte offset in the send slot, bytes) of each message")
      .def("recvs", [messages](const reshard::Plan& p, int64_t b) { return messages(p.bucket(b).recvs); },
           py::arg("bucket"), "(peer, byte offset in the receive slot, bytes) of each message")
      .def("groups", [](const reshard::Plan& p, int64_t b) { return p.bucket(b).groups; }, py::arg("bucket"))
      .def("bind", &reshard::Plan::bind, py::arg("sources"), py::arg("destinations"), py::arg("send_slots"),
           py::arg("recv_slots"))
      .def("run", &reshard::Plan::run, py::arg("bucket"), py::arg("phase"), py::arg("stream") = 0,
           py::arg("num_threads") = 0, py::call_guard<py::gil_scoped_release>(),
           "Runs the pack or copy phase of one bucket (one CUDA launch, or CPU threads)");
}
