//! Errors of the model crate.

use std::path::PathBuf;

/// Everything that can go wrong reading a configuration or a checkpoint, or running a model on bad
/// input. Each variant names the file, field or tensor and what was expected.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A configuration field has a value outside the allowed set.
    #[error("config field `{field}`: {message}")]
    InvalidConfig {
        /// The field's name as it appears in `config.json`.
        field: String,
        /// What is wrong and what is allowed.
        message: String,
    },
    /// `config.json` (or another JSON file) could not be parsed.
    #[error("cannot parse {path}: {}{source}", if field.is_empty() || field == "." { String::new() } else { format!("field `{field}`: ") })]
    ConfigParse {
        /// The file.
        path: PathBuf,
        /// Path of the offending field (`.` or empty when the file as a whole is malformed).
        field: String,
        /// The parser's message (with line and column).
        source: serde_json::Error,
    },
    /// A file could not be read or written.
    #[error("{action} {path}: {source}")]
    Io {
        /// What we tried ("cannot read", "cannot write", ...).
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A safetensors file is malformed.
    #[error("malformed safetensors file {path}: {message}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// A tensor expected by the model is absent from the checkpoint.
    #[error("tensor `{name}` is missing from the checkpoint in {dir}")]
    MissingTensor {
        /// The Hugging Face name of the tensor.
        name: String,
        /// The checkpoint directory.
        dir: PathBuf,
    },
    /// A tensor has the wrong shape.
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    ShapeMismatch {
        /// The Hugging Face name of the tensor.
        name: String,
        /// Shape in the checkpoint.
        found: Vec<usize>,
        /// Shape the configuration implies.
        expected: Vec<usize>,
    },
    /// A tensor has a dtype we cannot convert to f32.
    #[error("tensor `{name}` has dtype {dtype}; supported dtypes are F32, BF16 and F16")]
    UnsupportedDtype {
        /// The Hugging Face name of the tensor.
        name: String,
        /// The dtype found.
        dtype: String,
    },
    /// Input token ids are unusable.
    #[error("invalid input: {0}")]
    InvalidInput(String),
}

impl ModelError {
    /// Shorthand for [`ModelError::InvalidConfig`].
    pub fn config(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::InvalidConfig { field: field.into(), message: message.into() }
    }
}

/// Result alias of this crate.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;
