//! Helpers shared by the parity tests of every family: fixture discovery, the reference file
//! written by `scripts/make_*_fixtures.py`, relative error, and gradient collection by parameter id.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::Tensor;
use safetensors::SafeTensors;

/// The fixture directories (those with a `reference.safetensors`) under `fixtures/{family}`, sorted;
/// at least two.
pub fn fixtures(family: &str) -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures").join(family);
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("fixtures/{family}: {e}"))
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("reference.safetensors").exists())
        .collect();
    dirs.sort();
    assert!(dirs.len() >= 2, "expected at least two fixture configs in {root:?}");
    dirs
}

/// What transformers computed on a fixture.
pub struct Reference {
    /// f32 tensors by name (`logits`, `loss`, `grad.<hub name>`, ...): shape and values.
    pub tensors: HashMap<String, (Vec<usize>, Vec<f32>)>,
    /// `input_ids` as rows.
    pub ids: Vec<Vec<i64>>,
}

/// Reads `dir/reference.safetensors`.
pub fn reference(dir: &Path) -> Reference {
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

/// `||ours - reference|| / ||reference||`.
pub fn rel_err(ours: &[f32], reference: &[f32]) -> f64 {
    assert_eq!(ours.len(), reference.len());
    let num: f64 = ours.iter().zip(reference).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    let den: f64 = reference.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

/// A tensor's values as f32.
pub fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec::<f32>().unwrap()
}

struct GradCollector<'a, B: AutodiffBackend> {
    grads: &'a B::Gradients,
    out: HashMap<ParamId, Vec<f32>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for GradCollector<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = param.val().grad(self.grads) {
            self.out.insert(param.id, values(g));
        }
    }
}

/// The gradient of every parameter that has one, by parameter id.
pub fn collect_grads<B: AutodiffBackend, M: Module<B>>(model: &M, grads: &B::Gradients) -> HashMap<ParamId, Vec<f32>> {
    let mut collector = GradCollector::<B> { grads, out: HashMap::new() };
    model.visit(&mut collector);
    collector.out
}

struct ParamsCollector<'a> {
    grads: &'a GradientsParams,
    out: HashMap<ParamId, Vec<f32>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for ParamsCollector<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) {
            self.out.insert(param.id, values(g));
        }
    }
}

/// The gradient of every parameter in `grads` (an accumulator's), by parameter id.
pub fn collect_params<B: AutodiffBackend, M: Module<B>>(
    model: &M,
    grads: &GradientsParams,
) -> HashMap<ParamId, Vec<f32>> {
    let mut collector = ParamsCollector { grads, out: HashMap::new() };
    model.visit(&mut collector);
    collector.out
}

/// What [`check_grads`] found.
pub struct GradReport {
    /// Gradients compared with the reference.
    pub checked: usize,
    /// Reference gradients of parameters outside our graph (experts no token chose): all zero.
    pub unrouted: usize,
    /// The largest relative error and its parameter.
    pub worst: (f64, String),
}

/// Compares every gradient we have (`grads` by parameter id, `names` the Hub name of each id) with
/// `grad.<hub name>` of the reference, within `tol` relative error. A reference gradient we lack must
/// belong to an expert and be all zeros (transformers reports zeros for an expert no token chose;
/// ours is outside the graph).
pub fn check_grads(
    fixture: &str,
    grads: &HashMap<ParamId, Vec<f32>>,
    names: &HashMap<ParamId, String>,
    r: &Reference,
    tol: f64,
) -> GradReport {
    let mut report = GradReport { checked: 0, unrouted: 0, worst: (0.0, String::new()) };
    for (id, g) in grads {
        let hf = &names[id];
        let (shape, expected) =
            r.tensors.get(&format!("grad.{hf}")).unwrap_or_else(|| panic!("{fixture}: no reference grad for {hf}"));
        assert_eq!(shape.iter().product::<usize>(), g.len(), "{fixture}: grad shape of {hf}");
        let err = rel_err(g, expected);
        assert!(err <= tol, "{fixture}: gradient of {hf} relative error {err:.3e} > {tol:e}");
        if err > report.worst.0 {
            report.worst = (err, hf.clone());
        }
        report.checked += 1;
    }
    let seen: std::collections::HashSet<&str> = grads.keys().map(|id| names[id].as_str()).collect();
    for (k, (_, g)) in r.tensors.iter().filter(|(k, _)| k.starts_with("grad.")) {
        let hf = &k["grad.".len()..];
        if !seen.contains(hf) {
            assert!(hf.contains(".experts."), "{fixture}: no gradient for {hf}");
            assert!(
                g.iter().all(|x| *x == 0.0),
                "{fixture}: {hf} has no gradient here but a non-zero one in transformers"
            );
            report.unrouted += 1;
        }
    }
    report
}

/// Relative error allowed on logits against transformers (ten times the worst measured).
pub const LOGITS_TOL: f64 = 5e-6;
/// Relative error allowed on each parameter gradient against transformers (the same rule).
pub const GRADS_TOL: f64 = 5e-5;

/// The autodiff backend of the parity tests.
pub type Ad = burn::backend::Autodiff<burn::backend::Flex>;

/// Checks one fixture of any family against transformers: logits (relative error <= 5e-6), the
/// loss and its parts (aux only where the reference has one), and every parameter gradient
/// (<= 5e-5). The tolerances are ten times the worst we measure over every fixture (logits 5.2e-7,
/// gradients 3.9e-6, 2026-12-01): a regression of a tenth of what a wrong formula gives fails.
/// Returns the model and its gradients for family-specific checks.
pub fn check_fixture(dir: &Path) -> (disagmoe_models::MoeCausalLm<Ad>, HashMap<ParamId, Vec<f32>>) {
    use disagmoe_models::HfCheckpoint;
    let name = dir.file_name().unwrap().to_string_lossy().to_string();
    let device = Default::default();
    let model = disagmoe_models::MoeCausalLm::<Ad>::from_pretrained(dir, &device).expect("fixture loads");
    let r = reference(dir);
    let ids = model.input_ids(&r.ids, &device).unwrap();

    let out = model.forward(ids.clone());
    let logits_err = rel_err(&values(out.logits.clone()), &r.tensors["logits"].1);
    assert!(logits_err <= LOGITS_TOL, "{name}: logits relative error {logits_err:.3e} > {LOGITS_TOL:e}");

    let loss = model.loss(&out, ids, true);
    let mut parts = vec![("loss", values(loss.total.clone())[0]), ("lm_loss", values(loss.lm_loss.clone())[0])];
    match (&loss.aux_loss, r.tensors.get("aux_loss")) {
        (Some(aux), Some(_)) => parts.push(("aux_loss", values(aux.clone())[0])),
        (None, None) => {}
        (ours, _) => panic!("{name}: aux loss present here: {}, in transformers: {}", ours.is_some(), !ours.is_some()),
    }
    for (what, ours) in parts {
        let theirs = r.tensors[what].1[0];
        let err = ((ours - theirs) / theirs).abs();
        assert!(err <= 1e-5, "{name}: {what} {ours} vs transformers {theirs} (relative error {err:.2e})");
    }

    let grads = collect_grads(&model, &loss.total.backward());
    let GradReport { checked, unrouted, worst } = check_grads(&name, &grads, &model.state_dict_names(), &r, GRADS_TOL);
    println!(
        "{name}: logits rel err {logits_err:.2e}, {checked} grads (+{unrouted} zero ones of unrouted experts), worst {:.2e} ({})",
        worst.0, worst.1
    );
    (model, grads)
}
