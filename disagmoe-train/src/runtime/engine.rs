//! The distributed step engine: this process's workers, each on a thread of its own, driven one
//! step at a time by the training loop; and the factories of what a worker talks through, side by
//! side: its endpoint ([`local_endpoints`], MPI's or NCCL's) and its reducer ([`AllReduce`]).
//!
//! Under `local` every worker of the run is a thread here; under `mpi`/`nccl` this process runs its
//! rank's one worker. Each step the engine hands every thread the step's batch and waits for their
//! outcomes (the same on every worker after the step's global reduction). A worker that fails tells
//! the others (their message loops stop at once); the engine reports the root cause: a worker's own
//! failure before errors that only relay another's, and those before time-outs of workers left
//! waiting. Under MPI the failing process takes the whole job down (`MPI_Abort`).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use burn::tensor::backend::AutodiffBackend;

use disagmoe_models::decoder::AttentionLayer;
use disagmoe_models::{Experts, FamilyConfig, Router, TrainModule};

use super::collectives::{AllReduce, Ring};
use super::layout::Layout;
use super::part::{build_part, WeightSource};
use super::trace::{write_chrome_trace, TraceEvent};
use super::transport::{local_endpoints, Endpoint, Port};
use super::worker::Worker;
use super::{link_model, Shared};
use crate::checkpoint::TrainState;
use crate::config::TransportKind;
use crate::data::Batch;
use crate::error::{Result, TrainError};
use crate::optim::{AdamW, Moment};
use crate::trainer::{EngineInfo, FinalReport, StateBytes, StepEngine, StepReport};

/// What the engine reports about the model.
pub(crate) struct RunFacts {
    pub(crate) model_type: &'static str,
    pub(crate) vocab_size: usize,
    pub(crate) flops_per_token: f64,
}

enum Command {
    /// Count the parameters held (after every worker has built its part).
    Start,
    Step {
        step: usize,
        batch: Batch,
        lr: f64,
        /// f16's loss scale (1 otherwise).
        loss_scale: f64,
        stop: bool,
        /// Apply the update (a training step), or leave the model as it is (an evaluation).
        update: bool,
    },
    /// Write a training checkpoint (every worker its part, rank 0 commits).
    Checkpoint {
        dir: PathBuf,
        state: Box<TrainState>,
        keep: usize,
    },
    Finish {
        out: Option<PathBuf>,
        traces: bool,
    },
}

/// What the workers report once built: parameters by rank, and of the whole model.
pub(crate) struct StartReport {
    pub(crate) params_per_rank: Vec<usize>,
    pub(crate) params: usize,
}

/// What a worker hands over at the end (trace events only on rank 0).
pub(crate) struct FinalParts {
    pub(crate) checksum: f64,
    pub(crate) peak_rss_mb_per_rank: Vec<f64>,
    pub(crate) state_per_rank: Vec<StateBytes>,
    pub(crate) traces: Vec<TraceEvent>,
}

enum Reply {
    Start(Result<StartReport>),
    Step(Result<StepReport>),
    Checkpoint(Result<PathBuf>),
    Finish(Result<FinalParts>),
}

impl Reply {
    fn failed(&self) -> bool {
        matches!(self, Reply::Start(Err(_)) | Reply::Step(Err(_)) | Reply::Checkpoint(Err(_)) | Reply::Finish(Err(_)))
    }
}

/// This process's workers of a distributed run.
pub struct Distributed {
    info: EngineInfo,
    layout: Layout,
    trace: Option<std::path::PathBuf>,
    commands: Vec<Sender<Command>>,
    replies: Receiver<(usize, Reply)>,
    handles: Vec<JoinHandle<()>>,
    /// How long the others' answers are awaited once a worker has failed: a worker stuck on its
    /// work (its watchdog told the others) never answers, and is left behind.
    grace: Duration,
    optimizer_steps: u64,
    /// Evaluation passes so far (they tag their messages).
    eval_passes: usize,
    peak_rss_mb_per_rank: Vec<f64>,
    #[cfg(feature = "mpi")]
    process: Option<super::mpi::Process>,
}

