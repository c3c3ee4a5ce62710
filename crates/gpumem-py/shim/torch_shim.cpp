// The C++ side of gpumem's PyTorch allocator.
//
// PyTorch's CUDAPluggableAllocator calls `void* alloc(size_t, int, cudaStream_t)` and uses the
// pointer it gets without checking it, so a failed allocation has to reach PyTorch as a C++
// exception thrown from that call. The allocator itself is Rust (src/torch_abi.rs); when it
// fails, it calls gpumem_shim_throw() below, and the exception unwinds through the Rust frame
// (declared "C-unwind") into PyTorch.
//
// Which exception: PyTorch turns a c10::OutOfMemoryError into torch.OutOfMemoryError
// (torch.cuda.OutOfMemoryError) and any other std::exception into RuntimeError. gpumem does not
// link against libtorch (the wheel must import without torch), so it binds c10's
// OutOfMemoryError at run time, once torch is loaded (gpumem_shim_bind_c10): it looks up, by
// their exported names, c10::Error's constructor in libc10.so and OutOfMemoryError's vtable and
// type_info in libc10_cuda.so, checks them, and from then on throws a genuine
// c10::OutOfMemoryError built by c10's own constructor. When that binding is unavailable (no
// torch, another C++ ABI, symbols renamed in a later torch), it throws
// gpumem::OutOfMemoryError, a std::runtime_error that PyTorch reports as RuntimeError; the
// message starts with "CUDA out of memory." either way.

#include <cxxabi.h>
#include <dlfcn.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

extern "C" {
// Defined in Rust (src/torch_abi.rs). May throw what gpumem_shim_throw throws.
void* gpumem_torch_alloc(size_t size, int device, void* stream);
}

namespace gpumem {

// The exception thrown when c10::OutOfMemoryError is not bound.
class OutOfMemoryError : public std::runtime_error {
 public:
  explicit OutOfMemoryError(const std::string& what) : std::runtime_error(what) {}
  ~OutOfMemoryError() override;
};
// Out of line: the key function, so that the vtable and type_info are emitted here once.
OutOfMemoryError::~OutOfMemoryError() = default;

// Any other failure of the allocator (no driver, bad device, too many streams...).
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
  ~Error() override;
};
Error::~Error() = default;

}  // namespace gpumem

