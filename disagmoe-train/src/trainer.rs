//! Single-device training: the run configuration, the loop, progress, metrics and the summary.
//!
//! One step: next batch -> forward -> loss (LM + aux) -> backward -> global grad norm -> (skip if not
//! finite) -> clip -> AdamW with the scheduled learning rate -> metrics line.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use burn::module::{AutodiffModule, Module, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::Tensor;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::{Deserialize, Serialize};

use disagmoe_models::{HfCheckpoint, ModelConfig, MoeCausalLm};

use crate::checkpoint::{latest_checkpoint, load_checkpoint, save_checkpoint, TrainState};
use crate::data::{ByteTokenizer, HfTokenizer, PackedDataset, Tokenizer, BUNDLED_CORPUS, BUNDLED_CORPUS_NAME};
use crate::error::{Result, TrainError};
use crate::metrics::{ExpertLoad, JsonlWriter, StepMetrics};
use crate::optim::{grad_norm, AdamW, AdamWSettings, LrSchedule};
use crate::runtime::layout::Placement;
use crate::runtime::{TransportKind, WorkerFault};

/// The embedded default model: a small Qwen3-MoE over bytes (`configs/tiny-qwen3-moe.json`).
pub const DEFAULT_MODEL_CONFIG: &str = include_str!("../../configs/tiny-qwen3-moe.json");

/// Embedded model configurations, by name (`--model-preset`); all over bytes (vocabulary 256).
pub const MODEL_PRESETS: &[(&str, &str)] = &[
    ("tiny-qwen3-moe", DEFAULT_MODEL_CONFIG),
    ("tiny-gpt-oss", include_str!("../../configs/tiny-gpt-oss.json")),
    ("tiny-deepseek-v3", include_str!("../../configs/tiny-deepseek-v3.json")),
];

/// The `config.json` text of an embedded preset, or an error listing the presets.
pub fn model_preset(name: &str) -> Result<&'static str> {
    MODEL_PRESETS.iter().find(|(n, _)| *n == name).map(|(_, c)| *c).ok_or_else(|| {
        let names: Vec<&str> = MODEL_PRESETS.iter().map(|(n, _)| *n).collect();
        TrainError::option("model_preset", format!("`{name}` is not a preset; allowed: {names:?}"))
    })
}

/// How a disaggregated run's workers are split.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum AllocationMode {
    /// As given: `attn_workers`, `ffn_workers`, `groups`.
    #[default]
    Manual,
    /// Chosen by the planner and refined with measured step times.
    Auto,
}

/// What to do when a loss or gradient is NaN or infinite.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum NonFinitePolicy {
    /// Skip the update with a warning and count it (`skipped_steps`).
    #[default]
    Skip,
    /// Stop the run with an error naming the step and the tensor.
    Abort,
}

/// Fault injection for tests: multiply one parameter's gradient by NaN at one step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultInjection {
    /// Step (1-based) at which to inject.
    pub step: usize,
    /// Hugging Face name of the parameter whose gradient becomes NaN.
    pub tensor: String,
}

