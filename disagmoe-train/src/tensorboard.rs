//! TensorBoard event files of a run (`train --tensorboard DIR`), written by the process that
//! writes `metrics.jsonl` (rank 0 under MPI), with the same tags under every placement.
//!
//! Events are TensorBoard's protobuf messages (the `tensorboard-proto` crate's generated types)
//! framed as TFRecords by the `tensorboard-rs` crate's record writer, into a file this module opens
//! and writes, so that a failed write is an error of the run rather than a panic in that crate's
//! writer thread. One file per process start, named as TensorBoard's own writers name them
//! (`events.out.tfevents.<seconds>.<host>.<pid>`); a resumed run starts a new file and its steps
//! after the checkpoint supersede the earlier file's (TensorBoard shows the newest value of a
//! step).
//!
//! Tags: `loss`, `loss/lm`, `loss/aux`, `loss/z` and `loss/mtp` (when on), `lr`, `grad_norm`, `loss_scale`
//! (f16), `throughput/tokens_per_s`, `time/step_s`, `time/compute_s`, `comm/exposed_s`,
//! `comm/in_flight_wait_s`, `comm/bytes_sent`, `eval/loss` and `eval/perplexity` (at the steps that
//! evaluate; under a blend also `eval/loss/<source>` for each source and `data/tokens/<source>`,
//! the step's tokens from it, the source named by its path), and per MoE layer `expert_load/layer_<l>`: a histogram over expert indices whose
//! bucket `e` (edges `e - 1/2 .. e + 1/2`) holds the routed copies expert `e` received that step.

use std::io::BufWriter;
use std::path::{Path, PathBuf};

use protobuf::Message;
use tensorboard_proto::event::Event;
use tensorboard_proto::summary::Summary;
use tensorboard_rs::record_writer::RecordWriter;
use tensorboard_rs::summary::{histogram_raw, scalar};

use crate::error::{Result, TrainError};
use crate::metrics::StepMetrics;

/// An event file being written.
pub struct TensorBoard {
    writer: RecordWriter<BufWriter<std::fs::File>>,
    path: PathBuf,
}

fn io_error<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> TrainError + 'a {
    move |source| TrainError::Io { action, path: path.into(), source }
}

fn now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

impl TensorBoard {
    /// Creates `dir` if needed and a new event file in it.
    pub fn create(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(io_error("cannot create the TensorBoard directory", dir))?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .ok()
            .filter(|h| !h.is_empty() && !h.contains('/'))
            .unwrap_or_else(|| "localhost".into());
        let path = dir.join(format!("events.out.tfevents.{:010}.{host}.{}", now() as u64, std::process::id()));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(io_error("cannot create the TensorBoard event file", &path))?;
        let mut tb = TensorBoard { writer: RecordWriter::new(BufWriter::new(file)), path };
        let mut version = Event::new();
        version.set_wall_time(now());
        version.set_file_version("brain.Event:2".into());
        tb.event(version)?;
        tb.flush()?;
        Ok(tb)
    }

