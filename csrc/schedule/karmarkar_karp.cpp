// k-way Karmarkar–Karp (largest differencing method), O(n log n log k).
//
// A state is k sets sorted by sum, largest first; its spread is the largest sum minus the smallest.
// Start from one state per item (or, with equal_size, one state per run of k items in sorted order,
// one item per set), then repeatedly merge the two states of largest spread, pairing the i-th
// largest set of one with the i-th smallest of the other, until one state remains.
//
// What keeps this fast at 10^6 items and large k:
//  - a state stores only its non-empty sets (a singleton state is one set, not k), as a binary
//    min-heap plus its largest sum (sums only grow, so that is a running max). A merge touches only
//    the smaller state's m sets and the m smallest sets of the other: O(m log k). m is at most the
//    smaller state's item count, so all merges cost O(n log n log k) (smaller-half argument);
//  - states live in one arena of power-of-two blocks with free lists (no allocation per state);
//  - a set's members are a linked list threaded through one `next` array, so joining sets is O(1);
//  - the initial states are popped from a sorted array, only merged states go through a heap.
#include <algorithm>
#include <numeric>
#include <queue>
#include <utility>

#include "schedule/schedule.h"

namespace vf::schedule {
namespace {

struct Set {
  int64_t sum;
  int32_t count, head, tail;  // members: head -> next[head] -> ... -> tail (n < 2^31)
};

// Sets sort by sum, largest first; ties by member count, then by first member (unique across sets).
// A functor rather than a function so that the std:: heap and sort templates inline it.
struct Heavier {
  bool operator()(const Set& a, const Set& b) const {
    if (a.sum != b.sum) return a.sum > b.sum;
    if (a.count != b.count) return a.count > b.count;
    return a.head < b.head;
  }
};
struct Lighter {
  bool operator()(const Set& a, const Set& b) const { return Heavier{}(b, a); }
};

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

// Blocks of Sets in one vector; capacities are powers of two capped at k, freed blocks are reused.
class Arena {
 public:
  explicit Arena(int64_t k) : k_(k), free_(66) {}
  int64_t capacity_for(int64_t need) const {
    int64_t cap = 1;
    while (cap < need) cap *= 2;
    return std::min(cap, k_);
  }
  int64_t alloc(int64_t cap) {
    auto& list = free_[slot(cap)];
    if (!list.empty()) {
      const int64_t off = list.back();
      list.pop_back();
      return off;
    }
    const int64_t off = static_cast<int64_t>(sets_.size());
    sets_.resize(off + cap);
    return off;
  }
  void release(int64_t off, int64_t cap) { free_[slot(cap)].push_back(off); }
  void reserve(int64_t n) { sets_.reserve(n); }
  Set* at(int64_t off) { return sets_.data() + off; }

 private:
  int slot(int64_t cap) const { return cap == k_ ? 65 : 63 - __builtin_clzll(static_cast<uint64_t>(cap)); }
  int64_t k_;
  std::vector<Set> sets_;
  std::vector<std::vector<int64_t>> free_;
};

struct State {
  int64_t off, size, cap;  // sets in arena[off, off + size): a heap, lightest at the front (std::*_heap with Heavier)
  int64_t top;             // the largest sum
};

class Differencing {
 public:
  Differencing(int64_t n, int64_t k, int64_t num_states) : k_(k), next_(n, -1), arena_(k) {
    arena_.reserve(n);
    states_.reserve(num_states);
    entries_.reserve(num_states);
  }

  // A state from `m` single-item sets: items[0..m) with their costs.
  void add_state(const int64_t* items, int64_t m, const int64_t* cost) {
    const int64_t cap = arena_.capacity_for(m);
    State s{arena_.alloc(cap), m, cap, 0};
    Set* sets = arena_.at(s.off);
    for (int64_t j = 0; j < m; ++j) {
      const int32_t i = static_cast<int32_t>(items[j]);
      sets[j] = {cost[i], 1, i, i};
      s.top = std::max(s.top, cost[i]);
    }
    std::sort(sets, sets + m, Lighter{});  // sorted lightest first: a valid heap
    states_.push_back(s);
    entries_.push_back(entry(static_cast<int64_t>(states_.size()) - 1));
  }

  // Merges until one state is left; returns its sets (at most k), largest first.
  std::vector<Set> run() {
    const PopsLater later;
    std::vector<Entry> initial = std::move(entries_);
    std::sort(initial.begin(), initial.end(), [&](const Entry& x, const Entry& y) { return later(y, x); });
    std::priority_queue<Entry, std::vector<Entry>, PopsLater> merged;
    size_t next_initial = 0;
    auto pop = [&]() {
      if (next_initial < initial.size() && (merged.empty() || !later(initial[next_initial], merged.top())))
        return initial[next_initial++].id;
      const int64_t id = merged.top().id;
      merged.pop();
      return id;
    };
    for (size_t live = initial.size(); live > 1; --live) {
      const int64_t a = pop();
      const int64_t b = pop();
      merge_into(a, b);
      merged.push(entry(a));
    }
    const State& last = states_[pop()];
    std::vector<Set> sets(arena_.at(last.off), arena_.at(last.off) + last.size);
    std::sort(sets.begin(), sets.end(), Heavier{});
    return sets;
  }

  const std::vector<int32_t>& next() const { return next_; }

 private:
  Entry entry(int64_t id) {
    const State& s = states_[id];
    const int64_t smallest = s.size == k_ ? arena_.at(s.off)->sum : 0;  // absent sets are empty
    return {s.top - smallest, s.top, id};
  }

