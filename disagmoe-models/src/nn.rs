//! Small building blocks shared by the model families: linear layers stored as Hugging Face stores
//! them, RMSNorm and token embedding.
//!
//! Weights keep PyTorch's `[out_features, in_features]` layout so that a checkpoint tensor maps to a
//! parameter without a transpose, on load and on save.

use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

use crate::error::Result;
use crate::init::Init;
use crate::weights::{CheckpointReader, TensorSink};

/// `y = x W^T + b` with `W: [out, in]` (PyTorch's `nn.Linear`).
#[derive(Module, Debug)]
pub struct Linear<B: Backend> {
    /// `[out_features, in_features]`
    pub weight: Param<Tensor<B, 2>>,
    /// `[out_features]`
    pub bias: Option<Param<Tensor<B, 1>>>,
}

impl<B: Backend> Linear<B> {
    /// A linear layer `{prefix}.weight` initialised from normal(0, std), bias zero (as transformers'
    /// `_init_weights`).
    pub fn new(d_in: usize, d_out: usize, bias: bool, init: &Init<B>) -> Self {
        Self {
            weight: Param::from_tensor(init.normal("weight", [d_out, d_in])),
            bias: bias.then(|| Param::from_tensor(init.zeros([d_out]))),
        }
    }

    /// # Shapes
    /// - x: `[..., in]`
    /// - output: `[..., out]`
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        // One 2-D product over all leading dims: no copy of the transposed weight, one gemm call.
        let mut out_shape = x.dims();
        let d_in = out_shape[D - 1];
        let (d_out, _) = self.dims();
        out_shape[D - 1] = d_out;
        let rows = out_shape[..D - 1].iter().product::<usize>();
        let x = x.reshape([rows, d_in]);
        let y = disagmoe_kernels::fused::linear(x.clone(), self.weight.val())
            .unwrap_or_else(|| disagmoe_kernels::precision::matmul(x, self.weight.val().transpose()))
            .reshape(out_shape); // [.., out]
        match &self.bias {
            Some(b) => y + b.val().unsqueeze::<D>(),
            None => y,
        }
    }

    /// `(out, in)`.
    pub fn dims(&self) -> (usize, usize) {
        let [o, i] = self.weight.dims();
        (o, i)
    }

    /// Loads `{prefix}.weight` (and `{prefix}.bias` when the layer has one).
    pub fn load(&mut self, ckpt: &mut CheckpointReader, prefix: &str, device: &B::Device) -> Result<()> {
        let (o, i) = self.dims();
        self.weight = Param::from_tensor(ckpt.tensor::<B, 2>(&format!("{prefix}.weight"), [o, i], device)?);
        if self.bias.is_some() {
            self.bias = Some(Param::from_tensor(ckpt.tensor::<B, 1>(&format!("{prefix}.bias"), [o], device)?));
        }
        Ok(())
    }

    /// Saves under the same names [`Linear::load`] reads.
    pub fn save(&self, sink: &mut TensorSink, prefix: &str) {
        sink.put_param(format!("{prefix}.weight"), &self.weight);
        if let Some(b) = &self.bias {
            sink.put_param(format!("{prefix}.bias"), b);
        }
    }
}

/// Root-mean-square normalisation over the last dimension, `x / sqrt(mean(x^2) + eps) * weight`.
#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    /// `[dim]`, initialised to ones.
    pub weight: Param<Tensor<B, 1>>,
    /// Added to the mean square.
    pub eps: f64,
}

impl<B: Backend> RmsNorm<B> {
    /// A norm over `dim` features, weight at one.
    pub fn new(dim: usize, eps: f64, init: &Init<B>) -> Self {
        Self { weight: Param::from_tensor(init.ones([dim])), eps }
    }

    /// # Shapes
    /// - x: `[..., dim]` -> `[..., dim]`
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        if let Some(y) = disagmoe_kernels::fused::rms_norm(x.clone(), self.weight.val(), self.eps) {
            return y;
        }
        let inv_rms = x.clone().square().mean_dim(D - 1).add_scalar(self.eps).sqrt().recip(); // [..., 1]
        x * inv_rms * self.weight.val().unsqueeze::<D>()
    }

    /// Loads `{prefix}.weight`.
    pub fn load(&mut self, ckpt: &mut CheckpointReader, prefix: &str, device: &B::Device) -> Result<()> {
        let [d] = self.weight.dims();
        self.weight = Param::from_tensor(ckpt.tensor::<B, 1>(&format!("{prefix}.weight"), [d], device)?);
        Ok(())
    }

    /// Saves `{prefix}.weight`.
    pub fn save(&self, sink: &mut TensorSink, prefix: &str) {
        sink.put_param(format!("{prefix}.weight"), &self.weight);
    }
}

/// Token embedding table, with PyTorch's `padding_idx`: the padding token's row starts at zero and
/// never receives a gradient.
#[derive(Module, Debug)]
pub struct Embedding<B: Backend> {
    /// `[vocab, hidden]`
    pub weight: Param<Tensor<B, 2>>,
    /// The padding token (`pad_token_id`), whose row is not trained.
    #[module(skip)]
    pub padding_idx: Option<usize>,
}

impl<B: Backend> Embedding<B> {
    /// A table `{prefix}.weight` initialised from normal(0, std), the padding row zero.
    pub fn new(vocab: usize, hidden: usize, padding_idx: Option<usize>, init: &Init<B>) -> Self {
        let mut weight = init.normal("weight", [vocab, hidden]);
        if let Some(p) = padding_idx.filter(|&p| p < vocab) {
            weight = weight.slice_assign([p..p + 1, 0..hidden], init.zeros([1, hidden]));
        }
        Self { weight: Param::from_tensor(weight), padding_idx }
    }

    /// # Shapes
    /// - ids: `[batch, seq]` -> `[batch, seq, hidden]`
    pub fn forward(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let [b, s] = ids.dims();
        let [_, h] = self.weight.dims();
        let flat = ids.reshape([b * s]);
        // A table held in bf16 (`--precision bf16`'s working weights) is looked up in f32: the
        // gradient of a row, a sum over the token's occurrences, is then added in f32 and rounded
        // once (as PyTorch's embedding backward does), not in bf16 at each occurrence. The f32
        // table is transient, the size of the f32 gradient the backward makes anyway.
        let w = self.weight.val();
        let w = if w.dtype() == burn::tensor::DType::F32 { w } else { w.cast(burn::tensor::DType::F32) };
        let x = w.select(0, flat.clone()); // [T, M]
        let x = match self.padding_idx {
            // The padding rows' values, cut from the graph: no gradient reaches their table row.
            Some(p) => {
                let keep = flat.not_equal_elem(p as i64).float().unsqueeze_dim::<2>(1); // [T, 1]
                x.clone() * keep.clone() + x.detach() * keep.neg().add_scalar(1.0)
            }
            None => x,
        };
        x.reshape([b, s, h])
    }

    /// Loads `{prefix}.weight`.
    pub fn load(&mut self, ckpt: &mut CheckpointReader, prefix: &str, device: &B::Device) -> Result<()> {
        let [v, h] = self.weight.dims();
        self.weight = Param::from_tensor(ckpt.tensor::<B, 2>(&format!("{prefix}.weight"), [v, h], device)?);
        Ok(())
    }

    /// Saves `{prefix}.weight`.
    pub fn save(&self, sink: &mut TensorSink, prefix: &str) {
        sink.put_param(format!("{prefix}.weight"), &self.weight);
    }
}
