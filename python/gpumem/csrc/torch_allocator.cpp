// gpumem as PyTorch's CUDA allocator, subclassing c10's CUDAAllocator directly instead of going
// through torch.cuda.memory.CUDAPluggableAllocator (`gpumem.torch.install(native=True)`).
//
// Why: the pluggable allocator wraps every call in a mutex and an unordered_map that records
// each pointer's size, device and stream (a node allocated per tensor), and calls gpumem
// through std::function. Session 33 measured that wrapper at 406-612 ns per call from cold
// caches on the H200 host, about what PyTorch's whole native allocator costs per call. Here a
// tensor's allocation is one call into gpumem and its deleter another: gpumem finds the block
// by its address, so nothing is recorded per pointer on this side.
//
// gpumem.torch builds this file with torch.utils.cpp_extension against the PyTorch it runs
// with (no Python bindings: one C function, called through ctypes) and passes the addresses
// of gpumem._native's exported hooks (crates/gpumem-py/src/torch_abi.rs). Errors from gpumem
// arrive as C++ exceptions thrown by those hooks (c10::OutOfMemoryError once gpumem bound it),
// which pass through this file unchanged.
//
// Beyond what the pluggable allocator offers (allocation, frees, record_stream, empty_cache,
// setting the memory fraction), this class does what PyTorch's own allocator does and the
// pluggable one cannot:
// - answers cacheInfo, which cuDNN's benchmark mode calls;
// - answers c10's statistics and the memory fraction (getDeviceStats, resetPeakStats,
//   resetAccumulatedStats, getMemoryFraction), so torch._C's own functions read gpumem's;
// - calls the out-of-memory observers (torch._C._cuda_attach_out_of_memory_observer).
// CUDA graph capture gets private pools, through the same three C++ hooks as on the pluggable
// path (crates/gpumem-py/shim/torch_shim.cpp); getPoolUseCount answers from gpumem, and
// createOrIncrefPool makes torch.cuda.MemPool work (without an allocator of its own, use_on_oom
// or no_split, which are refused), and getCheckpointState / setCheckpointPoolState make
// torch.compile's CUDA graph trees (mode="reduce-overhead") work. Snapshots and history are gpumem's own Python functions
// (install() points torch.cuda's at them); the rest raises a clear error. PyTorch's memory
// profiler (torch.profiler with profile_memory=True) is told of each allocation and free by
// gpumem's hooks themselves, as on the pluggable path (crates/gpumem-py/src/torch_abi.rs).
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;

// gpumem._native's hooks (signatures in torch_abi.rs).
using AllocFn = void* (*)(size_t size, int device, cudaStream_t stream);
using FreeFn = void (*)(void* ptr, size_t size, int device, cudaStream_t stream);
using FreeAnyFn = void (*)(void* ptr);
using RecordStreamFn = void (*)(void* ptr, cudaStream_t stream);
using EmptyCacheFn = void (*)();
using FractionFn = void (*)(double fraction, int device);
using CacheInfoFn = size_t (*)(int device);
using DeviceStatsFn = size_t (*)(int device, int64_t* out, size_t len);
using ResetStatsFn = int (*)(int device);
using LimitAndFreeFn = int (*)(int device, uint64_t* out);
using MemoryFractionFn = double (*)(int device);
using PoolUseCountFn = int (*)(int device, uint64_t first, uint64_t second);
using PoolRetainFn = int (*)(int device, uint64_t first, uint64_t second, char* err,
                             size_t err_len);
using EmptyPoolFn = void (*)(uint64_t first, uint64_t second);
// torch.compile's CUDA graph trees: a pool's checkpoint (an owned handle, null on error) and
// its restore, which reports each block freed and allocated again through RestoreBlockFn.
using PoolCheckpointFn = void* (*)(int device, uint64_t first, uint64_t second, char* err,
                                   size_t err_len);
