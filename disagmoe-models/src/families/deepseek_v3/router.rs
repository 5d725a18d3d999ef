//! The DeepSeek router: sigmoid (or softmax) scores, a selection-only correction bias, group-limited
//! top-k, normalisation and `routed_scaling_factor`; plus aux-loss-free balancing of the bias.
//!
//! # Notation
//! - `T`: tokens; `M`: model width; `E`: routed experts; `k`: experts per token
//! - `G`: expert groups (`n_group`), each of `E / G` consecutive experts; `g`: groups kept (`topk_group`)
//!
//! # Routing, as transformers' `DeepseekV3TopkRouter` computes it
//! 1. `scores = sigmoid(x W^T)` `[T, E]` (differentiable; `softmax` for DeepSeekMoE/V2 gating);
//! 2. `choice = scores + e_score_correction_bias` (selection only, never differentiated);
//! 3. group score = sum of the two best `choice` values in the group; keep the `g` best groups;
//! 4. the `k` best `choice` values among the kept groups' experts are the chosen experts;
//! 5. gate weights = `scores` of the chosen experts, divided by their sum (+1e-20) when
//!    `norm_topk_prob`, times `routed_scaling_factor`.
//!
//! Steps 2-4 run on the device on CubeCL backends ([`DeepseekRouter::select_on_device`]), else on
//! the host ([`DeepseekRouter::select`]); ties go to the lower index.
//!
//! # Aux-loss-free balancing (DeepSeek-V3 paper, section 2.1.2)
//! After each step, [`DeepseekRouter::update_bias`] moves each expert's bias by `rate` towards
//! balance: `b_e += rate * sign(mean_load - load_e)`. The bias is a buffer, not a trained parameter:
//! it is a [`Param`] that does not require a gradient, so optimizers never see a gradient for it.

use burn::module::{Module, Param};
use burn::tensor::activation::{sigmoid, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

use super::config::ScoringFunc;
use crate::error::{ModelError, Result};
use crate::init::Init;
use crate::moe::{choose_top_k, ExpertIds, Router, RouterOutput};
use crate::weights::{CheckpointReader, TensorSink};

/// Shape and rule of a [`DeepseekRouter`].
#[derive(Debug, Clone, Copy)]
pub struct DeepseekRouterConfig {
    /// Model width M.
    pub hidden: usize,
    /// Routed experts E.
    pub experts: usize,
    /// Experts per token k.
    pub top_k: usize,
    /// Expert groups G (divides E).
    pub n_group: usize,
    /// Groups kept per token g.
    pub topk_group: usize,
    /// Normalise the chosen scores to sum to one.
    pub norm_topk_prob: bool,
    /// Multiplies the gate weights.
    pub routed_scaling_factor: f64,
    /// Sigmoid or softmax scores.
    pub scoring: ScoringFunc,
}

/// Group-limited top-k router with a selection-only correction bias (`mlp.gate` in DeepSeek-V3).
#[derive(Module, Debug)]
pub struct DeepseekRouter<B: Backend> {
    /// `[E, M]`, the checkpoint's `mlp.gate.weight`.
    pub weight: Param<Tensor<B, 2>>,
    /// `[E]`, the checkpoint's `mlp.gate.e_score_correction_bias`: added to the scores for selection
    /// only. Does not require a gradient; changed only by [`DeepseekRouter::update_bias`] and loading.
    pub e_score_correction_bias: Param<Tensor<B, 1>>,
    #[module(skip)]
    config: DeepseekRouterConfig,
}

fn buffer<B: Backend>(t: Tensor<B, 1>) -> Param<Tensor<B, 1>> {
    Param::from_tensor(t).set_require_grad(false)
}

fn host<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec::<f32>().expect("f32 values")
}

impl<B: Backend> DeepseekRouter<B> {
    /// A router with normal(0, std) weights and a zero bias, named `gate.weight` and
    /// `gate.e_score_correction_bias` (`init` is scoped to the MoE block).
    pub fn new(config: DeepseekRouterConfig, init: &Init<B>) -> Self {
        Self {
            weight: Param::from_tensor(init.child("gate").normal("weight", [config.experts, config.hidden])),
            e_score_correction_bias: buffer(init.zeros([config.experts])),
            config,
        }
    }

    /// The router's shape and rule.
    pub fn config(&self) -> &DeepseekRouterConfig {
        &self.config
    }

    /// The correction bias on the host, `[E]`.
    pub fn bias_values(&self) -> Vec<f32> {
        host(self.e_score_correction_bias.val())
    }

