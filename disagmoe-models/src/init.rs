//! Parameter initialisation by checkpoint name.
//!
//! Every freshly initialised tensor is drawn from its own random stream, seeded by the run seed
//! and the parameter's Hugging Face name (`model.layers.3.self_attn.q_proj.weight`); a tensor stacked
//! over experts (GPT-OSS's fused `[E, ...]` experts) seeds each expert's rows by the expert's index
//! as well. Any part of a model can therefore be built alone, on any device, and is bit-identical
//! to the same tensors (and rows) of the whole model built elsewhere: a worker of a distributed run
//! builds exactly what it holds, and a single-device run starts from the same weights.
//!
//! [`Init`] follows the checkpoint's name hierarchy the way loading does: a module's constructor gets
//! an `Init` scoped to its prefix (`init.child("q_proj")`) and names its own tensors (`"weight"`).

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

/// Where and how a module's parameters are initialised: the device, the run seed, the standard
/// deviation of the normal initialiser, and the checkpoint-name prefix of the module.
#[derive(Debug, Clone)]
pub struct Init<'a, B: Backend> {
    device: &'a B::Device,
    /// `None`: placeholders (zeros) that a checkpoint load replaces.
    seed: Option<u64>,
    std: f64,
    prefix: String,
}

impl<'a, B: Backend> Init<'a, B> {
    /// The root of a model: tensors named from the top (`model.embed_tokens.weight`, `lm_head.weight`).
    pub fn new(seed: u64, std: f64, device: &'a B::Device) -> Self {
        Self { device, seed: Some(seed), std, prefix: String::new() }
    }

    /// Zeros in place of random values, for a model whose every tensor a checkpoint load replaces
    /// (no random numbers drawn for nothing).
    pub fn placeholders(device: &'a B::Device) -> Self {
        Self { device, seed: None, std: 0.0, prefix: String::new() }
    }

    /// The same initialiser for the module `name` below this one (`model` -> `model.layers.0`).
    pub fn child(&self, name: impl AsRef<str>) -> Self {
        Self { prefix: self.full_name(name.as_ref()), ..self.clone() }
    }

    /// The device tensors are created on.
    pub fn device(&self) -> &'a B::Device {
        self.device
    }

    /// The standard deviation of [`Init::normal`].
    pub fn std(&self) -> f64 {
        self.std
    }

    /// This module's checkpoint-name prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The checkpoint name of this module's tensor `leaf`.
    pub fn full_name(&self, leaf: &str) -> String {
        if self.prefix.is_empty() {
            leaf.to_owned()
        } else {
            format!("{}.{leaf}", self.prefix)
        }
    }

    /// `N(0, std)` values of the tensor `leaf`, drawn from its own stream.
    pub fn normal<const D: usize>(&self, leaf: &str, shape: [usize; D]) -> Tensor<B, D> {
        self.normal_rows(leaf, shape, 0)
    }

    /// `N(0, std)` values of the rows `first..first + shape[0]` of a tensor stacked over experts
    /// (dimension 0): row `r` is drawn from a stream of its own seeded by its global index
    /// `first + r`, so a shard of rows equals the same rows of the whole tensor.
    pub fn normal_rows<const D: usize>(&self, leaf: &str, shape: [usize; D], first: usize) -> Tensor<B, D> {
        let Some(seed) = self.seed else { return self.zeros(shape) };
        let name = self.full_name(leaf);
        let rows = shape.first().copied().unwrap_or(1);
        let per_row: usize = shape.iter().skip(1).product();
        let mut values = Vec::with_capacity(rows * per_row);
        if D <= 1 {
            values.extend(NormalStream::new(seed, &name, None).take(rows).map(|x| (x * self.std) as f32));
        } else {
            for r in 0..rows {
                let stream = NormalStream::new(seed, &name, Some(first + r));
                values.extend(stream.take(per_row).map(|x| (x * self.std) as f32));
            }
        }
        Tensor::from_data(TensorData::new(values, shape), self.device)
    }

    /// Ones (norm weights).
    pub fn ones<const D: usize>(&self, shape: [usize; D]) -> Tensor<B, D> {
        Tensor::ones(shape, self.device)
    }

    /// Zeros (biases, correction biases).
    pub fn zeros<const D: usize>(&self, shape: [usize; D]) -> Tensor<B, D> {
        Tensor::zeros(shape, self.device)
    }
}

