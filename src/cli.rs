//! Command-line front end shared by the `disagmoe` binary and the examples.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use disagmoe_models::weights::{write_atomically, TensorSink};
use disagmoe_models::{HfCheckpoint, MoeCausalLm, SaveDtype};
use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1, SIGUSR2};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use disagmoe_train::runtime;
use disagmoe_train::{
    AllocationMode, DefaultBackend, ExchangeDtype, FaultPlan, NonFinitePolicy, Placement, Precision, Recompute,
    RunConfig, TrainBackend, TrainSummary, TransportKind,
};

/// On or off.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum Switch {
    /// Turned on.
    On,
    /// Turned off.
    Off,
}

/// `disagmoe train`: options override the `--run-config` TOML file, which overrides the defaults.
#[derive(Debug, Clone, Args, Default)]
pub struct TrainArgs {
    /// A TOML file with any of the options below: by section (`[optimizer]` `lr = 1e-3`, see
    /// `disagmoe_train::config`) or as flat snake_case keys (`warmup_steps = 20`).
    #[arg(long, value_name = "RUN.toml")]
    pub run_config: Option<PathBuf>,
    /// Train a fresh model of the shape in this Hugging Face style config.json.
    #[arg(long, value_name = "CONFIG.json", conflicts_with = "model_dir")]
    pub model_config: Option<PathBuf>,
    /// Continue from a checkpoint directory (config.json + safetensors).
    #[arg(long, value_name = "DIR")]
    pub model_dir: Option<PathBuf>,
    /// An embedded model when neither --model-config nor --model-dir is given: tiny-qwen3-moe
    /// (default), tiny-gpt-oss, tiny-deepseek-v3, tiny-deepseek-moe, tiny-mixtral, tiny-olmoe.
    #[arg(long, value_name = "NAME")]
    pub model_preset: Option<String>,
    /// Training data: a UTF-8 text file (tokenized at start-up), a directory written by `disagmoe
    /// tokenize`, or a Megatron `.bin`/`.idx` pair (either file or their common prefix); token
    /// data is read in place, window by window, never loaded whole. Or a weighted blend of them in
    /// Megatron's syntax: `--data 0.7 tokens/web 0.2 tokens/code 0.1 tokens/math` (weights relative,
    /// dealt exactly per block of 1000 windows). Default: the bundled public-domain corpus.
    #[arg(long, value_name = "FILE|DIR|BLEND", num_args = 1.., allow_negative_numbers = true)]
    pub data: Option<Vec<PathBuf>>,
    /// Hugging Face tokenizer.json. Default: the checkpoint's own, else byte-level.
    #[arg(long, value_name = "tokenizer.json")]
    pub tokenizer: Option<PathBuf>,
    /// Optimizer steps [default: 300].
    #[arg(long)]
    pub steps: Option<usize>,
    /// Sequences per step [default: 8].
    #[arg(long)]
    pub batch: Option<usize>,
    /// Tokens per sequence [default: 128].
    #[arg(long)]
    pub seq: Option<usize>,
    /// Train in phases of their own sequence length, `SEQxSTEPS` or `SEQxSTEPSxBATCH` each
    /// (`64x100,128x50x4`): at each boundary the run checkpoints and continues under the next
    /// shape, re-planned with --allocation auto; --steps defaults to their total.
    #[arg(long, value_delimiter = ',', value_name = "SEQxSTEPS[xBATCH],...")]
    pub phases: Vec<String>,
    /// Share of the corpus's windows held out for evaluation (evenly spread), never trained on, 0..=0.5
    /// [default: 0.02].
    #[arg(long, value_name = "F")]
    pub eval_fraction: Option<f64>,
    /// Evaluate on the held-out windows every K steps and at the last one: eval_loss and
    /// perplexity in metrics.jsonl, the progress line and the summary [default: 0, never].
    #[arg(long, value_name = "K")]
    pub eval_every: Option<usize>,
    /// Batches of held-out windows per evaluation, at most [default: 8].
    #[arg(long, value_name = "N")]
    pub eval_batches: Option<usize>,
    /// Attention within each document of a packed window, and no loss on the token after an
    /// end-of-document: auto (on for token shards, which have a document index; off for text),
    /// on (text refused), or off [default: auto].
    #[arg(long, value_name = "auto|on|off")]
    pub document_mask: Option<disagmoe_train::DocumentMask>,
    /// Rotary positions under a document mask: continue (counted from each window's start) or
    /// restart (from each document's start; needs the mask) [default: continue].
    #[arg(long, value_name = "continue|restart")]
    pub document_positions: Option<disagmoe_train::DocumentPositions>,
    /// Peak learning rate [default: 3e-3].
    #[arg(long)]
    pub lr: Option<f64>,
    /// Final learning rate of the cosine decay [default: 3e-4].
    #[arg(long)]
    pub min_lr: Option<f64>,
    /// Warm-up steps [default: 10% of steps, at most 100].
    #[arg(long)]
    pub warmup_steps: Option<usize>,
    /// Decoupled weight decay on matrices [default: 0.1].
    #[arg(long)]
    pub weight_decay: Option<f64>,
    /// Clip the global gradient norm (0: off) [default: 1.0].
    #[arg(long)]
    pub grad_clip: Option<f64>,
    /// What AdamW's moments are kept in: f32, or bf16 (half their bytes; each update computes in
    /// f32) [default: f32]. A resume keeps the checkpoint's unless --allow-change
    /// optimizer_state_dtype.
    #[arg(long, value_name = "f32|bf16")]
    pub optimizer_state_dtype: Option<disagmoe_train::config::StateDtype>,
    /// Seed of initialisation and data order [default: 42].
    #[arg(long)]
    pub seed: Option<u64>,
    /// Load-balancing loss [default: as the model config's output_router_logits].
    #[arg(long, value_enum)]
    pub aux_loss: Option<Switch>,
    /// Output directory: metrics.jsonl and the final checkpoint in final/.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Write TensorBoard event files here (losses, learning rate, gradient norm, throughput,
    /// communication, eval loss, and each MoE layer's expert load as a histogram; rank 0 only).
    #[arg(long, value_name = "DIR")]
    pub tensorboard: Option<PathBuf>,
    /// Print a log line every N steps when stderr is not a terminal [default: 10].
    #[arg(long)]
    pub log_every: Option<usize>,
    /// No progress bar or log lines.
    #[arg(long)]
    pub quiet: bool,
    /// Print the one-line JSON summary even on a terminal (it is always the last line of stdout
    /// when stdout is not a terminal; on a terminal a short summary for people replaces it).
    #[arg(long)]
    pub json: bool,
    /// Directory of training checkpoints (default: the --resume directory).
    #[arg(long, value_name = "DIR")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Write a checkpoint every K steps (0: only at the end and when stopped early) [default: 0].
    #[arg(long, value_name = "K")]
    pub checkpoint_every: Option<usize>,
    /// Keep the newest N checkpoints [default: 3].
    #[arg(long, value_name = "N")]
    pub keep_checkpoints: Option<usize>,
    /// Continue from the newest complete checkpoint in DIR.
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// End after step N with a checkpoint (the schedule still spans --steps).
    #[arg(long, value_name = "N")]
    pub stop_after: Option<usize>,
    /// Resume even though this setting differs from the checkpoint's run: seed, seq, batch, data,
    /// steps (to extend a run), schedule (lr, min-lr, warmup, weight decay, grad clip),
    /// optimizer_state_dtype; repeatable.
    /// The placement and worker counts may always change (the checkpoint is resharded).
    #[arg(long, value_name = "SETTING")]
    pub allow_change: Vec<String>,
    /// Aux-loss-free balancing rate of routers with a correction bias (DeepSeek-V3; 0: off)
    /// [default: 0.001].
    #[arg(long, value_name = "RATE")]
    pub bias_update_rate: Option<f64>,
    /// ST-MoE router z-loss coefficient: each MoE layer adds this times mean logsumexp(logits)^2
    /// to the loss, 0..=1 [default: 0, off; ST-MoE uses 1e-3].
    #[arg(long, value_name = "C")]
    pub router_z_loss_coef: Option<f64>,
    /// Round-robin expert assignment (every expert the same number of tokens) instead of the
    /// router's choice, for throughput benchmarks.
    #[arg(long)]
    pub force_balanced_routing: bool,
    /// Capacity factor: each expert takes at most ceil(C x tokens x k / experts) routed copies
    /// of a micro-batch, the rest are dropped (counted in the metrics) [default: dropless].
    #[arg(long, value_name = "C")]
    pub capacity_factor: Option<f64>,
    /// Multi-token prediction modules to train after the main model (DeepSeek-V3's MTP, loaded
    /// from and saved to the checkpoint's layers after the main ones; other families: 0)
    /// [default: 0].
    #[arg(long, value_name = "D")]
    pub mtp_depth: Option<usize>,
    /// Weight of the multi-token prediction loss: the loss adds C / D times the modules' summed
    /// cross-entropies [default: 0.1].
    #[arg(long, value_name = "C")]
    pub mtp_loss_coef: Option<f64>,
    /// The dtype of the matrix products: f32, bf16 or f16 (mixed precision: products in the low
    /// dtype with f32 accumulation; master weights, optimizer moments, gradients, norms, softmax
    /// and the loss in f32; checkpoints f32; f16 with dynamic loss scaling: a step whose gradients
    /// overflow is skipped and the scale halves) [default: f32].
    #[arg(long, value_name = "f32|bf16|f16")]
    pub precision: Option<Precision>,
    /// Activation recomputation: none, experts, attention or full (the chosen blocks, or the
    /// workers' stages, keep only their input in the forward and run it again in the backward:
    /// less memory, one more forward of those blocks) [default: none].
    #[arg(long, value_name = "none|experts|attention|full")]
    pub recompute: Option<Recompute>,
    /// The dtype of the final model's weights in --out's final/: f32, bf16 or f16 (rounded to
    /// nearest even; config.json's torch_dtype says which; training checkpoints stay f32)
    /// [default: f32].
    #[arg(long, value_name = "f32|bf16|f16")]
    pub save_dtype: Option<SaveDtype>,
    /// Non-finite loss or gradient: skip the step, or abort naming the tensor [default: skip].
    #[arg(long, value_enum)]
    pub on_nonfinite: Option<NonFinite>,
    /// Where the model runs: single (one device), disagg (AF-Pipe: attention and expert workers),
    /// ep (every worker holds attention and a shard of the experts) [default: single].
    #[arg(long, value_enum)]
    pub placement: Option<PlacementArg>,
    /// disagg: attention workers in all, a multiple of --groups [default: 2].
    #[arg(long, value_name = "M")]
    pub attn_workers: Option<usize>,
    /// disagg: expert workers in all, a multiple of --groups [default: 2].
    #[arg(long, value_name = "N")]
    pub ffn_workers: Option<usize>,
    /// disagg: groups; group g holds layers g, g+P, ... [default: 2].
    #[arg(long, value_name = "P")]
    pub groups: Option<usize>,
    /// disagg: manual (the counts above) or auto (the planner splits --attn-workers +
    /// --ffn-workers workers into attention, expert workers and groups; measured step times of a
    /// few candidates refine its choice) [default: manual].
    #[arg(long, value_enum)]
    pub allocation: Option<AllocationArg>,
    /// ep: workers [default: 4].
    #[arg(long, value_name = "W")]
    pub workers: Option<usize>,
    /// Micro-batches per step (divides --batch) [default: 1 single, 4 disagg, W ep].
    #[arg(long, value_name = "K")]
    pub micro_batches: Option<usize>,
    /// Micro-batches each embedding worker keeps in flight at most (started, backward not done),
    /// at most those it owns [default: disagg as many as half the available memory holds; ep 1,
    /// no overlap; 2 is ep's ping-pong overlap].
    #[arg(long = "in-flight", alias = "max-in-flight", value_name = "N")]
    pub in_flight: Option<usize>,
    /// disagg: cut each sequence over C attention workers of its group (context parallelism, ring
    /// attention; divides the attention workers per group, --seq a multiple of 2C) [default: 1].
    #[arg(long = "context-parallel", value_name = "C")]
    pub context_parallel: Option<usize>,
    /// CPU threads each worker computes with, in its own pool [default: the cores shared evenly by
    /// the workers of this process, under mpirun by the ranks of this node].
    #[arg(long, value_name = "N")]
    pub threads_per_worker: Option<usize>,
    /// Devices the workers compute on, comma-separated, repeats allowed (cpu, cuda:N, wgpu:N):
    /// local workers take them round-robin, an MPI rank the one of its node-local rank
    /// [default: the backend's device; with CUDA every GPU of the node].
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    pub devices: Vec<String>,
    /// How workers talk: local (threads of this process), mpi (one process per worker under
    /// mpirun; build with --features mpi) or nccl (GPUs; --features nccl) [default: local].
    #[arg(long, value_enum)]
    pub transport: Option<TransportArg>,
    /// Emulate links of X Gbit/s per worker (transfers take that long without using CPU).
    #[arg(long, value_name = "X")]
    pub link_gbps: Option<f64>,
    /// One-way latency of the emulated links, microseconds [default: 0].
    #[arg(long, value_name = "Y")]
    pub link_latency_us: Option<f64>,
    /// Write a Chrome trace (open in Perfetto) of every worker's streams.
    #[arg(long, value_name = "FILE.json")]
    pub trace: Option<PathBuf>,
    /// A worker that hears nothing for this long ends the run with an error [default: 60].
    #[arg(long, value_name = "SECONDS")]
    pub comm_timeout_s: Option<f64>,
    /// What the token exchange's payloads travel in between workers: f32, bf16, or fp8 (the
    /// dispatched activations in float8 e4m3 with one scale per 128 values of a token, the
    /// combine in bf16) [default: the --precision's: f32 under f32, bf16 under bf16 and f16].
    #[arg(long, value_name = "f32|bf16|fp8")]
    pub exchange_dtype: Option<ExchangeDtype>,
    /// The exchange's gradient messages: f32 or bf16 [default: bf16 when --exchange-dtype is
    /// bf16 or fp8, f32 otherwise].
    #[arg(long, value_name = "f32|bf16")]
    pub exchange_grad_dtype: Option<ExchangeDtype>,
    /// Where the exchange's payloads live between workers: auto (left on the device that computed
    /// them on a GPU backend when every worker of the process shares one device under the local
    /// transport, or under nccl; host data otherwise), host (read back and uploaded again), or
    /// device [default: auto].
    #[arg(long, value_name = "auto|host|device")]
    pub exchange_payloads: Option<disagmoe_train::ExchangePayloads>,
    /// Parameters held in copies (an attention group's data-parallel copies, ep's attention) are
    /// updated in shards: gradients reduce-scattered, each copy keeping the optimizer moments of
    /// its shard, the updated weights all-gathered [default: on].
    #[arg(long, value_name = "on|off")]
    pub distributed_optimizer: Option<Switch>,
    /// Redundant replicas of hot experts per MoE layer (disagg, ep): the heaviest experts by
    /// --expert-load get copies on several expert workers, each copy computing an even part of the
    /// expert's tokens of a micro-batch, its gradients summed over the copies [default: 0].
    #[arg(long, value_name = "R")]
    pub redundant_experts: Option<usize>,
    /// How a layer's experts are placed on its expert workers: contiguous (ranges) or balanced
    /// (EPLB: replicas of the heaviest experts, packed to even the workers' loads)
    /// [default: balanced with --redundant-experts, else contiguous].
    #[arg(long, value_name = "contiguous|balanced")]
    pub expert_placement: Option<disagmoe_train::ExpertPlacement>,
    /// The expert load a balanced placement evens: uniform, zipf:S, or an earlier run's
    /// metrics.jsonl [default: uniform].
    #[arg(long, value_name = "uniform|zipf:S|METRICS.jsonl")]
    pub expert_load: Option<String>,
    /// Re-place the experts every N steps from their measured loads (a moving average), moving the
    /// experts that change holder with their optimizer state (needs a balanced placement)
    /// [default: 0, never].
    #[arg(long, value_name = "N")]
    pub rebalance_every: Option<usize>,
}

