//! The shape every family shares, written once: a causal LM is an embedding, a stack of
//! (attention block, expert block) pairs with pre-norms and residuals, a final norm and a head.
//!
//! Families differ only in the attention layer ([`AttentionLayer`]: GQA with or without q/k norms
//! and sinks, MLA), the feed-forward layer ([`FeedForwardLayer`]: routed experts of some router and
//! expert type, or a dense MLP) and their configuration ([`FamilyConfig`]). A family is therefore a
//! type alias of [`CausalLm`] plus a config type that knows how to build it.

use std::path::Path;

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

use crate::attention::GqaAttention;
use crate::causal_lm::{causal_lm_loss, input_ids, lm_logits, CausalLmOutput, HfCheckpoint, LossParts};
use crate::error::Result;
use crate::moe::{Experts, Router, RouterStats, SparseMoeBlock, SwiGluMlp};
use crate::nn::{Embedding, Linear, RmsNorm};
use crate::rope::Rope;
use crate::weights::{CheckpointReader, TensorSink};

/// A self-attention layer of a decoder.
pub trait AttentionLayer<B: Backend> {
    /// # Shapes
    /// - x: `[B, S, M]`; cos, sin: `[1, 1, S, rotary dim]` -> `[B, S, M]`
    fn attend(&self, x: Tensor<B, 3>, cos: Tensor<B, 4>, sin: Tensor<B, 4>) -> Tensor<B, 3>;
    /// Loads the layer's weights under `prefix` (e.g. `model.layers.3.self_attn`).
    fn load_attention(&mut self, ckpt: &mut CheckpointReader, prefix: &str, device: &B::Device) -> Result<()>;
    /// Saves them under the names it loads.
    fn save_attention(&self, sink: &mut TensorSink, prefix: &str);
}

/// The feed-forward (expert) layer of a decoder.
pub trait FeedForwardLayer<B: Backend> {
    /// # Shapes
    /// - x: `[B, S, M]` -> `[B, S, M]`, plus router statistics when the layer routes
    fn feed_forward(&self, x: Tensor<B, 3>) -> (Tensor<B, 3>, Option<RouterStats<B>>);
    /// Loads the layer's weights under `prefix` (e.g. `model.layers.3.mlp`).
    fn load_feed_forward(&mut self, ckpt: &mut CheckpointReader, prefix: &str, device: &B::Device) -> Result<()>;
    /// Saves them under the names it loads.
    fn save_feed_forward(&self, sink: &mut TensorSink, prefix: &str);
}

impl<B: Backend> AttentionLayer<B> for GqaAttention<B> {
    fn attend(&self, x: Tensor<B, 3>, cos: Tensor<B, 4>, sin: Tensor<B, 4>) -> Tensor<B, 3> {
        self.forward(x, cos, sin)
    }
    fn load_attention(&mut self, ckpt: &mut CheckpointReader, prefix: &str, device: &B::Device) -> Result<()> {
        self.load(ckpt, prefix, device)
    }
    fn save_attention(&self, sink: &mut TensorSink, prefix: &str) {
        self.save(sink, prefix)
    }
}

impl<B: Backend, R: Module<B> + Router<B>, X: Module<B> + Experts<B>> FeedForwardLayer<B> for SparseMoeBlock<B, R, X> {
    fn feed_forward(&self, x: Tensor<B, 3>) -> (Tensor<B, 3>, Option<RouterStats<B>>) {
        let (y, stats) = self.forward(x);
        (y, Some(stats))
    }
    fn load_feed_forward(&mut self, ckpt: &mut CheckpointReader, prefix: &str, device: &B::Device) -> Result<()> {
        self.load(ckpt, prefix, device)
    }
    fn save_feed_forward(&self, sink: &mut TensorSink, prefix: &str) {
        self.save(sink, prefix)
    }
}

