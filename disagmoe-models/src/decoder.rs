//! The shape every family shares, written once: a causal LM is an embedding, a stack of
//! (attention block, expert block) pairs with pre-norms and residuals, a final norm and a head.
//!
//! Families differ only in the attention layer ([`AttentionLayer`]: GQA with or without q/k norms,
//! clipping and sinks, MLA), the router and expert types of their sparse layers, and their
//! configuration ([`crate::families::FamilyConfig`]). A family's model is [`FamilyModel`] of its
//! configuration type.

use std::ops::Range;

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};
use disagmoe_kernels::documents::Documents;
use disagmoe_kernels::ring::Partial;

use crate::attention::GqaAttention;
use crate::causal_lm::{causal_lm_loss, input_ids, lm_logits, CausalLmOutput, LossParts};
use crate::error::{ModelError, Result};
use crate::families::FamilyConfig;
use crate::init::Init;
use crate::kv_cache::{KvCache, LayerCache};
use crate::moe::{Experts, Router, RouterStats, RoutingOptions, SparseMoeBlock, SwiGluMlp};
use crate::mtp::{init_mtp, load_mtp, mtp_loss, save_mtp, MtpLayer};
use crate::nn::{Embedding, Linear, RmsNorm};
use crate::rope::Rope;
use crate::weights::{CheckpointReader, TensorSink};

/// A ring worker's queries and the block of its keys and values that goes round the ring
/// ([`AttentionLayer::ring_project`]).
#[derive(Debug, Clone)]
pub struct RingProjection<B: Backend> {
    /// `[B, T, H, D]`, rotated.
    pub q: Tensor<B, 4>,
    /// `[B, T, W]`: what the keys and values are made of.
    pub kv: Tensor<B, 3>,
}

/// A block of the ring: a worker's `[B, T, W]` keys-and-values payload over its two chunks.
#[derive(Debug, Clone)]
pub struct RingBlock<B: Backend> {
    /// `[B, T, W]`.
    pub kv: Tensor<B, 3>,
    /// The two chunks of the sequence it covers, front then back.
    pub held: [Range<usize>; 2],
}

