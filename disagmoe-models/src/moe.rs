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
//! 2. [`Dispatch::new`]: a stable counting sort of the `N` copies by expert (host side: the group
//!    sizes decide the shapes of the per-expert matmuls);
//! 3. [`Experts::forward_grouped`]: one matmul chain per expert over its contiguous rows;
//! 4. [`Dispatch::combine`]: gate-weighted sum of each token's `k` outputs back in token order.
//!
//! Experts are behind the [`Experts`] trait, so a new expert type plugs into [`SparseMoeBlock`]
//! without touching the router or the layer.

use burn::module::{Module, Param};
use burn::tensor::activation::{silu, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::{IndexingUpdateOp, Int, Tensor, TensorData};

use crate::error::{ModelError, Result};
use crate::nn::{normal_init, Linear};
use crate::weights::{CheckpointReader, TensorSink};

/// A set of `E` experts computed group by group.
///
/// Implement this to add an expert type; [`SparseMoeBlock`] does the routing, dispatch and combine.
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

    /// Keeps experts `range` (local ids) and drops the others, for expert parallelism. Expert
    /// types that do not implement it run on one holder per layer only.
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
    /// A freshly initialised MLP of width `hidden` and intermediate size `inter`.
    pub fn new(hidden: usize, inter: usize, std: f64, device: &B::Device) -> Self {
        Self {
            gate_proj: Linear::new(hidden, inter, false, std, device),
            up_proj: Linear::new(hidden, inter, false, std, device),
            down_proj: Linear::new(inter, hidden, false, std, device),
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
        self.gate_proj.load(ckpt, &format!("{prefix}.gate_proj"), device)?;
        self.up_proj.load(ckpt, &format!("{prefix}.up_proj"), device)?;
        self.down_proj.load(ckpt, &format!("{prefix}.down_proj"), device)
    }

    /// Saves under the names [`SwiGluMlp::load`] reads.
    pub fn save(&self, sink: &mut TensorSink, prefix: &str) {
        self.gate_proj.save(sink, &format!("{prefix}.gate_proj"));
        self.up_proj.save(sink, &format!("{prefix}.up_proj"));
        self.down_proj.save(sink, &format!("{prefix}.down_proj"));
    }
}

/// `E` SwiGLU experts (Qwen3-MoE, Mixtral, DeepSeek routed experts).
#[derive(Module, Debug)]
pub struct SwiGluExperts<B: Backend> {
    /// One MLP per expert.
    pub experts: Vec<SwiGluMlp<B>>,
}

impl<B: Backend> SwiGluExperts<B> {
    /// `num` freshly initialised experts.
    pub fn new(num: usize, hidden: usize, inter: usize, std: f64, device: &B::Device) -> Self {
        Self { experts: (0..num).map(|_| SwiGluMlp::new(hidden, inter, std, device)).collect() }
    }
}

impl<B: Backend> Experts<B> for SwiGluExperts<B> {
    fn num_experts(&self) -> usize {
        self.experts.len()
    }

    fn forward_grouped(&self, xs: Tensor<B, 2>, counts: &[usize]) -> Tensor<B, 2> {
        let no_bias = self
            .experts
            .iter()
            .all(|e| e.gate_proj.bias.is_none() && e.up_proj.bias.is_none() && e.down_proj.bias.is_none());
        if no_bias && disagmoe_kernels::fused::available::<B>() {
            let weights: Vec<_> = self
                .experts
                .iter()
                .map(|e| (e.gate_proj.weight.val(), e.up_proj.weight.val(), e.down_proj.weight.val()))
                .collect();
            if let Some(ys) = disagmoe_kernels::fused::swiglu_experts(xs.clone(), counts, &weights) {
                return ys;
            }
        }
        map_groups(xs, counts, |e, x| self.experts[e].forward(x))
    }

    /// Reads the Hub's per-expert names (`{prefix}.{j}.gate_proj.weight`, ...) or, when those are
    /// absent, the fused layout transformers 5 keeps in memory (`{prefix}.gate_up_proj`
    /// `[E, 2I, M]` with gate rows first, `{prefix}.down_proj` `[E, M, I]`).
    fn load(&mut self, ckpt: &mut CheckpointReader, prefix: &str, device: &B::Device) -> Result<()> {
        let fused = format!("{prefix}.gate_up_proj");
        if !ckpt.contains(&format!("{prefix}.0.gate_proj.weight")) && ckpt.contains(&fused) {
            let e = self.experts.len();
            let (inter, hidden) = self.experts[0].gate_proj.dims();
            let gate_up = ckpt.tensor::<B, 3>(&fused, [e, 2 * inter, hidden], device)?;
            let down = ckpt.tensor::<B, 3>(&format!("{prefix}.down_proj"), [e, hidden, inter], device)?;
            for (j, expert) in self.experts.iter_mut().enumerate() {
                let gu = gate_up.clone().narrow(0, j, 1).reshape([2 * inter, hidden]);
                expert.gate_proj.weight = Param::from_tensor(gu.clone().narrow(0, 0, inter));
                expert.up_proj.weight = Param::from_tensor(gu.narrow(0, inter, inter));
                expert.down_proj.weight = Param::from_tensor(down.clone().narrow(0, j, 1).reshape([hidden, inter]));
            }
            return Ok(());
        }
        for (j, expert) in self.experts.iter_mut().enumerate() {
            expert.load(ckpt, &format!("{prefix}.{j}"), device)?;
        }
        Ok(())
    }

    fn save(&self, sink: &mut TensorSink, prefix: &str) {
        for (j, expert) in self.experts.iter().enumerate() {
            expert.save(sink, &format!("{prefix}.{j}"));
        }
    }

    fn shard(self, range: std::ops::Range<usize>) -> Result<Self> {
        if range.end > self.experts.len() {
            return Err(ModelError::InvalidInput(format!("expert shard {range:?} of {} experts", self.experts.len())));
        }
        Ok(Self { experts: self.experts.into_iter().skip(range.start).take(range.len()).collect() })
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

/// What the router decided for a micro-batch.
#[derive(Debug, Clone)]
pub struct RouterOutput<B: Backend> {
    /// `[T, E]` full router probabilities (softmax over all experts), what the load-balancing loss
    /// averages.
    pub probs: Tensor<B, 2>,
    /// `[T, k]` gate weights of the chosen experts (renormalised when configured).
    pub weights: Tensor<B, 2>,
    /// `T * k` chosen expert ids, token-major (`ids[t * k + j]`), best first.
    pub ids: Vec<usize>,
}

impl<B: Backend> TopKRouter<B> {
    /// A router over `experts` experts for width `hidden`.
    pub fn new(
        hidden: usize,
        experts: usize,
        top_k: usize,
        norm_topk_prob: bool,
        std: f64,
        device: &B::Device,
    ) -> Self {
        Self { weight: Param::from_tensor(normal_init([experts, hidden], std, device)), top_k, norm_topk_prob }
    }
}

impl<B: Backend> Router<B> for TopKRouter<B> {
    fn route(&self, x: Tensor<B, 2>) -> RouterOutput<B> {
        let logits = x.matmul(self.weight.val().transpose()); // [T, E]
        let probs = softmax(logits, 1); // [T, E]
        let ids = top_k_ids(&probs, self.top_k);
        let mut weights = gather_chosen(probs.clone(), &ids, self.top_k); // [T, k]
        if self.norm_topk_prob {
            weights = weights.clone() / weights.sum_dim(1);
        }
        RouterOutput { probs, weights, ids }
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
}

impl Dispatch {
    /// A stable counting sort of the routed copies by expert id.
    pub fn new(ids: &[usize], num_experts: usize, top_k: usize) -> Self {
        let mut counts = vec![0usize; num_experts];
        for &e in ids {
            counts[e] += 1;
        }
        let mut next = exclusive_prefix_sum(&counts);
        let mut slots = vec![0usize; ids.len()];
        for (slot, &e) in ids.iter().enumerate() {
            slots[next[e]] = slot;
            next[e] += 1;
        }
        Self { counts, slots, top_k }
    }

    fn index_tensor<B: Backend>(values: impl Iterator<Item = usize>, device: &B::Device) -> Tensor<B, 1, Int> {
        let v: Vec<i64> = values.map(|x| x as i64).collect();
        let n = v.len();
        Tensor::from_data(TensorData::new(v, [n]), device)
    }

    /// Token index of each sorted row, `[N]`.
    pub fn token_index<B: Backend>(&self, device: &B::Device) -> Tensor<B, 1, Int> {
        Self::index_tensor::<B>(self.slots.iter().map(|s| s / self.top_k), device)
    }

    /// Gathers each token once per chosen expert, in expert order.
    ///
    /// # Shapes
    /// - x: `[T, M]` -> `[N, M]`
    pub fn permute<B: Backend>(&self, x: Tensor<B, 2>, tokens: Tensor<B, 1, Int>) -> Tensor<B, 2> {
        disagmoe_kernels::fused::permute_rows(x.clone(), &self.slots, self.top_k).unwrap_or_else(|| x.select(0, tokens))
    }

    /// Weights each expert output by its gate and sums a token's `k` outputs in token order.
    ///
    /// # Shapes
    /// - ys: `[N, M]` (expert order); weights: `[T, k]`; output: `[T, M]`
    pub fn combine<B: Backend>(
        &self,
        ys: Tensor<B, 2>,
        weights: Tensor<B, 2>,
        tokens: Tensor<B, 1, Int>,
    ) -> Tensor<B, 2> {
        if let Some(out) = disagmoe_kernels::fused::combine_rows(ys.clone(), weights.clone(), &self.slots) {
            return out;
        }
        let [t, k] = weights.dims();
        let [n, m] = ys.dims();
        let device = ys.device();
        let slot_idx = Self::index_tensor::<B>(self.slots.iter().copied(), &device);
        let w = weights.reshape([t * k]).select(0, slot_idx).reshape([n, 1]); // [N, 1]
        Tensor::zeros([t, m], &device).select_assign(0, tokens, ys * w, IndexingUpdateOp::Add)
    }
}

/// What one MoE layer reports for the load-balancing loss and the load metrics.
#[derive(Debug, Clone)]
pub struct RouterStats<B: Backend> {
    /// `[E]`: sum over tokens of the router's softmax probabilities (differentiable).
    pub prob_sum: Tensor<B, 1>,
    /// Routed copies per expert (tokens per expert counted once per top-k slot).
    pub counts: Vec<usize>,
    /// Tokens `T` routed by this layer.
    pub tokens: usize,
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
}

impl<B: Backend, R: Module<B> + Router<B>, X: Module<B> + Experts<B>> SparseMoeBlock<B, R, X> {
    /// A block without shared experts.
    pub fn new(gate: R, experts: X) -> Self {
        Self { gate, experts, shared_experts: None }
    }

    /// # Shapes
    /// - x: `[B, S, M]` -> `[B, S, M]`
    pub fn forward(&self, x: Tensor<B, 3>) -> (Tensor<B, 3>, RouterStats<B>) {
        let [b, s, m] = x.dims();
        let flat = x.reshape([b * s, m]); // [T, M]
                                          // 1. route
        let routed = self.gate.route(flat.clone());
        // 2. dispatch
        let dispatch = Dispatch::new(&routed.ids, self.experts.num_experts(), self.gate.top_k());
        let tokens = dispatch.token_index::<B>(&flat.device());
        let xs = dispatch.permute(flat.clone(), tokens.clone()); // [N, M]
                                                                 // 3. compute
        let ys = self.experts.forward_grouped(xs, &dispatch.counts); // [N, M]
                                                                     // 4. combine
        let mut out = dispatch.combine(ys, routed.weights, tokens); // [T, M]
        if let Some(shared) = &self.shared_experts {
            out = out + shared.forward(flat);
        }
        let stats = RouterStats {
            prob_sum: routed.probs.sum_dim(0).reshape([dispatch.counts.len()]),
            counts: dispatch.counts,
            tokens: b * s,
        };
        (out.reshape([b, s, m]), stats)
    }

    /// The simple path beside [`SparseMoeBlock::forward`]: token by token, chosen expert by chosen
    /// expert, no sorting and no scatter. Slow; tests hold the two equal, gradients included.
    ///
    /// # Shapes
    /// - x: `[B, S, M]` -> `[B, S, M]`
    pub fn forward_per_token(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [b, s, m] = x.dims();
        let flat = x.reshape([b * s, m]);
        let routed = self.gate.route(flat.clone());
        let (k, e) = (self.gate.top_k(), self.experts.num_experts());
        let rows: Vec<Tensor<B, 2>> = (0..b * s)
            .map(|t| {
                let xt = flat.clone().narrow(0, t, 1); // [1, M]
                (0..k)
                    .map(|j| {
                        let mut counts = vec![0; e];
                        counts[routed.ids[t * k + j]] = 1;
                        let w = routed.weights.clone().narrow(0, t, 1).narrow(1, j, 1); // [1, 1]
                        self.experts.forward_grouped(xt.clone(), &counts) * w
                    })
                    .reduce(|a, c| a + c)
                    .expect("k >= 1")
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

/// The Switch/Mixtral load-balancing loss exactly as transformers' `load_balancing_loss_func`
/// computes it over the concatenation of all MoE layers' rows:
/// `E * sum_e (C_e / R) * (P_e / R)`, with `C_e` the routed copies of expert `e` and `P_e` the sum of
/// its router probabilities over all layers and tokens, and `R` the number of rows (layers x tokens).
///
/// Returns `None` when there is no MoE layer.
pub fn load_balancing_loss<B: Backend>(stats: &[RouterStats<B>]) -> Option<Tensor<B, 1>> {
    let first = stats.first()?;
    let e = first.counts.len();
    let rows: usize = stats.iter().map(|s| s.tokens).sum();
    let mut counts = vec![0f32; e];
    for s in stats {
        for (c, &n) in counts.iter_mut().zip(&s.counts) {
            *c += n as f32;
        }
    }
    let device = first.prob_sum.device();
    let counts = Tensor::<B, 1>::from_data(TensorData::new(counts, [e]), &device).div_scalar(rows as f64);
    let prob = stats.iter().map(|s| s.prob_sum.clone()).reduce(|a, b| a + b)?.div_scalar(rows as f64);
    Some((counts * prob).sum().mul_scalar(e as f64))
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
