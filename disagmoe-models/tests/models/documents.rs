//! Document masks in the models: attention within each document of a packed row, the loss over
//! the targets inside documents. Every family (GQA with q/k norms, sliding windows and sinks,
//! MLA, multi-token prediction), the whole-model step and the recomputed one, and parity with
//! transformers run with a block-diagonal mask.

use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::activation::log_softmax;
use burn::tensor::{Int, Tensor};
use disagmoe_models::{model_presets, Documents, ModelConfig, MoeCausalLm, MtpSettings, Recompute};

use crate::common;
use common::{collect_params as collect, rel_err as rel};

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

/// Every document of a packed row is that document run alone (from position 0), for every family,
/// whether rotary positions continue over the row or restart at each document: rotary embeddings
/// make a score depend on `i - j` only, which shifting a whole document keeps, so the two differ by
/// rounding alone (transformers measures the same: `scripts/make_document_fixtures.py`).
#[test]
fn every_document_is_its_own_sequence_whether_positions_restart_or_not() {
    let device = Default::default();
    for (name, config) in cases() {
        let model = config.init::<B>(7, &device);
        let vocab = config.vocab_size() as i64;
        let rows = rows(vocab, 0);
        let ids = model.input_ids(&rows, &device).unwrap();
        let continuing = model.forward_documents(ids.clone(), Some(&documents())).logits;
        let restarting = model.forward_documents(ids, Some(&documents().restarting_positions())).logits;
        for (row, range) in [(0, 0..5), (0, 5..SEQ), (1, 0..3), (1, 3..8), (1, 8..SEQ)] {
            if name.contains("MTP") && range.len() <= 3 {
                continue; // too short for the second MTP module to predict anything alone
            }
            let alone = model.forward(model.input_ids(&[rows[row][range.clone()].to_vec()], &device).unwrap()).logits;
            let alone = values(alone);
            for (how, packed) in [("continuing", &continuing), ("restarting", &restarting)] {
                let pick = values(packed.clone().narrow(0, row, 1).narrow(1, range.start, range.len()));
                let d = pick.iter().zip(&alone).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
                assert!(d <= 1e-5, "{name}: positions {how}, row {row} document {range:?} vs alone: {d:.2e}");
            }
        }
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

/// The committed `documents.safetensors` of the parity fixtures (`scripts/make_document_fixtures.py`:
/// transformers, eager attention, a block-diagonal causal mask, the targets that begin a document
/// ignored): our logits within the parity tests' 5e-6 and the loss within 1e-5, relative. GQA
/// (Qwen3-MoE, OLMoE), a window on every layer (Mixtral), windows and sinks (GPT-OSS), MLA
/// (DeepSeek-V3).
#[test]
fn transformers_gives_the_same_logits_and_loss_under_a_document_mask() {
    use disagmoe_models::HfCheckpoint;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures");
    let mut dirs: Vec<std::path::PathBuf> = std::fs::read_dir(&root)
        .unwrap()
        .flat_map(|family| std::fs::read_dir(family.unwrap().path()).into_iter().flatten())
        .map(|d| d.unwrap().path())
        .filter(|d| d.join("documents.safetensors").exists())
        .collect();
    dirs.sort();
    assert!(dirs.len() >= 5, "document fixtures: {dirs:?}");
    let device = Default::default();
    for dir in dirs {
        let name = dir.strip_prefix(&root).unwrap().display().to_string();
        let bytes = std::fs::read(dir.join("documents.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let ints = |k: &str| -> (Vec<usize>, Vec<i64>) {
            let v = st.tensor(k).unwrap();
            (v.shape().to_vec(), v.data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect())
        };
        let floats = |k: &str| -> Vec<f32> {
            st.tensor(k).unwrap().data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
        };
        let (shape, ids) = ints("input_ids");
        let (_, starts) = ints("doc_starts");
        let s = shape[1];
        let cuts: Vec<Vec<usize>> =
            starts.chunks(s).map(|row| (1..s).filter(|&i| row[i] == i as i64).collect()).collect();
        assert!(cuts.iter().filter(|c| !c.is_empty()).count() >= 1, "{name}: {cuts:?}");
        let docs = Documents::new(s, &cuts).unwrap();
        let model = MoeCausalLm::<B>::from_pretrained(&dir, &device).expect("fixture loads");
        let rows: Vec<Vec<i64>> = ids.chunks(s).map(<[i64]>::to_vec).collect();
        let ids = model.input_ids(&rows, &device).unwrap();
        let out = model.forward_documents(ids.clone(), Some(&docs));
        let err = rel(&values(out.logits.clone()), &floats("logits"));
        assert!(err <= common::LOGITS_TOL, "{name}: logits relative error {err:.3e} > {:e}", common::LOGITS_TOL);
        let ours = values(model.loss(&out, ids.clone(), false).lm_loss)[0];
        let theirs = floats("lm_loss")[0];
        let loss_err = ((ours - theirs) / theirs).abs();
        assert!(loss_err <= 1e-5, "{name}: loss {ours} vs transformers {theirs} ({loss_err:.2e})");
        // Positions restarting at each document (transformers' position_ids from each start).
        let restart = docs.clone().restarting_positions();
        let out = model.forward_documents(ids.clone(), Some(&restart));
        let restart_err = rel(&values(out.logits.clone()), &floats("logits_restart"));
        assert!(restart_err <= common::LOGITS_TOL, "{name}: restarting positions, logits error {restart_err:.3e}");
        let ours = values(model.loss(&out, ids, false).lm_loss)[0];
        let theirs = floats("lm_loss_restart")[0];
        assert!(((ours - theirs) / theirs).abs() <= 1e-5, "{name}: restarting positions, loss {ours} vs {theirs}");
        println!(
            "{name}: cuts {cuts:?}, logits rel err {err:.2e} (restarting positions {restart_err:.2e}), loss rel err \
             {loss_err:.2e}"
        );
    }
}
