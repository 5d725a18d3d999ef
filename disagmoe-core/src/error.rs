//! Error types of `disagmoe-core`.
//!
//! Every error names the field or constraint at fault and, where there is one, the allowed range,
//! so that a bad config file or an impossible request is fixed by reading the message.

use thiserror::Error;

/// Everything that can go wrong while describing, planning or simulating a job.
#[derive(Debug, Error)]
pub enum CoreError {
    /// A configuration field holds a value outside its allowed range.
    #[error("invalid `{field}` = {value}: {allowed}")]
    InvalidField {
        /// Dotted path of the field, e.g. `cluster.nodes`.
        field: String,
        /// The offending value, printed.
        value: String,
        /// What would have been accepted.
        allowed: String,
    },
    /// A preset name that is not built in.
    #[error("unknown {kind} preset `{name}`; known presets: {known}")]
    UnknownPreset {
        /// `model` or `cluster`.
        kind: &'static str,
        /// The name asked for.
        name: String,
        /// Comma-separated list of the built-in names.
        known: String,
    },
    /// No allocation satisfies the request. `constraint` names the constraint that cannot be met,
    /// `shortfall` says by how much the best attempt misses it.
    #[error("no feasible allocation: constraint `{constraint}` fails: {detail}")]
    Infeasible {
        /// Name of the violated constraint (`total_gpus`, `total_nics`, `memory_attention`, ...).
        constraint: String,
        /// Human-readable shortfall, e.g. "needs 93.1 GB per GPU, 80.0 GB available (short by 13.1 GB)".
        detail: String,
    },
    /// The MILP solver failed for a reason other than infeasibility.
    #[error("MILP solver failed: {0}")]
    Solver(String),
    /// A schedule is malformed (dangling dependency, cycle, op on an unknown worker).
    #[error("invalid schedule `{schedule}`: {detail}")]
    InvalidSchedule {
        /// Schedule name.
        schedule: String,
        /// What is wrong.
        detail: String,
    },
    /// Reading or writing a file failed.
    #[error("i/o error on `{path}`: {source}")]
    Io {
        /// The file.
        path: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A JSON document could not be parsed.
    #[error("cannot parse JSON `{path}`: {source}")]
    Json {
        /// The file.
        path: String,
        /// The underlying error.
        #[source]
        source: serde_json::Error,
    },
    /// A TOML document could not be parsed.
    #[error("cannot parse TOML `{path}`: {message}")]
    Toml {
        /// The file.
        path: String,
        /// Parser message.
        message: String,
    },
    /// Drawing an SVG failed.
    #[error("cannot draw `{path}`: {message}")]
    Plot {
        /// The output file.
        path: String,
        /// Backend message.
        message: String,
    },
}

/// Result alias used throughout the crate.
pub type Result<T> = std::result::Result<T, CoreError>;

/// Shorthand for [`CoreError::InvalidField`].
pub(crate) fn invalid(field: &str, value: impl std::fmt::Display, allowed: &str) -> CoreError {
    CoreError::InvalidField { field: field.to_string(), value: value.to_string(), allowed: allowed.to_string() }
}

/// Fails with [`CoreError::InvalidField`] unless `value` is positive and finite.
pub(crate) fn check_positive(field: &str, value: f64) -> Result<()> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(invalid(field, value, "a positive finite number"))
    }
}

/// Fails with [`CoreError::InvalidField`] unless `value >= 1`.
pub(crate) fn check_nonzero(field: &str, value: usize) -> Result<()> {
    if value >= 1 {
        Ok(())
    } else {
        Err(invalid(field, value, "an integer >= 1"))
    }
}
