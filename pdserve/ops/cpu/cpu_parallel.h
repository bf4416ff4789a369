// Work items of uneven cost over the thread pool, each thread taking the next one as it finishes one
// (cpu_attention.cpp's decode kernel, the paged-attention kernels).
//
// at::parallel_for hands each thread an equal count of items, fixed in advance. A step's attention
// items are far from equal: a decode of 2000 tokens of context beside decodes of 100, or a mixed
// step's prompt-chunk items (a few microseconds each) after its decodes (~45 us each, SmolLM2, 256
// tokens). Split by count, a mixed step of 8 decodes and a 32-token chunk left one thread seven
// decodes and the other one decode and the chunk: the layer's attention took 296 us where its parts
// alone took 176 + 40. Taken as they come, in the order given (the costliest first: the cheap ones
// fill in at the end), no thread waits on another with items left.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <numeric>
#include <vector>

namespace pdserve_parallel {

// Indexes 0..cost.size()-1, costliest first (ties in their own order: the same order every call).
inline std::vector<int64_t> costliest_first(const std::vector<double>& cost) {
  std::vector<int64_t> order(cost.size());
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  return order;
}

// work(order[i], state) for every i, over the pool's threads; each thread makes its own `state`
// (its scratch) once, with make_state(). Nested in another parallel region, runs on this thread.
template <class MakeState, class Work>
void for_each_taken(const std::vector<int64_t>& order, MakeState make_state, Work work) {
  const int64_t n = static_cast<int64_t>(order.size());
  if (n == 0) return;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    auto state = make_state();
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      work(order[i], state);
    }
  });
}

}  // namespace pdserve_parallel
