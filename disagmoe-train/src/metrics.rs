//! Per-step training metrics (one schema for every placement) and the JSONL file they are appended to.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::error::{Result, TrainError};

/// Expert load of one MoE layer in one step.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ExpertLoad {
    /// Layer index in the model.
    pub layer: usize,
    /// Routed token copies per expert.
    pub tokens_per_expert: Vec<usize>,
    /// Busiest expert's load over the mean load (1.0 is perfectly balanced).
    pub max_mean_ratio: f64,
    /// Experts that got no token.
    pub dead_experts: usize,
    /// Routed copies dropped for capacity (`--capacity-factor`; 0 when dropless).
    pub dropped: usize,
    /// The busiest expert worker's routed copies over the mean of the layer's expert workers, per
    /// micro-batch (the step's sums of both); distributed runs only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker_imbalance: Option<f64>,
}

impl ExpertLoad {
    /// Load statistics from per-expert counts.
    pub fn from_counts(layer: usize, counts: &[usize]) -> Self {
        let total: usize = counts.iter().sum();
        let mean = total as f64 / counts.len().max(1) as f64;
        let max = counts.iter().copied().max().unwrap_or(0) as f64;
        Self {
            layer,
            tokens_per_expert: counts.to_vec(),
            max_mean_ratio: if mean > 0.0 { max / mean } else { 0.0 },
            dead_experts: counts.iter().filter(|&&c| c == 0).count(),
            dropped: 0,
            worker_imbalance: None,
        }
    }
}

/// One re-placement of the experts during a run (`rebalance_every`), at the end of its step.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Rebalance {
    /// Expert copies that went to a new holder (their parameters and AdamW moments moved).
    pub experts_moved: usize,
    /// Bytes of parameters and moments moved, over all workers.
    pub bytes_moved: f64,
    /// Seconds computing the new placement (the moving average and EPLB's packing).
    pub placement_s: f64,
    /// Seconds of the slowest worker moving experts and rebuilding its expert stages.
    pub move_s: f64,
    /// Parameters each rank holds under the new placement.
    pub params_per_rank: Vec<usize>,
}

/// The re-placements of the experts over a run (`rebalance_every`), in its summary.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RebalanceSummary {
    /// Re-placements made.
    pub count: usize,
    /// Expert copies moved over all of them.
    pub experts_moved: usize,
    /// Bytes of parameters and moments moved over all of them.
    pub bytes_moved: f64,
    /// Mean seconds per re-placement computing the placement.
    pub placement_s: f64,
    /// Mean seconds per re-placement of the slowest worker moving experts and rebuilding stages.
    pub move_s: f64,
}

impl RebalanceSummary {
    /// The summary of `all` (`None` when there was none).
    pub fn of(all: &[Rebalance]) -> Option<Self> {
        let n = all.len();
        (n > 0).then(|| Self {
            count: n,
            experts_moved: all.iter().map(|r| r.experts_moved).sum(),
            bytes_moved: all.iter().map(|r| r.bytes_moved).sum(),
            placement_s: all.iter().map(|r| r.placement_s).sum::<f64>() / n as f64,
            move_s: all.iter().map(|r| r.move_s).sum::<f64>() / n as f64,
        })
    }
}

/// Whether a byte count is zero (left out of a line).
fn no_bytes(b: &f64) -> bool {
    *b == 0.0
}

