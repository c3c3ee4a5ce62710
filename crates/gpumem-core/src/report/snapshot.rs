//! Snapshots in PyTorch's format: the allocator's segments and its allocation history as a
//! pickle shaped like `torch.cuda.memory._snapshot()`, which PyTorch's memory visualizer and
//! `python -m torch.cuda._memory_viz` read.
//!
//! The shape (keys, value types, action and state names) follows PyTorch's:
//!
//! ```text
//! {"segments": [{"device", "address", "total_size", "allocated_size", "active_size",
//!                "requested_size", "stream", "segment_type": "small"|"large",
//!                "segment_pool_id": (0, 0), "is_expandable", "frames": [],
//!                "blocks": [{"address", "size", "requested_size",
//!                            "state": "active_allocated"|"active_pending_free"|"inactive",
//!                            "frames": [{"filename", "line", "name"}...]}...]}...],
//!  "device_traces": [[{"action", "addr" (or "device_free" for "oom"), "size", "stream",
//!                      "time_us", "frames" (when backtraces are on)}...]],
//!  "allocator_settings": {...}, "external_annotations": []}
//! ```
//!
//! The visualizer replays the history backwards from the segments, so the two must agree:
//! every block must lie in a segment at every step. Segments are therefore what the device
//! holds for the policy: plain segments for the segment policies, and for the virtual-memory
//! policies (expandable, stitched) each contiguous mapped range, as PyTorch reports
//! expandable segments; the history carries the matching `segment_alloc`/`segment_free` or
//! `segment_map`/`segment_unmap` entries. [`check_replayable`] verifies that agreement on any
//! snapshot, PyTorch's own included.

use crate::engine::pools::is_pool_key;
use crate::engine::track::{Action, LiveRecord, Record};
use crate::engine::Allocator;
use crate::policy::{BlockInfo, BlockKind, SegmentInfo};
use crate::report::frames::{frames_of, Frame};
use crate::report::pickle_writer::PickleWriter;
use crate::stats::Pool;
use crate::trace::pickle::{BlockState, Snapshot};
use crate::trace::Kind;
use rustc_hash::FxHashMap;
use std::backtrace::Backtrace;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Frames shared by the blocks and entries that have the same backtrace.
pub type Frames = Arc<Vec<Frame>>;

/// A block of a snapshot being written.
#[derive(Debug, Clone)]
pub struct BlockOut {
    /// Address.
    pub address: u64,
    /// Bytes.
    pub size: u64,
    /// Bytes asked for (0 for inactive blocks).
    pub requested_size: u64,
    /// State.
    pub state: BlockState,
    /// Where it was allocated, when known.
    pub frames: Frames,
}

/// A segment of a snapshot being written.
#[derive(Debug, Clone)]
pub struct SegmentOut {
    /// Address.
    pub address: u64,
    /// Bytes.
    pub total_size: u64,
    /// Stream of its blocks.
    pub stream: u64,
    /// Pool.
    pub pool: Pool,
    /// A mapped range of a virtual reservation (expandable and stitched policies).
    pub is_expandable: bool,
    /// The private pool (a CUDA graph's) it belongs to, as PyTorch names it; (0, 0) for none.
    pub pool_id: (u64, u64),
    /// Blocks tiling it, by address.
    pub blocks: Vec<BlockOut>,
}

/// One history entry of a snapshot being written.
#[derive(Debug, Clone)]
pub struct EntryOut {
    /// What happened.
    pub action: Action,
    /// Address (device free bytes for an OOM).
    pub addr: u64,
    /// Bytes.
    pub size: u64,
    /// Stream.
    pub stream: u64,
    /// Microseconds since the epoch.
    pub time_us: u64,
    /// Where it was called from, when backtraces are on.
    pub frames: Option<Frames>,
}

/// Everything a snapshot holds, before it is pickled.
#[derive(Debug, Clone)]
pub struct SnapshotData {
    /// Device ordinal.
    pub device: u32,
    /// Policy name.
    pub policy: String,
    /// Whether the policy maps pages into virtual ranges.
    pub uses_pages: bool,
    /// Segments by address.
    pub segments: Vec<SegmentOut>,
    /// History, oldest first (empty when history is off).
    pub entries: Vec<EntryOut>,
}

