//! The AF-Pipe runtime: disaggregated training on attention and expert workers, and the colocated
//! expert-parallel baseline, over a transport.
//!
//! [`train_distributed`] takes the model apart ([`disagmoe_models::stages`]), deals the pieces to
//! workers by [`layout::Layout`], and runs every worker's message loop ([`worker::Worker`]): as
//! threads of this process (`local`), or one process per worker under `mpirun` (`mpi`, feature
//! `mpi`). Every worker sees the same step outcome after the step's global reduction, so the
//! summary is the same whoever prints it.

pub mod layout;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod trace;
pub mod transport;
pub mod worker;

use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

use burn::module::{AutodiffModule, Module, ModuleDisplay};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
use serde::{Deserialize, Serialize};

use disagmoe_models::decoder::AttentionLayer;
use disagmoe_models::stages::{AttentionStage, Ends, ExpertStage, SplitFeedForward, Stages};
use disagmoe_models::MoeCausalLm;

use self::layout::{Layout, Placement};
use self::transport::{local_endpoints, Endpoint, LinkModel, Port};
use self::worker::{Fork, StepOutcome, StepSettings, Worker, WorkerPart};
use crate::error::{Result, TrainError};
use crate::metrics::JsonlWriter;
use crate::optim::{AdamW, AdamWSettings};
use crate::trainer::{build_data, build_model, RunConfig, TrainSummary};
use disagmoe_models::{HfCheckpoint, TensorSink};

/// How workers talk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum TransportKind {
    /// Threads of one process, channels between them.
    #[default]
    Local,
    /// One process per worker under `mpirun` (feature `mpi`).
    Mpi,
    /// GPU to GPU through NCCL, one process per worker under `mpirun` (feature `nccl`).
    Nccl,
}

/// Testing only: one worker fails at one step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerFault {
    /// The worker's rank.
    pub worker: usize,
    /// Step (1-based).
    pub step: usize,
    /// Tasks it completes in that step before failing.
    #[serde(default)]
    pub after_tasks: usize,
    /// Die without a word: the process exits at once (MPI), or the thread ends without telling the
    /// others (local), who then notice by their time-out.
    #[serde(default)]
    pub exit: bool,
}

/// The resolved layout of a run config (`disagg` or `ep`).
pub fn layout_of(cfg: &RunConfig, layers: usize, experts: usize) -> Result<Layout> {
    let k = cfg.effective_micro_batches();
    match cfg.placement {
        Placement::Disagg => Layout::disagg(layers, experts, k, cfg.attn_workers, cfg.ffn_workers, cfg.groups),
        Placement::Ep => Layout::ep(layers, experts, k, cfg.workers),
        Placement::Single => Err(TrainError::option("placement", "the runtime runs `disagg` or `ep`")),
    }
}

/// The part of the model `rank` holds.
pub(crate) fn part_for<B, F, A>(
    stages: &Stages<B, A, F>,
    layout: &Layout,
    rank: usize,
    device: &B::Device,
) -> Result<WorkerPart<B, A, F::Router, F::Experts>>
where
    B: AutodiffBackend,
    A: Module<B> + ModuleDisplay + AttentionLayer<B>,
    F: SplitFeedForward<B>,
    WorkerPart<B, A, F::Router, F::Experts>: AutodiffModule<B>,
{
    let ends = layout.holds_ends(rank).then(|| stages.ends.clone());
    let attention = layout.attn_layers(rank).into_iter().map(|l| stages.attention[l].clone()).collect();
    let mut experts = Vec::new();
    for (l, i) in layout.ffn_layers(rank) {
        experts.push(stages.experts[l].clone().shard(layout.expert_range(i), i == 0)?);
    }
    Ok(WorkerPart { ends, attention, experts }.map(&mut Fork { device }))
}

/// What a worker reports at the end: the global outcome of each step (the same on every worker),
/// its own step times, and on rank 0 everyone's trace events.
pub(crate) struct RankZero {
    outcomes: Vec<StepOutcome>,
    step_s: Vec<f64>,
    checksum: f64,
    traces: Vec<trace::TraceEvent>,
    names: Vec<String>,
    /// On rank 0 with `out`: every parameter by checkpoint name.
    weights: Vec<transport::NamedTensor>,
    rank: usize,
}

