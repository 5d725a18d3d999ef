//! `config.json` of OLMoE (`model_type: "olmoe"`), as transformers' `OlmoeConfig` reads it, in the
//! Hub's spelling (transformers 4.x: `rope_theta`, `torch_dtype`) and the current one
//! (`rope_parameters`, `dtype`); `num_experts` is also read as `num_local_experts`.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::error::{ModelError, Result};
use crate::hf_json::{expect_model_type, parse_raw, positive, positive_f64, read_config, token_id};
use crate::rope::RopeScaling;

/// A validated OLMoE configuration, field names as in transformers' `OlmoeConfig`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OlmoeConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Model width M.
    pub hidden_size: usize,
    /// Intermediate size I of each expert.
    pub intermediate_size: usize,
    /// Decoder layers (every one routed).
    pub num_hidden_layers: usize,
    /// Query heads (head dim `hidden_size / num_attention_heads`).
    pub num_attention_heads: usize,
    /// Key/value heads.
    pub num_key_value_heads: usize,
    /// Experts per layer E.
    pub num_experts: usize,
    /// Experts per token k.
    pub num_experts_per_tok: usize,
    /// Renormalise the top-k probabilities to sum to one.
    pub norm_topk_prob: bool,
    /// Clamp q, k and v to `[-clip_qkv, clip_qkv]` after the projections and norms (`None`: no).
    pub clip_qkv: Option<f64>,
    /// RMSNorm epsilon (layer norms and the q/k norms).
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
    /// q/k/v/o projections have biases.
    pub attention_bias: bool,
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
    #[serde(alias = "num_local_experts")]
    num_experts: Option<i64>,
    num_experts_per_tok: Option<i64>,
    norm_topk_prob: Option<bool>,
    clip_qkv: Option<Value>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    max_position_embeddings: Option<i64>,
    tie_word_embeddings: Option<bool>,
    pad_token_id: Option<Value>,
    attention_bias: Option<bool>,
    router_aux_loss_coef: Option<f64>,
    output_router_logits: Option<bool>,
    initializer_range: Option<f64>,
    hidden_act: Option<String>,
    #[serde(alias = "dtype")]
    torch_dtype: Option<String>,
}

impl OlmoeConfig {
    /// Reads and validates `config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        read_config(path.as_ref(), Self::from_json_str)
    }

    /// Parses and validates a `config.json` text (either spelling).
    pub fn from_json_str(text: &str) -> Result<Self> {
        let raw: RawConfig = parse_raw(text)?;
        expect_model_type(raw.model_type.as_deref(), "olmoe")?;
        let hidden_size = positive("hidden_size", raw.hidden_size, Some(2048))?;
        let heads = positive("num_attention_heads", raw.num_attention_heads, Some(16))?;
        let kv = positive("num_key_value_heads", raw.num_key_value_heads, Some(heads as i64))?;
        if heads % kv != 0 {
            return Err(ModelError::config(
                "num_key_value_heads",
                format!("must divide num_attention_heads ({heads}), got {kv}"),
            ));
        }
        if hidden_size % heads != 0 || (hidden_size / heads) % 2 != 0 {
            return Err(ModelError::config(
                "num_attention_heads",
                format!("must divide hidden_size ({hidden_size}) into an even head dim, got {heads}"),
            ));
        }
        let experts = positive("num_experts", raw.num_experts, Some(64))?;
        let top_k = positive("num_experts_per_tok", raw.num_experts_per_tok, Some(8))?;
        if top_k > experts {
            return Err(ModelError::config(
                "num_experts_per_tok",
                format!("must be between 1 and num_experts ({experts}), got {top_k}"),
            ));
        }
        let clip_qkv = match &raw.clip_qkv {
            None | Some(Value::Null) => None,
            Some(v) => match v.as_f64() {
                Some(c) if c.is_finite() && c > 0.0 => Some(c),
                _ => return Err(ModelError::config("clip_qkv", format!("must be null or a number > 0, got {v}"))),
            },
        };
        let hidden_act = raw.hidden_act.unwrap_or_else(|| "silu".into());
        if hidden_act != "silu" {
            return Err(ModelError::config("hidden_act", format!("`{hidden_act}` is not supported; allowed: \"silu\"")));
        }
        let (theta_in, rope_scaling) = match (&raw.rope_parameters, &raw.rope_scaling) {
            (Some(p), _) if !p.is_null() => RopeScaling::from_hf("rope_parameters", p)?,
            (_, Some(s)) => RopeScaling::from_hf("rope_scaling", s)?,
            _ => (None, RopeScaling::Default),
        };
        let router_aux_loss_coef = raw.router_aux_loss_coef.unwrap_or(0.01);
        if !(router_aux_loss_coef.is_finite() && router_aux_loss_coef >= 0.0) {
            return Err(ModelError::config(
                "router_aux_loss_coef",
                format!("must be a finite number >= 0, got {router_aux_loss_coef}"),
            ));
        }
        let vocab_size = positive("vocab_size", raw.vocab_size, Some(50304))?;
        Ok(Self {
            vocab_size,
            hidden_size,
            intermediate_size: positive("intermediate_size", raw.intermediate_size, Some(2048))?,
            num_hidden_layers: positive("num_hidden_layers", raw.num_hidden_layers, Some(16))?,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            num_experts: experts,
            num_experts_per_tok: top_k,
            norm_topk_prob: raw.norm_topk_prob.unwrap_or(false),
            clip_qkv,
            rms_norm_eps: positive_f64("rms_norm_eps", raw.rms_norm_eps, 1e-5)?,
            rope_theta: positive_f64("rope_theta", theta_in.or(raw.rope_theta), 10000.0)?,
            rope_scaling,
            max_position_embeddings: positive("max_position_embeddings", raw.max_position_embeddings, Some(4096))?,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            pad_token_id: token_id("pad_token_id", raw.pad_token_id.as_ref(), vocab_size)?,
            attention_bias: raw.attention_bias.unwrap_or(false),
            router_aux_loss_coef,
            output_router_logits: raw.output_router_logits.unwrap_or(false),
            initializer_range: positive_f64("initializer_range", raw.initializer_range, 0.02)?,
            torch_dtype: raw.torch_dtype.unwrap_or_else(|| "float32".into()),
        })
    }

    /// Per-head dimension.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    /// The configuration as a transformers `config.json` (4.x spelling, read by every version).
    pub fn to_hf_json(&self) -> Value {
        json!({
            "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
            "norm_topk_prob": self.norm_topk_prob, "clip_qkv": self.clip_qkv,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling.to_hf(),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "pad_token_id": self.pad_token_id,
            "attention_bias": self.attention_bias, "attention_dropout": 0.0,
            "router_aux_loss_coef": self.router_aux_loss_coef, "output_router_logits": self.output_router_logits,
            "initializer_range": self.initializer_range, "hidden_act": "silu", "torch_dtype": "float32",
            "use_cache": true,
        })
    }
}