/// A self-attention layer of a decoder.
pub trait AttentionLayer<B: Backend> {
    /// Causal self-attention; within each document of `docs` when given.
    ///
    /// # Shapes
    /// - x: `[B, S, M]`; cos, sin: `[1, 1, S, rotary dim]` (`[B, 1, S, rotary dim]` when positions
    ///   restart per document); docs over `[B, S]` -> `[B, S, M]`
    fn attend(&self, x: Tensor<B, 3>, cos: Tensor<B, 4>, sin: Tensor<B, 4>, docs: Option<&Documents>) -> Tensor<B, 3>;
    /// [`AttentionLayer::attend`] of new tokens at positions `past..past + S` over them and every
    /// earlier token, through what `cache` holds of those (the new tokens join it): incremental
    /// decoding. The default keeps the layer's inputs and reruns [`AttentionLayer::attend`] over
    /// all of them (exact, not fast); attention types with keys worth keeping override it.
    ///
    /// # Shapes
    /// - x: `[B, S, M]`; cos, sin: `[1, 1, past + S, rotary dim]` (every position so far)
    /// - output: `[B, S, M]`
    fn attend_cached(
        &self,
        x: Tensor<B, 3>,
        cos: Tensor<B, 4>,
        sin: Tensor<B, 4>,
        past: usize,
        cache: &mut LayerCache<B>,
    ) -> Tensor<B, 3> {
        let s = x.dims()[1];
        let all = match std::mem::take(cache) {
            LayerCache::Inputs(seen) => Tensor::cat(vec![seen, x], 1),
            _ => x,
        };
        let t = all.dims()[1];
        debug_assert_eq!(t, past + s, "the inputs kept are every position so far");
        let out = self.attend(all.clone(), cos, sin, None);
        *cache = LayerCache::Inputs(all);
        out.narrow(1, t - s, s)
    }
    /// Context parallelism's first half (`disagmoe_kernels::ring`): of a ring worker's tokens
    /// `x` (its two chunks of the sequence, front then back, rotated at their positions by `cos`,
    /// `sin`), the queries `[B, T, H, D]` and the block that goes round the ring, `[B, T, W]`:
    /// what the keys and values are made of (GQA: the rotated keys and the values; MLA: the
    /// normalised latent and the rotated shared key). `None`: the attention type has no ring
    /// attention, and a run with context parallelism refuses it.
    fn ring_project(&self, _x: Tensor<B, 3>, _cos: Tensor<B, 4>, _sin: Tensor<B, 4>) -> Option<RingProjection<B>> {
        None
    }
    /// Context parallelism's attention over blocks of the ring, one or more at a time: that of the
    /// queries of [`AttentionLayer::ring_project`] at the worker's two chunks `held` (`q`, front
    /// and back: `disagmoe_kernels::ring::split_queries`) over `blocks` (the worker's own first,
    /// computed while it travels; then the others' in ring order, those of ring ranks `r - 1`,
    /// `r - 2`, ..., each as it comes), merged onto `start` (each chunk's attention over the
    /// blocks so far), before any sinks (`disagmoe_kernels::ring::chunk_partials`: merging block
    /// by block gives the bits of one call over them all). Within each document of `docs` (over
    /// the whole `[B, S]` sequence) when given. `None`: the attention type has no ring attention.
    fn ring_merge(
        &self,
        _q: &[Tensor<B, 4>; 2],
        _held: &[Range<usize>; 2],
        _blocks: Vec<RingBlock<B>>,
        _start: Option<[Partial<B>; 2]>,
        _docs: Option<&Documents>,
    ) -> Option<[Partial<B>; 2]> {
        None
    }
    /// Context parallelism's output once every block is merged ([`AttentionLayer::ring_merge`]):
    /// the sinks added, projected out, `[B, T, M]`. `None` as for [`AttentionLayer::ring_merge`].
    fn ring_out(&self, _all: Partial<B>) -> Option<Tensor<B, 3>> {
        None
    }
    /// Loads the layer's weights under `prefix` (e.g. `model.layers.3.self_attn`).
    fn load_attention(&mut self, ckpt: &mut CheckpointReader, prefix: &str, device: &B::Device) -> Result<()>;
    /// Saves them under the names it loads.
    fn save_attention(&self, sink: &mut TensorSink, prefix: &str);
}

impl<B: Backend> AttentionLayer<B> for GqaAttention<B> {
    fn attend(&self, x: Tensor<B, 3>, cos: Tensor<B, 4>, sin: Tensor<B, 4>, docs: Option<&Documents>) -> Tensor<B, 3> {
        self.forward(x, cos, sin, docs)
    }
    fn ring_project(&self, x: Tensor<B, 3>, cos: Tensor<B, 4>, sin: Tensor<B, 4>) -> Option<RingProjection<B>> {
        Some(self.ring_project(x, cos, sin))
    }
    fn ring_merge(
        &self,
        q: &[Tensor<B, 4>; 2],
        held: &[Range<usize>; 2],
        blocks: Vec<RingBlock<B>>,
        start: Option<[Partial<B>; 2]>,
        docs: Option<&Documents>,
    ) -> Option<[Partial<B>; 2]> {
        Some(self.ring_merge(q, held, blocks, start, docs))
    }
    fn ring_out(&self, all: Partial<B>) -> Option<Tensor<B, 3>> {
        Some(self.ring_out(all))
    }
    fn attend_cached(
        &self,
        x: Tensor<B, 3>,
        cos: Tensor<B, 4>,
        sin: Tensor<B, 4>,
        past: usize,
        cache: &mut LayerCache<B>,
    ) -> Tensor<B, 3> {
        self.forward_cached(x, cos, sin, past, cache)
    }
    fn load_attention(&mut self, ckpt: &mut CheckpointReader, prefix: &str, device: &B::Device) -> Result<()> {
        self.load(ckpt, prefix, device)
    }
    fn save_attention(&self, sink: &mut TensorSink, prefix: &str) {
        self.save(sink, prefix)
    }
}

