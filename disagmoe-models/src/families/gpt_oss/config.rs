//! `config.json` of GPT-OSS (`model_type: "gpt_oss"`), as transformers' `GptOssConfig` reads it,
//! in the transformers 4.x (`rope_theta`, `rope_scaling`) and current (`rope_parameters`) spellings.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::error::{ModelError, Result};
use crate::hf_json::{expect_model_type, parse_raw, positive, read_config, token_id};
use crate::rope::RopeScaling;

/// Attention kind of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerType {
    /// Causal attention over a window of `sliding_window` keys.
    SlidingAttention,
    /// Causal attention over the whole prefix.
    FullAttention,
}

/// A validated GPT-OSS configuration, field names as in transformers' `GptOssConfig`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GptOssConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Model width M.
    pub hidden_size: usize,
    /// Intermediate size I of each expert.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (divides the query heads).
    pub num_key_value_heads: usize,
    /// Per-head dimension.
    pub head_dim: usize,
    /// Experts per layer (`num_local_experts`).
    pub num_local_experts: usize,
    /// Experts per token.
    pub num_experts_per_tok: usize,
    /// Window of the sliding layers.
    pub sliding_window: usize,
    /// Attention kind per layer (default: sliding on even layers, full on odd ones).
    pub layer_types: Vec<LayerType>,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// RoPE scaling (default: YaRN, factor 32, original context 4096, no truncation).
    pub rope_scaling: RopeScaling,
    /// Longest position configured.
    pub max_position_embeddings: usize,
    /// `lm_head` shares the embedding.
    pub tie_word_embeddings: bool,
    /// Padding token: its embedding row starts at zero and is not trained (`None`: no padding token).
    pub pad_token_id: Option<usize>,
    /// Projection biases.
    pub attention_bias: bool,
    /// `alpha` of the expert activation.
    pub swiglu_alpha: f64,
    /// Clamp limit of the expert activation.
    pub swiglu_limit: f64,
    /// Coefficient of the load-balancing loss.
    pub router_aux_loss_coef: f64,
    /// Whether transformers adds the aux loss.
    pub output_router_logits: bool,
    /// Standard deviation of the normal initialiser.
    pub initializer_range: f64,
}

#[derive(Debug, Deserialize)]
struct RawConfig {
    model_type: Option<String>,
    vocab_size: Option<i64>,
    hidden_size: Option<i64>,
    intermediate_size: Option<i64>,
    num_hidden_layers: Option<i64>,
    num_attention_heads: Option<i64>,
    num_key_value_heads: Option<i64>,
    head_dim: Option<i64>,
    #[serde(alias = "num_experts")]
    num_local_experts: Option<i64>,
    num_experts_per_tok: Option<i64>,
    sliding_window: Option<i64>,
    layer_types: Option<Vec<LayerType>>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    max_position_embeddings: Option<i64>,
    tie_word_embeddings: Option<bool>,
    pad_token_id: Option<Value>,
    attention_bias: Option<bool>,
    swiglu_alpha: Option<f64>,
    swiglu_limit: Option<f64>,
    router_aux_loss_coef: Option<f64>,
    output_router_logits: Option<bool>,
    initializer_range: Option<f64>,
}

