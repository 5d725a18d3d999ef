//! Parity with their reference implementations (float32) of the families added through the family
//! registry: Mixtral and OLMoE (transformers) and DeepSeekMoE (DeepSeek's `modeling_deepseek.py`):
//! logits, the loss with its balance term, and the gradient of every parameter, on f32 and bf16
//! checkpoints; both `config.json` spellings; the published sizes.
//!
//! Fixtures come from `scripts/make_{mixtral,olmoe,deepseek_moe}_fixtures.py`; CI needs no Python.

use crate::common;

use common::{check_fixture, reference, rel_err, values, LOGITS_TOL};
use disagmoe_models::families::deepseek::DeepseekConfig;
use disagmoe_models::{HfCheckpoint, ModelConfig, MoeCausalLm};

fn check_family(family: &str) {
    let dirs = common::fixtures(family);
    assert!(dirs.iter().any(|d| d.to_string_lossy().ends_with("_bf16")), "{family}: a bf16 checkpoint is covered");
    for dir in dirs {
        check_fixture(&dir);
    }
}

fn check_family_reference_path(family: &str) {
    disagmoe_kernels::cpu::set_enabled_for_thread(Some(false));
    for dir in common::fixtures(family) {
        check_fixture(&dir);
    }
    disagmoe_kernels::cpu::set_enabled_for_thread(None);
}

#[test]
fn mixtral_logits_loss_and_gradients_match_transformers() {
    check_family("mixtral");
}

#[test]
fn olmoe_logits_loss_and_gradients_match_transformers() {
    // Includes a padding token whose embedding row gets no gradient, and clipped q/k/v.
    check_family("olmoe");
}

#[test]
fn deepseek_moe_logits_loss_and_gradients_match_deepseeks_model() {
    check_family("deepseek");
}

#[test]
fn the_reference_operations_match_too() {
    for family in ["mixtral", "olmoe", "deepseek"] {
        check_family_reference_path(family);
    }
}

/// `config.json` in the other spelling: transformers 4.x (`rope_theta`, `torch_dtype`) for what
/// current transformers wrote, and the current one (`rope_parameters`, `dtype`) for the Hub's.
fn other_spelling(text: &str) -> String {
    let mut v: serde_json::Value = serde_json::from_str(text).unwrap();
    let o = v.as_object_mut().unwrap();
    if let Some(p) = o.remove("rope_parameters") {
        o.insert("rope_theta".into(), p["rope_theta"].clone());
        let kind = p.get("rope_type").and_then(|t| t.as_str()).unwrap_or("default");
        o.insert("rope_scaling".into(), if kind == "default" { serde_json::Value::Null } else { p.clone() });
    } else if let Some(theta) = o.remove("rope_theta") {
        o.remove("rope_scaling");
        o.insert("rope_parameters".into(), serde_json::json!({"rope_type": "default", "rope_theta": theta}));
    }
    if let Some(d) = o.remove("dtype") {
        o.insert("torch_dtype".into(), d);
    } else if let Some(d) = o.remove("torch_dtype") {
        o.insert("dtype".into(), d);
    }
    for (a, b) in [("num_local_experts", "num_experts"), ("num_experts", "num_local_experts")] {
        if o.get("model_type").and_then(|t| t.as_str()) != Some("deepseek") {
            if let Some(n) = o.remove(a) {
                o.insert(b.into(), n);
                break;
            }
        }
    }
    v.to_string()
}

