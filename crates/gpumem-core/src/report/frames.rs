//! Stack frames from captured backtraces, in the shape PyTorch's snapshots use
//! (`{filename, line, name}`), and the call site of an allocation: the first frame that is
//! not gpumem's own code or the standard library.
//!
//! `std::backtrace::Backtrace` has no stable frame API, so its text form is parsed: one
//! `N: symbol` line per frame (more symbol lines without a number for inlined calls), each
//! followed by `at file:line:column` when debug information is available.

use serde::Serialize;
use std::backtrace::Backtrace;

/// One stack frame.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct Frame {
    /// Function (demangled symbol).
    pub name: String,
    /// Source file, or "??" when unknown.
    pub filename: String,
    /// Line, or 0 when unknown.
    pub line: u32,
}

impl std::fmt::Display for Frame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.line > 0 {
            write!(f, "{} ({}:{})", self.name, self.filename, self.line)
        } else {
            write!(f, "{}", self.name)
        }
    }
}

/// Frames of the capture machinery itself, dropped from the top of every backtrace.
fn is_capture_frame(name: &str) -> bool {
    name.starts_with("std::backtrace")
        || name.starts_with("<std::backtrace")
        || name.contains("engine::track::Tracker::record")
        || name.contains("engine::Allocator::track")
        || name.contains("engine::Allocator::handed_out")
}

/// Frames that are not the user's: gpumem's own crates (but not their tests), the standard
/// library, the test harness and the runtime's entry points.
pub fn is_internal(name: &str) -> bool {
    let n = name.trim_start_matches('<');
    const PREFIXES: [&str; 8] = [
        "std::",
        "core::",
        "alloc::",
        "test::",
        "__rust",
        "rust_begin_unwind",
        "__libc_start",
        "_start",
    ];
    if PREFIXES.iter().any(|p| n.starts_with(p)) || n == "main" || n.starts_with("<unknown>") {
        return true;
    }
    n.starts_with("gpumem") && !n.contains("::tests::")
}

/// The frames of `bt`, innermost first, without the capture machinery. Empty when the
/// backtrace was not captured (or has no symbols).
pub fn frames_of(bt: &Backtrace) -> Vec<Frame> {
    parse(&bt.to_string())
}

/// Parses the text form of a `std::backtrace::Backtrace`.
pub fn parse(text: &str) -> Vec<Frame> {
    let mut frames: Vec<Frame> = Vec::new();
    for raw in text.lines() {
        let l = raw.trim();
        if l.is_empty() {
            continue;
        }
        if let Some(loc) = l.strip_prefix("at ") {
            if let Some(f) = frames.last_mut() {
                // file:line:column, where the file itself may contain ':'.
                let mut parts = loc.rsplitn(3, ':');
                let _col = parts.next();
                let line = parts.next().and_then(|s| s.parse().ok());
                let file = parts.next();
                if let (Some(line), Some(file)) = (line, file) {
                    f.line = line;
                    f.filename = file.to_string();
                } else {
                    f.filename = loc.to_string();
                }
            }
            continue;
        }
        // "12: name", or a bare name for an inlined symbol of the same frame.
        let name = match l.split_once(": ") {
            Some((idx, rest)) if idx.chars().all(|c| c.is_ascii_digit()) => rest,
            _ => l,
        };
        if name.starts_with("note:") || name.contains("backtrace disabled") {
            continue;
        }
        frames.push(Frame {
            name: name.to_string(),
            filename: "??".to_string(),
            line: 0,
        });
    }
    let skip = frames
        .iter()
        .position(|f| !is_capture_frame(&f.name))
        .unwrap_or(frames.len());
    frames.drain(..skip);
    frames
}

/// The call site of an allocation: its first frame outside gpumem and the standard library.
pub fn call_site(frames: &[Frame]) -> Option<&Frame> {
    frames.iter().find(|f| !is_internal(&f.name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[inline(never)]
    fn capture_here() -> Backtrace {
        Backtrace::force_capture()
    }

    #[test]
    fn parses_the_std_text_form() {
        let text = "   0: std::backtrace::Backtrace::force_capture\n             at /rustc/x/library/std/src/backtrace.rs:312:13\n   1: gpumem_core::engine::Allocator::allocate\n             at ./src/engine/mod.rs:170:21\n      my_app::inlined_helper\n             at C:\\src\\app.rs:9:5\n   2: my_app::main\n             at ./src/main.rs:42:9\n   3: main\n   4: __libc_start_main\n";
        let f = parse(text);
        assert_eq!(f.len(), 5, "{f:?}");
        assert_eq!(f[0].name, "gpumem_core::engine::Allocator::allocate");
        assert_eq!(
            (f[0].filename.as_str(), f[0].line),
            ("./src/engine/mod.rs", 170)
        );
        assert_eq!(f[1].name, "my_app::inlined_helper");
        assert_eq!((f[1].filename.as_str(), f[1].line), ("C:\\src\\app.rs", 9));
        assert_eq!(f[3].filename, "??");
        assert_eq!(call_site(&f).unwrap().name, "my_app::inlined_helper");
    }

    #[test]
    fn a_real_backtrace_names_this_test() {
        let f = frames_of(&capture_here());
        let here = f
            .iter()
            .find(|fr| fr.name.contains("a_real_backtrace_names_this_test"))
            .unwrap_or_else(|| panic!("no frame of this test in {f:#?}"));
        assert!(here.filename.ends_with("frames.rs"), "{here:?}");
        assert!(here.line > 0);
        // gpumem's tests are the user's code as far as call sites go.
        assert!(call_site(&f).unwrap().name.contains("frames::tests::"));
    }

    #[test]
    fn internal_frames_are_recognised() {
        for n in [
            "std::rt::lang_start",
            "core::ops::function::FnOnce::call_once",
            "<alloc::boxed::Box<F,A> as core::ops::function::FnOnce<Args>>::call_once",
            "gpumem_core::engine::Allocator::allocate",
            "gpumem_py::alloc_hook",
            "test::run_test",
        ] {
            assert!(is_internal(n), "{n}");
        }
        for n in [
            "my_app::train_step",
            "gpumem_core::report::leaks::tests::leaky",
        ] {
            assert!(!is_internal(n), "{n}");
        }
    }
}
