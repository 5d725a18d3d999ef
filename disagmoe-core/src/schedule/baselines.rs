//! The baselines AF-Pipe is compared with, each built as a schedule and simulated, never scaled
//! by a fixed factor:
//!
//! - `1f1b-interleaved`: Megatron-LM interleaved 1F1B pipeline over `pp` stages with `v` model
//!   chunks per stage, expert parallelism over the data-parallel ranks of a stage, and blocking
//!   all-to-all dispatch/combine around each expert block.
//! - `tutel`: the same pipeline, with each MoE block split into 4 chunks whose all-to-alls
//!   overlap the previous chunk's expert GEMMs (every chunk re-reads the expert weights).
//! - `comet`: the same pipeline with fine-grained (16-chunk, tile-level) overlap: weights are read
//!   once, communication hides behind expert compute as far as it is shorter.
//! - `dualpipe`: DeepSeek's bidirectional pipeline: every stage holds a chunk of each direction
//!   (twice the parameters) and runs the fixed program of [`super::dualpipe`] one step at a time:
//!   warm-up forwards, then pairs of one forward and one backward chunk of the other direction
//!   whose compute hides each other's all-to-alls, then cool-down backwards with zero-bubble
//!   weight steps. A step starts when the previous one has finished and its inputs have arrived;
//!   within a step the two chunks share the GPUs (backward first) and one communication stream
//!   (earliest-ready first), and backward chunks compute each block's weight gradients in an op
//!   of their own, after its input gradients, at the lowest priority (DualPipe's ZeroBubble
//!   split). Point-to-point sends are asynchronous.
//!
//! Layout: tensor parallelism 1, the smallest power-of-two `pp` whose memory fits, `dp = G / pp`,
//! expert parallelism `ep` = the largest power of two dividing both the expert count and `dp`,
//! one sequence per rank per micro-batch, and the same global batch as AF-Pipe (DualPipe also
//! needs an even number of micro-batches, at least `2 pp`). Under full
//! recomputation (chosen only when activations would not fit) a layer's backward re-runs its
//! forward, including the dispatch all-to-all, since only the layer input is kept. When no
//! pipeline depth fits even with recomputation, context parallelism as Megatron's (`cp`, the
//! smallest power of two that fits): each sequence split over `cp` ranks of a stage in
//! load-balanced chunks, a rank holding `seq / cp` of its tokens, attention as ring attention
//! (the K/V blocks' transfers overlapping the blocks' compute, `CostModel::attention_layer_s`), and
//! `cp` times the micro-batches, each one sequence per `cp` ranks.

use super::dualpipe::{check_dualpipe, dualpipe_program, DualStep};
use super::{OpId, OpKind, Schedule, ScheduleBuilder, StreamKind as K, Transfer, WorkerRole, NO_LAYER};
use crate::cost::{CostModel, ExchangeTransfer};
use crate::error::{CoreError, Result};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};

/// The payloads of an EP all-to-all, in the order of `LayerCost::a2a_s`.
const A2A: [ExchangeTransfer; 3] = [ExchangeTransfer::Dispatch, ExchangeTransfer::Combine, ExchangeTransfer::Gradient];

/// A baseline schedule family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Baseline {
    /// Megatron-LM interleaved 1F1B with EP all-to-all.
    #[serde(rename = "1f1b-interleaved")]
    Megatron,
    /// Tutel-style chunked overlap.
    Tutel,
    /// Comet-style fine-grained overlap.
    Comet,
    /// DualPipe.
    DualPipe,
}

impl Baseline {
    /// Name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::Megatron => "1f1b-interleaved",
            Self::Tutel => "tutel",
            Self::Comet => "comet",
            Self::DualPipe => "dualpipe",
        }
    }

    /// Parses a command-line name.
    pub fn parse(name: &str) -> Option<Self> {
        [Self::Megatron, Self::Tutel, Self::Comet, Self::DualPipe].into_iter().find(|b| b.name() == name)
    }

    /// MoE chunks and whether each chunk re-reads the expert weights.
    fn chunking(self) -> (usize, bool) {
        match self {
            Self::Megatron | Self::DualPipe => (1, false),
            Self::Tutel => (4, true),
            Self::Comet => (16, false),
        }
    }
}

