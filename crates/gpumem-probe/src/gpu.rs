//! The device the probe runs on: the driver loaded at run time, the primary context, one
//! stream, and the probe kernels compiled by NVRTC for the device's own architecture.

use crate::error::{DriverContext, ProbeError};
use cudarc::driver::{sys, CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig};
use cudarc::nvrtc::{self, CompileError, CompileOptions};
use std::sync::Arc;

/// CUDA C source of every probe kernel.
pub const KERNEL_SOURCE: &str = include_str!("kernels/probe.cu");

/// The same kernels as PTX for compute_75 (PTX ISA 8.0), generated from [`KERNEL_SOURCE`] by
/// tools/gen_ptx.py: used where NVRTC is not installed (the driver compiles it for the GPU), or
/// when `GPUMEM_PROBE_PTX=shipped` asks for it.
pub const SHIPPED_PTX: &str = include_str!("kernels/probe.ptx");

/// Environment variable that forces the shipped PTX even where NVRTC is present.
pub const FORCE_SHIPPED_PTX_ENV: &str = "GPUMEM_PROBE_PTX";

/// True when libcuda can be loaded. cudarc panics on its first call where it cannot, so this is
/// asked before anything else.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen libcuda under its usual names and drops the handle; it runs
    // no code of the library beyond its initialisers.
    unsafe { sys::is_culib_present() }
}

/// True when libnvrtc can be loaded (see [`driver_present`]).
pub fn nvrtc_present() -> bool {
    // SAFETY: as in `driver_present`, for libnvrtc.
    unsafe { nvrtc::sys::is_culib_present() }
}

pub(crate) struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub module: Arc<CudaModule>,
    pub ordinal: usize,
    pub name: String,
    pub uuid: String,
    pub cc: (i32, i32),
    pub sm_count: u32,
    pub driver_version: i32,
    pub nvrtc_version: Option<(i32, i32)>,
    pub compiled_for: String,
}

impl Gpu {
    /// Opens device `ordinal` and compiles the kernels. Fails with a clear error, never a panic,
    /// where there is no driver, no device or no NVRTC.
    pub fn open(ordinal: usize) -> Result<Gpu, ProbeError> {
        if !driver_present() {
            return Err(ProbeError::NoDriver);
        }
        let count = CudaContext::device_count().map_err(|e| ProbeError::NoDevice {
            ordinal,
            detail: format!("the driver found no usable device ({:?})", e.0),
        })?;
        if ordinal >= count.max(0) as usize {
            return Err(ProbeError::NoDevice {
                ordinal,
                detail: format!("this machine has {count} CUDA device(s)"),
            });
        }
        let ctx = CudaContext::new(ordinal).ctx("open the device's primary context")?;
        // SAFETY: the probe uses one stream for everything (launches, copies, frees happen in
        // stream order), so cudarc's cross-stream event tracking has nothing to order; turning
        // it off keeps its extra event records out of the timed regions.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let name = ctx.name().ctx("read the device name")?;
        let uuid = format_uuid(&ctx.uuid().ctx("read the device UUID")?);
        let cc = ctx
            .compute_capability()
            .ctx("read the compute capability")?;
        let sm_count = attr(
            &ctx,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )? as u32;
        let mut driver_version = 0;
        // SAFETY: cuDriverGetVersion writes one int through a valid pointer; the library is
        // loaded (checked above).
        unsafe { sys::cuDriverGetVersion(&mut driver_version) }
            .result()
            .ctx("read the driver version")?;

        let force_shipped = std::env::var(FORCE_SHIPPED_PTX_ENV).is_ok_and(|v| v == "shipped");
        let (ptx, compiled_for, nvrtc_version) = if force_shipped || !nvrtc_present() {
            let why = if force_shipped {
                format!("{FORCE_SHIPPED_PTX_ENV}=shipped")
            } else {
                "NVRTC not found".to_string()
            };
            (
                nvrtc::Ptx::from_src(SHIPPED_PTX),
                format!("compute_75 PTX shipped with gpumem ({why}), JIT-compiled by the driver"),
                None,
            )
        } else {
            let (mut maj, mut min) = (0, 0);
            // SAFETY: nvrtcVersion writes two ints through valid pointers; libnvrtc is loaded.
            unsafe { nvrtc::sys::nvrtcVersion(&mut maj, &mut min) };
            let (ptx, arch) = compile(cc)?;
            (ptx, arch, Some((maj, min)))
        };
        let module = ctx.load_module(ptx).map_err(|e| {
            if e.0 == sys::CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION {
                let nvrtc = nvrtc_version
                    .map(|(a, b)| format!("NVRTC {a}.{b}"))
                    .unwrap_or_else(|| "the shipped PTX".into());
                ProbeError::Compile {
                    arch: compiled_for.clone(),
                    log: format!(
                        "{nvrtc} emits PTX newer than this driver ({}) accepts: use an NVRTC no \
                         newer than the driver's CUDA version",
                        format_version(driver_version)
                    ),
                }
            } else {
                ProbeError::driver(
                    format!("load the kernels ({compiled_for}; the driver compiles the PTX)"),
                    e,
                )
            }
        })?;
        Ok(Gpu {
            ctx,
            stream,
            module,
            ordinal,
            name,
            uuid,
            cc,
            sm_count,
            driver_version,
            nvrtc_version,
            compiled_for,
        })
    }

