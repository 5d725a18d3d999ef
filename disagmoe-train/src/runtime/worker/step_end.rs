//! The end of a worker's step: the attention copies' gradient all-reduce (reduce-scatter, with the
//! distributed optimizer: [`super::sharded`]), one global sum of what every worker measured, and
//! the update (clipping, AdamW, the routers' bias; the shards' update and all-gather), the same
//! decision on every worker.

use std::collections::HashMap;

use burn::module::Module;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::backend::AutodiffBackend;

use disagmoe_models::decoder::AttentionLayer;
use disagmoe_models::moe::{Experts, Router};
use disagmoe_models::TrainModule;

use super::autodiff::{Flatten, MoveGrads, Restore, ZeroFill};
use super::comm::StepMeters;
use super::sharded::{flatten_shared, restore_shared, ShardGrads};
use super::{Worker, WorkerPart};
use crate::error::{Result, TrainError};
use crate::metrics::ExchangeBytes;
use crate::optim::{grad_norm, poison_gradient, weight_and_grad_bytes};
use crate::runtime::collectives::ReduceValues;
use crate::runtime::trace::COMPUTE;
use crate::runtime::transport::now_us;
use crate::trainer::StateBytes;
use crate::trainer::{StepReport, StepTiming};

/// The losses of a step's micro-batches, summed (divided by the micro-batches at the end).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct StepLosses {
    /// LM loss + coefficient x balance loss.
    pub(super) total: f64,
    /// LM loss.
    pub(super) lm: f64,
    /// Balance loss before its coefficient.
    pub(super) aux: f64,
    /// Router z-loss before its coefficient (summed over layers).
    pub(super) z: f64,
    /// Multi-token prediction loss before its coefficient.
    pub(super) mtp: f64,
}

/// What a worker gathers during a step for its end.
#[derive(Debug, Default)]
pub(super) struct StepStats {
    /// LM, balance and multi-token prediction loss of each micro-batch whose head ran here.
    pub(super) mb_losses: Vec<(usize, f64, f64, f64)>,
    /// Routed copies per expert of each routed layer this worker routed.
    pub(super) counts: HashMap<usize, Vec<usize>>,
    /// Routed copies this worker dropped for capacity, by layer.
    pub(super) dropped: HashMap<usize, usize>,
    /// By layer, the busiest expert worker's routed copies and the workers' mean, each added over
    /// the micro-batches this worker dispatched.
    pub(super) worker_loads: HashMap<usize, (f64, f64)>,
    pub(super) losses: StepLosses,
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
    /// Of them, the token exchange's, by kind.
    exchange_bytes: [f64; 8],
    /// Payload bytes read back to the host.
    payload_host_bytes: f64,
    /// Workers asked to stop (a signal reached their process).
    stop: f64,
    /// Routed copies per expert of every MoE layer (counted by the first copy of its attention
    /// group), layer-major, then the copies each MoE layer dropped for capacity (counted where
    /// they were routed), then per MoE layer the busiest expert worker's copies and the workers'
    /// mean, added over micro-batches (counted where they were dispatched).
    expert_counts: Vec<f64>,
}

/// A field of [`GlobalSums`].
type Field = fn(&mut GlobalSums) -> &mut f64;

impl GlobalSums {
    /// The scalar fields in the order they travel (the expert counts follow). The order is part of
    /// the sums' bits (a ring adds each piece starting at another member), so it stays as it is.
    const SCALARS: [Field; 21] = [
        |g| &mut g.grad_sq,
        |g| &mut g.losses.total,
        |g| &mut g.losses.lm,
        |g| &mut g.losses.aux,
        |g| &mut g.waits_s,
        |g| &mut g.wire_s,
        |g| &mut g.compute_s,
        |g| &mut g.link_s,
        |g| &mut g.stop,
        |g| &mut g.bytes_sent,
        |g| &mut g.losses.z,
        |g| &mut g.exchange_bytes[0],
        |g| &mut g.exchange_bytes[1],
        |g| &mut g.exchange_bytes[2],
        |g| &mut g.exchange_bytes[3],
        |g| &mut g.exchange_bytes[4],
        |g| &mut g.exchange_bytes[5],
        |g| &mut g.payload_host_bytes,
        |g| &mut g.losses.mtp,
        |g| &mut g.exchange_bytes[6],
        |g| &mut g.exchange_bytes[7],
    ];

