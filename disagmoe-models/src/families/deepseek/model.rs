//! What each DeepSeekMoE layer is made of.

use std::ops::Range;

use burn::tensor::backend::Backend;
use disagmoe_core::model_shape::{AttentionShape as ShapeOfAttention, ModelShape, MoeShape};

use super::config::DeepseekConfig;
use crate::attention::{AttentionOptions, AttentionShape, GqaAttention};
use crate::balance::{AuxLoss, BalanceLoss};
use crate::decoder::FamilyModel;
use crate::error::Result;
use crate::families::{FamilyConfig, ModelDims};
use crate::init::Init;
use crate::moe::{ExpertNames, SwiGluExperts, TopKRouter};
use crate::rope::Rope;

/// DeepSeekMoE causal language model.
pub type DeepseekForCausalLM<B> = FamilyModel<B, DeepseekConfig>;

impl FamilyConfig for DeepseekConfig {
    const MODEL_TYPE: &'static str = "deepseek";
    type Attention<B: Backend> = GqaAttention<B>;
    type Router<B: Backend> = TopKRouter<B>;
    type Experts<B: Backend> = SwiGluExperts<B>;

    fn from_json_str(text: &str) -> Result<Self> {
        DeepseekConfig::from_json_str(text)
    }

    fn to_hf_json(&self) -> serde_json::Value {
        DeepseekConfig::to_hf_json(self)
    }

    fn max_positions(&self) -> Option<usize> {
        Some(self.max_position_embeddings)
    }

    fn dims(&self) -> ModelDims {
        ModelDims {
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            num_hidden_layers: self.num_hidden_layers,
            dense_intermediate_size: self.intermediate_size,
            rms_norm_eps: self.rms_norm_eps,
            initializer_range: self.initializer_range,
            tie_word_embeddings: self.tie_word_embeddings,
            pad_token_id: self.pad_token_id,
        }
    }

    /// Llama's `rotate_half` RoPE over the whole head.
    fn rope(&self) -> Rope {
        Rope::new(self.hidden_size / self.num_attention_heads, self.rope_theta, &self.rope_scaling)
    }

    fn is_sparse_layer(&self, layer: usize) -> bool {
        DeepseekConfig::is_sparse_layer(self, layer)
    }

    fn routed_experts(&self) -> usize {
        self.n_routed_experts.unwrap_or(0)
    }

    fn shared_expert_intermediate(&self) -> Option<usize> {
        (self.n_shared_experts > 0).then_some(self.moe_intermediate_size * self.n_shared_experts)
    }

    /// Plain (Llama-style) attention, GQA when `num_key_value_heads` says so.
    fn attention<B: Backend>(&self, _layer: usize, init: &Init<B>) -> GqaAttention<B> {
        GqaAttention::new(
            AttentionShape {
                hidden: self.hidden_size,
                heads: self.num_attention_heads,
                kv_heads: self.num_key_value_heads,
                head_dim: self.hidden_size / self.num_attention_heads,
                window: None,
            },
            AttentionOptions { bias: self.attention_bias, ..AttentionOptions::plain() },
            init,
        )
    }

    /// Softmax over the routed experts, top-k; renormalised only when `norm_topk_prob` and `k > 1`.
    fn router<B: Backend>(&self, _layer: usize, init: &Init<B>) -> TopKRouter<B> {
        let k = self.num_experts_per_tok;
        TopKRouter::new(self.hidden_size, self.routed_experts(), k, self.norm_topk_prob && k > 1, init)
    }

    fn experts<B: Backend>(&self, _layer: usize, range: Range<usize>, init: &Init<B>) -> SwiGluExperts<B> {
        SwiGluExperts::new(range, self.hidden_size, self.moe_intermediate_size, ExpertNames::HF, init)
    }

    /// DeepSeekMoE's per-layer expert balance loss, weighted by `aux_loss_alpha`.
    fn aux_loss(&self) -> Option<AuxLoss> {
        Some(AuxLoss { kind: BalanceLoss::DeepSeek { seq_aux: self.seq_aux }, coef: self.aux_loss_alpha })
    }

    /// DeepSeek's model adds it in training whenever `aux_loss_alpha > 0`.
    fn aux_loss_by_default(&self) -> bool {
        self.aux_loss_alpha > 0.0
    }

    fn model_shape(&self, name: &str) -> ModelShape {
        let heads = self.num_attention_heads;
        ModelShape {
            name: name.into(),
            layers: self.num_hidden_layers,
            hidden: self.hidden_size,
            vocab: self.vocab_size,
            tied_embeddings: self.tie_word_embeddings,
            attention: ShapeOfAttention::Gqa {
                heads,
                kv_heads: self.num_key_value_heads,
                head_dim: self.hidden_size / heads,
                bias: self.attention_bias,
                qk_norm: false,
                sinks: false,
            },
            sliding_window: None,
            moe: MoeShape {
                experts: self.routed_experts(),
                top_k: self.num_experts_per_tok,
                intermediate: self.moe_intermediate_size,
                shared_experts: self.n_shared_experts,
                expert_bias: false,
                router_bias: false,
            },
            dense_layers: (0..self.num_hidden_layers).filter(|&l| !self.is_sparse_layer(l)).collect(),
            dense_intermediate: self.intermediate_size,
            active_counting: Default::default(),
        }
    }
}
