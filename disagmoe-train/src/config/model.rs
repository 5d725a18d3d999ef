//! `[model]`: which model a run trains.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use disagmoe_models::ModelConfig;

use crate::error::{Result, TrainError};

/// The embedded preset used when no model is named.
pub const DEFAULT_PRESET: &str = "tiny-qwen3-moe";

/// Which model to train and how its routers are balanced.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelOptions {
    /// A Hugging Face style `config.json`: train a freshly initialised model of that shape
    /// (flag `--model-config`, flat key `model_config`).
    pub config: Option<PathBuf>,
    /// A checkpoint directory (`config.json` + safetensors): continue from its weights (flag
    /// `--model-dir`, flat key `model_dir`).
    pub dir: Option<PathBuf>,
    /// An embedded model configuration (see `disagmoe_models::model_presets`); used when neither
    /// `config` nor `dir` is given. Default: `tiny-qwen3-moe` (flag `--model-preset`, flat key
    /// `model_preset`).
    pub preset: Option<String>,
    /// Add the balance loss (default: as the family decides: transformers adds the Switch loss
    /// with `output_router_logits`, DeepSeekMoE whenever `aux_loss_alpha > 0`).
    pub aux_loss: Option<bool>,
    /// Aux-loss-free balancing: after each update, routers with a correction bias (DeepSeek-V3)
    /// move it by this much towards balance (0 turns it off). Default 0.001.
    pub bias_update_rate: Option<f64>,
}

impl ModelOptions {
    /// The aux-loss-free bias step, the default filled in.
    pub fn bias_update_rate(&self) -> f64 {
        self.bias_update_rate.unwrap_or(0.001)
    }

    /// Checks the section; the error names the option and the allowed values.
    pub fn validate(&self) -> Result<()> {
        if self.config.is_some() && self.dir.is_some() {
            return Err(TrainError::option("model_config", "give either model_config or model_dir, not both"));
        }
        if let Some(p) = &self.preset {
            ModelConfig::preset(p).map_err(|e| TrainError::option("model_preset", e.to_string()))?;
        }
        let rate = self.bias_update_rate();
        if !(rate.is_finite() && rate >= 0.0) {
            return Err(TrainError::option("bias_update_rate", format!("must be a finite number >= 0, got {rate}")));
        }
        Ok(())
    }

    /// The configuration of the model the run trains, read without building it: the checkpoint's
    /// `config.json`, the given `config.json`, or the preset.
    pub fn resolve(&self) -> Result<ModelConfig> {
        Ok(match (&self.dir, &self.config) {
            (Some(dir), _) => ModelConfig::from_file(dir.join("config.json"))?,
            (None, Some(path)) => ModelConfig::from_file(path)?,
            (None, None) => ModelConfig::preset(self.preset.as_deref().unwrap_or(DEFAULT_PRESET))?,
        })
    }
}
