//! Document masks in the models: attention within each document of a packed row, the loss over
//! the targets inside documents. Every family (GQA with q/k norms, sliding windows and sinks,
//! MLA, multi-token prediction), the whole-model step and the recomputed one.

use std::collections::HashMap;

use burn::backend::{Autodiff, Flex};
use burn::module::{AutodiffModule, Module, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::activation::log_softmax;
use burn::tensor::{Int, Tensor};
use disagmoe_models::{model_presets, Documents, ModelConfig, MoeCausalLm, MtpSettings, Recompute};

type B = Autodiff<Flex>;

const SEQ: usize = 12;

/// Every tiny preset, and DeepSeek-V3's with two multi-token prediction modules.
fn cases() -> Vec<(String, ModelConfig)> {
    let mut cases: Vec<(String, ModelConfig)> = model_presets()
        .iter()
        .filter(|(n, _)| n.starts_with("tiny-"))
        .map(|(n, _)| (n.to_string(), ModelConfig::preset(n).unwrap()))
        .collect();
    let mtp = MtpSettings { depth: 2, loss_coef: 0.3 };
    cases.push((
        "tiny-deepseek-v3, MTP 2".into(),
        ModelConfig::preset("tiny-deepseek-v3").unwrap().with_mtp(mtp).unwrap(),
    ));
    cases
}

/// Two rows of `SEQ` tokens: row 0 holds documents `0..5`, `5..12`; row 1 `0..3`, `3..8`, `8..12`.
fn documents() -> Documents {
    Documents::new(SEQ, &[vec![5], vec![3, 8]]).unwrap()
}

fn rows(vocab: i64, salt: i64) -> Vec<Vec<i64>> {
    (0..2).map(|r| (0..SEQ as i64).map(|t| (r * 31 + t * 7 + 3 + salt * (t + 5)) % vocab).collect()).collect()
}

fn values<const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec().unwrap()
}

/// Largest absolute difference between the logits `[B, S, V]` of `a` and `b` at row `row`,
/// positions `range`.
fn logits_diff(a: &Tensor<B, 3>, b: &Tensor<B, 3>, row: usize, range: std::ops::Range<usize>) -> f32 {
    let pick = |t: &Tensor<B, 3>| values(t.clone().narrow(0, row, 1).narrow(1, range.start, range.len()));
    pick(a).iter().zip(pick(b)).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn attention_stays_within_each_document_for_every_family() {
    let device = Default::default();
    let docs = documents();
    for (name, config) in cases() {
        let model = config.init::<B>(7, &device);
        let vocab = config.vocab_size() as i64;
        let ids = model.input_ids(&rows(vocab, 0), &device).unwrap();
        let masked = model.forward_documents(ids.clone(), Some(&docs)).logits;

        // Rows of one document each: no mask at all.
        let whole = model.forward_documents(ids.clone(), Some(&Documents::whole(2, SEQ))).logits;
        let plain = model.forward(ids.clone()).logits;
        let d = logits_diff(&whole, &plain, 0, 0..SEQ).max(logits_diff(&whole, &plain, 1, 0..SEQ));
        assert!(d <= 1e-6, "{name}: a mask of whole rows changed the logits by {d:.2e}");

        // A row's first document is that document run alone.
        let alone = model.forward(model.input_ids(&[rows(vocab, 0)[0][..5].to_vec()], &device).unwrap()).logits;
        let d = logits_diff(&masked, &alone, 0, 0..5);
        assert!(d <= 1e-5, "{name}: the first document differs from itself alone by {d:.2e}");

        // Later documents do not see the earlier ones: other tokens there change nothing in the
        // last document of each row (and, without the mask, they do).
        let mut other = rows(vocab, 0);
        let changed = rows(vocab, 1);
        other[0][..5].copy_from_slice(&changed[0][..5]);
        other[1][..8].copy_from_slice(&changed[1][..8]);
        let other = model.input_ids(&other, &device).unwrap();
        let masked_other = model.forward_documents(other.clone(), Some(&docs)).logits;
        let d = logits_diff(&masked, &masked_other, 0, 5..SEQ).max(logits_diff(&masked, &masked_other, 1, 8..SEQ));
        assert!(d <= 1e-5, "{name}: an earlier document moved a later one's logits by {d:.2e}");
        let plain_other = model.forward(other).logits;
        let seen = logits_diff(&plain, &plain_other, 0, 5..SEQ);
        assert!(seen > 1e-3, "{name}: without the mask the earlier tokens should matter ({seen:.2e})");
    }
}

#[test]
fn the_loss_counts_only_the_targets_inside_documents() {
    let device = Default::default();
    let docs = documents();
    for (name, config) in cases() {
        let model = config.init::<B>(7, &device);
        let vocab = config.vocab_size();
        let ids = model.input_ids(&rows(vocab as i64, 0), &device).unwrap();
        let out = model.forward_documents(ids.clone(), Some(&docs));
        let got = model.loss(&out, ids.clone(), false).lm_loss.into_scalar() as f64;
        // The mean over targets whose token is in its position's document, from the logits.
        let n = 2 * (SEQ - 1);
        let logp = values(log_softmax(out.logits.clone().narrow(1, 0, SEQ - 1).reshape([n, vocab]), 1));
        let labels: Vec<i64> = rows(vocab as i64, 0).iter().flat_map(|r| r[1..].to_vec()).collect();
        let crosses = docs.crosses();
        assert_eq!(crosses.iter().filter(|&&c| c).count(), 3, "one target per cut is ignored");
        let kept: Vec<f64> =
            (0..n).filter(|&i| !crosses[i]).map(|i| logp[i * vocab + labels[i] as usize] as f64).collect();
        let want = -kept.iter().sum::<f64>() / kept.len() as f64;
        assert!((got - want).abs() <= 1e-5 * want.abs(), "{name}: loss {got} vs {want} over the kept targets");
        // Without the mask the crossing targets count as well.
        let all = model.loss(&model.forward(ids.clone()), ids, false).lm_loss.into_scalar() as f64;
        assert!((all - got).abs() > 1e-4, "{name}: the mask should change the loss ({all} vs {got})");
    }
}

/// Every parameter's gradient, by id.
struct Collect<'a> {
    grads: &'a GradientsParams,
    out: HashMap<ParamId, Vec<f32>>,
}

