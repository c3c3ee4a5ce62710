//! GPUs through NVML (libnvidia-ml, loaded at run time by nvml-wrapper: without an NVIDIA
//! driver this is an error that says so, not a crash).

use crate::source::{
    in_own_pid_namespace, process_name, DeviceSource, GpuSample, MonitorError, ProcSample,
    PID_NAMESPACE_NOTE,
};
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;
use std::collections::BTreeMap;
use std::ffi::OsStr;

/// Samples every GPU NVML sees.
pub struct NvmlSource {
    nvml: Nvml,
    describe: String,
}

fn explain(e: &NvmlError) -> String {
    match e {
        NvmlError::LibloadingError(_) | NvmlError::LibraryNotFound => format!(
            "the NVML library (libnvidia-ml.so.1) could not be loaded ({e}): this machine has \
             no NVIDIA driver, or the library is not on the loader's path"
        ),
        NvmlError::DriverNotLoaded => {
            "the NVIDIA driver is not loaded (is there a GPU on this machine?)".to_string()
        }
        NvmlError::NoPermission => {
            "no permission to talk to the NVIDIA driver (check /dev/nvidia* access)".to_string()
        }
        other => other.to_string(),
    }
}

impl NvmlSource {
    /// Loads NVML and checks that it sees at least one GPU.
    pub fn new() -> Result<Self, MonitorError> {
        // Driver installs ship libnvidia-ml.so.1; the unversioned name only comes with
        // development packages.
        let nvml = Nvml::builder()
            .lib_path(OsStr::new("libnvidia-ml.so.1"))
            .init()
            .or_else(|_| Nvml::init())
            .map_err(|e| MonitorError::NoGpu(explain(&e)))?;
        let count = nvml
            .device_count()
            .map_err(|e| MonitorError::NoGpu(explain(&e)))?;
        if count == 0 {
            return Err(MonitorError::NoGpu("NVML sees no GPU".into()));
        }
        let describe = format!(
            "NVML {}, driver {}, {count} GPU{}",
            nvml.sys_nvml_version().unwrap_or_else(|_| "?".into()),
            nvml.sys_driver_version().unwrap_or_else(|_| "?".into()),
            if count == 1 { "" } else { "s" }
        );
        Ok(Self { nvml, describe })
    }
}

impl DeviceSource for NvmlSource {
    fn sample(&mut self) -> Result<Vec<GpuSample>, MonitorError> {
        let q = |e: NvmlError| MonitorError::Query(explain(&e));
        let count = self.nvml.device_count().map_err(q)?;
        let mut out = Vec::with_capacity(count as usize);
        for index in 0..count {
            let d = self.nvml.device_by_index(index).map_err(q)?;
            let mem = d.memory_info().map_err(q)?;
            let util = d.utilization_rates().ok();
            // Compute and graphics contexts; a process with both is listed once, with the
            // larger figure.
            let mut procs: BTreeMap<u32, Option<u64>> = BTreeMap::new();
            let lists = [
                d.running_compute_processes(),
                d.running_graphics_processes(),
            ];
            for list in lists.into_iter().flatten() {
                for p in list {
                    let used = match p.used_gpu_memory {
                        UsedGpuMemory::Used(b) => Some(b),
                        UsedGpuMemory::Unavailable => None,
                    };
                    let e = procs.entry(p.pid).or_insert(None);
                    *e = (*e).max(used);
                }
            }
            out.push(GpuSample {
                index,
                name: d.name().unwrap_or_else(|_| "?".into()),
                uuid: d.uuid().unwrap_or_default(),
                used_bytes: mem.used,
                total_bytes: mem.total,
                util_gpu: util.as_ref().map(|u| u.gpu),
                util_mem: util.as_ref().map(|u| u.memory),
                processes: procs
                    .into_iter()
                    .map(|(pid, used_bytes)| ProcSample {
                        pid,
                        // The driver's pid: in a container with a PID namespace of its own it
                        // may be the host's, and the name read from our /proc then "?" or
                        // another process's (see `process_name`; noted once at start).
                        name: process_name(pid),
                        used_bytes,
                    })
                    .collect(),
            });
        }
        Ok(out)
    }

    fn describe(&self) -> String {
        self.describe.clone()
    }

    fn notes(&self) -> Vec<String> {
        if in_own_pid_namespace() == Some(true) {
            vec![PID_NAMESPACE_NOTE.to_string()]
        } else {
            Vec::new()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a GPU (CI, this development machine) the error says what is missing; with
    /// one, the GPUs are read.
    #[test]
    fn loads_or_says_why_not() {
        match NvmlSource::new() {
            Ok(mut s) => {
                let gpus = s.sample().unwrap();
                assert!(!gpus.is_empty());
                assert!(gpus
                    .iter()
                    .all(|g| g.total_bytes > 0 && g.used_bytes <= g.total_bytes));
            }
            Err(e) => {
                let m = e.to_string();
                assert!(m.contains("NVML"), "{m}");
                assert!(
                    m.contains("driver") || m.contains("no GPU") || m.contains("permission"),
                    "{m}"
                );
            }
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn reads_the_gpu() {
        let mut s = NvmlSource::new().expect("NVML on a GPU machine");
        let g = s.sample().unwrap();
        assert!(g[0].total_bytes > 1 << 30, "{g:?}");
        assert!(!g[0].name.is_empty());
        assert!(s.describe().contains("driver"));
    }
}