#[test]
fn both_config_spellings_load_the_same_model() {
    let device = Default::default();
    for family in ["mixtral", "olmoe", "deepseek"] {
        for dir in common::fixtures(family) {
            let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
            let (a, b) = (
                ModelConfig::from_json_str(&text).unwrap(),
                ModelConfig::from_json_str(&other_spelling(&text)).unwrap(),
            );
            assert_eq!(a.to_hf_json(), b.to_hf_json(), "{dir:?}");
            // Loaded under the other spelling, the checkpoint gives the same logits.
            let tmp = tempfile::tempdir().unwrap();
            for f in std::fs::read_dir(&dir).unwrap() {
                let f = f.unwrap().path();
                std::fs::copy(&f, tmp.path().join(f.file_name().unwrap())).unwrap();
            }
            std::fs::write(tmp.path().join("config.json"), other_spelling(&text)).unwrap();
            let model = MoeCausalLm::<burn::backend::Flex>::from_pretrained(tmp.path(), &device).unwrap();
            let r = reference(&dir);
            let ids = model.input_ids(&r.ids, &device).unwrap();
            let err = rel_err(&values(model.forward(ids).logits), &r.tensors["logits"].1);
            assert!(err <= LOGITS_TOL, "{dir:?} in the other spelling: logits relative error {err:.2e}");
        }
    }
}

/// deepseek-ai/deepseek-moe-16b-base's `config.json` as the Hub spells it.
const HUB_16B: &str = r#"{
  "architectures": ["DeepseekForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekConfig", "AutoModel": "modeling_deepseek.DeepseekModel",
               "AutoModelForCausalLM": "modeling_deepseek.DeepseekForCausalLM"},
  "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1,
  "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944,
  "max_position_embeddings": 4096, "model_type": "deepseek", "moe_intermediate_size": 1408, "moe_layer_freq": 1,
  "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": false, "num_attention_heads": 16,
  "num_experts_per_tok": 6, "num_hidden_layers": 28, "num_key_value_heads": 16, "pretraining_tp": 1,
  "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 10000, "scoring_func": "softmax", "seq_aux": true,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.36.0", "use_cache": true,
  "vocab_size": 102400
}"#;

#[test]
fn deepseek_moe_16b_is_the_real_architecture_with_16_4b_parameters() {
    let hub = DeepseekConfig::from_json_str(HUB_16B).unwrap();
    let preset = DeepseekConfig::deepseek_moe_16b();
    assert_eq!(DeepseekConfig { initializer_range: preset.initializer_range, ..hub.clone() }, preset);
    let p = ModelConfig::Deepseek(hub).model_shape("deepseek-moe-16b").param_counts();
    let (total, active) = (p.total / 1e9, p.active / 1e9);
    println!("deepseek-moe-16b: {total:.2}B total, {active:.2}B active");
    assert!((total / 16.4 - 1.0).abs() < 0.02, "total {total:.2}B");
    assert!((active / 2.8 - 1.0).abs() < 0.02, "active {active:.2}B");
    // Without shared experts (`null`) and without routed experts (every layer dense).
    let none = HUB_16B.replace(r#""n_shared_experts": 2"#, r#""n_shared_experts": null"#);
    assert_eq!(DeepseekConfig::from_json_str(&none).unwrap().n_shared_experts, 0);
    let dense = HUB_16B.replace(r#""n_routed_experts": 64"#, r#""n_routed_experts": null"#);
    let dense = DeepseekConfig::from_json_str(&dense).unwrap();
    assert!((0..28).all(|l| !dense.is_sparse_layer(l)));
    // moe_layer_freq 2: dense below first_k_dense_replace and on odd layers.
    let freq =
        DeepseekConfig::from_json_str(&HUB_16B.replace(r#""moe_layer_freq": 1"#, r#""moe_layer_freq": 2"#)).unwrap();
    assert_eq!((0..6).filter(|&l| freq.is_sparse_layer(l)).collect::<Vec<_>>(), vec![2, 4]);
}

#[test]
fn saved_checkpoints_reload_bit_exact_for_the_new_families() {
    let device = Default::default();
    for family in ["mixtral", "olmoe", "deepseek"] {
        let dir = &common::fixtures(family)[0];
        let model = MoeCausalLm::<burn::backend::Flex>::from_pretrained(dir, &device).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        model.save_pretrained(tmp.path(), 64 * 1024).unwrap();
        let again = MoeCausalLm::<burn::backend::Flex>::from_pretrained(tmp.path(), &device).unwrap();
        let r = reference(dir);
        let ids = model.input_ids(&r.ids, &device).unwrap();
        assert_eq!(values(model.forward(ids.clone()).logits), values(again.forward(ids).logits), "{family}");
    }
}