/// `--placement` values.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum PlacementArg {
    /// The plain model on one device.
    Single,
    /// AF-Pipe: attention and experts on disjoint workers.
    Disagg,
    /// Colocated expert parallelism (the baseline).
    Ep,
}

/// `--allocation` values.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum AllocationArg {
    /// As given.
    Manual,
    /// Planner plus measured refinement.
    Auto,
}

/// `--transport` values.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum TransportArg {
    /// Threads of this process.
    Local,
    /// One process per worker under mpirun.
    Mpi,
    /// NCCL between GPUs, one process per worker under mpirun (build with --features nccl).
    Nccl,
}

/// `--on-nonfinite` values.
#[derive(Debug, Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum NonFinite {
    /// Skip the update, warn and count it.
    Skip,
    /// Stop with an error naming the step and tensor.
    Abort,
}

impl TrainArgs {
    /// The run configuration: defaults, then the TOML file, then the flags (test-only faults come
    /// from the environment, see `disagmoe_train::config::faults`).
    pub fn run_config(&self) -> anyhow::Result<RunConfig> {
        let mut cfg = match &self.run_config {
            Some(path) => RunConfig::from_toml_file(path)?,
            None => RunConfig::default(),
        };
        // `--flag value` -> field, when given.
        macro_rules! set {
            ($($field:ident => $($target:ident).+),* $(,)?) => {
                $( if let Some(v) = &self.$field { cfg.$($target).+ = v.clone().into(); } )*
            };
        }
        set!(steps => steps, seed => seed, log_every => log_every, out => out, tensorboard => tensorboard);
        if self.model_config.is_some() || self.model_dir.is_some() {
            cfg.model.config = self.model_config.clone();
            cfg.model.dir = self.model_dir.clone();
        }
        set!(model_preset => model.preset, bias_update_rate => model.bias_update_rate);
        set!(router_z_loss_coef => model.router_z_loss_coef, capacity_factor => model.capacity_factor);
        set!(mtp_depth => model.mtp_depth, mtp_loss_coef => model.mtp_loss_coef);
        if self.force_balanced_routing {
            cfg.model.force_balanced_routing = true;
        }
        if let Some(values) = &self.data {
            let words: Vec<String> = values.iter().map(|p| p.to_string_lossy().into_owned()).collect();
            if disagmoe_train::data::blend::is_blend(&words) {
                cfg.data.blend = disagmoe_train::data::blend::parse_blend(&words)?;
                cfg.data.path = None;
            } else {
                cfg.data.path = values.first().cloned();
                cfg.data.blend.clear();
            }
        }
        set!(tokenizer => data.tokenizer, batch => data.batch, seq => data.seq);
        if !self.phases.is_empty() {
            cfg.phases =
                self.phases.iter().map(|p| disagmoe_train::config::RunPhase::parse(p)).collect::<Result<_, _>>()?;
            if self.steps.is_none() {
                cfg.steps_from_phases();
            }
        }
        set!(eval_fraction => data.eval_fraction, eval_every => data.eval_every, eval_batches => data.eval_batches);
        set!(document_mask => data.document_mask, document_positions => data.document_positions);
        set!(
            lr => optimizer.lr, min_lr => optimizer.min_lr, warmup_steps => optimizer.warmup_steps,
            weight_decay => optimizer.weight_decay, grad_clip => optimizer.grad_clip,
        );
        set!(
            checkpoint_dir => checkpoint.dir, checkpoint_every => checkpoint.every,
            keep_checkpoints => checkpoint.keep, resume => checkpoint.resume, stop_after => checkpoint.stop_after,
        );
        set!(
            attn_workers => parallel.attn_workers, ffn_workers => parallel.ffn_workers, groups => parallel.groups,
            workers => parallel.workers, micro_batches => parallel.micro_batches, in_flight => parallel.in_flight,
            context_parallel => parallel.context_parallel,
            threads_per_worker => parallel.threads_per_worker,
            link_gbps => parallel.link_gbps, link_latency_us => parallel.link_latency_us, trace => parallel.trace,
            comm_timeout_s => parallel.comm_timeout_s,
        );
        if let Some(d) = self.exchange_dtype {
            cfg.parallel.exchange_dtype = Some(d);
        }
        if let Some(d) = self.exchange_grad_dtype {
            cfg.parallel.exchange_grad_dtype = Some(d);
        }
        if let Some(p) = self.exchange_payloads {
            cfg.parallel.exchange_payloads = p;
        }
        if let Some(d) = self.optimizer_state_dtype {
            cfg.optimizer.state_dtype = d;
        }
        if let Some(r) = self.redundant_experts {
            cfg.parallel.redundant_experts = r;
        }
        if let Some(p) = self.expert_placement {
            cfg.parallel.expert_placement = Some(p);
        }
        if let Some(l) = &self.expert_load {
            cfg.parallel.expert_load = Some(l.clone());
        }
        if let Some(n) = self.rebalance_every {
            cfg.parallel.rebalance_every = n;
        }
        if let Some(d) = self.distributed_optimizer {
            cfg.parallel.distributed_optimizer = d == Switch::On;
        }
        if !self.devices.is_empty() {
            cfg.parallel.devices = self.devices.clone();
        }
        if !self.allow_change.is_empty() {
            cfg.checkpoint.allow_change = self.allow_change.clone();
        }
        if let Some(a) = self.aux_loss {
            cfg.model.aux_loss = Some(a == Switch::On);
        }
        if self.quiet {
            cfg.progress = false;
        }
        if let Some(p) = self.precision {
            cfg.precision.compute = p;
        }
        if let Some(d) = self.save_dtype {
            cfg.save_dtype = d;
        }
        if let Some(r) = self.recompute {
            cfg.memory.recompute = r;
        }
        if let Some(p) = self.on_nonfinite {
            cfg.precision.on_nonfinite = match p {
                NonFinite::Skip => NonFinitePolicy::Skip,
                NonFinite::Abort => NonFinitePolicy::Abort,
            };
        }
        if let Some(p) = self.placement {
            cfg.parallel.placement = match p {
                PlacementArg::Single => Placement::Single,
                PlacementArg::Disagg => Placement::Disagg,
                PlacementArg::Ep => Placement::Ep,
            };
        }
        if let Some(a) = self.allocation {
            cfg.parallel.allocation = match a {
                AllocationArg::Manual => AllocationMode::Manual,
                AllocationArg::Auto => AllocationMode::Auto,
            };
        }
        if let Some(t) = self.transport {
            cfg.parallel.transport = match t {
                TransportArg::Local => TransportKind::Local,
                TransportArg::Mpi => TransportKind::Mpi,
                TransportArg::Nccl => TransportKind::Nccl,
            };
        }
        if !cfg.phases.is_empty() && self.seq.is_some() {
            anyhow::bail!(disagmoe_train::TrainError::option(
                "seq",
                "a run in phases takes each phase's sequence length from its phases (--phases SEQxSTEPS[xBATCH], or \
                 [[phases]] in the run config); leave --seq out"
            ));
        }
        cfg.faults = FaultPlan::from_env()?;
        cfg.validate()?;
        Ok(cfg)
    }
}

