//! A deterministic simulated device: addresses are numbers, nothing is read or written.
//!
//! It enforces the same rules as the CUDA driver (no double mapping, no release of a mapped
//! handle, no free of an unknown pointer, capacity limits), so a policy bug that would fail on
//! the GPU fails here too. Events complete either at once or when the owner of a
//! [`SimControl`] says so, which is how `gpumem replay` reproduces a trace's stream order.

use super::{Backend, DevPtr, DeviceInfo, DriverCall, EventHandle, PhysHandle, Stream};
use crate::error::BackendError;
use crate::units::{round_up, DEFAULT_PAGE, H200_TOTAL_BYTES};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::collections::BTreeMap;
use std::sync::Arc;

/// When simulated events complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventMode {
    /// Every event has completed by the time anyone asks (the GPU is infinitely fast).
    Immediate,
    /// Events complete only through [`SimControl::complete`] (or a host synchronize).
    Manual,
}

/// Parameters of a simulated device.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Device name reported.
    pub name: String,
    /// Total memory.
    pub total_bytes: u64,
    /// Memory used by others (other processes), unavailable to us.
    pub foreign_bytes: u64,
    /// Physical page size of the virtual-memory API.
    pub page_bytes: u64,
    /// Event completion.
    pub event_mode: EventMode,
    /// Addresses for plain segments, in order, with their sizes: when the next segment asked
    /// for has the size of the first hint, it gets that address. A replay passes the
    /// addresses the real driver returned, so that best fit breaks ties between equal blocks
    /// (by address) as it did on the GPU.
    pub segment_addresses: std::collections::VecDeque<(u64, DevPtr)>,
    /// Keep what tests audit: a copy of the page mappings, which [`SimControl::handle_at`]
    /// queries (which physical page backs which address), and the log of event operations,
    /// which [`SimControl::take_ops`] and [`SimControl::take_waits`] return.
    pub audit: bool,
    /// First virtual address handed out. Simulated devices of one process get bases far
    /// apart, so that, as under CUDA's unified addressing, no address belongs to two devices.
    pub address_base: u64,
}

/// The largest simulated device: 4 TiB, over ten times today's largest GPU, and small enough
/// that the policies' per-page tables of it (a slot per 2 MiB page) stay in tens of MiB.
pub const MAX_TOTAL_BYTES: u64 = 4 << 40;

/// Why `bytes` cannot be a simulated device's memory (zero, or over [`MAX_TOTAL_BYTES`]).
pub fn check_total_bytes(bytes: u64) -> Result<(), String> {
    if bytes == 0 {
        Err("a simulated device needs some memory (0 bytes given)".into())
    } else if bytes > MAX_TOTAL_BYTES {
        Err(format!(
            "{bytes} bytes is more than the 4 TiB a simulated device may have (the largest \
             GPUs hold under 300 GB)"
        ))
    } else {
        Ok(())
    }
}

impl Default for SimConfig {
    /// An H200: 150,109,880,320 bytes and 2 MiB pages, events completing at once.
    fn default() -> Self {
        Self {
            name: "sim (H200-sized)".to_string(),
            total_bytes: H200_TOTAL_BYTES,
            foreign_bytes: 0,
            page_bytes: DEFAULT_PAGE,
            event_mode: EventMode::Immediate,
            segment_addresses: Default::default(),
            audit: false,
            // Far from zero (a small pointer is never valid) and below the addresses the
            // CUDA driver hands out on Linux (0x7f..), which hints may reuse.
            address_base: 0x1000_0000_0000,
        }
    }
}

#[derive(Default)]
struct EventState {
    done: FxHashMap<u64, bool>,
    recorded: Vec<(EventHandle, Stream)>,
    /// Records, waits and host waits in the order they happened (kept only when the device
    /// audits).
    ops: Vec<EventOp>,
    next: u64,
}

