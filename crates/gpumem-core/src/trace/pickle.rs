//! A streaming reader of PyTorch memory snapshots (`torch.cuda.memory._snapshot()` pickled).
//!
//! It runs the pickle opcodes itself but builds only what it needs: trace-entry dicts
//! (those with an `action` key) are turned into compact [`Event`]s as soon as they are appended
//! to their list and then dropped, so memory stays small however long the history. Strings are
//! kept once in a table and referred to by index; containers referenced a second time through
//! the memo are not rebuilt (no trace entry is shared, so nothing the replay needs is lost).
//! The `segments` list (the allocator's state when the snapshot was taken) is small and is
//! read whole, by [`read_snapshot_full`] and [`load_snapshot`].

use super::input::Input;
use super::{Event, Kind, Trace, TraceMeta};
use crate::error::TraceError;
use crate::stats::Pool;
use serde::Serialize;

#[derive(Debug, Clone)]
enum V {
    None,
    Bool(bool),
    Int(i64),
    Float,
    Str(u32),
    BigInt,
    Bytes,
    List(Vec<V>),
    Dict(Vec<(V, V)>),
    Tuple,
    /// A tuple of two integers (a segment's `segment_pool_id`); other tuples are not kept.
    IntPair(i64, i64),
    /// A list whose trace entries were streamed out (index into the event lists).
    Events(u32),
    /// A trace-entry dict, already converted (index into the scratch buffer; `None` there
    /// for entries of actions the replay does not use).
    Entry(u32),
    /// A container seen before, not rebuilt.
    Shared,
    /// An instance of a class (not modelled).
    Opaque,
}

/// Containers are dropped without recursion: a pickle of lists nested a hundred thousand deep
/// (200 KB) would otherwise overflow the stack when its value is dropped. Values without
/// children (nearly all) leave at the first test.
impl Drop for V {
    #[inline]
    fn drop(&mut self) {
        let has_children = match self {
            V::List(items) => !items.is_empty(),
            V::Dict(pairs) => !pairs.is_empty(),
            _ => false,
        };
        if has_children {
            drop_children(self);
        }
    }
}

