//! GPT-OSS (`GptOssForCausalLM` in transformers, `model_type: "gpt_oss"`).
//!
//! Differences from Qwen3-MoE, each a building block: attention with projection biases and learned
//! per-head **sinks**, layers alternating sliding-window and full attention (`layer_types`), YaRN
//! RoPE; a router with a bias that takes the top-k of the raw logits and softmaxes over the k chosen;
//! experts with biases, a fused `gate_up_proj` `[E, M, 2I]` (gate = even columns, up = odd columns),
//! gate clamped to `<= limit`, up to `[-limit, limit]`, `out = (up + 1) * gate * sigmoid(alpha * gate)`.
//! Every layer is routed.
//!
//! Checkpoint names: `model.embed_tokens.weight`, `model.layers.{i}.input_layernorm.weight`,
//! `model.layers.{i}.self_attn.{q,k,v,o}_proj.{weight,bias}`, `model.layers.{i}.self_attn.sinks`,
//! `model.layers.{i}.post_attention_layernorm.weight`, `model.layers.{i}.mlp.router.{weight,bias}`,
//! `model.layers.{i}.mlp.experts.{gate_up_proj,gate_up_proj_bias,down_proj,down_proj_bias}` (or the
//! released MXFP4 form `*_blocks` + `*_scales`, dequantised on load), `model.norm.weight`,
//! `lm_head.weight`.

pub mod config;
pub mod experts;
pub mod model;

pub use self::config::{GptOssConfig, LayerType};
pub use self::experts::{clamped_swiglu, dequantize_mxfp4, GptOssExperts, GptOssRouter, FP4_VALUES};
pub use self::model::GptOssForCausalLM;

/// Embedded configurations (`--model-preset`).
pub const PRESETS: &[super::Preset] = &[("tiny-gpt-oss", include_str!("tiny.json"))];
