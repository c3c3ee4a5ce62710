//! The allocators behind PyTorch: one [`Allocator`] per device, created on the first request
//! for that device and kept for the life of the process, and the counters of misuse (frees of
//! pointers gpumem never handed out, double frees) that the C entry points report instead of
//! crashing.
//!
//! The process has one [`Registry`] ([`global`]), shared by the C functions PyTorch calls and
//! by the Python module, which live in the same shared library.

use gpumem_core::backend::sim::{EventMode, SimBackend, SimConfig, SimControl};
use gpumem_core::backend::{Backend, DevPtr, Stream};
use gpumem_core::engine::PoolId;
use gpumem_core::units::H200_TOTAL_BYTES;
use gpumem_core::{AllocError, Allocator, Config, MemoryStats, PoolCheckpoint, PoolRestore};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, OnceLock};

/// Most CUDA devices one process may use through gpumem.
pub const MAX_DEVICES: usize = 64;

/// Where the devices' memory comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum Source {
    /// The CUDA driver (gpumem-cuda), device by ordinal.
    Cuda,
    /// Simulated devices (tests and CI): `devices` of `total_bytes` each.
    Sim {
        /// Number of devices.
        devices: u32,
        /// Memory of each.
        total_bytes: u64,
        /// Events complete only when told ([`Registry::sim_complete_events`]).
        manual_events: bool,
    },
}

/// An allocation failure as PyTorch must see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TorchError {
    /// No memory for the request: surfaces as `torch.cuda.OutOfMemoryError`.
    OutOfMemory(String),
    /// Anything else (no driver, bad device, ...): surfaces as `RuntimeError`.
    Other(String),
}

impl TorchError {
    /// The message shown to the user.
    pub fn message(&self) -> &str {
        match self {
            TorchError::OutOfMemory(m) | TorchError::Other(m) => m,
        }
    }
}

/// What became of a free.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FreeOutcome {
    /// The block was returned to its pool (or will be, after other streams' events); its
    /// bytes as handed out (the request rounded up).
    Freed(u64),
    /// A null pointer (what a zero-byte allocation returns): nothing to do.
    Null,
    /// Not a pointer gpumem handed out on that device: reported and ignored.
    Foreign,
    /// Already freed: reported and ignored.
    DoubleFree,
    /// The device refused (a driver error): reported.
    Failed,
}

/// Counts of everything reported instead of raised.
#[derive(Debug, Default)]
pub struct Counters {
    /// Frees of pointers that gpumem did not hand out.
    pub foreign_frees: AtomicU64,
    /// Frees of blocks already freed.
    pub double_frees: AtomicU64,
    /// Frees the device refused.
    pub free_errors: AtomicU64,
    /// `record_stream` on memory that is not gpumem's (ignored, as PyTorch's allocator does).
    pub record_stream_foreign: AtomicU64,
    /// Other failures of `record_stream` and `empty_cache`.
    pub other_errors: AtomicU64,
    /// Frees naming another device than the one the block came from (freed there).
    pub wrong_device_frees: AtomicU64,
    /// Whether each kind of report (indexed by the `WARN_*` constants) was printed already.
    warned: [AtomicBool; 5],
}

/// PyTorch's calls into gpumem that [`HookClock`] times.
#[derive(Clone, Copy, Debug)]
pub enum Hook {
    /// The allocation hook (`gpumem_torch_alloc`).
    Alloc = 0,
    /// The free hook (`gpumem_torch_free`).
    Free = 1,
    /// `Tensor.record_stream` (`gpumem_torch_record_stream`).
    RecordStream = 2,
}

impl Hook {
    /// Every hook, in index order.
    pub const ALL: [Hook; 3] = [Hook::Alloc, Hook::Free, Hook::RecordStream];

    /// The name `gpumem.torch.hook_time()` reports it under.
    pub fn name(self) -> &'static str {
        match self {
            Hook::Alloc => "alloc",
            Hook::Free => "free",
            Hook::RecordStream => "record_stream",
        }
    }
}

/// Host time spent inside PyTorch's calls into gpumem (allocation, free, record_stream), driver
/// calls included, once switched on: what gpumem adds to a step's host work, measured in the
/// step itself. Off by default, since reading the clock twice per call costs tens of ns.
#[derive(Debug, Default)]
pub struct HookClock {
    on: AtomicBool,
    calls: [AtomicU64; Hook::ALL.len()],
    nanos: [AtomicU64; Hook::ALL.len()],
}

impl HookClock {
    /// Switches the clock on or off; the totals are kept either way.
    pub fn set(&self, on: bool) {
        self.on.store(on, Ordering::Relaxed);
    }

    /// The start of a timed call, if the clock is on.
    #[inline]
    pub fn start(&self) -> Option<std::time::Instant> {
        self.on
            .load(Ordering::Relaxed)
            .then(std::time::Instant::now)
    }

    /// Adds the call started at `start` (nothing if the clock was off then).
    #[inline]
    pub fn stop(&self, hook: Hook, start: Option<std::time::Instant>) {
        if let Some(t) = start {
            let ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
            self.calls[hook as usize].fetch_add(1, Ordering::Relaxed);
            self.nanos[hook as usize].fetch_add(ns, Ordering::Relaxed);
        }
    }

    /// (hook, calls timed, nanoseconds inside them) of every hook since the process started.
    pub fn snapshot(&self) -> Vec<(Hook, u64, u64)> {
        Hook::ALL
            .iter()
            .map(|&h| {
                (
                    h,
                    self.calls[h as usize].load(Ordering::Relaxed),
                    self.nanos[h as usize].load(Ordering::Relaxed),
                )
            })
            .collect()
    }
}

/// Writes a line to stderr, ignoring a failure to write (`eprintln!` panics when stderr is a
/// closed pipe, and these lines are written from PyTorch's hooks, where a panic outside
/// `catch_unwind` would abort the process).
pub(crate) fn warn(line: std::fmt::Arguments) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

const WARN_FOREIGN: usize = 0;
const WARN_DOUBLE_FREE: usize = 1;
const WARN_FREE_ERROR: usize = 2;
const WARN_OTHER: usize = 3;
const WARN_WRONG_DEVICE: usize = 4;

impl Counters {
    /// Counts one event in `counter`; prints `message` the first time a `kind` is reported.
    fn count(&self, kind: usize, counter: &AtomicU64, message: impl FnOnce() -> String) {
        counter.fetch_add(1, Ordering::Relaxed);
        if !self.warned[kind].swap(true, Ordering::Relaxed) {
            // Once per kind: a program freeing foreign pointers in a loop must not flood stderr.
            warn(format_args!(
                "gpumem: warning: {} (later occurrences are only counted: gpumem.torch.error_counts())",
                message()
            ));
        }
    }