/// A `torch.cuda.memory._snapshot()`-shaped pickle of the allocator's segments and history,
/// readable by PyTorch's memory visualizer and `torch.cuda._memory_viz`.
///
/// The history is there when the allocator keeps one (`GPUMEM_CONF=history:N`), with stack
/// frames when it captures backtraces (`backtraces:1`). Take snapshots while no other thread
/// is allocating: the segments and the history are read one after the other.
pub fn snapshot_pickle(alloc: &Allocator) -> Result<Vec<u8>, String> {
    Ok(to_pickle(&collect(alloc)?))
}

/// Writes [`snapshot_pickle`] to `path` (gzipped when it ends in `.gz`).
pub fn write_snapshot(alloc: &Allocator, path: &std::path::Path) -> Result<(), String> {
    write_pickle(&snapshot_pickle(alloc)?, path)
}

/// Writes pickled bytes to `path`, gzipped when it ends in `.gz`.
pub fn write_pickle(bytes: &[u8], path: &std::path::Path) -> Result<(), String> {
    use std::io::Write;
    let err = |e: std::io::Error| format!("cannot write {}: {e}", path.display());
    let file = std::fs::File::create(path).map_err(err)?;
    if path.extension().is_some_and(|e| e == "gz") {
        let mut w = flate2::write::GzEncoder::new(
            std::io::BufWriter::new(file),
            flate2::Compression::default(),
        );
        w.write_all(bytes).map_err(err)?;
        // finish() writes the gzip trailer and reports errors that a drop would hide.
        w.finish().map_err(err)?.flush().map_err(err)?;
    } else {
        let mut w = std::io::BufWriter::new(file);
        w.write_all(bytes).map_err(err)?;
        w.flush().map_err(err)?;
    }
    Ok(())
}

/// Parses each distinct backtrace once.
#[derive(Default)]
struct FrameCache(FxHashMap<*const Backtrace, Frames>);

impl FrameCache {
    fn get(&mut self, bt: &Arc<Backtrace>) -> Frames {
        self.0
            .entry(Arc::as_ptr(bt))
            .or_insert_with(|| Arc::new(frames_of(bt)))
            .clone()
    }
}

/// Reads the allocator's state and history into a [`SnapshotData`].
pub fn collect(alloc: &Allocator) -> Result<SnapshotData, String> {
    // The tracker is read first and released before the policies are locked (the engine
    // takes a stream's lock before the tracker's).
    let (history, live): (Vec<Record>, Vec<(u64, LiveRecord)>) = alloc
        .with_tracker(|t| (t.history().cloned().collect(), t.live()))
        .unwrap_or_default();
    // A CUDA graph's private pool holds plain segments whatever the policy: shown as such, with
    // the pool's id and the stream that filled it.
    let (pooled, infos): (Vec<SegmentInfo>, Vec<SegmentInfo>) = alloc
        .snapshot()
        .into_iter()
        .partition(|s| is_pool_key(s.stream));
    let (mapped, reserved) = {
        let d = alloc.device().lock();
        (d.mapped_ranges(), d.reservations())
    };
    let uses_pages = alloc.policy().uses_pages();
    let mut cache = FrameCache::default();
    let none: Frames = Arc::new(Vec::new());

    // Where each block was allocated from: the newest allocation of its address.
    let mut block_frames: FxHashMap<u64, Frames> = FxHashMap::default();
    for r in history.iter().filter(|r| r.action == Action::Alloc) {
        if let Some(bt) = &r.backtrace {
            block_frames.insert(r.addr, cache.get(bt));
        }
    }
    for (addr, l) in &live {
        if let Some(bt) = &l.backtrace {
            block_frames.insert(*addr, cache.get(bt));
        }
    }
    let frames_at = |a: u64| {
        block_frames
            .get(&a)
            .cloned()
            .unwrap_or_else(|| none.clone())
    };

    let mut segments = if uses_pages && !mapped.is_empty() {
        mapped_segments(&infos, &mapped, &reserved, &frames_at)?
    } else {
        plain_segments(&infos, uses_pages, &frames_at)?
    };
    if !pooled.is_empty() {
        for mut s in plain_segments(&pooled, false, &frames_at)? {
            if let Some((id, stream)) = alloc.private_pool_of(s.stream) {
                s.pool_id = id;
                s.stream = stream.unwrap_or(0);
            }
            segments.push(s);
        }
        segments.sort_by_key(|s| s.address);
    }

    let streams = segment_event_streams(&history, &segments);
    let entries = history
        .iter()
        .enumerate()
        .map(|(i, r)| EntryOut {
            action: r.action,
            addr: r.addr,
            size: r.size,
            stream: streams.get(&i).copied().unwrap_or(r.stream),
            time_us: r.time_us,
            frames: r.backtrace.as_ref().map(|bt| cache.get(bt)),
        })
        .collect();
    Ok(SnapshotData {
        device: alloc.device_info().ordinal,
        policy: alloc.policy().name().to_string(),
        uses_pages,
        segments,
        entries,
    })
}

