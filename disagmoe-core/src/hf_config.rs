//! Reading a [`ModelShape`] from a Hugging Face `config.json` of the `qwen3_moe`, `gpt_oss` or
//! `deepseek_v3` (also `deepseek_v2`, `deepseek`) families.
//!
//! Key names follow the transformers configuration classes. Where families disagree on a name the
//! reader accepts each spelling: `num_experts` / `num_local_experts` / `n_routed_experts`,
//! `num_experts_per_tok` / `experts_per_token`.

use crate::error::{CoreError, Result};
use crate::model_shape::{AttentionShape, ModelFamily, ModelShape, MoeShape, SlidingWindow};
use serde_json::Value;
use std::path::Path;

struct Keys<'a> {
    doc: &'a Value,
    source: &'a str,
}

impl Keys<'_> {
    fn opt(&self, names: &[&str]) -> Option<usize> {
        names.iter().find_map(|n| self.doc.get(*n).and_then(Value::as_u64)).map(|v| v as usize)
    }
    fn req(&self, names: &[&str]) -> Result<usize> {
        self.opt(names)
            .ok_or_else(|| CoreError::MissingKey { key: names.join(" | "), source_name: self.source.to_string() })
    }
    fn flag(&self, name: &str, default: bool) -> bool {
        self.doc.get(name).and_then(Value::as_bool).unwrap_or(default)
    }
}

/// Reads and validates `config.json` at `path`.
pub fn read_hf_config(path: &Path) -> Result<ModelShape> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| CoreError::Io { path: shown.clone(), source })?;
    let doc: Value = serde_json::from_str(&text).map_err(|source| CoreError::Json { path: shown.clone(), source })?;
    let name = path
        .parent()
        .and_then(|p| p.file_name())
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_else(|| "custom".to_string());
    parse_hf_config(&doc, &name, &shown)
}