/// The parallel layout of an EP baseline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpLayout {
    /// Pipeline stages.
    pub pp: usize,
    /// Data-parallel ranks per stage.
    pub dp: usize,
    /// Expert-parallel ranks.
    pub ep: usize,
    /// Model chunks per stage (interleaving); 2 directions for DualPipe.
    pub chunks: usize,
    /// Micro-batches per data-parallel rank per step.
    pub micro_batches: usize,
    /// Sequences per rank per micro-batch (with context parallelism: per `cp` ranks).
    pub seqs_per_micro_batch: usize,
    /// Context-parallel ranks each sequence is split over (1: none).
    pub cp: usize,
    /// Full activation recomputation (only each layer's input is kept; backward recomputes the
    /// forward), chosen when the activations would not fit otherwise.
    pub recompute: bool,
}

/// Memory of one GPU of a baseline stage holding `layers` layers (`copies` = 2 for DualPipe).
#[allow(clippy::too_many_arguments)]
fn ep_memory(
    cost: &CostModel,
    pp: usize,
    dp: usize,
    ep: usize,
    copies: usize,
    in_flight: usize,
    recompute: bool,
    cp: usize,
) -> f64 {
    let m = &cost.model;
    let layers = m.layers.div_ceil(pp) as f64 * copies as f64;
    let dense_per_layer = m.attention_params()
        + m.router_params()
        + m.moe.shared_experts as f64 * m.mlp_params(m.moe.intermediate, false);
    let table = (m.vocab * m.hidden) as f64;
    let dense = layers * dense_per_layer + 2.0 * table;
    let experts = layers * (m.moe.experts / ep) as f64 * m.expert_params();
    let tokens = cost.workload.seq.div_ceil(cp) as f64;
    let per_layer = cost.attention_activation_per_token() + cost.ffn_activation_per_token();
    let act = if recompute {
        in_flight as f64 * layers / copies as f64 * tokens * m.hidden as f64 * cost.precision.activation_bytes
            + tokens * per_layer
    } else {
        in_flight as f64 * layers / copies as f64 * tokens * per_layer
    };
    dense * cost.state_bytes(dp) + experts * cost.state_bytes(dp / ep) + act
}

/// Chooses the baseline's layout (see the module documentation).
pub fn ep_layout(cost: &CostModel, baseline: Baseline) -> Result<EpLayout> {
    let g = cost.cluster.total_gpus();
    let m = &cost.model;
    let usable = cost.cluster.gpu.usable_memory();
    let copies = if baseline == Baseline::DualPipe { 2 } else { 1 };
    let mut smallest = f64::INFINITY;
    let mut unschedulable = None;
    let min_pp = if baseline == Baseline::DualPipe { 2 } else { 1 };
    // Context parallelism only where no pipeline depth fits without it.
    let cps = (0..).map(|e| 1usize << e).take_while(|&cp| cp == 1 || 2 * cp <= cost.workload.seq);
    for cp in cps.take_while(|&cp| cp <= g) {
        if cp > 1 && smallest.is_infinite() {
            // Nothing was too large without it: what failed was the schedule (DualPipe's
            // micro-batches), which splitting sequences must not paper over.
            break;
        }
        for pp in (0..)
            .map(|e| 1usize << e)
            .take_while(|&pp| pp <= m.layers.min(g))
            .filter(|&pp| pp >= min_pp && g.is_multiple_of(pp))
        {
            let dp = g / pp;
            if !dp.is_multiple_of(cp) {
                continue;
            }
            let ep = (0..)
                .map(|e| 1usize << e)
                .take_while(|&e| e <= dp && m.moe.experts.is_multiple_of(e) && dp.is_multiple_of(e))
                .last()
                .unwrap_or(1);
            let seqs = cost.workload.global_batch;
            let micro_batches = seqs.div_ceil(dp / cp).max(1);
            if baseline == Baseline::DualPipe {
                if let Err(e) = check_dualpipe(pp, micro_batches) {
                    unschedulable = Some(e);
                    continue;
                }
            }
            let in_flight = pp.min(micro_batches) + 1;
            for recompute in [false, true] {
                let mem = ep_memory(cost, pp, dp, ep, copies, in_flight, recompute, cp);
                smallest = smallest.min(mem);
                if mem <= usable {
                    let chunks = match baseline {
                        Baseline::DualPipe => 2,
                        _ if pp > 1 && m.layers >= 2 * pp && micro_batches.is_multiple_of(pp) => 2,
                        _ => 1,
                    };
                    return Ok(EpLayout { pp, dp, ep, chunks, micro_batches, seqs_per_micro_batch: 1, cp, recompute });
                }
            }
        }
    }
    if let (Some(e), true) = (unschedulable, smallest.is_infinite()) {
        return Err(e);
    }
    Err(CoreError::Infeasible {
        constraint: format!("memory_{}", baseline.name()),
        detail: format!(
            "no pipeline depth or context-parallel size fits: the smallest footprint needs {:.1} GB per GPU, {:.1} GB usable (short by {:.1} GB)",
            smallest / 1e9,
            usable / 1e9,
            (smallest - usable) / 1e9
        ),
    })
}

