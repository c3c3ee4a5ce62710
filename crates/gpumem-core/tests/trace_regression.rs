//! Replays the five real PyTorch traces of ANCHORS.md §1 (bundled in traces/anchors/, converted
//! from shared/traces/ with `gpumem convert`) and checks each policy's numbers:
//! - stitched: peak held ÷ peak live ≤ 1.02 on every trace, and no driver call but event
//!   records in the last quarter of the fixed-shape training traces (steady state);
//! - native: the same segment allocations as the recorded allocator, peak held within 0.5 %;
//! - expandable: within 2 % of the expandable-segments column of ANCHORS.md §1;
//! - the lower reference (`gpumem_core::reference`): ANCHORS.md §1's own figures.

use gpumem_core::policy::PolicyKind;
use gpumem_core::reference::lower_reference;
use gpumem_core::replay::{replay, PolicyResult, ReplayOptions};
use gpumem_core::trace;
use gpumem_core::units::DEFAULT_PAGE;
use std::path::PathBuf;

fn load(name: &str) -> trace::Trace {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../traces/anchors")
        .join(format!("{name}.gmt.gz"));
    trace::load(&p, 0, None).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// (trace, expandable ratio measured on the H200 in ANCHORS.md §1, fixed-shape training?,
/// ANCHORS.md §1's lower reference)
const TRACES: [(&str, f64, bool, f64); 5] = [
    ("gpt2_train", 1.097, true, 1.0007),
    ("gpt2_varlen", 1.071, false, 1.0010),
    ("resnet50_train", 1.007, true, 1.0023),
    ("llama_decode", 1.018, false, 1.0016),
    ("prefetch_mlp", 1.072, false, 1.0082),
];

fn check_trace((name, expandable_anchor, fixed_shapes, reference): (&str, f64, bool, f64)) {
    let t = load(name);
    // The lower reference is computed as ANCHORS.md defines it: its figures, to the fourth
    // decimal they are given to.
    let r = lower_reference(&t, DEFAULT_PAGE);
    assert!(
        (r.ratio - reference).abs() < 0.00005,
        "{name}: lower reference {:.5}, ANCHORS.md says {reference}",
        r.ratio
    );
    let opts = ReplayOptions::default();
    let s = replay(&t, PolicyKind::Stitched, &opts, None).unwrap();
    assert!(
        s.ratio <= 1.02,
        "{name}: stitched ratio {:.4} > 1.02",
        s.ratio
    );
    assert_eq!(s.ooms, 0);
    // Warm-ups grow the pool and their remapping stops: the remap budget buys no spare pages
    // (one stream each, except prefetch's two, which share the first one's range,
    // `range:auto`; the only notes allowed say so, and what `shared_spare` did there).
    assert!(budgets_untouched(&s.notes), "{name}: {:?}", s.notes);
    if fixed_shapes {
        // The steady state maps, unmaps and waits for nothing. Event records are allowed: a
        // page taken back at another virtual page than the one it went idle from marks that
        // point of the stream (once per request), so that moving the page left behind later
        // never waits for work queued after it.
        let q = s.calls_by_quarter_by_kind[3]
            .as_object()
            .expect("calls by kind");
        let other: Vec<_> = q
            .iter()
            .filter(|(k, v)| k.as_str() != "cuEventRecord" && v.as_u64() != Some(0))
            .collect();
        assert!(
            other.is_empty(),
            "{name}: stitched makes driver calls in the steady state: {other:?}"
        );
    }
    let n = replay(&t, PolicyKind::Native, &opts, None).unwrap();
    let f = n.fidelity.expect("traces carry segment events");
    assert!(
        f.segments_match,
        "{name}: native segments differ at {:?}",
        f.first_mismatch
    );
    assert!(
        f.peak_held_error.abs() <= 0.005,
        "{name}: native peak off by {}",
        f.peak_held_error
    );
    let e = replay(&t, PolicyKind::Expandable, &opts, None).unwrap();
    let rel = (e.ratio - expandable_anchor).abs() / expandable_anchor;
    assert!(
        rel <= 0.02,
        "{name}: expandable ratio {:.4} vs anchor {expandable_anchor}",
        e.ratio
    );
    // The point of the stitched policy: it beats every anchor allocator on memory.
    assert!(
        s.ratio < n.ratio && s.ratio < e.ratio,
        "{name}: stitched does not win"
    );
}

#[test]
fn gpt2_train() {
    check_trace(TRACES[0]);
}

#[test]
fn gpt2_varlen() {
    check_trace(TRACES[1]);
}

#[test]
fn resnet50_train() {
    check_trace(TRACES[2]);
}

#[test]
fn llama_decode() {
    check_trace(TRACES[3]);
}

#[test]
fn prefetch_mlp() {
    check_trace(TRACES[4]);
}

/// Whether the policy's notes say nothing but that a second stream came to share the first
/// one's range (`range:auto`), that the shared range made pages instead of remaps
/// (`shared_spare`), and that a pool past 8 GiB went on in larger pages (`big_page`): no
/// budget raised spare pages or stopped page trading.
fn budgets_untouched(notes: &[String]) -> bool {
    notes
        .iter()
        .all(|n| n.contains("range:auto") || n.contains("shared_spare") || n.contains("(big_page,"))
}

/// An unseen recorded trace (under `traces/`): stitched within 1.02 of live and below native
/// and expandable segments, and the native simulation making exactly the recorded segments.
fn check_unseen(file: &str) {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../traces");
    let t = trace::load(&root.join(file), 0, None).unwrap();
    let opts = ReplayOptions::default();
    let s = replay(&t, PolicyKind::Stitched, &opts, None).unwrap();
    assert!(
        s.ratio <= 1.02,
        "{file}: stitched ratio {:.4} > 1.02",
        s.ratio
    );
    assert!(budgets_untouched(&s.notes), "{file}: {:?}", s.notes);
    let n = replay(&t, PolicyKind::Native, &opts, None).unwrap();
    let f = n.fidelity.expect("recorded under the native allocator");
    assert!(
        f.segments_match && f.peak_held_error == 0.0,
        "{file}: {f:?}"
    );
    let e = replay(&t, PolicyKind::Expandable, &opts, None).unwrap();
    assert!(
        s.ratio < n.ratio && s.ratio < e.ratio,
        "{file}: stitched does not win"
    );
}

/// Traces of other kinds recorded on an H200 with scripts/record_trace.py (an encoder-decoder
/// with random lengths, activation checkpointing, a small MLP, and the bundled two-stream GPT
/// with random lengths): not used to tune anything, they check that the bound holds beyond the
/// five anchor traces, and that the native simulation matches there too.
#[test]
fn other_kinds_of_workload() {
    for file in [
        "validation/encdec.pickle.gz",
        "validation/checkpointed.pickle.gz",
        "gpt_varlen.pickle.gz",
        // 393 MiB live: two-megabyte pages weigh more in so small a workload.
        "validation/mlp.pickle.gz",
    ] {
        check_unseen(file);
    }
}

/// A second set of unseen workloads, recorded on an H200 on 2026-12-01 with
/// `scripts/device/record.sh` (WORKLOADS="vit_accum:6 unet_res:12 serve_threads:12
/// kv_decode:8"), after the stitched policy's settings were fixed: a vision transformer with
/// gradient accumulation, a U-Net trained at a random resolution each step, and greedy decoding
/// with a key/value cache grown by concatenation. The bound holds on all three.
#[test]
fn unseen_training_and_decoding_workloads() {
    for file in [
        "validation/vit_accum.pickle.gz",
        "validation/unet_res.pickle.gz",
        "validation/kv_decode.pickle.gz",
    ] {
        check_unseen(file);
    }
}

/// An inference server: four threads, each on its own stream, serving requests of random size
/// (recorded with the set above). With a range per stream (`range:stream`) small blocks of
/// different streams cannot share a page, and at the peak the pages touched are 1.05 of the
/// live bytes. By default (`range:auto`) the first stream's range, which holds the model's
/// weights, becomes the one the streams share when the second stream comes: within the bound
/// (1.0191 when that changed, 2026-12-03), below the trace's lower reference (1.0272: every
/// block best-fit in one range, pages held only while touched, stream order ignored), which
/// page-aware placement beats by packing small blocks onto pages already touched.
#[test]
fn multi_stream_server() {
    check_unseen("validation/serve_threads.pickle.gz");
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../traces/validation");
    let t = trace::load(&root.join("serve_threads.pickle.gz"), 0, None).unwrap();
    let s = replay(&t, PolicyKind::Stitched, &ReplayOptions::default(), None).unwrap();
    assert_eq!(s.range, Some("auto"));
    let r = lower_reference(&t, DEFAULT_PAGE);
    assert!(
        (r.ratio - 1.0272).abs() < 0.00005,
        "lower reference {:.5}",
        r.ratio
    );
    let per_stream = ReplayOptions {
        config: gpumem_core::Config::parse("range:stream").unwrap(),
        ..ReplayOptions::default()
    };
    let own = replay(&t, PolicyKind::Stitched, &per_stream, None).unwrap();
    assert!(
        s.ratio < r.ratio && s.ratio < own.ratio - 0.02,
        "server: default {:.4}, reference {:.4}, a range per stream {:.4}",
        s.ratio,
        r.ratio,
        own.ratio
    );
}

/// The same server, and the other traces with several streams, with every stream's blocks in
/// one range (`range:shared`): within the bound, the server below its lower reference (page-aware
/// placement packs small blocks onto pages already touched; 1.0191 when added), and less
/// memory than with a range per stream on the server.
#[test]
fn multi_stream_traces_within_the_bound_in_a_shared_range() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../traces");
    let opts = ReplayOptions {
        config: gpumem_core::Config::parse("range:shared").unwrap(),
        ..ReplayOptions::default()
    };
    for file in [
        "validation/serve_threads.pickle.gz",
        "anchors/prefetch_mlp.gmt.gz",
        "gpt_varlen.pickle.gz",
    ] {
        let t = trace::load(&root.join(file), 0, None).unwrap();
        assert!(t.streams().len() >= 2, "{file}");
        let s = replay(&t, PolicyKind::Stitched, &opts, None).unwrap();
        assert_eq!(s.range, Some("shared"));
        assert!(
            s.ratio <= 1.02,
            "{file}: stitched with a shared range {:.4} > 1.02",
            s.ratio
        );
        assert_eq!(s.ooms, 0);
        if file.contains("serve_threads") {
            let r = lower_reference(&t, DEFAULT_PAGE);
            let per_stream = ReplayOptions {
                config: gpumem_core::Config::parse("range:stream").unwrap(),
                ..ReplayOptions::default()
            };
            let own = replay(&t, PolicyKind::Stitched, &per_stream, None).unwrap();
            assert!(
                s.ratio < r.ratio && s.ratio < own.ratio - 0.02,
                "server: shared {:.4}, reference {:.4}, a range per stream {:.4}",
                s.ratio,
                r.ratio,
                own.ratio
            );
        }
    }
}

