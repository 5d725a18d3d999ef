//! Hugging Face `config.json` for Qwen3-MoE (`model_type: "qwen3_moe"`).
//!
//! Two spellings exist in the wild and both are accepted:
//! - checkpoints released on the Hub (transformers 4.x): `num_experts`, `rope_theta`, `rope_scaling`,
//!   `torch_dtype`;
//! - what current transformers writes: `num_local_experts`, `rope_parameters`, `dtype`.
//!
//! [`Qwen3MoeConfig::from_json_str`] parses either, validates every field once, and yields one
//! normalised value. [`Qwen3MoeConfig::to_hf_json`] writes the 4.x spelling, which every transformers
//! version reads.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::error::{ModelError, Result};
use crate::hf_json::{expect_model_type, non_negative, parse_raw, positive, read_config, token_id};
pub use crate::rope::RopeScaling;

/// A validated Qwen3-MoE configuration, field names as in transformers' `Qwen3MoeConfig`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Qwen3MoeConfig {
    /// Vocabulary size (rows of `embed_tokens`, columns of `lm_head`).
    pub vocab_size: usize,
    /// Model width H.
    pub hidden_size: usize,
    /// Intermediate size of the dense MLP used by layers in `mlp_only_layers` or off the sparse step.
    pub intermediate_size: usize,
    /// Intermediate size I of each routed expert.
    pub moe_intermediate_size: usize,
    /// Number of decoder layers L.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (GQA); divides `num_attention_heads`.
    pub num_key_value_heads: usize,
    /// Per-head dimension (may differ from `hidden_size / num_attention_heads`).
    pub head_dim: usize,
    /// Routed experts E per MoE layer (0 makes every layer dense).
    pub num_experts: usize,
    /// Experts chosen per token (top-k), `1 <= k <= num_experts`.
    pub num_experts_per_tok: usize,
    /// Renormalise the top-k routing weights to sum to 1.
    pub norm_topk_prob: bool,
    /// A layer `i` is sparse when `(i + 1) % decoder_sparse_step == 0` and `i` is not in `mlp_only_layers`.
    pub decoder_sparse_step: usize,
    /// Layers that use the dense MLP.
    pub mlp_only_layers: Vec<usize>,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// RoPE scaling.
    pub rope_scaling: RopeScaling,
    /// Longest position the model was configured for.
    pub max_position_embeddings: usize,
    /// `lm_head` shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Padding token: its embedding row starts at zero and is not trained (`None`: no padding token).
    pub pad_token_id: Option<usize>,
    /// q/k/v/o projections have biases.
    pub attention_bias: bool,
    /// Sliding-window attention width for the layers that use it (`None`: full attention everywhere).
    pub sliding_window: Option<usize>,
    /// Kept from the file for round trips; transformers 5 does not use it for qwen3_moe.
    pub max_window_layers: usize,
    /// Coefficient of the load-balancing loss added to the LM loss.
    pub router_aux_loss_coef: f64,
    /// Whether transformers adds the aux loss (it does only when router logits are output).
    pub output_router_logits: bool,
    /// Standard deviation of the normal initialiser.
    pub initializer_range: f64,
    /// Activation of experts and MLPs (only `silu` is supported).
    pub hidden_act: String,
    /// dtype the checkpoint was saved in (informational: we compute in f32).
    pub torch_dtype: String,
}

