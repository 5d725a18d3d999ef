//! Qwen3-MoE (`Qwen3MoeForCausalLM` in transformers), natively in Burn.
//!
//! A model is a sequence of (attention block, expert block) pairs plus embedding and head; it knows
//! nothing about devices, ranks or transports.
//!
//! Checkpoint names: `model.embed_tokens.weight`, `model.layers.{i}.input_layernorm.weight`,
//! `model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `model.layers.{i}.self_attn.{q,k}_norm.weight`,
//! `model.layers.{i}.post_attention_layernorm.weight`, `model.layers.{i}.mlp.gate.weight`,
//! `model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight` (sparse layers) or
//! `model.layers.{i}.mlp.{gate,up,down}_proj.weight` (dense layers), `model.norm.weight`,
//! `lm_head.weight` (absent when tied).

use std::path::Path;

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

use crate::attention::{AttentionOptions, AttentionShape, GqaAttention};
use crate::config::Qwen3MoeConfig;
use crate::causal_lm::{causal_lm_loss, input_ids, lm_logits, load_stack, save_stack, HfCheckpoint};
pub use crate::causal_lm::{next_token_cross_entropy, CausalLmOutput, LossParts};
use crate::error::Result;
use crate::moe::{RouterStats, SparseMoeBlock, SwiGluExperts, SwiGluMlp, TopKRouter};
use crate::nn::{Embedding, Linear, RmsNorm};
use crate::rope::Rope;
use crate::weights::{CheckpointReader, TensorSink};

/// The expert block of one layer: routed experts, or a dense MLP where the config asks for one.
#[derive(Module, Debug)]
pub struct FeedForward<B: Backend> {
    /// Present on sparse layers.
    pub moe: Option<SparseMoeBlock<B, TopKRouter<B>, SwiGluExperts<B>>>,
    /// Present on dense layers (`mlp_only_layers`, or off the `decoder_sparse_step`).
    pub dense: Option<SwiGluMlp<B>>,
}

impl<B: Backend> FeedForward<B> {
    /// # Shapes
    /// - x: `[B, S, M]` -> `[B, S, M]`, plus router statistics on sparse layers
    pub fn forward(&self, x: Tensor<B, 3>) -> (Tensor<B, 3>, Option<RouterStats<B>>) {
        match (&self.moe, &self.dense) {
            (Some(moe), _) => {
                let (y, stats) = moe.forward(x);
                (y, Some(stats))
            }
            (None, Some(mlp)) => (mlp.forward(x), None),
            (None, None) => unreachable!("a feed-forward block is sparse or dense"),
        }
    }
}

/// One decoder layer: pre-norm attention and pre-norm feed-forward, each with a residual.
#[derive(Module, Debug)]
pub struct Qwen3MoeDecoderLayer<B: Backend> {
    /// Norm before attention.
    pub input_layernorm: RmsNorm<B>,
    /// Attention block.
    pub self_attn: GqaAttention<B>,
    /// Norm before the feed-forward.
    pub post_attention_layernorm: RmsNorm<B>,
    /// Expert block.
    pub mlp: FeedForward<B>,
}

impl<B: Backend> Qwen3MoeDecoderLayer<B> {
    fn new(config: &Qwen3MoeConfig, layer: usize, device: &B::Device) -> Self {
        let std = config.initializer_range;
        let shape = AttentionShape {
            hidden: config.hidden_size,
            heads: config.num_attention_heads,
            kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
            window: config.layer_window(layer),
        };
        let mlp = if config.is_sparse_layer(layer) {
            FeedForward {
                moe: Some(SparseMoeBlock::new(
                    TopKRouter::new(
                        config.hidden_size,
                        config.num_experts,
                        config.num_experts_per_tok,
                        config.norm_topk_prob,
                        std,
                        device,
                    ),
                    SwiGluExperts::new(config.num_experts, config.hidden_size, config.moe_intermediate_size, std, device),
                )),
                dense: None,
            }
        } else {
            FeedForward { moe: None, dense: Some(SwiGluMlp::new(config.hidden_size, config.intermediate_size, std, device)) }
        };
        Self {
            input_layernorm: RmsNorm::new(config.hidden_size, config.rms_norm_eps, device),
            self_attn: GqaAttention::new(
                shape,
                AttentionOptions { bias: config.attention_bias, qk_norm_eps: Some(config.rms_norm_eps), sinks: false },
                std,
                device,
            ),
            post_attention_layernorm: RmsNorm::new(config.hidden_size, config.rms_norm_eps, device),
            mlp,
        }
    }

    /// The attention half: `x + attn(norm(x))`.
    ///
    /// # Shapes
    /// - x: `[B, S, M]`; cos, sin: `[1, 1, S, D]` -> `[B, S, M]`
    pub fn attention_block(&self, x: Tensor<B, 3>, cos: Tensor<B, 4>, sin: Tensor<B, 4>) -> Tensor<B, 3> {
        x.clone() + self.self_attn.forward(self.input_layernorm.forward(x), cos, sin)
    }

    /// The expert half: `x + ffn(norm(x))`.
    ///
    /// # Shapes
    /// - x: `[B, S, M]` -> `[B, S, M]`
    pub fn expert_block(&self, x: Tensor<B, 3>) -> (Tensor<B, 3>, Option<RouterStats<B>>) {
        let (y, stats) = self.mlp.forward(self.post_attention_layernorm.forward(x.clone()));
        (x + y, stats)
    }

