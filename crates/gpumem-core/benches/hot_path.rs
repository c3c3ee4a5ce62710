//! The engine's hot path on the simulated device: the single-thread operation sequences of
//! ANCHORS.md §2 (the anchor's own generator, `gpumem_core::bench_ops`), through the public
//! `Allocator` API, for each gpumem policy. One iteration is one pass over a sequence; the
//! throughput line gives operations (allocations and frees) per second.
//!
//! `cargo bench -p gpumem-core --bench hot_path`. After a warm pass the sequences make no
//! driver call except the stitched policy's remaps on the 512 B–64 MiB case, which the
//! simulated device makes free: on a GPU those cost time (`gpumem bench alloc` measures them).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use gpumem_core::backend::sim::{SimBackend, SimConfig};
use gpumem_core::bench_ops::{make_ops, Op, OpParams};
use gpumem_core::{Allocation, Allocator, Config, PolicyKind};

const MIB: u64 = 1 << 20;

fn pass(alloc: &Allocator, ops: &[Op], slots: &mut [Option<Allocation>]) {
    for op in ops {
        match *op {
            Op::Alloc { slot, size } => {
                slots[slot as usize] = Some(alloc.allocate(size, 0).expect("allocate"))
            }
            Op::Free { slot } => {
                if let Some(a) = slots[slot as usize].take() {
                    alloc.free_allocation(&a).expect("free");
                }
            }
        }
    }
}

fn hot_path(c: &mut Criterion) {
    // The anchor's cases, shortened to 20,000 allocations so that one pass takes milliseconds.
    let cases = [
        ("same_1MiB", 1, MIB, MIB + 1),
        ("random_512B_64MiB_live500", 500, 512, 64 * MIB),
        ("random_512B_1MiB_live2000", 2000, 512, MIB),
    ];
    for (name, max_live, min_size, max_size) in cases {
        let ops = make_ops(OpParams {
            n_allocs: 20_000,
            max_live,
            min_size,
            max_size,
            seed: 7,
        });
        let mut group = c.benchmark_group(name);
        group.throughput(Throughput::Elements(ops.len() as u64));
        for policy in [
            PolicyKind::Caching,
            PolicyKind::Stitched,
            PolicyKind::Buddy,
            PolicyKind::Native,
        ] {
            let (sim, _) = SimBackend::new(SimConfig::default());
            let cfg = Config::parse(&format!("policy:{}", policy.name())).expect("config");
            let alloc = Allocator::new(Box::new(sim), cfg).expect("allocator");
            let mut slots = vec![None; max_live as usize];
            pass(&alloc, &ops, &mut slots); // warm: segments and pages in place
            group.bench_with_input(
                BenchmarkId::from_parameter(policy.name()),
                &ops,
                |b, ops| b.iter(|| pass(&alloc, ops, &mut slots)),
            );
        }
        group.finish();
    }
}

criterion_group!(benches, hot_path);
criterion_main!(benches);
