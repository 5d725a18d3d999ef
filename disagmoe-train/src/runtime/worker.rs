//! One worker of a distributed run: its part of the model, its message loop, and the end-of-step
//! collectives.
//!
//! The worker is event driven. Messages arrive through its [`Port`] (the communication stream; sends
//! never wait for the receiver), and a task becomes ready when all its inputs are there:
//!
//! | task            | ready when                                                      | sends                                   |
//! |-----------------|-----------------------------------------------------------------|-----------------------------------------|
//! | attention fwd l | embedding (l = 0), or residual + every holder's combine of l-1  | dispatch to l's holders, residual to l+1 |
//! | expert fwd l    | a dispatch arrives                                              | combine to l+1's attention worker       |
//! | head            | residual + every holder's combine of the last layer             | loss; grads to the last layer           |
//! | expert bwd l    | the gradient of its combine arrives                             | grad-dispatch to l's attention worker   |
//! | attention bwd l | grad-residual + every holder's grad-dispatch of l               | grads to l-1's attention and holders    |
//!
//! The compute stream takes backward work first, then expert forwards, then attention forwards, so
//! gradients flow out while new micro-batches come in. Every boundary between workers is a leaf of
//! Burn's autodiff graph: a received tensor becomes a leaf that requires a gradient, and a stage's
//! backward is `sum(output * received gradient)`.
//!
//! Every wait of the compute stream for data is exposed communication (`exposed_comm_s`); each is
//! also split at the arrival that ends it: the part after the message was sent waited for data on
//! the wire (`in_flight_wait_s`), the part before for data a peer had not computed yet.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::time::Duration;

use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, TensorData};

use disagmoe_kernels::order::range_key;
use disagmoe_models::causal_lm::next_token_cross_entropy;
use disagmoe_models::decoder::AttentionLayer;
use disagmoe_models::moe::{Experts, Routed, Router, RoutingOptions};
use disagmoe_models::stages::{AttentionStage, Ends, ExpertStage};
use disagmoe_models::{AuxLoss, TrainModule};

use super::collectives::{max_chunk_elements, ring_all_reduce, ReduceValues, Reducer, RingLink};
use super::exchange::{
    add_token_sums, dense_shares, empty, m2n_shares, rows_of, Assembled, DispatchGrad, GradInput, GradResidualIn,
    HolderRows, LayerInput, Partial, ResidualIn, Share,
};
use super::layout::Layout;
pub use super::part::WorkerPart;
use super::shards::{write_index, write_shards, ShardReport};
use super::trace::{Tracer, COMM, COMPUTE};
use super::transport::{now_us, AuxSums, Envelope, HostTensor, LayerAux, LayerCoefficients, Msg, Port};
use crate::checkpoint::{self, TrainState};
use crate::config::{CheckpointKill, CheckpointMoment};
use crate::data::Batch;
use crate::error::{Result, TrainError};
use crate::optim::{grad_norm, sum_of_squares, AdamW, Moment};
use disagmoe_models::SaveDtype::F32;
use disagmoe_models::{Recompute, SaveDtype};

/// Message tags of evaluation passes start here (training steps count from 1), so that an
/// evaluation's messages never mix with a step's.
pub const EVAL_PASS_BASE: usize = 1 << 48;

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
    /// Which stages keep only their input in the forward and run it again in the backward.
    pub recompute: Recompute,
    /// Testing: this worker fails at (step, after this many tasks); `true` dies without a word (the
    /// process exits under MPI, the thread ends silently in-process).
    pub fail_at: Option<(usize, usize, bool)>,
    /// Whether workers are processes of their own (then a silent failure ends the process).
    pub own_process: bool,
    /// Test-only fault: `(step, seconds)` this worker spends in its first task of that step.
    pub slow_at: Option<(usize, f64)>,
}

/// What a step measured, the same on every worker after the step's global reduction.
#[derive(Debug, Clone, Default)]
pub struct StepOutcome {
    /// Mean over micro-batches of LM loss + coefficient x aux loss.
    pub loss: f64,
    /// Mean LM loss.
    pub lm_loss: f64,
    /// Mean aux loss (before the coefficient), when on.
    pub aux_loss: Option<f64>,
    /// Mean router z-loss (summed over layers, before the coefficient), when on.
    pub z_loss: Option<f64>,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// The update was skipped (non-finite).
    pub skipped: bool,
    /// Seconds compute streams sat waiting for data (task inputs and the gradient all-reduce),
    /// summed over workers.
    pub exposed_comm_s: f64,
    /// The part of it during which the awaited data was already on the wire (the rest waited for
    /// data a peer had not computed yet).
    pub in_flight_wait_s: f64,
    /// Seconds compute streams computed, summed over workers.
    pub compute_s: f64,
    /// Seconds transfers spent on the (emulated) links, summed over workers.
    pub link_s: f64,
    /// Bytes sent, summed over workers (see [`crate::trainer::StepTiming::bytes_sent`]).
    pub bytes_sent: f64,
    /// Routed copies per expert of every MoE layer, in layer order.
    pub expert_counts: Vec<Vec<usize>>,
    /// Routed copies dropped for capacity per MoE layer.
    pub dropped: Vec<usize>,
    /// Some worker was asked to stop: every worker ends the run after this step.
    pub stop: bool,
}

#[derive(Debug)]
enum Task {
    AttnFwd {
        mb: usize,
        layer: usize,
    },
    Head {
        mb: usize,
    },
    AttnBwd {
        mb: usize,
        layer: usize,
    },
    /// A `Dispatch` from attention worker `src`.
    FfnFwd {
        src: usize,
        dispatch: Msg,
    },
    FfnBwd {
        mb: usize,
        layer: usize,
        g: HostTensor,
    },
}

/// The order of a worker's backward tasks: the head's, and each layer's (attention or experts),
/// micro-batches in increasing order. Every parameter's gradient is then the sum of the same terms
/// in the same order, whatever order the messages arrived in: a run is bit-reproducible (which an
/// exact resume needs). It never deadlocks: the lowest waiting micro-batch of a layer depends only
/// on lower or equal micro-batches.
#[derive(Debug, Default)]
struct BackwardOrder {
    /// (kind, layer) -> micro-batches still to run, in order.
    next: HashMap<(u8, usize), VecDeque<usize>>,
}

impl BackwardOrder {
    const HEAD: u8 = 0;
    const ATTN: u8 = 1;
    const FFN: u8 = 2;

    fn key(task: &Task) -> Option<((u8, usize), usize)> {
        match task {
            Task::Head { mb } => Some(((Self::HEAD, 0), *mb)),
            Task::AttnBwd { mb, layer } => Some(((Self::ATTN, *layer), *mb)),
            Task::FfnBwd { mb, layer, .. } => Some(((Self::FFN, *layer), *mb)),
            Task::AttnFwd { .. } | Task::FfnFwd { .. } => None,
        }
    }

    /// Whether `task` may run now.
    fn allows(&self, task: &Task) -> bool {
        match Self::key(task) {
            Some((key, mb)) => self.next.get(&key).and_then(|q| q.front()) == Some(&mb),
            None => true,
        }
    }

    /// Records that `task` runs.
    fn ran(&mut self, task: &Task) {
        if let Some((key, _)) = Self::key(task) {
            if let Some(q) = self.next.get_mut(&key) {
                q.pop_front();
            }
        }
    }
}

struct SentDispatch {
    holder: usize,
    /// The holder's place in the canonical order of a token's expert terms.
    key: (u64, u64),
    /// The tokens sent to it, ascending.
    tokens: Vec<u32>,
}

/// An attention stage's forward from its input: with its graph (kept for the backward, or run
/// again there under `--recompute attention|full`), or without one (the first forward of a
/// recomputed stage).
struct AttnGraph<B: AutodiffBackend, A: Module<B>, R: Module<B>> {
    stage: AttentionStage<B, A, R>,
    /// Layer 0: the embedding, whose output is the input.
    ends: Option<Ends<B>>,
    /// The input of layers past the first.
    h: Option<Tensor<B, 3>>,
    residual: Tensor<B, 2>,
    /// `[T, M]`: the normed layer output the holders are sent rows of.
    normed: Tensor<B, 2>,
    /// A routed layer's decision under the run's router options.
    routed: Option<Routed<B>>,
}

struct AttnSaved<B: AutodiffBackend, A: Module<B>, R: Module<B>> {
    /// The forward's graph; `None` when the stage is recomputed.
    graph: Option<AttnGraph<B, A, R>>,
    /// A recomputed stage's input (layer 0 recomputes from the token ids).
    input: Option<HostTensor>,
    from: Vec<Share>,
    sent: Vec<SentDispatch>,
}

