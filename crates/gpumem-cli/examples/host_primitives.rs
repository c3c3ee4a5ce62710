//! What the host's CPU costs for the few primitives gpumem's hot path is made of, so that
//! allocation latencies measured on different machines can be compared: a dependent integer
//! chain (clock speed), an uncontended lock and unlock (one atomic compare-exchange and a plain
//! store, as gpumem's shard lock), a hash-map remove and insert with 2,048 live keys (as the
//! live-block maps), and a pointer chase through 32 KiB, 1 MiB and 64 MiB (cache and memory
//! latency). Three rounds, one line each.
//!
//!     cargo build --release -p gpumem-cli --example host_primitives
//!     target/release/examples/host_primitives

use rustc_hash::FxHashMap;
use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// Nanoseconds per iteration of `f`, which runs `n` iterations.
fn ns_per(n: u64, f: impl FnOnce()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_nanos() as f64 / n as f64
}

/// xorshift64: cheap, deterministic pseudo-random numbers.
fn next(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

fn main() {
    let n = 20_000_000u64;
    let mut s = 88_172_645_463_325_252u64;
    for round in 0..3 {
        let chain = ns_per(n, || {
            let mut x = 1u64;
            for _ in 0..n {
                x = black_box(x ^ (x << 13));
                x ^= x >> 7;
                x ^= x << 17;
            }
            black_box(x);
        });
        let flag = AtomicBool::new(false);
        let lock = ns_per(n, || {
            for _ in 0..n {
                while flag
                    .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
                    .is_err()
                {}
                black_box(&flag);
                flag.store(false, Ordering::Release);
            }
        });
        let mut map: FxHashMap<u64, [u64; 3]> = FxHashMap::default();
        let mut keys = vec![0u64; 2048];
        for k in keys.iter_mut() {
            *k = next(&mut s) & !511;
            map.insert(*k, [1, 2, 3]);
        }
        let hn = n / 4;
        // One remove and one insert per iteration: two operations.
        let hash = ns_per(2 * hn, || {
            for i in 0..hn {
                let r = next(&mut s);
                let j = r as usize & 2047;
                map.remove(&keys[j]);
                keys[j] = r & !511;
                map.insert(keys[j], [i, 2, 3]);
            }
        });
        let mut chase = Vec::new();
        for kib in [32usize, 1024, 65536] {
            // One 8-byte word per 64-byte line, visited in a random cycle.
            let words = kib * 1024 / 8;
            let mut order: Vec<usize> = (0..words).step_by(8).collect();
            for i in (1..order.len()).rev() {
                order.swap(i, next(&mut s) as usize % (i + 1));
            }
            let mut link = vec![0usize; words];
            for w in 0..order.len() {
                link[order[w]] = order[(w + 1) % order.len()];
            }
            let steps = 5_000_000u64;
            let mut p = order[0];
            chase.push(ns_per(steps, || {
                for _ in 0..steps {
                    p = link[p];
                }
                black_box(p);
            }));
        }
        println!(
            "round {round}: chain {chain:.2} ns/step, lock+unlock {lock:.2} ns, hash remove or insert \
             {hash:.2} ns, chase 32 KiB {:.2} / 1 MiB {:.2} / 64 MiB {:.2} ns",
            chase[0], chase[1], chase[2]
        );
    }
}
