//! How much of a timed run its thread spent on a CPU, by the kernel's own account (Linux): the
//! thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`), and the time it spent runnable but waiting
//! for a CPU (`/proc/thread-self/schedstat`, second field).
//!
//! Beside a run's wall time this says whether a slow run was the thread's own (it ran the
//! whole time) or time taken from it. The waiting share is another process of the machine on
//! the same CPU. What is neither running nor waiting is, on kernels that account for it
//! (paravirtual steal time), the hypervisor running something else on the virtual CPU.
//!
//! Why two sources: the schedstat file's first field (time run) is only brought up to date at
//! scheduling events and ticks, so a read by the running thread itself lags by up to a tick
//! (milliseconds, against runs of a few); the CPU-time clock brings it up to date when read.
//! The waiting time only grows while the thread is off its CPU, and is brought up to date when
//! the thread gets one back, so the thread's own read of it is current.

pub use imp::SchedStat;

#[cfg(target_os = "linux")]
mod imp {
    use std::fs::File;
    use std::os::unix::fs::FileExt;

    /// The calling thread's scheduler account, opened once so that each reading is a clock
    /// read and one read of a small buffer (microseconds, inside the timed run).
    pub struct SchedStat(File);

    impl SchedStat {
        /// Opens the calling thread's account; `None` where the kernel keeps none.
        pub fn open() -> Option<Self> {
            File::open("/proc/thread-self/schedstat").ok().map(Self)
        }

        /// (nanoseconds on a CPU, nanoseconds waiting for one) so far. Call it on the thread
        /// that opened it: both are that thread's.
        pub fn read(&self) -> Option<(u64, u64)> {
            let run = thread_cpu_ns()?;
            let mut buf = [0u8; 96];
            let n = self.0.read_at(&mut buf, 0).ok()?;
            let (_, wait) = super::parse(std::str::from_utf8(&buf[..n]).ok()?)?;
            Some((run, wait))
        }
    }

    /// The calling thread's CPU time, nanoseconds.
    fn thread_cpu_ns() -> Option<u64> {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `clock_gettime` writes one `timespec` through the pointer, which points to a
        // live, writable local of that type for the whole call; the clock id is the platform's
        // own constant, and the call keeps no pointer after it returns.
        let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        (rc == 0).then(|| ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    /// No scheduler account outside Linux: never opens.
    pub struct SchedStat;

    impl SchedStat {
        pub fn open() -> Option<Self> {
            None
        }

        pub fn read(&self) -> Option<(u64, u64)> {
            None
        }
    }
}

/// The first two numbers of a schedstat line ("run_ns wait_ns timeslices").
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
fn parse(line: &str) -> Option<(u64, u64)> {
    let mut f = line.split_ascii_whitespace().map(|x| x.parse::<u64>().ok());
    Some((f.next()??, f.next()??))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedstat_lines_parse() {
        assert_eq!(parse("104883 1231032 2\n"), Some((104883, 1231032)));
        assert_eq!(parse("104883\n"), None);
        assert_eq!(parse("x 1 2"), None);
        assert_eq!(parse(""), None);
    }

    /// A thread that spins for 50 ms ran for most of it, and its time on a CPU and waiting for
    /// one never add up to more than the wall time.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_busy_thread_runs_most_of_its_wall_time() {
        use std::time::Instant;
        let s = SchedStat::open().expect("Linux has /proc/thread-self/schedstat");
        let (run0, wait0) = s.read().unwrap();
        let t0 = Instant::now();
        while t0.elapsed().as_millis() < 50 {
            std::hint::spin_loop();
        }
        let (run1, wait1) = s.read().unwrap();
        let wall = t0.elapsed().as_nanos() as f64;
        let (run, wait) = ((run1 - run0) as f64, (wait1 - wait0) as f64);
        // A machine busy with other tests may hold the thread off its CPU for a while, but
        // not for most of 50 ms of spinning.
        assert!(run > 0.2 * wall && run <= wall, "ran {run} ns of {wall}");
        assert!(
            run + wait <= wall * 1.01,
            "ran {run} and waited {wait} ns of {wall}"
        );
    }
}
