//! The placement of a distributed run ([`Layout`]: who holds which layer, which experts and
//! micro-batch) is `disagmoe-core`'s ([`disagmoe_core::layout`]), defined once for the runtime and
//! the schedule builders; this module re-exports it and names its errors as options of the run.

pub use disagmoe_core::layout::{layer_group, Layout, Placement};

use crate::error::TrainError;

/// A layout the run's options cannot make, as an error naming the option and what it allows.
pub fn option_error(e: disagmoe_core::error::CoreError) -> TrainError {
    match e {
        disagmoe_core::error::CoreError::InvalidField { field, value, allowed } => {
            TrainError::option(field, format!("{allowed}, got {value}"))
        }
        other => TrainError::option("placement", other.to_string()),
    }
}