using PoolCheckpointFreeFn = void (*)(void* checkpoint);
using RestoreBlockFn = void (*)(void* ctx, uint64_t ptr);
using PoolRestoreFn = int (*)(int device, const void* checkpoint, void* ctx,
                              RestoreBlockFn freed, RestoreBlockFn allocated, char* err,
                              size_t err_len);
using PoolLiveBlocksFn = int64_t (*)(int device, uint64_t first, uint64_t second, uint64_t* out,
                                     size_t cap, char* err, size_t err_len);
// The shim's CUDA graph hooks (crates/gpumem-py/shim/torch_shim.cpp); begin and end may throw.
using BeginAllocateToPoolFn = void (*)(int device, c10::cuda::MempoolId_t pool,
                                       std::function<bool(cudaStream_t)> filter);
using PoolFn = void (*)(int device, c10::cuda::MempoolId_t pool);

// The number of values DeviceStatsFn writes, in c10's DeviceStats order (torch_abi.rs,
// DEVICE_STATS_LEN): nine StatArrays of three pools of four values, then five counters.
constexpr size_t kStatArrays = 9;
constexpr size_t kDeviceStatsLen = kStatArrays * 3 * 4 + 5;

struct Hooks {
  AllocFn alloc = nullptr;
  FreeFn free = nullptr;
  FreeAnyFn free_any = nullptr;
  RecordStreamFn record_stream = nullptr;
  EmptyCacheFn empty_cache = nullptr;
  FractionFn set_fraction = nullptr;
  CacheInfoFn cache_info = nullptr;
  DeviceStatsFn device_stats = nullptr;
  ResetStatsFn reset_peak_stats = nullptr;
  ResetStatsFn reset_accumulated_stats = nullptr;
  LimitAndFreeFn limit_and_free = nullptr;
  MemoryFractionFn memory_fraction = nullptr;
  PoolUseCountFn pool_use_count = nullptr;
  PoolRetainFn pool_retain = nullptr;
  EmptyPoolFn empty_pool = nullptr;
  PoolCheckpointFn pool_checkpoint = nullptr;
  PoolCheckpointFreeFn pool_checkpoint_free = nullptr;
  PoolRestoreFn pool_restore = nullptr;
  PoolLiveBlocksFn pool_live_blocks = nullptr;
  BeginAllocateToPoolFn begin_allocate_to_pool = nullptr;
  PoolFn end_allocate_to_pool = nullptr;
  PoolFn release_pool = nullptr;
};

// Written once by gpumem_native_install before the allocator is published to PyTorch (an
// atomic store in changeCurrentAllocator), read-only afterwards.
Hooks hooks;

// A tensor's deleter gets only its pointer, so there is one deleter per device: freeing names
// the device the block came from, and gpumem's free looks the block up by address (the null
// stream only says which of the device's streams to look at first).
template <int Device>
void free_on_device(void* ptr) {
  hooks.free(ptr, 0, Device, nullptr);
}

template <size_t... I>
constexpr std::array<c10::DeleterFnPtr, sizeof...(I)> deleter_table(std::index_sequence<I...>) {
  return {{&free_on_device<static_cast<int>(I)>...}};
}

constexpr auto kDeleters = deleter_table(std::make_index_sequence<C10_COMPILE_TIME_MAX_GPUS>{});

// For pointers whose device is not known here (raw_delete, raw_deleter): gpumem searches.
void free_anywhere(void* ptr) {
  hooks.free_any(ptr);
}

// torch._C._cuda_attach_out_of_memory_observer's callbacks (torch.cuda.memory's "dump a
// snapshot when memory runs out" recipe), called before an out-of-memory error reaches
// PyTorch, as PyTorch's own allocator does.
std::mutex oom_observers_mutex;
std::vector<cca::OutOfMemoryObserver> oom_observers;

