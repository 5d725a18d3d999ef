//! Experts behind the [`Experts`] trait (step 3 of the layer): the trait, [`map_groups`], and
//! the SwiGLU experts and MLP most families use.

use burn::module::{Module, Param};
use burn::tensor::activation::silu;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::error::{ModelError, Result};
use crate::init::Init;
use crate::nn::Linear;
use crate::weights::{CheckpointReader, TensorSink};

/// A set of `E` experts computed group by group.
///
/// Implement this to add an expert type; [`SparseMoeBlock`] does the routing, dispatch and combine.
///
/// # Example
///
/// A toy expert type (each expert scales its rows by its own learned factor), plugged into a
/// sparse MoE block beside the framework's router; `examples/custom_expert.rs` trains a real one
/// (GeGLU) under `--placement disagg`.
///
/// ```
/// use burn::module::{Module, Param};
/// use burn::tensor::{backend::Backend, Distribution, Tensor};
/// use disagmoe_models::moe::{map_groups, Experts, SparseMoeBlock, TopKRouter};
/// use disagmoe_models::{CheckpointReader, Init, Result, TensorSink};
///
/// #[derive(Module, Debug)]
/// struct ScaleExperts<B: Backend> {
///     scale: Param<Tensor<B, 1>>, // [E]
/// }
///
/// impl<B: Backend> Experts<B> for ScaleExperts<B> {
///     fn num_experts(&self) -> usize {
///         self.scale.dims()[0]
///     }
///     fn forward_grouped(&self, xs: Tensor<B, 2>, counts: &[usize]) -> Tensor<B, 2> {
///         // Rows arrive sorted by expert: `counts[e]` rows for expert `e`.
///         map_groups(xs, counts, |e, x| x * self.scale.val().narrow(0, e, 1).unsqueeze::<2>())
///     }
///     fn load(&mut self, ckpt: &mut CheckpointReader, prefix: &str, device: &B::Device) -> Result<()> {
///         let e = self.num_experts();
///         self.scale = Param::from_tensor(ckpt.tensor(&format!("{prefix}.scale"), [e], device)?);
///         Ok(())
///     }
///     fn save(&self, sink: &mut TensorSink, prefix: &str) {
///         sink.put_param(format!("{prefix}.scale"), &self.scale);
///     }
/// }
///
/// type B = burn::backend::Flex;
/// let device = Default::default();
/// let router = TopKRouter::new(16, 4, 2, true, &Init::<B>::new(1, 0.5, &device));
/// let experts = ScaleExperts { scale: Param::from_tensor(Tensor::<B, 1>::ones([4], &device)) };
/// let block = SparseMoeBlock::new(router, experts);
/// let x = Tensor::<B, 3>::random([2, 5, 16], Distribution::Normal(0.0, 1.0), &device);
/// let (y, stats) = block.forward(x);
/// assert_eq!(y.dims(), [2, 5, 16]);
/// assert_eq!(stats.counts.iter().sum::<usize>(), 2 * 5 * 2); // every token to its top-2
/// ```
pub trait Experts<B: Backend> {
    /// Number of experts `E`.
    fn num_experts(&self) -> usize;

    /// Runs every expert on its block of rows.
    ///
    /// # Shapes
    /// - xs: `[N, M]`, rows sorted by expert, `counts[e]` rows for expert `e` (`sum(counts) == N`)
    /// - output: `[N, M]`, in the same row order
    fn forward_grouped(&self, xs: Tensor<B, 2>, counts: &[usize]) -> Tensor<B, 2>;

    /// Loads the experts' weights from a checkpoint (`prefix` is e.g. `model.layers.3.mlp.experts`).
    fn load(&mut self, ckpt: &mut CheckpointReader, prefix: &str, device: &B::Device) -> Result<()>;

    /// Saves the experts' weights under the names [`Experts::load`] reads.
    fn save(&self, sink: &mut TensorSink, prefix: &str);

    /// Whether all experts live in shared tensors (a fused `[E, ...]` layout). An optimizer then
    /// steps every expert of a layer whenever any of them saw a token (the others with a zero
    /// gradient), and a holder of a shard must do the same to stay equivalent.
    fn fused(&self) -> bool {
        false
    }

    /// Keeps experts `range` (local ids) and drops the others, for expert parallelism; the kept
    /// experts keep their checkpoint names. Expert types that do not implement it run on one
    /// holder per layer only.
    fn shard(self, range: std::ops::Range<usize>) -> Result<Self>
    where
        Self: Sized,
    {
        Err(ModelError::InvalidInput(format!(
            "this expert type cannot be split across devices (experts {range:?} requested); implement Experts::shard"
        )))
    }
}