/// SplitMix64: the seed mixer and the generator of one stream.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The seed of a stream: the run seed, the name's bytes (FNV-1a) and the row, mixed.
fn stream_seed(seed: u64, name: &str, row: Option<usize>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    let mut s = seed ^ h.rotate_left(17);
    let a = splitmix(&mut s);
    let mut s2 = a ^ row.map(|r| (r as u64).wrapping_add(1).wrapping_mul(0xD6E8_FEB8_6659_FD93)).unwrap_or(0);
    splitmix(&mut s2)
}

/// Standard normal values (Box-Muller over SplitMix64), deterministic for a seed.
struct NormalStream {
    state: u64,
    spare: Option<f64>,
}

impl NormalStream {
    fn new(seed: u64, name: &str, row: Option<usize>) -> Self {
        Self { state: stream_seed(seed, name, row), spare: None }
    }

    fn uniform(&mut self) -> f64 {
        // 53 random bits in (0, 1]: never 0, so the logarithm is finite.
        ((splitmix(&mut self.state) >> 11) as f64 + 1.0) * (1.0 / (1u64 << 53) as f64)
    }
}

impl Iterator for NormalStream {
    type Item = f64;
    fn next(&mut self) -> Option<f64> {
        if let Some(x) = self.spare.take() {
            return Some(x);
        }
        let (u1, u2) = (self.uniform(), self.uniform());
        let r = (-2.0 * u1.ln()).sqrt();
        let theta = std::f64::consts::TAU * u2;
        self.spare = Some(r * theta.sin());
        Some(r * theta.cos())
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::Flex;

    use super::*;

    fn values<const D: usize>(t: Tensor<Flex, D>) -> Vec<f32> {
        t.into_data().to_vec::<f32>().unwrap()
    }

    #[test]
    fn a_shard_of_rows_equals_the_same_rows_of_the_whole_tensor() {
        let device = Default::default();
        let init = Init::<Flex>::new(7, 0.02, &device).child("model.layers.1.mlp.experts");
        let whole = values(init.normal_rows("down_proj", [6, 4, 3], 0));
        let shard = values(init.normal_rows("down_proj", [2, 4, 3], 3));
        assert_eq!(&whole[3 * 12..5 * 12], &shard[..]);
    }

    #[test]
    fn streams_differ_by_name_and_seed_and_have_the_asked_spread() {
        let device = Default::default();
        let a = Init::<Flex>::new(1, 0.5, &device);
        let x = values(a.normal("model.embed_tokens.weight", [200, 50]));
        let y = values(a.normal("lm_head.weight", [200, 50]));
        let z = values(Init::<Flex>::new(2, 0.5, &device).normal("model.embed_tokens.weight", [200, 50]));
        assert_ne!(x, y);
        assert_ne!(x, z);
        assert_eq!(x, values(a.normal("model.embed_tokens.weight", [200, 50])), "deterministic");
        let n = x.len() as f64;
        let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n;
        let sd = (x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
        assert!(mean.abs() < 0.02 && (sd - 0.5).abs() < 0.02, "mean {mean} sd {sd}");
    }

    #[test]
    fn children_name_tensors_like_the_checkpoint() {
        let device = Default::default();
        let init = Init::<Flex>::new(0, 0.1, &device).child("model").child("layers.2").child("self_attn");
        assert_eq!(init.full_name("q_proj.weight"), "model.layers.2.self_attn.q_proj.weight");
    }
}