void tell_oom_observers(c10::DeviceIndex device, size_t n) {
  std::vector<cca::OutOfMemoryObserver> observers;
  {
    std::lock_guard<std::mutex> lock(oom_observers_mutex);
    observers = oom_observers;
  }
  if (observers.empty()) return;
  uint64_t limit_free[2] = {0, 0};  // the most gpumem may hold there, the device's free bytes
  (void)hooks.limit_and_free(device, limit_free);
  for (const auto& observer : observers) {
    observer(device, n, static_cast<size_t>(limit_free[0]), static_cast<size_t>(limit_free[1]));
  }
}

// An allocation of `n` bytes on `device` for `stream`. Throws on failure (after telling the
// out-of-memory observers, if it ran out); null for 0 bytes.
void* allocate_on(size_t n, c10::DeviceIndex device, cudaStream_t stream) {
  try {
    return hooks.alloc(n, device, stream);
  } catch (const c10::OutOfMemoryError&) {
    // gpumem's out-of-memory errors are c10's once install() bound them (it warns if not).
    tell_oom_observers(device, n);
    throw;
  }
}

// c10's DeviceStats from gpumem's figures (the order of kDeviceStatsLen).
c10::CachingDeviceAllocator::DeviceStats device_stats(c10::DeviceIndex device) {
  std::array<int64_t, kDeviceStatsLen> v{};
  TORCH_CHECK(hooks.device_stats(device, v.data(), v.size()) == kDeviceStatsLen,
              "gpumem: invalid CUDA device index ", static_cast<int>(device));
  c10::CachingDeviceAllocator::DeviceStats s;
  c10::CachingDeviceAllocator::StatArray* arrays[kStatArrays] = {
      &s.allocation,      &s.segment,         &s.active,
      &s.inactive_split,  &s.allocated_bytes, &s.reserved_bytes,
      &s.active_bytes,    &s.inactive_split_bytes, &s.requested_bytes};
  size_t i = 0;
  for (auto* array : arrays) {
    for (auto& stat : *array) {  // aggregate, small pool, large pool
      stat.current = v[i++];
      stat.peak = v[i++];
      stat.allocated = v[i++];
      stat.freed = v[i++];
    }
  }
  s.num_alloc_retries = v[i++];
  s.num_ooms = v[i++];
  s.num_sync_all_streams = v[i++];
  s.num_device_alloc = v[i++];
  s.num_device_free = v[i++];
  // gpumem splits blocks of any size (PyTorch's default: no limit, which reads -1).
  s.max_split_size = -1;
  return s;
}

void reset_stats(ResetStatsFn fn, c10::DeviceIndex device) {
  TORCH_CHECK(fn(device) == 0, "gpumem: invalid CUDA device index ", static_cast<int>(device));
}

[[noreturn]] void unsupported(const char* what) {
  TORCH_CHECK(false, "gpumem's allocator does not support ", what);
}

// For what gpumem answers through its own Python functions instead.
[[noreturn]] void use_python(const char* what) {
  TORCH_CHECK(false, "gpumem's allocator does not answer ", what,
              " in C++; gpumem.torch provides snapshot(), memory_snapshot() and "
              "record_memory_history(), and install() points torch.cuda's functions at them");
}

c10::DeviceIndex current_device() {
  c10::DeviceIndex device = -1;
  C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
  return device;
}

// getCheckpointState's answer: gpumem's checkpoint of a pool, freed with the state.
struct GpumemPoolState final : cca::AllocatorState {
  explicit GpumemPoolState(void* checkpoint) : checkpoint(checkpoint) {}
  ~GpumemPoolState() override { hooks.pool_checkpoint_free(checkpoint); }
  GpumemPoolState(const GpumemPoolState&) = delete;
  GpumemPoolState& operator=(const GpumemPoolState&) = delete;
  void* const checkpoint;
};

// The blocks a restore reports, gathered without letting an exception reach gpumem.
struct RestoredBlocks {
  std::vector<void*> freed;
  std::vector<void*> allocated;
  bool out_of_memory = false;

