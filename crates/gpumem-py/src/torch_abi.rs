//! The C functions PyTorch's `CUDAPluggableAllocator` calls (signatures from PyTorch 2.11's
//! `torch/csrc/cuda/CUDAPluggableAllocator.h`):
//!
//! | function | PyTorch hook | signature |
//! |---|---|---|
//! | [`gpumem_torch_alloc`] | alloc (constructor) | `void* (size_t size, int device, cudaStream_t stream)` |
//! | [`gpumem_torch_free`] | free (constructor) | `void (void* ptr, size_t size, int device, cudaStream_t stream)` |
//! | [`gpumem_torch_free_any`] | the native allocator's `raw_delete` (not a pluggable hook) | `void (void* ptr)` |
//! | [`gpumem_torch_cache_info`] | the native allocator's `cacheInfo` (not a pluggable hook) | `size_t (int device)` |
//! | [`gpumem_torch_record_stream`] | `set_record_stream_fn` | `void (void* ptr, cudaStream_t stream)` |
//! | [`gpumem_torch_empty_cache`] | `set_reset_fn` (`torch.cuda.empty_cache`) | `void ()` |
//! | [`gpumem_torch_set_memory_fraction`] | `set_memory_fraction_fn` | `void (double fraction, int device)` |
//! | [`gpumem_torch_device_stats`] | the native allocator's `getDeviceStats` | `size_t (int device, int64_t* out, size_t len)` |
//! | [`gpumem_torch_reset_peak_stats`] | the native allocator's `resetPeakStats` | `int (int device)` |
//! | [`gpumem_torch_reset_accumulated_stats`] | the native allocator's `resetAccumulatedStats` | `int (int device)` |
//! | [`gpumem_torch_memory_fraction`] | the native allocator's `getMemoryFraction` | `double (int device)` |
//! | [`gpumem_torch_limit_and_free`] | the native allocator's out-of-memory observers | `int (int device, uint64_t out[2])` |
//! | [`gpumem_torch_pool_hook_address`] | the addresses of the C++ hooks of CUDA graph capture: `set_begin_allocate_to_pool`, `set_end_allocate_to_pool_fn`, `set_release_pool` (and the native allocator's methods of the same names) | `size_t (int which)` |
//! | [`gpumem_torch_pool_begin`], [`gpumem_torch_pool_end`], [`gpumem_torch_pool_release`] | what those hooks call: a private pool begun, ended, released | `int (int device, uint64_t first, uint64_t second, char* err, size_t err_len)` |
//! | [`gpumem_torch_pool_use_count`] | the native allocator's `getPoolUseCount` | `int (int device, uint64_t first, uint64_t second)` |
//! | [`gpumem_torch_empty_pool`] | the native allocator's `emptyCache(mempool_id)` of one pool | `void (uint64_t first, uint64_t second)` |
//! | [`gpumem_torch_pool_retain`] | the native allocator's `createOrIncrefPool` (`torch.cuda.MemPool`) | as [`gpumem_torch_pool_begin`] |
//! | [`gpumem_torch_pool_checkpoint`], [`gpumem_torch_pool_checkpoint_free`] | the native allocator's `getCheckpointState` (torch.compile's CUDA graph trees): an owned handle | `void* (int device, uint64_t first, uint64_t second, char* err, size_t err_len)`, `void (void*)` |
//! | [`gpumem_torch_pool_live_blocks`] | its `checkPoolLiveAllocations`: the addresses of a pool's allocated blocks | `int64_t (int device, uint64_t first, uint64_t second, uint64_t* out, size_t cap, char* err, size_t err_len)` |
//! | [`gpumem_torch_pool_restore`] | its `setCheckpointPoolState`: the blocks freed and allocated again, told one by one | `int (int device, const void* checkpoint, void* ctx, void (*freed)(void*, uint64_t), void (*allocated)(void*, uint64_t), char* err, size_t err_len)` |
//!
//! CUDA graphs (`torch.cuda.graph`, `make_graphed_callables`) get private pools: while a
//! capture is underway, an allocation asks the shim which pool, if any, the stream's request
//! belongs to (the shim runs the filters PyTorch gave with each capture), and serves
//! it from that pool (see `gpumem_core::engine::pools`).
//!
//! The allocation and free functions tell PyTorch's memory profiler of each block they hand out
//! or take back while it records memory (`torch.profiler` with `profile_memory=True`), as
//! PyTorch's own allocator does, through c10's functions bound by [`bind_c10`]: on both install
//! paths, one check of a thread-local flag per call when it does not.
//!
//! No Rust panic crosses these functions: each runs inside `catch_unwind`. The allocation
//! function is the only one that fails visibly: PyTorch never checks the pointer it returns,
//! so a failure is thrown as a C++ exception by the shim (`shim/torch_shim.cpp`), which
//! unwinds through [`gpumem_torch_alloc`] (declared `extern "C-unwind"` for that reason) into
//! PyTorch. The free function runs inside PyTorch's deleters, where an exception would end the
//! process, so it reports misuse on stderr and in counters instead.
//!
//! A panic caught in a call that changes gpumem's state (an allocation, a free, a stream
//! record, a private-pool call, emptying the cache, a reset of statistics) may have left a pool
//! half-updated, a block both on a free list and handed out say. So it poisons the allocator
//! for the process: later allocations and pool calls fail with an error that says so, and later
//! frees, cache empties and resets are ignored (freed memory stays held), rather than hand out
//! memory that may already be in use.

use crate::registry::{device_index, global, warn, FreeOutcome, PoolOp, TorchError};
use gpumem_core::backend::DevPtr;
use std::ffi::{c_char, c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};

/// Set by the first panic caught inside a call that changes gpumem's state (module docs).
static POISONED: AtomicBool = AtomicBool::new(false);

/// Why a poisoned allocator refuses a request.
const POISONED_MESSAGE: &str = "gpumem: an earlier internal error (a panic, reported when it \
     happened) may have left the allocator's state inconsistent, so it serves no more requests in \
     this process; please report it";

/// Runs `f`, which changes gpumem's state, unless `poison` is set; a panic inside `f` sets
/// `poison` and comes back as an error naming `what` (a poisoned allocator's error otherwise).
fn guarded<T>(
    poison: &AtomicBool,
    what: impl FnOnce() -> String,
    f: impl FnOnce() -> Result<T, TorchError>,
) -> Result<T, TorchError> {
    if poison.load(Ordering::Relaxed) {
        return Err(TorchError::Other(POISONED_MESSAGE.into()));
    }
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        poison.store(true, Ordering::Relaxed);
        Err(TorchError::Other(format!(
            "gpumem: internal error (a panic) {}; gpumem serves no more requests in this \
             process, as its state may be inconsistent; please report it",
            what()
        )))
    })
}