/// Everything a training run needs to know, as a TOML file (`--run-config`) or from flags.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunConfig {
    /// A Hugging Face style `config.json`: train a freshly initialised model of that shape.
    pub model_config: Option<PathBuf>,
    /// A checkpoint directory (`config.json` + safetensors): continue from its weights.
    pub model_dir: Option<PathBuf>,
    /// An embedded model configuration (see [`MODEL_PRESETS`]); used when neither `model_config` nor
    /// `model_dir` is given. Default: `tiny-qwen3-moe`.
    pub model_preset: Option<String>,
    /// Text corpus (UTF-8). Default: the bundled public-domain corpus.
    pub data: Option<PathBuf>,
    /// A Hugging Face `tokenizer.json`. Default: the checkpoint's own if it has one, else bytes.
    pub tokenizer: Option<PathBuf>,
    /// Optimizer steps.
    pub steps: usize,
    /// Sequences per step.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Final learning rate of the cosine decay.
    pub min_lr: f64,
    /// Warm-up steps (default: 10% of `steps`, at most 100).
    pub warmup_steps: Option<usize>,
    /// Decoupled weight decay on matrices.
    pub weight_decay: f64,
    /// AdamW beta1.
    pub beta1: f64,
    /// AdamW beta2.
    pub beta2: f64,
    /// AdamW epsilon.
    pub eps: f64,
    /// Clip the global gradient norm to this (0 turns clipping off).
    pub grad_clip: f64,
    /// Seed of initialisation and data order.
    pub seed: u64,
    /// Add the load-balancing loss (default: as the model config's `output_router_logits` says,
    /// which is what transformers does).
    pub aux_loss: Option<bool>,
    /// Output directory: `metrics.jsonl` and the final checkpoint in `final/`.
    pub out: Option<PathBuf>,
    /// Print a log line every this many steps when there is no terminal for the progress bar.
    pub log_every: usize,
    /// Show the progress bar (when stderr is a terminal).
    pub progress: bool,
    /// Directory of training checkpoints (`step-<n>` subdirectories). Default: the `resume`
    /// directory when resuming, else none.
    pub checkpoint_dir: Option<PathBuf>,
    /// Write a checkpoint every this many steps (0: only at the end and when stopped early).
    pub checkpoint_every: usize,
    /// Checkpoints kept (the newest).
    pub keep_checkpoints: usize,
    /// Continue from the newest complete checkpoint in this directory.
    pub resume: Option<PathBuf>,
    /// End the run after this step with a checkpoint, as a job cut off by its scheduler (the
    /// learning-rate schedule still spans `steps`).
    pub stop_after: Option<usize>,
    /// Policy for non-finite losses and gradients.
    pub on_nonfinite: NonFinitePolicy,
    /// Testing only: make one gradient NaN at one step.
    pub inject_nonfinite: Option<FaultInjection>,
    /// Aux-loss-free balancing: after each update, routers with a correction bias (DeepSeek-V3)
    /// move it by this much towards balance (0 turns it off).
    pub bias_update_rate: f64,
    /// Where the model runs: `single` (one device), `disagg` (AF-Pipe on attention and expert
    /// workers), `ep` (colocated expert-parallel baseline).
    pub placement: Placement,
    /// `disagg`: attention workers `M` in all (a multiple of `groups`).
    pub attn_workers: usize,
    /// `disagg`: expert workers `N` in all (a multiple of `groups`).
    pub ffn_workers: usize,
    /// `disagg`: groups `p`; group `g` holds layers `g, g+p, ...`.
    pub groups: usize,
    /// `disagg`: `manual` (the three counts above) or `auto` (the planner chooses them within
    /// `attn_workers + ffn_workers` workers and measured step times refine its choice).
    pub allocation: AllocationMode,
    /// `ep`: workers.
    pub workers: usize,
    /// Micro-batches per step (`batch` must be a multiple). Default: 1 for `single`, 4 for
    /// `disagg`, `workers` for `ep`. Each micro-batch's loss (with its own load-balancing term) is
    /// averaged, so runs with the same value compare across placements.
    pub micro_batches: Option<usize>,
    /// `disagg`: micro-batches each embedding worker keeps in flight (started, backward not done);
    /// default: all of its micro-batches of the step at once.
    pub in_flight: Option<usize>,
    /// How workers talk: `local` (threads), `mpi` (processes under mpirun; feature `mpi`), `nccl`
    /// (processes under mpirun, messages through NCCL; feature `nccl`).
    pub transport: TransportKind,
    /// Emulate links of this many Gbit/s per worker (off when absent).
    pub link_gbps: Option<f64>,
    /// One-way latency of the emulated links, microseconds.
    pub link_latency_us: f64,
    /// Write a Chrome trace of every worker's streams here (distributed runs).
    pub trace: Option<PathBuf>,
    /// A worker that waits this long for any message ends the run with an error, seconds.
    pub comm_timeout_s: f64,
    /// Testing only: one worker fails at one step.
    pub fail_worker: Option<WorkerFault>,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            model_config: None,
            model_dir: None,
            model_preset: None,
            data: None,
            tokenizer: None,
            steps: 300,
            batch: 8,
            seq: 128,
            lr: 3e-3,
            min_lr: 3e-4,
            warmup_steps: None,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            grad_clip: 1.0,
            seed: 42,
            aux_loss: None,
            out: None,
            log_every: 10,
            progress: true,
            checkpoint_dir: None,
            checkpoint_every: 0,
            keep_checkpoints: 3,
            resume: None,
            stop_after: None,
            on_nonfinite: NonFinitePolicy::Skip,
            inject_nonfinite: None,
            bias_update_rate: 0.001,
            placement: Placement::Single,
            attn_workers: 2,
            ffn_workers: 2,
            groups: 2,
            allocation: AllocationMode::Manual,
            workers: 4,
            micro_batches: None,
            in_flight: None,
            transport: TransportKind::Local,
            link_gbps: None,
            link_latency_us: 0.0,
            trace: None,
            comm_timeout_s: 60.0,
            fail_worker: None,
        }
    }
}