  static void add(std::vector<void*>& to, RestoredBlocks* self, uint64_t ptr) noexcept {
    try {
      to.push_back(reinterpret_cast<void*>(ptr));
    } catch (...) {
      self->out_of_memory = true;
    }
  }
  static void on_freed(void* ctx, uint64_t ptr) noexcept {
    auto* self = static_cast<RestoredBlocks*>(ctx);
    add(self->freed, self, ptr);
  }
  static void on_allocated(void* ctx, uint64_t ptr) noexcept {
    auto* self = static_cast<RestoredBlocks*>(ctx);
    add(self->allocated, self, ptr);
  }
};

class GpumemAllocator final : public cca::CUDAAllocator {
 public:
  // --- the hot path -------------------------------------------------------------------------

  c10::DataPtr allocate(size_t n) override {
    const c10::DeviceIndex device = current_device();
    TORCH_CHECK(device >= 0 && device < C10_COMPILE_TIME_MAX_GPUS, "gpumem: device index ",
                static_cast<int>(device), " out of range");
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
    return allocate_with_stream(n, device, stream);
  }

  // allocate() once the device and stream are known (gpumem_native_test_allocate calls it
  // directly, where no GPU can be asked which device is current).
  c10::DataPtr allocate_with_stream(size_t n, c10::DeviceIndex device, cudaStream_t stream) {
    void* ptr = allocate_on(n, device, stream);  // throws on failure; null for 0 bytes
    // While a pool is being filled, raw_deleter(): CUDA graph trees check that a pool's
    // tensors carry it before taking their memory back (_free_And_Remove_DeleterFn). Otherwise
    // the device's own deleter, which spares the free a search over devices.
    const c10::DeleterFnPtr deleter = pools_filling_.load(std::memory_order_relaxed) != 0
                                          ? &free_anywhere
                                          : kDeleters[static_cast<size_t>(device)];
    return {ptr, ptr, deleter, c10::Device(c10::DeviceType::CUDA, device)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &free_anywhere; }

  void* raw_alloc(size_t nbytes) override {
    const c10::DeviceIndex device = current_device();
    return allocate_on(nbytes, device, c10::cuda::getCurrentCUDAStream(device).stream());
  }

  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    return allocate_on(nbytes, current_device(), stream);
  }