/// The feed-forward half of a decoder layer: routed experts, or a dense SwiGLU MLP on the layers a
/// family keeps dense (`mlp_only_layers`, `decoder_sparse_step`, `first_k_dense_replace`,
/// `moe_layer_freq`). Both live under the layer's feed-forward prefix (`...mlp`).
#[derive(Module, Debug)]
pub enum FeedForward<B: Backend, R: Module<B>, X: Module<B>> {
    /// A routed (sparse) layer.
    Sparse(SparseMoeBlock<B, R, X>),
    /// A dense layer.
    Dense(SwiGluMlp<B>),
}

impl<B: Backend, R: Module<B> + Router<B>, X: Module<B> + Experts<B>> FeedForward<B, R, X> {
    /// # Shapes
    /// - x: `[B, S, M]` -> `[B, S, M]`, plus router statistics on routed layers
    pub fn forward(&self, x: Tensor<B, 3>) -> (Tensor<B, 3>, Option<RouterStats<B>>) {
        match self {
            FeedForward::Sparse(moe) => {
                let (y, stats) = moe.forward(x);
                (y, Some(stats))
            }
            FeedForward::Dense(mlp) => (mlp.forward(x), None),
        }
    }

    /// The MoE block of a routed layer.
    pub fn moe(&self) -> Option<&SparseMoeBlock<B, R, X>> {
        match self {
            FeedForward::Sparse(moe) => Some(moe),
            FeedForward::Dense(_) => None,
        }
    }

    /// The MoE block of a routed layer, mutably.
    pub fn moe_mut(&mut self) -> Option<&mut SparseMoeBlock<B, R, X>> {
        match self {
            FeedForward::Sparse(moe) => Some(moe),
            FeedForward::Dense(_) => None,
        }
    }

    fn load(&mut self, ckpt: &mut CheckpointReader, prefix: &str, device: &B::Device) -> Result<()> {
        match self {
            FeedForward::Sparse(moe) => moe.load(ckpt, prefix, device),
            FeedForward::Dense(mlp) => mlp.load(ckpt, prefix, device),
        }
    }

    fn save(&self, sink: &mut TensorSink, prefix: &str) {
        match self {
            FeedForward::Sparse(moe) => moe.save(sink, prefix),
            FeedForward::Dense(mlp) => mlp.save(sink, prefix),
        }
    }
}

/// One decoder layer: `x + attn(norm(x))`, then `x + ffn(norm(x))`.
#[derive(Module, Debug)]
pub struct DecoderLayer<B: Backend, A: Module<B>, R: Module<B>, X: Module<B>> {
    /// Norm before attention (`input_layernorm`).
    pub input_layernorm: RmsNorm<B>,
    /// Attention (`self_attn`).
    pub self_attn: A,
    /// Norm before the feed-forward (`post_attention_layernorm`).
    pub post_attention_layernorm: RmsNorm<B>,
    /// Feed-forward (`mlp`; Mixtral: `block_sparse_moe`).
    pub mlp: FeedForward<B, R, X>,
    /// Checkpoint name of the feed-forward module.
    #[module(skip)]
    pub ffn_name: &'static str,
}

