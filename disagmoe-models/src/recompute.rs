//! Activation recomputation: one micro-batch's forward and backward taken block by block, where a
//! block whose activations are dropped keeps only its input and runs its forward a second time in
//! the backward.
//!
//! The whole-model step ([`crate::decoder::CausalLm::forward`], then one `backward`) keeps every
//! intermediate tensor of every layer until the backward reaches it. With [`Recompute`] other than
//! `none`, the step instead goes through the model's blocks (each layer's attention block
//! `x + attn(norm(x))` and expert block `x + ffn(norm(x))`, then the head, then the embedding):
//!
//! - **forward**: a recomputed block runs without a graph (on the inner backend) and keeps only
//!   its input `[B, S, M]`; a kept block runs with its graph, from its own leaf input;
//! - **backward**, last block first: a recomputed block runs its forward again with a graph; the
//!   block's objective `sum(output * g) (+ its layer's balance and z-loss terms)` is differentiated,
//!   giving the block's parameter gradients and `g` for the block before.
//!
//! The gradients are those of the whole-model step (the objective of a block is the chain rule
//! cut at its input), the balance loss is linear in each layer's score sums with coefficients
//! known after the forward ([`crate::BalanceLoss::coefficients`]), so each layer adds its own
//! term; the sums are taken in another order, so the results agree to rounding (the tests hold
//! them at 1e-5). Peak activation memory goes from every layer's to one block's plus the `[B, S,
//! M]` inputs of the blocks that are recomputed.

use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor, TensorData};
use disagmoe_kernels::documents::Documents;
use serde::{Deserialize, Serialize};

use crate::balance::LayerRouting;
use crate::causal_lm::{lm_logits, next_token_cross_entropy};
use crate::decoder::FamilyModel;
use crate::families::FamilyConfig;
use crate::moe::RouterStats;
use crate::mtp::mtp_loss;

/// Which blocks drop their activations in the forward and recompute them in the backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// Keep every activation (one graph for the whole model).
    #[default]
    None,
    /// Recompute the expert blocks (norm, router, experts, shared experts).
    Experts,
    /// Recompute the attention blocks (norm, attention).
    Attention,
    /// Recompute both: only each block's input is kept.
    Full,
}

impl Recompute {
    /// The names the command line accepts.
    pub const NAMES: [&'static str; 4] = ["none", "experts", "attention", "full"];

    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            Recompute::None => "none",
            Recompute::Experts => "experts",
            Recompute::Attention => "attention",
            Recompute::Full => "full",
        }
    }

    /// Whether the attention blocks are recomputed.
    pub fn attention(self) -> bool {
        matches!(self, Recompute::Attention | Recompute::Full)
    }

    /// Whether the expert blocks are recomputed.
    pub fn experts(self) -> bool {
        matches!(self, Recompute::Experts | Recompute::Full)
    }
}

impl std::fmt::Display for Recompute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Recompute {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" => Ok(Recompute::None),
            "experts" => Ok(Recompute::Experts),
            "attention" => Ok(Recompute::Attention),
            "full" => Ok(Recompute::Full),
            _ => Err(format!("unknown recompute setting {s:?} (allowed: {})", Recompute::NAMES.join(", "))),
        }
    }
}

/// The losses and router counts of one micro-batch (values before any scaling).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MicroBatchLoss {
    /// `lm + coef * aux + z_coef * z`.
    pub total: f64,
    /// Next-token cross-entropy.
    pub lm: f64,
    /// Balance loss before its coefficient, when on.
    pub aux: Option<f64>,
    /// Router z-loss summed over the routed layers before its coefficient, when on.
    pub z: Option<f64>,
    /// The multi-token prediction loss before its coefficient, when trained.
    pub mtp: Option<f64>,
    /// Routed copies per expert, per routed layer.
    pub counts: Vec<Vec<usize>>,
    /// Routed copies per expert of each multi-token prediction module's routed block.
    pub mtp_counts: Vec<Vec<usize>>,
    /// Copies dropped for capacity, per routed layer.
    pub dropped: Vec<usize>,
}

/// What the forward keeps of a block for the backward.
enum Saved<B: AutodiffBackend> {
    /// Recomputed: its input.
    Input(Tensor<B::InnerBackend, 3>),
    /// Kept: its leaf input, its output and (routed expert blocks) the router statistics, with
    /// their graph.
    Graph { input: Tensor<B, 3>, output: Tensor<B, 3>, stats: Option<RouterStats<B>> },
}

