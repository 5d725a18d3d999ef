//! The task bodies of a worker: attention forward and backward, the head, and an expert holder's
//! forward and backward. Each computes on the worker's device and hands its payloads (host rows,
//! or tensors left on the device: [`super::payload`]) to the exchange
//! ([`crate::runtime::exchange`]), which builds the messages the task sends.

use burn::module::{AutodiffModule, Module};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, TensorData};

use disagmoe_models::decoder::AttentionLayer;
use disagmoe_models::moe::{Experts, Routed, Router};
use disagmoe_models::nn::Embedding;
use disagmoe_models::stages::{AttentionStage, ExpertStage};
use disagmoe_models::TrainModule;

use super::autodiff::{grad_of, index, term_scale, Fork};
use super::payload::{read_back, OnDevice};
use super::ring::RingLeaves;
use super::Worker;
use crate::error::Result;
use crate::runtime::exchange::{
    self, empty, gather_dispatch_grads, input_grad_messages, Assembled, DispatchPlan, Dispatched, GateGrad,
    GradResidualIn, SentDispatch, Share,
};
use crate::runtime::msg::{AuxSums, LayerAux, LayerCoefficients, Msg, Packed};

/// An attention stage's forward from its input: with its graph (kept for the backward, or run
/// again there under `--recompute attention|full`), or without one (the first forward of a
/// recomputed stage).
pub(super) struct AttnGraph<B: AutodiffBackend, A: Module<B>, R: Module<B>> {
    pub(super) stage: AttentionStage<B, A, R>,
    /// Layer 0: the embedding, whose output is the input.
    pub(super) embed: Option<Embedding<B>>,
    /// The input of layers past the first.
    pub(super) h: Option<Tensor<B, 3>>,
    pub(super) residual: Tensor<B, 2>,
    /// `[T, M]`: the normed layer output the holders are sent rows of.
    pub(super) normed: Tensor<B, 2>,
    /// A routed layer's decision under the run's router options.
    pub(super) routed: Option<Routed<B>>,
    /// Context parallelism: the ring half's leaves (the stage's `h` is then its input's leaf).
    pub(super) ring: Option<RingLeaves<B>>,
}

/// What an attention forward keeps for its backward.
pub(super) struct AttnSaved<B: AutodiffBackend, A: Module<B>, R: Module<B>> {
    /// The forward's graph; `None` when the stage is recomputed.
    graph: Option<AttnGraph<B, A, R>>,
    /// A recomputed stage's input (layer 0 recomputes from the token ids).
    input: Option<Packed>,
    /// Who sent which tokens of the input (where its gradient's rows go back).
    from: Vec<Share>,
    /// What was dispatched to each holder.
    sent: Vec<SentDispatch>,
}

/// An expert stage's forward on a holder's rows, with or without its graph.
pub(super) struct FfnGraph<B: AutodiffBackend, X: Module<B>> {
    stage: ExpertStage<B, X>,
    y: Tensor<B, 2>,
    w: Option<Tensor<B, 2>>,
    out: Tensor<B, 2>,
}

/// A recomputed expert stage's input: the rows, their gate weights and expert ids.
pub(super) struct FfnInput {
    y: Packed,
    w: Option<Packed>,
    ids: Vec<usize>,
}

/// What an expert forward keeps for its backward.
pub(super) struct FfnSaved<B: AutodiffBackend, X: Module<B>> {
    /// The attention worker the gradients go back to.
    dst: usize,
    rows: usize,
    /// The forward's graph (`None` without rows, or when the stage is recomputed).
    graph: Option<FfnGraph<B, X>>,
    input: Option<FfnInput>,
}

