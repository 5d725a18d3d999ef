//! `config.json` of DeepSeek-V3 (`model_type: "deepseek_v3"`), as transformers' `DeepseekV3Config`
//! reads it.
//!
//! Two spellings exist on disk: transformers 4.x (`rope_theta`, `rope_scaling`, `torch_dtype`,
//! `num_nextn_predict_layers`) and 5.x (`rope_parameters` with the theta inside, `dtype`,
//! `num_mtp_layers` in memory). [`DeepseekV3Config::from_json_str`] accepts either, validates every
//! field once and yields one normalised value; [`DeepseekV3Config::to_hf_json`] writes the 4.x
//! spelling, which every transformers version reads.
//!
//! One field is ours: `scoring_func` (`"sigmoid"`, the default and what transformers' deepseek_v3
//! always does, or `"softmax"`, DeepSeekMoE/DeepSeek-V2 gating). The Hub's DeepSeek-V3 `config.json`
//! carries it too; transformers ignores it.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::error::{ModelError, Result};
use crate::hf_json::{expect_model_type, non_negative, parse_raw, positive, positive_f64, read_config, token_id};
use crate::rope::RopeScaling;

/// How router logits become expert scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ScoringFunc {
    /// `sigmoid(logits)` per expert (DeepSeek-V3; what transformers' deepseek_v3 computes).
    Sigmoid,
    /// `softmax(logits)` over the experts (DeepSeekMoE-16B, DeepSeek-V2).
    Softmax,
}

impl ScoringFunc {
    /// The `scoring_func` string of `config.json`.
    pub fn as_str(self) -> &'static str {
        match self {
            ScoringFunc::Sigmoid => "sigmoid",
            ScoringFunc::Softmax => "softmax",
        }
    }
}

/// A validated DeepSeek-V3 configuration, field names as in transformers' `DeepseekV3Config`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeepseekV3Config {
    /// Vocabulary size (rows of `embed_tokens`, columns of `lm_head`).
    pub vocab_size: usize,
    /// Model width M.
    pub hidden_size: usize,
    /// Intermediate size of the dense MLP of the first `first_k_dense_replace` layers.
    pub intermediate_size: usize,
    /// Intermediate size I of each routed expert (the shared MLP has `I * n_shared_experts`).
    pub moe_intermediate_size: usize,
    /// Number of decoder layers L (the MTP layers of a Hub checkpoint come after these).
    pub num_hidden_layers: usize,
    /// Attention heads H.
    pub num_attention_heads: usize,
    /// Kept for round trips; MLA expands keys and values per head, so it must equal
    /// `num_attention_heads`.
    pub num_key_value_heads: usize,
    /// Shared experts every token goes through (one SwiGLU of `I * n_shared_experts`; 0: none).
    pub n_shared_experts: usize,
    /// Routed experts E per MoE layer.
    pub n_routed_experts: usize,
    /// Gate weights are multiplied by this after (optional) normalisation.
    pub routed_scaling_factor: f64,
    /// Rank of the compressed key/value latent (`kv_a_proj_with_mqa` output minus the rope part).
    pub kv_lora_rank: usize,
    /// Rank of the compressed query latent; `None`: a plain `q_proj`.
    pub q_lora_rank: Option<usize>,
    /// Per-head query/key dims that get RoPE (the key part is shared by all heads); even.
    pub qk_rope_head_dim: usize,
    /// Per-head value dim.
    pub v_head_dim: usize,
    /// Per-head query/key dims without RoPE.
    pub qk_nope_head_dim: usize,
    /// Expert groups for group-limited routing; divides `n_routed_experts`.
    pub n_group: usize,
    /// Groups a token may route to, `1 <= topk_group <= n_group`.
    pub topk_group: usize,
    /// Experts per token k, at most `topk_group * n_routed_experts / n_group`.
    pub num_experts_per_tok: usize,
    /// Layers `0..first_k_dense_replace` use the dense MLP; the rest are MoE layers.
    pub first_k_dense_replace: usize,
    /// Normalise the chosen scores to sum to one (before `routed_scaling_factor`).
    pub norm_topk_prob: bool,
    /// Router scoring (see [`ScoringFunc`]).
    pub scoring_func: ScoringFunc,
    /// RMSNorm epsilon of the layer norms (the q/kv latent norms use transformers' fixed 1e-6).
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// RoPE scaling (YaRN with `mscale_all_dim` also scales the softmax, as in transformers).
    pub rope_scaling: RopeScaling,
    /// The rope dims of q and k are stored as interleaved pairs (DeepSeek checkpoints).
    pub rope_interleave: bool,
    /// Longest position the model was configured for.
    pub max_position_embeddings: usize,
    /// `lm_head` shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Padding token: its embedding row starts at zero and is not trained (`None`: no padding token).
    pub pad_token_id: Option<usize>,
    /// `q_a_proj`, `kv_a_proj_with_mqa` and `o_proj` have biases.
    pub attention_bias: bool,
    /// Kept for round trips: transformers' deepseek_v3 computes no auxiliary loss either way.
    pub output_router_logits: bool,
    /// Multi-token-prediction layers stored after the main layers (what the checkpoint holds; the
    /// run trains [`DeepseekV3Config::mtp`]'s depth of them, none unless asked).
    pub num_nextn_predict_layers: usize,
    /// The multi-token prediction this run trains (`--mtp-depth`, `--mtp-loss-coef`; not in
    /// `config.json`).
    #[serde(skip)]
    pub mtp: crate::mtp::MtpSettings,
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
    n_shared_experts: Option<i64>,
    #[serde(alias = "num_local_experts")]
    n_routed_experts: Option<i64>,
    routed_scaling_factor: Option<f64>,
    kv_lora_rank: Option<i64>,
    /// Outer `None`: absent (transformers' default 1536); inner `None`: `null` (a plain `q_proj`).
    #[serde(default, deserialize_with = "present")]
    q_lora_rank: Option<Option<Value>>,
    qk_rope_head_dim: Option<i64>,
    v_head_dim: Option<i64>,
    qk_nope_head_dim: Option<i64>,
    n_group: Option<i64>,
    topk_group: Option<i64>,
    num_experts_per_tok: Option<i64>,
    first_k_dense_replace: Option<i64>,
    norm_topk_prob: Option<bool>,
    scoring_func: Option<String>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    rope_interleave: Option<bool>,
    max_position_embeddings: Option<i64>,
    tie_word_embeddings: Option<bool>,
    pad_token_id: Option<Value>,
    attention_bias: Option<bool>,
    output_router_logits: Option<bool>,
    #[serde(alias = "num_mtp_layers")]
    num_nextn_predict_layers: Option<i64>,
    initializer_range: Option<f64>,
    hidden_act: Option<String>,
    #[serde(alias = "dtype")]
    torch_dtype: Option<String>,
}

