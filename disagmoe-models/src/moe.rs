//! Mixture-of-experts block: router, grouped experts, and the load-balancing loss.
//!
//! # Notation
//! - `T`: tokens in the micro-batch (batch x sequence, flattened)
//! - `M`: model width (hidden size)
//! - `E`: routed experts; `k`: experts chosen per token (top-k)
//! - `N = T * k`: routed token copies; copies are sorted by expert so that expert `e` sees one
//!   contiguous block of `counts[e]` rows
//!
//! The layer reads `route -> dispatch -> compute -> combine`, one named step each:
//! 1. [`TopKRouter::route`]: logits `[T, E]`, softmax in f32, top-k, optional renormalisation;
//! 2. [`Dispatch::new`]: a stable counting sort of the `N` copies by expert (the group sizes
//!    decide the shapes of the per-expert matmuls); on CubeCL backends the router's top-k, this
//!    sort, the permute and the combine run on the device ([`ExpertIds::Device`]) and only the
//!    counts per expert and sequence come back to the host;
//! 3. [`Experts::forward_grouped`]: one matmul chain per expert over its contiguous rows;
//! 4. [`Dispatch::combine`]: gate-weighted sum of each token's `k` outputs back in token order.
//!
//! Experts are behind the [`Experts`] trait, so a new expert type plugs into [`SparseMoeBlock`]
//! without touching the router or the layer.

