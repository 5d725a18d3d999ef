//! DeepSeek-V3 and DeepSeekMoE-style models (`DeepseekV3ForCausalLM` in transformers), natively in Burn.
//!
//! A model is a sequence of (attention block, expert block) pairs plus embedding and head; it knows
//! nothing about devices, ranks or transports. Attention is multi-head latent attention
//! ([`crate::mla`]); the first `first_k_dense_replace` layers have a dense SwiGLU MLP, the others
//! routed SwiGLU experts chosen by the [`DeepseekRouter`] plus always-on shared experts.
//!
//! Checkpoint names: `model.embed_tokens.weight`, `model.layers.{i}.input_layernorm.weight`,
//! `model.layers.{i}.self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}.weight`,
//! `model.layers.{i}.self_attn.{kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}.weight`
//! (plus `.bias` of `q_a_proj`, `kv_a_proj_with_mqa`, `o_proj` with `attention_bias`),
//! `model.layers.{i}.post_attention_layernorm.weight`, dense layers
//! `model.layers.{i}.mlp.{gate,up,down}_proj.weight`, MoE layers `model.layers.{i}.mlp.gate.weight`,
//! `model.layers.{i}.mlp.gate.e_score_correction_bias` (a buffer),
//! `model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight` (or the fused
//! `mlp.experts.{gate_up_proj, down_proj}`), `model.layers.{i}.mlp.shared_experts.{gate,up,down}_proj.weight`,
//! `model.norm.weight`, `lm_head.weight` (absent when tied). Hub checkpoints also hold the
//! multi-token-prediction layer(s) at `model.layers.{num_hidden_layers}.*`; they are skipped on load.
//!
//! Balancing: transformers' deepseek_v3 computes no auxiliary loss, so `loss`
//! returns `aux_loss: None`; balance comes from [`DeepseekV3ForCausalLM::update_router_biases`]
//! (aux-loss-free bias updates from the step's expert load).

pub mod config;

use std::path::Path;

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

pub use self::config::{DeepseekV3Config, ScoringFunc};
use crate::decoder::{AttentionLayer, CausalLm, DecoderLayer, FamilyConfig, FeedForward};
use crate::deepseek_router::{DeepseekRouter, DeepseekRouterConfig};
use crate::error::{ModelError, Result};
use crate::mla::{MlaAttention, MlaShape};
use crate::moe::{SparseMoeBlock, SwiGluExperts, SwiGluMlp};
use crate::rope::Rope;
use crate::weights::{CheckpointReader, TensorSink};

/// A DeepSeek MoE block: group-limited router, routed SwiGLU experts, shared experts.
pub type DeepseekMoe<B> = SparseMoeBlock<B, DeepseekRouter<B>, SwiGluExperts<B>>;
/// The expert block of one layer: routed plus shared experts, or a dense MLP in the first layers.
pub type DeepseekFeedForward<B> = FeedForward<B, DeepseekRouter<B>, SwiGluExperts<B>>;
/// One decoder layer: pre-norm MLA and pre-norm feed-forward, each with a residual.
pub type DeepseekV3DecoderLayer<B> = DecoderLayer<B, MlaAttention<B>, DeepseekFeedForward<B>>;
/// DeepSeek-V3 causal language model.
pub type DeepseekV3ForCausalLM<B> = CausalLm<B, DeepseekV3Config, MlaAttention<B>, DeepseekFeedForward<B>>;

