//! One worker of a distributed run: its part of the model and its message loop.
//!
//! The worker is event driven: "receive, tell the scheduler, run what it returns". Messages arrive
//! through its port ([`comm`]: the communication stream; sends never wait for the receiver); the
//! exchange's messages are kept by the [`Inbox`] and their arrival told to the [`Scheduler`],
//! which decides which task is ready and which runs next (the rules are
//! [`crate::runtime::scheduler`]'s). The task bodies ([`tasks`]) compute and hand host rows to the
//! exchange ([`crate::runtime::exchange`]), which builds every message. The step ends with the
//! global sums and the update ([`step_end`]); the worker also writes checkpoints and the final
//! model ([`persist`]). Everything that touches Burn's autodiff graph across a boundary is
//! [`autodiff`]'s.

mod autodiff;
mod comm;
mod payload;
mod persist;
mod rebalance;
mod ring;
mod sharded;
mod step_end;
mod tasks;

use std::collections::HashMap;
use std::time::Duration;

use burn::module::{Module, ParamId};
use burn::optim::GradientsAccumulator;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;

use disagmoe_core::exchange::ExchangePrecision;
use disagmoe_models::decoder::AttentionLayer;
use disagmoe_models::moe::{Experts, Router, RoutingOptions};
use disagmoe_models::{AuxLoss, Recompute, TrainModule};

use self::comm::Comm;
#[cfg(feature = "mpi")]
pub(crate) use self::payload::device_alloc;
pub use self::rebalance::ExpertBuilder;
use self::sharded::Sharded;
use self::step_end::StepStats;
use self::tasks::{AttnSaved, FfnSaved};
use super::collectives::AllReduce;
use super::exchange::Inbox;
use super::layout::Layout;
use super::msg::{Envelope, Msg, RunBounds};
pub use super::part::WorkerPart;
use super::scheduler::{Arrival, Scheduler, Task};
use super::trace::COMPUTE;
use super::transport::{now_us, Port};
use crate::data::Batch;
use crate::error::{Result, TrainError};
use crate::optim::AdamW;
use crate::trainer::{StateBytes, StepReport};

/// Message tags of evaluation passes start here (training steps count from 1), so that an
/// evaluation's messages never mix with a step's.
pub const EVAL_PASS_BASE: usize = 1 << 48;

/// A pass in words: `step 3`, or `an evaluation pass`.
fn pass_name(step: usize) -> String {
    if step >= EVAL_PASS_BASE {
        "an evaluation pass".into()
    } else {
        format!("step {step}")
    }
}

/// Settings every worker shares.
#[derive(Debug, Clone)]
pub struct StepSettings {
    /// Sequences per micro-batch.
    pub mb_rows: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// The balance loss and its coefficient, when the run adds it.
    pub aux: Option<AuxLoss>,
    /// Clip the global gradient norm to this (0: off).
    pub grad_clip: f64,
    /// Correction-bias step (0: off).
    pub bias_update_rate: f64,
    /// Stop with an error on a non-finite loss or gradient instead of skipping the update.
    pub abort_on_nonfinite: bool,
    /// Longest wait for any message before the worker gives up on its peers.
    pub timeout: Duration,
    /// Micro-batches an embedding worker keeps in flight (started, backward not finished):
    /// `ep` runs 1F1B with one; AF-Pipe starts a new one whenever one finishes.
    pub in_flight: usize,
    /// Router z-loss, capacity and forced balance, applied to every routed layer's decision.
    pub routing: RoutingOptions,
    /// The multi-token prediction modules the head workers train (with the head) and their loss
    /// weight.
    pub mtp: disagmoe_models::MtpSettings,
    /// Which stages keep only their input in the forward and run it again in the backward.
    pub recompute: Recompute,
    /// Testing: this worker fails at (step, after this many tasks); `true` dies without a word (the
    /// process exits under MPI, the thread ends silently in-process).
    pub fail_at: Option<(usize, usize, bool)>,
    /// Whether workers are processes of their own (then a silent failure ends the process).
    pub own_process: bool,
    /// Test-only fault: `(step, seconds)` this worker spends in its first task of that step.
    pub slow_at: Option<(usize, f64)>,
    /// Test-only fault: `(step, seconds)` this worker stays away from the step's end, idle.
    pub absent_at: Option<(usize, f64)>,
    /// Test-only fault: `(step, tensor)` whose gradient becomes NaN at that step where it is held
    /// (see `Worker::inject_nonfinite`).
    pub poison_at: Option<(usize, String)>,
    /// What the token exchange's payloads travel in between workers.
    pub exchange: ExchangePrecision,
    /// The exchange's payloads stay tensors on the device that computed them (workers of one
    /// process on one device), instead of host data.
    pub device_payloads: bool,
    /// Parameters held in copies are updated in shards ([`sharded`]).
    pub distributed_optimizer: bool,
    /// The matrices are held in bf16 with f32 master weights in the optimizer (`--precision
    /// bf16`, [`crate::optim::AdamW::adopt_masters`]).
    pub bf16_weights: bool,
    /// The options an explicit expert placement was computed from, saved with it in checkpoints
    /// ([`crate::runtime::placement_options`]).
    pub placement_options: String,
    /// Re-place the experts every this many steps (0: never; [`rebalance`]).
    pub rebalance_every: usize,
    /// Redundant expert replicas per MoE layer (the re-placements keep as many).
    pub redundant_experts: usize,
    /// The moving average of the expert loads a resumed run starts from (empty: none yet).
    pub expert_loads: crate::runtime::ExpertLoads,
}

