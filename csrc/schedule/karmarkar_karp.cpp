// k-way Karmarkar–Karp (largest differencing method) in O(n log n).
//
// A state is k sets sorted by sum, largest first; its spread is the largest sum minus the smallest.
// Start from one state per item (or, with equal_size, one state per run of k items in sorted order,
// one item per set), then repeatedly merge the two states of largest spread, pairing the i-th
// largest set of one with the i-th smallest of the other, until one state remains.
//
// Two things keep this fast at 10^6 items:
//  - a state stores only its non-empty sets (a singleton state is one set, not k), so memory is
//    O(n) and a merge costs O(m_a + m_b log m_b) where m_b is the smaller state's set count;
//  - a set's members are a linked list threaded through one `next` array, so merging sets is O(1).
#include <algorithm>
#include <numeric>
#include <queue>
#include <utility>

#include "schedule/schedule.h"

namespace vf::schedule {
namespace {

struct Set {
  int64_t sum, count, head, tail;
};

// Sets sort by sum, largest first; ties by member count, then by first member (unique across sets).
bool heavier(const Set& a, const Set& b) {
  if (a.sum != b.sum) return a.sum > b.sum;
  if (a.count != b.count) return a.count > b.count;
  return a.head < b.head;
}

struct Entry {
  int64_t spread, top, id;
};

// priority_queue pops the greatest: largest spread, then largest top set, then smallest id.
struct PopsLater {
  bool operator()(const Entry& a, const Entry& b) const {
    if (a.spread != b.spread) return a.spread < b.spread;
    if (a.top != b.top) return a.top < b.top;
    return a.id > b.id;
  }
};

class Differencing {
 public:
  Differencing(int64_t n, int64_t k) : k_(k), next_(n, -1) {}

  void add_state(std::vector<Set> sets) {
    std::sort(sets.begin(), sets.end(), heavier);
    const int64_t id = static_cast<int64_t>(states_.size());
    states_.push_back(std::move(sets));
    entries_.push_back(entry(id));
  }

  // Merges until one state is left; returns its sets (at most k, largest first).
  std::vector<Set> run() {
    std::priority_queue<Entry, std::vector<Entry>, PopsLater> heap(PopsLater{}, std::move(entries_));
    while (heap.size() > 1) {
      const int64_t a = heap.top().id;
      heap.pop();
      const int64_t b = heap.top().id;
      heap.pop();
      merge_into(a, b);
      heap.push(entry(a));
    }
    return std::move(states_[heap.top().id]);
  }

  const std::vector<int64_t>& next() const { return next_; }

 private:
  Entry entry(int64_t id) const {
    const auto& s = states_[id];
    const int64_t m = static_cast<int64_t>(s.size());
    const int64_t smallest = m == k_ ? s.back().sum : 0;  // absent sets are empty
    return {s.front().sum - smallest, s.front().sum, id};
  }

  void join(Set& into, const Set& other) {
    if (into.count == 0) {
      into = other;
      return;
    }
    next_[into.tail] = other.head;
    into.tail = other.tail;
    into.sum += other.sum;
    into.count += other.count;
  }

  // states_[a] <- states_[a] merged with states_[b] (set i of one joins set k-1-i of the other).
  void merge_into(int64_t a, int64_t b) {
    // The pairing is symmetric, so let the state with fewer sets be the one whose sets move.
    const bool swap = states_[b].size() > states_[a].size();
    std::vector<Set>& big = states_[swap ? b : a];
    std::vector<Set>& small = states_[swap ? a : b];
    const int64_t mb = static_cast<int64_t>(big.size()), ms = static_cast<int64_t>(small.size());
    // Sets big[i] with i >= k - ms receive small[k - 1 - i]; the others are an unchanged sorted prefix.
    const int64_t kept = std::min(mb, k_ - ms);
    changed_.clear();
    for (int64_t j = 0; j < ms; ++j) {
      const int64_t i = k_ - 1 - j;
      Set s = i < mb ? big[i] : Set{0, 0, -1, -1};
      join(s, small[j]);
      changed_.push_back(s);
    }
    std::sort(changed_.begin(), changed_.end(), heavier);
    merged_.resize(kept + ms);
    std::merge(big.begin(), big.begin() + kept, changed_.begin(), changed_.end(), merged_.begin(), heavier);
    std::vector<Set>& out = states_[a];
    out.swap(merged_);
    std::vector<Set>().swap(states_[b]);  // free b
  }

  int64_t k_;
  std::vector<int64_t> next_;
  std::vector<std::vector<Set>> states_;
  std::vector<Entry> entries_;
  std::vector<Set> changed_, merged_;
};

}  // namespace

Groups karmarkar_karp(const int64_t* cost, int64_t n, int64_t k, bool equal_size) {
  Groups g;
  g.offsets.assign(k + 1, 0);
  if (n == 0) return g;
  // Items by cost, smallest first; ties by index.
  std::vector<int64_t> items(n);
  std::iota(items.begin(), items.end(), 0);
  std::sort(items.begin(), items.end(), [&](int64_t x, int64_t y) {
    return cost[x] != cost[y] ? cost[x] < cost[y] : x < y;
  });
  Differencing kk(n, k);
  const int64_t per_state = equal_size ? k : 1;
  for (int64_t start = 0; start < n; start += per_state) {
    std::vector<Set> sets;
    sets.reserve(per_state);
    for (int64_t j = start; j < start + per_state; ++j) sets.push_back({cost[items[j]], 1, items[j], items[j]});
    kk.add_state(std::move(sets));
  }
  const std::vector<Set> final_sets = kk.run();
  const auto& next = kk.next();
  g.order.reserve(n);
  for (int64_t p = 0; p < k; ++p) {
    if (p < static_cast<int64_t>(final_sets.size())) {
      const size_t begin = g.order.size();
      for (int64_t i = final_sets[p].head; i != -1; i = next[i]) g.order.push_back(i);
      std::sort(g.order.begin() + begin, g.order.end());
    }
    g.offsets[p + 1] = static_cast<int64_t>(g.order.size());
  }
  return g;
}

}  // namespace vf::schedule
