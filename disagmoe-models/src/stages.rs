//! A model taken apart into what an attention device and an expert device compute, without any
//! notion of devices: the runtime in `disagmoe-train` decides who holds which piece.
//!
//! Layer `l` becomes an [`AttentionStage`] (input norm, attention, post-attention norm, router) and
//! an [`ExpertStage`] (routed experts, shared experts, or the dense MLP of a dense layer); the
//! embedding, final norm and head are the [`Ends`]. Composed back in order they compute exactly what
//! [`CausalLm::forward`](crate::decoder::CausalLm::forward) computes:
//!
//! ```text
//! h_0 = embed(ids)
//! for l: (x_l, y_l, route_l) = attention_stage_l(h_l)       // x = h + attn(norm(h)), y = norm2(x)
//!        h_{l+1} = x_l + sum over holders r of expert_stage_l^r(y_l[tokens of r], weights, ids)
//! logits = head(norm(h_L))
//! ```
//!
//! An expert stage can hold any set of a layer's experts (contiguous runs, [`expert_runs`]); then
//! each holder computes the gate-weighted sum of its own experts' outputs for the tokens it got, and
//! the partial sums add up to the layer's output.
//!
//! Each piece can also be **built alone** ([`Ends::init`], [`AttentionStage::init`],
//! [`ExpertStage::init`], with only the experts it holds), **loaded alone** from a checkpoint (only
//! its own tensors, and only its rows of a tensor stacked over experts) and **saved alone** under
//! its checkpoint names: a worker of a distributed run never allocates what it does not hold.

use std::ops::Range;

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};
use disagmoe_kernels::documents::Documents;
use disagmoe_kernels::ring::Partial;

use crate::balance::AuxLoss;
use crate::decoder::{init_ends, AttentionLayer, DecoderLayer, FamilyModel, FeedForward, RingBlock, RingProjection};
use crate::error::Result;
use crate::families::FamilyConfig;
use crate::init::Init;
use crate::moe::{Dispatch, Experts, Router, RouterOutput, SparseMoeBlock, SwiGluMlp};
use crate::mtp::{init_mtp, load_mtp, mtp_loss, save_mtp, MtpLayer, MtpOutput};
use crate::nn::{Embedding, Linear, RmsNorm};
use crate::rope::Rope;
use crate::weights::{CheckpointReader, TensorSink};

/// The checkpoint prefix of layer `layer`'s feed-forward module (`model.layers.3.mlp`).
fn ffn_prefix(layer: usize, ffn_name: &str) -> String {
    format!("model.layers.{layer}.{ffn_name}")
}

/// The embedding, final norm and head of a model, and the multi-token prediction modules that
/// share them.
#[derive(Module, Debug)]
pub struct Ends<B: Backend, A: Module<B>, R: Module<B>, X: Module<B>> {
    /// `model.embed_tokens`
    pub embed_tokens: Embedding<B>,
    /// `model.norm`
    pub norm: RmsNorm<B>,
    /// `lm_head` (absent when tied to the embedding).
    pub lm_head: Option<Linear<B>>,
    /// The multi-token prediction modules (none unless trained).
    pub mtp: Vec<MtpLayer<B, A, R, X>>,
}

