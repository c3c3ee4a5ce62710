//! `big_page` (on by default: 16 MiB from 8 GiB): once the first tier holds `big_after`, the
//! stitched policy places new blocks in a second pool of larger pages, except where the first
//! tier's pages are still mapped and idle in place (docs/stitched.md, "What comes next"). These
//! check that the blocks placed after the switch lie on the larger pages, mapped whole and
//! aligned, and that the same blocks again come back in place; that frees and misuse reach the
//! tier that holds the block; that the memory held stays near the live peak; that a pool under
//! the threshold is untouched; the bound on a recorded trace that switches; that the block
//! statistics' peaks are those of both tiers together; and that streams that allocate after
//! another switched are served at once.

use gpumem_core::backend::sim::{SimBackend, SimConfig, SimControl};
use gpumem_core::policy::PolicyKind;
use gpumem_core::replay::{replay, ReplayOptions};
use gpumem_core::trace;
use gpumem_core::{Allocator, Config};
use std::path::PathBuf;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn audited_sim(conf: &str, total: u64) -> (Allocator, SimControl) {
    let (sim, ctl) = SimBackend::new(SimConfig {
        total_bytes: total,
        audit: true,
        ..SimConfig::default()
    });
    (
        Allocator::new(Box::new(sim), Config::parse(conf).unwrap()).unwrap(),
        ctl,
    )
}

/// Sizes of mappings now: (2 MiB mappings, 16 MiB mappings); panics on any other size or on a
/// 16 MiB mapping not aligned to 16 MiB.
fn mapping_sizes(ctl: &SimControl) -> (usize, usize) {
    let (mut small, mut big) = (0, 0);
    for (va, len, _) in ctl.mappings() {
        match len {
            l if l == 2 * MIB => small += 1,
            l if l == 16 * MIB => {
                assert_eq!(va % (16 * MIB), 0, "16 MiB page at {va:#x}");
                big += 1;
            }
            l => panic!("a mapping of {l} bytes at {va:#x}"),
        }
    }
    (small, big)
}

#[test]
fn blocks_placed_after_the_switch_lie_on_the_larger_pages() {
    let (a, ctl) = audited_sim("big_page:16MiB,big_after:64MiB", 16 * GIB);
    // 40 blocks of 3 MiB: the device holds 64 MiB after about 21 of them.
    let first: Vec<_> = (0..40).map(|_| a.allocate(3 * MIB, 1).unwrap()).collect();
    let (small, big) = mapping_sizes(&ctl);
    assert!(
        (30..=40).contains(&small),
        "the first tier's 2 MiB pages: {small}"
    );
    assert!(big >= 4, "the second tier's 16 MiB pages: {big}");
    for al in &first {
        for at in [al.ptr, al.ptr + al.size - 1] {
            assert!(ctl.handle_at(at).is_some(), "{at:#x} is not mapped");
        }
    }
    a.check().unwrap();
    assert!(
        a.policy_notes().iter().any(|n| n.contains("big_page")),
        "{:?}",
        a.policy_notes()
    );
    // The same working set again, after every first block is freed: the first tier still has
    // its pages mapped and idle in place, so the blocks go back there and nothing is mapped.
    for al in first {
        a.free(al.ptr).unwrap();
    }
    let held = a.held_bytes();
    let again: Vec<_> = (0..40).map(|_| a.allocate(3 * MIB, 1).unwrap()).collect();
    a.check().unwrap();
    assert_eq!(
        mapping_sizes(&ctl),
        (small, big),
        "mappings after the same blocks again"
    );
    assert_eq!(a.held_bytes(), held);
    // Twice the working set: what the first tier's mapped pages cannot hold goes to the
    // second tier's pages, and the memory held stays within 2 % of live plus the rounding of
    // a few pages.
    let more: Vec<_> = (0..40).map(|_| a.allocate(3 * MIB, 1).unwrap()).collect();
    a.check().unwrap();
    let (small2, big2) = mapping_sizes(&ctl);
    assert_eq!(
        small2, small,
        "the first tier maps no page after the switch"
    );
    assert!(big2 >= big + 7, "second tier: {big} then {big2}");
    let live = 80 * 3 * MIB;
    assert!(
        a.held_bytes() <= live + live / 50 + 48 * MIB,
        "held {} MiB for {} MiB live",
        a.held_bytes() / MIB,
        live / MIB
    );
    for al in again.into_iter().chain(more) {
        a.free(al.ptr).unwrap();
    }
    a.check().unwrap();
}