  void raw_delete(void* ptr) override { free_anywhere(ptr); }

  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    hooks.record_stream(ptr.get(), stream.stream());
  }
  using cca::CUDAAllocator::recordStream;

  // --- what gpumem answers --------------------------------------------------------------------

  void init(int /*device_count*/) override { initialized_.store(true); }
  bool initialized() override { return initialized_.load(); }
  // (0, 0): every cache (torch.cuda.empty_cache); a pool's id: that pool's alone, once no one
  // uses it (a MemPool's destructor).
  void emptyCache(c10::MempoolId_t mempool_id) override {
    if (mempool_id.first == 0 && mempool_id.second == 0) {
      hooks.empty_cache();
    } else {
      hooks.empty_pool(mempool_id.first, mempool_id.second);
    }
  }
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    hooks.set_fraction(fraction, device);
  }
  // The cap as the fraction it was given as (1 without one).
  double getMemoryFraction(c10::DeviceIndex device) override {
    const double fraction = hooks.memory_fraction(device);
    TORCH_CHECK(fraction > 0, "gpumem: invalid CUDA device index ", static_cast<int>(device));
    return fraction;
  }
  // Only remembered: gpumem has no switch to turn allocation off.
  void enable(bool value) override { enabled_.store(value, std::memory_order_relaxed); }
  bool isEnabled() const override { return enabled_.load(std::memory_order_relaxed); }
  // The largest block obtainable now; cuDNN's benchmark mode sizes workspaces by it (PyTorch's
  // pluggable allocator raises here, so torch.backends.cudnn.benchmark fails under it). As
  // PyTorch's own, never less than what the caller passed in.
  void cacheInfo(c10::DeviceIndex device, size_t* largest) override {
    const size_t obtainable = hooks.cache_info(device);
    if (obtainable > *largest) *largest = obtainable;
  }
  // As the pluggable allocator: a block is its own base allocation.
  void* getBaseAllocation(void* ptr, size_t* /*size*/) override { return ptr; }
  // CUDA graph capture: the capture's streams are served from a private pool of gpumem's
  // between begin and end; the pool's memory stays the graph's until releasePool.
  void beginAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t pool,
                           std::function<bool(cudaStream_t)> filter) override {
    hooks.begin_allocate_to_pool(device, pool, std::move(filter));
    pools_filling_.fetch_add(1, std::memory_order_relaxed);
  }
  void endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t pool) override {
    hooks.end_allocate_to_pool(device, pool);
    pools_filling_.fetch_sub(1, std::memory_order_relaxed);
  }
  void releasePool(c10::DeviceIndex device, c10::MempoolId_t pool) override {
    hooks.release_pool(device, pool);
  }
  int getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t pool) override {
    return hooks.pool_use_count(device, pool.first, pool.second);
  }
  // torch.cuda.MemPool: a private pool taken when the MemPool is made (use_mem_pool then fills
  // it through beginAllocateToPool, and its destructor releases it). A MemPool with an
  // allocator of its own would need gpumem to call that allocator: refused, as are use_on_oom
  // (regular requests served from the pool when memory runs out) and no_split.
  void createOrIncrefPool(c10::DeviceIndex device, c10::MempoolId_t pool,
                          std::shared_ptr<cca::CUDAAllocator> allocator) override {
    TORCH_CHECK(allocator == nullptr,
                "gpumem: a torch.cuda.MemPool with an allocator of its own is not supported "
                "(gpumem serves the pool itself); make it without one");
    char err[1024] = {0};
    TORCH_CHECK(hooks.pool_retain(device, pool.first, pool.second, err, sizeof err) == 0, err);
  }
  void setUseOnOOM(c10::DeviceIndex, c10::MempoolId_t, bool use_on_oom) override {
    // Called with false by every MemPool's destructor, which must not throw.
    TORCH_CHECK(!use_on_oom,
                "gpumem: torch.cuda.MemPool(use_on_oom=True) is not supported: a pool's memory "
                "is never lent to other requests");
  }
  void setNoSplit(c10::DeviceIndex, c10::MempoolId_t) override {
    TORCH_CHECK(false, "gpumem: torch.cuda.MemPool(no_split=True) is not supported");
  }
  // torch.compile(mode="reduce-overhead")'s CUDA graph trees: after recording a graph they
  // checkpoint its pool; before recording another after replays (whose outputs live in the
  // pool unbeknown to the allocator), they set the pool back to that checkpoint and give the
  // live tensors the blocks allocated again (with raw_deleter(), as PyTorch's own).
  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                          c10::MempoolId_t pool) override {
    char err[1024] = {0};
    void* checkpoint = hooks.pool_checkpoint(device, pool.first, pool.second, err, sizeof err);
    TORCH_CHECK(checkpoint != nullptr, err);
    try {
      return std::make_shared<GpumemPoolState>(checkpoint);
    } catch (...) {
      hooks.pool_checkpoint_free(checkpoint);
      throw;
    }
  }
  cca::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device,
                                              std::shared_ptr<cca::AllocatorState> as) override {
    auto* state = dynamic_cast<GpumemPoolState*>(as.get());
    TORCH_CHECK(state != nullptr,
                "gpumem: setCheckpointPoolState was given a state that gpumem's "
                "getCheckpointState did not make");
    RestoredBlocks blocks;
    char err[1024] = {0};
    TORCH_CHECK(hooks.pool_restore(device, state->checkpoint, &blocks, &RestoredBlocks::on_freed,
                                   &RestoredBlocks::on_allocated, err, sizeof err) == 0,
                err);
    cca::CheckpointDelta delta;
    // The blocks allocated again are owned by their DataPtrs from here on, so that none is
    // lost if what follows throws.
    const c10::Device dev(c10::DeviceType::CUDA, device);
    for (void* p : blocks.allocated) delta.dataptrs_allocd.emplace_back(p, p, &free_anywhere, dev);
    TORCH_CHECK(!blocks.out_of_memory,
                "gpumem: out of host memory while restoring a CUDA graph pool's checkpoint");
    delta.ptrs_freed = std::move(blocks.freed);
    return delta;
  }
  // Whether the blocks allocated in the pool are exactly `expected` (the trees' check after
  // every recording and restore, on by default in PyTorch 2.11).
  bool checkPoolLiveAllocations(c10::DeviceIndex device, c10::MempoolId_t pool,
                                const std::unordered_set<void*>& expected) override {
    std::vector<uint64_t> live(expected.size() + 1);
    char err[1024] = {0};
    const int64_t n = hooks.pool_live_blocks(device, pool.first, pool.second, live.data(),
                                             live.size(), err, sizeof err);
    TORCH_CHECK(n >= 0, err);
    if (static_cast<size_t>(n) != expected.size()) return false;
    for (int64_t i = 0; i < n; ++i) {
      if (expected.count(reinterpret_cast<void*>(live[static_cast<size_t>(i)])) == 0) return false;
    }
    return true;
  }
  std::string name() override { return "gpumem"; }

  // Statistics under PyTorch's names, so that torch._C's own functions (and C++ callers of
  // c10's getDeviceStats) read gpumem's figures.
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    return device_stats(device);
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    reset_stats(hooks.reset_peak_stats, device);
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    reset_stats(hooks.reset_accumulated_stats, device);
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    c10::cuda::CUDAGuard guard(dev);
    cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();  // already on: clear the sticky error
    } else {
      C10_CUDA_CHECK(err);
    }
  }

  // gpumem's memory is mapped with cuMemMap (stitched) or cuMemAlloc'd; without peer access a
  // copy between two devices must name both (cudaMemcpyPeerAsync), as PyTorch's own does.
  cudaError_t memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice,
                          size_t count, cudaStream_t stream, bool p2p_enabled) override {
    if (p2p_enabled || dstDevice == srcDevice) {
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    }
    return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
  }

  // --- what PyTorch's pluggable allocator does not support either (snapshots and history
  // through gpumem's Python functions) ---------------------------------------------------------

  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex) override {
    unsupported("getExpandableSegmentSizes");
  }
  cca::SnapshotInfo snapshot(c10::MempoolId_t, bool) override {
    use_python("snapshot");
  }
  cca::ShareableHandle shareIpcHandle(void*) override { unsupported("shareIpcHandle"); }
  std::shared_ptr<void> getIpcDevPtr(std::string) override { unsupported("getIpcDevPtr"); }
  void recordHistory(bool, cca::CreateContextFn, size_t, cca::RecordContext, bool,
                     const std::vector<std::string>&) override {
    use_python("recordHistory");
  }
  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> lock(oom_observers_mutex);
    oom_observers.push_back(std::move(observer));
  }
  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker) override {
    unsupported("attachAllocatorTraceTracker");
  }

 private:
  std::atomic<bool> initialized_{false};
  std::atomic<bool> enabled_{true};
  // Captures (or pool contexts) filling a private pool now: see allocate_with_stream.
  std::atomic<int> pools_filling_{0};
};

