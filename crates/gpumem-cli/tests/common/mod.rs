//! What the CLI's test files share: running the built `gpumem` and reading what it said.
// Each test binary includes this module and uses part of it.
#![allow(dead_code)]

use std::process::{Command, Output};

/// The `gpumem` binary this package built.
pub fn gpumem() -> Command {
    Command::new(env!("CARGO_BIN_EXE_gpumem"))
}

/// What a finished command wrote on stderr.
pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}
