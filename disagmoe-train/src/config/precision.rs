//! `[precision]`: numerics of the run (today: what to do with non-finite values; the compute
//! precision is f32).

use serde::{Deserialize, Serialize};

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
    /// Policy for non-finite losses and gradients.
    pub on_nonfinite: NonFinitePolicy,
}