    /// The event file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn event(&mut self, event: Event) -> Result<()> {
        let bytes = event.write_to_bytes().map_err(|e| TrainError::Io {
            action: "cannot encode a TensorBoard event",
            path: self.path.clone(),
            source: std::io::Error::other(e.to_string()),
        })?;
        let path = self.path.clone();
        self.writer.write(&bytes).map_err(io_error("cannot write the TensorBoard event file", &path))
    }

    fn summary(&mut self, step: usize, summary: Summary) -> Result<()> {
        let mut event = Event::new();
        event.set_wall_time(now());
        event.set_step(step as i64);
        event.set_summary(summary);
        self.event(event)
    }

    fn scalar(&mut self, step: usize, tag: &str, value: f64) -> Result<()> {
        self.summary(step, scalar(tag, value as f32))
    }

    /// Writes the tags of one step (see the module doc) and flushes them to the file.
    pub fn write(&mut self, m: &StepMetrics) -> Result<()> {
        let s = m.step;
        let scalars = [
            ("loss", Some(m.loss)),
            ("loss/lm", Some(m.lm_loss)),
            ("loss/aux", m.aux_loss),
            ("loss/z", m.z_loss),
            ("loss/mtp", m.mtp_loss),
            ("lr", Some(m.lr)),
            ("grad_norm", Some(m.grad_norm)),
            ("loss_scale", m.loss_scale),
            ("throughput/tokens_per_s", Some(m.tokens_per_s)),
            ("time/step_s", Some(m.step_s)),
            ("time/compute_s", Some(m.compute_s)),
            ("comm/exposed_s", Some(m.exposed_comm_s)),
            ("comm/in_flight_wait_s", Some(m.in_flight_wait_s)),
            ("comm/bytes_sent", Some(m.bytes_sent)),
            ("eval/loss", m.eval_loss),
            ("eval/perplexity", m.eval_perplexity),
        ];
        for (tag, value) in scalars {
            if let Some(v) = value {
                self.scalar(s, tag, v)?;
            }
        }
        // A blend: each source's held-out loss and tokens, named by its path.
        for (label, &loss) in m.eval_loss_per_source.iter().flatten() {
            self.scalar(s, &format!("eval/loss/{}", source_tag(label)), loss)?;
        }
        for (label, &tokens) in m.tokens_per_source.iter().flatten() {
            self.scalar(s, &format!("data/tokens/{}", source_tag(label)), tokens as f64)?;
        }
        for load in &m.expert_load {
            let counts: Vec<f64> = load.tokens_per_expert.iter().map(|&c| c as f64).collect();
            let num: f64 = counts.iter().sum();
            let sum: f64 = counts.iter().enumerate().map(|(e, c)| e as f64 * c).sum();
            let squares: f64 = counts.iter().enumerate().map(|(e, c)| (e * e) as f64 * c).sum();
            let hit: Vec<usize> = (0..counts.len()).filter(|&e| counts[e] > 0.0).collect();
            let (min, max) = match (hit.first(), hit.last()) {
                (Some(&a), Some(&b)) => (a as f64, b as f64),
                _ => (0.0, 0.0),
            };
            let limits: Vec<f64> = (0..counts.len()).map(|e| e as f64 + 0.5).collect();
            let tag = format!("expert_load/layer_{}", load.layer);
            self.summary(s, histogram_raw(&tag, min, max, num, sum, squares, &limits, &counts))?;
        }
        self.flush()
    }

    /// Flushes what was written to the file.
    pub fn flush(&mut self) -> Result<()> {
        let path = self.path.clone();
        self.writer.flush().map_err(io_error("cannot write the TensorBoard event file", &path))
    }
}

/// One value read back from an event file.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// A scalar.
    Scalar(f32),
    /// A histogram: its bucket counts.
    Histogram(Vec<f64>),
}

/// Reads every summary value of the event files in `dir` as `(step, tag, value)` (TFRecord
/// framing checked by length; the CRCs are not verified).
pub fn read_dir(dir: &Path) -> Result<Vec<(i64, String, Value)>> {
    let mut out = Vec::new();
    let entries = std::fs::read_dir(dir).map_err(io_error("cannot read the TensorBoard directory", dir))?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("events.out.tfevents.")))
        .collect();
    files.sort();
    for path in files {
        let bytes = std::fs::read(&path).map_err(io_error("cannot read the TensorBoard event file", &path))?;
        let bad = |what: &str| TrainError::Io {
            action: "cannot parse the TensorBoard event file",
            path: path.clone(),
            source: std::io::Error::other(what.to_string()),
        };
        let mut at = 0;
        while at < bytes.len() {
            let len = bytes.get(at..at + 8).ok_or_else(|| bad("truncated record length"))?;
            let len = u64::from_le_bytes(len.try_into().expect("8 bytes")) as usize;
            let data = bytes.get(at + 12..at + 12 + len).ok_or_else(|| bad("truncated record"))?;
            let event = Event::parse_from_bytes(data).map_err(|e| bad(&e.to_string()))?;
            for v in event.get_summary().get_value() {
                let value = if v.has_histo() {
                    Value::Histogram(v.get_histo().get_bucket().to_vec())
                } else {
                    Value::Scalar(v.get_simple_value())
                };
                out.push((event.get_step(), v.get_tag().to_string(), value));
            }
            at += 12 + len + 4;
        }
    }
    Ok(out)
}

/// A blend source's path as part of a tag: characters other than letters, digits, `_`, `-`, `.`
/// and `/` become `_`, a leading `/` is dropped (no empty tag level).
fn source_tag(label: &str) -> String {
    let label = label.trim_start_matches('/');
    label.chars().map(|c| if c.is_ascii_alphanumeric() || "_-./".contains(c) { c } else { '_' }).collect()
}
