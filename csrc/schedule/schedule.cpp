// The scheduler's launchers (argument checks) and its packing algorithms: best-fit decreasing,
// the padded-layout cut, splitting to reach a count, and rollout waves. Karmarkar–Karp is in
// karmarkar_karp.cpp.
#include <algorithm>
#include <limits>
#include <numeric>
#include <queue>
#include <set>
#include <utility>

#include "common/check.h"
#include "schedule/schedule.h"

namespace vf::schedule {
namespace {

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

// ---- argument checks ----

const int64_t* int64_input(const TensorRef& t, const char* name) {
  VF_CHECK(t.dim() == 1, name, " must be a 1-D tensor [n], got shape ", shape_str(t.sizes));
  check_dtype(t, name, DType::i64);
  VF_CHECK(t.device == Device::cpu, name, " must be on the CPU (plans are host computations)");
  check_contiguous(t, name);
  VF_CHECK(t.sizes[0] >= 1, name, " must hold at least one sequence, got none");
  VF_CHECK(t.sizes[0] < (int64_t{1} << 31), name, " may hold at most 2^31 - 1 sequences, got ", t.sizes[0]);
  return t.ptr<const int64_t>();
}

// lengths >= 1; returns the longest. The plans' figures (token sums, padded sizes: count times
// the longest member) stay within n * longest, which must therefore fit in int64.
int64_t checked_lengths(const int64_t* x, int64_t n, const char* name) {
  int64_t longest = 0;
  for (int64_t i = 0; i < n; ++i) {
    VF_CHECK(x[i] >= 1, name, " must be >= 1 everywhere, got ", x[i], " at index ", i);
    longest = std::max(longest, x[i]);
  }
  VF_CHECK(static_cast<__int128>(longest) * n <= kMax, name, ": ", n, " sequences times the longest (", longest,
           ") is beyond int64");
  return longest;
}

int64_t* int64_output(const TensorRef& t, const char* name, int64_t min_size) {
  VF_CHECK(t.dim() == 1 && t.sizes[0] >= min_size, name, " must be a 1-D tensor of at least ", min_size,
           " elements, got shape ", shape_str(t.sizes));
  check_dtype(t, name, DType::i64);
  VF_CHECK(t.device == Device::cpu, name, " must be on the CPU");
  check_contiguous(t, name);
  return t.ptr<int64_t>();
}

void write(const Groups& g, int64_t* order, int64_t* offsets) {
  std::copy(g.order.begin(), g.order.end(), order);
  std::copy(g.offsets.begin(), g.offsets.end(), offsets);
}

// ---- packing ----

// Items by length, longest first; ties by index.
std::vector<int64_t> longest_first(const int64_t* lengths, int64_t n) { return order_by(lengths, n, true); }

// Groups from a list of member lists: members sorted, groups ordered by `weight`, largest first
// (ties by first member).
Groups compress(std::vector<std::vector<int64_t>> members, const std::vector<int64_t>& weight) {
  std::vector<int64_t> rank(members.size());
  for (auto& m : members) std::sort(m.begin(), m.end());
  std::iota(rank.begin(), rank.end(), 0);
  std::sort(rank.begin(), rank.end(), [&](int64_t a, int64_t b) {
    if (weight[a] != weight[b]) return weight[a] > weight[b];
    return members[a].front() < members[b].front();
  });
  Groups g;
  g.offsets.push_back(0);
  for (int64_t r : rank) {
    g.order.insert(g.order.end(), members[r].begin(), members[r].end());
    g.offsets.push_back(static_cast<int64_t>(g.order.size()));
  }
  return g;
}

std::vector<std::vector<int64_t>> members_of(const Groups& g, const std::vector<int64_t>* map = nullptr) {
  std::vector<std::vector<int64_t>> out(g.count());
  for (int64_t b = 0; b < g.count(); ++b)
    for (int64_t j = g.offsets[b]; j < g.offsets[b + 1]; ++j) out[b].push_back(map ? (*map)[g.order[j]] : g.order[j]);
  return out;
}

// Budget use of a micro-batch: token sum, or members * longest member (padded layout).
int64_t budget_use(const std::vector<int64_t>& m, const int64_t* lengths, bool padded) {
  int64_t sum = 0, longest = 0;
  for (int64_t i : m) {
    sum += lengths[i];
    longest = std::max(longest, lengths[i]);
  }
  return padded ? static_cast<int64_t>(m.size()) * longest : sum;
}

// Splits the micro-batch of largest budget use (with >= 2 members) in two until there are
// `count`: each half's use is at most the whole's, so budgets keep holding. Halves alternate
// members by length so their token sums stay close; in the padded layout they stay consecutive
// in length order, so each half keeps a tight longest member.
void split_to(std::vector<std::vector<int64_t>>& mbs, int64_t count, const int64_t* lengths, bool padded) {
  std::priority_queue<std::pair<int64_t, int64_t>> heap;  // (use, -slot): ties to the earlier slot
  for (size_t b = 0; b < mbs.size(); ++b)
    if (mbs[b].size() >= 2) heap.push({budget_use(mbs[b], lengths, padded), -static_cast<int64_t>(b)});
  while (static_cast<int64_t>(mbs.size()) < count) {
    VF_CHECK(!heap.empty(), "cannot split ", mbs.size(), " micro-batches into ", count);  // callers keep count <= n
    const int64_t b = -heap.top().second;
    heap.pop();
    std::vector<int64_t> items = mbs[b];
    std::sort(items.begin(), items.end(), [&](int64_t x, int64_t y) {
      return lengths[x] != lengths[y] ? lengths[x] > lengths[y] : x < y;
    });
    std::vector<int64_t> first, second;
    const size_t half = items.size() / 2;
    for (size_t j = 0; j < items.size(); ++j) {
      const bool to_first = padded ? j < items.size() - half : (j % 2 == 0);
      (to_first ? first : second).push_back(items[j]);
    }
    mbs[b] = std::move(first);
    mbs.push_back(std::move(second));
    for (int64_t s : {b, static_cast<int64_t>(mbs.size()) - 1})
      if (mbs[s].size() >= 2) heap.push({budget_use(mbs[s], lengths, padded), -s});
  }
}

// Packed layout, for the items that fit the budget: the fewest bins among best-fit decreasing and
// Karmarkar–Karp at the lower bound ceil(total / budget); then, at the chosen count (or `count`
// if larger), Karmarkar–Karp's balanced bins when they fit the budget, else the bins split to count.
std::vector<std::vector<int64_t>> pack_fitting(const std::vector<int64_t>& items, const int64_t* lengths,
                                               int64_t budget, int64_t count) {
  const int64_t n = static_cast<int64_t>(items.size());
  std::vector<int64_t> len(n);
  for (int64_t j = 0; j < n; ++j) len[j] = lengths[items[j]];
  const Groups bfd = best_fit_decreasing(len.data(), n, budget);
  const int64_t total = std::accumulate(len.begin(), len.end(), int64_t{0});
  const int64_t lower = total / budget + (total % budget != 0);
  const int64_t target = std::max(count, bfd.count());
  auto fits = [&](const Groups& g) {
    for (int64_t b = 0; b < g.count(); ++b) {
      int64_t sum = 0;
      for (int64_t j = g.offsets[b]; j < g.offsets[b + 1]; ++j) sum += len[g.order[j]];
      if (sum > budget) return false;
    }
    return true;
  };
  if (count < bfd.count() && lower < bfd.count()) {
    Groups fewer = karmarkar_karp(len.data(), n, std::max(count, lower), false);
    if (fits(fewer)) return members_of(fewer, &items);
  }
  Groups balanced = karmarkar_karp(len.data(), n, target, false);
  if (fits(balanced)) return members_of(balanced, &items);
  auto mbs = members_of(bfd, &items);
  split_to(mbs, target, lengths, false);
  return mbs;
}

// Padded layout: longest first, each micro-batch takes the next items while members * its first
// (longest) member stays within the budget.
std::vector<std::vector<int64_t>> pack_padded(const std::vector<int64_t>& items, const int64_t* lengths,
                                              int64_t budget) {
  std::vector<std::vector<int64_t>> mbs;
  for (int64_t i : items) {
    if (!mbs.empty() && static_cast<int64_t>(mbs.back().size() + 1) <= budget / lengths[mbs.back().front()]) {
      mbs.back().push_back(i);
    } else {
      mbs.push_back({i});
    }
  }
  return mbs;
}

}  // namespace

Groups best_fit_decreasing(const int64_t* lengths, int64_t n, int64_t budget) {
  const std::vector<int64_t> items = longest_first(lengths, n);
  std::vector<std::vector<int64_t>> bins;
  std::set<std::pair<int64_t, int64_t>> room;  // (remaining capacity, bin): best fit = smallest room that fits
  for (int64_t i : items) {
    auto it = room.lower_bound({lengths[i], -1});
    if (lengths[i] > budget || it == room.end()) {
      bins.push_back({i});
      if (lengths[i] < budget) room.insert({budget - lengths[i], static_cast<int64_t>(bins.size()) - 1});
      continue;
    }
    const auto [left, b] = *it;
    room.erase(it);
    bins[b].push_back(i);
    if (left > lengths[i]) room.insert({left - lengths[i], b});
  }
  Groups g;
  g.offsets.push_back(0);
  for (auto& b : bins) {
    g.order.insert(g.order.end(), b.begin(), b.end());
    g.offsets.push_back(static_cast<int64_t>(g.order.size()));
  }
  return g;
}

void balance_partitions(const TensorRef& lengths, int64_t k, bool equal_size, int64_t linear, int64_t quadratic,
                        const TensorRef& order, const TensorRef& offsets, const TensorRef& costs) {
  const int64_t* len = int64_input(lengths, "lengths");
  const int64_t n = lengths.sizes[0];
  checked_lengths(len, n, "lengths");
  VF_CHECK(k >= 1, "k must be >= 1, got ", k);
  VF_CHECK(k <= n, "k must be <= the number of sequences (", n, "), got ", k);
  if (equal_size) {
    VF_CHECK(n % k == 0, "equal_size=True needs k to divide the number of sequences: ", n, " % ", k, " = ", n % k,
             " (pass equal_size=False, or drop or pad sequences)");
  }
  VF_CHECK(linear >= 0 && quadratic >= 0 && linear + quadratic > 0,
           "cost coefficients must be >= 0 and not both 0, got linear=", linear, ", quadratic=", quadratic);
  int64_t* out_order = int64_output(order, "order", n);
  int64_t* out_offsets = int64_output(offsets, "offsets", k + 1);
  int64_t* out_costs = int64_output(costs, "costs", k);
  std::vector<int64_t> cost(n);
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    int64_t lin = 0, sq = 0, quad = 0, c = 0;
    const bool wraps = __builtin_mul_overflow(linear, len[i], &lin) || __builtin_mul_overflow(len[i], len[i], &sq) ||
                       __builtin_mul_overflow(quadratic, sq, &quad) || __builtin_add_overflow(lin, quad, &c) ||
                       __builtin_add_overflow(total, c, &total);
    VF_CHECK(!wraps, "the costs linear*L + quadratic*L^2 of lengths sum beyond int64 (at lengths[", i, "] = ",
             len[i], " with linear=", linear, ", quadratic=", quadratic, ")");
    cost[i] = c;
  }
  const Groups g = karmarkar_karp(cost.data(), n, k, equal_size);
  write(g, out_order, out_offsets);
  for (int64_t p = 0; p < k; ++p) {
    int64_t sum = 0;
    for (int64_t j = g.offsets[p]; j < g.offsets[p + 1]; ++j) sum += cost[g.order[j]];
    out_costs[p] = sum;
  }
}

