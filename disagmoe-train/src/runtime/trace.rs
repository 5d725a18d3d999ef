//! Chrome trace events (open the file in Perfetto or `chrome://tracing`): one process per worker,
//! one thread per stream (compute, communication).

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};

/// Stream ids within a worker.
pub const COMPUTE: u32 = 0;
/// The communication stream: one span per transfer, from send to delivery.
pub const COMM: u32 = 1;

/// A complete event (`"ph": "X"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceEvent {
    /// What happened (`fwd attn L2 mb1`, `wait`, `send dispatch -> 3`).
    pub name: String,
    /// Category: `forward`, `backward`, `send`, `wait`, `optimizer`.
    pub cat: String,
    /// Start, microseconds since the Unix epoch.
    pub ts: u64,
    /// Duration, microseconds.
    pub dur: u64,
    /// Worker.
    pub pid: usize,
    /// Stream.
    pub tid: u32,
    /// Payload bytes of a send (0 for other events).
    #[serde(default)]
    pub bytes: u64,
}

/// Collects a worker's events when tracing is on.
#[derive(Debug, Default)]
pub struct Tracer {
    on: bool,
    pid: usize,
    /// Events so far.
    pub events: Vec<TraceEvent>,
}

impl Tracer {
    /// A tracer for worker `pid`; records nothing unless `on`.
    pub fn new(on: bool, pid: usize) -> Self {
        Self { on, pid, events: Vec::new() }
    }

    /// Records a span from `start` to `end` (microseconds).
    pub fn span(&mut self, name: impl FnOnce() -> String, cat: &str, tid: u32, start: u64, end: u64) {
        self.span_bytes(name, cat, tid, start, end, 0);
    }

    /// Records a span that moved `bytes` (a send).
    pub fn span_bytes(&mut self, name: impl FnOnce() -> String, cat: &str, tid: u32, start: u64, end: u64, bytes: u64) {
        if self.on {
            self.events.push(TraceEvent {
                name: name(),
                cat: cat.into(),
                ts: start,
                dur: end.saturating_sub(start),
                pid: self.pid,
                tid,
                bytes,
            });
        }
    }
}

/// Writes events of all workers as a Chrome trace JSON file, with process and thread names.
pub fn write_chrome_trace(path: &Path, workers: &[String], events: &[TraceEvent]) -> Result<()> {
    let t0 = events.iter().map(|e| e.ts).min().unwrap_or(0);
    let mut out: Vec<serde_json::Value> = Vec::new();
    for (pid, name) in workers.iter().enumerate() {
        out.push(serde_json::json!({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}));
        for (tid, t) in [(COMPUTE, "compute"), (COMM, "communication")] {
            out.push(
                serde_json::json!({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": t}}),
            );
        }
    }
    for e in events {
        let mut event = serde_json::json!({
            "name": e.name, "cat": e.cat, "ph": "X", "ts": e.ts - t0, "dur": e.dur, "pid": e.pid, "tid": e.tid
        });
        if e.bytes > 0 {
            event["args"] = serde_json::json!({ "bytes": e.bytes });
        }
        out.push(event);
    }
    let text = serde_json::to_string(&serde_json::json!({"traceEvents": out, "displayTimeUnit": "ms"}))
        .expect("trace events serialise");
    std::fs::write(path, text).map_err(|source| TrainError::Io {
        action: "cannot write trace",
        path: path.into(),
        source,
    })
}
