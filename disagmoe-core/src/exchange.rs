//! The precision of the token exchange's payloads: what a value of each kind of message costs on
//! the wire. The runtime packs its messages this way (`disagmoe_train::runtime::msg::Packed`), and
//! the cost model sizes M2N and N2M transfers with the same figures.
//!
//! | `exchange_dtype` | dispatch (M2N activations) | combine (N2M), residual, gate weights | gradients |
//! |---|---|---|---|
//! | `f32` | f32 | f32 | f32 |
//! | `bf16` | bf16 | bf16 | bf16 |
//! | `fp8` | e4m3, one f32 scale per [`FP8_BLOCK`] values of a token | bf16 | bf16 |
//!
//! Gradients never travel in fp8 (DeepEP's choice too: its FP8 dispatch combines in bf16); a run
//! may keep them in f32 under a bf16 or fp8 exchange (`exchange_grad_dtype`).

use serde::{Deserialize, Serialize};

/// Values of a token's row that share one fp8 scale: DeepEP's block (one scale per 128 values).
pub const FP8_BLOCK: usize = 128;

/// Bytes of one f32 fp8 scale.
const SCALE_BYTES: f64 = 4.0;

/// The dtype a message's values travel in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ExchangeDtype {
    /// 4 bytes a value, exact.
    #[default]
    F32,
    /// bfloat16, 2 bytes a value, rounded to nearest even.
    Bf16,
    /// float8 e4m3 (1 byte a value) with one f32 scale per [`FP8_BLOCK`] values of a row; only
    /// the dispatch travels so, the rest in bf16.
    Fp8,
}

impl ExchangeDtype {
    /// The names the command line and the run config accept.
    pub const NAMES: [&'static str; 3] = ["f32", "bf16", "fp8"];

    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            ExchangeDtype::F32 => "f32",
            ExchangeDtype::Bf16 => "bf16",
            ExchangeDtype::Fp8 => "fp8",
        }
    }

    /// Bytes on the wire of a row of `width` values in this dtype, scales included.
    pub fn row_bytes(self, width: usize) -> f64 {
        let w = width as f64;
        match self {
            ExchangeDtype::F32 => 4.0 * w,
            ExchangeDtype::Bf16 => 2.0 * w,
            ExchangeDtype::Fp8 => w + SCALE_BYTES * width.div_ceil(FP8_BLOCK) as f64,
        }
    }
}

impl std::fmt::Display for ExchangeDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for ExchangeDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(ExchangeDtype::F32),
            "bf16" => Ok(ExchangeDtype::Bf16),
            "fp8" => Ok(ExchangeDtype::Fp8),
            _ => Err(format!("unknown exchange dtype {s:?} (allowed: {})", ExchangeDtype::NAMES.join(", "))),
        }
    }
}

/// What each kind of the exchange's messages carries its values in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub struct ExchangePrecision {
    /// M2N: the token activations sent to expert holders.
    pub dispatch: ExchangeDtype,
    /// N2M (the holders' outputs), the residual hand-off and the gate weights.
    pub combine: ExchangeDtype,
    /// Every gradient message (never fp8).
    pub grads: ExchangeDtype,
}

impl ExchangePrecision {
    /// All in f32 (the runtime's default under f32 compute).
    pub const F32: ExchangePrecision =
        ExchangePrecision { dispatch: ExchangeDtype::F32, combine: ExchangeDtype::F32, grads: ExchangeDtype::F32 };

    /// All in bf16 (the planner's default: bf16 training).
    pub const BF16: ExchangePrecision =
        ExchangePrecision { dispatch: ExchangeDtype::Bf16, combine: ExchangeDtype::Bf16, grads: ExchangeDtype::Bf16 };

    /// The exchange of `--exchange-dtype dtype`: the dispatch in `dtype`, the combine and the
    /// gradients in bf16 unless `dtype` is f32.
    pub fn of(dtype: ExchangeDtype) -> Self {
        let low = match dtype {
            ExchangeDtype::F32 => ExchangeDtype::F32,
            ExchangeDtype::Bf16 | ExchangeDtype::Fp8 => ExchangeDtype::Bf16,
        };
        ExchangePrecision { dispatch: dtype, combine: low, grads: low }
    }

    /// [`Self::of`] with the gradients in `grads` when given. Gradients in fp8 are refused,
    /// naming the allowed values.
    pub fn new(dtype: ExchangeDtype, grads: Option<ExchangeDtype>) -> Result<Self, String> {
        let of = Self::of(dtype);
        let grads = grads.unwrap_or(of.grads);
        if grads == ExchangeDtype::Fp8 {
            return Err("fp8: gradients travel in f32 or bf16 (allowed: f32, bf16)".into());
        }
        Ok(ExchangePrecision { grads, ..of })
    }

    /// In words: `f32`, `bf16`, or `fp8 dispatch, bf16 combine, bf16 gradients`.
    pub fn describe(&self) -> String {
        if self.dispatch == self.combine && self.combine == self.grads {
            self.dispatch.name().to_string()
        } else {
            format!("{} dispatch, {} combine, {} gradients", self.dispatch, self.combine, self.grads)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_per_row_and_the_gradients_dtype() {
        assert_eq!(ExchangeDtype::F32.row_bytes(128), 512.0);
        assert_eq!(ExchangeDtype::Bf16.row_bytes(128), 256.0);
        assert_eq!(ExchangeDtype::Fp8.row_bytes(128), 132.0);
        assert_eq!(ExchangeDtype::Fp8.row_bytes(200), 208.0, "a partial block has its own scale");
        let fp8 = ExchangePrecision::new(ExchangeDtype::Fp8, None).unwrap();
        assert_eq!(
            (fp8.dispatch, fp8.combine, fp8.grads),
            (ExchangeDtype::Fp8, ExchangeDtype::Bf16, ExchangeDtype::Bf16)
        );
        assert_eq!(fp8.describe(), "fp8 dispatch, bf16 combine, bf16 gradients");
        assert_eq!(ExchangePrecision::new(ExchangeDtype::F32, None).unwrap(), ExchangePrecision::F32);
        let e = ExchangePrecision::new(ExchangeDtype::Fp8, Some(ExchangeDtype::Fp8)).unwrap_err();
        assert!(e.contains("allowed: f32, bf16"), "{e}");
        let e = "e5m2".parse::<ExchangeDtype>().unwrap_err();
        assert!(e.contains("allowed: f32, bf16, fp8"), "{e}");
    }
}
