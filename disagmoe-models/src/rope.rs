//! Rotary position embeddings (RoPE), half-split rotation as in transformers' `rotate_half`.
//!
//! The tables are computed the way transformers computes them, in f32: `inv_freq[i] =
//! 1 / theta^(2i / d)`, `angle = position * inv_freq`, `emb = cat(angle, angle)`.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use crate::config::RopeScaling;

/// Precomputed frequencies of one rotary embedding.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
    head_dim: usize,
}

impl Rope {
    /// RoPE over `head_dim` (even) with base `theta` and optional scaling.
    pub fn new(head_dim: usize, theta: f64, scaling: &RopeScaling) -> Self {
        let theta = theta as f32;
        let mut inv_freq: Vec<f32> =
            (0..head_dim / 2).map(|i| 1.0f32 / theta.powf((2 * i) as f32 / head_dim as f32)).collect();
        if let RopeScaling::Linear { factor } = scaling {
            for f in &mut inv_freq {
                *f /= *factor as f32;
            }
        }
        Self { inv_freq, head_dim }
    }

    /// `(cos, sin)` tables for positions `0..seq`.
    ///
    /// # Shapes
    /// - output: two `[1, 1, seq, head_dim]` tensors
    pub fn tables<B: Backend>(&self, seq: usize, device: &B::Device) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let d = self.head_dim;
        let mut cos = Vec::with_capacity(seq * d);
        let mut sin = Vec::with_capacity(seq * d);
        for p in 0..seq {
            for half in 0..2 {
                let _ = half;
                for &f in &self.inv_freq {
                    let angle = (p as f32 * f) as f64;
                    cos.push(angle.cos() as f32);
                    sin.push(angle.sin() as f32);
                }
            }
        }
        (
            Tensor::from_data(TensorData::new(cos, [1, 1, seq, d]), device),
            Tensor::from_data(TensorData::new(sin, [1, 1, seq, d]), device),
        )
    }
}

/// `x * cos + rotate_half(x) * sin`, with `rotate_half(x) = cat(-x[.., d/2..], x[.., ..d/2])`.
///
/// # Shapes
/// - x: `[batch, heads, seq, head_dim]`; cos, sin: `[1, 1, seq, head_dim]`
pub fn apply_rotary<B: Backend>(x: Tensor<B, 4>, cos: Tensor<B, 4>, sin: Tensor<B, 4>) -> Tensor<B, 4> {
    let d = x.dims()[3];
    let x1 = x.clone().narrow(3, 0, d / 2);
    let x2 = x.clone().narrow(3, d / 2, d / 2);
    let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
    x * cos + rotated * sin
}
