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
}

/// The name of process `pid` from `/proc`, or "?".
pub fn process_name(pid: u32) -> String {
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty());
    comm.unwrap_or_else(|| "?".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

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