/// A call that cannot fail visibly (a free, a stream record, emptying the cache, a reset):
/// `f` under [`guarded`], its result dropped, the error (a panic, or a poisoned allocator,
/// reported once) on stderr. A poisoned allocator ignores the call.
fn guarded_quietly<R>(what: impl FnOnce() -> String, f: impl FnOnce() -> R) {
    static TOLD: AtomicBool = AtomicBool::new(false);
    let poisoned_before = POISONED.load(Ordering::Relaxed);
    if let Err(e) = guarded(&POISONED, what, || Ok(f())) {
        if !poisoned_before || !TOLD.swap(true, Ordering::Relaxed) {
            warn(format_args!("{}", e.message()));
        }
    }
}

/// Error kinds understood by `gpumem_shim_throw`.
const KIND_OUT_OF_MEMORY: c_int = 1;
const KIND_OTHER: c_int = 2;

extern "C-unwind" {
    /// Throws the C++ exception for an allocator failure (`shim/torch_shim.cpp`).
    fn gpumem_shim_throw(kind: c_int, msg: *const c_char, len: usize) -> !;
}

extern "C" {
    fn gpumem_shim_bind_c10(
        libc10: *const c_char,
        libc10_cuda: *const c_char,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn gpumem_shim_oom_is_c10() -> c_int;
    fn gpumem_shim_pool_hook_address(which: c_int) -> *const c_void;
    fn gpumem_shim_capture_pool(device: c_int, stream: *mut c_void, out: *mut u64) -> c_int;
    fn gpumem_shim_test_capture(
        begin: c_int,
        device: c_int,
        first: u64,
        second: u64,
        stream: *mut c_void,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn gpumem_shim_profiler_records_memory() -> c_int;
    fn gpumem_shim_profiler_report(
        ptr: *mut c_void,
        bytes: i64,
        allocated: u64,
        reserved: u64,
        device: c_int,
    );
    fn gpumem_shim_profiler_bound() -> c_int;
    fn gpumem_shim_call_alloc(
        size: usize,
        device: c_int,
        stream: *mut c_void,
        out: *mut *mut c_void,
        type_buf: *mut c_char,
        type_len: usize,
        msg_buf: *mut c_char,
        msg_len: usize,
    ) -> c_int;
}

/// Throws `e` as a C++ exception into the caller of [`gpumem_torch_alloc`].
fn throw(e: TorchError) -> ! {
    let kind = match e {
        TorchError::OutOfMemory(_) => KIND_OUT_OF_MEMORY,
        TorchError::Other(_) => KIND_OTHER,
    };
    let msg = e.message();
    // SAFETY: `msg` points to `msg.len()` initialised bytes that stay alive for the call (the
    // shim copies them into its exception before throwing). The function never returns; the
    // exception unwinds through this frame, which is allowed because the import is declared
    // "C-unwind" and this frame holds no lock. Once c10 is bound (`bind_c10`), the exception
    // is a c10::OutOfMemoryError that c10's own constructor builds in a 1,024-byte buffer.
    // Binding checks the type's name, base class and vtable shape; it cannot check two
    // layouts the shim assumes: c10::SourceLocation (two pointers and a 32-bit line in every
    // PyTorch 2.x) and c10::Error fitting in 1,024 bytes (128 in 2.11). The constructor's
    // mangled name fixes libstdc++'s C++11 string ABI: a torch built with the old ABI does
    // not export it, and binding fails (then a std::runtime_error is thrown instead).
    unsafe { gpumem_shim_throw(kind, msg.as_ptr().cast(), msg.len()) }
}

/// PyTorch's allocation hook: `size` bytes on `device` for use on `stream`. Returns null for
/// zero bytes (as PyTorch's own allocator does); throws a C++ exception on failure (a
/// `c10::OutOfMemoryError` once [`bind_c10`] succeeded, else a `std::runtime_error`).
#[no_mangle]
pub extern "C-unwind" fn gpumem_torch_alloc(
    size: usize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    let (ptr, bytes) = served_or_thrown(size, device, || {
        global().alloc_sized(size as u64, device, stream as u64)
    });
    if ptr != 0 && profiler_records_memory() {
        if let Ok(d) = device_index(device) {
            report_to_profiler(ptr, bytes as i64, d);
        }
    }
    ptr as *mut c_void
}

/// The private pool of the capture `stream` takes part in on `device`, if any (asked only
/// while a capture is underway): the shim runs the filters PyTorch gave with the captures.
#[cold]
pub(crate) fn capture_pool(device: usize, stream: u64) -> Option<(u64, u64)> {
    let mut id = [0u64; 2];
    // SAFETY: `id` is valid for the two writes the shim makes when it answers 1; the shim
    // function is noexcept (a filter that throws counts as not matching). The stream is only
    // passed to the filters, never dereferenced here.
    let found = unsafe {
        gpumem_shim_capture_pool(
            device as c_int,
            stream as usize as *mut c_void,
            id.as_mut_ptr(),
        )
    };
    (found == 1).then_some((id[0], id[1]))
}

/// For the tests: begins (`begin`) or ends a capture of `pool` on `device` whose filter takes
/// exactly `stream`, through the shim's own hooks; the error is what the hook threw.
pub fn test_capture(
    begin: bool,
    device: c_int,
    pool: (u64, u64),
    stream: u64,
) -> Result<(), String> {
    let mut err = [0 as c_char; 1024];
    // SAFETY: `err` is valid for `err.len()` writes; the shim function is noexcept and only
    // compares `stream` with the streams its filter is asked about.
    let rc = unsafe {
        gpumem_shim_test_capture(
            c_int::from(begin),
            device,
            pool.0,
            pool.1,
            stream as usize as *mut c_void,
            err.as_mut_ptr(),
            err.len(),
        )
    };
    if rc == 0 {
        return Ok(());
    }
    // SAFETY: on failure the shim wrote a NUL-terminated message (copy_out cuts it to fit).
    Err(unsafe { std::ffi::CStr::from_ptr(err.as_ptr()) }
        .to_string_lossy()
        .into_owned())
}

/// Whether PyTorch's profiler records memory on this thread (never before [`bind_c10`]).
#[inline]
fn profiler_records_memory() -> bool {
    // SAFETY: no arguments; the shim function is noexcept and reads an atomic function pointer
    // that bind_c10 set to c10's own function, or null.
    unsafe { gpumem_shim_profiler_records_memory() != 0 }
}

/// Tells the profiler of the block at `ptr` handed out (`bytes` > 0) or taken back (< 0) on
/// `device`, with the device's bytes allocated and reserved after it.
#[cold]
fn report_to_profiler(ptr: DevPtr, bytes: i64, device: usize) {
    let Ok((allocated, reserved)) = catch_unwind(|| usage(device)) else {
        return;
    };
    // SAFETY: plain values; the shim function is noexcept (it swallows what c10 throws) and
    // does nothing if c10's function is not bound. c10 only records the pointer's value.
    unsafe {
        gpumem_shim_profiler_report(
            ptr as *mut c_void,
            bytes,
            allocated.max(0) as u64,
            reserved.max(0) as u64,
            device as c_int,
        )
    };
}

/// Whether [`bind_c10`] found c10's memory-profiler functions.
pub fn profiler_bound() -> bool {
    // SAFETY: no arguments; reads an atomic of the shim.
    unsafe { gpumem_shim_profiler_bound() != 0 }
}

/// What a free came to, told to the profiler when it records memory.
#[inline]
fn report_free(ptr: *mut c_void, (outcome, found): (FreeOutcome, Option<usize>)) {
    if let (FreeOutcome::Freed(bytes), Some(d)) = (outcome, found) {
        if profiler_records_memory() {
            report_to_profiler(ptr as DevPtr, -(bytes as i64), d);
        }
    }
}

/// What `allocate` returned, or (on an error or a panic) the C++ exception for it thrown into
/// the caller: the one way out of gpumem's allocation hooks.
fn served_or_thrown<T>(
    size: usize,
    device: c_int,
    allocate: impl FnOnce() -> Result<T, TorchError>,
) -> T {
    guarded(
        &POISONED,
        || format!("while allocating {size} bytes on device {device}"),
        allocate,
    )
    .unwrap_or_else(|e| throw(e))
}

/// PyTorch's free hook. `size` is what was asked for and `stream` the stream of the
/// allocation. Never throws: a foreign pointer or a double free is counted and reported once.
#[no_mangle]
pub extern "C" fn gpumem_torch_free(
    ptr: *mut c_void,
    _size: usize,
    device: c_int,
    stream: *mut c_void,
) {
    guarded_quietly(
        || format!("while freeing {ptr:p}"),
        || {
            report_free(
                ptr,
                global().free_located(ptr as u64, device, stream as u64),
            )
        },
    );
}

/// Frees `ptr` wherever gpumem allocated it: the native allocator's `raw_delete` and
/// `raw_deleter` (`python/gpumem/csrc/torch_allocator.cpp`), which know only the pointer.
/// Never throws; misuse is counted and reported once, as in [`gpumem_torch_free`].
#[no_mangle]
pub extern "C" fn gpumem_torch_free_any(ptr: *mut c_void) {
    guarded_quietly(
        || format!("while freeing {ptr:p}"),
        || report_free(ptr, global().free_any_located(ptr as u64)),
    );
}

/// The largest allocation `device` can serve now without running out of memory: the native
/// allocator's `cacheInfo`, which cuDNN's benchmark mode sizes its workspaces by (PyTorch's
/// pluggable allocator has no such hook and raises there). 0 on failure, reported once.
#[no_mangle]
pub extern "C" fn gpumem_torch_cache_info(device: c_int) -> usize {
    match catch_unwind(|| global().cache_info(device)) {
        Ok(bytes) => usize::try_from(bytes).unwrap_or(usize::MAX),
        Err(_) => {
            warn(format_args!(
                "gpumem: internal error (a panic) in cache_info; please report it"
            ));
            0
        }
    }
}

/// `Tensor.record_stream(stream)`: the block at `ptr` is not reused before the work queued on
/// `stream` at the time it is freed has completed.
#[no_mangle]
pub extern "C" fn gpumem_torch_record_stream(ptr: *mut c_void, stream: *mut c_void) {
    guarded_quietly(
        || format!("in record_stream of {ptr:p}"),
        || {
            global().record_stream(ptr as u64, stream as u64);
        },
    );
}

/// `torch.cuda.empty_cache()`: every device returns the memory no tensor uses.
#[no_mangle]
pub extern "C" fn gpumem_torch_empty_cache() {
    guarded_quietly(|| "in empty_cache".into(), || global().empty_cache());
}

/// c10's `emptyCache(mempool_id)` for a pool other than (0, 0): every device returns the
/// cached memory of that private pool alone, once no one uses it (a `torch.cuda.MemPool`'s
/// destructor calls it).
#[no_mangle]
pub extern "C" fn gpumem_torch_empty_pool(first: u64, second: u64) {
    guarded_quietly(
        || "in empty_cache of a pool".into(),
        || global().empty_pool_cache((first, second)),
    );
}

/// `torch.cuda.set_per_process_memory_fraction(fraction, device)`.
#[no_mangle]
pub extern "C" fn gpumem_torch_set_memory_fraction(fraction: f64, device: c_int) {
    match catch_unwind(|| global().set_memory_fraction(fraction, device)) {
        Ok(Ok(())) => {}
        Ok(Err(e)) => warn(format_args!("{}", e.message())),
        Err(_) => warn(format_args!(
            "gpumem: internal error (a panic) in set_memory_fraction"
        )),
    }
}

/// How many values [`gpumem_torch_device_stats`] writes: c10's `DeviceStats` in its own order.
/// First its nine statistics (allocation, segment, active, inactive_split, allocated_bytes,
/// reserved_bytes, active_bytes, inactive_split_bytes, requested_bytes). Each has three pools
/// (all, small, large) of four values (current, peak, allocated, freed). Then the counters
/// num_alloc_retries, num_ooms, num_sync_all_streams, num_device_alloc and num_device_free.
/// `python/gpumem/csrc/torch_allocator.cpp` reads them in this order.
pub const DEVICE_STATS_LEN: usize = 9 * 3 * 4 + 5;

/// `device`'s statistics in c10's order (see [`DEVICE_STATS_LEN`]).
pub fn device_stats_array(device: usize) -> [i64; DEVICE_STATS_LEN] {
    let m = global().memory_stats(device);
    let mut out = [0i64; DEVICE_STATS_LEN];
    let stats = m
        .arrays()
        .into_iter()
        .flat_map(|(_, a)| a.each())
        .flat_map(|(_, s)| [s.current, s.peak, s.allocated, s.freed]);
    let counters = m.counters().map(|(_, v)| v);
    for (o, v) in out.iter_mut().zip(stats.chain(counters)) {
        *o = v;
    }
    out
}

/// c10's `getDeviceStats`: writes the first `len` of `device`'s [`DEVICE_STATS_LEN`]
/// statistics to `out` (all zero where gpumem never allocated) and returns
/// [`DEVICE_STATS_LEN`]; returns 0, writing nothing, for a device index that cannot be one.
///
/// # Safety
/// `out` must be valid for writes of `len` `int64_t`s (or `len` must be 0).
#[no_mangle]
pub unsafe extern "C" fn gpumem_torch_device_stats(
    device: c_int,
    out: *mut i64,
    len: usize,
) -> usize {
    let Ok(d) = device_index(device) else {
        return 0;
    };
    let Ok(values) = catch_unwind(|| device_stats_array(d)) else {
        warn(format_args!(
            "gpumem: internal error (a panic) in device_stats; please report it"
        ));
        return 0;
    };
    let n = len.min(DEVICE_STATS_LEN);
    if n > 0 && !out.is_null() {
        // SAFETY: the caller guarantees `out` is valid for `len` writes, and n <= len.
        unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), out, n) };
    }
    DEVICE_STATS_LEN
}

