//! Schedules: per worker, ordered lists of compute and communication operations on micro-batches,
//! with dependencies. One schedule value is executed by two engines: the discrete-event
//! [`crate::simulator`] here, and the runtime of `disagmoe-train` on real workers, so that
//! predicted and measured step times compare op by op.
//!
//! A [`Worker`] is a group of ranks that run the same program in lockstep (an attention group,
//! an expert group, or a pipeline stage of the EP baselines); the ranks of a group split the
//! tokens. Each worker has [`Stream`]s: compute streams share the worker's GPUs, the
//! communication stream owns its port, and receives complete when their send does (plus their
//! `duration_s`, a link's latency, where one is set).
//! Every op carries its modelled duration (`duration_s`) and volume, which the runtime ignores.
//!
//! Builders: [`afpipe::build_afpipe`] and the baselines in [`baselines`] (DualPipe's per-rank
//! program in [`dualpipe`]).

pub mod afpipe;
pub mod baselines;
pub mod dualpipe;

use crate::cost::CostModel;
use crate::error::{CoreError, Result};
use serde::{Deserialize, Serialize};

/// Index of an op in [`Schedule::ops`].
pub type OpId = usize;

/// The dependencies of an op: inline up to two (nearly every op), on the heap beyond.
pub type Deps = smallvec::SmallVec<[OpId; 2]>;

/// (De)serialises [`Deps`] as a plain list.
mod deps_as_list {
    use super::{Deps, OpId};
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(deps: &Deps, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(deps.iter())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Deps, D::Error> {
        Vec::<OpId>::deserialize(d).map(Deps::from_vec)
    }
}

/// What a worker does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "snake_case")]
pub enum WorkerRole {
    /// Attention group `group` (A-worker).
    Attention {
        /// Group index.
        group: usize,
    },
    /// Expert group `group` (F-worker).
    Ffn {
        /// Group index.
        group: usize,
    },
    /// Pipeline stage of an EP baseline (attention and experts together).
    Stage {
        /// Stage index.
        stage: usize,
    },
}

/// The kind of a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamKind {
    /// Forward compute (shares the GPUs with the other compute streams).
    ForwardCompute,
    /// Backward compute.
    BackwardCompute,
    /// The only compute stream of a worker that does not split forward and backward.
    Compute,
    /// Weight gradients split off the backward (DualPipe); the lowest priority for the GPUs.
    WeightGradCompute,
    /// Expert forward of a worker that also runs attention forward, ahead of it (the runtime's
    /// `ep` workers; see `disagmoe-train`'s `runtime::predict`).
    ExpertForwardCompute,
    /// Sends and collectives.
    Comm,
    /// Sends of gradients, when a worker keeps them apart from activations (AF-Pipe).
    GradComm,
    /// Posted receives (complete when the matching send completes; never block each other).
    Recv,
}

impl StreamKind {
    /// Whether ops of this stream occupy the worker's GPUs.
    pub fn is_compute(self) -> bool {
        matches!(
            self,
            Self::ForwardCompute
                | Self::BackwardCompute
                | Self::Compute
                | Self::WeightGradCompute
                | Self::ExpertForwardCompute
        )
    }
}

/// One stream of a worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stream {
    /// Kind.
    pub kind: StreamKind,
    /// Ops in program order.
    pub ops: Vec<OpId>,
    /// `true`: ops start strictly in `ops` order. `false`: any op whose dependencies are met may
    /// start, earliest-ready first (a dynamic stream; [`Schedule::freeze`] turns it ordered).
    pub ordered: bool,
}

/// A group of ranks running one program.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Worker {
    /// Name, e.g. `A0`, `F1`, `stage3`.
    pub name: String,
    /// Role.
    pub role: WorkerRole,
    /// GPUs (ranks) in the group.
    pub gpus: usize,
    /// NICs of the group.
    pub nics: usize,
    /// Port bandwidth of the group to other workers, bytes/s.
    pub port_bw: f64,
    /// Streams; compute streams are listed backward-first (their priority for the GPUs).
    pub streams: Vec<Stream>,
    /// Whether the worker's sends and receives share one port (a transport whose two directions
    /// do not overlap, as measured on a real network), instead of a port each way. Written only
    /// when set, so a schedule of full-duplex ports serialises as before.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub half_duplex: bool,
}