/// An expert stage's forward on a holder's rows, with or without its graph.
struct FfnGraph<B: AutodiffBackend, X: Module<B>> {
    stage: ExpertStage<B, X>,
    y: Tensor<B, 2>,
    w: Option<Tensor<B, 2>>,
    out: Tensor<B, 2>,
}

/// A recomputed expert stage's input: the rows, their gate weights and expert ids.
struct FfnInput {
    y: HostTensor,
    w: Option<HostTensor>,
    ids: Vec<usize>,
}

struct FfnSaved<B: AutodiffBackend, X: Module<B>> {
    dst: usize,
    rows: usize,
    /// The forward's graph (`None` without rows, or when the stage is recomputed).
    graph: Option<FfnGraph<B, X>>,
    input: Option<FfnInput>,
}

/// The losses of a step's micro-batches, summed (divided by the micro-batches at the end).
#[derive(Debug, Clone, Copy, Default)]
struct StepLosses {
    /// LM loss + coefficient x balance loss.
    total: f64,
    /// LM loss.
    lm: f64,
    /// Balance loss before its coefficient.
    aux: f64,
    /// Router z-loss before its coefficient (summed over layers).
    z: f64,
}

/// What every worker adds up at the end of a step, in one all-reduce.
#[derive(Debug, Clone, Default)]
struct GlobalSums {
    /// Squared gradient norm (each parameter counted once).
    grad_sq: f64,
    /// Losses of the micro-batches.
    losses: StepLosses,
    /// Waits for data, and the part of them with the data on the wire, seconds.
    waits_s: f64,
    wire_s: f64,
    /// Compute and emulated-link time, seconds.
    compute_s: f64,
    link_s: f64,
    /// Bytes sent.
    bytes_sent: f64,
    /// Workers asked to stop (a signal reached their process).
    stop: f64,
    /// Routed copies per expert of every MoE layer (counted by the first copy of its attention
    /// group), layer-major, then the copies each MoE layer dropped for capacity (counted where
    /// they were routed).
    expert_counts: Vec<f64>,
}

impl GlobalSums {
    const FIXED: usize = 11;

    fn to_vec(&self) -> Vec<f64> {
        let l = self.losses;
        let mut v = vec![
            self.grad_sq,
            l.total,
            l.lm,
            l.aux,
            self.waits_s,
            self.wire_s,
            self.compute_s,
            self.link_s,
            self.stop,
            self.bytes_sent,
            l.z,
        ];
        v.extend(&self.expert_counts);
        v
    }

    fn from_vec(v: &[f64]) -> Self {
        Self {
            grad_sq: v[0],
            losses: StepLosses { total: v[1], lm: v[2], aux: v[3], z: v[10] },
            waits_s: v[4],
            wire_s: v[5],
            compute_s: v[6],
            link_s: v[7],
            stop: v[8],
            bytes_sent: v[9],
            expert_counts: v[Self::FIXED..].to_vec(),
        }
    }
}

/// The `i`-th report of every worker's [`Msg::Shards`] (the model's files, then each moment's).
fn nth_reports(gathered: &[Msg], i: usize) -> Vec<ShardReport> {
    gathered.iter().filter_map(|m| if let Msg::Shards(r) = m { r.get(i).cloned() } else { None }).collect()
}

/// A worker and its state within a step.
pub struct Worker<B: AutodiffBackend, A: Module<B>, R: Module<B>, X: Module<B>> {
    rank: usize,
    layout: Layout,
    settings: StepSettings,
    port: Port,
    device: B::Device,
    part: Option<WorkerPart<B, A, R, X>>,
    attn_index: HashMap<usize, usize>,
    ffn_index: HashMap<usize, usize>,
    cos: Tensor<B, 4>,
    sin: Tensor<B, 4>,
    /// Tracing.
    pub tracer: Tracer,
    // Per step.
    step: usize,
    rows: HashMap<usize, Vec<Vec<i64>>>,
    inputs: HashMap<(usize, usize), LayerInput>,
    grad_inputs: HashMap<(usize, usize), GradInput>,
    attn_saved: HashMap<(usize, usize), AttnSaved<B, A, R>>,
    ffn_saved: HashMap<(usize, usize), FfnSaved<B, X>>,
    ready_bwd: VecDeque<Task>,
    ready_ffn: VecDeque<Task>,
    ready_fwd: VecDeque<Task>,
    waiting_mbs: VecDeque<usize>,
    bwd_left: usize,
    order: BackwardOrder,
    grads: GradientsAccumulator<WorkerPart<B, A, R, X>>,
    /// The head's gradients apart (a tied embedding also gets the first layer's: two sums, each in
    /// micro-batch order, added at the end).
    head_grads: GradientsAccumulator<WorkerPart<B, A, R, X>>,
    /// LM and balance loss of each micro-batch whose head ran here.
    mb_losses: Vec<(usize, f64, f64)>,
    counts: HashMap<usize, Vec<usize>>,
    /// Routed copies this worker dropped for capacity this step, by layer.
    dropped: HashMap<usize, usize>,
    losses: StepLosses,
    wait_comm_us: u64,
    wait_bubble_us: u64,
    compute_us: u64,
    link_us: u64,
    /// Bytes sent so far: messages of the token exchange, and each all-reduce as a ring sends it
    /// (2(n-1)/n of the data per member), whatever reduces it.
    bytes_sent: u64,
    tasks_run: usize,
    /// This step's loss scale (f16; 1 otherwise).
    loss_scale: f64,
    later: Vec<Envelope>,
    opt: AdamW<B>,
    /// How this worker's groups sum (ring over the port, or MPI).
    reducer: Reducer,
    /// All-reduces run so far per group (first rank, size): a group's members count alike, so the
    /// count tells one all-reduce's messages from another's.
    reductions: HashMap<(usize, usize), u64>,
    /// Checkpoint name of each parameter this worker holds.
    names: HashMap<ParamId, String>,
    /// Checkpoint name of a layer's feed-forward module.
    ffn_name: &'static str,
}

fn host<B: AutodiffBackend, const D: usize>(t: &Tensor<B, D>) -> HostTensor {
    let data = t.to_data().convert::<f32>();
    HostTensor { shape: data.shape.clone().into(), data: data.to_vec::<f32>().expect("f32 tensor") }
}

/// The gradient of the step's loss with respect to a loss term with coefficient `coef` in a
/// micro-batch's loss, rounded as one device's autodiff rounds it (`total = lm + coef * term`,
/// then `total / micro_batches` when there are several: `f32(1 / K) * f32(coef)` in f32), so the
/// balance and z-loss gradients have the single engine's bits.
fn term_scale(micro_batches: usize, coef: f64) -> f32 {
    if micro_batches > 1 {
        (1.0f32 / micro_batches as f32) * coef as f32
    } else {
        coef as f32
    }
}

fn leaf<B: AutodiffBackend, const D: usize>(h: &HostTensor, device: &B::Device) -> Tensor<B, D> {
    Tensor::<B, D>::from_data(TensorData::new(h.data.clone(), h.shape.clone()), device).require_grad()
}

fn constant<B: AutodiffBackend, const D: usize>(h: &HostTensor, device: &B::Device) -> Tensor<B, D> {
    Tensor::<B, D>::from_data(TensorData::new(h.data.clone(), h.shape.clone()), device)
}

fn index<B: AutodiffBackend>(v: &[u32], device: &B::Device) -> Tensor<B, 1, Int> {
    Tensor::from_data(TensorData::new(v.iter().map(|&i| i as i64).collect::<Vec<_>>(), [v.len()]), device)
}

fn grad_of<B: AutodiffBackend, const D: usize>(
    t: &Option<Tensor<B, D>>,
    grads: &mut B::Gradients,
    shape: &[usize],
) -> HostTensor {
    let g = t.as_ref().and_then(|t| t.grad_remove(grads));
    match g {
        Some(g) => {
            let data = g.into_data().convert::<f32>();
            HostTensor { shape: shape.to_vec(), data: data.to_vec::<f32>().expect("f32 grad") }
        }
        None => HostTensor { shape: shape.to_vec(), data: vec![0.0; shape.iter().product()] },
    }
}

/// The ring all-reduce's link: chunks through the worker's port, tagged by the all-reduce's number.
struct PortRing<'a, B: AutodiffBackend, A: Module<B>, R: Module<B>, X: Module<B>> {
    worker: &'a mut Worker<B, A, R, X>,
    op: u64,
}