/// Signals that ask a run to stop after the current step: SIGINT and SIGTERM, and SIGUSR1/SIGUSR2,
/// which Open MPI's `mpirun` forwards to every rank without ending the job (it answers SIGTERM by
/// killing the ranks a moment later, too soon for a large checkpoint).
const STOP_SIGNALS: [i32; 4] = [SIGINT, SIGTERM, SIGUSR1, SIGUSR2];

/// Runs `train` on the compiled-in backend and prints the summary as one JSON line on stdout.
/// A stop signal finishes the current step, writes a checkpoint (when a checkpoint directory is
/// set) and ends the run normally.
pub fn run_train(args: &TrainArgs) -> anyhow::Result<TrainSummary> {
    let cfg = args.run_config()?;
    let devices = disagmoe_train::backend::run_devices(&cfg.parallel.devices)?;
    // A second signal while the step finishes exits at once (status 130). In a distributed run
    // every worker learns of a stop request at the end of the step (it is part of the step's
    // global sum), so all of them checkpoint after the same step.
    let stop = Arc::new(AtomicBool::new(false));
    for signal in STOP_SIGNALS {
        // The exit is registered first so that it sees the flag as it was before this signal.
        signal_hook::flag::register_conditional_shutdown(signal, 130, Arc::clone(&stop))
            .and_then(|_| signal_hook::flag::register(signal, Arc::clone(&stop)))
            .map_err(|e| anyhow::anyhow!("cannot install the handler of signal {signal}: {e}"))?;
    }
    // `allocation = auto` is resolved by the library (`disagmoe_train::allocate`).
    let summary = disagmoe_train::train_on::<TrainBackend>(&cfg, &devices, &stop)?;
    // Under mpirun every rank knows the summary; one prints it: JSON for scripts (stdout is not a
    // terminal, or --json), a few lines for people otherwise (and on a terminal's stderr). Under
    // MPI always JSON: mpirun gives its ranks a pseudo-terminal even when its own output is a pipe.
    if disagmoe_train::is_primary(&cfg) {
        use std::io::IsTerminal;
        let own_terminal = std::io::stdout().is_terminal() && cfg.parallel.transport == TransportKind::Local;
        let json = args.json || !own_terminal;
        if json {
            println!("{}", serde_json::to_string(&summary)?);
        }
        let people = summary.for_people(cfg.out.as_deref());
        if !json {
            println!("{people}");
        } else if !args.quiet && std::io::stderr().is_terminal() {
            eprintln!("{people}");
        }
    }
    Ok(summary)
}

