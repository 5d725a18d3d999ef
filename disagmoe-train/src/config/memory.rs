//! `[memory]`: what a run keeps in memory between the forward and the backward.

use serde::{Deserialize, Serialize};

pub use disagmoe_models::Recompute;

/// Activation memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MemoryOptions {
    /// Which blocks drop their activations in the forward and recompute them in the backward
    /// (`none`, `experts`, `attention`, `full`): on one device block by block
    /// (`disagmoe_models::recompute`); in the runtime each attention or expert stage of a
    /// micro-batch in flight keeps only its input until its backward.
    pub recompute: Recompute,
}
