//! Mixture-of-experts language models in Burn, with Hugging Face `config.json` and safetensors I/O.
//!
//! Entry points: [`Qwen3MoeConfig`] (parse and validate a `config.json`, then `init` a fresh model)
//! and [`Qwen3MoeForCausalLM`] (`from_pretrained`, `forward`, `loss`, `save_pretrained`). The MoE
//! machinery ([`moe`]) is shared: a router, the [`moe::Experts`] trait that new expert types
//! implement, the grouped dispatch, and the load-balancing loss.
//!
//! **This crate knows nothing about device groups, ranks or transports.** A model is a sequence of
//! (attention block, expert block) pairs plus embedding and head; partitioning and placement happen
//! in `disagmoe-train` on that shape. Everything is computed in f32; checkpoints may be f32, bf16 or
//! f16.

pub mod attention;
pub mod causal_lm;
pub mod config;
pub mod decoder;
pub mod deepseek_router;
pub mod deepseek_v3;
pub mod error;
pub mod family;
pub mod gpt_oss;
mod hf_json;
pub mod mla;
pub mod moe;
pub mod nn;
pub mod qwen3_moe;
pub mod rope;
pub mod stages;
pub mod weights;

pub use causal_lm::HfCheckpoint;
pub use config::{Qwen3MoeConfig, RopeScaling};
pub use decoder::{CausalLm, FamilyConfig};
pub use deepseek_v3::{DeepseekV3Config, DeepseekV3ForCausalLM};
pub use error::{ModelError, Result};
pub use family::{ModelConfig, MoeCausalLm, SUPPORTED_MODEL_TYPES};
pub use gpt_oss::{GptOssConfig, GptOssForCausalLM};
pub use moe::{Experts, Router, RouterStats, SparseMoeBlock, SwiGluExperts, TopKRouter};
pub use qwen3_moe::{CausalLmOutput, LossParts, Qwen3MoeForCausalLM};
pub use weights::{CheckpointReader, TensorSink};