void report(char* err, int err_len, const std::string& msg) {
  if (err && err_len > 0) std::snprintf(err, static_cast<size_t>(err_len), "%s", msg.c_str());
}

}  // namespace

// Makes gpumem PyTorch's CUDA allocator, given the addresses of gpumem._native's hooks.
// Returns 0, or 1 with a message in `err` (PyTorch refuses once its own allocator has been
// initialized; a hook address is missing).
extern "C" int gpumem_native_install(const uintptr_t* addresses, int count, char* err,
                                     int err_len) {
  // The hooks in the order gpumem.torch passes their addresses (_native_hook_addresses).
  Hooks h;
  auto fields = std::make_tuple(&h.alloc, &h.free, &h.free_any, &h.record_stream,
                                &h.empty_cache, &h.set_fraction, &h.cache_info, &h.device_stats,
                                &h.reset_peak_stats, &h.reset_accumulated_stats,
                                &h.limit_and_free, &h.memory_fraction, &h.pool_use_count,
                                &h.pool_retain, &h.empty_pool, &h.pool_checkpoint,
                                &h.pool_checkpoint_free, &h.pool_restore, &h.pool_live_blocks,
                                &h.begin_allocate_to_pool, &h.end_allocate_to_pool,
                                &h.release_pool);
  constexpr int kHooks = static_cast<int>(std::tuple_size<decltype(fields)>::value);
  if (addresses == nullptr || count != kHooks) {
    report(err, err_len,
           "gpumem's native allocator takes " + std::to_string(kHooks) + " hook addresses, not " +
               std::to_string(count) + " (a gpumem package and a stale build of this file?)");
    return 1;
  }
  for (int i = 0; i < count; ++i) {
    if (addresses[i] == 0) {
      report(err, err_len, "gpumem hook address " + std::to_string(i) + " is null");
      return 1;
    }
  }
  int next = 0;
  std::apply(
      [&](auto*... field) {
        ((*field = reinterpret_cast<std::remove_reference_t<decltype(*field)>>(addresses[next++])),
         ...);
      },
      fields);
  try {
    hooks = h;
    // Keeps the allocator alive for the process (PyTorch holds the shared_ptr) and checks that
    // PyTorch's own allocator has not been initialized.
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(
        std::make_shared<GpumemAllocator>());
    return 0;
  } catch (const std::exception& e) {
    report(err, err_len, e.what());
  } catch (...) {
    report(err, err_len, "unknown exception");
  }
  return 1;
}

