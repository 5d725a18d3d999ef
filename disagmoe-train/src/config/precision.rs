//! `[precision]`: numerics of the run: the dtype of the matrix products (mixed precision, see
//! `disagmoe_kernels::precision`), f16's loss scaling ([`crate::loss_scale`]) and what to do with
//! non-finite values.

use serde::{Deserialize, Serialize};

pub use disagmoe_kernels::precision::Precision;

use crate::error::{Result, TrainError};

/// What to do when a loss or gradient is NaN or infinite.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum NonFinitePolicy {
    /// Skip the update with a warning and count it (`skipped_steps`).
    #[default]
    Skip,
    /// Stop the run with an error naming the step and the tensor.
    Abort,
}

/// The numerics of a run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrecisionOptions {
    /// The dtype of the matrix products (`f32`, `bf16`, `f16`; master weights, optimizer moments,
    /// gradients, norms, softmax and the loss stay f32).
    pub compute: Precision,
    /// Policy for non-finite losses and gradients (under f16, overflows are the loss scaler's:
    /// skipped, and the scale halves).
    pub on_nonfinite: NonFinitePolicy,
    /// f16: the first loss scale.
    pub initial_loss_scale: f64,
    /// f16: steps without an overflow after which the loss scale doubles.
    pub loss_scale_window: usize,
}

impl Default for PrecisionOptions {
    fn default() -> Self {
        Self {
            compute: Precision::F32,
            on_nonfinite: NonFinitePolicy::Skip,
            initial_loss_scale: 65536.0,
            loss_scale_window: 2000,
        }
    }
}

impl PrecisionOptions {
    /// Refuses settings that cannot work together.
    pub fn validate(&self) -> Result<()> {
        if !(self.initial_loss_scale.is_finite() && self.initial_loss_scale >= 1.0) {
            return Err(TrainError::option(
                "initial_loss_scale",
                format!("must be a finite number >= 1, got {}", self.initial_loss_scale),
            ));
        }
        if self.loss_scale_window == 0 {
            return Err(TrainError::option("loss_scale_window", "must be at least 1"));
        }
        if self.compute == Precision::F16 && self.on_nonfinite == NonFinitePolicy::Abort {
            return Err(TrainError::option(
                "on_nonfinite",
                "abort cannot go with precision f16: f16's loss scaling skips the steps whose gradients \
                 overflow and halves the scale, by design (allowed with f16: skip)",
            ));
        }
        Ok(())
    }

    /// The run's loss scaler: dynamic under f16 (from `resumed` when a checkpoint has one), off
    /// otherwise.
    pub fn loss_scaler(&self, resumed: Option<crate::loss_scale::LossScaleState>) -> crate::loss_scale::LossScaler {
        match self.compute {
            Precision::F16 => {
                crate::loss_scale::LossScaler::dynamic(self.initial_loss_scale, self.loss_scale_window, resumed)
            }
            _ => crate::loss_scale::LossScaler::off(),
        }
    }
}