namespace {

constexpr int kErrOutOfMemory = 1;

// c10::SourceLocation, passed by value to c10::Error's constructor. Its layout (two pointers
// and a 32-bit line) has been the same in every PyTorch 2.x release.
struct SourceLocation {
  const char* function;
  const char* file;
  uint32_t line;
};

// c10::Error::Error(c10::SourceLocation, std::string): the base-object constructor, called
// with `this` as first argument (Itanium C++ ABI). Declaring it as a free function with the
// same parameters makes the compiler pass the SourceLocation and the std::string exactly as a
// call to the constructor would.
using ErrorCtor = void (*)(void* self, SourceLocation where, std::string msg);

constexpr const char* kErrorCtorSymbol =
    "_ZN3c105ErrorC2ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE";
constexpr const char* kOomTypeinfoSymbol = "_ZTIN3c1016OutOfMemoryErrorE";
constexpr const char* kOomVtableSymbol = "_ZTVN3c1016OutOfMemoryErrorE";
constexpr const char* kOomTypeName = "N3c1016OutOfMemoryErrorE";
constexpr const char* kErrorTypeName = "N3c105ErrorE";

// Bytes reserved for the exception object: c10::Error is 128 bytes in PyTorch 2.11 (x86-64);
// the constructor writes only its own fields, so a larger buffer is harmless and leaves room
// for fields later releases may add.
constexpr size_t kC10ErrorBytes = 1024;

struct C10Binding {
  ErrorCtor ctor;
  std::type_info* oom_type;
  void* oom_vptr;  // address point of OutOfMemoryError's vtable
};

C10Binding g_binding;
std::atomic<bool> g_bound{false};

// c10's memory-profiler entry points (c10/core/Allocator.h), bound with the rest from the
// loaded libc10: whether the calling thread's profiler records memory (a thread-local lookup),
// and the report of one allocation (bytes > 0) or free (bytes < 0) with the device's totals
// after it. PyTorch's own allocator calls both on every allocation and free; gpumem's hooks do
// the same, on both install paths. c10::Device is a DeviceType and a DeviceIndex, one signed
// byte each, passed by value (in a register: it is trivially copyable).
struct Device {
  int8_t type;
  int8_t index;
};
constexpr int8_t kDeviceTypeCuda = 1;  // c10::DeviceType::CUDA
using ProfilingEnabledFn = bool (*)();
using ReportUsageFn = void (*)(void* ptr, int64_t bytes, size_t allocated, size_t reserved,
                               Device device);
constexpr const char* kProfilingEnabledSymbol = "_ZN3c1022memoryProfilingEnabledEv";
constexpr const char* kReportUsageSymbol = "_ZN3c1027reportMemoryUsageToProfilerEPvlmmNS_6DeviceE";
std::atomic<ProfilingEnabledFn> g_profiling_enabled{nullptr};
std::atomic<ReportUsageFn> g_report_usage{nullptr};

void copy_out(const char* s, size_t size, char* buf, size_t len) noexcept {
  if (buf == nullptr || len == 0) return;
  size_t n = size < len - 1 ? size : len - 1;
  std::memcpy(buf, s, n);
  buf[n] = '\0';
}

void copy_out(const std::string& s, char* buf, size_t len) noexcept {
  copy_out(s.data(), s.size(), buf, len);
}

void copy_out(const char* s, char* buf, size_t len) noexcept {
  copy_out(s, std::strlen(s), buf, len);
}

// Serialises binding (install() may be retried from several threads).
std::mutex g_bind_lock;

// Destroys a thrown c10::OutOfMemoryError: a virtual destructor call through std::exception,
// c10::Error's primary base, reaches the complete-object destructor in c10's vtable.
void destroy_c10_error(void* p) { static_cast<std::exception*>(p)->~exception(); }

[[noreturn]] void throw_c10_oom(std::string text) {
  void* obj = __cxxabiv1::__cxa_allocate_exception(kC10ErrorBytes);
  std::memset(obj, 0, kC10ErrorBytes);
  try {
    g_binding.ctor(obj, SourceLocation{"gpumem_torch_alloc", "gpumem/shim/torch_shim.cpp", __LINE__},
                   std::move(text));
  } catch (...) {
    __cxxabiv1::__cxa_free_exception(obj);
    throw;
  }
  // What OutOfMemoryError's (inherited) constructor does after c10::Error's: install its vtable.
  *static_cast<void**>(obj) = g_binding.oom_vptr;
  __cxxabiv1::__cxa_throw(obj, g_binding.oom_type, &destroy_c10_error);
}

std::string demangle(const char* name) {
  int status = 0;
  char* d = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  if (status != 0 || d == nullptr) return name;
  std::string s(d);
  std::free(d);
  return s;
}

}  // namespace

extern "C" {

// Throws the exception for an allocator failure of `kind` (1: out of memory, else another
// error) with the given message. Called from Rust; never returns.
[[noreturn]] void gpumem_shim_throw(int kind, const char* msg, size_t len) {
  std::string text(msg, len);
  if (kind == kErrOutOfMemory) {
    if (g_bound.load(std::memory_order_acquire)) throw_c10_oom(std::move(text));
    throw gpumem::OutOfMemoryError(text);
  }
  throw gpumem::Error(text);
}

}  // extern "C"