    /// (name, value) of every counter.
    pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("foreign_frees", self.foreign_frees.load(Ordering::Relaxed)),
            ("double_frees", self.double_frees.load(Ordering::Relaxed)),
            ("free_errors", self.free_errors.load(Ordering::Relaxed)),
            (
                "record_stream_foreign",
                self.record_stream_foreign.load(Ordering::Relaxed),
            ),
            ("other_errors", self.other_errors.load(Ordering::Relaxed)),
            (
                "wrong_device_frees",
                self.wrong_device_frees.load(Ordering::Relaxed),
            ),
        ]
    }
}

/// One device's allocator.
pub struct DeviceSlot {
    /// The allocator.
    pub alloc: Arc<Allocator>,
    /// The event control of a simulated device.
    pub sim: Option<SimControl>,
}

struct Setup {
    /// The configuration text (`policy:stitched,...`), once fixed.
    conf_text: Option<String>,
    config: Option<Config>,
    source: Source,
    /// Allocation history asked for with [`Registry::record_history`], applied on top of the
    /// configuration when the allocators are created.
    history: Option<HistoryRequest>,
    /// Whether any allocator exists (configuration is frozen from then on).
    created: bool,
    /// Memory fractions set for devices that have no allocator yet (applied when it is
    /// created, so that setting one does not fix the configuration before `install()`).
    fractions: Vec<(usize, f64)>,
}

/// Caps what `alloc` holds at `fraction` of its device (0 allows nothing).
fn apply_fraction(alloc: &Allocator, fraction: f64) -> Result<(), TorchError> {
    if fraction == 0.0 {
        alloc.set_cap(Some(0));
        Ok(())
    } else {
        alloc
            .set_memory_fraction(fraction)
            .map_err(|e| TorchError::Other(format!("gpumem: {e}")))
    }
}

/// Why [`Registry::configure`] refused a configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigureError {
    /// Not a valid configuration (Python: `ValueError`).
    Invalid(String),
    /// Valid, but allocators already serve with another one (Python: `GpumemError`).
    Conflict(String),
}

impl std::fmt::Display for ConfigureError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConfigureError::Invalid(m) | ConfigureError::Conflict(m) => f.write_str(m),
        }
    }
}

/// `config` with the history of `req`, if any, in place of its own.
fn with_history(mut config: Config, req: Option<HistoryRequest>) -> Config {
    if let Some(h) = req {
        config.history = h.entries;
        // One flag serves history and leak tracking: stacks asked for by either are kept.
        config.backtraces |= h.backtraces;
    }
    config
}

/// The allocation history asked for from Python (`gpumem.torch.record_memory_history`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HistoryRequest {
    /// Entries of the ring buffer (0: no history).
    pub entries: usize,
    /// A backtrace at each allocation.
    pub backtraces: bool,
}

/// Why a history request could not be met.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HistoryError {
    /// The request asked to stop recording (callers may only warn: nothing is lost).
    pub turning_off: bool,
    /// What happened and what to do instead.
    pub message: String,
}

/// The configuration text parsed, with `GPUMEM_LEAK_CHECK` applied on top of it (as
/// [`Config::from_env`] does).
pub(crate) fn parse_conf(text: &str) -> Result<Config, AllocError> {
    Config::from_vars(
        Some(text),
        std::env::var("GPUMEM_LEAK_CHECK").ok().as_deref(),
    )
}

/// `GPUMEM_CONF`'s text and configuration, for allocators made without `install()`; the error
/// names the variable.
fn env_conf() -> Result<(String, Config), TorchError> {
    let text = std::env::var("GPUMEM_CONF").unwrap_or_default();
    let config =
        parse_conf(&text).map_err(|e| TorchError::Other(format!("gpumem: GPUMEM_CONF: {e}")))?;
    Ok((text, config))
}

/// c10's calls on a private pool (CUDA graphs, MemPools): see the engine's methods of the same
/// names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolOp {
    /// `beginAllocateToPool`: a capture starts filling it ([`Allocator::begin_pool`]).
    Begin,
    /// `createOrIncrefPool`: a MemPool takes it ([`Allocator::retain_pool`]).
    Retain,
    /// `endAllocateToPool`: the capture ended ([`Allocator::end_pool`]).
    End,
    /// `releasePool`: a graph or MemPool let go of it ([`Allocator::release_pool`]).
    Release,
}

/// The per-device allocators of the process.
pub struct Registry {
    slots: Box<[OnceLock<DeviceSlot>]>,
    setup: Mutex<Setup>,
    /// Misuse and failures reported instead of raised.
    pub counters: Counters,
    /// Host time inside the hooks, when switched on.
    pub clock: HookClock,
}

static GLOBAL: LazyLock<Registry> = LazyLock::new(|| Registry::new(Source::Cuda));

/// The registry PyTorch's calls and the Python module share.
pub fn global() -> &'static Registry {
    &GLOBAL
}

/// `device` as an index of the registry's devices, or the error for one that cannot be.
pub(crate) fn device_index(device: i32) -> Result<usize, TorchError> {
    usize::try_from(device)
        .ok()
        .filter(|&d| d < MAX_DEVICES)
        .ok_or_else(|| {
            TorchError::Other(format!(
                "gpumem: invalid CUDA device index {device} (expected 0..{MAX_DEVICES})"
            ))
        })
}

impl Registry {
    /// An empty registry drawing memory from `source`.
    pub fn new(source: Source) -> Self {
        Self {
            slots: (0..MAX_DEVICES).map(|_| OnceLock::new()).collect(),
            setup: Mutex::new(Setup {
                conf_text: None,
                config: None,
                source,
                history: None,
                fractions: Vec::new(),
                created: false,
            }),
            counters: Counters::default(),
            clock: HookClock::default(),
        }
    }

    /// Fixes the configuration: `conf`, or `GPUMEM_CONF` when `None`, or the defaults
    /// (`GPUMEM_LEAK_CHECK=1` adds leak tracking with backtraces). Once an allocator exists
    /// only the same configuration is accepted.
    pub fn configure(&self, conf: Option<&str>) -> Result<String, ConfigureError> {
        let text = match conf {
            Some(c) => c.to_string(),
            None => std::env::var("GPUMEM_CONF").unwrap_or_default(),
        };
        let config = parse_conf(&text)
            .map_err(|e| ConfigureError::Invalid(format!("gpumem configuration: {e}")))?;
        let mut setup = self.setup.lock();
        if setup.created && setup.conf_text.as_deref() != Some(text.as_str()) {
            return Err(ConfigureError::Conflict(format!(
                "gpumem is already serving allocations with configuration '{}'; it cannot change \
                 to '{text}' in this process",
                setup.conf_text.as_deref().unwrap_or("")
            )));
        }
        setup.conf_text = Some(text.clone());
        setup.config = Some(config);
        Ok(text)
    }

