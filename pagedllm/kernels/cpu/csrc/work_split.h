// How the GEMMs share their work among threads: a weight's column panels / groups
// (decode-sized calls, which only stream the weight, and compute-bound calls of fewer
// rows), or rows (compute-bound calls of many rows).
//
// An even static split leaves one thread waiting for the other at the end of every call:
// two cores streaming their halves do not finish together (profiled on Zen 4, single
// decode: the main thread spent ~17% of its time at the GEMMs' closing barrier). So the
// runs are claimed instead, shrinking as the weight runs out (a quarter of what is left
// per thread, never fewer than `min_run`), each contiguous, so it still streams in order.
// Measured there, in-process A/B: bfloat16 decoder stack 9.69 -> 9.16 ms per step, Q4_1
// 5.45 -> 4.96 ms (halving per thread, or longer minimum runs: the same within noise).
// Which thread computes a column never changes its bits (one chain per output either way).
// Compute-bound calls claim their runs the same way, down to runs of one (cpu_gemm.cpp,
// cpu_quant.cpp): on a VM one vCPU often runs slower than the other (profiled on Zen 3,
// float32 batch64: ~10% of both threads' time at the closing barriers, 3.7% after).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace pagedllm_ops {

// Rows up to which a GEMM call counts as streaming its weight (decode): such calls claim
// their runs here, and the bfloat16 / float32 GEMM leaves the stream to the hardware
// prefetcher and reads it with non-temporal loads (cpu_gemm.cpp).
constexpr int64_t kStreamRows = 4;

// One call's claim counters, all 0 at the start: held inline up to kInline (every
// decode-sized call, and the thread counts of most machines), on the heap beyond, so the
// ~120 GEMM calls of a decode step allocate nothing for them.
class ClaimCounters {
 public:
  explicit ClaimCounters(int64_t n)
      : heap_(n > kInline ? std::make_unique<std::atomic<int64_t>[]>(n) : nullptr),
        data_(heap_ ? heap_.get() : inline_) {
    reset(n);
  }
  ClaimCounters(const ClaimCounters&) = delete;
  ClaimCounters& operator=(const ClaimCounters&) = delete;

  void reset(int64_t n) {
    for (int64_t i = 0; i < n; ++i) data_[i].store(0, std::memory_order_relaxed);
  }
  std::atomic<int64_t>* data() { return data_; }
  std::atomic<int64_t>& operator[](int64_t i) { return data_[i]; }

 private:
  static constexpr int64_t kInline = 8;
  std::atomic<int64_t> inline_[kInline];
  std::unique_ptr<std::atomic<int64_t>[]> heap_;
  std::atomic<int64_t>* data_;
};

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

// Rows [r0, r1) as `units` runs of `unit` rows (a multiple of `block`, near `cap` or
// below, as even as blocks allow; the last run may be short).
struct RowShare {
  int64_t r0, r1, unit, units = 0;
  RowShare(int64_t begin, int64_t end, int64_t cap, int64_t block)
      : r0(begin), r1(std::max(begin, end)), unit(block) {
    if (r1 == r0) return;
    const int64_t runs = (r1 - r0 + cap - 1) / cap;
    unit = ((r1 - r0 + runs - 1) / runs + block - 1) / block * block;
    units = (r1 - r0 + unit - 1) / unit;
  }
};

// Calls fn(o, j) for every unit j < units(o) of every thread o of a parallel region, each
// once: thread t takes its own units in order, then those of the other threads that they
// have not reached yet (cursors[o]: thread o's next unit, 0 at the start). Each thread's
// share stays with it unless it falls behind, as when a VM's vCPU or a busy SMT sibling
// runs slower than the other: an even static split then leaves the faster thread waiting
// at the region's closing barrier (the float32 GEMM on a 2-vCPU Zen 3 VM: ~10% of each
// thread's time).
template <typename Units, typename Fn>
inline void claim_own_then_others(std::atomic<int64_t>* cursors, int64_t threads, int64_t t,
                                  Units&& units, Fn&& fn) {
  for (int64_t i = 0; i < threads; ++i) {
    const int64_t o = (t + i) % threads, count = units(o);
    for (;;) {
      const int64_t j = cursors[o].fetch_add(1, std::memory_order_relaxed);
      if (j >= count) break;
      fn(o, j);
    }
  }
}

}  // namespace pagedllm_ops
