//! Sizes, constants shared by the policies, and human-readable formatting.

/// 1 KiB.
pub const KIB: u64 = 1 << 10;
/// 1 MiB.
pub const MIB: u64 = 1 << 20;
/// 1 GiB.
pub const GIB: u64 = 1 << 30;

/// Every block is a multiple of this many bytes (PyTorch's `kMinBlockSize`).
pub const MIN_BLOCK: u64 = 512;
/// Largest request served from the small pool (PyTorch's `kSmallSize`).
pub const SMALL_SIZE: u64 = MIB;
/// Segment size of the small pool (PyTorch's `kSmallBuffer`).
pub const SMALL_BUFFER: u64 = 2 * MIB;
/// Requests below this (and above `SMALL_SIZE`) share 20 MiB segments (`kMinLargeAlloc`).
pub const MIN_LARGE_ALLOC: u64 = 10 * MIB;
/// Segment size for 1–10 MiB requests (PyTorch's `kLargeBuffer`).
pub const LARGE_BUFFER: u64 = 20 * MIB;
/// Large segments are rounded up to this (PyTorch's `kRoundLarge`).
pub const ROUND_LARGE: u64 = 2 * MIB;
/// Physical page size of the CUDA virtual-memory API on current NVIDIA GPUs.
pub const DEFAULT_PAGE: u64 = 2 * MIB;
/// Memory of one NVIDIA H200 as `cudaGetDeviceProperties` reports it (ANCHORS.md §4).
pub const H200_TOTAL_BYTES: u64 = 150_109_880_320;

/// Rounds `n` up to a multiple of `to` (which must be non-zero).
#[inline]
pub fn round_up(n: u64, to: u64) -> u64 {
    n.div_ceil(to) * to
}

/// Formats a byte count the way PyTorch's `format_size` does ("1.50 GiB"), boundaries included
/// (exactly 1 MiB is "1024.00 KiB"), so that OOM messages read as PyTorch's do.
pub fn format_size(bytes: u64) -> String {
    if bytes <= 1_048_576 {
        format!("{:.2} KiB", bytes as f64 / 1024.0)
    } else if bytes <= 1_073_741_824 {
        format!("{:.2} MiB", bytes as f64 / 1_048_576.0)
    } else {
        format!("{:.2} GiB", bytes as f64 / 1_073_741_824.0)
    }
}

/// Parses "512", "4KiB", "2MB", "1.5GiB", "80G" into bytes. Decimal and binary units are
/// both taken as binary (as PyTorch users write them).
pub fn parse_size(text: &str) -> Option<u64> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => KIB,
        "m" | "mb" | "mib" => MIB,
        "g" | "gb" | "gib" => GIB,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return None,
    };
    if !num.contains('.') {
        // Whole numbers exactly (an f64 rounds byte counts above 2^53).
        return num.parse::<u64>().ok()?.checked_mul(mult);
    }
    let value: f64 = num.parse().ok()?;
    let bytes = value * mult as f64;
    (bytes.is_finite() && bytes >= 0.0 && bytes < u64::MAX as f64).then_some(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_byte_counts_parse_exactly() {
        assert_eq!(parse_size("9007199254740993"), Some((1 << 53) + 1));
        assert_eq!(parse_size("18446744073709551615"), Some(u64::MAX));
        assert_eq!(parse_size("18446744073709551616"), None);
        assert_eq!(parse_size("16777216TiB"), None); // 2^64: overflows
        assert_eq!(parse_size("3GiB"), Some(3 << 30));
        assert_eq!(parse_size("1.5KiB"), Some(1536));
    }

    #[test]
    fn rounding() {
        assert_eq!(round_up(1, 512), 512);
        assert_eq!(round_up(512, 512), 512);
        assert_eq!(round_up(513, 512), 1024);
    }

    #[test]
    fn sizes_parse_and_format() {
        assert_eq!(parse_size("512"), Some(512));
        assert_eq!(parse_size("4KiB"), Some(4096));
        assert_eq!(parse_size("2MB"), Some(2 * MIB));
        assert_eq!(parse_size("1.5GiB"), Some(3 * GIB / 2));
        assert_eq!(parse_size("80G"), Some(80 * GIB));
        assert_eq!(parse_size("ten"), None);
        assert_eq!(parse_size("5 parsecs"), None);
        assert_eq!(format_size(1024), "1.00 KiB");
        assert_eq!(format_size(3 * MIB / 2), "1.50 MiB");
        assert_eq!(format_size(3 * GIB), "3.00 GiB");
    }
}
