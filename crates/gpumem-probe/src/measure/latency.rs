//! Pointer-chase latency per level: one thread walks a random cyclic permutation of lines, each
//! load's address being the previous load's value, so loads cannot overlap. clock64 and
//! %globaltimer read around the timed chain give cycles and nanoseconds per load, and their
//! ratio the SM clock the chase really ran at.

use super::{download, Session};
use crate::error::{DriverContext, ProbeError};
use crate::report::Latency;
use crate::stats::Stats;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

/// Which kernel walks the chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Walker {
    /// Chain copied into shared memory.
    Shared,
    /// Default global loads (cached in L1).
    L1,
    /// ld.global.cg (L2 only).
    L2Only,
}

/// How the cycle visits the lines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Order {
    /// A uniformly random cyclic permutation of all lines.
    Random,
    /// Pages of `page` bytes in random order; within each page, its lines in random order. Each
    /// line is still visited once per cycle, but consecutive loads stay in one page, so the
    /// walk misses the TLB once per page instead of (almost) every load.
    PageLocal { page: u64 },
}

pub(crate) struct ChaseSpec {
    pub level: &'static str,
    pub set_bytes: u64,
    pub stride_bytes: u64,
    pub order: Order,
    pub walker: Walker,
    pub steps: u32,
    pub warm: u32,
    pub repeats: usize,
    pub residency: Residency,
}

/// Where the lines of the set are when a timed walk reaches them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Residency {
    /// Every launch repeats the same walk after `warm` steps: the walker has read each timed
    /// line before, so it answers from the closest copy (L1, or the L2 partition near the SM).
    Warm,
    /// Before every launch L2 is flushed and the whole set is copied in again (a device-to-
    /// device copy from a pristine copy, writing whole lines), so every line sits in L2 where
    /// the copy left it; the walk starts on lines no walk has read yet. This is the anchor's
    /// situation (anchors/hier.py uploads the set, then times lines its warm-up never
    /// reached): a first read from one SM, served by either L2 partition. (Rewriting only the
    /// chain's words with a kernel is not the same: a line holding one freshly written word
    /// is read back at HBM latency, 650 cycles on an H200.)
    Written,
    /// The set is larger than the walk: every launch starts where the previous one's walk
    /// cannot have reached, and L2 is flushed first, so no timed load finds its line cached.
    Cold,
}

/// successor[line] = next line of one cycle through all `n` lines in the given order.
pub(crate) fn successor_cycle(n: usize, line_bytes: u64, order: Order, seed: u64) -> Vec<u32> {
    assert!(n > 0 && n <= u32::MAX as usize);
    let mut rng = SmallRng::seed_from_u64(seed);
    let visit: Vec<u32> = match order {
        Order::Random => {
            let mut v: Vec<u32> = (0..n as u32).collect();
            v.shuffle(&mut rng);
            v
        }
        Order::PageLocal { page } => {
            let per_page = ((page / line_bytes) as usize).clamp(1, n);
            let pages = n.div_ceil(per_page);
            let mut page_order: Vec<usize> = (0..pages).collect();
            page_order.shuffle(&mut rng);
            let mut v = Vec::with_capacity(n);
            for p in page_order {
                let lo = p * per_page;
                let hi = (lo + per_page).min(n);
                let start = v.len();
                v.extend(lo as u32..hi as u32);
                v[start..].shuffle(&mut rng);
            }
            v
        }
    };
    let mut next = vec![0u32; n];
    for i in 0..n {
        next[visit[i] as usize] = visit[(i + 1) % n];
    }
    next
}

/// The line reached after `steps` steps from `start`.
pub(crate) fn walk(next: &[u32], start: u32, steps: u64) -> u32 {
    let mut j = start;
    for _ in 0..steps {
        j = next[j as usize];
    }
    j
}

