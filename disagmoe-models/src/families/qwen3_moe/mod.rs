//! Qwen3-MoE (`Qwen3MoeForCausalLM` in transformers, `model_type: "qwen3_moe"`): GQA attention that
//! normalises q and k per head before RoPE, softmax-then-top-k routed SwiGLU experts (renormalised
//! when `norm_topk_prob`), dense SwiGLU layers where `mlp_only_layers` / `decoder_sparse_step` say,
//! the Switch load-balancing loss.
//!
//! Checkpoint names: `model.embed_tokens.weight`, `model.layers.{i}.input_layernorm.weight`,
//! `model.layers.{i}.self_attn.{q,k,v,o}_proj.weight` (`.bias` with `attention_bias`),
//! `model.layers.{i}.self_attn.{q,k}_norm.weight`, `model.layers.{i}.post_attention_layernorm.weight`,
//! `model.layers.{i}.mlp.gate.weight`, `model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight`
//! (sparse layers; transformers 5's fused `mlp.experts.{gate_up_proj,down_proj}` is read too) or
//! `model.layers.{i}.mlp.{gate,up,down}_proj.weight` (dense layers), `model.norm.weight`,
//! `lm_head.weight` (absent when tied).

pub mod config;
pub mod model;

pub use self::config::Qwen3MoeConfig;
pub use self::model::Qwen3MoeForCausalLM;

/// Embedded configurations (`--model-preset`).
pub const PRESETS: &[super::Preset] = &[("tiny-qwen3-moe", include_str!("tiny.json"))];