/// What a routed layer's forward leaves for the loss values and the balance coefficients.
struct LayerStats<B: Backend> {
    routing: LayerRouting,
    prob_sum: Tensor<B, 2>,
    z: Option<Tensor<B, 1>>,
    counts: Vec<usize>,
    dropped: usize,
}

impl<B: Backend> LayerStats<B> {
    fn of(s: RouterStats<B>) -> Self {
        Self { routing: s.routing, prob_sum: s.prob_sum, z: s.z_loss, counts: s.counts, dropped: s.dropped }
    }
}

fn scalars<B: Backend>(parts: Vec<Tensor<B, 1>>) -> Vec<f64> {
    if parts.is_empty() {
        return Vec::new();
    }
    Tensor::cat(parts, 0).into_data().convert::<f64>().to_vec().expect("f64 scalars")
}

impl<B: AutodiffBackend, C: FamilyConfig> FamilyModel<B, C> {
    /// One micro-batch's loss and gradients with `recompute` (see the module): the objective
    /// differentiated is `scale x (lm + coef x aux + z_coef x z)`; each block's parameter
    /// gradients are handed to `on_grads` as soon as they exist (a parameter used by two blocks,
    /// a tied embedding, comes twice: add them). `inner` is this model on the inner backend
    /// (`valid()`), which computes the forward of the recomputed blocks without a graph.
    ///
    /// With `docs`, attention stays within each document and the losses ignore the targets in
    /// another document ([`FamilyModel::forward_documents`]).
    ///
    /// # Shapes
    /// - ids: `[B, S]`; docs over `[B, S]`
    pub fn backward_recomputed(
        &self,
        inner: &FamilyModel<B::InnerBackend, C>,
        ids: Tensor<B, 2, Int>,
        docs: Option<&Documents>,
        with_aux: bool,
        recompute: Recompute,
        scale: f64,
        on_grads: &mut dyn FnMut(B::Gradients),
    ) -> MicroBatchLoss {
        let [_, s] = ids.dims();
        let device = ids.device();
        let (cos, sin) = self.rope().tables::<B>(s, &device); // [1, 1, S, rotary dim]
        let (cos, sin) = crate::rope::document_tables(cos, sin, docs); // [B or 1, 1, S, rotary dim]
        let (inner_cos, inner_sin) = (cos.clone().inner(), sin.clone().inner());
        // 1. Forward: block by block, keeping each block's graph or only its input.
        let mut h = inner.embed_tokens.forward(ids.clone().inner()); // [B, S, M]
        let mut saved = Vec::with_capacity(2 * self.layers.len());
        let mut stats: Vec<Option<LayerStats<B::InnerBackend>>> = Vec::with_capacity(self.layers.len());
        for (layer, inner_layer) in self.layers.iter().zip(&inner.layers) {
            if recompute.attention() {
                saved.push(Saved::Input(h.clone()));
                h = inner_layer.attention_block(h, inner_cos.clone(), inner_sin.clone(), docs);
            } else {
                let input = Tensor::from_inner(h).require_grad();
                let output = layer.attention_block(input.clone(), cos.clone(), sin.clone(), docs);
                h = output.clone().inner();
                saved.push(Saved::Graph { input, output, stats: None });
            }
            if recompute.experts() {
                saved.push(Saved::Input(h.clone()));
                let (y, s) = inner_layer.expert_block(h);
                h = y;
                stats.push(s.map(LayerStats::of));
            } else {
                let input = Tensor::from_inner(h).require_grad();
                let (output, s) = layer.expert_block(input.clone());
                h = output.clone().inner();
                stats.push(s.as_ref().map(|s| LayerStats::of(s.clone()).inner()));
                saved.push(Saved::Graph { input, output, stats: s });
            }
        }
        // 2. The head: the LM loss and the gradient of the last hidden states.
        //    The multi-token prediction modules, when trained, keep their graph: they run here,
        //    from the final hidden states and the shared embedding and head.
        let last = Tensor::<B, 3>::from_inner(h).require_grad();
        let normed = self.norm.forward(last.clone());
        let logits = lm_logits(normed.clone(), self.lm_head.as_ref(), &self.embed_tokens);
        let ignore = docs.map(Documents::crosses);
        let lm_loss = next_token_cross_entropy(logits, ids.clone(), ignore.as_deref());
        let mtp = mtp_loss(
            &self.mtp,
            normed,
            ids.clone(),
            &self.embed_tokens,
            self.lm_head.as_ref(),
            cos.clone(),
            sin.clone(),
            docs,
        );
        // 3. The loss values, and each routed layer's balance coefficients.
        let routed: Vec<&LayerStats<B::InnerBackend>> = stats.iter().flatten().collect();
        let aux = self.config().aux_loss().filter(|_| with_aux && !routed.is_empty());
        let routings: Vec<LayerRouting> = routed.iter().map(|s| s.routing.clone()).collect();
        let coefficients = aux.map(|a| a.kind.coefficients(&routings)).unwrap_or_default();
        let mut parts = vec![lm_loss.clone().inner()];
        parts.extend(routed.iter().map(|s| s.prob_sum.clone().reshape([-1])));
        let z_parts: Vec<_> = routed.iter().filter_map(|s| s.z.clone()).collect();
        let with_z = z_parts.len() == routed.len() && !routed.is_empty();
        if with_z {
            parts.push(Tensor::cat(z_parts, 0).sum());
        }
        if let Some(m) = &mtp {
            parts.push(m.loss.clone().inner());
        }
        let values = scalars(parts);
        let lm = values[0];
        let mut at = 1;
        let prob_sums: Vec<Vec<f64>> = routed
            .iter()
            .map(|s| {
                let n = s.prob_sum.dims().iter().product::<usize>();
                at += n;
                values[at - n..at].to_vec()
            })
            .collect();
        let aux_value = aux.map(|a| a.kind.value(&routings, &prob_sums));
        let mtp_value = mtp.as_ref().map(|_| *values.last().expect("the MTP loss"));
        let z_value = with_z.then(|| values[at]);
        let z_coef = self.routing().z_loss_coef;
        let mtp_coef = self.config().mtp().loss_coef;
        let total = lm
            + aux.zip(aux_value).map_or(0.0, |(a, v)| a.coef * v)
            + z_value.map_or(0.0, |z| z_coef * z)
            + mtp_value.map_or(0.0, |m| mtp_coef * m);
        let mtp_counts =
            mtp.as_ref().map_or_else(Vec::new, |m| m.router_stats.iter().map(|s| s.counts.clone()).collect());
        let head_loss = match mtp {
            Some(m) => lm_loss + m.loss.mul_scalar(mtp_coef),
            None => lm_loss,
        };
        let mut grads = head_loss.mul_scalar(scale).backward();
        let mut g = last.grad_remove(&mut grads).expect("the head's input has a gradient");
        on_grads(grads);
        // 4. Backward, last block first.
        let mut routed_index = stats.iter().filter(|s| s.is_some()).count();
        for (i, block) in saved.into_iter().enumerate().rev() {
            let layer = &self.layers[i / 2];
            let is_expert = i % 2 == 1;
            let (input, output, block_stats) = match block {
                Saved::Graph { input, output, stats } => (input, output, stats),
                Saved::Input(x) => {
                    let input = Tensor::from_inner(x).require_grad();
                    if is_expert {
                        let (output, s) = layer.expert_block(input.clone());
                        (input, output, s)
                    } else {
                        (input.clone(), layer.attention_block(input, cos.clone(), sin.clone(), docs), None)
                    }
                }
            };
            let mut objective = (output * Tensor::from_inner(g)).sum();
            if let Some(s) = block_stats {
                routed_index -= 1;
                if let Some(a) = aux {
                    let [b, e] = s.prob_sum.dims();
                    let c: Vec<f32> = coefficients[routed_index].iter().map(|&c| (c * a.coef * scale) as f32).collect();
                    let c = Tensor::<B, 2>::from_data(TensorData::new(c, [b, e]), &device);
                    objective = objective + (s.prob_sum * c).sum();
                }
                if let Some(z) = s.z_loss.filter(|_| with_z) {
                    objective = objective + z.mul_scalar(z_coef * scale);
                }
            }
            let mut grads = objective.backward();
            g = input.grad_remove(&mut grads).expect("a block's input has a gradient");
            on_grads(grads);
        }
        // 5. The embedding.
        let objective = (self.embed_tokens.forward(ids) * Tensor::from_inner(g)).sum();
        on_grads(objective.backward());
        MicroBatchLoss {
            total,
            lm,
            aux: aux_value,
            z: z_value,
            mtp: mtp_value,
            counts: routed.iter().map(|s| s.counts.clone()).collect(),
            mtp_counts,
            dropped: routed.iter().map(|s| s.dropped).collect(),
        }
    }
}

impl<B: AutodiffBackend> LayerStats<B> {
    fn inner(self) -> LayerStats<B::InnerBackend> {
        LayerStats {
            routing: self.routing,
            prob_sum: self.prob_sum.inner(),
            z: self.z.map(Tensor::inner),
            counts: self.counts,
            dropped: self.dropped,
        }
    }
}
