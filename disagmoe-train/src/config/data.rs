//! `[data]`: the corpus, its tokenizer, and the shape of a batch.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};

/// What a step reads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataOptions {
    /// Training data: a UTF-8 text file, a `disagmoe tokenize` directory or a Megatron `.bin`/`.idx`
    /// pair. Default: the bundled public-domain corpus (flag `--data`, flat key `data`).
    pub path: Option<PathBuf>,
    /// A Hugging Face `tokenizer.json`. Default: the checkpoint's own if it has one, else bytes.
    pub tokenizer: Option<PathBuf>,
    /// Sequences per step.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Share of the corpus's windows held out for evaluation (evenly spread), never trained on.
    pub eval_fraction: f64,
    /// Evaluate the held-out windows every this many steps and at the last step (0: never).
    pub eval_every: usize,
    /// Batches of held-out windows one evaluation reads at most (fewer when the split is smaller).
    pub eval_batches: usize,
}

/// Default [`DataOptions::eval_fraction`]: 2% of the windows.
pub const DEFAULT_EVAL_FRACTION: f64 = 0.02;

impl Default for DataOptions {
    fn default() -> Self {
        Self {
            path: None,
            tokenizer: None,
            batch: 8,
            seq: 128,
            eval_fraction: DEFAULT_EVAL_FRACTION,
            eval_every: 0,
            eval_batches: 8,
        }
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
        if self.batch.checked_mul(self.seq).is_none() {
            return Err(TrainError::option(
                "seq",
                format!("batch ({}) x seq ({}) tokens per step is beyond any memory", self.batch, self.seq),
            ));
        }
        if !(0.0..=0.5).contains(&self.eval_fraction) {
            return Err(TrainError::option(
                "eval_fraction",
                format!("must be in 0..=0.5 (a share of the corpus held out), got {}", self.eval_fraction),
            ));
        }
        if self.eval_every > 0 && self.eval_fraction == 0.0 {
            return Err(TrainError::option("eval_every", "needs held-out data: eval_fraction must be above 0"));
        }
        if self.eval_batches == 0 {
            return Err(TrainError::option("eval_batches", "must be at least 1"));
        }
        Ok(())
    }

    /// Tokens in one step's batch.
    pub fn tokens_per_step(&self) -> usize {
        self.batch * self.seq
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by the `run_config_toml` fuzz target's check: `batch = 2^32`, `seq = 2^32` validated,
    /// and the tokens per step (`batch x seq`) overflowed.
    #[test]
    fn tokens_per_step_that_overflow_are_refused() {
        let d = DataOptions { batch: 1 << 32, seq: 1 << 32, ..DataOptions::default() };
        let e = d.validate().unwrap_err().to_string();
        assert!(e.contains("seq") && e.contains("tokens per step"), "{e}");
        let d = DataOptions { batch: 1 << 20, seq: 1 << 20, ..DataOptions::default() };
        assert!(d.validate().is_ok());
        assert_eq!(d.tokens_per_step(), 1 << 40);
    }
}