impl<B, A, R, X> Ends<B, A, R, X>
where
    B: Backend,
    A: Module<B> + AttentionLayer<B>,
    R: Module<B> + Router<B>,
    X: Module<B> + Experts<B>,
{
    /// The embedding, final norm and head of a family's model (and its multi-token prediction
    /// modules, when trained), from `init` (rooted at the model).
    pub fn init<C>(config: &C, init: &Init<B>) -> Self
    where
        C: FamilyConfig<Attention<B> = A, Router<B> = R, Experts<B> = X>,
    {
        let (embed_tokens, norm, lm_head) = init_ends(config, init);
        Self { embed_tokens, norm, lm_head, mtp: init_mtp(config, init) }
    }

    /// Loads `model.embed_tokens`, `model.norm`, `lm_head` (when untied) and the multi-token
    /// prediction modules.
    pub fn load(&mut self, ckpt: &mut CheckpointReader, device: &B::Device) -> Result<()> {
        self.embed_tokens.load(ckpt, "model.embed_tokens", device)?;
        self.norm.load(ckpt, "model.norm", device)?;
        if let Some(head) = &mut self.lm_head {
            head.load(ckpt, "lm_head", device)?;
        }
        load_mtp(&mut self.mtp, ckpt, &self.embed_tokens, self.lm_head.as_ref(), device)
    }

    /// Saves under the names [`Ends::load`] reads.
    pub fn save(&self, sink: &mut TensorSink) {
        self.embed_tokens.save(sink, "model.embed_tokens");
        self.norm.save(sink, "model.norm");
        if let Some(head) = &self.lm_head {
            head.save(sink, "lm_head");
        }
        save_mtp(&self.mtp, sink, self.lm_head.is_none());
    }

    /// Hidden states of token ids.
    ///
    /// # Shapes
    /// - ids: `[B, S]` -> `[B, S, M]`
    pub fn embed(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.embed_tokens.forward(ids)
    }

    /// Next-token logits of the last hidden states.
    ///
    /// # Shapes
    /// - h: `[B, S, M]` -> `[B, S, V]`
    pub fn logits(&self, h: Tensor<B, 3>) -> Tensor<B, 3> {
        crate::causal_lm::lm_logits(self.norm.forward(h), self.lm_head.as_ref(), &self.embed_tokens)
    }

    /// The next-token loss of the last hidden states, and the multi-token prediction modules'
    /// output when the model trains them ([`crate::mtp::mtp_loss`]); with `docs`, the losses
    /// ignore the targets in another document and the modules attend within documents.
    ///
    /// # Shapes
    /// - h: `[B, S, M]`; ids: `[B, S]`; cos, sin: `[1, 1, S, rotary dim]`; docs over `[B, S]`
    pub fn head_loss(
        &self,
        h: Tensor<B, 3>,
        ids: Tensor<B, 2, Int>,
        cos: Tensor<B, 4>,
        sin: Tensor<B, 4>,
        docs: Option<&Documents>,
    ) -> (Tensor<B, 1>, Option<MtpOutput<B>>) {
        let normed = self.norm.forward(h);
        let logits = crate::causal_lm::lm_logits(normed.clone(), self.lm_head.as_ref(), &self.embed_tokens);
        let ignore = docs.map(Documents::crosses);
        let lm = crate::causal_lm::next_token_cross_entropy(logits, ids.clone(), ignore.as_deref());
        let mtp = mtp_loss(&self.mtp, normed, ids, &self.embed_tokens, self.lm_head.as_ref(), cos, sin, docs);
        (lm, mtp)
    }
}

/// The attention side of one decoder layer: norms, attention and (on routed layers) the router.
#[derive(Module, Debug)]
pub struct AttentionStage<B: Backend, A: Module<B>, R: Module<B>> {
    /// `input_layernorm`
    pub input_layernorm: RmsNorm<B>,
    /// `self_attn`
    pub self_attn: A,
    /// `post_attention_layernorm`
    pub post_attention_layernorm: RmsNorm<B>,
    /// The layer's router (`None` on dense layers).
    pub router: Option<R>,
}

/// What an attention stage hands on.
#[derive(Debug, Clone)]
pub struct AttentionStageOutput<B: Backend> {
    /// `[T, M]`: `h + attn(norm(h))`, the residual the expert output is added to.
    pub residual: Tensor<B, 2>,
    /// `[T, M]`: `post_attention_layernorm(residual)`, the experts' input.
    pub normed: Tensor<B, 2>,
    /// The router's decision (routed layers).
    pub route: Option<RouterOutput<B>>,
}

