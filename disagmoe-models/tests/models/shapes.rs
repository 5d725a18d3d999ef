//! Each family describes itself to the planner in `disagmoe-core` (`FamilyConfig::model_shape`):
//! the Hub's `config.json` of a published model gives the planner's preset of that model.

use disagmoe_core::model_shape::ModelShape;
use disagmoe_models::ModelConfig;
use serde_json::json;

fn shape(doc: serde_json::Value, name: &str) -> ModelShape {
    let s = ModelConfig::from_json_str(&doc.to_string()).unwrap().model_shape(name);
    s.validate().unwrap();
    s
}

#[test]
fn qwen3_config_json_matches_the_preset() {
    let doc = json!({
        "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 768, "intermediate_size": 6144, "vocab_size": 151936,
        "tie_word_embeddings": false, "decoder_sparse_step": 1, "mlp_only_layers": []
    });
    let mut s = shape(doc, "qwen3-30b-a3b");
    let preset = ModelShape::preset("qwen3-30b-a3b").unwrap();
    s.dense_intermediate = preset.dense_intermediate;
    assert_eq!(s, preset);
}

#[test]
fn gpt_oss_accepts_num_local_experts_and_reads_the_layer_pattern() {
    let types: Vec<&str> = (0..36).map(|i| if i % 2 == 0 { "sliding_attention" } else { "full_attention" }).collect();
    let doc = json!({
        "model_type": "gpt_oss", "hidden_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 128, "num_experts_per_tok": 4,
        "intermediate_size": 2880, "vocab_size": 201088, "sliding_window": 128, "layer_types": types
    });
    assert_eq!(shape(doc, "gpt-oss-120b"), ModelShape::preset("gpt-oss-120b").unwrap());
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
    assert_eq!(shape(doc, "deepseek-v3"), ModelShape::preset("deepseek-v3").unwrap());
}

#[test]
fn deepseek_moe_mixtral_and_olmoe_hub_configs_match_the_presets() {
    let deepseek = json!({
        "model_type": "deepseek", "hidden_size": 2048, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 16, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
        "moe_intermediate_size": 1408, "intermediate_size": 10944, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "vocab_size": 102400, "tie_word_embeddings": false
    });
    assert_eq!(shape(deepseek, "deepseek-moe-16b"), ModelShape::preset("deepseek-moe-16b").unwrap());
    let mixtral = json!({
        "model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2,
        "vocab_size": 32000, "rope_theta": 1e6, "sliding_window": null, "torch_dtype": "bfloat16"
    });
    assert_eq!(shape(mixtral, "mixtral-8x7b"), ModelShape::preset("mixtral-8x7b").unwrap());
    let olmoe = json!({
        "model_type": "olmoe", "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 16,
        "num_key_value_heads": 16, "intermediate_size": 1024, "num_experts": 64, "num_experts_per_tok": 8,
        "vocab_size": 50304, "pad_token_id": 1, "clip_qkv": null, "norm_topk_prob": false
    });
    assert_eq!(shape(olmoe, "olmoe-1b-7b"), ModelShape::preset("olmoe-1b-7b").unwrap());
}

#[test]
fn missing_keys_and_unknown_families_are_named() {
    let e = ModelConfig::from_json_str(r#"{"model_type": "llama"}"#).unwrap_err().to_string();
    assert!(e.contains("llama") && e.contains("qwen3_moe") && e.contains("mixtral"), "{e}");
    let e = ModelConfig::from_json_str(r#"{"model_type": "qwen3_moe", "num_hidden_layers": 2, "vocab_size": 10}"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("hidden_size"), "{e}");
}