fn state_of(k: BlockKind) -> Option<BlockState> {
    match k {
        BlockKind::Allocated => Some(BlockState::ActiveAllocated),
        BlockKind::Pending => Some(BlockState::ActivePendingFree),
        BlockKind::Free => Some(BlockState::Inactive),
        BlockKind::Unmapped => None,
    }
}

/// Cuts `[start, end)` into blocks: the parts of `pieces` (sorted by address) inside it, and
/// inactive blocks for the gaps; neighbouring inactive blocks are merged. An active block
/// that does not fit whole is an error (the engine would have handed out unmapped memory).
fn tile<'a>(
    start: u64,
    end: u64,
    pieces: impl Iterator<Item = &'a BlockInfo>,
    frames_at: &dyn Fn(u64) -> Frames,
) -> Result<Vec<BlockOut>, String> {
    let mut out: Vec<BlockOut> = Vec::new();
    let push = |out: &mut Vec<BlockOut>, b: BlockOut| match out.last_mut() {
        Some(last)
            if last.state == BlockState::Inactive
                && b.state == BlockState::Inactive
                && last.address + last.size == b.address =>
        {
            last.size += b.size
        }
        _ => out.push(b),
    };
    let inactive = |a: u64, s: u64| BlockOut {
        address: a,
        size: s,
        requested_size: 0,
        state: BlockState::Inactive,
        frames: Arc::new(Vec::new()),
    };
    let mut cursor = start;
    for p in pieces {
        let Some(state) = state_of(p.kind) else {
            continue;
        };
        let (s, e) = (p.addr.max(cursor), (p.addr + p.size).min(end));
        if s >= e {
            continue;
        }
        if state != BlockState::Inactive && (s != p.addr || e != p.addr + p.size) {
            return Err(format!(
                "block {:#x} ({} bytes, in use) is not inside the memory held at \
                 [{start:#x}, {end:#x}): the allocator's state is inconsistent",
                p.addr, p.size
            ));
        }
        if s > cursor {
            push(&mut out, inactive(cursor, s - cursor));
        }
        let b = if state == BlockState::Inactive {
            inactive(s, e - s)
        } else {
            BlockOut {
                address: s,
                size: e - s,
                requested_size: p.requested,
                state,
                frames: frames_at(s),
            }
        };
        push(&mut out, b);
        cursor = e;
    }
    if cursor < end {
        push(&mut out, inactive(cursor, end - cursor));
    }
    Ok(out)
}

/// Segments of the segment policies: as the policies report them. (A virtual-memory policy
/// without a record of its mappings is shown the same way, minus its unmapped blocks.)
fn plain_segments(
    infos: &[SegmentInfo],
    uses_pages: bool,
    frames_at: &dyn Fn(u64) -> Frames,
) -> Result<Vec<SegmentOut>, String> {
    let mut out = Vec::new();
    for si in infos {
        // Runs of mapped blocks (all of them for plain segments).
        let mut run: Vec<&BlockInfo> = Vec::new();
        let mut runs: Vec<Vec<&BlockInfo>> = Vec::new();
        for b in &si.blocks {
            if b.kind == BlockKind::Unmapped {
                if !run.is_empty() {
                    runs.push(std::mem::take(&mut run));
                }
            } else {
                run.push(b);
            }
        }
        if !run.is_empty() {
            runs.push(run);
        }
        if runs.is_empty() && !uses_pages {
            runs.push(Vec::new());
        }
        for r in runs {
            let (start, end) = match (r.first(), r.last()) {
                (Some(f), Some(l)) if uses_pages => (f.addr, l.addr + l.size),
                _ => (si.addr, si.addr + si.size),
            };
            out.push(SegmentOut {
                address: start,
                total_size: end - start,
                stream: si.stream,
                pool: si.pool,
                is_expandable: uses_pages,
                pool_id: (0, 0),
                blocks: tile(start, end, r.into_iter(), frames_at)?,
            });
        }
    }
    out.sort_by_key(|s| s.address);
    Ok(out)
}

