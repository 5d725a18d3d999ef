//! What a prediction is timed by: a [`Calibration`] read from a traced run (medians of the steps
//! after the first), and its overhead (what the schedule does not hold).

use std::collections::HashMap;
use std::path::Path;

use super::predict;
use crate::error::{Result, TrainError};
use crate::runtime::layout::Layout;

/// Per-task durations, message sizes and end-of-step costs of one configuration, measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Calibration {
    /// Median duration of each compute task, seconds, by (worker, trace name: `fwd attn L0 mb3`,
    /// `fwd experts L1 mb0`, `head mb2`, `bwd attn L0 mb3`, `bwd experts L1 mb0`).
    pub tasks: HashMap<(usize, String), f64>,
    /// Median payload bytes of each message that left its worker, by (sender, trace name:
    /// `dispatch L0 mb3 -> 1`).
    pub messages: HashMap<(usize, String), f64>,
    /// Per worker: median end-of-step span (all-reduces and the optimizer), seconds.
    pub end_of_step_s: Vec<f64>,
    /// Per worker: median per step of the all-reduce messages it sent, and of their bytes.
    pub reduce_messages: Vec<f64>,
    pub reduce_bytes: Vec<f64>,
    /// Median over the steps after the first of the longest time between a worker's step end and
    /// its next, seconds.
    pub step_s: f64,
    /// Steps the medians are taken over.
    pub steps: usize,
    /// The calibration's measured step minus its simulated step, seconds (see the module doc).
    pub overhead_s: f64,
}

/// A complete event of a trace, microseconds.
#[derive(Debug, Clone)]
struct Span {
    start: u64,
    end: u64,
    name: String,
    cat: String,
    bytes: u64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => 0.5 * (v[n / 2 - 1] + v[n / 2]),
    }
}

fn bad_trace(path: &Path, what: impl std::fmt::Display) -> TrainError {
    TrainError::option("trace", format!("{} is not a runtime trace this can calibrate from: {what}", path.display()))
}

impl Calibration {
    /// Reads a Chrome trace written by a run of `workers` workers with `--trace` (and without
    /// `--link-gbps`); the first step is left out when there are more.
    pub fn from_trace(path: &Path, workers: usize) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| TrainError::Io {
            action: "cannot read trace",
            path: path.into(),
            source,
        })?;
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad_trace(path, e))?;
        let events = json["traceEvents"].as_array().ok_or_else(|| bad_trace(path, "no traceEvents"))?;
        let mut per_worker: Vec<Vec<Span>> = vec![Vec::new(); workers];
        for e in events.iter().filter(|e| e["ph"] == "X") {
            let pid = e["pid"].as_u64().ok_or_else(|| bad_trace(path, "an event without pid"))? as usize;
            let list = per_worker
                .get_mut(pid)
                .ok_or_else(|| bad_trace(path, format!("an event of worker {pid} in a run of {workers}")))?;
            let (ts, dur) = (e["ts"].as_u64().unwrap_or(0), e["dur"].as_u64().unwrap_or(0));
            let name = e["name"].as_str().unwrap_or_default().to_string();
            let cat = e["cat"].as_str().unwrap_or_default().to_string();
            list.push(Span { start: ts, end: ts + dur, name, cat, bytes: e["args"]["bytes"].as_u64().unwrap_or(0) });
        }
        // Step boundaries: the end of each worker's end-of-step span.
        let ends: Vec<Vec<u64>> = per_worker
            .iter()
            .map(|evs| {
                let mut ends: Vec<u64> = evs.iter().filter(|e| e.cat == "optimizer").map(|e| e.end).collect();
                ends.sort_unstable();
                ends
            })
            .collect();
        let steps = ends.iter().map(Vec::len).min().unwrap_or(0);
        if steps == 0 {
            return Err(bad_trace(path, "a worker finished no step"));
        }
        let first = usize::from(steps > 1);
        let mut tasks: HashMap<(usize, String), Vec<f64>> = HashMap::new();
        let mut messages: HashMap<(usize, String), Vec<f64>> = HashMap::new();
        let (mut end_of_step, mut reduce_messages, mut reduce_bytes) = (Vec::new(), Vec::new(), Vec::new());
        for (w, evs) in per_worker.iter().enumerate() {
            let step_of = |ts: u64| ends[w].partition_point(|&end| end < ts);
            let (mut eos, mut msgs, mut bytes) = (vec![], vec![0.0; steps], vec![0.0; steps]);
            for e in evs {
                let s = step_of(e.start);
                if s < first || s >= steps {
                    continue;
                }
                let secs = (e.end - e.start) as f64 * 1e-6;
                match e.cat.as_str() {
                    "forward" | "backward" => tasks.entry((w, e.name.clone())).or_default().push(secs),
                    "optimizer" => eos.push(secs),
                    "send" if e.name.starts_with("reduce") => {
                        msgs[s] += 1.0;
                        bytes[s] += e.bytes as f64;
                    }
                    "send" => messages.entry((w, e.name.clone())).or_default().push(e.bytes as f64),
                    _ => {}
                }
            }
            end_of_step.push(median(eos));
            reduce_messages.push(median(msgs[first..].to_vec()));
            reduce_bytes.push(median(bytes[first..].to_vec()));
        }
        // A step lasts as long as its slowest worker's (each measured on its own clock: ranks on
        // other hosts share none).
        let intervals: Vec<f64> = (1..steps)
            .map(|s| ends.iter().map(|e| e[s].saturating_sub(e[s - 1])).max().unwrap_or(0) as f64 * 1e-6)
            .collect();
        Ok(Self {
            tasks: tasks.into_iter().map(|(k, v)| (k, median(v))).collect(),
            messages: messages.into_iter().map(|(k, v)| (k, median(v))).collect(),
            end_of_step_s: end_of_step,
            reduce_messages,
            reduce_bytes,
            step_s: median(intervals),
            steps: steps - first,
            overhead_s: 0.0,
        })
    }

    /// Sets [`Calibration::overhead_s`] from the calibration run's own `layout` and in-flight
    /// window (simulated without a link).
    pub fn with_overhead(mut self, layout: &Layout, in_flight: usize) -> Result<Self> {
        if self.steps == 0 || self.step_s == 0.0 {
            return Err(TrainError::option("steps", "calibrating needs a run of at least 2 steps"));
        }
        let simulated = predict(layout, &self, in_flight, None)?.step_s;
        self.overhead_s = self.step_s - simulated;
        Ok(self)
    }
}
