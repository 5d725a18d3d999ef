//! Parity with Hugging Face transformers (float32): logits, loss with the aux term, and the
//! gradient of every parameter after one backward pass.
//!
//! Fixtures come from `scripts/make_qwen3_fixtures.py` (tiny random checkpoints saved by
//! transformers' `save_pretrained`, plus reference outputs); CI needs no Python.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, Param, ParamId};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor};
use disagmoe_models::MoeCausalLm;
use safetensors::SafeTensors;

type B = Autodiff<Flex>;

fn fixtures() -> Vec<PathBuf> {
    family_fixtures("qwen3_moe")
}

fn family_fixtures(family: &str) -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures").join(family);
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .expect("fixtures/qwen3_moe exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("reference.safetensors").exists())
        .collect();
    dirs.sort();
    assert!(dirs.len() >= 2, "expected at least two fixture configs in {root:?}");
    dirs
}

struct Reference {
    tensors: HashMap<String, (Vec<usize>, Vec<f32>)>,
    ids: Vec<Vec<i64>>,
}

fn reference(dir: &Path) -> Reference {
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors = HashMap::new();
    let mut ids = Vec::new();
    for (name, view) in st.tensors() {
        if name == "input_ids" {
            let v: Vec<i64> = view.data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
            let s = view.shape()[1];
            ids = v.chunks(s).map(<[i64]>::to_vec).collect();
        } else {
            let v: Vec<f32> = view.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
            tensors.insert(name, (view.shape().to_vec(), v));
        }
    }
    Reference { tensors, ids }
}

fn rel_err(ours: &[f32], reference: &[f32]) -> f64 {
    assert_eq!(ours.len(), reference.len());
    let num: f64 = ours.iter().zip(reference).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    let den: f64 = reference.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

fn values<const D: usize>(t: Tensor<impl burn::tensor::backend::Backend, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec::<f32>().unwrap()
}

struct GradCollector<'a> {
    grads: &'a <B as AutodiffBackend>::Gradients,
    out: HashMap<ParamId, Vec<f32>>,
}

impl burn::module::ModuleVisitor<B> for GradCollector<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = param.val().grad(self.grads) {
            self.out.insert(param.id, values(g));
        }
    }
}

fn check_fixture(dir: &Path) {
    let name = dir.file_name().unwrap().to_string_lossy().to_string();
    let device = Default::default();
    let model = MoeCausalLm::<B>::from_pretrained(dir, &device).expect("fixture loads");
    let r = reference(dir);
    let ids: Tensor<B, 2, Int> = model.input_ids(&r.ids, &device).unwrap();

    let out = model.forward(ids.clone());
    let logits_err = rel_err(&values(out.logits.clone()), &r.tensors["logits"].1);
    assert!(logits_err <= 1e-4, "{name}: logits relative error {logits_err:.3e} > 1e-4");

    let loss = model.loss(&out, ids, true);
    let total = values(loss.total.clone())[0];
    let lm = values(loss.lm_loss.clone())[0];
    let aux = values(loss.aux_loss.clone().expect("MoE layers give an aux loss"))[0];
    for (what, ours, theirs) in
        [("loss", total, r.tensors["loss"].1[0]), ("lm_loss", lm, r.tensors["lm_loss"].1[0]), ("aux_loss", aux, r.tensors["aux_loss"].1[0])]
    {
        let err = ((ours - theirs) / theirs).abs();
        assert!(err <= 1e-5, "{name}: {what} {ours} vs transformers {theirs} (relative error {err:.2e})");
    }

    let grads = loss.total.backward();
    let mut collector = GradCollector { grads: &grads, out: HashMap::new() };
    model.visit(&mut collector);
    let names = model.state_dict().names_by_id();
    let mut checked = 0;
    let mut worst = (0.0f64, String::new());
    for (id, g) in &collector.out {
        let hf = &names[id];
        let (shape, expected) = r.tensors.get(&format!("grad.{hf}")).unwrap_or_else(|| panic!("{name}: no reference grad for {hf}"));
        assert_eq!(shape.iter().product::<usize>(), g.len(), "{name}: grad shape of {hf}");
        let err = rel_err(g, expected);
        assert!(err <= 1e-3, "{name}: gradient of {hf} relative error {err:.3e} > 1e-3");
        if err > worst.0 {
            worst = (err, hf.clone());
        }
        checked += 1;
    }
    let expected_params = r.tensors.keys().filter(|k| k.starts_with("grad.")).count();
    assert_eq!(checked, expected_params, "{name}: every parameter has a gradient");
    println!("{name}: logits rel err {logits_err:.2e}, loss {total} (aux {aux}), {checked} grads, worst {:.2e} ({})", worst.0, worst.1);
}

#[test]
fn qwen3_moe_logits_loss_and_gradients_match_transformers() {
    for dir in fixtures() {
        check_fixture(&dir);
    }
}

#[test]
fn gpt_oss_logits_loss_and_gradients_match_transformers() {
    // Includes `mxfp4`: expert weights stored as MXFP4 blocks and scales, dequantised on load; the
    // reference used transformers' own dequantisation.
    let dirs = family_fixtures("gpt_oss");
    assert!(dirs.iter().any(|d| d.ends_with("mxfp4")));
    for dir in dirs {
        check_fixture(&dir);
    }
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



