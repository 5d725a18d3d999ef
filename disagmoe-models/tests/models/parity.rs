//! Parity with Hugging Face transformers (float32): logits, loss with the aux term, and the
//! gradient of every parameter after one backward pass.
//!
//! Fixtures come from `scripts/make_qwen3_fixtures.py` (tiny random checkpoints saved by
//! transformers' `save_pretrained`, plus reference outputs); CI needs no Python.

use crate::common;

use std::path::PathBuf;

use burn::backend::Flex;
use common::{check_fixture, reference, rel_err, values};
use disagmoe_models::{HfCheckpoint, MoeCausalLm};

fn fixtures() -> Vec<PathBuf> {
    common::fixtures("qwen3_moe")
}

#[test]
fn qwen3_moe_logits_loss_and_gradients_match_transformers() {
    // On Autodiff<Flex> this runs the fused CPU operations (attention, RMSNorm, RoPE, SwiGLU,
    // linear layers, cross-entropy); the test below holds the reference compositions to the same
    // fixtures.
    assert!(disagmoe_kernels::fused::available::<burn::backend::Autodiff<Flex>>());
    for dir in fixtures() {
        check_fixture(&dir);
    }
}

#[test]
fn qwen3_moe_reference_operations_match_transformers_too() {
    disagmoe_kernels::cpu::set_enabled_for_thread(Some(false));
    assert!(!disagmoe_kernels::fused::available::<burn::backend::Autodiff<Flex>>());
    for dir in fixtures() {
        check_fixture(&dir);
    }
    disagmoe_kernels::cpu::set_enabled_for_thread(None);
}

#[test]
fn gpt_oss_logits_loss_and_gradients_match_transformers() {
    // Includes `mxfp4`: expert weights stored as MXFP4 blocks and scales, dequantised on load; the
    // reference used transformers' own dequantisation.
    let dirs = common::fixtures("gpt_oss");
    assert!(dirs.iter().any(|d| d.ends_with("mxfp4")));
    for dir in dirs {
        check_fixture(&dir);
    }
}

#[test]
fn gpt_oss_reference_operations_match_transformers_too() {
    disagmoe_kernels::cpu::set_enabled_for_thread(Some(false));
    for dir in common::fixtures("gpt_oss") {
        check_fixture(&dir);
    }
    disagmoe_kernels::cpu::set_enabled_for_thread(None);
}

#[test]
fn saved_checkpoint_reloads_bit_exact() {
    let dir = &fixtures()[0];
    let device = Default::default();
    let model = MoeCausalLm::<Flex>::from_pretrained(dir, &device).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    model.save_pretrained(tmp.path(), 64 * 1024).unwrap(); // small shards: exercises the index
    assert!(tmp.path().join("model.safetensors.index.json").exists());
    let again = MoeCausalLm::<Flex>::from_pretrained(tmp.path(), &device).unwrap();
    let r = reference(dir);
    let ids = model.input_ids(&r.ids, &device).unwrap();
    let a = values(model.forward(ids.clone()).logits);
    let b = values(again.forward(ids).logits);
    assert_eq!(a, b);
}

#[test]
fn bf16_and_f16_checkpoints_load() {
    use safetensors::tensor::{Dtype, TensorView};
    let dir = &fixtures()[0];
    let device = Default::default();
    let model = MoeCausalLm::<Flex>::from_pretrained(dir, &device).unwrap();
    let sink = model.state_dict();
    for (dtype, tol) in [(Dtype::BF16, 2e-2), (Dtype::F16, 2e-3)] {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::copy(dir.join("config.json"), tmp.path().join("config.json")).unwrap();
        let encoded: Vec<(String, Vec<usize>, Vec<u8>)> = sink
            .names()
            .map(|n| {
                let (shape, v) = sink.get(n).unwrap();
                let bytes = v
                    .iter()
                    .flat_map(|x| match dtype {
                        Dtype::BF16 => half::bf16::from_f32(*x).to_le_bytes(),
                        _ => half::f16::from_f32(*x).to_le_bytes(),
                    })
                    .collect();
                (n.to_owned(), shape.to_vec(), bytes)
            })
            .collect();
        let views: Vec<(String, TensorView)> =
            encoded.iter().map(|(n, s, b)| (n.clone(), TensorView::new(dtype, s.clone(), b).unwrap())).collect();
        safetensors::serialize_to_file(views, None, &tmp.path().join("model.safetensors")).unwrap();
        let low = MoeCausalLm::<Flex>::from_pretrained(tmp.path(), &device).unwrap();
        let r = reference(dir);
        let ids = model.input_ids(&r.ids, &device).unwrap();
        let err = rel_err(&values(low.forward(ids).logits), &r.tensors["logits"].1);
        assert!(err < tol, "{dtype:?} checkpoint: logits relative error {err:.2e}");
    }
}
