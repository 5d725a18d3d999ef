//! The load-balancing (auxiliary) losses of the families: one definition, used by the model on
//! one device and by the head of the distributed runtime.
//!
//! # Notation
//! - `l`: an MoE layer; `b`: a sequence of the micro-batch; `e`: a routed expert (`E` of them)
//! - `T`: tokens of the micro-batch (`B` sequences of `S`); `k`: experts per token
//! - `C[l][b, e]`: routed copies of expert `e` from sequence `b` at layer `l`
//! - `P[l][b, e]`: the sum of the router's scores of expert `e` over the tokens of sequence `b`
//!
//! Once the routing is fixed every loss here is linear in the score sums:
//! `aux = sum over l, b, e of c[l][b, e] * P[l][b, e]`, with coefficients `c` that depend only on
//! the counts `C`. [`BalanceLoss::coefficients`] computes `c`. The model multiplies its
//! differentiable `P` by them ([`BalanceLoss::loss`]); the runtime carries `P` and `C` along the
//! layers on the host, evaluates the same sum ([`BalanceLoss::value`]) and hands each layer its
//! coefficients as the gradient of its `P`.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use serde::{Deserialize, Serialize};

use crate::moe::RouterStats;

/// Which balance loss a family trains with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum BalanceLoss {
    /// transformers' `load_balancing_loss_func` (Switch Transformer; Qwen3-MoE, Mixtral, OLMoE,
    /// GPT-OSS): one loss over the rows of all MoE layers at once,
    /// `E * sum_e (C_e / R) * (P_e / R)` with `C_e`, `P_e` summed over layers and sequences and
    /// `R` the rows (tokens x MoE layers).
    Switch,
    /// DeepSeekMoE's expert-level balance loss, per MoE layer and summed over the layers (before
    /// `aux_loss_alpha`): `sum_e (E C_e / (T k)) (P_e / T)`; with `seq_aux` the same per sequence
    /// (`S` for `T`), averaged over the sequences.
    DeepSeek {
        /// Per sequence (`seq_aux: true` in `config.json`).
        seq_aux: bool,
    },
}

/// A balance loss and the coefficient it enters the training loss with: `total = lm + coef * aux`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AuxLoss {
    /// The loss.
    pub kind: BalanceLoss,
    /// Its coefficient (`router_aux_loss_coef`, DeepSeekMoE's `aux_loss_alpha`).
    pub coef: f64,
}

/// One MoE layer's routing of one micro-batch, on the host.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerRouting {
    /// Sequences `B`.
    pub sequences: usize,
    /// Tokens `T = B S`.
    pub tokens: usize,
    /// Routed experts `E`.
    pub experts: usize,
    /// Experts per token `k`.
    pub top_k: usize,
    /// `C[b, e]`, `[B, E]` row-major.
    pub counts: Vec<u32>,
}

impl LayerRouting {
    /// Counts from token-major expert ids (`ids[t k + j]`, tokens sequence by sequence).
    pub fn from_ids(ids: &[usize], sequences: usize, tokens: usize, experts: usize, top_k: usize) -> Self {
        let mut counts = vec![0u32; sequences * experts];
        let per_seq = tokens / sequences.max(1);
        for (slot, &e) in ids.iter().enumerate() {
            let b = (slot / top_k.max(1)) / per_seq.max(1);
            counts[b.min(sequences.saturating_sub(1)) * experts + e] += 1;
        }
        Self { sequences, tokens, experts, top_k, counts }
    }

    /// Routed copies per expert, all sequences together.
    pub fn per_expert(&self) -> Vec<usize> {
        let mut out = vec![0usize; self.experts];
        for row in self.counts.chunks(self.experts.max(1)) {
            for (o, &c) in out.iter_mut().zip(row) {
                *o += c as usize;
            }
        }
        out
    }
}

impl BalanceLoss {
    /// The coefficients `c[l]` (`[B, E]` row-major per layer, in the order of `layers`) with
    /// `aux = sum_l sum c[l] * P[l]`.
    pub fn coefficients(&self, layers: &[LayerRouting]) -> Vec<Vec<f64>> {
        match *self {
            BalanceLoss::Switch => {
                let e = layers.first().map(|l| l.experts).unwrap_or(0);
                let rows: f64 = layers.iter().map(|l| l.tokens as f64).sum();
                let mut total = vec![0f64; e];
                for l in layers {
                    for (t, c) in total.iter_mut().zip(l.per_expert()) {
                        *t += c as f64;
                    }
                }
                let per_expert: Vec<f64> = total.iter().map(|c| e as f64 * c / (rows * rows)).collect();
                layers.iter().map(|l| (0..l.sequences).flat_map(|_| per_expert.iter().copied()).collect()).collect()
            }
            BalanceLoss::DeepSeek { seq_aux: false } => layers
                .iter()
                .map(|l| {
                    let (t, k, e) = (l.tokens as f64, l.top_k as f64, l.experts as f64);
                    let c = l.per_expert();
                    let per_expert: Vec<f64> = c.iter().map(|&c| e * c as f64 / (t * t * k)).collect();
                    (0..l.sequences).flat_map(|_| per_expert.iter().copied()).collect()
                })
                .collect(),
            BalanceLoss::DeepSeek { seq_aux: true } => layers
                .iter()
                .map(|l| {
                    let (b, k, e) = (l.sequences as f64, l.top_k as f64, l.experts as f64);
                    let s = l.tokens as f64 / b;
                    l.counts.iter().map(|&c| e * c as f64 / (s * s * k * b)).collect()
                })
                .collect(),
        }
    }