/// An event operation, in the log a test audits (see [`SimControl::take_ops`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventOp {
    /// `event` was recorded on `stream`.
    Record {
        /// The event.
        event: EventHandle,
        /// Its stream.
        stream: Stream,
    },
    /// `stream` waits (on the device) for `event`.
    Wait {
        /// The waiting stream.
        stream: Stream,
        /// The event.
        event: EventHandle,
    },
    /// The host waited for `event`, which has then completed.
    Synchronize {
        /// The event.
        event: EventHandle,
    },
}

type MappingMirror = Arc<Mutex<BTreeMap<DevPtr, (u64, PhysHandle)>>>;

/// A handle to the simulated device's events, kept by whoever drives the simulation.
#[derive(Clone)]
pub struct SimControl {
    events: Arc<Mutex<EventState>>,
    mode: EventMode,
    mirror: Option<MappingMirror>,
}

impl SimControl {
    /// Marks an event as completed.
    pub fn complete(&self, event: EventHandle) {
        if let Some(d) = self.events.lock().done.get_mut(&event.0) {
            *d = true;
        }
    }

    /// Completes every event recorded since the last [`SimControl::take_recorded`] (as if the
    /// device had caught up with all its streams); returns how many.
    pub fn complete_recorded(&self) -> usize {
        let mut ev = self.events.lock();
        let recorded = std::mem::take(&mut ev.recorded);
        for (e, _) in &recorded {
            if let Some(d) = ev.done.get_mut(&e.0) {
                *d = true;
            }
        }
        recorded.len()
    }

    /// Events recorded since the last call, with their streams, oldest first.
    pub fn take_recorded(&self) -> Vec<(EventHandle, Stream)> {
        std::mem::take(&mut self.events.lock().recorded)
    }

    /// Stream waits (`stream` waits for `event`) since the last call, oldest first: the
    /// waits of [`SimControl::take_ops`]'s log, which this drains (kept only when the device
    /// audits, see [`SimConfig::audit`]).
    pub fn take_waits(&self) -> Vec<(Stream, EventHandle)> {
        self.take_ops()
            .into_iter()
            .filter_map(|op| match op {
                EventOp::Wait { stream, event } => Some((stream, event)),
                _ => None,
            })
            .collect()
    }

    /// Event records, stream waits and host waits since the last call, in the order they
    /// happened (kept only when the device audits, see [`SimConfig::audit`]).
    pub fn take_ops(&self) -> Vec<EventOp> {
        std::mem::take(&mut self.events.lock().ops)
    }

    /// Events recorded and not yet completed.
    pub fn pending(&self) -> usize {
        self.events.lock().done.values().filter(|d| !**d).count()
    }

    /// The event mode.
    pub fn mode(&self) -> EventMode {
        self.mode
    }

    /// Every mapping now, `(address, bytes, handle)` in address order, when the device audits
    /// mappings (empty otherwise).
    pub fn mappings(&self) -> Vec<(DevPtr, u64, PhysHandle)> {
        self.mirror.as_ref().map_or_else(Vec::new, |m| {
            m.lock()
                .iter()
                .map(|(&va, &(len, h))| (va, len, h))
                .collect()
        })
    }

    /// The physical allocation mapped at `va`, when the device audits mappings.
    pub fn handle_at(&self, va: DevPtr) -> Option<PhysHandle> {
        let m = self.mirror.as_ref()?.lock();
        let (&start, &(len, h)) = m.range(..=va).next_back()?;
        (va < start + len).then_some(h)
    }
}

/// The simulated device.
pub struct SimBackend {
    cfg: SimConfig,
    held: u64,
    next_va: u64,
    segments: FxHashMap<DevPtr, u64>,
    reservations: BTreeMap<DevPtr, u64>,
    handles: FxHashMap<u64, (u64, u32)>,
    next_handle: u64,
    mappings: BTreeMap<DevPtr, (u64, PhysHandle)>,
    mirror: Option<MappingMirror>,
    events: Arc<Mutex<EventState>>,
}

