//! Allocation traces: the events an allocator saw, read from PyTorch snapshot pickles
//! (`torch.cuda.memory._snapshot()`, plain or gzipped), RMM's CSV event logs, or gpumem's own
//! compact format. Every reader streams: it decodes as it reads, without building the file's
//! whole object tree, and keeps only the compact events.

pub mod compact;
pub mod input;
pub mod pickle;
pub mod rmm;

use crate::error::TraceError;
use serde::{Deserialize, Serialize};
use std::io::Read;
use std::path::Path;

/// What an event records, with PyTorch's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[repr(u8)]
pub enum Kind {
    /// A block was handed out (`size` is the requested size).
    Alloc = 0,
    /// The user freed it.
    FreeRequested = 1,
    /// It became reusable (after other streams' events).
    FreeCompleted = 2,
    /// The recording allocator took a segment from the device.
    SegmentAlloc = 3,
    /// It returned one.
    SegmentFree = 4,
    /// It mapped pages (expandable segments).
    SegmentMap = 5,
    /// It unmapped pages.
    SegmentUnmap = 6,
    /// A request failed for lack of memory.
    Oom = 7,
    /// A snapshot was taken.
    Snapshot = 8,
}

impl Kind {
    /// From PyTorch's action name.
    pub fn from_torch(name: &str) -> Option<Kind> {
        Some(match name {
            "alloc" => Kind::Alloc,
            "free_requested" => Kind::FreeRequested,
            "free_completed" => Kind::FreeCompleted,
            "segment_alloc" => Kind::SegmentAlloc,
            "segment_free" => Kind::SegmentFree,
            "segment_map" => Kind::SegmentMap,
            "segment_unmap" => Kind::SegmentUnmap,
            "oom" => Kind::Oom,
            "snapshot" => Kind::Snapshot,
            _ => return None,
        })
    }

    /// PyTorch's action name.
    pub fn torch_name(self) -> &'static str {
        match self {
            Kind::Alloc => "alloc",
            Kind::FreeRequested => "free_requested",
            Kind::FreeCompleted => "free_completed",
            Kind::SegmentAlloc => "segment_alloc",
            Kind::SegmentFree => "segment_free",
            Kind::SegmentMap => "segment_map",
            Kind::SegmentUnmap => "segment_unmap",
            Kind::Oom => "oom",
            Kind::Snapshot => "snapshot",
        }
    }

    /// From the compact format's tag.
    pub fn from_u8(v: u8) -> Option<Kind> {
        use Kind::*;
        [
            Alloc,
            FreeRequested,
            FreeCompleted,
            SegmentAlloc,
            SegmentFree,
            SegmentMap,
            SegmentUnmap,
            Oom,
            Snapshot,
        ]
        .get(v as usize)
        .copied()
    }
}

/// One event of a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    /// What happened.
    pub kind: Kind,
    /// Stream handle.
    pub stream: u64,
    /// Address.
    pub addr: u64,
    /// Bytes (requested size for allocations, segment size for segment events).
    pub size: u64,
    /// Microseconds (since the epoch in PyTorch traces; relative in others).
    pub time_us: u64,
}

/// Where a trace came from and what it says about its recording.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TraceMeta {
    /// The file it was read from.
    pub source: String,
    /// "pytorch-snapshot", "rmm-csv" or "gpumem".
    pub format: String,
    /// The device the events belong to.
    pub device: u32,
    /// Whether the recording allocator used expandable segments (PyTorch snapshots).
    pub expandable_segments: Option<bool>,
    /// `PYTORCH_CUDA_ALLOC_CONF` at recording time.
    pub alloc_conf: Option<String>,
    /// Entries the reader left out: an action gpumem does not replay (`oom`, `snapshot`...)
    /// or none.
    #[serde(default)]
    pub skipped_entries: u64,
    /// Segments that belonged to private pools (CUDA graphs, MemPools) when the snapshot was
    /// taken (PyTorch snapshots).
    #[serde(default)]
    pub pool_segments: u64,
}

/// A trace in memory.
#[derive(Debug, Clone, Default)]
pub struct Trace {
    /// Events in order.
    pub events: Vec<Event>,
    /// Where it came from.
    pub meta: TraceMeta,
}