use burn::module::{Module, Param};
use burn::tensor::activation::{silu, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

use crate::balance::LayerRouting;
use crate::error::{ModelError, Result};
use crate::init::Init;
use crate::nn::Linear;
use crate::weights::{CheckpointReader, TensorSink};

/// A set of `E` experts computed group by group.
///
/// Implement this to add an expert type; [`SparseMoeBlock`] does the routing, dispatch and combine.
///
/// # Example
///
/// A toy expert type (each expert scales its rows by its own learned factor), plugged into a
/// sparse MoE block beside the framework's router; `examples/custom_expert.rs` trains a real one
/// (GeGLU) under `--placement disagg`.
///
/// ```
/// use burn::module::{Module, Param};
/// use burn::tensor::{backend::Backend, Distribution, Tensor};
/// use disagmoe_models::moe::{map_groups, Experts, SparseMoeBlock, TopKRouter};
/// use disagmoe_models::{CheckpointReader, Init, Result, TensorSink};
///
/// #[derive(Module, Debug)]
/// struct ScaleExperts<B: Backend> {
///     scale: Param<Tensor<B, 1>>, // [E]
/// }
///
/// impl<B: Backend> Experts<B> for ScaleExperts<B> {
///     fn num_experts(&self) -> usize {
///         self.scale.dims()[0]
///     }
///     fn forward_grouped(&self, xs: Tensor<B, 2>, counts: &[usize]) -> Tensor<B, 2> {
///         // Rows arrive sorted by expert: `counts[e]` rows for expert `e`.
///         map_groups(xs, counts, |e, x| x * self.scale.val().narrow(0, e, 1).unsqueeze::<2>())
///     }
///     fn load(&mut self, ckpt: &mut CheckpointReader, prefix: &str, device: &B::Device) -> Result<()> {
///         let e = self.num_experts();
///         self.scale = Param::from_tensor(ckpt.tensor(&format!("{prefix}.scale"), [e], device)?);
///         Ok(())
///     }
///     fn save(&self, sink: &mut TensorSink, prefix: &str) {
///         sink.put_param(format!("{prefix}.scale"), &self.scale);
///     }
/// }
///
/// type B = burn::backend::Flex;
/// let device = Default::default();
/// let router = TopKRouter::new(16, 4, 2, true, &Init::<B>::new(1, 0.5, &device));
/// let experts = ScaleExperts { scale: Param::from_tensor(Tensor::<B, 1>::ones([4], &device)) };
/// let block = SparseMoeBlock::new(router, experts);
/// let x = Tensor::<B, 3>::random([2, 5, 16], Distribution::Normal(0.0, 1.0), &device);
/// let (y, stats) = block.forward(x);
/// assert_eq!(y.dims(), [2, 5, 16]);
/// assert_eq!(stats.counts.iter().sum::<usize>(), 2 * 5 * 2); // every token to its top-2
/// ```
pub trait Experts<B: Backend> {
    /// Number of experts `E`.
    fn num_experts(&self) -> usize;

    /// Runs every expert on its block of rows.
    ///
    /// # Shapes
    /// - xs: `[N, M]`, rows sorted by expert, `counts[e]` rows for expert `e` (`sum(counts) == N`)
    /// - output: `[N, M]`, in the same row order
    fn forward_grouped(&self, xs: Tensor<B, 2>, counts: &[usize]) -> Tensor<B, 2>;

    /// Loads the experts' weights from a checkpoint (`prefix` is e.g. `model.layers.3.mlp.experts`).
    fn load(&mut self, ckpt: &mut CheckpointReader, prefix: &str, device: &B::Device) -> Result<()>;

    /// Saves the experts' weights under the names [`Experts::load`] reads.
    fn save(&self, sink: &mut TensorSink, prefix: &str);

    /// Whether all experts live in shared tensors (a fused `[E, ...]` layout). An optimizer then
    /// steps every expert of a layer whenever any of them saw a token (the others with a zero
    /// gradient), and a holder of a shard must do the same to stay equivalent.
    fn fused(&self) -> bool {
        false
    }

    /// Keeps experts `range` (local ids) and drops the others, for expert parallelism; the kept
    /// experts keep their checkpoint names. Expert types that do not implement it run on one
    /// holder per layer only.
    fn shard(self, range: std::ops::Range<usize>) -> Result<Self>
    where
        Self: Sized,
    {
        Err(ModelError::InvalidInput(format!(
            "this expert type cannot be split across devices (experts {range:?} requested); implement Experts::shard"
        )))
    }
}

/// Applies `f(e, rows_of_e)` to each non-empty expert block of `xs` and concatenates the results.
///
/// # Shapes
/// - xs: `[N, M]` grouped by `counts`; `f` maps `[counts[e], M] -> [counts[e], M']`; output `[N, M']`
pub fn map_groups<B: Backend>(
    xs: Tensor<B, 2>,
    counts: &[usize],
    mut f: impl FnMut(usize, Tensor<B, 2>) -> Tensor<B, 2>,
) -> Tensor<B, 2> {
    let mut outs = Vec::with_capacity(counts.len());
    let mut start = 0;
    for (e, &c) in counts.iter().enumerate() {
        if c > 0 {
            outs.push(f(e, xs.clone().narrow(0, start, c)));
        }
        start += c;
    }
    Tensor::cat(outs, 0)
}

/// SwiGLU feed-forward `down(silu(gate(x)) * up(x))`: one routed expert, or the dense MLP.
#[derive(Module, Debug)]
pub struct SwiGluMlp<B: Backend> {
    /// `[I, M]`
    pub gate_proj: Linear<B>,
    /// `[I, M]`
    pub up_proj: Linear<B>,
    /// `[M, I]`
    pub down_proj: Linear<B>,
}

impl<B: Backend> SwiGluMlp<B> {
    /// A freshly initialised MLP of width `hidden` and intermediate size `inter`, its projections
    /// named `gate_proj`, `up_proj`, `down_proj` below `init`'s prefix.
    pub fn new(hidden: usize, inter: usize, init: &Init<B>) -> Self {
        Self::named(hidden, inter, ExpertNames::HF, init)
    }

    /// [`SwiGluMlp::new`] with the projections named by `names`.
    pub fn named(hidden: usize, inter: usize, names: ExpertNames, init: &Init<B>) -> Self {
        Self {
            gate_proj: Linear::new(hidden, inter, false, &init.child(names.gate)),
            up_proj: Linear::new(hidden, inter, false, &init.child(names.up)),
            down_proj: Linear::new(inter, hidden, false, &init.child(names.down)),
        }
    }

    /// # Shapes
    /// - x: `[..., M]` -> `[..., M]`
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let (g, u) = (self.gate_proj.forward(x.clone()), self.up_proj.forward(x));
        let h = disagmoe_kernels::fused::swiglu(g.clone(), u.clone()).unwrap_or_else(|| silu(g) * u);
        self.down_proj.forward(h)
    }

    /// Loads `{prefix}.{gate,up,down}_proj.weight`.
    pub fn load(&mut self, ckpt: &mut CheckpointReader, prefix: &str, device: &B::Device) -> Result<()> {
        self.load_named(ckpt, prefix, ExpertNames::HF, device)
    }

    /// Loads `{prefix}.{names}.weight`.
    pub fn load_named(
        &mut self,
        ckpt: &mut CheckpointReader,
        prefix: &str,
        names: ExpertNames,
        device: &B::Device,
    ) -> Result<()> {
        self.gate_proj.load(ckpt, &format!("{prefix}.{}", names.gate), device)?;
        self.up_proj.load(ckpt, &format!("{prefix}.{}", names.up), device)?;
        self.down_proj.load(ckpt, &format!("{prefix}.{}", names.down), device)
    }

    /// Saves under the names [`SwiGluMlp::load`] reads.
    pub fn save(&self, sink: &mut TensorSink, prefix: &str) {
        self.save_named(sink, prefix, ExpertNames::HF)
    }

    /// Saves under the names [`SwiGluMlp::load_named`] reads.
    pub fn save_named(&self, sink: &mut TensorSink, prefix: &str, names: ExpertNames) {
        self.gate_proj.save(sink, &format!("{prefix}.{}", names.gate));
        self.up_proj.save(sink, &format!("{prefix}.{}", names.up));
        self.down_proj.save(sink, &format!("{prefix}.{}", names.down));
    }
}

