//! DeepSeek-V3 parity with Hugging Face transformers (float32): logits, loss, and the gradient of
//! every parameter after one backward pass; plus checkpoint I/O (round trip, fused experts, MTP
//! layers) and aux-loss-free balancing (the correction bias moves only through `update_bias`).
//!
//! Fixtures come from `scripts/make_deepseek_fixtures.py` (tiny random checkpoints saved by
//! transformers' `save_pretrained`, random correction biases, plus reference outputs); CI needs no
//! Python.

use crate::common;

use std::path::{Path, PathBuf};

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::Tensor;
use common::{check_fixture, collect_grads, reference, rel_err, values};
use disagmoe_models::HfCheckpoint;
use disagmoe_models::{DeepseekV3Config, DeepseekV3ForCausalLM, TensorSink};
use safetensors::SafeTensors;

type B = Autodiff<Flex>;

fn fixtures() -> Vec<PathBuf> {
    common::fixtures("deepseek_v3")
}

fn check_deepseek_fixture(dir: &Path) {
    let (model, grads) = check_fixture(dir);
    let names = model.state_dict_names();
    let biases_without_grad =
        names.iter().filter(|(_, n)| n.ends_with("e_score_correction_bias")).all(|(id, _)| !grads.contains_key(id));
    assert!(biases_without_grad, "{dir:?}: a correction bias got a gradient");
}

#[test]
fn logits_loss_and_gradients_match_transformers() {
    for dir in fixtures() {
        check_deepseek_fixture(&dir);
    }
}

#[test]
fn reference_operations_match_transformers_too() {
    disagmoe_kernels::cpu::set_enabled_for_thread(Some(false));
    for dir in fixtures() {
        check_deepseek_fixture(&dir);
    }
    disagmoe_kernels::cpu::set_enabled_for_thread(None);
}

fn logits_of(model: &DeepseekV3ForCausalLM<Flex>, dir: &Path) -> Vec<f32> {
    let r = reference(dir);
    let ids = model.input_ids(&r.ids, &Default::default()).unwrap();
    values(model.forward(ids).logits)
}

#[test]
fn saved_checkpoint_reloads_bit_exact() {
    for dir in fixtures() {
        let device = Default::default();
        let model = DeepseekV3ForCausalLM::<Flex>::from_pretrained(&dir, &device).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        model.save_pretrained(tmp.path(), 32 * 1024).unwrap(); // small shards: exercises the index
        assert!(tmp.path().join("model.safetensors.index.json").exists());
        let again = DeepseekV3ForCausalLM::<Flex>::from_pretrained(tmp.path(), &device).unwrap();
        assert_eq!(again.config(), model.config());
        assert_eq!(logits_of(&model, &dir), logits_of(&again, &dir));
        // Same tensor names as the transformers checkpoint, correction biases included.
        let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let theirs = st.names().into_iter().map(|n| n.to_string()).collect::<std::collections::BTreeSet<_>>();
        let sink = model.state_dict();
        let ours = sink.names().map(str::to_owned).collect::<std::collections::BTreeSet<_>>();
        assert_eq!(ours, theirs);
    }
}

