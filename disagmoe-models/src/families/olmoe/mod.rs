//! OLMoE (`OlmoeForCausalLM` in transformers, `model_type: "olmoe"`): attention whose q and k are
//! RMS-normalised over the whole projection (not per head) and optionally clipped to
//! `[-clip_qkv, clip_qkv]` together with v; every layer routed by a softmax top-k router
//! (renormalised when `norm_topk_prob`) to SwiGLU experts; the Switch load-balancing loss.
//!
//! Checkpoint names: `model.embed_tokens.weight`, `model.layers.{i}.input_layernorm.weight`,
//! `model.layers.{i}.self_attn.{q,k,v,o}_proj.weight` (`.bias` with `attention_bias`),
//! `model.layers.{i}.self_attn.{q,k}_norm.weight`, `model.layers.{i}.post_attention_layernorm.weight`,
//! `model.layers.{i}.mlp.gate.weight`, `model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight`,
//! `model.norm.weight`, `lm_head.weight` (absent when tied).

pub mod config;
pub mod model;

pub use self::config::OlmoeConfig;
pub use self::model::OlmoeForCausalLM;

/// Embedded configurations (`--model-preset`).
pub const PRESETS: &[super::Preset] = &[("tiny-olmoe", include_str!("tiny.json"))];
