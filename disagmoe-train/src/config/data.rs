//! `[data]`: the corpus, its tokenizer, and the shape of a batch.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};

/// What a step reads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataOptions {
    /// Text corpus (UTF-8). Default: the bundled public-domain corpus (flag `--data`, flat key `data`).
    pub path: Option<PathBuf>,
    /// A Hugging Face `tokenizer.json`. Default: the checkpoint's own if it has one, else bytes.
    pub tokenizer: Option<PathBuf>,
    /// Sequences per step.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
}

impl Default for DataOptions {
    fn default() -> Self {
        Self { path: None, tokenizer: None, batch: 8, seq: 128 }
    }
}

impl DataOptions {
    /// Checks the section; the error names the option and the allowed values.
    pub fn validate(&self) -> Result<()> {
        if self.batch == 0 {
            return Err(TrainError::option("batch", "must be at least 1"));
        }
        if self.seq < 2 {
            return Err(TrainError::option("seq", format!("must be at least 2 tokens, got {}", self.seq)));
        }
        Ok(())
    }

    /// Tokens in one step's batch.
    pub fn tokens_per_step(&self) -> usize {
        self.batch * self.seq
    }
}