/// Segments of the virtual-memory policies: each mapped range, cut where a reserved virtual
/// range (one stream's, one pool's) starts, owned by that reservation, with the policies'
/// blocks inside it.
fn mapped_segments(
    infos: &[SegmentInfo],
    mapped: &[(u64, u64)],
    reserved: &[(u64, u64, u64, Pool)],
    frames_at: &dyn Fn(u64) -> Frames,
) -> Result<Vec<SegmentOut>, String> {
    // `reserved` is by address; a mapping lies inside one reservation.
    let owner = |a: u64| {
        let k = reserved.partition_point(|r| r.0 <= a);
        (k > 0 && a < reserved[k - 1].0 + reserved[k - 1].1)
            .then(|| (reserved[k - 1].2, reserved[k - 1].3))
    };
    let mut blocks: Vec<&BlockInfo> = infos.iter().flat_map(|s| s.blocks.iter()).collect();
    blocks.sort_unstable_by_key(|b| b.addr);
    let mut out = Vec::new();
    for &(a, len) in mapped {
        let end = a + len;
        // Cut points: reservations that start strictly inside this (coalesced) mapped range.
        let mut cuts = vec![a];
        cuts.extend(reserved.iter().map(|r| r.0).filter(|&r| r > a && r < end));
        cuts.push(end);
        for w in cuts.windows(2) {
            let (s, e) = (w[0], w[1]);
            let (stream, pool) = owner(s)
                .ok_or_else(|| format!("mapped range {s:#x} lies in no reserved virtual range"))?;
            let first = blocks.partition_point(|b| b.addr + b.size <= s);
            let inside = blocks[first..].iter().take_while(|b| b.addr < e).copied();
            out.push(SegmentOut {
                address: s,
                total_size: e - s,
                stream,
                pool,
                is_expandable: true,
                pool_id: (0, 0),
                blocks: tile(s, e, inside, frames_at)?,
            });
        }
    }
    // Every block in use must be in mapped memory.
    for b in &blocks {
        if matches!(b.kind, BlockKind::Allocated | BlockKind::Pending)
            && !out
                .iter()
                .any(|s| b.addr >= s.address && b.addr + b.size <= s.address + s.total_size)
        {
            return Err(format!(
                "block {:#x} ({} bytes, in use) is not in mapped memory: the allocator's \
                 state is inconsistent",
                b.addr, b.size
            ));
        }
    }
    Ok(out)
}

/// The stream of each segment entry of the history. Mappings carry the stream the device
/// recorded for them (that of the reservation they are in); a plain segment's is that of the
/// segment containing it now, else that of the first block allocated inside it, else that of
/// the entry that created it.
fn segment_event_streams(history: &[Record], segments: &[SegmentOut]) -> FxHashMap<usize, u64> {
    let is_seg = |a: Action| {
        matches!(
            a,
            Action::SegmentAlloc | Action::SegmentFree | Action::SegmentMap | Action::SegmentUnmap
        )
    };
    let mut spans: Vec<(u64, u64, u64)> = segments
        .iter()
        .map(|s| (s.address, s.address + s.total_size, s.stream))
        .collect();
    spans.sort_unstable();
    let now = |addr: u64| {
        let k = spans.partition_point(|s| s.0 <= addr);
        (k > 0 && addr < spans[k - 1].1).then(|| spans[k - 1].2)
    };
    let mut out = FxHashMap::default();
    let mut waiting: Vec<(u64, u64, usize)> = Vec::new();
    let mut by_start: BTreeMap<u64, u64> = BTreeMap::new();
    for (i, r) in history.iter().enumerate() {
        if matches!(r.action, Action::SegmentMap | Action::SegmentUnmap) {
            // The device recorded the stream whose reservation the mapping is in.
            out.insert(i, r.stream);
            continue;
        }
        if is_seg(r.action) {
            if let Some(s) = now(r.addr) {
                out.insert(i, s);
            } else if matches!(r.action, Action::SegmentAlloc | Action::SegmentMap) {
                waiting.push((r.addr, r.addr + r.size, i));
            } else if let Some(&s) = by_start.get(&r.addr) {
                out.insert(i, s);
            }
            if let (Some(&s), Action::SegmentAlloc | Action::SegmentMap) = (out.get(&i), r.action) {
                by_start.insert(r.addr, s);
            }
        } else if r.action == Action::Alloc && !waiting.is_empty() {
            waiting.retain(|&(s, e, idx)| {
                if r.addr >= s && r.addr < e {
                    out.insert(idx, r.stream);
                    by_start.insert(s, r.stream);
                    false
                } else {
                    true
                }
            });
        }
    }
    out
}

