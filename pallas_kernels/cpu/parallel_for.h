// Shared by the CPU kernels: a parallel loop over XLA's intra-op thread pool (the FFI context's ThreadPool).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace jaxpaged {

// Runs fn(i) for i in [0, n) on the calling thread and the pool's threads; returns when all have run.
// Helpers that start late find no work left; the caller never waits for a helper that has not claimed an item.
template <typename F>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, F fn) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto state = std::make_shared<State>();
  auto work = [state, n, fn]() {
    int64_t i;
    while ((i = state->next.fetch_add(1)) < n) {
      fn(i);
      if (state->done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(state->mu);
        state->cv.notify_all();
      }
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work(); });
  work();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load() == n; });
}

}  // namespace jaxpaged
