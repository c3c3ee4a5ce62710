// PyTorch's caching allocator on gpumem's allocation-benchmark sequences (ops.h), and on a
// recorded workload's own sequence (gpumem_torch_run_trace).
//
// scripts/bench_torch_alloc.py and scripts/trace_alloc_time.py build this with
// torch.utils.cpp_extension (only c10 headers, no Python bindings) and call it through ctypes.
// Each call times the loop of c10::cuda::CUDACachingAllocator::raw_alloc_with_stream /
// raw_delete and nothing else. Those go to whichever allocator PyTorch uses in the process: its
// own, or gpumem's once gpumem.torch.install() has switched it.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "ops.h"

namespace {

using Clock = std::chrono::steady_clock;
namespace cca = c10::cuda::CUDACachingAllocator;

void report(char* err, int err_len, const std::string& msg) {
  if (err && err_len > 0) std::snprintf(err, static_cast<size_t>(err_len), "%s", msg.c_str());
}

// Runs one thread's sequence on `stream`; returns false (with the message) on failure.
bool run_sequence(const std::vector<gpumem_bench::Op>& ops, cudaStream_t stream,
                  std::vector<void*>& slots, std::string& error) {
  try {
    for (const auto& op : ops) {
      if (op.size > 0) {
        slots[op.slot] = cca::raw_alloc_with_stream(static_cast<size_t>(op.size), stream);
      } else {
        cca::raw_delete(slots[op.slot]);
        slots[op.slot] = nullptr;
      }
    }
    return true;
  } catch (const std::exception& e) {
    error = e.what();
  } catch (...) {
    error = "unknown exception";
  }
  for (void*& p : slots) {
    if (p) {
      cca::raw_delete(p);
      p = nullptr;
    }
  }
  return false;
}

// The end of a trace pass: frees what `held` still holds (unless `keep_live`: then it stays
// allocated for the rest of the process) and waits for the device. False, with the message in
// `err`, if the device reports an error.
bool end_pass(std::vector<void*>& held, bool keep_live, char* err, int err_len) {
  for (void*& p : held) {
    if (p && !keep_live) cca::raw_delete(p);
    p = nullptr;
  }
  cudaError_t sync = cudaDeviceSynchronize();
  if (sync != cudaSuccess) {
    report(err, err_len, std::string("cudaDeviceSynchronize: ") + cudaGetErrorString(sync));
    return false;
  }
  return true;
}

// After a trace pass failed: frees what it still holds, ignoring further errors.
void free_after_error(std::vector<void*>& held) {
  for (void*& p : held) {
    if (p) {
      try {
        cca::raw_delete(p);
      } catch (...) {
      }
      p = nullptr;
    }
  }
}

}  // namespace

// Aggregate ns per op (wall time / all ops) of `threads` threads, thread t running the
// sequence of seed `seed + t`, all starting together. One thread runs on the calling thread's
// current stream (the default stream, as in the anchor); several threads each take a stream
// from PyTorch's pool when `own_streams` is set (else all use the default stream). Returns a
// negative number, with the message in `err`, on failure.
extern "C" double gpumem_torch_run(int64_t n_allocs, int64_t max_live, int64_t min_size,
                                   int64_t max_size, uint64_t seed, int64_t threads,
                                   int own_streams, char* err, int err_len) {
  try {
    if (threads < 1) {
      report(err, err_len, "threads must be at least 1");
      return -1.0;
    }
    std::vector<std::vector<gpumem_bench::Op>> seqs;
    int64_t total = 0;
    for (int64_t t = 0; t < threads; ++t) {
      seqs.push_back(gpumem_bench::make_ops(n_allocs, max_live, min_size, max_size, seed + t));
      total += static_cast<int64_t>(seqs.back().size());
    }
    std::vector<cudaStream_t> streams;
    for (int64_t t = 0; t < threads; ++t) {
      if (threads > 1 && own_streams) {
        streams.push_back(c10::cuda::getStreamFromPool(false, 0).stream());
      } else {
        streams.push_back(c10::cuda::getCurrentCUDAStream(0).stream());
      }
    }
    std::atomic<int64_t> ready{0};
    std::atomic<bool> go{false};
    std::vector<std::string> errors(threads);
    std::vector<char> ok(threads, 1);
    std::vector<std::thread> pool;
    for (int64_t t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        cudaSetDevice(0);
        std::vector<void*> slots(static_cast<size_t>(max_live), nullptr);
        ready++;
        while (!go.load()) {
        }
        ok[t] = run_sequence(seqs[t], streams[t], slots, errors[t]);
      });
    }
    while (ready.load() < threads) {
    }
    auto start = Clock::now();
    go = true;
    for (auto& th : pool) th.join();
    double ns = std::chrono::duration<double, std::nano>(Clock::now() - start).count() /
                static_cast<double>(total);
    cudaError_t sync = cudaDeviceSynchronize();
    for (int64_t t = 0; t < threads; ++t) {
      if (!ok[t]) {
        report(err, err_len, "thread " + std::to_string(t) + ": " + errors[t]);
        return -1.0;
      }
    }
    if (sync != cudaSuccess) {
      report(err, err_len, std::string("cudaDeviceSynchronize: ") + cudaGetErrorString(sync));
      return -1.0;
    }
    return ns;
  } catch (const std::exception& e) {
    report(err, err_len, e.what());
  } catch (...) {
    report(err, err_len, "unknown exception");
  }
  return -1.0;
}

