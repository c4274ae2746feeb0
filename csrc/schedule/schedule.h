// The batch scheduler: data-parallel balancing (Karmarkar–Karp largest differencing), token-budget
// micro-batches (best-fit decreasing, rebalanced by Karmarkar–Karp where the budget allows), and
// rollout dispatch waves grouped by prompt length. Plans are small host computations: CPU only.
//
// Every plan comes back in compressed form: `order` holds the members of group 0, then group 1, ...
// (ascending sequence index inside a group) and group g is order[offsets[g] : offsets[g + 1]].
// Results depend only on the input values (every tie is broken by sequence index), so the same
// input gives the same plan on every rank and every run.
#pragma once
#include <cstdint>
#include <vector>

#include "common/tensor.h"

namespace vf::schedule {

// ---- algorithms on host arrays (no argument checks; the launchers below check) ----

// A plan in compressed rows: group g is order[offsets[g] : offsets[g + 1]].
struct Groups {
  std::vector<int64_t> order;
  std::vector<int64_t> offsets;  // [num_groups + 1]
  int64_t count() const { return static_cast<int64_t>(offsets.size()) - 1; }
};

// Indices 0..n-1 ordered by key (keys >= 0), ascending or descending, ties by index ascending:
// an LSD radix sort, O(n) per non-constant key byte.
std::vector<int64_t> order_by(const int64_t* key, int64_t n, bool descending);

// k-way largest differencing on cost[0..n): k groups ordered by cost, largest first; with
// equal_size (k must divide n) every group has n / k members. Groups are empty only when n < k.
// O(n log n + n k') time where k' is the size of the smaller state in a merge (1 for most merges).
Groups karmarkar_karp(const int64_t* cost, int64_t n, int64_t k, bool equal_size);

// Bins of capacity `budget` (sum of lengths), as few as best-fit decreasing finds; a length above
// the budget gets a bin of its own. Bins in the order they were opened.
Groups best_fit_decreasing(const int64_t* lengths, int64_t n, int64_t budget);

// ---- launchers: check every argument (ValueError / TypeError naming it), then plan ----
// Inputs are 1-D contiguous int64 CPU tensors; outputs are int64 CPU tensors the caller allocates.

// cost_i = linear * L_i + quadratic * L_i^2 (tokens: 1, 0; verl's FLOP proxy: 24576, 1).
// order [n], offsets [k + 1], costs [k] (each group's cost). Groups ordered by cost, largest first.
void balance_partitions(const TensorRef& lengths, int64_t k, bool equal_size, int64_t linear, int64_t quadratic,
                        const TensorRef& order, const TensorRef& offsets, const TensorRef& costs);

// Micro-batches whose budget use stays within max_tokens: the token sum (packed layout) or the
// member count times the longest member (padded layout, `padded`). At least min_count of them.
// A sequence above max_tokens gets a micro-batch of its own. Micro-batches ordered by budget use,
// largest first. order [n], offsets [n + 1] (the first count + 1 entries are written). Returns count.
int64_t pack_micro_batches(const TensorRef& lengths, int64_t max_tokens, int64_t min_count, bool padded,
                           const TensorRef& order, const TensorRef& offsets);

// Dispatch waves for the rollout engine: requests sorted by prompt length (then by max new tokens),
// cut into consecutive waves of at most max_num_seqs requests whose worst-case KV tokens
// (sum of prompt lengths + members * the wave's max_tokens) stay within max_batch_tokens and whose
// longest prompt is at most max_length_ratio times the shortest; a request that alone exceeds the
// token budget gets a wave of its own. max_new_tokens is [n] (per request); with
// max_model_len > 0 each is clipped to max_model_len - prompt_len (a prompt must be shorter).
// order [n], offsets [n + 1], wave_max_tokens [n] (the first count entries are written). Returns count.
int64_t rollout_buckets(const TensorRef& prompt_lens, const TensorRef& max_new_tokens, int64_t max_num_seqs,
                        int64_t max_batch_tokens, int64_t max_model_len, double max_length_ratio,
                        const TensorRef& order, const TensorRef& offsets, const TensorRef& wave_max_tokens);

}  // namespace vf::schedule
