//! `[optimizer]`: AdamW, the learning-rate schedule, and gradient clipping.

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};
use crate::optim::{AdamWSettings, LrSchedule};

/// AdamW and its learning-rate schedule (warm-up, then cosine decay to `min_lr`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimizerOptions {
    /// Peak learning rate.
    pub lr: f64,
    /// Final learning rate of the cosine decay.
    pub min_lr: f64,
    /// Warm-up steps (default: 10% of `steps`, at most 100).
    pub warmup_steps: Option<usize>,
    /// Decoupled weight decay on matrices.
    pub weight_decay: f64,
    /// AdamW beta1.
    pub beta1: f64,
    /// AdamW beta2.
    pub beta2: f64,
    /// AdamW epsilon.
    pub eps: f64,
    /// Clip the global gradient norm to this (0 turns clipping off).
    pub grad_clip: f64,
    /// What AdamW's two moments are kept in: `f32`, or `bf16` (half their bytes; each update
    /// reads them into f32, computes in f32 and rounds them back, as Megatron-Core's
    /// precision-aware optimizer does). A resume keeps the checkpoint's unless
    /// `--allow-change optimizer_state_dtype`.
    pub state_dtype: StateDtype,
}

/// The dtype of AdamW's moments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum StateDtype {
    /// 4 bytes per value.
    #[default]
    F32,
    /// 2 bytes per value.
    Bf16,
}

impl std::str::FromStr for StateDtype {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "f32" => Ok(Self::F32),
            "bf16" => Ok(Self::Bf16),
            _ => Err(format!("unknown optimizer state dtype {s:?} (allowed: f32, bf16)")),
        }
    }
}

impl StateDtype {
    /// Its name in options and `state.json`.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
        }
    }
}

impl Default for OptimizerOptions {
    fn default() -> Self {
        Self {
            lr: 3e-3,
            min_lr: 3e-4,
            warmup_steps: None,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            grad_clip: 1.0,
            state_dtype: StateDtype::F32,
        }
    }
}

impl OptimizerOptions {
    /// Checks the section against a run of `steps` steps; the error names the option and the
    /// allowed values.
    pub fn validate(&self, steps: usize) -> Result<()> {
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(TrainError::option("lr", format!("must be a finite number > 0, got {}", self.lr)));
        }
        if !(self.min_lr.is_finite() && self.min_lr >= 0.0 && self.min_lr <= self.lr) {
            return Err(TrainError::option(
                "min_lr",
                format!("must be between 0 and lr ({}), got {}", self.lr, self.min_lr),
            ));
        }
        if let Some(w) = self.warmup_steps {
            if w > steps {
                return Err(TrainError::option("warmup_steps", format!("must be at most steps ({steps}), got {w}")));
            }
        }
        for (field, v) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&v) {
                return Err(TrainError::option(field, format!("must be in [0, 1), got {v}")));
            }
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return Err(TrainError::option("eps", format!("must be a finite number > 0, got {}", self.eps)));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(TrainError::option("weight_decay", format!("must be >= 0, got {}", self.weight_decay)));
        }
        if !(self.grad_clip.is_finite() && self.grad_clip >= 0.0) {
            return Err(TrainError::option(
                "grad_clip",
                format!("must be >= 0 (0 turns clipping off), got {}", self.grad_clip),
            ));
        }
        Ok(())
    }

    /// The AdamW hyper-parameters.
    pub fn adamw(&self) -> AdamWSettings {
        AdamWSettings {
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
            bf16_moments: self.state_dtype == StateDtype::Bf16,
        }
    }

    /// The learning-rate schedule of a run of `steps` steps.
    pub fn lr_schedule(&self, steps: usize) -> LrSchedule {
        let warmup = self.warmup_steps.unwrap_or_else(|| default_warmup(steps));
        LrSchedule { peak: self.lr, min: self.min_lr, warmup, total: steps }
    }
}

/// The warm-up of a run of `steps` steps when `--warmup-steps` is not given: a tenth of the run,
/// at most 100 steps.
pub fn default_warmup(steps: usize) -> usize {
    (steps / 10).min(100)
}
