//! Activation recomputation gives the whole-model step's loss and gradients: every family, every
//! setting, with the balance loss and the router z-loss on.

use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use burn::optim::{GradientsAccumulator, GradientsParams};
use disagmoe_models::{model_presets, ModelConfig, MoeCausalLm, Recompute, RoutingOptions};

use crate::common;
use common::{collect_params as collect, rel_err as rel};

type B = Autodiff<Flex>;

#[test]
fn every_setting_gives_the_whole_model_gradients_for_every_family() {
    let device = Default::default();
    // A micro-batch of two: the loss over 2.
    let scale = 0.5;
    // Every tiny preset, and one with the head tied to the embedding (its gradient comes from
    // the head's block and from the embedding's: added).
    let mut cases: Vec<(String, ModelConfig)> = model_presets()
        .iter()
        .filter(|(n, _)| n.starts_with("tiny-"))
        .map(|(n, _)| (n.to_string(), ModelConfig::preset(n).unwrap()))
        .collect();
    let (_, qwen) = model_presets().into_iter().find(|(n, _)| *n == "tiny-qwen3-moe").unwrap();
    let tied = qwen.replace("\"tie_word_embeddings\": false", "\"tie_word_embeddings\": true");
    assert_ne!(tied, qwen);
    cases.push(("tiny-qwen3-moe, tied".into(), ModelConfig::from_json_str(&tied).unwrap()));
    for (name, config) in &cases {
        let mut model = config.init::<B>(11, &device);
        model.set_routing(RoutingOptions { z_loss_coef: 1e-2, ..Default::default() });
        let vocab = config.vocab_size() as i64;
        let rows: Vec<Vec<i64>> = (0..2).map(|r| (0..12).map(|t| (r * 31 + t * 7 + 3) % vocab).collect()).collect();
        let ids = model.input_ids(&rows, &device).unwrap();
        // The whole-model step.
        let out = model.forward(ids.clone());
        let loss = model.loss(&out, ids.clone(), true);
        let total: f64 = loss.total.clone().into_scalar() as f64;
        let want = collect(&model, &GradientsParams::from_grads(loss.total.mul_scalar(scale).backward(), &model));
        assert!(!want.is_empty());
        let inner = model.valid();
        for recompute in [Recompute::None, Recompute::Experts, Recompute::Attention, Recompute::Full] {
            let mut acc = GradientsAccumulator::<MoeCausalLm<B>>::new();
            let got = model
                .backward_recomputed(&inner, ids.clone(), None, true, recompute, scale, &mut |g| {
                    acc.accumulate(&model, GradientsParams::from_grads(g, &model))
                })
                .unwrap();
            assert!(
                (got.total - total).abs() <= 1e-6 * total.abs(),
                "{name} {recompute}: loss {} vs {total}",
                got.total
            );
            assert!(got.z.is_some(), "{name}: the z-loss is on");
            assert_eq!(got.aux.is_some(), loss.aux_loss.is_some(), "{name}: the balance loss when the family has one");
            assert_eq!(got.counts.len(), out.router_stats.len(), "{name}: one count vector per routed layer");
            for (c, s) in got.counts.iter().zip(&out.router_stats) {
                assert_eq!(c, &s.counts, "{name} {recompute}: the same routing");
            }
            let got = collect(&model, &acc.grads());
            assert_eq!(got.len(), want.len(), "{name} {recompute}: every parameter has a gradient");
            let worst = want.iter().map(|(id, w)| rel(&got[id], w)).fold(0.0, f64::max);
            assert!(worst <= 1e-5, "{name} {recompute}: worst relative gradient error {worst:.2e}");
        }
    }
}