/// Which transfer a send is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Transfer {
    /// Attention group to expert group (forward), or its gradient in the opposite direction.
    M2n,
    /// Expert group to the next layer's attention group, or its gradient.
    N2m,
    /// Activations between pipeline stages.
    PipelineP2p,
    /// Keys and values among the attention workers of a ring (context parallelism), or their
    /// gradients.
    Ring,
}

/// What an op does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum OpKind {
    /// Attention block forward (router and norms included).
    AttentionForward,
    /// Attention block backward.
    AttentionBackward,
    /// Expert block forward (or a chunk of it).
    ExpertForward,
    /// Expert block backward.
    ExpertBackward,
    /// Final norm, output head and loss, forward.
    HeadForward,
    /// Head backward.
    HeadBackward,
    /// Weight gradients computed apart from the input gradients (DualPipe).
    WeightGradient,
    /// Point-to-point send to worker `to`.
    Send {
        /// Receiving worker.
        to: usize,
        /// Which transfer.
        transfer: Transfer,
        /// Whether it carries gradients.
        backward: bool,
    },
    /// Receive from worker `from` (matches the send it depends on).
    Recv {
        /// Sending worker.
        from: usize,
    },
    /// EP all-to-all dispatch (tokens to experts) inside the worker's ranks.
    Dispatch {
        /// Whether it carries gradients.
        backward: bool,
    },
    /// EP all-to-all combine (expert outputs back).
    Combine {
        /// Whether it carries gradients.
        backward: bool,
    },
    /// Gradient all-reduce over the worker's ranks.
    AllReduce,
    /// The optimizer step (and what else ends a step on the worker) after the all-reduce.
    Optimizer,
}

impl OpKind {
    /// Short label for traces.
    pub fn label(&self) -> &'static str {
        match self {
            Self::AttentionForward => "attn_fwd",
            Self::AttentionBackward => "attn_bwd",
            Self::ExpertForward => "expert_fwd",
            Self::ExpertBackward => "expert_bwd",
            Self::HeadForward => "head_fwd",
            Self::HeadBackward => "head_bwd",
            Self::WeightGradient => "weight_grad",
            Self::Send { transfer: Transfer::M2n, .. } => "m2n",
            Self::Send { transfer: Transfer::N2m, .. } => "n2m",
            Self::Send { transfer: Transfer::PipelineP2p, .. } => "p2p",
            Self::Send { transfer: Transfer::Ring, .. } => "ring",
            Self::Recv { .. } => "recv",
            Self::Dispatch { .. } => "dispatch",
            Self::Combine { .. } => "combine",
            Self::AllReduce => "all_reduce",
            Self::Optimizer => "optimizer",
        }
    }

    /// Whether the op is communication.
    pub fn is_comm(&self) -> bool {
        matches!(
            self,
            Self::Send { .. } | Self::Recv { .. } | Self::Dispatch { .. } | Self::Combine { .. } | Self::AllReduce
        )
    }
}

/// One operation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Op {
    /// Worker executing it (the sender, for sends).
    pub worker: usize,
    /// Index of its stream in the worker's `streams`.
    pub stream: usize,
    /// What it does.
    pub kind: OpKind,
    /// Micro-batch.
    pub micro_batch: u32,
    /// Layer (`u32::MAX` for ops not tied to a layer).
    pub layer: u32,
    /// Chunk within a chunked op (0 when not chunked).
    pub chunk: u16,
    /// Ops that must complete before this one starts.
    #[serde(with = "deps_as_list")]
    pub deps: Deps,
    /// Modelled duration, seconds.
    pub duration_s: f64,
    /// FLOPs per GPU (compute ops).
    pub flops: f64,
    /// Bytes moved by the whole worker (communication ops).
    pub bytes: f64,
}

/// A complete schedule for one training step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Schedule {
    /// Name (`afpipe`, `1f1b-interleaved`, `tutel`, `comet`, `dualpipe`).
    pub name: String,
    /// Workers.
    pub workers: Vec<Worker>,
    /// All ops.
    pub ops: Vec<Op>,
}