    /// Aux-loss-free balancing: `b_e += rate * sign(mean(counts) - counts[e])`, so that overloaded
    /// experts become less likely to be chosen and underloaded ones more. `counts` are the routed
    /// copies per expert of the last step (e.g. [`crate::moe::RouterStats::counts`], summed over
    /// micro-batches); a balanced expert (`counts[e] == mean`) keeps its bias.
    pub fn update_bias(&mut self, counts: &[usize], rate: f64) -> Result<()> {
        let e = self.config.experts;
        if counts.len() != e {
            return Err(ModelError::InvalidInput(format!(
                "update_bias: {} expert counts for a router of {e} experts",
                counts.len()
            )));
        }
        if !(rate.is_finite() && rate >= 0.0) {
            return Err(ModelError::InvalidInput(format!(
                "update_bias: rate must be a finite number >= 0, got {rate}"
            )));
        }
        let mean = counts.iter().sum::<usize>() as f64 / e as f64;
        let delta: Vec<f32> = counts
            .iter()
            .map(|&c| {
                let gap = mean - c as f64;
                (rate
                    * if gap > 0.0 {
                        1.0
                    } else if gap < 0.0 {
                        -1.0
                    } else {
                        0.0
                    }) as f32
            })
            .collect();
        let old = self.e_score_correction_bias.val();
        let delta = Tensor::<B, 1>::from_data(TensorData::new(delta, [e]), &old.device());
        let id = self.e_score_correction_bias.id;
        self.e_score_correction_bias = Param::initialized(id, (old.detach() + delta).set_require_grad(false));
        Ok(())
    }

    /// Steps 3-4 on the device (CubeCL backends), from the biased scores `choice` `[T, E]`: each
    /// group's score is the sum of its two best choices (the top-k kernel on `[T G, E / G]`), the
    /// `topk_group` best groups are kept (the top-k kernel again, ties to the lower group), and
    /// the `k` best choices among their experts are chosen (the others masked below every
    /// score). The same experts as [`DeepseekRouter::select`], `[T k]` token-major, best first;
    /// `None` where the kernels do not apply, or for a configuration whose groups do not split
    /// the scores' columns evenly (one built by hand rather than checked from JSON).
    pub fn select_on_device(&self, choice: Tensor<B, 2>) -> Option<Tensor<B, 1, Int>> {
        let DeepseekRouterConfig { experts: e, top_k: k, n_group: g, topk_group: keep, .. } = self.config;
        if g == 0 || e % g != 0 || choice.dims()[1] != e || !(1..=g).contains(&keep) {
            return None;
        }
        let (t, per) = (choice.dims()[0], e / g);
        let device = choice.device();
        let grouped = choice.clone().reshape([t * g, per]);
        let best = per.min(2);
        let top_ids = disagmoe_kernels::fused::top_k(grouped.clone(), best)?.reshape([t * g, best]);
        let top = grouped.gather(1, top_ids); // [T G, best], best first
        let group_scores = match best {
            2 => top.clone().narrow(1, 0, 1) + top.narrow(1, 1, 1),
            _ => top,
        }
        .reshape([t, g]);
        let kept = disagmoe_kernels::fused::top_k(group_scores, keep)?; // [T keep]
        let group_of = Tensor::<B, 1, Int>::arange(0..e as i64, &device).div_scalar(per as i64).cast(kept.dtype());
        let allowed = kept
            .reshape([t, keep, 1])
            .expand([t, keep, e])
            .equal(group_of.reshape([1, 1, e]).expand([t, keep, e]))
            .any_dim(1)
            .reshape([t, e]);
        disagmoe_kernels::fused::top_k(choice.mask_fill(allowed.bool_not(), f32::MIN), k)
    }