/// The replay's GPU-lag model: events the policy records complete that long after, so host
/// waits are counted only where the GPU would still be behind. The lag changes how often the
/// host waits, never where memory goes.
#[test]
fn gpu_lag_changes_host_waits_not_memory() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../traces");
    let t = trace::load(&root.join("gpt_varlen.pickle.gz"), 0, None).unwrap();
    let waits = |lag: Option<u64>| {
        let opts = ReplayOptions {
            gpu_lag_us: lag,
            ..ReplayOptions::default()
        };
        let r = replay(&t, PolicyKind::Stitched, &opts, None).unwrap();
        let w = r.driver_calls["cuEventSynchronize"].as_u64().unwrap_or(0);
        (w, r.peak_held_bytes)
    };
    let (none, held) = waits(None);
    let (zero, held0) = waits(Some(0));
    let (ten, held10) = waits(Some(10_000));
    assert_eq!((held0, held10), (held, held));
    assert!(
        zero < ten && ten <= none,
        "host waits: lag 0 {zero}, 10 ms {ten}, never complete {none}"
    );
}

/// A 64-step GPT-2 run with random lengths, recorded on the H200 (traces/runs/README.md): new
/// longest lengths keep moving the layout after the warm-up, so virtual pages keep being moved
/// to other physical pages. With the GPU 10 ms behind the host, none of those moves after the
/// first quarter makes the host wait: each waits only for the point where its virtual page went
/// idle, and an event marks that point where the page changed hands (before, 3 waits in each
/// later quarter; on the H200 13-15 timed steps each waited 24-31 ms).
#[test]
fn a_long_random_length_run_makes_no_host_wait_after_its_first_quarter() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../traces/runs");
    let t = trace::load(&root.join("gpt2_varlen64.gmt.gz"), 0, None).unwrap();
    let opts = ReplayOptions {
        gpu_lag_us: Some(10_000),
        ..ReplayOptions::default()
    };
    let r = replay(&t, PolicyKind::Stitched, &opts, None).unwrap();
    assert!(r.ratio <= 1.02, "held / live {:.4}", r.ratio);
    let count = |q: usize, kind: &str| r.calls_by_quarter_by_kind[q][kind].as_u64().unwrap_or(0);
    let moved: u64 = (1..4).map(|q| count(q, "cuMemUnmap")).sum();
    assert!(moved > 0, "the run must still move pages after its warm-up");
    let waits: Vec<u64> = (0..4).map(|q| count(q, "cuEventSynchronize")).collect();
    assert_eq!(&waits[1..], &[0, 0, 0], "host waits by quarter: {waits:?}");
}