impl<B: Backend, A: Module<B> + AttentionLayer<B>, R: Module<B> + Router<B>> AttentionStage<B, A, R> {
    /// The attention side of `layer` of a family's model, from `init` (rooted at the model).
    pub fn init<C>(config: &C, layer: usize, init: &Init<B>) -> Self
    where
        C: FamilyConfig<Attention<B> = A, Router<B> = R>,
    {
        let d = config.dims();
        let prefix = init.child(format!("model.layers.{layer}"));
        Self {
            input_layernorm: RmsNorm::new(d.hidden_size, d.rms_norm_eps, &prefix.child("input_layernorm")),
            self_attn: config.attention(layer, &prefix.child("self_attn")),
            post_attention_layernorm: RmsNorm::new(
                d.hidden_size,
                d.rms_norm_eps,
                &prefix.child("post_attention_layernorm"),
            ),
            router: config
                .is_sparse_layer(layer)
                .then(|| config.router(layer, &init.child(ffn_prefix(layer, C::FFN_NAME)))),
        }
    }

    /// Loads layer `layer`'s norms, attention and router (under its feed-forward module
    /// `ffn_name`).
    pub fn load(
        &mut self,
        ckpt: &mut CheckpointReader,
        layer: usize,
        ffn_name: &str,
        device: &B::Device,
    ) -> Result<()> {
        let prefix = format!("model.layers.{layer}");
        self.input_layernorm.load(ckpt, &format!("{prefix}.input_layernorm"), device)?;
        self.self_attn.load_attention(ckpt, &format!("{prefix}.self_attn"), device)?;
        self.post_attention_layernorm.load(ckpt, &format!("{prefix}.post_attention_layernorm"), device)?;
        if let Some(router) = &mut self.router {
            router.load(ckpt, &ffn_prefix(layer, ffn_name), device)?;
        }
        Ok(())
    }

    /// Saves under the names [`AttentionStage::load`] reads.
    pub fn save(&self, sink: &mut TensorSink, layer: usize, ffn_name: &str) {
        let prefix = format!("model.layers.{layer}");
        self.input_layernorm.save(sink, &format!("{prefix}.input_layernorm"));
        self.self_attn.save_attention(sink, &format!("{prefix}.self_attn"));
        self.post_attention_layernorm.save(sink, &format!("{prefix}.post_attention_layernorm"));
        if let Some(router) = &self.router {
            router.save(sink, &ffn_prefix(layer, ffn_name));
        }
    }

    /// Attention stays within each document of `docs` when given.
    ///
    /// # Shapes
    /// - h: `[B, S, M]`; cos, sin: `[1, 1, S, rotary dim]`; docs over `[B, S]`
    pub fn forward(
        &self,
        h: Tensor<B, 3>,
        cos: Tensor<B, 4>,
        sin: Tensor<B, 4>,
        docs: Option<&Documents>,
    ) -> AttentionStageOutput<B> {
        let [b, s, m] = h.dims();
        let x = h.clone() + self.self_attn.attend(self.input_layernorm.forward(h), cos, sin, docs); // [B, S, M]
        let residual = x.reshape([b * s, m]); // [T, M]
        let normed = self.post_attention_layernorm.forward(residual.clone()); // [T, M]
        let route = self.router.as_ref().map(|r| r.route(normed.clone()));
        AttentionStageOutput { residual, normed, route }
    }

    /// Context parallelism's first half of the stage on a ring worker's tokens `h` (`[B, T, M]`,
    /// its two chunks; `cos`, `sin` at their positions): the queries and the block of keys and
    /// values that goes round the ring ([`AttentionLayer::ring_project`]); `None` when the
    /// attention type has no ring attention.
    pub fn ring_project(&self, h: Tensor<B, 3>, cos: Tensor<B, 4>, sin: Tensor<B, 4>) -> Option<RingProjection<B>> {
        self.self_attn.ring_project(self.input_layernorm.forward(h), cos, sin)
    }