impl SimBackend {
    /// A simulated device and the control handle of its events.
    pub fn new(cfg: SimConfig) -> (Self, SimControl) {
        let base = cfg.address_base;
        let events = Arc::new(Mutex::new(EventState::default()));
        let mirror = cfg.audit.then(|| Arc::new(Mutex::new(BTreeMap::new())));
        let ctl = SimControl {
            events: events.clone(),
            mode: cfg.event_mode,
            mirror: mirror.clone(),
        };
        (
            Self {
                cfg,
                held: 0,
                next_va: base,
                segments: FxHashMap::default(),
                reservations: BTreeMap::new(),
                handles: FxHashMap::default(),
                next_handle: 1,
                mappings: BTreeMap::new(),
                mirror,
                events,
            },
            ctl,
        )
    }

    /// Physical bytes currently held from the simulated device.
    pub fn held_bytes(&self) -> u64 {
        self.held
    }

    fn take_physical(&mut self, call: DriverCall, bytes: u64) -> Result<(), BackendError> {
        let avail = self
            .cfg
            .total_bytes
            .saturating_sub(self.cfg.foreign_bytes)
            .saturating_sub(self.held);
        if bytes > avail {
            return Err(BackendError::oom(
                call,
                format!("simulated device has {avail} bytes free, {bytes} requested"),
            ));
        }
        self.held += bytes;
        Ok(())
    }

    fn fresh_va(&mut self, bytes: u64, align: u64) -> DevPtr {
        let va = round_up(self.next_va, align);
        self.next_va = va + round_up(bytes.max(1), align);
        va
    }

    fn check_pages(&self, call: DriverCall, va: DevPtr, bytes: u64) -> Result<(), BackendError> {
        let p = self.cfg.page_bytes;
        if bytes == 0 || bytes % p != 0 || va % p != 0 {
            return Err(BackendError::new(
                call,
                format!("range {va:#x}+{bytes} is not aligned to the {p}-byte page"),
            ));
        }
        if !super::inside_reservation(&self.reservations, va, bytes) {
            return Err(BackendError::new(
                call,
                format!("range {va:#x}+{bytes} is not inside a reserved virtual range"),
            ));
        }
        Ok(())
    }

    fn overlapping(&self, va: DevPtr, bytes: u64) -> Vec<DevPtr> {
        let mut out = Vec::new();
        if let Some((&s, &(len, _))) = self.mappings.range(..va).next_back() {
            if s + len > va {
                out.push(s);
            }
        }
        out.extend(self.mappings.range(va..va + bytes).map(|(&s, _)| s));
        out
    }
}

impl Backend for SimBackend {
    fn is_simulated(&self) -> bool {
        true
    }
    fn info(&self) -> DeviceInfo {
        DeviceInfo {
            name: self.cfg.name.clone(),
            ordinal: 0,
            total_bytes: self.cfg.total_bytes,
            page_bytes: self.cfg.page_bytes,
            supports_vmm: true,
        }
    }

    fn mem_get_info(&mut self) -> Result<(u64, u64), BackendError> {
        let used = self.held + self.cfg.foreign_bytes;
        Ok((
            self.cfg.total_bytes.saturating_sub(used),
            self.cfg.total_bytes,
        ))
    }

    fn mem_alloc(&mut self, bytes: u64) -> Result<DevPtr, BackendError> {
        if bytes == 0 {
            return Err(BackendError::new(DriverCall::MemAlloc, "size 0"));
        }
        self.take_physical(DriverCall::MemAlloc, bytes)?;
        let hinted = match self.cfg.segment_addresses.front() {
            Some(&(size, addr)) if size == bytes => {
                self.cfg.segment_addresses.pop_front();
                // A hint from a trace may be anything: one that clashes, is null or runs past
                // the end of the address space is not taken.
                let fits = addr != 0 && addr.checked_add(bytes).is_some();
                let clash = fits
                    && self
                        .segments
                        .iter()
                        .any(|(&p, &len)| p < addr + bytes && addr < p + len);
                (fits && !clash).then_some(addr)
            }
            _ => None,
        };
        let ptr = hinted.unwrap_or_else(|| self.fresh_va(bytes, 512));
        self.segments.insert(ptr, bytes);
        Ok(ptr)
    }