    /// The configuration text in force (after [`Registry::configure`] or the first allocator).
    pub fn conf_text(&self) -> Option<String> {
        self.setup.lock().conf_text.clone()
    }

    /// Records the allocation history (`entries` events, 0 for none), with a backtrace at each
    /// allocation when `backtraces`. The engine reads these settings when it creates an
    /// allocator, so they take effect only before the first allocation; afterwards a request
    /// that matches what is in force is accepted and any other is an error.
    pub fn record_history(&self, req: HistoryRequest) -> Result<(), HistoryError> {
        let mut setup = self.setup.lock();
        if !setup.created {
            setup.history = Some(req);
            return Ok(());
        }
        let Some(config) = self.first_slot().map(|s| s.alloc.config()) else {
            setup.history = Some(req);
            return Ok(());
        };
        let (entries, backtraces) = (config.history, config.backtraces);
        if req.entries == entries && (backtraces || !req.backtraces) {
            return Ok(());
        }
        let now = if entries == 0 {
            "records no history".to_string()
        } else {
            format!(
                "records the last {entries} events {} stack traces",
                if backtraces { "with" } else { "without" }
            )
        };
        Err(HistoryError {
            turning_off: req.entries == 0,
            message: format!(
                "gpumem already serves allocations and {now}: the history is set when gpumem \
                 creates its allocator for a device, before the first CUDA allocation. Call \
                 gpumem.torch.record_memory_history() before any tensor is created on the GPU, \
                 or set GPUMEM_CONF=history:N,backtraces:1 (or install(conf=...))"
            ),
        })
    }

    /// The configuration the allocators have, or will have when created; the error the first
    /// allocation would raise when `GPUMEM_CONF` is not a configuration (rather than the
    /// defaults, which no allocator would have).
    pub fn effective_config(&self) -> Result<Config, TorchError> {
        if let Some(s) = self.first_slot() {
            return Ok(s.alloc.config().clone());
        }
        let setup = self.setup.lock();
        let config = match setup.config.clone() {
            Some(c) => c,
            None => env_conf()?.1,
        };
        Ok(with_history(config, setup.history))
    }

    /// How many devices there are to serve: the simulated ones, or the CUDA driver's count.
    /// `None` where it is not known without initialising CUDA: before gpumem made its first
    /// allocator (a statistics call must not initialise CUDA in a process that may still fork,
    /// as PyTorch's do not), or on a machine with no driver.
    pub fn devices_present(&self) -> Option<usize> {
        match &self.setup.lock().source {
            Source::Sim { devices, .. } => Some(*devices as usize),
            Source::Cuda => self
                .first_slot()
                .and_then(|_| gpumem_cuda::device_count().ok())
                .map(|n| n as usize),
        }
    }

    /// Switches to simulated devices. Only before the first allocator exists.
    pub fn use_source(&self, source: Source) -> Result<(), String> {
        let mut setup = self.setup.lock();
        if setup.created {
            return Err("gpumem already created allocators; choose the device source first".into());
        }
        setup.source = source;
        Ok(())
    }

    /// The allocator of `device`, if it was created.
    #[inline]
    pub fn get(&self, device: usize) -> Option<&DeviceSlot> {
        self.slots.get(device).and_then(|s| s.get())
    }

    /// The allocator of the first device that has one (all share one configuration).
    fn first_slot(&self) -> Option<&DeviceSlot> {
        self.slots.iter().find_map(OnceLock::get)
    }

    /// Devices that have an allocator.
    pub fn devices(&self) -> Vec<usize> {
        (0..MAX_DEVICES)
            .filter(|&d| self.get(d).is_some())
            .collect()
    }

    /// The allocator of `device`, created on first use.
    pub fn device(&self, device: usize) -> Result<&DeviceSlot, TorchError> {
        if let Some(s) = self.get(device) {
            return Ok(s);
        }
        let slot = self.slots.get(device).ok_or_else(|| {
            TorchError::Other(format!("gpumem: invalid CUDA device index {device}"))
        })?;
        let mut setup = self.setup.lock();
        if let Some(s) = slot.get() {
            return Ok(s);
        }
        if setup.config.is_none() {
            // Loaded without gpumem.torch.install() (a hand-made CUDAPluggableAllocator):
            // the environment decides.
            let (text, config) = env_conf()?;
            setup.conf_text = Some(text);
            setup.config = Some(config);
        }
        let config = with_history(setup.config.clone().unwrap_or_default(), setup.history);
        let (backend, sim): (Box<dyn Backend>, Option<SimControl>) = match &setup.source {
            Source::Cuda => {
                let b = gpumem_cuda::open_backend(device as u32).map_err(|e| {
                    TorchError::Other(format!("gpumem: cannot open CUDA device {device}: {e}"))
                })?;
                (b, None)
            }
            Source::Sim {
                devices,
                total_bytes,
                manual_events,
            } => {
                if device >= *devices as usize {
                    return Err(TorchError::Other(format!(
                        "gpumem: simulated device {device} does not exist ({devices} simulated)"
                    )));
                }
                let (b, ctl) = SimBackend::new(SimConfig {
                    name: format!("sim{device}"),
                    total_bytes: *total_bytes,
                    event_mode: if *manual_events {
                        EventMode::Manual
                    } else {
                        EventMode::Immediate
                    },
                    // Addresses unique across the simulated devices, as CUDA's unified addressing
                    // makes them across real ones (a free naming the wrong device is found).
                    address_base: SimConfig::default().address_base + ((device as u64) << 44),
                    ..SimConfig::default()
                });
                (Box::new(b), Some(ctl))
            }
        };
        let alloc = Allocator::new(backend, config).map_err(|e| {
            TorchError::Other(format!(
                "gpumem: cannot create the allocator of device {device}: {e}"
            ))
        })?;
        if let Some(&(_, f)) = setup.fractions.iter().rev().find(|(d, _)| *d == device) {
            apply_fraction(&alloc, f)?;
        }
        setup.fractions.retain(|(d, _)| *d != device);
        setup.created = true;
        let _ = slot.set(DeviceSlot {
            alloc: Arc::new(alloc),
            sim,
        });
        slot.get()
            .ok_or_else(|| TorchError::Other("gpumem: device slot vanished".into()))
    }

