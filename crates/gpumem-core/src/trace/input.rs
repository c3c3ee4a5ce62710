//! Buffered byte input for the trace readers: detects gzip, decompresses on a second thread
//! (so inflating and parsing overlap on two cores), and tracks the offset for error messages.

use crate::error::TraceError;
use std::io::Read;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;

/// Called now and then with the bytes of the source (compressed, if it is) consumed so far.
pub type Progress = Arc<dyn Fn(u64) + Send + Sync>;

const CHUNK: usize = 1 << 20;
/// Longest line a text trace (an RMM log) may have.
pub const MAX_LINE: usize = 1 << 20;

enum Source {
    Plain(Box<dyn Read + Send>),
    /// Chunks inflated by a worker thread.
    Thread(Receiver<std::io::Result<Vec<u8>>>),
}

/// A byte stream with look-ahead.
pub struct Input {
    src: Source,
    buf: Vec<u8>,
    pos: usize,
    /// Offset of `buf[0]` in the decompressed stream.
    base: u64,
    eof: bool,
    name: String,
    compressed: Option<Arc<AtomicU64>>,
    progress: Option<Progress>,
    /// Bytes of the content once decompressed, when known (sizes buffers up front).
    pub size_hint: Option<u64>,
}

impl Input {
    /// Wraps `src`, inflating it on another thread when it starts with the gzip magic.
    /// `progress` receives the compressed bytes consumed so far.
    pub fn open(
        mut src: Box<dyn Read + Send>,
        name: &str,
        progress: Option<Progress>,
    ) -> Result<Input, TraceError> {
        let io = |source| TraceError::Io {
            path: name.to_string(),
            source,
        };
        let mut magic = [0u8; 2];
        let mut got = 0;
        while got < 2 {
            let n = src.read(&mut magic[got..]).map_err(io)?;
            if n == 0 {
                break;
            }
            got += n;
        }
        let head = magic[..got].to_vec();
        let chained: Box<dyn Read + Send> = Box::new(std::io::Cursor::new(head.clone()).chain(src));
        let source = if head == [0x1f, 0x8b] {
            let (tx, rx) = sync_channel::<std::io::Result<Vec<u8>>>(8);
            // The worker counts the compressed bytes it reads; progress is reported from the
            // parsing thread as chunks arrive.
            let counted = Counted {
                inner: chained,
                count: Arc::new(AtomicU64::new(0)),
            };
            let count = counted.count.clone();
            std::thread::spawn(move || {
                let mut dec = flate2::read::MultiGzDecoder::new(std::io::BufReader::with_capacity(
                    CHUNK, counted,
                ));
                loop {
                    let mut chunk = vec![0u8; CHUNK];
                    let mut filled = 0;
                    let res = loop {
                        match dec.read(&mut chunk[filled..]) {
                            Ok(0) => break Ok(()),
                            Ok(n) => {
                                filled += n;
                                if filled == CHUNK {
                                    break Ok(());
                                }
                            }
                            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                            Err(e) => break Err(e),
                        }
                    };
                    if let Err(e) = res {
                        let _ = tx.send(Err(e));
                        return;
                    }
                    if filled == 0 {
                        return;
                    }
                    chunk.truncate(filled);
                    if tx.send(Ok(chunk)).is_err() {
                        return;
                    }
                }
            });
            let mut inp = Input::new(Source::Thread(rx), name, progress);
            inp.compressed = Some(count);
            return Ok(inp);
        } else {
            Source::Plain(chained)
        };
        Ok(Input::new(source, name, progress))
    }

    fn new(src: Source, name: &str, progress: Option<Progress>) -> Input {
        Input {
            src,
            buf: Vec::with_capacity(CHUNK * 2),
            pos: 0,
            base: 0,
            eof: false,
            name: name.to_string(),
            compressed: None,
            progress,
            size_hint: None,
        }
    }

    fn report(&self) {
        if let Some(p) = &self.progress {
            let done = match &self.compressed {
                Some(c) => c.load(Ordering::Relaxed),
                None => self.base + self.buf.len() as u64,
            };
            p(done);
        }
    }

    /// Offset of the next byte in the decompressed stream.
    #[inline]
    pub fn offset(&self) -> u64 {
        self.base + self.pos as u64
    }