namespace {

// Binds c10::OutOfMemoryError from the already loaded libc10.so and libc10_cuda.so (paths or
// sonames). Returns 0 on success, else 1 with the reason in `err`. Loads nothing new
// (RTLD_NOLOAD): the libraries must be those of the torch imported in this process.
int bind_c10(const char* libc10, const char* libc10_cuda, char* err, size_t err_len) {
  std::lock_guard<std::mutex> guard(g_bind_lock);
  // Bound once for the process: throwing code may read the binding from now on.
  if (g_bound.load(std::memory_order_acquire)) return 0;
  void* h_c10 = dlopen(libc10, RTLD_NOW | RTLD_NOLOAD);
  if (h_c10 == nullptr) {
    const char* e = dlerror();
    copy_out(std::string(libc10) + " is not loaded in this process (import torch first)" +
                 (e ? std::string(": ") + e : std::string()),
             err, err_len);
    return 1;
  }
  // The profiler's two functions are bound on their own: without them (renamed in a later
  // torch) gpumem reports nothing to the profiler, and the rest still binds.
  auto* enabled = reinterpret_cast<ProfilingEnabledFn>(dlsym(h_c10, kProfilingEnabledSymbol));
  auto* report = reinterpret_cast<ReportUsageFn>(dlsym(h_c10, kReportUsageSymbol));
  if (enabled != nullptr && report != nullptr) {
    g_report_usage.store(report, std::memory_order_release);
    g_profiling_enabled.store(enabled, std::memory_order_release);
  }
  void* h_cuda = dlopen(libc10_cuda, RTLD_NOW | RTLD_NOLOAD);
  if (h_cuda == nullptr) {
    copy_out(std::string(libc10_cuda) + " is not loaded in this process (is this a CUDA build of torch?)",
             err, err_len);
    return 1;
  }
  void* ctor = dlsym(h_c10, kErrorCtorSymbol);
  void* type = dlsym(h_cuda, kOomTypeinfoSymbol);
  void* vtable = dlsym(h_cuda, kOomVtableSymbol);
  if (type == nullptr) type = dlsym(h_c10, kOomTypeinfoSymbol);
  if (vtable == nullptr) vtable = dlsym(h_c10, kOomVtableSymbol);
  if (ctor == nullptr || type == nullptr || vtable == nullptr) {
    copy_out(std::string("c10 does not export ") +
                 (ctor == nullptr ? "c10::Error(SourceLocation, std::string) with this C++ ABI"
                                  : "c10::OutOfMemoryError's type_info and vtable"),
             err, err_len);
    return 1;
  }
  // Check what the symbols point at before trusting them: the type is named
  // c10::OutOfMemoryError and derives (single, public) from c10::Error, and the vtable starts
  // with offset-to-top 0 and the same type's name (Itanium ABI layout).
  auto* ti = static_cast<std::type_info*>(type);
  auto* si = dynamic_cast<const abi::__si_class_type_info*>(ti);
  if (std::strcmp(ti->name(), kOomTypeName) != 0 || si == nullptr ||
      std::strcmp(si->__base_type->name(), kErrorTypeName) != 0) {
    copy_out("c10::OutOfMemoryError's type_info does not have the expected shape", err, err_len);
    return 1;
  }
  auto** vt = static_cast<void**>(vtable);
  auto* vt_type = static_cast<const std::type_info*>(vt[1]);
  if (reinterpret_cast<intptr_t>(vt[0]) != 0 || vt_type == nullptr ||
      std::strcmp(vt_type->name(), kOomTypeName) != 0) {
    copy_out("c10::OutOfMemoryError's vtable does not have the expected shape", err, err_len);
    return 1;
  }
  g_binding.ctor = reinterpret_cast<ErrorCtor>(ctor);
  g_binding.oom_type = ti;
  g_binding.oom_vptr = &vt[2];
  g_bound.store(true, std::memory_order_release);
  return 0;
}

}  // namespace

extern "C" {

// bind_c10 for Rust: nothing may unwind out of a plain "C" import, so whatever the binding
// throws (std::bad_alloc building a message, std::system_error from the lock) becomes an
// error return.
int gpumem_shim_bind_c10(const char* libc10, const char* libc10_cuda, char* err,
                         size_t err_len) noexcept {
  try {
    return bind_c10(libc10, libc10_cuda, err, err_len);
  } catch (const std::exception& e) {
    copy_out(e.what(), err, err_len);
  } catch (...) {
    copy_out("an unknown C++ exception while binding c10", err, err_len);
  }
  return 1;
}

// 1 when out-of-memory failures are thrown as c10::OutOfMemoryError, 0 when as
// gpumem::OutOfMemoryError (a std::runtime_error).
int gpumem_shim_oom_is_c10(void) noexcept { return g_bound.load(std::memory_order_acquire) ? 1 : 0; }

// Calls gpumem_torch_alloc as PyTorch does and catches what it throws, for tests: returns 0
// with *out set, or 1 (a std::exception: its demangled type and what() copied out), or 2
// (anything else).
int gpumem_shim_call_alloc(size_t size, int device, void* stream, void** out, char* type_buf,
                           size_t type_len, char* msg_buf, size_t msg_len) noexcept {
  // The outer handler catches what the inner ones may throw (demangling allocates), so that
  // nothing unwinds into the Rust caller.
  try {
    try {
      *out = gpumem_torch_alloc(size, device, stream);
      return 0;
    } catch (const std::exception& e) {
      std::type_info* t = abi::__cxa_current_exception_type();
      copy_out(t ? demangle(t->name()) : std::string("?"), type_buf, type_len);
      copy_out(e.what(), msg_buf, msg_len);
      return 1;
    } catch (...) {
      std::type_info* t = abi::__cxa_current_exception_type();
      copy_out(t ? demangle(t->name()) : std::string("?"), type_buf, type_len);
      copy_out("", msg_buf, msg_len);
      return 2;
    }
  } catch (...) {
    copy_out("?", type_buf, type_len);
    copy_out("(the exception could not be described)", msg_buf, msg_len);
    return 2;
  }
}

}  // extern "C"