/// Checkpoint names of a SwiGLU MLP's three projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertNames {
    /// The gate projection (`silu` side).
    pub gate: &'static str,
    /// The up projection.
    pub up: &'static str,
    /// The down projection.
    pub down: &'static str,
}

impl ExpertNames {
    /// `gate_proj`, `up_proj`, `down_proj` (Qwen3-MoE, OLMoE, DeepSeek).
    pub const HF: Self = Self { gate: "gate_proj", up: "up_proj", down: "down_proj" };
    /// `w1`, `w3`, `w2` (Mixtral: gate = w1, up = w3, down = w2).
    pub const MIXTRAL: Self = Self { gate: "w1", up: "w3", down: "w2" };
}

/// SwiGLU experts (Qwen3-MoE, Mixtral, OLMoE, DeepSeek routed experts), each an MLP of its own
/// named `{prefix}.{j}.{gate,up,down}` in checkpoints (`j` the expert's global index).
#[derive(Module, Debug)]
pub struct SwiGluExperts<B: Backend> {
    /// One MLP per expert held.
    pub experts: Vec<SwiGluMlp<B>>,
    /// Global index of the first expert held.
    #[module(skip)]
    pub first: usize,
    /// Checkpoint names of each expert's projections.
    #[module(skip)]
    pub names: ExpertNames,
}

impl<B: Backend> SwiGluExperts<B> {
    /// Experts `range` (global indices) of a layer, freshly initialised; `init` is scoped to the
    /// experts' prefix (`model.layers.3.mlp.experts`).
    pub fn new(range: std::ops::Range<usize>, hidden: usize, inter: usize, names: ExpertNames, init: &Init<B>) -> Self {
        let experts =
            range.clone().map(|j| SwiGluMlp::named(hidden, inter, names, &init.child(j.to_string()))).collect();
        Self { experts, first: range.start, names }
    }
}

impl<B: Backend> Experts<B> for SwiGluExperts<B> {
    fn num_experts(&self) -> usize {
        self.experts.len()
    }

    fn forward_grouped(&self, xs: Tensor<B, 2>, counts: &[usize]) -> Tensor<B, 2> {
        // Expert projections have no biases (`SwiGluMlp` builds and loads none).
        let weights: Vec<_> = self
            .experts
            .iter()
            .map(|e| (e.gate_proj.weight.val(), e.up_proj.weight.val(), e.down_proj.weight.val()))
            .collect();
        disagmoe_kernels::fused::swiglu_experts(xs.clone(), counts, &weights)
            .unwrap_or_else(|| disagmoe_kernels::reference::swiglu_experts(xs, counts, &weights))
    }