impl Distributed {
    /// Starts this process's workers: each builds (or reads) its own part of the model of family
    /// `C` on its thread, then the engine asks them for the parameter counts.
    pub(crate) fn start<B, C>(
        shared: Arc<Shared<B>>,
        config: C,
        facts: RunFacts,
        devices: &[B::Device],
    ) -> Result<Box<dyn StepEngine>>
    where
        B: AutodiffBackend,
        C: FamilyConfig,
        C::Attention<B>: TrainModule<B>,
        C::Router<B>: TrainModule<B>,
        C::Experts<B>: TrainModule<B>,
    {
        let cfg = &shared.cfg;
        let layout = shared.layout.clone();
        #[cfg(feature = "mpi")]
        let mut process = None;
        let endpoints: Vec<Box<dyn Endpoint>> = match cfg.parallel.transport {
            TransportKind::Local => {
                local_endpoints(layout.workers).into_iter().map(|e| Box::new(e) as Box<dyn Endpoint>).collect()
            }
            #[cfg(feature = "mpi")]
            TransportKind::Mpi | TransportKind::Nccl => {
                let p = super::mpi::Process::start(cfg, layout.workers)?;
                // The nccl transport receives device payloads into the device its worker computes on.
                let device = &devices[device_slot(cfg.parallel.transport, p.rank()) % devices.len()];
                let alloc = shared.settings.device_payloads.then(|| super::worker::device_alloc::<B>(device)).flatten();
                let endpoint = process_endpoint(&p, cfg, alloc);
                process = Some(p);
                vec![endpoint]
            }
            #[cfg(not(feature = "mpi"))]
            other => unreachable!("transport {other:?} is refused before start"),
        };
        let ranks: Vec<usize> = endpoints.iter().map(|e| e.rank()).collect();
        let (reply_tx, replies) = channel();
        let mut commands = Vec::new();
        let mut handles = Vec::new();
        for endpoint in endpoints {
            let (tx, rx) = channel();
            commands.push(tx);
            let rank = endpoint.rank();
            let device = devices[device_slot(cfg.parallel.transport, rank) % devices.len()].clone();
            let (shared, reply_tx, config) = (shared.clone(), reply_tx.clone(), config.clone());
            let handle = std::thread::Builder::new()
                .name(format!("worker-{rank}"))
                .stack_size(64 << 20)
                .spawn(move || {
                    // The worker computes in its own pool: Burn's CPU backend, its matmuls and our
                    // CPU operations parallelise on the pool they are called from.
                    let threads = shared.cfg.parallel.threads_per_worker();
                    let pool = match rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .thread_name(move |i| format!("worker-{rank}-cpu-{i}"))
                        .stack_size(64 << 20)
                        .build()
                    {
                        Ok(pool) => pool,
                        Err(e) => {
                            let _ = rx.recv();
                            let cause = format!("cannot start its {threads} compute threads: {e}");
                            let _ =
                                reply_tx.send((rank, Reply::Start(Err(TrainError::Worker { worker: rank, cause }))));
                            return;
                        }
                    };
                    pool.install(move || {
                        // The products of this worker's models (one precision per run).
                        disagmoe_kernels::precision::set_precision_for_thread(Some(shared.cfg.precision.compute));
                        let part = match build_part::<B, C>(&config, &shared.layout, rank, &shared.source, &device) {
                            Ok(part) => part,
                            Err(e) => {
                                // The error answers the first command; the others learn of it by their
                                // time-out or the engine's round.
                                let _ = rx.recv();
                                let _ = reply_tx.send((rank, Reply::Start(Err(e))));
                                return;
                            }
                        };
                        let reducer = match reducer_of(shared.cfg.parallel.transport, &shared.layout, rank) {
                            Ok(reducer) => reducer,
                            Err(e) => {
                                let _ = rx.recv();
                                let _ = reply_tx.send((rank, Reply::Start(Err(e))));
                                return;
                            }
                        };
                        let port = Port::new(
                            endpoint,
                            link_model(&shared.cfg),
                            shared.settings.timeout,
                            shared.settings.own_process,
                        );
                        let mut settings = shared.settings.clone();
                        let fault = shared.cfg.faults.fail_worker.as_ref().filter(|f| f.worker == rank);
                        settings.fail_at = fault.map(|f| (f.step, f.after_tasks, f.exit));
                        let slow = shared.cfg.faults.slow_worker.as_ref().filter(|f| f.worker == rank);
                        settings.slow_at = slow.map(|f| (f.step, f.seconds));
                        let absent = shared.cfg.faults.absent_worker.as_ref().filter(|f| f.worker == rank);
                        settings.absent_at = absent.map(|f| (f.step, f.seconds));
                        let mut opt = AdamW::<B>::new(shared.cfg.optimizer.adamw());
                        if let Some((path, steps)) = &shared.resume {
                            // The moments of this worker's tensors, read like its weights.
                            let moments = Moment::BOTH.map(|m| {
                                let source = WeightSource::Checkpoint(crate::checkpoint::moment_dir(path, m));
                                build_part::<B, C>(&config, &shared.layout, rank, &source, &device)
                            });
                            let [first, second] = moments;
                            let loaded =
                                first.and_then(|m| second.and_then(|v| opt.import_moment_modules(&part, &m, &v)));
                            if let Err(e) = loaded {
                                let _ = rx.recv();
                                let _ = reply_tx.send((rank, Reply::Start(Err(e))));
                                return;
                            }
                            opt.set_steps_taken(*steps);
                        }
                        let trace = shared.cfg.parallel.trace.is_some();
                        let (build_config, build_device) = (config.clone(), device.clone());
                        let build_experts: super::worker::ExpertBuilder<B, C::Experts<B>> =
                            Box::new(move |layer, runs| {
                                let init = disagmoe_models::Init::placeholders(&build_device);
                                disagmoe_models::stages::ExpertStage::init(&build_config, layer, runs, false, &init)
                            });
                        let worker = Worker::new(
                            shared.layout.clone(),
                            settings,
                            port,
                            reducer,
                            part,
                            C::FFN_NAME,
                            (shared.rope.0.clone().to_device(&device), shared.rope.1.clone().to_device(&device)),
                            device,
                            trace,
                            opt,
                            build_experts,
                        );
                        serve(&shared, worker, rx, reply_tx);
                    })
                })
                .map_err(|e| TrainError::Worker { worker: rank, cause: format!("cannot start its thread: {e}") })?;
            handles.push(handle);
        }
        let info = EngineInfo {
            params: 0,
            params_per_rank: Vec::new(),
            workers: layout.workers,
            worker_names: (0..layout.workers).map(|w| layout.worker_name(w)).collect(),
            placement: cfg.parallel.placement.name(),
            primary: ranks.contains(&0),
            // The ends read their micro-batches' rows; with document masks, every attention
            // worker reads the batch's document boundaries (the index, not the tokens).
            needs_data: ranks.iter().any(|&r| {
                layout.holds_ends(r)
                    || (cfg.data.masks_documents() && (0..layout.layers).any(|l| !layout.attn_units(r, l).is_empty()))
            }),
            sparse_layers: (0..layout.layers).filter(|&l| layout.sparse[l]).collect(),
            model_type: facts.model_type,
            vocab_size: facts.vocab_size,
            in_flight: shared.settings.in_flight,
            flops_per_token: facts.flops_per_token,
            expert_placement: super::explicit_placement(&layout),
        };
        let mut engine = Self {
            info,
            layout,
            trace: cfg.parallel.trace.clone(),
            commands,
            replies,
            handles,
            grace: shared.settings.timeout * 2 + Duration::from_secs(1),
            optimizer_steps: shared.resume.as_ref().map_or(0, |(_, steps)| *steps),
            eval_passes: 0,
            peak_rss_mb_per_rank: Vec::new(),
            #[cfg(feature = "mpi")]
            process,
        };
        let replies = engine.round(|| Command::Start)?;
        let Some((_, Reply::Start(Ok(report)))) = replies.into_iter().next() else {
            unreachable!("every worker replied to the start")
        };
        engine.info.params = report.params;
        engine.info.params_per_rank = report.params_per_rank;
        Ok(Box::new(engine))
    }