/// c10's `resetPeakStats`: `device`'s peaks become the current values. Returns 0, or 1 for a
/// device index that cannot be one.
#[no_mangle]
pub extern "C" fn gpumem_torch_reset_peak_stats(device: c_int) -> c_int {
    reset(device, |d| global().reset_peak_stats(d), "reset_peak_stats")
}

/// c10's `resetAccumulatedStats`: `device`'s allocated/freed totals and counters go to zero.
/// Returns 0, or 1 for a device index that cannot be one.
#[no_mangle]
pub extern "C" fn gpumem_torch_reset_accumulated_stats(device: c_int) -> c_int {
    reset(
        device,
        |d| global().reset_accumulated_stats(d),
        "reset_accumulated_stats",
    )
}

fn reset(device: c_int, f: impl FnOnce(usize), what: &str) -> c_int {
    let Ok(d) = device_index(device) else {
        return 1;
    };
    guarded_quietly(|| format!("in {what}"), || f(d));
    0
}

/// `device`'s bytes allocated and reserved now, as the profiler is told them.
fn usage(device: usize) -> (i64, i64) {
    let m = global().memory_stats(device);
    (m.allocated_bytes.all.current, m.reserved_bytes.all.current)
}

/// c10's `getMemoryFraction` (`torch.cuda.get_per_process_memory_fraction`): `device`'s cap as
/// the fraction it was given as, 1 without one. Returns -1 for a device index that cannot be
/// one or an allocator that cannot be made there, reported once.
#[no_mangle]
pub extern "C" fn gpumem_torch_memory_fraction(device: c_int) -> f64 {
    match catch_unwind(|| global().memory_fraction(device)) {
        Ok(Ok(f)) => f,
        Ok(Err(e)) => {
            warn(format_args!("{}", e.message()));
            -1.0
        }
        Err(_) => {
            warn(format_args!(
                "gpumem: internal error (a panic) in memory_fraction; please report it"
            ));
            -1.0
        }
    }
}