/// The raw file, every spelling allowed, nothing validated yet.
#[derive(Debug, Deserialize)]
struct RawConfig {
    model_type: Option<String>,
    vocab_size: Option<i64>,
    hidden_size: Option<i64>,
    intermediate_size: Option<i64>,
    moe_intermediate_size: Option<i64>,
    num_hidden_layers: Option<i64>,
    num_attention_heads: Option<i64>,
    num_key_value_heads: Option<i64>,
    head_dim: Option<i64>,
    #[serde(alias = "num_local_experts")]
    num_experts: Option<i64>,
    num_experts_per_tok: Option<i64>,
    norm_topk_prob: Option<bool>,
    decoder_sparse_step: Option<i64>,
    mlp_only_layers: Option<Vec<i64>>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    max_position_embeddings: Option<i64>,
    tie_word_embeddings: Option<bool>,
    pad_token_id: Option<Value>,
    attention_bias: Option<bool>,
    use_sliding_window: Option<bool>,
    sliding_window: Option<Value>,
    max_window_layers: Option<i64>,
    router_aux_loss_coef: Option<f64>,
    output_router_logits: Option<bool>,
    initializer_range: Option<f64>,
    hidden_act: Option<String>,
    #[serde(alias = "dtype")]
    torch_dtype: Option<String>,
}