    /// Allocates for PyTorch: `size` bytes on `device` for use on `stream`. Zero bytes give the
    /// null pointer, as PyTorch's own allocator returns for them.
    #[inline]
    pub fn alloc(&self, size: u64, device: i32, stream: Stream) -> Result<DevPtr, TorchError> {
        self.alloc_sized(size, device, stream).map(|(ptr, _)| ptr)
    }

    /// [`Registry::alloc`], also returning the block's bytes as handed out (the request
    /// rounded up; 0 for the null pointer), as PyTorch's profiler is told of an allocation.
    #[inline]
    pub fn alloc_sized(
        &self,
        size: u64,
        device: i32,
        stream: Stream,
    ) -> Result<(DevPtr, u64), TorchError> {
        self.alloc_routed(size, device, stream, crate::torch_abi::capture_pool)
    }

    /// [`Registry::alloc_sized`], where while a CUDA graph capture is underway
    /// `pool_of(device, stream)` says which private pool, if any, the request belongs to (the
    /// shim asks the captures' own filters); otherwise it is not called.
    #[inline]
    fn alloc_routed(
        &self,
        size: u64,
        device: i32,
        stream: Stream,
        pool_of: impl FnOnce(usize, Stream) -> Option<PoolId>,
    ) -> Result<(DevPtr, u64), TorchError> {
        let t = self.clock.start();
        let r = self.alloc_untimed(size, device, stream, pool_of);
        self.clock.stop(Hook::Alloc, t);
        r
    }

    #[inline]
    fn alloc_untimed(
        &self,
        size: u64,
        device: i32,
        stream: Stream,
        pool_of: impl FnOnce(usize, Stream) -> Option<PoolId>,
    ) -> Result<(DevPtr, u64), TorchError> {
        if size == 0 {
            return Ok((0, 0));
        }
        let d = device_index(device)?;
        let slot = self.device(d)?;
        let pool = if slot.alloc.pools_filling() {
            pool_of(d, stream)
        } else {
            None
        };
        match pool {
            None => slot.alloc.allocate(size, stream),
            Some(id) => slot.alloc.allocate_in_pool(size, stream, id),
        }
        .map(|a| (a.ptr, a.size))
        .map_err(|e| torch_error(d, size, e))
    }

    /// One of c10's calls on private pool `id` of `device` (see [`PoolOp`]).
    pub fn pool(&self, device: usize, op: PoolOp, id: PoolId) -> Result<(), TorchError> {
        let a = &self.device(device)?.alloc;
        match op {
            PoolOp::Begin => a.begin_pool(id),
            PoolOp::Retain => a.retain_pool(id),
            PoolOp::End => a.end_pool(id),
            PoolOp::Release => a.release_pool(id),
        }
        .map_err(|e| TorchError::Other(format!("gpumem (device {device}): {e}")))
    }

    /// The blocks of private pool `id` on `device` now (c10's `getCheckpointState`, which
    /// torch.compile's CUDA graph trees call after each graph they record).
    pub fn pool_checkpoint(&self, device: usize, id: PoolId) -> Result<PoolCheckpoint, TorchError> {
        self.on_pool_device(device, |a| a.checkpoint_pool(id))
    }

    /// Sets the private pool of checkpoint `cp` on `device` back to it (c10's
    /// `setCheckpointPoolState`): see [`Allocator::restore_pool`].
    pub fn pool_restore(
        &self,
        device: usize,
        cp: &PoolCheckpoint,
    ) -> Result<PoolRestore, TorchError> {
        self.on_pool_device(device, |a| a.restore_pool(cp))
    }

    /// `f` on the allocator of `device`, which must have one (its pools were made by earlier
    /// calls), with an error that names the device.
    fn on_pool_device<T>(
        &self,
        device: usize,
        f: impl FnOnce(&Allocator) -> Result<T, AllocError>,
    ) -> Result<T, TorchError> {
        let slot = self.get(device).ok_or_else(|| {
            TorchError::Other(format!("gpumem: no private pool on device {device}"))
        })?;
        f(&slot.alloc).map_err(|e| TorchError::Other(format!("gpumem (device {device}): {e}")))
    }

    /// Users of pool `id` on `device` (c10's `getPoolUseCount`); 0 where gpumem never
    /// allocated.
    pub fn pool_use_count(&self, device: usize, id: PoolId) -> u32 {
        self.get(device).map_or(0, |s| s.alloc.pool_use_count(id))
    }

    /// Frees for PyTorch. Never fails: misuse is counted and reported once on stderr.
    #[inline]
    pub fn free(&self, ptr: DevPtr, device: i32, stream: Stream) -> FreeOutcome {
        self.free_located(ptr, device, stream).0
    }

    /// [`Registry::free`], also returning the device whose pool settled the free (the one
    /// named, or another that held the block; `None` for a null or foreign pointer).
    #[inline]
    pub fn free_located(
        &self,
        ptr: DevPtr,
        device: i32,
        stream: Stream,
    ) -> (FreeOutcome, Option<usize>) {
        let t = self.clock.start();
        let r = self.free_untimed(ptr, device, stream);
        self.clock.stop(Hook::Free, t);
        r
    }

    #[inline]
    fn free_untimed(
        &self,
        ptr: DevPtr,
        device: i32,
        stream: Stream,
    ) -> (FreeOutcome, Option<usize>) {
        if ptr == 0 {
            return (FreeOutcome::Null, None);
        }
        let c = &self.counters;
        let named = usize::try_from(device).ok();
        let Some(slot) = named.and_then(|d| self.get(d)) else {
            if let Some((outcome, d)) = self.free_on_another_device(ptr, device, stream) {
                return (outcome, Some(d));
            }
            c.count(WARN_FOREIGN, &c.foreign_frees, || {
                format!("free of {ptr:#x} on device {device}, where gpumem allocated nothing")
            });
            return (FreeOutcome::Foreign, None);
        };
        if let Some(outcome) = self.settle_free(slot.alloc.free_on_sized(ptr, stream), ptr, device)
        {
            return (outcome, named);
        }
        if let Some((outcome, d)) = self.free_on_another_device(ptr, device, stream) {
            return (outcome, Some(d));
        }
        c.count(WARN_FOREIGN, &c.foreign_frees, || {
            format!("free of {ptr:#x}, which gpumem did not allocate on device {device}")
        });
        (FreeOutcome::Foreign, None)
    }

