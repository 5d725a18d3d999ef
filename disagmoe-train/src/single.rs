//! The single-device step engine: the whole model on one device, micro-batches one after another.
//!
//! One step: for each micro-batch forward -> loss (LM + balance) -> backward, gradients added ->
//! global gradient norm -> (skip if not finite) -> clip -> AdamW with the scheduled learning rate ->
//! aux-loss-free bias update.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use burn::module::{AutodiffModule, Module, ParamId};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;

use disagmoe_kernels::documents::Documents;
use disagmoe_models::{HfCheckpoint, MicroBatchLoss, MoeCausalLm, Recompute, SaveDtype};

use crate::checkpoint::{load_checkpoint, save_checkpoint, TrainState};
use crate::config::{NonFinitePolicy, RunConfig};
use crate::data::Batch;
use crate::error::{Result, TrainError};
use crate::optim::{grad_norm, grads_in_f32, poison_gradient, sum_of_squares, weight_and_grad_bytes, AdamW};
use crate::trainer::{EngineInfo, FinalReport, StateBytes, StepEngine, StepReport, StepTiming};

/// The whole model on one device.
pub struct SingleDevice<B: AutodiffBackend> {
    model: Option<MoeCausalLm<B>>,
    opt: AdamW<B>,
    device: B::Device,
    names: HashMap<ParamId, String>,
    info: EngineInfo,
    with_aux: bool,
    micro_batches: usize,
    grad_clip: f64,
    bias_update_rate: f64,
    on_nonfinite: NonFinitePolicy,
    recompute: Recompute,
    save_dtype: SaveDtype,
    /// Testing: make one parameter's gradient NaN at one step.
    poison: Option<(usize, ParamId)>,
    /// The most training state held at a step's end so far.
    peak_state: StateBytes,
}

/// The model a run config asks for, freshly initialised from the run seed (every tensor drawn from
/// the seed and its checkpoint name), or loaded from `model.dir`.
pub fn build_model<B: AutodiffBackend>(cfg: &RunConfig, device: &B::Device) -> Result<MoeCausalLm<B>> {
    Ok(match &cfg.model.dir {
        Some(dir) => MoeCausalLm::from_pretrained_with(dir, cfg.model.mtp(), device)?,
        None => cfg.model.resolve()?.init(cfg.seed, device),
    })
}

/// Mean next-token cross-entropy of `model` over `rows` (equal-length token rows; attention
/// within each document of `docs` and the targets that begin another one ignored, when given),
/// without gradients: what an evaluation reports.
pub fn evaluate_rows<B: burn::tensor::backend::Backend>(
    model: &MoeCausalLm<B>,
    rows: &[Vec<i64>],
    docs: Option<&Documents>,
    device: &B::Device,
) -> Result<f64> {
    let ids = model.input_ids(rows, device)?;
    let logits = model.forward_documents(ids.clone(), docs).logits;
    let ignore = docs.map(Documents::crosses);
    let loss = disagmoe_models::causal_lm::next_token_cross_entropy(logits, ids, ignore.as_deref());
    Ok(loss.into_data().convert::<f64>().to_vec::<f64>().map_err(|e| TrainError::Worker {
        worker: 0,
        cause: format!("the evaluation loss cannot be read back: {e:?}"),
    })?[0])
}

