// gpumem's allocation benchmark: the operation sequences of ANCHORS.md §2, in C++.
//
// The Rust harness (crates/gpumem-cuda/src/bench/ops.rs) generates the same sequences; its tests
// compile opgen.cpp, which includes this header, and compare the two op by op. The PyTorch
// extension (torch_allocbench.cpp) includes it too, so every allocator in a run sees the same
// requests.
//
// A sequence: std::mt19937_64 seeded with `seed`, one std::uniform_real_distribution<double> on
// [0, 1). While fewer than `n_allocs` allocations were made and a slot is free, the next op is
// an allocation if nothing is live or a draw is below 0.5; otherwise a live slot, chosen by a
// draw, is freed. Sizes are log-uniform in [min_size, max_size) (truncated to an integer).
#pragma once
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace gpumem_bench {

// One op: slot >= 0 with size > 0 allocates `size` bytes into `slot`; size == 0 frees `slot`.
struct Op {
  int64_t slot;
  int64_t size;
};

inline std::vector<Op> make_ops(int64_t n_allocs, int64_t max_live, int64_t min_size,
                                int64_t max_size, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> draw(0.0, 1.0);
  const double log_lo = std::log(static_cast<double>(min_size));
  const double log_hi = std::log(static_cast<double>(max_size));
  std::vector<int64_t> idle;  // free slots, taken from the back
  for (int64_t s = max_live - 1; s >= 0; --s) idle.push_back(s);
  std::vector<int64_t> busy;  // live slots, in no particular order
  std::vector<Op> ops;
  int64_t allocated = 0;
  while (allocated < n_allocs || !busy.empty()) {
    bool alloc = allocated < n_allocs && !idle.empty() && (busy.empty() || draw(gen) < 0.5);
    if (alloc) {
      int64_t s = idle.back();
      idle.pop_back();
      int64_t size = static_cast<int64_t>(std::exp(log_lo + (log_hi - log_lo) * draw(gen)));
      ops.push_back({s, size});
      busy.push_back(s);
      ++allocated;
    } else {
      size_t k = static_cast<size_t>(draw(gen) * busy.size());
      if (k >= busy.size()) k = busy.size() - 1;
      int64_t s = busy[k];
      busy[k] = busy.back();
      busy.pop_back();
      ops.push_back({s, 0});
      idle.push_back(s);
    }
  }
  return ops;
}

}  // namespace gpumem_bench