    /// Steps 2-4: the chosen experts of each token from host scores `[T, E]` and bias `[E]`,
    /// token-major, best first.
    pub fn select(&self, scores: &[f32], bias: &[f32], tokens: usize) -> Vec<usize> {
        let DeepseekRouterConfig { experts: e, top_k: k, n_group: g, topk_group: keep, .. } = self.config;
        let per = e / g;
        let mut ids = Vec::with_capacity(tokens * k);
        let mut choice = vec![0f32; e];
        let mut groups: Vec<(f32, usize)> = Vec::with_capacity(g);
        let mut allowed: Vec<usize> = Vec::with_capacity(keep * per);
        for t in 0..tokens {
            for (j, c) in choice.iter_mut().enumerate() {
                *c = scores[t * e + j] + bias[j];
            }
            // 3. group scores: sum of the two best choices in each group (the one when a group has one).
            groups.clear();
            for gi in 0..g {
                let mut top = [f32::NEG_INFINITY; 2];
                for &c in &choice[gi * per..(gi + 1) * per] {
                    if c > top[0] {
                        top = [c, top[0]];
                    } else if c > top[1] {
                        top[1] = c;
                    }
                }
                groups.push((if per >= 2 { top[0] + top[1] } else { top[0] }, gi));
            }
            groups.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            // 4. top-k experts of the kept groups.
            allowed.clear();
            for &(_, gi) in &groups[..keep] {
                allowed.extend(gi * per..(gi + 1) * per);
            }
            allowed.sort_by(|&a, &b| choice[b].total_cmp(&choice[a]).then(a.cmp(&b)));
            ids.extend_from_slice(&allowed[..k]);
        }
        ids
    }
}

impl<B: Backend> Router<B> for DeepseekRouter<B> {
    /// [`RouterOutput::probs`] holds the scores `[T, E]` (sigmoid scores; softmax probabilities under
    /// softmax gating), without the correction bias. Its rows do not sum to one under sigmoid scoring.
    fn route(&self, x: Tensor<B, 2>) -> RouterOutput<B> {
        let [t, _] = x.dims();
        let k = self.config.top_k;
        // 1. scores
        let logits = x.matmul(self.weight.val().transpose()); // [T, E]
        let scores = match self.config.scoring {
            ScoringFunc::Sigmoid => sigmoid(logits.clone()),
            ScoringFunc::Softmax => softmax(logits.clone(), 1),
        }; // [T, E]
        // 2-4. selection, on the device on CubeCL backends (with every group kept, one group or
        // `topk_group = n_group`, it is the top-k of the biased scores), else on the host.
        let choice = (scores.clone() + self.e_score_correction_bias.val().unsqueeze::<2>()).detach();
        let ids = if self.config.topk_group >= self.config.n_group {
            choose_top_k(&choice, k)
        } else {
            match self.select_on_device(choice) {
                Some(ids) => ExpertIds::Device(ids),
                None => ExpertIds::Host(self.select(&host(scores.clone()), &self.bias_values(), t)),
            }
        };
        // 5. gate weights from the unbiased scores
        let mut weights = ids.gather(scores.clone(), k); // [T, k]
        if self.config.norm_topk_prob {
            weights = weights.clone() / weights.sum_dim(1).add_scalar(1e-20);
        }
        let weights = weights.mul_scalar(self.config.routed_scaling_factor);
        RouterOutput { probs: scores, weights, ids, logits }
    }

    fn top_k(&self) -> usize {
        self.config.top_k
    }

    /// Reads `{block}.gate.weight` and `{block}.gate.e_score_correction_bias`; a checkpoint without
    /// the bias (DeepSeek-V2 style) keeps a zero bias.
    fn load(&mut self, ckpt: &mut CheckpointReader, block_prefix: &str, device: &B::Device) -> Result<()> {
        let [e, m] = self.weight.dims();
        self.weight =
            Param::from_tensor(ckpt.tensor::<B, 2>(&format!("{block_prefix}.gate.weight"), [e, m], device)?);
        let bias_name = format!("{block_prefix}.gate.e_score_correction_bias");
        if ckpt.contains(&bias_name) {
            self.e_score_correction_bias = buffer(ckpt.tensor::<B, 1>(&bias_name, [e], device)?);
        } else if self.config.scoring == ScoringFunc::Sigmoid {
            tracing::warn!(tensor = %bias_name, "checkpoint has no correction bias; starting from zero");
        }
        Ok(())
    }

    fn save(&self, sink: &mut TensorSink, block_prefix: &str) {
        sink.put_param(format!("{block_prefix}.gate.weight"), &self.weight);
        sink.put_param(format!("{block_prefix}.gate.e_score_correction_bias"), &self.e_score_correction_bias);
    }

