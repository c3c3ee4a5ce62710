//! Configuration from a string in the style of `PYTORCH_CUDA_ALLOC_CONF`:
//! `GPUMEM_CONF="policy:stitched,prealloc:0.9,fraction:0.95"`.
//!
//! | key | value | meaning |
//! |---|---|---|
//! | `policy` | native, expandable, caching, buddy, stitched | placement policy (default stitched) |
//! | `prealloc` | bytes (`80GiB`) or a fraction of the device (`0.9`) | memory taken at start |
//! | `fraction` | 0 < f ≤ 1 | cap on memory held, as a share of the device |
//! | `cap` | bytes | cap on memory held |
//! | `slack` | ≥ 0 | stitched: spare pages beyond the in-use peak, as a fraction of it |
//! | `shared_spare` | 0..1 | stitched, several streams in one range: pages made rather than remapped while the pages held stay within this share of the range's live peak in requested bytes (default 0.02) |
//! | `page` | bytes, a power of two (`16MiB`) | stitched: the physical page (one handle each), a multiple of the device's granularity (2 MiB): kernels stream faster over larger ones, blocks hold whole pages |
//! | `big_page` | bytes, a power of two (default `16MiB`), or `off` | stitched: once the pool holds `big_after`, new blocks go to a second pool whose pages are this size (a large pool grows for a fraction of the driver calls; the blocks placed before stay on the first pages, which still take blocks that fit where their pages are mapped) |
//! | `big_after` | bytes (default `8GiB`) | stitched: bytes held from which `big_page` applies |
//! | `va_factor` | integer ≥ 1 | stitched: virtual space per stream, in device sizes |
//! | `stream_pages` | shared, own | stitched: pages held up to the highest total in use (shared), or up to the sum of each stream's own peak (own: fewer remaps with many streams, more memory) |
//! | `range` | auto, stream, shared | stitched: one virtual range per stream, or one range shared by the device's streams, with blocks and pages handed between them through events (less memory with several streams, one placement lock for all); auto (default): the first stream's range alone until a second stream allocates, then that range shared by all |
//! | `spill` | auto, off, n ≥ 1 | stitched, with `range:shared` (or `range:auto` once shared): when a stream places blocks in a range of its own; auto (default): for good, once the shared range's lock is contended (threads that do nothing but allocate); n: every n-th allocation (a testing aid) |
//! | `trade_budget` | 0 < f ≤ 1, or `off` | stitched, several streams: share of the time that moving idle pages between streams may cost before the streams keep their own peaks instead (default 0.1) |
//! | `history` | entries | keep a ring buffer of the last N allocation events (0: off) |
//! | `leak_check` | 0/1 | track live allocations (for leak reports) |
//! | `backtraces` | 0/1 | capture a backtrace at each allocation (with history or leak_check) |
//! | `costs` | h200, zero | the driver-cost model used for estimates |

use crate::backend::CostModel;
use crate::error::AllocError;
use crate::policy::shared_range::Spill;
use crate::policy::RangeMode;
use crate::policy::{PolicyKind, PolicyOptions};
use crate::units::parse_size;

/// An amount of memory given either in bytes or as a share of the device.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Amount {
    /// Bytes.
    Bytes(u64),
    /// A fraction of the device's total memory (0..=1).
    Fraction(f64),
}

impl Amount {
    /// Bytes on a device of `total` bytes.
    pub fn bytes(self, total: u64) -> u64 {
        match self {
            Amount::Bytes(b) => b,
            Amount::Fraction(f) => (total as f64 * f) as u64,
        }
    }

    fn parse(key: &str, v: &str) -> Result<Amount, AllocError> {
        if let Ok(f) = v.parse::<f64>() {
            if v.contains('.') || f <= 1.0 {
                if !(0.0..=1.0).contains(&f) {
                    return Err(AllocError::Config(format!(
                        "{key}:{v}: a fraction must be between 0 and 1"
                    )));
                }
                return Ok(Amount::Fraction(f));
            }
        }
        parse_size(v).map(Amount::Bytes).ok_or_else(|| {
            AllocError::Config(format!(
                "{key}:{v}: expected bytes (e.g. 80GiB) or a fraction (e.g. 0.9)"
            ))
        })
    }
}