    /// Context parallelism's attention of the queries of [`AttentionStage::ring_project`] (per
    /// chunk) over `blocks` of the ring merged onto `start` ([`AttentionLayer::ring_merge`]): the
    /// worker's own block first, while it travels round the ring, then the others' as they come.
    pub fn ring_merge(
        &self,
        q: &[Tensor<B, 4>; 2],
        held: &[Range<usize>; 2],
        blocks: Vec<RingBlock<B>>,
        start: Option<[Partial<B>; 2]>,
        docs: Option<&Documents>,
    ) -> Option<[Partial<B>; 2]> {
        self.self_attn.ring_merge(q, held, blocks, start, docs)
    }

    /// Context parallelism's second half: with the attention over every block of the ring
    /// merged (`all`, [`AttentionStage::ring_merge`]), what [`AttentionStage::forward`] hands on
    /// for this worker's tokens `h` (their order: `[T, M]` rows of `[B, T]`).
    pub fn ring_finish(&self, h: Tensor<B, 3>, all: Partial<B>) -> Option<AttentionStageOutput<B>> {
        let [b, t, m] = h.dims();
        let x = h + self.self_attn.ring_out(all)?; // [B, T, M]
        let residual = x.reshape([b * t, m]); // [T, M]
        let normed = self.post_attention_layernorm.forward(residual.clone()); // [T, M]
        let route = self.router.as_ref().map(|r| r.route(normed.clone()));
        Some(AttentionStageOutput { residual, normed, route })
    }

    /// Experts chosen per token (`None` on dense layers).
    pub fn top_k(&self) -> Option<usize> {
        self.router.as_ref().map(|r| r.top_k())
    }
}

/// The expert side of one decoder layer: some of its routed experts and, where this holder has
/// them, the shared experts or the dense MLP.
///
/// The routed experts held are any set of global ids, kept as contiguous runs (`runs`), one expert
/// module per run: a holder of a contiguous range has one run, a holder of a balanced placement
/// (hot experts replicated, replicas packed to even the load) has several, and the runtime may
/// keep a replicated expert in a run of its own so that its gradients can be summed with its
/// replicas'.
#[derive(Module, Debug)]
pub struct ExpertStage<B: Backend, X: Module<B>> {
    /// The routed experts of each run of `runs`, in order (empty on dense layers and on holders of
    /// no routed expert).
    pub experts: Vec<X>,
    /// Shared experts every token goes through (DeepSeek).
    pub shared_experts: Option<SwiGluMlp<B>>,
    /// The MLP of a dense layer.
    pub dense: Option<SwiGluMlp<B>>,
    /// The global ids of each module of `experts`: ascending, disjoint, non-empty ranges.
    #[module(skip)]
    pub runs: Vec<Range<usize>>,
}

pub use disagmoe_core::experts::expert_runs;

impl<B: Backend, X: Module<B> + Experts<B>> ExpertStage<B, X> {
    /// The expert side of `layer` of a family's model holding the routed experts of `runs`
    /// (global ids, ascending disjoint ranges, see [`expert_runs`]; empty on dense layers) and,
    /// when `first_holder`, the shared experts or the dense MLP; from `init` (rooted at the model).
    /// Nothing else is allocated.
    pub fn init<C>(config: &C, layer: usize, runs: &[Range<usize>], first_holder: bool, init: &Init<B>) -> Self
    where
        C: FamilyConfig<Experts<B> = X>,
    {
        let d = config.dims();
        let init = init.child(ffn_prefix(layer, C::FFN_NAME));
        if !config.is_sparse_layer(layer) {
            let dense = first_holder.then(|| SwiGluMlp::new(d.hidden_size, d.dense_intermediate_size, &init));
            return Self { experts: Vec::new(), shared_experts: None, dense, runs: Vec::new() };
        }
        let runs: Vec<Range<usize>> = runs.iter().filter(|r| !r.is_empty()).cloned().collect();
        debug_assert!(runs.windows(2).all(|w| w[0].end <= w[1].start), "ascending disjoint runs: {runs:?}");
        Self {
            experts: runs.iter().map(|r| config.experts(layer, r.clone(), &init.child("experts"))).collect(),
            shared_experts: config
                .shared_expert_intermediate()
                .filter(|_| first_holder)
                .map(|inter| SwiGluMlp::new(d.hidden_size, inter, &init.child("shared_experts"))),
            dense: None,
            runs,
        }
    }

