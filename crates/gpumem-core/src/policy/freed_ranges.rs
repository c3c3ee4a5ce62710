//! Freed byte ranges of a shared range, each with the stream that freed it and when (see
//! `shared_range`): disjoint, in address order, in one sorted vector.
//!
//! Why not a `BTreeMap`: the shared range consults these records on every allocation and
//! free, and holds about a hundred of them (the prefetch trace: 106 on average, 170 at most).
//! At that size a binary search over one vector and a move of its tail cost less than the
//! map's node walks: the map's `range`, `remove` and `insert` made about 3,000 instructions
//! of every alloc/free pair in the prefetch trace's replay (callgrind, session 30).

/// A freed range: its end, the stream that freed it, and the pool epoch of the free.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Freed {
    pub end: u64,
    pub stream: u32,
    pub stamp: u64,
}

/// Disjoint freed ranges `[start, end)`, sorted by start (so by end too).
#[derive(Debug, Default)]
pub(crate) struct FreedRanges {
    items: Vec<(u64, Freed)>,
}

impl FreedRanges {
    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn clear(&mut self) {
        self.items.clear();
    }

    /// Every record, in address order: (start, record).
    #[cfg(test)]
    pub fn iter(&self) -> impl Iterator<Item = &(u64, Freed)> {
        self.items.iter()
    }

    /// The positions of the records that overlap `[addr, end)`: the first whose end lies past
    /// `addr` up to the first that starts at or after `end`.
    #[inline]
    fn span(&self, addr: u64, end: u64) -> std::ops::Range<usize> {
        let first = self.items.partition_point(|(_, r)| r.end <= addr);
        let mut last = first;
        while last < self.items.len() && self.items[last].0 < end {
            last += 1;
        }
        first..last
    }

    /// The records that overlap `[addr, end)`, whole.
    #[cfg(test)]
    pub fn overlapping(&self, addr: u64, end: u64) -> &[(u64, Freed)] {
        &self.items[self.span(addr, end)]
    }

    /// Puts `with` (if any) in place of `[addr, end)`, whose overlapping records are at
    /// `span`: they keep only their parts outside it. One move of the vector's tail at most.
    /// Returns where `with` went (or would have gone).
    #[inline]
    fn replace_span(
        &mut self,
        span: std::ops::Range<usize>,
        addr: u64,
        end: u64,
        with: Option<Freed>,
    ) -> usize {
        let left = span
            .clone()
            .next()
            .map(|i| self.items[i])
            .filter(|&(start, _)| start < addr)
            .map(|(start, r)| (start, Freed { end: addr, ..r }));
        let right = span
            .clone()
            .next_back()
            .map(|i| self.items[i].1)
            .filter(|r| r.end > end)
            .map(|r| (end, r));
        let at = span.start + usize::from(left.is_some());
        let mut pieces = left.into_iter().chain(with.map(|r| (addr, r))).chain(right);
        // `splice` alone would do, but its drain costs more than the records' moves here:
        // about 380 more instructions per alloc/free pair on the prefetch replay. A span of
        // none or one record (the common cases) is written in place instead.
        match span.len() {
            // No record overlaps, so the only piece is `with`.
            0 => {
                if let Some(p) = pieces.next() {
                    self.items.insert(span.start, p);
                }
            }
            1 => match pieces.next() {
                Some(p) => {
                    self.items[span.start] = p;
                    for (i, p) in pieces.enumerate() {
                        self.items.insert(span.start + 1 + i, p);
                    }
                }
                None => {
                    self.items.remove(span.start);
                }
            },
            _ => self.items.splice(span, pieces).for_each(drop),
        }
        at
    }

    /// Forgets `[addr, end)`: the records overlapping it keep only their parts outside it.
    #[cfg(test)]
    pub fn cut(&mut self, addr: u64, end: u64) {
        self.replace_span(self.span(addr, end), addr, end, None);
    }

    /// Shows `visit` the records that overlap `[addr, end)` (if any), then, if it succeeds,
    /// forgets `[addr, end)` as [`FreedRanges::cut`] does; if it fails, nothing changes. One
    /// search serves both (an allocation in a shared range does this every time).
    #[inline]
    pub fn cut_after<E>(
        &mut self,
        addr: u64,
        end: u64,
        visit: impl FnOnce(&[(u64, Freed)]) -> Result<(), E>,
    ) -> Result<(), E> {
        let span = self.span(addr, end);
        if span.is_empty() {
            return Ok(());
        }
        visit(&self.items[span.clone()])?;
        self.replace_span(span, addr, end, None);
        Ok(())
    }

    /// Whether the records are disjoint, in address order and none empty.
    pub fn check(&self) -> Result<(), String> {
        let mut last_end = 0;
        for &(a, r) in &self.items {
            if a < last_end || r.end <= a {
                return Err(format!("freed records overlap or are empty at {a:#x}"));
            }
            last_end = r.end;
        }
        Ok(())
    }