/// What the native allocator tells PyTorch's out-of-memory observers
/// (`torch._C._cuda_attach_out_of_memory_observer`) of `device` after a failed allocation:
/// writes the most gpumem may hold there (its cap, or the device's total bytes) and the
/// device's free bytes to `out`. Returns 0, or 1 (nothing written) for a device index that
/// cannot be one, where gpumem never allocated, or a null `out`.
///
/// # Safety
/// `out` must be null or valid for writes of two `uint64_t`s.
#[no_mangle]
pub unsafe extern "C" fn gpumem_torch_limit_and_free(device: c_int, out: *mut u64) -> c_int {
    let figures = device_index(device)
        .ok()
        .and_then(|d| catch_unwind(|| global().limit_and_free(d)).ok().flatten());
    let Some((limit, free)) = figures else {
        return 1;
    };
    if out.is_null() {
        return 1;
    }
    // SAFETY: `out` is not null, and the caller guarantees it is valid for two writes.
    unsafe { std::ptr::copy_nonoverlapping([limit, free].as_ptr(), out, 2) };
    0
}

/// Which C++ hook [`gpumem_torch_pool_hook_address`] gives: c10's `beginAllocateToPool`
/// (`void(int, MempoolId_t, std::function<bool(cudaStream_t)>)`), `endAllocateToPool` and
/// `releasePool` (both `void(int, MempoolId_t)`).
pub const POOL_HOOK_BEGIN: c_int = 0;
/// See [`POOL_HOOK_BEGIN`].
pub const POOL_HOOK_END: c_int = 1;
/// See [`POOL_HOOK_BEGIN`].
pub const POOL_HOOK_RELEASE: c_int = 2;

/// The address of one of the shim's CUDA graph hooks (`shim/torch_shim.cpp`; `which` is one
/// of the `POOL_HOOK_*` values), for `CUDAPluggableAllocator`'s setters and the native
/// allocator; 0 for another value. Their signatures are C++'s, so they are handed over as
/// addresses and only ever called from C++.
#[no_mangle]
pub extern "C" fn gpumem_torch_pool_hook_address(which: c_int) -> usize {
    // SAFETY: returns the address of a function defined in the shim, or null; no state.
    unsafe { gpumem_shim_pool_hook_address(which) as usize }
}

/// A CUDA graph capture begins filling private pool (`first`, `second`) on `device`. Returns
/// 0, or 1 with the reason in `err` (NUL-terminated, cut to `err_len`), which the shim throws.
///
/// # Safety
/// `err` is null or valid for `err_len` writes (as for every private-pool function below).
#[no_mangle]
pub unsafe extern "C" fn gpumem_torch_pool_begin(
    device: c_int,
    first: u64,
    second: u64,
    err: *mut c_char,
    err_len: usize,
) -> c_int {
    // SAFETY: the caller's promise on `err`, passed on.
    unsafe { pool_call(device, PoolOp::Begin, (first, second), err, err_len) }
}

/// A `torch.cuda.MemPool` takes pool (`first`, `second`) on `device`, made on first use
/// (c10's `createOrIncrefPool`). As [`gpumem_torch_pool_begin`].
///
/// # Safety
/// As [`gpumem_torch_pool_begin`].
#[no_mangle]
pub unsafe extern "C" fn gpumem_torch_pool_retain(
    device: c_int,
    first: u64,
    second: u64,
    err: *mut c_char,
    err_len: usize,
) -> c_int {
    // SAFETY: the caller's promise on `err`, passed on.
    unsafe { pool_call(device, PoolOp::Retain, (first, second), err, err_len) }
}

/// The capture filling pool (`first`, `second`) on `device` ended. As
/// [`gpumem_torch_pool_begin`].
///
/// # Safety
/// As [`gpumem_torch_pool_begin`].
#[no_mangle]
pub unsafe extern "C" fn gpumem_torch_pool_end(
    device: c_int,
    first: u64,
    second: u64,
    err: *mut c_char,
    err_len: usize,
) -> c_int {
    // SAFETY: the caller's promise on `err`, passed on.
    unsafe { pool_call(device, PoolOp::End, (first, second), err, err_len) }
}

/// A graph using pool (`first`, `second`) on `device` was destroyed. As
/// [`gpumem_torch_pool_begin`].
///
/// # Safety
/// As [`gpumem_torch_pool_begin`].
#[no_mangle]
pub unsafe extern "C" fn gpumem_torch_pool_release(
    device: c_int,
    first: u64,
    second: u64,
    err: *mut c_char,
    err_len: usize,
) -> c_int {
    // SAFETY: the caller's promise on `err`, passed on.
    unsafe { pool_call(device, PoolOp::Release, (first, second), err, err_len) }
}