    /// What a device's free of `ptr` came to, misuse counted and reported once; `None` if the
    /// device has no live block there (the caller looks elsewhere or reports a foreign free).
    fn settle_free(
        &self,
        r: Result<u64, AllocError>,
        ptr: DevPtr,
        device: impl std::fmt::Display,
    ) -> Option<FreeOutcome> {
        let c = &self.counters;
        match r {
            Ok(bytes) => Some(FreeOutcome::Freed(bytes)),
            Err(AllocError::UnknownPointer { .. }) => None,
            Err(AllocError::DoubleFree { .. }) => {
                c.count(WARN_DOUBLE_FREE, &c.double_frees, || {
                    format!("double free of {ptr:#x} on device {device}")
                });
                Some(FreeOutcome::DoubleFree)
            }
            Err(e) => {
                c.count(WARN_FREE_ERROR, &c.free_errors, || {
                    format!("free of {ptr:#x} on device {device} failed: {e}")
                });
                Some(FreeOutcome::Failed)
            }
        }
    }

    /// Frees `ptr` on whichever device gpumem allocated it: for callers that know only the
    /// pointer (the native allocator's `raw_delete`, `gpumem.torch.install(native=True)`).
    /// Devices are tried in order, each looking first at the null stream's blocks. Never
    /// fails: misuse is counted and reported once, as in [`Registry::free`].
    pub fn free_any(&self, ptr: DevPtr) -> FreeOutcome {
        self.free_any_located(ptr).0
    }

    /// [`Registry::free_any`], also returning the device where the block was found (`None`
    /// for a null or foreign pointer).
    pub fn free_any_located(&self, ptr: DevPtr) -> (FreeOutcome, Option<usize>) {
        let t = self.clock.start();
        let r = self.free_any_untimed(ptr);
        self.clock.stop(Hook::Free, t);
        r
    }

    fn free_any_untimed(&self, ptr: DevPtr) -> (FreeOutcome, Option<usize>) {
        if ptr == 0 {
            return (FreeOutcome::Null, None);
        }
        for (d, slot) in self.slots.iter().enumerate() {
            let Some(slot) = slot.get() else { continue };
            if let Some(outcome) = self.settle_free(slot.alloc.free_on_sized(ptr, 0), ptr, d) {
                return (outcome, Some(d));
            }
        }
        let c = &self.counters;
        c.count(WARN_FOREIGN, &c.foreign_frees, || {
            format!("free of {ptr:#x}, which gpumem did not allocate on any device")
        });
        (FreeOutcome::Foreign, None)
    }

    /// `device`'s cap as a fraction of it (1 without one), as
    /// `torch.cuda.get_per_process_memory_fraction` reads it. Once configured, makes the
    /// device's allocator if it has none yet (so that `fraction:` or `cap:` of the
    /// configuration counts); before, it answers from the fraction set for the device, if any,
    /// without fixing the configuration.
    pub fn memory_fraction(&self, device: i32) -> Result<f64, TorchError> {
        let d = device_index(device)?;
        if self.get(d).is_none() {
            let setup = self.setup.lock();
            if setup.config.is_none() {
                let pending = setup.fractions.iter().rev().find(|(x, _)| *x == d);
                return Ok(pending.map_or(1.0, |&(_, f)| f));
            }
        }
        Ok(self.device(d)?.alloc.memory_fraction())
    }

    /// The largest allocation `device` can serve now without running out of memory
    /// (`Allocator::largest_obtainable`): PyTorch's `cacheInfo`, which cuDNN's benchmark mode
    /// sizes its workspaces by. Makes the device's allocator if it has none yet; 0 (reported
    /// once) if that fails.
    pub fn cache_info(&self, device: i32) -> u64 {
        match device_index(device).and_then(|d| self.device(d)) {
            Ok(slot) => slot.alloc.largest_obtainable(),
            Err(e) => {
                let c = &self.counters;
                c.count(WARN_OTHER, &c.other_errors, || {
                    format!("cache_info on device {device} failed: {}", e.message())
                });
                0
            }
        }
    }

    /// A free that named `device` for a live block of another device (PyTorch names the right
    /// one; a hand-written caller may not): freed where it lives, reported once, rather than
    /// leaked. With the device that held it; `None` if no other device has it live.
    fn free_on_another_device(
        &self,
        ptr: DevPtr,
        device: i32,
        stream: Stream,
    ) -> Option<(FreeOutcome, usize)> {
        let c = &self.counters;
        for d in self.devices() {
            if usize::try_from(device).ok() == Some(d) {
                continue;
            }
            let slot = self.get(d)?;
            match slot.alloc.free_on_sized(ptr, stream) {
                Err(AllocError::UnknownPointer { .. }) => continue,
                Err(AllocError::DoubleFree { .. }) => {
                    c.count(WARN_DOUBLE_FREE, &c.double_frees, || {
                        format!("double free of {ptr:#x} (allocated on device {d})")
                    });
                    return Some((FreeOutcome::DoubleFree, d));
                }
                r => {
                    c.count(WARN_WRONG_DEVICE, &c.wrong_device_frees, || {
                        format!(
                            "free of {ptr:#x} named device {device}, but gpumem allocated it on device {d}: freed there"
                        )
                    });
                    let outcome = match r {
                        Ok(bytes) => FreeOutcome::Freed(bytes),
                        Err(_) => FreeOutcome::Failed,
                    };
                    return Some((outcome, d));
                }
            }
        }
        None
    }

    /// `Tensor.record_stream`: the block at `ptr` is used on `stream` too, so it is reused only
    /// after the work queued there before its free has completed. Memory that is not gpumem's
    /// is ignored (as PyTorch's allocator ignores memory it does not own). Returns whether a
    /// gpumem block was found.
    pub fn record_stream(&self, ptr: DevPtr, stream: Stream) -> bool {
        let t = self.clock.start();
        let r = self.record_stream_untimed(ptr, stream);
        self.clock.stop(Hook::RecordStream, t);
        r
    }

    fn record_stream_untimed(&self, ptr: DevPtr, stream: Stream) -> bool {
        if ptr == 0 {
            return false;
        }
        let c = &self.counters;
        for d in 0..MAX_DEVICES {
            let Some(slot) = self.get(d) else { continue };
            match slot.alloc.record_stream(ptr, stream) {
                Ok(()) => return true,
                Err(AllocError::UnknownPointer { .. } | AllocError::DoubleFree { .. }) => {}
                Err(e) => {
                    c.count(WARN_OTHER, &c.other_errors, || {
                        format!("record_stream of {ptr:#x} on stream {stream:#x} failed: {e}")
                    });
                    return false;
                }
            }
        }
        c.record_stream_foreign.fetch_add(1, Ordering::Relaxed);
        false
    }