/// Everything a worker needs besides its endpoint.
pub(crate) struct Shared<B: AutodiffBackend> {
    cfg: RunConfig,
    layout: Layout,
    settings: StepSettings,
    rope: (Tensor<B, 4>, Tensor<B, 4>),
    vocab: usize,
    /// Checkpoint name of every parameter of the whole model.
    param_names: std::collections::HashMap<burn::module::ParamId, String>,
}

fn step_settings(cfg: &RunConfig, with_aux: bool, aux_coef: f64, rank: usize) -> StepSettings {
    StepSettings {
        mb_rows: cfg.batch / cfg.effective_micro_batches(),
        seq: cfg.seq,
        with_aux,
        aux_coef,
        grad_clip: cfg.grad_clip,
        bias_update_rate: cfg.bias_update_rate,
        abort_on_nonfinite: cfg.on_nonfinite == crate::trainer::NonFinitePolicy::Abort,
        timeout: Duration::from_secs_f64(cfg.comm_timeout_s),
        fail_at: cfg.fail_worker.as_ref().filter(|f| f.worker == rank).map(|f| (f.step, f.after_tasks, f.exit)),
        own_process: cfg.transport != TransportKind::Local,
        in_flight: cfg.in_flight.unwrap_or(usize::MAX),
    }
}

/// One worker's whole run.
pub(crate) fn worker_main<B, A, R, X>(
    shared: &Shared<B>,
    port: Port,
    part: WorkerPart<B, A, R, X>,
    device: B::Device,
) -> Result<RankZero>
where
    B: AutodiffBackend,
    A: Module<B> + ModuleDisplay + AttentionLayer<B>,
    R: Module<B> + ModuleDisplay + disagmoe_models::Router<B>,
    X: Module<B> + ModuleDisplay + disagmoe_models::Experts<B>,
    WorkerPart<B, A, R, X>: AutodiffModule<B>,
    ExpertStage<B, X>: AutodiffModule<B>,
    AttentionStage<B, A, R>: AutodiffModule<B>,
    Ends<B>: AutodiffModule<B>,
{
    let cfg = &shared.cfg;
    let rank = port.rank();
    let mut settings = shared.settings.clone();
    settings.fail_at = cfg.fail_worker.as_ref().filter(|f| f.worker == rank).map(|f| (f.step, f.after_tasks, f.exit));
    let opt = AdamW::<B>::new(AdamWSettings {
        beta1: cfg.beta1,
        beta2: cfg.beta2,
        eps: cfg.eps,
        weight_decay: cfg.weight_decay,
    });
    let mut worker =
        Worker::new(shared.layout.clone(), settings, port, part, shared.rope.clone(), device, cfg.trace.is_some(), opt);
    let schedule = cfg.schedule();
    let body = |worker: &mut Worker<B, A, R, X>| -> Result<RankZero> {
        // Inside the guarded part, so that a failure here also tells the other workers.
        let mut data = if shared.layout.holds_ends(rank) { Some(build_data(cfg, shared.vocab)?) } else { None };
        let mut metrics = match (&cfg.out, rank) {
            (Some(dir), 0) => Some(JsonlWriter::append(&dir.join("metrics.jsonl"))?),
            _ => None,
        };
        let mut outcomes = Vec::new();
        let mut step_s = Vec::new();
        for step in 1..=cfg.steps {
            let t0 = Instant::now();
            let batch = data.as_mut().map(|d| d.next_batch(cfg.batch)).unwrap_or_default();
            let out = worker.run_step(step, &batch, schedule.at(step))?;
            step_s.push(t0.elapsed().as_secs_f64());
            if let Some(w) = &mut metrics {
                let tokens = cfg.batch * cfg.seq;
                w.write(&serde_json::json!({
                    "step": step, "loss": out.loss, "lm_loss": out.lm_loss, "aux_loss": out.aux_loss,
                    "lr": schedule.at(step), "grad_norm": out.grad_norm, "skipped": out.skipped, "tokens": tokens,
                    "step_s": step_s[step - 1], "tokens_per_s": tokens as f64 / step_s[step - 1],
                    "exposed_comm_s": out.exposed_comm_s, "in_flight_wait_s": out.in_flight_wait_s,
                    "compute_s": out.compute_s, "link_s": out.link_s,
                }))?;
            }
            if rank == 0 && cfg.progress && (step % cfg.log_every == 0 || step == 1 || step == cfg.steps) {
                eprintln!(
                    "step {step:>5}/{} loss {:.4} lm {:.4} grad_norm {:.3} step {:.3}s exposed comm {:.3}s (on the wire {:.3}s)",
                    cfg.steps, out.loss, out.lm_loss, out.grad_norm, step_s[step - 1], out.exposed_comm_s, out.in_flight_wait_s
                );
            }
            outcomes.push(out);
        }
        let checksum = worker.param_checksum()?;
        let weights = if cfg.out.is_some() { worker.gather_weights(&shared.param_names)? } else { Vec::new() };
        let traces = if cfg.trace.is_some() { worker.gather_traces()? } else { Vec::new() };
        Ok(RankZero {
            outcomes,
            step_s,
            checksum,
            traces,
            names: (0..shared.layout.workers).map(|w| shared.layout.worker_name(w)).collect(),
            weights,
            rank,
        })
    };
    let result = std::panic::catch_unwind(AssertUnwindSafe(|| body(&mut worker))).unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "unknown panic".into());
        Err(TrainError::Worker { worker: rank, cause: format!("panicked: {what}") })
    });
    if let Err(e) = &result {
        // Tell the others, unless this worker is stopping because another one failed (or plays
        // dead for a test).
        let silent = cfg.fail_worker.as_ref().is_some_and(|f| f.worker == rank && f.exit);
        if !silent && !matches!(e, TrainError::Worker { worker, .. } if *worker != rank) {
            let cause = match e {
                TrainError::Worker { cause, .. } => cause.clone(),
                other => other.to_string(),
            };
            worker.abort(&cause);
        }
    }
    result
}