/// Moves the children of `v`, and theirs, onto a heap stack and drops them there, each with no
/// children left.
#[cold]
#[inline(never)]
fn drop_children(v: &mut V) {
    fn take(v: &mut V, pending: &mut Vec<V>) {
        match v {
            V::List(items) => pending.append(items),
            V::Dict(pairs) => {
                for (k, v) in pairs.drain(..) {
                    pending.push(k);
                    pending.push(v);
                }
            }
            _ => {}
        }
    }
    let mut pending = Vec::new();
    take(v, &mut pending);
    while let Some(mut child) = pending.pop() {
        take(&mut child, &mut pending);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tag {
    Other,
    Action,
    Addr,
    Size,
    Stream,
    TimeUs,
    DeviceTraces,
    AllocatorSettings,
    ExpandableSegments,
    AllocConf,
    Kind(Kind),
}

fn tag_of(s: &str) -> Tag {
    match s {
        "action" => Tag::Action,
        "addr" => Tag::Addr,
        "size" => Tag::Size,
        "stream" => Tag::Stream,
        "time_us" => Tag::TimeUs,
        "device_traces" => Tag::DeviceTraces,
        "allocator_settings" => Tag::AllocatorSettings,
        "expandable_segments" => Tag::ExpandableSegments,
        "PYTORCH_CUDA_ALLOC_CONF" => Tag::AllocConf,
        other => match Kind::from_torch(other) {
            Some(k) => Tag::Kind(k),
            None => Tag::Other,
        },
    }
}

struct Vm<'a> {
    inp: &'a mut Input,
    stack: Vec<V>,
    marks: Vec<usize>,
    /// Memo index -> a string id with STR_BIT set, an index into `memo_vals`, or NO_VALUE for
    /// containers (not kept).
    memo: Vec<u32>,
    memo_vals: Vec<V>,
    next_memo: u32,
    /// Length of `scratch` at which `append` next scans the stack for entries.
    scratch_scan_at: usize,
    /// Trace entries converted but not yet appended to their list.
    scratch: Vec<Option<Event>>,
    strs: Strings,
    events: Vec<Vec<Event>>,
    skipped: u64,
}

/// Every distinct string read, once, with its tag; `V::Str` holds an index into it.
#[derive(Default)]
struct Strings {
    text: Vec<Box<str>>,
    tags: Vec<Tag>,
    /// Bytes -> index: PyTorch writes some values (such as "N/A") afresh in every entry; one
    /// copy each is enough.
    index: rustc_hash::FxHashMap<Box<[u8]>, u32>,
}

impl Strings {
    /// The index of the string `bytes`, added if new; `None` if it is not UTF-8.
    fn intern(&mut self, bytes: &[u8]) -> Option<u32> {
        if let Some(&i) = self.index.get(bytes) {
            return Some(i);
        }
        let s = std::str::from_utf8(bytes).ok()?;
        self.tags.push(tag_of(s));
        self.text.push(s.into());
        let i = (self.text.len() - 1) as u32;
        self.index.insert(bytes.into(), i);
        Some(i)
    }
}

const NO_VALUE: u32 = u32::MAX;
/// How far past the memo's end a BINPUT index may reach (picklers number it without gaps).
const MEMO_GAP: usize = 1 << 16;
/// Values and marks the pickle stack may hold at once. A snapshot's pickle holds a few
/// thousand (PyTorch's pickler batches APPENDS and SETITEMS by 1,000); a million values of
/// 32 bytes is far past that and still small, where a gzip of 300 KB of EMPTY_LIST opcodes
/// would otherwise ask for gigabytes.
const MAX_STACK: usize = 1 << 20;
/// The longest string read (a snapshot's are file and function names): four copies of it live
/// at once while it is interned.
const MAX_STRING: usize = 64 << 20;
/// Entries converted before `append` first scans the stack to forget them.
const SCRATCH_SCAN_MIN: usize = 64;
/// Marks a memo entry that is a string id (most are), which then needs no `memo_vals` slot.
const STR_BIT: u32 = 1 << 31;

/// The trace entry with these fields, given as (key, integer value, value's tag), if it is
/// one (it has an `action` key): `Some(None)` for an entry whose action the replay ignores.
#[inline]
fn event_from(fields: impl Iterator<Item = (Tag, i64, Tag)>) -> Option<Option<Event>> {
    let mut kind = None;
    let mut is_entry = false;
    let (mut addr, mut size, mut stream, mut time) = (0i64, 0i64, 0i64, 0i64);
    for (key, int, val) in fields {
        match key {
            Tag::Action => {
                is_entry = true;
                if let Tag::Kind(k) = val {
                    kind = Some(k);
                }
            }
            Tag::Addr => addr = int,
            Tag::Size => size = int,
            Tag::Stream => stream = int,
            Tag::TimeUs => time = int,
            _ => {}
        }
    }
    if !is_entry {
        return None;
    }
    Some(kind.map(|kind| Event {
        kind,
        stream: stream as u64,
        addr: addr as u64,
        size: size.max(0) as u64,
        time_us: time.max(0) as u64,
    }))
}

/// The trace entry described by `pairs` (key, value, key, value, ...), if it is one.
fn entry_of(tags: &[Tag], pairs: &[V]) -> Option<Option<Event>> {
    let tag = |v: &V| match v {
        V::Str(i) => tags[*i as usize],
        _ => Tag::Other,
    };
    event_from(pairs.chunks_exact(2).map(|kv| {
        let int = match &kv[1] {
            V::Int(i) => *i,
            V::Bool(b) => *b as i64,
            _ => 0,
        };
        (tag(&kv[0]), int, tag(&kv[1]))
    }))
}

/// A LONG1/LONG4 operand of 1 to 8 bytes: little-endian two's complement.
#[inline]
fn long_le(b: &[u8]) -> i64 {
    let neg = b[b.len() - 1] & 0x80 != 0;
    let mut x = if neg { [0xffu8; 8] } else { [0u8; 8] };
    x[..b.len()].copy_from_slice(b);
    i64::from_le_bytes(x)
}

fn malformed(offset: u64, what: impl Into<String>) -> TraceError {
    TraceError::Malformed {
        offset,
        what: what.into(),
    }
}

impl<'a> Vm<'a> {
    fn pop(&mut self) -> Result<V, TraceError> {
        let off = self.inp.offset();
        self.stack
            .pop()
            .ok_or_else(|| malformed(off, "pickle stack underflow"))
    }

    fn top(&mut self) -> Result<&mut V, TraceError> {
        let off = self.inp.offset();
        self.stack
            .last_mut()
            .ok_or_else(|| malformed(off, "pickle stack is empty"))
    }

    fn pop_mark(&mut self) -> Result<Vec<V>, TraceError> {
        let off = self.inp.offset();
        let m = self
            .marks
            .pop()
            .ok_or_else(|| malformed(off, "no MARK on the pickle stack"))?;
        if m > self.stack.len() {
            return Err(malformed(off, "MARK above the stack top"));
        }
        Ok(self.stack.split_off(m))
    }

    /// Reads past `n` bytes of an operand not kept, a MiB at a time.
    fn skip(&mut self, mut n: usize, what: &str) -> Result<(), TraceError> {
        while n > 0 {
            let k = n.min(1 << 20);
            self.inp.take(k, what)?;
            n -= k;
        }
        Ok(())
    }

    fn string(&mut self, bytes: &[u8]) -> Result<V, TraceError> {
        self.strs
            .intern(bytes)
            .map(V::Str)
            .ok_or_else(|| malformed(self.inp.offset(), "string is not UTF-8"))
    }

    /// The value memoized at `i`: containers (not kept) and unknown indexes read as Shared.
    #[inline]
    fn memo_get(&self, i: usize) -> V {
        match self.memo.get(i) {
            Some(&k) if k != NO_VALUE => self.memo_value(k),
            _ => V::Shared,
        }
    }

    /// The value of a memo entry (not NO_VALUE).
    #[inline]
    fn memo_value(&self, k: u32) -> V {
        if k & STR_BIT != 0 {
            V::Str(k & !STR_BIT)
        } else {
            self.memo_vals[k as usize].clone()
        }
    }

    fn memo_put(&mut self, idx: u32) -> Result<(), TraceError> {
        let v = match self.top()? {
            // Containers are filled after they are memoized; a second reference to one is
            // represented as Shared rather than copied.
            V::List(_)
            | V::Dict(_)
            | V::Tuple
            | V::Events(_)
            | V::Entry(_)
            | V::Shared
            | V::Opaque => None,
            other => Some(other.clone()),
        };
        let i = idx as usize;
        if i >= self.memo.len() {
            // Picklers number the memo from 0 without gaps; a far index would only cost
            // memory (a 9-byte file asked for 8 GiB).
            // Nor can an index exceed the bytes read so far (each put takes at least one): a
            // chain of puts, each a gap further, would otherwise grow the memo without bound.
            if i > self.memo.len() + MEMO_GAP || i as u64 > self.inp.offset() {
                return Err(malformed(
                    self.inp.offset(),
                    format!(
                        "memo index {idx} far beyond the {} entries and {} bytes so far",
                        self.memo.len(),
                        self.inp.offset()
                    ),
                ));
            }
            self.memo.resize(i + 1, NO_VALUE);
        }
        self.memo[i] = match v {
            Some(V::Str(id)) if id < STR_BIT => id | STR_BIT,
            Some(v) => {
                self.memo_vals.push(v);
                (self.memo_vals.len() - 1) as u32
            }
            None => NO_VALUE,
        };
        Ok(())
    }

    fn tag(&self, v: &V) -> Tag {
        match v {
            V::Str(i) => self.strs.tags[*i as usize],
            _ => Tag::Other,
        }
    }

    /// Appends `items` to the list below them, streaming trace entries out.
    fn append(&mut self, items: Vec<V>) -> Result<(), TraceError> {
        let off = self.inp.offset();
        let mut target_id = match self.stack.last() {
            Some(V::Events(id)) => Some(*id),
            Some(_) => None,
            None => return Err(malformed(off, "APPEND with no list")),
        };
        let mut kept = Vec::new();
        for it in items {
            let as_event = match &it {
                V::Entry(i) => Some(self.scratch[*i as usize].take()),
                _ => None,
            };
            match as_event {
                Some(ev) => {
                    let id = match target_id {
                        Some(id) => id,
                        None => {
                            // A PyTorch trace entry takes about 70 pickled bytes: size the
                            // list once rather than growing (and copying) it many times.
                            // The hint (gzip's trailer) is the file's word, so the guess is
                            // capped: 4 M entries is more than the largest trace seen (1.66 M).
                            let guess = self.inp.size_hint.unwrap_or(0) / 72;
                            self.events
                                .push(Vec::with_capacity(guess.min(1 << 22) as usize));
                            let id = (self.events.len() - 1) as u32;
                            target_id = Some(id);
                            id
                        }
                    };
                    match ev {
                        Some(e) => self.events[id as usize].push(e),
                        None => self.skipped += 1,
                    }
                }
                None => kept.push(it),
            }
        }
        let target = self.stack.last_mut().expect("checked above");
        match (target, target_id) {
            // A list that received trace entries becomes an event list; anything else
            // appended to it is not kept.
            (t @ V::List(_), Some(id)) => *t = V::Events(id),
            (V::List(l), None) => l.extend(kept),
            (V::Events(_), _) | (V::Shared, _) | (V::Opaque, _) => {}
            _ => return Err(malformed(off, "APPEND to something that is not a list")),
        }
        // Forget converted entries once none is left on the stack. The stack is scanned only
        // when the list of entries has doubled since the last scan, so that a stack kept deep
        // on purpose does not make every APPEND scan it (quadratic time).
        if self.scratch.len() >= self.scratch_scan_at {
            if !self.stack.iter().any(|v| matches!(v, V::Entry(_))) {
                self.scratch.clear();
            }
            self.scratch_scan_at = (2 * self.scratch.len()).max(SCRATCH_SCAN_MIN);
        }
        Ok(())
    }

    /// SETITEMS: the pairs above the mark at `m` go into the dict below it. A fresh dict
    /// that turns out to be a trace entry is converted on the spot.
    fn set_items_from(&mut self, m: usize) -> Result<(), TraceError> {
        let off = self.inp.offset();
        if m == 0 || m > self.stack.len() {
            return Err(malformed(off, "SETITEMS with no dict"));
        }
        if (self.stack.len() - m) % 2 != 0 {
            return Err(malformed(off, "SETITEMS with an odd number of items"));
        }
        let (head, pairs) = self.stack.split_at_mut(m);
        let target = head.last_mut().expect("m > 0");
        match target {
            V::Dict(d) => {
                if d.is_empty() {
                    if let Some(ev) = entry_of(&self.strs.tags, pairs) {
                        self.scratch.push(ev);
                        *target = V::Entry((self.scratch.len() - 1) as u32);
                        self.stack.truncate(m);
                        return Ok(());
                    }
                }
                for kv in pairs.chunks_exact_mut(2) {
                    d.push((
                        std::mem::replace(&mut kv[0], V::None),
                        std::mem::replace(&mut kv[1], V::None),
                    ));
                }
            }
            V::Shared | V::Opaque => {}
            _ => return Err(malformed(off, "SETITEMS on something that is not a dict")),
        }
        self.stack.truncate(m);
        Ok(())
    }

    /// Decodes, straight from the buffer, the few opcodes trace entries are made of, while at
    /// least 16 bytes are buffered; returns at the first other opcode (or a short buffer) for
    /// [`Vm::run`]'s general loop. About three times faster than one opcode at a time.
    fn fast_ops(&mut self) -> Result<(), TraceError> {
        loop {
            let w = self.inp.window();
            if w.len() < 16 {
                return Ok(());
            }
            let mut b = [0u8; 16];
            b.copy_from_slice(&w[..16]);
            let used = match b[0] {
                b'h' => {
                    let v = self.memo_get(b[1] as usize);
                    self.stack.push(v);
                    2
                }
                b'j' => {
                    let v = self.memo_get(u32::from_le_bytes([b[1], b[2], b[3], b[4]]) as usize);
                    self.stack.push(v);
                    5
                }
                0x94 => {
                    let i = self.next_memo;
                    self.next_memo += 1;
                    self.memo_put(i)?;
                    1
                }
                b'}' => match self.whole_entry() {
                    Some(used) => used,
                    None => {
                        self.stack.push(V::Dict(Vec::new()));
                        1
                    }
                },
                b'(' => {
                    self.marks.push(self.stack.len());
                    1
                }
                b'K' => {
                    self.stack.push(V::Int(b[1] as i64));
                    2
                }
                b'M' => {
                    self.stack
                        .push(V::Int(u16::from_le_bytes([b[1], b[2]]) as i64));
                    3
                }
                b'J' => {
                    let v = i32::from_le_bytes([b[1], b[2], b[3], b[4]]) as i64;
                    self.stack.push(V::Int(v));
                    5
                }
                0x8a if (1..=8).contains(&b[1]) => {
                    let n = b[1] as usize;
                    self.stack.push(V::Int(long_le(&b[2..2 + n])));
                    2 + n
                }
                b'u' => {
                    let off = self.inp.offset();
                    let m = self
                        .marks
                        .pop()
                        .ok_or_else(|| malformed(off, "no MARK on the pickle stack"))?;
                    self.set_items_from(m)?;
                    1
                }
                _ => return Ok(()),
            };
            self.inp.advance(used);
        }
    }

    /// A whole trace entry at the head of the buffer, parsed without the stack: EMPTY_DICT
    /// MEMOIZE MARK, then (key, value) pairs whose keys are strings and whose values are
    /// integers, booleans, None or strings (new strings are memoized as they come), then
    /// SETITEMS. Returns the bytes it spans with the entry pushed, or `None` (having changed
    /// nothing) for anything else, which the general loop then reads.
    fn whole_entry(&mut self) -> Option<usize> {
        let w = self.inp.window();
        let w = &w[..w.len().min(512)];
        if w.len() < 4 || w[1] != 0x94 || w[2] != b'(' {
            return None;
        }
        // A string operand: a memo reference, or a new short string memoized at once.
        enum S {
            Memo(usize),
            New(usize, usize),
        }
        fn string_at(w: &[u8], at: &mut usize) -> Option<S> {
            match *w.get(*at)? {
                b'h' => {
                    *at += 2;
                    Some(S::Memo(*w.get(*at - 1)? as usize))
                }
                b'j' => {
                    let b = w.get(*at + 1..*at + 5)?;
                    *at += 5;
                    Some(S::Memo(
                        u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize
                    ))
                }
                0x8c => {
                    let n = *w.get(*at + 1)? as usize;
                    let start = *at + 2;
                    if *w.get(start + n)? != 0x94 {
                        return None;
                    }
                    *at = start + n + 1;
                    Some(S::New(start, n))
                }
                _ => None,
            }
        }
        // First pass: check the whole entry and collect what it says.
        let mut at = 3;
        let mut pairs: [(Option<S>, i64, Option<S>); 12] = Default::default();
        let mut n_pairs = 0;
        loop {
            if *w.get(at)? == b'u' {
                at += 1;
                break;
            }
            if n_pairs == pairs.len() {
                return None;
            }
            let key = string_at(w, &mut at)?;
            let op = *w.get(at)?;
            let (int, val) = match op {
                b'K' => {
                    at += 2;
                    (*w.get(at - 1)? as i64, None)
                }
                b'M' => {
                    let b = w.get(at + 1..at + 3)?;
                    at += 3;
                    (u16::from_le_bytes([b[0], b[1]]) as i64, None)
                }
                b'J' => {
                    let b = w.get(at + 1..at + 5)?;
                    at += 5;
                    (i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64, None)
                }
                0x8a => {
                    let n = *w.get(at + 1)? as usize;
                    if !(1..=8).contains(&n) {
                        return None;
                    }
                    let b = w.get(at + 2..at + 2 + n)?;
                    at += 2 + n;
                    (long_le(b), None)
                }
                0x88 | 0x89 => {
                    at += 1;
                    ((op == 0x88) as i64, None)
                }
                b'N' => {
                    at += 1;
                    (0, None)
                }
                _ => (0, Some(string_at(w, &mut at)?)),
            };
            pairs[n_pairs] = (Some(key), int, val);
            n_pairs += 1;
        }
        // Memo references must name strings already known, and one key must be "action":
        // other dicts (segments, settings) are left to the general loop, which keeps them.
        // Only references to slots filled before this entry: the second pass fills the slots
        // from `next_memo` on, and must not change what a reference of this entry reads.
        let tag_now = |s: &S| -> Option<Tag> {
            match *s {
                S::Memo(i) if i >= self.next_memo as usize => None,
                S::Memo(i) => match self.memo.get(i) {
                    Some(&k) if k != NO_VALUE => match self.memo_value(k) {
                        V::Str(id) => Some(self.strs.tags[id as usize]),
                        _ => None,
                    },
                    _ => None,
                },
                S::New(a, n) => std::str::from_utf8(&w[a..a + n]).ok().map(tag_of),
            }
        };
        let mut has_action = false;
        for (k, _, v) in &pairs[..n_pairs] {
            has_action |= tag_now(k.as_ref().expect("set"))? == Tag::Action;
            if let Some(v) = v {
                tag_now(v)?;
            }
        }
        if !has_action {
            return None;
        }
        // Second pass: memoize as the pickle does (the dict first, then each new string), and
        // read the entry.
        let dict_memo = self.next_memo as usize;
        self.next_memo += 1;
        let mut tag_of_s = |s: &S, memo: &mut Vec<u32>, next: &mut u32| -> Tag {
            let id = match *s {
                S::Memo(i) => {
                    let k = memo[i];
                    if k & STR_BIT != 0 {
                        k & !STR_BIT
                    } else {
                        match &self.memo_vals[k as usize] {
                            V::Str(id) => *id,
                            _ => unreachable!("checked above"),
                        }
                    }
                }
                S::New(a, n) => {
                    let id = self.strs.intern(&w[a..a + n]).expect("checked above");
                    let m = *next as usize;
                    *next += 1;
                    if memo.len() <= m {
                        memo.resize(m + 1, NO_VALUE);
                    }
                    memo[m] = id | STR_BIT;
                    id
                }
            };
            self.strs.tags[id as usize]
        };
        let mut memo = std::mem::take(&mut self.memo);
        if memo.len() <= dict_memo {
            memo.resize(dict_memo + 1, NO_VALUE);
        }
        memo[dict_memo] = NO_VALUE;
        let mut next = self.next_memo;
        let entry = event_from(pairs[..n_pairs].iter().map(|(k, int, v)| {
            let key = tag_of_s(k.as_ref().expect("set"), &mut memo, &mut next);
            let val = v.as_ref().map(|v| tag_of_s(v, &mut memo, &mut next));
            (key, *int, val.unwrap_or(Tag::Other))
        }))
        .expect("an action key, checked above");
        self.memo = memo;
        self.next_memo = next;
        self.scratch.push(entry);
        self.stack.push(V::Entry((self.scratch.len() - 1) as u32));
        Some(at)
    }

    fn run(&mut self) -> Result<V, TraceError> {
        loop {
            if self.stack.len() + self.marks.len() > MAX_STACK {
                return Err(malformed(
                    self.inp.offset(),
                    format!(
                        "the pickle stack holds over {MAX_STACK} values and marks (a memory \
                         snapshot's holds a few thousand)"
                    ),
                ));
            }
            self.fast_ops()?;
            let off = self.inp.offset();
            let Some(op) = self.inp.next_byte()? else {
                return Err(TraceError::Truncated(format!(
                    "{}: the pickle ends at byte {off} before its STOP opcode",
                    self.inp.name()
                )));
            };
            match op {
                0x80 => {
                    // PROTO
                    let v = self.inp.take(1, "PROTO")?[0];
                    if v > 5 {
                        return Err(malformed(
                            off,
                            format!("pickle protocol {v} is not supported"),
                        ));
                    }
                }
                0x95 => {
                    // FRAME: a length hint only.
                    self.inp.take(8, "FRAME")?;
                }
                b'.' => return self.pop(),
                b'(' => self.marks.push(self.stack.len()),
                b'}' => self.stack.push(V::Dict(Vec::new())),
                b']' => self.stack.push(V::List(Vec::new())),
                b')' => self.stack.push(V::Tuple),
                0x8f => self.stack.push(V::List(Vec::new())), // EMPTY_SET
                b'N' => self.stack.push(V::None),
                0x88 => self.stack.push(V::Bool(true)),
                0x89 => self.stack.push(V::Bool(false)),
                b'K' => {
                    let v = self.inp.take(1, "BININT1")?[0];
                    self.stack.push(V::Int(v as i64));
                }
                b'M' => {
                    let b = self.inp.take(2, "BININT2")?;
                    self.stack
                        .push(V::Int(u16::from_le_bytes([b[0], b[1]]) as i64));
                }
                b'J' => {
                    let b = self.inp.take(4, "BININT")?;
                    self.stack
                        .push(V::Int(i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64));
                }
                0x8a | 0x8b => {
                    // LONG1 / LONG4: little-endian two's complement.
                    let n = if op == 0x8a {
                        self.inp.take(1, "LONG1")?[0] as usize
                    } else {
                        let b = self.inp.take(4, "LONG4")?;
                        u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize
                    };
                    if n == 0 {
                        self.stack.push(V::Int(0));
                    } else if n <= 8 {
                        let b = self.inp.take(n, "LONG")?;
                        self.stack.push(V::Int(long_le(b)));
                    } else {
                        // Beyond any size or address: read past, never held (LONG4 may
                        // announce 4 GiB).
                        self.skip(n, "LONG")?;
                        self.stack.push(V::BigInt);
                    }
                }
                b'G' => {
                    let b = self.inp.take(8, "BINFLOAT")?;
                    let mut a = [0u8; 8];
                    a.copy_from_slice(b);
                    let _ = f64::from_be_bytes(a);
                    self.stack.push(V::Float);
                }
                0x8c | b'X' | 0x8d | b'U' | b'T' => {
                    // SHORT_BINUNICODE, BINUNICODE, BINUNICODE8, SHORT_BINSTRING, BINSTRING
                    let n = match op {
                        0x8c | b'U' => self.inp.take(1, "string length")?[0] as usize,
                        0x8d => {
                            let b = self.inp.take(8, "string length")?;
                            let mut a = [0u8; 8];
                            a.copy_from_slice(b);
                            u64::from_le_bytes(a) as usize
                        }
                        _ => {
                            let b = self.inp.take(4, "string length")?;
                            u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize
                        }
                    };
                    if n > MAX_STRING {
                        return Err(malformed(
                            off,
                            format!(
                                "string of {n} bytes (at most {MAX_STRING} are read; a memory \
                                 snapshot's strings are names)"
                            ),
                        ));
                    }
                    let bytes = self.inp.take(n, "string")?.to_vec();
                    let v = self.string(&bytes)?;
                    self.stack.push(v);
                }
                b'C' | b'B' | 0x8e => {
                    // SHORT_BINBYTES, BINBYTES, BINBYTES8
                    let n = match op {
                        b'C' => self.inp.take(1, "bytes length")?[0] as usize,
                        b'B' => {
                            let b = self.inp.take(4, "bytes length")?;
                            u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize
                        }
                        _ => {
                            let b = self.inp.take(8, "bytes length")?;
                            let mut a = [0u8; 8];
                            a.copy_from_slice(b);
                            u64::from_le_bytes(a) as usize
                        }
                    };
                    if n > 1 << 30 {
                        return Err(malformed(off, format!("bytes object of {n} bytes")));
                    }
                    self.skip(n, "bytes")?;
                    self.stack.push(V::Bytes);
                }
                0x94 => {
                    // MEMOIZE
                    let i = self.next_memo;
                    self.next_memo += 1;
                    self.memo_put(i)?;
                }
                b'q' => {
                    let i = self.inp.take(1, "BINPUT")?[0] as u32;
                    self.memo_put(i)?;
                }
                b'r' => {
                    let b = self.inp.take(4, "LONG_BINPUT")?;
                    let i = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    self.memo_put(i)?;
                }
                b'h' | b'j' => {
                    let i = if op == b'h' {
                        self.inp.take(1, "BINGET")?[0] as u32
                    } else {
                        let b = self.inp.take(4, "LONG_BINGET")?;
                        u32::from_le_bytes([b[0], b[1], b[2], b[3]])
                    };
                    let v = self.memo_get(i as usize);
                    self.stack.push(v);
                }
                b's' => {
                    let m = self.stack.len().saturating_sub(2);
                    if self.stack.len() < 3 {
                        return Err(malformed(off, "SETITEM with too few items"));
                    }
                    self.set_items_from(m)?;
                }
                b'u' => {
                    let m = self
                        .marks
                        .pop()
                        .ok_or_else(|| malformed(off, "no MARK on the pickle stack"))?;
                    self.set_items_from(m)?;
                }
                b'a' => {
                    let v = self.pop()?;
                    self.append(vec![v])?;
                }
                b'e' | 0x90 => {
                    // APPENDS, ADDITEMS
                    let items = self.pop_mark()?;
                    self.append(items)?;
                }
                b't' => {
                    let items = self.pop_mark()?;
                    self.stack.push(tuple_of(&items));
                }
                0x91 => {
                    // FROZENSET
                    let items = self.pop_mark()?;
                    self.stack.push(V::List(items));
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    if self.stack.len() < n {
                        return Err(malformed(off, "TUPLE with too few items"));
                    }
                    let t = tuple_of(&self.stack[self.stack.len() - n..]);
                    self.stack.truncate(self.stack.len() - n);
                    self.stack.push(t);
                }
                b'0' => {
                    self.pop()?;
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    // DUP: a second reference to a container is Shared, as for the memo (a
                    // copy would let a few bytes of DUP and APPEND double the memory each time).
                    let v = match self.top()? {
                        V::List(_) | V::Dict(_) | V::Events(_) | V::Entry(_) => V::Shared,
                        other => other.clone(),
                    };
                    self.stack.push(v);
                }
                b'c' => {
                    // GLOBAL module\nname\n
                    for _ in 0..2 {
                        loop {
                            let Some(b) = self.inp.next_byte()? else {
                                return Err(TraceError::Truncated("inside GLOBAL".into()));
                            };
                            if b == b'\n' {
                                break;
                            }
                        }
                    }
                    self.stack.push(V::Opaque);
                }
                0x93 => {
                    // STACK_GLOBAL
                    self.pop()?;
                    self.pop()?;
                    self.stack.push(V::Opaque);
                }
                b'R' | 0x81 => {
                    // REDUCE, NEWOBJ
                    self.pop()?;
                    self.pop()?;
                    self.stack.push(V::Opaque);
                }
                0x92 => {
                    // NEWOBJ_EX
                    self.pop()?;
                    self.pop()?;
                    self.pop()?;
                    self.stack.push(V::Opaque);
                }
                b'b' => {
                    // BUILD: state applied to the object below.
                    self.pop()?;
                }
                b'Q' => {
                    // BINPERSID
                    self.pop()?;
                    self.stack.push(V::Opaque);
                }
                _ => {
                    return Err(malformed(
                        off,
                        format!(
                        "unsupported pickle opcode {op:#04x} (is this a PyTorch memory snapshot?)"
                    ),
                    ))
                }
            }
        }
    }

    fn dict_get<'v>(&self, items: &'v [(V, V)], tag: Tag) -> Option<&'v V> {
        items
            .iter()
            .find(|(k, _)| self.tag(k) == tag)
            .map(|(_, v)| v)
    }
}