impl<B, A, R, X> DecoderLayer<B, A, R, X>
where
    B: Backend,
    A: Module<B> + AttentionLayer<B>,
    R: Module<B> + Router<B>,
    X: Module<B> + Experts<B>,
{
    /// The attention half: `x + attn(norm(x))`, within each document of `docs` when given.
    ///
    /// # Shapes
    /// - x: `[B, S, M]`; cos, sin: `[1, 1, S, rotary dim]` (`[B, 1, S, rotary dim]` when positions
    ///   restart per document); docs over `[B, S]` -> `[B, S, M]`
    pub fn attention_block(
        &self,
        x: Tensor<B, 3>,
        cos: Tensor<B, 4>,
        sin: Tensor<B, 4>,
        docs: Option<&Documents>,
    ) -> Tensor<B, 3> {
        x.clone() + self.self_attn.attend(self.input_layernorm.forward(x), cos, sin, docs)
    }

    /// [`DecoderLayer::attention_block`] of new tokens at positions `past..`, through `cache`.
    ///
    /// # Shapes
    /// - x: `[B, S, M]`; cos, sin: `[1, 1, past + S, rotary dim]` -> `[B, S, M]`
    pub fn attention_block_cached(
        &self,
        x: Tensor<B, 3>,
        cos: Tensor<B, 4>,
        sin: Tensor<B, 4>,
        past: usize,
        cache: &mut LayerCache<B>,
    ) -> Tensor<B, 3> {
        x.clone() + self.self_attn.attend_cached(self.input_layernorm.forward(x), cos, sin, past, cache)
    }

    /// The expert half: `x + ffn(norm(x))`, with router statistics on routed layers.
    ///
    /// # Shapes
    /// - x: `[B, S, M]` -> `[B, S, M]`
    pub fn expert_block(&self, x: Tensor<B, 3>) -> (Tensor<B, 3>, Option<RouterStats<B>>) {
        let (y, stats) = self.mlp.forward(self.post_attention_layernorm.forward(x.clone()));
        (x + y, stats)
    }

    pub(crate) fn load(&mut self, ckpt: &mut CheckpointReader, prefix: &str, device: &B::Device) -> Result<()> {
        self.input_layernorm.load(ckpt, &format!("{prefix}.input_layernorm"), device)?;
        self.self_attn.load_attention(ckpt, &format!("{prefix}.self_attn"), device)?;
        self.post_attention_layernorm.load(ckpt, &format!("{prefix}.post_attention_layernorm"), device)?;
        self.mlp.load(ckpt, &format!("{prefix}.{}", self.ffn_name), device)
    }

    pub(crate) fn save(&self, sink: &mut TensorSink, prefix: &str) {
        self.input_layernorm.save(sink, &format!("{prefix}.input_layernorm"));
        self.self_attn.save_attention(sink, &format!("{prefix}.self_attn"));
        self.post_attention_layernorm.save(sink, &format!("{prefix}.post_attention_layernorm"));
        self.mlp.save(sink, &format!("{prefix}.{}", self.ffn_name));
    }
}

/// The attention type of a family.
pub type FamilyAttention<B, C> = <C as FamilyConfig>::Attention<B>;
/// The feed-forward type of a family.
pub type FamilyFeedForward<B, C> = FeedForward<B, <C as FamilyConfig>::Router<B>, <C as FamilyConfig>::Experts<B>>;
/// One decoder layer of a family.
pub type FamilyLayer<B, C> =
    DecoderLayer<B, <C as FamilyConfig>::Attention<B>, <C as FamilyConfig>::Router<B>, <C as FamilyConfig>::Experts<B>>;
/// The causal LM of a family.
pub type FamilyModel<B, C> =
    CausalLm<B, C, <C as FamilyConfig>::Attention<B>, <C as FamilyConfig>::Router<B>, <C as FamilyConfig>::Experts<B>>;

/// A causal language model: embedding, decoder layers, final norm, head.
///
/// Checkpoint names: `model.embed_tokens.weight`, `model.layers.{i}.input_layernorm.weight`,
/// `model.layers.{i}.self_attn.*`, `model.layers.{i}.post_attention_layernorm.weight`,
/// `model.layers.{i}.mlp.*` (Mixtral: `block_sparse_moe.*`), `model.norm.weight`, `lm_head.weight`
/// (absent when tied).
#[derive(Module, Debug)]
pub struct CausalLm<B: Backend, C, A: Module<B>, R: Module<B>, X: Module<B>> {
    /// `model.embed_tokens`
    pub embed_tokens: Embedding<B>,
    /// `model.layers`
    pub layers: Vec<DecoderLayer<B, A, R, X>>,
    /// `model.norm`
    pub norm: RmsNorm<B>,
    /// `lm_head` (absent when tied to the embedding).
    pub lm_head: Option<Linear<B>>,
    /// The multi-token prediction modules (`model.layers.{L + k - 1}`; none unless the
    /// configuration's [`FamilyConfig::mtp`] asks for them).
    pub mtp: Vec<MtpLayer<B, A, R, X>>,
    #[module(skip)]
    config: C,
    #[module(skip)]
    rope: Rope,
    /// Router z-loss, capacity and forced balance of every MoE layer.
    #[module(skip)]
    routing: RoutingOptions,
}