impl RunConfig {
    /// Reads a TOML run config; unknown keys are errors.
    pub fn from_toml_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| TrainError::Io {
            action: "cannot read run config",
            path: path.into(),
            source,
        })?;
        toml::from_str(&text).map_err(|e| TrainError::RunConfig { path: path.into(), message: e.to_string() })
    }

    /// Checks every option once; the error names the option and the allowed values.
    pub fn validate(&self) -> Result<()> {
        let positive = |field: &str, v: usize| {
            if v == 0 {
                Err(TrainError::option(field, "must be at least 1"))
            } else {
                Ok(())
            }
        };
        positive("steps", self.steps)?;
        positive("batch", self.batch)?;
        positive("log_every", self.log_every)?;
        if self.seq < 2 {
            return Err(TrainError::option("seq", format!("must be at least 2 tokens, got {}", self.seq)));
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(TrainError::option("lr", format!("must be a finite number > 0, got {}", self.lr)));
        }
        if !(self.min_lr.is_finite() && self.min_lr >= 0.0 && self.min_lr <= self.lr) {
            return Err(TrainError::option(
                "min_lr",
                format!("must be between 0 and lr ({}), got {}", self.lr, self.min_lr),
            ));
        }
        if let Some(w) = self.warmup_steps {
            if w > self.steps {
                return Err(TrainError::option(
                    "warmup_steps",
                    format!("must be at most steps ({}), got {w}", self.steps),
                ));
            }
        }
        for (field, v) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&v) {
                return Err(TrainError::option(field, format!("must be in [0, 1), got {v}")));
            }
        }
        if !(self.eps > 0.0) {
            return Err(TrainError::option("eps", format!("must be > 0, got {}", self.eps)));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(TrainError::option("weight_decay", format!("must be >= 0, got {}", self.weight_decay)));
        }
        if !(self.bias_update_rate.is_finite() && self.bias_update_rate >= 0.0) {
            return Err(TrainError::option("bias_update_rate", format!("must be >= 0, got {}", self.bias_update_rate)));
        }
        if !(self.grad_clip.is_finite() && self.grad_clip >= 0.0) {
            return Err(TrainError::option(
                "grad_clip",
                format!("must be >= 0 (0 turns clipping off), got {}", self.grad_clip),
            ));
        }
        if self.model_config.is_some() && self.model_dir.is_some() {
            return Err(TrainError::option("model_config", "give either model_config or model_dir, not both"));
        }
        if let Some(p) = &self.model_preset {
            model_preset(p)?;
        }
        if let Some(n) = self.stop_after {
            if n == 0 || n > self.steps {
                return Err(TrainError::option(
                    "stop_after",
                    format!("must be between 1 and steps ({}), got {n}", self.steps),
                ));
            }
        }
        positive("keep_checkpoints", self.keep_checkpoints)?;
        let k = self.effective_micro_batches();
        if k == 0 || self.batch % k != 0 {
            return Err(TrainError::option(
                "micro_batches",
                format!("must divide batch ({}) evenly, got {k}", self.batch),
            ));
        }
        for (field, v) in [
            ("attn_workers", self.attn_workers),
            ("ffn_workers", self.ffn_workers),
            ("groups", self.groups),
            ("workers", self.workers),
        ] {
            positive(field, v)?;
        }
        if self.allocation == AllocationMode::Auto && self.placement != Placement::Disagg {
            return Err(TrainError::option("allocation", "auto needs placement disagg"));
        }
        if self.allocation == AllocationMode::Auto && self.transport != TransportKind::Local {
            return Err(TrainError::option(
                "allocation",
                "auto measures its candidates in this process and needs transport local; run the counts it chooses under mpirun with allocation manual",
            ));
        }
        if self.in_flight == Some(0) {
            return Err(TrainError::option("in_flight", "must be at least 1"));
        }
        if let Some(g) = self.link_gbps {
            if !(g.is_finite() && g > 0.0) {
                return Err(TrainError::option("link_gbps", format!("must be a finite number > 0, got {g}")));
            }
        }
        if !(self.link_latency_us.is_finite() && self.link_latency_us >= 0.0) {
            return Err(TrainError::option("link_latency_us", format!("must be >= 0, got {}", self.link_latency_us)));
        }
        if !(self.comm_timeout_s.is_finite() && self.comm_timeout_s > 0.0) {
            return Err(TrainError::option("comm_timeout_s", format!("must be > 0, got {}", self.comm_timeout_s)));
        }
        if self.placement == Placement::Single && (self.link_gbps.is_some() || self.trace.is_some()) {
            return Err(TrainError::option(
                if self.trace.is_some() { "trace" } else { "link_gbps" },
                "needs placement disagg or ep (a single device has no links)",
            ));
        }
        Ok(())
    }

    /// Micro-batches per step, the default filled in.
    pub fn effective_micro_batches(&self) -> usize {
        self.micro_batches.unwrap_or(match self.placement {
            Placement::Single => 1,
            Placement::Disagg => 4,
            Placement::Ep => self.workers,
        })
    }

    /// The learning-rate schedule of this run.
    pub fn schedule(&self) -> LrSchedule {
        let warmup = self.warmup_steps.unwrap_or_else(|| (self.steps / 10).min(100));
        LrSchedule { peak: self.lr, min: self.min_lr, warmup, total: self.steps }
    }
}