// c10's cacheInfo for `device`, through PyTorch's current allocator exactly as cuDNN calls it
// (the tests check that it reaches gpumem). Returns 0, or 1 if it threw.
extern "C" int gpumem_native_cache_info(int device, size_t* largest) {
  try {
    *largest = 0;
    cca::cacheInfo(static_cast<c10::DeviceIndex>(device), largest);
    return 0;
  } catch (...) {
    return 1;
  }
}

// For the tests, where no GPU can say which device is current: allocate() on `device` and the
// null stream, then (if `release`) drop the tensor's DataPtr, which runs its deleter, both as
// PyTorch would. Writes the pointer to `out`. Returns 0, or 1 with a message in `err` if it
// threw.
extern "C" int gpumem_native_test_allocate(size_t n, int device, int release, void** out,
                                           char* err, int err_len) {
  try {
    auto* allocator = dynamic_cast<GpumemAllocator*>(cca::get());
    TORCH_CHECK(allocator != nullptr, "gpumem's native allocator is not PyTorch's");
    c10::DataPtr p =
        allocator->allocate_with_stream(n, static_cast<c10::DeviceIndex>(device), nullptr);
    *out = p.get();
    if (!release) (void)p.release_context();  // kept: freed later through raw_delete
    return 0;
  } catch (const std::exception& e) {
    report(err, err_len, e.what());
  }
  return 1;
}

// For the tests, where a torch.cuda.MemPool cannot be made (it asks CUDA for the current
// device): what its constructor (step 0, or 1 with use_on_oom=True) and its destructor (step 2)
// call, through c10's functions as they call them. Returns 0, or 1 with a message in `err`.
extern "C" int gpumem_native_test_mem_pool(int device, uint64_t first, uint64_t second, int step,
                                           char* err, int err_len) {
  try {
    const auto dev = static_cast<c10::DeviceIndex>(device);
    const c10::MempoolId_t id{first, second};
    if (step == 0 || step == 1) {
      cca::createOrIncrefPool(dev, id, nullptr);
      if (step == 1) cca::setUseOnOOM(dev, id, true);
    } else {
      cca::setUseOnOOM(dev, id, false);
      cca::releasePool(dev, id);
      cca::emptyCache(id);
    }
    return 0;
  } catch (const std::exception& e) {
    report(err, err_len, e.what());
  }
  return 1;
}

