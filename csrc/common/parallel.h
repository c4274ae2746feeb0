// parallel_for over [0, n): splits the range into contiguous chunks, one per thread.
#pragma once
#include <algorithm>
#include <cstdint>
#include <exception>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace vf {

// Starting a thread costs tens of microseconds, about a pass over this many float elements: a thread
// gets at least this much work, or the loop runs on the calling thread.
constexpr int64_t kMinElementsPerThread = int64_t{1} << 15;

// The rows of `width` elements that make a thread's least work.
inline int64_t min_rows_per_thread(int64_t width) {
  return std::max<int64_t>(1, kMinElementsPerThread / std::max<int64_t>(1, width));
}

// fn(begin, end) over [0, n) on up to num_threads threads (0: the hardware's), each given at least
// min_per_thread items.
template <typename Fn>
void parallel_for(int64_t n, int num_threads, int64_t min_per_thread, Fn&& fn) {
  if (n <= 0) return;
  int threads = num_threads > 0 ? num_threads : static_cast<int>(std::thread::hardware_concurrency());
  threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, n / std::max<int64_t>(1, min_per_thread))));
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

// Asks the kernel for transparent huge pages over a large output buffer that is about to be
// written for the first time: a freshly allocated tensor is otherwise faulted in 4 KiB at a time,
// which costs more than the kernel's own writes for outputs of hundreds of MiB. Advisory only.
inline void advise_huge_pages(void* data, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (bytes < static_cast<int64_t>(4 * kHuge)) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + static_cast<uintptr_t>(bytes)) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

}  // namespace vf