/// The last line a run prints: what a user or a script wants to know.
#[derive(Debug, Clone, Serialize)]
pub struct TrainSummary {
    /// Loss of the first step.
    pub first_loss: f64,
    /// Loss of the last step.
    pub last_loss: f64,
    /// Loss of every step.
    pub losses: Vec<f64>,
    /// Tokens per second after warm-up: over the steps after the first when two or more ran (the
    /// first step pays one-time costs: first touch of every buffer, optimizer moments, thread
    /// pool start), else over the one step. The usual throughput figure; [`tokens_per_s_all`]
    /// counts every step.
    ///
    /// [`tokens_per_s_all`]: TrainSummary::tokens_per_s_all
    pub tokens_per_s: f64,
    /// Tokens per second over every step, the first included.
    pub tokens_per_s_all: f64,
    /// Wall time of the first step, seconds.
    pub first_step_s: f64,
    /// Steps run.
    pub steps: usize,
    /// Steps whose update was skipped for non-finite gradients.
    pub skipped_steps: usize,
    /// Backend the run used.
    pub backend: String,
    /// Parameters of the model.
    pub params: usize,
    /// Wall time of the training loop in seconds.
    pub train_s: f64,
    /// Sum of squares of all parameters after the last step (compares runs and resumes).
    pub param_checksum: f64,
    /// Step of the checkpoint the run resumed from.
    pub resumed_from_step: Option<usize>,
    /// The run ended before `steps` (`stop_after` or a signal); a checkpoint holds its state.
    pub stopped_early: bool,
    /// The last checkpoint written.
    pub checkpoint: Option<PathBuf>,
    /// `single`, `disagg` or `ep`.
    pub placement: String,
    /// Workers (1 for `single`).
    pub workers: usize,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// Mean wall time of a step, seconds.
    pub step_s: f64,
    /// Mean per step of the time compute streams sat waiting for data (task inputs and gradient
    /// all-reduce), summed over workers.
    pub exposed_comm_s: f64,
    /// The part of `exposed_comm_s` during which the awaited data was already on the wire.
    pub in_flight_wait_s: f64,
    /// Mean per step of the time compute streams computed, summed over workers.
    pub compute_s: f64,
    /// Mean per step of the time transfers spent on emulated links, summed over workers (0 without
    /// `link_gbps`).
    pub link_s: f64,
}