    /// Loads the tensors of what this stage holds of layer `layer` (the rows of its experts only,
    /// where the checkpoint stacks them).
    pub fn load(
        &mut self,
        ckpt: &mut CheckpointReader,
        layer: usize,
        ffn_name: &str,
        device: &B::Device,
    ) -> Result<()> {
        let prefix = ffn_prefix(layer, ffn_name);
        for x in &mut self.experts {
            x.load(ckpt, &format!("{prefix}.experts"), device)?;
        }
        if let Some(shared) = &mut self.shared_experts {
            shared.load(ckpt, &format!("{prefix}.shared_experts"), device)?;
        }
        if let Some(dense) = &mut self.dense {
            dense.load(ckpt, &prefix, device)?;
        }
        Ok(())
    }

    /// Saves under the names [`ExpertStage::load`] reads (an expert shard of a stacked tensor
    /// saves its rows under the whole tensor's name).
    pub fn save(&self, sink: &mut TensorSink, layer: usize, ffn_name: &str) {
        let prefix = ffn_prefix(layer, ffn_name);
        for x in &self.experts {
            x.save(sink, &format!("{prefix}.experts"));
        }
        self.save_shared(sink, layer, ffn_name);
    }

    /// Saves the shared experts and the dense MLP only (see [`ExpertStage::save`]).
    pub fn save_shared(&self, sink: &mut TensorSink, layer: usize, ffn_name: &str) {
        let prefix = ffn_prefix(layer, ffn_name);
        if let Some(shared) = &self.shared_experts {
            shared.save(sink, &format!("{prefix}.shared_experts"));
        }
        if let Some(dense) = &self.dense {
            dense.save(sink, &prefix);
        }
    }

    /// Routed experts held (global ids, ascending).
    pub fn held(&self) -> Vec<usize> {
        self.runs.iter().flat_map(|r| r.clone()).collect()
    }

    /// Whether every token of the layer must come here (shared experts or dense MLP).
    pub fn needs_all_tokens(&self) -> bool {
        self.shared_experts.is_some() || self.dense.is_some()
    }

    /// This holder's share of the layer output for the tokens it was sent.
    ///
    /// `ids[t * k + j]` is the global expert of token `t`'s `j`-th choice; choices of experts not
    /// held here ([`ExpertStage::held`]; other holders', another replica's, or dropped) are skipped.
    /// `weights` are the gate weights of all `k` choices. Dense layers ignore `weights` and `ids`.
    ///
    /// # Shapes
    /// - y: `[n, M]`; weights: `[n, k]`; ids: `n * k` -> `[n, M]`
    pub fn forward(&self, y: Tensor<B, 2>, weights: Option<Tensor<B, 2>>, ids: &[usize]) -> Tensor<B, 2> {
        let [n, m] = y.dims();
        let device = y.device();
        if let Some(dense) = &self.dense {
            return dense.forward(y);
        }
        if let (false, Some(w)) = (self.experts.is_empty(), weights) {
            let k = if n == 0 { 1 } else { ids.len() / n };
            // 1. The model's dispatch over this holder's experts: a stable counting sort of the
            //    (token, choice) slots that chose them; the others are other holders' share.
            let dispatch = Dispatch::for_expert_set(ids, &self.held(), k);
            if dispatch.rows() > 0 {
                // 2. Permute (and the shared experts' input), compute run by run (a run's rows are
                //    contiguous in expert order), and combine gate-weighted back in token order
                //    with the shared experts' output, adding in the order one device adds the same
                //    terms (forward and backward).
                let (xs, shared_in) = dispatch.permute(y, self.shared_experts.is_some()); // [N, M], [n, M]
                let ys = self.forward_runs(xs, &dispatch.counts); // [N, M]
                let shared = self.shared_experts.as_ref().zip(shared_in).map(|(shared, x)| shared.forward(x));
                return dispatch.combine(ys, w, shared); // [n, M]
            }
        }
        match &self.shared_experts {
            Some(shared) => shared.forward(y),
            None => Tensor::zeros([n, m], &device),
        }
    }