// One pass of a recorded sequence on the current stream, through whichever allocator PyTorch
// uses: op i allocates sizes[i] bytes into slot slots[i] when sizes[i] > 0, and frees that
// slot's allocation when sizes[i] == 0. The ops are timed in `chunks` consecutive parts of
// equal op count, chunk_ns[c] receiving part c's wall time. What is still allocated at the end
// is freed afterwards, untimed, unless `keep_live` is set: then it stays allocated for the
// rest of the process (a workload's weights and optimizer state, which the recording never
// frees). Returns the pass's total ns, or a negative number with the message in `err` (after
// freeing what the pass allocated).
extern "C" double gpumem_torch_run_trace(const int64_t* sizes, const int64_t* slots,
                                         int64_t n_ops, int64_t n_slots, int64_t chunks,
                                         int keep_live, double* chunk_ns, char* err,
                                         int err_len) {
  std::vector<void*> held;
  try {
    if (n_ops < 1 || n_slots < 1 || chunks < 1 || chunks > n_ops) {
      report(err, err_len, "expected at least one op, one slot, and 1 to n_ops chunks");
      return -1.0;
    }
    for (int64_t i = 0; i < n_ops; ++i) {
      if (sizes[i] < 0 || slots[i] < 0 || slots[i] >= n_slots) {
        report(err, err_len, "op " + std::to_string(i) + ": bad size or slot");
        return -1.0;
      }
    }
    held.assign(static_cast<size_t>(n_slots), nullptr);
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(0).stream();
    double total = 0.0;
    int64_t op = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t end = (c + 1 == chunks) ? n_ops : n_ops * (c + 1) / chunks;
      auto start = Clock::now();
      for (; op < end; ++op) {
        void*& slot = held[static_cast<size_t>(slots[op])];
        if (sizes[op] > 0) {
          slot = cca::raw_alloc_with_stream(static_cast<size_t>(sizes[op]), stream);
        } else if (slot) {
          cca::raw_delete(slot);
          slot = nullptr;
        }
      }
      chunk_ns[c] = std::chrono::duration<double, std::nano>(Clock::now() - start).count();
      total += chunk_ns[c];
    }
    if (!end_pass(held, keep_live != 0, err, err_len)) return -1.0;
    return total;
  } catch (const std::exception& e) {
    report(err, err_len, e.what());
  } catch (...) {
    report(err, err_len, "unknown exception");
  }
  free_after_error(held);
  return -1.0;
}