/// Layers of virtual stage `vs` of `n` (contiguous, sizes differing by at most one).
fn stage_layers(layers: usize, n: usize, vs: usize) -> std::ops::Range<usize> {
    let (q, r) = (layers / n, layers % n);
    let start = vs * q + vs.min(r);
    start..start + q + usize::from(vs < r)
}

/// Per-rank costs of one layer.
struct LayerCost {
    attn_s: f64,
    /// The ring's transfers of a context-parallel attention, forward and backward (twice the
    /// bytes), seconds: an attention op takes the longer of its compute and its ring's (0 without
    /// context parallelism).
    ring_s: (f64, f64),
    attn_flops: f64,
    ffn_s: f64,
    ffn_flops: f64,
    ffn_work: crate::cost::Work,
    ffn_weights: f64,
    /// Seconds and bytes of one all-to-all by payload (dispatch, combine, gradient).
    a2a_s: [f64; 3],
    a2a_bytes: [f64; 3],
    dense: bool,
}

/// Where a backward chunk computes its weight gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WeightGrads {
    /// With the input gradients, one op per block (the EP baselines).
    Inline,
    /// In an op of their own after each block's input gradients, on the lowest-priority compute
    /// stream, so that the input gradients release the next all-to-all sooner (DualPipe's
    /// chunks, split as in ZeroBubble).
    Split,
    /// Left for a later weight step (DualPipe's zero-bubble backwards).
    Deferred,
}

/// The ops of one chunk (a micro-batch's forward or backward through one virtual stage).
struct Chunk {
    /// The op every other op of the chunk depends on.
    first: OpId,
    /// The ops that end the chunk (its output is ready when they are done).
    ends: Vec<OpId>,
    /// The send of its output to the next virtual stage, if on another worker.
    send: Option<OpId>,
    /// The received input it waits for, if any: (micro-batch, virtual stage, backward).
    input: Option<(usize, usize, bool)>,
    /// Deferred weight gradients ([`WeightGrads::Deferred`]): seconds, FLOPs per GPU.
    weight: (f64, f64),
}

