//! DeepSeekMoE (`model_type: "deepseek"`, the architecture of DeepSeekMoE-16B; DeepSeek's own
//! `modeling_deepseek.py`, which transformers does not ship): plain multi-head (or grouped-query)
//! attention with Llama's `rotate_half` RoPE; dense SwiGLU layers below `first_k_dense_replace` and
//! where `layer % moe_layer_freq != 0`; elsewhere a softmax gate over `n_routed_experts` picking
//! top-k fine-grained SwiGLU experts (renormalised only when `norm_topk_prob` and `k > 1`), plus
//! `n_shared_experts` shared experts as one SwiGLU MLP of width `moe_intermediate_size *
//! n_shared_experts`; the per-layer expert balance loss `aux_loss_alpha` (per sequence with
//! `seq_aux`).
//!
//! DeepSeek's code adds the balance loss through a backward hook with a gradient of one per layer,
//! outside the returned loss; here it is part of the training loss (`lm + alpha * aux`), which
//! gives the same gradients for one micro-batch. With several micro-batches each one's loss is
//! averaged, as for every family.
//!
//! Checkpoint names: `model.embed_tokens.weight`, `model.layers.{i}.input_layernorm.weight`,
//! `model.layers.{i}.self_attn.{q,k,v,o}_proj.weight` (`.bias` with `attention_bias`),
//! `model.layers.{i}.post_attention_layernorm.weight`, MoE layers `model.layers.{i}.mlp.gate.weight`,
//! `model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight`,
//! `model.layers.{i}.mlp.shared_experts.{gate,up,down}_proj.weight`, dense layers
//! `model.layers.{i}.mlp.{gate,up,down}_proj.weight`, `model.norm.weight`, `lm_head.weight`
//! (absent when tied).

pub mod config;
pub mod model;

pub use self::config::DeepseekConfig;
pub use self::model::DeepseekForCausalLM;

/// Embedded configurations (`--model-preset`).
pub const PRESETS: &[super::Preset] = &[("tiny-deepseek-moe", include_str!("tiny.json"))];