/// Reads a snapshot pickle and returns the events of device `device`.
pub fn read_snapshot(inp: &mut Input, device: u32) -> Result<Trace, TraceError> {
    read_snapshot_full(inp, device).map(|s| s.trace)
}

/// What a block of a snapshot segment is doing, with PyTorch's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum BlockState {
    /// `active_allocated`: in use by a tensor.
    ActiveAllocated,
    /// `active_pending_free`: freed, waiting for the work of other streams that used it.
    ActivePendingFree,
    /// `inactive`: cached, free for reuse.
    Inactive,
}

impl BlockState {
    /// PyTorch's name.
    pub fn torch_name(self) -> &'static str {
        match self {
            BlockState::ActiveAllocated => "active_allocated",
            BlockState::ActivePendingFree => "active_pending_free",
            BlockState::Inactive => "inactive",
        }
    }

    /// From PyTorch's name (other `active_*` spellings of older versions count as pending).
    pub fn from_torch(name: &str) -> Option<BlockState> {
        match name {
            "active_allocated" => Some(BlockState::ActiveAllocated),
            "inactive" => Some(BlockState::Inactive),
            n if n.starts_with("active_") => Some(BlockState::ActivePendingFree),
            _ => None,
        }
    }

    /// Allocated or waiting to be freed (PyTorch's "active").
    pub fn is_active(self) -> bool {
        self != BlockState::Inactive
    }
}