/// Builds a baseline schedule.
pub fn build_baseline(cost: &CostModel, baseline: Baseline) -> Result<Schedule> {
    let layout = ep_layout(cost, baseline)?;
    let m = &cost.model;
    let (pp, dp, ep) = (layout.pp, layout.dp, layout.ep);
    let cp = layout.cp;
    let mut rank = cost.clone();
    rank.workload.micro_batch = layout.seqs_per_micro_batch;
    // A rank's tokens of a micro-batch: its share of the sequences, `seq / cp` of each under
    // context parallelism (the expert group's, `ep` ranks' worth).
    let mut ep_group = cost.clone();
    ep_group.workload.micro_batch = layout.seqs_per_micro_batch * ep;
    ep_group.workload.seq = cost.workload.seq.div_ceil(cp);
    let tokens = rank.workload.micro_batch as f64 * cost.workload.seq.div_ceil(cp) as f64;
    let layers: Vec<LayerCost> = (0..m.layers)
        .map(|l| {
            // `cp` ranks share each sequence: the ring's transfers overlap the blocks' compute.
            let a = rank.attention_forward(l, cp, cp);
            let f = ep_group.ffn_forward(l, ep);
            LayerCost {
                attn_s: cost.gpu_time(a),
                ring_s: (rank.ring_time(l, cp, cp, false), rank.ring_time(l, cp, cp, true)),
                attn_flops: a.flops,
                ffn_s: cost.gpu_time(f),
                ffn_flops: f.flops,
                ffn_work: f,
                ffn_weights: ep_group.ffn_weight_bytes(l, ep),
                a2a_s: A2A.map(|t| cost.ep_all_to_all_time(l, ep, tokens, t)),
                a2a_bytes: A2A
                    .map(|t| tokens * m.moe.top_k as f64 * m.hidden as f64 * cost.exchange_value_bytes(t) * dp as f64),
                dense: m.is_dense(l),
            }
        })
        .collect();
    let (chunks, reread) = baseline.chunking();
    let dual = baseline == Baseline::DualPipe;
    let mut b = ScheduleBuilder::new(baseline.name());
    let streams: &[(K, bool)] = if dual {
        &[
            (K::BackwardCompute, true),
            (K::ForwardCompute, true),
            (K::WeightGradCompute, true),
            (K::Comm, false),
            (K::Recv, false),
        ]
    } else {
        &[(K::Compute, true), (K::Comm, true), (K::Recv, false)]
    };
    let nics = (dp as f64 * cost.cluster.nics_per_gpu()).round() as usize;
    for s in 0..pp {
        b.worker(
            format!("stage{s}"),
            WorkerRole::Stage { stage: s },
            dp,
            nics,
            cost.group_bandwidth(dp, nics),
            streams,
        );
    }
    let fwd_stream = if dual { K::ForwardCompute } else { K::Compute };
    let bwd_stream = if dual { K::BackwardCompute } else { K::Compute };
    let head = rank.head_forward(cp, cp);
    let p2p_bytes = tokens * m.hidden as f64 * cost.precision.activation_bytes * dp as f64;
    let n_virtual = pp * layout.chunks;
    // Worker of virtual stage `vs` in direction `dir` (DualPipe's second direction runs the
    // stages in reverse).
    let worker_of = |vs: usize, dir: usize| {
        if dual {
            if dir == 0 {
                vs
            } else {
                pp - 1 - vs
            }
        } else {
            vs % pp
        }
    };
    let stages_per_dir = if dual { pp } else { n_virtual };

    // Forward or backward of one (micro-batch, virtual stage).
    let mut recvs: HashMap<(usize, usize, bool), OpId> = HashMap::new();
    let mut pending: Vec<(OpId, (usize, usize, bool))> = Vec::new();
    let mut head_fwd: HashMap<(usize, usize), OpId> = HashMap::new();
    let mut all_bwd: Vec<Vec<OpId>> = vec![Vec::new(); pp];
    let mut chunk_op = |b: &mut ScheduleBuilder, mb: usize, vs: usize, backward: bool, grads: WeightGrads| {
        let dir = if dual { mb % 2 } else { 0 };
        let w = worker_of(vs, dir);
        let range = stage_layers(m.layers, stages_per_dir, vs);
        let last_stage = vs + 1 == stages_per_dir;
        let mut deps: Vec<OpId> = Vec::new();
        let key_in = (mb, vs, backward);
        let has_input = (!backward && vs > 0) || (backward && !last_stage);
        if has_input {
            match recvs.get(&key_in) {
                Some(&r) => deps.push(r),
                None => pending.push((usize::MAX, key_in)),
            }
        }
        let needs_patch = deps.is_empty() && pending.last().is_some_and(|p| p.0 == usize::MAX);
        let mut first_op = None;
        let note = |op: OpId, first: &mut Option<OpId>| {
            if first.is_none() {
                *first = Some(op);
            }
        };
        let list: Vec<usize> = if backward { range.clone().rev().collect() } else { range.clone().collect() };
        if backward && last_stage {
            // The loss ran at the end of this micro-batch's forward chunk.
            let w_ = head.backward();
            let after_forward = vec![head_fwd[&(mb, vs)]];
            let hb = b.op(
                w,
                bwd_stream,
                OpKind::HeadBackward,
                mb,
                NO_LAYER,
                0,
                after_forward,
                cost.gpu_time(w_),
                w_.flops,
                0.0,
            );
            note(hb, &mut first_op);
            deps = vec![hb];
        }
        // Backward: input gradients (1x forward), weight gradients (1x, unless apart) and the
        // recomputed forward under full recomputation.
        let scale = match backward {
            false => 1.0,
            true => 1.0 + f64::from(u8::from(grads == WeightGrads::Inline)) + f64::from(u8::from(layout.recompute)),
        };
        let mut weight = (0.0, 0.0);
        let mut weight_ops: Vec<OpId> = Vec::new();
        // The weight gradients (`secs`, `flops`) of a block whose input gradients `after` computes.
        let mut weight_of =
            |b: &mut ScheduleBuilder, after: OpId, lu: u32, piece: u16, secs: f64, flops: f64| match grads {
                WeightGrads::Inline => {}
                WeightGrads::Deferred => {
                    weight.0 += secs;
                    weight.1 += flops;
                }
                WeightGrads::Split => weight_ops.push(b.op(
                    w,
                    K::WeightGradCompute,
                    OpKind::WeightGradient,
                    mb,
                    lu,
                    piece,
                    vec![after],
                    secs,
                    flops,
                    0.0,
                )),
            };
        for l in list {
            let c = &layers[l];
            let lu = l as u32;
            let stream = if backward { bwd_stream } else { fwd_stream };
            let attn = |b: &mut ScheduleBuilder, deps: Vec<OpId>| {
                let kind = if backward { OpKind::AttentionBackward } else { OpKind::AttentionForward };
                // The ring's blocks go round again in a recomputed forward.
                let ring = match backward {
                    false => c.ring_s.0,
                    true => c.ring_s.1 + if layout.recompute { c.ring_s.0 } else { 0.0 },
                };
                let secs = (scale * c.attn_s).max(ring);
                b.op(w, stream, kind, mb, lu, 0, deps, secs, scale * c.attn_flops, 0.0)
            };
            let ekind = if backward { OpKind::ExpertBackward } else { OpKind::ExpertForward };
            if !backward {
                let a = attn(b, std::mem::take(&mut deps));
                note(a, &mut first_op);
                deps = vec![a];
            }
            if c.dense {
                let e = b.op(
                    w,
                    stream,
                    ekind,
                    mb,
                    lu,
                    0,
                    std::mem::take(&mut deps),
                    scale * c.ffn_s,
                    scale * c.ffn_flops,
                    0.0,
                );
                note(e, &mut first_op);
                if backward {
                    weight_of(b, e, lu, 0, c.ffn_s, c.ffn_flops);
                }
                deps = vec![e];
            } else {
                // First all-to-all: dispatch (forward) or combine-gradient (backward).
                let (k1, k2) = if backward {
                    (OpKind::Combine { backward: true }, OpKind::Dispatch { backward: true })
                } else {
                    (OpKind::Dispatch { backward: false }, OpKind::Combine { backward: false })
                };
                let n = chunks;
                // Seconds and bytes of one chunk's all-to-all of payload `i` (of `A2A`).
                let a2a = |i: usize| c.a2a_s[i] / n as f64 + cost.cluster.node.latency_s * (n > 1) as u8 as f64;
                let bytes = |i: usize| c.a2a_bytes[i] / n as f64;
                let (p1, p2) = if backward { (2, 2) } else { (0, 1) };
                let piece = if n > 1 { cost.gpu_time(c.ffn_work.chunk(n, c.ffn_weights, reread)) } else { c.ffn_s };
                let base = std::mem::take(&mut deps);
                let mut firsts = Vec::new();
                let mut outs = Vec::new();
                let mut comps = Vec::new();
                for i in 0..n {
                    // Later chunks also wait for the first, which carries any patched stage input.
                    let d_deps = if i == 0 { base.clone() } else { base.iter().copied().chain([firsts[0]]).collect() };
                    let d1 = b.op(w, K::Comm, k1, mb, lu, i as u16, d_deps, a2a(p1), 0.0, bytes(p1));
                    note(d1, &mut first_op);
                    firsts.push(d1);
                    if i >= 1 {
                        let prev = comps[i - 1];
                        outs.push(b.op(w, K::Comm, k2, mb, lu, (i - 1) as u16, vec![prev], a2a(p2), 0.0, bytes(p2)));
                    }
                    // Full recomputation keeps only the layer input, so recomputing the expert
                    // forward first re-runs the dispatch (the expert inputs live on other ranks).
                    // The combine is not re-run: an implementation can skip it.
                    let e_deps = if backward && layout.recompute {
                        let kind = OpKind::Dispatch { backward: false };
                        vec![b.op(w, K::Comm, kind, mb, lu, i as u16, vec![d1], a2a(0), 0.0, bytes(0))]
                    } else {
                        vec![d1]
                    };
                    let e = b.op(
                        w,
                        stream,
                        ekind,
                        mb,
                        lu,
                        i as u16,
                        e_deps,
                        scale * piece,
                        scale * c.ffn_flops / n as f64,
                        0.0,
                    );
                    if backward {
                        weight_of(b, e, lu, i as u16, piece, c.ffn_flops / n as f64);
                    }
                    comps.push(e);
                }
                let last = comps[n - 1];
                outs.push(b.op(w, K::Comm, k2, mb, lu, (n - 1) as u16, vec![last], a2a(p2), 0.0, bytes(p2)));
                deps = outs;
            }
            if backward {
                let a = attn(b, std::mem::take(&mut deps));
                weight_of(b, a, lu, 0, c.attn_s, c.attn_flops);
                deps = vec![a];
            }
        }
        if !backward && last_stage {
            // Final norm, output head and loss end the last stage's forward chunk.
            let hf = b.op(
                w,
                fwd_stream,
                OpKind::HeadForward,
                mb,
                NO_LAYER,
                0,
                std::mem::take(&mut deps),
                cost.gpu_time(head),
                head.flops,
                0.0,
            );
            head_fwd.insert((mb, vs), hf);
            deps = vec![hf];
        }
        let last = deps[0];
        let last = if deps.len() > 1 {
            // Join: the chunk ends when all its combines are done; the next op depends on all.
            *deps.iter().max().unwrap_or(&last)
        } else {
            last
        };
        if needs_patch {
            if let Some(p) = pending.last_mut() {
                p.0 = first_op.expect("a chunk has ops");
            }
        }
        // Hand the activations (or gradients) to the next virtual stage.
        let next = if backward { vs.checked_sub(1) } else { (!last_stage).then_some(vs + 1) };
        let mut send = None;
        if let Some(nv) = next {
            let to = worker_of(nv, dir);
            let r = if to == w {
                last
            } else {
                let r = b.transfer(cost, w, to, Transfer::PipelineP2p, backward, mb, NO_LAYER, deps.clone(), p2p_bytes);
                send = Some(b.schedule.ops[r].deps[0]);
                r
            };
            recvs.insert((mb, nv, backward), r);
        }
        if backward {
            all_bwd[w].push(last);
            all_bwd[w].extend(weight_ops.iter().copied());
        }
        deps.extend(weight_ops);
        Chunk {
            first: first_op.expect("a chunk has ops"),
            ends: deps,
            send,
            input: has_input.then_some(key_in),
            weight,
        }
    };

    let mbs = layout.micro_batches;
    // Extra waits for inputs (op, input key) and the weight-gradient ops of each stage.
    let mut pair_waits: Vec<(OpId, (usize, usize, bool))> = Vec::new();
    let mut weight_ops: Vec<(usize, OpId)> = Vec::new();
    if dual {
        // DualPipe's fixed program per rank: each step starts when the rank's previous step has
        // finished (computation and all-to-alls) and all of its own inputs have arrived; sends are
        // asynchronous. A micro-batch of direction `d` has an id `2 i + d`.
        for r in 0..pp {
            let mut next = [[0usize; 2]; 2];
            let mut prev_end: Vec<OpId> = Vec::new();
            let mut late_send: Option<OpId> = None;
            let mut weights: VecDeque<(usize, (f64, f64))> = VecDeque::new();
            for step in dualpipe_program(pp, r, mbs)? {
                let split = |zero_bubble: bool| if zero_bubble { WeightGrads::Deferred } else { WeightGrads::Split };
                let parts: Vec<(usize, bool, WeightGrads)> = match step {
                    DualStep::Forward { phase, .. } => vec![(phase, false, WeightGrads::Inline)],
                    DualStep::Backward { phase, zero_bubble } => vec![(phase, true, split(zero_bubble))],
                    DualStep::ForwardBackward { forward, backward } => {
                        vec![(forward, false, WeightGrads::Inline), (backward, true, split(false))]
                    }
                    DualStep::Weight => vec![],
                };
                let mut chunks: Vec<Chunk> = Vec::with_capacity(2);
                for (phase, backward, grads) in parts {
                    let dir = phase ^ usize::from(r >= pp / 2);
                    let i = &mut next[usize::from(backward)][dir];
                    let mb = 2 * *i + dir;
                    *i += 1;
                    let vs = if dir == 0 { r } else { pp - 1 - r };
                    let c = chunk_op(&mut b, mb, vs, backward, grads);
                    b.schedule.ops[c.first].deps.extend(prev_end.iter().copied());
                    if grads == WeightGrads::Deferred {
                        weights.push_back((mb, c.weight));
                    }
                    chunks.push(c);
                }
                let end: Vec<OpId> = if step == DualStep::Weight {
                    let (mb, (secs, flops)) =
                        weights.pop_front().expect("a weight step follows a zero-bubble backward");
                    let op = b.op(
                        r,
                        K::WeightGradCompute,
                        OpKind::WeightGradient,
                        mb,
                        NO_LAYER,
                        0,
                        prev_end,
                        secs,
                        flops,
                        0.0,
                    );
                    weight_ops.push((r, op));
                    vec![op]
                } else {
                    // A pair starts when both of its inputs are there.
                    for x in &chunks {
                        for y in chunks.iter().filter(|y| y.first != x.first) {
                            if let Some(key) = x.input {
                                pair_waits.push((y.first, key));
                            }
                        }
                    }
                    chunks.iter().flat_map(|c| c.ends.iter().copied()).collect()
                };
                if let Some(s) = late_send.take() {
                    b.schedule.ops[s].deps.extend(end.iter().copied());
                }
                if let DualStep::Forward { send_after_next: true, .. } = step {
                    late_send = chunks[0].send;
                }
                prev_end = end;
            }
        }
    } else {
        // Megatron's interleaved 1F1B order per stage.
        let v = layout.chunks;
        for s in 0..pp {
            let total = mbs * v;
            let warmup = if v == 1 { (pp - s - 1).min(mbs) } else { ((pp - s - 1) * 2 + (v - 1) * pp).min(total) };
            let fwd_of = |k: usize| {
                let (group, within) = (k / (pp * v), k % (pp * v));
                (group * pp + within % pp, (within / pp) * pp + s)
            };
            let bwd_of = |k: usize| {
                let (group, within) = (k / (pp * v), k % (pp * v));
                (group * pp + within % pp, (v - 1 - within / pp) * pp + s)
            };
            let mut order: Vec<(usize, usize, bool)> = (0..warmup)
                .map(|k| {
                    let (mb, vs) = fwd_of(k);
                    (mb, vs, false)
                })
                .collect();
            for k in 0..total - warmup {
                let (mb, vs) = fwd_of(warmup + k);
                order.push((mb, vs, false));
                let (mb, vs) = bwd_of(k);
                order.push((mb, vs, true));
            }
            for k in total - warmup..total {
                let (mb, vs) = bwd_of(k);
                order.push((mb, vs, true));
            }
            for (mb, vs, backward) in order {
                if mb < mbs {
                    chunk_op(&mut b, mb, vs, backward, WeightGrads::Inline);
                }
            }
        }
    }
    pending.extend(pair_waits);
    for (s, op) in weight_ops {
        all_bwd[s].push(op);
    }
    // Cross-stage dependencies whose producer was generated after the consumer.
    for (op, key) in pending {
        let r = *recvs.get(&key).ok_or_else(|| CoreError::InvalidSchedule {
            schedule: baseline.name().into(),
            detail: format!(
                "no producer for micro-batch {} virtual stage {} ({})",
                key.0,
                key.1,
                if key.2 { "backward" } else { "forward" }
            ),
        })?;
        b.schedule.ops[op].deps.push(r);
    }
    // Gradient all-reduce: dense parameters over dp ranks, experts over dp / ep.
    let copies = if dual { 2.0 } else { 1.0 };
    let per_stage_layers = m.layers.div_ceil(pp) as f64 * copies;
    let dense = per_stage_layers * (m.attention_params() + m.router_params()) * cost.precision.grad_comm_bytes;
    let experts = per_stage_layers * (m.moe.experts / ep) as f64 * m.expert_params() * cost.precision.grad_comm_bytes;
    let secs = cost.all_reduce_time(dense, dp, nics) + cost.all_reduce_time(experts, dp / ep, (nics / ep).max(1));
    for (s, deps) in all_bwd.into_iter().enumerate() {
        b.op(s, K::Comm, OpKind::AllReduce, 0, NO_LAYER, 0, deps, secs, 0.0, dense + experts);
    }
    b.finish()
}