/// One line of `metrics.jsonl`.
#[derive(Debug, Clone, Serialize)]
pub struct StepMetrics {
    /// Step number, from 1.
    pub step: usize,
    /// Total loss (LM + coefficient x aux).
    pub loss: f64,
    /// Next-token cross-entropy.
    pub lm_loss: f64,
    /// Load-balancing loss before its coefficient, when on.
    pub aux_loss: Option<f64>,
    /// Router z-loss summed over the MoE layers, before its coefficient, when on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub z_loss: Option<f64>,
    /// Multi-token prediction loss `(1 / D) sum_k L_k`, before its coefficient, when trained.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtp_loss: Option<f64>,
    /// Learning rate used.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Whether the update was skipped (non-finite gradients; under f16 an overflow).
    pub skipped: bool,
    /// f16: the loss scale this step ran with (absent for other precisions).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    /// Tokens in this step.
    pub tokens: usize,
    /// Wall time of this step in seconds.
    pub step_s: f64,
    /// Tokens per second of this step.
    pub tokens_per_s: f64,
    /// Seconds compute streams sat waiting for data, summed over workers (0 on one device).
    pub exposed_comm_s: f64,
    /// The part of `exposed_comm_s` with the awaited data already on the wire.
    pub in_flight_wait_s: f64,
    /// Seconds compute streams computed, summed over workers (the step's wall time on one device).
    pub compute_s: f64,
    /// Seconds transfers spent on emulated links, summed over workers.
    pub link_s: f64,
    /// Bytes sent, summed over workers (0 on one device).
    #[serde(default)]
    pub bytes_sent: f64,
    /// Of them, the token exchange's by message kind (as packed), summed over workers.
    #[serde(default, skip_serializing_if = "ExchangeBytes::is_zero")]
    pub exchange_bytes: ExchangeBytes,
    /// Bytes of the exchange's payloads copied from the workers' tensors to host memory, summed
    /// over workers (0, and left out, when they stay on the device or on one device).
    #[serde(default, skip_serializing_if = "no_bytes")]
    pub payload_host_bytes: f64,
    /// Expert load of each MoE layer.
    pub expert_load: Vec<ExpertLoad>,
    /// Mean next-token cross-entropy on the held-out windows, at the steps that evaluated.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f64>,
    /// `exp(eval_loss)`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_perplexity: Option<f64>,
    /// A blend's tokens of this step from each source (by the path as given).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_source: Option<std::collections::BTreeMap<String, u64>>,
    /// A blend's held-out loss of each source, at the steps that evaluated (`eval_loss` is their
    /// mean weighted as the blend).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_loss_per_source: Option<std::collections::BTreeMap<String, f64>>,
    /// The explicit expert placement in effect after this step (MoE layer -> the experts of each
    /// of its holders): on the first step of each start or resume of a run with one, and on each
    /// step that re-placed the experts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_placement: Option<std::collections::BTreeMap<usize, Vec<Vec<usize>>>>,
    /// The re-placement of the experts at the end of this step (`rebalance_every`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rebalance: Option<Rebalance>,
}

/// Bytes of the token exchange by message kind, as packed in the run's exchange precision
/// (`disagmoe_core::exchange`): forward M2N and N2M, the residual hand-off, and the three
/// gradients that mirror them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct ExchangeBytes {
    /// Attention -> expert holders: token activations, gate weights, token and expert ids.
    pub dispatch: f64,
    /// Expert holders -> the next layer's attention: outputs and token ids.
    pub combine: f64,
    /// Attention -> the next layer's attention: the residual stream and balance-loss sums.
    pub residual: f64,
    /// Backward, to expert holders: the gradient of their outputs.
    pub grad_combine: f64,
    /// Backward, to the previous attention worker: the residual's gradient.
    pub grad_residual: f64,
    /// Backward, expert holders -> attention: gradients of the dispatched rows and gate weights.
    pub grad_dispatch: f64,
    /// Context parallelism: the keys and values going round the rings of attention workers.
    #[serde(default)]
    pub kv: f64,
    /// Context parallelism, backward: their gradients going back to their owners.
    #[serde(default)]
    pub grad_kv: f64,
}

impl ExchangeBytes {
    /// From the bytes of each kind in field order (the order of `Msg::exchange_kind`).
    pub fn from_kinds(
        [dispatch, combine, residual, grad_combine, grad_residual, grad_dispatch, kv, grad_kv]: [f64; 8],
    ) -> Self {
        Self { dispatch, combine, residual, grad_combine, grad_residual, grad_dispatch, kv, grad_kv }
    }