pub(crate) fn measure(s: &mut Session, spec: &ChaseSpec) -> Result<Latency, ProbeError> {
    let n_lines = (spec.set_bytes / spec.stride_bytes) as usize;
    let stride_words = (spec.stride_bytes / 4) as u32;
    let words = n_lines * stride_words as usize;
    if n_lines < 2 || words > u32::MAX as usize {
        return Err(ProbeError::Options(format!(
            "chase set of {} bytes at stride {} is out of range",
            spec.set_bytes, spec.stride_bytes
        )));
    }
    let seed = s.seed();
    let next = successor_cycle(n_lines, spec.stride_bytes, spec.order, seed);

    // Lay the chain out on the device: upload the compact successor list, expand it.
    let mut chain: CudaSlice<u32> = s.alloc(words, "the pointer-chase set")?;
    {
        let next_dev = s.gpu.stream.clone_htod(&next).ctx("upload the chain")?;
        let f = s.gpu.func("chase_build")?;
        let n = n_lines as u64;
        let cfg = LaunchConfig {
            grid_dim: (s.gpu.sm_count * 8, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = s.gpu.stream.launch_builder(&f);
        b.arg(&mut chain).arg(&next_dev).arg(&n).arg(&stride_words);
        // SAFETY: chase_build(u32* a, const u32* next, u64 n, u32 stride) writes
        // a[i * stride] for i < n (< words, the length of `chain`) and reads next[0..n).
        unsafe { b.launch(cfg) }.ctx("launch chase_build")?;
        s.gpu.sync()?;
    }
    // The pristine copy the Written walks copy the set back from.
    let pristine: Option<CudaSlice<u32>> = if spec.residency == Residency::Written {
        let mut p: CudaSlice<u32> = s.alloc(words, "the pristine chase set")?;
        s.gpu
            .stream
            .memcpy_dtod(&chain, &mut p)
            .ctx("copy the chase set")?;
        Some(p)
    } else {
        None
    };
    let fresh_lines = spec.residency != Residency::Warm;
    let per_launch = u64::from(spec.warm) + u64::from(spec.steps);
    if fresh_lines && spec.repeats as u64 * per_launch > n_lines as u64 {
        return Err(ProbeError::Options(format!(
            "{}: {} launches of {per_launch} steps revisit lines of a {n_lines}-line set",
            spec.level, spec.repeats
        )));
    }
    let flush_len = if fresh_lines {
        let l2 = s
            .gpu
            .attr(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?;
        (4 * l2.max(1 << 20)) as usize
    } else {
        0
    };
    let mut flush: Option<CudaSlice<u8>> = if fresh_lines {
        Some(s.alloc(flush_len, "the L2 flush buffer")?)
    } else {
        None
    };

    let (kernel, load) = match spec.walker {
        Walker::Shared => ("chase_smem", "ld.shared.u32"),
        Walker::L1 => ("chase_l1", "ld.global.u32 (cached in L1)"),
        Walker::L2Only => ("chase_cg", "ld.global.cg.u32 (L2 only)"),
    };
    let f = s.gpu.func(kernel)?;
    let mut out: CudaSlice<u64> = s.alloc(3, "the chase result")?;
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1, 1, 1),
        shared_mem_bytes: if spec.walker == Walker::Shared {
            (words * 4) as u32
        } else {
            0
        },
    };

    let mut cycles = Vec::new();
    let mut ns = Vec::new();
    let mut clocks = Vec::new();
    let mut verified = true;
    for r in 0..spec.repeats {
        // Cold and written walks start on fresh lines of the cycle; warm ones repeat one walk.
        let start_line = if fresh_lines {
            walk(&next, 0, r as u64 * per_launch)
        } else {
            0
        };
        if let Some(buf) = flush.as_mut() {
            s.gpu.stream.memset_zeros(buf).ctx("flush L2")?;
        }
        if let Some(p) = pristine.as_ref() {
            s.gpu
                .stream
                .memcpy_dtod(p, &mut chain)
                .ctx("copy the chase set back")?;
        }
        {
            // SAFETY: poisoning the three u64 results through a view of six u32.
            let mut o = unsafe { out.transmute_mut::<u32>(6) }
                .ok_or_else(|| ProbeError::Internal("view the chase result as u32".into()))?;
            s.poison(&mut o)?;
        }
        let start = start_line * stride_words;
        let mut b = s.gpu.stream.launch_builder(&f);
        b.arg(&chain);
        let n_words = words as u32;
        if spec.walker == Walker::Shared {
            b.arg(&n_words);
        }
        b.arg(&start).arg(&spec.warm).arg(&spec.steps).arg(&mut out);
        // SAFETY: the chase kernels read a[j] for j on the cycle (all < words, the length of
        // `chain`; the shared variant copies `words` words into `words * 4` bytes of dynamic
        // shared memory) and write out[0..3).
        unsafe { b.launch(cfg) }.ctx(&format!("launch {kernel}"))?;
        let res = download(&s.gpu.stream, &out, &format!("run {kernel}"))?;
        let want = walk(&next, start_line, per_launch) * stride_words;
        let ok = res[2] == u64::from(want);
        verified &= s.check(
            &format!("{} pointer chase", spec.level),
            (!ok).then(|| format!("ended on word {}, the host walk on {want}", res[2])),
        );
        if res[1] == 0 {
            return Err(ProbeError::Internal(format!(
                "{kernel}: the global timer did not advance over {} loads",
                spec.steps
            )));
        }
        cycles.push(res[0] as f64 / f64::from(spec.steps));
        ns.push(res[1] as f64 / f64::from(spec.steps));
        clocks.push(res[0] as f64 / res[1] as f64 * 1e9);
    }
    let order = match spec.order {
        Order::Random => "random cyclic permutation of the lines".to_string(),
        Order::PageLocal { page } => format!(
            "random within each {} page, pages in random order",
            crate::render::fmt_bytes(page)
        ),
    };
    let none = || ProbeError::Internal("no chase results".into());
    Ok(Latency {
        level: spec.level.to_string(),
        set_bytes: spec.set_bytes,
        stride_bytes: spec.stride_bytes,
        order,
        load: load.to_string(),
        steps: spec.steps,
        warm_steps: spec.warm,
        cycles: Stats::of(&cycles).ok_or_else(none)?,
        ns: Stats::of(&ns).ok_or_else(none)?,
        sm_clock_hz: Stats::of(&clocks).ok_or_else(none)?.median,
        verified,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn is_one_cycle(next: &[u32]) -> bool {
        let mut seen = vec![false; next.len()];
        let mut j = 0u32;
        for _ in 0..next.len() {
            if seen[j as usize] {
                return false;
            }
            seen[j as usize] = true;
            j = next[j as usize];
        }
        j == 0 && seen.iter().all(|&x| x)
    }

    #[test]
    fn random_order_is_one_cycle_through_every_line() {
        let next = successor_cycle(4096, 128, Order::Random, 1);
        assert!(is_one_cycle(&next));
        // Random: far from the identity shift.
        let sequential = next
            .iter()
            .enumerate()
            .filter(|(i, &n)| n as usize == i + 1)
            .count();
        assert!(sequential < 16, "{sequential} sequential successors");
        assert_eq!(walk(&next, 0, 4096), 0);
    }

    #[test]
    fn page_local_order_finishes_each_page_before_the_next() {
        // 64 lines of 128 B per 8 KiB page, 16 pages.
        let next = successor_cycle(1024, 128, Order::PageLocal { page: 8192 }, 2);
        assert!(is_one_cycle(&next));
        let page_changes = (0..1024)
            .scan(0u32, |j, _| {
                let from = *j / 64;
                *j = next[*j as usize];
                Some((from != *j / 64) as u32)
            })
            .sum::<u32>();
        assert_eq!(page_changes, 16, "one page change per page per cycle");
    }
}