impl ModuleVisitor<B> for Collect<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.get::<Flex, D>(param.id) {
            self.out.insert(param.id, g.into_data().convert::<f32>().to_vec().unwrap());
        }
    }
}

fn collect(model: &MoeCausalLm<B>, grads: &GradientsParams) -> HashMap<ParamId, Vec<f32>> {
    let mut c = Collect { grads, out: HashMap::new() };
    model.visit(&mut c);
    c.out
}

fn rel(a: &[f32], b: &[f32]) -> f64 {
    let d: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let n: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (d / n.max(1e-30)).sqrt()
}

#[test]
fn recomputation_gives_the_masked_step_for_every_family() {
    let device = Default::default();
    let docs = documents();
    for (name, config) in cases() {
        let model = config.init::<B>(7, &device);
        let ids: Tensor<B, 2, Int> = model.input_ids(&rows(config.vocab_size() as i64, 0), &device).unwrap();
        let out = model.forward_documents(ids.clone(), Some(&docs));
        let loss = model.loss(&out, ids.clone(), true);
        let total = loss.total.clone().into_scalar() as f64;
        let mtp = loss.mtp_loss.clone().map(|m| m.into_scalar() as f64);
        let want = collect(&model, &GradientsParams::from_grads(loss.total.backward(), &model));
        let inner = model.valid();
        for recompute in [Recompute::None, Recompute::Full] {
            let mut acc = GradientsAccumulator::<MoeCausalLm<B>>::new();
            let got = model
                .backward_recomputed(&inner, ids.clone(), Some(&docs), true, recompute, 1.0, &mut |g| {
                    acc.accumulate(&model, GradientsParams::from_grads(g, &model))
                })
                .unwrap();
            assert!(
                (got.total - total).abs() <= 1e-6 * total.abs(),
                "{name} {recompute}: loss {} vs {total}",
                got.total
            );
            if let (Some(a), Some(b)) = (got.mtp, mtp) {
                assert!((a - b).abs() <= 1e-6 * b.abs(), "{name} {recompute}: MTP loss {a} vs {b}");
            }
            assert_eq!(got.mtp.is_some(), mtp.is_some(), "{name}: the MTP loss when trained");
            let got = collect(&model, &acc.grads());
            assert_eq!(got.len(), want.len(), "{name} {recompute}: every parameter has a gradient");
            let worst = want.iter().map(|(id, w)| rel(&got[id], w)).fold(0.0, f64::max);
            assert!(worst <= 1e-5, "{name} {recompute}: worst relative gradient error {worst:.2e}");
        }
    }
}

#[test]
fn the_mtp_loss_ignores_targets_past_a_document_end() {
    // Module k (1-based) at position i predicts the token k + 1 ahead: with documents of 2
    // tokens, depth 1 has no target inside a document, so its loss is zero; the main loss
    // (1 ahead) still has one per document.
    let device = Default::default();
    let config =
        ModelConfig::preset("tiny-deepseek-v3").unwrap().with_mtp(MtpSettings { depth: 1, loss_coef: 0.3 }).unwrap();
    let model = config.init::<B>(7, &device);
    let ids = model.input_ids(&rows(config.vocab_size() as i64, 0), &device).unwrap();
    let pairs = Documents::new(SEQ, &[(1..SEQ / 2).map(|i| 2 * i).collect(), vec![2, 4, 6, 8, 10]]).unwrap();
    let out = model.forward_documents(ids.clone(), Some(&pairs));
    let parts = model.loss(&out, ids, false);
    assert_eq!(parts.mtp_loss.unwrap().into_scalar(), 0.0, "no MTP target lies inside a 2-token document");
    assert!(parts.lm_loss.into_scalar() > 0.0);
}