    fn update_balance_bias(&mut self, counts: &[usize], rate: f64) -> Result<bool> {
        self.update_bias(counts, rate).map(|_| true)
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::Flex;

    use super::*;

    fn router(
        experts: usize,
        top_k: usize,
        n_group: usize,
        topk_group: usize,
        scoring: ScoringFunc,
    ) -> DeepseekRouter<Flex> {
        let config = DeepseekRouterConfig {
            hidden: 1,
            experts,
            top_k,
            n_group,
            topk_group,
            norm_topk_prob: true,
            routed_scaling_factor: 2.5,
            scoring,
        };
        let device = Default::default();
        DeepseekRouter::new(config, &Init::new(3, 0.1, &device))
    }

    #[test]
    fn group_limited_selection_skips_the_best_expert_of_a_dropped_group() {
        let r = router(8, 3, 4, 2, ScoringFunc::Sigmoid);
        // Group sums of the two best: g0 1.0, g1 1.5, g2 0.4, g3 1.25 -> keep g1, g3.
        let scores = [0.9, 0.1, 0.8, 0.7, 0.2, 0.2, 0.6, 0.65];
        assert_eq!(r.select(&scores, &[0.0; 8], 1), vec![2, 3, 7]);
        // A bias on expert 0 lifts group 0 above group 3 and expert 0 to the top.
        let mut bias = [0.0; 8];
        bias[0] = 0.3;
        assert_eq!(r.select(&scores, &bias, 1), vec![0, 2, 3]);
    }

    /// A configuration built by hand (the JSON path refuses it) whose groups do not split the
    /// experts, or scores of another width: the device selection declines, it does not panic.
    #[test]
    fn device_selection_declines_groups_that_do_not_split_the_scores() {
        let device = Default::default();
        let uneven = router(10, 2, 4, 2, ScoringFunc::Sigmoid);
        assert!(uneven.select_on_device(Tensor::<Flex, 2>::zeros([3, 10], &device)).is_none());
        let even = router(8, 2, 4, 2, ScoringFunc::Sigmoid);
        assert!(even.select_on_device(Tensor::<Flex, 2>::zeros([3, 6], &device)).is_none());
    }

    #[test]
    fn gate_weights_come_from_unbiased_scores_normalised_and_scaled() {
        let device = Default::default();
        let mut r = router(4, 2, 1, 1, ScoringFunc::Sigmoid);
        let logits = [2.0f32, 1.0, 0.5, -1.0];
        r.weight = Param::from_tensor(Tensor::from_data(TensorData::new(logits.to_vec(), [4, 1]), &device));
        // Make expert 3 the favourite through the bias only.
        r.update_bias(&[1, 1, 1, 0], 5.0).unwrap(); // bias [0, 0, 0, +5] (mean 0.75: three above, one below)
        assert_eq!(r.bias_values(), vec![-5.0, -5.0, -5.0, 5.0]);
        let out = r.route(Tensor::ones([1, 1], &device));
        assert_eq!(out.ids.to_host(), vec![3, 0]);
        let s = |x: f32| 1.0 / (1.0 + (-x).exp());
        let (a, b) = (s(-1.0), s(2.0));
        let expected = [2.5 * a / (a + b), 2.5 * b / (a + b)];
        let got = out.weights.into_data().to_vec::<f32>().unwrap();
        for (g, e) in got.iter().zip(expected) {
            assert!((g - e).abs() < 1e-6, "{got:?} vs {expected:?}");
        }
        let probs = out.probs.into_data().to_vec::<f32>().unwrap();
        assert!((probs[0] - s(2.0)).abs() < 1e-6, "probs are the sigmoid scores without the bias");
    }

    #[test]
    fn update_bias_follows_the_sign_of_the_load_gap() {
        let mut r = router(4, 1, 1, 1, ScoringFunc::Sigmoid);
        r.update_bias(&[4, 0, 2, 2], 0.01).unwrap();
        assert_eq!(r.bias_values(), vec![-0.01, 0.01, 0.0, 0.0]);
        assert!(r.update_bias(&[1, 2, 3], 0.01).is_err());
        assert!(r.update_bias(&[1, 2, 3, 4], f64::NAN).is_err());
        assert!(!r.e_score_correction_bias.val().is_require_grad());
    }

    #[test]
    fn softmax_scoring_gives_probabilities() {
        let r = router(6, 2, 2, 1, ScoringFunc::Softmax);
        let out = r.route(Tensor::<Flex, 2>::ones([3, 1], &Default::default()));
        let p = out.probs.into_data().to_vec::<f32>().unwrap();
        for row in p.chunks(6) {
            assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5);
        }
        // Both experts of each token come from one group of three.
        for ids in out.ids.to_host().chunks(2) {
            assert_eq!(ids[0] / 3, ids[1] / 3, "{ids:?}");
        }
    }
}
