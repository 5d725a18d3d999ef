//! Context parallelism's task bodies (`--context-parallel C`): a unit's attention stage in two
//! halves each way, the ring half forward a task per other block (the scheduler's module doc has
//! the tasks and when they are ready).
//!
//! - **Projection half** (`AttnFwd`): the unit's input (its two chunks of the sequence,
//!   `disagmoe_kernels::ring::chunks`), the input norm, the queries and the block of keys and
//!   values at the unit's positions ([`AttentionStage::ring_project`]); the block goes to the
//!   `C - 1` other units of the ring ([`Msg::Kv`]). Then, while it travels, the attention of the
//!   unit's queries over its own block ([`AttentionStage::ring_merge`]: on the diagonal, the
//!   largest of the ring's blocks under the causal mask), on leaves of a graph of its own (the
//!   queries' and the block's values).
//! - **Ring half** (`RingFwd`, one task per other block): the attention of the unit's queries
//!   over the other units' blocks in ring order (those of ring ranks `r - 1`, `r - 2`, ...),
//!   each merged onto the blocks' before it as soon as it is here and they are merged
//!   ([`AttentionStage::ring_merge`]), so that it is computed while the later ones travel (each
//!   unit sends its block round the ring in that order: to `r + 1` first); after the last, the
//!   output projection, the norm and the router ([`AttentionStage::ring_finish`]). Its graph is
//!   its own: leaves the queries, the own block's output and log-sum-exp, the received blocks
//!   and the input. Then the stage hands on as without context parallelism (`Worker::hand_on`).
//! - **Backward of the ring half** (`AttnBwd`): the stage's objective as without context
//!   parallelism; the gradients of the received blocks go back to their owners
//!   ([`Msg::GradKv`]); then, while they travel, the own block's backward. The gradients of the
//!   queries, the unit's block and the input wait.
//! - **Backward of the projection half** (`RingBwd`): with the ring's gradients of the unit's
//!   block here (added in unit order after the own block's), the projection's backward, and the
//!   input's gradient sent back as without context parallelism.
//!
//! Under `--recompute attention|full` no graph is kept: the projection half keeps its input (the
//! token ids at layer 0) and the values of its queries, block and input, the ring half the blocks
//! it received. The ring half's backward computes the own block's attention again (values), its
//! graph, and after its backward the own block's graph; the projection half's backward computes
//! its own from the input. The own block is then computed three times, and no two of those
//! graphs are held at once.
//!
//! The parameters of the two backward tasks are disjoint (the input norm and the projections of
//! the queries, keys and values or the latent; the output projection, the sinks, MLA's expansion
//! of the latent in both the own block's and the ring's graphs, the post-attention norm and the
//! router), each task's added to the step's gradients in unit order, so a run stays
//! bit-reproducible.

use std::collections::HashMap;
use std::ops::Range;

use burn::module::Module;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, TensorData};

use disagmoe_kernels::ring::{chunks, split_queries, Partial};
use disagmoe_models::decoder::{AttentionLayer, RingBlock, RingProjection};
use disagmoe_models::moe::{Experts, Router};
use disagmoe_models::nn::Embedding;
use disagmoe_models::stages::AttentionStage;
use disagmoe_models::TrainModule;

use super::autodiff::{grad_of, Fork};
use super::tasks::AttnGraph;
use super::Worker;
use crate::error::{Result, TrainError};
use crate::runtime::exchange::Share;
use crate::runtime::msg::{AuxSums, LayerCoefficients, Msg, Packed};
use crate::runtime::scheduler::Task;
use crate::runtime::trace::COMPUTE;
use crate::runtime::transport::now_us;

