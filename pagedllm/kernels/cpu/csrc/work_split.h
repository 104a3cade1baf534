// How the GEMMs share a weight's column panels / groups among threads when a call only
// streams the weight (decode-sized calls: a few rows).
//
// An even static split leaves one thread waiting for the other at the end of every call:
// two cores streaming their halves do not finish together (profiled on Zen 4, single
// decode: the main thread spent ~17% of its time at the GEMMs' closing barrier). So the
// runs are claimed instead, shrinking as the weight runs out (a quarter of what is left
// per thread, never fewer than `min_run`), each contiguous, so it still streams in order.
// Measured there, in-process A/B: bfloat16 decoder stack 9.69 -> 9.16 ms per step, Q4_1
// 5.45 -> 4.96 ms (halving per thread, or longer minimum runs: the same within noise).
// Which thread computes a column never changes its bits (one chain per output either way).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace pagedllm_ops {

// Rows up to which a GEMM call counts as streaming its weight (decode): such calls claim
// their runs here, and the bfloat16 / float32 GEMM leaves the stream to the hardware
// prefetcher and reads it with non-temporal loads (cpu_gemm.cpp).
constexpr int64_t kStreamRows = 4;

// Calls fn(begin, end) for runs of [0, total) claimed from `next` (shared by the threads
// of one parallel region, starting at 0) until none are left.
template <typename Fn>
inline void claim_runs(std::atomic<int64_t>& next, int64_t total, int64_t threads,
                       int64_t min_run, Fn&& fn) {
  for (;;) {
    int64_t begin = next.load(std::memory_order_relaxed), size = 0;
    do {
      const int64_t left = total - begin;
      if (left <= 0) return;
      size = std::min(left, std::max(min_run, left / (2 * threads)));
    } while (!next.compare_exchange_weak(begin, begin + size, std::memory_order_relaxed));
    fn(begin, begin + size);
  }
}

}  // namespace pagedllm_ops