impl<B, A, R, X> Worker<B, A, R, X>
where
    B: AutodiffBackend,
    A: TrainModule<B> + AttentionLayer<B>,
    R: TrainModule<B> + Router<B>,
    X: TrainModule<B> + Experts<B>,
{
    /// Sends every message of `msgs`, in order.
    pub(super) fn send_all(&mut self, msgs: Vec<(usize, Msg)>) -> Result<()> {
        msgs.into_iter().try_for_each(|(dst, msg)| self.comm.send(dst, msg))
    }

    /// A payload for another worker: `t` left on the device, or read back to the host.
    pub(super) fn emit(&self, t: Tensor<B::InnerBackend, 2>) -> Packed {
        if self.settings.device_payloads {
            Packed::Device(OnDevice::wrap(t))
        } else {
            Packed::F32(read_back(t))
        }
    }

    /// A received payload as a tensor of `shape` (its values row-major): a leaf that requires a
    /// gradient (`track`), or a constant of the graph.
    pub(super) fn take<const D: usize>(&self, p: &Packed, shape: [usize; D], track: bool) -> Tensor<B, D> {
        let inner = match p {
            Packed::Device(d) => OnDevice::<B::InnerBackend>::tensor(d).reshape(shape),
            Packed::F32(h) => Tensor::from_data(TensorData::new(h.data.clone(), shape), &self.device),
            other => unreachable!("the inbox unpacks every payload: {:?}", other.shape()),
        };
        let t = Tensor::from_inner(inner);
        if track {
            t.require_grad()
        } else {
            t
        }
    }

    /// A received `[rows, cols]` payload as a constant of the graph.
    fn constant(&self, p: &Packed) -> Tensor<B, 2> {
        let shape = p.shape();
        self.take(p, [shape[0], shape[1]], false)
    }

    /// A unit's layer input `[T, M]` as `[B, S, M]` (`S`: the unit's positions): a leaf, or a
    /// constant (`track: false`).
    pub(super) fn hidden(&self, h: &Packed, track: bool) -> Tensor<B, 3> {
        let m = *h.shape().last().expect("[T, M]");
        self.take(h, [self.settings.mb_rows, self.unit_seq(), m], track)
    }

    /// Attention stage `layer` of micro-batch `mb` on `input` (layer 0: `None`, the token ids'
    /// embedding), with its graph or without (`track`), and a routed layer's decision.
    fn attend(&self, mb: usize, layer: usize, input: Option<Packed>, track: bool) -> Result<AttnGraph<B, A, R>> {
        let device = self.device.clone();
        let fork = &mut Fork { device: &device, track };
        let past_first = input.is_some();
        let (h, embed) = match input {
            None => {
                let ends = self.part().ends.as_ref().expect("the embedding worker holds the ends");
                let embed = ends.embed_tokens.clone().map(fork);
                (embed.forward(self.ids(mb)?), Some(embed))
            }
            Some(h) => (self.hidden(&h, track), None),
        };
        let stage = self.part().attention[self.attn_index[&layer]].clone().map(fork);
        let docs = self.documents.get(&self.layout.unit_of(mb).0);
        let (cos, sin) = disagmoe_models::rope::document_tables(self.rope.0.clone(), self.rope.1.clone(), docs);
        let out = stage.forward(h.clone(), cos, sin, docs);
        let routed = self.route(out.route, stage.top_k());
        let h = past_first.then_some(h);
        Ok(AttnGraph { stage, embed, h, residual: out.residual, normed: out.normed, routed, ring: None })
    }

    /// A routed layer's decision on the stage's output under the run's router options.
    pub(super) fn route(
        &self,
        route: Option<disagmoe_models::moe::RouterOutput<B>>,
        top_k: Option<usize>,
    ) -> Option<Routed<B>> {
        match (route, top_k) {
            (Some(decision), Some(k)) => {
                Some(self.settings.routing.route(decision, self.settings.mb_rows, self.layout.experts, k))
            }
            _ => None,
        }
    }

    /// Records a routed layer's decision statistics: the load metrics, the aux-loss-free bias
    /// update, (carried to the head) the balance loss, the copies dropped for capacity, and the
    /// z-loss (its value joins the step's loss here, its gradient this layer's backward).
    fn record_routing(&mut self, layer: usize, routed: &Routed<B>, aux: &mut AuxSums) {
        let stats = &routed.stats;
        if let Some(loss) = &stats.z_loss {
            // A ring worker's z-loss is the mean over its share of the micro-batch's tokens.
            let value =
                loss.to_data().convert::<f64>().to_vec::<f64>().expect("f64")[0] / self.layout.context_parallel as f64;
            self.stats.losses.z += value;
            self.stats.losses.total += self.settings.routing.z_loss_coef * value;
        }
        *self.stats.dropped.entry(layer).or_default() += stats.dropped;
        if self.settings.aux.is_some() {
            let host_ps: Vec<f32> = stats.prob_sum.to_data().convert::<f32>().to_vec().expect("f32");
            aux.layers.push(LayerAux {
                layer,
                routing: stats.routing.clone(),
                prob_sum: host_ps.iter().map(|&x| x as f64).collect(),
            });
        }
        let acc = self.stats.counts.entry(layer).or_insert_with(|| vec![0; self.layout.experts]);
        for (a, c) in acc.iter_mut().zip(&stats.counts) {
            *a += c;
        }
    }

    pub(super) fn attention_forward(&mut self, mb: usize, layer: usize) -> Result<()> {
        let (mut input, aux, from) = if layer == 0 {
            (None, AuxSums::default(), Vec::new())
        } else {
            let Assembled { h, aux, from } = self.inbox.assemble(mb, layer);
            (Some(h), aux, from)
        };
        if self.layout.context_parallel > 1 {
            return self.ring_project(mb, layer, input, aux, from);
        }
        let recompute = self.settings.recompute.attention();
        // A recomputed stage keeps its input for the backward; a kept one hands it over.
        let first = if recompute { input.clone() } else { input.take() };
        let out = self.attend(mb, layer, first, !recompute)?;
        self.hand_on(mb, layer, out, aux, from, input)
    }

    /// What an attention stage's forward sends on (the dispatch to the holders, the residual to the
    /// next layer) and keeps for its backward: `input` when the stage is recomputed.
    pub(super) fn hand_on(
        &mut self,
        mb: usize,
        layer: usize,
        out: AttnGraph<B, A, R>,
        mut aux: AuxSums,
        from: Vec<Share>,
        input: Option<Packed>,
    ) -> Result<()> {
        let recompute = self.settings.recompute.attention();
        let [t, m] = out.normed.dims();
        let plan = match &out.routed {
            Some(routed) => {
                self.record_routing(layer, routed, &mut aux);
                let k = out.stage.top_k().expect("a routed layer has a top-k");
                // The shares are host messages: the ids come to the host here (on CubeCL
                // backends the router chose them on the device).
                let kept = routed.kept.to_host();
                DispatchPlan::routed(mb, layer, &self.layout, &kept, k, t, m)
            }
            None => DispatchPlan::dense(mb, layer, &self.layout, t, m),
        };
        if let (Some(&max), n) = (plan.copies.iter().max(), plan.copies.len()) {
            let sums = self.stats.worker_loads.entry(layer).or_default();
            sums.0 += max as f64;
            sums.1 += plan.copies.iter().sum::<usize>() as f64 / n as f64;
        }
        let (msgs, sent) = plan.into_messages(|tokens| match &out.routed {
            Some(routed) => {
                let idx = index::<B::InnerBackend>(tokens, &self.device);
                let y = self.emit(out.normed.clone().inner().select(0, idx.clone()));
                (y, Some(self.emit(routed.route.weights.clone().inner().select(0, idx))))
            }
            // A dense layer's one share is every token.
            None => (self.emit(out.normed.clone().inner()), None),
        });
        self.send_all(msgs)?;
        let next = self.next_attn_worker(mb, layer);
        self.comm.send(next, exchange::residual(mb, layer, self.emit(out.residual.clone().inner()), aux))?;
        let saved = if recompute {
            AttnSaved { graph: None, input, from, sent }
        } else {
            AttnSaved { graph: Some(out), input: None, from, sent }
        };
        self.attn_saved.insert((mb, layer), saved);
        Ok(())
    }

    fn next_attn_worker(&self, mb: usize, layer: usize) -> usize {
        if layer + 1 == self.layout.layers {
            self.layout.head_worker(self.layout.unit_of(mb).0)
        } else {
            self.layout.attn_worker(mb, layer + 1)
        }
    }

    /// The token ids of unit `unit` (its positions of its micro-batch's rows, [`Worker::positions`]).
    pub(super) fn ids(&self, unit: usize) -> Result<Tensor<B, 2, Int>> {
        let rows = &self.rows[&self.layout.unit_of(unit).0];
        let positions = self.positions(unit);
        let flat: Vec<i64> = rows.iter().flat_map(|r| positions.iter().map(|&p| r[p])).collect();
        Ok(Tensor::from_data(TensorData::new(flat, [rows.len(), positions.len()]), &self.device))
    }

    /// The token ids of micro-batch `mb`'s whole rows.
    fn micro_batch_ids(&self, mb: usize) -> Tensor<B, 2, Int> {
        let rows = &self.rows[&mb];
        let flat: Vec<i64> = rows.iter().flatten().copied().collect();
        Tensor::from_data(TensorData::new(flat, [rows.len(), self.settings.seq]), &self.device)
    }

    /// Expert stage `layer` on a holder's rows, with its graph or without (`track`).
    fn expert(&self, layer: usize, input: &FfnInput, track: bool) -> FfnGraph<B, X> {
        let device = self.device.clone();
        let stage = self.part().experts[self.ffn_index[&layer]].clone().map(&mut Fork { device: &device, track });
        let input_tensor = |h: &Packed| {
            let shape = h.shape();
            self.take(h, [shape[0], shape[1]], track)
        };
        let y = input_tensor(&input.y);
        let w = input.w.as_ref().map(input_tensor);
        let out = stage.forward(y.clone(), w.clone(), &input.ids);
        FfnGraph { stage, y, w, out }
    }

    /// Runs this holder's share of `layer` on the dispatch from attention worker `src`.
    pub(super) fn ffn_forward(&mut self, src: usize, mb: usize, layer: usize) -> Result<()> {
        let Dispatched { tokens, y, weights: w, ids } = self.inbox.dispatched(mb, layer);
        let rows = tokens.len();
        let dst = self.next_attn_worker(mb, layer);
        let m = y.shape().last().copied().unwrap_or(0);
        if rows == 0 {
            self.ffn_saved.insert((mb, layer), FfnSaved { dst: src, rows, graph: None, input: None });
            return self.comm.send(dst, exchange::combine(mb, layer, tokens, Vec::new(), empty(m).into()));
        }
        // Where each row sits in the order of addition, under an explicit placement.
        let k = ids.len() / rows;
        let shared = self.part().experts[self.ffn_index[&layer]].needs_all_tokens();
        let spans = exchange::share_spans(&self.layout, layer, &ids, k, shared);
        let input = FfnInput { y, w, ids: ids.iter().map(|&e| e as usize).collect() };
        let recompute = self.settings.recompute.experts();
        let graph = self.expert(layer, &input, !recompute);
        self.comm.send(dst, exchange::combine(mb, layer, tokens, spans, self.emit(graph.out.clone().inner())))?;
        let saved = if recompute {
            FfnSaved { dst: src, rows, graph: None, input: Some(input) }
        } else {
            FfnSaved { dst: src, rows, graph: Some(graph), input: None }
        };
        self.ffn_saved.insert((mb, layer), saved);
        Ok(())
    }

    /// Adds the gradients of `module`'s parameters (a forked piece of the part) to the step's.
    pub(super) fn accumulate<M: AutodiffModule<B>>(&mut self, grads: &mut B::Gradients, module: &M) {
        let params = crate::optim::grads_in_f32(module, GradientsParams::from_module(grads, module));
        self.grads.accumulate(self.part.as_ref().expect("part"), params);
    }

    pub(super) fn ffn_backward(&mut self, mb: usize, layer: usize) -> Result<()> {
        let g = self.inbox.grad_combine(mb, layer);
        let saved = self.ffn_saved.remove(&(mb, layer)).expect("expert forward before backward");
        let m = g.shape().last().copied().unwrap_or(0);
        let graph = match (saved.graph, &saved.input) {
            (Some(graph), _) => Some(graph),
            (None, Some(input)) => Some(self.expert(layer, input, true)),
            (None, None) => None,
        };
        let (gy, gw) = match graph {
            None => (empty(m).into(), None),
            Some(FfnGraph { stage, y, w, out }) => {
                let g = self.constant(&g);
                let mut grads = (out * g).sum().backward();
                let gy = self.emit(grad_of(&Some(y), &mut grads, [saved.rows, m], &self.device));
                let gw = w.map(|w| {
                    let shape = w.dims();
                    self.emit(grad_of(&Some(w), &mut grads, shape, &self.device))
                });
                self.accumulate(&mut grads, &stage);
                (gy, gw)
            }
        };
        self.comm.send(saved.dst, exchange::grad_dispatch(mb, layer, gy, gw))
    }

    /// Sends the gradient of `layer`'s input (`[B, S, M]`) back ([`input_grad_messages`]).
    pub(super) fn send_input_grad(
        &mut self,
        mb: usize,
        layer: usize,
        gh: Tensor<B::InnerBackend, 3>,
        from: &[Share],
        aux_coef: Vec<LayerCoefficients>,
    ) -> Result<()> {
        let prev = self.layout.attn_worker(mb, layer - 1);
        let [b, s, m] = gh.dims();
        let gh = self.emit(gh.reshape([b * s, m]));
        self.send_all(input_grad_messages(mb, layer, gh, from, prev, aux_coef))
    }

    /// The balance loss of a micro-batch from the sums carried along its layers (its one
    /// definition, in `disagmoe_models::balance`), and each routed layer's coefficients as the
    /// gradient of its sums.
    fn balance_loss(&self, aux: &AuxSums) -> (f64, Vec<LayerCoefficients>) {
        let Some(a) = self.settings.aux.filter(|_| !aux.layers.is_empty()) else { return (0.0, Vec::new()) };
        let routing: Vec<_> = aux.layers.iter().map(|l| l.routing.clone()).collect();
        let sums: Vec<Vec<f64>> = aux.layers.iter().map(|l| l.prob_sum.clone()).collect();
        let coefficients = a.kind.coefficients(&routing);
        let loss = a.kind.value(&routing, &sums);
        let scale = term_scale(self.layout.micro_batches, a.coef) * self.loss_scale as f32;
        let per_layer = (aux.layers.iter().zip(coefficients))
            .map(|(l, c)| LayerCoefficients { layer: l.layer, values: c.iter().map(|&x| scale * x as f32).collect() })
            .collect();
        (loss, per_layer)
    }

    pub(super) fn head(&mut self, mb: usize) -> Result<()> {
        let layers = self.layout.layers;
        // Every unit of the micro-batch (one without context parallelism): its input as a leaf,
        // the sums of its balance statistics, and who sent its rows.
        let units: Vec<usize> = self.layout.ring_units(mb * self.layout.context_parallel).collect();
        let mut leaves = Vec::with_capacity(units.len());
        let mut froms = Vec::with_capacity(units.len());
        let mut aux = AuxSums::default();
        for &u in &units {
            let Assembled { h, aux: unit_aux, from } = self.inbox.assemble(u, layers);
            leaves.push(self.hidden(&h, true));
            froms.push(from);
            aux.merge(unit_aux);
        }
        let h = self.sequence_order(leaves.clone());
        let ids = self.micro_batch_ids(mb);
        let mbs = self.layout.micro_batches as f64;
        let device = self.device.clone();
        let ends = self
            .part()
            .ends
            .clone()
            .expect("the head worker holds the ends")
            .map(&mut Fork { device: &device, track: true });
        // The next-token loss, and the multi-token prediction modules' (they live with the head).
        let docs = self.documents.get(&mb);
        let (cos, sin) = disagmoe_models::rope::document_tables(self.rope.0.clone(), self.rope.1.clone(), docs);
        let (ce, mtp) = ends.head_loss(h.clone(), ids, cos, sin, docs);
        let lm: f64 = ce.to_data().convert::<f64>().to_vec::<f64>().expect("f64")[0];
        let (aux_loss, aux_coef) = self.balance_loss(&aux);
        let ce = match mtp {
            Some(out) => {
                for (m, stats) in ends.mtp.iter().zip(&out.router_stats) {
                    let acc = self.stats.counts.entry(m.layer).or_insert_with(|| vec![0; stats.counts.len()]);
                    acc.iter_mut().zip(&stats.counts).for_each(|(a, c)| *a += c);
                }
                let value: f64 = out.loss.to_data().convert::<f64>().to_vec::<f64>().expect("f64")[0];
                self.stats.mb_losses.push((mb, lm, aux_loss, value));
                ce + out.loss.mul_scalar(self.settings.mtp.loss_coef)
            }
            None => {
                self.stats.mb_losses.push((mb, lm, aux_loss, 0.0));
                ce
            }
        };
        let ce = ce.div_scalar(mbs);
        let mut grads = if self.loss_scale != 1.0 { ce.mul_scalar(self.loss_scale) } else { ce }.backward();
        let params = crate::optim::grads_in_f32(&ends, GradientsParams::from_module(&mut grads, &ends));
        self.head_grads.accumulate(self.part.as_ref().expect("part"), params);
        for ((u, leaf), from) in units.into_iter().zip(leaves).zip(froms) {
            let shape = leaf.dims();
            let gh = grad_of(&Some(leaf), &mut grads, shape, &self.device);
            self.send_input_grad(u, layers, gh, &from, aux_coef.clone())?;
        }
        Ok(())
    }

    pub(super) fn attention_backward(&mut self, mb: usize, layer: usize) -> Result<()> {
        let saved = self.attn_saved.remove(&(mb, layer)).expect("attention forward before backward");
        let inp = self.inbox.grads(mb, layer);
        let GradResidualIn { g: g_res, aux_coef } = inp.residual.expect("grad residual");
        let graph = match saved.graph {
            Some(graph) => graph,
            None if self.layout.context_parallel > 1 => self.ring_recompute(mb, layer),
            None => self.attend(mb, layer, saved.input, true)?,
        };
        let mut objective = (graph.residual.clone() * self.constant(&g_res)).sum();
        let [t, m] = graph.normed.dims();
        let (g_normed, gates) = gather_dispatch_grads(&saved.sent, inp.dispatch, t, m);
        objective = objective + (graph.normed.clone() * self.constant(&g_normed)).sum();
        if let Some(Routed { route, stats, .. }) = &graph.routed {
            for GateGrad { tokens, gw } in gates {
                let w = route.weights.clone().select(0, index::<B>(tokens, &self.device));
                objective = objective + (w * self.constant(&gw)).sum();
            }
            let coefficients = aux_coef.iter().find(|c| c.layer == layer).filter(|_| self.settings.aux.is_some());
            if let Some(c) = coefficients {
                let [b, e] = stats.prob_sum.dims();
                let c = Tensor::<B, 2>::from_data(TensorData::new(c.values.clone(), [b, e]), &self.device);
                objective = objective + (stats.prob_sum.clone() * c).sum();
            }
        }
        if let Some(z) = graph.routed.as_ref().and_then(|r| r.stats.z_loss.as_ref()) {
            // A ring worker's z-loss is the mean over its share of the micro-batch's tokens.
            let scale = term_scale(self.layout.micro_batches, self.settings.routing.z_loss_coef)
                * self.loss_scale as f32
                / self.layout.context_parallel as f32;
            objective = objective + z.clone().mul_scalar(scale as f64);
        }
        let mut grads = objective.backward();
        if let Some(ring) = graph.ring {
            // Context parallelism: the ring half's backward; the projection half's waits for the
            // gradients of this unit's keys and values from the ring.
            self.accumulate(&mut grads, &graph.stage);
            let h = graph.h.expect("a ring half's input leaf");
            return self.ring_half_backward(mb, layer, ring, h, &mut grads, saved.from, aux_coef);
        }
        let gh = graph.h.as_ref().map(|h| grad_of(&Some(h.clone()), &mut grads, h.dims(), &self.device));
        self.accumulate(&mut grads, &graph.stage);
        if let Some(embed) = &graph.embed {
            self.accumulate(&mut grads, embed);
        }
        // Layer 0: the embedding's gradient is already in `grads`; the micro-batch is done.
        match gh {
            Some(gh) => self.send_input_grad(mb, layer, gh, &saved.from, aux_coef),
            None => Ok(()),
        }
    }
}