/// A worker and its state within a step.
pub struct Worker<B: AutodiffBackend, A: Module<B>, R: Module<B>, X: Module<B>> {
    layout: Layout,
    settings: StepSettings,
    comm: Comm,
    /// How this worker's groups sum (ring over the port, MPI or NCCL).
    reducer: Box<dyn AllReduce>,
    device: B::Device,
    /// `None` only while the optimizer steps it.
    part: Option<WorkerPart<B, A, R, X>>,
    /// Index of a held layer among the part's attention stages and expert stages.
    attn_index: HashMap<usize, usize>,
    ffn_index: HashMap<usize, usize>,
    rope: (Tensor<B, 4>, Tensor<B, 4>),
    opt: AdamW<B>,
    /// The distributed optimizer's shard, for a worker with copies when it is on.
    sharded: Option<Sharded<B::InnerBackend>>,
    /// The most training state held at a step's end so far.
    peak_state: StateBytes,
    /// Checkpoint name of each parameter this worker holds.
    names: HashMap<ParamId, String>,
    /// Checkpoint name of a layer's feed-forward module.
    ffn_name: &'static str,
    // Per step.
    /// Token ids of this worker's micro-batches.
    rows: HashMap<usize, Vec<Vec<i64>>>,
    /// The documents of every micro-batch whose windows are masked by document (attention stays
    /// within them; the loss skips the targets that begin another).
    documents: HashMap<usize, disagmoe_kernels::documents::Documents>,
    inbox: Inbox,
    attn_saved: HashMap<(usize, usize), AttnSaved<B, A, R>>,
    /// Context parallelism's halves of attention stages (`ring`).
    ring: ring::RingState<B, A, R>,
    ffn_saved: HashMap<(usize, usize), FfnSaved<B, X>>,
    grads: GradientsAccumulator<WorkerPart<B, A, R, X>>,
    /// The head's gradients apart (a tied embedding also gets the first layer's: two sums, each in
    /// micro-batch order, added at the end).
    head_grads: GradientsAccumulator<WorkerPart<B, A, R, X>>,
    stats: StepStats,
    tasks_run: usize,
    /// This step's loss scale (f16; 1 otherwise).
    loss_scale: f64,
    /// The moving average of the expert loads (`rebalance_every`).
    loads: crate::runtime::ExpertLoads,
    /// Builds the expert stages a re-placement of the experts gives this worker.
    build_experts: ExpertBuilder<B, X>,
}

