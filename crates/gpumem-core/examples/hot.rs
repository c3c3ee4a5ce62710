use gpumem_core::backend::sim::{SimBackend, SimConfig};
use gpumem_core::{Allocator, Config, PolicyKind};
use std::time::Instant;
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn f(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}
fn ops(n: usize, live: usize, lo: u64, hi: u64, seed: u64) -> Vec<(i64, u64)> {
    let mut r = Rng(seed);
    let mut free: Vec<i64> = (0..live as i64).rev().collect();
    let mut lv: Vec<i64> = vec![];
    let mut out = vec![];
    let mut made = 0;
    let (l0, l1) = ((lo as f64).ln(), (hi as f64).ln());
    while made < n || !lv.is_empty() {
        if made < n && !free.is_empty() && (lv.is_empty() || r.f() < 0.5) {
            let s = free.pop().unwrap();
            out.push((s, (l0 + (l1 - l0) * r.f()).exp() as u64));
            lv.push(s);
            made += 1;
        } else {
            let k = ((r.f() * lv.len() as f64) as usize).min(lv.len() - 1);
            let s = lv.swap_remove(k);
            out.push((-s - 1, 0));
            free.push(s);
        }
    }
    out
}
fn main() {
    if std::env::args().nth(1).as_deref() == Some("mt") {
        for p in ["caching", "stitched"] {
            for t in [1, 2] {
                println!("{p} {t} threads: {:.1} ns/op aggregate", mt(p, t));
            }
        }
        return;
    }
    let cases = [
        ("same_1MiB", 200_000, 1, 1 << 20, (1 << 20) + 1),
        ("rand_512_64M_500", 100_000, 500, 512, 64 << 20),
        ("rand_512_1M_2000", 200_000, 2000, 512, 1 << 20),
    ];
    let args: Vec<String> = std::env::args().collect();
    for p in PolicyKind::ALL {
        if args.len() > 1 && args[1] != p.name() {
            continue;
        }
        for (name, n, live, lo, hi) in cases {
            if args.len() > 2 && args[2] != name {
                continue;
            }
            let o = ops(n, live, lo, hi, 7);
            let a = Allocator::new(
                Box::new(SimBackend::new(SimConfig::default()).0),
                Config::parse(&format!(
                    "policy:{},{}",
                    p.name(),
                    std::env::var("XCONF").unwrap_or_default()
                ))
                .unwrap(),
            )
            .unwrap();
            let mut slots = vec![None; live];
            let mut best = f64::MAX;
            for _ in 0..(if args.len() > 3 { 1 } else { 4 }) {
                let t = Instant::now();
                for &(v, sz) in &o {
                    if v >= 0 {
                        slots[v as usize] = Some(a.allocate(sz, 0).unwrap());
                    } else {
                        a.free_allocation(&slots[(-v - 1) as usize].take().unwrap())
                            .unwrap();
                    }
                }
                best = best.min(t.elapsed().as_nanos() as f64 / o.len() as f64);
            }
            let c = a.driver_calls();
            println!(
                "{:10} {:18} {:8.1} ns/op  calls {} est {:.3}s {:?}",
                p.name(),
                name,
                best,
                c.total(),
                c.est_seconds(),
                c.nonzero()
            );
        }
    }
}
#[allow(dead_code)]
pub fn mt(policy: &str, threads: usize) -> f64 {
    let a = std::sync::Arc::new(
        Allocator::new(
            Box::new(SimBackend::new(SimConfig::default()).0),
            Config::parse(&format!("policy:{policy}")).unwrap(),
        )
        .unwrap(),
    );
    let seqs: Vec<_> = (0..threads)
        .map(|t| ops(50_000, 200, 512, 1 << 20, 100 + t as u64))
        .collect();
    let total: usize = seqs.iter().map(|s| s.len()).sum();
    let barrier = std::sync::Barrier::new(threads);
    let spans: Vec<(Instant, Instant)> = std::thread::scope(|s| {
        let hs: Vec<_> = seqs
            .iter()
            .enumerate()
            .map(|(t, o)| {
                let a = a.clone();
                let barrier = &barrier;
                s.spawn(move || {
                    let stream = 0x1000 * (t as u64 + 1);
                    let mut slots = vec![None; 200];
                    barrier.wait();
                    let t0 = Instant::now();
                    for &(v, sz) in o {
                        if v >= 0 {
                            slots[v as usize] = Some(a.allocate(sz, stream).unwrap());
                        } else {
                            a.free_allocation(&slots[(-v - 1) as usize].take().unwrap())
                                .unwrap();
                        }
                    }
                    (t0, Instant::now())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let start = spans.iter().map(|s| s.0).min().unwrap();
    let end = spans.iter().map(|s| s.1).max().unwrap();
    (end - start).as_nanos() as f64 / total as f64
}
