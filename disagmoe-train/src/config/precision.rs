//! `[precision]`: numerics of the run: the dtype of the matrix products (mixed precision, see
//! `disagmoe_kernels::precision`) and what to do with non-finite values.

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
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrecisionOptions {
    /// The dtype of the matrix products (`f32`, `bf16`; master weights, optimizer moments,
    /// gradients, norms, softmax and the loss stay f32).
    pub compute: Precision,
    /// Policy for non-finite losses and gradients.
    pub on_nonfinite: NonFinitePolicy,
}

impl PrecisionOptions {
    /// Refuses what cannot run yet: `f16` needs dynamic loss scaling (gradients below f16's
    /// smallest normal vanish without it), which is not built.
    pub fn validate(&self) -> Result<()> {
        if self.compute == Precision::F16 {
            return Err(TrainError::option(
                "precision",
                "f16 needs dynamic loss scaling, which this version does not have yet; use bf16 (the same \
                 tensor-core speed with f32's range) or f32",
            ));
        }
        Ok(())
    }
}