/// Routed experts on sparse layers, a dense SwiGLU MLP on the others (`mlp_only_layers`,
/// `decoder_sparse_step`, `first_k_dense_replace`). Both live under `{prefix}` = `...mlp`.
#[derive(Module, Debug)]
pub struct FeedForward<B: Backend, R: Module<B>, X: Module<B>> {
    /// Present on sparse layers.
    pub moe: Option<SparseMoeBlock<B, R, X>>,
    /// Present on dense layers.
    pub dense: Option<SwiGluMlp<B>>,
}

impl<B: Backend, R: Module<B> + Router<B>, X: Module<B> + Experts<B>> FeedForward<B, R, X> {
    /// A sparse layer.
    pub fn sparse(moe: SparseMoeBlock<B, R, X>) -> Self {
        Self { moe: Some(moe), dense: None }
    }

    /// A dense layer.
    pub fn dense(mlp: SwiGluMlp<B>) -> Self {
        Self { moe: None, dense: Some(mlp) }
    }
}

impl<B: Backend, R: Module<B> + Router<B>, X: Module<B> + Experts<B>> FeedForwardLayer<B> for FeedForward<B, R, X> {
    fn feed_forward(&self, x: Tensor<B, 3>) -> (Tensor<B, 3>, Option<RouterStats<B>>) {
        match (&self.moe, &self.dense) {
            (Some(moe), _) => moe.feed_forward(x),
            (None, Some(mlp)) => (mlp.forward(x), None),
            (None, None) => unreachable!("a feed-forward block is sparse or dense"),
        }
    }
    fn load_feed_forward(&mut self, ckpt: &mut CheckpointReader, prefix: &str, device: &B::Device) -> Result<()> {
        match (&mut self.moe, &mut self.dense) {
            (Some(moe), _) => moe.load(ckpt, prefix, device),
            (None, Some(mlp)) => mlp.load(ckpt, prefix, device),
            (None, None) => Ok(()),
        }
    }
    fn save_feed_forward(&self, sink: &mut TensorSink, prefix: &str) {
        if let Some(moe) = &self.moe {
            moe.save(sink, prefix);
        }
        if let Some(mlp) = &self.dense {
            mlp.save(sink, prefix);
        }
    }
}

/// One decoder layer: `x + attn(norm(x))`, then `x + ffn(norm(x))`.
#[derive(Module, Debug)]
pub struct DecoderLayer<B: Backend, A: Module<B>, F: Module<B>> {
    /// Norm before attention (`input_layernorm`).
    pub input_layernorm: RmsNorm<B>,
    /// Attention (`self_attn`).
    pub self_attn: A,
    /// Norm before the feed-forward (`post_attention_layernorm`).
    pub post_attention_layernorm: RmsNorm<B>,
    /// Feed-forward (`mlp`).
    pub mlp: F,
}

impl<B: Backend, A: Module<B> + AttentionLayer<B>, F: Module<B> + FeedForwardLayer<B>> DecoderLayer<B, A, F> {
    /// A layer of width `hidden` around an attention and a feed-forward layer.
    pub fn new(hidden: usize, eps: f64, self_attn: A, mlp: F, device: &B::Device) -> Self {
        Self {
            input_layernorm: RmsNorm::new(hidden, eps, device),
            self_attn,
            post_attention_layernorm: RmsNorm::new(hidden, eps, device),
            mlp,
        }
    }

    /// The attention half: `x + attn(norm(x))`.
    ///
    /// # Shapes
    /// - x: `[B, S, M]`; cos, sin: `[1, 1, S, rotary dim]` -> `[B, S, M]`
    pub fn attention_block(&self, x: Tensor<B, 3>, cos: Tensor<B, 4>, sin: Tensor<B, 4>) -> Tensor<B, 3> {
        x.clone() + self.self_attn.attend(self.input_layernorm.forward(x), cos, sin)
    }