impl<B, A, R, X, T> RingLink<T> for PortRing<'_, B, A, R, X>
where
    B: AutodiffBackend,
    A: TrainModule<B> + AttentionLayer<B>,
    R: TrainModule<B> + Router<B>,
    X: TrainModule<B> + Experts<B>,
    T: ReduceValues,
{
    fn send_chunk(&mut self, dst: usize, seq: u64, data: Vec<T>) -> Result<()> {
        self.worker.send(dst, Msg::Reduce { op: self.op, seq, data: T::wrap(data) })
    }

    fn recv_chunk(&mut self, src: usize, seq: u64) -> Result<Vec<T>> {
        let (op, w) = (self.op, &mut *self.worker);
        loop {
            let step = w.step;
            let found = w.later.iter().position(|e| {
                e.src == src && matches!(&e.msg, Msg::Reduce { op: o, seq: s, .. } if *o == op && *s == seq)
            });
            if let Some(pos) = found {
                let Msg::Reduce { data, .. } = w.later.remove(pos).msg else { unreachable!("matched a reduce") };
                return T::unwrap(data).ok_or_else(|| TrainError::Worker {
                    worker: src,
                    cause: format!("sent all-reduce {op} values of another type"),
                });
            }
            let env = w.wait_for_message(|| format!("in an all-reduce of step {step}"))?;
            if let Msg::Abort { worker, cause } = env.msg {
                return Err(TrainError::Worker { worker, cause });
            }
            w.later.push(env);
        }
    }
}

/// Gives every parameter of a module its own autodiff leaf (and moves it to `device`). Workers fork
/// their stage for each task, so the graphs of micro-batches in flight at once share no node: Burn
/// would otherwise join them through the parameters, and a backward of one would disturb another.
/// With `track: false` the parameters are constants: the forward builds no graph (the first
/// forward of a recomputed stage).
pub(crate) struct Fork<'a, B: AutodiffBackend> {
    pub(crate) device: &'a B::Device,
    pub(crate) track: bool,
}

impl<B: AutodiffBackend> ModuleMapper<B> for Fork<'_, B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let require_grad = self.track && tensor.is_require_grad();
        let mut t = Tensor::<B, D>::from_inner(tensor.inner().to_device(self.device));
        if require_grad {
            t = t.require_grad();
        }
        Param::from_mapped_value(id, t, mapper)
    }
}

/// Flattens (and later restores) the gradients of a module's parameters, with presence flags.
struct Flatten<'a> {
    grads: &'a mut GradientsParams,
    out: Vec<f32>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Flatten<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let n: usize = param.val().dims().iter().product();
        match self.grads.get::<B::InnerBackend, D>(param.id) {
            Some(g) => {
                self.out.push(1.0);
                self.out.extend(g.into_data().convert::<f32>().to_vec::<f32>().expect("f32"));
            }
            None => {
                self.out.push(0.0);
                self.out.extend(std::iter::repeat_n(0.0, n));
            }
        }
    }
}

/// Gives parameters without a gradient a zero one (fused expert shards that saw no token).
struct ZeroFill<'a> {
    grads: &'a mut GradientsParams,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for ZeroFill<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if self.grads.get::<B::InnerBackend, D>(param.id).is_none() {
            let v = param.val();
            self.grads.register::<B::InnerBackend, D>(param.id, Tensor::zeros(v.dims(), &v.device()));
        }
    }
}