impl<B: AutodiffBackend> SingleDevice<B> {
    /// The engine of `cfg`: a fresh (or `model.dir`) model, or the model and optimizer state of the
    /// checkpoint `resume` when resuming.
    pub fn new(cfg: &RunConfig, device: &B::Device, resume: Option<&Path>) -> Result<Self> {
        let mut opt = AdamW::<B>::new(cfg.optimizer.adamw());
        let mut model = match resume {
            Some(path) => load_checkpoint::<B>(path, cfg.model.mtp(), &mut opt, device)?.0,
            None => build_model::<B>(cfg, device)?,
        };
        model.set_routing(cfg.model.routing());
        let mconf = model.config();
        let names = model.state_dict_names();
        if crate::optim::bf16_weights(cfg.precision.compute) {
            let low = |id: ParamId, dims: usize| names.get(&id).is_some_and(|n| crate::optim::held_in_bf16(n, dims));
            model = opt.adopt_masters(model, &low);
        }
        let poison = match &cfg.faults.inject_nonfinite {
            Some(inj) => {
                let id = names.iter().find(|(_, n)| **n == inj.tensor).map(|(id, _)| *id).ok_or_else(|| {
                    TrainError::option(
                        "inject_nonfinite.tensor",
                        format!("`{}` is not a parameter of the model", inj.tensor),
                    )
                })?;
                Some((inj.step, id))
            }
            None => None,
        };
        let params = model.num_params();
        let info = EngineInfo {
            params,
            params_per_rank: vec![params],
            workers: 1,
            worker_names: vec!["single device".into()],
            placement: "single",
            primary: true,
            needs_data: true,
            sparse_layers: mconf.sparse_layers(),
            model_type: mconf.model_type(),
            vocab_size: mconf.vocab_size(),
            in_flight: 1,
            flops_per_token: disagmoe_core::cost::training_flops_per_token(
                &mconf.model_shape("the run's model"),
                cfg.data.seq,
            )
            .unwrap_or(f64::NAN),
            expert_placement: Default::default(),
        };
        Ok(Self {
            with_aux: cfg.model.with_aux_loss(mconf.aux_loss_by_default(), !mconf.sparse_layers().is_empty()),
            model: Some(model),
            opt,
            device: device.clone(),
            names,
            info,
            micro_batches: cfg.micro_batches(),
            grad_clip: cfg.optimizer.grad_clip,
            bias_update_rate: cfg.model.bias_update_rate(),
            on_nonfinite: cfg.precision.on_nonfinite,
            recompute: cfg.memory.recompute,
            save_dtype: cfg.save_dtype,
            poison,
            peak_state: StateBytes::default(),
        })
    }

    fn model(&self) -> &MoeCausalLm<B> {
        self.model.as_ref().expect("the model is only taken during the update")
    }

    /// The trained model (with its f32 master weights where it held bf16 working copies).
    pub fn into_model(self) -> MoeCausalLm<B> {
        self.opt.masters_as(self.model.expect("model"))
    }
}

/// Micro-batch losses and router counts of one step.
#[derive(Default)]
struct StepSums {
    total: f64,
    lm: f64,
    aux: Option<f64>,
    z: Option<f64>,
    mtp: Option<f64>,
    counts: Vec<Vec<usize>>,
    mtp_counts: Vec<Vec<usize>>,
    dropped: Vec<usize>,
}

impl StepSums {
    /// Adds one of `mbs` micro-batches: its losses over `mbs`, its counts.
    fn add(&mut self, m: MicroBatchLoss, mbs: usize) {
        let k = mbs as f64;
        self.total += m.total / k;
        self.lm += m.lm / k;
        if let Some(a) = m.aux {
            self.aux = Some(self.aux.unwrap_or(0.0) + a / k);
        }
        if let Some(z) = m.z {
            self.z = Some(self.z.unwrap_or(0.0) + z / k);
        }
        if let Some(x) = m.mtp {
            self.mtp = Some(self.mtp.unwrap_or(0.0) + x / k);
        }
        add_counts(&mut self.mtp_counts, &m.mtp_counts);
        self.dropped.resize(m.dropped.len(), 0);
        self.dropped.iter_mut().zip(&m.dropped).for_each(|(d, x)| *d += x);
        add_counts(&mut self.counts, &m.counts);
    }
}

/// Adds per-layer expert counts into `acc`.
fn add_counts(acc: &mut Vec<Vec<usize>>, more: &[Vec<usize>]) {
    acc.resize(more.len(), Vec::new());
    for (c, x) in acc.iter_mut().zip(more) {
        c.resize(x.len(), 0);
        c.iter_mut().zip(x).for_each(|(a, b)| *a += b);
    }
}

