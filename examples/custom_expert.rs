//! The extension point, shown: a new expert type defined here, outside the crates, plugged into a
//! Qwen3-MoE model through the `Experts` trait, trained on the bundled corpus under
//! `--placement disagg` (its experts split over two expert workers by the trait's sharding hook).
//!
//! ```text
//! cargo run --release --example custom_expert                # 120 steps, disagg 1+2, as threads
//! cargo run --release --example custom_expert -- --steps 60  # any `disagmoe train` option works
//! cargo run --release --example custom_expert -- --placement ep --workers 2
//! ```
//!
//! The expert is GeGLU (Shazeer, "GLU Variants Improve Transformer"): `down(gelu(gate x) * up x)`,
//! with each projection of all experts stacked in one `[E, ...]` tensor. Everything else (the
//! attention, the router, the loss, the loop, the data, the metrics, the AF-Pipe runtime) is the
//! framework's: a family is a configuration type (`FamilyConfig`) naming its layer types, here
//! Qwen3-MoE's attention and router with this expert type.

use std::ops::Range;
use std::sync::atomic::AtomicBool;

use burn::module::{Module, Param};
use burn::tensor::activation::gelu;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use clap::{Args, FromArgMatches};
use disagmoe::cli::{init_logging, report, TrainArgs};
use disagmoe::core::model_shape::ModelShape;
use disagmoe::models::attention::GqaAttention;
use disagmoe::models::balance::AuxLoss;
use disagmoe::models::families::ModelDims;
use disagmoe::models::moe::map_groups;
use disagmoe::models::rope::Rope;
use disagmoe::models::{
    CheckpointReader, Experts, FamilyConfig, Init, ModelConfig, ModelError, Qwen3MoeConfig, Result, TensorSink,
    TopKRouter,
};
use disagmoe::train::{train_family, Placement, TrainBackend};

/// `E` GeGLU experts of width `M` and hidden size `I`, stacked: a shard of experts is a range of
/// rows of each tensor.
#[derive(Module, Debug)]
pub struct GegluExperts<B: Backend> {
    /// `[E, I, M]`
    gate: Param<Tensor<B, 3>>,
    /// `[E, I, M]`
    up: Param<Tensor<B, 3>>,
    /// `[E, M, I]`
    down: Param<Tensor<B, 3>>,
    /// Global id of expert 0 of this shard.
    #[module(skip)]
    first: usize,
}

impl<B: Backend> GegluExperts<B> {
    /// Experts `range` (global ids), drawn row by row from the run seed and their names, so a
    /// worker holding a shard builds exactly the rows of the whole layer's tensors.
    pub fn new(range: Range<usize>, hidden: usize, inter: usize, init: &Init<B>) -> Self {
        let n = range.len();
        Self {
            gate: Param::from_tensor(init.normal_rows("gate", [n, inter, hidden], range.start)),
            up: Param::from_tensor(init.normal_rows("up", [n, inter, hidden], range.start)),
            down: Param::from_tensor(init.normal_rows("down", [n, hidden, inter], range.start)),
            first: range.start,
        }
    }

    /// Expert `e`'s (local id) matrix of a stacked tensor.
    fn of(t: &Param<Tensor<B, 3>>, e: usize) -> Tensor<B, 2> {
        let [_, r, c] = t.dims();
        t.val().narrow(0, e, 1).reshape([r, c])
    }
}

impl<B: Backend> Experts<B> for GegluExperts<B> {
    fn num_experts(&self) -> usize {
        self.gate.dims()[0]
    }

    fn forward_grouped(&self, xs: Tensor<B, 2>, counts: &[usize]) -> Tensor<B, 2> {
        // Each expert on its block of rows (the framework sorted the rows by expert).
        map_groups(xs, counts, |e, x| {
            let g = gelu(x.clone().matmul(Self::of(&self.gate, e).transpose())); // [n, I]
            let u = x.matmul(Self::of(&self.up, e).transpose()); // [n, I]
            (g * u).matmul(Self::of(&self.down, e).transpose()) // [n, M]
        })
    }