/// One block of a snapshot segment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SnapshotBlock {
    /// Address.
    pub address: u64,
    /// Bytes.
    pub size: u64,
    /// Bytes the user asked for.
    pub requested_size: u64,
    /// State.
    pub state: BlockState,
}

/// One segment of a snapshot (`torch.cuda.memory._snapshot()["segments"]`): memory held from
/// the device, and the blocks it is cut into.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SnapshotSegment {
    /// Device ordinal.
    pub device: u32,
    /// Address.
    pub address: u64,
    /// Bytes.
    pub total_size: u64,
    /// Stream.
    pub stream: u64,
    /// Pool (`segment_type` "small" or "large").
    pub pool: Pool,
    /// Part of an expandable segment (a mapped range of a virtual reservation).
    pub is_expandable: bool,
    /// The private pool (a CUDA graph's or a MemPool's) it belonged to, as PyTorch names it
    /// (`segment_pool_id`); (0, 0) for none.
    pub pool_id: (u64, u64),
    /// Blocks by address.
    pub blocks: Vec<SnapshotBlock>,
}

/// A snapshot: the allocation history of one device and its segments when it was taken.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// The history (`device_traces[device]`).
    pub trace: Trace,
    /// The segments of that device.
    pub segments: Vec<SnapshotSegment>,
}

