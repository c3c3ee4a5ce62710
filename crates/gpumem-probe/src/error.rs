//! Why a probe could not run.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum ProbeError {
    /// libcuda could not be loaded: no NVIDIA driver on this machine.
    #[error("no CUDA driver: libcuda could not be loaded (is this a machine with an NVIDIA GPU and its driver?)")]
    NoDriver,
    /// The driver loaded but reports no usable device.
    #[error("no CUDA device {ordinal}: {detail}")]
    NoDevice { ordinal: usize, detail: String },
    #[error("NVRTC could not compile the probe kernels for {arch}: {log}")]
    Compile { arch: String, log: String },
    /// A driver call failed; `what` says which step.
    #[error("{what}: CUDA driver error {code}")]
    Driver { what: String, code: String },
    #[error("invalid probe options: {0}")]
    Options(String),
    #[error("internal error: {0}")]
    Internal(String),
}

impl ProbeError {
    pub(crate) fn driver(what: impl Into<String>, e: cudarc::driver::DriverError) -> Self {
        let code = match (e.error_name(), e.error_string()) {
            (Ok(n), Ok(s)) => format!("{} ({})", n.to_string_lossy(), s.to_string_lossy()),
            _ => format!("{:?}", e.0),
        };
        ProbeError::Driver {
            what: what.into(),
            code,
        }
    }
}

/// `result.ctx("what")` turns a driver error into a [`ProbeError`] that says which step failed.
pub(crate) trait DriverContext<T> {
    fn ctx(self, what: &str) -> Result<T, ProbeError>;
}

impl<T> DriverContext<T> for Result<T, cudarc::driver::DriverError> {
    fn ctx(self, what: &str) -> Result<T, ProbeError> {
        self.map_err(|e| ProbeError::driver(what, e))
    }
}