    fn load(&mut self, ckpt: &mut CheckpointReader, prefix: &str, device: &B::Device) -> Result<()> {
        let read = |ckpt: &mut CheckpointReader, t: &Param<Tensor<B, 3>>, leaf: &str| -> Result<Tensor<B, 3>> {
            let [n, r, c] = t.dims();
            let rows = (0..n)
                .map(|e| {
                    let name = format!("{prefix}.{}.{leaf}.weight", self.first + e);
                    Ok(ckpt.tensor::<B, 2>(&name, [r, c], device)?.reshape([1, r, c]))
                })
                .collect::<Result<Vec<_>>>()?;
            Ok(Tensor::cat(rows, 0))
        };
        let (gate, up, down) = (
            read(ckpt, &self.gate, "gate_proj")?,
            read(ckpt, &self.up, "up_proj")?,
            read(ckpt, &self.down, "down_proj")?,
        );
        self.gate = Param::from_tensor(gate);
        self.up = Param::from_tensor(up);
        self.down = Param::from_tensor(down);
        Ok(())
    }

    fn save(&self, sink: &mut TensorSink, prefix: &str) {
        // One tensor per expert under its global id, as Qwen3-MoE names its experts.
        for (leaf, t) in [("gate_proj", &self.gate), ("up_proj", &self.up), ("down_proj", &self.down)] {
            for e in 0..self.num_experts() {
                sink.put(format!("{prefix}.{}.{leaf}.weight", self.first + e), Self::of(t, e));
            }
        }
    }

    /// All experts live in shared tensors: an optimizer steps every row whenever the layer saw a
    /// token, and every holder of a shard does the same.
    fn fused(&self) -> bool {
        true
    }

    /// The sharding hook: keep experts `range` (local ids), i.e. those rows of each tensor.
    fn shard(self, range: Range<usize>) -> Result<Self> {
        if range.end > self.num_experts() {
            return Err(ModelError::InvalidInput(format!(
                "expert shard {range:?} of a layer holding {} experts",
                self.num_experts()
            )));
        }
        let rows = |t: Param<Tensor<B, 3>>| Param::from_tensor(t.val().narrow(0, range.start, range.len()));
        Ok(Self { gate: rows(self.gate), up: rows(self.up), down: rows(self.down), first: self.first + range.start })
    }
}

/// Qwen3-MoE with GeGLU experts: the family's configuration, its layer types, and the one change.
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen3Geglu(Qwen3MoeConfig);

impl FamilyConfig for Qwen3Geglu {
    const MODEL_TYPE: &'static str = "qwen3_moe_geglu";
    type Attention<B: Backend> = GqaAttention<B>;
    type Router<B: Backend> = TopKRouter<B>;
    type Experts<B: Backend> = GegluExperts<B>;

    fn from_json_str(text: &str) -> Result<Self> {
        let mut v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| ModelError::InvalidInput(e.to_string()))?;
        v["model_type"] = "qwen3_moe".into();
        Ok(Self(<Qwen3MoeConfig as FamilyConfig>::from_json_str(&v.to_string())?))
    }
    fn to_hf_json(&self) -> serde_json::Value {
        let mut v = self.0.to_hf_json();
        v["model_type"] = Self::MODEL_TYPE.into();
        v["expert_act"] = "gelu".into();
        v
    }
    fn dims(&self) -> ModelDims {
        self.0.dims()
    }
    fn rope(&self) -> Rope {
        FamilyConfig::rope(&self.0)
    }
    fn is_sparse_layer(&self, layer: usize) -> bool {
        FamilyConfig::is_sparse_layer(&self.0, layer)
    }
    fn routed_experts(&self) -> usize {
        self.0.routed_experts()
    }
    fn attention<B: Backend>(&self, layer: usize, init: &Init<B>) -> GqaAttention<B> {
        self.0.attention(layer, init)
    }
    fn router<B: Backend>(&self, layer: usize, init: &Init<B>) -> TopKRouter<B> {
        self.0.router(layer, init)
    }
    /// The one change: GeGLU experts instead of SwiGLU ones.
    fn experts<B: Backend>(&self, _layer: usize, range: Range<usize>, init: &Init<B>) -> GegluExperts<B> {
        GegluExperts::new(range, self.0.hidden_size, self.0.moe_intermediate_size, init)
    }
    fn aux_loss(&self) -> Option<AuxLoss> {
        self.0.aux_loss()
    }
    fn aux_loss_by_default(&self) -> bool {
        self.0.aux_loss_by_default()
    }
    fn model_shape(&self, name: &str) -> ModelShape {
        self.0.model_shape(name)
    }
}