/// Reads a snapshot file (gzipped or not): the history and the segments of `device`.
pub fn load_snapshot(
    path: &std::path::Path,
    device: u32,
    progress: Option<super::input::Progress>,
) -> Result<Snapshot, TraceError> {
    let name = path.display().to_string();
    let file = std::fs::File::open(path).map_err(|source| TraceError::Io {
        path: name.clone(),
        source,
    })?;
    let mut inp = Input::open(Box::new(file), &name, progress)?;
    if inp.peek(1)?.first() != Some(&0x80) {
        return Err(TraceError::UnknownFormat(format!(
            "{name}: not a pickle (a PyTorch memory snapshot from torch.cuda.memory._snapshot() \
             or gpumem)"
        )));
    }
    let mut s = read_snapshot_full(&mut inp, device)?;
    s.trace.meta.source = name;
    super::validate(&s.trace)?;
    Ok(s)
}

/// Reads a snapshot from bytes in memory (a pickle, gzipped or not).
pub fn read_snapshot_bytes(
    bytes: Vec<u8>,
    name: &str,
    device: u32,
) -> Result<Snapshot, TraceError> {
    let mut inp = Input::open(Box::new(std::io::Cursor::new(bytes)), name, None)?;
    let mut s = read_snapshot_full(&mut inp, device)?;
    s.trace.meta.source = name.to_string();
    super::validate(&s.trace)?;
    Ok(s)
}