int64_t pack_micro_batches(const TensorRef& lengths, int64_t max_tokens, int64_t min_count, bool padded,
                           const TensorRef& order, const TensorRef& offsets) {
  const int64_t* len = int64_input(lengths, "lengths");
  const int64_t n = lengths.sizes[0];
  checked_lengths(len, n, "lengths");
  VF_CHECK(max_tokens >= 1, "max_tokens must be >= 1, got ", max_tokens);
  VF_CHECK(min_count >= 1, "min_num must be >= 1, got ", min_count);
  VF_CHECK(min_count <= n, "cannot make ", min_count, " micro-batches from ", n,
           " sequences (min_num / the agreed count must be <= the number of sequences)");
  int64_t* out_order = int64_output(order, "order", n);
  int64_t* out_offsets = int64_output(offsets, "offsets", n + 1);

  const std::vector<int64_t> items = longest_first(len, n);
  std::vector<std::vector<int64_t>> mbs;
  std::vector<int64_t> fitting;
  for (int64_t i : items) {
    if (len[i] > max_tokens) {
      mbs.push_back({i});  // reported by the caller, never dropped
    } else {
      fitting.push_back(i);
    }
  }
  const int64_t oversize = static_cast<int64_t>(mbs.size());  // min_count <= n: enough fitting items
  if (padded) {
    auto rest = pack_padded(fitting, len, max_tokens);
    mbs.insert(mbs.end(), rest.begin(), rest.end());
    split_to(mbs, min_count, len, true);
  } else if (!fitting.empty()) {
    auto rest = pack_fitting(fitting, len, max_tokens, std::max<int64_t>(1, min_count - oversize));
    mbs.insert(mbs.end(), rest.begin(), rest.end());
  }
  std::vector<int64_t> use(mbs.size());
  for (size_t b = 0; b < mbs.size(); ++b) use[b] = budget_use(mbs[b], len, padded);
  const Groups g = compress(std::move(mbs), use);
  write(g, out_order, out_offsets);
  return g.count();
}