/// One micro-batch through the whole model with one graph: its loss values and the total loss
/// tensor to differentiate.
fn whole_model_loss<B: AutodiffBackend>(
    model: &MoeCausalLm<B>,
    ids: burn::tensor::Tensor<B, 2, burn::tensor::Int>,
    docs: Option<&Documents>,
    with_aux: bool,
) -> (MicroBatchLoss, Tensor<B, 1>) {
    let out = model.forward_documents(ids.clone(), docs);
    let loss = model.loss(&out, ids, with_aux);
    let parts: Vec<Tensor<B, 1>> = [
        Some(loss.total.clone()),
        Some(loss.lm_loss.clone()),
        loss.aux_loss.clone(),
        loss.z_loss.clone(),
        loss.mtp_loss.clone(),
    ]
    .into_iter()
    .flatten()
    .collect();
    let scalars: Vec<f64> = Tensor::cat(parts, 0).into_data().convert::<f64>().to_vec().expect("f64 scalars");
    let mut rest = scalars[2..].iter().copied();
    let micro = MicroBatchLoss {
        total: scalars[0],
        lm: scalars[1],
        aux: loss.aux_loss.as_ref().and_then(|_| rest.next()),
        z: loss.z_loss.as_ref().and_then(|_| rest.next()),
        mtp: loss.mtp_loss.as_ref().and_then(|_| rest.next()),
        counts: out.router_stats.iter().map(|s| s.counts.clone()).collect(),
        mtp_counts: out.mtp.iter().flat_map(|m| m.router_stats.iter().map(|s| s.counts.clone())).collect(),
        dropped: out.router_stats.iter().map(|s| s.dropped).collect(),
    };
    (micro, loss.total)
}

impl<B: AutodiffBackend> StepEngine for SingleDevice<B> {
    fn info(&self) -> EngineInfo {
        self.info.clone()
    }

