//! Small building blocks shared by the model families: linear layers stored as Hugging Face stores
//! them, RMSNorm, token embedding, and the initialisers.
//!
//! Weights keep PyTorch's `[out_features, in_features]` layout so that a checkpoint tensor maps to a
//! parameter without a transpose, on load and on save.

use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Int, Tensor};

use crate::error::Result;
use crate::weights::{CheckpointReader, TensorSink};

/// A normal(0, std) initialised tensor, as transformers' `_init_weights` does for linears and embeddings.
pub fn normal_init<B: Backend, const D: usize>(shape: [usize; D], std: f64, device: &B::Device) -> Tensor<B, D> {
    Tensor::random(shape, Distribution::Normal(0.0, std), device)
}

/// `y = x W^T + b` with `W: [out, in]` (PyTorch's `nn.Linear`).
#[derive(Module, Debug)]
pub struct Linear<B: Backend> {
    /// `[out_features, in_features]`
    pub weight: Param<Tensor<B, 2>>,
    /// `[out_features]`
    pub bias: Option<Param<Tensor<B, 1>>>,
}

impl<B: Backend> Linear<B> {
    /// A linear layer initialised from normal(0, std), bias zero.
    pub fn new(d_in: usize, d_out: usize, bias: bool, std: f64, device: &B::Device) -> Self {
        Self {
            weight: Param::from_tensor(normal_init([d_out, d_in], std, device)),
            bias: bias.then(|| Param::from_tensor(Tensor::zeros([d_out], device))),
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
            .unwrap_or_else(|| x.matmul(self.weight.val().transpose()))
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
    /// A norm over `dim` features.
    pub fn new(dim: usize, eps: f64, device: &B::Device) -> Self {
        Self { weight: Param::from_tensor(Tensor::ones([dim], device)), eps }
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

/// Token embedding table.
#[derive(Module, Debug)]
pub struct Embedding<B: Backend> {
    /// `[vocab, hidden]`
    pub weight: Param<Tensor<B, 2>>,
}

impl<B: Backend> Embedding<B> {
    /// A table initialised from normal(0, std).
    pub fn new(vocab: usize, hidden: usize, std: f64, device: &B::Device) -> Self {
        Self { weight: Param::from_tensor(normal_init([vocab, hidden], std, device)) }
    }

    /// # Shapes
    /// - ids: `[batch, seq]` -> `[batch, seq, hidden]`
    pub fn forward(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let [b, s] = ids.dims();
        let [_, h] = self.weight.dims();
        self.weight.val().select(0, ids.reshape([b * s])).reshape([b, s, h])
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