    /// Records `[addr, r.end)` as freed, in place of whatever records it overlaps, and joins
    /// it with a neighbour it touches that the same stream freed at the same epoch: a taker
    /// waits for the same point of that stream either way. (A stream's frees between two
    /// marks share their epoch, so a layer's worth of freed tensors becomes one record.)
    pub fn insert(&mut self, addr: u64, r: Freed) {
        debug_assert!(addr < r.end, "a freed range is not empty");
        let same = |a: &Freed, b: &Freed| a.stream == b.stream && a.stamp == b.stamp;
        let span = self.span(addr, r.end);
        if span.is_empty() {
            // The common case (a live block's bytes, cut when it was placed): no record
            // overlaps. A touching neighbour of the same stream and epoch grows in place,
            // rather than the record going in and then out again (two moves of the tail).
            let i = span.start;
            let prev = i > 0 && {
                let p = &self.items[i - 1].1;
                p.end == addr && same(p, &r)
            };
            let next = self
                .items
                .get(i)
                .is_some_and(|&(start, n)| start == r.end && same(&n, &r));
            match (prev, next) {
                (true, true) => {
                    self.items[i - 1].1.end = self.items[i].1.end;
                    self.items.remove(i);
                }
                (true, false) => self.items[i - 1].1.end = r.end,
                (false, true) => self.items[i].0 = addr,
                (false, false) => self.items.insert(i, (addr, r)),
            }
            return;
        }
        let i = self.replace_span(span, addr, r.end, Some(r));
        if let Some(&(next, n)) = self.items.get(i + 1) {
            if next == r.end && same(&n, &r) {
                self.items[i].1.end = n.end;
                self.items.remove(i + 1);
            }
        }
        if i > 0 {
            let (prev, cur) = (self.items[i - 1].1, self.items[i].1);
            if prev.end == addr && same(&prev, &cur) {
                self.items[i - 1].1.end = cur.end;
                self.items.remove(i);
            }
        }
    }

    /// Keeps only the records for which `keep` holds.
    pub fn retain(&mut self, mut keep: impl FnMut(&Freed) -> bool) {
        self.items.retain(|(_, r)| keep(r));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn freed(end: u64, stream: u32) -> Freed {
        Freed {
            end,
            stream,
            stamp: stream as u64,
        }
    }

    #[test]
    fn a_cut_keeps_the_parts_outside_it_and_an_insert_replaces() {
        let mut f = FreedRanges::default();
        f.insert(0, freed(100, 1));
        f.cut(40, 60);
        let got: Vec<_> = f.iter().map(|&(a, r)| (a, r.end, r.stream)).collect();
        assert_eq!(got, vec![(0, 40, 1), (60, 100, 1)]);
        f.insert(30, freed(70, 2));
        let got: Vec<_> = f.iter().map(|&(a, r)| (a, r.end, r.stream)).collect();
        assert_eq!(got, vec![(0, 30, 1), (30, 70, 2), (70, 100, 1)]);
        assert_eq!(f.overlapping(69, 71).len(), 2);
        assert_eq!(f.overlapping(100, 200).len(), 0);
        f.cut(0, 100);
        assert_eq!(f.len(), 0);
    }

    #[test]
    fn touching_frees_of_one_stream_and_epoch_become_one_record() {
        let mut f = FreedRanges::default();
        f.insert(10, freed(20, 1));
        f.insert(30, freed(40, 1));
        f.insert(20, freed(30, 1));
        let got: Vec<_> = f.iter().map(|&(a, r)| (a, r.end)).collect();
        assert_eq!(got, vec![(10, 40)], "joined on both sides");
        // Another stream, or the same stream at another epoch, stays apart.
        f.insert(40, freed(50, 2));
        f.insert(
            50,
            Freed {
                end: 60,
                stream: 2,
                stamp: 9,
            },
        );
        assert_eq!(f.len(), 3);
    }

    /// The same records kept byte by byte: what the sorted vector must agree with.
    fn model_apply(model: &mut [Option<(u32, u64)>], op: &(bool, u64, u64, u32)) {
        let &(ins, a, len, s) = op;
        for b in &mut model[a as usize..(a + len) as usize] {
            *b = ins.then_some((s, s as u64));
        }
    }

    proptest! {
        #[test]
        fn agrees_with_a_byte_by_byte_model(
            ops in proptest::collection::vec((any::<bool>(), 0u64..60, 1u64..20, 0u32..3), 1..80),
            probe in (0u64..79, 1u64..10),
        ) {
            let mut f = FreedRanges::default();
            let mut model = vec![None; 80];
            for op in &ops {
                let &(ins, a, len, s) = op;
                if ins {
                    f.insert(a, freed(a + len, s));
                    model_apply(&mut model, op);
                } else if s == 2 {
                    // A refused `cut_after` changes nothing; it is shown what `overlapping` lists.
                    let listed = f.overlapping(a, a + len).to_vec();
                    let r: Result<(), ()> = f.cut_after(a, a + len, |over| {
                        assert_eq!(over, &listed[..]);
                        Err(())
                    });
                    prop_assert_eq!(r.is_err(), !listed.is_empty());
                } else {
                    let r: Result<(), ()> = f.cut_after(a, a + len, |_| Ok(()));
                    prop_assert_eq!(r, Ok(()));
                    model_apply(&mut model, op);
                }
                // Disjoint, sorted, none empty, no two touching alike (joined), and byte for
                // byte the model.
                prop_assert_eq!(f.check(), Ok(()));
                let mut prev: Option<Freed> = None;
                let mut bytes = vec![None; 80];
                for &(start, r) in f.iter() {
                    if let Some(p) = prev {
                        prop_assert!(!(p.end == start && p.stream == r.stream && p.stamp == r.stamp));
                    }
                    prev = Some(r);
                    for b in &mut bytes[start as usize..r.end as usize] {
                        *b = Some((r.stream, r.stamp));
                    }
                }
                prop_assert_eq!(&bytes, &model);
            }
            // `overlapping` lists exactly the records with a byte in the probe.
            let (a, len) = probe;
            let end = (a + len).min(80);
            let listed: Vec<u64> = f.overlapping(a, end).iter().map(|&(s, _)| s).collect();
            let expected: Vec<u64> = f
                .iter()
                .filter(|&&(s, r)| s < end && r.end > a)
                .map(|&(s, _)| s)
                .collect();
            prop_assert_eq!(listed, expected);
        }
    }
}