/// `disagmoe compare`: the same training job under `ep`, `ep` with overlap and `disagg`, side by
/// side.
#[derive(Debug, Clone, Args)]
pub struct CompareArgs {
    /// Every `disagmoe train` option; --placement and --in-flight are set per run (ep 1, ep-overlap
    /// 2, disagg as given or its default). The ep runs get as many workers as the disagg run
    /// (--attn-workers + --ffn-workers) unless --workers says otherwise.
    #[command(flatten)]
    pub train: TrainArgs,
    /// Also predict every run with the simulator (`disagmoe-core`), from a calibration run per
    /// placement: the same configuration traced without link emulation (ep's serves ep-overlap).
    #[arg(long)]
    pub predict: bool,
    /// Steps of each calibration run (the first is left out of its medians).
    #[arg(long, default_value_t = 4, value_name = "N", requires = "predict")]
    pub calibration_steps: usize,
    /// Also run ep and disagg with the balanced expert placement the options give
    /// (--redundant-experts, --expert-placement balanced, --expert-load, --rebalance-every), rows
    /// `ep-balanced` and `disagg-balanced`; the other rows then place the experts in contiguous
    /// ranges: the step with and without balancing, under the same routing.
    #[arg(long)]
    pub balancing: bool,
}

/// One run of a comparison, as `compare` prints it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CompareRow {
    /// `ep`, `ep-overlap` or `disagg`.
    pub placement: String,
    /// Micro-batches each embedding worker kept in flight.
    pub in_flight: usize,
    /// Workers, and CPU threads each computed with.
    pub workers: usize,
    pub threads_per_worker: usize,
    /// Mean step wall time after the first step (its warm-up left out when there are two or
    /// more), seconds.
    pub step_s: f64,
    /// The simulator's prediction for this run (`--predict`): step time, exposed communication
    /// (waits while the awaited data was queued for or on the wire: what `in_flight_wait_s`
    /// measures; `exposed_comm_s` also counts waiting for a peer still computing) and compute.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicted_step_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicted_exposed_comm_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicted_compute_s: Option<f64>,
    /// Per step, summed over workers: waits for data, the part with the data on the wire,
    /// compute, and emulated-link time, seconds.
    pub exposed_comm_s: f64,
    pub in_flight_wait_s: f64,
    pub compute_s: f64,
    pub link_s: f64,
    /// The run's mean `worker_imbalance` (busiest expert worker over the mean, per micro-batch).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker_imbalance: Option<f64>,
    /// Mean seconds per re-placement of the experts (placing and moving), when the run made any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rebalance_s: Option<f64>,
    /// Bytes each worker sent per step (token exchange and gradient all-reduce).
    pub bytes_sent_per_worker: f64,
    /// Of them, the token exchange's, as packed in `exchange_dtype`.
    pub exchange_bytes_per_worker: f64,
    /// What the exchange's payloads travelled in.
    pub exchange_dtype: Option<String>,
    pub tokens_per_s: f64,
    /// The run's whole summary.
    pub summary: TrainSummary,
}