/// The projection half of a unit's attention stage: its graph, or (recomputed) none.
struct Projection<B: AutodiffBackend, A: Module<B>, R: Module<B>> {
    stage: AttentionStage<B, A, R>,
    /// Layer 0: the embedding, whose output is the input.
    embed: Option<Embedding<B>>,
    /// `[B, T, M]`: the input, a leaf past the first layer.
    h: Tensor<B, 3>,
    /// `[B, T, H, D]`
    q: Tensor<B, 4>,
    /// `[B, T, W]`: the unit's block of keys and values.
    kv: Tensor<B, 3>,
}

/// The attention over a unit's own block, on leaves of a graph of its own (the values of the
/// projection half's queries and block): computed while the block travels; its backward runs in
/// the ring half's, after the received blocks' gradients are sent.
struct OwnBlock<B: AutodiffBackend, A: Module<B>, R: Module<B>> {
    /// The stage's parameters for it (MLA's expansion of the latent).
    stage: AttentionStage<B, A, R>,
    /// `[B, T, H, D]`
    q: Tensor<B, 4>,
    /// `[B, T, W]`
    kv: Tensor<B, 3>,
    partial: Partial<B>,
}

/// The projection half of a unit's attention stage, kept for its backward.
pub(super) struct RingHalf<B: AutodiffBackend, A: Module<B>, R: Module<B>> {
    /// The half's graph (without one when recomputed: its values).
    half: Projection<B, A, R>,
    /// A recomputed half's input (`None` at layer 0: the token ids).
    input: Option<Option<Packed>>,
    /// A recomputed ring half's received blocks, by unit, in ring order (the order they are
    /// merged in: [`Worker::ring_recompute`] relies on it).
    blocks: Vec<(usize, Packed)>,
    /// The ring half's graph between its tasks.
    merging: Option<Merging<B, A, R>>,
    /// The attention over the unit's own block, with its graph until the ring half's backward
    /// (recomputed: its values until the ring half runs).
    own: Option<OwnBlock<B, A, R>>,
    /// The input's balance sums and who sent its rows, until the ring half runs.
    aux: Option<(AuxSums, Vec<Share>)>,
}

/// A ring half's graph while its blocks come in (or its values, recomputed).
struct Merging<B: AutodiffBackend, A: Module<B>, R: Module<B>> {
    stage: AttentionStage<B, A, R>,
    /// The leaves: the queries, the own block's attention, the input and the blocks so far.
    leaves: RingLeaves<B>,
    h: Tensor<B, 3>,
    /// The queries of the unit's two chunks (front, back).
    q: [Tensor<B, 4>; 2],
    /// Each chunk's attention over the blocks so far.
    all: [Partial<B>; 2],
}

/// The leaves of a ring half's graph besides its input.
pub(super) struct RingLeaves<B: AutodiffBackend> {
    q: Tensor<B, 4>,
    /// The own block's attention.
    own: Partial<B>,
    /// The other units' blocks, by unit, in ring order.
    peers: Vec<(usize, Tensor<B, 3>)>,
}

/// A ring half's backward, waiting for the ring's gradients of the unit's block.
pub(super) struct RingPending<B: AutodiffBackend> {
    gq: Tensor<B::InnerBackend, 4>,
    /// The own block's attention's gradient of the unit's block.
    gkv: Tensor<B::InnerBackend, 3>,
    gh: Tensor<B::InnerBackend, 3>,
    from: Vec<Share>,
    aux_coef: Vec<LayerCoefficients>,
}

/// A step's context-parallel state of a worker, by (unit, layer).
pub(super) struct RingState<B: AutodiffBackend, A: Module<B>, R: Module<B>> {
    halves: HashMap<(usize, usize), RingHalf<B, A, R>>,
    pending: HashMap<(usize, usize), RingPending<B>>,
}

impl<B: AutodiffBackend, A: Module<B>, R: Module<B>> Default for RingState<B, A, R> {
    fn default() -> Self {
        Self { halves: HashMap::new(), pending: HashMap::new() }
    }
}