// CUDA graph capture (torch.cuda.graph, make_graphed_callables) asks the allocator to serve the
// capture's streams from a private pool (c10's beginAllocateToPool, called before
// cudaStreamBeginCapture), so that the memory a graph uses is never handed to another tensor
// while the graph may replay; endAllocateToPool when the capture ends; releasePool when the
// graph is destroyed. The pool itself is gpumem's (Rust: gpumem_torch_pool_*); the shim keeps
// what only C++ can hold, the filter PyTorch gives with each capture (a std::function that says
// whether a stream takes part in it), and answers gpumem_torch_alloc's question, during a
// capture, of which pool a request belongs to.
//
// The signatures are PyTorch's (CUDAPluggableAllocator::set_begin_allocate_to_pool,
// set_end_allocate_to_pool_fn, set_release_pool), spelled without its headers:
// c10::cuda::MempoolId_t is std::pair<unsigned long long, unsigned long long> and cudaStream_t
// is CUstream_st*. The native allocator (python/gpumem/csrc/torch_allocator.cpp) calls the
// same three functions.
struct CUstream_st;

extern "C" {
// Defined in Rust (src/torch_abi.rs): 0, or 1 with the reason in `err`.
int gpumem_torch_pool_begin(int device, uint64_t first, uint64_t second, char* err,
                            size_t err_len);
int gpumem_torch_pool_end(int device, uint64_t first, uint64_t second, char* err,
                          size_t err_len);
int gpumem_torch_pool_release(int device, uint64_t first, uint64_t second, char* err,
                              size_t err_len);
}

namespace {

using PoolId = std::pair<unsigned long long, unsigned long long>;
using StreamFilter = std::function<bool(CUstream_st*)>;

struct Capture {
  int device;
  PoolId pool;
  StreamFilter filter;
};

// The captures underway. Read by every allocation while one is (a handful at most).
std::mutex g_captures_mutex;
std::vector<Capture> g_captures;

constexpr size_t kPoolErrLen = 1024;

void begin_allocate_to_pool(int device, PoolId pool, StreamFilter filter) {
  char err[kPoolErrLen] = {0};
  if (gpumem_torch_pool_begin(device, pool.first, pool.second, err, sizeof err) != 0) {
    throw gpumem::Error(std::string("cannot begin a CUDA graph capture: ") + err);
  }
  try {
    std::lock_guard<std::mutex> lock(g_captures_mutex);
    g_captures.push_back(Capture{device, pool, std::move(filter)});
  } catch (...) {
    // Not recorded here (out of memory on the host): undone on gpumem's side too, so that it
    // neither stays in capture mode nor keeps the pool for a graph that will never exist.
    gpumem_torch_pool_end(device, pool.first, pool.second, err, sizeof err);
    gpumem_torch_pool_release(device, pool.first, pool.second, err, sizeof err);
    throw;
  }
}

void end_allocate_to_pool(int device, PoolId pool) {
  {
    std::lock_guard<std::mutex> lock(g_captures_mutex);
    for (auto it = g_captures.begin(); it != g_captures.end(); ++it) {
      if (it->device == device && it->pool == pool) {
        g_captures.erase(it);
        break;
      }
    }
  }
  char err[kPoolErrLen] = {0};
  if (gpumem_torch_pool_end(device, pool.first, pool.second, err, sizeof err) != 0) {
    throw gpumem::Error(std::string("cannot end a CUDA graph capture: ") + err);
  }
}

// Called from CUDAGraph::reset(), which runs in the graph's destructor: it must not throw.
void release_pool(int device, PoolId pool) noexcept {
  char err[kPoolErrLen] = {0};
  if (gpumem_torch_pool_release(device, pool.first, pool.second, err, sizeof err) != 0) {
    std::fprintf(stderr, "gpumem: warning: releasing a CUDA graph's pool: %s\n", err);
  }
}

}  // namespace