  void join(Set& into, const Set& other) {
    next_[into.tail] = other.head;
    into.tail = other.tail;
    into.sum += other.sum;
    into.count += other.count;
  }

  // states_[a] <- states_[a] merged with states_[b]: the i-th largest set of one joins the i-th
  // smallest of the other (absent sets count as empty, hence smallest).
  void merge_into(int64_t a, int64_t b) {
    // The pairing is symmetric, so let the state with fewer sets be the one whose sets move.
    if (states_[b].size > states_[a].size) std::swap(states_[a], states_[b]);
    State& big = states_[a];
    const State small_state = states_[b];
    const int64_t ms = small_state.size, need = std::min(k_, big.size + ms);
    if (need > big.cap) {
      const int64_t cap = arena_.capacity_for(need), off = arena_.alloc(cap);
      std::copy(arena_.at(big.off), arena_.at(big.off) + big.size, arena_.at(off));
      arena_.release(big.off, big.cap);
      big.off = off;
      big.cap = cap;
    }
    Set* heap = arena_.at(big.off);
    Set* small = arena_.at(small_state.off);
    // Lightest first (a sorted array is also a valid heap); small's j-th largest is small[ms - 1 - j].
    // States that came out of the sorted branch below are sorted already, which insertion sort sees in O(m).
    std::sort(small, small + ms, Lighter{});
    auto largest = [&](int64_t j) -> const Set& { return small[ms - 1 - j]; };
    const int64_t empty = k_ - big.size;  // largest(j) joins the j-th smallest set of big: an absent one for j < empty
    const int64_t touched = std::max<int64_t>(0, ms - empty);
    if (2 * touched >= big.size) {
      // Most of big changes (always so with equal_size): sort it, join, sort again.
      std::sort(heap, heap + big.size, Lighter{});
      for (int64_t j = empty; j < ms; ++j) join(heap[j - empty], largest(j));
      for (int64_t j = 0; j < std::min(ms, empty); ++j) heap[big.size++] = largest(j);
      std::sort(heap, heap + big.size, Lighter{});
      big.top = heap[big.size - 1].sum;
    } else {
      changed_.clear();
      for (int64_t j = 0; j < ms; ++j) {
        if (j < empty) {
          changed_.push_back(largest(j));
          continue;
        }
        std::pop_heap(heap, heap + big.size, Heavier{});
        Set s = heap[--big.size];
        join(s, largest(j));
        changed_.push_back(s);
      }
      for (const Set& s : changed_) {
        heap[big.size++] = s;
        std::push_heap(heap, heap + big.size, Heavier{});
        big.top = std::max(big.top, s.sum);
      }
    }
    arena_.release(small_state.off, small_state.cap);
  }

  int64_t k_;
  std::vector<int32_t> next_;
  Arena arena_;
  std::vector<State> states_;
  std::vector<Entry> entries_;
  std::vector<Set> changed_;
};

}  // namespace

std::vector<int64_t> order_by(const int64_t* key, int64_t n, bool descending) {
  std::vector<int64_t> idx(n), tmp(n);
  std::iota(idx.begin(), idx.end(), 0);
  auto bits = [&](int64_t i) {
    const uint64_t k = static_cast<uint64_t>(key[i]);
    return descending ? ~k : k;
  };
  uint64_t any = 0, all = ~uint64_t{0};
  for (int64_t i = 0; i < n; ++i) {
    any |= bits(i);
    all &= bits(i);
  }
  for (int shift = 0; shift < 64; shift += 8) {
    if ((((any ^ all) >> shift) & 0xff) == 0) continue;  // this byte is the same in every key
    int64_t start[257] = {0};
    for (int64_t i = 0; i < n; ++i) ++start[((bits(i) >> shift) & 0xff) + 1];
    for (int b = 0; b < 256; ++b) start[b + 1] += start[b];
    for (int64_t j = 0; j < n; ++j) tmp[start[(bits(idx[j]) >> shift) & 0xff]++] = idx[j];  // stable
    idx.swap(tmp);
  }
  return idx;
}

Groups karmarkar_karp(const int64_t* cost, int64_t n, int64_t k, bool equal_size) {
  Groups g;
  g.offsets.assign(k + 1, 0);
  if (n == 0) return g;
  const std::vector<int64_t> items = order_by(cost, n, false);  // smallest first
  const int64_t per_state = equal_size ? k : 1;
  Differencing kk(n, k, n / per_state);
  for (int64_t start = 0; start < n; start += per_state) kk.add_state(items.data() + start, per_state, cost);
  const std::vector<Set> final_sets = kk.run();
  // Label each item with its partition, then lay partitions out by a counting pass over the items
  // in index order, which leaves every partition's members ascending.
  const auto& next = kk.next();
  std::vector<int32_t> label(n);
  for (int64_t p = 0; p < static_cast<int64_t>(final_sets.size()); ++p) {
    for (int32_t i = final_sets[p].head; i != -1; i = next[i]) label[i] = static_cast<int32_t>(p);
    g.offsets[p + 1] = final_sets[p].count;
  }
  for (int64_t p = 0; p < k; ++p) g.offsets[p + 1] += g.offsets[p];
  std::vector<int64_t> fill(g.offsets.begin(), g.offsets.end() - 1);
  g.order.resize(n);
  for (int64_t i = 0; i < n; ++i) g.order[fill[label[i]]++] = i;
  return g;
}

}  // namespace vf::schedule