    fn into_vec(mut self) -> Vec<f64> {
        let mut v: Vec<f64> = Self::SCALARS.iter().map(|field| *field(&mut self)).collect();
        v.extend(&self.expert_counts);
        v
    }

    fn from_vec(v: &[f64]) -> Self {
        let n = Self::SCALARS.len();
        let mut g = Self { expert_counts: v[n..].to_vec(), ..Self::default() };
        for (field, &x) in Self::SCALARS.iter().zip(v) {
            *field(&mut g) = x;
        }
        g
    }
}

impl<B, A, R, X> Worker<B, A, R, X>
where
    B: AutodiffBackend,
    A: TrainModule<B> + AttentionLayer<B>,
    R: TrainModule<B> + Router<B>,
    X: TrainModule<B> + Experts<B>,
{
    /// Sums `data` over `group` in place with this worker's reducer (every member ends with the
    /// same bits); the bytes a ring would send are counted, whatever reduces it.
    pub(super) fn all_reduce<T: ReduceValues>(&mut self, group: &[usize], data: &mut [T]) -> Result<()> {
        if group.len() <= 1 {
            return Ok(());
        }
        let n = group.len();
        self.comm.meters.bytes_sent += (2 * (n - 1) * data.len() * std::mem::size_of::<T>() / n) as u64;
        T::sum_with(self.reducer.as_mut(), &mut self.comm, group, data)
    }

    /// The first half of [`Self::all_reduce`] over this worker's copies: its shard of `data` holds
    /// the sum (see [`super::sharded`]).
    fn reduce_scatter(&mut self, group: &[usize], data: &mut [f32]) -> Result<()> {
        let n = group.len();
        self.comm.meters.bytes_sent += ((n - 1) * data.len() * 4 / n) as u64;
        self.reducer.reduce_scatter_f32(&mut self.comm, group, data)
    }

    /// The second half: every copy's shard of `data` reaches the others.
    pub(super) fn all_gather(&mut self, group: &[usize], data: &mut [f32]) -> Result<()> {
        let n = group.len();
        self.comm.meters.bytes_sent += ((n - 1) * data.len() * 4 / n) as u64;
        self.reducer.all_gather_f32(&mut self.comm, group, data)
    }

    /// The routers' expert counts of the layers in `routed` this worker routed (zeros for the
    /// others), for its copies' sum.
    fn counts_to_add(&self, routed: &[usize]) -> Vec<f32> {
        let e = self.layout.experts;
        routed
            .iter()
            .flat_map(|l| self.stats.counts.get(l).cloned().unwrap_or_else(|| vec![0; e]))
            .map(|x| x as f32)
            .collect()
    }

    /// Takes the copies' summed counts (`sums`, as [`Self::counts_to_add`] laid them out) as this
    /// worker's, for the layers it routed or that any copy did.
    fn take_summed_counts(&mut self, routed: &[usize], sums: &[f32]) {
        let e = self.layout.experts;
        for (l, c) in routed.iter().zip(sums.chunks(e.max(1))) {
            if self.stats.counts.contains_key(l) || c.iter().any(|&x| x > 0.0) {
                self.stats.counts.insert(*l, c.iter().map(|&x| x.round() as usize).collect());
            }
        }
    }

    /// The copies' sum of their attention-side gradients (in place in `grads`) and router counts;
    /// with the distributed optimizer, the gradients reduce-scattered instead (taken out of
    /// `grads`: the returned shard holds them) and which of them exist summed with the counts.
    ///
    /// Without it the copies' all-reduce is the same reduce-scatter followed by an all-gather, over
    /// the same vector: each sum is then added in the same order as with the distributed optimizer
    /// (a library's all-reduce, `MPI_Allreduce`, would add four copies' gradients in another order
    /// than its reduce-scatter), so the two differ only by the order of the norm's sum. The bytes
    /// sent are the all-reduce's; under `local` the two halves are the ring all-reduce's.
    fn reduce_copies(
        &mut self,
        grads: &mut GradientsParams,
        replicas: &[usize],
        routed: &[usize],
    ) -> Result<Option<ShardGrads>> {
        if self.sharded.is_none() && replicas.len() <= 1 {
            return Ok(None);
        }
        let (mut data, mut small) = match &self.sharded {
            Some(sharded) => sharded.flatten(grads, self.part()),
            None => flatten_shared(grads, self.part(), 0),
        };
        let params = small.len();
        small.extend(self.counts_to_add(routed));
        self.all_reduce(replicas, &mut small)?;
        self.reduce_scatter(replicas, &mut data)?;
        self.take_summed_counts(routed, &small[params..]);
        if self.sharded.is_some() {
            return Ok(Some(ShardGrads { data, present: small[..params].iter().map(|&x| x > 0.0).collect() }));
        }
        self.all_gather(replicas, &mut data)?;
        restore_shared(grads, self.part(), &data, &small[..params]);
        Ok(None)
    }

    /// The holders of each replicated expert of this worker sum their gradients of it (every
    /// holder keeps the sum, so their AdamW steps stay identical): one all-reduce per replicated
    /// expert over its holders, in (layer, expert) order on every holder. A gradient that only some
    /// replicas have (an expert of its own per replica, which saw tokens on one) exists on all of
    /// them afterwards; one that none has stays absent.
    fn reduce_expert_replicas(&mut self, grads: &mut GradientsParams) -> Result<()> {
        if !self.layout.has_replicas() {
            return Ok(());
        }
        let rank = self.rank();
        let mut replicated = Vec::new();
        for (s, (l, _)) in self.layout.ffn_layers(rank).into_iter().enumerate() {
            for (r, run) in self.part().experts[s].runs.iter().enumerate() {
                if run.len() == 1 && self.layout.expert_replicas(l, run.start) > 1 {
                    replicated.push((s, r, self.layout.expert_holders(l, run.start)));
                }
            }
        }
        for (s, r, group) in replicated {
            let mut flat = Flatten { grads, out: Vec::new() };
            self.part().experts[s].experts[r].visit(&mut flat);
            let mut data = flat.out;
            self.all_reduce(&group, &mut data)?;
            self.part().experts[s].experts[r].visit(&mut Restore { grads, data: &data, pos: 0 });
        }
        Ok(())
    }

    /// The gradient norm of this worker's expert stages, a replicated expert counted by its first
    /// holder only.
    fn expert_grad_norm(&self, grads: &mut GradientsParams) -> crate::optim::GradNorms {
        let part = self.part();
        if !self.layout.has_replicas() {
            return grad_norm::<B, _>(&part.experts, grads);
        }
        // The gradients of the replicas counted elsewhere are set aside for the norm.
        let rank = self.rank();
        let mut aside = GradientsParams::new();
        for (stage, (l, _)) in part.experts.iter().zip(self.layout.ffn_layers(rank)) {
            for (x, run) in stage.experts.iter().zip(&stage.runs) {
                if !crate::runtime::part::counts_run(&self.layout, l, run, rank) {
                    x.visit(&mut MoveGrads { from: &mut *grads, to: &mut aside });
                }
            }
        }
        let norm = grad_norm::<B, _>(&part.experts, grads);
        for stage in &part.experts {
            stage.visit(&mut MoveGrads { from: &mut aside, to: &mut *grads });
        }
        norm
    }

    /// The distributed optimizer's update (after `opt.step`, whose step it shares): this copy's
    /// shard of the shared weights, then every copy's shard gathered into the part.
    fn update_shard(&mut self, g: &mut ShardGrads, lr: f64, grad_scale: f64) -> Result<()> {
        let sharded = self.sharded.as_mut().expect("a shard to update");
        sharded.update_shard(g, &self.opt, lr, grad_scale, self.part.as_ref().expect("part"));
        let group = sharded.group.clone();
        self.all_gather(&group, &mut g.data)?;
        let part = self.part.take().expect("part");
        self.part = Some(self.sharded.as_ref().expect("sharded").load(g, part));
        Ok(())
    }

    /// The global sums of this worker's step: squared gradient norm, losses, the step's waits,
    /// compute, link time and bytes since `start` (the final reduction is the step's barrier and
    /// is not counted), the stop request, and the expert load of every MoE layer.
    fn my_sums(&self, grad_sq: f64, start: StepMeters, stop: bool, sparse: &[usize]) -> GlobalSums {
        let e = self.layout.experts;
        let rank = self.rank();
        let mut expert_counts = vec![0.0; sparse.len() * e];
        // Expert load of every MoE layer: its attention group's first copy counts it.
        if self.layout.replicas(rank).first() == Some(&rank) {
            for (i, l) in sparse.iter().enumerate() {
                if let Some(c) = self.stats.counts.get(l) {
                    for (j, &x) in c.iter().enumerate() {
                        expert_counts[i * e + j] = x as f64;
                    }
                }
            }
        }
        // Each (micro-batch, layer) is routed by one attention worker: it counts the copies dropped.
        expert_counts.extend(sparse.iter().map(|l| self.stats.dropped.get(l).copied().unwrap_or(0) as f64));
        let loads = |l: &usize| self.stats.worker_loads.get(l).copied().unwrap_or_default();
        expert_counts.extend(sparse.iter().flat_map(|l| [loads(l).0, loads(l).1]));
        let d = self.meters() - start;
        let wire_s = d.wait_wire_us as f64 * 1e-6;
        GlobalSums {
            grad_sq,
            losses: self.stats.losses,
            waits_s: wire_s + d.wait_peer_us as f64 * 1e-6,
            wire_s,
            compute_s: d.compute_us as f64 * 1e-6,
            link_s: d.link_us as f64 * 1e-6,
            bytes_sent: d.bytes_sent as f64,
            exchange_bytes: d.exchange_bytes.map(|b| b as f64),
            payload_host_bytes: d.payload_host_bytes as f64,
            stop: if stop { 1.0 } else { 0.0 },
            expert_counts,
        }
    }

    /// The test-only fault `inject_nonfinite`: at its step, the named tensor's gradient becomes NaN
    /// where it is held: on its expert holder(s), and on the first copy of an attention-side tensor
    /// (the copies' all-reduce spreads it to the others, as it would a real one).
    fn inject_nonfinite(&self, grads: &mut GradientsParams) {
        let Some((_, tensor)) = self.settings.poison_at.as_ref().filter(|(step, _)| *step == self.comm.step) else {
            return;
        };
        let Some(&id) = self.names.iter().find(|(_, name)| *name == tensor).map(|(id, _)| id) else {
            return;
        };
        let part = self.part();
        let rank = self.rank();
        if !poison_gradient(&part.experts, id, grads) && self.layout.replicas(rank).first().is_none_or(|&r| r == rank) {
            poison_gradient(&part.ends, id, grads);
            poison_gradient(&part.attention, id, grads);
        }
    }

    /// The step's end (see the module doc); returns the step's report, the same on every worker.
    pub(super) fn end_of_step(&mut self, lr: f64, start: StepMeters, stop: bool, update: bool) -> Result<StepReport> {
        let t0 = now_us();
        let rank = self.rank();
        let step = self.comm.step;
        if let Some((_, seconds)) = self.settings.absent_at.filter(|(s, _)| *s == step) {
            eprintln!(
                "worker {rank}: staying away from the end of step {step} for {seconds} s on purpose (fault injection)"
            );
            self.comm.idle();
            std::thread::sleep(std::time::Duration::from_secs_f64(seconds));
        }
        self.comm.working_on(format!("the end of {} (all-reduces, optimizer step)", super::pass_name(step)));
        let mut grads = {
            let part = self.part.as_ref().expect("part");
            let (body, head) = (self.grads.grads(), self.head_grads.grads());
            let mut sum = GradientsAccumulator::<WorkerPart<B, A, R, X>>::new();
            sum.accumulate(part, body);
            sum.accumulate(part, head);
            sum.grads()
        };
        if update {
            self.inject_nonfinite(&mut grads);
        }
        // Losses of this worker's micro-batches, added in micro-batch order.
        let mut mb_losses = std::mem::take(&mut self.stats.mb_losses);
        mb_losses.sort_by_key(|&(mb, ..)| mb);
        let coef = self.settings.aux.map_or(0.0, |a| a.coef);
        let mtp_coef = self.settings.mtp.loss_coef;
        for (_, lm, aux, mtp) in mb_losses {
            let l = &mut self.stats.losses;
            l.total += lm + coef * aux + mtp_coef * mtp;
            l.lm += lm;
            l.aux += aux;
            l.mtp += mtp;
        }
        let replicas = self.layout.replicas(rank);
        let mut routed: Vec<usize> = self.attn_index.keys().copied().collect();
        routed.sort_unstable();
        // The multi-token prediction modules' routed blocks, by their layer index (after the
        // main layers), on the copies that hold the head.
        let mtp_layers: Vec<usize> = self.part().ends.iter().flat_map(|e| &e.mtp).map(|m| m.layer).collect();
        routed.extend(&mtp_layers);
        let e = self.layout.experts;
        let (param_bytes, grad_bytes) = if update { weight_and_grad_bytes(self.part(), &grads) } else { (0, 0) };
        // 1. Copies of the attention side add their gradients and their routers' expert counts
        //    (not for an evaluation: nothing is updated).
        let mut shard = if update { self.reduce_copies(&mut grads, &replicas, &routed)? } else { None };
        // A fused expert tensor is stepped whenever its layer saw tokens, on every holder.
        let part = self.part.as_ref().expect("part");
        for x in part.experts.iter().flat_map(|s| &s.experts).filter(|x| x.fused()) {
            x.visit(&mut ZeroFill { grads: &mut grads });
        }
        // The holders of a replicated expert sum their gradients of it.
        if update {
            self.reduce_expert_replicas(&mut grads)?;
        }
        // 2. One global sum: squared gradient norm (each parameter once: a replicated expert's
        //    gradient is counted by its first holder), losses, timings.
        let part = self.part.as_ref().expect("part");
        let mut norms = vec![self.expert_grad_norm(&mut grads)];
        if replicas.first() == Some(&rank) && shard.is_none() {
            norms.push(grad_norm::<B, _>(&part.ends, &grads));
            norms.push(grad_norm::<B, _>(&part.attention, &grads));
        }
        // With the distributed optimizer each copy adds the squares of its shard.
        let (shard_sq, shard_bad) = match (&self.sharded, &shard) {
            (Some(s), Some(g)) => s.squares(g),
            _ => (0.0, None),
        };
        let sq: f64 = norms.iter().map(|n| n.total.powi(2)).sum::<f64>() + shard_sq;
        // The first tensor of this worker whose gradient is not finite, for the error message.
        let bad = (norms.iter().flat_map(|n| n.per_param.iter()))
            .find(|(_, v)| !v.is_finite())
            .map(|(id, _)| *id)
            .or(shard_bad)
            .and_then(|id| self.names.get(&id).cloned());
        let sparse: Vec<usize> = (0..self.layout.layers).filter(|&l| self.layout.sparse[l]).collect();
        let mut sums = self.my_sums(sq, start, stop, &sparse).into_vec();
        self.all_reduce(&self.everyone(), &mut sums)?;
        let g = GlobalSums::from_vec(&sums);
        let mbs = self.layout.micro_batches as f64;
        // The gradients are `loss_scale` times too large (f16's loss scaling).
        let norm = g.grad_sq.sqrt() / self.loss_scale;
        let (counts, rest) = g.expert_counts.split_at(sparse.len() * e);
        let (dropped, loads) = rest.split_at(sparse.len());
        let report = StepReport {
            loss: g.losses.total / mbs,
            lm_loss: g.losses.lm / mbs,
            aux_loss: self.settings.aux.is_some().then_some(g.losses.aux / mbs),
            z_loss: (self.settings.routing.z_loss_coef > 0.0).then_some(g.losses.z / mbs),
            mtp_loss: (self.settings.mtp.depth > 0).then_some(g.losses.mtp / mbs),
            grad_norm: norm,
            skipped: !(g.losses.total.is_finite() && norm.is_finite()),
            expert_counts: counts.chunks(e.max(1)).map(|c| c.iter().map(|&x| x.round() as usize).collect()).collect(),
            dropped: dropped.iter().map(|&x| x.round() as usize).collect(),
            worker_imbalance: loads.chunks(2).map(|c| if c[1] > 0.0 { c[0] / c[1] } else { 0.0 }).collect(),
            timing: StepTiming {
                exposed_comm_s: g.waits_s,
                in_flight_wait_s: g.wire_s,
                compute_s: g.compute_s,
                link_s: g.link_s,
                bytes_sent: g.bytes_sent,
                exchange_bytes: ExchangeBytes::from_kinds(g.exchange_bytes),
                payload_host_bytes: g.payload_host_bytes,
            },
            stop: g.stop > 0.0,
            rebalance: None,
        };
        if report.skipped && self.settings.abort_on_nonfinite && update {
            // Every worker learns which workers hold a non-finite gradient (only a holder can name
            // the tensor), so that each one's line says where; the same error ends every worker.
            let mut held = vec![0f64; self.layout.workers];
            held[rank] = if bad.is_some() { 1.0 } else { 0.0 };
            self.all_reduce(&self.everyone(), &mut held)?;
            return Err(TrainError::NonFinite {
                step: self.comm.step,
                what: if g.losses.total.is_finite() { "gradient" } else { "loss" },
                tensor: bad.unwrap_or_default(),
                workers: (0..held.len()).filter(|&w| held[w] > 0.0).collect(),
            });
        }
        // 3. The update, the same decision on every worker.
        if !report.skipped && update {
            let scale = if self.settings.grad_clip > 0.0 && norm > self.settings.grad_clip {
                self.settings.grad_clip / (norm + 1e-6)
            } else {
                1.0
            };
            let part = self.part.take().expect("part");
            self.part = Some(self.opt.step(part, &mut grads, lr, scale / self.loss_scale));
            if let Some(g) = shard.as_mut() {
                self.update_shard(g, lr, scale / self.loss_scale)?;
            }
            let mut part = self.part.take().expect("part");
            if self.settings.bias_update_rate > 0.0 {
                for l in &routed {
                    let router = match self.attn_index.get(l) {
                        Some(&i) => part.attention[i].router.as_mut(),
                        None => part
                            .ends
                            .iter_mut()
                            .flat_map(|e| &mut e.mtp)
                            .find(|m| m.layer == *l)
                            .and_then(|m| m.router_mut()),
                    };
                    if let (Some(c), Some(router)) = (self.stats.counts.get(l), router) {
                        router.update_balance_bias(c, self.settings.bias_update_rate)?;
                    }
                }
            }
            self.part = Some(part);
        }
        if update {
            let now = StateBytes {
                params: param_bytes,
                grads: grad_bytes,
                optimizer: self.opt.state_bytes() + self.sharded.as_ref().map_or(0, |s| s.state_bytes()),
            };
            self.peak_state = self.peak_state.max(now);
        }
        self.stats = StepStats::default();
        self.comm.tracer.span(|| "all-reduce + optimizer".into(), "optimizer", COMPUTE, t0, now_us());
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_global_sums_travel_and_come_back_field_by_field() {
        let g = GlobalSums {
            grad_sq: 1.0,
            losses: StepLosses { total: 2.0, lm: 3.0, aux: 4.0, z: 11.0, mtp: 19.0 },
            waits_s: 5.0,
            wire_s: 6.0,
            compute_s: 7.0,
            link_s: 8.0,
            stop: 9.0,
            bytes_sent: 10.0,
            exchange_bytes: [12.0, 13.0, 14.0, 15.0, 16.0, 17.0, 20.0, 21.0],
            payload_host_bytes: 18.0,
            expert_counts: vec![22.0, 23.0],
        };
        let v = g.into_vec();
        // The order they always travelled in (it is part of a ring sum's bits); the MTP loss and
        // the ring's key-value bytes, added last among the scalars, come before the expert counts.
        assert_eq!(v, (1..=23).map(f64::from).collect::<Vec<_>>());
        let back = GlobalSums::from_vec(&v);
        assert_eq!(
            (back.losses.z, back.losses.mtp, back.bytes_sent, &back.expert_counts),
            (11.0, 19.0, 10.0, &vec![22.0, 23.0])
        );
        assert_eq!(back.exchange_bytes[6..], [20.0, 21.0]);
        assert_eq!(back.into_vec(), v);
    }
}