fn write_frames(w: &mut PickleWriter, frames: &[Frame]) {
    w.begin_list();
    for f in frames {
        w.begin_dict();
        w.key("filename");
        w.str(&f.filename);
        w.key("line");
        w.int(f.line as i64);
        w.key("name");
        w.str(&f.name);
        w.end();
    }
    w.end();
}

/// Pickles snapshot data in PyTorch's shape.
pub fn to_pickle(d: &SnapshotData) -> Vec<u8> {
    let mut w = PickleWriter::new();
    w.begin_dict();
    w.key("segments");
    w.begin_list();
    for s in &d.segments {
        let sum = |f: &dyn Fn(&BlockOut) -> bool, v: &dyn Fn(&BlockOut) -> u64| -> u64 {
            s.blocks.iter().filter(|b| f(b)).map(v).sum()
        };
        w.begin_dict();
        w.key("device");
        w.int(d.device as i64);
        w.key("address");
        w.uint(s.address);
        w.key("total_size");
        w.uint(s.total_size);
        w.key("allocated_size");
        w.uint(sum(&|b| b.state == BlockState::ActiveAllocated, &|b| {
            b.size
        }));
        w.key("active_size");
        w.uint(sum(&|b| b.state.is_active(), &|b| b.size));
        w.key("requested_size");
        w.uint(sum(&|b| b.state.is_active(), &|b| b.requested_size));
        w.key("stream");
        w.int(s.stream as i64);
        w.key("segment_type");
        w.str(match s.pool {
            Pool::Small => "small",
            Pool::Large => "large",
        });
        w.key("segment_pool_id");
        w.begin_tuple();
        w.int(s.pool_id.0 as i64);
        w.int(s.pool_id.1 as i64);
        w.end();
        w.key("is_expandable");
        w.bool(s.is_expandable);
        w.key("frames");
        write_frames(&mut w, &[]);
        w.key("blocks");
        w.begin_list();
        for b in &s.blocks {
            w.begin_dict();
            w.key("address");
            w.uint(b.address);
            w.key("size");
            w.uint(b.size);
            w.key("requested_size");
            w.uint(b.requested_size);
            w.key("state");
            w.str(b.state.torch_name());
            w.key("frames");
            write_frames(&mut w, &b.frames);
            w.end();
        }
        w.end();
        w.end();
    }
    w.end();
    w.key("device_traces");
    w.begin_list();
    for dev in 0..=d.device {
        w.begin_list();
        if dev == d.device {
            for e in &d.entries {
                w.begin_dict();
                w.key("action");
                w.str(e.action.torch_name());
                w.key(if e.action == Action::Oom {
                    "device_free"
                } else {
                    "addr"
                });
                w.uint(e.addr);
                w.key("size");
                w.uint(e.size);
                w.key("stream");
                w.int(e.stream as i64);
                w.key("time_us");
                w.uint(e.time_us);
                if let Some(f) = &e.frames {
                    w.key("frames");
                    write_frames(&mut w, f);
                }
                w.end();
            }
        }
        w.end();
    }
    w.end();
    w.key("allocator_settings");
    w.begin_dict();
    w.key("PYTORCH_CUDA_ALLOC_CONF");
    w.str(&std::env::var("PYTORCH_CUDA_ALLOC_CONF").unwrap_or_default());
    // gpumem never refuses to split a block: PyTorch's "no limit".
    w.key("max_split_size");
    w.int(-1);
    w.key("expandable_segments");
    w.bool(d.uses_pages);
    w.key("gpumem_policy");
    w.str(&d.policy);
    w.key("GPUMEM_CONF");
    w.str(&std::env::var("GPUMEM_CONF").unwrap_or_default());
    w.end();
    w.key("external_annotations");
    w.begin_list();
    w.end();
    w.end();
    w.finish()
}

