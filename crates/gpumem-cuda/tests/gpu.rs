//! Tests on a real GPU. They are ignored by a plain `cargo test` (listed as "needs a CUDA
//! GPU"); scripts/device/cuda.sh runs them on the GPU machine with `--ignored`, once directly
//! and once under `compute-sanitizer --tool memcheck`.

use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{CudaContext, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use gpumem_core::backend::{EventHandle, PhysHandle};
use gpumem_core::bench_ops::Mt19937_64;
use gpumem_core::policy::PolicyKind;
use gpumem_core::trace::{Event, Kind, Trace};
use gpumem_core::{AllocError, Config};
use gpumem_cuda::replay::GpuReplay;
use gpumem_cuda::{device_count, open_backend, CudaAllocator, DeviceBuffer};
use std::sync::{Arc, Mutex, MutexGuard};

const MIB: u64 = 1 << 20;

/// Tests measure the device's free memory: they take turns, whatever the runner's threads.
/// Each first checks for a driver, so that a machine without one fails with a clear message
/// (cudarc itself would panic on its first call).
fn exclusive() -> MutexGuard<'static, ()> {
    static GPU: Mutex<()> = Mutex::new(());
    let guard = GPU.lock().unwrap_or_else(|e| e.into_inner());
    if let Err(e) = device_count() {
        panic!("these tests need a CUDA GPU: {e}");
    }
    guard
}

fn gpu(policy: PolicyKind, conf: &str) -> CudaAllocator {
    let mut c = Config::parse(conf).expect("configuration");
    c.policy = policy;
    CudaAllocator::new(0, c).expect("CUDA device 0")
}

fn log_uniform(rng: &mut Mt19937_64, lo: u64, hi: u64) -> u64 {
    let (a, b) = ((lo as f64).ln(), (hi as f64).ln());
    (a + (b - a) * rng.uniform()).exp() as u64
}

fn free_bytes(ctx: &Arc<CudaContext>) -> u64 {
    ctx.synchronize().expect("synchronize");
    ctx.mem_get_info().expect("cuMemGetInfo").0 as u64
}

/// Fills `buf` with the 32-bit `pattern` on its own stream.
fn fill(buf: &DeviceBuffer, pattern: u32) {
    let words = (buf.len_bytes() / 4) as usize;
    // SAFETY: the buffer holds at least `words` 32-bit words; its stream is live.
    let r =
        unsafe { sys::cuMemsetD32Async(buf.ptr(), pattern, words, buf.cuda_stream().cu_stream()) };
    assert_eq!(r, CUresult::CUDA_SUCCESS, "cuMemsetD32Async");
}

