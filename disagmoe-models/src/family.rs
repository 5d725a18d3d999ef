//! One type over the model families, chosen by `config.json`'s `model_type`, for code that should
//! not care which family it runs (the trainer, the CLI).

use std::path::Path;

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

use crate::causal_lm::{CausalLmOutput, HfCheckpoint, LossParts};
use crate::decoder::FamilyConfig;
use crate::deepseek_v3::{DeepseekV3Config, DeepseekV3ForCausalLM};
use crate::error::{ModelError, Result};
use crate::gpt_oss::{GptOssConfig, GptOssForCausalLM};
use crate::qwen3_moe::Qwen3MoeForCausalLM;
use crate::weights::{CheckpointReader, TensorSink};
use crate::Qwen3MoeConfig;

/// `model_type` values this crate reads.
pub const SUPPORTED_MODEL_TYPES: &[&str] = &["qwen3_moe", "gpt_oss", "deepseek_v3"];

/// A validated configuration of any supported family.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelConfig {
    /// `qwen3_moe`
    Qwen3Moe(Qwen3MoeConfig),
    /// `gpt_oss`
    GptOss(GptOssConfig),
    /// `deepseek_v3`
    DeepseekV3(DeepseekV3Config),
}

macro_rules! each_config {
    ($self:expr, $c:ident => $e:expr) => {
        match $self {
            ModelConfig::Qwen3Moe($c) => $e,
            ModelConfig::GptOss($c) => $e,
            ModelConfig::DeepseekV3($c) => $e,
        }
    };
}

impl ModelConfig {
    /// Parses a `config.json` text, dispatching on `model_type`.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let v: serde_json::Value = serde_json::from_str(text).map_err(|source| ModelError::ConfigParse {
            path: "config.json".into(),
            field: String::new(),
            source,
        })?;
        match v.get("model_type").and_then(|t| t.as_str()) {
            Some("qwen3_moe") => Ok(Self::Qwen3Moe(Qwen3MoeConfig::from_json_str(text)?)),
            Some("gpt_oss") => Ok(Self::GptOss(GptOssConfig::from_json_str(text)?)),
            Some("deepseek_v3") => Ok(Self::DeepseekV3(DeepseekV3Config::from_json_str(text)?)),
            Some(other) => Err(ModelError::config(
                "model_type",
                format!("`{other}` is not supported; allowed: {SUPPORTED_MODEL_TYPES:?}"),
            )),
            None => Err(ModelError::config("model_type", format!("is required; allowed: {SUPPORTED_MODEL_TYPES:?}"))),
        }
    }

    /// Reads and validates a `config.json` file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
            action: "cannot read model config",
            path: path.into(),
            source,
        })?;
        Self::from_json_str(&text).map_err(|e| match e {
            ModelError::ConfigParse { field, source, .. } => {
                ModelError::ConfigParse { path: path.into(), field, source }
            }
            other => other,
        })
    }

    /// A freshly initialised model.
    pub fn init<B: Backend>(&self, device: &B::Device) -> MoeCausalLm<B> {
        match self {
            Self::Qwen3Moe(c) => MoeCausalLm::Qwen3Moe(c.init(device)),
            Self::GptOss(c) => MoeCausalLm::GptOss(c.init(device)),
            Self::DeepseekV3(c) => MoeCausalLm::DeepseekV3(c.init(device)),
        }
    }

    /// `model_type`.
    pub fn model_type(&self) -> &'static str {
        match self {
            Self::Qwen3Moe(_) => "qwen3_moe",
            Self::GptOss(_) => "gpt_oss",
            Self::DeepseekV3(_) => "deepseek_v3",
        }
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        each_config!(self, c => c.vocab_size)
    }

    /// Whether transformers would add the load-balancing loss for this config.
    pub fn output_router_logits(&self) -> bool {
        each_config!(self, c => c.output_router_logits)
    }

    /// Indices of the layers with routed experts, in order.
    pub fn sparse_layers(&self) -> Vec<usize> {
        match self {
            Self::Qwen3Moe(c) => (0..c.num_hidden_layers).filter(|&l| c.is_sparse_layer(l)).collect(),
            Self::GptOss(c) => (0..c.num_hidden_layers).collect(),
            Self::DeepseekV3(c) => (0..c.num_hidden_layers).filter(|&l| c.is_sparse_layer(l)).collect(),
        }
    }

    /// The configuration as a transformers `config.json`.
    pub fn to_hf_json(&self) -> serde_json::Value {
        each_config!(self, c => c.to_hf_json())
    }
}

