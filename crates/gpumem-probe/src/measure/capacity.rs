//! Capacity per level, from device attributes (and the architecture table for L1).

use crate::anchors::l1_plus_smem_per_sm;
use crate::error::{DriverContext, ProbeError};
use crate::gpu::Gpu;
use crate::report::Capacity;
use cudarc::driver::sys::CUdevice_attribute as A;

pub(crate) fn read(gpu: &Gpu) -> Result<Capacity, ProbeError> {
    let a = |x| gpu.attr(x).map(|v| v.max(0) as u64);
    Ok(Capacity {
        registers_per_sm: a(A::CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR)?,
        registers_per_block: a(A::CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK)?,
        smem_per_sm: a(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)?,
        smem_per_block: a(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK)?,
        smem_per_block_optin: a(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?,
        l1_plus_smem_per_sm: l1_plus_smem_per_sm(gpu.cc.0, gpu.cc.1),
        l2_bytes: a(A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?,
        l2_persisting_max: gpu
            .attr_opt(A::CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE)
            .unwrap_or(0) as u64,
        hbm_bytes: gpu.ctx.total_mem().ctx("cuDeviceTotalMem")? as u64,
    })
}