/// For each op, the ops that depend on it, in one flat array (two passes, no allocation per op:
/// a step's schedule at scale has millions of ops; 32-bit indices halve what the simulator's
/// event loop reads).
pub(crate) struct Dependents {
    start: Vec<u32>,
    flat: Vec<u32>,
}

impl Dependents {
    /// The dependents of every op of `schedule`, each list in op order; an error naming the first
    /// dependency on an op that does not exist, or for more ops or dependencies than 32 bits
    /// count.
    pub(crate) fn of(schedule: &Schedule) -> Result<Self> {
        let n = schedule.ops.len();
        let bad = |detail: String| CoreError::InvalidSchedule { schedule: schedule.name.clone(), detail };
        let mut start = vec![0u32; n + 1];
        let mut total = 0u64;
        for (i, o) in schedule.ops.iter().enumerate() {
            for &d in &o.deps {
                if d >= n {
                    return Err(bad(format!("op {i} depends on missing op {d}")));
                }
                start[d + 1] += 1;
            }
            total += o.deps.len() as u64;
        }
        if total > u64::from(u32::MAX) || n > u32::MAX as usize {
            return Err(bad(format!("{n} ops with {total} dependencies: at most {} of each", u32::MAX)));
        }
        for i in 0..n {
            start[i + 1] += start[i];
        }
        let mut next = start.clone();
        let mut flat = vec![0u32; total as usize];
        for (i, o) in schedule.ops.iter().enumerate() {
            for &d in &o.deps {
                flat[next[d] as usize] = i as u32;
                next[d] += 1;
            }
        }
        Ok(Self { start, flat })
    }

    /// The ops that depend on `op`.
    pub(crate) fn of_op(&self, op: OpId) -> &[u32] {
        &self.flat[self.start[op] as usize..self.start[op + 1] as usize]
    }
}

/// Layer value of ops not tied to a layer.
pub const NO_LAYER: u32 = u32::MAX;

impl Schedule {
    /// Checks that every dependency and stream entry names an existing op, every op sits in
    /// exactly the stream it names, and the dependency graph has no cycle.
    pub fn validate(&self) -> Result<()> {
        let bad = |detail: String| CoreError::InvalidSchedule { schedule: self.name.clone(), detail };
        let n = self.ops.len();
        let mut seen = vec![false; n];
        for (w, worker) in self.workers.iter().enumerate() {
            for (s, stream) in worker.streams.iter().enumerate() {
                for &op in &stream.ops {
                    let o = self
                        .ops
                        .get(op)
                        .ok_or_else(|| bad(format!("stream {s} of worker {w} lists missing op {op}")))?;
                    if o.worker != w || o.stream != s || std::mem::replace(&mut seen[op], true) {
                        return Err(bad(format!(
                            "op {op} is listed in stream {s} of worker {w} but belongs to worker {} stream {}",
                            o.worker, o.stream
                        )));
                    }
                }
            }
        }
        if let Some(op) = seen.iter().position(|s| !s) {
            return Err(bad(format!("op {op} is in no stream")));
        }
        // Builders add ops after their dependencies, so one scan usually proves there is no
        // cycle; only a schedule with a dependency on a later op (or itself) needs the sort.
        let mut later = false;
        for (i, o) in self.ops.iter().enumerate() {
            for &d in &o.deps {
                if d >= n {
                    return Err(bad(format!("op {i} depends on missing op {d}")));
                }
                later |= d >= i;
            }
        }
        if !later {
            return Ok(());
        }
        let out = Dependents::of(self)?;
        let mut indeg: Vec<usize> = self.ops.iter().map(|o| o.deps.len()).collect();
        let mut stack: Vec<OpId> = (0..n).filter(|&i| indeg[i] == 0).collect();
        let mut done = 0;
        while let Some(i) = stack.pop() {
            done += 1;
            for &j in out.of_op(i) {
                let j = j as usize;
                indeg[j] -= 1;
                if indeg[j] == 0 {
                    stack.push(j);
                }
            }
        }
        if done != n {
            return Err(bad(format!("dependency cycle among {} ops", n - done)));
        }
        Ok(())
    }