/// Applies `f(e, rows_of_e)` to each non-empty expert block of `xs` and concatenates the results.
///
/// # Shapes
/// - xs: `[N, M]` grouped by `counts`; `f` maps `[counts[e], M] -> [counts[e], M']`; output `[N, M']`
pub fn map_groups<B: Backend>(
    xs: Tensor<B, 2>,
    counts: &[usize],
    mut f: impl FnMut(usize, Tensor<B, 2>) -> Tensor<B, 2>,
) -> Tensor<B, 2> {
    let mut outs = Vec::with_capacity(counts.len());
    let mut start = 0;
    for (e, &c) in counts.iter().enumerate() {
        if c > 0 {
            outs.push(f(e, xs.clone().narrow(0, start, c)));
        }
        start += c;
    }
    Tensor::cat(outs, 0)
}

/// SwiGLU feed-forward `down(silu(gate(x)) * up(x))`: one routed expert, or the dense MLP.
#[derive(Module, Debug)]
pub struct SwiGluMlp<B: Backend> {
    /// `[I, M]`
    pub gate_proj: Linear<B>,
    /// `[I, M]`
    pub up_proj: Linear<B>,
    /// `[M, I]`
    pub down_proj: Linear<B>,
}

impl<B: Backend> SwiGluMlp<B> {
    /// A freshly initialised MLP of width `hidden` and intermediate size `inter`, its projections
    /// named `gate_proj`, `up_proj`, `down_proj` below `init`'s prefix.
    pub fn new(hidden: usize, inter: usize, init: &Init<B>) -> Self {
        Self::named(hidden, inter, ExpertNames::HF, init)
    }

    /// [`SwiGluMlp::new`] with the projections named by `names`.
    pub fn named(hidden: usize, inter: usize, names: ExpertNames, init: &Init<B>) -> Self {
        Self {
            gate_proj: Linear::new(hidden, inter, false, &init.child(names.gate)),
            up_proj: Linear::new(hidden, inter, false, &init.child(names.up)),
            down_proj: Linear::new(inter, hidden, false, &init.child(names.down)),
        }
    }

    /// # Shapes
    /// - x: `[..., M]` -> `[..., M]`
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let (g, u) = (self.gate_proj.forward(x.clone()), self.up_proj.forward(x));
        let h = disagmoe_kernels::fused::swiglu(g.clone(), u.clone()).unwrap_or_else(|| silu(g) * u);
        self.down_proj.forward(h)
    }

    /// Loads `{prefix}.{gate,up,down}_proj.weight`.
    pub fn load(&mut self, ckpt: &mut CheckpointReader, prefix: &str, device: &B::Device) -> Result<()> {
        self.load_named(ckpt, prefix, ExpertNames::HF, device)
    }

    /// Loads `{prefix}.{names}.weight`.
    pub fn load_named(
        &mut self,
        ckpt: &mut CheckpointReader,
        prefix: &str,
        names: ExpertNames,
        device: &B::Device,
    ) -> Result<()> {
        self.gate_proj.load(ckpt, &format!("{prefix}.{}", names.gate), device)?;
        self.up_proj.load(ckpt, &format!("{prefix}.{}", names.up), device)?;
        self.down_proj.load(ckpt, &format!("{prefix}.{}", names.down), device)
    }

    /// Saves under the names [`SwiGluMlp::load`] reads.
    pub fn save(&self, sink: &mut TensorSink, prefix: &str) {
        self.save_named(sink, prefix, ExpertNames::HF)
    }

    /// Saves under the names [`SwiGluMlp::load_named`] reads.
    pub fn save_named(&self, sink: &mut TensorSink, prefix: &str, names: ExpertNames) {
        self.gate_proj.save(sink, &format!("{prefix}.{}", names.gate));
        self.up_proj.save(sink, &format!("{prefix}.{}", names.up));
        self.down_proj.save(sink, &format!("{prefix}.{}", names.down));
    }
}

/// Checkpoint names of a SwiGLU MLP's three projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertNames {
    /// The gate projection (`silu` side).
    pub gate: &'static str,
    /// The up projection.
    pub up: &'static str,
    /// The down projection.
    pub down: &'static str,
}

impl ExpertNames {
    /// `gate_proj`, `up_proj`, `down_proj` (Qwen3-MoE, OLMoE, DeepSeek).
    pub const HF: Self = Self { gate: "gate_proj", up: "up_proj", down: "down_proj" };
    /// `w1`, `w3`, `w2` (Mixtral: gate = w1, up = w3, down = w2).
    pub const MIXTRAL: Self = Self { gate: "w1", up: "w3", down: "w2" };
}