/// Everything that configures an allocator.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Placement policy.
    pub policy: PolicyKind,
    /// Memory taken at start.
    pub prealloc: Option<Amount>,
    /// Cap on memory held.
    pub cap: Option<Amount>,
    /// The stitched policy's physical page (None: the device's granularity).
    pub page: Option<u64>,
    /// Policy knobs.
    pub options: PolicyOptions,
    /// Ring-buffer size of the allocation history (0: off).
    pub history: usize,
    /// Track live allocations for leak reports.
    pub leak_check: bool,
    /// Capture backtraces for tracked allocations.
    pub backtraces: bool,
    /// Driver-cost model.
    pub costs: CostModel,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            policy: PolicyKind::Stitched,
            prealloc: None,
            cap: None,
            page: None,
            options: PolicyOptions::default(),
            history: 0,
            leak_check: false,
            backtraces: false,
            costs: CostModel::h200(),
        }
    }
}

fn flag(key: &str, v: &str) -> Result<bool, AllocError> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(AllocError::Config(format!(
            "{key}:{v}: expected 0/1 or true/false"
        ))),
    }
}

/// A key with two named values: `off` (the default, false) or `on` (true).
fn one_of(key: &str, v: &str, off: &str, on: &str) -> Result<bool, AllocError> {
    if v == off {
        Ok(false)
    } else if v == on {
        Ok(true)
    } else {
        Err(AllocError::Config(format!(
            "{key}:{v}: expected {off} or {on}"
        )))
    }
}

/// A number in `[lo, hi]` (NaN refused).
fn number_in(key: &str, v: &str, lo: f64, hi: f64) -> Result<f64, AllocError> {
    v.parse::<f64>()
        .ok()
        .filter(|x| (lo..=hi).contains(x))
        .ok_or_else(|| AllocError::Config(format!("{key}:{v}: expected a number in [{lo}, {hi}]")))
}

/// A share of the time in (0, 1], or `off` (infinite: never), for the budget keys.
fn share_or_off(key: &str, v: &str) -> Result<f64, AllocError> {
    if v == "off" {
        return Ok(f64::INFINITY);
    }
    v.parse::<f64>()
        .ok()
        .filter(|f| *f > 0.0 && *f <= 1.0)
        .ok_or_else(|| {
            AllocError::Config(format!(
                "{key}:{v}: expected a share of the time in (0, 1], or off"
            ))
        })
}