/// Runs every worker as a thread of this process and returns rank 0's report.
fn run_local<B, A, F>(shared: Shared<B>, stages: Stages<B, A, F>, device: &B::Device) -> Result<RankZero>
where
    B: AutodiffBackend,
    A: Module<B> + ModuleDisplay + AttentionLayer<B> + Send + 'static,
    F: SplitFeedForward<B>,
    WorkerPart<B, A, F::Router, F::Experts>: AutodiffModule<B> + Send + 'static,
    ExpertStage<B, F::Experts>: AutodiffModule<B>,
    AttentionStage<B, A, F::Router>: AutodiffModule<B>,
    Ends<B>: AutodiffModule<B>,
{
    let link = link_model(&shared.cfg);
    let mut parts = Vec::new();
    for rank in 0..shared.layout.workers {
        parts.push(part_for(&stages, &shared.layout, rank, device)?);
    }
    drop(stages);
    let shared = &shared;
    let results: Vec<Result<RankZero>> = std::thread::scope(|scope| {
        let handles: Vec<_> = local_endpoints(shared.layout.workers)
            .into_iter()
            .zip(parts)
            .map(|(endpoint, part)| {
                let device = device.clone();
                std::thread::Builder::new()
                    .name(format!("worker-{}", endpoint.rank()))
                    .stack_size(64 << 20)
                    .spawn_scoped(scope, move || {
                        let port = Port::new(Box::new(endpoint) as Box<dyn Endpoint>, link);
                        worker_main(shared, port, part, device)
                    })
                    .expect("spawn a worker thread")
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("worker threads catch their panics")).collect()
    });
    // The cause of a failed run: a worker's own failure first, then any other error, then the
    // time-outs of workers left waiting, then errors that only relay another worker's failure.
    let rank_of = |rank: usize, e: &TrainError| match e {
        TrainError::Worker { worker, .. } if *worker != rank => 3,
        TrainError::Worker { .. } => 0,
        TrainError::Stalled { .. } => 2,
        _ => 1,
    };
    let mut root: Option<(usize, TrainError)> = None;
    let mut zero = None;
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(z) if rank == 0 => zero = Some(z),
            Ok(_) => {}
            Err(e) => {
                let p = rank_of(rank, &e);
                if root.as_ref().is_none_or(|(q, _)| p < *q) {
                    root = Some((p, e));
                }
            }
        }
    }
    let root = root.map(|(_, e)| e);
    match root {
        Some(e) => Err(e),
        None => Ok(zero.expect("rank 0 reports")),
    }
}