    /// Sends `command` to every worker of this process and collects their replies in rank order;
    /// `Err` is the root cause of a failure.
    fn round(&mut self, command: impl Fn() -> Command) -> Result<Vec<(usize, Reply)>> {
        for tx in &self.commands {
            // A worker that has ended (after a failure) dropped its inbox; its reply says why.
            let _ = tx.send(command());
        }
        let mut replies: Vec<(usize, Reply)> = Vec::with_capacity(self.commands.len());
        while replies.len() < self.commands.len() {
            let next = if replies.iter().any(|(_, r)| r.failed()) {
                self.replies.recv_timeout(self.grace).ok()
            } else {
                self.replies.recv().ok()
            };
            match next {
                Some(r) => replies.push(r),
                None => break,
            }
        }
        replies.sort_by_key(|(rank, _)| *rank);
        let mut root: Option<(u8, TrainError)> = None;
        let mut ok = Vec::new();
        for (rank, reply) in replies {
            let err = match reply {
                Reply::Start(Err(e)) | Reply::Step(Err(e)) | Reply::Checkpoint(Err(e)) | Reply::Finish(Err(e)) => e,
                other => {
                    ok.push((rank, other));
                    continue;
                }
            };
            let p = root_cause_rank(rank, &err);
            if root.as_ref().is_none_or(|(q, _)| p < *q) {
                root = Some((p, err));
            }
        }
        if ok.len() < self.commands.len() && root.is_none() {
            root = Some((9, TrainError::Worker { worker: 0, cause: "a worker thread ended without a word".into() }));
        }
        match root {
            Some((_, e)) => Err(self.fail(e)),
            None => Ok(ok),
        }
    }

