//! Mixed precision: the dtype the models' matrix products run in.
//!
//! Under `f16` the parameters, optimizer moments and gradients stay f32; under `bf16` the training
//! runtime holds the matrices in bf16 with f32 master weights in its optimizer (`disagmoe-train`'s
//! `AdamW::adopt_masters`: casting a bf16 operand to bf16 is free). Under `bf16` or `f16`
//! every matrix product of a model -- the dense projections and the LM head, the grouped expert
//! products, attention's `q k^T` and `p v` -- goes through [`matmul`], which casts both operands
//! to the low dtype, multiplies (Burn's backends accumulate in f32: flex converts to f32 for its
//! gemm, CubeCL's matmul accumulates in f32 on tensor cores) and casts the product back to f32.
//! Everything between products stays f32: norms, softmax, rotary embedding, router
//! probabilities, the loss, gradient sums and norms. Autodiff casts each gradient back through the
//! same casts, so an f32 weight's gradient arrives in f32 (a bf16 weight's in bf16: the runtime
//! casts it to f32 as it leaves the backward) and its products' gradients run in the low dtype
//! too.
//!
//! The fused CPU operations that contain products (linear, attention, grouped experts) are f32
//! only and step aside under a low precision ([`crate::fused`] returns `None` for them), so the
//! models run their reference compositions through [`matmul`]. On CubeCL backends the grouped
//! expert kernels and the flash-attention kernel take part on operands cast to the low dtype
//! (f32 accumulation, softmax in f32, output cast back to f32) where they measured faster than
//! the composition (`crate::cube::probe`).
//!
//! One precision per process ([`set_precision`], what `disagmoe train --precision` sets), with a
//! per-thread override for tests ([`set_precision_for_thread`]).

use std::cell::Cell;
use std::sync::atomic::{AtomicU8, Ordering};

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};

/// The dtype of the matrix products.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Everything in f32 (the default).
    #[default]
    F32,
    /// Products in bfloat16 with f32 accumulation; the rest f32.
    Bf16,
    /// Products in float16 with f32 accumulation; the rest f32.
    F16,
}

impl Precision {
    /// The names the command line accepts.
    pub const NAMES: [&'static str; 3] = ["f32", "bf16", "f16"];

    /// Its name (`f32`, `bf16`, `f16`).
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
        }
    }

    /// The low dtype of the products, `None` for f32.
    pub fn dtype(self) -> Option<DType> {
        match self {
            Precision::F32 => None,
            Precision::Bf16 => Some(DType::BF16),
            Precision::F16 => Some(DType::F16),
        }
    }

    fn code(self) -> u8 {
        match self {
            Precision::F32 => 0,
            Precision::Bf16 => 1,
            Precision::F16 => 2,
        }
    }

    fn from_code(code: u8) -> Self {
        match code {
            1 => Precision::Bf16,
            2 => Precision::F16,
            _ => Precision::F32,
        }
    }

    /// Whether backend `B` computes in this precision on `device` (casts, products and the
    /// elementwise operations their gradients need).
    pub fn supported<B: Backend>(self, device: &B::Device) -> bool {
        self.dtype().is_none_or(|d| B::supports_dtype(device, d))
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(Precision::F32),
            "bf16" => Ok(Precision::Bf16),
            "f16" => Ok(Precision::F16),
            _ => Err(format!("unknown precision {s:?} (allowed: {})", Precision::NAMES.join(", "))),
        }
    }
}

static PRECISION: AtomicU8 = AtomicU8::new(0);

thread_local! {
    static THREAD_PRECISION: Cell<Option<Precision>> = const { Cell::new(None) };
}

/// Sets the precision of the products for the whole process.
pub fn set_precision(p: Precision) {
    PRECISION.store(p.code(), Ordering::Relaxed);
}

/// Overrides [`set_precision`] on the calling thread (`None` removes the override).
pub fn set_precision_for_thread(p: Option<Precision>) {
    THREAD_PRECISION.with(|c| c.set(p));
}

/// The precision of the products on this thread.
pub fn precision() -> Precision {
    THREAD_PRECISION.with(Cell::get).unwrap_or_else(|| Precision::from_code(PRECISION.load(Ordering::Relaxed)))
}

/// Whether the products run in a low precision on this thread.
pub fn low() -> bool {
    precision() != Precision::F32
}

/// `a b` (Burn's batched `matmul`) in this thread's precision: under `bf16`/`f16` both operands
/// are cast to it and the product back to f32.
pub fn matmul<B: Backend, const D: usize>(a: Tensor<B, D>, b: Tensor<B, D>) -> Tensor<B, D> {
    match precision().dtype() {
        // A weight held in bf16 meets f32 activations only where no precision was set: in f32.
        None if a.dtype() != b.dtype() => a.cast(DType::F32).matmul(b.cast(DType::F32)),
        None => a.matmul(b),
        Some(low) => a.cast(low).matmul(b.cast(low)).cast(DType::F32),
    }
}

#[cfg(all(test, feature = "flex"))]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, Flex};
    use burn::tensor::Distribution;

    type B = Autodiff<Flex>;

    #[test]
    fn low_precision_products_round_the_operands_and_keep_f32_around_them() {
        let device = Default::default();
        let a = Tensor::<B, 2>::random([8, 16], Distribution::Normal(0.0, 1.0), &device).require_grad();
        let b = Tensor::<B, 2>::random([16, 4], Distribution::Normal(0.0, 1.0), &device).require_grad();
        let exact = matmul(a.clone(), b.clone());
        set_precision_for_thread(Some(Precision::Bf16));
        let low = matmul(a.clone(), b.clone());
        let grads = low.clone().sum().backward();
        set_precision_for_thread(None);
        assert_eq!(low.dtype(), DType::F32, "the product comes back in f32");
        let (x, y) = (exact.into_data().to_vec::<f32>().unwrap(), low.into_data().to_vec::<f32>().unwrap());
        let worst = x.iter().zip(&y).map(|(p, q)| (p - q).abs() / (1.0 + p.abs())).fold(0f32, f32::max);
        // bf16 keeps 8 significant bits: the products differ, by about that much.
        assert!(worst > 1e-5 && worst < 5e-2, "bf16 product vs f32: {worst}");
        let ga = a.grad(&grads).unwrap();
        assert_eq!(ga.dtype(), DType::F32, "a weight's gradient arrives in f32");
        let want = b.clone().inner().sum_dim(1).reshape([1, 16]).expand([8, 16]).into_data();
        let (g, w) = (ga.into_data().to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
        let worst = g.iter().zip(&w).map(|(p, q)| (p - q).abs() / (1.0 + q.abs())).fold(0f32, f32::max);
        assert!(worst < 5e-2, "gradient of sum(a b) wrt a is rowsum(b): off by {worst}");
        assert_eq!(precision(), Precision::F32);
        assert_eq!("bf16".parse::<Precision>(), Ok(Precision::Bf16));
        assert!("fp8".parse::<Precision>().unwrap_err().contains("f32, bf16, f16"));
    }
}
