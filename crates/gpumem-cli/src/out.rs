//! Where the CLI's output goes: stdout and stderr without panicking, and output files checked
//! before the work that fills them.
//!
//! `println!` panics when stdout is a closed pipe (`gpumem replay ... | head -1`), and
//! `eprintln!` does the same on stderr. Every line the CLI prints goes through here instead: a
//! reader that has gone away ends the command quietly with status 0, as `cat` or `grep` would
//! (by SIGPIPE), and a lost diagnostic on a closed stderr is dropped rather than fatal.

use std::io::{ErrorKind, Write};
use std::path::Path;

/// Writes `text` to stdout and flushes it. When stdout is a closed pipe the reader has all it
/// wanted, so the process ends here with status 0; any other write error ends it with status 1
/// and a message on stderr.
pub fn print(text: &str) {
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        if e.kind() == ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprint(&format!("gpumem: cannot write to stdout: {e}\n"));
        std::process::exit(1);
    }
}

/// [`print`](fn@print) with a newline.
pub fn println(line: &str) {
    print(&format!("{line}\n"));
}

/// Writes `text` to stderr; a failure is ignored (there is nowhere left to report it).
pub fn eprint(text: &str) {
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}

/// [`eprint`](fn@eprint) with a newline.
pub fn eprintln(line: &str) {
    eprint(&format!("{line}\n"));
}

/// Fails now, before any long work, if `path` cannot be written; leaves nothing behind.
pub fn check_writable(path: &Path, flag: &str) -> Result<(), String> {
    let existed = path.exists();
    std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)
        .map_err(|e| format!("{flag} {}: cannot write there: {e}", path.display()))?;
    if !existed {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}

/// `print!` through [`print`](fn@print).
macro_rules! out_print {
    ($($arg:tt)*) => { $crate::out::print(&format!($($arg)*)) };
}

/// `println!` through [`println`](fn@println).
macro_rules! out_println {
    ($($arg:tt)*) => { $crate::out::println(&format!($($arg)*)) };
}

/// `eprint!` through [`eprint`](fn@eprint).
macro_rules! err_print {
    ($($arg:tt)*) => { $crate::out::eprint(&format!($($arg)*)) };
}

/// `eprintln!` through [`eprintln`](fn@eprintln).
macro_rules! err_println {
    ($($arg:tt)*) => { $crate::out::eprintln(&format!($($arg)*)) };
}