/// The embedding, final norm and head of a family's model, from `init` (rooted at the model).
pub fn init_ends<B: Backend, C: FamilyConfig>(
    config: &C,
    init: &Init<B>,
) -> (Embedding<B>, RmsNorm<B>, Option<Linear<B>>) {
    let d = config.dims();
    (
        Embedding::new(d.vocab_size, d.hidden_size, d.pad_token_id, &init.child("model.embed_tokens")),
        RmsNorm::new(d.hidden_size, d.rms_norm_eps, &init.child("model.norm")),
        (!d.tie_word_embeddings).then(|| Linear::new(d.hidden_size, d.vocab_size, false, &init.child("lm_head"))),
    )
}

/// The feed-forward block of `layer`, freshly initialised: the experts `experts` (global ids) of a
/// routed layer with its router and (when `with_shared`) its shared experts, or the dense MLP.
pub fn init_feed_forward<B: Backend, C: FamilyConfig>(
    config: &C,
    layer: usize,
    experts: std::ops::Range<usize>,
    with_shared: bool,
    init: &Init<B>,
) -> FamilyFeedForward<B, C> {
    let d = config.dims();
    let init = init.child(format!("model.layers.{layer}.{}", C::FFN_NAME));
    if config.is_sparse_layer(layer) {
        let mut moe =
            SparseMoeBlock::new(config.router(layer, &init), config.experts(layer, experts, &init.child("experts")));
        if with_shared {
            moe.shared_experts = config
                .shared_expert_intermediate()
                .map(|inter| SwiGluMlp::new(d.hidden_size, inter, &init.child("shared_experts")));
        }
        FeedForward::Sparse(moe)
    } else {
        FeedForward::Dense(SwiGluMlp::new(d.hidden_size, d.dense_intermediate_size, &init))
    }
}

/// Decoder layer `layer` of a family, freshly initialised (every expert).
pub fn init_layer<B: Backend, C: FamilyConfig>(config: &C, layer: usize, init: &Init<B>) -> FamilyLayer<B, C> {
    let d = config.dims();
    let prefix = init.child(format!("model.layers.{layer}"));
    DecoderLayer {
        input_layernorm: RmsNorm::new(d.hidden_size, d.rms_norm_eps, &prefix.child("input_layernorm")),
        self_attn: config.attention(layer, &prefix.child("self_attn")),
        post_attention_layernorm: RmsNorm::new(
            d.hidden_size,
            d.rms_norm_eps,
            &prefix.child("post_attention_layernorm"),
        ),
        mlp: init_feed_forward(config, layer, 0..config.routed_experts(), true, init),
        ffn_name: C::FFN_NAME,
    }
}

impl<B: Backend, C: FamilyConfig> FamilyModel<B, C> {
    /// A freshly initialised model: every tensor drawn from (`seed`, its checkpoint name), as
    /// [`Init`] describes, with the family's initialiser spread (`initializer_range`).
    pub fn init(config: C, seed: u64, device: &B::Device) -> Self {
        let std = config.dims().initializer_range;
        Self::new(config, &Init::new(seed, std, device))
    }

    /// A model whose tensors come from `init` (seeded, or placeholders for a checkpoint to fill).
    pub fn new(config: C, init: &Init<B>) -> Self {
        let d = config.dims();
        let (embed_tokens, norm, lm_head) = init_ends(&config, init);
        let layers = (0..d.num_hidden_layers).map(|l| init_layer(&config, l, init)).collect();
        let mtp = init_mtp(&config, init);
        let rope = config.rope();
        Self { embed_tokens, layers, norm, lm_head, mtp, config, rope, routing: RoutingOptions::default() }
    }

