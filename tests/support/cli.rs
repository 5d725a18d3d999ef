//! What the tests that run the `disagmoe` command share: the command, its summary line, its losses.
#![allow(dead_code)]

use std::process::{Command, Output};

/// The `disagmoe` command under test.
pub fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_disagmoe"))
}

/// The JSON summary a successful run prints last (the run's stderr in the message otherwise).
pub fn summary(out: &Output) -> serde_json::Value {
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "run failed: {}\n{}", String::from_utf8_lossy(&out.stderr), text);
    let last = text.lines().last().expect("a summary line");
    serde_json::from_str(last).unwrap_or_else(|e| panic!("last line is not JSON ({e}): {last}"))
}

/// The loss of every step of a summary.
pub fn losses(v: &serde_json::Value) -> Vec<f64> {
    v["losses"].as_array().unwrap().iter().map(|l| l.as_f64().unwrap()).collect()
}