/// The prefetch pipeline's runs free a step's tensors in orders that differ from run to run
/// (PyTorch's autograd thread races the main thread), the same blocks between the same
/// allocations. The placement must not depend on that order: every recorded run replays to the
/// same mappings and the same peak (before the free lists kept blocks freed together in address
/// order, these runs mapped 1,411 to 1,607 pages).
#[test]
fn prefetch_runs_that_free_in_other_orders_map_the_same_pages() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../traces/prefetch_runs");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".pickle.gz"))
        .collect();
    files.sort();
    assert!(files.len() >= 20, "the recorded runs: {}", files.len());
    let opts = ReplayOptions {
        gpu_lag_us: Some(10_000),
        ..ReplayOptions::default()
    };
    let mut seen = std::collections::BTreeMap::new();
    for f in &files {
        let t = trace::load(f, 0, None).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        let r = replay(&t, PolicyKind::Stitched, &opts, None).unwrap();
        let maps = r.driver_calls["cuMemMap"].as_u64().unwrap();
        seen.entry((maps, r.peak_held_bytes))
            .or_insert_with(Vec::new)
            .push(f.file_name().unwrap().to_string_lossy().into_owned());
    }
    assert_eq!(
        seen.len(),
        1,
        "pages mapped and peak held per run: {seen:?}"
    );
}

