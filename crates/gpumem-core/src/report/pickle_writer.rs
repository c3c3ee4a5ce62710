//! A small pickle writer (protocol 2): just what a memory snapshot needs: dicts, lists,
//! tuples, strings, integers, floats, booleans and None.
//!
//! Values are written in order, as a stream: open a container, write its items (a dict's as
//! key, value, key, value...), close it. Long containers are flushed every 1,000 items, as
//! Python's own pickler does, so that a reader's stack stays short. Strings are memoized: a
//! key repeated on millions of trace entries is written once and referred to after that.

use rustc_hash::FxHashMap;

const PROTO: u8 = 0x80;
const STOP: u8 = b'.';
const MARK: u8 = b'(';
const EMPTY_DICT: u8 = b'}';
const EMPTY_LIST: u8 = b']';
const SETITEMS: u8 = b'u';
const APPENDS: u8 = b'e';
const TUPLE: u8 = b't';
const NONE: u8 = b'N';
const NEWTRUE: u8 = 0x88;
const NEWFALSE: u8 = 0x89;
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const BININT: u8 = b'J';
const LONG1: u8 = 0x8a;
const BINFLOAT: u8 = b'G';
const BINUNICODE: u8 = b'X';
const BINPUT: u8 = b'q';
const LONG_BINPUT: u8 = b'r';
const BINGET: u8 = b'h';
const LONG_BINGET: u8 = b'j';

/// Items per MARK..SETITEMS/APPENDS batch (Python's pickler uses the same).
const BATCH: usize = 1000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Open {
    Dict,
    List,
    Tuple,
}

/// Writes one pickled value into a byte buffer.
pub struct PickleWriter {
    buf: Vec<u8>,
    /// Open containers and the values written into each since its last flush.
    open: Vec<(Open, usize)>,
    memo: FxHashMap<String, u32>,
}

impl Default for PickleWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl PickleWriter {
    /// A writer with the protocol header written.
    pub fn new() -> Self {
        Self {
            buf: vec![PROTO, 2],
            open: Vec::new(),
            memo: FxHashMap::default(),
        }
    }

    /// One value was written into the innermost container: flush a full batch.
    fn item(&mut self) {
        let Some((kind, n)) = self.open.last_mut() else {
            return;
        };
        *n += 1;
        let per_batch = match kind {
            Open::Dict => 2 * BATCH,
            Open::List => BATCH,
            Open::Tuple => usize::MAX,
        };
        if *n == per_batch {
            let op = if *kind == Open::Dict {
                SETITEMS
            } else {
                APPENDS
            };
            *n = 0;
            self.buf.push(op);
            self.buf.push(MARK);
        }
    }

    /// `None`.
    pub fn none(&mut self) {
        self.buf.push(NONE);
        self.item();
    }

    /// `True` / `False`.
    pub fn bool(&mut self, b: bool) {
        self.buf.push(if b { NEWTRUE } else { NEWFALSE });
        self.item();
    }

    /// A signed integer.
    pub fn int(&mut self, v: i64) {
        if (0..=0xff).contains(&v) {
            self.buf.extend([BININT1, v as u8]);
        } else if (0..=0xffff).contains(&v) {
            self.buf.push(BININT2);
            self.buf.extend((v as u16).to_le_bytes());
        } else if i32::try_from(v).is_ok() {
            self.buf.push(BININT);
            self.buf.extend((v as i32).to_le_bytes());
        } else {
            self.long(v as i128);
        }
        self.item();
    }

    /// An unsigned integer (addresses, sizes).
    pub fn uint(&mut self, v: u64) {
        match i64::try_from(v) {
            Ok(i) => self.int(i),
            Err(_) => {
                self.long(v as i128);
                self.item();
            }
        }
    }

    /// LONG1: little-endian two's complement in the fewest bytes.
    fn long(&mut self, v: i128) {
        let bytes = v.to_le_bytes();
        let mut n = bytes.len();
        // Drop high bytes that only repeat the sign.
        while n > 1 {
            let top = bytes[n - 1];
            let next_sign = bytes[n - 2] & 0x80;
            if (top == 0 && next_sign == 0) || (top == 0xff && next_sign != 0) {
                n -= 1;
            } else {
                break;
            }
        }
        self.buf.extend([LONG1, n as u8]);
        self.buf.extend(&bytes[..n]);
    }

    /// A float.
    pub fn float(&mut self, v: f64) {
        self.buf.push(BINFLOAT);
        self.buf.extend(v.to_be_bytes());
        self.item();
    }