impl Config {
    /// Parses `key:value,key:value`. Unknown keys and bad values are errors that name them.
    pub fn parse(text: &str) -> Result<Config, AllocError> {
        let mut c = Config::default();
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (k, v) = item
                .split_once(':')
                .ok_or_else(|| AllocError::Config(format!("'{item}': expected key:value")))?;
            let (k, v) = (k.trim(), v.trim());
            match k {
                "policy" => {
                    c.policy = PolicyKind::parse(v).ok_or_else(|| {
                        AllocError::Config(format!(
                        "policy:{v}: unknown policy (native, expandable, caching, buddy, stitched)"
                    ))
                    })?
                }
                "prealloc" => c.prealloc = Some(Amount::parse(k, v)?),
                "fraction" => match Amount::parse(k, v)? {
                    Amount::Fraction(f) if f > 0.0 => c.cap = Some(Amount::Fraction(f)),
                    _ => {
                        return Err(AllocError::Config(format!(
                            "fraction:{v}: expected a fraction in (0, 1]"
                        )))
                    }
                },
                "cap" => match Amount::parse(k, v)? {
                    Amount::Bytes(0) => {
                        return Err(AllocError::Config(format!(
                            "cap:{v}: a cap of nothing would refuse every allocation"
                        )))
                    }
                    Amount::Fraction(f) if f <= 0.0 => {
                        return Err(AllocError::Config(format!(
                            "cap:{v}: a cap of nothing would refuse every allocation"
                        )))
                    }
                    a => c.cap = Some(a),
                },
                "page" => {
                    c.page = Some(parse_size(v).filter(|b| b.is_power_of_two()).ok_or_else(
                        || {
                            AllocError::Config(format!(
                                "page:{v}: expected a power of two of bytes (e.g. 16MiB)"
                            ))
                        },
                    )?)
                }
                "slack" => c.options.slack = number_in(k, v, 0.0, 10.0)?,
                "shared_spare" => c.options.shared_spare = number_in(k, v, 0.0, 1.0)?,
                "big_page" => {
                    c.options.big_page = match v {
                        "off" | "0" => 0,
                        _ => parse_size(v)
                            // Under the driver's 2 MiB granularity a second tier could not
                            // exist: the policy would drop it without a word.
                            .filter(|b| b.is_power_of_two() && (2 << 20..=1 << 30).contains(b))
                            .ok_or_else(|| {
                                AllocError::Config(format!(
                                    "big_page:{v}: expected a power of two of bytes from 2MiB up \
                                     to 1GiB (e.g. 16MiB), or off"
                                ))
                            })?,
                    }
                }
                "big_after" => {
                    c.options.big_after = parse_size(v).ok_or_else(|| {
                        AllocError::Config(format!("big_after:{v}: expected bytes (e.g. 4GiB)"))
                    })?
                }
                "va_factor" => {
                    c.options.va_factor = v
                        .parse::<u64>()
                        .ok()
                        .filter(|f| (1..=64).contains(f))
                        .ok_or_else(|| {
                            AllocError::Config(format!("va_factor:{v}: expected 1..64"))
                        })?
                }
                "stream_pages" => c.options.own_stream_peaks = one_of(k, v, "shared", "own")?,
                "range" => {
                    c.options.range = RangeMode::parse(v).ok_or_else(|| {
                        AllocError::Config(format!("range:{v}: expected auto, stream or shared"))
                    })?
                }
                "spill" => {
                    c.options.spill = match v {
                        "auto" => Spill::Auto,
                        "off" => Spill::Off,
                        _ => Spill::Every(v.parse::<u32>().ok().filter(|&n| n >= 1).ok_or_else(
                            || {
                                AllocError::Config(format!(
                                    "spill:{v}: expected auto, off or a count of allocations (1 or more)"
                                ))
                            },
                        )?),
                    }
                }
                "trade_budget" => c.options.trade_budget = share_or_off(k, v)?,
                "remap_budget" => c.options.remap_budget = share_or_off(k, v)?,
                "history" => {
                    c.history = v.parse().map_err(|_| {
                        AllocError::Config(format!("history:{v}: expected a number of entries"))
                    })?
                }
                "leak_check" => c.leak_check = flag(k, v)?,
                "backtraces" => c.backtraces = flag(k, v)?,
                "costs" => {
                    c.costs = match v {
                        "h200" => CostModel::h200(),
                        "zero" => CostModel::zero(),
                        _ => {
                            return Err(AllocError::Config(format!(
                                "costs:{v}: expected h200 or zero"
                            )))
                        }
                    }
                }
                _ => {
                    return Err(AllocError::Config(format!(
                        "unknown key '{k}' (known: policy, prealloc, fraction, cap, page, slack, \
                         shared_spare, big_page, big_after, va_factor, stream_pages, range, spill, trade_budget, remap_budget, history, leak_check, backtraces, \
                         costs)"
                    )))
                }
            }
        }
        Ok(c)
    }

    /// The configuration in `GPUMEM_CONF`, or the default when it is unset.
    /// `GPUMEM_LEAK_CHECK=1` turns on leak tracking with backtraces on top of it (the
    /// embedding program prints the report at exit, see `report::leaks::print_at_exit`).
    pub fn from_env() -> Result<Config, AllocError> {
        Self::from_vars(
            std::env::var("GPUMEM_CONF").ok().as_deref(),
            std::env::var("GPUMEM_LEAK_CHECK").ok().as_deref(),
        )
    }

    /// [`Config::from_env`] with the two variables given (`None`: unset).
    pub fn from_vars(conf: Option<&str>, leak_check: Option<&str>) -> Result<Config, AllocError> {
        let mut c = match conf {
            Some(s) => Config::parse(s)?,
            None => Config::default(),
        };
        if let Some(v) = leak_check.map(str::trim).filter(|v| !v.is_empty()) {
            if flag("GPUMEM_LEAK_CHECK", v)? {
                c.leak_check = true;
                c.backtraces = true;
            }
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::units::GIB;

    #[test]
    fn parses_all_keys() {
        let c = Config::parse(
            "policy:buddy, prealloc:0.9,cap:40GiB,slack:0.02,history:1000,leak_check:1,backtraces:true,costs:zero",
        )
        .unwrap();
        assert_eq!(c.policy, PolicyKind::Buddy);
        assert_eq!(c.prealloc, Some(Amount::Fraction(0.9)));
        assert_eq!(c.cap, Some(Amount::Bytes(40 * GIB)));
        assert_eq!(c.options.slack, 0.02);
        assert_eq!(c.costs, CostModel::zero());
        assert_eq!(
            Config::parse("shared_spare:0.03")
                .unwrap()
                .options
                .shared_spare,
            0.03
        );
        assert_eq!(
            Config::parse("").unwrap().options.shared_spare,
            crate::policy::SHARED_SPARE
        );
        assert!(!c.options.own_stream_peaks);
        assert!(
            Config::parse("stream_pages:own")
                .unwrap()
                .options
                .own_stream_peaks
        );
        assert_eq!(
            Config::parse("stream_pages:shared").unwrap(),
            Config::default()
        );
        assert_eq!(Config::default().options.range, RangeMode::Auto);
        for (text, mode) in [
            ("range:shared", RangeMode::Shared),
            ("range:stream", RangeMode::Stream),
            ("range:auto", RangeMode::Auto),
        ] {
            assert_eq!(Config::parse(text).unwrap().options.range, mode, "{text}");
        }
        assert_eq!(Config::default().options.spill, Spill::Auto);
        assert_eq!(
            Config::parse("spill:off").unwrap().options.spill,
            Spill::Off
        );
        assert_eq!(
            Config::parse("spill:3").unwrap().options.spill,
            Spill::Every(3)
        );
        assert_eq!(Config::default().options.trade_budget, 0.1);
        assert_eq!(
            Config::parse("trade_budget:0.2")
                .unwrap()
                .options
                .trade_budget,
            0.2
        );
        assert!(Config::parse("trade_budget:off")
            .unwrap()
            .options
            .trade_budget
            .is_infinite());
        assert_eq!(Config::default().options.remap_budget, 0.2);
        assert_eq!(
            Config::parse("remap_budget:0.05")
                .unwrap()
                .options
                .remap_budget,
            0.05
        );
        assert!(Config::parse("remap_budget:off")
            .unwrap()
            .options
            .remap_budget
            .is_infinite());
        assert_eq!(c.history, 1000);
        assert!(c.leak_check && c.backtraces);
        assert_eq!(Amount::Fraction(0.5).bytes(100), 50);
        let f = Config::parse("fraction:0.5").unwrap();
        assert_eq!(f.cap, Some(Amount::Fraction(0.5)));
        assert_eq!(Config::parse("").unwrap(), Config::default());
    }

    #[test]
    fn leak_check_variable_turns_on_tracking_with_backtraces() {
        let c = Config::from_vars(Some("policy:caching"), Some("1")).unwrap();
        assert_eq!(c.policy, PolicyKind::Caching);
        assert!(c.leak_check && c.backtraces);
        let off = Config::from_vars(None, Some("0")).unwrap();
        assert!(!off.leak_check && !off.backtraces);
        assert!(!Config::from_vars(None, None).unwrap().leak_check);
        let e = Config::from_vars(None, Some("maybe"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("GPUMEM_LEAK_CHECK"), "{e}");
    }

    #[test]
    fn errors_name_the_problem() {
        for (bad, needle) in [
            ("policy:magic", "unknown policy"),
            ("costs:fast", "expected h200 or zero"),
            ("prealloc:1.5", "between 0 and 1"),
            ("prealloc:lots", "expected bytes"),
            ("fraction:2GiB", "fraction"),
            ("nonsense", "key:value"),
            ("colour:blue", "unknown key 'colour'"),
            ("slack:-1", "slack"),
            ("shared_spare:-0.01", "shared_spare"),
            ("shared_spare:2", "shared_spare"),
            ("shared_spare:NaN", "shared_spare"),
            ("stream_pages:mine", "expected shared or own"),
            ("range:one", "expected auto, stream or shared"),
            ("spill:0", "expected auto, off or a count"),
            ("spill:sometimes", "expected auto, off or a count"),
            ("trade_budget:0", "trade_budget"),
            ("trade_budget:1.5", "trade_budget"),
            ("trade_budget:NaN", "trade_budget"),
            ("trade_budget:never", "or off"),
            ("remap_budget:0", "remap_budget"),
            ("remap_budget:2", "remap_budget"),
            ("remap_budget:inf", "remap_budget"),
            ("remap_budget:sometimes", "or off"),
            ("cap:0", "a cap of nothing"),
            ("cap:0.0", "a cap of nothing"),
            ("cap:0GiB", "a cap of nothing"),
            ("big_page:4KiB", "from 2MiB"),
            ("big_page:1", "from 2MiB"),
        ] {
            let e = Config::parse(bad).unwrap_err().to_string();
            assert!(e.contains(needle), "{bad}: {e}");
        }
    }
}