    fn load(&mut self, ckpt: &mut CheckpointReader, prefix: &str, device: &B::Device) -> Result<()> {
        self.input_layernorm.load(ckpt, &format!("{prefix}.input_layernorm"), device)?;
        self.self_attn.load(ckpt, &format!("{prefix}.self_attn"), device)?;
        self.post_attention_layernorm.load(ckpt, &format!("{prefix}.post_attention_layernorm"), device)?;
        match (&mut self.mlp.moe, &mut self.mlp.dense) {
            (Some(moe), _) => moe.load(ckpt, &format!("{prefix}.mlp"), device),
            (None, Some(mlp)) => mlp.load(ckpt, &format!("{prefix}.mlp"), device),
            (None, None) => Ok(()),
        }
    }

    fn save(&self, sink: &mut TensorSink, prefix: &str) {
        self.input_layernorm.save(sink, &format!("{prefix}.input_layernorm"));
        self.self_attn.save(sink, &format!("{prefix}.self_attn"));
        self.post_attention_layernorm.save(sink, &format!("{prefix}.post_attention_layernorm"));
        if let Some(moe) = &self.mlp.moe {
            moe.save(sink, &format!("{prefix}.mlp"));
        }
        if let Some(mlp) = &self.mlp.dense {
            mlp.save(sink, &format!("{prefix}.mlp"));
        }
    }
}

/// Qwen3-MoE causal language model.
#[derive(Module, Debug)]
pub struct Qwen3MoeForCausalLM<B: Backend> {
    /// `model.embed_tokens`
    pub embed_tokens: Embedding<B>,
    /// `model.layers`
    pub layers: Vec<Qwen3MoeDecoderLayer<B>>,
    /// `model.norm`
    pub norm: RmsNorm<B>,
    /// `lm_head` (absent when tied to the embedding).
    pub lm_head: Option<Linear<B>>,
    #[module(skip)]
    config: Qwen3MoeConfig,
    #[module(skip)]
    rope: Rope,
}

impl Qwen3MoeConfig {
    /// A freshly initialised model (normal(0, `initializer_range`) weights, norms at one), as
    /// transformers initialises it.
    pub fn init<B: Backend>(&self, device: &B::Device) -> Qwen3MoeForCausalLM<B> {
        let std = self.initializer_range;
        Qwen3MoeForCausalLM {
            embed_tokens: Embedding::new(self.vocab_size, self.hidden_size, std, device),
            layers: (0..self.num_hidden_layers).map(|l| Qwen3MoeDecoderLayer::new(self, l, device)).collect(),
            norm: RmsNorm::new(self.hidden_size, self.rms_norm_eps, device),
            lm_head: (!self.tie_word_embeddings).then(|| Linear::new(self.hidden_size, self.vocab_size, false, std, device)),
            config: self.clone(),
            rope: Rope::new(self.head_dim, self.rope_theta, &self.rope_scaling),
        }
    }
}

impl<B: Backend> HfCheckpoint<B> for Qwen3MoeForCausalLM<B> {
    fn init_from_config(path: &Path, device: &B::Device) -> Result<Self> {
        Ok(Qwen3MoeConfig::from_file(path)?.init(device))
    }

    fn hf_config(&self) -> serde_json::Value {
        self.config.to_hf_json()
    }

    fn load_weights(&mut self, ckpt: &mut CheckpointReader, device: &B::Device) -> Result<()> {
        let stack = (&mut self.embed_tokens, self.layers.as_mut_slice(), &mut self.norm, self.lm_head.as_mut());
        load_stack(stack, ckpt, device, |layer, ckpt, prefix| layer.load(ckpt, prefix, device))
    }

    fn save_into(&self, sink: &mut TensorSink) {
        let stack = (&self.embed_tokens, self.layers.as_slice(), &self.norm, self.lm_head.as_ref());
        save_stack(stack, sink, |layer, sink, prefix| layer.save(sink, prefix));
    }
}

impl<B: Backend> Qwen3MoeForCausalLM<B> {
    /// The model's configuration.
    pub fn config(&self) -> &Qwen3MoeConfig {
        &self.config
    }

    /// Token ids as a `[batch, seq]` tensor, checked against the vocabulary.
    pub fn input_ids(&self, rows: &[Vec<i64>], device: &B::Device) -> Result<Tensor<B, 2, Int>> {
        input_ids(rows, self.config.vocab_size, device)
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
        let (cos, sin) = self.rope.tables::<B>(s, &device); // [1, 1, S, D]
        // 2. (attention block, expert block) pairs.
        let mut router_stats = Vec::new();
        for layer in &self.layers {
            x = layer.attention_block(x, cos.clone(), sin.clone());
            let (y, stats) = layer.expert_block(x);
            x = y;
            router_stats.extend(stats);
        }
        // 3. Final norm and head.
        let x = self.norm.forward(x);
        let logits = lm_logits(x, self.lm_head.as_ref(), &self.embed_tokens);
        CausalLmOutput { logits, router_stats }
    }

    /// The training loss of a forward pass over `ids`: next-token cross-entropy (labels = inputs
    /// shifted by one) plus `router_aux_loss_coef` times the load-balancing loss when `with_aux`.
    pub fn loss(&self, out: &CausalLmOutput<B>, ids: Tensor<B, 2, Int>, with_aux: bool) -> LossParts<B> {
        causal_lm_loss(out, ids, with_aux, self.config.router_aux_loss_coef)
    }
}
