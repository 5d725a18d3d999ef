//! The step-engine trait: what the training loop asks of whatever runs a step, on one device
//! (the `single` module) or on workers (the distributed runtime).

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use crate::checkpoint::TrainState;
use crate::data::Batch;
use crate::error::Result;

/// What the loop learns about a run once its engine is built.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineInfo {
    /// Parameters of the whole model.
    pub params: usize,
    /// Parameters each worker holds, by rank (the data-parallel copies of attention each count
    /// theirs).
    pub params_per_rank: Vec<usize>,
    /// Workers (1 on one device).
    pub workers: usize,
    /// What each worker is, by rank (`attention g0.w1 (rank 1)`, `experts g1.w0 (rank 3)`, ...).
    pub worker_names: Vec<String>,
    /// `single`, `disagg` or `ep`.
    pub placement: &'static str,
    /// Whether this process reports for the run (prints, writes metrics and the final model's
    /// config): always on one device and under `local`; rank 0 under MPI.
    pub primary: bool,
    /// Whether this process embeds micro-batches and so needs the step's batch.
    pub needs_data: bool,
    /// Layer indices of the MoE layers, in order (for the expert-load metrics).
    pub sparse_layers: Vec<usize>,
    /// `model_type` of the model.
    pub model_type: &'static str,
    /// Vocabulary size (the data is checked against it).
    pub vocab_size: usize,
    /// Micro-batches each embedding worker keeps in flight (1 on one device).
    pub in_flight: usize,
    /// Training FLOPs per token of the model at the run's sequence length
    /// (`disagmoe_core::cost::training_flops_per_token`).
    pub flops_per_token: f64,
    /// MoE layers whose experts are placed by an explicit table: for each, the experts of each of
    /// its holders (empty when every layer is split in contiguous ranges, and on one device).
    pub expert_placement: std::collections::BTreeMap<usize, Vec<Vec<usize>>>,
}

/// Where a step's time went, summed over workers (zero on one device but `compute_s`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTiming {
    /// Seconds compute streams sat waiting for data (task inputs and the gradient all-reduce).
    pub exposed_comm_s: f64,
    /// The part of it during which the awaited data was already on the wire.
    pub in_flight_wait_s: f64,
    /// Seconds compute streams computed.
    pub compute_s: f64,
    /// Seconds transfers spent on emulated links.
    pub link_s: f64,
    /// Bytes workers sent: the token exchange's messages, and each all-reduce as a ring sends it
    /// (2(n-1)/n of the data per member) whatever reduced it.
    pub bytes_sent: f64,
    /// Of them, the token exchange's messages (their payloads as packed: see
    /// `disagmoe_core::exchange`).
    pub exchange_bytes: crate::metrics::ExchangeBytes,
    /// Bytes of the exchange's payloads copied from the workers' tensors to host memory (on a
    /// GPU: read back over PCIe; 0 when the payloads stay on the device).
    pub payload_host_bytes: f64,
}

/// What one step did, the same on every worker.
#[derive(Debug, Clone, PartialEq)]
pub struct StepReport {
    /// Mean over micro-batches of LM loss + coefficient x balance loss.
    pub loss: f64,
    /// Mean LM loss.
    pub lm_loss: f64,
    /// Mean balance loss (before its coefficient), when on.
    pub aux_loss: Option<f64>,
    /// Mean router z-loss (summed over the MoE layers, before its coefficient), when on.
    pub z_loss: Option<f64>,
    /// Mean multi-token prediction loss (before its coefficient), when trained.
    pub mtp_loss: Option<f64>,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// The update was skipped (non-finite loss or gradient).
    pub skipped: bool,
    /// Routed copies per expert of each MoE layer (the order of [`EngineInfo::sparse_layers`]).
    pub expert_counts: Vec<Vec<usize>>,
    /// Routed copies dropped for capacity, per MoE layer (same order; zeros when dropless).
    pub dropped: Vec<usize>,
    /// Per MoE layer (same order), the busiest expert worker's routed copies over the mean of the
    /// layer's expert workers, each micro-batch's (added over the step's micro-batches: sum of
    /// the busiest over sum of the means); empty on one device.
    pub worker_imbalance: Vec<f64>,
    /// Where the time went (distributed runs).
    pub timing: StepTiming,
    /// The experts were placed anew at the end of this step (`rebalance_every`): what it cost,
    /// and the placement from the next step on.
    pub rebalance: Option<(crate::metrics::Rebalance, std::collections::BTreeMap<usize, Vec<Vec<usize>>>)>,
    /// The run is to stop after this step (a signal reached this process or, in a distributed run,
    /// any worker's: every worker decides alike).
    pub stop: bool,
}

/// Runs training steps for the loop in [`crate::trainer`]: one device or a distributed runtime.
pub trait StepEngine {
    /// Facts about the run.
    fn info(&self) -> EngineInfo;

    /// Runs step `step` (1-based) on `batch` (the step's whole batch, whose rows each worker reads
    /// for its own micro-batches; empty where [`EngineInfo::needs_data`] is false) with learning
    /// rate `lr`: forward, backward, reduce, clip, update. The loss is multiplied by `loss_scale`
    /// before the backward and the gradients divided by it before clipping and the update (f16's
    /// loss scaling; 1 otherwise); the report's `grad_norm` is the unscaled norm. `stop` is this
    /// process's stop request (set by a signal), which the report's `stop` carries (agreed among
    /// the workers of a distributed run).
    fn step(&mut self, step: usize, batch: &Batch, lr: f64, loss_scale: f64, stop: &AtomicBool) -> Result<StepReport>;

    /// Updates the optimizer has applied so far.
    fn optimizer_steps(&self) -> u64;

    /// Mean next-token cross-entropy of the current model over `batch` (held-out windows, masked
    /// by document as training is; empty where [`EngineInfo::needs_data`] is false), with no
    /// gradient and no change to the model.
    fn evaluate(&mut self, batch: &Batch) -> Result<f64>;

    /// Writes a training checkpoint of the current weights and optimizer state with `state` into
    /// `dir`, keeping the newest `keep`; returns its path.
    fn save_checkpoint(&mut self, dir: &Path, state: &TrainState, keep: usize) -> Result<PathBuf>;

    /// Ends the run: writes the final model to `out` (a Hugging Face directory) when given.
    fn finish(&mut self, out: Option<&Path>) -> Result<FinalReport>;
}

/// What a run's engine reports at its end.
#[derive(Debug, Clone, PartialEq)]
pub struct FinalReport {
    /// Sum of squares of all parameters (each once).
    pub param_checksum: f64,
    /// Peak resident memory of the process of each worker, MB, by rank (under `local` every worker
    /// is a thread of the one process, and each reports it).
    pub peak_rss_mb_per_rank: Vec<f64>,
    /// The most training state each worker held at the end of a step, by rank.
    pub state_per_rank: Vec<StateBytes>,
}

/// Bytes of training state a worker holds, counted from its live tensors (their elements times
/// their dtype's size): parameters, gradients, optimizer moments. Activations, messages and
/// buffers of the collectives are not in it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StateBytes {
    /// The weights.
    pub params: u64,
    /// The step's gradients (summed over its micro-batches), before any reduction.
    pub grads: u64,
    /// AdamW's moments (of its shard only for parameters held in copies, with the distributed
    /// optimizer).
    pub optimizer: u64,
}

impl StateBytes {
    /// All of it.
    pub fn total(&self) -> u64 {
        self.params + self.grads + self.optimizer
    }

    /// The larger of two by total.
    pub fn max(self, other: Self) -> Self {
        if other.total() > self.total() {
            other
        } else {
            self
        }
    }
}