extern "C" {

// The address of one of the hooks above (0 begin, 1 end, 2 release; null for another value),
// for PyTorch's setters and the native allocator (Rust passes them on: a C++ symbol of a
// static library is not exported by the wheel's shared library).
const void* gpumem_shim_pool_hook_address(int which) noexcept {
  switch (which) {
    case 0:
      return reinterpret_cast<const void*>(&begin_allocate_to_pool);
    case 1:
      return reinterpret_cast<const void*>(&end_allocate_to_pool);
    case 2:
      return reinterpret_cast<const void*>(&release_pool);
    default:
      return nullptr;
  }
}

// Which capture's pool a request on `stream` of `device` belongs to: 1 with the pool in
// out[0], out[1], or 0 when none (no capture on the device, or the stream takes part in none).
int gpumem_shim_capture_pool(int device, void* stream, uint64_t* out) noexcept {
  try {
    std::lock_guard<std::mutex> lock(g_captures_mutex);
    for (const Capture& c : g_captures) {
      if (c.device == device && c.filter && c.filter(static_cast<CUstream_st*>(stream))) {
        out[0] = c.pool.first;
        out[1] = c.pool.second;
        return 1;
      }
    }
  } catch (...) {
    // A filter that throws (its CUDA query failed) does not claim the request.
  }
  return 0;
}

// For the tests without a GPU: a capture of pool (first, second) on `device` whose filter takes
// exactly the stream `stream`, begun and ended as PyTorch's CUDAGraph does (through the hooks
// above). Returns 0, or 1 with the exception's message in `err`.
int gpumem_shim_test_capture(int begin, int device, uint64_t first, uint64_t second,
                             void* stream, char* err, size_t err_len) noexcept {
  try {
    PoolId pool{first, second};
    if (begin) {
      begin_allocate_to_pool(device, pool,
                             [stream](CUstream_st* s) { return static_cast<void*>(s) == stream; });
    } else {
      end_allocate_to_pool(device, pool);
    }
    return 0;
  } catch (const std::exception& e) {
    copy_out(e.what(), err, err_len);
    return 1;
  }
}

}  // extern "C"

extern "C" {

// 1 when PyTorch's profiler records memory on the calling thread (torch.profiler with
// profile_memory=True), 0 when not or when c10's functions are not bound.
int gpumem_shim_profiler_records_memory(void) noexcept {
  ProfilingEnabledFn enabled = g_profiling_enabled.load(std::memory_order_acquire);
  if (enabled == nullptr) return 0;
  try {
    return enabled() ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

// Tells the profiler of an allocation (bytes > 0) or a free (bytes < 0) of the block at `ptr`
// on CUDA device `device`, with the device's bytes allocated and reserved after it.
void gpumem_shim_profiler_report(void* ptr, int64_t bytes, uint64_t allocated,
                                 uint64_t reserved, int device) noexcept {
  ReportUsageFn report = g_report_usage.load(std::memory_order_acquire);
  if (report == nullptr) return;
  try {
    report(ptr, bytes, static_cast<size_t>(allocated), static_cast<size_t>(reserved),
           Device{kDeviceTypeCuda, static_cast<int8_t>(device)});
  } catch (...) {
    // A report that fails loses one profiler event, never the allocation.
  }
}

// 1 when c10's profiler functions are bound (gpumem.torch.install() binds them).
int gpumem_shim_profiler_bound(void) noexcept {
  return g_profiling_enabled.load(std::memory_order_acquire) != nullptr ? 1 : 0;
}

}  // extern "C"
