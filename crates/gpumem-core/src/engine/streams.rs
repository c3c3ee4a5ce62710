//! A fixed-capacity, lock-free map from stream handles to their shards. Lookups read two
//! atomics and never write shared memory, so threads on different streams do not contend.

use crate::backend::Stream;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Most streams one allocator serves.
pub const MAX_STREAMS: usize = 1024;
const EMPTY: u64 = u64::MAX;

/// Stream handle -> value of type `T`, created on first use and kept until the table drops.
pub struct StreamTable<T> {
    keys: Box<[AtomicU64]>,
    values: Box<[OnceLock<T>]>,
    len: AtomicUsize,
}

impl<T> StreamTable<T> {
    /// An empty table.
    pub fn new() -> Self {
        Self {
            keys: (0..MAX_STREAMS).map(|_| AtomicU64::new(EMPTY)).collect(),
            values: (0..MAX_STREAMS).map(|_| OnceLock::new()).collect(),
            len: AtomicUsize::new(0),
        }
    }

    #[inline]
    fn home(stream: Stream) -> usize {
        // Stream handles are pointers: drop the low bits, then spread with a Fibonacci hash.
        ((stream >> 4).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 54) as usize & (MAX_STREAMS - 1)
    }

    /// The value of `stream` with its slot index, creating it with `make` on first use.
    /// `None` when the table is full (or for the one reserved handle, `u64::MAX`).
    #[inline]
    pub fn get_or_insert(&self, stream: Stream, make: impl FnOnce() -> T) -> Option<(usize, &T)> {
        if stream == EMPTY {
            return None;
        }
        let mut i = Self::home(stream);
        let mut make = Some(make);
        for _ in 0..MAX_STREAMS {
            let k = self.keys[i].load(Ordering::Acquire);
            let mine = if k == stream {
                true
            } else if k == EMPTY {
                match self.keys[i].compare_exchange(
                    EMPTY,
                    stream,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => {
                        self.len.fetch_add(1, Ordering::Relaxed);
                        true
                    }
                    Err(actual) => actual == stream,
                }
            } else {
                false
            };
            if mine {
                let v = self.values[i].get_or_init(|| (make.take().expect("made once"))());
                return Some((i, v));
            }
            i = (i + 1) & (MAX_STREAMS - 1);
        }
        None
    }

    /// The value of `stream` if it exists.
    #[inline]
    pub fn get(&self, stream: Stream) -> Option<(usize, &T)> {
        if stream == EMPTY {
            return None;
        }
        let mut i = Self::home(stream);
        for _ in 0..MAX_STREAMS {
            match self.keys[i].load(Ordering::Acquire) {
                k if k == stream => return self.values[i].get().map(|v| (i, v)),
                EMPTY => return None,
                _ => i = (i + 1) & (MAX_STREAMS - 1),
            }
        }
        None
    }

    /// The value in slot `i`, if any.
    #[inline]
    pub fn slot(&self, i: usize) -> Option<&T> {
        self.values.get(i).and_then(|v| v.get())
    }

    /// Every (slot, value) present, in slot order.
    pub fn iter(&self) -> impl Iterator<Item = (usize, &T)> + '_ {
        self.values
            .iter()
            .enumerate()
            .filter_map(|(i, v)| v.get().map(|v| (i, v)))
    }

    /// Number of streams.
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    /// Whether no stream has been seen.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<T> Default for StreamTable<T> {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_and_find() {
        let t: StreamTable<u64> = StreamTable::new();
        let (i, v) = t.get_or_insert(0, || 10).unwrap();
        assert_eq!(*v, 10);
        let (j, v) = t.get_or_insert(0, || 99).unwrap();
        assert_eq!((i, *v), (j, 10), "second insert finds the first value");
        assert!(t.get(0x7f00_1234_5670).is_none());
        t.get_or_insert(0x7f00_1234_5670, || 20).unwrap();
        assert_eq!(*t.get(0x7f00_1234_5670).unwrap().1, 20);
        assert_eq!(t.len(), 2);
        assert!(t.get_or_insert(u64::MAX, || 0).is_none());
    }

    #[test]
    fn fills_up_then_refuses() {
        let t: StreamTable<u64> = StreamTable::new();
        for s in 0..MAX_STREAMS as u64 {
            assert!(t.get_or_insert(s * 16, || s).is_some());
        }
        assert!(t.get_or_insert(123_456_789, || 0).is_none());
        assert_eq!(t.iter().count(), MAX_STREAMS);
    }

    #[test]
    fn concurrent_inserts_agree() {
        let t: StreamTable<u64> = StreamTable::new();
        std::thread::scope(|s| {
            for th in 0..4u64 {
                let t = &t;
                s.spawn(move || {
                    for k in 0..200u64 {
                        let (_, v) = t.get_or_insert(k * 64, || k * 1000 + th).unwrap();
                        assert_eq!(*v / 1000, k);
                    }
                });
            }
        });
        assert_eq!(t.len(), 200);
    }
}