    pub fn func(&self, name: &str) -> Result<CudaFunction, ProbeError> {
        self.module
            .load_function(name)
            .ctx(&format!("find kernel {name}"))
    }

    pub fn attr(&self, a: sys::CUdevice_attribute) -> Result<i64, ProbeError> {
        attr(&self.ctx, a)
    }

    /// An attribute the driver may not report (deprecated ones): `None` instead of an error.
    pub fn attr_opt(&self, a: sys::CUdevice_attribute) -> Option<i64> {
        attr(&self.ctx, a).ok().filter(|v| *v > 0)
    }

    pub fn sync(&self) -> Result<(), ProbeError> {
        self.stream
            .synchronize()
            .ctx("synchronize (a kernel failed)")
    }

    /// Blocks per SM that can be resident at once for `f` with `block` threads: a grid of
    /// SMs x this is one full wave.
    pub fn blocks_per_sm(
        &self,
        f: &CudaFunction,
        block: u32,
        smem: usize,
    ) -> Result<u32, ProbeError> {
        let n = f
            .occupancy_max_active_blocks_per_multiprocessor(block, smem, None)
            .ctx("query occupancy")?;
        if n == 0 {
            return Err(ProbeError::Internal(format!(
                "a block of {block} threads does not fit on an SM"
            )));
        }
        Ok(n)
    }

    /// One full wave of `f` in blocks of `block` threads: a grid of SMs x the blocks that can be
    /// resident per SM.
    pub fn full_wave(&self, f: &CudaFunction, block: u32) -> Result<LaunchConfig, ProbeError> {
        let grid = self.sm_count * self.blocks_per_sm(f, block, 0)?;
        Ok(LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (block, 1, 1),
            shared_mem_bytes: 0,
        })
    }

    /// Runs `launch` `warmup` times untimed, then `runs` times each between two events; returns
    /// the seconds of each timed run. `launch` must only enqueue work on `self.stream`.
    pub fn time_runs(
        &self,
        warmup: usize,
        runs: usize,
        mut launch: impl FnMut() -> Result<(), ProbeError>,
    ) -> Result<Vec<f64>, ProbeError> {
        for _ in 0..warmup {
            launch()?;
        }
        self.sync()?;
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.ctx.new_event(flags).ctx("create an event")?;
        let end = self.ctx.new_event(flags).ctx("create an event")?;
        let mut secs = Vec::with_capacity(runs);
        for _ in 0..runs {
            start.record(&self.stream).ctx("record an event")?;
            launch()?;
            end.record(&self.stream).ctx("record an event")?;
            let ms = start.elapsed_ms(&end).ctx("time a kernel (it failed)")?;
            secs.push(f64::from(ms) / 1e3);
        }
        Ok(secs)
    }
}

fn attr(ctx: &Arc<CudaContext>, a: sys::CUdevice_attribute) -> Result<i64, ProbeError> {
    ctx.attribute(a)
        .map(i64::from)
        .ctx(&format!("read device attribute {a:?}"))
}

/// Compiles [`KERNEL_SOURCE`] for the device: real machine code for `sm_XY` first; where this
/// NVRTC does not know the architecture, PTX for `compute_XY`, then for the newest older
/// virtual architecture it knows (the driver JIT-compiles PTX forward).
fn compile(cc: (i32, i32)) -> Result<(nvrtc::Ptx, String), ProbeError> {
    let dev = cc.0 * 10 + cc.1;
    let mut archs = vec![format!("sm_{dev}"), format!("compute_{dev}")];
    for v in [90, 89, 86, 80, 75] {
        if v < dev {
            archs.push(format!("compute_{v}"));
        }
    }
    let mut last = String::new();
    for arch in &archs {
        let opts = CompileOptions {
            options: vec![format!("--gpu-architecture={arch}"), "-lineinfo".into()],
            name: Some("gpumem_probe.cu".into()),
            ..Default::default()
        };
        match nvrtc::compile_ptx_with_opts(KERNEL_SOURCE, opts) {
            Ok(ptx) => return Ok((ptx, arch.clone())),
            Err(CompileError::CompileError { nvrtc, log, .. }) => {
                let log = log.to_string_lossy().trim().to_string();
                // An unknown architecture is an invalid option; anything else is a real error.
                if nvrtc.0 != nvrtc::sys::nvrtcResult::NVRTC_ERROR_INVALID_OPTION {
                    return Err(ProbeError::Compile {
                        arch: arch.clone(),
                        log: format!("{:?}: {log}", nvrtc.0),
                    });
                }
                last = log;
            }
            Err(e) => {
                return Err(ProbeError::Compile {
                    arch: arch.clone(),
                    log: format!("{e:?}"),
                })
            }
        }
    }
    Err(ProbeError::Compile {
        arch: archs.join(", "),
        log: format!("no architecture accepted: {last}"),
    })
}

/// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", the form nvidia-smi and NVML use.
pub(crate) fn format_uuid(u: &sys::CUuuid) -> String {
    let b: Vec<u8> = u.bytes.iter().map(|&c| c as u8).collect();
    let hex =
        |r: std::ops::Range<usize>| b[r].iter().map(|x| format!("{x:02x}")).collect::<String>();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        hex(0..4),
        hex(4..6),
        hex(6..8),
        hex(8..10),
        hex(10..16)
    )
}

/// 13000 -> "13.0".
pub fn format_version(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel the probe launches.
    const KERNELS: [&str; 15] = [
        "chase_l1",
        "chase_cg",
        "chase_smem",
        "chase_build",
        "copy_f4",
        "copy_f4_x4",
        "copy_f4_x4_cs",
        "copy_f4_tile",
        "read_f4_x4",
        "smem_read",
        "fma_peak",
        "add_scalar",
        "add_f4",
        "add_strided",
        "fill_u32",
    ];

    #[test]
    fn versions_and_uuids_are_formatted_like_nvidia_smi() {
        assert_eq!(format_version(13000), "13.0");
        assert_eq!(format_version(12080), "12.8");
        let mut u = sys::CUuuid { bytes: [0; 16] };
        for (i, b) in u.bytes.iter_mut().enumerate() {
            *b = (i as u8 * 17) as _;
        }
        assert_eq!(format_uuid(&u), "GPU-00112233-4455-6677-8899-aabbccddeeff");
    }

    /// The constants the host uses to predict kernel results must be the kernels' own.
    #[test]
    fn host_constants_match_the_kernel_source() {
        use crate::measure::{bandwidth, compute};
        for (name, value) in [
            ("SMEM_BLOCK", u64::from(bandwidth::SMEM_BLOCK)),
            ("SMEM_UNROLL", bandwidth::SMEM_UNROLL),
            ("FMA_CHAINS", u64::from(compute::CHAINS)),
            ("FMA_STEPS", u64::from(compute::STEPS)),
        ] {
            let line = format!("#define {name} {value}\n");
            assert!(KERNEL_SOURCE.contains(&line), "probe.cu lacks {line:?}");
        }
        for k in KERNELS {
            let declared = KERNEL_SOURCE.contains(&format!(" {k}("))
                || KERNEL_SOURCE.contains(&format!("\n{k}("));
            assert!(declared, "kernel {k} missing");
        }
    }

    /// FNV-1a, 64 bits (the hash tools/gen_ptx.py writes into the shipped PTX's first line).
    fn fnv1a64(data: &[u8]) -> u64 {
        data.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
    }

    #[test]
    fn shipped_ptx_is_generated_from_the_current_source() {
        let first = SHIPPED_PTX.lines().next().unwrap();
        let want = format!("fnv1a64={:016x}", fnv1a64(KERNEL_SOURCE.as_bytes()));
        assert!(
            first.contains(&want),
            "probe.cu changed: regenerate probe.ptx with tools/gen_ptx.py ({first})"
        );
        assert!(SHIPPED_PTX.contains(".target sm_75"));
        for k in KERNELS {
            assert!(
                SHIPPED_PTX.contains(&format!(".entry {k}(")),
                "kernel {k} missing"
            );
        }
    }

    /// Compiles every kernel for sm_90 and for sm_80 with the NVRTC on this machine. Needs
    /// libnvrtc (not the driver); the device script runs it.
    #[test]
    #[ignore = "needs NVRTC (libnvrtc.so on the library path)"]
    fn kernels_compile_with_nvrtc() {
        assert!(nvrtc_present(), "libnvrtc not found");
        for cc in [(9, 0), (8, 0)] {
            let (ptx, arch) = compile(cc).expect("kernels compile");
            assert_eq!(arch, format!("sm_{}{}", cc.0, cc.1));
            let src = ptx.to_src();
            for k in KERNELS {
                assert!(src.contains(&format!(".entry {k}(")), "kernel {k} missing");
            }
            // The L2 and HBM chases must bypass L1; the shared-memory read must be 16 B wide.
            assert!(src.contains("ld.global.cg.u32"));
            assert!(src.contains("ld.shared.v4.f32"));
        }
    }
}
