//! Out of memory: the allocator releases its cache and retries before failing, and the
//! error names the request, live, cached, fragmentation and the largest free block, and
//! suggests the change the numbers point to.

use gpumem_core::backend::sim::{SimBackend, SimConfig};
use gpumem_core::units::{GIB, MIB};
use gpumem_core::{AllocError, Allocator, Config, OomReport};

fn allocator(total: u64, foreign: u64, conf: &str) -> Allocator {
    let (sim, _) = SimBackend::new(SimConfig {
        total_bytes: total,
        foreign_bytes: foreign,
        ..SimConfig::default()
    });
    Allocator::new(Box::new(sim), Config::parse(conf).unwrap()).unwrap()
}

fn oom(e: AllocError) -> OomReport {
    match e {
        AllocError::OutOfMemory(r) => *r,
        other => panic!("expected an out-of-memory error, got {other}"),
    }
}

/// Six 8 MiB tensors fill three 20 MiB segments (two each, 4 MiB left at the end); the first
/// of each pair is freed: 36 MiB cached, but in pieces of 8 and 4 MiB.
fn fragment(a: &Allocator) -> Vec<gpumem_core::Allocation> {
    let blocks: Vec<_> = (0..6).map(|_| a.allocate(8 * MIB, 0).unwrap()).collect();
    for b in blocks.iter().step_by(2) {
        a.free_allocation(b).unwrap();
    }
    blocks
}

#[test]
fn fragmentation_points_to_stitching() {
    let a = allocator(60 * MIB, 0, "policy:native");
    fragment(&a);
    assert_eq!(a.held_bytes(), 60 * MIB);
    let r = oom(a.allocate(16 * MIB, 0).unwrap_err());
    assert_eq!(r.requested, 16 * MIB);
    assert_eq!(
        r.held,
        60 * MIB,
        "no segment was entirely free: nothing to release"
    );
    assert_eq!(r.allocated, 24 * MIB);
    assert_eq!(r.cached, 36 * MIB);
    assert_eq!(r.largest_free_block, 8 * MIB);
    assert_eq!(
        r.retries, 1,
        "the cache was released and the request retried once"
    );
    assert!((r.fragmentation() - 0.6).abs() < 1e-9);
    let msg = r.to_string();
    for needle in [
        "16.00 MiB",
        "24.00 MiB allocated",
        "36.00 MiB cached",
        "60.0%",
        "largest free block is 8.00 MiB",
        "policy:stitched",
    ] {
        assert!(msg.contains(needle), "{needle:?} not in: {msg}");
    }
    let s = a.memory_stats();
    assert_eq!((s.num_alloc_retries, s.num_ooms), (1, 1));
    // The suggestion is right: the same requests fit under the stitched policy.
    let b = allocator(60 * MIB, 0, "policy:stitched");
    fragment(&b);
    b.allocate(16 * MIB, 0)
        .expect("stitching maps the free pages under the new block");
}

#[test]
fn a_cap_below_the_device_points_to_the_cap() {
    let a = allocator(GIB, 0, "policy:stitched,fraction:0.25");
    let _kept = a.allocate(200 * MIB, 0).unwrap();
    let r = oom(a.allocate(100 * MIB, 0).unwrap_err());
    assert_eq!(r.cap, Some(GIB / 4));
    // The stitched policy holds exactly the 100 two-megabyte pages of the live 200 MiB; the
    // rest of the 1 GiB device is free: the device has room, the cap is what refuses.
    assert_eq!(r.held, 200 * MIB);
    assert_eq!(r.device_free, GIB - 200 * MIB);
    let msg = r.to_string();
    assert!(msg.contains("capped at 256.00 MiB"), "{msg}");
    assert!(msg.contains("fraction"), "{msg}");
}

#[test]
fn live_tensors_filling_the_device_point_to_the_program() {
    let a = allocator(64 * MIB, 0, "policy:caching");
    let _kept: Vec<_> = (0..15).map(|_| a.allocate(4 * MIB, 0).unwrap()).collect();
    let r = oom(a.allocate(8 * MIB, 0).unwrap_err());
    assert!(r.cached < r.requested, "{r:?}");
    assert_eq!(r.allocated, 60 * MIB);
    let msg = r.to_string();
    assert!(msg.contains("live tensors fill the memory"), "{msg}");
    assert!(!msg.contains("stitched"), "{msg}");
}

#[test]
fn memory_held_elsewhere_points_to_the_other_processes() {
    let a = allocator(64 * MIB, 40 * MIB, "policy:caching");
    let _kept = a.allocate(4 * MIB, 0).unwrap();
    // Others hold 40 MiB of the device.
    let r = oom(a.allocate(22 * MIB, 0).unwrap_err());
    assert_eq!(r.device_free, 64 * MIB - 40 * MIB - r.held);
    // The caching policy gives the 4 MiB tensor one 20 MiB segment (1-10 MiB requests get
    // one), which it cannot release while the tensor lives: 64 - 40 - 20 = 4 MiB are free.
    assert_eq!(r.held, 20 * MIB);
    assert_eq!(r.device_free, 4 * MIB);
    assert!(r.to_string().contains("someone else"), "{r}");
}