impl Trace {
    /// What a replay of this trace leaves out or ignores, one line each (none for a clean
    /// trace): entries with an action gpumem does not replay, allocations of 0 bytes (which
    /// PyTorch never records: a size the reader could not read as a byte count), and frees of
    /// addresses with no live allocation.
    pub fn warnings(&self) -> Vec<String> {
        let mut live: rustc_hash::FxHashSet<(u64, u64)> = Default::default();
        let (mut zero, mut unknown_frees, mut realloc) = (0u64, 0u64, 0u64);
        for e in &self.events {
            match e.kind {
                Kind::Alloc if e.size == 0 => zero += 1,
                // The guard records the address; it fails (falls through) when it was not live.
                Kind::Alloc if !live.insert((e.stream, e.addr)) => realloc += 1,
                Kind::FreeRequested if !live.contains(&(e.stream, e.addr)) => unknown_frees += 1,
                Kind::FreeCompleted => {
                    live.remove(&(e.stream, e.addr));
                }
                _ => {}
            }
        }
        let mut w = Vec::new();
        if !self
            .events
            .iter()
            .any(|e| e.kind == Kind::Alloc && e.size > 0)
        {
            w.push(
                "the trace holds no allocation to replay (a PyTorch snapshot has them only if \
                 torch.cuda.memory._record_memory_history was on while the program ran)"
                    .into(),
            );
        }
        if self.meta.skipped_entries > 0 {
            w.push(format!(
                "{} entries have an action gpumem does not replay (such as oom or snapshot) or none; \
                 they were left out",
                self.meta.skipped_entries
            ));
        }
        if self.meta.pool_segments > 0 {
            w.push(format!(
                "{} segments belonged to private pools (CUDA graphs or MemPools) when the \
                 snapshot was taken; the replay serves every allocation from the ordinary pools, \
                 so memory a graph kept to itself may be shared here",
                self.meta.pool_segments
            ));
        }
        if zero > 0 {
            w.push(format!(
                "{zero} allocations of 0 bytes (or of a size that is not a byte count) were left out"
            ));
        }
        if realloc > 0 {
            w.push(format!(
                "{realloc} allocations at an address that was still live (the trace lacks its \
                 free); the earlier block was taken as freed there"
            ));
        }
        if unknown_frees > 0 {
            w.push(format!(
                "{unknown_frees} frees of addresses with no live allocation were ignored"
            ));
        }
        w
    }

    /// Whether the trace has the recording allocator's own segment events (which a
    /// simulation of it can be checked against).
    pub fn has_segment_events(&self) -> bool {
        self.events
            .iter()
            .any(|e| matches!(e.kind, Kind::SegmentAlloc | Kind::SegmentMap))
    }

    /// Streams that appear, in order of first appearance.
    pub fn streams(&self) -> Vec<u64> {
        let mut v: Vec<u64> = Vec::new();
        for e in &self.events {
            if !v.contains(&e.stream) {
                v.push(e.stream);
            }
        }
        v
    }

    /// Number of allocation events.
    pub fn allocs(&self) -> usize {
        self.events.iter().filter(|e| e.kind == Kind::Alloc).count()
    }
}

/// The formats gpumem reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// A PyTorch snapshot pickle.
    TorchPickle,
    /// RMM's CSV event log.
    RmmCsv,
    /// gpumem's compact format.
    Compact,
}

/// Recognises a format from the first bytes of the (decompressed) content.
pub fn sniff(head: &[u8]) -> Option<Format> {
    if head.starts_with(compact::MAGIC) {
        Some(Format::Compact)
    } else if head.first() == Some(&0x80) {
        Some(Format::TorchPickle)
    } else if head.starts_with(b"Thread,Time,Action") || head.starts_with(b"\xef\xbb\xbfThread,") {
        Some(Format::RmmCsv)
    } else {
        None
    }
}