/// Users of pool (`first`, `second`) on `device`: the graphs captured into it and not yet
/// destroyed (0 for an unknown pool or device).
#[no_mangle]
pub extern "C" fn gpumem_torch_pool_use_count(device: c_int, first: u64, second: u64) -> c_int {
    let Ok(d) = device_index(device) else {
        return 0;
    };
    catch_unwind(|| global().pool_use_count(d, (first, second)))
        .map_or(0, |n| n.min(c_int::MAX as u32) as c_int)
}

/// A checkpoint handed to C++: the device it was taken on and the pool's blocks then.
struct TorchCheckpoint {
    device: usize,
    checkpoint: gpumem_core::PoolCheckpoint,
}

/// The addresses of the checkpoint handles given out and not yet freed, so that a handle C++
/// did not get from gpumem, or freed already, is refused instead of read.
static LIVE_CHECKPOINTS: std::sync::Mutex<Vec<usize>> = std::sync::Mutex::new(Vec::new());

/// [`LIVE_CHECKPOINTS`], locked (a panic while it was held left it whole: each change is one
/// push or one swap_remove).
fn live_checkpoints() -> std::sync::MutexGuard<'static, Vec<usize>> {
    LIVE_CHECKPOINTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// c10's `getCheckpointState`: the blocks of private pool (`first`, `second`) on `device` now,
/// as an owned handle for [`gpumem_torch_pool_restore`], to be freed with
/// [`gpumem_torch_pool_checkpoint_free`]. Null on failure, with the reason in `err`.
///
/// # Safety
/// As [`gpumem_torch_pool_begin`].
#[no_mangle]
pub unsafe extern "C" fn gpumem_torch_pool_checkpoint(
    device: c_int,
    first: u64,
    second: u64,
    err: *mut c_char,
    err_len: usize,
) -> *mut c_void {
    // SAFETY: the caller's promise on `err`, passed on.
    let taken = unsafe {
        pool_entry(device, "a checkpoint", err, err_len, |d| {
            global()
                .pool_checkpoint(d, (first, second))
                .map(|checkpoint| TorchCheckpoint {
                    device: d,
                    checkpoint,
                })
        })
    };
    taken.map_or(std::ptr::null_mut(), |cp| {
        let handle = Box::into_raw(Box::new(cp));
        live_checkpoints().push(handle as usize);
        handle.cast()
    })
}

/// Frees a handle of [`gpumem_torch_pool_checkpoint`] (null: nothing). A handle that is not a
/// live one (never given out, or freed already) is left alone and reported on stderr.
#[no_mangle]
pub extern "C" fn gpumem_torch_pool_checkpoint_free(checkpoint: *mut c_void) {
    if checkpoint.is_null() {
        return;
    }
    let mut live = live_checkpoints();
    let Some(i) = live.iter().position(|&h| h == checkpoint as usize) else {
        warn(format_args!(
            "gpumem: getCheckpointState's handle {checkpoint:p} freed, but it is not a live \
             handle of gpumem (freed twice, or never given out); ignored"
        ));
        return;
    };
    live.swap_remove(i);
    // SAFETY: a live handle (checked above): made by `Box::into_raw` in
    // gpumem_torch_pool_checkpoint and not freed since; it left the live list under its lock,
    // so no other call frees it again.
    drop(unsafe { Box::from_raw(checkpoint.cast::<TorchCheckpoint>()) });
}

/// Told of one block of a restore: the caller's context and the block's address. Must not
/// unwind.
pub type RestoreBlockFn = unsafe extern "C" fn(ctx: *mut c_void, ptr: u64);

/// c10's `setCheckpointPoolState`: sets the private pool of `checkpoint` on `device` back to
/// it, then calls `freed` for each block that was allocated and is now free, and `allocated`
/// for each block of the checkpoint allocated again (to be freed as usual). Returns 0, or 1
/// with the reason in `err` and no call made (among the reasons: a handle that is not a live
/// one, a null function).
///
/// # Safety
/// `err` as for [`gpumem_torch_pool_begin`]; the two functions, where not null, may be called
/// with `ctx`; `checkpoint` must not be freed while this call runs.
#[no_mangle]
pub unsafe extern "C" fn gpumem_torch_pool_restore(
    device: c_int,
    checkpoint: *const c_void,
    ctx: *mut c_void,
    freed: Option<RestoreBlockFn>,
    allocated: Option<RestoreBlockFn>,
    err: *mut c_char,
    err_len: usize,
) -> c_int {
    let live = live_checkpoints().contains(&(checkpoint as usize));
    let restore = |d| {
        let (Some(freed), Some(allocated)) = (freed, allocated) else {
            return Err(TorchError::Other(
                "gpumem: setCheckpointPoolState was given a null function".into(),
            ));
        };
        if checkpoint.is_null() {
            return Err(TorchError::Other(
                "gpumem: setCheckpointPoolState was given no checkpoint".into(),
            ));
        }
        if !live {
            return Err(TorchError::Other(format!(
                "gpumem: setCheckpointPoolState was given {checkpoint:p}, which is not a \
                 live checkpoint of gpumem (freed, or never given out)"
            )));
        }
        // SAFETY: a live handle of gpumem_torch_pool_checkpoint (checked above), which the
        // caller does not free while this call runs.
        let cp = unsafe { &*checkpoint.cast::<TorchCheckpoint>() };
        if d != cp.device {
            return Err(TorchError::Other(format!(
                "gpumem: a checkpoint of device {} cannot be restored on device {d}",
                cp.device
            )));
        }
        global()
            .pool_restore(d, &cp.checkpoint)
            .map(|done| (done, freed, allocated))
    };
    // SAFETY: the caller's promise on `err`, passed on.
    let restored = unsafe { pool_entry(device, "a checkpoint's restore", err, err_len, restore) };
    let Some((done, freed, allocated)) = restored else {
        return 1;
    };
    for &p in &done.freed {
        // SAFETY: the caller's function, with the caller's context, as documented.
        unsafe { freed(ctx, p) };
    }
    for a in &done.allocated {
        // SAFETY: as above.
        unsafe { allocated(ctx, a.ptr) };
    }
    0
}

/// c10's `checkPoolLiveAllocations` (CUDA graph trees check their pool with it after every
/// recording and restore): writes the addresses of the blocks allocated in private pool
/// (`first`, `second`) on `device`, at most `cap` of them, to `out`, and returns how many
/// there are; -1 on failure (a null `out` with `cap` above 0 among them), with the reason in
/// `err`.
///
/// # Safety
/// `out` is valid for `cap` writes (or `cap` is 0); `err` as for [`gpumem_torch_pool_begin`].
#[no_mangle]
pub unsafe extern "C" fn gpumem_torch_pool_live_blocks(
    device: c_int,
    first: u64,
    second: u64,
    out: *mut u64,
    cap: usize,
    err: *mut c_char,
    err_len: usize,
) -> i64 {
    // SAFETY: the caller's promise on `err`, passed on.
    let Some(cp) = (unsafe {
        pool_entry(device, "a pool's live blocks", err, err_len, |d| {
            if out.is_null() && cap > 0 {
                return Err(TorchError::Other(format!(
                    "gpumem: checkPoolLiveAllocations was given no room for its {cap} addresses"
                )));
            }
            global().pool_checkpoint(d, (first, second))
        })
    }) else {
        return -1;
    };
    for (i, b) in cp.blocks.iter().take(cap).enumerate() {
        // SAFETY: i < cap, `out` is not null when cap > 0 (checked above), and the caller
        // guarantees it holds `cap` values.
        unsafe { *out.add(i) = b.addr };
    }
    i64::try_from(cp.blocks.len()).unwrap_or(i64::MAX)
}