/// `(tokens_per_s, tokens_per_s_all, first_step_s)` from the wall time of each step (see
/// [`TrainSummary::tokens_per_s`]).
pub fn throughput(step_s: &[f64], tokens_per_step: usize) -> (f64, f64, f64) {
    let rate = |s: &[f64]| (s.len() * tokens_per_step) as f64 / s.iter().sum::<f64>().max(1e-9);
    let all = rate(step_s);
    let steady = if step_s.len() >= 2 { rate(&step_s[1..]) } else { all };
    (steady, all, step_s.first().copied().unwrap_or(0.0))
}

struct SquareSum<'a, B: Backend> {
    parts: &'a mut Vec<Tensor<B, 1>>,
}

impl<B: Backend> ModuleVisitor<B> for SquareSum<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        self.parts.push(param.val().square().sum());
    }
}

/// Sum of squares of all parameters of a module (one host read).
pub fn param_checksum<B: Backend, M: Module<B>>(model: &M) -> f64 {
    let mut parts = Vec::new();
    model.visit(&mut SquareSum { parts: &mut parts });
    if parts.is_empty() {
        return 0.0;
    }
    let host: Vec<f64> = Tensor::cat(parts, 0).into_data().convert::<f64>().to_vec().expect("f64");
    host.iter().sum()
}

struct Poison<'a> {
    target: ParamId,
    grads: &'a mut GradientsParams,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Poison<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if param.id == self.target {
            if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
                self.grads.register::<B::InnerBackend, D>(param.id, g.mul_scalar(f64::NAN));
            }
        }
    }
}

/// Builds the model a run config asks for: from a checkpoint, from a `config.json`, or the default.
pub fn build_model<B: AutodiffBackend>(cfg: &RunConfig, device: &B::Device) -> Result<MoeCausalLm<B>> {
    B::seed(device, cfg.seed);
    Ok(match (&cfg.model_dir, &cfg.model_config) {
        (Some(dir), _) => MoeCausalLm::from_pretrained(dir, device)?,
        (None, Some(path)) => ModelConfig::from_file(path)?.init(device),
        (None, None) => {
            ModelConfig::from_json_str(model_preset(cfg.model_preset.as_deref().unwrap_or("tiny-qwen3-moe"))?)?
                .init(device)
        }
    })
}

pub(crate) fn build_data(cfg: &RunConfig, model_vocab: usize) -> Result<PackedDataset> {
    let tokenizer: Box<dyn Tokenizer> = match (&cfg.tokenizer, &cfg.model_dir) {
        (Some(path), _) => Box::new(HfTokenizer::from_file(path)?),
        (None, Some(dir)) if dir.join("tokenizer.json").exists() => {
            Box::new(HfTokenizer::from_file(dir.join("tokenizer.json"))?)
        }
        _ => Box::new(ByteTokenizer),
    };
    match &cfg.data {
        Some(path) => PackedDataset::from_file(path, tokenizer.as_ref(), cfg.seq, cfg.seed, model_vocab, cfg.batch),
        None => PackedDataset::new(
            BUNDLED_CORPUS,
            BUNDLED_CORPUS_NAME,
            tokenizer.as_ref(),
            cfg.seq,
            cfg.seed,
            model_vocab,
            cfg.batch,
        ),
    }
}