/// Checks that a snapshot's history can be replayed backwards from its segments the way
/// PyTorch's memory visualizer does it ("Allocator State History"): every segment entry finds
/// the segment it created or removed, every free finds its block, and no block is ever outside
/// a segment. Returns the first disagreement.
pub fn check_replayable(snap: &Snapshot) -> Result<(), String> {
    // Segments: start -> (end, stream); blocks: start -> (end, freed-but-pending).
    let mut segs: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
    let mut blocks: BTreeMap<u64, (u64, bool)> = BTreeMap::new();
    for s in &snap.segments {
        if segs
            .insert(s.address, (s.address + s.total_size, s.stream))
            .is_some()
        {
            return Err(format!("two segments at {:#x}", s.address));
        }
        for b in &s.blocks {
            if b.state.is_active() {
                let pending = b.state == BlockState::ActivePendingFree;
                blocks.insert(b.address, (b.address + b.requested_size.max(1), pending));
            }
        }
    }
    let inside = |segs: &BTreeMap<u64, (u64, u64)>, a: u64, e: u64| {
        segs.range(..=a)
            .next_back()
            .is_some_and(|(_, &(end, _))| a < end && e <= end)
    };
    for (&a, &(e, _)) in &blocks {
        if !inside(&segs, a, e) {
            return Err(format!("block {a:#x} is in no segment of the snapshot"));
        }
    }
    let ev = &snap.trace.events;
    let mut i = ev.len();
    while i > 0 {
        i -= 1;
        let e = ev[i];
        let at = |what: &str| {
            format!(
                "history entry {i} ({} {:#x}): {what}",
                e.kind.torch_name(),
                e.addr
            )
        };
        match e.kind {
            Kind::FreeCompleted => {
                // The visualizer merges a free_requested directly followed by its
                // free_completed into one "free".
                let merged =
                    i > 0 && ev[i - 1].kind == Kind::FreeRequested && ev[i - 1].addr == e.addr;
                let end = e.addr + e.size.max(1);
                if !inside(&segs, e.addr, end) {
                    return Err(at("the freed block is in no segment at that point"));
                }
                blocks.insert(e.addr, (end, !merged));
                if merged {
                    i -= 1;
                }
            }
            Kind::FreeRequested => match blocks.get_mut(&e.addr) {
                Some(b) => b.1 = false,
                None => return Err(at("no block at this address to un-free")),
            },
            Kind::Alloc => {
                blocks.remove(&e.addr);
            }
            Kind::SegmentFree | Kind::SegmentUnmap => {
                let (mut a, mut end) = (e.addr, e.addr + e.size);
                if e.kind == Kind::SegmentUnmap {
                    // Merged with neighbours of the same stream.
                    if let Some((&pa, &(pe, ps))) = segs.range(..a).next_back() {
                        if pe == a && ps == e.stream {
                            segs.remove(&pa);
                            a = pa;
                        }
                    }
                    if let Some(&(ne, ns)) = segs.get(&end) {
                        if ns == e.stream {
                            segs.remove(&end);
                            end = ne;
                        }
                    }
                }
                if segs.range(a..end).next().is_some()
                    || segs
                        .range(..a)
                        .next_back()
                        .is_some_and(|(_, &(pe, _))| pe > a)
                {
                    return Err(at("the segment overlaps another one"));
                }
                segs.insert(a, (end, e.stream));
            }
            Kind::SegmentAlloc | Kind::SegmentMap => {
                let end = e.addr + e.size;
                if e.kind == Kind::SegmentAlloc {
                    match segs.get(&e.addr) {
                        Some(&(se, _)) if se == end => {
                            segs.remove(&e.addr);
                        }
                        _ => return Err(at("no segment with this address and size to remove")),
                    }
                } else {
                    let Some((&sa, &(se, ss))) = segs.range(..=e.addr).next_back() else {
                        return Err(at("the mapped range is in no segment"));
                    };
                    if end > se {
                        return Err(at("the mapped range is in no segment"));
                    }
                    segs.remove(&sa);
                    if sa < e.addr {
                        segs.insert(sa, (e.addr, ss));
                    }
                    if end < se {
                        segs.insert(end, (se, ss));
                    }
                }
                if let Some((&ba, _)) = blocks.range(e.addr..end).next() {
                    return Err(at(&format!(
                        "block {ba:#x} is still live in memory that did not exist yet"
                    )));
                }
                if let Some((&ba, &(be, _))) = blocks.range(..e.addr).next_back() {
                    if be > e.addr && !inside(&segs, ba, be) {
                        return Err(at(&format!(
                            "block {ba:#x} is still live in memory that did not exist yet"
                        )));
                    }
                }
            }
            Kind::Oom | Kind::Snapshot => {}
        }
    }
    Ok(())
}