    /// The expert half: `x + ffn(norm(x))`, with router statistics on routed layers.
    ///
    /// # Shapes
    /// - x: `[B, S, M]` -> `[B, S, M]`
    pub fn expert_block(&self, x: Tensor<B, 3>) -> (Tensor<B, 3>, Option<RouterStats<B>>) {
        let (y, stats) = self.mlp.feed_forward(self.post_attention_layernorm.forward(x.clone()));
        (x + y, stats)
    }

    fn load(&mut self, ckpt: &mut CheckpointReader, prefix: &str, device: &B::Device) -> Result<()> {
        self.input_layernorm.load(ckpt, &format!("{prefix}.input_layernorm"), device)?;
        self.self_attn.load_attention(ckpt, &format!("{prefix}.self_attn"), device)?;
        self.post_attention_layernorm.load(ckpt, &format!("{prefix}.post_attention_layernorm"), device)?;
        self.mlp.load_feed_forward(ckpt, &format!("{prefix}.mlp"), device)
    }

    fn save(&self, sink: &mut TensorSink, prefix: &str) {
        self.input_layernorm.save(sink, &format!("{prefix}.input_layernorm"));
        self.self_attn.save_attention(sink, &format!("{prefix}.self_attn"));
        self.post_attention_layernorm.save(sink, &format!("{prefix}.post_attention_layernorm"));
        self.mlp.save_feed_forward(sink, &format!("{prefix}.mlp"));
    }
}

/// What a family's configuration provides to the shared model.
pub trait FamilyConfig: Clone + std::fmt::Debug + Send + Sync + 'static {
    /// The family's model type on a backend.
    type Model<B: Backend>;
    /// Reads and validates a `config.json`.
    fn from_file(path: &Path) -> Result<Self>;
    /// A freshly initialised model, as transformers initialises it.
    fn init<B: Backend>(&self, device: &B::Device) -> Self::Model<B>;
    /// The configuration as transformers writes `config.json`.
    fn to_hf_json(&self) -> serde_json::Value;
    /// Vocabulary size.
    fn vocab_size(&self) -> usize;
    /// Coefficient of the load-balancing loss, or `None` when the family has none.
    fn aux_loss_coef(&self) -> Option<f64>;
    /// Reports checkpoint tensors the model did not read (default: one warning).
    fn report_unused(&self, unused: Vec<String>) {
        if let Some(first) = unused.first() {
            tracing::warn!(count = unused.len(), first = %first, "checkpoint tensors not used by the model");
        }
    }
}

/// A causal language model: embedding, decoder layers, final norm, head.
///
/// Checkpoint names: `model.embed_tokens.weight`, `model.layers.{i}.input_layernorm.weight`,
/// `model.layers.{i}.self_attn.*`, `model.layers.{i}.post_attention_layernorm.weight`,
/// `model.layers.{i}.mlp.*`, `model.norm.weight`, `lm_head.weight` (absent when tied).
#[derive(Module, Debug)]
pub struct CausalLm<B: Backend, C, A: Module<B>, F: Module<B>> {
    /// `model.embed_tokens`
    pub embed_tokens: Embedding<B>,
    /// `model.layers`
    pub layers: Vec<DecoderLayer<B, A, F>>,
    /// `model.norm`
    pub norm: RmsNorm<B>,
    /// `lm_head` (absent when tied to the embedding).
    pub lm_head: Option<Linear<B>>,
    #[module(skip)]
    config: C,
    #[module(skip)]
    rope: Rope,
}