    /// A failure of this process: under MPI the whole job ends here (the error printed first);
    /// in-process it is returned.
    fn fail(&mut self, e: TrainError) -> TrainError {
        #[cfg(feature = "mpi")]
        if let Some(p) = &self.process {
            p.abort(&e);
        }
        e
    }
}

/// Which of the listed devices worker `rank` computes on (modulo their number): local workers take
/// them round-robin; an MPI rank (one worker per process) the one of its node-local rank.
fn device_slot(transport: TransportKind, rank: usize) -> usize {
    match transport {
        TransportKind::Local => rank,
        _ => crate::config::parallel::node_local_rank().unwrap_or(rank),
    }
}

/// This process's endpoint under `mpirun`: MPI's, or NCCL's (bootstrapped over MPI; a failure to
/// bring it up ends the job, as the other ranks wait in theirs).
#[cfg(feature = "mpi")]
#[cfg_attr(not(feature = "nccl"), allow(unused_variables))]
fn process_endpoint(
    process: &super::mpi::Process,
    cfg: &crate::config::RunConfig,
    alloc: Option<Arc<dyn crate::runtime::msg::DeviceAlloc>>,
) -> Box<dyn Endpoint> {
    match cfg.parallel.transport {
        #[cfg(feature = "nccl")]
        TransportKind::Nccl => match super::nccl::NcclEndpoint::start(
            &process.world(),
            alloc,
            Duration::from_secs_f64(2.0 * cfg.parallel.comm_timeout_s),
        ) {
            Ok(e) => Box::new(e),
            Err(e) => process.abort(&e),
        },
        _ => Box::new(super::mpi::MpiEndpoint::start()),
    }
}

/// How worker `rank` sums under `transport`: the ring over its port (`local`), MPI
/// sub-communicators (`mpi`), NCCL communicators bootstrapped over them (`nccl`). Every worker of
/// an MPI job calls it at the same point (the communicators are made collectively).
#[cfg_attr(not(feature = "mpi"), allow(unused_variables))]
fn reducer_of(transport: TransportKind, layout: &Layout, rank: usize) -> Result<Box<dyn AllReduce>> {
    Ok(match transport {
        #[cfg(feature = "nccl")]
        TransportKind::Nccl => {
            let mpi = super::mpi::MpiGroups::new(&layout.replicas(rank), &layout.expert_replica_groups());
            Box::new(super::nccl::NcclGroups::new(mpi, rank)?)
        }
        #[cfg(feature = "mpi")]
        TransportKind::Mpi => {
            Box::new(super::mpi::MpiGroups::new(&layout.replicas(rank), &layout.expert_replica_groups()))
        }
        // `nccl` without the feature is refused before any worker starts.
        _ => Box::new(Ring::new(rank)),
    })
}

