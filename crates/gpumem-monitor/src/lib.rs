//! `gpumem monitor`: GPU memory per device and per process, read through NVML every interval
//! (like `nvidia-smi -l 1`), with an alarm when a process's memory grows steadily (a leak).
//!
//! - [`source`]: where samples come from: the [`DeviceSource`] trait, NVML ([`nvml`]) and a
//!   scripted fake for tests ([`fake`]).
//! - [`detect`]: the growth detector (per-process baseline, robust slope, evenness test).
//! - [`render`]: the table and the JSON lines.
//! - [`prom`]: the Prometheus text endpoint.
//! - [`run`](mod@run): the loop that ties them together and stops cleanly when asked.

pub mod detect;
pub mod fake;
pub mod nvml;
pub mod prom;
pub mod render;
pub mod run;
pub mod source;

pub use detect::{Alarm, DetectorConfig, GrowthDetector};
pub use run::{run, Clock, ManualClock, MonitorOptions, Output, RealClock, RunSummary, Stopped};

pub use source::{DeviceSource, GpuSample, MonitorError, ProcSample};