/// Whether this process prints the run's summary: always, except on MPI ranks other than 0.
pub fn is_primary(cfg: &RunConfig) -> bool {
    match cfg.transport {
        #[cfg(feature = "mpi")]
        TransportKind::Mpi if cfg.placement != Placement::Single => mpi::world_rank() == 0,
        #[cfg(feature = "nccl")]
        TransportKind::Nccl if cfg.placement != Placement::Single => mpi::world_rank() == 0,
        _ => true,
    }
}

pub(crate) fn link_model(cfg: &RunConfig) -> Option<LinkModel> {
    cfg.link_gbps.map(|gbps| LinkModel { gbps, latency_us: cfg.link_latency_us })
}

/// Checks the options a distributed run cannot honour yet.
fn check_distributed(cfg: &RunConfig) -> Result<()> {
    let unsupported = [
        ("checkpoint_dir", cfg.checkpoint_dir.is_some()),
        ("resume", cfg.resume.is_some()),
        ("stop_after", cfg.stop_after.is_some()),
        ("inject_nonfinite", cfg.inject_nonfinite.is_some()),
    ];
    if let Some((field, _)) = unsupported.iter().find(|(_, set)| *set) {
        return Err(TrainError::option(
            *field,
            format!("is only supported with placement single for now, got placement {}", cfg.placement.name()),
        ));
    }
    #[cfg(not(feature = "nccl"))]
    if cfg.transport == TransportKind::Nccl {
        return Err(TrainError::option(
            "transport",
            "nccl needs a build with the `nccl` feature (cargo build --features nccl, on a machine with CUDA); allowed here: local, mpi (feature mpi)",
        ));
    }
    Ok(())
}

/// Trains with placement `disagg` or `ep` and returns the summary (the same on every rank).
pub fn train_distributed<B: AutodiffBackend>(cfg: &RunConfig, device: &B::Device) -> Result<TrainSummary> {
    cfg.validate()?;
    check_distributed(cfg)?;
    let model = build_model::<B>(cfg, device)?;
    let params = model.num_params();
    let mconf = model.config();
    let with_aux = cfg.aux_loss.unwrap_or(mconf.output_router_logits()) && !mconf.sparse_layers().is_empty();
    let vocab = mconf.vocab_size();
    let param_names = model.state_dict_names();
    let start = Instant::now();
    macro_rules! go {
        ($m:expr) => {{
            let stages = $m.into_stages();
            let aux_coef = stages.aux_loss_coef.unwrap_or(0.0);
            let layers = stages.attention.len();
            let experts = stages.experts.iter().map(|x| x.local_experts().len()).max().unwrap_or(0);
            let mut layout = layout_of(cfg, layers, experts)?;
            layout.shared_experts = stages.experts.iter().map(|x| x.shared_experts.is_some()).collect();
            let rope = stages.rope.tables::<B>(cfg.seq, device);
            let shared = Shared {
                cfg: cfg.clone(),
                settings: step_settings(cfg, with_aux, aux_coef, 0),
                layout,
                rope,
                vocab,
                param_names: param_names.clone(),
            };
            match cfg.transport {
                TransportKind::Local => run_local(shared, stages, device)?,
                #[cfg(feature = "mpi")]
                TransportKind::Mpi => mpi::run_mpi(shared, stages, device)?,
                #[cfg(not(feature = "mpi"))]
                TransportKind::Mpi => {
                    return Err(TrainError::option(
                        "transport",
                        "mpi needs a build with the `mpi` feature (cargo build --features mpi); allowed here: local",
                    ))
                }
                #[cfg(feature = "nccl")]
                TransportKind::Nccl => mpi::run_mpi(shared, stages, device)?,
                #[cfg(not(feature = "nccl"))]
                TransportKind::Nccl => unreachable!("rejected above"),
            }
        }};
    }
    let zero = match model {
        MoeCausalLm::Qwen3Moe(m) => go!(m),
        MoeCausalLm::GptOss(m) => go!(m),
        MoeCausalLm::DeepseekV3(m) => go!(m),
    };
    let train_s = start.elapsed().as_secs_f64();
    if zero.rank == 0 {
        if let Some(path) = &cfg.trace {
            trace::write_chrome_trace(path, &zero.names, &zero.traces)?;
        }
        if let Some(dir) = &cfg.out {
            save_gathered(&dir.join("final"), &zero.weights, &mconf.to_hf_json())?;
        }
    }
    Ok(summarise(cfg, zero, params, train_s))
}