impl<B, A, R, X> Worker<B, A, R, X>
where
    B: AutodiffBackend,
    A: TrainModule<B> + AttentionLayer<B>,
    R: TrainModule<B> + Router<B>,
    X: TrainModule<B> + Experts<B>,
{
    /// Tokens of a unit per row: the sequence, or a ring worker's share of it.
    pub(super) fn unit_seq(&self) -> usize {
        self.settings.seq / self.layout.context_parallel
    }

    /// The two chunks of the sequence ring rank `r` holds.
    fn held(&self, r: usize) -> [Range<usize>; 2] {
        chunks(self.settings.seq, self.layout.context_parallel).expect("the config checks seq against the ring")[r]
            .clone()
    }

    /// The positions of unit `unit`'s tokens in their sequence, in the order it holds them (every
    /// position without context parallelism).
    pub(super) fn positions(&self, unit: usize) -> Vec<usize> {
        if self.layout.context_parallel == 1 {
            return (0..self.settings.seq).collect();
        }
        let [a, b] = self.held(self.layout.unit_of(unit).1);
        a.chain(b).collect()
    }

    /// The leaves of a micro-batch's units (`[B, T, M]` each, ring rank order) as its sequences
    /// `[B, S, M]`, positions in order.
    pub(super) fn sequence_order(&self, mut leaves: Vec<Tensor<B, 3>>) -> Tensor<B, 3> {
        if leaves.len() == 1 {
            return leaves.remove(0);
        }
        let order: Vec<usize> = (0..leaves.len()).flat_map(|r| self.positions(r)).collect();
        let mut inverse = vec![0i64; order.len()];
        for (at, &p) in order.iter().enumerate() {
            inverse[p] = at as i64;
        }
        let inverse = Tensor::<B, 1, Int>::from_data(TensorData::new(inverse, [order.len()]), &self.device);
        Tensor::cat(leaves, 1).select(1, inverse)
    }

    /// The rotary tables at unit `unit`'s positions (restarting per document when the run's
    /// documents say so).
    fn unit_tables(&self, unit: usize) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let docs = self.documents.get(&self.layout.unit_of(unit).0);
        let (cos, sin) = disagmoe_models::rope::document_tables(self.rope.0.clone(), self.rope.1.clone(), docs);
        let positions: Vec<i64> = self.positions(unit).into_iter().map(|p| p as i64).collect();
        let n = positions.len();
        let idx = Tensor::<B, 1, Int>::from_data(TensorData::new(positions, [n]), &self.device);
        (cos.select(2, idx.clone()), sin.select(2, idx))
    }

    /// The projection half of `layer` for unit `unit` on its input (layer 0: `None`, the
    /// embedding of its tokens), with its graph or without (`track`).
    fn project(&self, unit: usize, layer: usize, input: Option<&Packed>, track: bool) -> Result<Projection<B, A, R>> {
        let device = self.device.clone();
        let fork = &mut Fork { device: &device, track };
        let (h, embed) = match input {
            None => {
                let ends = self.part().ends.as_ref().expect("the embedding worker holds the ends");
                let embed = ends.embed_tokens.clone().map(fork);
                (embed.forward(self.ids(unit)?), Some(embed))
            }
            Some(h) => (self.hidden(h, track), None),
        };
        let stage = self.part().attention[self.attn_index[&layer]].clone().map(fork);
        let (cos, sin) = self.unit_tables(unit);
        let RingProjection { q, kv } = stage.ring_project(h.clone(), cos, sin).ok_or_else(|| {
            TrainError::option(
                "context_parallel",
                "1 for this model: its attention type has no ring attention (GQA, with windows and sinks, and MLA have)",
            )
        })?;
        Ok(Projection { stage, embed, h, q, kv })
    }

    /// The attention of a projection half's queries over its own block, on leaves of a graph of
    /// its own (`track`) or values only.
    fn own_block(&self, unit: usize, layer: usize, half: &Projection<B, A, R>, track: bool) -> OwnBlock<B, A, R> {
        let device = self.device.clone();
        let stage = self.part().attention[self.attn_index[&layer]].clone().map(&mut Fork { device: &device, track });
        let (q, kv) = (leaf(half.q.clone(), track), leaf(half.kv.clone(), track));
        let docs = self.documents.get(&self.layout.unit_of(unit).0);
        let held = self.held(self.layout.unit_of(unit).1);
        let own = vec![RingBlock { kv: kv.clone(), held: held.clone() }];
        let chunks = split_queries(q.clone(), &held);
        let partial = Partial::join(stage.ring_merge(&chunks, &held, own, None, docs).expect("its projection had one"));
        OwnBlock { stage, q, kv, partial }
    }

    /// The projection half of `layer` for unit `unit` (see [`Worker::project`]); its block goes
    /// to the ring.
    pub(super) fn ring_project(
        &mut self,
        unit: usize,
        layer: usize,
        input: Option<Packed>,
        aux: AuxSums,
        from: Vec<Share>,
    ) -> Result<()> {
        let recompute = self.settings.recompute.attention();
        let half = self.project(unit, layer, input.as_ref(), !recompute)?;
        let [b, t, w] = half.kv.dims();
        // Round the ring: to ring rank r + 1 first, whose attention merges it first.
        let (c, r) = (self.layout.context_parallel, self.layout.unit_of(unit).1);
        for d in 1..c {
            let v = unit - r + (r + d) % c;
            let block = self.emit(half.kv.clone().inner().reshape([b * t, w]));
            self.comm.send(self.layout.attn_worker(v, layer), Msg::Kv { mb: unit, layer, to: v, kv: block })?;
        }
        // While the block travels: the attention over the unit's own block (traced apart, for the
        // prediction's calibration).
        let t0 = now_us();
        let own = Some(self.own_block(unit, layer, &half, !recompute));
        self.trace_own(Task::AttnFwd { mb: unit, layer }, t0);
        let input = recompute.then_some(input);
        let kept = RingHalf { half, input, blocks: Vec::new(), merging: None, own, aux: Some((aux, from)) };
        self.ring.halves.insert((unit, layer), kept);
        Ok(())
    }

    /// The unit and ring rank whose block is `back` places back along unit `unit`'s ring.
    fn ring_peer(&self, unit: usize, back: usize) -> (usize, usize) {
        let (c, r) = (self.layout.context_parallel, self.layout.unit_of(unit).1);
        let rv = (r + c - back) % c;
        (unit - r + rv, rv)
    }

    /// The start of the ring half's graph (leaves: the queries, the own block's attention and
    /// the input), or its values only (`track: false`). `own`: the own block's attention
    /// (`None`: computed again from the projection half's values).
    fn ring_start(&self, unit: usize, layer: usize, own: Option<Partial<B>>, track: bool) -> Merging<B, A, R> {
        let half = &self.ring.halves[&(unit, layer)].half;
        let Partial { out, lse } = own.unwrap_or_else(|| self.own_block(unit, layer, half, false).partial);
        let (q, own) = (leaf(half.q.clone(), track), Partial { out: leaf(out, track), lse: leaf(lse, track) });
        let device = self.device.clone();
        let stage = self.part().attention[self.attn_index[&layer]].clone().map(&mut Fork { device: &device, track });
        let held = self.held(self.layout.unit_of(unit).1);
        let (chunks, all) = (split_queries(q.clone(), &held), own.clone().chunks(&held));
        Merging {
            stage,
            leaves: RingLeaves { q, own, peers: Vec::new() },
            h: leaf(half.h.clone(), track),
            q: chunks,
            all,
        }
    }

    /// The attention over the block `back` places back along the ring (`block`, a leaf when
    /// `track`) merged on.
    fn ring_merge(
        &self,
        m: &mut Merging<B, A, R>,
        unit: usize,
        layer: usize,
        back: usize,
        block: &Packed,
        track: bool,
    ) {
        let [b, t, w] = self.ring.halves[&(unit, layer)].half.kv.dims();
        let (v, rv) = self.ring_peer(unit, back);
        let kv = self.take(block, [b, t, w], track);
        let docs = self.documents.get(&self.layout.unit_of(unit).0);
        let held = self.held(self.layout.unit_of(unit).1);
        let blocks = vec![RingBlock { kv: kv.clone(), held: self.held(rv) }];
        let all = m.all.clone();
        m.all = m.stage.ring_merge(&m.q, &held, blocks, Some(all), docs).expect("its projection had one");
        m.leaves.peers.push((v, kv));
    }

    /// The ring half's graph once every block is merged: the output projection, the norm and the
    /// router.
    fn ring_end(&self, m: Merging<B, A, R>) -> AttnGraph<B, A, R> {
        let out = m.stage.ring_finish(m.h.clone(), Partial::join(m.all)).expect("its projection half had one");
        let routed = self.route(out.route, m.stage.top_k());
        AttnGraph {
            stage: m.stage,
            embed: None,
            h: Some(m.h),
            residual: out.residual,
            normed: out.normed,
            routed,
            ring: Some(m.leaves),
        }
    }

    /// Task `back` (`1..C`) of the ring half of `layer` for unit `unit`: the block `back` places
    /// back along the ring merged on; after the last, the stage hands on.
    pub(super) fn ring_forward(&mut self, unit: usize, layer: usize, back: usize) -> Result<()> {
        let recompute = self.settings.recompute.attention();
        let (v, _) = self.ring_peer(unit, back);
        let block = self.inbox.ring_block(unit, layer, v);
        let kept = self.ring.halves.get_mut(&(unit, layer)).expect("the projection half runs first");
        let mut m = match kept.merging.take() {
            Some(m) => m,
            None => {
                let own = kept.own.as_ref().expect("the projection half runs first").partial.clone();
                self.ring_start(unit, layer, Some(own), !recompute)
            }
        };
        self.ring_merge(&mut m, unit, layer, back, &block, !recompute);
        let kept = self.ring.halves.get_mut(&(unit, layer)).expect("the projection half runs first");
        if recompute {
            kept.blocks.push((v, block));
        }
        if back + 1 < self.layout.context_parallel {
            kept.merging = Some(m);
            return Ok(());
        }
        let (aux, from) = kept.aux.take().expect("one ring half per projection half");
        if recompute {
            kept.own = None;
        }
        let graph = self.ring_end(m);
        self.hand_on(unit, layer, graph, aux, from, None)
    }

    /// A recomputed ring half's graph, for its backward: as its tasks computed it.
    pub(super) fn ring_recompute(&self, unit: usize, layer: usize) -> AttnGraph<B, A, R> {
        let mut m = self.ring_start(unit, layer, None, true);
        for (back, (_, block)) in self.ring.halves[&(unit, layer)].blocks.iter().enumerate() {
            self.ring_merge(&mut m, unit, layer, back + 1, block, true);
        }
        self.ring_end(m)
    }

    /// The end of the ring half's backward (its objective's gradients in `grads`, its parameters'
    /// taken): the received blocks' gradients go back to their owners; then the backward of the
    /// attention over the unit's own block (computed again when recomputed) while they travel;
    /// the gradients of the queries, the unit's block and the input wait for the projection
    /// half's backward.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn ring_half_backward(
        &mut self,
        unit: usize,
        layer: usize,
        ring: RingLeaves<B>,
        h: Tensor<B, 3>,
        grads: &mut B::Gradients,
        from: Vec<Share>,
        aux_coef: Vec<LayerCoefficients>,
    ) -> Result<()> {
        let device = self.device.clone();
        let gq = grad_of(&Some(ring.q.clone()), grads, ring.q.dims(), &device);
        let gout = grad_of(&Some(ring.own.out.clone()), grads, ring.own.out.dims(), &device);
        let glse = grad_of(&Some(ring.own.lse.clone()), grads, ring.own.lse.dims(), &device);
        let gh = grad_of(&Some(h.clone()), grads, h.dims(), &device);
        for (v, block) in ring.peers {
            let [b, t, w] = block.dims();
            let g = grad_of(&Some(block), grads, [b, t, w], &device).reshape([b * t, w]);
            let g = self.emit(g);
            self.comm.send(self.layout.attn_worker(v, layer), Msg::GradKv { mb: v, layer, from: unit, g })?;
        }
        let t0 = now_us();
        let kept = self.ring.halves.get_mut(&(unit, layer)).expect("the projection half ran");
        // A recomputed ring half's received blocks are not needed again.
        drop(std::mem::take(&mut kept.blocks));
        let own = match kept.own.take() {
            Some(own) => own,
            None => self.own_block(unit, layer, &self.ring.halves[&(unit, layer)].half, true),
        };
        let OwnBlock { stage, q, kv, partial } = own;
        let objective = (partial.out * Tensor::from_inner(gout)).sum() + (partial.lse * Tensor::from_inner(glse)).sum();
        let mut own_grads = objective.backward();
        let gq = gq + grad_of(&Some(q.clone()), &mut own_grads, q.dims(), &device);
        let gkv = grad_of(&Some(kv.clone()), &mut own_grads, kv.dims(), &device);
        self.accumulate(&mut own_grads, &stage);
        self.trace_own(Task::AttnBwd { mb: unit, layer }, t0);
        self.ring.pending.insert((unit, layer), RingPending { gq, gkv, gh, from, aux_coef });
        Ok(())
    }

    /// Traces the own block's part of `task`, from `start` to now (inside the task's own span).
    fn trace_own(&mut self, task: Task, start: u64) {
        let end = now_us();
        self.comm.tracer.span(
            || task.own_block_name().expect("an attention task"),
            task.category(),
            COMPUTE,
            start,
            end,
        );
    }

    /// The projection half's backward of `layer` for unit `unit`, the ring's gradients of its
    /// block here; the input's gradient goes back.
    pub(super) fn ring_backward(&mut self, unit: usize, layer: usize) -> Result<()> {
        let RingHalf { half, input, .. } = self.ring.halves.remove(&(unit, layer)).expect("the projection half ran");
        let half = match input {
            Some(input) => {
                drop(half); // the forward's values, before the graph is computed again
                self.project(unit, layer, input.as_ref(), true)?
            }
            None => half,
        };
        let RingPending { gq, mut gkv, gh, from, aux_coef } =
            self.ring.pending.remove(&(unit, layer)).expect("the ring half's backward ran");
        let [b, t, w] = gkv.dims();
        // The unit's own attention's gradient, then the ring's in unit order.
        for (_, g) in self.inbox.ring_grads(unit, layer) {
            gkv = gkv + self.take::<3>(&g, [b, t, w], false).inner();
        }
        let constant = Tensor::<B, 4>::from_inner;
        let objective = (half.q.clone() * constant(gq)).sum()
            + (half.kv.clone() * Tensor::from_inner(gkv)).sum()
            + (half.h.clone() * Tensor::from_inner(gh)).sum();
        let mut grads = objective.backward();
        let gh = (layer > 0).then(|| grad_of(&Some(half.h.clone()), &mut grads, half.h.dims(), &self.device));
        self.accumulate(&mut grads, &half.stage);
        if let Some(embed) = &half.embed {
            self.accumulate(&mut grads, embed);
        }
        match gh {
            Some(gh) => self.send_input_grad(unit, layer, gh, &from, aux_coef),
            None => Ok(()),
        }
    }
}

/// `t`'s values as a leaf of a new graph (requiring its gradient when `track`).
fn leaf<B: AutodiffBackend, const D: usize>(t: Tensor<B, D>, track: bool) -> Tensor<B, D> {
    let t = Tensor::<B, D>::from_inner(t.inner());
    if track {
        t.require_grad()
    } else {
        t
    }
}