/// A causal LM of any supported family.
#[derive(Module, Debug)]
pub enum MoeCausalLm<B: Backend> {
    /// Qwen3-MoE.
    Qwen3Moe(Qwen3MoeForCausalLM<B>),
    /// GPT-OSS.
    GptOss(GptOssForCausalLM<B>),
    /// DeepSeek-V3 (and DeepSeekMoE-style configurations).
    DeepseekV3(DeepseekV3ForCausalLM<B>),
}

macro_rules! each_model {
    ($self:expr, $m:ident => $e:expr) => {
        match $self {
            MoeCausalLm::Qwen3Moe($m) => $e,
            MoeCausalLm::GptOss($m) => $e,
            MoeCausalLm::DeepseekV3($m) => $e,
        }
    };
}

impl<B: Backend> MoeCausalLm<B> {
    /// The model's configuration.
    pub fn config(&self) -> ModelConfig {
        match self {
            Self::Qwen3Moe(m) => ModelConfig::Qwen3Moe(m.config().clone()),
            Self::GptOss(m) => ModelConfig::GptOss(m.config().clone()),
            Self::DeepseekV3(m) => ModelConfig::DeepseekV3(m.config().clone()),
        }
    }

    /// Aux-loss-free balancing: moves the routers' correction biases from the expert load of the
    /// last step (`counts[l]` per MoE layer, in `router_stats` order). Families whose routers have no
    /// correction bias ignore it. Returns whether anything was updated.
    pub fn update_router_biases(&mut self, counts: &[Vec<usize>], rate: f64) -> Result<bool> {
        match self {
            Self::DeepseekV3(m) => m.update_router_biases(counts, rate).map(|_| true),
            _ => Ok(false),
        }
    }

    /// Token ids as a `[batch, seq]` tensor, checked against the vocabulary.
    pub fn input_ids(&self, rows: &[Vec<i64>], device: &B::Device) -> Result<Tensor<B, 2, Int>> {
        each_model!(self, m => m.input_ids(rows, device))
    }

    /// The forward pass: `[B, S]` ids -> `[B, S, V]` logits and router statistics.
    pub fn forward(&self, ids: Tensor<B, 2, Int>) -> CausalLmOutput<B> {
        each_model!(self, m => m.forward(ids))
    }

    /// The training loss of a forward pass.
    pub fn loss(&self, out: &CausalLmOutput<B>, ids: Tensor<B, 2, Int>, with_aux: bool) -> LossParts<B> {
        each_model!(self, m => m.loss(out, ids, with_aux))
    }
}

impl<B: Backend> HfCheckpoint<B> for MoeCausalLm<B> {
    /// Dispatches on `model_type`.
    fn init_from_config(path: &Path, device: &B::Device) -> Result<Self> {
        Ok(ModelConfig::from_file(path)?.init(device))
    }

    fn hf_config(&self) -> serde_json::Value {
        each_model!(self, m => m.hf_config())
    }

    fn load_weights(&mut self, ckpt: &mut CheckpointReader, device: &B::Device) -> Result<()> {
        each_model!(self, m => m.load_weights(ckpt, device))
    }

    fn save_into(&self, sink: &mut TensorSink) {
        each_model!(self, m => m.save_into(sink))
    }

    fn report_unused(&self, unused: Vec<String>) {
        each_model!(self, m => m.report_unused(unused))
    }
}