    /// The source's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Reads more data; returns false at the end.
    fn fill(&mut self) -> Result<bool, TraceError> {
        if self.eof {
            return Ok(false);
        }
        // Drop consumed bytes.
        if self.pos > 0 {
            self.buf.drain(..self.pos);
            self.base += self.pos as u64;
            self.pos = 0;
        }
        let io = |source| TraceError::Io {
            path: self.name.clone(),
            source,
        };
        match &mut self.src {
            Source::Plain(r) => {
                let old = self.buf.len();
                self.buf.resize(old + CHUNK, 0);
                let n = loop {
                    match r.read(&mut self.buf[old..]) {
                        Ok(n) => break n,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => {
                            self.buf.truncate(old);
                            return Err(io(e));
                        }
                    }
                };
                self.buf.truncate(old + n);
                if n == 0 {
                    self.eof = true;
                }
                self.report();
                Ok(n > 0)
            }
            Source::Thread(rx) => match rx.recv() {
                Ok(Ok(chunk)) => {
                    self.buf.extend_from_slice(&chunk);
                    self.report();
                    Ok(true)
                }
                Ok(Err(e)) => Err(TraceError::Malformed {
                    offset: self.base + self.buf.len() as u64,
                    what: format!("gzip stream is damaged: {e}"),
                }),
                Err(_) => {
                    self.eof = true;
                    Ok(false)
                }
            },
        }
    }

    /// Makes at least `n` bytes available; false if the stream ends first.
    #[inline]
    pub fn ensure(&mut self, n: usize) -> Result<bool, TraceError> {
        while self.buf.len() - self.pos < n {
            if !self.fill()? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The next `n` bytes (fewer at the end) without consuming them.
    pub fn peek(&mut self, n: usize) -> Result<Vec<u8>, TraceError> {
        self.ensure(n)?;
        let end = (self.pos + n).min(self.buf.len());
        Ok(self.buf[self.pos..end].to_vec())
    }

    /// The unconsumed bytes in the buffer.
    #[inline]
    pub fn window(&self) -> &[u8] {
        &self.buf[self.pos..]
    }

    /// Consumes `n` bytes.
    #[inline]
    pub fn advance(&mut self, n: usize) {
        self.pos += n;
    }

    /// Takes exactly `n` bytes or fails with a truncation error naming `what`.
    #[inline]
    pub fn take(&mut self, n: usize, what: &str) -> Result<&[u8], TraceError> {
        if !self.ensure(n)? {
            return Err(TraceError::Truncated(format!(
                "{}: the stream ends at byte {} inside {what}",
                self.name,
                self.base + self.buf.len() as u64
            )));
        }
        let s = self.pos;
        self.pos += n;
        Ok(&self.buf[s..s + n])
    }

    /// One byte, or `None` at the end.
    #[inline]
    pub fn next_byte(&mut self) -> Result<Option<u8>, TraceError> {
        if self.pos < self.buf.len() || self.ensure(1)? {
            let b = self.buf[self.pos];
            self.pos += 1;
            Ok(Some(b))
        } else {
            Ok(None)
        }
    }

    /// The next line without its end (`None` at the end of the stream). A line longer than
    /// [`MAX_LINE`] bytes is an error (no text log has one).
    pub fn line(&mut self) -> Result<Option<String>, TraceError> {
        // Bytes of the window already searched for the end of the line.
        let mut searched = 0;
        loop {
            if let Some(i) = self.window()[searched..]
                .iter()
                .position(|&b| b == b'\n')
                .map(|i| i + searched)
            {
                let s = String::from_utf8_lossy(&self.window()[..i])
                    .trim_end_matches('\r')
                    .to_string();
                self.advance(i + 1);
                return Ok(Some(s));
            }
            searched = self.window().len();
            if searched > MAX_LINE {
                return Err(TraceError::Malformed {
                    offset: self.offset(),
                    what: format!("a line longer than {MAX_LINE} bytes"),
                });
            }
            if !self.fill()? {
                if self.window().is_empty() {
                    return Ok(None);
                }
                let s = String::from_utf8_lossy(self.window())
                    .trim_end()
                    .to_string();
                let n = self.window().len();
                self.advance(n);
                return Ok(Some(s));
            }
        }
    }
}

/// A reader that counts the bytes read through it.
struct Counted {
    inner: Box<dyn Read + Send>,
    count: Arc<AtomicU64>,
}

impl Read for Counted {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}