/// Runs `ep` (one micro-batch in flight: no overlap), `ep-overlap` (two: one micro-batch's
/// all-to-all overlaps another's compute) and `disagg` with the same model, data, batch,
/// micro-batches, links and threads per worker; prints a table on stderr and `{"runs": [...]}` as
/// one JSON line on stdout.
pub fn run_compare(args: &CompareArgs) -> anyhow::Result<serde_json::Value> {
    if args.predict && args.calibration_steps < 2 {
        let why = format!("must be at least 2 (the first step is left out), got {}", args.calibration_steps);
        return Err(disagmoe_train::TrainError::option("calibration_steps", why).into());
    }
    let mut train = args.train.clone();
    train.placement = Some(PlacementArg::Disagg);
    let given = train.run_config()?;
    if !given.phases.is_empty() {
        bail!("compare times each placement on one step shape; train a run in phases with `disagmoe train --phases`");
    }
    let balanced = given.parallel.expert_placement() == disagmoe_train::ExpertPlacement::Balanced;
    if args.balancing && !balanced {
        bail!(
            "--balancing compares a balanced expert placement with contiguous ranges: give it one (--redundant-experts R, \
             --expert-placement balanced, and optionally --expert-load and --rebalance-every)"
        );
    }
    // With --balancing the plain rows place the experts in contiguous ranges.
    let mut base = given.clone();
    if args.balancing {
        let p = &mut base.parallel;
        (p.redundant_experts, p.expert_placement, p.expert_load, p.rebalance_every) = (0, None, None, 0);
    }
    let device = Default::default();
    let mut disagg = base.clone();
    disagg.parallel.placement = Placement::Disagg;
    let mut ep = base.clone();
    ep.parallel.placement = Placement::Ep;
    if args.train.workers.is_none() {
        ep.parallel.workers = disagg.parallel.attn_workers + disagg.parallel.ffn_workers;
    }
    // Same micro-batches for all, whatever each placement's default.
    let mbs = base.parallel.micro_batches.unwrap_or(ep.parallel.workers * 4);
    ep.parallel.micro_batches = Some(mbs);
    disagg.parallel.micro_batches = Some(mbs);
    // Same threads per worker for all: the disagg run's workers share the cores as the ep run's.
    let threads = disagg.parallel.threads_per_worker();
    ep.parallel.threads_per_worker = Some(threads);
    disagg.parallel.threads_per_worker = Some(threads);
    ep.parallel.in_flight = Some(1);
    let mut overlap = ep.clone();
    overlap.parallel.in_flight = Some(2);
    if ep.parallel.trace.is_some() || ep.out.is_some() {
        bail!("--trace and --out are not available with compare (every run would write them); use disagmoe train per placement");
    }
    if ep.parallel.transport != TransportKind::Local {
        bail!("compare runs every placement in this process and needs --transport local (MPI starts once per process)");
    }
    let mut runs = vec![("ep", ep), ("ep-overlap", overlap), ("disagg", disagg)];
    if args.balancing {
        let with_balancing = |cfg: &RunConfig| {
            let mut cfg = cfg.clone();
            cfg.parallel.redundant_experts = given.parallel.redundant_experts;
            cfg.parallel.expert_placement = given.parallel.expert_placement;
            cfg.parallel.expert_load = given.parallel.expert_load.clone();
            cfg.parallel.rebalance_every = given.parallel.rebalance_every;
            cfg
        };
        runs.push(("ep-balanced", with_balancing(&runs[0].1)));
        runs.push(("disagg-balanced", with_balancing(&runs[2].1)));
    }
    for (name, cfg) in &runs {
        cfg.validate().with_context(|| format!("the {name} run"))?;
    }
    // Calibrations first: one per run, except that ep's (at one micro-batch in flight) also
    // serves ep-overlap.
    let calibration_of = |i: usize| if i == 1 { 0 } else { i };
    let calibrated = if args.predict {
        let steps = args.calibration_steps;
        let mut all = Vec::new();
        for (i, (name, cfg)) in runs.iter().enumerate() {
            let c = (calibration_of(i) == i)
                .then(|| {
                    disagmoe_train::launch::calibrate::<TrainBackend>(cfg, &device, steps)
                        .with_context(|| format!("the calibration run of {name}"))
                })
                .transpose()?;
            all.push(c);
        }
        Some(all)
    } else {
        None
    };
    let mut rows = Vec::new();
    for (i, (name, cfg)) in runs.iter().enumerate() {
        let s = disagmoe_train::train::<TrainBackend>(cfg, &device).with_context(|| format!("the {name} run"))?;
        let in_flight = s.in_flight.unwrap_or(1);
        let predicted = match &calibrated {
            Some(c) => {
                let c = c[calibration_of(i)].as_ref().expect("calibrated");
                let link = runtime::link_model(cfg);
                Some(runtime::predict::predict(&c.layout, &c.calibration, in_flight, link.map(Into::into))?)
            }
            None => None,
        };
        // The steady step: the first step's warm-up left out.
        let steady =
            if s.steps >= 2 { (s.step_s * s.steps as f64 - s.first_step_s) / (s.steps - 1) as f64 } else { s.step_s };
        rows.push(CompareRow {
            placement: name.to_string(),
            in_flight,
            workers: s.workers,
            threads_per_worker: s.threads_per_worker,
            step_s: steady,
            predicted_step_s: predicted.map(|p| p.step_s),
            predicted_exposed_comm_s: predicted.map(|p| p.exposed_comm_s),
            predicted_compute_s: predicted.map(|p| p.compute_s),
            exposed_comm_s: s.exposed_comm_s,
            in_flight_wait_s: s.in_flight_wait_s,
            compute_s: s.compute_s,
            link_s: s.link_s,
            worker_imbalance: s.worker_imbalance,
            rebalance_s: s.rebalances.as_ref().map(|r| r.placement_s + r.move_s),
            bytes_sent_per_worker: s.bytes_sent_per_worker,
            exchange_bytes_per_worker: s.exchange_bytes_per_worker,
            exchange_dtype: s.exchange_dtype.clone(),
            tokens_per_s: s.tokens_per_s,
            summary: s,
        });
    }
    if let Some(dtype) = rows.first().and_then(|r| r.exchange_dtype.as_deref()) {
        eprintln!("exchange payloads: {dtype}");
    }
    eprintln!(
        "{:<16} {:>9} {:>8} {:>8} {:>9} {:>14} {:>16} {:>10} {:>9} {:>13} {:>13} {:>10}",
        "",
        "in-flight",
        "workers",
        "threads",
        "step_s",
        "exposed_comm_s",
        "in_flight_wait_s",
        "compute_s",
        "link_s",
        "MB sent/wkr",
        "exchange MB",
        "tokens/s"
    );
    for r in &rows {
        eprintln!(
            "{:<16} {:>9} {:>8} {:>8} {:>9.3} {:>14.3} {:>16.3} {:>10.3} {:>9.3} {:>13.2} {:>13.2} {:>10.0}",
            r.placement,
            r.in_flight,
            r.workers,
            r.threads_per_worker,
            r.step_s,
            r.exposed_comm_s,
            r.in_flight_wait_s,
            r.compute_s,
            r.link_s,
            r.bytes_sent_per_worker / 1e6,
            r.exchange_bytes_per_worker / 1e6,
            r.tokens_per_s
        );
        if let (Some(step), Some(exposed), Some(compute)) =
            (r.predicted_step_s, r.predicted_exposed_comm_s, r.predicted_compute_s)
        {
            eprintln!(
                "{:<16} {:>9} {:>8} {:>8} {:>9.3} {:>14} {:>16.3} {:>10.3}   (step {:+.0}%)",
                "  predicted",
                "",
                "",
                "",
                step,
                "",
                exposed,
                compute,
                100.0 * (step - r.step_s) / r.step_s
            );
        }
    }
    if args.balancing {
        // The balance each run had, and what its re-placements cost.
        for r in &rows {
            let imbalance = r.worker_imbalance.map_or("-".into(), |x| format!("{x:.3}"));
            let rebalance = r.rebalance_s.map_or(String::new(), |x| format!(", {:.1} ms per re-placement", x * 1e3));
            eprintln!("{:<16} busiest expert worker / mean {imbalance}{rebalance}", r.placement);
        }
    }
    let mut out = serde_json::json!({ "runs": rows });
    if let Some(c) = &calibrated {
        // What each prediction rests on: the calibration run's steady step and the part of it the
        // schedule does not hold.
        out["calibrations"] = serde_json::json!(runs
            .iter()
            .zip(c)
            .filter_map(|((name, _), c)| c.as_ref().map(|c| (name, c)))
            .map(|(name, c)| serde_json::json!({
                "placement": name,
                "in_flight": c.in_flight,
                "steps": c.calibration.steps,
                "step_s": c.calibration.step_s,
                "overhead_s": c.calibration.overhead_s,
            }))
            .collect::<Vec<_>>());
    }
    println!("{out}");
    Ok(out)
}

