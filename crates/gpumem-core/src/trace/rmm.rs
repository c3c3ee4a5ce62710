//! RMM's CSV event log (`logging_resource_adaptor`): `Thread,Time,Action,Pointer,Size,Stream`,
//! one row per allocate or deallocate. RMM frees are immediate, so each deallocation becomes
//! a `free_requested` followed by a `free_completed`.

use super::input::Input;
use super::{Event, Kind, Trace, TraceMeta};
use crate::error::TraceError;

fn parse_int(s: &str) -> Option<u64> {
    let s = s.trim();
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(h) => u64::from_str_radix(h, 16).ok(),
        None if s.is_empty() => Some(0),
        None => s.parse().ok(),
    }
}

/// Seconds since the epoch ("1634567890.123456") or a time of day ("21:24:09.471658"), in µs.
fn parse_time(s: &str) -> Option<u64> {
    let s = s.trim();
    let seconds = if s.contains(':') {
        let mut parts = s.split(':');
        let h: f64 = parts.next()?.parse().ok()?;
        let m: f64 = parts.next()?.parse().ok()?;
        let sec: f64 = parts.next()?.parse().ok()?;
        h * 3600.0 + m * 60.0 + sec
    } else {
        s.parse().ok()?
    };
    // Up to about 30,000 years: anything beyond (or negative, or NaN) is not a log's time.
    (0.0..=MAX_SECONDS)
        .contains(&seconds)
        .then_some((seconds * 1e6) as u64)
}

/// The largest time a log line may carry, in seconds (µs totals then stay far from u64::MAX).
const MAX_SECONDS: f64 = 1e12;

/// Longest header quoted in an error message.
const QUOTE_MAX: usize = 200;

/// `text`, cut to its first QUOTE_MAX characters for an error message.
fn quote(text: &str) -> String {
    match text.char_indices().nth(QUOTE_MAX) {
        Some((i, _)) => format!("{}… ({} bytes)", &text[..i], text.len()),
        None => text.to_string(),
    }
}

/// Reads an RMM CSV log.
pub fn read_csv(inp: &mut Input) -> Result<Trace, TraceError> {
    let header = inp.line()?.unwrap_or_default();
    let cols: Vec<String> = header
        .trim_start_matches('\u{feff}')
        .split(',')
        .map(|c| c.trim().to_ascii_lowercase())
        .collect();
    let col = |name: &str| -> Result<usize, TraceError> {
        cols.iter()
            .position(|c| c == name)
            .ok_or_else(|| TraceError::Malformed {
                offset: 0,
                what: format!("RMM log header has no '{name}' column: {}", quote(&header)),
            })
    };
    let (c_time, c_action, c_ptr, c_size) =
        (col("time")?, col("action")?, col("pointer")?, col("size")?);
    let c_stream = cols.iter().position(|c| c == "stream");
    let mut events = Vec::new();
    let mut last_time = 0u64;
    let mut day = 0u64;
    let mut lineno = 1usize;
    loop {
        // Where the line starts in the (decompressed) stream, for its errors.
        let at = inp.offset();
        let Some(line) = inp.line()? else {
            break;
        };
        lineno += 1;
        if line.trim().is_empty() {
            continue;
        }
        let f: Vec<&str> = line.split(',').collect();
        let bad = |what: &str| TraceError::Malformed {
            offset: at,
            what: format!("line {lineno}: {what}: {}", quote(&line)),
        };
        let get = |i: usize| f.get(i).copied().ok_or_else(|| bad("too few columns"));
        let mut time = parse_time(get(c_time)?).ok_or_else(|| bad("bad time"))?;
        // Times of day wrap at midnight.
        if get(c_time)?.contains(':') {
            time += day;
            if time + 3_600_000_000 < last_time {
                day += 86_400_000_000;
                time += 86_400_000_000;
            }
        }
        // (Times are at most MAX_SECONDS, and a day is added only when the clock goes back by
        // an hour, so these sums stay far below u64::MAX.)
        last_time = time;
        let addr = parse_int(get(c_ptr)?).ok_or_else(|| bad("bad pointer"))?;
        let size = parse_int(get(c_size)?).ok_or_else(|| bad("bad size"))?;
        let stream = match c_stream {
            Some(c) => parse_int(get(c)?).ok_or_else(|| bad("bad stream"))?,
            None => 0,
        };
        let action = get(c_action)?.trim().to_ascii_lowercase();
        let ev = |kind| Event {
            kind,
            stream,
            addr,
            size,
            time_us: time,
        };
        match action.as_str() {
            "allocate" => events.push(ev(Kind::Alloc)),
            "free" | "deallocate" => {
                events.push(ev(Kind::FreeRequested));
                events.push(ev(Kind::FreeCompleted));
            }
            "allocate failure" | "allocate_failure" => events.push(ev(Kind::Oom)),
            other => return Err(bad(&format!("unknown action '{other}'"))),
        }
    }
    Ok(Trace {
        events,
        meta: TraceMeta {
            format: "rmm-csv".into(),
            ..TraceMeta::default()
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Trace, TraceError> {
        let mut inp = Input::open(
            Box::new(std::io::Cursor::new(text.as_bytes().to_vec())),
            "t.csv",
            None,
        )?;
        read_csv(&mut inp)
    }

    #[test]
    fn reads_rows() {
        let t = parse(
            "Thread,Time,Action,Pointer,Size,Stream\n\
             1,1634567890.5,allocate,0x7f0000000000,1024,0x10\n\
             1,1634567890.75,deallocate,0x7f0000000000,1024,0x10\n",
        )
        .unwrap();
        assert_eq!(t.events.len(), 3);
        assert_eq!(t.events[0].kind, Kind::Alloc);
        assert_eq!(t.events[0].addr, 0x7f00_0000_0000);
        assert_eq!(t.events[0].stream, 0x10);
        assert_eq!(t.events[0].time_us, 1_634_567_890_500_000);
        // A deallocate row is a free requested and completed at once, both at its time.
        assert_eq!(t.events[1].kind, Kind::FreeRequested);
        assert_eq!(t.events[2].kind, Kind::FreeCompleted);
        for e in &t.events {
            assert_eq!((e.addr, e.size, e.stream), (0x7f00_0000_0000, 1024, 0x10));
        }
        assert_eq!(t.events[1].time_us, 1_634_567_890_750_000);
        assert_eq!(t.events[2].time_us, 1_634_567_890_750_000);
    }

    #[test]
    fn time_of_day_format() {
        let t = parse("Thread,Time,Action,Pointer,Size,Stream\n1,01:00:00.5,allocate,16,512,0\n")
            .unwrap();
        assert_eq!(t.events[0].time_us, 3_600_500_000);
    }

    #[test]
    fn bad_rows_name_the_line() {
        let e = parse("Thread,Time,Action,Pointer,Size,Stream\n1,2.0,allocate,zz,1,0\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 2") && e.contains("bad pointer"), "{e}");
        // The byte is where the line starts (the header's 39 bytes), not the line's number.
        assert!(e.contains("at byte 39:"), "{e}");
        let e = parse("Thread,Time,Action,Pointer,Size,Stream\n1,2.0,borrow,16,1,0\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown action 'borrow'"), "{e}");
        let e = parse("Thread,When,What\n").unwrap_err().to_string();
        assert!(e.contains("no 'time' column"), "{e}");
    }
}