/// Runs a training job on one device and returns its summary (and the trained model).
pub fn train<B: AutodiffBackend>(cfg: &RunConfig, device: &B::Device) -> Result<(TrainSummary, MoeCausalLm<B>)> {
    train_until(cfg, device, &AtomicBool::new(false))
}

/// [`train`], finishing the current step and checkpointing when `stop` becomes true (the CLI sets
/// it on SIGINT/SIGTERM).
pub fn train_until<B: AutodiffBackend>(
    cfg: &RunConfig,
    device: &B::Device,
    stop: &AtomicBool,
) -> Result<(TrainSummary, MoeCausalLm<B>)> {
    cfg.validate()?;
    crate::backend::keep_freed_memory();
    let settings = AdamWSettings { beta1: cfg.beta1, beta2: cfg.beta2, eps: cfg.eps, weight_decay: cfg.weight_decay };
    let mut opt = AdamW::<B>::new(settings);
    let checkpoint_dir = cfg.checkpoint_dir.clone().or_else(|| cfg.resume.clone());
    let (mut model, resumed) = match &cfg.resume {
        Some(dir) => {
            let path = latest_checkpoint(dir)?.ok_or_else(|| TrainError::Checkpoint {
                path: dir.clone(),
                message: "holds no complete checkpoint to resume from (expected step-<n> directories with a manifest)"
                    .into(),
            })?;
            let (model, state) = load_checkpoint::<B>(&path, &mut opt, device)?;
            if state.step >= cfg.steps {
                return Err(TrainError::option(
                    "steps",
                    format!(
                        "the checkpoint {} is at step {}; steps must be larger to continue, got {}",
                        path.display(),
                        state.step,
                        cfg.steps
                    ),
                ));
            }
            tracing::info!(checkpoint = %path.display(), step = state.step, "resuming");
            (model, Some(state))
        }
        None => {
            if let Some(dir) = &checkpoint_dir {
                if let Some(existing) = latest_checkpoint(dir)? {
                    return Err(TrainError::Checkpoint {
                        path: dir.clone(),
                        message: format!(
                            "already holds checkpoints of a run (newest: {}); pass --resume {} to continue it, or choose another --checkpoint-dir",
                            existing.display(),
                            dir.display()
                        ),
                    });
                }
            }
            (build_model::<B>(cfg, device)?, None)
        }
    };
    let mconf = model.config();
    let mut data = build_data(cfg, mconf.vocab_size())?;
    if let Some(state) = &resumed {
        data.seek(state.data);
    }
    let sparse_layers = mconf.sparse_layers();
    let with_aux = cfg.aux_loss.unwrap_or(mconf.output_router_logits()) && !sparse_layers.is_empty();
    let schedule = cfg.schedule();
    let mut metrics = match &cfg.out {
        Some(dir) => Some(JsonlWriter::append(&dir.join("metrics.jsonl"))?),
        None => None,
    };
    let params = model.num_params();
    let names = model.state_dict_names();
    let poison = match &cfg.inject_nonfinite {
        Some(inj) => Some((
            inj.step,
            *names.iter().find(|(_, n)| **n == inj.tensor).map(|(id, _)| id).ok_or_else(|| {
                TrainError::option(
                    "inject_nonfinite.tensor",
                    format!("`{}` is not a parameter of the model", inj.tensor),
                )
            })?,
        )),
        None => None,
    };
    tracing::info!(
        model = mconf.model_type(),
        backend = crate::BACKEND_NAME,
        params,
        corpus = data.source(),
        corpus_tokens = data.num_tokens(),
        windows = data.windows(),
        "training"
    );

    let interactive = cfg.progress && std::io::stderr().is_terminal();
    let bar = ProgressBar::with_draw_target(
        Some(cfg.steps as u64),
        if interactive { ProgressDrawTarget::stderr() } else { ProgressDrawTarget::hidden() },
    );
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );

    let mut losses = resumed.as_ref().map(|s| s.losses.clone()).unwrap_or_default();
    let mut step_times: Vec<f64> = Vec::new();
    let mut skipped = resumed.as_ref().map(|s| s.skipped_steps).unwrap_or(0);
    let first_step = resumed.as_ref().map(|s| s.step + 1).unwrap_or(1);
    let last_step = cfg.stop_after.unwrap_or(cfg.steps);
    bar.set_position(first_step as u64 - 1);
    let tokens_per_step = cfg.batch * cfg.seq;
    let start = Instant::now();
    let mut last_checkpoint = None;
    let mut done = first_step - 1;
    let save = |model: &MoeCausalLm<B>,
                opt: &AdamW<B>,
                step: usize,
                data: &PackedDataset,
                losses: &[f64],
                skipped: usize|
     -> Result<Option<PathBuf>> {
        match &checkpoint_dir {
            Some(dir) => {
                let state = TrainState {
                    step,
                    optimizer_steps: opt.steps_taken(),
                    data: data.position(),
                    losses: losses.to_vec(),
                    skipped_steps: skipped,
                    seed: cfg.seed,
                    total_steps: cfg.steps,
                };
                Ok(Some(save_checkpoint(dir, model, opt, &state, cfg.keep_checkpoints)?))
            }
            None => Ok(None),
        }
    };
    for step in first_step..=last_step {
        let t0 = Instant::now();
        let rows = data.next_batch(cfg.batch);
        // Micro-batches: each one's loss (with its own load-balancing term) over K, gradients added.
        let k = cfg.effective_micro_batches();
        let per = cfg.batch / k;
        let mut acc = GradientsAccumulator::new();
        let (mut total, mut lm, mut aux) = (0.0, 0.0, None::<f64>);
        let mut counts: Vec<Vec<usize>> = Vec::new();
        for chunk in rows.chunks(per) {
            let ids = model.input_ids(chunk, device)?;
            let out = model.forward(ids.clone());
            let loss = model.loss(&out, ids, with_aux);
            let scalars = burn::tensor::Tensor::cat(
                [Some(loss.total.clone()), Some(loss.lm_loss.clone()), loss.aux_loss.clone()]
                    .into_iter()
                    .flatten()
                    .collect(),
                0,
            )
            .into_data()
            .convert::<f64>()
            .to_vec::<f64>()
            .expect("f64 scalars");
            total += scalars[0] / k as f64;
            lm += scalars[1] / k as f64;
            if let Some(a) = scalars.get(2) {
                aux = Some(aux.unwrap_or(0.0) + a / k as f64);
            }
            counts.resize(out.router_stats.len(), Vec::new());
            for (c, s) in counts.iter_mut().zip(&out.router_stats) {
                c.resize(s.counts.len(), 0);
                for (a, b) in c.iter_mut().zip(&s.counts) {
                    *a += b;
                }
            }
            let total = if k > 1 { loss.total.div_scalar(k as f64) } else { loss.total };
            acc.accumulate(&model, GradientsParams::from_grads(total.backward(), &model));
        }
        let expert_load: Vec<ExpertLoad> =
            counts.iter().zip(&sparse_layers).map(|(c, &l)| ExpertLoad::from_counts(l, c)).collect();
        let mut grads = acc.grads();
        if let Some((_, target)) = poison.filter(|(s, _)| *s == step) {
            model.visit(&mut Poison { target, grads: &mut grads });
        }
        let norms = grad_norm::<B, _>(&model, &grads);
        let lr = schedule.at(step);
        let finite = total.is_finite() && norms.total.is_finite();
        if !finite && cfg.on_nonfinite == NonFinitePolicy::Abort {
            let tensor =
                norms.per_param.iter().find(|(_, n)| !n.is_finite()).and_then(|(id, _)| names.get(id).cloned());
            return Err(TrainError::NonFinite {
                step,
                what: if total.is_finite() { "gradient" } else { "loss" },
                tensor: tensor.unwrap_or_default(),
            });
        }
        if finite {
            let scale = if cfg.grad_clip > 0.0 && norms.total > cfg.grad_clip {
                cfg.grad_clip / (norms.total + 1e-6)
            } else {
                1.0
            };
            model = opt.step(model, &mut grads, lr, scale);
            if cfg.bias_update_rate > 0.0 {
                model.update_router_biases(&counts, cfg.bias_update_rate)?;
            }
        } else {
            skipped += 1;
            let worst = norms
                .per_param
                .iter()
                .find(|(_, n)| !n.is_finite())
                .map(|(id, _)| names.get(id).cloned().unwrap_or_else(|| format!("{id}")))
                .unwrap_or_else(|| "the loss".into());
            tracing::warn!(step, loss = total, tensor = %worst, "non-finite loss or gradient: update skipped");
        }
        let step_s = t0.elapsed().as_secs_f64();
        step_times.push(step_s);
        losses.push(total);
        let record = StepMetrics {
            step,
            loss: total,
            lm_loss: lm,
            aux_loss: aux,
            lr,
            grad_norm: norms.total,
            skipped: !finite,
            tokens: tokens_per_step,
            step_s,
            tokens_per_s: tokens_per_step as f64 / step_s,
            expert_load,
        };
        if let Some(w) = &mut metrics {
            w.write(&record)?;
        }
        let rate = ((step + 1 - first_step) * tokens_per_step) as f64 / start.elapsed().as_secs_f64();
        bar.set_message(format!("loss {total:.4} | lr {lr:.2e} | {rate:.0} tok/s"));
        bar.inc(1);
        if !interactive && cfg.progress && (step % cfg.log_every == 0 || step == 1 || step == cfg.steps) {
            let worst = record.expert_load.iter().map(|l| l.max_mean_ratio).fold(0.0, f64::max);
            let dead: usize = record.expert_load.iter().map(|l| l.dead_experts).sum();
            eprintln!(
                "step {step:>5}/{} loss {total:.4} lm {lm:.4} lr {lr:.2e} grad_norm {:.3} load max/mean {worst:.2} dead {dead} {rate:.0} tok/s",
                cfg.steps, norms.total
            );
        }
        done = step;
        let interrupted = stop.load(Ordering::SeqCst);
        if (cfg.checkpoint_every > 0 && step % cfg.checkpoint_every == 0) || step == last_step || interrupted {
            last_checkpoint = save(&model, &opt, step, &data, &losses, skipped)?.or(last_checkpoint);
        }
        if interrupted {
            tracing::warn!(step, "stopped by signal after finishing the step");
            break;
        }
    }
    bar.finish_and_clear();
    let train_s = start.elapsed().as_secs_f64();
    if let Some(dir) = &cfg.out {
        model.valid().save_pretrained(dir.join("final"), 2 << 30)?;
    }
    let steps_run = done + 1 - first_step;
    let (tokens_per_s, tokens_per_s_all, first_step_s) = throughput(&step_times, tokens_per_step);
    let summary = TrainSummary {
        first_loss: *losses.first().expect("at least one step"),
        last_loss: *losses.last().expect("at least one step"),
        tokens_per_s,
        tokens_per_s_all,
        first_step_s,
        steps: done,
        skipped_steps: skipped,
        backend: crate::BACKEND_NAME.into(),
        params,
        train_s,
        param_checksum: param_checksum(&model),
        resumed_from_step: resumed.as_ref().map(|s| s.step),
        stopped_early: done < cfg.steps,
        checkpoint: last_checkpoint,
        placement: Placement::Single.name().into(),
        workers: 1,
        micro_batches: cfg.effective_micro_batches(),
        step_s: train_s / steps_run.max(1) as f64,
        exposed_comm_s: 0.0,
        in_flight_wait_s: 0.0,
        compute_s: train_s / steps_run.max(1) as f64,
        link_s: 0.0,
        losses,
    };
    Ok((summary, model))
}