/// Rewrites a fixture through `edit` (which may add or replace tensors) into a temporary directory.
fn rewritten(dir: &Path, edit: impl FnOnce(&TensorSink) -> TensorSink) -> tempfile::TempDir {
    let model = DeepseekV3ForCausalLM::<Flex>::from_pretrained(dir, &Default::default()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(dir.join("config.json"), tmp.path().join("config.json")).unwrap();
    edit(&model.state_dict()).write(tmp.path(), usize::MAX).unwrap();
    tmp
}

fn copy_sink(sink: &TensorSink, keep: impl Fn(&str) -> bool) -> TensorSink {
    let mut out = TensorSink::new();
    for n in sink.names().filter(|n| keep(n)) {
        let (s, v) = sink.get(n).unwrap();
        out.put_raw(n.to_owned(), s.to_vec(), v.to_vec());
    }
    out
}

#[test]
fn multi_token_prediction_layer_is_skipped_on_load() {
    let dir = &fixtures()[0];
    let layers = DeepseekV3Config::from_file(dir.join("config.json")).unwrap().num_hidden_layers;
    let tmp = rewritten(dir, |sink| {
        let mut out = copy_sink(sink, |_| true);
        // What a Hub checkpoint stores for its MTP module (names from DeepSeek-V3's release).
        for (suffix, shape) in
            [("eh_proj.weight", vec![4, 8]), ("enorm.weight", vec![4]), ("mlp.experts.0.up_proj.weight", vec![3, 4])]
        {
            let n: usize = shape.iter().product();
            out.put_raw(format!("model.layers.{layers}.{suffix}"), shape, vec![0.5; n]);
        }
        out
    });
    let model = DeepseekV3ForCausalLM::<Flex>::from_pretrained(tmp.path(), &Default::default())
        .expect("MTP tensors are skipped");
    let original = DeepseekV3ForCausalLM::<Flex>::from_pretrained(dir, &Default::default()).unwrap();
    assert_eq!(logits_of(&model, dir), logits_of(&original, dir));
}

#[test]
fn fused_expert_layout_loads() {
    for dir in fixtures() {
        let config = DeepseekV3Config::from_file(dir.join("config.json")).unwrap();
        let (e, i, m) = (config.n_routed_experts, config.moe_intermediate_size, config.hidden_size);
        let tmp = rewritten(&dir, |sink| {
            let mut out = copy_sink(sink, |n| !n.contains(".mlp.experts."));
            for l in (0..config.num_hidden_layers).filter(|&l| config.is_sparse_layer(l)) {
                let p = format!("model.layers.{l}.mlp.experts");
                let get = |j: usize, w: &str| sink.get(&format!("{p}.{j}.{w}_proj.weight")).unwrap().1.to_vec();
                // transformers 5's in-memory layout: gate_up_proj [E, 2I, M] (gate rows first), down_proj [E, M, I].
                let gate_up: Vec<f32> = (0..e).flat_map(|j| [get(j, "gate"), get(j, "up")].concat()).collect();
                let down: Vec<f32> = (0..e).flat_map(|j| get(j, "down")).collect();
                out.put_raw(format!("{p}.gate_up_proj"), vec![e, 2 * i, m], gate_up);
                out.put_raw(format!("{p}.down_proj"), vec![e, m, i], down);
            }
            out
        });
        let fused = DeepseekV3ForCausalLM::<Flex>::from_pretrained(tmp.path(), &Default::default()).unwrap();
        let original = DeepseekV3ForCausalLM::<Flex>::from_pretrained(&dir, &Default::default()).unwrap();
        assert_eq!(logits_of(&fused, &dir), logits_of(&original, &dir));
    }
}

fn biases(model: &DeepseekV3ForCausalLM<B>) -> Vec<Vec<f32>> {
    model.routers().map(|r| r.bias_values()).collect()
}

fn router_weights(model: &DeepseekV3ForCausalLM<B>) -> Vec<Vec<f32>> {
    model.routers().map(|r| values(r.weight.val())).collect()
}

#[test]
fn optimizer_steps_leave_the_correction_bias_and_update_bias_moves_it() {
    let dir = &fixtures()[0];
    let device = Default::default();
    let mut model = DeepseekV3ForCausalLM::<B>::from_pretrained(dir, &device).unwrap();
    let r = reference(dir);
    let ids = model.input_ids(&r.ids, &device).unwrap();
    let bias0 = biases(&model);
    let weights0 = router_weights(&model);
    let mut optim = AdamConfig::new().with_weight_decay(Some(burn::optim::decay::WeightDecayConfig::new(0.1))).init();
    let mut counts = Vec::new();
    for _ in 0..3 {
        let out = model.forward(ids.clone());
        counts = out.router_stats.iter().map(|s| s.counts.clone()).collect::<Vec<_>>();
        let loss = model.loss(&out, ids.clone(), true);
        let grads = GradientsParams::from_grads(loss.total.backward(), &model);
        model = optim.step(1e-2, model, grads);
    }
    assert_eq!(biases(&model), bias0, "optimizer steps must not touch e_score_correction_bias");
    assert_ne!(router_weights(&model), weights0, "the router weights do train");

    let rate = 1e-3;
    model.update_router_biases(&counts, rate).unwrap();
    for ((after, before), c) in biases(&model).iter().zip(&bias0).zip(&counts) {
        let mean = c.iter().sum::<usize>() as f64 / c.len() as f64;
        for ((a, b), &n) in after.iter().zip(before).zip(c) {
            let expected = *b as f64 + rate * (mean - n as f64).signum() * if n as f64 == mean { 0.0 } else { 1.0 };
            assert!(
                (*a as f64 - expected).abs() < 1e-7,
                "bias {b} with load {n} (mean {mean}) became {a}, expected {expected}"
            );
        }
    }
    // The updated bias is still a buffer: another optimizer step leaves it where update_bias put it.
    let updated = biases(&model);
    let out = model.forward(ids.clone());
    let grads = GradientsParams::from_grads(model.loss(&out, ids, false).total.backward(), &model);
    model = optim.step(1e-2, model, grads);
    assert_eq!(biases(&model), updated);
    assert!(model.update_router_biases(&counts[..1], rate).is_err(), "one count vector per MoE layer");
}

#[test]
fn parameter_count_matches_a_built_model() {
    for dir in fixtures() {
        let model = DeepseekV3ForCausalLM::<Flex>::from_pretrained(&dir, &Default::default()).unwrap();
        let built = model.num_params() as u64;
        let biases: u64 = model.routers().map(|r| r.bias_values().len() as u64).sum();
        assert_eq!(model.config().num_parameters(), built - biases);
    }
}

#[test]
fn grouped_moe_matches_the_per_token_path_gradients_included() {
    let device = Default::default();
    for dir in fixtures() {
        let model = DeepseekV3ForCausalLM::<B>::from_pretrained(&dir, &device).unwrap();
        let m = model.config().hidden_size;
        let layer = (0..model.config().num_hidden_layers).find(|&l| model.config().is_sparse_layer(l)).unwrap();
        let moe = model.layers[layer].mlp.moe().unwrap();
        let x = Tensor::<B, 3>::random([2, 7, m], burn::tensor::Distribution::Normal(0.0, 1.0), &device);
        // Each path's backward before the next forward: graphs sharing the parameters' nodes
        // while another thread runs a backward can lose their leaves (Burn's autodiff cleanup).
        let grouped = moe.forward(x.clone()).0;
        let g1 = collect_grads(moe, &grouped.clone().sum().backward());
        let per_token = moe.forward_per_token(x);
        let g2 = collect_grads(moe, &per_token.clone().sum().backward());
        let err = rel_err(&values(grouped), &values(per_token));
        assert!(err < 1e-6, "outputs differ: {err:.2e}");
        assert_eq!(g1.len(), g2.len());
        for (id, g) in &g1 {
            let err = rel_err(g, &g2[id]);
            assert!(err < 1e-5, "gradient differs: {err:.2e}");
        }
    }
}
