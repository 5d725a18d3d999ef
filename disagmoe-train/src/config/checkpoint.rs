//! `[checkpoint]`: training checkpoints, resuming, and stopping early.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};

/// Where and when the run writes training checkpoints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointOptions {
    /// Directory of training checkpoints (`step-<n>` subdirectories). Default: the `resume`
    /// directory when resuming, else none (flag `--checkpoint-dir`, flat key `checkpoint_dir`).
    pub dir: Option<PathBuf>,
    /// Write a checkpoint every this many steps (0: only at the end and when stopped early; flag
    /// `--checkpoint-every`, flat key `checkpoint_every`).
    pub every: usize,
    /// Checkpoints kept, the newest (flag `--keep-checkpoints`, flat key `keep_checkpoints`).
    pub keep: usize,
    /// Continue from the newest complete checkpoint in this directory.
    pub resume: Option<PathBuf>,
    /// End the run after this step with a checkpoint, as a job cut off by its scheduler (the
    /// learning-rate schedule still spans `steps`).
    pub stop_after: Option<usize>,
    /// Settings a resume may change on purpose (`seed`, `seq`, `batch`, `data`, `steps`,
    /// `schedule`); any other difference from the checkpoint's run is refused (flag
    /// `--allow-change`, repeatable).
    pub allow_change: Vec<String>,
}

impl Default for CheckpointOptions {
    fn default() -> Self {
        Self { dir: None, every: 0, keep: 3, resume: None, stop_after: None, allow_change: Vec::new() }
    }
}

impl CheckpointOptions {
    /// Checks the section against a run of `steps` steps.
    pub fn validate(&self, steps: usize) -> Result<()> {
        if self.keep == 0 {
            return Err(TrainError::option("keep_checkpoints", "must be at least 1"));
        }
        for c in &self.allow_change {
            if !crate::checkpoint::CHANGEABLE.contains(&c.as_str()) {
                return Err(TrainError::option(
                    "allow_change",
                    format!(
                        "`{c}` is not a setting a resume may change; allowed: {}",
                        crate::checkpoint::CHANGEABLE.join(", ")
                    ),
                ));
            }
        }
        if let Some(n) = self.stop_after {
            if n == 0 || n > steps {
                return Err(TrainError::option(
                    "stop_after",
                    format!("must be between 1 and steps ({steps}), got {n}"),
                ));
            }
        }
        Ok(())
    }

    /// The directory checkpoints go to: `dir`, else the directory resumed from.
    pub fn directory(&self) -> Option<PathBuf> {
        self.dir.clone().or_else(|| self.resume.clone())
    }

    /// Whether there is anything to write.
    pub fn enabled(&self) -> bool {
        self.directory().is_some()
    }
}
