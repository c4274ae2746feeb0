// Python bindings of the batch scheduler (declarations with strict scalar arguments, py_scalar.h; the
// functions check their inputs).
#include <pybind11/pybind11.h>

#include "bindings.h"
#include "py_scalar.h"
#include "py_tensor.h"
#include "schedule/schedule.h"

namespace py = pybind11;

namespace vf {

void bind_schedule(py::module_& m) {
  using namespace schedule;
  // scalars as py::handle: strict_* refuse a bool or float for an int, a bool for a float (py_scalar.h)
  m.def(
      "balance_partitions",
      [](const TensorRef& lengths, py::handle k, py::handle equal_size, py::handle linear, py::handle quadratic,
         const TensorRef& order, const TensorRef& offsets, const TensorRef& costs) {
        const int64_t k_ = strict_int(k, "k"), linear_ = strict_int(linear, "linear");
        const int64_t quadratic_ = strict_int(quadratic, "quadratic");
        const bool equal = strict_bool(equal_size, "equal_size");
        py::gil_scoped_release nogil;
        balance_partitions(lengths, k_, equal, linear_, quadratic_, order, offsets, costs);
      },
      py::arg("lengths"), py::arg("k"), py::arg("equal_size"), py::arg("linear"), py::arg("quadratic"),
      py::arg("order"), py::arg("offsets"), py::arg("costs"),
      "Karmarkar-Karp k-way partition of int64 lengths by cost linear*L + quadratic*L^2 into order/offsets/costs");
  m.def(
      "pack_micro_batches",
      [](const TensorRef& lengths, py::handle max_tokens, py::handle min_count, py::handle padded,
         const TensorRef& order, const TensorRef& offsets) {
        const int64_t budget = strict_int(max_tokens, "max_tokens"), least = strict_int(min_count, "min_count");
        const bool by_padding = strict_bool(padded, "padded");
        py::gil_scoped_release nogil;
        return pack_micro_batches(lengths, budget, least, by_padding, order, offsets);
      },
      py::arg("lengths"), py::arg("max_tokens"), py::arg("min_count"), py::arg("padded"), py::arg("order"),
      py::arg("offsets"), "Token-budget micro-batches of int64 lengths into order/offsets; returns their count");
  m.def(
      "rollout_buckets",
      [](const TensorRef& prompt_lens, const TensorRef& max_new_tokens, py::handle max_num_seqs,
         py::handle max_batch_tokens, py::handle max_model_len, py::handle max_length_ratio, const TensorRef& order,
         const TensorRef& offsets, const TensorRef& wave_max_tokens) {
        const int64_t seqs = strict_int(max_num_seqs, "max_num_seqs");
        const int64_t tokens = strict_int(max_batch_tokens, "max_batch_tokens");
        const int64_t model_len = strict_int(max_model_len, "max_model_len");
        const double ratio = strict_float(max_length_ratio, "max_length_ratio");
        py::gil_scoped_release nogil;
        return rollout_buckets(prompt_lens, max_new_tokens, seqs, tokens, model_len, ratio, order, offsets,
                               wave_max_tokens);
      },
      py::arg("prompt_lens"), py::arg("max_new_tokens"), py::arg("max_num_seqs"), py::arg("max_batch_tokens"),
      py::arg("max_model_len"), py::arg("max_length_ratio"), py::arg("order"), py::arg("offsets"),
      py::arg("wave_max_tokens"),
      "Rollout dispatch waves by prompt length into order/offsets/wave_max_tokens; returns their count");
}

}  // namespace vf