/// `disagmoe forward`.
#[derive(Debug, Clone, Args)]
pub struct ForwardArgs {
    /// Checkpoint directory (config.json + model.safetensors or a sharded index).
    #[arg(long, value_name = "DIR")]
    pub model_dir: PathBuf,
    /// JSON list of equal-length lists of token ids.
    #[arg(long, value_name = "IDS.json")]
    pub input_ids: PathBuf,
    /// Where to write tensor `logits` (f32, [batch, seq, vocab]).
    #[arg(long, value_name = "LOGITS.safetensors")]
    pub out: PathBuf,
}

fn read_ids(path: &Path) -> anyhow::Result<Vec<Vec<i64>>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read input ids {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| {
        format!("{}: expected a JSON list of equal-length lists of integer token ids, e.g. [[1, 2, 3]]", path.display())
    })
}

/// Runs the model on the ids, writes the logits, and prints `{"loss": ...}` (mean next-token
/// cross-entropy) as the last line.
pub fn run_forward(args: &ForwardArgs) -> anyhow::Result<f64> {
    let device = Default::default();
    disagmoe_train::backend::probe::<DefaultBackend>(&device)?;
    let rows = read_ids(&args.input_ids)?;
    let model = MoeCausalLm::<DefaultBackend>::from_pretrained(&args.model_dir, &device)?;
    let ids = model.input_ids(&rows, &device).with_context(|| args.input_ids.display().to_string())?;
    let [_, s] = ids.dims();
    if s < 2 {
        bail!("{}: sequences need at least 2 tokens for a next-token loss, got {s}", args.input_ids.display());
    }
    let out = model.forward(ids.clone());
    let loss = disagmoe_models::causal_lm::next_token_cross_entropy(out.logits.clone(), ids, None).into_scalar() as f64;
    let mut sink = TensorSink::new();
    sink.put("logits".into(), out.logits);
    let (shape, values) = sink.get("logits").map(|(s, v)| (s.to_vec(), v.to_vec())).expect("just put");
    let bytes: Vec<u8> = values.iter().flat_map(|x| x.to_le_bytes()).collect();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape, &bytes)?;
    if let Some(dir) = args.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    write_atomically(&args.out, |tmp| {
        safetensors::serialize_to_file([("logits", view)], None, tmp).map_err(|e| std::io::Error::other(e.to_string()))
    })?;
    println!("{}", serde_json::json!({ "loss": loss }));
    Ok(loss)
}