#[test]
fn frees_and_misuse_reach_the_tier_that_holds_the_block() {
    let (a, _ctl) = audited_sim("big_page:16MiB,big_after:32MiB", 16 * GIB);
    let old: Vec<_> = (0..20).map(|_| a.allocate(3 * MIB, 1).unwrap()).collect();
    let new: Vec<_> = (0..8).map(|_| a.allocate(5 * MIB, 1).unwrap()).collect();
    // A block of each tier: freed once, refused the second time.
    for al in [&old[0], &new[0]] {
        a.free(al.ptr).unwrap();
        let e = a.free(al.ptr).unwrap_err().to_string();
        assert!(e.contains("double free"), "{e}");
    }
    // Inside a block of either tier, or far outside both: not a block of this allocator.
    for p in [old[1].ptr + 4096, new[1].ptr + 4096, 0xdead_0000] {
        assert!(a.free(p).is_err(), "{p:#x}");
    }
    for al in old.iter().skip(1).chain(new.iter().skip(1)) {
        a.free(al.ptr).unwrap();
    }
    a.check().unwrap();
    assert_eq!(a.memory_stats().allocated_bytes.all.current, 0);
}

#[test]
fn a_pool_under_the_threshold_keeps_one_page_size() {
    let (a, ctl) = audited_sim("big_page:16MiB", 16 * GIB);
    let blocks: Vec<_> = (0..50)
        .map(|i| a.allocate((1 + i % 7) * MIB, 1).unwrap())
        .collect();
    assert_eq!(mapping_sizes(&ctl).1, 0, "no 16 MiB page under 4 GiB held");
    assert!(!a.policy_notes().iter().any(|n| n.contains("big_page")));
    for al in blocks {
        a.free(al.ptr).unwrap();
    }
}

#[test]
fn a_recorded_trace_that_switches_stays_within_the_bound_for_fewer_calls() {
    // unet_res holds 9.9 GiB: it switches at the default 8 GiB, and at 4 GiB. The bundled
    // GPT-style trace (1.2 GiB) never does and replays exactly as without the tiers.
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../traces");
    let run = |name: &str, conf: &str| {
        let p = dir.join(name);
        let t = trace::load(&p, 0, None).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        let opts = ReplayOptions {
            config: Config::parse(conf).unwrap(),
            ..ReplayOptions::default()
        };
        replay(&t, PolicyKind::Stitched, &opts, None).unwrap()
    };
    let plain = run("validation/unet_res.pickle.gz", "big_page:off");
    for conf in ["", "big_after:4GiB"] {
        let tiers = run("validation/unet_res.pickle.gz", conf);
        assert_eq!(tiers.ooms, 0);
        assert!(
            tiers.ratio <= 1.02,
            "unet_res, {conf:?}: {:.4} of live",
            tiers.ratio
        );
        assert!(
            tiers.notes.iter().any(|n| n.contains("big_page")),
            "{conf:?}: {:?}",
            tiers.notes
        );
        // Growth after the first quarter (the pool meets larger resolutions): in 16 MiB pages.
        let late = |r: &gpumem_core::replay::PolicyResult| {
            r.est_seconds_by_quarter[1..].iter().sum::<f64>()
        };
        assert!(
            late(&tiers) < 0.3 * late(&plain),
            "{conf:?}: driver time after the first quarter {:.3} s against {:.3} s",
            late(&tiers),
            late(&plain)
        );
    }
    let early = run("validation/unet_res.pickle.gz", "big_after:4GiB");
    assert!(
        early.est_driver_seconds < 0.7 * plain.est_driver_seconds,
        "driver time {:.3} s against {:.3} s",
        early.est_driver_seconds,
        plain.est_driver_seconds
    );
    let small_plain = run("gpt_varlen.pickle.gz", "big_page:off");
    let small_tiers = run("gpt_varlen.pickle.gz", "");
    assert_eq!(small_plain.peak_held_bytes, small_tiers.peak_held_bytes);
    assert_eq!(small_plain.driver_calls, small_tiers.driver_calls);
}

