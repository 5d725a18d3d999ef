//! `config.json` of DeepSeekMoE (`model_type: "deepseek"`), as DeepSeek's own
//! `configuration_deepseek.py` (deepseek-ai/deepseek-moe-16b-base) reads it.
//!
//! Two spellings are accepted: the Hub's (transformers 4.x: `rope_theta`, `rope_scaling`,
//! `torch_dtype`) and current transformers' (`rope_parameters` with the theta inside, `dtype`).
//! `n_shared_experts` and `n_routed_experts` may be `null` (no shared experts; every layer dense).
//! `aux_loss_alpha` and `seq_aux` default to the 16B model's 0.001 and `true`.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::error::{ModelError, Result};
use crate::hf_json::{expect_model_type, non_negative, parse_raw, positive, positive_f64, read_config, token_id};
use crate::rope::RopeScaling;

/// A validated DeepSeekMoE configuration, field names as in `DeepseekConfig`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeepseekConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Model width M.
    pub hidden_size: usize,
    /// Intermediate size of the dense MLP of dense layers.
    pub intermediate_size: usize,
    /// Intermediate size I of each routed expert (the shared MLP has `I * n_shared_experts`).
    pub moe_intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Attention heads H (head dim `hidden_size / H`).
    pub num_attention_heads: usize,
    /// Key/value heads (divides the heads; 16B has plain multi-head attention).
    pub num_key_value_heads: usize,
    /// Shared experts every token goes through, as one SwiGLU MLP (0: none; `null` in the file).
    pub n_shared_experts: usize,
    /// Routed experts E per MoE layer (`None`: `null` in the file, every layer dense).
    pub n_routed_experts: Option<usize>,
    /// Experts per token k.
    pub num_experts_per_tok: usize,
    /// Layers `0..first_k_dense_replace` are dense.
    pub first_k_dense_replace: usize,
    /// Of the others, layers with `layer % moe_layer_freq == 0` are MoE layers.
    pub moe_layer_freq: usize,
    /// Renormalise the chosen probabilities to sum to one (only when `k > 1`).
    pub norm_topk_prob: bool,
    /// Coefficient of the balance loss (0: off).
    pub aux_loss_alpha: f64,
    /// The balance loss per sequence (`true`) or over the whole batch.
    pub seq_aux: bool,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// RoPE scaling (`linear` or none).
    pub rope_scaling: RopeScaling,
    /// Longest position configured.
    pub max_position_embeddings: usize,
    /// `lm_head` shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Padding token: its embedding row starts at zero and is not trained (`None`: no padding token).
    pub pad_token_id: Option<usize>,
    /// q/k/v/o projections have biases.
    pub attention_bias: bool,
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
    moe_intermediate_size: Option<i64>,
    num_hidden_layers: Option<i64>,
    num_attention_heads: Option<i64>,
    num_key_value_heads: Option<i64>,
    n_shared_experts: Option<i64>,
    n_routed_experts: Option<i64>,
    num_experts_per_tok: Option<i64>,
    first_k_dense_replace: Option<i64>,
    moe_layer_freq: Option<i64>,
    norm_topk_prob: Option<bool>,
    scoring_func: Option<String>,
    aux_loss_alpha: Option<f64>,
    seq_aux: Option<bool>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    max_position_embeddings: Option<i64>,
    tie_word_embeddings: Option<bool>,
    pad_token_id: Option<Value>,
    attention_bias: Option<bool>,
    pretraining_tp: Option<i64>,
    initializer_range: Option<f64>,
    hidden_act: Option<String>,
    #[serde(alias = "dtype")]
    torch_dtype: Option<String>,
}