/// Writes the gathered parameters as a Hugging Face checkpoint; expert shards of a fused tensor are
/// put back together in row order.
fn save_gathered(dir: &std::path::Path, weights: &[transport::NamedTensor], config: &serde_json::Value) -> Result<()> {
    let mut sink = TensorSink::new();
    let mut shards: std::collections::BTreeMap<&str, Vec<&transport::NamedTensor>> = Default::default();
    for w in weights {
        match w.offset {
            None => sink.put_raw(w.name.clone(), w.tensor.shape.clone(), w.tensor.data.clone()),
            Some(_) => shards.entry(&w.name).or_default().push(w),
        }
    }
    for (name, mut parts) in shards {
        parts.sort_by_key(|p| p.offset);
        let mut shape = parts[0].tensor.shape.clone();
        shape[0] = parts.iter().map(|p| p.tensor.rows()).sum();
        let data: Vec<f32> = parts.iter().flat_map(|p| p.tensor.data.iter().copied()).collect();
        sink.put_raw(name.to_owned(), shape, data);
    }
    disagmoe_models::causal_lm::write_pretrained(dir, &sink, config, 2 << 30)?;
    Ok(())
}

fn summarise(cfg: &RunConfig, zero: RankZero, params: usize, train_s: f64) -> TrainSummary {
    let steps = zero.outcomes.len();
    let losses: Vec<f64> = zero.outcomes.iter().map(|o| o.loss).collect();
    let mean = |f: &dyn Fn(&StepOutcome) -> f64| zero.outcomes.iter().map(f).sum::<f64>() / steps.max(1) as f64;
    let run_s: f64 = zero.step_s.iter().sum();
    let (tokens_per_s, tokens_per_s_all, first_step_s) = crate::trainer::throughput(&zero.step_s, cfg.batch * cfg.seq);
    TrainSummary {
        first_loss: losses.first().copied().unwrap_or(f64::NAN),
        last_loss: losses.last().copied().unwrap_or(f64::NAN),
        tokens_per_s,
        tokens_per_s_all,
        first_step_s,
        steps,
        skipped_steps: zero.outcomes.iter().filter(|o| o.skipped).count(),
        backend: crate::BACKEND_NAME.into(),
        params,
        train_s,
        param_checksum: zero.checksum,
        resumed_from_step: None,
        stopped_early: false,
        checkpoint: None,
        losses,
        placement: cfg.placement.name().into(),
        workers: zero.names.len(),
        micro_batches: cfg.effective_micro_batches(),
        step_s: run_s / steps.max(1) as f64,
        exposed_comm_s: mean(&|o| o.exposed_comm_s),
        in_flight_wait_s: mean(&|o| o.in_flight_wait_s),
        compute_s: mean(&|o| o.compute_s),
        link_s: mean(&|o| o.link_s),
    }
}
