//! Host-side inputs and reference results, spread over the CPU cores: the probe checks
//! gigabytes of kernel output against the host, and that should take seconds, not minutes.

use rand::rngs::SmallRng;
use rand::SeedableRng;
use std::ops::Range;

/// Elements per independently seeded chunk: the data depends on the seed only, not on how
/// many threads produced it.
const CHUNK: usize = 1 << 20;

pub(crate) fn worker_count() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(1, 32)
}

/// Seed of chunk `k` of a stream seeded with `seed` (SplitMix64 finaliser, so neighbouring
/// chunks get unrelated generators).
fn chunk_seed(seed: u64, k: usize) -> u64 {
    let mut z = seed ^ (k as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Fills `dst` with `gen` drawn from generators seeded from `seed`, in parallel.
pub(crate) fn fill_random<T: Send>(
    dst: &mut [T],
    seed: u64,
    gen: impl Fn(&mut SmallRng) -> T + Sync,
) {
    let chunks_total = dst.len().div_ceil(CHUNK);
    let per_worker = chunks_total.div_ceil(worker_count()).max(1) * CHUNK;
    std::thread::scope(|s| {
        for (w, part) in dst.chunks_mut(per_worker).enumerate() {
            let gen = &gen;
            s.spawn(move || {
                for (c, chunk) in part.chunks_mut(CHUNK).enumerate() {
                    let k = w * (per_worker / CHUNK) + c;
                    let mut rng = SmallRng::seed_from_u64(chunk_seed(seed, k));
                    for x in chunk {
                        *x = gen(&mut rng);
                    }
                }
            });
        }
    });
}

/// Runs `f` over `0..n` split into one contiguous range per worker; results in range order.
pub(crate) fn par_ranges<R: Send>(n: usize, f: impl Fn(Range<usize>) -> R + Sync) -> Vec<R> {
    let per = n.div_ceil(worker_count()).max(1);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .step_by(per)
            .map(|lo| {
                let f = &f;
                s.spawn(move || f(lo..(lo + per).min(n)))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("host worker panicked"))
            .collect()
    })
}

/// Where `got` differs from `want` bit for bit: (count, first index).
pub(crate) fn mismatches_u32(
    got: &[u32],
    want: impl Fn(usize) -> u32 + Sync,
) -> (usize, Option<usize>) {
    let parts = par_ranges(got.len(), |r| {
        let mut count = 0usize;
        let mut first = None;
        for i in r {
            if got[i] != want(i) {
                count += 1;
                first.get_or_insert(i);
            }
        }
        (count, first)
    });
    let count = parts.iter().map(|p| p.0).sum();
    let first = parts.iter().find_map(|p| p.1);
    (count, first)
}

/// The sum each thread of a grid-stride kernel over `n4` float4 elements computes: element `i`
/// belongs to thread `i mod threads`. Values must be small integers so the sums are exact.
pub(crate) fn per_thread_sums(data: &[f32], n4: usize, threads: usize) -> Vec<u64> {
    let parts = par_ranges(n4, |r| {
        let mut sums = vec![0u64; threads];
        for i in r {
            let v = &data[4 * i..4 * i + 4];
            sums[i % threads] += v.iter().map(|&x| x as u64).sum::<u64>();
        }
        sums
    });
    let mut total = vec![0u64; threads];
    for p in parts {
        for (t, s) in total.iter_mut().zip(p) {
            *t += s;
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::RngExt;

    #[test]
    fn random_fill_depends_on_the_seed_only() {
        let mut a = vec![0u32; 3 * CHUNK + 17];
        let mut b = vec![0u32; 3 * CHUNK + 17];
        fill_random(&mut a, 7, |r| r.random());
        fill_random(&mut b, 7, |r| r.random());
        assert_eq!(a, b);
        fill_random(&mut b, 8, |r| r.random());
        assert_ne!(a, b);
        // Chunks are not copies of each other.
        assert_ne!(a[..64], a[CHUNK..CHUNK + 64]);
    }

    #[test]
    fn mismatches_are_counted_and_located() {
        let got: Vec<u32> = (0..1000).collect();
        assert_eq!(mismatches_u32(&got, |i| i as u32), (0, None));
        let (n, first) = mismatches_u32(&got, |i| if i % 100 == 42 { 0 } else { i as u32 });
        assert_eq!((n, first), (10, Some(42)));
    }

    #[test]
    fn per_thread_sums_follow_the_grid_stride_mapping() {
        // 6 float4 over 4 threads: thread 0 gets elements 0 and 4, thread 1 gets 1 and 5.
        let data: Vec<f32> = (0..24).map(|x| (x % 5) as f32).collect();
        let sums = per_thread_sums(&data, 6, 4);
        let hsum = |i: usize| data[4 * i..4 * i + 4].iter().sum::<f32>() as u64;
        assert_eq!(
            sums,
            vec![hsum(0) + hsum(4), hsum(1) + hsum(5), hsum(2), hsum(3)]
        );
    }
}