/// # Safety
/// `err` is null or valid for `err_len` writes.
unsafe fn pool_call(
    device: c_int,
    op: PoolOp,
    id: (u64, u64),
    err: *mut c_char,
    err_len: usize,
) -> c_int {
    // SAFETY: the caller's promise on `err`, passed on.
    let done = unsafe {
        pool_entry(device, "a private-pool call", err, err_len, |d| {
            global().pool(d, op, id)
        })
    };
    if done.is_some() {
        0
    } else {
        1
    }
}

/// The body of an exported private-pool function: `f` on the registry's index of `device`,
/// under [`guarded`] (a panic inside it turned into an error, which poisons the allocator). On
/// error, `None`, with the message copied into `err` (room for `err_len` bytes) for the C++
/// caller to throw.
///
/// # Safety
/// `err` is null or valid for `err_len` writes.
unsafe fn pool_entry<T>(
    device: c_int,
    what: &str,
    err: *mut c_char,
    err_len: usize,
    f: impl FnOnce(usize) -> Result<T, TorchError>,
) -> Option<T> {
    let r = device_index(device).and_then(|d| guarded(&POISONED, || format!("in {what}"), || f(d)));
    // SAFETY: the caller's promise on `err`, passed on.
    r.map_err(|e| unsafe { write_c_string(e.message(), err, err_len) })
        .ok()
}

/// Copies `text` into `out` (room for `len` bytes), cut to fit and NUL-terminated.
///
/// # Safety
/// `out` is null or valid for `len` writes.
unsafe fn write_c_string(text: &str, out: *mut c_char, len: usize) {
    if out.is_null() || len == 0 {
        return;
    }
    let n = text.len().min(len - 1);
    // SAFETY: `out` is not null and valid for `len` writes (the caller's promise); n + 1 <= len.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), out.cast::<u8>(), n);
        *out.add(n) = 0;
    }
}

