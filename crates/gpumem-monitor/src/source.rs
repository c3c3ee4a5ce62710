//! Samples of GPU memory and where they come from.

use serde::Serialize;

/// Errors of the monitor.
#[derive(Debug, thiserror::Error)]
pub enum MonitorError {
    /// No way to read the GPUs (no driver, no NVML library, no permission).
    #[error("cannot read the GPUs through NVML: {0}")]
    NoGpu(String),
    /// A query failed while monitoring.
    #[error("NVML query failed: {0}")]
    Query(String),
    /// The metrics endpoint could not be served.
    #[error("metrics endpoint: {0}")]
    Endpoint(String),
    /// The options do not make sense (a message naming the flag and what would work).
    #[error("{0}")]
    Config(String),
    /// Writing the output failed.
    #[error("output: {0}")]
    Output(#[from] std::io::Error),
}

/// Memory a process uses on one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProcSample {
    /// Process id.
    pub pid: u32,
    /// Its name (`/proc/PID/comm`), or "?" when it cannot be read.
    pub name: String,
    /// Bytes of GPU memory it uses, when the driver says.
    pub used_bytes: Option<u64>,
}

/// One GPU at one moment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuSample {
    /// Index (as nvidia-smi numbers them).
    pub index: u32,
    /// Model name.
    pub name: String,
    /// UUID.
    pub uuid: String,
    /// Bytes used.
    pub used_bytes: u64,
    /// Bytes in total.
    pub total_bytes: u64,
    /// Percent of time a kernel ran over the last sample period.
    pub util_gpu: Option<u32>,
    /// Percent of time device memory was read or written.
    pub util_mem: Option<u32>,
    /// Processes using it.
    pub processes: Vec<ProcSample>,
}

/// Something that can sample the GPUs.
pub trait DeviceSource {
    /// The GPUs now.
    fn sample(&mut self) -> Result<Vec<GpuSample>, MonitorError>;

    /// What the source is ("NVML 12.580.82, driver 580.82"), for the header.
    fn describe(&self) -> String;

    /// Caveats about what the source reports, printed once to the log when a run starts
    /// (such as process names that may be wrong in a container).
    fn notes(&self) -> Vec<String> {
        Vec::new()
    }
}

/// The name of process `pid` from `/proc`, or "?".
///
/// `pid` must be a pid of this process's PID namespace for the name to be right. NVML gives
/// the pids the driver knows, and the driver is not aware of PID namespaces on every
/// version: in a container with a PID namespace of its own (no `--pid=host`) it may report
/// the host's pids. Such a pid is then either missing from this `/proc` (the name is "?") or
/// the pid of an unrelated process here, whose name is shown. Nothing in `/proc` can tell the
/// two apart from inside the container, so the monitor says so once when it starts (see
/// [`in_own_pid_namespace`]) rather than guess.
pub fn process_name(pid: u32) -> String {
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty());
    comm.unwrap_or_else(|| "?".to_string())
}

/// `readlink /proc/self/ns/pid` in the initial (host's) PID namespace: the kernel numbers it
/// `PROC_PID_INIT_INO`, 0xEFFFFFFC, the same on every Linux since 3.8.
const INITIAL_PID_NAMESPACE: &str = "pid:[4026531836]";

/// Whether this process runs in a PID namespace of its own (as in most containers), where
/// the pids NVML reports may be the host's; None when `/proc` does not say.
pub fn in_own_pid_namespace() -> Option<bool> {
    let link = std::fs::read_link("/proc/self/ns/pid").ok()?;
    Some(is_own_pid_namespace(&link.to_string_lossy()))
}

fn is_own_pid_namespace(link: &str) -> bool {
    link != INITIAL_PID_NAMESPACE
}

/// The note printed at the start of a run in a PID namespace of its own.
pub const PID_NAMESPACE_NOTE: &str = "this process runs in a PID namespace of its own (a \
    container?): NVML may report the host's pids, which this /proc does not have (name \
    \"?\") or has as another process (a wrong name); run the monitor in the host's PID \
    namespace (docker run --pid=host) for names you can trust";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_initial_pid_namespace_is_told_apart() {
        assert!(!is_own_pid_namespace("pid:[4026531836]"));
        assert!(is_own_pid_namespace("pid:[4026532449]"));
        // This process: whatever /proc says, the answer follows it.
        if let Ok(link) = std::fs::read_link("/proc/self/ns/pid") {
            assert_eq!(
                in_own_pid_namespace(),
                Some(link.to_string_lossy() != "pid:[4026531836]")
            );
        }
    }

    #[test]
    fn names_come_from_proc() {
        let me = process_name(std::process::id());
        let comm = std::fs::read_to_string("/proc/self/comm").unwrap();
        assert_eq!(me, comm.trim());
        // The kernel names a process after its executable, cut to 15 bytes: this test binary.
        let exe = std::env::current_exe().unwrap();
        let file = exe.file_name().unwrap().to_string_lossy();
        assert_eq!(me, file[..file.len().min(15)]);
        assert_eq!(process_name(u32::MAX), "?");
    }
}