int64_t rollout_buckets(const TensorRef& prompt_lens, const TensorRef& max_new_tokens, int64_t max_num_seqs,
                        int64_t max_batch_tokens, int64_t max_model_len, double max_length_ratio,
                        const TensorRef& order, const TensorRef& offsets, const TensorRef& wave_max_tokens) {
  const int64_t* p = int64_input(prompt_lens, "prompt_lens");
  const int64_t n = prompt_lens.sizes[0];
  const int64_t longest_prompt = checked_lengths(p, n, "prompt_lens");
  const int64_t* m_in = int64_input(max_new_tokens, "max_new_tokens");
  VF_CHECK(max_new_tokens.sizes[0] == n, "max_new_tokens must have one entry per prompt: [", n, "], got ",
           shape_str(max_new_tokens.sizes));
  const int64_t most_new = checked_lengths(m_in, n, "max_new_tokens");
  // A wave's worst-case tokens (and the padded figures) stay within n * (longest prompt + most new tokens).
  VF_CHECK((static_cast<__int128>(longest_prompt) + most_new) * n <= kMax, "prompt_lens and max_new_tokens: ", n,
           " requests times (the longest prompt ", longest_prompt, " + the largest max_new_tokens ", most_new,
           ") is beyond int64");
  VF_CHECK(max_num_seqs >= 1, "max_num_seqs must be >= 1, got ", max_num_seqs);
  VF_CHECK(max_batch_tokens >= 1, "max_batch_tokens must be >= 1, got ", max_batch_tokens);
  VF_CHECK(max_model_len >= 0, "max_model_len must be >= 1 (or 0 for none), got ", max_model_len);
  VF_CHECK(max_length_ratio >= 1.0, "max_length_ratio must be >= 1 (inf for no limit), got ", max_length_ratio);
  int64_t* out_order = int64_output(order, "order", n);
  int64_t* out_offsets = int64_output(offsets, "offsets", n + 1);
  int64_t* out_max = int64_output(wave_max_tokens, "wave_max_tokens", n);
  std::vector<int64_t> m(m_in, m_in + n);
  if (max_model_len > 0) {
    for (int64_t i = 0; i < n; ++i) {
      VF_CHECK(p[i] < max_model_len, "prompt_lens[", i, "] = ", p[i], " leaves no room for a response within ",
               "max_model_len = ", max_model_len);
      m[i] = std::min(m[i], max_model_len - p[i]);
    }
  }
  std::vector<int64_t> items(n);
  std::iota(items.begin(), items.end(), 0);
  std::sort(items.begin(), items.end(), [&](int64_t x, int64_t y) {
    if (p[x] != p[y]) return p[x] < p[y];
    if (m[x] != m[y]) return m[x] < m[y];
    return x < y;
  });
  // Consecutive cut: a wave grows while it has room for the next request at the wave's max_tokens
  // and the next prompt is at most max_length_ratio times the wave's first (shortest) prompt.
  int64_t waves = 0, count = 0, max_m = 0, first_p = 0;
  __int128 prompt_sum = 0;
  out_offsets[0] = 0;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t i = items[j];
    const int64_t new_max = std::max(max_m, m[i]);
    const __int128 need = prompt_sum + p[i] + static_cast<__int128>(count + 1) * new_max;
    const bool similar = static_cast<double>(p[i]) <= max_length_ratio * static_cast<double>(first_p);
    if (count > 0 && (count + 1 > max_num_seqs || need > max_batch_tokens || !similar)) {
      out_max[waves] = max_m;
      out_offsets[++waves] = j;
      count = 0;
      prompt_sum = 0;
      max_m = 0;
    }
    if (count == 0) first_p = p[i];
    ++count;
    prompt_sum += p[i];
    max_m = std::max(max_m, m[i]);
  }
  out_max[waves] = max_m;
  out_offsets[++waves] = n;
  for (int64_t w = 0; w < waves; ++w) {
    std::copy(items.begin() + out_offsets[w], items.begin() + out_offsets[w + 1], out_order + out_offsets[w]);
    std::sort(out_order + out_offsets[w], out_order + out_offsets[w + 1]);
  }
  return waves;
}

}  // namespace vf::schedule
