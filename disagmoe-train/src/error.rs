//! Errors of the training crate.

use std::path::PathBuf;

/// What can stop a training run before it starts or while it runs.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A model could not be built or loaded.
    #[error(transparent)]
    Model(#[from] disagmoe_models::ModelError),
    /// A training option has a value outside the allowed set.
    #[error("training option `{field}`: {message}")]
    InvalidOption {
        /// The option's name (as in the TOML run config and the `--flag`).
        field: String,
        /// What is wrong and what is allowed.
        message: String,
    },
    /// The corpus is unusable.
    #[error("corpus {path}: {message}")]
    Corpus {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The tokenizer could not be loaded or used.
    #[error("tokenizer {path}: {message}")]
    Tokenizer {
        /// The `tokenizer.json` file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A file could not be read or written.
    #[error("{action} {path}: {source}")]
    Io {
        /// What we tried.
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A training checkpoint is unusable.
    #[error("checkpoint {path}: {message}")]
    Checkpoint {
        /// The file or directory.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A loss or gradient is not finite and the policy is `abort`.
    #[error("non-finite {what} at step {step}{}{}; set on_nonfinite = \"skip\" to skip such steps", if tensor.is_empty() { String::new() } else { format!(" in `{tensor}`") }, held_by(workers))]
    NonFinite {
        /// The step.
        step: usize,
        /// `loss` or `gradient`.
        what: &'static str,
        /// The parameter whose gradient is not finite (Hugging Face name), if it is a gradient and
        /// this worker holds it.
        tensor: String,
        /// The workers of a distributed run whose own gradients are not finite (empty on one
        /// device).
        workers: Vec<usize>,
    },
    /// A worker of a distributed run failed (or lost its peers); the run stopped.
    #[error("worker {worker}: {cause}")]
    Worker {
        /// The worker's rank.
        worker: usize,
        /// What went wrong.
        cause: String,
    },
    /// The compiled-in backend cannot compute on this machine (no driver, no device).
    #[error(
        "no usable {backend} device: {reason}. This binary computes with {backend} (built with --features \
         {backend}); run it where the device and its driver are, or train on the CPU with a build without \
         --features {backend} (`cargo build --release`)"
    )]
    NoDevice {
        /// The cargo feature that chose the backend (`cuda`, `wgpu`, ...).
        backend: &'static str,
        /// What failed, in its own words (first line).
        reason: String,
    },
    /// A worker waited too long for its peers.
    #[error("worker {worker}: waited {seconds:.0} s {at} for data that never came; {}", unreachable.as_deref().unwrap_or("no peer was busy meanwhile: a peer has stopped, or the run is stuck"))]
    Stalled {
        /// The waiting worker.
        worker: usize,
        /// How long it waited.
        seconds: f64,
        /// Where (e.g. `at step 3`).
        at: String,
        /// Who cannot be reached, in words, where the transport can tell (a peer silent, heartbeats
        /// included, for more than half the time-out).
        unreachable: Option<String>,
    },
    /// The run config TOML is malformed.
    #[error("run config {path}: {message}")]
    RunConfig {
        /// The file.
        path: PathBuf,
        /// The parser's message (names the key).
        message: String,
    },
}

impl TrainError {
    /// Shorthand for [`TrainError::InvalidOption`].
    pub fn option(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::InvalidOption { field: field.into(), message: message.into() }
    }
}

/// Result alias of this crate.
pub type Result<T, E = TrainError> = std::result::Result<T, E>;

/// ` (held by worker 2)`, ` (held by workers 1, 3)`, or nothing.
fn held_by(workers: &[usize]) -> String {
    let list: Vec<String> = workers.iter().map(usize::to_string).collect();
    match list.len() {
        0 => String::new(),
        1 => format!(" (held by worker {})", list[0]),
        _ => format!(" (held by workers {})", list.join(", ")),
    }
}
