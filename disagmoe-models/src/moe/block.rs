//! The sparse MoE block ([`SparseMoeBlock`]): route, dispatch, compute, combine, with the
//! statistics the balance loss and the load metrics read ([`RouterStats`]).

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

use crate::balance::LayerRouting;
use crate::error::{ModelError, Result};
use crate::weights::{CheckpointReader, TensorSink};

use super::*;

/// What one MoE layer reports for the load-balancing loss and the load metrics.
#[derive(Debug, Clone)]
pub struct RouterStats<B: Backend> {
    /// `[B, E]`: per sequence, the sum over its tokens of the router's scores (softmax
    /// probabilities; DeepSeek-V3's sigmoid scores), differentiable.
    pub prob_sum: Tensor<B, 2>,
    /// Routed copies per expert, all sequences together (the router's decision, before any
    /// capacity drop).
    pub counts: Vec<usize>,
    /// Routed copies dropped for capacity.
    pub dropped: usize,
    /// The router z-loss of the layer (before its coefficient), when on.
    pub z_loss: Option<Tensor<B, 1>>,
    /// The routing per sequence on the host, what the balance losses need besides `prob_sum`.
    pub routing: LayerRouting,
}

impl<B: Backend> RouterStats<B> {
    /// The statistics of a router's decision over `sequences` sequences of `T / sequences` tokens.
    pub fn new(route: &RouterOutput<B>, sequences: usize, experts: usize, top_k: usize) -> Self {
        let [t, _] = route.probs.dims();
        let prob_sum = route
            .probs
            .clone()
            .reshape([sequences, t / sequences.max(1), experts])
            .sum_dim(1)
            .reshape([sequences, experts]);
        let routing = match &route.ids {
            ExpertIds::Host(ids) => LayerRouting::from_ids(ids, sequences, t, experts, top_k),
            ExpertIds::Device(ids) => device_routing(ids, sequences, t, experts, top_k)
                .unwrap_or_else(|| LayerRouting::from_ids(&route.ids.to_host(), sequences, t, experts, top_k)),
        };
        Self { prob_sum, counts: routing.per_expert(), routing, z_loss: None, dropped: 0 }
    }
}

/// [`LayerRouting`] of ids on the device: the per-sequence counts are counted there and only
/// they come back (`[E, B]`). `None` when the kernel does not apply.
fn device_routing<B: Backend>(
    ids: &Tensor<B, 1, Int>,
    sequences: usize,
    tokens: usize,
    experts: usize,
    top_k: usize,
) -> Option<LayerRouting> {
    let per_sequence = tokens / sequences.max(1) * top_k;
    if sequences == 0 || per_sequence * sequences != ids.dims()[0] {
        return None;
    }
    let counts = disagmoe_kernels::fused::sequence_counts(ids.clone(), experts, per_sequence)?;
    let by_expert = counts.to_data().convert::<i64>().to_vec::<i64>().ok()?; // [E, B]
    let mut counts = vec![0u32; sequences * experts];
    for e in 0..experts {
        for b in 0..sequences {
            counts[b * experts + e] = by_expert[e * sequences + b] as u32;
        }
    }
    Some(LayerRouting { sequences, tokens, experts, top_k, counts })
}

/// A sparse MoE block: a router of any [`Router`] type, `E` experts of any [`Experts`] type, and
/// optional always-on shared experts (DeepSeek).
#[derive(Module, Debug)]
pub struct SparseMoeBlock<B: Backend, R: Module<B>, X: Module<B>> {
    /// The router.
    pub gate: R,
    /// The routed experts (`mlp.experts`).
    pub experts: X,
    /// Shared experts every token goes through (`mlp.shared_experts`).
    pub shared_experts: Option<SwiGluMlp<B>>,
    /// Router z-loss, capacity and forced balance.
    #[module(skip)]
    pub routing: RoutingOptions,
}

impl<B: Backend, R: Module<B> + Router<B>, X: Module<B> + Experts<B>> SparseMoeBlock<B, R, X> {
    /// A block without shared experts.
    pub fn new(gate: R, experts: X) -> Self {
        Self { gate, experts, shared_experts: None, routing: RoutingOptions::default() }
    }

    /// # Shapes
    /// - x: `[B, S, M]` -> `[B, S, M]`
    pub fn forward(&self, x: Tensor<B, 3>) -> (Tensor<B, 3>, RouterStats<B>) {
        let [b, s, m] = x.dims();
        let flat = x.reshape([b * s, m]); // [T, M]
                                          // 1. route
        let (e, k) = (self.experts.num_experts(), self.gate.top_k());
        let Routed { route: routed, stats, kept } = self.routing.route(self.gate.route(flat.clone()), b, e, k);
        if let ExpertIds::Device(ids) = &kept {
            if let Some(out) = self.forward_on_device(flat.clone(), ids, routed.weights.clone(), &stats.counts) {
                DEVICE_ROUTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                return (out.reshape([b, s, m]), stats);
            }
        }
        // 2. dispatch (the copies within capacity)
        let dispatch = Dispatch::new(&kept.to_host(), e, k);
        let (xs, shared_in) = dispatch.permute(flat, self.shared_experts.is_some()); // [N, M], [T, M]

        // 3. compute
        let ys = self.experts.forward_grouped(xs, &dispatch.counts); // [N, M]
        let shared = self.shared_experts.as_ref().zip(shared_in).map(|(shared, x)| shared.forward(x));
        // 4. combine (with the shared experts' output)
        let out = dispatch.combine(ys, routed.weights.clone(), shared); // [T, M]
        (out.reshape([b, s, m]), stats)
    }

