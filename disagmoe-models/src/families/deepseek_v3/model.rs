//! What each DeepSeek-V3 layer is made of.

use std::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use disagmoe_kernels::ring::Partial;
use disagmoe_core::model_shape::{AttentionShape as ShapeOfAttention, ModelShape, MoeShape};

use super::config::DeepseekV3Config;
use super::router::{DeepseekRouter, DeepseekRouterConfig};
use crate::decoder::{AttentionLayer, FamilyModel, RingBlock, RingProjection};
use crate::error::Result;
use crate::families::{FamilyConfig, ModelDims};
use crate::init::Init;
use crate::kv_cache::LayerCache;
use crate::mla::{MlaAttention, MlaShape};
use crate::moe::{ExpertNames, SwiGluExperts};
use crate::rope::Rope;
use crate::weights::{CheckpointReader, TensorSink};
use crate::balance::AuxLoss;
use crate::mtp::MtpSettings;

/// DeepSeek-V3 causal language model.
pub type DeepseekV3ForCausalLM<B> = FamilyModel<B, DeepseekV3Config>;

impl<B: Backend> AttentionLayer<B> for MlaAttention<B> {
    fn attend(
        &self,
        x: Tensor<B, 3>,
        cos: Tensor<B, 4>,
        sin: Tensor<B, 4>,
        docs: Option<&disagmoe_kernels::documents::Documents>,
    ) -> Tensor<B, 3> {
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
        docs: Option<&disagmoe_kernels::documents::Documents>,
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

impl FamilyConfig for DeepseekV3Config {
    const MODEL_TYPE: &'static str = "deepseek_v3";
    type Attention<B: Backend> = MlaAttention<B>;
    type Router<B: Backend> = DeepseekRouter<B>;
    type Experts<B: Backend> = SwiGluExperts<B>;

    fn from_json_str(text: &str) -> Result<Self> {
        DeepseekV3Config::from_json_str(text)
    }

    fn to_hf_json(&self) -> serde_json::Value {
        DeepseekV3Config::to_hf_json(self)
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
        Rope::new(self.qk_rope_head_dim, self.rope_theta, &self.rope_scaling)
    }

    fn is_sparse_layer(&self, layer: usize) -> bool {
        DeepseekV3Config::is_sparse_layer(self, layer)
    }

    fn routed_experts(&self) -> usize {
        self.n_routed_experts
    }

    fn shared_expert_intermediate(&self) -> Option<usize> {
        (self.n_shared_experts > 0).then_some(self.moe_intermediate_size * self.n_shared_experts)
    }

    fn attention<B: Backend>(&self, _layer: usize, init: &Init<B>) -> MlaAttention<B> {
        let shape = MlaShape {
            hidden: self.hidden_size,
            heads: self.num_attention_heads,
            q_lora_rank: self.q_lora_rank,
            kv_lora_rank: self.kv_lora_rank,
            qk_nope_head_dim: self.qk_nope_head_dim,
            qk_rope_head_dim: self.qk_rope_head_dim,
            v_head_dim: self.v_head_dim,
            bias: self.attention_bias,
            rope_interleave: self.rope_interleave,
            softmax_scale: self.softmax_scale(),
        };
        MlaAttention::new(shape, init)
    }

    fn router<B: Backend>(&self, _layer: usize, init: &Init<B>) -> DeepseekRouter<B> {
        let config = DeepseekRouterConfig {
            hidden: self.hidden_size,
            experts: self.n_routed_experts,
            top_k: self.num_experts_per_tok,
            n_group: self.n_group,
            topk_group: self.topk_group,
            norm_topk_prob: self.norm_topk_prob,
            routed_scaling_factor: self.routed_scaling_factor,
            scoring: self.scoring_func,
        };
        DeepseekRouter::new(config, init)
    }

    fn experts<B: Backend>(&self, _layer: usize, range: Range<usize>, init: &Init<B>) -> SwiGluExperts<B> {
        SwiGluExperts::new(range, self.hidden_size, self.moe_intermediate_size, ExpertNames::HF, init)
    }

    /// transformers' deepseek_v3 adds no auxiliary loss; balance is aux-loss-free.
    fn aux_loss(&self) -> Option<AuxLoss> {
        None
    }

    fn aux_loss_by_default(&self) -> bool {
        false
    }

    fn model_shape(&self, name: &str) -> ModelShape {
        ModelShape {
            name: name.into(),
            layers: self.num_hidden_layers,
            hidden: self.hidden_size,
            vocab: self.vocab_size,
            tied_embeddings: self.tie_word_embeddings,
            attention: ShapeOfAttention::Mla {
                heads: self.num_attention_heads,
                q_lora_rank: self.q_lora_rank,
                kv_lora_rank: self.kv_lora_rank,
                qk_nope_head_dim: self.qk_nope_head_dim,
                qk_rope_head_dim: self.qk_rope_head_dim,
                v_head_dim: self.v_head_dim,
            },
            sliding_window: None,
            moe: MoeShape {
                experts: self.n_routed_experts,
                top_k: self.num_experts_per_tok,
                intermediate: self.moe_intermediate_size,
                shared_experts: self.n_shared_experts,
                expert_bias: false,
                router_bias: true,
            },
            dense_layers: (0..self.num_hidden_layers).filter(|&l| !self.is_sparse_layer(l)).collect(),
            dense_intermediate: self.intermediate_size,
            active_counting: Default::default(),
        }
    }

    fn mtp(&self) -> MtpSettings {
        self.mtp
    }

    fn set_mtp(&mut self, mtp: MtpSettings) -> Result<()> {
        self.mtp = mtp;
        Ok(())
    }

    /// Multi-token-prediction layers (`model.layers.{num_hidden_layers}.*` and beyond) the run does
    /// not train are skipped with one log line.
    fn report_unused(&self, unused: Vec<String>) {
        let layers = self.num_hidden_layers;
        let (mtp, other): (Vec<String>, Vec<String>) = unused.into_iter().partition(|n| is_mtp_tensor(n, layers));
        if !mtp.is_empty() {
            tracing::info!(count = mtp.len(), layer = layers, "skipping the multi-token-prediction layer tensors");
        }
        if let Some(first) = other.first() {
            tracing::warn!(count = other.len(), first = %first, "checkpoint tensors not used by the model");
        }
    }
}

impl<B: Backend> DeepseekV3ForCausalLM<B> {
    /// The router of each MoE layer, in layer order.
    pub fn routers(&self) -> impl Iterator<Item = &DeepseekRouter<B>> {
        self.layers.iter().filter_map(|l| l.mlp.moe().map(|m| &m.gate))
    }
}

/// Whether `name` belongs to a multi-token-prediction layer (`model.layers.{l}.` with `l >= layers`).
fn is_mtp_tensor(name: &str, layers: usize) -> bool {
    name.strip_prefix("model.layers.")
        .and_then(|rest| rest.split('.').next())
        .and_then(|l| l.parse::<usize>().ok())
        .is_some_and(|l| l >= layers)
}