/// Reads a trace file of any known format, gzipped or not, keeping the events of `device`.
/// `progress` is called with the compressed bytes read so far, for progress bars.
pub fn load(
    path: &Path,
    device: u32,
    progress: Option<input::Progress>,
) -> Result<Trace, TraceError> {
    let name = path.display().to_string();
    let io = |source| TraceError::Io {
        path: name.clone(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let hint = decompressed_size(&file).map_err(io)?;
    let mut t = read_sized(Box::new(file), &name, device, progress, hint)?;
    t.meta.source = name;
    Ok(t)
}

/// The size of the file's content once decompressed: a gzip file says it (modulo 4 GiB) in
/// its last four bytes. Used to size the event list once instead of growing it.
fn decompressed_size(file: &std::fs::File) -> std::io::Result<Option<u64>> {
    use std::io::{Seek, SeekFrom};
    let len = file.metadata()?.len();
    let mut f = file;
    let mut magic = [0u8; 2];
    if len < 18 || f.read_exact(&mut magic).is_err() {
        f.seek(SeekFrom::Start(0))?;
        return Ok(Some(len));
    }
    let size = if magic == [0x1f, 0x8b] {
        let mut tail = [0u8; 4];
        f.seek(SeekFrom::End(-4))?;
        f.read_exact(&mut tail)?;
        // Below 4 GiB exactly; above, a lower bound is still a fine first capacity.
        Some(u32::from_le_bytes(tail) as u64)
    } else {
        Some(len)
    };
    f.seek(SeekFrom::Start(0))?;
    Ok(size)
}

/// Reads a trace from any reader (gzip detected by its magic number).
pub fn read(
    src: Box<dyn Read + Send>,
    name: &str,
    device: u32,
    progress: Option<input::Progress>,
) -> Result<Trace, TraceError> {
    read_sized(src, name, device, progress, None)
}

/// [`read`], knowing (roughly) how many bytes the content has once decompressed.
fn read_sized(
    src: Box<dyn Read + Send>,
    name: &str,
    device: u32,
    progress: Option<input::Progress>,
    size_hint: Option<u64>,
) -> Result<Trace, TraceError> {
    let mut inp = input::Input::open(src, name, progress)?;
    inp.size_hint = size_hint;
    let head = inp.peek(32)?;
    let fmt = sniff(&head).ok_or_else(|| {
        TraceError::UnknownFormat(format!(
            "{name}: not a PyTorch snapshot pickle, an RMM CSV log or a gpumem trace \
             (first bytes {:02x?})",
            &head[..head.len().min(8)]
        ))
    })?;
    let mut trace = match fmt {
        Format::TorchPickle => pickle::read_snapshot(&mut inp, device)?,
        Format::RmmCsv => rmm::read_csv(&mut inp)?,
        Format::Compact => compact::read(&mut inp)?,
    };
    trace.meta.source = name.to_string();
    validate(&trace)?;
    Ok(trace)
}

/// Checks that the events make sense together: sizes are sane and no address is allocated
/// twice without a free in between.
pub fn validate(t: &Trace) -> Result<(), TraceError> {
    // Live blocks, each with whether its free was requested already. Zero-byte allocations are
    // left out of the replay, so they are not tracked here either.
    let mut live: rustc_hash::FxHashMap<(u64, u64), bool> = Default::default();
    for (i, e) in t.events.iter().enumerate() {
        match e.kind {
            Kind::Alloc => {
                if e.size > (1u64 << 50) {
                    return Err(TraceError::Inconsistent {
                        index: i,
                        what: format!("allocation of {} bytes is not plausible", e.size),
                    });
                }
                if e.size > 0 && live.insert((e.stream, e.addr), false).is_some() {
                    return Err(TraceError::Inconsistent {
                        index: i,
                        what: format!("address {:#x} allocated twice without a free", e.addr),
                    });
                }
            }
            Kind::FreeRequested => {
                if let Some(requested) = live.get_mut(&(e.stream, e.addr)) {
                    if std::mem::replace(requested, true) {
                        return Err(TraceError::Inconsistent {
                            index: i,
                            what: format!(
                                "the free of address {:#x} requested twice (an allocator \
                                 records one request per block)",
                                e.addr
                            ),
                        });
                    }
                }
            }
            Kind::FreeCompleted => {
                live.remove(&(e.stream, e.addr));
            }
            _ => {}
        }
    }
    Ok(())
}

/// A gzip writer (for `.gmt.gz` output).
pub fn gzip_writer<W: std::io::Write>(w: W) -> impl std::io::Write {
    flate2::write::GzEncoder::new(w, flate2::Compression::default())
}