    /// Each run's experts on its rows of `xs` (rows sorted by held expert, `counts` per held
    /// expert), concatenated in the same order.
    fn forward_runs(&self, xs: Tensor<B, 2>, counts: &[usize]) -> Tensor<B, 2> {
        if let [x] = self.experts.as_slice() {
            return x.forward_grouped(xs, counts);
        }
        let (mut outs, mut row, mut at) = (Vec::with_capacity(self.runs.len()), 0, 0);
        for (x, run) in self.experts.iter().zip(&self.runs) {
            let c = &counts[at..at + run.len()];
            let n: usize = c.iter().sum();
            if n > 0 {
                outs.push(x.forward_grouped(xs.clone().narrow(0, row, n), c));
            }
            (row, at) = (row + n, at + run.len());
        }
        Tensor::cat(outs, 0)
    }
}

impl<B: Backend, R: Module<B> + Router<B>, X: Module<B> + Experts<B>> FeedForward<B, R, X> {
    /// The router (routed layers) and everything else as an expert stage.
    pub fn split(self) -> (Option<R>, ExpertStage<B, X>) {
        match self {
            FeedForward::Sparse(SparseMoeBlock { gate, experts, shared_experts, .. }) => {
                let runs = vec![0..experts.num_experts()];
                (Some(gate), ExpertStage { experts: vec![experts], shared_experts, dense: None, runs })
            }
            FeedForward::Dense(mlp) => {
                (None, ExpertStage { experts: Vec::new(), shared_experts: None, dense: Some(mlp), runs: Vec::new() })
            }
        }
    }
}

/// A model taken apart: ends, one attention stage and one expert stage per layer, the RoPE tables'
/// source, and the loss settings.
pub struct Stages<B: Backend, A: Module<B>, R: Module<B>, X: Module<B>> {
    /// Embedding, final norm, head (and the multi-token prediction modules).
    pub ends: Ends<B, A, R, X>,
    /// Attention side of each layer, in order.
    pub attention: Vec<AttentionStage<B, A, R>>,
    /// Expert side of each layer, in order (all experts).
    pub experts: Vec<ExpertStage<B, X>>,
    /// Rotary embedding of the attention layers.
    pub rope: Rope,
    /// The balance loss and its coefficient (`None`: the family has none).
    pub aux_loss: Option<AuxLoss>,
    /// Vocabulary size.
    pub vocab_size: usize,
}

impl<B: Backend, C: FamilyConfig> FamilyModel<B, C> {
    /// Takes the model apart into [`Stages`].
    pub fn into_stages(self) -> Stages<B, C::Attention<B>, C::Router<B>, C::Experts<B>> {
        let (vocab_size, aux_loss, rope) =
            (self.config().dims().vocab_size, self.config().aux_loss(), self.rope().clone());
        let Self { embed_tokens, layers, norm, lm_head, mtp, .. } = self;
        let mut attention = Vec::with_capacity(layers.len());
        let mut experts = Vec::with_capacity(layers.len());
        for DecoderLayer { input_layernorm, self_attn, post_attention_layernorm, mlp, .. } in layers {
            let (router, stage) = mlp.split();
            attention.push(AttentionStage { input_layernorm, self_attn, post_attention_layernorm, router });
            experts.push(stage);
        }
        Stages { ends: Ends { embed_tokens, norm, lm_head, mtp }, attention, experts, rope, aux_loss, vocab_size }
    }
}
