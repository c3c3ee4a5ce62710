// Prints the op sequences of gpumem's allocation benchmark, for the Rust harness's tests.
// Usage: opgen N_ALLOCS MAX_LIVE MIN_SIZE MAX_SIZE SEED  -> one line per op: "slot size"
// (size 0: free).
#include <cstdio>
#include <cstdlib>
#include "ops.h"

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s N_ALLOCS MAX_LIVE MIN_SIZE MAX_SIZE SEED\n", argv[0]);
    return 2;
  }
  auto ops = gpumem_bench::make_ops(std::atoll(argv[1]), std::atoll(argv[2]), std::atoll(argv[3]),
                                    std::atoll(argv[4]), std::strtoull(argv[5], nullptr, 10));
  for (const auto& op : ops) std::printf("%lld %lld\n", (long long)op.slot, (long long)op.size);
  return 0;
}
