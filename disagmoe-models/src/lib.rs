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
//!
//! # A model in a few lines
//!
//! ```
//! use disagmoe_models::generate::{generate, Sampling};
//! use disagmoe_models::{ModelConfig, RoutingOptions};
//!
//! type B = burn::backend::Flex;
//! let device = Default::default();
//! // Any supported config.json (here an embedded preset), a seeded model of that shape.
//! let mut model = ModelConfig::preset("tiny-qwen3-moe")?.init::<B>(7, &device);
//! // The router options of the literature act on every MoE layer of any family.
//! model.set_routing(RoutingOptions { z_loss_coef: 1e-3, capacity_factor: Some(1.25), ..Default::default() });
//! let ids = model.input_ids(&[vec![72, 101, 108, 108, 111, 33]], &device)?;
//! let out = model.forward(ids.clone()); // logits [1, 6, 256] and per-layer router statistics
//! let loss = model.loss(&out, ids, true); // LM + balance loss + z-loss
//! assert!(loss.total.into_scalar() > 0.0);
//! // Continue a prompt through the KV cache, greedily.
//! let tokens = generate(&model, &[72, 101], 5, &[], Sampling::greedy(), &device, |_| {})?;
//! assert_eq!(tokens.len(), 5);
//! # Ok::<(), disagmoe_models::ModelError>(())
//! ```
//!
//! A new expert type implements [`Experts`] (see its example, and `examples/custom_expert.rs`
//! in the repository: GeGLU experts defined outside the crates, trained under `--placement
//! disagg`); a new routing rule implements [`Router`].

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
pub mod mtp;
pub mod nn;
pub mod recompute;
pub mod rope;
pub mod stages;
pub mod weights;

pub use balance::{AuxLoss, BalanceLoss, LayerRouting};
pub use causal_lm::{CausalLmOutput, HfCheckpoint, LossParts};
pub use decoder::{CausalLm, FamilyModel};
pub use disagmoe_kernels::documents::Documents;
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
pub use mtp::MtpSettings;
pub use recompute::{MicroBatchLoss, Recompute};
pub use rope::RopeScaling;
pub use weights::{CheckpointReader, SaveDtype, TensorSink};