/// Reads a snapshot pickle: the events and the segments of device `device`.
pub fn read_snapshot_full(inp: &mut Input, device: u32) -> Result<Snapshot, TraceError> {
    let name = inp.name().to_string();
    let mut vm = Vm {
        inp,
        stack: Vec::with_capacity(64),
        marks: Vec::with_capacity(16),
        memo: Vec::new(),
        memo_vals: Vec::new(),
        next_memo: 0,
        scratch_scan_at: SCRATCH_SCAN_MIN,
        scratch: Vec::new(),
        strs: Strings::default(),
        events: Vec::new(),
        skipped: 0,
    };
    let top = vm.run()?;
    let V::Dict(items) = &top else {
        return Err(TraceError::UnknownFormat(format!(
            "{name}: the pickle holds no allocation history (an old snapshot without \
             device_traces? record with torch.cuda.memory._record_memory_history())"
        )));
    };
    let mut meta = TraceMeta {
        format: "pytorch-snapshot".into(),
        device,
        skipped_entries: vm.skipped,
        ..TraceMeta::default()
    };
    if let Some(V::Dict(settings)) = vm.dict_get(items, Tag::AllocatorSettings) {
        if let Some(V::Bool(b)) = vm.dict_get(settings, Tag::ExpandableSegments) {
            meta.expandable_segments = Some(*b);
        }
        if let Some(V::Str(s)) = vm.dict_get(settings, Tag::AllocConf) {
            meta.alloc_conf = Some(vm.strs.text[*s as usize].to_string());
        }
    }
    let per_device: Vec<Option<u32>> = match vm.dict_get(items, Tag::DeviceTraces) {
        Some(V::List(l)) => l
            .iter()
            .map(|v| match v {
                V::Events(id) => Some(*id),
                _ => None,
            })
            .collect(),
        _ => {
            return Err(TraceError::UnknownFormat(format!(
                "{name}: the snapshot has no device_traces: record with \
                 torch.cuda.memory._record_memory_history() before taking it"
            )))
        }
    };
    let events = match per_device.get(device as usize) {
        Some(Some(id)) => std::mem::take(&mut vm.events[*id as usize]),
        Some(None) => Vec::new(),
        None => {
            return Err(TraceError::Inconsistent {
                index: 0,
                what: format!(
                    "the snapshot has traces for {} device(s); device {device} is not one of them",
                    per_device.len()
                ),
            })
        }
    };
    let segments = match vm.get(items, "segments") {
        Some(V::List(l)) => l
            .iter()
            .enumerate()
            .map(|(i, v)| vm.segment(v, i))
            .filter(|s| !matches!(s, Ok(seg) if seg.device != device))
            .collect::<Result<Vec<_>, _>>()?,
        Some(V::Shared) | None => Vec::new(),
        Some(_) => return Err(malformed(0, format!("{name}: 'segments' is not a list"))),
    };
    meta.pool_segments = segments.iter().filter(|s| s.pool_id != (0, 0)).count() as u64;
    Ok(Snapshot {
        trace: Trace { events, meta },
        segments,
    })
}

