//! Mixture-of-experts language models in Burn, with Hugging Face `config.json` and safetensors I/O.
//!
//! Entry points: [`ModelConfig`] (parse and validate any supported `config.json`, then `init` a
//! fresh model) and [`MoeCausalLm`] (a model of any family: `from_pretrained`, `forward`, `loss`,
//! `save_pretrained`). Each family lives in its own folder under [`families`] and is registered by
//! one line there. The MoE machinery ([`moe`]) is shared: the [`Router`] and [`Experts`] traits
//! that new routing rules and expert types implement, the grouped dispatch, and the balance losses
//! ([`balance`]).
//!
//! **This crate knows nothing about device groups, ranks or transports, and never communicates.**
//! A model is a sequence of (attention block, expert block) pairs plus embedding and head;
//! [`stages`] takes it apart, and the runtime in `disagmoe-train` decides who holds which piece.
//! Everything is computed in f32; checkpoints may be f32, bf16 or f16. Every freshly initialised
//! tensor is drawn from the run seed and its checkpoint name ([`init`]), so any part of a model can be
//! built alone.

pub mod attention;
pub mod balance;
pub mod causal_lm;
pub mod decoder;
pub mod error;
pub mod families;
pub mod generate;
mod hf_json;
pub mod init;
pub mod kv_cache;
pub mod mla;
pub mod moe;
pub mod nn;
pub mod rope;
pub mod stages;
pub mod weights;

pub use balance::{AuxLoss, BalanceLoss, LayerRouting};
pub use causal_lm::{CausalLmOutput, HfCheckpoint, LossParts};
pub use decoder::{CausalLm, FamilyModel};
pub use error::{ModelError, Result};
pub use families::deepseek_v3::{DeepseekV3Config, DeepseekV3ForCausalLM};
pub use families::gpt_oss::{GptOssConfig, GptOssForCausalLM};
pub use families::qwen3_moe::{Qwen3MoeConfig, Qwen3MoeForCausalLM};
pub use families::{
    model_presets, FamilyConfig, FamilyVisitor, ModelConfig, MoeCausalLm, TrainModule, SUPPORTED_MODEL_TYPES,
};
pub use init::Init;
pub use kv_cache::{KvCache, LayerCache};
pub use moe::{Experts, Router, RouterStats, RoutingOptions, SparseMoeBlock, SwiGluExperts, TopKRouter};
pub use rope::RopeScaling;
pub use weights::{CheckpointReader, TensorSink};
