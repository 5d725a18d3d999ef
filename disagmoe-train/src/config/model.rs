//! `[model]`: which model a run trains.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use disagmoe_models::ModelConfig;

use crate::error::{Result, TrainError};

/// The most multi-token prediction modules a run may train.
pub const MAX_MTP_DEPTH: usize = 8;

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
    /// ST-MoE's router z-loss: each MoE layer adds this times `mean_t logsumexp(logits_t)^2` to
    /// the loss (0, the default, turns it off).
    pub router_z_loss_coef: f64,
    /// Round-robin expert assignment (every expert the same count) instead of the router's
    /// choice: for throughput benchmarks, as other trainers' tables are measured.
    pub force_balanced_routing: bool,
    /// Capacity factor: each expert takes at most `ceil(c x T x k / E)` of a micro-batch's routed
    /// copies, in token order, and the rest are dropped (counted per layer in the metrics).
    /// Default: none, dropless.
    pub capacity_factor: Option<f64>,
    /// Multi-token prediction modules trained after the main model (DeepSeek-V3's MTP; 0, the
    /// default, trains none; refused by families without them).
    pub mtp_depth: usize,
    /// Weight of the multi-token prediction loss: the loss adds `coef / D * sum_k L_k`. Default
    /// 0.1 (Megatron-Core's; DeepSeek-V3's report used 0.3 for the first 10T tokens, then 0.1).
    pub mtp_loss_coef: Option<f64>,
}

impl ModelOptions {
    /// Whether a run adds the balance loss: as configured, else as the family decides
    /// (`family_default`); never without MoE layers.
    pub fn with_aux_loss(&self, family_default: bool, has_moe_layers: bool) -> bool {
        self.aux_loss.unwrap_or(family_default) && has_moe_layers
    }

    /// The router options every MoE layer applies.
    pub fn routing(&self) -> disagmoe_models::RoutingOptions {
        disagmoe_models::RoutingOptions {
            z_loss_coef: self.router_z_loss_coef,
            force_balanced: self.force_balanced_routing,
            capacity_factor: self.capacity_factor,
        }
    }

    /// The multi-token prediction the run trains, the default coefficient filled in.
    pub fn mtp(&self) -> disagmoe_models::MtpSettings {
        disagmoe_models::MtpSettings {
            depth: self.mtp_depth,
            loss_coef: self.mtp_loss_coef.unwrap_or(disagmoe_models::MtpSettings::DEFAULT_LOSS_COEF),
        }
    }

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
        let z = self.router_z_loss_coef;
        if !(z.is_finite() && (0.0..=1.0).contains(&z)) {
            return Err(TrainError::option(
                "router_z_loss_coef",
                format!("must be in 0..=1 (ST-MoE uses 1e-3), got {z}"),
            ));
        }
        if self.mtp_depth > MAX_MTP_DEPTH {
            return Err(TrainError::option(
                "mtp_depth",
                format!("must be in 0..={MAX_MTP_DEPTH} (DeepSeek-V3 trains 1), got {}", self.mtp_depth),
            ));
        }
        let coef = self.mtp().loss_coef;
        if !(coef.is_finite() && (0.0..=10.0).contains(&coef)) {
            return Err(TrainError::option(
                "mtp_loss_coef",
                format!("must be in 0..=10 (DeepSeek-V3 used 0.3, then 0.1), got {coef}"),
            ));
        }
        if self.mtp_loss_coef.is_some() && self.mtp_depth == 0 {
            return Err(TrainError::option("mtp_loss_coef", "is set but mtp_depth is 0: no MTP module to weigh"));
        }
        if let Some(c) = self.capacity_factor {
            if !(c.is_finite() && c > 0.0 && c <= 1e6) {
                return Err(TrainError::option(
                    "capacity_factor",
                    format!("must be a number > 0 (1.0: room for an even share; 1.25 is common), got {c}"),
                ));
            }
        }
        Ok(())
    }

    /// The configuration of the model the run trains, read without building it: the checkpoint's
    /// `config.json`, the given `config.json`, or the preset.
    /// The multi-token prediction of [`ModelOptions::mtp`] is set on it (a family without MTP
    /// modules refuses a depth above 0).
    pub fn resolve(&self) -> Result<ModelConfig> {
        let config = match (&self.dir, &self.config) {
            (Some(dir), _) => ModelConfig::from_file(dir.join("config.json"))?,
            (None, Some(path)) => ModelConfig::from_file(path)?,
            (None, None) => ModelConfig::preset(self.preset.as_deref().unwrap_or(DEFAULT_PRESET))?,
        };
        self.with_mtp(config)
    }

    /// `config` with the run's multi-token prediction set.
    pub fn with_mtp(&self, config: ModelConfig) -> Result<ModelConfig> {
        config.with_mtp(self.mtp()).map_err(|e| TrainError::option("mtp_depth", e.to_string()))
    }
}
