//! gpumem's own trace format: a small JSON header and varint-coded events with
//! delta-coded addresses and times, typically 5–8 bytes an event. Optionally gzipped.
//!
//! ```text
//! "GMTRACE1\n"  u32-le header length  header (JSON TraceMeta)
//! repeated: kind (u8)  stream (varint)  addr delta (zigzag varint)  size (varint)  time delta (zigzag varint)
//! 0xff
//! ```

use super::input::Input;
use super::{Event, Kind, Trace, TraceMeta};
use crate::error::TraceError;
use std::io::Write;

/// The first bytes of a compact trace.
pub const MAGIC: &[u8] = b"GMTRACE1\n";
const END: u8 = 0xff;

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

fn unzigzag(v: u64) -> i64 {
    ((v >> 1) as i64) ^ -((v & 1) as i64)
}

/// Writes `trace` in the compact format.
pub fn write(trace: &Trace, w: &mut dyn Write) -> std::io::Result<()> {
    let header = serde_json::to_vec(&trace.meta).map_err(std::io::Error::other)?;
    w.write_all(MAGIC)?;
    w.write_all(&(header.len() as u32).to_le_bytes())?;
    w.write_all(&header)?;
    let mut buf = Vec::with_capacity(1 << 16);
    let (mut addr, mut time) = (0u64, 0u64);
    for e in &trace.events {
        buf.push(e.kind as u8);
        put_varint(&mut buf, e.stream);
        put_varint(&mut buf, zigzag(e.addr.wrapping_sub(addr) as i64));
        put_varint(&mut buf, e.size);
        put_varint(&mut buf, zigzag(e.time_us.wrapping_sub(time) as i64));
        addr = e.addr;
        time = e.time_us;
        if buf.len() > 1 << 15 {
            w.write_all(&buf)?;
            buf.clear();
        }
    }
    buf.push(END);
    w.write_all(&buf)
}

fn varint(inp: &mut Input, what: &str) -> Result<u64, TraceError> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let Some(b) = inp.next_byte()? else {
            return Err(TraceError::Truncated(format!(
                "{}: inside {what}",
                inp.name()
            )));
        };
        v |= ((b & 0x7f) as u64) << shift;
        if b & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err(TraceError::Malformed {
        offset: inp.offset(),
        what: format!("{what}: varint longer than 64 bits"),
    })
}

/// Reads a compact trace.
pub fn read(inp: &mut Input) -> Result<Trace, TraceError> {
    inp.take(MAGIC.len(), "magic")?;
    let n = inp.take(4, "header length")?;
    let n = u32::from_le_bytes([n[0], n[1], n[2], n[3]]) as usize;
    if n > 1 << 24 {
        return Err(TraceError::Malformed {
            offset: inp.offset(),
            what: format!("header of {n} bytes"),
        });
    }
    let off = inp.offset();
    let meta: TraceMeta =
        serde_json::from_slice(inp.take(n, "header")?).map_err(|e| TraceError::Malformed {
            offset: off,
            what: format!("header is not valid JSON: {e}"),
        })?;
    let mut events = Vec::new();
    let (mut addr, mut time) = (0u64, 0u64);
    loop {
        let off = inp.offset();
        let Some(tag) = inp.next_byte()? else {
            return Err(TraceError::Truncated(format!(
                "{}: the event list has no end marker (file cut short?)",
                inp.name()
            )));
        };
        if tag == END {
            break;
        }
        let kind = Kind::from_u8(tag).ok_or_else(|| TraceError::Malformed {
            offset: off,
            what: format!("unknown event kind {tag}"),
        })?;
        let stream = varint(inp, "stream")?;
        addr = addr.wrapping_add(unzigzag(varint(inp, "address")?) as u64);
        let size = varint(inp, "size")?;
        time = time.wrapping_add(unzigzag(varint(inp, "time")?) as u64);
        events.push(Event {
            kind,
            stream,
            addr,
            size,
            time_us: time,
        });
    }
    Ok(Trace { events, meta })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Trace {
        let ev = |kind, addr, size, time_us| Event {
            kind,
            stream: 7,
            addr,
            size,
            time_us,
        };
        Trace {
            events: vec![
                ev(Kind::SegmentAlloc, 0x7f00_0000_0000, 2 << 20, 100),
                ev(Kind::Alloc, 0x7f00_0000_0000, 3072, 101),
                ev(Kind::Alloc, 0x7f00_0000_0c00, 512, 99),
                ev(Kind::FreeRequested, 0x7f00_0000_0000, 3072, 150),
                ev(Kind::FreeCompleted, 0x7f00_0000_0000, 3072, 150),
            ],
            meta: TraceMeta {
                format: "gpumem".into(),
                ..TraceMeta::default()
            },
        }
    }

    fn roundtrip(bytes: Vec<u8>) -> Result<Trace, TraceError> {
        let mut inp = Input::open(Box::new(std::io::Cursor::new(bytes)), "t.gmt", None)?;
        read(&mut inp)
    }

    #[test]
    fn roundtrip_is_exact() {
        let t = sample();
        let mut bytes = Vec::new();
        write(&t, &mut bytes).unwrap();
        let header = u32::from_le_bytes([bytes[9], bytes[10], bytes[11], bytes[12]]) as usize;
        let body = bytes.len() - 13 - header;
        // Five events with small deltas: a handful of bytes each, plus the end marker.
        assert!(body <= 5 * 9 + 1, "compact body: {body} bytes");
        let back = roundtrip(bytes).unwrap();
        assert_eq!(back.events, t.events);
        assert_eq!(back.meta, t.meta);
    }

    #[test]
    fn truncation_and_garbage_are_errors() {
        let mut bytes = Vec::new();
        write(&sample(), &mut bytes).unwrap();
        for cut in [5, 12, bytes.len() - 1, bytes.len() - 3] {
            let e = roundtrip(bytes[..cut].to_vec()).unwrap_err();
            assert!(
                matches!(e, TraceError::Truncated(_) | TraceError::Malformed { .. }),
                "cut {cut}: {e}"
            );
        }
        let mut bad = bytes.clone();
        let hdr = 9 + 4 + u32::from_le_bytes([bytes[9], bytes[10], bytes[11], bytes[12]]) as usize;
        bad[hdr] = 42;
        assert!(roundtrip(bad)
            .unwrap_err()
            .to_string()
            .contains("unknown event kind 42"));
    }
}
