//! DeepSeek-V3 (`DeepseekV3ForCausalLM` in transformers, `model_type: "deepseek_v3"`).
//!
//! Attention is multi-head latent attention ([`crate::mla`]); the first `first_k_dense_replace`
//! layers have a dense SwiGLU MLP, the others routed SwiGLU experts chosen by the [`DeepseekRouter`]
//! (sigmoid scores, a selection-only correction bias, group-limited top-k) plus always-on shared
//! experts.
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
//! Balancing: transformers' deepseek_v3 computes no auxiliary loss, so the loss has none; balance
//! comes from aux-loss-free bias updates from the step's expert load
//! ([`crate::decoder::CausalLm::update_router_biases`]).

pub mod config;
pub mod model;
pub mod router;

pub use self::config::{DeepseekV3Config, ScoringFunc};
pub use self::model::DeepseekV3ForCausalLM;
pub use self::router::{DeepseekRouter, DeepseekRouterConfig};

/// Embedded configurations (`--model-preset`).
pub const PRESETS: &[super::Preset] = &[("tiny-deepseek-v3", include_str!("tiny.json"))];