/// `--remap-sites` on a recorded prefetch run: recording them changes nothing, and they say
/// where the remapping is (the forward pass's 32 MiB weight casts, on the compute stream).
#[test]
fn remap_sites_name_the_allocations_that_unmap_pages_without_changing_the_replay() {
    let f = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../traces/prefetch_runs/s18_prefetch_mlp.gpumem.720.pickle.gz");
    let t = trace::load(&f, 0, None).unwrap();
    let plain = ReplayOptions {
        gpu_lag_us: Some(10_000),
        ..ReplayOptions::default()
    };
    let with_sites = ReplayOptions {
        remap_sites: true,
        ..plain.clone()
    };
    let a = replay(&t, PolicyKind::Stitched, &plain, None).unwrap();
    let b = replay(&t, PolicyKind::Stitched, &with_sites, None).unwrap();
    assert!(a.remap_sites.is_empty(), "not recorded unless asked for");
    assert_eq!(
        (a.peak_held_bytes, &a.driver_calls, a.calls_by_quarter),
        (b.peak_held_bytes, &b.driver_calls, b.calls_by_quarter)
    );
    let sites = &b.remap_sites;
    assert!(!sites.is_empty());
    assert!(
        sites.windows(2).all(|w| w[0].pages >= w[1].pages),
        "most pages first"
    );
    let top = &sites[0];
    assert_eq!(top.size, 32 << 20, "the weight casts remap most: {sites:?}");
    let compute = sites.iter().filter(|s| s.stream == top.stream).count();
    assert!(
        compute >= 3,
        "most sites are the compute stream's: {sites:?}"
    );
    for s in sites {
        assert!(s.allocations >= 1 && s.pages >= s.allocations);
        assert!(s.pages_second_half <= s.pages && s.first_event <= s.last_event);
    }
    // Every unmap of a replay comes from an allocation's slow path, and each call unmaps at
    // least one page.
    let pages: u64 = sites.iter().map(|s| s.pages).sum();
    let unmap_calls = b.driver_calls["cuMemUnmap"].as_u64().unwrap();
    assert!(
        pages >= unmap_calls && unmap_calls > 0,
        "{pages} pages, {unmap_calls} calls"
    );
    assert!(sites.iter().map(|s| s.allocations).sum::<u64>() <= b.allocs);
}