/// A tuple's value: a pair of integers is kept (`segment_pool_id`), any other tuple is not.
fn tuple_of(items: &[V]) -> V {
    match items {
        [V::Int(a), V::Int(b)] => V::IntPair(*a, *b),
        _ => V::Tuple,
    }
}

impl Vm<'_> {
    /// The value under string key `key` of a dict's items.
    fn get<'v>(&self, items: &'v [(V, V)], key: &str) -> Option<&'v V> {
        items
            .iter()
            .find(|(k, _)| matches!(k, V::Str(i) if &*self.strs.text[*i as usize] == key))
            .map(|(_, v)| v)
    }

    fn str_of<'s>(&'s self, v: &V) -> Option<&'s str> {
        match v {
            V::Str(i) => Some(&self.strs.text[*i as usize]),
            _ => None,
        }
    }

    /// An integer field of segment `seg` (blocks: `block`), or a clear error.
    fn int_field(
        &self,
        items: &[(V, V)],
        key: &str,
        seg: usize,
        block: Option<usize>,
    ) -> Result<Option<i64>, TraceError> {
        match self.get(items, key) {
            None | Some(V::None) => Ok(None),
            Some(V::Int(i)) => Ok(Some(*i)),
            Some(V::Bool(b)) => Ok(Some(*b as i64)),
            Some(_) => Err(malformed(
                0,
                format!(
                    "segment {seg}{}: '{key}' is not an integer",
                    block.map(|b| format!(" block {b}")).unwrap_or_default()
                ),
            )),
        }
    }

    fn segment(&self, v: &V, i: usize) -> Result<SnapshotSegment, TraceError> {
        let V::Dict(items) = v else {
            return Err(malformed(0, format!("segment {i} is not a dict")));
        };
        let need = |key: &str| -> Result<u64, TraceError> {
            self.int_field(items, key, i, None)?
                .map(|v| v.max(0) as u64)
                .ok_or_else(|| malformed(0, format!("segment {i} has no '{key}'")))
        };
        let address = need("address")?;
        let total_size = need("total_size")?;
        let device = self
            .int_field(items, "device", i, None)?
            .unwrap_or(0)
            .max(0) as u32;
        let stream = self.int_field(items, "stream", i, None)?.unwrap_or(0) as u64;
        let pool = match self.get(items, "segment_type").and_then(|v| self.str_of(v)) {
            Some("small") => Pool::Small,
            Some("large") | None => Pool::Large,
            Some(other) => {
                return Err(malformed(
                    0,
                    format!("segment {i}: segment_type '{other}' is neither small nor large"),
                ))
            }
        };
        let is_expandable = matches!(self.get(items, "is_expandable"), Some(V::Bool(true)));
        let pool_id = match self.get(items, "segment_pool_id") {
            Some(&V::IntPair(a, b)) => (a as u64, b as u64),
            _ => (0, 0),
        };
        let mut blocks = Vec::new();
        if let Some(V::List(l)) = self.get(items, "blocks") {
            let mut next = address;
            for (j, b) in l.iter().enumerate() {
                let V::Dict(bi) = b else {
                    return Err(malformed(0, format!("segment {i} block {j} is not a dict")));
                };
                let size = self
                    .int_field(bi, "size", i, Some(j))?
                    .ok_or_else(|| malformed(0, format!("segment {i} block {j} has no size")))?
                    .max(0) as u64;
                let state_name = self.get(bi, "state").and_then(|v| self.str_of(v));
                let state = state_name.and_then(BlockState::from_torch).ok_or_else(|| {
                    malformed(
                        0,
                        format!(
                            "segment {i} block {j}: unknown state {:?}",
                            state_name.unwrap_or("(none)")
                        ),
                    )
                })?;
                // Older snapshots have no block addresses: blocks tile their segment.
                let addr = self
                    .int_field(bi, "address", i, Some(j))?
                    .map(|a| a as u64)
                    .unwrap_or(next);
                let requested = self
                    .int_field(bi, "requested_size", i, Some(j))?
                    .map(|r| r.max(0) as u64)
                    .unwrap_or(size);
                next = addr + size;
                blocks.push(SnapshotBlock {
                    address: addr,
                    size,
                    requested_size: requested,
                    state,
                });
            }
        }
        Ok(SnapshotSegment {
            device,
            address,
            total_size,
            stream,
            pool,
            is_expandable,
            pool_id,
            blocks,
        })
    }
}
