//! Router options that act on any router's decision ([`RoutingOptions`]: z-loss, capacity with
//! token dropping, forced balance), and a layer's routing under them ([`Routed`]).

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

use super::*;

/// Router options from the literature that act on any [`Router`]'s decision, so every family has
/// them: ST-MoE's router z-loss, a capacity factor with token dropping, and forced balanced
/// routing for throughput benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RoutingOptions {
    /// Router z-loss coefficient (ST-MoE): each MoE layer adds `coef x mean_t logsumexp(logits_t)^2`
    /// to the loss (0: off).
    pub z_loss_coef: f64,
    /// Round-robin assignment instead of the router's choice: slot `t k + j` (token `t`, choice
    /// `j`) goes to expert `(t k + j) mod E`, keeping the router's gate weights, so every expert
    /// gets the same count (within one) — as the throughput tables of other trainers are measured.
    pub force_balanced: bool,
    /// Capacity factor `c`: each expert takes at most `ceil(c x T x k / E)` of a micro-batch's
    /// `T x k` routed copies, in token order; the copies past it are dropped (the token keeps its
    /// residual and its other experts). `None`: dropless.
    pub capacity_factor: Option<f64>,
}

/// The expert id of a routed copy dropped for capacity: no expert computes it (every dispatch
/// skips ids outside its experts).
pub const DROPPED: usize = usize::MAX;

/// A layer's routing of one micro-batch under [`RoutingOptions`]: what both the whole model
/// ([`SparseMoeBlock::forward`]) and the runtime's attention workers act on.
#[derive(Debug, Clone)]
pub struct Routed<B: Backend> {
    /// The decision (the router's, or the forced round robin), gate weights included.
    pub route: RouterOutput<B>,
    /// Its statistics, with the z-loss (when on) and the copies dropped for capacity.
    pub stats: RouterStats<B>,
    /// The expert of each routed copy that is computed: `route.ids` with the copies past an
    /// expert's capacity replaced by [`DROPPED`] (on the host; dropless routing keeps the
    /// router's ids where they are).
    pub kept: ExpertIds<B>,
}

impl RoutingOptions {
    /// Routes a micro-batch of `sequences` sequences: the router's `decision` with these options
    /// applied (forced balance, then capacity), and its statistics.
    pub fn route<B: Backend>(
        &self,
        decision: RouterOutput<B>,
        sequences: usize,
        experts: usize,
        top_k: usize,
    ) -> Routed<B> {
        let route = self.apply(decision);
        let mut stats = RouterStats::new(&route, sequences, experts, top_k);
        stats.z_loss = self.z_loss(&route);
        let kept = match self.capacity_factor {
            None => route.ids.clone(),
            Some(_) => {
                let (kept, dropped) = self.keep_within_capacity(&route.ids.to_host(), experts, top_k);
                stats.dropped = dropped;
                ExpertIds::Host(kept)
            }
        };
        Routed { route, stats, kept }
    }

    /// The decision a layer acts on: the router's, or the round-robin one when forced.
    pub fn apply<B: Backend>(&self, mut route: RouterOutput<B>) -> RouterOutput<B> {
        if self.force_balanced {
            let e = route.logits.dims()[1];
            route.ids = match &route.ids {
                ExpertIds::Host(ids) => ExpertIds::Host((0..ids.len()).map(|slot| slot % e).collect()),
                ExpertIds::Device(ids) => {
                    let slots = Tensor::<B, 1, Int>::arange(0..ids.dims()[0] as i64, &ids.device());
                    ExpertIds::Device(slots.remainder_scalar(e as i64).cast(ids.dtype()))
                }
            };
        }
        route
    }

    /// The routed copies each expert computes: `ids` with the copies past an expert's capacity
    /// replaced by [`DROPPED`], and how many were dropped. Dropless: `ids` unchanged.
    pub fn keep_within_capacity(&self, ids: &[usize], experts: usize, top_k: usize) -> (Vec<usize>, usize) {
        let Some(factor) = self.capacity_factor else { return (ids.to_vec(), 0) };
        let tokens = ids.len() / top_k.max(1);
        let capacity = (factor * (tokens * top_k) as f64 / experts.max(1) as f64).ceil() as usize;
        let mut taken = vec![0usize; experts];
        let mut dropped = 0;
        let kept = ids
            .iter()
            .map(|&e| {
                if e < experts && taken[e] < capacity {
                    taken[e] += 1;
                    e
                } else {
                    dropped += 1;
                    DROPPED
                }
            })
            .collect();
        (kept, dropped)
    }

    /// The z-loss of a decision, when on.
    pub fn z_loss<B: Backend>(&self, route: &RouterOutput<B>) -> Option<Tensor<B, 1>> {
        (self.z_loss_coef > 0.0).then(|| router_z_loss(route.logits.clone()))
    }
}

/// ST-MoE's router z-loss of one layer: `mean_t logsumexp(logits_t)^2` (before its coefficient).
///
/// # Shapes
/// - logits: `[T, E]` -> `[1]`
pub fn router_z_loss<B: Backend>(logits: Tensor<B, 2>) -> Tensor<B, 1> {
    // logsumexp shifted by the (constant) row maximum: the same value and gradient, no overflow.
    let max = logits.clone().max_dim(1).detach(); // [T, 1]
    let lse = (logits - max.clone()).exp().sum_dim(1).log() + max; // [T, 1]
    lse.powf_scalar(2.0).mean()
}