/// Reads `buf` back through cudarc (exercising `DevicePtr`) and checks every word.
fn expect_pattern(buf: &DeviceBuffer, pattern: u32, what: &str) {
    let words: Vec<u32> = buf.cuda_stream().clone_dtoh(buf).expect("copy to host");
    assert_eq!(words.len() as u64, buf.len_bytes() / 4);
    if let Some(i) = words.iter().position(|&w| w != pattern) {
        panic!(
            "{what}: block {:#x} ({} bytes) word {i} is {:#x}, expected {pattern:#x}",
            buf.ptr(),
            buf.len_bytes(),
            words[i]
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_device_is_described() {
    let _gpu = exclusive();
    let n = device_count().expect("a CUDA driver and device");
    assert!(n >= 1);
    let b = open_backend(0).expect("backend of device 0");
    let info = b.info();
    assert!(info.total_bytes > 1 << 30, "{info:?}");
    assert!(info.supports_vmm, "{info:?}");
    assert!(
        info.page_bytes.is_power_of_two() && info.page_bytes >= 64 << 10,
        "{info:?}"
    );
    let e = open_backend(n).err().expect("no such device");
    assert!(e.message.contains("no CUDA device"), "{e}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_backend_refuses_what_it_did_not_hand_out() {
    let _gpu = exclusive();
    let mut b = open_backend(0).expect("backend");
    assert!(b.mem_free(0xdead_0000, 4096).is_err());
    assert!(b.mem_release(PhysHandle(0x1234)).is_err());
    assert!(b.event_query(EventHandle(0x1)).is_err());
    let p = b.mem_alloc(MIB).expect("cuMemAlloc");
    assert!(b.mem_free(p, 2 * MIB).is_err(), "wrong size");
    b.mem_free(p, MIB).expect("cuMemFree");
    assert!(b.mem_free(p, MIB).is_err(), "double free");
    let page = b.info().page_bytes;
    let va = b.address_reserve(4 * page, 0).expect("reserve");
    let h = b.mem_create(page).expect("create");
    b.mem_map(va, page, h).expect("map");
    b.set_access(va, page).expect("access");
    // Only this backend's own reservations are mapped, unmapped or opened: refused before
    // the driver is asked, so another library's mappings in the context are never touched.
    let h2 = b.mem_create(page).expect("create");
    assert!(
        b.mem_map(va + 4 * page, page, h2).is_err(),
        "map past the reservation"
    );
    assert!(
        b.set_access(va + 3 * page, 2 * page).is_err(),
        "access across its end"
    );
    assert!(b.mem_unmap(va - page, page).is_err(), "unmap before it");
    b.mem_release(h2).expect("release the unmapped handle");
    assert!(b.mem_release(h).is_err(), "release while mapped");
    assert!(b.address_free(va, 4 * page).is_err(), "free while mapped");
    // Events: NOT_READY is "not yet", not an error; a recorded event completes.
    let e = b.event_record(0).expect("record");
    b.event_synchronize(e).expect("synchronize");
    assert!(b.event_query(e).expect("query"));
    b.event_destroy(e);
    b.mem_unmap(va, page).expect("unmap");
    b.mem_release(h).expect("release");
    b.address_free(va, 4 * page).expect("free range");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_policy_allocates_and_frees_a_random_mix() {
    let _gpu = exclusive();
    let ctx = CudaContext::new(0).expect("context");
    let stream = ctx.new_stream().expect("stream");
    for policy in PolicyKind::ALL {
        let before = free_bytes(&ctx);
        let a = gpu(policy, "");
        let mut rng = Mt19937_64::new(11);
        let mut live: Vec<DeviceBuffer> = Vec::new();
        for _ in 0..3000 {
            if live.len() < 64 && (live.is_empty() || rng.uniform() < 0.55) {
                let size = log_uniform(&mut rng, 512, 64 * MIB);
                let b = a.alloc(size, &stream).expect("allocation");
                assert!(b.ptr() != 0 && b.block_bytes() >= size);
                live.push(b);
            } else {
                let i = (rng.uniform() * live.len() as f64) as usize;
                live.swap_remove(i.min(live.len() - 1));
            }
        }
        a.engine().check().expect("invariants");
        let held = a.engine().held_bytes();
        assert!(held > 0);
        live.clear();
        let st = a.memory_stats();
        assert_eq!(st.allocated_bytes.all.current, 0, "{}", policy.name());
        a.empty_cache().expect("empty_cache");
        assert_eq!(
            a.engine().held_bytes(),
            0,
            "{}: cache not emptied",
            policy.name()
        );
        drop(a);
        let after = free_bytes(&ctx);
        assert!(
            after + 4 * MIB >= before,
            "{}: {} bytes did not come back",
            policy.name(),
            before - after
        );
    }
}

/// Each live block holds its own pattern; blocks around it come and go (on two streams, so
/// the stitched policy hands pages between streams); every block is read back intact. This is
/// what shows that a policy never hands out memory a live block uses, and that the stitched
/// policy's page mapping is right on real hardware.
#[test]
#[ignore = "needs a CUDA GPU"]
fn patterns_survive_their_neighbours() {
    let _gpu = exclusive();
    // Every policy, the stitched one with one range shared by both streams, whose blocks
    // then share pages, the stitched one on 8 MiB physical pages (several of the device's
    // granules per handle, mapped at 8 MiB-aligned addresses), and the stitched one in two
    // tiers, switching to 16 MiB pages once 64 MiB are held (blocks of both tiers live
    // together, and the first tier's pages go back as they are freed).
    let runs = PolicyKind::ALL.into_iter().map(|p| (p, "")).chain([
        (PolicyKind::Stitched, "range:shared"),
        (PolicyKind::Stitched, "page:8MiB"),
        (PolicyKind::Stitched, "big_page:16MiB,big_after:64MiB"),
    ]);
    for (policy, conf) in runs {
        let a = gpu(policy, conf);
        let streams = [
            a.context().new_stream().expect("stream"),
            a.context().new_stream().expect("stream"),
        ];
        let mut rng = Mt19937_64::new(23);
        let mut live: Vec<(DeviceBuffer, u32)> = Vec::new();
        let mut next_pattern = 0x5a00_0001u32;
        for step in 0..1200 {
            if live.len() < 48 && (live.is_empty() || rng.uniform() < 0.55) {
                // Mostly small blocks that share pages, some that span several pages.
                let size = if rng.uniform() < 0.8 {
                    log_uniform(&mut rng, 512, 2 * MIB)
                } else {
                    log_uniform(&mut rng, 2 * MIB, 24 * MIB)
                } / 4
                    * 4;
                let s = &streams[(rng.uniform() * 2.0) as usize % 2];
                let b = a.alloc(size.max(4), s).expect("allocation");
                next_pattern = next_pattern.wrapping_add(0x0101_0101);
                fill(&b, next_pattern);
                live.push((b, next_pattern));
            } else {
                let i = ((rng.uniform() * live.len() as f64) as usize).min(live.len() - 1);
                live.swap_remove(i);
            }
            if step % 200 == 199 {
                for (b, p) in &live {
                    expect_pattern(b, *p, &format!("{} {conf} step {step}", policy.name()));
                }
            }
        }
        for (b, p) in &live {
            expect_pattern(b, *p, &format!("{} {conf} at the end", policy.name()));
        }
        a.engine().check().expect("invariants");
        if conf.starts_with("big_page") {
            let notes = a.engine().policy_notes();
            assert!(
                notes.iter().any(|n| n.contains("big_page")),
                "the pool never switched: {notes:?}"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn record_stream_defers_reuse_until_the_other_stream_is_done() {
    let _gpu = exclusive();
    for policy in PolicyKind::ALL {
        let a = gpu(policy, "");
        let s1 = a.context().new_stream().expect("stream");
        let s2 = a.context().new_stream().expect("stream");
        let busy = a.alloc(1 << 30, &s2).expect("1 GiB");
        let buf = a.alloc(8 * MIB, &s1).expect("8 MiB");
        let (p0, len0) = (buf.ptr(), buf.block_bytes());
        // Keep s2 busy for a while (each 1 GiB memset takes a fraction of a millisecond), then
        // use `buf` there, and say so.
        for i in 0..200u32 {
            fill(&busy, i);
        }
        // SAFETY: `buf` holds 8 MiB; s2 is live.
        let r = unsafe { sys::cuMemsetD32Async(buf.ptr(), 7, (2 * MIB) as usize, s2.cu_stream()) };
        assert_eq!(r, CUresult::CUDA_SUCCESS);
        buf.record_stream(&s2).expect("record_stream");
        drop(buf);
        // SAFETY: a live stream.
        let q = unsafe { sys::cuStreamQuery(s2.cu_stream()) };
        assert_eq!(
            q,
            CUresult::CUDA_ERROR_NOT_READY,
            "s2 finished too early for the test to mean anything"
        );
        let b2 = a.alloc(8 * MIB, &s1).expect("8 MiB again");
        let overlaps = b2.ptr() < p0 + len0 && p0 < b2.ptr() + b2.block_bytes();
        assert!(!overlaps, "{}: reused a block s2 still uses", policy.name());
        let st = a.memory_stats();
        let pending = st.active_bytes.all.current - st.allocated_bytes.all.current;
        assert!(
            pending >= 8 * MIB as i64,
            "{}: the freed block is not pending",
            policy.name()
        );
        s2.synchronize().expect("synchronize s2");
        let b3 = a.alloc(4096, &s1).expect("small");
        let st = a.memory_stats();
        assert_eq!(
            st.active_bytes.all.current,
            st.allocated_bytes.all.current,
            "{}: the block was not released once s2 finished",
            policy.name()
        );
        drop((b2, b3, busy));
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn out_of_memory_under_a_cap_is_an_error() {
    let _gpu = exclusive();
    for policy in PolicyKind::ALL {
        let a = gpu(policy, "cap:256MiB");
        let s = a.context().new_stream().expect("stream");
        let x = a.alloc(100 * MIB, &s).expect("first 100 MiB");
        let y = a.alloc(100 * MIB, &s).expect("second 100 MiB");
        match a.alloc(200 * MIB, &s) {
            Err(AllocError::OutOfMemory(r)) => {
                assert_eq!(r.cap, Some(256 * MIB), "{}", policy.name());
                assert!(r.to_string().contains("out of memory"));
            }
            other => panic!("{}: expected out of memory, got {other:?}", policy.name()),
        }
        drop(x);
        let z = a.alloc(100 * MIB, &s).expect("room again after a free");
        drop((y, z));
    }
}

const FILL_PTX: &str = r#"
.version 6.0
.target sm_50
.address_size 64

.visible .entry fill_u32(
    .param .u64 out,
    .param .u32 value,
    .param .u64 n
)
{
    .reg .pred %p;
    .reg .b32 %r<5>;
    .reg .b64 %rd<6>;

    ld.param.u64 %rd1, [out];
    ld.param.u32 %r1, [value];
    ld.param.u64 %rd2, [n];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mad.lo.u32 %r2, %r2, %r3, %r4;
    cvt.u64.u32 %rd3, %r2;
    setp.ge.u64 %p, %rd3, %rd2;
    @%p bra DONE;
    cvta.to.global.u64 %rd4, %rd1;
    shl.b64 %rd5, %rd3, 2;
    add.u64 %rd4, %rd4, %rd5;
    st.global.u32 [%rd4], %r1;
DONE:
    ret;
}
"#;

#[test]
#[ignore = "needs a CUDA GPU"]
fn buffers_free_on_drop_and_work_with_cudarc() {
    let _gpu = exclusive();
    let a = gpu(PolicyKind::Stitched, "");
    let stream: Arc<CudaStream> = a.context().new_stream().expect("stream");
    let n = (MIB + 3) as usize; // words
    let mut buf = a.alloc(4 * n as u64, &stream).expect("allocation");
    assert_eq!(
        a.memory_stats().allocated_bytes.all.current,
        buf.block_bytes() as i64
    );
    // Copies through cudarc's DevicePtr / DevicePtrMut.
    let host: Vec<u32> = (0..n as u32)
        .map(|i| i.wrapping_mul(2_654_435_761))
        .collect();
    stream.memcpy_htod(&host, &mut buf).expect("host to device");
    let back: Vec<u32> = stream.clone_dtoh(&buf).expect("device to host");
    assert_eq!(back, host);
    // A kernel launched through cudarc with the buffer as its argument.
    let module = a
        .context()
        .load_module(Ptx::from_src(FILL_PTX))
        .expect("load PTX");
    let f = module.load_function("fill_u32").expect("kernel");
    let value = 0xC0FF_EE00u32;
    let n64 = n as u64;
    let mut launch = stream.launch_builder(&f);
    launch.arg(&mut buf).arg(&value).arg(&n64);
    // SAFETY: fill_u32(out, value, n) writes n u32 words at out; the buffer holds n words.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }.expect("launch");
    let back: Vec<u32> = stream.clone_dtoh(&buf).expect("device to host");
    assert!(back.iter().all(|&w| w == value));
    drop(buf);
    assert_eq!(
        a.memory_stats().allocated_bytes.all.current,
        0,
        "freed on drop"
    );
    // Raw streams (as PyTorch passes them) work too.
    // SAFETY: the stream outlives the buffer.
    let raw = unsafe { a.alloc_on_raw(MIB, stream.cu_stream() as usize as u64) }.expect("raw");
    assert_eq!(raw.raw_stream(), stream.cu_stream() as usize as u64);
    drop(raw);
    assert_eq!(a.memory_stats().allocated_bytes.all.current, 0);
}

/// PyTorch calls allocators from threads with no current context (autograd's worker thread):
/// the backend makes the primary context current itself.
#[test]
#[ignore = "needs a CUDA GPU"]
fn threads_without_a_context_can_allocate() {
    let _gpu = exclusive();
    let a = gpu(PolicyKind::Caching, "");
    let a2 = a.clone();
    std::thread::spawn(move || {
        let mut cur: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: a valid place for the result.
        unsafe { sys::cuCtxGetCurrent(&mut cur) };
        assert!(cur.is_null(), "a fresh thread has no current context");
        // SAFETY: 0 is the legacy default stream, always valid.
        let b = unsafe { a2.alloc_on_raw(3 * MIB, 0) }.expect("allocation on a bare thread");
        assert!(b.ptr() != 0);
        // SAFETY: as above.
        unsafe { sys::cuCtxGetCurrent(&mut cur) };
        assert_eq!(
            cur,
            a2.context().cu_ctx(),
            "the primary context was made current"
        );
    })
    .join()
    .expect("thread");
    assert_eq!(a.memory_stats().allocated_bytes.all.current, 0);
}

/// A synthetic trace replayed on the GPU: every block written, physical memory close to the
/// accounting, and all of it returned afterwards.
#[test]
#[ignore = "needs a CUDA GPU"]
fn replay_writes_every_block_and_returns_the_memory() {
    let _gpu = exclusive();
    let mut rng = Mt19937_64::new(5);
    let mut events = Vec::new();
    let mut live: Vec<(u64, u64)> = Vec::new();
    let (mut t, mut addr, mut written) = (0u64, 0x7f00_0000_0000u64, 0u64);
    let mut ev = |kind, addr, size, t: &mut u64| {
        *t += 1;
        events.push(Event {
            kind,
            stream: 0,
            addr,
            size,
            time_us: *t,
        });
    };
    for _ in 0..400 {
        if live.len() < 40 && (live.is_empty() || rng.uniform() < 0.6) {
            let size = log_uniform(&mut rng, 512, 32 * MIB);
            addr += 64 * MIB;
            ev(Kind::Alloc, addr, size, &mut t);
            live.push((addr, size));
            written += size;
        } else {
            let (p, s) = live
                .swap_remove(((rng.uniform() * live.len() as f64) as usize).min(live.len() - 1));
            ev(Kind::FreeRequested, p, s, &mut t);
            ev(Kind::FreeCompleted, p, s, &mut t);
        }
    }
    let trace = Trace {
        events,
        ..Trace::default()
    };
    let g = GpuReplay::open(&trace).expect("device");
    let reference = gpumem_core::reference::lower_reference(&trace, 2 * MIB).ratio;
    for policy in PolicyKind::ALL {
        let r = g
            .run(&trace, policy, &Config::default(), false)
            .expect("replay");
        assert_eq!(r.ooms, 0);
        // The trace's lower reference comes with every policy's figures.
        assert_eq!(r.lower_reference, reference);
        assert!(reference >= 1.0, "{reference}");
        assert_eq!(r.bytes_written, written, "{}", policy.name());
        assert!(r.gpu_peak_held_bytes >= r.peak_live_bytes, "{r:?}");
        // The driver hands out at least what gpumem holds, and not much more.
        assert!(
            r.physical_peak_bytes + 4 * MIB >= r.gpu_peak_held_bytes,
            "{}: physical {} < held {}",
            policy.name(),
            r.physical_peak_bytes,
            r.gpu_peak_held_bytes
        );
        assert!(
            r.physical_peak_bytes <= r.gpu_peak_held_bytes + r.gpu_peak_held_bytes / 10 + 64 * MIB,
            "{r:?}"
        );
        assert!(r.not_returned_bytes <= 4 << 20, "{r:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// The Rust API's contract with its callers (a review of 2026-12-01 found each of these broken:
// safe code crashed the process, or read or reused memory out of order).
// ---------------------------------------------------------------------------------------------

fn current_context() -> sys::CUcontext {
    let mut cur: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: a valid place for the result; the driver is loaded (a context exists).
    let r = unsafe { sys::cuCtxGetCurrent(&mut cur) };
    assert_eq!(r, CUresult::CUDA_SUCCESS);
    cur
}

/// Queues a memset of `v` over the first `bytes` of the block at `ptr` on `s`.
fn memset32(ptr: u64, v: u32, bytes: u64, s: sys::CUstream) {
    // SAFETY: callers pass a live block of at least `bytes` bytes and a live stream.
    let r = unsafe { sys::cuMemsetD32Async(ptr, v, (bytes / 4) as usize, s) };
    assert_eq!(r, CUresult::CUDA_SUCCESS, "cuMemsetD32Async");
}

/// The first word of the block at `ptr`, once the device is idle.
fn first_word(ctx: &Arc<CudaContext>, ptr: u64) -> u32 {
    ctx.synchronize().expect("synchronize");
    let mut w = 0u32;
    // SAFETY: 4 bytes from a live block into `w`.
    let r = unsafe { sys::cuMemcpyDtoH_v2(&mut w as *mut u32 as *mut _, ptr, 4) };
    assert_eq!(r, CUresult::CUDA_SUCCESS, "cuMemcpyDtoH");
    w
}

/// Keeps `s` busy for about 100 ms writing `busy` (a block of its own).
fn keep_busy(busy: &DeviceBuffer, s: sys::CUstream) {
    for i in 0..300u32 {
        memset32(busy.ptr(), i, busy.len_bytes(), s);
    }
}

const EARLY: u32 = 0xAAAA_AAAA;
const LATE: u32 = 0xBBBB_BBBB;

#[test]
#[ignore = "needs a CUDA GPU"]
fn calls_put_the_callers_context_back() {
    let _g = exclusive();
    let a = gpu(PolicyKind::Native, "");
    let s = a.context().new_stream().expect("stream");
    let mine = CudaContext::new_non_primary(0, 0).expect("a context of this thread's own");
    mine.bind_to_thread().expect("bind");
    let buf = a.alloc(8 * MIB, &s).expect("alloc");
    assert_eq!(current_context(), mine.cu_ctx(), "after an allocation");
    drop(buf);
    a.empty_cache().expect("empty_cache");
    assert_eq!(
        current_context(),
        mine.cu_ctx(),
        "after a free and empty_cache"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn streams_of_another_context_and_the_per_thread_stream_are_refused() {
    let _g = exclusive();
    let a = gpu(PolicyKind::Caching, "");
    let s = a.context().new_stream().expect("stream");
    let other = CudaContext::new_non_primary(0, 0).expect("another context");
    let foreign = other.new_stream().expect("a stream of the other context");
    let buf = a.alloc(8 * MIB, &s).expect("alloc");
    let e = buf.record_stream(&foreign).unwrap_err().to_string();
    assert!(e.contains("another context"), "{e}");
    drop(buf);
    assert_eq!(
        a.memory_stats().allocated_bytes.all.current,
        0,
        "freed at drop"
    );
    let e = a.alloc(MIB, &a.context().per_thread_stream()).unwrap_err();
    assert!(e.to_string().contains("per-thread default stream"), "{e}");
}

/// Streams dropped by the caller stay alive in the allocator: the free's event on a stream the
/// buffer was used on, empty_cache's events, and a new stream's handle all stay valid.
#[test]
#[ignore = "needs a CUDA GPU"]
fn streams_dropped_by_the_caller_stay_valid_for_the_allocator() {
    let _g = exclusive();
    // A buffer used on a stream dropped before it (idle: the driver would destroy it at once).
    let a = gpu(PolicyKind::Caching, "");
    let s1 = a.context().new_stream().expect("stream");
    let buf = a.alloc(MIB, &s1).expect("alloc");
    {
        let s2 = a.context().new_stream().expect("stream");
        buf.record_stream(&s2).expect("record_stream");
        let v: Vec<u8> = s2.clone_dtoh(&buf).expect("copy on s2");
        assert_eq!(v.len() as u64, MIB);
    }
    drop(buf);
    assert_eq!(a.memory_stats().allocated_bytes.all.current, 0);
    // The same through cudarc alone, on a stream the allocator was never told of.
    let buf = a.alloc(MIB, &s1).expect("alloc");
    {
        let s3 = a.context().new_stream().expect("stream");
        let v: Vec<u8> = s3.clone_dtoh(&buf).expect("copy on s3");
        assert_eq!(v.len() as u64, MIB);
    }
    drop(buf);
    assert_eq!(a.memory_stats().allocated_bytes.all.current, 0);
    // empty_cache after the pool's stream was dropped (expandable records before unmapping).
    let a = gpu(PolicyKind::Expandable, "");
    let s = a.context().new_stream().expect("stream");
    drop(a.alloc(64 * MIB, &s).expect("alloc"));
    drop(s);
    a.empty_cache().expect("empty_cache");
    assert_eq!(a.engine().held_bytes(), 0);
    // A new stream never inherits the blocks of a dropped one whose work is still running.
    let a = gpu(PolicyKind::Caching, "");
    let keep = a.context().new_stream().expect("stream");
    let s1 = a.context().new_stream().expect("stream");
    let busy = a.alloc(1 << 30, &keep).expect("busy");
    let buf = a.alloc(64 * MIB, &s1).expect("alloc");
    let old = buf.ptr();
    keep_busy(&busy, keep.cu_stream());
    s1.wait(&keep.record_event(None).expect("event"))
        .expect("wait");
    memset32(buf.ptr(), EARLY, buf.len_bytes(), s1.cu_stream());
    drop(buf);
    drop(s1);
    let s2 = a.context().new_stream().expect("stream");
    let b2 = a.alloc(64 * MIB, &s2).expect("alloc");
    memset32(b2.ptr(), LATE, b2.len_bytes(), s2.cu_stream());
    let w = first_word(a.context(), b2.ptr());
    assert!(
        b2.ptr() != old || w == LATE,
        "the new stream got the block the dropped stream was still writing (read {w:#x})"
    );
}

/// In a shared range (`range:shared`), bytes one stream freed while its work on them was still
/// queued go to another stream only behind that work: the second stream's write lands after
/// the first one's late write, whether the bytes are a small block on a page others use or a
/// block of whole pages.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_shared_range_hands_bytes_to_another_stream_behind_its_work() {
    let _g = exclusive();
    let a = gpu(PolicyKind::Stitched, "range:shared");
    let s1 = a.context().new_stream().expect("stream");
    let s2 = a.context().new_stream().expect("stream");
    let busy = a.alloc(1 << 30, &s1).expect("busy");
    for size in [64 << 10, 8 * MIB] {
        // A neighbour on s2 first, so that s2 is a user of the range before the handover.
        let neighbour = a.alloc(4096, &s2).expect("neighbour");
        let buf = a.alloc(size, &s1).expect("alloc");
        let old = buf.ptr();
        keep_busy(&busy, s1.cu_stream());
        memset32(buf.ptr(), EARLY, buf.len_bytes(), s1.cu_stream()); // lands ~100 ms later
        drop(buf);
        let b2 = a.alloc(size, &s2).expect("alloc on s2");
        let overlap = b2.ptr() < old + size && old < b2.ptr() + b2.len_bytes();
        assert!(overlap, "{size}: s2 did not get any of s1's bytes");
        memset32(b2.ptr(), LATE, b2.len_bytes(), s2.cu_stream());
        a.context().synchronize().expect("synchronize");
        expect_pattern(
            &b2,
            LATE,
            &format!("{size}: s2's block after s1's earlier write"),
        );
        drop((b2, neighbour));
    }
    a.engine().check().expect("invariants");
}

/// cudarc's contract for `device_ptr`: the stream waits for earlier writes to the memory.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_copy_on_another_stream_sees_the_buffers_writes() {
    let _g = exclusive();
    let a = gpu(PolicyKind::Caching, "");
    let s1 = a.context().new_stream().expect("stream");
    let s2 = a.context().new_stream().expect("stream");
    let busy = a.alloc(1 << 30, &s1).expect("busy");
    let buf = a.alloc(4 * MIB, &s1).expect("alloc");
    memset32(buf.ptr(), 0, buf.len_bytes(), s1.cu_stream());
    s1.synchronize().expect("synchronize");
    keep_busy(&busy, s1.cu_stream());
    memset32(buf.ptr(), EARLY, buf.len_bytes(), s1.cu_stream()); // lands after ~100 ms
    let host: Vec<u32> = s2.clone_dtoh(&buf).expect("copy on s2");
    let stale = host.iter().filter(|&&w| w != EARLY).count();
    assert_eq!(
        stale, 0,
        "the copy on s2 read {stale} words before s1's write"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_captured_graph_keeps_its_pool_and_eager_buffers_survive_its_replays() {
    // A CUDA graph captured in the global mode (the strictest) with gpumem's private pool, for
    // every policy: the capture's buffer comes from the pool (gpumem's driver calls during the
    // capture neither fail nor invalidate it), eager buffers made after it never overlap it,
    // and replaying the graph (which writes its buffer) leaves them intact.
    let _g = exclusive();
    for p in PolicyKind::ALL {
        let alloc = gpu(p, "");
        let ctx = alloc.context().clone();
        let s = ctx.new_stream().expect("stream");
        // Eager work first, so the stream has blocks of its own (and, for stitched, pages).
        let warm = alloc.alloc(8 * MIB, &s).expect("eager");
        fill(&warm, 1);
        drop(warm);
        const POOL: (u64, u64) = (1, 0);
        alloc.engine().begin_pool(POOL).expect("begin_pool");
        s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
            .expect("begin capture");
        let out = alloc
            .alloc_in_pool(8 * MIB, &s, POOL)
            .expect("allocation during capture");
        let tmp = alloc
            .alloc_in_pool(3 * MIB, &s, POOL)
            .expect("allocation during capture");
        memset32(tmp.ptr(), 0xAB, tmp.len_bytes(), s.cu_stream());
        memset32(out.ptr(), 0xCD, out.len_bytes(), s.cu_stream());
        drop(tmp); // freed during the capture: the pool's to reuse
        let graph = s
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .expect("end capture")
            .expect("a graph");
        alloc.engine().end_pool(POOL).expect("end_pool");
        let eager: Vec<DeviceBuffer> = (0..6)
            .map(|i| {
                alloc
                    .alloc(if i % 2 == 0 { 8 * MIB } else { 3 * MIB }, &s)
                    .unwrap()
            })
            .collect();
        for e in &eager {
            assert!(
                e.ptr() + e.len_bytes() <= out.ptr() || e.ptr() >= out.ptr() + out.len_bytes(),
                "{p:?}: an eager buffer is in the graph's memory"
            );
            fill(e, 0x77);
        }
        for _ in 0..3 {
            graph.launch().expect("replay");
        }
        for e in &eager {
            expect_pattern(e, 0x77, &format!("{p:?}: eager buffer after the replays"));
        }
        expect_pattern(&out, 0xCD, &format!("{p:?}: the graph's output"));
        drop(eager);
        drop(graph);
        drop(out);
        alloc.engine().release_pool(POOL).expect("release_pool");
        alloc.empty_cache().expect("empty_cache");
        assert_eq!(alloc.engine().pool_count(), 0, "{p:?}");
        alloc.engine().check().unwrap();
    }
}