/// Sets up logging to stderr: warnings, plus progress information unless `quiet` (`RUST_LOG`
/// overrides both).
pub fn init_logging(quiet: bool) {
    // CubeCL's device channel warns "Task failed: Any" when its device runtime cannot start (no
    // driver): the probe before a run says what failed in one line, so that warning is left out
    // (RUST_LOG brings it back).
    let default = if quiet {
        "warn,cubecl_common::device::handle::channel=error"
    } else {
        "warn,cubecl_common::device::handle::channel=error,disagmoe=info,disagmoe_train=info"
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .try_init();
}

/// Prints an error chain the way a user wants to read it and returns the exit code.
pub fn report(err: &anyhow::Error) -> i32 {
    // The chain, without causes whose text the message already carries.
    let mut msg = err.to_string();
    for cause in err.chain().skip(1) {
        let c = cause.to_string();
        if !msg.contains(&c) {
            msg.push_str(": ");
            msg.push_str(&c);
        }
    }
    eprintln!("error: {msg}");
    2
}

/// The whole `main` of a `train_*` example: parse the `disagmoe train` options under the example's
/// name, train `preset` unless they name a model, and exit 2 with a clear message on failure.
pub fn example_main(name: &'static str, about: &'static str, preset: &str) {
    use clap::FromArgMatches;
    let matches = TrainArgs::augment_args(clap::Command::new(name)).about(about).get_matches();
    let args = TrainArgs::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    init_logging(args.quiet);
    if let Err(e) = run_example(args, preset) {
        std::process::exit(report(&e));
    }
}

/// What the `train_*` examples do: train `preset` unless the arguments name a model, and end as
/// `disagmoe train` does (the JSON summary as the last line of stdout for scripts, a short summary
/// for people on a terminal).
pub fn run_example(mut args: TrainArgs, preset: &str) -> anyhow::Result<TrainSummary> {
    if args.model_config.is_none() && args.model_dir.is_none() && args.model_preset.is_none() {
        args.model_preset = Some(preset.to_owned());
    }
    run_train(&args)
}