/// SwiGLU experts (Qwen3-MoE, Mixtral, OLMoE, DeepSeek routed experts), each an MLP of its own
/// named `{prefix}.{j}.{gate,up,down}` in checkpoints (`j` the expert's global index).
#[derive(Module, Debug)]
pub struct SwiGluExperts<B: Backend> {
    /// One MLP per expert held.
    pub experts: Vec<SwiGluMlp<B>>,
    /// Global index of the first expert held.
    #[module(skip)]
    pub first: usize,
    /// Checkpoint names of each expert's projections.
    #[module(skip)]
    pub names: ExpertNames,
}

impl<B: Backend> SwiGluExperts<B> {
    /// Experts `range` (global indices) of a layer, freshly initialised; `init` is scoped to the
    /// experts' prefix (`model.layers.3.mlp.experts`).
    pub fn new(range: std::ops::Range<usize>, hidden: usize, inter: usize, names: ExpertNames, init: &Init<B>) -> Self {
        let experts =
            range.clone().map(|j| SwiGluMlp::named(hidden, inter, names, &init.child(j.to_string()))).collect();
        Self { experts, first: range.start, names }
    }
}

impl<B: Backend> Experts<B> for SwiGluExperts<B> {
    fn num_experts(&self) -> usize {
        self.experts.len()
    }

    fn forward_grouped(&self, xs: Tensor<B, 2>, counts: &[usize]) -> Tensor<B, 2> {
        // Expert projections have no biases (`SwiGluMlp` builds and loads none).
        let weights: Vec<_> = self
            .experts
            .iter()
            .map(|e| (e.gate_proj.weight.val(), e.up_proj.weight.val(), e.down_proj.weight.val()))
            .collect();
        disagmoe_kernels::fused::swiglu_experts(xs.clone(), counts, &weights)
            .unwrap_or_else(|| disagmoe_kernels::reference::swiglu_experts(xs, counts, &weights))
    }

    /// Reads the Hub's per-expert names (`{prefix}.{j}.gate_proj.weight`, ...) or, when those are
    /// absent, the fused layout transformers 5 keeps in memory (`{prefix}.gate_up_proj`
    /// `[E, 2I, M]` with gate rows first, `{prefix}.down_proj` `[E, M, I]`).
    fn load(&mut self, ckpt: &mut CheckpointReader, prefix: &str, device: &B::Device) -> Result<()> {
        let fused = format!("{prefix}.gate_up_proj");
        let first = format!("{prefix}.{}.{}.weight", self.first, self.names.gate);
        if !ckpt.contains(&first) && ckpt.contains(&fused) && !self.experts.is_empty() {
            let (n, start) = (self.experts.len(), self.first);
            let (inter, hidden) = self.experts[0].gate_proj.dims();
            let gate_up = ckpt.tensor_rows::<B, 3>(&fused, [n, 2 * inter, hidden], start, device)?;
            let down = ckpt.tensor_rows::<B, 3>(&format!("{prefix}.down_proj"), [n, hidden, inter], start, device)?;
            for (j, expert) in self.experts.iter_mut().enumerate() {
                let gu = gate_up.clone().narrow(0, j, 1).reshape([2 * inter, hidden]);
                expert.gate_proj.weight = Param::from_tensor(gu.clone().narrow(0, 0, inter));
                expert.up_proj.weight = Param::from_tensor(gu.narrow(0, inter, inter));
                expert.down_proj.weight = Param::from_tensor(down.clone().narrow(0, j, 1).reshape([hidden, inter]));
            }
            return Ok(());
        }
        let (first, names) = (self.first, self.names);
        for (j, expert) in self.experts.iter_mut().enumerate() {
            expert.load_named(ckpt, &format!("{prefix}.{}", first + j), names, device)?;
        }
        Ok(())
    }

    fn save(&self, sink: &mut TensorSink, prefix: &str) {
        for (j, expert) in self.experts.iter().enumerate() {
            expert.save_named(sink, &format!("{prefix}.{}", self.first + j), self.names);
        }
    }

    fn shard(self, range: std::ops::Range<usize>) -> Result<Self> {
        if range.end > self.experts.len() {
            return Err(ModelError::InvalidInput(format!("expert shard {range:?} of {} experts", self.experts.len())));
        }
        let first = self.first + range.start;
        Ok(Self { experts: self.experts.into_iter().skip(range.start).take(range.len()).collect(), first, ..self })
    }
}