    /// A string (memoized: the second time, a reference is written).
    pub fn str(&mut self, s: &str) {
        if let Some(&i) = self.memo.get(s) {
            self.memo_op(BINGET, LONG_BINGET, i);
        } else {
            self.buf.push(BINUNICODE);
            self.buf.extend((s.len() as u32).to_le_bytes());
            self.buf.extend(s.as_bytes());
            let i = self.memo.len() as u32;
            self.memo_op(BINPUT, LONG_BINPUT, i);
            self.memo.insert(s.to_string(), i);
        }
        self.item();
    }

    /// A memo opcode with index `i`: `short` with a one-byte index when it fits, else `long`
    /// with four bytes.
    fn memo_op(&mut self, short: u8, long: u8, i: u32) {
        match u8::try_from(i) {
            Ok(b) => self.buf.extend([short, b]),
            Err(_) => {
                self.buf.push(long);
                self.buf.extend(i.to_le_bytes());
            }
        }
    }

    /// Opens a dict: write key, value, key, value... then [`Self::end`].
    pub fn begin_dict(&mut self) {
        self.buf.extend([EMPTY_DICT, MARK]);
        self.open.push((Open::Dict, 0));
    }

    /// Opens a list: write its items, then [`Self::end`].
    pub fn begin_list(&mut self) {
        self.buf.extend([EMPTY_LIST, MARK]);
        self.open.push((Open::List, 0));
    }

    /// Opens a tuple: write its items, then [`Self::end`].
    pub fn begin_tuple(&mut self) {
        self.buf.push(MARK);
        self.open.push((Open::Tuple, 0));
    }

    /// Closes the innermost container.
    ///
    /// # Panics
    /// If no container is open, or a dict has a key without a value (a bug in the caller).
    pub fn end(&mut self) {
        let (kind, n) = self.open.pop().expect("end() with no open container");
        match kind {
            Open::Dict => {
                assert!(n % 2 == 0, "dict closed after a key with no value");
                self.buf.push(SETITEMS);
            }
            Open::List => self.buf.push(APPENDS),
            Open::Tuple => self.buf.push(TUPLE),
        }
        self.item();
    }

    /// A `key: str` entry inside a dict: writes the key; write the value next.
    pub fn key(&mut self, k: &str) {
        debug_assert_eq!(self.open.last().map(|o| o.0), Some(Open::Dict));
        self.str(k);
    }

    /// The pickle, once every container is closed.
    ///
    /// # Panics
    /// If a container is still open.
    pub fn finish(mut self) -> Vec<u8> {
        assert!(self.open.is_empty(), "finish() with open containers");
        self.buf.push(STOP);
        self.buf
    }

    /// Bytes written so far.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Whether nothing but the header was written.
    pub fn is_empty(&self) -> bool {
        self.buf.len() <= 2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_values_have_the_expected_bytes() {
        let mut w = PickleWriter::new();
        w.begin_list();
        w.int(5);
        w.int(300);
        w.int(-1);
        w.uint(1 << 40);
        w.bool(true);
        w.none();
        w.str("ab");
        w.str("ab");
        w.end();
        let b = w.finish();
        let expected: Vec<u8> = [
            &[PROTO, 2, EMPTY_LIST, MARK][..],
            &[BININT1, 5],
            &[BININT2, 0x2c, 0x01],
            &[BININT, 0xff, 0xff, 0xff, 0xff],
            &[LONG1, 6, 0, 0, 0, 0, 0, 1],
            &[NEWTRUE, NONE],
            &[BINUNICODE, 2, 0, 0, 0, b'a', b'b', BINPUT, 0],
            &[BINGET, 0],
            &[APPENDS, STOP],
        ]
        .concat();
        assert_eq!(b, expected);
    }

    #[test]
    fn long_encoding_is_minimal_twos_complement() {
        let enc = |v: i128| {
            let mut w = PickleWriter::new();
            w.long(v);
            w.buf[2..].to_vec()
        };
        assert_eq!(enc(1 << 31), vec![LONG1, 5, 0, 0, 0, 0x80, 0]);
        assert_eq!(
            enc(-(1 << 31) - 1),
            vec![LONG1, 5, 0xff, 0xff, 0xff, 0x7f, 0xff]
        );
        assert_eq!(
            enc(u64::MAX as i128),
            vec![LONG1, 9, 255, 255, 255, 255, 255, 255, 255, 255, 0]
        );
    }

    #[test]
    fn long_lists_are_flushed_in_batches() {
        let mut w = PickleWriter::new();
        w.begin_list();
        for i in 0..2500 {
            w.int(i % 200);
        }
        w.end();
        let b = w.finish();
        // APPENDS followed by MARK only where a full batch was flushed (an operand byte of
        // 101 is always followed by the next K opcode).
        let flushes = b
            .windows(2)
            .filter(|w| w[0] == APPENDS && w[1] == MARK)
            .count();
        assert_eq!(flushes, 2, "two full batches flushed before the last one");
        assert_eq!(&b[b.len() - 2..], &[APPENDS, STOP]);
    }
}
