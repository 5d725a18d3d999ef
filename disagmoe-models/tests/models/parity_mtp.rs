//! DeepSeek-V3's multi-token prediction against a reference built from transformers' DeepSeek-V3
//! pieces (`scripts/make_deepseek_mtp_fixtures.py`: the report's MTP module, embedding first as the
//! Hub's `eh_proj` expects), on tiny random checkpoints that carry the MTP layer in the Hub's
//! layout: the losses, every gradient (the MTP layer's and the shared embedding's and head's
//! included), the same under recomputation, and the checkpoint saved back unchanged.

use crate::common;

use std::collections::HashMap;
use std::path::Path;

use burn::module::AutodiffModule;
use disagmoe_models::{HfCheckpoint, ModelConfig, MoeCausalLm, MtpSettings, Recompute};

use common::{check_grads, collect_grads, reference, rel_err, values, Ad, GradReport, GRADS_TOL, LOGITS_TOL};

fn settings(dir: &Path) -> MtpSettings {
    MtpSettings { depth: 1, loss_coef: reference(dir).tensors["mtp_loss_coef"].1[0] as f64 }
}

fn load(dir: &Path) -> MoeCausalLm<Ad> {
    MoeCausalLm::<Ad>::from_pretrained_with(dir, settings(dir), &Default::default()).expect("fixture loads")
}

fn close(name: &str, what: &str, ours: f32, theirs: f32) {
    let err = ((ours - theirs) / theirs).abs();
    assert!(err <= 1e-5, "{name}: {what} {ours} vs the reference {theirs} (relative error {err:.2e})");
}

#[test]
fn the_mtp_loss_and_every_gradient_match_the_reference() {
    for dir in common::fixtures("deepseek_v3_mtp") {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let device = Default::default();
        let model = load(&dir);
        let r = reference(&dir);
        let ids = model.input_ids(&r.ids, &device).unwrap();
        let out = model.forward(ids.clone());
        let logits_err = rel_err(&values(out.logits.clone()), &r.tensors["logits"].1);
        assert!(logits_err <= LOGITS_TOL, "{name}: logits relative error {logits_err:.3e}");
        let loss = model.loss(&out, ids, true);
        let mtp = values(loss.mtp_loss.clone().expect("an MTP loss"))[0];
        close(&name, "mtp_loss", mtp, r.tensors["mtp_loss"].1[0]);
        close(&name, "lm_loss", values(loss.lm_loss.clone())[0], r.tensors["lm_loss"].1[0]);
        close(&name, "loss", values(loss.total.clone())[0], r.tensors["loss"].1[0]);
        let grads = collect_grads(&model, &loss.total.backward());
        let names = model.state_dict_names();
        let mtp_grads = grads.keys().filter(|id| names[*id].starts_with("model.layers.3.")).count();
        assert!(mtp_grads >= 10, "{name}: only {mtp_grads} gradients of the MTP layer");
        let GradReport { checked, unrouted, worst } = check_grads(&name, &grads, &names, &r, GRADS_TOL);
        println!(
            "{name}: mtp loss {mtp} (reference {}), {checked} grads ({mtp_grads} of the MTP layer, +{unrouted} zero ones), worst {:.2e} ({})",
            r.tensors["mtp_loss"].1[0], worst.0, worst.1
        );
    }
}

#[test]
fn recomputation_gives_the_same_mtp_gradients() {
    for dir in common::fixtures("deepseek_v3_mtp") {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let device = Default::default();
        let model = load(&dir);
        let r = reference(&dir);
        let ids = model.input_ids(&r.ids, &device).unwrap();
        let inner = model.valid();
        let mut grads: HashMap<burn::module::ParamId, Vec<f32>> = HashMap::new();
        let micro = model
            .backward_recomputed(&inner, ids, None, true, Recompute::Full, 1.0, &mut |g| {
                for (id, v) in collect_grads(&model, &g) {
                    let acc = grads.entry(id).or_insert_with(|| vec![0.0; v.len()]);
                    acc.iter_mut().zip(&v).for_each(|(a, b)| *a += b);
                }
            })
            .unwrap();
        close(&name, "mtp_loss (recomputed)", micro.mtp.expect("an MTP loss") as f32, r.tensors["mtp_loss"].1[0]);
        close(&name, "loss (recomputed)", micro.total as f32, r.tensors["loss"].1[0]);
        assert_eq!(micro.mtp_counts.len(), 1, "{name}: the MTP layer's expert counts");
        check_grads(&name, &grads, &model.state_dict_names(), &r, GRADS_TOL);
    }
}

#[test]
fn a_hub_checkpoint_with_mtp_weights_saves_them_back_unchanged() {
    for dir in common::fixtures("deepseek_v3_mtp") {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let model = load(&dir);
        let out = std::env::temp_dir().join(format!("disagmoe-mtp-roundtrip-{name}-{}", std::process::id()));
        model.save_pretrained(&out, usize::MAX).unwrap();
        let read = |d: &Path| {
            let mut ckpt = disagmoe_models::CheckpointReader::open(d).unwrap();
            let names = ckpt.names();
            names.into_iter().map(|n| (n.clone(), ckpt.read_f32(&n).unwrap())).collect::<HashMap<_, _>>()
        };
        let (original, saved) = (read(&dir), read(&out));
        let mut a: Vec<&String> = original.keys().collect();
        let mut b: Vec<&String> = saved.keys().collect();
        a.sort();
        b.sort();
        assert_eq!(a, b, "{name}: the saved tensors are the checkpoint's");
        assert!(a.iter().any(|n| n.ends_with("layers.3.shared_head.head.weight")), "{name}: the MTP layer is saved");
        for (n, t) in &original {
            assert!(saved[n] == *t, "{name}: {n} changed in the round trip");
        }
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
        assert_eq!(config["num_nextn_predict_layers"], 1);
        std::fs::remove_dir_all(&out).unwrap();
    }
}

#[test]
fn families_without_mtp_and_checkpoints_without_its_layer_are_refused_by_name() {
    let on = MtpSettings { depth: 1, loss_coef: 0.1 };
    let e = ModelConfig::preset("tiny-qwen3-moe").unwrap().with_mtp(on).unwrap_err().to_string();
    assert!(e.contains("qwen3_moe has no multi-token prediction module") && e.contains("allowed: 0"), "{e}");
    // The main fixtures carry no MTP layer.
    let dir = common::fixtures("deepseek_v3").remove(0);
    let e = MoeCausalLm::<Ad>::from_pretrained_with(&dir, on, &Default::default()).unwrap_err().to_string();
    assert!(e.contains("no multi-token prediction module at layer 3") && e.contains("--mtp-depth 0"), "{e}");
    // Without MTP the layer is skipped as before, and nothing of it is trained.
    let dir = common::fixtures("deepseek_v3_mtp").remove(0);
    let off = MoeCausalLm::<Ad>::from_pretrained(&dir, &Default::default()).unwrap();
    assert!(off.state_dict_names().values().all(|n| !n.starts_with("model.layers.3.")));
}
