//! Theoretical memory bandwidth from NVML: bus width (bits) / 8 x maximum memory clock x 2
//! (double data rate). NVML is loaded at run time; where it is absent the probe says so and
//! carries on.

use crate::report::TheoreticalBandwidth;
use nvml_wrapper::enum_wrappers::device::Clock;
use nvml_wrapper::Nvml;

/// Bytes per second of a `bus_bits`-wide bus at `mem_clock_mhz`, double data rate, in GB/s.
pub fn theoretical_gbps(bus_bits: u32, mem_clock_mhz: u32) -> f64 {
    f64::from(bus_bits) / 8.0 * f64::from(mem_clock_mhz) * 1e6 * 2.0 / 1e9
}

/// Reads the device with this UUID (as nvidia-smi prints it) through NVML.
pub(crate) fn theoretical(uuid: &str) -> Result<TheoreticalBandwidth, String> {
    let nvml = Nvml::init().map_err(|e| format!("NVML unavailable: {e}"))?;
    let dev = nvml
        .device_by_uuid(uuid)
        .map_err(|e| format!("NVML does not know {uuid}: {e}"))?;
    let bus = dev
        .memory_bus_width()
        .map_err(|e| format!("NVML memory bus width: {e}"))?;
    let clock = dev
        .max_clock_info(Clock::Memory)
        .map_err(|e| format!("NVML max memory clock: {e}"))?;
    Ok(TheoreticalBandwidth {
        bus_width_bits: bus,
        max_memory_clock_mhz: clock,
        gbps: theoretical_gbps(bus, clock),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn h200_bus_and_clock_give_4814_gbps() {
        // ANCHORS §3: 6016 bits, 3201 MHz: 752 B x 6402 MT/s = 4814.3 GB/s (ANCHORS rounds
        // it to 4.815 TB/s).
        let g = theoretical_gbps(6016, 3201);
        assert!((g - 4814.304).abs() < 1e-6, "{g}");
        // A100 40 GB: 5120 bits at 1215 MHz = 1555 GB/s (datasheet 1,555 GB/s).
        assert!((theoretical_gbps(5120, 1215) - 1555.2).abs() < 0.1);
    }
}