    /// The model's configuration.
    pub fn config(&self) -> &C {
        &self.config
    }

    /// Sets the router options (z-loss, capacity, forced balance) of every MoE layer.
    pub fn set_routing(&mut self, routing: RoutingOptions) {
        self.routing = routing;
        for moe in self.layers.iter_mut().filter_map(|l| l.mlp.moe_mut()) {
            moe.routing = routing;
        }
        for m in &mut self.mtp {
            m.set_routing(routing);
        }
    }

    /// The rotary embedding of its attention layers.
    pub fn rope(&self) -> &Rope {
        &self.rope
    }

    /// The router options of its MoE layers.
    pub fn routing(&self) -> RoutingOptions {
        self.routing
    }

    /// Token ids as a `[batch, seq]` tensor, checked against the vocabulary.
    pub fn input_ids(&self, rows: &[Vec<i64>], device: &B::Device) -> Result<Tensor<B, 2, Int>> {
        input_ids(rows, self.config.dims().vocab_size, device)
    }

    /// The forward pass.
    ///
    /// # Shapes
    /// - ids: `[B, S]` -> logits `[B, S, V]`
    pub fn forward(&self, ids: Tensor<B, 2, Int>) -> CausalLmOutput<B> {
        self.forward_documents(ids, None)
    }

    /// The forward pass of packed rows: attention stays within each document of `docs` (when
    /// given), and [`CausalLm::loss`] then ignores the targets that begin another document.
    /// Rotary positions count from each row's start (Megatron's default), or from each document's
    /// when `docs` says so ([`Documents::restarting_positions`]).
    ///
    /// # Shapes
    /// - ids: `[B, S]`; docs over `[B, S]` -> logits `[B, S, V]`
    ///
    /// # Panics
    /// If `docs` is not over `[B, S]` (data loading builds them from the same windows).
    pub fn forward_documents(&self, ids: Tensor<B, 2, Int>, docs: Option<&Documents>) -> CausalLmOutput<B> {
        let [b, s] = ids.dims();
        if let Some(d) = docs {
            assert_eq!([d.batch(), d.seq()], [b, s], "a document mask over the batch's rows");
        }
        let device = ids.device();
        // 1. Embed.
        let mut x = self.embed_tokens.forward(ids.clone()); // [B, S, M]
        let (cos, sin) = self.rope.tables::<B>(s, &device); // [1, 1, S, rotary dim]
        let (cos, sin) = crate::rope::document_tables(cos, sin, docs); // [B or 1, 1, S, rotary dim]

        // 2. (attention block, expert block) pairs.
        let mut router_stats = Vec::new();
        for layer in &self.layers {
            x = layer.attention_block(x, cos.clone(), sin.clone(), docs);
            let (y, stats) = layer.expert_block(x);
            x = y;
            router_stats.extend(stats);
        }
        // 3. Final norm and head.
        let normed = self.norm.forward(x); // [B, S, M]
        let logits = lm_logits(normed.clone(), self.lm_head.as_ref(), &self.embed_tokens); // [B, S, V]

        // 4. The multi-token prediction modules, when trained.
        let mtp = mtp_loss(&self.mtp, normed, ids, &self.embed_tokens, self.lm_head.as_ref(), cos, sin, docs);
        CausalLmOutput { logits, router_stats, mtp, documents: docs.cloned() }
    }

    /// An empty cache for [`CausalLm::forward_cached`].
    pub fn new_cache(&self) -> KvCache<B> {
        KvCache::new(self.layers.len())
    }