#[test]
fn bad_settings_are_refused_with_a_reason() {
    for (conf, key) in [
        ("big_page:3MiB", "big_page"),
        ("big_page:lots", "big_page"),
        ("big_page:2GiB", "big_page"),
        ("big_after:soon", "big_after"),
    ] {
        let e = Config::parse(conf).unwrap_err().to_string();
        assert!(e.contains(key), "{conf}: {e}");
    }
    assert_eq!(Config::parse("big_page:off").unwrap().options.big_page, 0);
    assert_eq!(
        Config::parse("big_page:16MiB,big_after:1GiB")
            .unwrap()
            .options
            .big_after,
        GIB
    );
}

/// With two tiers, a stream's block statistics are the sum of the tiers', but their peaks are
/// those of the sum: each tier's own peak comes at another time, and adding them counts blocks
/// that were never live together.
#[test]
fn peaks_are_those_of_both_tiers_together() {
    let (a, _ctl) = audited_sim("big_page:16MiB,big_after:64MiB", 16 * GIB);
    let mut live = 0u64;
    let mut peak = 0u64;
    // 40 blocks of 3 MiB: the first ones on the first tier, the rest on the second.
    let mut blocks: Vec<_> = (0..40).map(|_| a.allocate(3 * MIB, 1).unwrap()).collect();
    for al in &blocks {
        live += al.size;
    }
    peak = peak.max(live);
    // The second tier's blocks go first, then the first tier's.
    while let Some(al) = blocks.pop() {
        live -= al.size;
        a.free(al.ptr).unwrap();
    }
    // Larger blocks: a few where the first tier's pages are still mapped, the rest on the
    // second tier, which now holds more than it did before.
    let big: Vec<_> = (0..10).map(|_| a.allocate(20 * MIB, 1).unwrap()).collect();
    for al in &big {
        live += al.size;
    }
    peak = peak.max(live);
    let st = a.memory_stats();
    assert_eq!(
        st.allocated_bytes.all.peak, peak as i64,
        "allocated bytes' peak"
    );
    assert_eq!(st.allocated_bytes.all.current, live as i64);
    assert_eq!(
        st.requested_bytes.all.peak,
        (200 * MIB) as i64,
        "requested bytes' peak"
    );
    assert_eq!(st.allocation.all.peak, 40, "blocks' peak");
    // reset_peak_memory_stats: the peaks start again from what is live now.
    a.reset_peak_stats();
    let st = a.memory_stats();
    assert_eq!(st.allocated_bytes.all.peak, live as i64);
    assert_eq!(st.allocation.all.peak, 10);
    for al in big {
        a.free(al.ptr).unwrap();
    }
    a.check().unwrap();
}

/// A stream runs on its first-tier instance alone until the switch; the engine wraps it in the
/// tiers when it next allocates. A stream that allocates for the first time after another one
/// switched, or one whose first request after the switch the first tier (which maps no page
/// any more) refuses, is served by the second tier at once.
#[test]
fn streams_that_allocate_after_another_switched_are_served() {
    let (a, ctl) = audited_sim("big_page:16MiB,big_after:64MiB", 16 * GIB);
    // Stream 3 holds a small block from before the switch, and frees it.
    let early = a.allocate(MIB, 3).unwrap();
    a.free(early.ptr).unwrap();
    // Stream 1 makes the first tier pass 64 MiB.
    let one: Vec<_> = (0..30).map(|_| a.allocate(3 * MIB, 1).unwrap()).collect();
    assert!(
        a.policy_notes().iter().any(|n| n.contains("big_page")),
        "{:?}",
        a.policy_notes()
    );
    // Stream 2 comes now; stream 3 asks for more than its idle page holds.
    let two = a.allocate(5 * MIB, 2).unwrap();
    let three = a.allocate(10 * MIB, 3).unwrap();
    // At once: not through the out-of-memory path, which empties every stream's cache first.
    assert_eq!(a.memory_stats().num_alloc_retries, 0);
    for al in [&two, &three] {
        let h = ctl.handle_at(al.ptr).expect("mapped");
        assert!(
            ctl.mappings()
                .iter()
                .any(|&(va, len, hh)| hh == h && len == 16 * MIB && va <= al.ptr),
            "{:#x} is not on a 16 MiB page",
            al.ptr
        );
    }
    a.check().unwrap();
    for al in one.into_iter().chain([two, three]) {
        a.free(al.ptr).unwrap();
    }
    a.check().unwrap();
    assert_eq!(a.memory_stats().allocated_bytes.all.current, 0);
}