    fn mem_free(&mut self, ptr: DevPtr, bytes: u64) -> Result<(), BackendError> {
        match self.segments.remove(&ptr) {
            Some(b) if b == bytes => {
                self.held -= b;
                Ok(())
            }
            Some(b) => {
                self.segments.insert(ptr, b);
                Err(BackendError::new(
                    DriverCall::MemFree,
                    format!("segment {ptr:#x} has {b} bytes, not {bytes}"),
                ))
            }
            None => Err(BackendError::new(
                DriverCall::MemFree,
                format!("{ptr:#x} is not a segment of this device"),
            )),
        }
    }

    fn address_reserve(&mut self, bytes: u64, align: u64) -> Result<DevPtr, BackendError> {
        let p = self.cfg.page_bytes;
        if bytes == 0 || bytes % p != 0 {
            return Err(BackendError::new(
                DriverCall::AddressReserve,
                format!("size {bytes} is not a non-zero multiple of the page"),
            ));
        }
        let align = super::reserve_alignment(align, p)?;
        let va = self.fresh_va(bytes, align);
        self.reservations.insert(va, bytes);
        Ok(va)
    }

    fn address_free(&mut self, va: DevPtr, bytes: u64) -> Result<(), BackendError> {
        if self.reservations.get(&va) != Some(&bytes) {
            return Err(BackendError::new(
                DriverCall::AddressFree,
                format!("{va:#x}+{bytes} is not a reserved range"),
            ));
        }
        if !self.overlapping(va, bytes).is_empty() {
            return Err(BackendError::new(
                DriverCall::AddressFree,
                format!("{va:#x}+{bytes} still has mappings"),
            ));
        }
        self.reservations.remove(&va);
        Ok(())
    }

    fn mem_create(&mut self, bytes: u64) -> Result<PhysHandle, BackendError> {
        let p = self.cfg.page_bytes;
        if bytes == 0 || bytes % p != 0 {
            return Err(BackendError::new(
                DriverCall::MemCreate,
                format!("size {bytes} is not a non-zero multiple of the page"),
            ));
        }
        self.take_physical(DriverCall::MemCreate, bytes)?;
        let h = self.next_handle;
        self.next_handle += 1;
        self.handles.insert(h, (bytes, 0));
        Ok(PhysHandle(h))
    }

    fn mem_release(&mut self, handle: PhysHandle) -> Result<(), BackendError> {
        match self.handles.get(&handle.0) {
            None => Err(BackendError::new(
                DriverCall::MemRelease,
                format!("unknown handle {}", handle.0),
            )),
            Some(&(_, maps)) if maps > 0 => Err(BackendError::new(
                DriverCall::MemRelease,
                format!("handle {} is still mapped {maps} time(s)", handle.0),
            )),
            Some(&(bytes, _)) => {
                self.handles.remove(&handle.0);
                self.held -= bytes;
                Ok(())
            }
        }
    }

    fn mem_map(&mut self, va: DevPtr, bytes: u64, handle: PhysHandle) -> Result<(), BackendError> {
        self.check_pages(DriverCall::MemMap, va, bytes)?;
        let Some(entry) = self.handles.get(&handle.0).copied() else {
            return Err(BackendError::new(
                DriverCall::MemMap,
                format!("unknown handle {}", handle.0),
            ));
        };
        if entry.0 != bytes {
            return Err(BackendError::new(
                DriverCall::MemMap,
                format!(
                    "handle {} has {} bytes, mapping asks {bytes}",
                    handle.0, entry.0
                ),
            ));
        }
        if let Some(s) = self.overlapping(va, bytes).first() {
            return Err(BackendError::new(
                DriverCall::MemMap,
                format!("{va:#x}+{bytes} overlaps the existing mapping at {s:#x}"),
            ));
        }
        self.mappings.insert(va, (bytes, handle));
        if let Some(m) = &self.mirror {
            m.lock().insert(va, (bytes, handle));
        }
        self.handles.insert(handle.0, (entry.0, entry.1 + 1));
        Ok(())
    }

