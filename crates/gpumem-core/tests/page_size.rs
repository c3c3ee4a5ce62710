//! `page:` makes the stitched policy's physical pages larger than the device's granularity
//! (kernels stream faster over larger handles on an H200; blocks hold whole pages, so they
//! cost memory). These check that every handle is then mapped whole, at an address aligned
//! to it, that what is held stays whole pages, that pages the device cannot make are refused
//! with a reason, and that the other policies ignore it.

use gpumem_core::backend::sim::{SimBackend, SimConfig, SimControl};
use gpumem_core::backend::Stream;
use gpumem_core::policy::PolicyKind;
use gpumem_core::replay::{replay, ReplayOptions};
use gpumem_core::testing::TestRng;
use gpumem_core::trace;
use gpumem_core::{Allocator, Config};
use std::path::PathBuf;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// An allocator configured by `conf` over a simulated device of `total` bytes that mirrors
/// its mappings (for [`SimControl::mappings`]).
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

#[test]
fn larger_pages_are_mapped_whole_at_addresses_aligned_to_them() {
    // Both range modes: a range per stream, and one range shared by the streams.
    for range in ["stream", "shared"] {
        for page in [4 * MIB, 16 * MIB] {
            let conf = format!("range:{range},page:{}MiB", page / MIB);
            let (a, ctl) = audited_sim(&conf, 16 * GIB);
            let mut rng = TestRng::new(0x9a6e + page);
            let mut live = Vec::new();
            for step in 0..3000 {
                if live.len() < 60 && (live.is_empty() || rng.unit_f64() < 0.55) {
                    // Sizes from 512 B to 64 MiB, log-uniform: blocks inside a page and across many.
                    let size = (512.0 * (131072f64).powf(rng.unit_f64())) as u64;
                    let stream = 1 + rng.index(2) as Stream;
                    let al = a.allocate(size, stream).expect("allocation");
                    // Both ends of the block lie in mapped memory.
                    for at in [al.ptr, al.ptr + size - 1] {
                        assert!(ctl.handle_at(at).is_some(), "{conf}: {at:#x} is not mapped");
                    }
                    live.push(al);
                } else {
                    let i = rng.index(live.len());
                    a.free(live.swap_remove(i).ptr).expect("free");
                }
                if step % 500 == 499 {
                    a.check()
                        .unwrap_or_else(|e| panic!("{conf} step {step}: {e}"));
                    let maps = ctl.mappings();
                    assert!(!maps.is_empty(), "{conf}: nothing mapped");
                    for (va, len, _) in maps {
                        assert_eq!(len, page, "{conf}: a mapping of {len} bytes at {va:#x}");
                        assert_eq!(va % page, 0, "{conf}: mapping at {va:#x} is not aligned");
                    }
                    assert_eq!(a.held_bytes() % page, 0, "{conf}: {} held", a.held_bytes());
                }
            }
        }
    }
}

#[test]
fn pages_the_device_cannot_make_are_refused_with_a_reason() {
    // Not a power of two: refused when the configuration is read.
    let e = Config::parse("page:3MiB").unwrap_err().to_string();
    assert!(e.contains("page:3MiB") && e.contains("power of two"), "{e}");
    assert!(Config::parse("page:lots").is_err());
    // Below the simulated device's 2 MiB granularity, or above 1 GiB: refused by the
    // allocator, which knows the device.
    for conf in ["page:1MiB", "page:2GiB"] {
        let (sim, _) = SimBackend::new(SimConfig::default());
        let e = Allocator::new(Box::new(sim), Config::parse(conf).unwrap())
            .err()
            .unwrap_or_else(|| panic!("{conf} was accepted"))
            .to_string();
        assert!(e.contains("granularity"), "{conf}: {e}");
    }
}

#[test]
fn other_policies_ignore_the_page_as_every_stitched_key() {
    // One configuration for every policy of a replay or a benchmark: the policies that map no
    // pages of their own hold exactly what they hold without it, and say nothing of it.
    for policy in ["caching", "native", "buddy", "expandable"] {
        let held = |conf: &str| {
            let (sim, _) = SimBackend::new(SimConfig::default());
            let a = Allocator::new(Box::new(sim), Config::parse(conf).unwrap()).unwrap();
            for n in [1000, 5 * MIB, 300 << 10, 40 * MIB] {
                a.allocate(n, 1 as Stream).expect("allocation");
            }
            assert!(
                a.policy_notes().is_empty(),
                "{conf}: {:?}",
                a.policy_notes()
            );
            a.held_bytes()
        };
        let plain = held(&format!("policy:{policy}"));
        assert_eq!(
            held(&format!("policy:{policy},page:16MiB")),
            plain,
            "{policy}"
        );
    }
}

#[test]
fn larger_pages_hold_whole_pages_and_more_memory_on_a_recorded_trace() {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../traces/gpt_varlen.pickle.gz");
    let t = trace::load(&p, 0, None).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    let mut held = Vec::new();
    for page in [2 * MIB, 16 * MIB] {
        let opts = ReplayOptions {
            config: Config::parse(&format!("page:{}MiB", page / MIB)).unwrap(),
            ..ReplayOptions::default()
        };
        let s = replay(&t, PolicyKind::Stitched, &opts, None).unwrap();
        assert_eq!(s.ooms, 0);
        // The replay says which page it used, when it is not the default.
        let said = s.notes.iter().any(|n| n.contains("physical pages of 16"));
        assert_eq!(said, page == 16 * MIB, "page {page}: {:?}", s.notes);
        assert_eq!(
            s.peak_held_bytes % page,
            0,
            "page {page}: {}",
            s.peak_held_bytes
        );
        held.push(s.peak_held_bytes);
    }
    // Larger pages leave more of each one unused around the blocks (1.0141 and 1.0236 of
    // live when this was written).
    assert!(held[1] > held[0], "held with 2 and 16 MiB pages: {held:?}");
}
