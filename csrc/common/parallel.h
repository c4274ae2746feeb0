// parallel_for over [0, n): splits the range into contiguous chunks, one per thread.
#pragma once
#include <algorithm>
#include <cstdint>
#include <exception>
#include <thread>
#include <vector>

namespace vf {

template <typename Fn>
void parallel_for(int64_t n, int num_threads, Fn&& fn) {
  if (n <= 0) return;
  int threads = num_threads > 0 ? num_threads : static_cast<int>(std::thread::hardware_concurrency());
  // Below this many items per thread, starting threads costs more than it saves.
  constexpr int64_t kMinPerThread = 16;
  threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, n / kMinPerThread)));
  if (threads == 1) {
    fn(int64_t{0}, n);
    return;
  }
  std::vector<std::thread> pool;
  std::vector<std::exception_ptr> errors(threads);
  const int64_t chunk = (n + threads - 1) / threads;
  for (int i = 0; i < threads; ++i) {
    const int64_t begin = i * chunk, end = std::min(n, begin + chunk);
    if (begin >= end) break;
    pool.emplace_back([&, i, begin, end] {
      try {
        fn(begin, end);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    });
  }
  for (auto& t : pool) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace vf
