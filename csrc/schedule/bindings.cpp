// Python bindings of the batch scheduler (declarations only; the functions check their inputs).
#include <pybind11/pybind11.h>

#include "bindings.h"
#include "py_tensor.h"
#include "schedule/schedule.h"

namespace py = pybind11;

namespace vf {

void bind_schedule(py::module_& m) {
  using namespace schedule;
  m.def("balance_partitions", &balance_partitions, py::arg("lengths"), py::arg("k"), py::arg("equal_size"),
        py::arg("linear"), py::arg("quadratic"), py::arg("order"), py::arg("offsets"), py::arg("costs"),
        py::call_guard<py::gil_scoped_release>(),
        "Karmarkar-Karp k-way partition of int64 lengths by cost linear*L + quadratic*L^2 into order/offsets/costs");
  m.def("pack_micro_batches", &pack_micro_batches, py::arg("lengths"), py::arg("max_tokens"),
        py::arg("min_count"), py::arg("padded"), py::arg("order"), py::arg("offsets"),
        py::call_guard<py::gil_scoped_release>(),
        "Token-budget micro-batches of int64 lengths into order/offsets; returns their count");
  m.def("rollout_buckets", &rollout_buckets, py::arg("prompt_lens"), py::arg("max_new_tokens"),
        py::arg("max_num_seqs"), py::arg("max_batch_tokens"), py::arg("max_model_len"), py::arg("max_length_ratio"),
        py::arg("order"), py::arg("offsets"), py::arg("wave_max_tokens"), py::call_guard<py::gil_scoped_release>(),
        "Rollout dispatch waves by prompt length into order/offsets/wave_max_tokens; returns their count");
}

}  // namespace vf