    /// `torch.cuda.empty_cache()`: every device returns its unused cached memory. Returns the
    /// bytes released.
    pub fn empty_cache(&self) -> u64 {
        self.release_on_every_device("empty_cache", Allocator::empty_cache)
    }

    /// c10's `emptyCache(mempool_id)`: every device returns the cached memory of private pool
    /// `id` alone, if no one uses it any more.
    pub fn empty_pool_cache(&self, id: PoolId) -> u64 {
        self.release_on_every_device("empty_cache of a pool", |a| a.empty_pool_cache(id))
    }

    /// Runs `release` on every device gpumem allocated on, summing the bytes released; a
    /// device that fails is counted and reported (named `what`), the others go on.
    fn release_on_every_device(
        &self,
        what: &str,
        release: impl Fn(&Allocator) -> Result<u64, AllocError>,
    ) -> u64 {
        let mut released = 0;
        for d in 0..MAX_DEVICES {
            let Some(slot) = self.get(d) else { continue };
            match release(&slot.alloc) {
                Ok(b) => released += b,
                Err(e) => {
                    let c = &self.counters;
                    c.count(WARN_OTHER, &c.other_errors, || {
                        format!("{what} on device {d} failed: {e}")
                    });
                }
            }
        }
        released
    }

    /// `torch.cuda.set_per_process_memory_fraction(fraction, device)`: caps the memory gpumem
    /// holds on `device` (0 allows nothing).
    pub fn set_memory_fraction(&self, fraction: f64, device: i32) -> Result<(), TorchError> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(TorchError::Other(format!(
                "gpumem: memory fraction {fraction} is not in [0, 1]"
            )));
        }
        let d = device_index(device)?;
        if let Some(slot) = self.get(d) {
            return apply_fraction(&slot.alloc, fraction);
        }
        let mut setup = self.setup.lock();
        match self.get(d) {
            // Created meanwhile (under the same lock as the pending list).
            Some(slot) => apply_fraction(&slot.alloc, fraction),
            None => {
                setup.fractions.push((d, fraction));
                Ok(())
            }
        }
    }

    /// Statistics of `device` (all zero if gpumem never allocated there).
    pub fn memory_stats(&self, device: usize) -> MemoryStats {
        self.get(device)
            .map(|s| s.alloc.memory_stats())
            .unwrap_or_default()
    }

    /// `device`'s limit (cap or total bytes) and free bytes, as PyTorch's out-of-memory
    /// observers are told them (`None` where gpumem never allocated).
    pub fn limit_and_free(&self, device: usize) -> Option<(u64, u64)> {
        self.get(device).map(|s| s.alloc.limit_and_free())
    }

    /// Zeroes `device`'s accumulated totals and counters
    /// (`torch.cuda.reset_accumulated_memory_stats`); nothing to do where gpumem never
    /// allocated.
    pub fn reset_accumulated_stats(&self, device: usize) {
        if let Some(s) = self.get(device) {
            s.alloc.reset_accumulated_stats();
        }
    }

    /// Sets `device`'s peaks to the current values (`torch.cuda.reset_peak_memory_stats`).
    pub fn reset_peak_stats(&self, device: usize) {
        if let Some(s) = self.get(device) {
            s.alloc.reset_peak_stats();
        }
    }

    /// What the policy on `device` changed on its own, one line each (none if gpumem never
    /// allocated there).
    pub fn policy_notes(&self, device: usize) -> Vec<String> {
        self.get(device)
            .map(|s| s.alloc.policy_notes())
            .unwrap_or_default()
    }

    /// Completes every event recorded so far on simulated `device`; returns how many.
    pub fn sim_complete_events(&self, device: usize) -> usize {
        match self.get(device).and_then(|s| s.sim.as_ref()) {
            Some(ctl) => ctl.complete_recorded(),
            None => 0,
        }
    }
}

/// The message PyTorch users see for an allocator error. Out-of-memory messages start with
/// "CUDA out of memory." like PyTorch's own, which tools match on to shrink a batch.
pub fn torch_error(device: usize, size: u64, e: AllocError) -> TorchError {
    match e {
        AllocError::OutOfMemory(report) => TorchError::OutOfMemory(format!(
            "CUDA out of memory. gpumem on device {device}: {report}"
        )),
        AllocError::InvalidSize { reason, .. } => TorchError::OutOfMemory(format!(
            "CUDA out of memory. gpumem on device {device}: tried to allocate {} ({size} bytes), \
             {reason}",
            gpumem_core::units::format_size(size)
        )),
        AllocError::Backend(b) if b.out_of_memory => TorchError::OutOfMemory(format!(
            "CUDA out of memory. gpumem on device {device}: the driver refused {size} bytes: {b}"
        )),
        other => TorchError::Other(format!("gpumem on device {device}: {other}")),
    }
}