impl<B: Backend> AttentionLayer<B> for MlaAttention<B> {
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

impl DeepseekV3Config {
    fn layer<B: Backend>(&self, layer: usize, device: &B::Device) -> DeepseekV3DecoderLayer<B> {
        let c = self;
        let std = c.initializer_range;
        let shape = MlaShape {
            hidden: c.hidden_size,
            heads: c.num_attention_heads,
            q_lora_rank: c.q_lora_rank,
            kv_lora_rank: c.kv_lora_rank,
            qk_nope_head_dim: c.qk_nope_head_dim,
            qk_rope_head_dim: c.qk_rope_head_dim,
            v_head_dim: c.v_head_dim,
            bias: c.attention_bias,
            rope_interleave: c.rope_interleave,
            softmax_scale: c.softmax_scale(),
        };
        let mlp = if c.is_sparse_layer(layer) {
            let router = DeepseekRouterConfig {
                hidden: c.hidden_size,
                experts: c.n_routed_experts,
                top_k: c.num_experts_per_tok,
                n_group: c.n_group,
                topk_group: c.topk_group,
                norm_topk_prob: c.norm_topk_prob,
                routed_scaling_factor: c.routed_scaling_factor,
                scoring: c.scoring_func,
            };
            let mut moe = SparseMoeBlock::new(
                DeepseekRouter::new(router, std, device),
                SwiGluExperts::new(c.n_routed_experts, c.hidden_size, c.moe_intermediate_size, std, device),
            );
            moe.shared_experts = (c.n_shared_experts > 0)
                .then(|| SwiGluMlp::new(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts, std, device));
            FeedForward::sparse(moe)
        } else {
            FeedForward::dense(SwiGluMlp::new(c.hidden_size, c.intermediate_size, std, device))
        };
        DecoderLayer::new(c.hidden_size, c.rms_norm_eps, MlaAttention::new(shape, std, device), mlp, device)
    }
}

impl FamilyConfig for DeepseekV3Config {
    type Model<B: Backend> = DeepseekV3ForCausalLM<B>;

    fn from_file(path: &Path) -> Result<Self> {
        DeepseekV3Config::from_file(path)
    }

    /// Normal(0, `initializer_range`) weights, norms at one, zero correction biases, as
    /// transformers initialises them.
    fn init<B: Backend>(&self, device: &B::Device) -> DeepseekV3ForCausalLM<B> {
        let layers = (0..self.num_hidden_layers).map(|l| self.layer(l, device)).collect();
        let dims =
            (self.vocab_size, self.hidden_size, self.rms_norm_eps, self.initializer_range, self.tie_word_embeddings);
        CausalLm::assemble(
            self.clone(),
            Rope::new(self.qk_rope_head_dim, self.rope_theta, &self.rope_scaling),
            dims,
            layers,
            device,
        )
    }

    fn to_hf_json(&self) -> serde_json::Value {
        DeepseekV3Config::to_hf_json(self)
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// transformers' deepseek_v3 adds no auxiliary loss; balance is aux-loss-free.
    fn aux_loss_coef(&self) -> Option<f64> {
        None
    }

    /// Multi-token-prediction layers (`model.layers.{num_hidden_layers}.*` and beyond) are skipped
    /// with one log line.
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
        self.layers.iter().filter_map(|l| l.mlp.moe.as_ref().map(|m| &m.gate))
    }

    /// Aux-loss-free balancing: updates each MoE layer's correction bias from its expert load,
    /// `counts[l]` being the routed copies per expert of the `l`-th MoE layer (the order of
    /// [`CausalLmOutput::router_stats`]), with `b += rate * sign(mean_load - load)`.
    pub fn update_router_biases(&mut self, counts: &[Vec<usize>], rate: f64) -> Result<()> {
        let moe_layers = self.routers().count();
        if counts.len() != moe_layers {
            return Err(ModelError::InvalidInput(format!(
                "update_router_biases: {} count vectors for {moe_layers} MoE layers",
                counts.len()
            )));
        }
        let routers = self.layers.iter_mut().filter_map(|l| l.mlp.moe.as_mut().map(|m| &mut m.gate));
        for (router, c) in routers.zip(counts) {
            router.update_bias(c, rate)?;
        }
        Ok(())
    }
}

/// Whether `name` belongs to a multi-token-prediction layer (`model.layers.{l}.` with `l >= layers`).
fn is_mtp_tensor(name: &str, layers: usize) -> bool {
    name.strip_prefix("model.layers.")
        .and_then(|rest| rest.split('.').next())
        .and_then(|l| l.parse::<usize>().ok())
        .is_some_and(|l| l >= layers)
}
