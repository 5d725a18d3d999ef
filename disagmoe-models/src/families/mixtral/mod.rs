//! Mixtral (`MixtralForCausalLM` in transformers, `model_type: "mixtral"`): GQA attention without
//! biases or norms (a sliding window in every layer when `sliding_window` is set), every layer a
//! sparse MoE block `block_sparse_moe` whose router takes the softmax over the experts, its top-k,
//! renormalised; SwiGLU experts `w2(silu(w1 x) * w3 x)`; the Switch load-balancing loss.
//!
//! Checkpoint names: `model.embed_tokens.weight`, `model.layers.{i}.input_layernorm.weight`,
//! `model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `model.layers.{i}.post_attention_layernorm.weight`,
//! `model.layers.{i}.block_sparse_moe.gate.weight`,
//! `model.layers.{i}.block_sparse_moe.experts.{j}.{w1,w2,w3}.weight`, `model.norm.weight`,
//! `lm_head.weight` (absent when tied).

pub mod config;
pub mod model;

pub use self::config::MixtralConfig;
pub use self::model::MixtralForCausalLM;

/// Embedded configurations (`--model-preset`).
pub const PRESETS: &[super::Preset] = &[("tiny-mixtral", include_str!("tiny.json"))];
