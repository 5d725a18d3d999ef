//! What each Mixtral layer is made of.

use std::ops::Range;

use burn::tensor::backend::Backend;
use disagmoe_core::model_shape::{AttentionShape as ShapeOfAttention, ModelShape, MoeShape};

use super::config::MixtralConfig;
use crate::attention::{AttentionOptions, AttentionShape, GqaAttention};
use crate::balance::{AuxLoss, BalanceLoss};
use crate::decoder::FamilyModel;
use crate::error::Result;
use crate::families::{FamilyConfig, ModelDims};
use crate::init::Init;
use crate::moe::{ExpertNames, SwiGluExperts, TopKRouter};
use crate::rope::Rope;

/// Mixtral causal language model.
pub type MixtralForCausalLM<B> = FamilyModel<B, MixtralConfig>;

impl FamilyConfig for MixtralConfig {
    const MODEL_TYPE: &'static str = "mixtral";
    const FFN_NAME: &'static str = "block_sparse_moe";
    type Attention<B: Backend> = GqaAttention<B>;
    type Router<B: Backend> = TopKRouter<B>;
    type Experts<B: Backend> = SwiGluExperts<B>;

    fn from_json_str(text: &str) -> Result<Self> {
        MixtralConfig::from_json_str(text)
    }

    fn to_hf_json(&self) -> serde_json::Value {
        MixtralConfig::to_hf_json(self)
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

    /// Every Mixtral layer is routed.
    fn is_sparse_layer(&self, _layer: usize) -> bool {
        true
    }

    fn routed_experts(&self) -> usize {
        self.num_local_experts
    }

    /// GQA without biases or norms; the sliding window, when configured, in every layer.
    fn attention<B: Backend>(&self, _layer: usize, init: &Init<B>) -> GqaAttention<B> {
        GqaAttention::new(
            AttentionShape {
                hidden: self.hidden_size,
                heads: self.num_attention_heads,
                kv_heads: self.num_key_value_heads,
                head_dim: self.head_dim,
                window: self.sliding_window,
            },
            AttentionOptions::plain(),
            init,
        )
    }

    /// Softmax over the experts, top-k, always renormalised.
    fn router<B: Backend>(&self, _layer: usize, init: &Init<B>) -> TopKRouter<B> {
        TopKRouter::new(self.hidden_size, self.num_local_experts, self.num_experts_per_tok, true, init)
    }

    /// Experts named `w1` (gate), `w3` (up), `w2` (down).
    fn experts<B: Backend>(&self, _layer: usize, range: Range<usize>, init: &Init<B>) -> SwiGluExperts<B> {
        SwiGluExperts::new(range, self.hidden_size, self.intermediate_size, ExpertNames::MIXTRAL, init)
    }

    fn aux_loss(&self) -> Option<AuxLoss> {
        Some(AuxLoss { kind: BalanceLoss::Switch, coef: self.router_aux_loss_coef })
    }

    fn aux_loss_by_default(&self) -> bool {
        self.output_router_logits
    }

    fn model_shape(&self, name: &str) -> ModelShape {
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
                bias: false,
                qk_norm: false,
                sinks: false,
            },
            sliding_window: self
                .sliding_window
                .map(|window| disagmoe_core::model_shape::SlidingWindow { window, period: 1 }),
            moe: MoeShape {
                experts: self.num_local_experts,
                top_k: self.num_experts_per_tok,
                intermediate: self.intermediate_size,
                shared_experts: 0,
                expert_bias: false,
                router_bias: false,
            },
            dense_layers: vec![],
            dense_intermediate: 0,
            active_counting: Default::default(),
        }
    }
}