    fn step(&mut self, step: usize, batch: &Batch, lr: f64, loss_scale: f64, stop: &AtomicBool) -> Result<StepReport> {
        let docs = batch.documents(0..batch.len())?;
        let batch = batch.rows(0..batch.len())?;
        let t0 = std::time::Instant::now();
        let mbs = self.micro_batches;
        let per = batch.len() / mbs;
        let mut acc = GradientsAccumulator::new();
        let mut sums = StepSums::default();
        // The loss differentiated: each micro-batch's (with its own balance term) over K, times the
        // f16 loss scale (the gradients come out `loss_scale` times too large, unscaled at the update).
        let scale = loss_scale / mbs as f64;
        // Recomputation runs the dropped blocks' first forward on the inner backend.
        let inner = (self.recompute != Recompute::None).then(|| self.model().valid());
        for (i, chunk) in batch.chunks(per).enumerate() {
            let model = self.model();
            let ids = model.input_ids(chunk, &self.device)?;
            let docs = docs.as_ref().map(|d| d.rows(i * per..i * per + chunk.len()));
            let micro = match &inner {
                Some(inner) => model.backward_recomputed(
                    inner,
                    ids,
                    docs.as_ref(),
                    self.with_aux,
                    self.recompute,
                    scale,
                    &mut |g| acc.accumulate(model, grads_in_f32(model, GradientsParams::from_grads(g, model))),
                )?,
                None => {
                    let (micro, total) = whole_model_loss(model, ids, docs.as_ref(), self.with_aux);
                    let total = if mbs > 1 { total.div_scalar(mbs as f64) } else { total };
                    let total = if loss_scale != 1.0 { total.mul_scalar(loss_scale) } else { total };
                    acc.accumulate(model, grads_in_f32(model, GradientsParams::from_grads(total.backward(), model)));
                    micro
                }
            };
            sums.add(micro, mbs);
        }
        let mut grads = acc.grads();
        if let Some((_, target)) = self.poison.filter(|(s, _)| *s == step) {
            poison_gradient(self.model(), target, &mut grads);
        }
        let mut norms = grad_norm::<B, _>(self.model(), &grads);
        if loss_scale != 1.0 {
            norms.total /= loss_scale;
        }
        let finite = sums.total.is_finite() && norms.total.is_finite();
        let worst =
            || norms.per_param.iter().find(|(_, n)| !n.is_finite()).and_then(|(id, _)| self.names.get(id).cloned());
        if !finite && self.on_nonfinite == NonFinitePolicy::Abort {
            return Err(TrainError::NonFinite {
                step,
                what: if sums.total.is_finite() { "gradient" } else { "loss" },
                tensor: worst().unwrap_or_default(),
                workers: Vec::new(),
            });
        }
        if finite {
            let scale = if self.grad_clip > 0.0 && norms.total > self.grad_clip {
                self.grad_clip / (norms.total + 1e-6)
            } else {
                1.0
            };
            let (params, grad_bytes) = weight_and_grad_bytes(self.model(), &grads);
            let model = self.model.take().expect("model");
            let mut model = self.opt.step(model, &mut grads, lr, scale / loss_scale);
            let now = StateBytes { params, grads: grad_bytes, optimizer: self.opt.state_bytes() };
            self.peak_state = self.peak_state.max(now);
            if self.bias_update_rate > 0.0 {
                let counts: Vec<Vec<usize>> = sums.counts.iter().chain(&sums.mtp_counts).cloned().collect();
                model.update_router_biases(&counts, self.bias_update_rate)?;
            }
            self.model = Some(model);
        } else {
            let tensor = worst().unwrap_or_else(|| "the loss".into());
            tracing::warn!(step, loss = sums.total, tensor = %tensor, "non-finite loss or gradient: update skipped");
        }
        Ok(StepReport {
            loss: sums.total,
            lm_loss: sums.lm,
            aux_loss: sums.aux,
            z_loss: sums.z,
            mtp_loss: sums.mtp,
            grad_norm: norms.total,
            skipped: !finite,
            expert_counts: sums.counts,
            dropped: sums.dropped,
            worker_imbalance: Vec::new(),
            timing: StepTiming { compute_s: t0.elapsed().as_secs_f64(), ..Default::default() },
            rebalance: None,
            stop: stop.load(Ordering::SeqCst),
        })
    }

    fn optimizer_steps(&self) -> u64 {
        self.opt.steps_taken()
    }

    fn evaluate(&mut self, batch: &Batch) -> Result<f64> {
        // The mean of the micro-batches' means, as the step's loss (under a document mask the
        // micro-batches count different numbers of targets).
        let model = self.model().valid();
        let per = batch.len().div_ceil(self.micro_batches).max(1);
        let (mut sum, mut n) = (0.0, 0);
        for start in (0..batch.len()).step_by(per) {
            let range = start..(start + per).min(batch.len());
            let docs = batch.documents(range.clone())?;
            sum += evaluate_rows(&model, &batch.rows(range)?, docs.as_ref(), &self.device)?;
            n += 1;
        }
        Ok(sum / n.max(1) as f64)
    }

    fn save_checkpoint(&mut self, dir: &Path, state: &TrainState, keep: usize) -> Result<PathBuf> {
        save_checkpoint(dir, self.model(), &self.opt, state, keep)
    }

    fn finish(&mut self, out: Option<&Path>) -> Result<FinalReport> {
        if let Some(dir) = out {
            self.opt.masters_as(self.model().clone()).valid().save_pretrained_as(dir, 2 << 30, self.save_dtype)?;
        }
        Ok(FinalReport {
            param_checksum: sum_of_squares(&self.opt.masters_as(self.model().clone())),
            peak_rss_mb_per_rank: vec![crate::metrics::peak_rss_mb()],
            state_per_rank: vec![self.peak_state],
        })
    }
}