    /// The forward pass of new tokens, following the `cache.len` positions `cache` has seen
    /// (which it then holds too): incremental decoding. Equals the last `S` positions of
    /// [`CausalLm::forward`] over the whole sequence.
    ///
    /// # Shapes
    /// - ids: `[B, S]` -> logits `[B, S, V]`
    pub fn forward_cached(&self, ids: Tensor<B, 2, Int>, cache: &mut KvCache<B>) -> Tensor<B, 3> {
        let [_, s] = ids.dims();
        let device = ids.device();
        let past = cache.len;
        let mut x = self.embed_tokens.forward(ids); // [B, S, M]
        let (cos, sin) = self.rope.tables::<B>(past + s, &device); // [1, 1, past + S, rotary dim]
        for (layer, held) in self.layers.iter().zip(cache.layers.iter_mut()) {
            x = layer.attention_block_cached(x, cos.clone(), sin.clone(), past, held);
            x = layer.expert_block(x).0;
        }
        cache.len += s;
        lm_logits(self.norm.forward(x), self.lm_head.as_ref(), &self.embed_tokens)
        // [B, S, V]
    }

    /// Next-token cross-entropy (labels = inputs shifted by one), plus the family's coefficient
    /// times its balance loss when `with_aux` and the family has one, plus the multi-token
    /// prediction loss times its coefficient when the model trains MTP modules.
    pub fn loss(&self, out: &CausalLmOutput<B>, ids: Tensor<B, 2, Int>, with_aux: bool) -> LossParts<B> {
        let mut parts = causal_lm_loss(out, ids, self.config.aux_loss().filter(|_| with_aux), self.routing.z_loss_coef);
        if let Some(mtp) = &out.mtp {
            parts.total = parts.total + mtp.loss.clone().mul_scalar(self.config.mtp().loss_coef);
            parts.mtp_loss = Some(mtp.loss.clone());
        }
        parts
    }

    /// Aux-loss-free balancing: each routed layer's router moves its correction bias from its
    /// expert load of the last step (`counts[i]` for the `i`-th routed layer, the order of
    /// [`CausalLmOutput::router_stats`]). Routers without a correction bias ignore it; returns
    /// whether any router changed.
    ///
    /// The routed blocks of the multi-token prediction modules follow, in depth order
    /// ([`CausalLmOutput::mtp`]'s statistics).
    pub fn update_router_biases(&mut self, counts: &[Vec<usize>], rate: f64) -> Result<bool> {
        let moe_layers = self.layers.iter().filter(|l| l.mlp.moe().is_some()).count()
            + self.mtp.iter().filter(|m| m.block.mlp.moe().is_some()).count();
        if counts.len() != moe_layers {
            return Err(ModelError::InvalidInput(format!(
                "update_router_biases: {} count vectors for {moe_layers} MoE layers",
                counts.len()
            )));
        }
        let mut changed = false;
        let routers = (self.layers.iter_mut().map(|l| &mut l.mlp))
            .chain(self.mtp.iter_mut().map(|m| &mut m.block.mlp))
            .filter_map(|f| f.moe_mut().map(|m| &mut m.gate));
        for (router, c) in routers.zip(counts) {
            changed |= router.update_balance_bias(c, rate)?;
        }
        Ok(changed)
    }

    /// Loads every parameter from a checkpoint by its Hugging Face name.
    pub fn load_weights(&mut self, ckpt: &mut CheckpointReader, device: &B::Device) -> Result<()> {
        self.embed_tokens.load(ckpt, "model.embed_tokens", device)?;
        for (i, layer) in self.layers.iter_mut().enumerate() {
            layer.load(ckpt, &format!("model.layers.{i}"), device)?;
        }
        self.norm.load(ckpt, "model.norm", device)?;
        if let Some(head) = &mut self.lm_head {
            head.load(ckpt, "lm_head", device)?;
        }
        load_mtp(&mut self.mtp, ckpt, &self.embed_tokens, self.lm_head.as_ref(), device)
    }

    /// Puts every parameter into `sink` under its Hugging Face name.
    pub fn save_into(&self, sink: &mut TensorSink) {
        self.embed_tokens.save(sink, "model.embed_tokens");
        for (i, layer) in self.layers.iter().enumerate() {
            layer.save(sink, &format!("model.layers.{i}"));
        }
        self.norm.save(sink, "model.norm");
        if let Some(head) = &self.lm_head {
            head.save(sink, "lm_head");
        }
        save_mtp(&self.mtp, sink, self.lm_head.is_none());
    }
}