    /// Reads the Hub's per-expert names (`{prefix}.{j}.gate_proj.weight`, ...) or, when those are
    /// absent, the fused layout transformers 5 keeps in memory (`{prefix}.gate_up_proj`
    /// `[E, 2I, M]` with gate rows first, `{prefix}.down_proj` `[E, M, I]`).
    fn load(&mut self, ckpt: &mut CheckpointReader, prefix: &str, device: &B::Device) -> Result<()> {
        let fused = format!("{prefix}.gate_up_proj");
        let first = format!("{prefix}.{}.{}.weight", self.first, self.names.gate);
        if !ckpt.contains(&first) && ckpt.contains(&fused) && !self.experts.is_empty() {
            let (n, start) = (self.experts.len(), self.first);
            let (inter, hidden) = self.experts[0].gate_proj.dims();
            let gate_up = ckpt.tensor_rows::<B, 3>(&fused, [n, 2 * inter, hidden], start, device)?;
            let down = ckpt.tensor_rows::<B, 3>(&format!("{prefix}.down_proj"), [n, hidden, inter], start, device)?;
            for (j, expert) in self.experts.iter_mut().enumerate() {
                let gu = gate_up.clone().narrow(0, j, 1).reshape([2 * inter, hidden]);
                expert.gate_proj.weight = Param::from_tensor(gu.clone().narrow(0, 0, inter));
                expert.up_proj.weight = Param::from_tensor(gu.narrow(0, inter, inter));
                expert.down_proj.weight = Param::from_tensor(down.clone().narrow(0, j, 1).reshape([hidden, inter]));
            }
            return Ok(());
        }
        let (first, names) = (self.first, self.names);
        for (j, expert) in self.experts.iter_mut().enumerate() {
            expert.load_named(ckpt, &format!("{prefix}.{}", first + j), names, device)?;
        }
        Ok(())
    }

    fn save(&self, sink: &mut TensorSink, prefix: &str) {
        for (j, expert) in self.experts.iter().enumerate() {
            expert.save_named(sink, &format!("{prefix}.{}", self.first + j), self.names);
        }
    }

    fn shard(self, range: std::ops::Range<usize>) -> Result<Self> {
        if range.end > self.experts.len() {
            return Err(ModelError::InvalidInput(format!("expert shard {range:?} of {} experts", self.experts.len())));
        }
        let first = self.first + range.start;
        Ok(Self { experts: self.experts.into_iter().skip(range.start).take(range.len()).collect(), first, ..self })
    }
}

/// Chooses `k` experts per token and their gate weights.
///
/// Implement this to add a routing rule; [`SparseMoeBlock`] is generic over it. Routers load and save
/// themselves relative to the MoE block's prefix (e.g. `model.layers.3.mlp`), since families name
/// them differently (`gate`, `router`).
pub trait Router<B: Backend> {
    /// Step 1 of the layer: scores, selection, gate weights.
    ///
    /// # Shapes
    /// - x: `[T, M]`
    fn route(&self, x: Tensor<B, 2>) -> RouterOutput<B>;
    /// Experts per token `k`.
    fn top_k(&self) -> usize;
    /// Loads the router's weights under the MoE block's prefix.
    fn load(&mut self, ckpt: &mut CheckpointReader, block_prefix: &str, device: &B::Device) -> Result<()>;
    /// Saves them under the names [`Router::load`] reads.
    fn save(&self, sink: &mut TensorSink, block_prefix: &str);
    /// Aux-loss-free balancing from a step's routed copies per expert; routers without a
    /// correction bias return `Ok(false)`.
    fn update_balance_bias(&mut self, _counts: &[usize], _rate: f64) -> Result<bool> {
        Ok(false)
    }
}

