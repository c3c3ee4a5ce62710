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
    let cases = [
        ("same_1MiB", 200_000, 1, 1 << 20, (1 << 20) + 1),
        ("rand_512_64M_500", 100_000, 500, 512, 64 << 20),
        ("rand_512_1M_2000", 200_000, 2000, 512, 1 << 20),
    ];
    for p in PolicyKind::ALL {
        for (name, n, live, lo, hi) in cases {
            let o = ops(n, live, lo, hi, 7);
            let a = Allocator::new(
                Box::new(SimBackend::new(SimConfig::default()).0),
                Config::parse(&format!("policy:{}", p.name())).unwrap(),
            )
            .unwrap();
            let mut slots = vec![None; live];
            let mut best = f64::MAX;
            for _ in 0..4 {
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
            println!("{:10} {:18} {:8.1} ns/op", p.name(), name, best);
        }
    }
}
