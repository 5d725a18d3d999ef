//! `config.json` of Mixtral (`model_type: "mixtral"`), as transformers' `MixtralConfig` reads it.
//!
//! Two spellings exist and both are accepted: the Hub's (transformers 4.x: `rope_theta`,
//! `torch_dtype`) and current transformers' (`rope_parameters` with the theta inside, `dtype`);
//! `num_local_experts` is also read as `num_experts`.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::error::{ModelError, Result};
use crate::hf_json::{expect_model_type, parse_raw, positive, positive_f64, read_config, token_id};
use crate::rope::RopeScaling;

/// A validated Mixtral configuration, field names as in transformers' `MixtralConfig`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MixtralConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Model width M.
    pub hidden_size: usize,
    /// Intermediate size I of each expert.
    pub intermediate_size: usize,
    /// Decoder layers (every one routed).
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (divides the query heads).
    pub num_key_value_heads: usize,
    /// Per-head dimension (`null` in the file: `hidden_size / num_attention_heads`).
    pub head_dim: usize,
    /// Experts per layer E.
    pub num_local_experts: usize,
    /// Experts per token k.
    pub num_experts_per_tok: usize,
    /// Sliding-window attention over this many keys in every layer (`None`: full causal attention).
    pub sliding_window: Option<usize>,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// RoPE scaling.
    pub rope_scaling: RopeScaling,
    /// Longest position configured.
    pub max_position_embeddings: usize,
    /// `lm_head` shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Padding token: its embedding row starts at zero and is not trained (`None`: no padding token).
    pub pad_token_id: Option<usize>,
    /// Coefficient of the load-balancing loss.
    pub router_aux_loss_coef: f64,
    /// Whether transformers adds the aux loss.
    pub output_router_logits: bool,
    /// Standard deviation of the normal initialiser.
    pub initializer_range: f64,
    /// dtype the checkpoint was saved in (informational: we compute in f32).
    pub torch_dtype: String,
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
    head_dim: Option<Value>,
    #[serde(alias = "num_experts")]
    num_local_experts: Option<i64>,
    num_experts_per_tok: Option<i64>,
    sliding_window: Option<Value>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    max_position_embeddings: Option<i64>,
    tie_word_embeddings: Option<bool>,
    pad_token_id: Option<Value>,
    router_aux_loss_coef: Option<f64>,
    router_jitter_noise: Option<f64>,
    output_router_logits: Option<bool>,
    initializer_range: Option<f64>,
    hidden_act: Option<String>,
    #[serde(alias = "dtype")]
    torch_dtype: Option<String>,
}

/// A field that is `null`, absent, or a positive integer.
fn optional_positive(field: &str, v: &Option<Value>) -> Result<Option<usize>> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(x) => match x.as_i64() {
            Some(n) if n > 0 => Ok(Some(n as usize)),
            _ => Err(ModelError::config(field, format!("must be null or a positive integer, got {x}"))),
        },
    }
}

impl MixtralConfig {
    /// Reads and validates `config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        read_config(path.as_ref(), Self::from_json_str)
    }

    /// Parses and validates a `config.json` text (either spelling).
    pub fn from_json_str(text: &str) -> Result<Self> {
        let raw: RawConfig = parse_raw(text)?;
        expect_model_type(raw.model_type.as_deref(), "mixtral")?;
        let hidden_size = positive("hidden_size", raw.hidden_size, Some(4096))?;
        let heads = positive("num_attention_heads", raw.num_attention_heads, Some(32))?;
        let kv = positive("num_key_value_heads", raw.num_key_value_heads, Some(8))?;
        if heads % kv != 0 {
            return Err(ModelError::config(
                "num_key_value_heads",
                format!("must divide num_attention_heads ({heads}), got {kv}"),
            ));
        }
        let head_dim = optional_positive("head_dim", &raw.head_dim)?.unwrap_or(hidden_size / heads);
        if head_dim % 2 != 0 {
            return Err(ModelError::config("head_dim", format!("must be even for rotary embeddings, got {head_dim}")));
        }
        let experts = positive("num_local_experts", raw.num_local_experts, Some(8))?;
        let top_k = positive("num_experts_per_tok", raw.num_experts_per_tok, Some(2))?;
        if top_k > experts {
            return Err(ModelError::config(
                "num_experts_per_tok",
                format!("must be between 1 and num_local_experts ({experts}), got {top_k}"),
            ));
        }
        let hidden_act = raw.hidden_act.unwrap_or_else(|| "silu".into());
        if hidden_act != "silu" {
            return Err(ModelError::config("hidden_act", format!("`{hidden_act}` is not supported; allowed: \"silu\"")));
        }
        if let Some(j) = raw.router_jitter_noise.filter(|&j| j != 0.0) {
            tracing::warn!(router_jitter_noise = j, "router jitter noise is not applied (routing stays deterministic)");
        }
        let (theta_in, rope_scaling) = match (&raw.rope_parameters, &raw.rope_scaling) {
            (Some(p), _) if !p.is_null() => RopeScaling::from_hf("rope_parameters", p)?,
            (_, Some(s)) => RopeScaling::from_hf("rope_scaling", s)?,
            _ => (None, RopeScaling::Default),
        };
        let router_aux_loss_coef = raw.router_aux_loss_coef.unwrap_or(0.001);
        if !(router_aux_loss_coef.is_finite() && router_aux_loss_coef >= 0.0) {
            return Err(ModelError::config(
                "router_aux_loss_coef",
                format!("must be a finite number >= 0, got {router_aux_loss_coef}"),
            ));
        }
        let vocab_size = positive("vocab_size", raw.vocab_size, Some(32000))?;
        Ok(Self {
            vocab_size,
            hidden_size,
            intermediate_size: positive("intermediate_size", raw.intermediate_size, Some(14336))?,
            num_hidden_layers: positive("num_hidden_layers", raw.num_hidden_layers, Some(32))?,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            head_dim,
            num_local_experts: experts,
            num_experts_per_tok: top_k,
            sliding_window: optional_positive("sliding_window", &raw.sliding_window)?,
            rms_norm_eps: positive_f64("rms_norm_eps", raw.rms_norm_eps, 1e-5)?,
            rope_theta: positive_f64("rope_theta", theta_in.or(raw.rope_theta), 1e6)?,
            rope_scaling,
            max_position_embeddings: positive("max_position_embeddings", raw.max_position_embeddings, Some(131072))?,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            pad_token_id: token_id("pad_token_id", raw.pad_token_id.as_ref(), vocab_size)?,
            router_aux_loss_coef,
            output_router_logits: raw.output_router_logits.unwrap_or(false),
            initializer_range: positive_f64("initializer_range", raw.initializer_range, 0.02)?,
            torch_dtype: raw.torch_dtype.unwrap_or_else(|| "float32".into()),
        })
    }

    /// The configuration as a transformers `config.json` (4.x spelling, read by every version).
    pub fn to_hf_json(&self) -> Value {
        json!({
            "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "num_local_experts": self.num_local_experts,
            "num_experts_per_tok": self.num_experts_per_tok, "sliding_window": self.sliding_window,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling.to_hf(),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "pad_token_id": self.pad_token_id,
            "router_aux_loss_coef": self.router_aux_loss_coef, "router_jitter_noise": 0.0,
            "output_router_logits": self.output_router_logits, "initializer_range": self.initializer_range,
            "hidden_act": "silu", "attention_dropout": 0.0, "torch_dtype": "float32", "use_cache": true,
        })
    }
}