impl<B: Backend, C, A: Module<B>, F: Module<B>> CausalLm<B, C, A, F>
where
    C: FamilyConfig,
    A: AttentionLayer<B>,
    F: FeedForwardLayer<B>,
{
    /// Assembles a model; `tied` drops the separate head.
    pub fn assemble(
        config: C,
        rope: Rope,
        (vocab, hidden, eps, std, tied): (usize, usize, f64, f64, bool),
        layers: Vec<DecoderLayer<B, A, F>>,
        device: &B::Device,
    ) -> Self {
        Self {
            embed_tokens: Embedding::new(vocab, hidden, std, device),
            layers,
            norm: RmsNorm::new(hidden, eps, device),
            lm_head: (!tied).then(|| Linear::new(hidden, vocab, false, std, device)),
            config,
            rope,
        }
    }

    /// The model's configuration.
    pub fn config(&self) -> &C {
        &self.config
    }

    /// The rotary embedding of its attention layers.
    pub fn rope(&self) -> &Rope {
        &self.rope
    }

    /// Token ids as a `[batch, seq]` tensor, checked against the vocabulary.
    pub fn input_ids(&self, rows: &[Vec<i64>], device: &B::Device) -> Result<Tensor<B, 2, Int>> {
        input_ids(rows, self.config.vocab_size(), device)
    }

    /// The forward pass.
    ///
    /// # Shapes
    /// - ids: `[B, S]` -> logits `[B, S, V]`
    pub fn forward(&self, ids: Tensor<B, 2, Int>) -> CausalLmOutput<B> {
        let [_, s] = ids.dims();
        let device = ids.device();
        // 1. Embed.
        let mut x = self.embed_tokens.forward(ids); // [B, S, M]
        let (cos, sin) = self.rope.tables::<B>(s, &device); // [1, 1, S, rotary dim]
                                                            // 2. (attention block, expert block) pairs.
        let mut router_stats = Vec::new();
        for layer in &self.layers {
            x = layer.attention_block(x, cos.clone(), sin.clone());
            let (y, stats) = layer.expert_block(x);
            x = y;
            router_stats.extend(stats);
        }
        // 3. Final norm and head.
        let logits = lm_logits(self.norm.forward(x), self.lm_head.as_ref(), &self.embed_tokens); // [B, S, V]
        CausalLmOutput { logits, router_stats }
    }

    /// Next-token cross-entropy (labels = inputs shifted by one), plus the family's coefficient
    /// times the load-balancing loss when `with_aux` and the family has one.
    pub fn loss(&self, out: &CausalLmOutput<B>, ids: Tensor<B, 2, Int>, with_aux: bool) -> LossParts<B> {
        let coef = self.config.aux_loss_coef();
        causal_lm_loss(out, ids, with_aux && coef.is_some(), coef.unwrap_or(0.0))
    }
}

impl<B: Backend, C, A: Module<B>, F: Module<B>> HfCheckpoint<B> for CausalLm<B, C, A, F>
where
    C: FamilyConfig<Model<B> = Self>,
    A: AttentionLayer<B>,
    F: FeedForwardLayer<B>,
{
    fn init_from_config(path: &Path, device: &B::Device) -> Result<Self> {
        Ok(C::from_file(path)?.init::<B>(device))
    }

    fn hf_config(&self) -> serde_json::Value {
        self.config.to_hf_json()
    }

    fn load_weights(&mut self, ckpt: &mut CheckpointReader, device: &B::Device) -> Result<()> {
        self.embed_tokens.load(ckpt, "model.embed_tokens", device)?;
        for (i, layer) in self.layers.iter_mut().enumerate() {
            layer.load(ckpt, &format!("model.layers.{i}"), device)?;
        }
        self.norm.load(ckpt, "model.norm", device)?;
        if let Some(head) = &mut self.lm_head {
            head.load(ckpt, "lm_head", device)?;
        }
        Ok(())
    }

    fn save_into(&self, sink: &mut TensorSink) {
        self.embed_tokens.save(sink, "model.embed_tokens");
        for (i, layer) in self.layers.iter().enumerate() {
            layer.save(sink, &format!("model.layers.{i}"));
        }
        self.norm.save(sink, "model.norm");
        if let Some(head) = &self.lm_head {
            head.save(sink, "lm_head");
        }
    }

    fn report_unused(&self, unused: Vec<String>) {
        self.config.report_unused(unused)
    }
}
