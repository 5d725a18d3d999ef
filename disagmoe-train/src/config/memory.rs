//! `[memory]`: what a run keeps in memory between the forward and the backward.

use serde::{Deserialize, Serialize};

pub use disagmoe_models::Recompute;

use super::Placement;
use crate::error::{Result, TrainError};

/// Activation memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MemoryOptions {
    /// Which blocks drop their activations in the forward and recompute them in the backward
    /// (`none`, `experts`, `attention`, `full`; see `disagmoe_models::recompute`).
    pub recompute: Recompute,
}

impl MemoryOptions {
    /// Refuses settings the placement cannot honour.
    pub fn validate(&self, placement: Placement) -> Result<()> {
        if self.recompute != Recompute::None && placement != Placement::Single {
            return Err(TrainError::option(
                "recompute",
                format!(
                    "`{}` is implemented for --placement single; the {} workers keep their activations \
                     (allowed with {}: none; bound their memory with --max-in-flight)",
                    self.recompute,
                    placement.name(),
                    placement.name()
                ),
            ));
        }
        Ok(())
    }
}