/// Makes out-of-memory failures `c10::OutOfMemoryError`s (so that Python sees
/// `torch.cuda.OutOfMemoryError`), given the paths of the loaded `libc10.so` and
/// `libc10_cuda.so`. On error nothing changes and the reason is returned.
pub fn bind_c10(libc10: &str, libc10_cuda: &str) -> Result<(), String> {
    let c10 = std::ffi::CString::new(libc10).map_err(|e| e.to_string())?;
    let cuda = std::ffi::CString::new(libc10_cuda).map_err(|e| e.to_string())?;
    let mut err = vec![0u8; 512];
    // SAFETY: both paths are NUL-terminated strings alive for the call; `err` is a writable
    // buffer of `err.len()` bytes, which the shim NUL-terminates within that length. The shim
    // function is `noexcept` and catches every C++ exception itself (returning 1), so nothing
    // unwinds into this frame.
    let rc = unsafe {
        gpumem_shim_bind_c10(
            c10.as_ptr(),
            cuda.as_ptr(),
            err.as_mut_ptr().cast(),
            err.len(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(c_buffer_text(&err))
    }
}

/// Whether out-of-memory failures are thrown as `c10::OutOfMemoryError`.
pub fn oom_is_c10() -> bool {
    // SAFETY: reads an atomic flag of the shim; no arguments.
    unsafe { gpumem_shim_oom_is_c10() != 0 }
}

/// What a call of [`gpumem_torch_alloc`] did, seen from C++ the way PyTorch sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallOutcome {
    /// It returned this pointer.
    Returned(u64),
    /// It threw a C++ exception of this (demangled) type with this `what()`.
    Threw {
        /// The exception's type.
        type_name: String,
        /// Its message.
        what: String,
    },
}

/// Calls [`gpumem_torch_alloc`] from C++ and catches what it throws: the test of the path an
/// allocation failure takes into PyTorch.
pub fn call_alloc_from_cpp(size: usize, device: i32, stream: u64) -> CallOutcome {
    let mut out: *mut c_void = std::ptr::null_mut();
    let mut ty = vec![0u8; 256];
    let mut msg = vec![0u8; 4096];
    // SAFETY: `out` is a valid place for one pointer; the two buffers are writable for the
    // lengths given and the shim NUL-terminates within them. The callee is `noexcept` and
    // catches every C++ exception, including any its handlers throw while describing one, so
    // nothing unwinds into this Rust frame.
    let rc = unsafe {
        gpumem_shim_call_alloc(
            size,
            device,
            stream as *mut c_void,
            &mut out,
            ty.as_mut_ptr().cast(),
            ty.len(),
            msg.as_mut_ptr().cast(),
            msg.len(),
        )
    };
    if rc == 0 {
        CallOutcome::Returned(out as u64)
    } else {
        CallOutcome::Threw {
            type_name: c_buffer_text(&ty),
            what: c_buffer_text(&msg),
        }
    }
}

fn c_buffer_text(buf: &[u8]) -> String {
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::sim_source;
    use gpumem_core::units::MIB;

    /// The only test that touches the process-wide registry (the others build their own).
    #[test]
    fn the_c_entry_points_serve_and_fail_like_pytorch_expects() {
        global()
            .use_source(sim_source(1, Some(256 * MIB), false))
            .unwrap();
        global().configure(Some("policy:stitched")).unwrap();

        // Served: a pointer, freed through the free hook.
        let p = gpumem_torch_alloc(4 * MIB as usize, 0, std::ptr::null_mut());
        assert!(!p.is_null());
        assert_eq!(
            global().memory_stats(0).requested_bytes.all.current,
            (4 * MIB) as i64
        );
        gpumem_torch_record_stream(p, 0x40 as *mut c_void);
        gpumem_torch_free(p, 4 * MIB as usize, 0, std::ptr::null_mut());
        assert_eq!(global().memory_stats(0).allocated_bytes.all.current, 0);

        // Zero bytes: null, and freeing null is harmless.
        assert!(gpumem_torch_alloc(0, 0, std::ptr::null_mut()).is_null());
        gpumem_torch_free(std::ptr::null_mut(), 0, 0, std::ptr::null_mut());

        // Misuse through the free hook is counted, not fatal (this is the only test that uses
        // the process-wide registry, so the counts are exact).
        let count = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
        gpumem_torch_free(0x1234_5000 as *mut c_void, 16, 0, std::ptr::null_mut());
        assert_eq!(count(&global().counters.foreign_frees), 1);
        // A live block freed naming a device index that is not one: freed where it lives
        // (addresses are unique across devices), not leaked; freeing it again is a double
        // free, whichever device is named.
        let q = gpumem_torch_alloc(MIB as usize, 0, std::ptr::null_mut());
        assert_eq!(
            global().memory_stats(0).allocated_bytes.all.current,
            MIB as i64
        );
        gpumem_torch_free(q, MIB as usize, -3, std::ptr::null_mut());
        assert_eq!(global().memory_stats(0).allocated_bytes.all.current, 0);
        assert_eq!(count(&global().counters.wrong_device_frees), 1);
        gpumem_torch_free(q, MIB as usize, 64, std::ptr::null_mut());
        assert_eq!(count(&global().counters.double_frees), 1);
        assert_eq!(count(&global().counters.foreign_frees), 1);
        // record_stream on null and on a freed pointer: nothing happens, nothing is fatal.
        gpumem_torch_record_stream(std::ptr::null_mut(), 0x40 as *mut c_void);
        gpumem_torch_record_stream(q, 0x40 as *mut c_void);
        // Fractions that are not fractions, and bad devices, change nothing.
        for (f, d) in [(f64::NAN, 0), (-0.5, 0), (2.0, 0), (0.5, -1), (0.5, 64)] {
            gpumem_torch_set_memory_fraction(f, d);
        }
        // No cap came of them: 200 of the device's 256 MiB can still be had.
        let big = gpumem_torch_alloc(200 * MIB as usize, 0, std::ptr::null_mut());
        assert!(!big.is_null());
        gpumem_torch_free(big, 0, 0, std::ptr::null_mut());
        gpumem_torch_empty_cache();

        // A failure reaches the C++ caller as an exception with PyTorch's wording.
        match call_alloc_from_cpp(1 << 40, 0, 0) {
            CallOutcome::Threw { type_name, what } => {
                assert_eq!(type_name, "gpumem::OutOfMemoryError", "{what}");
                assert!(what.starts_with("CUDA out of memory."), "{what}");
            }
            other => panic!("expected an exception, got {other:?}"),
        }
        match call_alloc_from_cpp(usize::MAX, 0, 0) {
            CallOutcome::Threw { type_name, what } => {
                assert_eq!(type_name, "gpumem::OutOfMemoryError", "{what}");
                assert!(what.starts_with("CUDA out of memory."), "{what}");
            }
            other => panic!("expected an exception, got {other:?}"),
        }
        match call_alloc_from_cpp(512, 9, 0) {
            CallOutcome::Threw { type_name, what } => {
                assert_eq!(type_name, "gpumem::Error");
                assert!(what.contains("does not exist"), "{what}");
            }
            other => panic!("expected an exception, got {other:?}"),
        }
        // The process goes on, and the fraction hook caps the device.
        gpumem_torch_set_memory_fraction(0.5, 0);
        // Half of the 256 MiB device: 200 MiB is refused, and the message names the cap and
        // the setting that raises it.
        match call_alloc_from_cpp(200 * MIB as usize, 0, 0) {
            CallOutcome::Threw { type_name, what } => {
                assert_eq!(type_name, "gpumem::OutOfMemoryError", "{what}");
                assert!(what.starts_with("CUDA out of memory."), "{what}");
                assert!(what.contains("may hold at most 128.00 MiB"), "{what}");
                assert!(what.contains("capped at 128.00 MiB"), "{what}");
                assert!(what.contains("fraction:"), "{what}");
            }
            other => panic!("expected an exception, got {other:?}"),
        }
        match call_alloc_from_cpp(MIB as usize, 0, 0) {
            CallOutcome::Returned(p) => {
                gpumem_torch_free(p as *mut c_void, 0, 0, std::ptr::null_mut())
            }
            other => panic!("expected a pointer, got {other:?}"),
        }
        gpumem_torch_empty_cache();
        assert_eq!(global().memory_stats(0).reserved_bytes.all.current, 0);

        // What the native allocator reads for c10. (The profiler is not bound here: no torch.)
        assert!(!profiler_bound() && !profiler_records_memory());
        let p = gpumem_torch_alloc(3000, 0, std::ptr::null_mut());
        assert!(!p.is_null());
        let mut stats = [0i64; DEVICE_STATS_LEN + 1];
        // SAFETY: `stats` holds DEVICE_STATS_LEN + 1 values.
        let n = unsafe { gpumem_torch_device_stats(0, stats.as_mut_ptr(), stats.len()) };
        assert_eq!(n, DEVICE_STATS_LEN);
        assert_eq!(stats[..DEVICE_STATS_LEN], device_stats_array(0));
        assert_eq!(
            stats[DEVICE_STATS_LEN], 0,
            "nothing written past the statistics"
        );
        // allocated_bytes (the fifth statistic), all pools: current, peak, allocated, freed.
        let m = global().memory_stats(0);
        assert_eq!(stats[4 * 12], 3072);
        assert_eq!(stats[4 * 12 + 1], m.allocated_bytes.all.peak);
        assert_eq!(stats[4 * 12 + 2], m.allocated_bytes.all.allocated);
        assert_eq!(stats[4 * 12 + 3], m.allocated_bytes.all.freed);
        // The counters last: num_ooms counted the refusals above.
        assert_eq!(stats[DEVICE_STATS_LEN - 4], m.num_ooms);
        assert!(m.num_ooms >= 3);
        // SAFETY: a null `out` with len 0 writes nothing.
        assert_eq!(
            unsafe { gpumem_torch_device_stats(-1, std::ptr::null_mut(), 0) },
            0
        );
        assert_eq!(gpumem_torch_reset_peak_stats(64), 1);
        assert_eq!(gpumem_torch_reset_accumulated_stats(0), 0);
        let m = global().memory_stats(0);
        assert_eq!((m.allocation.all.allocated, m.num_ooms), (0, 0));
        assert_eq!(m.allocated_bytes.all.current, 3072);
        // Freed by pointer alone, then again: a double free, counted.
        gpumem_torch_free_any(p);
        assert_eq!(global().memory_stats(0).allocated_bytes.all.current, 0);
        gpumem_torch_free_any(p);
        assert_eq!(count(&global().counters.double_frees), 2);
        assert_eq!(gpumem_torch_reset_peak_stats(0), 0);
        assert_eq!(global().memory_stats(0).allocated_bytes.all.peak, 0);
        // What out-of-memory observers are told: the cap set above (half of 256 MiB) and the
        // simulated device's free bytes (all but what gpumem holds).
        let mut limit_free = [0u64; 2];
        // SAFETY: `limit_free` holds two values.
        assert_eq!(
            unsafe { gpumem_torch_limit_and_free(0, limit_free.as_mut_ptr()) },
            0
        );
        let held = global().memory_stats(0).reserved_bytes.all.current as u64;
        assert!(held > 0);
        assert_eq!(limit_free, [128 * MIB, 256 * MIB - held]);
        assert_eq!(
            gpumem_torch_memory_fraction(0),
            0.5,
            "the cap as it was given"
        );
        assert_eq!(gpumem_torch_memory_fraction(64), -1.0);
        // SAFETY: as above; nothing is written for a device that cannot be one.
        assert_eq!(
            unsafe { gpumem_torch_limit_and_free(-2, limit_free.as_mut_ptr()) },
            1
        );
        // The CUDA graph hooks are C++ (called only from C++; the Python tests run them).
        for which in [POOL_HOOK_BEGIN, POOL_HOOK_END, POOL_HOOK_RELEASE] {
            assert_ne!(gpumem_torch_pool_hook_address(which), 0);
        }
        assert_eq!(gpumem_torch_pool_hook_address(3), 0);
        let mut err = [0 as c_char; 160];
        let text = |err: &[c_char]| {
            // SAFETY: the functions write a NUL-terminated message into `err` (it starts zeroed
            // and they never write its last byte but as the terminator).
            unsafe { std::ffi::CStr::from_ptr(err.as_ptr()) }
                .to_string_lossy()
                .into_owned()
        };
        // SAFETY: `err` is valid for `err.len()` writes.
        let rc = unsafe { gpumem_torch_pool_begin(-1, 1, 0, err.as_mut_ptr(), err.len()) };
        assert_eq!(rc, 1);
        assert!(text(&err).contains("device"), "{}", text(&err));
        assert_eq!(gpumem_torch_pool_use_count(-1, 1, 0), 0);
        assert!(!oom_is_c10());
        assert!(bind_c10("/nonexistent/libc10.so", "/nonexistent/libc10_cuda.so").is_err());

        // Bad pointers from C are refused with an error, never written through or read.
        // SAFETY: a null `out` is what is checked; nothing is written.
        assert_eq!(
            unsafe { gpumem_torch_limit_and_free(0, std::ptr::null_mut()) },
            1
        );
        err.fill(0);
        // SAFETY: `err` as above; `out` is null with a capacity of 4, which must be refused.
        let n = unsafe {
            gpumem_torch_pool_live_blocks(
                0,
                1,
                0,
                std::ptr::null_mut(),
                4,
                err.as_mut_ptr(),
                err.len(),
            )
        };
        assert_eq!(n, -1);
        assert!(text(&err).contains("no room"), "{}", text(&err));
        unsafe extern "C" fn told(ctx: *mut c_void, _ptr: u64) {
            // SAFETY: the test passes a pointer to its AtomicU64 as `ctx`.
            unsafe { &*ctx.cast::<std::sync::atomic::AtomicU64>() }
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let calls = std::sync::atomic::AtomicU64::new(0);
        let ctx = &calls as *const _ as *mut c_void;
        let bogus = 0x5000 as *const c_void;
        err.fill(0);
        // SAFETY: `err` as above; the handle is not a live one, which must be refused before
        // it is read, and `told` may be called with `ctx`.
        let rc = unsafe {
            gpumem_torch_pool_restore(
                0,
                bogus,
                ctx,
                Some(told),
                Some(told),
                err.as_mut_ptr(),
                err.len(),
            )
        };
        assert_eq!(rc, 1);
        assert!(
            text(&err).contains("not a live checkpoint"),
            "{}",
            text(&err)
        );
        err.fill(0);
        // SAFETY: as above, with a null function, which must be refused.
        let rc = unsafe {
            gpumem_torch_pool_restore(0, bogus, ctx, None, Some(told), err.as_mut_ptr(), err.len())
        };
        assert_eq!(rc, 1);
        assert!(text(&err).contains("null function"), "{}", text(&err));
        assert_eq!(calls.load(std::sync::atomic::Ordering::Relaxed), 0);
        // Freeing a handle gpumem never gave out is reported and ignored.
        gpumem_torch_pool_checkpoint_free(bogus as *mut c_void);

        // A poisoned allocator (as after a panic inside it) serves nothing more and ignores
        // frees, which leak, instead of touching a state that may be inconsistent.
        let live = gpumem_torch_alloc(MIB as usize, 0, std::ptr::null_mut());
        assert!(!live.is_null());
        let allocated = global().memory_stats(0).allocated_bytes.all.current;
        POISONED.store(true, Ordering::Relaxed);
        match call_alloc_from_cpp(MIB as usize, 0, 0) {
            CallOutcome::Threw { type_name, what } => {
                assert_eq!(type_name, "gpumem::Error");
                assert!(what.contains("serves no more requests"), "{what}");
            }
            other => panic!("expected an exception, got {other:?}"),
        }
        gpumem_torch_free(live, MIB as usize, 0, std::ptr::null_mut());
        gpumem_torch_free_any(live);
        assert_eq!(
            global().memory_stats(0).allocated_bytes.all.current,
            allocated
        );
        err.fill(0);
        // SAFETY: `err` as above.
        let rc = unsafe { gpumem_torch_pool_begin(0, 1, 0, err.as_mut_ptr(), err.len()) };
        assert_eq!(rc, 1);
        assert!(
            text(&err).contains("serves no more requests"),
            "{}",
            text(&err)
        );
        let reserved = global().memory_stats(0).reserved_bytes.all.current;
        gpumem_torch_empty_cache();
        assert_eq!(
            global().memory_stats(0).reserved_bytes.all.current,
            reserved,
            "a poisoned allocator returns nothing either"
        );
        POISONED.store(false, Ordering::Relaxed);
        gpumem_torch_free(live, MIB as usize, 0, std::ptr::null_mut());
        assert_eq!(
            global().memory_stats(0).allocated_bytes.all.current,
            allocated - MIB as i64
        );
    }

    #[test]
    fn a_panic_inside_gpumem_poisons_it_and_later_calls_are_refused() {
        // A flag of the test's own, so that the process-wide one stays clear.
        let poison = AtomicBool::new(false);
        let served = guarded(&poison, || "in a test".into(), || Ok::<_, TorchError>(7));
        assert!(matches!(served, Ok(7)));
        // (The panic's message shows in this test's captured output.)
        let failed = guarded(
            &poison,
            || "in a test".into(),
            || -> Result<u32, _> { panic!("a broken invariant") },
        );
        let Err(e) = failed else {
            panic!("a panic must come back as an error")
        };
        assert!(
            e.message().contains("internal error (a panic) in a test"),
            "{}",
            e.message()
        );
        assert!(poison.load(Ordering::Relaxed));
        let ran = std::cell::Cell::new(false);
        let refused = guarded(
            &poison,
            || "in a test".into(),
            || {
                ran.set(true);
                Ok::<_, TorchError>(1)
            },
        );
        assert!(!ran.get(), "a poisoned allocator runs nothing");
        let Err(e) = refused else {
            panic!("a poisoned allocator refuses")
        };
        assert_eq!(e.message(), POISONED_MESSAGE);
    }
}
