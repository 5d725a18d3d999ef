//! Qwen3-MoE (`Qwen3MoeForCausalLM` in transformers), natively in Burn: the shared decoder
//! ([`crate::decoder`]) with GQA attention that normalises q and k per head before RoPE, and
//! softmax-then-top-k routed SwiGLU experts (dense SwiGLU layers where the config asks for them).
//!
//! Checkpoint names: `model.embed_tokens.weight`, `model.layers.{i}.input_layernorm.weight`,
//! `model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `model.layers.{i}.self_attn.{q,k}_norm.weight`,
//! `model.layers.{i}.post_attention_layernorm.weight`, `model.layers.{i}.mlp.gate.weight`,
//! `model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight` (sparse layers) or
//! `model.layers.{i}.mlp.{gate,up,down}_proj.weight` (dense layers), `model.norm.weight`,
//! `lm_head.weight` (absent when tied).

use std::path::Path;

use burn::tensor::backend::Backend;

use crate::attention::{AttentionOptions, AttentionShape, GqaAttention};
pub use crate::causal_lm::{next_token_cross_entropy, CausalLmOutput, LossParts};
use crate::config::Qwen3MoeConfig;
use crate::decoder::{CausalLm, DecoderLayer, FamilyConfig, FeedForward};
use crate::error::Result;
use crate::moe::{SparseMoeBlock, SwiGluExperts, SwiGluMlp, TopKRouter};
use crate::rope::Rope;

/// The expert block of a Qwen3-MoE layer.
pub type Qwen3MoeFeedForward<B> = FeedForward<B, TopKRouter<B>, SwiGluExperts<B>>;
/// One Qwen3-MoE decoder layer.
pub type Qwen3MoeDecoderLayer<B> = DecoderLayer<B, GqaAttention<B>, Qwen3MoeFeedForward<B>>;
/// Qwen3-MoE causal language model.
pub type Qwen3MoeForCausalLM<B> = CausalLm<B, Qwen3MoeConfig, GqaAttention<B>, Qwen3MoeFeedForward<B>>;

impl Qwen3MoeConfig {
    fn layer<B: Backend>(&self, layer: usize, device: &B::Device) -> Qwen3MoeDecoderLayer<B> {
        let std = self.initializer_range;
        let attention = GqaAttention::new(
            AttentionShape {
                hidden: self.hidden_size,
                heads: self.num_attention_heads,
                kv_heads: self.num_key_value_heads,
                head_dim: self.head_dim,
                window: self.layer_window(layer),
            },
            AttentionOptions { bias: self.attention_bias, qk_norm_eps: Some(self.rms_norm_eps), sinks: false },
            std,
            device,
        );
        let mlp = if self.is_sparse_layer(layer) {
            FeedForward::sparse(SparseMoeBlock::new(
                TopKRouter::new(
                    self.hidden_size,
                    self.num_experts,
                    self.num_experts_per_tok,
                    self.norm_topk_prob,
                    std,
                    device,
                ),
                SwiGluExperts::new(self.num_experts, self.hidden_size, self.moe_intermediate_size, std, device),
            ))
        } else {
            FeedForward::dense(SwiGluMlp::new(self.hidden_size, self.intermediate_size, std, device))
        };
        DecoderLayer::new(self.hidden_size, self.rms_norm_eps, attention, mlp, device)
    }
}

impl FamilyConfig for Qwen3MoeConfig {
    type Model<B: Backend> = Qwen3MoeForCausalLM<B>;

    fn from_file(path: &Path) -> Result<Self> {
        Qwen3MoeConfig::from_file(path)
    }

    /// Normal(0, `initializer_range`) weights, norms at one, as transformers initialises them.
    fn init<B: Backend>(&self, device: &B::Device) -> Qwen3MoeForCausalLM<B> {
        let layers = (0..self.num_hidden_layers).map(|l| self.layer(l, device)).collect();
        let dims =
            (self.vocab_size, self.hidden_size, self.rms_norm_eps, self.initializer_range, self.tie_word_embeddings);
        CausalLm::assemble(
            self.clone(),
            Rope::new(self.head_dim, self.rope_theta, &self.rope_scaling),
            dims,
            layers,
            device,
        )
    }

    fn to_hf_json(&self) -> serde_json::Value {
        Qwen3MoeConfig::to_hf_json(self)
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn aux_loss_coef(&self) -> Option<f64> {
        Some(self.router_aux_loss_coef)
    }
}