/// Deserialises a field that is present (even as `null`) to `Some(..)`.
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Option<Option<Value>>, D::Error> {
    Ok(Some(Option::<Value>::deserialize(d)?))
}

impl DeepseekV3Config {
    /// Reads and validates `config.json` from a file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        read_config(path.as_ref(), Self::from_json_str)
    }

    /// Parses and validates a `config.json` text.
    pub fn from_json_str(text: &str) -> Result<Self> {
        Self::from_raw(parse_raw(text)?)
    }

    fn from_raw(raw: RawConfig) -> Result<Self> {
        expect_model_type(raw.model_type.as_deref(), "deepseek_v3")?;
        let num_attention_heads = positive("num_attention_heads", raw.num_attention_heads, None)?;
        let num_key_value_heads =
            positive("num_key_value_heads", raw.num_key_value_heads, Some(num_attention_heads as i64))?;
        if num_key_value_heads != num_attention_heads {
            return Err(ModelError::config(
                "num_key_value_heads",
                format!("must equal num_attention_heads ({num_attention_heads}) for multi-head latent attention, got {num_key_value_heads}"),
            ));
        }
        let qk_rope_head_dim = positive("qk_rope_head_dim", raw.qk_rope_head_dim, Some(64))?;
        if qk_rope_head_dim % 2 != 0 {
            return Err(ModelError::config(
                "qk_rope_head_dim",
                format!("must be even for rotary embeddings, got {qk_rope_head_dim}"),
            ));
        }
        let q_lora_rank = match &raw.q_lora_rank {
            None => Some(1536),
            Some(None) | Some(Some(Value::Null)) => None,
            Some(Some(v)) => match v.as_i64() {
                Some(r) if r > 0 => Some(r as usize),
                _ => {
                    return Err(ModelError::config(
                        "q_lora_rank",
                        format!("must be a positive integer or null, got {v}"),
                    ))
                }
            },
        };
        let n_routed_experts = positive("n_routed_experts", raw.n_routed_experts, Some(256))?;
        let n_group = positive("n_group", raw.n_group, Some(8))?;
        if n_routed_experts % n_group != 0 {
            return Err(ModelError::config(
                "n_group",
                format!("must divide n_routed_experts ({n_routed_experts}), got {n_group}"),
            ));
        }
        let topk_group = positive("topk_group", raw.topk_group, Some(4))?;
        if topk_group > n_group {
            return Err(ModelError::config(
                "topk_group",
                format!("must be between 1 and n_group ({n_group}), got {topk_group}"),
            ));
        }
        let reachable = topk_group * (n_routed_experts / n_group);
        let num_experts_per_tok = positive("num_experts_per_tok", raw.num_experts_per_tok, Some(8))?;
        if num_experts_per_tok > reachable {
            return Err(ModelError::config(
                "num_experts_per_tok",
                format!("must be between 1 and topk_group * n_routed_experts / n_group ({reachable}), got {num_experts_per_tok}"),
            ));
        }
        let num_hidden_layers = positive("num_hidden_layers", raw.num_hidden_layers, None)?;
        let scoring_func = match raw.scoring_func.as_deref().unwrap_or("sigmoid") {
            "sigmoid" => ScoringFunc::Sigmoid,
            "softmax" => ScoringFunc::Softmax,
            other => {
                return Err(ModelError::config(
                    "scoring_func",
                    format!("`{other}` is not supported; allowed: \"sigmoid\", \"softmax\""),
                ))
            }
        };
        let routed_scaling_factor = positive_f64("routed_scaling_factor", raw.routed_scaling_factor, 2.5)?;
        // rope: `rope_parameters` (current) carries theta inside; `rope_theta`/`rope_scaling` (4.x).
        let (theta_in_params, rope_scaling) = match (&raw.rope_parameters, &raw.rope_scaling) {
            (Some(p), _) if !p.is_null() => RopeScaling::from_hf("rope_parameters", p)?,
            (_, Some(s)) => RopeScaling::from_hf("rope_scaling", s)?,
            _ => (None, RopeScaling::Default),
        };
        let rope_theta = positive_f64("rope_theta", theta_in_params.or(raw.rope_theta), 10000.0)?;
        let rms_norm_eps = positive_f64("rms_norm_eps", raw.rms_norm_eps, 1e-6)?;
        let hidden_act = raw.hidden_act.unwrap_or_else(|| "silu".into());
        if hidden_act != "silu" {
            return Err(ModelError::config(
                "hidden_act",
                format!("`{hidden_act}` is not supported; allowed: \"silu\""),
            ));
        }
        let initializer_range = positive_f64("initializer_range", raw.initializer_range, 0.02)?;
        let vocab_size = positive("vocab_size", raw.vocab_size, None)?;
        let pad_token_id = token_id("pad_token_id", raw.pad_token_id.as_ref(), vocab_size)?;
        Ok(Self {
            vocab_size,
            hidden_size: positive("hidden_size", raw.hidden_size, None)?,
            intermediate_size: positive("intermediate_size", raw.intermediate_size, Some(18432))?,
            moe_intermediate_size: positive("moe_intermediate_size", raw.moe_intermediate_size, Some(2048))?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            n_shared_experts: non_negative("n_shared_experts", raw.n_shared_experts, 1)?,
            n_routed_experts,
            routed_scaling_factor,
            kv_lora_rank: positive("kv_lora_rank", raw.kv_lora_rank, Some(512))?,
            q_lora_rank,
            qk_rope_head_dim,
            v_head_dim: positive("v_head_dim", raw.v_head_dim, Some(128))?,
            qk_nope_head_dim: positive("qk_nope_head_dim", raw.qk_nope_head_dim, Some(128))?,
            n_group,
            topk_group,
            num_experts_per_tok,
            first_k_dense_replace: non_negative("first_k_dense_replace", raw.first_k_dense_replace, 3)?,
            norm_topk_prob: raw.norm_topk_prob.unwrap_or(true),
            scoring_func,
            rms_norm_eps,
            rope_theta,
            rope_scaling,
            rope_interleave: raw.rope_interleave.unwrap_or(true),
            max_position_embeddings: positive("max_position_embeddings", raw.max_position_embeddings, Some(4096))?,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            pad_token_id,
            attention_bias: raw.attention_bias.unwrap_or(false),
            output_router_logits: raw.output_router_logits.unwrap_or(false),
            num_nextn_predict_layers: non_negative("num_nextn_predict_layers", raw.num_nextn_predict_layers, 1)?,
            initializer_range,
            hidden_act,
            torch_dtype: raw.torch_dtype.unwrap_or_else(|| "float32".into()),
            mtp: Default::default(),
        })
    }

    /// Whether layer `layer` routes tokens to experts (`layer >= first_k_dense_replace`).
    pub fn is_sparse_layer(&self, layer: usize) -> bool {
        layer >= self.first_k_dense_replace
    }

    /// Per-head query/key dim, `qk_nope_head_dim + qk_rope_head_dim`.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Softmax scale of attention: `qk_head_dim^-0.5`, times `mscale^2` when the rope is scaled and
    /// `mscale_all_dim` is set (transformers' `yarn_apply_mscale`).
    pub fn softmax_scale(&self) -> f64 {
        let base = (self.qk_head_dim() as f64).powf(-0.5);
        match &self.rope_scaling {
            RopeScaling::Yarn { factor, mscale_all_dim: Some(m), .. } if *m != 0.0 => {
                let mscale = if *factor <= 1.0 { 1.0 } else { 0.1 * m * factor.ln() + 1.0 };
                base * mscale * mscale
            }
            _ => base,
        }
    }

    /// Number of parameters implied by the shapes (embedding, attention, dense and expert MLPs,
    /// routers, norms, head), counted without allocating anything. The routers' correction biases
    /// are buffers and are not counted.
    pub fn num_parameters(&self) -> u64 {
        let (m, h) = (self.hidden_size as u64, self.num_attention_heads as u64);
        let (r, dr, dn, dv) = (
            self.kv_lora_rank as u64,
            self.qk_rope_head_dim as u64,
            self.qk_nope_head_dim as u64,
            self.v_head_dim as u64,
        );
        let bias = |n: u64| if self.attention_bias { n } else { 0 };
        let q = match self.q_lora_rank.map(|x| x as u64) {
            None => h * (dn + dr) * m,
            Some(qr) => qr * m + bias(qr) + qr + h * (dn + dr) * qr,
        };
        let attn = q + (r + dr) * m + bias(r + dr) + r + h * (dn + dv) * r + m * h * dv + bias(m);
        let mlp = |inter: u64| 3 * m * inter;
        let e = self.n_routed_experts as u64;
        let moe = e * mlp(self.moe_intermediate_size as u64)
            + e * m
            + mlp((self.moe_intermediate_size * self.n_shared_experts) as u64);
        let layers: u64 = (0..self.num_hidden_layers)
            .map(|l| attn + 2 * m + if self.is_sparse_layer(l) { moe } else { mlp(self.intermediate_size as u64) })
            .sum();
        let embed = self.vocab_size as u64 * m;
        embed + layers + m + if self.tie_word_embeddings { 0 } else { embed }
    }

    /// The configuration as a transformers `config.json` (4.x spelling, read by every version).
    pub fn to_hf_json(&self) -> Value {
        json!({
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "n_shared_experts": self.n_shared_experts,
            "n_routed_experts": self.n_routed_experts,
            "routed_scaling_factor": self.routed_scaling_factor,
            "kv_lora_rank": self.kv_lora_rank,
            "q_lora_rank": self.q_lora_rank,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "num_experts_per_tok": self.num_experts_per_tok,
            "first_k_dense_replace": self.first_k_dense_replace,
            "norm_topk_prob": self.norm_topk_prob,
            "scoring_func": self.scoring_func.as_str(),
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling.to_hf(),
            "rope_interleave": self.rope_interleave,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "pad_token_id": self.pad_token_id,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "output_router_logits": self.output_router_logits,
            "num_nextn_predict_layers": self.num_nextn_predict_layers.max(self.mtp.depth),
            "initializer_range": self.initializer_range,
            "hidden_act": self.hidden_act,
            "torch_dtype": "float32",
            "use_cache": true,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Hub's `deepseek-ai/DeepSeek-V3` `config.json` (4.x spelling, `rope_scaling.type`, extra
    /// keys transformers ignores: `topk_method`, `seq_aux`, `quantization_config`, ...).
    const HUB_V3: &str = r#"{
      "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
      "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
      "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02,
      "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
      "model_type": "deepseek_v3", "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8,
      "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": true, "num_attention_heads": 128,
      "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
      "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
      "qk_rope_head_dim": 64,
      "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]},
      "rms_norm_eps": 1e-06,
      "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                       "original_max_position_embeddings": 4096, "type": "yarn"},
      "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": true,
      "tie_word_embeddings": false, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
      "transformers_version": "4.33.1", "use_cache": true, "v_head_dim": 128, "vocab_size": 129280
    }"#;

    #[test]
    fn hub_deepseek_v3_config_parses_with_671b_parameters() {
        let c = DeepseekV3Config::from_json_str(HUB_V3).unwrap();
        assert_eq!(c.q_lora_rank, Some(1536));
        assert_eq!((c.n_group, c.topk_group, c.num_experts_per_tok), (8, 4, 8));
        assert_eq!(c.scoring_func, ScoringFunc::Sigmoid);
        assert!(matches!(c.rope_scaling, RopeScaling::Yarn { factor, .. } if factor == 40.0));
        let mscale = 0.1 * 40f64.ln() + 1.0;
        assert!((c.softmax_scale() - 192f64.powf(-0.5) * mscale * mscale).abs() < 1e-12);
        // 671B in the main model (the MTP module's 14B come on top, in layer 61).
        let n = c.num_parameters() as f64;
        assert!((n - 671e9).abs() / 671e9 < 0.005, "{n:.4e}");
        assert!(!c.is_sparse_layer(2) && c.is_sparse_layer(3));
        // Round trip through the 4.x spelling.
        let again = DeepseekV3Config::from_json_str(&c.to_hf_json().to_string()).unwrap();
        assert_eq!(DeepseekV3Config { torch_dtype: c.torch_dtype.clone(), ..again }, c);
    }

    #[test]
    fn q_lora_rank_absent_is_the_default_and_null_is_a_plain_projection() {
        let base = r#""vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2"#;
        let absent = DeepseekV3Config::from_json_str(&format!("{{{base}}}")).unwrap();
        assert_eq!(absent.q_lora_rank, Some(1536));
        let null = DeepseekV3Config::from_json_str(&format!(r#"{{{base}, "q_lora_rank": null}}"#)).unwrap();
        assert_eq!(null.q_lora_rank, None);
        let v5 = DeepseekV3Config::from_json_str(&format!(
            r#"{{{base}, "dtype": "bfloat16", "num_mtp_layers": 0, "rope_parameters": {{"rope_type": "default", "rope_theta": 5000.0}}}}"#
        ))
        .unwrap();
        assert_eq!((v5.rope_theta, v5.num_nextn_predict_layers, v5.torch_dtype.as_str()), (5000.0, 0, "bfloat16"));
    }

    #[test]
    fn invalid_fields_are_named_with_the_allowed_values() {
        let base = r#""vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "n_routed_experts": 8, "num_experts_per_tok": 2"#;
        for (extra, field, hint) in [
            (r#""model_type": "deepseek_v2""#, "model_type", "deepseek_v3"),
            (r#""n_group": 3"#, "n_group", "must divide n_routed_experts (8)"),
            (r#""n_group": 4, "topk_group": 5"#, "topk_group", "between 1 and n_group (4)"),
            (r#""topk_group": 1"#, "num_experts_per_tok", "n_routed_experts / n_group (1)"),
            (r#""num_key_value_heads": 1"#, "num_key_value_heads", "must equal num_attention_heads (2)"),
            (r#""scoring_func": "relu""#, "scoring_func", "\"sigmoid\", \"softmax\""),
            (r#""q_lora_rank": -4"#, "q_lora_rank", "positive integer or null"),
            (r#""qk_rope_head_dim": 5"#, "qk_rope_head_dim", "even"),
            (r#""routed_scaling_factor": 0"#, "routed_scaling_factor", "> 0"),
            (
                r#""rope_scaling": {"type": "yarn", "factor": 4}"#,
                "rope_scaling.original_max_position_embeddings",
                "required",
            ),
        ] {
            let err = DeepseekV3Config::from_json_str(&format!("{{{base}, {extra}}}")).unwrap_err();
            match &err {
                ModelError::InvalidConfig { field: f, message } => {
                    assert_eq!(f, field, "{extra}: {err}");
                    assert!(message.contains(hint), "{extra}: `{message}` lacks `{hint}`");
                }
                other => panic!("{extra}: unexpected error {other}"),
            }
        }
    }
}