/// Builds a shape from a parsed `config.json` document; `source` names it in errors.
pub fn parse_hf_config(doc: &Value, name: &str, source: &str) -> Result<ModelShape> {
    let k = Keys { doc, source };
    let model_type = doc
        .get("model_type")
        .and_then(Value::as_str)
        .ok_or_else(|| CoreError::MissingKey { key: "model_type".into(), source_name: source.into() })?;
    let family = match model_type {
        "qwen3_moe" => ModelFamily::Qwen3Moe,
        "gpt_oss" => ModelFamily::GptOss,
        "deepseek_v3" | "deepseek_v2" | "deepseek" => ModelFamily::DeepSeek,
        other => return Err(CoreError::UnsupportedModelType(other.to_string())),
    };
    let hidden = k.req(&["hidden_size"])?;
    let layers = k.req(&["num_hidden_layers"])?;
    let heads = k.req(&["num_attention_heads"])?;
    let kv_heads = k.opt(&["num_key_value_heads"]).unwrap_or(heads);
    let head_dim = k.opt(&["head_dim"]).unwrap_or(hidden / heads.max(1));
    let experts = k.req(&["num_experts", "num_local_experts", "n_routed_experts"])?;
    let top_k = k.req(&["num_experts_per_tok", "experts_per_token"])?;
    let vocab = k.req(&["vocab_size"])?;
    let tied_embeddings = k.flag("tie_word_embeddings", false);
    let dense_intermediate = k.opt(&["intermediate_size"]).unwrap_or(0);

    let (attention, moe, dense_layers, sliding_window) = match family {
        ModelFamily::Qwen3Moe => {
            let step = k.opt(&["decoder_sparse_step"]).unwrap_or(1).max(1);
            let mlp_only: Vec<usize> = doc
                .get("mlp_only_layers")
                .and_then(Value::as_array)
                .map(|a| a.iter().filter_map(Value::as_u64).map(|v| v as usize).collect())
                .unwrap_or_default();
            let dense = (0..layers).filter(|l| mlp_only.contains(l) || (l + 1) % step != 0).collect();
            (
                AttentionShape::Gqa {
                    heads,
                    kv_heads,
                    head_dim,
                    bias: k.flag("attention_bias", false),
                    qk_norm: true,
                    sinks: false,
                },
                MoeShape {
                    experts,
                    top_k,
                    intermediate: k.req(&["moe_intermediate_size"])?,
                    shared_experts: 0,
                    expert_bias: false,
                    router_bias: false,
                },
                dense,
                None,
            )
        }
        ModelFamily::GptOss => {
            let window = k.opt(&["sliding_window"]);
            let period = match doc.get("layer_types").and_then(Value::as_array) {
                Some(types) => {
                    let sliding: Vec<usize> = types
                        .iter()
                        .enumerate()
                        .filter(|(_, t)| t.as_str() == Some("sliding_attention"))
                        .map(|(i, _)| i)
                        .collect();
                    if sliding.is_empty() {
                        None
                    } else if sliding.len() == types.len() {
                        Some(1)
                    } else {
                        Some(sliding.get(1).map(|s| s - sliding[0]).unwrap_or(types.len()))
                    }
                }
                None => Some(2),
            };
            let sliding_window = match (window, period) {
                (Some(window), Some(period)) => Some(SlidingWindow { window, period }),
                _ => None,
            };
            (
                AttentionShape::Gqa {
                    heads,
                    kv_heads,
                    head_dim,
                    bias: k.flag("attention_bias", true),
                    qk_norm: false,
                    sinks: true,
                },
                MoeShape {
                    experts,
                    top_k,
                    intermediate: k.req(&["intermediate_size"])?,
                    shared_experts: 0,
                    expert_bias: true,
                    router_bias: true,
                },
                vec![],
                sliding_window,
            )
        }
        ModelFamily::DeepSeek => {
            let first_dense = k.opt(&["first_k_dense_replace"]).unwrap_or(0);
            let freq = k.opt(&["moe_layer_freq"]).unwrap_or(1).max(1);
            let dense = (0..layers).filter(|&l| l < first_dense || l % freq != 0).collect();
            let attention = if model_type == "deepseek" {
                AttentionShape::Gqa { heads, kv_heads, head_dim, bias: false, qk_norm: false, sinks: false }
            } else {
                AttentionShape::Mla {
                    heads,
                    q_lora_rank: k.opt(&["q_lora_rank"]),
                    kv_lora_rank: k.req(&["kv_lora_rank"])?,
                    qk_nope_head_dim: k.req(&["qk_nope_head_dim"])?,
                    qk_rope_head_dim: k.req(&["qk_rope_head_dim"])?,
                    v_head_dim: k.req(&["v_head_dim"])?,
                }
            };
            (
                attention,
                MoeShape {
                    experts,
                    top_k,
                    intermediate: k.req(&["moe_intermediate_size"])?,
                    shared_experts: k.opt(&["n_shared_experts"]).unwrap_or(0),
                    expert_bias: false,
                    router_bias: model_type == "deepseek_v3",
                },
                dense,
                None,
            )
        }
    };
    let shape = ModelShape {
        name: name.to_string(),
        family,
        layers,
        hidden,
        vocab,
        tied_embeddings,
        attention,
        sliding_window,
        moe,
        dense_layers,
        dense_intermediate,
    };
    shape.validate()?;
    Ok(shape)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn qwen3_config_json_matches_the_preset() {
        let doc = json!({
            "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
            "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
            "moe_intermediate_size": 768, "intermediate_size": 6144, "vocab_size": 151936,
            "tie_word_embeddings": false, "decoder_sparse_step": 1, "mlp_only_layers": []
        });
        let mut shape = parse_hf_config(&doc, "qwen3-30b-a3b", "test").unwrap();
        let preset = ModelShape::preset("qwen3-30b-a3b").unwrap();
        shape.dense_intermediate = preset.dense_intermediate;
        assert_eq!(shape, preset);
    }

    #[test]
    fn gpt_oss_accepts_num_local_experts_and_reads_the_layer_pattern() {
        let types: Vec<&str> =
            (0..36).map(|i| if i % 2 == 0 { "sliding_attention" } else { "full_attention" }).collect();
        let doc = json!({
            "model_type": "gpt_oss", "hidden_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64,
            "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 128, "experts_per_token": 4,
            "intermediate_size": 2880, "vocab_size": 201088, "sliding_window": 128, "layer_types": types
        });
        let shape = parse_hf_config(&doc, "gpt-oss-120b", "test").unwrap();
        let mut preset = ModelShape::preset("gpt-oss-120b").unwrap();
        preset.dense_intermediate = 2880;
        assert_eq!(shape, preset);
    }

    #[test]
    fn deepseek_v3_config_reads_mla_and_dense_prefix() {
        let doc = json!({
            "model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
            "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
            "moe_intermediate_size": 2048, "intermediate_size": 18432, "first_k_dense_replace": 3, "moe_layer_freq": 1,
            "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "vocab_size": 129280
        });
        let shape = parse_hf_config(&doc, "deepseek-v3", "test").unwrap();
        assert_eq!(shape, ModelShape::preset("deepseek-v3").unwrap());
    }

    #[test]
    fn missing_keys_and_unknown_families_are_named() {
        let e = parse_hf_config(&json!({"model_type": "llama"}), "x", "c.json").unwrap_err().to_string();
        assert!(e.contains("llama") && e.contains("qwen3_moe"), "{e}");
        let doc = json!({"model_type": "qwen3_moe", "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_experts_per_tok": 1, "vocab_size": 10});
        let e = parse_hf_config(&doc, "x", "c.json").unwrap_err().to_string();
        assert!(e.contains("num_experts | num_local_experts") && e.contains("c.json"), "{e}");
    }
}