#[test]
fn releasing_the_cache_and_retrying_can_succeed() {
    let a = allocator(64 * MIB, 0, "policy:native");
    // A 40 MiB segment, cached once its tensor is freed; then a small segment.
    let big = a.allocate(40 * MIB, 0).unwrap();
    a.free_allocation(&big).unwrap();
    let _small = a.allocate(1000, 0).unwrap();
    assert_eq!(a.held_bytes(), 42 * MIB);
    // 50 MiB neither fits the cached 40 MiB block nor beside it: the allocator releases the
    // cached segment and succeeds on its retry.
    let p = a
        .allocate(50 * MIB, 0)
        .expect("succeeds after releasing the cache");
    assert_eq!(p.size, 50 * MIB);
    assert_eq!(a.held_bytes(), 52 * MIB);
    let s = a.memory_stats();
    assert_eq!((s.num_alloc_retries, s.num_ooms), (1, 0));
}

#[test]
fn already_stitched_is_not_told_to_stitch() {
    let r = OomReport {
        requested: 16 * MIB,
        stream: 0,
        policy: "stitched".into(),
        device_total: 60 * MIB,
        device_free: 0,
        cap: None,
        held: 60 * MIB,
        allocated: 24 * MIB,
        cached: 36 * MIB,
        largest_free_block: 8 * MIB,
        retries: 1,
        during_capture: false,
    };
    assert!(
        !r.suggestion().contains("policy:stitched"),
        "{}",
        r.suggestion()
    );
}

/// Ten 8 MiB tensors, every other one freed: 40 MiB live and 40 MiB cached in 8 MiB pieces.
fn half_freed(a: &Allocator) -> Vec<gpumem_core::Allocation> {
    let blocks: Vec<_> = (0..10).map(|_| a.allocate(8 * MIB, 0).unwrap()).collect();
    for b in blocks.iter().step_by(2) {
        a.free_allocation(b).unwrap();
    }
    blocks
}

/// `largest_obtainable` (PyTorch's `cacheInfo`, which cuDNN sizes its workspaces by) brackets
/// what the next allocation can really get: a request a page under it succeeds, one a few MiB
/// over it runs out of memory, with and without a cap. Two allocators built alike answer the
/// two requests, since a failed one releases the cache.
#[test]
fn largest_obtainable_is_what_the_next_allocation_can_get() {
    for conf in ["policy:native", "policy:caching", "policy:stitched", ""] {
        for fraction in [None, Some(0.5)] {
            let build = || {
                let a = allocator(256 * MIB, 0, conf);
                if let Some(f) = fraction {
                    a.set_memory_fraction(f).unwrap();
                }
                let kept = half_freed(&a);
                (a, kept)
            };
            let (fits, _kept_fits) = build();
            let (over, _kept_over) = build();
            let largest = fits.largest_obtainable();
            assert_eq!(largest, over.largest_obtainable(), "{conf} {fraction:?}");
            let case = format!("{conf:?} fraction {fraction:?}: largest_obtainable {largest}");
            assert!(largest >= 8 * MIB, "{case}: at least a cached block");
            fits.allocate(largest - 2 * MIB, 0)
                .unwrap_or_else(|e| panic!("{case}: 2 MiB under it failed: {e}"));
            let e = over.allocate(largest + 4 * MIB, 0).unwrap_err();
            assert!(
                matches!(e, AllocError::OutOfMemory(_)),
                "{case}: 4 MiB over it: {e}"
            );
        }
    }
}

/// A stitched request that took pages back from its stream's idle list and then found no
/// room for the rest puts them back: the retry can release them, and no page is lost to later
/// requests.
#[test]
fn a_failed_stitched_request_loses_no_idle_page() {
    let a = allocator(GIB, 0, "policy:stitched,fraction:0.25");
    let p = a.allocate(64 * MIB, 0).unwrap();
    a.free_allocation(&p).unwrap();
    assert_eq!(a.held_bytes(), 64 * MIB);
    // 300 MiB lands where the 64 MiB were: it takes their 32 idle pages back, then needs 118
    // more under a cap of 128 pages.
    let r = oom(a.allocate(300 * MIB, 0).unwrap_err());
    assert_eq!(r.cap, Some(GIB / 4));
    a.check().unwrap();
    // The retry released the idle pages: none is held by a failed request.
    assert_eq!(a.held_bytes(), 0);
    // All 128 pages of the cap are there for the next request.
    let q = a
        .allocate(256 * MIB, 0)
        .expect("the whole cap is obtainable");
    assert_eq!(a.held_bytes(), 256 * MIB);
    a.free_allocation(&q).unwrap();
    a.check().unwrap();
}