struct Restore<'a> {
    grads: &'a mut GradientsParams,
    data: &'a [f32],
    pos: usize,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Restore<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let shape = param.val().dims();
        let n: usize = shape.iter().product();
        let present = self.data[self.pos] > 0.0;
        let values: Vec<f32> = self.data[self.pos + 1..self.pos + 1 + n].to_vec();
        self.pos += 1 + n;
        self.grads.remove::<B::InnerBackend, D>(param.id);
        if present {
            let device = param.val().device();
            let t = Tensor::<B::InnerBackend, D>::from_data(TensorData::new(values, shape), &device);
            self.grads.register::<B::InnerBackend, D>(param.id, t);
        }
    }
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
        self.rank
    }

    /// A worker holding `part` (whose parameters are named in checkpoints under a feed-forward
    /// module `ffn_name`), with RoPE tables for the run's sequence length.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        layout: Layout,
        settings: StepSettings,
        port: Port,
        reducer: Reducer,
        part: WorkerPart<B, A, R, X>,
        ffn_name: &'static str,
        (cos, sin): (Tensor<B, 4>, Tensor<B, 4>),
        device: B::Device,
        trace: bool,
        opt: AdamW<B>,
    ) -> Self {
        let rank = port.rank();
        let names = part.names(&layout, rank, ffn_name);
        let attn_index = layout.attn_layers(rank).into_iter().enumerate().map(|(i, l)| (l, i)).collect();
        let ffn_index = layout.ffn_layers(rank).into_iter().enumerate().map(|(i, (l, _))| (l, i)).collect();
        Self {
            rank,
            tracer: Tracer::new(trace, rank),
            layout,
            settings,
            port,
            device,
            part: Some(part),
            attn_index,
            ffn_index,
            cos,
            sin,
            step: 0,
            rows: HashMap::new(),
            inputs: HashMap::new(),
            grad_inputs: HashMap::new(),
            attn_saved: HashMap::new(),
            ffn_saved: HashMap::new(),
            ready_bwd: VecDeque::new(),
            ready_ffn: VecDeque::new(),
            ready_fwd: VecDeque::new(),
            waiting_mbs: VecDeque::new(),
            bwd_left: 0,
            order: BackwardOrder::default(),
            grads: GradientsAccumulator::new(),
            head_grads: GradientsAccumulator::new(),
            mb_losses: Vec::new(),
            counts: HashMap::new(),
            dropped: HashMap::new(),
            losses: StepLosses::default(),
            wait_comm_us: 0,
            wait_bubble_us: 0,
            compute_us: 0,
            link_us: 0,
            bytes_sent: 0,
            tasks_run: 0,
            loss_scale: 1.0,
            later: Vec::new(),
            opt,
            reducer,
            reductions: HashMap::new(),
            names,
            ffn_name,
        }
    }

    fn part(&self) -> &WorkerPart<B, A, R, X> {
        self.part.as_ref().expect("the part is only taken during the optimizer step")
    }

    fn send(&mut self, dst: usize, msg: Msg) -> Result<()> {
        let (kind, at, bytes) = (msg.kind(), msg.at(), msg.payload_bytes() as u64);
        // The token exchange (the messages of a micro-batch and layer) to other workers (a message
        // to oneself never leaves; all-reduces are counted by `all_reduce`, whatever carries them).
        if at.is_some() && dst != self.rank {
            self.bytes_sent += bytes;
        }
        let (sent, delivered, wire) = self.port.send(dst, self.step, msg)?;
        self.link_us += wire;
        let name = || match at {
            Some((mb, layer)) => format!("{kind} L{layer} mb{mb} -> {dst}"),
            None => format!("{kind} -> {dst}"),
        };
        self.tracer.span_bytes(name, "send", COMM, sent, delivered, bytes);
        Ok(())
    }

    /// Runs one pass over `batch` (the step's whole batch; each worker uses its micro-batches;
    /// workers without the embedding may pass an empty slice): forward and backward of every
    /// micro-batch, the global sums, and (when `update`) the gradient reduction and the optimizer
    /// step with learning rate `lr`; returns the pass's global outcome. A pass without `update` is
    /// an evaluation: the model is left as it was and the outcome's losses are the batch's. `step`
    /// tags the pass's messages: training steps from 1, evaluations from [`EVAL_PASS_BASE`].
    pub fn run_step(
        &mut self,
        step: usize,
        batch: &Batch,
        lr: f64,
        loss_scale: f64,
        stop: bool,
        update: bool,
    ) -> Result<StepOutcome> {
        self.step = step;
        self.loss_scale = loss_scale;
        self.tasks_run = 0;
        let start = [self.wait_comm_us, self.wait_bubble_us, self.compute_us, self.link_us, self.bytes_sent];
        let mine = self.layout.own_micro_batches(self.rank);
        let rows_per = self.settings.mb_rows;
        // Only this worker's micro-batches' windows are read.
        self.rows =
            mine.iter().map(|&m| Ok((m, batch.rows(m * rows_per..(m + 1) * rows_per)?))).collect::<Result<_>>()?;
        // Backward tasks this worker will run: one per (owned micro-batch, held attention layer) and
        // per (micro-batch, held expert layer); the head's backward is part of its task.
        let attn_tasks: usize = (0..self.layout.micro_batches)
            .map(|m| self.attn_index.keys().filter(|&&l| self.layout.attn_worker(m, l) == self.rank).count())
            .sum();
        self.bwd_left = attn_tasks + self.layout.micro_batches * self.ffn_index.len();
        let all_mbs = 0..self.layout.micro_batches;
        let mut next = HashMap::new();
        next.insert(
            (BackwardOrder::HEAD, 0),
            all_mbs.clone().filter(|&m| self.layout.head_worker(m) == self.rank).collect(),
        );
        for &l in self.attn_index.keys() {
            let mine = all_mbs.clone().filter(|&m| self.layout.attn_worker(m, l) == self.rank).collect();
            next.insert((BackwardOrder::ATTN, l), mine);
        }
        for &l in self.ffn_index.keys() {
            next.insert((BackwardOrder::FFN, l), all_mbs.clone().collect());
        }
        self.order = BackwardOrder { next };
        let in_flight = self.settings.in_flight.max(1);
        self.waiting_mbs = mine.into_iter().collect();
        for _ in 0..in_flight.min(self.waiting_mbs.len()) {
            if let Some(m) = self.waiting_mbs.pop_front() {
                self.ready_fwd.push_back(Task::AttnFwd { mb: m, layer: 0 });
            }
        }
        for env in std::mem::take(&mut self.later) {
            self.accept(env)?;
        }
        while self.bwd_left > 0 {
            while let Some(env) = self.port.recv(Duration::ZERO)? {
                self.accept(env)?;
            }
            let task = self
                .ready_bwd
                .iter()
                .position(|t| self.order.allows(t))
                .and_then(|i| self.ready_bwd.remove(i))
                .or_else(|| self.ready_ffn.pop_front())
                .or_else(|| self.ready_fwd.pop_front());
            match task {
                Some(task) => self.run_task(task)?,
                None => {
                    let env = self.wait_for_message(|| format!("at step {step}"))?;
                    self.accept(env)?;
                }
            }
        }
        self.end_of_step(lr, start, stop, update)
    }

    fn accept(&mut self, env: Envelope) -> Result<()> {
        if let Msg::Abort { worker, cause } = env.msg {
            return Err(TrainError::Worker { worker, cause });
        }
        if env.step != self.step || matches!(env.msg, Msg::Reduce { .. }) {
            self.later.push(env);
            return Ok(());
        }
        self.admit(&env)?;
        let src = env.src;
        match env.msg {
            Msg::Dispatch { mb, layer, tokens, y, weights, ids } => {
                let dispatch = Msg::Dispatch { mb, layer, tokens, y, weights, ids };
                self.ready_ffn.push_back(Task::FfnFwd { src, dispatch })
            }
            Msg::GradCombine { mb, layer, g } => self.ready_bwd.push_back(Task::FfnBwd { mb, layer, g }),
            Msg::Combine { mb, layer, tokens, out } => {
                let key = self.holder_key(layer, src);
                self.inputs.entry((mb, layer + 1)).or_default().partials.push(Partial {
                    holder: src,
                    key,
                    tokens,
                    out,
                });
                self.check_input(mb, layer + 1);
            }
            Msg::Residual { mb, layer, x, aux } => {
                self.inputs.entry((mb, layer + 1)).or_default().residual = Some(ResidualIn { x, aux });
                self.check_input(mb, layer + 1);
            }
            Msg::GradResidual { mb, layer, g, aux_coef } => {
                self.grad_inputs.entry((mb, layer)).or_default().residual = Some(GradResidualIn { g, aux_coef });
                self.check_grad_input(mb, layer);
            }
            Msg::GradDispatch { mb, layer, gy, gw } => {
                self.grad_inputs.entry((mb, layer)).or_default().dispatch.push(DispatchGrad { holder: src, gy, gw });
                self.check_grad_input(mb, layer);
            }
            Msg::Trace(_)
            | Msg::Shards(_)
            | Msg::Shutdown
            | Msg::Heartbeat { .. }
            | Msg::Reduce { .. }
            | Msg::Abort { .. } => {}
        }
        Ok(())
    }

    /// Refuses a message of this step that does not fit the run (a micro-batch, layer or token
    /// beyond the layout's, or a sender that is not a worker), naming its sender, before anything
    /// indexes with it.
    fn admit(&self, env: &Envelope) -> Result<()> {
        let (mbs, layers, tokens) =
            (self.layout.micro_batches, self.layout.layers, self.settings.mb_rows * self.settings.seq);
        let bad = |what: String| {
            Err(TrainError::Worker {
                worker: self.rank(),
                cause: format!("a message from worker {} cannot be taken: {what}", env.src),
            })
        };
        if env.src >= self.layout.workers {
            return bad(format!("no worker {} in a run of {}", env.src, self.layout.workers));
        }
        let (mb, layer, ids) = match &env.msg {
            Msg::Dispatch { mb, layer, tokens, .. } | Msg::Combine { mb, layer, tokens, .. } => {
                (*mb, *layer, Some(tokens))
            }
            Msg::Residual { mb, layer, .. }
            | Msg::GradCombine { mb, layer, .. }
            | Msg::GradResidual { mb, layer, .. }
            | Msg::GradDispatch { mb, layer, .. } => (*mb, *layer, None),
            _ => return Ok(()),
        };
        if mb >= mbs || layer >= layers {
            return bad(format!(
                "{} of micro-batch {mb}, layer {layer} (the run has {mbs} and {layers})",
                env.msg.kind()
            ));
        }
        if let Some(&t) = ids.and_then(|ids| ids.iter().find(|&&t| t as usize >= tokens)) {
            return bad(format!("{} names token {t} of a micro-batch of {tokens}", env.msg.kind()));
        }
        Ok(())
    }

    fn check_input(&mut self, mb: usize, layer: usize) {
        let holders = self.layout.ffn_holders(layer - 1).len();
        if let Some(inp) = self.inputs.get(&(mb, layer)) {
            if inp.complete(holders) {
                let task = if layer == self.layout.layers { Task::Head { mb } } else { Task::AttnFwd { mb, layer } };
                if layer == self.layout.layers {
                    self.ready_bwd.push_back(task);
                } else {
                    self.ready_fwd.push_back(task);
                }
            }
        }
    }

    fn check_grad_input(&mut self, mb: usize, layer: usize) {
        let holders = self.layout.ffn_holders(layer).len();
        if let Some(inp) = self.grad_inputs.get(&(mb, layer)) {
            if inp.complete(holders) {
                self.ready_bwd.push_back(Task::AttnBwd { mb, layer });
            }
        }
    }

    fn run_task(&mut self, task: Task) -> Result<()> {
        if let Some((_, at, silent)) = self.settings.fail_at.filter(|(s, _, _)| *s == self.step) {
            if self.tasks_run >= at {
                if silent && self.settings.own_process {
                    eprintln!("worker {}: ending the process mid-step on purpose (fault injection)", self.rank);
                    std::process::exit(3);
                }
                return Err(TrainError::Worker {
                    worker: self.rank,
                    cause: format!(
                        "{} at step {} (fault injection)",
                        if silent { "stopped without a word" } else { "failed on purpose" },
                        self.step
                    ),
                });
            }
        }
        if let Some((_, seconds)) = self.settings.slow_at.filter(|(s, _)| *s == self.step && self.tasks_run == 0) {
            eprintln!("worker {}: computing for {seconds} s on purpose (fault injection)", self.rank);
            std::thread::sleep(Duration::from_secs_f64(seconds));
        }
        self.tasks_run += 1;
        self.order.ran(&task);
        let t0 = now_us();
        let (name, cat) = match task {
            Task::AttnFwd { mb, layer } => {
                self.attention_forward(mb, layer)?;
                (format!("fwd attn L{layer} mb{mb}"), "forward")
            }
            Task::Head { mb } => {
                self.head(mb)?;
                (format!("head mb{mb}"), "backward")
            }
            Task::AttnBwd { mb, layer } => {
                self.attention_backward(mb, layer)?;
                (format!("bwd attn L{layer} mb{mb}"), "backward")
            }
            Task::FfnFwd { src, dispatch } => {
                let Msg::Dispatch { mb, layer, .. } = dispatch else { unreachable!("expert tasks hold dispatches") };
                self.ffn_forward(src, dispatch)?;
                (format!("fwd experts L{layer} mb{mb}"), "forward")
            }
            Task::FfnBwd { mb, layer, g } => {
                self.ffn_backward(mb, layer, g)?;
                (format!("bwd experts L{layer} mb{mb}"), "backward")
            }
        };
        let t1 = now_us();
        self.compute_us += t1 - t0;
        self.tracer.span(|| name, cat, COMPUTE, t0, t1);
        Ok(())
    }

    /// The hidden state entering `layer` (or the head when `layer == layers`): residual plus every
    /// holder's share (N2M, [`LayerInput::assemble`]).
    fn assemble(&mut self, mb: usize, layer: usize) -> Assembled {
        self.inputs.remove(&(mb, layer)).expect("ready input").assemble()
    }

    /// A layer input `[T, M]` as `[B, S, M]`: a leaf, or a constant (`track: false`).
    fn hidden(&self, h: HostTensor, track: bool) -> Tensor<B, 3> {
        let m = *h.shape.last().expect("[T, M]");
        let (b, s) = (self.settings.mb_rows, self.settings.seq);
        let t = Tensor::<B, 3>::from_data(TensorData::new(h.data, [b, s, m]), &self.device);
        if track {
            t.require_grad()
        } else {
            t
        }
    }

    /// Attention stage `layer` of micro-batch `mb` on `input` (layer 0: `None`, the token ids'
    /// embedding), with its graph or without (`track`), and a routed layer's decision.
    fn attend(&self, mb: usize, layer: usize, input: Option<HostTensor>, track: bool) -> Result<AttnGraph<B, A, R>> {
        let device = self.device.clone();
        let fork = &mut Fork { device: &device, track };
        let past_first = input.is_some();
        let (h, ends) = match input {
            None => {
                let ends = self.part().ends.clone().expect("the embedding worker holds the ends").map(fork);
                (ends.embed(self.ids(mb)?), Some(ends))
            }
            Some(h) => (self.hidden(h, track), None),
        };
        let stage = self.part().attention[self.attn_index[&layer]].clone().map(fork);
        let out = stage.forward(h.clone(), self.cos.clone(), self.sin.clone());
        let routed = match (out.route, stage.top_k()) {
            (Some(decision), Some(k)) => {
                Some(self.settings.routing.route(decision, self.settings.mb_rows, self.layout.experts, k))
            }
            _ => None,
        };
        let h = past_first.then_some(h);
        Ok(AttnGraph { stage, ends, h, residual: out.residual, normed: out.normed, routed })
    }

    fn attention_forward(&mut self, mb: usize, layer: usize) -> Result<()> {
        let (mut input, mut aux, from) = if layer == 0 {
            (None, AuxSums::default(), Vec::new())
        } else {
            let Assembled { h, aux, from } = self.assemble(mb, layer);
            (Some(h), aux, from)
        };
        let recompute = self.settings.recompute.attention();
        // A recomputed stage keeps its input for the backward; a kept one hands it over.
        let first = if recompute { input.clone() } else { input.take() };
        let out = self.attend(mb, layer, first, !recompute)?;
        let holders = self.layout.ffn_holders(layer);
        let [t, m] = out.normed.dims();
        let mut sent = Vec::with_capacity(holders.len());
        let mut msgs = Vec::with_capacity(holders.len());
        match &out.routed {
            Some(Routed { route, stats, kept }) => {
                let (e, k) = (self.layout.experts, out.stage.top_k().expect("a routed layer has a top-k"));
                // The decision's statistics per sequence: the load metrics, the aux-loss-free bias
                // update, (carried to the head) the balance loss, the copies dropped for capacity,
                // and the z-loss (its value joins the step's loss here, its gradient this layer's
                // backward).
                if let Some(loss) = &stats.z_loss {
                    let value = loss.to_data().convert::<f64>().to_vec::<f64>().expect("f64")[0];
                    self.losses.z += value;
                    self.losses.total += self.settings.routing.z_loss_coef * value;
                }
                *self.dropped.entry(layer).or_default() += stats.dropped;
                if self.settings.aux.is_some() {
                    let host_ps: Vec<f32> = stats.prob_sum.to_data().convert::<f32>().to_vec().expect("f32");
                    aux.layers.push(LayerAux {
                        layer,
                        routing: stats.routing.clone(),
                        prob_sum: host_ps.iter().map(|&x| x as f64).collect(),
                    });
                }
                let acc = self.counts.entry(layer).or_insert_with(|| vec![0; e]);
                for (a, c) in acc.iter_mut().zip(&stats.counts) {
                    *a += c;
                }
                // M2N: each token once to each holder of one of its experts it computes (the copies
                // dropped for capacity go to no holder).
                let ranges: Vec<_> =
                    holders.iter().enumerate().map(|(i, &h)| (h, self.layout.expert_range(i))).collect();
                // The shares are host messages: the ids come to the host here (on CubeCL
                // backends the router chose them on the device).
                let kept = kept.to_host();
                let shares = m2n_shares(&kept, k, t, &ranges, self.holds_all_tokens(layer));
                // (One share per holder, in the order of `ranges`.)
                for (share, (_, range)) in shares.into_iter().zip(&ranges) {
                    let ids = share.ids(&kept, k);
                    let Share { holder, tokens } = share;
                    let key = range_key(range);
                    if tokens.is_empty() {
                        sent.push(SentDispatch { holder, key, tokens: Vec::new() });
                        let (y, weights) = (empty(m), Some(empty(k)));
                        msgs.push((holder, Msg::Dispatch { mb, layer, tokens, y, weights, ids }));
                        continue;
                    }
                    let idx = index::<B>(&tokens, &self.device);
                    let y = host(&out.normed.clone().select(0, idx.clone()));
                    let weights = Some(host(&route.weights.clone().select(0, idx)));
                    msgs.push((holder, Msg::Dispatch { mb, layer, tokens: tokens.clone(), y, weights, ids }));
                    sent.push(SentDispatch { holder, key, tokens });
                }
            }
            None => {
                // A dense layer: every token goes to the first holder, none to the others.
                for (i, Share { holder, tokens }) in dense_shares(t, &holders).into_iter().enumerate() {
                    let y = if tokens.is_empty() { empty(m) } else { host(&out.normed) };
                    let key = range_key(&self.layout.expert_range(i));
                    sent.push(SentDispatch { holder, key, tokens: tokens.clone() });
                    msgs.push((holder, Msg::Dispatch { mb, layer, tokens, y, weights: None, ids: vec![] }));
                }
            }
        }
        for (dst, msg) in msgs {
            self.send(dst, msg)?;
        }
        let next = self.next_attn_worker(mb, layer);
        self.send(next, Msg::Residual { mb, layer, x: host(&out.residual), aux })?;
        let saved = if recompute {
            AttnSaved { graph: None, input, from, sent }
        } else {
            AttnSaved { graph: Some(out), input: None, from, sent }
        };
        self.attn_saved.insert((mb, layer), saved);
        Ok(())
    }

    /// Where holder `holder`'s share of `layer` sits in the canonical order of a token's expert
    /// terms: the key of its expert range.
    fn holder_key(&self, layer: usize, holder: usize) -> (u64, u64) {
        let index = self.layout.ffn_holders(layer).iter().position(|&h| h == holder).expect("a holder of the layer");
        range_key(&self.layout.expert_range(index))
    }

    /// Whether the first holder of `layer` needs every token (it holds shared experts).
    fn holds_all_tokens(&self, layer: usize) -> bool {
        self.layout.shared_experts.get(layer).copied().unwrap_or(false)
    }

    fn next_attn_worker(&self, mb: usize, layer: usize) -> usize {
        if layer + 1 == self.layout.layers {
            self.layout.head_worker(mb)
        } else {
            self.layout.attn_worker(mb, layer + 1)
        }
    }

    fn ids(&self, mb: usize) -> Result<Tensor<B, 2, Int>> {
        let rows = &self.rows[&mb];
        let flat: Vec<i64> = rows.iter().flatten().copied().collect();
        Ok(Tensor::from_data(TensorData::new(flat, [rows.len(), self.settings.seq]), &self.device))
    }

    /// Expert stage `layer` on a holder's rows, with its graph or without (`track`).
    fn expert(&self, layer: usize, input: &FfnInput, track: bool) -> FfnGraph<B, X> {
        let device = self.device.clone();
        let stage = self.part().experts[self.ffn_index[&layer]].clone().map(&mut Fork { device: &device, track });
        let input_tensor = |h: &HostTensor| {
            if track {
                leaf::<B, 2>(h, &self.device)
            } else {
                constant::<B, 2>(h, &self.device)
            }
        };
        let y = input_tensor(&input.y);
        let w = input.w.as_ref().map(input_tensor);
        let out = stage.forward(y.clone(), w.clone(), &input.ids);
        FfnGraph { stage, y, w, out }
    }

    /// Runs this holder's share of a layer on a `Dispatch` from attention worker `src`.
    fn ffn_forward(&mut self, src: usize, dispatch: Msg) -> Result<()> {
        let Msg::Dispatch { mb, layer, tokens, y, weights: w, ids } = dispatch else {
            unreachable!("expert tasks hold dispatches")
        };
        let rows = tokens.len();
        let dst = self.next_attn_worker(mb, layer);
        let m = y.shape.last().copied().unwrap_or(0);
        if rows == 0 {
            self.ffn_saved.insert((mb, layer), FfnSaved { dst: src, rows, graph: None, input: None });
            return self.send(dst, Msg::Combine { mb, layer, tokens, out: empty(m) });
        }
        let input = FfnInput { y, w, ids: ids.iter().map(|&e| e as usize).collect() };
        let recompute = self.settings.recompute.experts();
        let graph = self.expert(layer, &input, !recompute);
        self.send(dst, Msg::Combine { mb, layer, tokens, out: host(&graph.out) })?;
        let saved = if recompute {
            FfnSaved { dst: src, rows, graph: None, input: Some(input) }
        } else {
            FfnSaved { dst: src, rows, graph: Some(graph), input: None }
        };
        self.ffn_saved.insert((mb, layer), saved);
        Ok(())
    }

    /// Adds the gradients of `module`'s parameters (a forked piece of the part) to the step's.
    fn accumulate<M: AutodiffModule<B>>(&mut self, grads: &mut B::Gradients, module: &M) {
        let params = GradientsParams::from_module(grads, module);
        self.grads.accumulate(self.part.as_ref().expect("part"), params);
    }

    fn ffn_backward(&mut self, mb: usize, layer: usize, g: HostTensor) -> Result<()> {
        let saved = self.ffn_saved.remove(&(mb, layer)).expect("expert forward before backward");
        let m = g.shape.last().copied().unwrap_or(0);
        let graph = match (saved.graph, &saved.input) {
            (Some(graph), _) => Some(graph),
            (None, Some(input)) => Some(self.expert(layer, input, true)),
            (None, None) => None,
        };
        let (gy, gw) = match graph {
            None => (empty(m), None),
            Some(FfnGraph { stage, y, w, out }) => {
                let g = constant::<B, 2>(&g, &self.device);
                let mut grads = (out * g).sum().backward();
                let gy = grad_of(&Some(y), &mut grads, &[saved.rows, m]);
                let gw = w.map(|w| {
                    let shape = w.dims().to_vec();
                    grad_of(&Some(w), &mut grads, &shape)
                });
                self.accumulate(&mut grads, &stage);
                (gy, gw)
            }
        };
        self.bwd_left -= 1;
        self.send(saved.dst, Msg::GradDispatch { mb, layer, gy, gw })
    }

    /// Sends the gradient of a layer input `h` back (the mirror of N2M): all of it to the previous
    /// attention worker (the residual), each holder's rows to that holder.
    fn send_input_grad(
        &mut self,
        mb: usize,
        layer: usize,
        gh: HostTensor,
        from: &[Share],
        aux_coef: Vec<LayerCoefficients>,
    ) -> Result<()> {
        for share in from {
            self.send(share.holder, Msg::GradCombine { mb, layer: layer - 1, g: rows_of(&gh, &share.tokens) })?;
        }
        let prev = self.layout.attn_worker(mb, layer - 1);
        let m = *gh.shape.last().expect("[B, S, M]");
        let g = HostTensor { shape: vec![gh.data.len() / m, m], data: gh.data };
        self.send(prev, Msg::GradResidual { mb, layer: layer - 1, g, aux_coef })
    }

    fn head(&mut self, mb: usize) -> Result<()> {
        let layers = self.layout.layers;
        let Assembled { h, aux, from } = self.assemble(mb, layers);
        let h = self.hidden(h, true);
        let ids = self.ids(mb)?;
        let mbs = self.layout.micro_batches as f64;
        let device = self.device.clone();
        let ends = self
            .part()
            .ends
            .clone()
            .expect("the head worker holds the ends")
            .map(&mut Fork { device: &device, track: true });
        let ce = next_token_cross_entropy(ends.logits(h.clone()), ids);
        let lm: f64 = ce.to_data().convert::<f64>().to_vec::<f64>().expect("f64")[0];
        // The balance loss from the sums carried along the layers (its one definition, in
        // `disagmoe_models::balance`), and each layer's coefficients as the gradient of its sums.
        let (aux_loss, aux_coef) = match (&self.settings.aux, aux.layers.is_empty()) {
            (Some(a), false) => {
                let routing: Vec<_> = aux.layers.iter().map(|l| l.routing.clone()).collect();
                let sums: Vec<Vec<f64>> = aux.layers.iter().map(|l| l.prob_sum.clone()).collect();
                let coefficients = a.kind.coefficients(&routing);
                let loss = a.kind.value(&routing, &sums);
                let per_layer = aux
                    .layers
                    .iter()
                    .zip(coefficients)
                    .map(|(l, c)| LayerCoefficients {
                        layer: l.layer,
                        values: {
                            let scale = term_scale(self.layout.micro_batches, a.coef) * self.loss_scale as f32;
                            c.iter().map(|&x| scale * x as f32).collect()
                        },
                    })
                    .collect();
                (loss, per_layer)
            }
            _ => (0.0, Vec::new()),
        };
        self.mb_losses.push((mb, lm, aux_loss));
        let ce = ce.div_scalar(mbs);
        let mut grads = if self.loss_scale != 1.0 { ce.mul_scalar(self.loss_scale) } else { ce }.backward();
        let shape = h.dims().to_vec();
        let gh = grad_of(&Some(h), &mut grads, &shape);
        let params = GradientsParams::from_module(&mut grads, &ends);
        self.head_grads.accumulate(self.part.as_ref().expect("part"), params);
        self.send_input_grad(mb, layers, gh, &from, aux_coef)
    }

    fn attention_backward(&mut self, mb: usize, layer: usize) -> Result<()> {
        let saved = self.attn_saved.remove(&(mb, layer)).expect("attention forward before backward");
        let inp = self.grad_inputs.remove(&(mb, layer)).expect("ready grads");
        let GradResidualIn { g: g_res, aux_coef } = inp.residual.expect("grad residual");
        let graph = match saved.graph {
            Some(graph) => graph,
            None => self.attend(mb, layer, saved.input, true)?,
        };
        let mut objective = (graph.residual.clone() * constant::<B, 2>(&g_res, &self.device)).sum();
        let mut dispatch = inp.dispatch;
        dispatch.sort_by_key(|d| d.holder);
        // The gradient of the normed output: the holders' input gradients added token by token in
        // the canonical order (one device's permute backward adds a token's copies that way).
        let [t, m] = graph.normed.dims();
        let mut g_normed = HostTensor { shape: vec![t, m], data: vec![0.0; t * m] };
        let sent_to = |holder: usize| saved.sent.iter().find(|s| s.holder == holder).expect("a dispatch per holder");
        let rows: Vec<HolderRows> = dispatch
            .iter()
            .map(|d| {
                let sent = sent_to(d.holder);
                HolderRows { key: sent.key, tokens: &sent.tokens, rows: &d.gy.data }
            })
            .collect();
        add_token_sums(&mut g_normed.data, m, &rows);
        objective = objective + (graph.normed.clone() * constant::<B, 2>(&g_normed, &self.device)).sum();
        if let Some(Routed { route, stats, .. }) = &graph.routed {
            for DispatchGrad { holder, gw, .. } in dispatch {
                let tokens = &sent_to(holder).tokens;
                if let (false, Some(gw)) = (tokens.is_empty(), gw) {
                    let w = route.weights.clone().select(0, index::<B>(tokens, &self.device));
                    objective = objective + (w * constant::<B, 2>(&gw, &self.device)).sum();
                }
            }
            let coefficients = aux_coef.iter().find(|c| c.layer == layer).filter(|_| self.settings.aux.is_some());
            if let Some(c) = coefficients {
                let [b, e] = stats.prob_sum.dims();
                let c = Tensor::<B, 2>::from_data(TensorData::new(c.values.clone(), [b, e]), &self.device);
                objective = objective + (stats.prob_sum.clone() * c).sum();
            }
        }
        if let Some(z) = graph.routed.as_ref().and_then(|r| r.stats.z_loss.as_ref()) {
            let scale =
                term_scale(self.layout.micro_batches, self.settings.routing.z_loss_coef) * self.loss_scale as f32;
            objective = objective + z.clone().mul_scalar(scale as f64);
        }
        let mut grads = objective.backward();
        let gh = graph.h.as_ref().map(|h| {
            let shape = h.dims().to_vec();
            grad_of(&Some(h.clone()), &mut grads, &shape)
        });
        self.accumulate(&mut grads, &graph.stage);
        if let Some(ends) = &graph.ends {
            self.accumulate(&mut grads, ends);
        }
        self.bwd_left -= 1;
        match gh {
            Some(gh) => self.send_input_grad(mb, layer, gh, &saved.from, aux_coef)?,
            None => {
                // Layer 0: the embedding's gradient is already in `grads`; this micro-batch is done,
                // so the next one starts.
                if let Some(next) = self.waiting_mbs.pop_front() {
                    self.ready_fwd.push_back(Task::AttnFwd { mb: next, layer: 0 });
                }
            }
        }
        Ok(())
    }

    /// Sums `data` over `group` in place with this worker's reducer (every member ends with the
    /// same bits). A new all-reduce number tells its messages apart from any other's.
    fn all_reduce<T: ReduceValues>(&mut self, group: &[usize], data: &mut [T]) -> Result<()> {
        if group.len() <= 1 {
            return Ok(());
        }
        let n = group.len();
        self.bytes_sent += (2 * (n - 1) * data.len() * std::mem::size_of::<T>() / n) as u64;
        let count = self.reductions.entry((group[0], group.len())).or_insert(0);
        *count += 1;
        let op = ((group[0] as u64) << 48) | ((group.len() as u64) << 32) | *count;
        match &self.reducer {
            Reducer::Ring => {
                let chunk = max_chunk_elements(std::mem::size_of::<T>());
                let me = self.rank;
                ring_all_reduce(&mut PortRing { worker: self, op }, group, me, data, chunk)
            }
            // Blocked on the peers inside the collective: not busy (see `Port`'s heartbeat).
            #[cfg(feature = "mpi")]
            Reducer::Mpi(groups) => self.port.pulse().waiting(|| T::mpi_all_reduce(groups, group, data)),
            #[cfg(feature = "nccl")]
            Reducer::Nccl(groups) => self.port.pulse().waiting(|| T::nccl_all_reduce(groups, group, data)),
        }
    }

    /// Waits for the next message, counting the wait as exposed communication (the part after the
    /// message was sent as time on the wire); a worker that hears nothing for the time-out stops.
    fn wait_for_message(&mut self, at: impl FnOnce() -> String) -> Result<Envelope> {
        let t0 = now_us();
        let env = self.port.recv(self.settings.timeout)?.ok_or_else(|| TrainError::Stalled {
            worker: self.rank,
            seconds: self.settings.timeout.as_secs_f64(),
            at: at(),
        })?;
        let t1 = now_us();
        let in_flight_from = env.sent_us.clamp(t0, t1);
        self.wait_comm_us += t1 - in_flight_from;
        self.wait_bubble_us += in_flight_from - t0;
        self.tracer.span(|| format!("wait ({})", env.msg.kind()), "wait", COMPUTE, t0, t1);
        Ok(env)
    }

    fn end_of_step(&mut self, lr: f64, start: [u64; 5], stop: bool, update: bool) -> Result<StepOutcome> {
        let t0 = now_us();
        let mut grads = {
            let part = self.part.as_ref().expect("part");
            let (body, head) = (self.grads.grads(), self.head_grads.grads());
            let mut sum = GradientsAccumulator::<WorkerPart<B, A, R, X>>::new();
            sum.accumulate(part, body);
            sum.accumulate(part, head);
            sum.grads()
        };
        // Losses of this worker's micro-batches, added in micro-batch order.
        self.mb_losses.sort_by_key(|&(mb, _, _)| mb);
        let coef = self.settings.aux.map_or(0.0, |a| a.coef);
        for (_, lm, aux) in self.mb_losses.drain(..) {
            self.losses.total += lm + coef * aux;
            self.losses.lm += lm;
            self.losses.aux += aux;
        }
        let replicas = self.layout.replicas(self.rank);
        let mut routed: Vec<usize> = self.attn_index.keys().copied().collect();
        routed.sort_unstable();
        let e = self.layout.experts;
        // 1. Copies of the attention side add their gradients and their routers' expert counts
        //    (not for an evaluation: nothing is updated).
        if replicas.len() > 1 && update {
            // f32 gradients with a presence flag per parameter, then the routers' counts.
            let part = self.part.as_ref().expect("part");
            let mut flat = Flatten { grads: &mut grads, out: Vec::new() };
            part.ends.visit(&mut flat);
            part.attention.visit(&mut flat);
            let mut data = flat.out;
            for l in &routed {
                let c = self.counts.get(l).cloned().unwrap_or_else(|| vec![0; e]);
                data.extend(c.iter().map(|&x| x as f32));
            }
            self.all_reduce(&replicas, &mut data)?;
            let part = self.part.as_ref().expect("part");
            let mut restore = Restore { grads: &mut grads, data: &data, pos: 0 };
            part.ends.visit(&mut restore);
            part.attention.visit(&mut restore);
            let mut pos = restore.pos;
            for l in &routed {
                if self.counts.contains_key(l) || data[pos..pos + e].iter().any(|&x| x > 0.0) {
                    self.counts.insert(*l, data[pos..pos + e].iter().map(|&x| x.round() as usize).collect());
                }
                pos += e;
            }
        }
        // A fused expert tensor is stepped whenever its layer saw tokens, on every holder.
        let part = self.part.as_ref().expect("part");
        for stage in &part.experts {
            if let Some(x) = stage.experts.as_ref().filter(|x| x.fused()) {
                x.visit(&mut ZeroFill { grads: &mut grads });
            }
        }
        // 2. One global sum: squared gradient norm (each parameter once), losses, timings.
        let mut norms = vec![grad_norm::<B, _>(&part.experts, &grads)];
        if replicas.first() == Some(&self.rank) {
            norms.push(grad_norm::<B, _>(&part.ends, &grads));
            norms.push(grad_norm::<B, _>(&part.attention, &grads));
        }
        let sq: f64 = norms.iter().map(|n| n.total.powi(2)).sum();
        // The first tensor of this worker whose gradient is not finite, for the error message.
        let bad = norms
            .iter()
            .flat_map(|n| n.per_param.iter())
            .find(|(_, v)| !v.is_finite())
            .and_then(|(id, _)| self.names.get(id).cloned());
        let all: Vec<usize> = (0..self.layout.workers).collect();
        // The step's waits, compute and link time so far (the final reduction is the step's barrier
        // and is not counted).
        let [wait_c, wait_b, comp, link0, bytes0] = start;
        let wire_s = (self.wait_comm_us - wait_c) as f64 * 1e-6;
        // Expert load of every MoE layer: its attention group's first copy counts it.
        let sparse: Vec<usize> = (0..self.layout.layers).filter(|&l| self.layout.sparse[l]).collect();
        let mut expert_counts = vec![0.0; sparse.len() * e];
        if replicas.first() == Some(&self.rank) {
            for (i, l) in sparse.iter().enumerate() {
                if let Some(c) = self.counts.get(l) {
                    for (j, &x) in c.iter().enumerate() {
                        expert_counts[i * e + j] = x as f64;
                    }
                }
            }
        }
        // Each (micro-batch, layer) is routed by one attention worker: it counts the copies dropped.
        expert_counts.extend(sparse.iter().map(|l| self.dropped.get(l).copied().unwrap_or(0) as f64));
        let mine = GlobalSums {
            grad_sq: sq,
            losses: self.losses,
            waits_s: wire_s + (self.wait_bubble_us - wait_b) as f64 * 1e-6,
            wire_s,
            compute_s: (self.compute_us - comp) as f64 * 1e-6,
            link_s: (self.link_us - link0) as f64 * 1e-6,
            bytes_sent: (self.bytes_sent - bytes0) as f64,
            stop: if stop { 1.0 } else { 0.0 },
            expert_counts,
        };
        let mut sums = mine.to_vec();
        self.all_reduce(&all, &mut sums)?;
        let g = GlobalSums::from_vec(&sums);
        let mbs = self.layout.micro_batches as f64;
        // The gradients are `loss_scale` times too large (f16's loss scaling).
        let norm = g.grad_sq.sqrt() / self.loss_scale;
        let out = StepOutcome {
            loss: g.losses.total / mbs,
            lm_loss: g.losses.lm / mbs,
            aux_loss: self.settings.aux.is_some().then_some(g.losses.aux / mbs),
            z_loss: (self.settings.routing.z_loss_coef > 0.0).then_some(g.losses.z / mbs),
            grad_norm: norm,
            skipped: !(g.losses.total.is_finite() && norm.is_finite()),
            exposed_comm_s: g.waits_s,
            in_flight_wait_s: g.wire_s,
            compute_s: g.compute_s,
            link_s: g.link_s,
            bytes_sent: g.bytes_sent,
            expert_counts: g.expert_counts[..sparse.len() * e]
                .chunks(e.max(1))
                .map(|c| c.iter().map(|&x| x.round() as usize).collect())
                .collect(),
            dropped: g.expert_counts[sparse.len() * e..].iter().map(|&x| x.round() as usize).collect(),
            stop: g.stop > 0.0,
        };
        if out.skipped && self.settings.abort_on_nonfinite && update {
            return Err(TrainError::NonFinite {
                step: self.step,
                what: if g.losses.total.is_finite() { "gradient" } else { "loss" },
                tensor: bad.unwrap_or_default(),
            });
        }
        // 3. The update, the same decision on every worker.
        if !out.skipped && update {
            let scale = if self.settings.grad_clip > 0.0 && norm > self.settings.grad_clip {
                self.settings.grad_clip / (norm + 1e-6)
            } else {
                1.0
            };
            let part = self.part.take().expect("part");
            let mut part = self.opt.step(part, &mut grads, lr, scale / self.loss_scale);
            if self.settings.bias_update_rate > 0.0 {
                for l in &routed {
                    if let (Some(c), Some(router)) =
                        (self.counts.get(l), part.attention[self.attn_index[l]].router.as_mut())
                    {
                        router.update_balance_bias(c, self.settings.bias_update_rate)?;
                    }
                }
            }
            self.part = Some(part);
        }
        self.counts.clear();
        self.dropped.clear();
        self.losses = StepLosses::default();
        self.tracer.span(|| "all-reduce + optimizer".into(), "optimizer", COMPUTE, t0, now_us());
        Ok(out)
    }

    /// Parameters each worker holds (by rank) and parameters of the whole model (each counted once),
    /// the same on every worker.
    pub fn param_counts(&mut self) -> Result<(Vec<usize>, usize)> {
        let (own, counted) = self.part().param_counts(&self.layout, self.rank);
        let workers = self.layout.workers;
        let mut v = vec![0f64; workers + 1];
        v[self.rank] = own as f64;
        v[workers] = counted as f64;
        let all: Vec<usize> = (0..workers).collect();
        self.all_reduce(&all, &mut v)?;
        Ok((v[..workers].iter().map(|&x| x as usize).collect(), v[workers] as usize))
    }

    /// The end of the run: the sum of squares of every parameter (each once) and each worker's peak
    /// resident memory, the same on every worker; with `out`, the model written there by every
    /// worker ([`super::shards`]) in `dtype`, rank 0 writing `config.json` and the index last.
    pub fn finish(
        &mut self,
        out: Option<&Path>,
        config: &serde_json::Value,
        dtype: SaveDtype,
    ) -> Result<(f64, Vec<f64>)> {
        let part = self.part.as_ref().expect("part");
        let mut own = sum_of_squares(&part.experts);
        if self.layout.replicas(self.rank).first() == Some(&self.rank) {
            own += sum_of_squares(&part.ends) + sum_of_squares(&part.attention);
        }
        if let Some(dir) = out {
            let parts = part.counted_once(&self.layout, self.rank, self.ffn_name);
            let report = write_shards(dir, self.rank, &parts, self.layout.experts, dtype)?;
            let reports = self.collect_on_zero(Msg::Shards(vec![report]), "the written files")?;
            if self.rank == 0 {
                let mut config = config.clone();
                dtype.mark_config(&mut config);
                write_index(dir, &nth_reports(&reports, 0), &config)?;
            }
        }
        let workers = self.layout.workers;
        let mut v = vec![0f64; workers + 1];
        v[0] = own;
        v[1 + self.rank] = crate::metrics::peak_rss_mb();
        let all: Vec<usize> = (0..workers).collect();
        self.all_reduce(&all, &mut v)?;
        Ok((v[0], v[1..].to_vec()))
    }

    /// Writes a training checkpoint of the state after `state.step` into `dir` without gathering
    /// anything: rank 0 makes the partial directory; every worker writes its tensors and its AdamW
    /// moments ([`super::shards`], the moments laid out as the model under `exp_avg/` and
    /// `exp_avg_sq/`), synced, and reports them; rank 0 then writes the indexes and commits
    /// ([`crate::checkpoint::commit`]), and every worker waits for that before it goes on.
    pub fn checkpoint(
        &mut self,
        dir: &Path,
        state: &TrainState,
        keep: usize,
        config: &serde_json::Value,
        kill: Option<&CheckpointKill>,
    ) -> Result<PathBuf> {
        let (step, rank) = (state.step, self.rank);
        let hook = |at| {
            if let Some(k) = kill {
                k.maybe(rank, step, at);
            }
        };
        let all: Vec<usize> = (0..self.layout.workers).collect();
        // Phase 0: the partial directory exists before anyone writes.
        if rank == 0 {
            checkpoint::begin(dir, step)?;
        }
        self.all_reduce(&all, &mut [0f64])?;
        // Phase 1: every worker's files, each synced.
        let partial = checkpoint::partial_dir(dir, step);
        let experts = self.layout.experts;
        let part = self.part.as_ref().expect("part");
        let mut reports =
            vec![write_shards(&partial, rank, &part.counted_once(&self.layout, rank, self.ffn_name), experts, F32)?];
        hook(CheckpointMoment::Writing);
        for moment in Moment::BOTH {
            let moments = self.opt.moments_as(part.clone(), moment);
            let parts = moments.counted_once(&self.layout, rank, self.ffn_name);
            reports.push(write_shards(&checkpoint::moment_dir(&partial, moment), rank, &parts, experts, F32)?);
        }
        hook(CheckpointMoment::Written);
        let gathered = self.collect_on_zero(Msg::Shards(reports), "the checkpoint's files")?;
        // Phase 2: rank 0 alone makes it a checkpoint.
        if rank == 0 {
            write_index(&partial, &nth_reports(&gathered, 0), config)?;
            for (i, moment) in Moment::BOTH.into_iter().enumerate() {
                write_index(&checkpoint::moment_dir(&partial, moment), &nth_reports(&gathered, i + 1), config)?;
            }
            hook(CheckpointMoment::Indexed);
            checkpoint::commit(dir, &partial, state, keep)?;
            hook(CheckpointMoment::Committed);
        }
        self.all_reduce(&all, &mut [0f64])?;
        Ok(dir.join(checkpoint::step_dir_name(step)))
    }

    /// Sends `msg` to worker 0; worker 0 returns it with every other worker's message of the same
    /// kind (the others return an empty list).
    fn collect_on_zero(&mut self, msg: Msg, what: &str) -> Result<Vec<Msg>> {
        if self.rank != 0 {
            self.send(0, msg)?;
            return Ok(Vec::new());
        }
        let kind = std::mem::discriminant(&msg);
        let mut all = vec![msg];
        let (early, mut later): (Vec<Envelope>, Vec<Envelope>) =
            std::mem::take(&mut self.later).into_iter().partition(|e| std::mem::discriminant(&e.msg) == kind);
        all.extend(early.into_iter().map(|e| e.msg));
        while all.len() < self.layout.workers {
            let env = self.port.recv(self.settings.timeout)?.ok_or_else(|| TrainError::Stalled {
                worker: self.rank,
                seconds: self.settings.timeout.as_secs_f64(),
                at: format!("gathering {what}"),
            })?;
            match env.msg {
                Msg::Abort { worker, cause } => return Err(TrainError::Worker { worker, cause }),
                m if std::mem::discriminant(&m) == kind => all.push(m),
                m => later.push(Envelope { msg: m, ..env }),
            }
        }
        self.later.extend(later);
        Ok(all)
    }

    /// Gathers every worker's trace events on worker 0 (others return an empty list).
    pub fn gather_traces(&mut self) -> Result<Vec<super::trace::TraceEvent>> {
        let mine = std::mem::take(&mut self.tracer.events);
        let all = self.collect_on_zero(Msg::Trace(mine), "trace events")?;
        Ok(all.into_iter().flat_map(|m| if let Msg::Trace(e) = m { e } else { Vec::new() }).collect())
    }

    /// Tells every other worker that this one failed.
    pub fn abort(&mut self, cause: &str) {
        for w in 0..self.layout.workers {
            if w != self.rank {
                let _ = self.port.send(w, self.step, Msg::Abort { worker: self.rank, cause: cause.into() });
            }
        }
    }
}