    /// The loss from host score sums `P[l]` (`[B, E]` per layer, in the order of `layers`).
    pub fn value(&self, layers: &[LayerRouting], prob_sums: &[Vec<f64>]) -> f64 {
        self.coefficients(layers)
            .iter()
            .zip(prob_sums)
            .map(|(c, p)| c.iter().zip(p).map(|(c, p)| c * p).sum::<f64>())
            .sum()
    }

    /// The loss of a forward pass's router statistics, differentiable through the score sums;
    /// `None` without MoE layers.
    pub fn loss<B: Backend>(&self, stats: &[RouterStats<B>]) -> Option<Tensor<B, 1>> {
        let routing: Vec<LayerRouting> = stats.iter().map(|s| s.routing.clone()).collect();
        let coefficients = self.coefficients(&routing);
        stats
            .iter()
            .zip(coefficients)
            .map(|(s, c)| {
                let [b, e] = s.prob_sum.dims();
                let c: Vec<f32> = c.iter().map(|&x| x as f32).collect();
                let c = Tensor::<B, 2>::from_data(TensorData::new(c, [b, e]), &s.prob_sum.device());
                (s.prob_sum.clone() * c).sum()
            })
            .reduce(|a, b| a + b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routing(counts: Vec<u32>, sequences: usize, tokens: usize, experts: usize, top_k: usize) -> LayerRouting {
        LayerRouting { sequences, tokens, experts, top_k, counts }
    }

    #[test]
    fn switch_is_experts_times_fraction_times_mean_probability_over_all_layers() {
        // Two layers of 2 sequences x 2 tokens, 2 experts, top-1.
        let l0 = routing(vec![2, 0, 1, 1], 2, 4, 2, 1);
        let l1 = routing(vec![0, 2, 0, 2], 2, 4, 2, 1);
        let p = vec![vec![1.5, 0.5, 1.0, 1.0], vec![0.2, 1.8, 0.4, 1.6]];
        // C = [3, 5], P = [3.1, 4.9], R = 8: E * sum (C/R)(P/R).
        let want = 2.0 * (3.0 / 8.0 * 3.1 / 8.0 + 5.0 / 8.0 * 4.9 / 8.0);
        let got = BalanceLoss::Switch.value(&[l0, l1], &p);
        assert!((got - want).abs() < 1e-12, "{got} vs {want}");
    }

    #[test]
    fn deepseek_losses_follow_the_reference_formulas() {
        // One layer, 2 sequences of 3 tokens, 3 experts, top-2.
        let l = routing(vec![3, 2, 1, 0, 4, 2], 2, 6, 3, 2);
        let p = vec![vec![1.2, 1.0, 0.8, 0.6, 1.5, 0.9]];
        // seq_aux false: f_e = E C_e / (T k), P_e mean score over T.
        let (c, ps) = ([3.0, 6.0, 3.0], [1.8, 2.5, 1.7]);
        let want: f64 = (0..3).map(|e| 3.0 * c[e] / 12.0 * ps[e] / 6.0).sum();
        let got = BalanceLoss::DeepSeek { seq_aux: false }.value(&[l.clone()], &p);
        assert!((got - want).abs() < 1e-12, "{got} vs {want}");
        // seq_aux true: per sequence with S = 3, averaged.
        let per_seq =
            |b: usize| (0..3).map(|e| 3.0 * l.counts[b * 3 + e] as f64 / 6.0 * p[0][b * 3 + e] / 3.0).sum::<f64>();
        let want = (per_seq(0) + per_seq(1)) / 2.0;
        let got = BalanceLoss::DeepSeek { seq_aux: true }.value(&[l], &p);
        assert!((got - want).abs() < 1e-12, "{got} vs {want}");
    }

    #[test]
    fn counts_are_split_by_sequence() {
        // 2 sequences of 2 tokens, top-2: slots 0-3 belong to sequence 0.
        let r = LayerRouting::from_ids(&[0, 1, 1, 2, 2, 0, 2, 1], 2, 4, 3, 2);
        assert_eq!(r.counts, vec![1, 2, 1, 1, 1, 2]);
        assert_eq!(r.per_expert(), vec![2, 3, 3]);
    }
}
