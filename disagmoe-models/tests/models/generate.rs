//! Incremental decoding for every family: greedy tokens equal transformers' `generate` on the parity
//! fixtures (DeepSeekMoE: its composed reference run greedily), and decoding through the KV cache in
//! chunks of any size equals the full forward pass over the whole sequence (sliding windows, sinks,
//! MLA's latent cache and MXFP4 experts included).
//!
//! Fixtures: `generate.safetensors` next to each parity checkpoint, from
//! `scripts/make_generate_fixtures.py`; CI needs no Python.

use crate::common;

use std::path::Path;

use burn::tensor::{Int, Tensor, TensorData};
use disagmoe_models::generate::{generate, Sampling};
use disagmoe_models::{HfCheckpoint, MoeCausalLm};
use safetensors::SafeTensors;

type B = burn::backend::Flex;

const FAMILIES: [&str; 6] = ["qwen3_moe", "gpt_oss", "deepseek_v3", "mixtral", "olmoe", "deepseek"];

fn ids(view: &safetensors::tensor::TensorView) -> Vec<i64> {
    view.data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect()
}

fn model(dir: &Path) -> MoeCausalLm<B> {
    MoeCausalLm::<B>::from_pretrained(dir, &Default::default()).unwrap()
}

#[test]
fn greedy_tokens_equal_transformers_generate_for_every_family() {
    for family in FAMILIES {
        let mut checked = 0;
        for dir in common::fixtures(family) {
            let path = dir.join("generate.safetensors");
            if !path.exists() {
                // Only the MXFP4 checkpoint, which transformers cannot run on the CPU, has none.
                assert!(dir.ends_with("mxfp4"), "{}: no generate.safetensors", dir.display());
                continue;
            }
            let bytes = std::fs::read(&path).unwrap();
            let st = SafeTensors::deserialize(&bytes).unwrap();
            let (prompt, want) = (ids(&st.tensor("prompt").unwrap()), ids(&st.tensor("tokens").unwrap()));
            let m = model(&dir);
            let mut streamed = Vec::new();
            let got =
                generate(&m, &prompt, want.len(), &[], Sampling::greedy(), &Default::default(), |t| streamed.push(t))
                    .unwrap();
            assert_eq!(got, want, "{}: greedy tokens after {prompt:?}", dir.display());
            assert_eq!(streamed, got, "every token is handed out as it is chosen");
            checked += 1;
        }
        assert!(checked >= 2, "{family}: {checked} generation fixtures");
    }
}

#[test]
fn cached_decoding_equals_the_full_forward_for_every_family() {
    let device = Default::default();
    let mut worst = 0.0f32;
    for family in FAMILIES {
        for dir in common::fixtures(family) {
            let m = model(&dir);
            let vocab = m.config().vocab_size();
            // 21 positions: longer than every fixture's sliding window, fed as a prompt of 4, then
            // single tokens and chunks of 3 (a chunk's queries straddle a window's edge).
            let seq: Vec<i64> = (0..21).map(|i| ((i * 37 + 11) % vocab) as i64).collect();
            let full = m.forward(m.input_ids(std::slice::from_ref(&seq), &device).unwrap()).logits; // [1, 21, V]
            let full: Vec<f32> = full.into_data().to_vec().unwrap();
            let mut cache = m.new_cache();
            let mut cached = Vec::new();
            let mut at = 0;
            for chunk in [4, 1, 1, 3, 1, 3, 1, 1, 3, 1, 1, 1] {
                let part =
                    Tensor::<B, 2, Int>::from_data(TensorData::new(seq[at..at + chunk].to_vec(), [1, chunk]), &device);
                let logits: Vec<f32> = m.forward_cached(part, &mut cache).into_data().to_vec().unwrap();
                cached.extend(logits);
                at += chunk;
            }
            assert_eq!(at, seq.len());
            assert_eq!(cache.len, seq.len());
            let scale = full.iter().fold(0.0f32, |a, x| a.max(x.abs()));
            let diff = full.iter().zip(&cached).fold(0.0f32, |a, (x, y)| a.max((x - y).abs())) / scale;
            worst = worst.max(diff);
            assert!(
                diff < 7e-6,
                "{}: cached logits differ from the full pass by {diff:e} (relative to the largest)",
                dir.display()
            );
        }
    }
    eprintln!("largest difference, cached vs full forward: {worst:e} of the largest logit");
}

#[test]
fn a_windowed_layer_keeps_only_its_window() {
    // qwen3_moe/gqa4_no_norm_tied_window: sliding window 5 on every layer.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/qwen3_moe/gqa4_no_norm_tied_window");
    let m = model(&dir);
    let mut cache = m.new_cache();
    let device = Default::default();
    for t in 0..12i64 {
        m.forward_cached(Tensor::<B, 2, Int>::from_data(TensorData::new(vec![t], [1, 1]), &device), &mut cache);
    }
    assert_eq!(cache.len, 12);
    assert!(
        cache.layers.iter().all(|l| l.held() == 5),
        "{:?}",
        cache.layers.iter().map(|l| l.held()).collect::<Vec<_>>()
    );
}

#[test]
fn bad_prompts_are_refused_by_name() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/qwen3_moe/mha_top1");
    let m = model(&dir);
    let device = Default::default();
    let empty = generate(&m, &[], 4, &[], Sampling::greedy(), &device, |_| {}).unwrap_err().to_string();
    assert!(empty.contains("prompt"), "{empty}");
    let beyond = generate(&m, &[1, 10_000], 4, &[], Sampling::greedy(), &device, |_| {}).unwrap_err().to_string();
    assert!(beyond.contains("10000"), "{beyond}");
    // More new tokens than the model has positions (any huge count): refused before anything is
    // reserved, naming the most it can take.
    let max = m.config().max_positions().expect("a Qwen3-MoE config has max_position_embeddings");
    for n in [max, usize::MAX, 1_000_000_000_000_000_000] {
        let e = generate(&m, &[1, 2], n, &[], Sampling::greedy(), &device, |_| {}).unwrap_err().to_string();
        assert!(e.contains("max_position_embeddings") && e.contains(&format!("at most {}", max - 2)), "{n}: {e}");
    }
    assert_eq!(generate(&m, &[1, 2], 1, &[], Sampling::greedy(), &device, |_| {}).unwrap().len(), 1);
    // A stop token ends generation after it.
    let first = generate(&m, &[6, 62, 76, 27, 50], 1, &[], Sampling::greedy(), &device, |_| {}).unwrap();
    let stopped = generate(&m, &[6, 62, 76, 27, 50], 8, &first, Sampling::greedy(), &device, |_| {}).unwrap();
    assert_eq!(stopped, first);
}