    fn mem_unmap(&mut self, va: DevPtr, bytes: u64) -> Result<(), BackendError> {
        self.check_pages(DriverCall::MemUnmap, va, bytes)?;
        let found = self.overlapping(va, bytes);
        // Like cuMemUnmap, the range must consist of whole mappings.
        let mut covered = 0;
        for s in &found {
            let (len, _) = self.mappings[s];
            if *s < va || s + len > va + bytes {
                return Err(BackendError::new(
                    DriverCall::MemUnmap,
                    format!("{va:#x}+{bytes} cuts the mapping at {s:#x}+{len}"),
                ));
            }
            covered += len;
        }
        if covered != bytes {
            return Err(BackendError::new(
                DriverCall::MemUnmap,
                format!("{va:#x}+{bytes} is not wholly mapped"),
            ));
        }
        for s in found {
            let (_, h) = self.mappings.remove(&s).expect("found above");
            if let Some(m) = &self.mirror {
                m.lock().remove(&s);
            }
            if let Some(e) = self.handles.get_mut(&h.0) {
                e.1 -= 1;
            }
        }
        Ok(())
    }

    fn set_access(&mut self, va: DevPtr, bytes: u64) -> Result<(), BackendError> {
        self.check_pages(DriverCall::SetAccess, va, bytes)?;
        let covered: u64 = self
            .overlapping(va, bytes)
            .iter()
            .map(|s| self.mappings[s].0)
            .sum();
        if covered < bytes {
            return Err(BackendError::new(
                DriverCall::SetAccess,
                format!("{va:#x}+{bytes} is not wholly mapped"),
            ));
        }
        Ok(())
    }

    fn event_record(&mut self, stream: Stream) -> Result<EventHandle, BackendError> {
        let mut ev = self.events.lock();
        ev.next += 1;
        let h = EventHandle(ev.next);
        let done = self.cfg.event_mode == EventMode::Immediate;
        ev.done.insert(h.0, done);
        ev.recorded.push((h, stream));
        if self.cfg.audit {
            ev.ops.push(EventOp::Record { event: h, stream });
        }
        Ok(h)
    }

    fn event_completed(&mut self) -> Result<EventHandle, BackendError> {
        let mut ev = self.events.lock();
        ev.next += 1;
        let h = EventHandle(ev.next);
        ev.done.insert(h.0, true);
        Ok(h)
    }

    fn event_query(&mut self, event: EventHandle) -> Result<bool, BackendError> {
        self.events
            .lock()
            .done
            .get(&event.0)
            .copied()
            .ok_or_else(|| BackendError::new(DriverCall::EventQuery, "unknown event"))
    }

    fn event_synchronize(&mut self, event: EventHandle) -> Result<(), BackendError> {
        // The host waits until the device has finished: the event is then complete.
        let mut ev = self.events.lock();
        match ev.done.get_mut(&event.0) {
            Some(d) => {
                *d = true;
                if self.cfg.audit {
                    ev.ops.push(EventOp::Synchronize { event });
                }
                Ok(())
            }
            None => Err(BackendError::new(
                DriverCall::EventSynchronize,
                "unknown event",
            )),
        }
    }

    fn event_destroy(&mut self, event: EventHandle) {
        self.events.lock().done.remove(&event.0);
    }