    /// Steps 2-4 with the router's ids on the device: the counting sort, the permute and the
    /// combine run there; `counts` (already on the host, from the statistics) size the grouped
    /// products. `None` when a kernel does not apply (the caller sorts on the host).
    ///
    /// # Shapes
    /// - flat: `[T, M]`; ids: `[T k]`; weights: `[T, k]` -> `[T, M]`
    fn forward_on_device(
        &self,
        flat: Tensor<B, 2>,
        ids: &Tensor<B, 1, Int>,
        weights: Tensor<B, 2>,
        counts: &[usize],
    ) -> Option<Tensor<B, 2>> {
        let (e, k) = (self.experts.num_experts(), self.gate.top_k());
        let n = ids.dims()[0];
        // The routed kernels trust the routing to place every copy: the counts (on the host
        // already, counted on the device from the same ids) say whether each id was an expert.
        if counts.len() != e || counts.iter().sum::<usize>() != n {
            return None;
        }
        let routing = disagmoe_kernels::fused::route(ids.clone(), e)?;
        let xs = disagmoe_kernels::fused::permute_routed(flat, &routing, k, self.shared_experts.is_some())?;
        let (xs, shared_in) = match &self.shared_experts {
            Some(_) => {
                let t = xs.dims()[0] - n;
                (xs.clone().narrow(0, 0, n), Some(xs.narrow(0, n, t)))
            }
            None => (xs, None),
        };
        let ys = self.experts.forward_grouped(xs, counts); // [N, M]
        let shared = self.shared_experts.as_ref().zip(shared_in).map(|(shared, x)| shared.forward(x));
        disagmoe_kernels::fused::combine_routed(ys, weights, &routing, shared)
    }

    /// The simple path beside [`SparseMoeBlock::forward`]: token by token, chosen expert by chosen
    /// expert, no sorting and no scatter. Slow; tests hold the two equal, gradients included.
    ///
    /// # Shapes
    /// - x: `[B, S, M]` -> `[B, S, M]`
    pub fn forward_per_token(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [b, s, m] = x.dims();
        let flat = x.reshape([b * s, m]);
        let (k, e) = (self.gate.top_k(), self.experts.num_experts());
        let Routed { route: routed, kept, .. } = self.routing.route(self.gate.route(flat.clone()), b, e, k);
        let kept = kept.to_host();
        let rows: Vec<Tensor<B, 2>> = (0..b * s)
            .map(|t| {
                let xt = flat.clone().narrow(0, t, 1); // [1, M]
                (0..k)
                    .filter(|&j| kept[t * k + j] != DROPPED)
                    .map(|j| {
                        let mut counts = vec![0; e];
                        counts[kept[t * k + j]] = 1;
                        let w = routed.weights.clone().narrow(0, t, 1).narrow(1, j, 1); // [1, 1]
                        self.experts.forward_grouped(xt.clone(), &counts) * w
                    })
                    .reduce(|a, c| a + c)
                    .unwrap_or_else(|| xt.zeros_like())
            })
            .collect();
        let mut out = Tensor::cat(rows, 0);
        if let Some(shared) = &self.shared_experts {
            out = out + shared.forward(flat);
        }
        out.reshape([b, s, m])
    }

    /// Loads the router, the experts under `{prefix}.experts` and the shared experts under
    /// `{prefix}.shared_experts`.
    pub fn load(&mut self, ckpt: &mut CheckpointReader, prefix: &str, device: &B::Device) -> Result<()> {
        self.gate.load(ckpt, prefix, device)?;
        self.experts.load(ckpt, &format!("{prefix}.experts"), device)?;
        if let Some(shared) = &mut self.shared_experts {
            shared.load(ckpt, &format!("{prefix}.shared_experts"), device)?;
        }
        Ok(())
    }

    /// Saves under the names [`SparseMoeBlock::load`] reads.
    pub fn save(&self, sink: &mut TensorSink, prefix: &str) {
        self.gate.save(sink, prefix);
        self.experts.save(sink, &format!("{prefix}.experts"));
        if let Some(shared) = &self.shared_experts {
            shared.save(sink, &format!("{prefix}.shared_experts"));
        }
    }
}

/// Validates token ids against a vocabulary size.
pub fn check_token_ids(ids: &[i64], vocab: usize) -> Result<()> {
    if let Some((pos, &bad)) = ids.iter().enumerate().find(|(_, &t)| t < 0 || t as usize >= vocab) {
        return Err(ModelError::InvalidInput(format!(
            "token id {bad} at position {pos} is outside the vocabulary 0..{vocab}"
        )));
    }
    Ok(())
}