impl Qwen3MoeConfig {
    /// Reads and validates `config.json` from a file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        read_config(path.as_ref(), Self::from_json_str)
    }

    /// Parses and validates a `config.json` text.
    pub fn from_json_str(text: &str) -> Result<Self> {
        Self::from_raw(parse_raw(text)?)
    }

    fn from_raw(raw: RawConfig) -> Result<Self> {
        expect_model_type(raw.model_type.as_deref(), "qwen3_moe")?;
        let hidden_size = positive("hidden_size", raw.hidden_size, None)?;
        let num_attention_heads = positive("num_attention_heads", raw.num_attention_heads, None)?;
        let num_key_value_heads =
            positive("num_key_value_heads", raw.num_key_value_heads, Some(num_attention_heads as i64))?;
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(ModelError::config(
                "num_key_value_heads",
                format!("must divide num_attention_heads ({num_attention_heads}), got {num_key_value_heads}"),
            ));
        }
        let default_head_dim = (hidden_size / num_attention_heads) as i64;
        let head_dim = positive("head_dim", raw.head_dim, Some(default_head_dim))?;
        if head_dim % 2 != 0 {
            return Err(ModelError::config("head_dim", format!("must be even for rotary embeddings, got {head_dim}")));
        }
        let num_hidden_layers = positive("num_hidden_layers", raw.num_hidden_layers, None)?;
        let num_experts = non_negative("num_experts", raw.num_experts, 128)?;
        let num_experts_per_tok = positive("num_experts_per_tok", raw.num_experts_per_tok, Some(8))?;
        if num_experts > 0 && num_experts_per_tok > num_experts {
            return Err(ModelError::config(
                "num_experts_per_tok",
                format!("must be between 1 and num_experts ({num_experts}), got {num_experts_per_tok}"),
            ));
        }
        let mut mlp_only_layers = Vec::new();
        for (i, &l) in raw.mlp_only_layers.iter().flatten().enumerate() {
            if l < 0 || l as usize >= num_hidden_layers {
                return Err(ModelError::config(
                    format!("mlp_only_layers[{i}]"),
                    format!("must be a layer index in 0..{num_hidden_layers}, got {l}"),
                ));
            }
            mlp_only_layers.push(l as usize);
        }
        // rope: `rope_parameters` (current) carries theta inside; `rope_theta`/`rope_scaling` (4.x).
        let (theta_in_params, rope_scaling) = match (&raw.rope_parameters, &raw.rope_scaling) {
            (Some(p), _) if !p.is_null() => RopeScaling::from_hf("rope_parameters", p)?,
            (_, Some(s)) => RopeScaling::from_hf("rope_scaling", s)?,
            _ => (None, RopeScaling::Default),
        };
        let rope_theta = theta_in_params.or(raw.rope_theta).unwrap_or(10000.0);
        if !(rope_theta > 0.0) {
            return Err(ModelError::config("rope_theta", format!("must be > 0, got {rope_theta}")));
        }
        let rms_norm_eps = raw.rms_norm_eps.unwrap_or(1e-6);
        if !(rms_norm_eps > 0.0) {
            return Err(ModelError::config("rms_norm_eps", format!("must be > 0, got {rms_norm_eps}")));
        }
        let hidden_act = raw.hidden_act.unwrap_or_else(|| "silu".into());
        if hidden_act != "silu" {
            return Err(ModelError::config(
                "hidden_act",
                format!("`{hidden_act}` is not supported; allowed: \"silu\""),
            ));
        }
        let use_sliding_window = raw.use_sliding_window.unwrap_or(false);
        let sliding_window = match (&raw.sliding_window, use_sliding_window) {
            (_, false) | (None, _) | (Some(Value::Null), _) => None,
            (Some(v), true) => match v.as_i64() {
                Some(w) if w > 0 => Some(w as usize),
                _ => return Err(ModelError::config("sliding_window", format!("must be a positive integer, got {v}"))),
            },
        };
        let router_aux_loss_coef = raw.router_aux_loss_coef.unwrap_or(0.001);
        if !router_aux_loss_coef.is_finite() || router_aux_loss_coef < 0.0 {
            return Err(ModelError::config(
                "router_aux_loss_coef",
                format!("must be a finite number >= 0, got {router_aux_loss_coef}"),
            ));
        }
        let initializer_range = raw.initializer_range.unwrap_or(0.02);
        if !(initializer_range > 0.0) {
            return Err(ModelError::config("initializer_range", format!("must be > 0, got {initializer_range}")));
        }
        let vocab_size = positive("vocab_size", raw.vocab_size, None)?;
        let pad_token_id = token_id("pad_token_id", raw.pad_token_id.as_ref(), vocab_size)?;
        Ok(Self {
            vocab_size,
            hidden_size,
            intermediate_size: positive("intermediate_size", raw.intermediate_size, Some(6144))?,
            moe_intermediate_size: positive("moe_intermediate_size", raw.moe_intermediate_size, Some(768))?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            num_experts,
            num_experts_per_tok,
            norm_topk_prob: raw.norm_topk_prob.unwrap_or(false),
            decoder_sparse_step: positive("decoder_sparse_step", raw.decoder_sparse_step, Some(1))?,
            mlp_only_layers,
            rms_norm_eps,
            rope_theta,
            rope_scaling,
            max_position_embeddings: positive("max_position_embeddings", raw.max_position_embeddings, Some(32768))?,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            pad_token_id,
            attention_bias: raw.attention_bias.unwrap_or(false),
            sliding_window,
            max_window_layers: non_negative("max_window_layers", raw.max_window_layers, 28)?,
            router_aux_loss_coef,
            output_router_logits: raw.output_router_logits.unwrap_or(false),
            initializer_range,
            hidden_act,
            torch_dtype: raw.torch_dtype.unwrap_or_else(|| "float32".into()),
        })
    }

    /// Whether layer `layer` routes tokens to experts (as transformers decides it).
    pub fn is_sparse_layer(&self, layer: usize) -> bool {
        !self.mlp_only_layers.contains(&layer) && self.num_experts > 0 && (layer + 1) % self.decoder_sparse_step == 0
    }

    /// Sliding window of layer `layer`, if it has one. As in transformers 5, a window set with
    /// `use_sliding_window` applies to every layer (`max_window_layers` is kept only for round trips).
    pub fn layer_window(&self, _layer: usize) -> Option<usize> {
        self.sliding_window
    }

    /// The configuration as a transformers `config.json` (4.x spelling, read by every version).
    pub fn to_hf_json(&self) -> Value {
        let rope_scaling = self.rope_scaling.to_hf();
        json!({
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": self.decoder_sparse_step,
            "mlp_only_layers": self.mlp_only_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "pad_token_id": self.pad_token_id,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "use_sliding_window": self.sliding_window.is_some(),
            "sliding_window": self.sliding_window,
            "max_window_layers": self.max_window_layers,
            "router_aux_loss_coef": self.router_aux_loss_coef,
            "output_router_logits": self.output_router_logits,
            "initializer_range": self.initializer_range,
            "hidden_act": self.hidden_act,
            "torch_dtype": "float32",
            "use_cache": true,
        })
    }

    /// Ratio of query heads to key/value heads.
    pub fn gqa_groups(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }
}