    /// The bytes of each kind in field order.
    pub fn kinds(&self) -> [f64; 8] {
        [
            self.dispatch,
            self.combine,
            self.residual,
            self.grad_combine,
            self.grad_residual,
            self.grad_dispatch,
            self.kv,
            self.grad_kv,
        ]
    }

    /// All kinds.
    pub fn total(&self) -> f64 {
        self.kinds().iter().sum()
    }

    /// Whether nothing was exchanged (one device).
    pub fn is_zero(&self) -> bool {
        self.total() == 0.0
    }

    /// Each kind plus `other`'s.
    pub fn add(&mut self, other: &ExchangeBytes) {
        let (a, b) = (self.kinds(), other.kinds());
        *self = Self::from_kinds(std::array::from_fn(|i| a[i] + b[i]));
    }

    /// Each kind times `f`.
    pub fn scaled(self, f: f64) -> ExchangeBytes {
        Self::from_kinds(self.kinds().map(|b| b * f))
    }
}

/// Appends JSON lines to a file, flushing after each.
pub struct JsonlWriter {
    file: std::fs::File,
    path: PathBuf,
}

impl JsonlWriter {
    /// Opens `path` for appending, creating its directory.
    pub fn append(path: &Path) -> Result<Self> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|source| TrainError::Io {
                action: "cannot create directory",
                path: dir.into(),
                source,
            })?;
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|source| TrainError::Io { action: "cannot open metrics file", path: path.into(), source })?;
        Ok(Self { file, path: path.into() })
    }

    /// Writes one record as a line.
    pub fn write<T: Serialize>(&mut self, record: &T) -> Result<()> {
        let mut line = serde_json::to_vec(record).expect("metrics serialise");
        line.push(b'\n');
        self.file.write_all(&line).and_then(|_| self.file.flush()).map_err(|source| TrainError::Io {
            action: "cannot write metrics to",
            path: self.path.clone(),
            source,
        })
    }
}

/// Drops the lines of `path` whose `step` is past `step` (the steps a resumed run is about to do
/// again), atomically; nothing to do when the file does not exist.
pub fn truncate_after(path: &Path, step: usize) -> Result<()> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(source) => return Err(TrainError::Io { action: "cannot read metrics file", path: path.into(), source }),
    };
    let keep = |line: &str| {
        serde_json::from_str::<serde_json::Value>(line)
            .ok()
            .and_then(|v| v.get("step").and_then(|s| s.as_u64()))
            .is_some_and(|s| s as usize <= step)
    };
    let kept: String = text.lines().filter(|l| keep(l)).map(|l| format!("{l}\n")).collect();
    if kept.len() == text.len() {
        return Ok(());
    }
    disagmoe_models::weights::write_atomically(path, |tmp| std::fs::write(tmp, kept.as_bytes()))?;
    Ok(())
}

/// Memory the system can still give this process, bytes (`MemAvailable` of `/proc/meminfo`; 8 GiB
/// where the system does not say).
pub fn available_memory_bytes() -> usize {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<usize>().ok())
        })
        .map(|kb| kb * 1024)
        .unwrap_or(8 << 30)
}

/// This process's peak resident memory so far, MB (`VmHWM` of `/proc/self/status`; 0 where the
/// system does not say).
pub fn peak_rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map(|kb| kb / 1024.0)
        .unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resume_drops_the_steps_after_its_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let lines: String = (1..=7).map(|s| format!("{{\"step\":{s},\"loss\":1.0}}\n")).collect();
        std::fs::write(&path, lines).unwrap();
        truncate_after(&path, 5).unwrap();
        let steps: Vec<u64> = std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["step"].as_u64().unwrap())
            .collect();
        assert_eq!(steps, vec![1, 2, 3, 4, 5]);
        truncate_after(&dir.path().join("none.jsonl"), 3).unwrap();
    }

    #[test]
    fn load_ratio_and_dead_experts() {
        let l = ExpertLoad::from_counts(3, &[4, 0, 2, 2]);
        assert_eq!(l.dead_experts, 1);
        assert!((l.max_mean_ratio - 2.0).abs() < 1e-12);
    }
}