impl<B, A, R, X> Worker<B, A, R, X>
where
    B: AutodiffBackend,
    A: TrainModule<B> + AttentionLayer<B>,
    R: TrainModule<B> + Router<B>,
    X: TrainModule<B> + Experts<B>,
{
    /// This worker's rank.
    pub fn rank(&self) -> usize {
        self.comm.rank
    }

    /// A worker holding `part` (whose parameters are named in checkpoints under a feed-forward
    /// module `ffn_name`), with RoPE tables for the run's sequence length.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        layout: Layout,
        settings: StepSettings,
        port: Port,
        reducer: Box<dyn AllReduce>,
        mut part: WorkerPart<B, A, R, X>,
        ffn_name: &'static str,
        rope: (Tensor<B, 4>, Tensor<B, 4>),
        device: B::Device,
        trace: bool,
        mut opt: AdamW<B>,
        build_experts: ExpertBuilder<B, X>,
    ) -> Self {
        let comm = Comm::new(port, layout.workers, settings.timeout, trace, settings.exchange);
        // The multi-token prediction modules route inside their block, under the run's options.
        for m in part.ends.iter_mut().flat_map(|e| &mut e.mtp) {
            m.set_routing(settings.routing);
        }
        let settings_loads = settings.expert_loads.clone();
        let rank = comm.rank;
        let replicas = layout.replicas(rank);
        let names = part.names(&layout, rank, ffn_name);
        if settings.bf16_weights {
            let low = |id: ParamId, dims: usize| names.get(&id).is_some_and(|n| crate::optim::held_in_bf16(n, dims));
            part = opt.adopt_masters(part, &low);
        }
        let sharded = (settings.distributed_optimizer && replicas.len() > 1).then(|| {
            let (n, pos) = (replicas.len(), replicas.iter().position(|&r| r == rank).expect("a copy of itself"));
            let mut s = Sharded::new(replicas.clone(), &part, |len| reducer.shard(n, pos, len));
            s.take_moments_from(&mut opt);
            s.take_masters_from(&mut opt);
            s
        });
        let attn_index = layout.attn_layers(rank).into_iter().enumerate().map(|(i, l)| (l, i)).collect();
        let ffn_index = layout.ffn_layers(rank).into_iter().enumerate().map(|(i, (l, _))| (l, i)).collect();
        Self {
            layout,
            settings,
            comm,
            reducer,
            device,
            part: Some(part),
            attn_index,
            ffn_index,
            rope,
            opt,
            sharded,
            peak_state: StateBytes::default(),
            names,
            ffn_name,
            rows: HashMap::new(),
            documents: HashMap::new(),
            inbox: Inbox::default(),
            attn_saved: HashMap::new(),
            ring: ring::RingState::default(),
            ffn_saved: HashMap::new(),
            grads: GradientsAccumulator::new(),
            head_grads: GradientsAccumulator::new(),
            stats: StepStats::default(),
            tasks_run: 0,
            loss_scale: 1.0,
            loads: settings_loads,
            build_experts,
        }
    }

    /// Every worker of the run (the group of the global sums).
    fn everyone(&self) -> Vec<usize> {
        (0..self.layout.workers).collect()
    }

    fn part(&self) -> &WorkerPart<B, A, R, X> {
        self.part.as_ref().expect("the part is only taken during the optimizer step")
    }

    /// What this worker measured so far, with the payload bytes its thread read back.
    fn meters(&self) -> comm::StepMeters {
        comm::StepMeters { payload_host_bytes: payload::host_bytes(), ..self.comm.meters }
    }

    /// Runs one pass over `batch` (the step's whole batch; each worker uses its micro-batches;
    /// workers without the embedding may pass an empty slice): forward and backward of every
    /// micro-batch, the global sums, and (when `update`) the gradient reduction and the optimizer
    /// step with learning rate `lr`; returns the pass's global report. A pass without `update` is
    /// an evaluation: the model is left as it was and the report's losses are the batch's. `step`
    /// tags the pass's messages: training steps from 1, evaluations from [`EVAL_PASS_BASE`].
    pub fn run_step(
        &mut self,
        step: usize,
        batch: &Batch,
        lr: f64,
        loss_scale: f64,
        stop: bool,
        update: bool,
    ) -> Result<StepReport> {
        self.comm.step = step;
        self.loss_scale = loss_scale;
        self.tasks_run = 0;
        let start = self.meters();
        let rank = self.rank();
        let rows_per = self.settings.mb_rows;
        // Only this worker's micro-batches' windows are read.
        self.rows = (self.layout.own_micro_batches(rank).into_iter())
            .map(|m| Ok((m, batch.rows(m * rows_per..(m + 1) * rows_per)?)))
            .collect::<Result<_>>()?;
        // The documents of the micro-batches this worker attends to (from the index alone).
        self.documents = HashMap::new();
        if !batch.is_empty() {
            if batch.len() < self.layout.micro_batches * rows_per {
                return Err(TrainError::Worker {
                    worker: rank,
                    cause: format!(
                        "a batch of {} rows for {} micro-batches of {rows_per}",
                        batch.len(),
                        self.layout.micro_batches
                    ),
                });
            }
            let layers = self.layout.layers;
            let attends = |m: usize| {
                (0..layers).any(|l| {
                    self.layout
                        .ring_units(m * self.layout.context_parallel)
                        .any(|u| self.layout.attn_worker(u, l) == rank)
                })
            };
            for m in (0..self.layout.micro_batches).filter(|&m| attends(m)) {
                if let Some(d) = batch.documents(m * rows_per..(m + 1) * rows_per)? {
                    self.documents.insert(m, d);
                }
            }
        }
        let mut schedule = Scheduler::new(&self.layout, rank, self.settings.in_flight);
        for env in std::mem::take(&mut self.comm.later) {
            self.accept(env, &mut schedule)?;
        }
        while !schedule.finished() {
            while let Some(env) = self.comm.poll()? {
                self.accept(env, &mut schedule)?;
            }
            match schedule.next() {
                Some(task) => {
                    self.run_task(task)?;
                    schedule.done(task);
                }
                None => {
                    let env = self.comm.wait_for_message(|| format!("at step {step}"))?;
                    self.accept(env, &mut schedule)?;
                }
            }
        }
        let mut report = self.end_of_step(lr, start, stop, update)?;
        if update {
            report.rebalance = self.after_update(&report)?;
        }
        Ok(report)
    }

    /// Takes in a message: an abort ends the step; a message of a later pass and an all-reduce
    /// chunk are kept; one of the token exchange is checked against the run, kept by the inbox and
    /// told to the scheduler.
    fn accept(&mut self, env: Envelope, schedule: &mut Scheduler) -> Result<()> {
        if let Msg::Abort { worker, cause } = env.msg {
            return Err(TrainError::Worker { worker, cause });
        }
        if env.step != self.comm.step || matches!(env.msg, Msg::Reduce { .. }) {
            self.comm.later.push(env);
            return Ok(());
        }
        let bounds = RunBounds {
            workers: self.layout.workers,
            micro_batches: self.layout.units(),
            layers: self.layout.layers,
            tokens: self.settings.mb_rows * self.unit_seq(),
            ring: self.layout.context_parallel,
        };
        env.msg.admit(env.src, &bounds).map_err(|what| TrainError::Worker {
            worker: self.rank(),
            cause: format!("a message from worker {} cannot be taken: {what}", env.src),
        })?;
        if let Some(arrival) = Arrival::of(&env.msg, env.src) {
            self.inbox.keep(&self.layout, env.src, env.msg);
            schedule.on_message(arrival);
        }
        Ok(())
    }

    /// Runs `task` (and the test-only faults of the step), timed and traced.
    fn run_task(&mut self, task: Task) -> Result<()> {
        let (step, rank) = (self.comm.step, self.rank());
        self.comm.working_on(format!("{} of {}", task.name(), pass_name(step)));
        if let Some((_, at, silent)) = self.settings.fail_at.filter(|(s, _, _)| *s == step) {
            if self.tasks_run >= at {
                if silent && self.settings.own_process {
                    eprintln!("worker {rank}: ending the process mid-step on purpose (fault injection)");
                    std::process::exit(3);
                }
                let what = if silent { "stopped without a word" } else { "failed on purpose" };
                let cause = format!("{what} at step {step} (fault injection)");
                return Err(TrainError::Worker { worker: rank, cause });
            }
        }
        if let Some((_, seconds)) = self.settings.slow_at.filter(|(s, _)| *s == step && self.tasks_run == 0) {
            eprintln!("worker {rank}: computing for {seconds} s on purpose (fault injection)");
            std::thread::sleep(Duration::from_secs_f64(seconds));
        }
        self.tasks_run += 1;
        let t0 = now_us();
        match task {
            Task::AttnFwd { mb, layer } => self.attention_forward(mb, layer)?,
            Task::Head { mb } => self.head(mb)?,
            Task::AttnBwd { mb, layer } => self.attention_backward(mb, layer)?,
            Task::RingFwd { mb, layer, block } => self.ring_forward(mb, layer, block)?,
            Task::RingBwd { mb, layer } => self.ring_backward(mb, layer)?,
            Task::FfnFwd { mb, layer, src } => self.ffn_forward(src, mb, layer)?,
            Task::FfnBwd { mb, layer } => self.ffn_backward(mb, layer)?,
        }
        let t1 = now_us();
        self.comm.meters.compute_us += t1 - t0;
        self.comm.tracer.span(|| task.name(), task.category(), COMPUTE, t0, t1);
        Ok(())
    }

    /// Tells every other worker that this one failed.
    pub fn abort(&mut self, cause: &str) {
        self.comm.abort(cause);
    }
}