// One pass of a recorded sequence as gpumem_torch_run_trace, with the program's own work
// between the calls modelled, each op on its recorded stream and timed alone. Before every op,
// `evict_bytes` of a buffer are written (one byte per 64-byte line), so that each call finds
// the allocator's data out of the core's private caches, as in a training step, where kernel
// launches, PyTorch's dispatch and Python run between two allocator calls. Op i runs on stream
// stream_of[i]: 0 is the current stream, 1.. n_streams-1 streams from PyTorch's pool (the same
// ones in every pass of the process). sums_ns receives [allocations' ns, frees' ns, one empty
// timed span's ns (the clock's own cost per op, measured after eviction like the ops)].
// Returns the pass's total timed ns, or a negative number with the message in `err` (after
// freeing what the pass allocated).
extern "C" double gpumem_torch_run_trace_cold(const int64_t* sizes, const int64_t* slots,
                                              const int64_t* stream_of, int64_t n_ops,
                                              int64_t n_slots, int64_t n_streams,
                                              int64_t evict_bytes, int keep_live,
                                              double* sums_ns, char* err, int err_len) {
  std::vector<void*> held;
  try {
    if (n_ops < 1 || n_slots < 1 || n_streams < 1 || evict_bytes < 0) {
      report(err, err_len, "expected ops, slots, streams and a non-negative eviction size");
      return -1.0;
    }
    for (int64_t i = 0; i < n_ops; ++i) {
      if (sizes[i] < 0 || slots[i] < 0 || slots[i] >= n_slots || stream_of[i] < 0 ||
          stream_of[i] >= n_streams) {
        report(err, err_len, "op " + std::to_string(i) + ": bad size, slot or stream");
        return -1.0;
      }
    }
    static std::vector<cudaStream_t> streams;
    while (static_cast<int64_t>(streams.size()) < n_streams) {
      streams.push_back(streams.empty() ? c10::cuda::getCurrentCUDAStream(0).stream()
                                        : c10::cuda::getStreamFromPool(false, 0).stream());
    }
    static std::vector<unsigned char> buffer;
    buffer.assign(static_cast<size_t>(evict_bytes), 0);
    unsigned char round = 0;
    auto evict = [&] {
      ++round;
      volatile unsigned char* b = buffer.data();
      for (size_t i = 0; i < buffer.size(); i += 64) b[i] = round;
    };
    held.assign(static_cast<size_t>(n_slots), nullptr);
    double alloc_ns = 0.0, free_ns = 0.0, clock_ns = 0.0;
    int64_t timed = 0;
    for (int64_t op = 0; op < n_ops; ++op) {
      void*& slot = held[static_cast<size_t>(slots[op])];
      if (sizes[op] == 0 && !slot) continue;
      evict();
      auto start = Clock::now();
      if (sizes[op] > 0) {
        slot = cca::raw_alloc_with_stream(static_cast<size_t>(sizes[op]),
                                          streams[static_cast<size_t>(stream_of[op])]);
        alloc_ns += std::chrono::duration<double, std::nano>(Clock::now() - start).count();
      } else {
        cca::raw_delete(slot);
        slot = nullptr;
        free_ns += std::chrono::duration<double, std::nano>(Clock::now() - start).count();
      }
      // The clock's own cost, in the same state of the caches: every 16th op, once more.
      if (++timed % 16 == 0) {
        evict();
        auto t0 = Clock::now();
        clock_ns += std::chrono::duration<double, std::nano>(Clock::now() - t0).count() * 16;
      }
    }
    if (!end_pass(held, keep_live != 0, err, err_len)) return -1.0;
    sums_ns[0] = alloc_ns;
    sums_ns[1] = free_ns;
    sums_ns[2] = timed ? clock_ns / static_cast<double>(timed) : 0.0;
    return alloc_ns + free_ns;
  } catch (const std::exception& e) {
    report(err, err_len, e.what());
  } catch (...) {
    report(err, err_len, "unknown exception");
  }
  free_after_error(held);
  return -1.0;
}

// Number of ops in a sequence (to check the Python side's bookkeeping).
extern "C" int64_t gpumem_torch_count_ops(int64_t n_allocs, int64_t max_live, int64_t min_size,
                                          int64_t max_size, uint64_t seed) {
  return static_cast<int64_t>(
      gpumem_bench::make_ops(n_allocs, max_live, min_size, max_size, seed).size());
}
