// A parallel loop whose threads claim their work as they go, for the kernels that fill a step.
//
// at::parallel_for splits a range into one contiguous share per thread, decided before the loop runs.
// A thread the OS preempts for a while (the server's HTTP thread, a benchmark client, any other process
// on the same cores) then holds up the whole call by that while, since every other thread waits for its
// share at the end; with as many threads as cores, that is every time anything else runs. Here each
// thread takes the next of about kClaimsPerThread * threads contiguous claims when it finishes its last,
// so a preempted thread delays the call by at most one claim while the others take over the rest
// (benchmarks/RESULTS.md, "Work claimed as threads go"). Not for a GEMV over one or two rows of x,
// which streams W: there one contiguous share per thread ran faster (the same section).
//
// fn(first, last) is called for disjoint [first, last) covering [begin, end), each on whichever thread
// claimed it, possibly several times per thread: per-call setup belongs inside fn, and a result must
// not depend on the thread that computes it (per-thread scratch only).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace kvserve {

// Claims per thread: more claims bound a preempted thread's delay more tightly; each costs one atomic
// add on a shared line and a call's setup.
constexpr int64_t kClaimsPerThread = 8;

// The most claims a loop over `items` items makes, at most one item each: how finely a caller that
// balances its own items (ItemSplit) should cut them.
inline int64_t claim_count(int64_t items) {
  return std::max<int64_t>(1, std::min<int64_t>(items, at::get_num_threads() * kClaimsPerThread));
}

template <typename Fn>
void parallel_claims(int64_t begin, int64_t end, const Fn& fn) {
  const int64_t items = end - begin;
  if (items <= 0) return;
  const int64_t claims = claim_count(items), grain = (items + claims - 1) / claims;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (items + grain - 1) / grain);
  if (threads <= 1 || at::in_parallel_region()) {
    fn(begin, end);
    return;
  }
  std::atomic<int64_t> next{begin};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t first; (first = next.fetch_add(grain, std::memory_order_relaxed)) < end;) {
      fn(first, std::min(first + grain, end));
    }
  });
}

}  // namespace kvserve