/// Linear router with softmax-then-top-k selection (Qwen3-MoE, Mixtral).
#[derive(Module, Debug)]
pub struct TopKRouter<B: Backend> {
    /// `[E, M]`, the checkpoint's `mlp.gate.weight`.
    pub weight: Param<Tensor<B, 2>>,
    /// Experts per token.
    pub top_k: usize,
    /// Renormalise the chosen probabilities to sum to one.
    pub norm_topk_prob: bool,
}

/// Times [`ExpertIds::to_host`] read ids from the device (all threads): a test of the claim
/// that routing on CubeCL backends brings back counts, never token ids.
static DEVICE_ID_READS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How many times routed expert ids have been read back from the device so far.
pub fn device_id_reads() -> usize {
    DEVICE_ID_READS.load(std::sync::atomic::Ordering::Relaxed)
}

/// MoE layer forwards whose sort, permute and combine ran on the device (all threads).
static DEVICE_ROUTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How many MoE layer forwards have routed on the device so far.
pub fn device_routed_layers() -> usize {
    DEVICE_ROUTED.load(std::sync::atomic::Ordering::Relaxed)
}

/// The expert of each routed copy, token-major (`T k`, best first): on the host, or on the
/// device where the router chose there (CubeCL backends: `disagmoe_kernels::fused::top_k`), so
/// that the layer sorts, permutes and combines on the device and only counts come back.
#[derive(Debug, Clone)]
pub enum ExpertIds<B: Backend> {
    /// On the host.
    Host(Vec<usize>),
    /// `[T k]` on the device (`u32` elements).
    Device(Tensor<B, 1, Int>),
}