/// The order in which failures explain a run's end: a worker's own failure first (a non-finite
/// gradient with its tensor named too), then any other error, then the time-outs of workers left
/// waiting, then errors that only relay another's (a hung worker's line reaches the run this way:
/// its watchdog tells the others, and the hung worker itself never answers).
fn root_cause_rank(rank: usize, e: &TrainError) -> u8 {
    match e {
        // The worker that holds a non-finite gradient names it; the others only know the step's.
        TrainError::NonFinite { tensor, .. } if !tensor.is_empty() => 0,
        TrainError::Worker { worker, .. } if *worker != rank => 3,
        TrainError::Worker { .. } => 0,
        TrainError::Stalled { .. } => 2,
        _ => 1,
    }
}

/// A worker thread: runs the commands of the engine until the run ends or the worker fails.
fn serve<B, A, R, X>(
    shared: &Shared<B>,
    mut worker: Worker<B, A, R, X>,
    commands: Receiver<Command>,
    replies: Sender<(usize, Reply)>,
) where
    B: AutodiffBackend,
    A: TrainModule<B> + AttentionLayer<B>,
    R: TrainModule<B> + Router<B>,
    X: TrainModule<B> + Experts<B>,
{
    let rank = worker.rank();
    for command in commands {
        let (reply, last) = match command {
            Command::Start => {
                let r = guarded(shared, &mut worker, |w| {
                    let (params_per_rank, params) = w.param_counts()?;
                    Ok(StartReport { params_per_rank, params })
                });
                let failed = r.is_err();
                (Reply::Start(r), failed)
            }
            Command::Step { step, batch, lr, loss_scale, stop, update } => {
                let r = guarded(shared, &mut worker, |w| w.run_step(step, &batch, lr, loss_scale, stop, update));
                let failed = r.is_err();
                (Reply::Step(r), failed)
            }
            Command::Checkpoint { dir, state, keep } => {
                let r = guarded(shared, &mut worker, |w| {
                    let kill = shared.cfg.faults.kill_in_checkpoint.clone();
                    w.checkpoint(&dir, &state, keep, &shared.hf_config, kill.as_ref())
                });
                let failed = r.is_err();
                (Reply::Checkpoint(r), failed)
            }
            Command::Finish { out, traces } => {
                let r = guarded(shared, &mut worker, |w| {
                    let config = &shared.hf_config;
                    let (checksum, peak_rss_mb_per_rank, state_per_rank) =
                        w.finish(out.as_deref(), config, shared.cfg.save_dtype)?;
                    let traces = if traces { w.gather_traces()? } else { Vec::new() };
                    Ok(FinalParts { checksum, peak_rss_mb_per_rank, state_per_rank, traces })
                });
                (Reply::Finish(r), true)
            }
        };
        if replies.send((rank, reply)).is_err() || last {
            return;
        }
    }
}

/// Runs `f` on the worker, turning a panic into an error; a worker that fails tells the others,
/// unless it stops because another one failed (or plays dead for a test).
fn guarded<B, A, R, X, T>(
    shared: &Shared<B>,
    worker: &mut Worker<B, A, R, X>,
    f: impl FnOnce(&mut Worker<B, A, R, X>) -> Result<T>,
) -> Result<T>
where
    B: AutodiffBackend,
    A: TrainModule<B> + AttentionLayer<B>,
    R: TrainModule<B> + Router<B>,
    X: TrainModule<B> + Experts<B>,
{
    let rank = worker.rank();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(worker))).unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "unknown panic".into());
        Err(TrainError::Worker { worker: rank, cause: format!("panicked: {what}") })
    });
    if let Err(e) = &result {
        let silent = shared.cfg.faults.fail_worker.as_ref().is_some_and(|f| f.worker == rank && f.exit);
        // A non-finite step under `abort` is the same decision on every worker, from the global
        // sums: nobody waits for the others, and telling them would race their own error.
        let everyone_knows = matches!(e, TrainError::NonFinite { .. });
        if !silent && !everyone_knows && !matches!(e, TrainError::Worker { worker, .. } if *worker != rank) {
            let cause = match e {
                TrainError::Worker { cause, .. } => cause.clone(),
                other => other.to_string(),
            };
            worker.abort(&cause);
        }
    }
    result
}