/// The two ways a holder gets a shard agree: built for its range (what the runtime does, so no
/// worker ever allocates the whole layer) and cut from the whole layer by `Experts::shard`.
fn check_sharding(c: &Qwen3MoeConfig) -> anyhow::Result<()> {
    type B = disagmoe::train::DefaultBackend;
    let device = Default::default();
    let init = Init::<B>::new(7, 0.02, &device).child("model.layers.0.mlp.experts");
    let e = c.num_experts;
    let (half, hidden, inter) = (e / 2, c.hidden_size, c.moe_intermediate_size);
    let whole = GegluExperts::<B>::new(0..e, hidden, inter, &init).shard(half..e)?;
    let built = GegluExperts::<B>::new(half..e, hidden, inter, &init);
    for (a, b) in [(&whole.gate, &built.gate), (&whole.up, &built.up), (&whole.down, &built.down)] {
        let host = |t: &Param<Tensor<B, 3>>| t.val().into_data().convert::<f32>().to_vec::<f32>().expect("f32");
        anyhow::ensure!(host(a) == host(b), "a shard differs from the same rows of the layer");
    }
    anyhow::ensure!(whole.first == built.first);
    Ok(())
}

fn main() {
    let command = TrainArgs::augment_args(clap::Command::new("custom_expert"))
        .about("Train a Qwen3-MoE with GeGLU experts defined outside the crates, under disagg");
    let args = TrainArgs::from_arg_matches(&command.get_matches()).unwrap_or_else(|e| e.exit());
    init_logging(args.quiet);
    if let Err(e) = run(args) {
        std::process::exit(report(&e));
    }
}

fn run(mut args: TrainArgs) -> anyhow::Result<()> {
    // Defaults of this example: the embedded tiny Qwen3-MoE's shape, 120 steps, 1 attention and 2
    // expert workers (each holding half of every layer's experts).
    args.model_preset.get_or_insert_with(|| "tiny-qwen3-moe".into());
    args.steps.get_or_insert(120);
    let mut cfg = args.run_config()?;
    if cfg.parallel.placement == Placement::Single {
        cfg.parallel.placement = Placement::Disagg;
        cfg.parallel.attn_workers = 1;
        cfg.parallel.ffn_workers = 2;
        cfg.parallel.groups = 1;
    }
    let ModelConfig::Qwen3Moe(qwen3) = cfg.model.resolve()? else {
        anyhow::bail!("this example swaps the experts of a Qwen3-MoE: give a qwen3_moe model");
    };
    check_sharding(&qwen3)?;
    let summary =
        train_family::<TrainBackend, _>(&cfg, Qwen3Geglu(qwen3), &Default::default(), &AtomicBool::new(false))?;
    eprintln!("{}", summary.for_people(cfg.out.as_deref()));
    println!("{}", serde_json::to_string(&summary)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `cargo test --example custom_expert` (run by `cargo test --workspace`): the GeGLU family
    /// learns under disagg 1+2, and its shards agree with the whole layer's rows.
    #[test]
    fn geglu_experts_learn_under_disagg() {
        let args = TrainArgs::from_arg_matches(
            &TrainArgs::augment_args(clap::Command::new("t"))
                .get_matches_from(["t", "--steps", "12", "--batch", "4", "--seq", "32", "--quiet"]),
        )
        .unwrap();
        let mut cfg = args.run_config().unwrap();
        cfg.parallel.placement = Placement::Disagg;
        (cfg.parallel.attn_workers, cfg.parallel.ffn_workers, cfg.parallel.groups) = (1, 2, 1);
        let ModelConfig::Qwen3Moe(qwen3) = cfg.model.resolve().unwrap() else { unreachable!("the default preset") };
        check_sharding(&qwen3).unwrap();
        let s = train_family::<TrainBackend, _>(&cfg, Qwen3Geglu(qwen3), &Default::default(), &AtomicBool::new(false))
            .unwrap();
        assert_eq!(s.params_per_rank[1], s.params_per_rank[2], "each expert worker holds half the experts");
        assert!(s.last_loss < 0.85 * s.first_loss, "{} -> {}", s.first_loss, s.last_loss);
    }
}
