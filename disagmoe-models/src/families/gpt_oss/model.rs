//! What each GPT-OSS layer is made of.

use std::ops::Range;

use burn::tensor::backend::Backend;
use disagmoe_core::model_shape::{ActiveCounting, AttentionShape as ShapeOfAttention, ModelShape, MoeShape, SlidingWindow};

use super::config::{GptOssConfig, LayerType};
use super::experts::{GptOssExperts, GptOssRouter};
use crate::attention::{AttentionOptions, AttentionShape, GqaAttention, QkNorm};
use crate::balance::{AuxLoss, BalanceLoss};
use crate::decoder::FamilyModel;
use crate::error::Result;
use crate::families::{FamilyConfig, ModelDims};
use crate::init::Init;
use crate::rope::Rope;

/// GPT-OSS causal language model.
pub type GptOssForCausalLM<B> = FamilyModel<B, GptOssConfig>;

impl FamilyConfig for GptOssConfig {
    const MODEL_TYPE: &'static str = "gpt_oss";
    type Attention<B: Backend> = GqaAttention<B>;
    type Router<B: Backend> = GptOssRouter<B>;
    type Experts<B: Backend> = GptOssExperts<B>;

    fn from_json_str(text: &str) -> Result<Self> {
        GptOssConfig::from_json_str(text)
    }

    fn to_hf_json(&self) -> serde_json::Value {
        GptOssConfig::to_hf_json(self)
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

    fn rope(&self) -> Rope {
        Rope::new(self.head_dim, self.rope_theta, &self.rope_scaling)
    }

    /// Every GPT-OSS layer is routed.
    fn is_sparse_layer(&self, _layer: usize) -> bool {
        true
    }

    fn routed_experts(&self) -> usize {
        self.num_local_experts
    }

    /// Projection biases and sinks; a window on the sliding layers of `layer_types`.
    fn attention<B: Backend>(&self, layer: usize, init: &Init<B>) -> GqaAttention<B> {
        GqaAttention::new(
            AttentionShape {
                hidden: self.hidden_size,
                heads: self.num_attention_heads,
                kv_heads: self.num_key_value_heads,
                head_dim: self.head_dim,
                window: (self.layer_types[layer] == LayerType::SlidingAttention).then_some(self.sliding_window),
            },
            AttentionOptions { bias: self.attention_bias, qk_norm: QkNorm::None, clip_qkv: None, sinks: true },
            init,
        )
    }

    fn router<B: Backend>(&self, _layer: usize, init: &Init<B>) -> GptOssRouter<B> {
        GptOssRouter::new(self.hidden_size, self.num_local_experts, self.num_experts_per_tok, init)
    }

    fn experts<B: Backend>(&self, _layer: usize, range: Range<usize>, init: &Init<B>) -> GptOssExperts<B> {
        GptOssExperts::new(range, self.hidden_size, self.intermediate_size, self.swiglu_alpha, self.swiglu_limit, init)
    }

    fn aux_loss(&self) -> Option<AuxLoss> {
        Some(AuxLoss { kind: BalanceLoss::Switch, coef: self.router_aux_loss_coef })
    }

    fn aux_loss_by_default(&self) -> bool {
        self.output_router_logits
    }

    fn model_shape(&self, name: &str) -> ModelShape {
        let sliding: Vec<usize> = (0..self.num_hidden_layers)
            .filter(|&l| self.layer_types[l] == LayerType::SlidingAttention)
            .collect();
        let period = match sliding.as_slice() {
            [] => None,
            s if s.len() == self.num_hidden_layers => Some(1),
            [a, b, ..] => Some(b - a),
            [_] => Some(self.num_hidden_layers),
        };
        ModelShape {
            name: name.into(),
            layers: self.num_hidden_layers,
            hidden: self.hidden_size,
            vocab: self.vocab_size,
            tied_embeddings: self.tie_word_embeddings,
            attention: ShapeOfAttention::Gqa {
                heads: self.num_attention_heads,
                kv_heads: self.num_key_value_heads,
                head_dim: self.head_dim,
                bias: self.attention_bias,
                qk_norm: false,
                sinks: true,
            },
            sliding_window: period.map(|period| SlidingWindow { window: self.sliding_window, period }),
            moe: MoeShape {
                experts: self.num_local_experts,
                top_k: self.num_experts_per_tok,
                intermediate: self.intermediate_size,
                shared_experts: 0,
                expert_bias: true,
                router_bias: true,
            },
            dense_layers: vec![],
            dense_intermediate: 0,
            active_counting: ActiveCounting::HeadOnly,
        }
    }
}
