// Python bindings of the resharding engine (declarations, strict scalar arguments (py_scalar.h), and
// the GIL-held check that bound tensors did not move before a run; the planner checks its tables).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <tuple>

#include "bindings.h"
#include "py_scalar.h"
#include "py_tensor.h"
#include "reshard/fp8.h"
#include "reshard/reshard.h"

namespace py = pybind11;

namespace vf {
namespace {

// Binding `given` (a list) again at bound slots [first, first + len) would change nothing: each is the
// object bind() took, or a tensor viewing exactly its elements, and the bound one still points where
// it did (unless check_memory is false: run checks that again). Needs the GIL.
bool same_as_bound(const reshard::Plan& p, const pybind11::list& given, size_t first, bool check_memory) {
  const auto& bound = p.bound();
  for (size_t i = 0; i < given.size(); ++i) {
    PyObject* obj = PyList_GET_ITEM(given.ptr(), i);
    const TensorRef& t = bound[first + i];
    if (!t.owner) return false;
    if (static_cast<const PyTensorOwner*>(t.owner.get())->tensor != obj && !views_same(obj, t)) return false;
    if (check_memory && !still_bound(t)) return false;
  }
  return true;
}

}  // namespace

void bind_reshard(py::module_& m) {
  using namespace reshard;
  py::enum_<Phase>(m, "ReshardPhase")
      .value("pack", Phase::pack)
      .value("copy", Phase::copy)
      .value("copy_local", Phase::copy_local)
      .value("copy_received", Phase::copy_received);
  // Column counts of the int64 tables Python builds (the column order is reshard.h's).
  m.attr("reshard_piece_cols") = static_cast<int>(kPieceCols);
  m.attr("reshard_tensor_cols") = static_cast<int>(kTensorCols);

  py::class_<PlanArgs> args(m, "ReshardPlanArgs");
  args.def(py::init<>());
#define VF_BIND(type, name, init, doc) bind_field(args, #name, &PlanArgs::name, doc);
  VF_PLAN_ARGS_FIELDS(VF_BIND)
#undef VF_BIND

  auto messages = [](const std::vector<Message>& ms) {
    std::vector<std::tuple<int64_t, int64_t, int64_t>> out;
    for (const auto& x : ms) out.emplace_back(x.peer, x.offset, x.bytes);
    return out;
  };
  py::class_<Plan>(m, "ReshardPlan")
      .def(py::init<const PlanArgs&>(), py::arg("args"), py::call_guard<py::gil_scoped_release>(),
           "Plans one rank's copies and messages; see csrc/reshard/reshard.h")
      .def_property_readonly("rank", &Plan::rank)
      .def_property_readonly("world_size", &Plan::world_size)
      .def_property_readonly("num_buckets", &Plan::num_buckets)
      .def_property_readonly("local_sources", &Plan::local_sources)
      .def_property_readonly("local_destinations", &Plan::local_destinations)
      .def_property_readonly("max_send_bytes", &Plan::max_send_bytes)
      .def_property_readonly("max_recv_bytes", &Plan::max_recv_bytes)
      .def_property_readonly("local_bytes", &Plan::local_bytes)
      .def_property_readonly("received_bytes", &Plan::received_bytes)
      .def_property_readonly("zero_bytes", &Plan::zero_bytes)
      .def_property_readonly("num_segments", [](const Plan& p) { return p.segments().size(); })
      .def_property_readonly("num_tiles", [](const Plan& p) { return p.tiles().size(); })
      .def("sends", [messages](const Plan& p, py::handle b) { return messages(p.bucket(strict_int(b, "bucket")).sends); },
           py::arg("bucket"), "(peer, byte offset in the send slot, bytes) of each message")
      .def("recvs", [messages](const Plan& p, py::handle b) { return messages(p.bucket(strict_int(b, "bucket")).recvs); },
           py::arg("bucket"), "(peer, byte offset in the receive slot, bytes) of each message")
      .def("groups", [](const Plan& p, py::handle b) { return p.bucket(strict_int(b, "bucket")).groups; },
           py::arg("bucket"))
      .def("bind", &Plan::bind, py::arg("sources"), py::arg("destinations"), py::arg("send_slots"),
           py::arg("recv_slots"))
      .def("bind_destinations_in", &Plan::bind_destinations_in, py::arg("buffer"), py::arg("offsets"),
           "Binds new destinations as slices of one buffer (element offsets), keeping the bound sources")
      .def(
          "is_bound",
          [](const Plan& p, const py::list& sources, const py::list& destinations, py::handle check) {
            const bool check_memory = strict_bool(check, "check_memory");
            const size_t S = p.local_sources().size(), D = p.local_destinations().size();
            if (p.bound().size() < S + D || sources.size() != S || destinations.size() != D) return false;
            return same_as_bound(p, sources, 0, check_memory) && same_as_bound(p, destinations, S, check_memory);
          },
          py::arg("sources"), py::arg("destinations"), py::arg("check_memory") = true,
          "Whether running what bind() holds would run on these lists' tensors: each the object bound, or "
          "one viewing exactly its elements, the bound one unmoved (check_memory=False: the memory is left "
          "to run's check)")
      .def(
          "sources_bound",
          [](const Plan& p, const py::list& sources) {
            const size_t S = p.local_sources().size();
            return p.bound().size() >= S && sources.size() == S && same_as_bound(p, sources, 0, true);
          },
          py::arg("sources"), "is_bound for the sources alone (the destinations may be bound anew)")
      .def(
          "run",
          [](Plan& p, py::handle bucket_arg, Phase phase, CudaStream stream, py::handle threads_arg) {
            const int64_t bucket = strict_int(bucket_arg, "bucket");
            const int num_threads = strict_scalar<int>(threads_arg, "num_threads");
            VF_CHECK(num_threads >= 0, "num_threads must be >= 0 (0: all cores), got ", num_threads);
            // The tensors this run touches are still where bind() found them (checked holding the GIL).
            if (!p.bound().empty()) {
              for (int32_t i : p.touched(bucket, phase))
                VF_CHECK(still_bound(p.bound()[i]), p.bound_name(i),
                         ": the tensor's memory changed since bind() (set_, resize_ or a freed storage); bind again");
            }
            py::gil_scoped_release nogil;
            p.run(bucket, phase, stream, num_threads);
          },
          py::arg("bucket"), py::arg("phase"), py::arg("stream") = py::none(), py::arg("num_threads") = 0,
          "Runs the pack or copy phase of one bucket (one CUDA launch on `stream`, a torch.cuda.Stream or "
          "None for the default stream; or CPU threads)");
  m.def(
      "fp8_quantize",
      [](const TensorRef& src, const TensorRef& dst, const TensorRef& scale, py::handle block_rows,
         py::handle block_cols, CudaStream stream, py::handle threads) {
        const int64_t br = strict_int(block_rows, "block_rows"), bc = strict_int(block_cols, "block_cols");
        const int num_threads = strict_scalar<int>(threads, "num_threads");
        py::gil_scoped_release nogil;
        fp8_quantize(src, dst, scale, br, bc, stream, num_threads);
      },
      py::arg("src"), py::arg("dst"), py::arg("scale"), py::arg("block_rows"), py::arg("block_cols"),
      py::arg("stream") = py::none(), py::arg("num_threads") = 0,
      "FP8 e4m3 quantisation of src [rows, cols] into dst (uint8 bytes) with one float32 scale per block "
      "(block_cols 0: per row); see csrc/reshard/fp8.h");
  m.def(
      "fp8_quantize_many",
      [](const py::list& srcs, const py::list& dsts, const py::list& scales, py::handle block_rows,
         py::handle block_cols, CudaStream stream, py::handle threads) {
        const int64_t br = strict_int(block_rows, "block_rows"), bc = strict_int(block_cols, "block_cols");
        const int num_threads = strict_scalar<int>(threads, "num_threads");
        VF_CHECK(dsts.size() == srcs.size() && scales.size() == srcs.size(), "srcs, dsts and scales must be as long, "
                 "got ", srcs.size(), ", ", dsts.size(), " and ", scales.size());
        std::vector<TensorRef> held;  // the tensors stay referenced until the launches are queued
        std::vector<Fp8Job> jobs;
        // on CUDA the jobs are queued a launch's worth at a time: the GPU starts while the rest are read from
        // Python; a bad tensor is named after the ones before it were queued
        auto run = [&]() {
          py::gil_scoped_release nogil;
          fp8_quantize_jobs(jobs, held[0].device, held[0].device_index, stream, num_threads);
          jobs.clear();
        };
        for (size_t i = 0; i < srcs.size(); ++i) {
          const std::string what = "[" + std::to_string(i) + "]";
          held.push_back(tensor_ref_from_py(srcs[i]));
          held.push_back(tensor_ref_from_py(dsts[i]));
          held.push_back(tensor_ref_from_py(scales[i]));
          const TensorRef &s = held[held.size() - 3], &d = held[held.size() - 2], &sc = held.back();
          check_same_device(held[0], "srcs[0]", s, ("srcs" + what).c_str());
          jobs.push_back(fp8_job(s, d, sc, br, bc, what));
          if (held[0].device == Device::cuda && jobs.size() == static_cast<size_t>(kFp8BatchJobs)) run();
        }
        if (!jobs.empty()) run();
      },
      py::arg("srcs"), py::arg("dsts"), py::arg("scales"), py::arg("block_rows"), py::arg("block_cols"),
      py::arg("stream") = py::none(), py::arg("num_threads") = 0,
      "fp8_quantize of each srcs[i] into dsts[i] and scales[i] (one block shape, destinations disjoint), in "
      "as few CUDA launches as fp8.h allows; see csrc/reshard/fp8.h");
}

}  // namespace vf