impl<B: Backend> ExpertIds<B> {
    /// Routed copies `T k`.
    pub fn len(&self) -> usize {
        match self {
            Self::Host(ids) => ids.len(),
            Self::Device(ids) => ids.dims()[0],
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The ids on the host: borrowed when they are there, else read from the device (counted by
    /// [`device_id_reads`]: for the paths that need them, such as the runtime's host messages).
    pub fn to_host(&self) -> std::borrow::Cow<'_, [usize]> {
        match self {
            Self::Host(ids) => std::borrow::Cow::Borrowed(ids),
            Self::Device(ids) => {
                DEVICE_ID_READS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                std::borrow::Cow::Owned(
                    ids.to_data()
                        .convert::<i64>()
                        .to_vec::<i64>()
                        .expect("int ids")
                        .into_iter()
                        .map(|e| e as usize)
                        .collect(),
                )
            }
        }
    }

    /// The chosen scores, differentiable: `scores[t, ids[t k + j]]` (a gather on the device
    /// when the ids are there).
    ///
    /// # Shapes
    /// - scores: `[T, E]` -> `[T, k]`
    pub fn gather(&self, scores: Tensor<B, 2>, k: usize) -> Tensor<B, 2> {
        match self {
            Self::Host(ids) => gather_chosen(scores, ids, k),
            Self::Device(ids) => {
                let t = scores.dims()[0];
                scores.gather(1, ids.clone().reshape([t, k]))
            }
        }
    }
}

impl<B: Backend> From<Vec<usize>> for ExpertIds<B> {
    fn from(ids: Vec<usize>) -> Self {
        Self::Host(ids)
    }
}

/// The `k` highest scores of each row of `scores` (`[T, E]`), token-major, best first, ties to
/// the lower index: chosen on the device on CubeCL backends, else on the host ([`top_k_ids`]).
pub fn choose_top_k<B: Backend>(scores: &Tensor<B, 2>, k: usize) -> ExpertIds<B> {
    match disagmoe_kernels::fused::top_k(scores.clone(), k) {
        Some(ids) => ExpertIds::Device(ids),
        None => ExpertIds::Host(top_k_ids(scores, k)),
    }
}

/// What the router decided for a micro-batch.
#[derive(Debug, Clone)]
pub struct RouterOutput<B: Backend> {
    /// `[T, E]` full router probabilities (softmax over all experts), what the load-balancing loss
    /// averages.
    pub probs: Tensor<B, 2>,
    /// `[T, k]` gate weights of the chosen experts (renormalised when configured).
    pub weights: Tensor<B, 2>,
    /// `T * k` chosen expert ids, token-major (`ids[t * k + j]`), best first: on the device
    /// where the router chose there.
    pub ids: ExpertIds<B>,
    /// `[T, E]` the router's logits (before softmax or sigmoid), what the router z-loss reads.
    pub logits: Tensor<B, 2>,
}

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

impl<B: Backend> TopKRouter<B> {
    /// A router over `experts` experts for width `hidden`, its weight `{block}.gate.weight` (`init`
    /// is scoped to the MoE block).
    pub fn new(hidden: usize, experts: usize, top_k: usize, norm_topk_prob: bool, init: &Init<B>) -> Self {
        Self {
            weight: Param::from_tensor(init.child("gate").normal("weight", [experts, hidden])),
            top_k,
            norm_topk_prob,
        }
    }
}

impl<B: Backend> Router<B> for TopKRouter<B> {
    fn route(&self, x: Tensor<B, 2>) -> RouterOutput<B> {
        let logits = x.matmul(self.weight.val().transpose()); // [T, E]
        let probs = softmax(logits.clone(), 1); // [T, E]
        let ids = choose_top_k(&probs, self.top_k);
        let mut weights = ids.gather(probs.clone(), self.top_k); // [T, k]
        if self.norm_topk_prob {
            weights = weights.clone() / weights.sum_dim(1);
        }
        RouterOutput { probs, weights, ids, logits }
    }

    fn top_k(&self) -> usize {
        self.top_k
    }

    fn load(&mut self, ckpt: &mut CheckpointReader, block_prefix: &str, device: &B::Device) -> Result<()> {
        let [e, m] = self.weight.dims();
        self.weight =
            Param::from_tensor(ckpt.tensor::<B, 2>(&format!("{block_prefix}.gate.weight"), [e, m], device)?);
        Ok(())
    }

    fn save(&self, sink: &mut TensorSink, block_prefix: &str) {
        sink.put_param(format!("{block_prefix}.gate.weight"), &self.weight);
    }
}

/// Ids of the `k` highest scores of each row of `scores` (`[T, E]`), token-major, best first;
/// read on the host (the per-expert group sizes decide the shapes of the expert matmuls).
pub fn top_k_ids<B: Backend>(scores: &Tensor<B, 2>, k: usize) -> Vec<usize> {
    let [t, e] = scores.dims();
    let host = scores.to_data().convert::<f32>().to_vec::<f32>().expect("f32 router scores");
    top_k_rows(&host, t, e, k)
}

/// The scores of the chosen experts, differentiable: `scores[t, ids[t * k + j]]`.
///
/// # Shapes
/// - scores: `[T, E]`; ids: `T * k` -> `[T, k]`
pub fn gather_chosen<B: Backend>(scores: Tensor<B, 2>, ids: &[usize], k: usize) -> Tensor<B, 2> {
    let [t, _] = scores.dims();
    let idx = Tensor::<B, 2, Int>::from_data(
        TensorData::new(ids.iter().map(|&i| i as i64).collect::<Vec<_>>(), [t, k]),
        &scores.device(),
    );
    scores.gather(1, idx)
}

/// Indices of the `k` largest values of each row of a row-major `[rows, cols]` matrix, largest
/// first; ties go to the lower index.
pub fn top_k_rows(values: &[f32], rows: usize, cols: usize, k: usize) -> Vec<usize> {
    let mut out = Vec::with_capacity(rows * k);
    let mut order: Vec<usize> = Vec::with_capacity(cols);
    for r in 0..rows {
        let row = &values[r * cols..(r + 1) * cols];
        order.clear();
        order.extend(0..cols);
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        out.extend_from_slice(&order[..k]);
    }
    out
}

/// Where each group starts when groups of `counts` rows are laid out one after another.
pub fn exclusive_prefix_sum(counts: &[usize]) -> Vec<usize> {
    counts
        .iter()
        .scan(0, |acc, &c| {
            let start = *acc;
            *acc += c;
            Some(start)
        })
        .collect()
}

/// Step 2 and 4: the expert-sorted order of the `N = T * k` routed copies.
#[derive(Debug, Clone)]
pub struct Dispatch {
    /// Rows per expert, `[E]`.
    pub counts: Vec<usize>,
    /// For each sorted position, the token-major slot `t * k + j` it came from, `[N]`.
    pub slots: Vec<usize>,
    /// Experts per token.
    pub top_k: usize,
    /// The expert of each token-major slot `t * k + j`, `[T k]` (the router's choices; a copy not
    /// in `slots` is another holder's or dropped).
    pub experts: Vec<usize>,
}

impl Dispatch {
    /// A stable counting sort of the routed copies by expert id.
    pub fn new(ids: &[usize], num_experts: usize, top_k: usize) -> Self {
        Self::for_experts(ids, 0..num_experts, top_k)
    }

    /// The same sort of only the copies routed to `experts` (a holder's shard): `counts` has one
    /// entry per expert of the range, `slots` lists only those copies. Permute and combine work on
    /// such a subset unchanged; the other holders' shares add up to the layer's output.
    pub fn for_experts(ids: &[usize], experts: std::ops::Range<usize>, top_k: usize) -> Self {
        let mut counts = vec![0usize; experts.len()];
        for &e in ids.iter().filter(|e| experts.contains(e)) {
            counts[e - experts.start] += 1;
        }
        let mut next = exclusive_prefix_sum(&counts);
        let mut slots = vec![0usize; counts.iter().sum()];
        for (slot, &e) in ids.iter().enumerate().filter(|(_, e)| experts.contains(e)) {
            slots[next[e - experts.start]] = slot;
            next[e - experts.start] += 1;
        }
        Self { counts, slots, top_k, experts: ids.to_vec() }
    }

    /// Routed copies sorted here (`N`).
    pub fn rows(&self) -> usize {
        self.slots.len()
    }

    /// Gathers each token once per chosen expert, in expert order (the fused operation or kernel
    /// where `disagmoe_kernels::fused` has one, else its reference); with `shared`, also `x` for
    /// the shared experts, through the same operation so that the fused backward adds a token's
    /// gradients (its copies' and the shared experts') in the canonical order of
    /// `disagmoe_kernels::order`.
    ///
    /// # Shapes
    /// - x: `[T, M]` -> `[N, M]` and, with `shared`, `[T, M]`
    pub fn permute<B: Backend>(&self, x: Tensor<B, 2>, shared: bool) -> (Tensor<B, 2>, Option<Tensor<B, 2>>) {
        let n = self.rows();
        match disagmoe_kernels::fused::permute_rows(x.clone(), &self.slots, self.top_k, &self.experts, shared) {
            Some(out) if shared => {
                let t = out.dims()[0] - n;
                (out.clone().narrow(0, 0, n), Some(out.narrow(0, n, t)))
            }
            Some(out) => (out, None),
            None => {
                (disagmoe_kernels::reference::permute_rows(x.clone(), &self.slots, self.top_k), shared.then_some(x))
            }
        }
    }

    /// Weights each expert output by its gate and adds a token's outputs (and its row of `base`,
    /// the shared experts' output) back in token order. The fused CPU operation adds them in the
    /// canonical order of `disagmoe_kernels::order`, so one holder's share of a layer and the
    /// attention worker's sum of the shares give the bits of one device's combine.
    ///
    /// # Shapes
    /// - ys: `[N, M]` (expert order); weights: `[T, k]`; base: `[T, M]`; output: `[T, M]`
    pub fn combine<B: Backend>(
        &self,
        ys: Tensor<B, 2>,
        weights: Tensor<B, 2>,
        base: Option<Tensor<B, 2>>,
    ) -> Tensor<B, 2> {
        disagmoe_kernels::fused::combine_rows(ys.clone(), weights.clone(), &self.slots, &self.experts, base.clone())
            .unwrap_or_else(|| {
                let out = disagmoe_kernels::reference::combine_rows(ys, weights, &self.slots);
                match base {
                    Some(base) => out + base,
                    None => out,
                }
            })
    }
}

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