impl DeepseekConfig {
    /// Reads and validates `config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        read_config(path.as_ref(), Self::from_json_str)
    }

    /// Parses and validates a `config.json` text.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let raw: RawConfig = parse_raw(text)?;
        expect_model_type(raw.model_type.as_deref(), "deepseek")?;
        let hidden_size = positive("hidden_size", raw.hidden_size, Some(4096))?;
        let heads = positive("num_attention_heads", raw.num_attention_heads, Some(32))?;
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
        let n_routed_experts = match raw.n_routed_experts {
            None => None,
            Some(e) => Some(positive("n_routed_experts", Some(e), None)?),
        };
        let top_k = positive("num_experts_per_tok", raw.num_experts_per_tok, Some(6))?;
        if let Some(e) = n_routed_experts.filter(|&e| top_k > e) {
            return Err(ModelError::config(
                "num_experts_per_tok",
                format!("must be between 1 and n_routed_experts ({e}), got {top_k}"),
            ));
        }
        if let Some(s) = raw.scoring_func.as_deref().filter(|s| *s != "softmax") {
            return Err(ModelError::config(
                "scoring_func",
                format!("`{s}` is not supported for model_type deepseek; allowed: \"softmax\""),
            ));
        }
        if let Some(tp) = raw.pretraining_tp.filter(|&tp| tp != 1) {
            return Err(ModelError::config("pretraining_tp", format!("only 1 is supported, got {tp}")));
        }
        let hidden_act = raw.hidden_act.unwrap_or_else(|| "silu".into());
        if hidden_act != "silu" {
            return Err(ModelError::config("hidden_act", format!("`{hidden_act}` is not supported; allowed: \"silu\"")));
        }
        let (theta_in, rope_scaling) = match (&raw.rope_parameters, &raw.rope_scaling) {
            (Some(p), _) if !p.is_null() => RopeScaling::from_hf("rope_parameters", p)?,
            (_, Some(s)) => RopeScaling::from_hf("rope_scaling", s)?,
            _ => (None, RopeScaling::Default),
        };
        if matches!(rope_scaling, RopeScaling::Yarn { .. }) {
            return Err(ModelError::config("rope_scaling", "yarn is not supported for model_type deepseek; allowed: linear, none"));
        }
        let aux_loss_alpha = raw.aux_loss_alpha.unwrap_or(0.001);
        if !(aux_loss_alpha.is_finite() && aux_loss_alpha >= 0.0) {
            return Err(ModelError::config("aux_loss_alpha", format!("must be a finite number >= 0, got {aux_loss_alpha}")));
        }
        let vocab_size = positive("vocab_size", raw.vocab_size, Some(102400))?;
        Ok(Self {
            vocab_size,
            hidden_size,
            intermediate_size: positive("intermediate_size", raw.intermediate_size, Some(11008))?,
            moe_intermediate_size: positive("moe_intermediate_size", raw.moe_intermediate_size, Some(1407))?,
            num_hidden_layers: positive("num_hidden_layers", raw.num_hidden_layers, Some(32))?,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            n_shared_experts: non_negative("n_shared_experts", raw.n_shared_experts, 0)?,
            n_routed_experts,
            num_experts_per_tok: top_k,
            first_k_dense_replace: non_negative("first_k_dense_replace", raw.first_k_dense_replace, 0)?,
            moe_layer_freq: positive("moe_layer_freq", raw.moe_layer_freq, Some(1))?,
            norm_topk_prob: raw.norm_topk_prob.unwrap_or(false),
            aux_loss_alpha,
            seq_aux: raw.seq_aux.unwrap_or(true),
            rms_norm_eps: positive_f64("rms_norm_eps", raw.rms_norm_eps, 1e-6)?,
            rope_theta: positive_f64("rope_theta", theta_in.or(raw.rope_theta), 10000.0)?,
            rope_scaling,
            max_position_embeddings: positive("max_position_embeddings", raw.max_position_embeddings, Some(2048))?,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            pad_token_id: token_id("pad_token_id", raw.pad_token_id.as_ref(), vocab_size)?,
            attention_bias: raw.attention_bias.unwrap_or(false),
            initializer_range: positive_f64("initializer_range", raw.initializer_range, 0.02)?,
            torch_dtype: raw.torch_dtype.unwrap_or_else(|| "float32".into()),
        })
    }

    /// DeepSeekMoE-16B (deepseek-ai/deepseek-moe-16b-base): 28 layers of width 2048, 16 heads of
    /// plain multi-head attention, the first layer dense (intermediate 10944), then 64 routed experts
    /// (intermediate 1408) plus 2 shared experts, top-6 softmax gating without renormalisation.
    pub fn deepseek_moe_16b() -> Self {
        Self {
            vocab_size: 102400,
            hidden_size: 2048,
            intermediate_size: 10944,
            moe_intermediate_size: 1408,
            num_hidden_layers: 28,
            num_attention_heads: 16,
            num_key_value_heads: 16,
            n_shared_experts: 2,
            n_routed_experts: Some(64),
            num_experts_per_tok: 6,
            first_k_dense_replace: 1,
            moe_layer_freq: 1,
            norm_topk_prob: false,
            aux_loss_alpha: 0.001,
            seq_aux: true,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            rope_scaling: RopeScaling::Default,
            max_position_embeddings: 4096,
            tie_word_embeddings: false,
            pad_token_id: None,
            attention_bias: false,
            initializer_range: 0.006,
            torch_dtype: "bfloat16".into(),
        }
    }

    /// Whether layer `layer` routes tokens to experts.
    pub fn is_sparse_layer(&self, layer: usize) -> bool {
        self.n_routed_experts.is_some() && layer >= self.first_k_dense_replace && layer % self.moe_layer_freq == 0
    }

    /// The configuration as DeepSeek's `config.json` (the Hub's spelling).
    pub fn to_hf_json(&self) -> Value {
        json!({
            "architectures": ["DeepseekForCausalLM"], "model_type": "deepseek",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "n_shared_experts": (self.n_shared_experts > 0).then_some(self.n_shared_experts),
            "n_routed_experts": self.n_routed_experts, "num_experts_per_tok": self.num_experts_per_tok,
            "first_k_dense_replace": self.first_k_dense_replace, "moe_layer_freq": self.moe_layer_freq,
            "norm_topk_prob": self.norm_topk_prob, "scoring_func": "softmax",
            "aux_loss_alpha": self.aux_loss_alpha, "seq_aux": self.seq_aux,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling.to_hf(),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "pad_token_id": self.pad_token_id,
            "attention_bias": self.attention_bias, "attention_dropout": 0.0, "pretraining_tp": 1,
            "initializer_range": self.initializer_range, "hidden_act": "silu", "torch_dtype": "float32",
            "use_cache": true,
        })
    }
}