/// A simulated source of `devices` H200-sized devices (or `total_bytes` each).
pub fn sim_source(devices: u32, total_bytes: Option<u64>, manual_events: bool) -> Source {
    Source::Sim {
        devices,
        total_bytes: total_bytes.unwrap_or(H200_TOTAL_BYTES),
        manual_events,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpumem_core::units::MIB;

    fn sim(devices: u32, total: u64, manual: bool) -> Registry {
        Registry::new(sim_source(devices, Some(total), manual))
    }

    #[test]
    fn zero_bytes_give_null_and_freeing_null_is_a_no_op() {
        let r = sim(1, 1 << 30, false);
        assert_eq!(r.alloc(0, 0, 0), Ok(0));
        assert_eq!(r.free(0, 0, 0), FreeOutcome::Null);
        assert!(
            r.devices().is_empty(),
            "no allocator is created for a zero-byte request"
        );
    }

    #[test]
    fn allocations_are_counted_per_device() {
        let r = sim(2, 1 << 30, false);
        let a = r.alloc(3 * MIB, 0, 0).unwrap();
        let b = r.alloc(1000, 1, 7).unwrap();
        assert_eq!(r.devices(), vec![0, 1]);
        let s0 = r.memory_stats(0);
        let s1 = r.memory_stats(1);
        assert_eq!(s0.requested_bytes.all.current, (3 * MIB) as i64);
        assert_eq!(s1.requested_bytes.all.current, 1000);
        assert_eq!(s1.allocated_bytes.all.current, 1024, "rounded to 512 B");
        assert_eq!(r.free(a, 0, 0), FreeOutcome::Freed(3 * MIB));
        assert_eq!(
            r.free(b, 1, 7),
            FreeOutcome::Freed(1024),
            "the bytes as handed out"
        );
        assert_eq!(r.memory_stats(0).allocated_bytes.all.current, 0);
        assert_eq!(r.memory_stats(3).allocated_bytes.all.peak, 0);
    }

    #[test]
    fn the_hook_clock_times_only_calls_made_while_on() {
        let r = sim(1, 1 << 30, false);
        let counts =
            |r: &Registry| -> Vec<u64> { r.clock.snapshot().iter().map(|&(_, n, _)| n).collect() };
        let a = r.alloc(MIB, 0, 0).unwrap();
        assert_eq!(r.free(a, 0, 0), FreeOutcome::Freed(MIB));
        assert_eq!(counts(&r), vec![0, 0, 0], "off by default");
        r.clock.set(true);
        let a = r.alloc(MIB, 0, 0).unwrap();
        let b = r.alloc(3 * MIB, 0, 0).unwrap();
        assert!(r.record_stream(a, 9));
        assert_eq!(r.free(a, 0, 0), FreeOutcome::Freed(MIB));
        // Misuse is timed too: it is a call PyTorch made.
        assert_eq!(r.free(0xdead_0000, 0, 0), FreeOutcome::Foreign);
        r.clock.set(false);
        assert_eq!(r.free(b, 0, 0), FreeOutcome::Freed(3 * MIB));
        assert_eq!(counts(&r), vec![2, 2, 1]);
        let names: Vec<&str> = r
            .clock
            .snapshot()
            .iter()
            .map(|(h, _, _)| h.name())
            .collect();
        assert_eq!(names, ["alloc", "free", "record_stream"]);
        assert!(
            r.clock.snapshot()[0].2 > 0,
            "two allocations took some time"
        );
    }

    #[test]
    fn misuse_is_counted_not_fatal() {
        let r = sim(1, 1 << 30, false);
        let a = r.alloc(MIB, 0, 0).unwrap();
        assert_eq!(r.free(a, 0, 0), FreeOutcome::Freed(MIB));
        assert_eq!(r.free(a, 0, 0), FreeOutcome::DoubleFree);
        assert_eq!(r.free(0xdead_0000, 0, 0), FreeOutcome::Foreign);
        assert_eq!(r.free(0xdead_0000, 5, 0), FreeOutcome::Foreign);
        let counts: Vec<_> = r.counters.snapshot();
        assert_eq!(counts[0], ("foreign_frees", 2));
        assert_eq!(counts[1], ("double_frees", 1));
        assert!(!r.record_stream(0xdead_0000, 3));
        assert_eq!(r.counters.record_stream_foreign.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn memory_fraction_reads_back_what_was_set() {
        let r = sim(3, 1 << 30, false);
        r.set_memory_fraction(0.25, 1).unwrap(); // before any allocator or configuration
        assert_eq!(r.memory_fraction(1), Ok(0.25));
        assert_eq!(r.memory_fraction(0), Ok(1.0), "no cap");
        assert!(r.devices().is_empty(), "reading made no allocator");
        r.configure(Some("fraction:0.75")).unwrap();
        assert_eq!(r.memory_fraction(2), Ok(0.75), "the configuration's cap");
        assert_eq!(
            r.memory_fraction(1),
            Ok(0.25),
            "the fraction set for the device"
        );
        r.set_memory_fraction(0.5, 0).unwrap();
        assert_eq!(r.memory_fraction(0), Ok(0.5));
        assert!(r.memory_fraction(-1).is_err());
    }

    #[test]
    fn cache_info_is_what_the_device_can_still_serve() {
        let r = sim(1, 1 << 30, false);
        let empty = r.cache_info(0);
        assert_eq!(empty, 1 << 30, "a fresh device: all of it");
        let a = r.alloc(300 * MIB, 0, 0).unwrap();
        let b = r.alloc(100 * MIB, 0, 0).unwrap();
        assert_eq!(r.free(a, 0, 0), FreeOutcome::Freed(300 * MIB));
        // 300 MiB cached (idle pages) and 624 MiB never taken: all but the live 100 MiB.
        assert_eq!(r.cache_info(0), (1 << 30) - 100 * MIB);
        r.set_memory_fraction(0.5, 0).unwrap();
        assert_eq!(r.cache_info(0), 512 * MIB - 100 * MIB, "within the cap");
        assert_eq!(r.free(b, 0, 0), FreeOutcome::Freed(100 * MIB));
        assert_eq!(r.cache_info(-1), 0, "a bad device: nothing");
        assert_eq!(r.counters.other_errors.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_free_says_which_device_settled_it() {
        let r = sim(2, 1 << 30, false);
        let on1 = r.alloc(3 * MIB, 1, 0).unwrap();
        let on0 = r.alloc(MIB, 0, 0).unwrap();
        // Named right, named wrong (freed where it lives, and counted), then misuse.
        assert_eq!(
            r.free_located(on0, 0, 0),
            (FreeOutcome::Freed(MIB), Some(0))
        );
        assert_eq!(
            r.free_located(on1, 0, 0),
            (FreeOutcome::Freed(3 * MIB), Some(1))
        );
        assert_eq!(r.counters.wrong_device_frees.load(Ordering::Relaxed), 1);
        assert_eq!(
            r.free_located(on1, 1, 0),
            (FreeOutcome::DoubleFree, Some(1))
        );
        assert_eq!(
            r.free_located(0xdead_0000, 1, 0),
            (FreeOutcome::Foreign, None)
        );
        assert_eq!(r.free_located(0, 1, 0), (FreeOutcome::Null, None));
    }

    #[test]
    fn free_any_finds_the_device_and_stream_itself() {
        // The native allocator's raw_delete knows only the pointer: blocks of the second
        // device and of a side stream are found, and each misuse is reported as by `free`.
        let r = sim(2, 1 << 30, false);
        let on0 = r.alloc(3 * MIB, 0, 0).unwrap();
        let on1_side = r.alloc(1000, 1, 7).unwrap();
        assert_eq!(r.free_any(on1_side), FreeOutcome::Freed(1024));
        assert_eq!(r.memory_stats(1).allocated_bytes.all.current, 0);
        assert_eq!(
            r.memory_stats(0).allocated_bytes.all.current,
            (3 * MIB) as i64,
            "device 0's block untouched"
        );
        // Device 0 has a null-stream pool, which is asked first and passed over in the search.
        let on0_side = r.alloc(5 * MIB, 0, 0x55).unwrap();
        assert_eq!(r.free_any(on0_side), FreeOutcome::Freed(5 * MIB));
        assert_eq!(r.free_any(on0), FreeOutcome::Freed(3 * MIB));
        assert_eq!(r.memory_stats(0).allocated_bytes.all.current, 0);
        assert_eq!(r.free_any(0), FreeOutcome::Null);
        assert_eq!(r.free_any(on0), FreeOutcome::DoubleFree);
        assert_eq!(r.free_any(0xdead_0000), FreeOutcome::Foreign);
        let counts: Vec<_> = r.counters.snapshot();
        assert_eq!(counts[0], ("foreign_frees", 1));
        assert_eq!(counts[1], ("double_frees", 1));
        assert_eq!(
            r.counters.wrong_device_frees.load(Ordering::Relaxed),
            0,
            "no device was named, so none was wrong"
        );
    }

    #[test]
    fn record_stream_delays_reuse_until_the_event_completes() {
        let r = sim(1, 1 << 30, true);
        let a = r.alloc(8 * MIB, 0, 0).unwrap();
        assert!(r.record_stream(a, 0x55));
        assert_eq!(r.free(a, 0, 0), FreeOutcome::Freed(8 * MIB));
        let active = r.memory_stats(0).active_bytes.all.current;
        assert_eq!(
            active,
            (8 * MIB) as i64,
            "still active while stream 0x55 may use it"
        );
        let b = r.alloc(8 * MIB, 0, 0).unwrap();
        assert_ne!(
            a, b,
            "the block used on another stream is not handed out again"
        );
        // The free's event on stream 0x55 (the stitched policy records its own events too).
        assert!(r.sim_complete_events(0) >= 1);
        r.free(b, 0, 0);
        let c = r.alloc(8 * MIB, 0, 0).unwrap();
        r.free(c, 0, 0);
        assert_eq!(
            r.memory_stats(0).active_bytes.all.current,
            0,
            "the pending block was released once its event completed"
        );
    }

    #[test]
    fn fraction_caps_and_oom_says_so() {
        let r = sim(1, 1 << 30, false);
        r.set_memory_fraction(0.25, 0).unwrap();
        let err = r.alloc(512 * MIB, 0, 0).unwrap_err();
        match &err {
            TorchError::OutOfMemory(m) => {
                assert!(m.starts_with("CUDA out of memory."), "{m}");
                assert!(m.contains("gpumem"), "{m}");
            }
            other => panic!("expected out of memory, got {other:?}"),
        }
        assert_eq!(r.memory_stats(0).num_ooms, 1);
        assert!(r.alloc(128 * MIB, 0, 0).is_ok(), "small requests still fit");
        assert!(r.set_memory_fraction(1.5, 0).is_err());
        r.set_memory_fraction(0.0, 0).unwrap();
        assert!(matches!(
            r.alloc(64 * MIB, 0, 0),
            Err(TorchError::OutOfMemory(_))
        ));
    }

    #[test]
    fn absurd_sizes_are_out_of_memory_like_pytorch() {
        let r = sim(1, 1 << 30, false);
        let err = r.alloc(1 << 50, 0, 0).unwrap_err();
        assert!(matches!(err, TorchError::OutOfMemory(_)), "{err:?}");
        assert!(
            err.message().contains("1048576.00 GiB"),
            "{}",
            err.message()
        );
    }

    #[test]
    fn bad_devices_and_configurations_are_errors() {
        let r = sim(1, 1 << 30, false);
        assert!(matches!(r.alloc(512, -1, 0), Err(TorchError::Other(_))));
        assert!(matches!(r.alloc(512, 1, 0), Err(TorchError::Other(_))));
        assert!(r.configure(Some("policy:nonsense")).is_err());
        r.configure(Some("policy:caching")).unwrap();
        r.alloc(512, 0, 0).unwrap();
        assert_eq!(r.get(0).unwrap().alloc.policy().name(), "caching");
        assert!(
            r.configure(Some("policy:caching")).is_ok(),
            "same again is fine"
        );
        match r.configure(Some("policy:buddy")) {
            Err(ConfigureError::Conflict(e)) => assert!(e.contains("cannot change"), "{e}"),
            other => panic!("a change after the first allocation gave {other:?}"),
        }
        assert!(matches!(
            r.configure(Some("policy:nonsense")),
            Err(ConfigureError::Invalid(_))
        ));
        assert!(r.use_source(Source::Cuda).is_err());
    }

    #[test]
    fn history_is_set_before_the_first_allocator_and_fixed_after() {
        let r = sim(1, 1 << 30, false);
        // Asked for before the configuration (record_memory_history before install()).
        r.record_history(HistoryRequest {
            entries: 100,
            backtraces: true,
        })
        .unwrap();
        r.configure(Some("policy:native")).unwrap();
        assert_eq!(r.effective_config().unwrap().history, 100);
        let p = r.alloc(MIB, 0, 0).unwrap();
        let alloc = &r.get(0).unwrap().alloc;
        assert_eq!(
            (alloc.config().history, alloc.config().backtraces),
            (100, true)
        );
        let recorded = alloc.with_tracker(|t| t.history().count()).unwrap();
        assert_eq!(recorded, 2, "a segment and an allocation");
        // What is in force is accepted again (stacks are kept even if not asked for).
        for backtraces in [true, false] {
            r.record_history(HistoryRequest {
                entries: 100,
                backtraces,
            })
            .unwrap();
        }
        let e = r
            .record_history(HistoryRequest {
                entries: 5,
                backtraces: true,
            })
            .unwrap_err();
        assert!(!e.turning_off);
        assert!(
            e.message
                .contains("records the last 100 events with stack traces"),
            "{}",
            e.message
        );
        let e = r
            .record_history(HistoryRequest {
                entries: 0,
                backtraces: false,
            })
            .unwrap_err();
        assert!(e.turning_off, "{e:?}");
        assert_eq!(r.free(p, 0, 0), FreeOutcome::Freed(MIB));
    }

    #[test]
    fn history_can_be_refused_before_the_first_allocator() {
        let r = sim(1, 1 << 30, false);
        r.configure(Some("policy:caching,history:50")).unwrap();
        r.record_history(HistoryRequest {
            entries: 0,
            backtraces: false,
        })
        .unwrap();
        r.alloc(MIB, 0, 0).unwrap();
        let alloc = &r.get(0).unwrap().alloc;
        assert_eq!(alloc.config().history, 0);
        assert!(alloc.with_tracker(|_| ()).is_none(), "no tracker at all");
    }

    #[test]
    fn empty_cache_returns_memory() {
        let r = sim(1, 1 << 30, false);
        let a = r.alloc(64 * MIB, 0, 0).unwrap();
        r.free(a, 0, 0);
        let held = r.memory_stats(0).reserved_bytes.all.current;
        assert!(held >= (64 * MIB) as i64);
        assert_eq!(r.empty_cache() as i64, held);
        assert_eq!(r.memory_stats(0).reserved_bytes.all.current, 0);
    }
}