impl GptOssConfig {
    /// Reads and validates `config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        read_config(path.as_ref(), Self::from_json_str)
    }

    /// Parses and validates a `config.json` text (transformers 4.x or current spelling).
    pub fn from_json_str(text: &str) -> Result<Self> {
        let raw: RawConfig = parse_raw(text)?;
        expect_model_type(raw.model_type.as_deref(), "gpt_oss")?;
        let hidden_size = positive("hidden_size", raw.hidden_size, Some(2880))?;
        let heads = positive("num_attention_heads", raw.num_attention_heads, Some(64))?;
        let kv = positive("num_key_value_heads", raw.num_key_value_heads, Some(heads as i64))?;
        if heads % kv != 0 {
            return Err(ModelError::config(
                "num_key_value_heads",
                format!("must divide num_attention_heads ({heads}), got {kv}"),
            ));
        }
        let head_dim = positive("head_dim", raw.head_dim, Some((hidden_size / heads) as i64))?;
        if head_dim % 2 != 0 {
            return Err(ModelError::config("head_dim", format!("must be even for rotary embeddings, got {head_dim}")));
        }
        let layers = positive("num_hidden_layers", raw.num_hidden_layers, Some(36))?;
        let experts = positive("num_local_experts", raw.num_local_experts, Some(128))?;
        let top_k = positive("num_experts_per_tok", raw.num_experts_per_tok, Some(4))?;
        if top_k > experts {
            return Err(ModelError::config(
                "num_experts_per_tok",
                format!("must be between 1 and num_local_experts ({experts}), got {top_k}"),
            ));
        }
        let layer_types = match raw.layer_types {
            Some(t) if t.len() != layers => {
                return Err(ModelError::config(
                    "layer_types",
                    format!("must list one type per layer ({layers}), got {}", t.len()),
                ))
            }
            Some(t) => t,
            None => (0..layers)
                .map(|i| if (i + 1) % 2 == 1 { LayerType::SlidingAttention } else { LayerType::FullAttention })
                .collect(),
        };
        let default_yarn = json!({"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                  "truncate": false, "original_max_position_embeddings": 4096});
        let (theta_in, rope_scaling) = match (&raw.rope_parameters, &raw.rope_scaling) {
            (Some(p), _) if !p.is_null() => RopeScaling::from_hf("rope_parameters", p)?,
            (_, Some(s)) => RopeScaling::from_hf("rope_scaling", s)?,
            _ => RopeScaling::from_hf("rope_parameters", &default_yarn)?,
        };
        let rope_theta = theta_in.or(raw.rope_theta).unwrap_or(150000.0);
        let swiglu_limit = raw.swiglu_limit.unwrap_or(7.0);
        if !(swiglu_limit > 0.0) {
            return Err(ModelError::config("swiglu_limit", format!("must be > 0, got {swiglu_limit}")));
        }
        let vocab_size = positive("vocab_size", raw.vocab_size, Some(201088))?;
        let pad_token_id = token_id("pad_token_id", raw.pad_token_id.as_ref(), vocab_size)?;
        Ok(Self {
            vocab_size,
            hidden_size,
            intermediate_size: positive("intermediate_size", raw.intermediate_size, Some(2880))?,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            head_dim,
            num_local_experts: experts,
            num_experts_per_tok: top_k,
            sliding_window: positive("sliding_window", raw.sliding_window, Some(128))?,
            layer_types,
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-5),
            rope_theta,
            rope_scaling,
            max_position_embeddings: positive("max_position_embeddings", raw.max_position_embeddings, Some(131072))?,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            pad_token_id,
            attention_bias: raw.attention_bias.unwrap_or(true),
            swiglu_alpha: raw.swiglu_alpha.unwrap_or(1.702),
            swiglu_limit,
            router_aux_loss_coef: raw.router_aux_loss_coef.unwrap_or(0.001),
            output_router_logits: raw.output_router_logits.unwrap_or(false),
            initializer_range: raw.initializer_range.unwrap_or(0.02),
        })
    }

    /// The configuration as a transformers `config.json`.
    pub fn to_hf_json(&self) -> Value {
        let mut rope = self.rope_scaling.to_hf();
        if let Some(o) = rope.as_object_mut() {
            o.insert("rope_theta".into(), json!(self.rope_theta));
        }
        json!({
            "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "num_local_experts": self.num_local_experts,
            "num_experts_per_tok": self.num_experts_per_tok, "sliding_window": self.sliding_window,
            "layer_types": self.layer_types, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": if rope.is_null() { Value::Null } else { rope },
            "max_position_embeddings": self.max_position_embeddings, "tie_word_embeddings": self.tie_word_embeddings, "pad_token_id": self.pad_token_id,
            "attention_bias": self.attention_bias, "swiglu_alpha": self.swiglu_alpha, "swiglu_limit": self.swiglu_limit,
            "router_aux_loss_coef": self.router_aux_loss_coef, "output_router_logits": self.output_router_logits,
            "initializer_range": self.initializer_range, "hidden_act": "silu", "torch_dtype": "float32",
        })
    }
}