    fn stream_wait_event(
        &mut self,
        stream: Stream,
        event: EventHandle,
    ) -> Result<(), BackendError> {
        let mut ev = self.events.lock();
        if ev.done.contains_key(&event.0) {
            if self.cfg.audit {
                ev.ops.push(EventOp::Wait { stream, event });
            }
            Ok(())
        } else {
            Err(BackendError::new(
                DriverCall::StreamWaitEvent,
                "unknown event",
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::units::MIB;

    fn sim() -> SimBackend {
        SimBackend::new(SimConfig {
            total_bytes: 64 * MIB,
            ..SimConfig::default()
        })
        .0
    }

    #[test]
    fn segment_hints_past_the_address_space_or_clashing_are_not_taken() {
        let (mut b, _) = SimBackend::new(SimConfig {
            total_bytes: 64 * MIB,
            segment_addresses: [
                (2 * MIB, u64::MAX - MIB),
                (2 * MIB, 0x7000_0000),
                (2 * MIB, 0x7010_0000),
            ]
            .into(),
            ..SimConfig::default()
        });
        // Past the end of the address space: a fresh address instead, freed like any other.
        let p = b.mem_alloc(2 * MIB).unwrap();
        assert!(p.checked_add(2 * MIB).is_some(), "{p:#x}");
        // Taken as hinted; the next hint overlaps it, so it is not.
        let q = b.mem_alloc(2 * MIB).unwrap();
        assert_eq!(q, 0x7000_0000);
        let r = b.mem_alloc(2 * MIB).unwrap();
        assert!(
            r + 2 * MIB <= q || r >= q + 2 * MIB,
            "{r:#x} overlaps {q:#x}"
        );
        for x in [p, q, r] {
            b.mem_free(x, 2 * MIB).unwrap();
        }
    }

    #[test]
    fn segments_count_against_capacity() {
        let mut s = sim();
        let a = s.mem_alloc(40 * MIB).unwrap();
        let err = s.mem_alloc(40 * MIB).unwrap_err();
        assert!(err.out_of_memory);
        s.mem_free(a, 40 * MIB).unwrap();
        assert_eq!(s.held_bytes(), 0);
        assert!(s.mem_free(a, 40 * MIB).is_err(), "double free must fail");
    }

    #[test]
    fn mapping_rules_are_enforced() {
        let mut s = sim();
        let va = s.address_reserve(8 * MIB, 0).unwrap();
        // Ranges align to what is asked, if it is a power of two multiple of the page.
        let wide = s.address_reserve(8 * MIB, 64 * MIB).unwrap();
        assert_eq!(wide % (64 * MIB), 0);
        assert!(
            s.address_reserve(8 * MIB, 6 * MIB).is_err(),
            "6 MiB alignment"
        );
        // Below the page (0 included): the page.
        let small = s.address_reserve(8 * MIB, MIB).unwrap();
        assert_eq!(small % (2 * MIB), 0);
        let h = s.mem_create(2 * MIB).unwrap();
        s.mem_map(va, 2 * MIB, h).unwrap();
        s.set_access(va, 2 * MIB).unwrap();
        assert!(s.mem_map(va, 2 * MIB, h).is_err(), "double mapping");
        assert!(
            s.set_access(va, 4 * MIB).is_err(),
            "access over an unmapped page"
        );
        assert!(s.mem_release(h).is_err(), "release while mapped");
        // The same handle may be mapped at a second address (aliasing).
        s.mem_map(va + 2 * MIB, 2 * MIB, h).unwrap();
        s.mem_unmap(va, 4 * MIB).unwrap();
        s.mem_release(h).unwrap();
        assert_eq!(s.held_bytes(), 0);
        assert!(
            s.mem_unmap(va, 2 * MIB).is_err(),
            "unmap of an unmapped range"
        );
        s.address_free(va, 8 * MIB).unwrap();
    }

    #[test]
    fn manual_events_complete_when_told() {
        let (mut s, ctl) = SimBackend::new(SimConfig {
            event_mode: EventMode::Manual,
            ..SimConfig::default()
        });
        let e = s.event_record(7).unwrap();
        assert!(!s.event_query(e).unwrap());
        assert_eq!(ctl.take_recorded(), vec![(e, 7)]);
        ctl.complete(e);
        assert!(s.event_query(e).unwrap());
        let (a, b) = (s.event_record(1).unwrap(), s.event_record(2).unwrap());
        assert!(!s.event_query(a).unwrap() && !s.event_query(b).unwrap());
        assert_eq!(ctl.complete_recorded(), 2);
        assert!(s.event_query(a).unwrap() && s.event_query(b).unwrap());
        assert_eq!(ctl.complete_recorded(), 0, "each event is completed once");
    }
}