/// Freeing by address and stream, as PyTorch's hooks do, places and maps exactly as freeing
/// through the handles: the two-stream prefetch trace (a shared range, blocks used on the
/// other stream) gives the same memory and the same driver calls, by kind and by quarter,
/// either way.
#[test]
fn frees_by_address_replay_as_frees_by_handle() {
    let t = load("prefetch_mlp");
    let by_handle = replay(&t, PolicyKind::Stitched, &ReplayOptions::default(), None).unwrap();
    let opts = ReplayOptions {
        free_by_address: true,
        ..ReplayOptions::default()
    };
    let by_address = replay(&t, PolicyKind::Stitched, &opts, None).unwrap();
    assert_same_memory_and_calls(&by_address, &by_handle);
    assert_eq!(by_address.ooms, 0);
}

/// Two replays of one trace held the same memory and made the same driver calls, by kind and
/// by quarter (and did make some).
fn assert_same_memory_and_calls(a: &PolicyResult, b: &PolicyResult) {
    assert_eq!(a.peak_held_bytes, b.peak_held_bytes);
    assert_eq!(a.driver_calls, b.driver_calls);
    assert_eq!(a.calls_by_quarter, b.calls_by_quarter);
    assert!(b.driver_calls_total > 0, "the replay did something");
}

/// Writing other memory between the calls (`--cold-kib`, for measuring cache misses) changes
/// nothing the allocator does.
#[test]
fn a_cold_replay_places_as_a_warm_one() {
    let t = load("prefetch_mlp");
    let warm = replay(&t, PolicyKind::Stitched, &ReplayOptions::default(), None).unwrap();
    let opts = ReplayOptions {
        cold_bytes: 256 << 10,
        free_by_address: true,
        ..ReplayOptions::default()
    };
    let cold = replay(&t, PolicyKind::Stitched, &opts, None).unwrap();
    assert_same_memory_and_calls(&cold, &warm);
    assert_eq!(cold.allocs, warm.allocs);
}