// For the tests, where torch._C._cuda_attach_out_of_memory_observer cannot run (it initializes
// CUDA first): attaches `observer` through c10's attachOutOfMemoryObserver, as that binding
// does. Returns 0, or 1 if it threw.
extern "C" int gpumem_native_test_attach_oom_observer(void (*observer)(int64_t, size_t, size_t,
                                                                       size_t)) {
  try {
    cca::attachOutOfMemoryObserver(observer);
    return 0;
  } catch (...) {
    return 1;
  }
}

// For the tests, where torch.compile's CUDA graph trees cannot run: what they call through
// c10. Step 0: getCheckpointState of pool (first, second), kept in *state. Step 1:
// setCheckpointPoolState with *state; writes to `out` the number of blocks freed, their
// pointers, the number allocated again, then for each its pointer and 1 if its DataPtr carries
// raw_deleter(). Those DataPtrs let go of their blocks, which the test frees with raw_delete.
// Step 2: drops *state. Returns 0, or 1 with a message in `err` (also when `out` is too short).
extern "C" int gpumem_native_test_checkpoint(int device, uint64_t first, uint64_t second,
                                             int step, void** state, uint64_t* out,
                                             size_t out_len, char* err, int err_len) {
  using State = std::shared_ptr<cca::AllocatorState>;
  try {
    const auto dev = static_cast<c10::DeviceIndex>(device);
    if (step == 0) {
      *state = new State(cca::getCheckpointState(dev, c10::MempoolId_t{first, second}));
    } else if (step == 1) {
      cca::CheckpointDelta delta = cca::setCheckpointPoolState(dev, *static_cast<State*>(*state));
      const size_t need = 2 + delta.ptrs_freed.size() + 2 * delta.dataptrs_allocd.size();
      TORCH_CHECK(need <= out_len, "room for ", out_len, " values, ", need, " needed");
      size_t i = 0;
      out[i++] = delta.ptrs_freed.size();
      for (void* p : delta.ptrs_freed) out[i++] = reinterpret_cast<uint64_t>(p);
      out[i++] = delta.dataptrs_allocd.size();
      const auto standard = cca::get()->raw_deleter();
      for (auto& p : delta.dataptrs_allocd) {
        out[i++] = reinterpret_cast<uint64_t>(p.get());
        out[i++] = p.get_deleter() == standard ? 1 : 0;
        (void)p.release_context();
      }
    } else {
      delete static_cast<State*>(*state);
      *state = nullptr;
    }
    return 0;
  } catch (const std::exception& e) {
    report(err, err_len, e.what());
  }
  return 1;
}

// For the tests: allocate() of `n` bytes on `device` and the null stream, kept (freed later
// through raw_delete); writes the pointer to `out`. Returns 1 if its DataPtr carries
// raw_deleter() (while a private pool is being filled), 0 if the device's own deleter, -1 if
// it threw.
extern "C" int gpumem_native_test_deleter(size_t n, int device, void** out) {
  try {
    auto* allocator = dynamic_cast<GpumemAllocator*>(cca::get());
    TORCH_CHECK(allocator != nullptr, "gpumem's native allocator is not PyTorch's");
    c10::DataPtr p =
        allocator->allocate_with_stream(n, static_cast<c10::DeviceIndex>(device), nullptr);
    *out = p.get();
    const bool standard = p.get_deleter() == allocator->raw_deleter();
    (void)p.release_context();
    return standard ? 1 : 0;
  } catch (...) {
    return -1;
  }
}