impl StepEngine for Distributed {
    fn info(&self) -> EngineInfo {
        self.info.clone()
    }

    fn step(&mut self, step: usize, batch: &Batch, lr: f64, loss_scale: f64, stop: &AtomicBool) -> Result<StepReport> {
        // Read as the step starts: the workers add it up at the step's end, so every worker (and
        // every process) stops after the same step.
        let stop = stop.load(Ordering::SeqCst);
        let replies =
            self.round(|| Command::Step { step, batch: batch.clone(), lr, loss_scale, stop, update: true })?;
        let Some((_, Reply::Step(Ok(report)))) = replies.into_iter().next() else {
            unreachable!("every worker replied to the step")
        };
        if !report.skipped {
            self.optimizer_steps += 1;
        }
        Ok(report)
    }

    fn optimizer_steps(&self) -> u64 {
        self.optimizer_steps
    }

    fn evaluate(&mut self, batch: &Batch) -> Result<f64> {
        // A pass of the step's schedule without the update, tagged apart from the steps.
        self.eval_passes += 1;
        let step = super::worker::EVAL_PASS_BASE + self.eval_passes;
        let replies = self.round(|| Command::Step {
            step,
            batch: batch.clone(),
            lr: 0.0,
            loss_scale: 1.0,
            stop: false,
            update: false,
        })?;
        let Some((_, Reply::Step(Ok(out)))) = replies.into_iter().next() else {
            unreachable!("every worker replied to the evaluation")
        };
        Ok(out.lm_loss)
    }

    fn save_checkpoint(&mut self, dir: &Path, state: &TrainState, keep: usize) -> Result<PathBuf> {
        let replies = self.round(|| Command::Checkpoint { dir: dir.into(), state: Box::new(state.clone()), keep })?;
        let Some((_, Reply::Checkpoint(Ok(path)))) = replies.into_iter().next() else {
            unreachable!("every worker replied to the checkpoint")
        };
        Ok(path)
    }

    fn finish(&mut self, out: Option<&Path>) -> Result<FinalReport> {
        let (out, traces) = (out.map(Path::to_path_buf), self.trace.is_some());
        let replies = self.round(|| Command::Finish { out: out.clone(), traces })?;
        let (mut checksum, mut state_per_rank) = (0.0, Vec::new());
        for (rank, reply) in replies {
            let Reply::Finish(Ok(parts)) = reply else { unreachable!("every worker replied to the finish") };
            checksum = parts.checksum;
            self.peak_rss_mb_per_rank = parts.peak_rss_mb_per_rank;
            state_per_rank = parts.state_per_rank;
            if rank == 0 {
                if let Some(path) = &self.trace {
                    let names: Vec<String> = (0..self.layout.workers).map(|w| self.layout.worker_name(w)).collect();
                    write_chrome_trace(path, &names, &parts.traces)?;
                }
            }
        }
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
        #[cfg(feature = "mpi")]
        if let Some(p) = &self.process {
            p.barrier();
        }
        Ok(FinalReport {
            param_checksum: checksum,
            peak_rss_mb_per_rank: std::mem::take(&mut self.peak_rss_mb_per_rank),
            state_per_rank,
        })
    }
}

impl Drop for Distributed {
    /// Ends the worker threads (closing their command channels) before the transport goes; a
    /// thread still stuck on its work after the grace period is left behind.
    fn drop(&mut self) {
        self.commands.clear();
        let until = std::time::Instant::now() + self.grace;
        for h in self.handles.drain(..) {
            while !h.is_finished() && std::time::Instant::now() < until {
                std::thread::sleep(Duration::from_millis(10));
            }
            if h.is_finished() {
                let _ = h.join();
            }
        }
    }
}