    /// Turns every dynamic stream into an ordered one, in the order the simulator starts its ops.
    /// Simulating the frozen schedule reproduces the same timeline. (The runtime of
    /// `disagmoe-train` does not execute a frozen order: its workers are event driven, by the
    /// rules of its scheduler, which its prediction of a run shares.)
    pub fn freeze(&mut self) -> Result<()> {
        let trace = crate::simulator::simulate(self)?;
        for worker in &mut self.workers {
            for stream in worker.streams.iter_mut().filter(|s| !s.ordered) {
                stream.ops.sort_by(|&a, &b| trace.start[a].total_cmp(&trace.start[b]).then(a.cmp(&b)));
                stream.ordered = stream.kind != StreamKind::Recv;
            }
        }
        Ok(())
    }
}

/// Incremental construction of a schedule.
#[derive(Debug)]
pub struct ScheduleBuilder {
    /// The schedule under construction.
    pub schedule: Schedule,
}

impl ScheduleBuilder {
    /// An empty schedule named `name`.
    pub fn new(name: &str) -> Self {
        Self { schedule: Schedule { name: name.to_string(), workers: Vec::new(), ops: Vec::new() } }
    }

    /// Adds a worker with the given streams (`(kind, ordered)`), returning its index.
    pub fn worker(
        &mut self,
        name: String,
        role: WorkerRole,
        gpus: usize,
        nics: usize,
        port_bw: f64,
        streams: &[(StreamKind, bool)],
    ) -> usize {
        let streams = streams.iter().map(|&(kind, ordered)| Stream { kind, ops: Vec::new(), ordered }).collect();
        self.schedule.workers.push(Worker { name, role, gpus, nics, port_bw, streams, half_duplex: false });
        self.schedule.workers.len() - 1
    }

    /// Index of the first stream of `kind` on `worker`.
    pub fn stream_of(&self, worker: usize, kind: StreamKind) -> usize {
        self.schedule.workers[worker].streams.iter().position(|s| s.kind == kind).expect("worker has the stream")
    }

    /// Appends an op to the end of its stream.
    #[allow(clippy::too_many_arguments)]
    pub fn op(
        &mut self,
        worker: usize,
        stream: StreamKind,
        kind: OpKind,
        micro_batch: usize,
        layer: u32,
        chunk: u16,
        deps: impl IntoIterator<Item = OpId>,
        duration_s: f64,
        flops: f64,
        bytes: f64,
    ) -> OpId {
        let s = self.stream_of(worker, stream);
        let id = self.schedule.ops.len();
        self.schedule.ops.push(Op {
            worker,
            stream: s,
            kind,
            micro_batch: micro_batch as u32,
            layer,
            chunk,
            deps: deps.into_iter().collect(),
            duration_s,
            flops,
            bytes,
        });
        self.schedule.workers[worker].streams[s].ops.push(id);
        id
    }

    /// A send from `from` to `to` on `from`'s comm stream plus the matching receive on `to`;
    /// returns the receive (what consumers depend on).
    #[allow(clippy::too_many_arguments)]
    pub fn transfer(
        &mut self,
        cost: &CostModel,
        from: usize,
        to: usize,
        transfer: Transfer,
        backward: bool,
        micro_batch: usize,
        layer: u32,
        deps: impl IntoIterator<Item = OpId>,
        bytes: f64,
    ) -> OpId {
        let (src, dst) = (self.schedule.workers[from].port_bw, self.schedule.workers[to].port_bw);
        let secs = cost.transfer_time(bytes, src, dst);
        let has_grad = self.schedule.workers[from].streams.iter().any(|s| s.kind == StreamKind::GradComm);
        let stream = if backward && has_grad { StreamKind::GradComm } else { StreamKind::Comm };
        let send = self.op(
            from,
            stream,
            OpKind::Send { to, transfer, backward },
            micro_batch,
            layer,
            0,
            deps,
            secs,
            0.0,
            bytes,
        );
        self.op(to, StreamKind::Recv, OpKind::Recv { from }, micro_batch, layer, 0, [send], 0.0, 0.0, bytes)
    }

    /// Finishes, validating the result.
    pub fn finish(self) -> Result<Schedule> {
        self.schedule.validate()?;
        Ok(self.schedule)
    }
}
