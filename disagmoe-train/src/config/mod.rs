//! The configuration of a training run, one section per concern, each validating itself.
//!
//! | section | type | keys |
//! |---|---|---|
//! | (top) | [`RunConfig`] | `steps`, `seed`, `out`, `tensorboard`, `save_dtype`, `log_every`, `progress`, `phases` (`[[phases]]` tables: [`RunPhase`]) |
//! | `[model]` | [`ModelOptions`] | `config`, `dir`, `preset`, `aux_loss`, `bias_update_rate`, `router_z_loss_coef`, `force_balanced_routing`, `capacity_factor`, `mtp_depth`, `mtp_loss_coef` |
//! | `[data]` | [`DataOptions`] | `path`, `tokenizer`, `batch`, `seq`, `eval_fraction`, `eval_every`, `eval_batches`, `document_mask`, `document_positions` |
//! | `[optimizer]` | [`OptimizerOptions`] | `lr`, `min_lr`, `warmup_steps`, `weight_decay`, `beta1`, `beta2`, `eps`, `grad_clip`, `state_dtype` (flat: `optimizer_state_dtype`) |
//! | `[checkpoint]` | [`CheckpointOptions`] | `dir`, `every`, `keep`, `resume`, `stop_after`, `allow_change` |
//! | `[parallel]` | [`ParallelOptions`] | `placement`, `attn_workers`, `ffn_workers`, `groups`, `allocation`, `workers`, `micro_batches`, `in_flight`, `threads_per_worker`, `devices`, `transport`, `link_gbps`, `link_latency_us`, `trace`, `comm_timeout_s`, `exchange_dtype`, `exchange_grad_dtype`, `exchange_payloads`, `distributed_optimizer`, `redundant_experts`, `expert_placement`, `expert_load`, `rebalance_every` |
//! | `[precision]` | [`PrecisionOptions`] | `compute`, `on_nonfinite`, `initial_loss_scale`, `loss_scale_window` |
//! | `[memory]` | [`MemoryOptions`] | `recompute` |
//!
//! A TOML run config (`--run-config`) may use the sections, or flat keys: every key above at the
//! top level (a test checks that every field of every section is reachable both ways), with these
//! spellings for the ones that were renamed inside their section (the flat keys of earlier
//! versions): `model_config` (`model.config`), `model_dir` (`model.dir`),
//! `model_preset` (`model.preset`), `data` (`data.path`), `checkpoint_dir` (`checkpoint.dir`),
//! `checkpoint_every` (`checkpoint.every`), `keep_checkpoints` (`checkpoint.keep`). Command-line flags
//! keep their names (`--lr`, `--checkpoint-dir`, ...) and override the file.
//!
//! Test-only fault injection is not part of it ([`faults`]).

pub mod checkpoint;
pub mod data;
pub mod faults;
pub mod memory;
pub mod model;
pub mod optimizer;
pub mod parallel;
pub mod phases;
pub mod precision;

use std::path::{Path, PathBuf};

use disagmoe_models::SaveDtype;
use serde::{Deserialize, Serialize};

pub use self::checkpoint::CheckpointOptions;
pub use self::data::{DataOptions, DocumentMask, DocumentPositions};
pub use self::faults::{CheckpointKill, CheckpointMoment, FaultInjection, FaultPlan, WorkerFault};
pub use self::memory::{MemoryOptions, Recompute};
pub use self::model::ModelOptions;
pub use self::optimizer::{OptimizerOptions, StateDtype};
pub use self::parallel::{
    AllocationMode, ExchangeDtype, ExchangePayloads, ExchangePrecision, ExpertLoad, ExpertPlacement, ParallelOptions,
    Placement, TransportKind,
};
pub use self::phases::RunPhase;
pub use self::precision::{NonFinitePolicy, Precision, PrecisionOptions};
use crate::error::{Result, TrainError};

/// Everything a training run needs to know, as a TOML file (`--run-config`) or from flags.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunConfig {
    /// Optimizer steps.
    pub steps: usize,
    /// Seed of initialisation and data order.
    pub seed: u64,
    /// Output directory: `metrics.jsonl` and the final model in `final/`.
    pub out: Option<PathBuf>,
    /// TensorBoard event files of the run go here (`crate::tensorboard`).
    pub tensorboard: Option<PathBuf>,
    /// The dtype of the final model's weights (`f32`, `bf16`, `f16`); training checkpoints keep
    /// the f32 master weights.
    pub save_dtype: SaveDtype,
    /// Print a log line every this many steps when there is no terminal for the progress bar.
    pub log_every: usize,
    /// Show the progress bar (when stderr is a terminal) or log lines.
    pub progress: bool,
    /// The model.
    pub model: ModelOptions,
    /// The corpus and the batch.
    pub data: DataOptions,
    /// AdamW and the learning-rate schedule.
    pub optimizer: OptimizerOptions,
    /// Training checkpoints.
    pub checkpoint: CheckpointOptions,
    /// Placement, workers and links.
    pub parallel: ParallelOptions,
    /// Numerics.
    pub precision: PrecisionOptions,
    /// Activation memory.
    pub memory: MemoryOptions,
    /// The run in phases of their own sequence length (and batch), in order; `steps` is their
    /// total (filled in when left out). Empty: one phase of `seq` and `batch`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub phases: Vec<RunPhase>,
    /// Testing only: faults to inject (never read from a run config file).
    #[serde(skip)]
    pub faults: FaultPlan,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            steps: 300,
            seed: 42,
            out: None,
            tensorboard: None,
            save_dtype: SaveDtype::F32,
            log_every: 10,
            progress: true,
            model: ModelOptions::default(),
            data: DataOptions::default(),
            optimizer: OptimizerOptions::default(),
            checkpoint: CheckpointOptions::default(),
            parallel: ParallelOptions::default(),
            precision: PrecisionOptions::default(),
            memory: MemoryOptions::default(),
            phases: Vec::new(),
            faults: FaultPlan::default(),
        }
    }
}

/// Sections of a run config, and the flat keys of earlier versions each one takes (flat key,
/// key inside the section).
const SECTIONS: &[(&str, &[(&str, &str)])] = &[
    (
        "model",
        &[
            ("model_config", "config"),
            ("model_dir", "dir"),
            ("model_preset", "preset"),
            ("aux_loss", "aux_loss"),
            ("bias_update_rate", "bias_update_rate"),
            ("router_z_loss_coef", "router_z_loss_coef"),
            ("force_balanced_routing", "force_balanced_routing"),
            ("capacity_factor", "capacity_factor"),
            ("mtp_depth", "mtp_depth"),
            ("mtp_loss_coef", "mtp_loss_coef"),
        ],
    ),
    (
        "data",
        &[
            ("data", "path"),
            ("blend", "blend"),
            ("tokenizer", "tokenizer"),
            ("batch", "batch"),
            ("seq", "seq"),
            ("eval_fraction", "eval_fraction"),
            ("eval_every", "eval_every"),
            ("eval_batches", "eval_batches"),
            ("document_mask", "document_mask"),
            ("document_positions", "document_positions"),
        ],
    ),
    (
        "optimizer",
        &[
            ("lr", "lr"),
            ("min_lr", "min_lr"),
            ("warmup_steps", "warmup_steps"),
            ("weight_decay", "weight_decay"),
            ("beta1", "beta1"),
            ("beta2", "beta2"),
            ("eps", "eps"),
            ("grad_clip", "grad_clip"),
            ("optimizer_state_dtype", "state_dtype"),
        ],
    ),
    (
        "checkpoint",
        &[
            ("checkpoint_dir", "dir"),
            ("checkpoint_every", "every"),
            ("keep_checkpoints", "keep"),
            ("resume", "resume"),
            ("stop_after", "stop_after"),
            ("allow_change", "allow_change"),
        ],
    ),
    (
        "parallel",
        &[
            ("placement", "placement"),
            ("attn_workers", "attn_workers"),
            ("ffn_workers", "ffn_workers"),
            ("groups", "groups"),
            ("allocation", "allocation"),
            ("workers", "workers"),
            ("micro_batches", "micro_batches"),
            ("in_flight", "in_flight"),
            ("max_in_flight", "in_flight"),
            ("threads_per_worker", "threads_per_worker"),
            ("devices", "devices"),
            ("transport", "transport"),
            ("link_gbps", "link_gbps"),
            ("link_latency_us", "link_latency_us"),
            ("trace", "trace"),
            ("comm_timeout_s", "comm_timeout_s"),
            ("exchange_dtype", "exchange_dtype"),
            ("exchange_grad_dtype", "exchange_grad_dtype"),
            ("exchange_payloads", "exchange_payloads"),
            ("distributed_optimizer", "distributed_optimizer"),
            ("redundant_experts", "redundant_experts"),
            ("expert_placement", "expert_placement"),
            ("expert_load", "expert_load"),
            ("rebalance_every", "rebalance_every"),
            ("context_parallel", "context_parallel"),
        ],
    ),
    (
        "precision",
        &[
            ("compute", "compute"),
            ("on_nonfinite", "on_nonfinite"),
            ("initial_loss_scale", "initial_loss_scale"),
            ("loss_scale_window", "loss_scale_window"),
        ],
    ),
    ("memory", &[("recompute", "recompute")]),
];

/// Top-level keys that are not sections.
const TOP_LEVEL: &[&str] = &["steps", "seed", "out", "tensorboard", "save_dtype", "log_every", "progress", "phases"];

/// Moves the flat keys of a run config into their sections; refuses unknown keys (naming the
/// allowed ones) and the test-only fault keys.
fn nest_flat_keys(mut table: toml::Table) -> std::result::Result<toml::Table, String> {
    let mut out = toml::Table::new();
    for (section, _) in SECTIONS {
        match table.remove(*section) {
            Some(toml::Value::Table(t)) => {
                out.insert((*section).to_owned(), toml::Value::Table(t));
            }
            // `data = "corpus.txt"`: the flat key of the corpus path, not the section.
            Some(v) if *section == "data" => {
                table.insert("data".to_owned(), v);
            }
            Some(other) => return Err(format!("`{section}` must be a table ([{section}]), got {}", other.type_str())),
            None => {}
        }
    }
    for (key, value) in table {
        if TOP_LEVEL.contains(&key.as_str()) {
            out.insert(key, value);
            continue;
        }
        if key == "fail_worker" || key == "inject_nonfinite" {
            return Err(format!(
                "`{key}` is a testing hook, not a run option; tests set it through the {} environment variable",
                faults::FAULTS_ENV
            ));
        }
        let Some((section, inner)) = SECTIONS
            .iter()
            .find_map(|(s, keys)| keys.iter().find(|(flat, _)| *flat == key).map(|(_, inner)| (*s, *inner)))
        else {
            let mut allowed: Vec<&str> = TOP_LEVEL.to_vec();
            allowed.extend(SECTIONS.iter().map(|(s, _)| *s));
            allowed.extend(SECTIONS.iter().flat_map(|(_, keys)| keys.iter().map(|(flat, _)| *flat)));
            return Err(format!("unknown key `{key}`; allowed: {}", allowed.join(", ")));
        };
        let entry = out.entry(section.to_owned()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        let toml::Value::Table(t) = entry else { unreachable!("sections are tables") };
        if t.contains_key(inner) {
            return Err(format!("`{key}` is given twice (flat and as {section}.{inner})"));
        }
        t.insert(inner.to_owned(), value);
    }
    Ok(out)
}

impl RunConfig {
    /// Parses a TOML run config (sections or flat keys); unknown keys are errors.
    pub fn from_toml_str(text: &str) -> std::result::Result<Self, String> {
        let table: toml::Table = toml::from_str(text).map_err(|e| e.to_string())?;
        let steps_given = table.contains_key("steps");
        let nested = nest_flat_keys(table)?;
        let mut cfg: Self = toml::Value::Table(nested).try_into().map_err(|e: toml::de::Error| e.to_string())?;
        cfg.data.blend_from_path().map_err(|e| e.to_string())?;
        if !steps_given {
            cfg.steps_from_phases();
        }
        Ok(cfg)
    }

    /// Reads a TOML run config; unknown keys are errors.
    pub fn from_toml_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| TrainError::Io {
            action: "cannot read run config",
            path: path.into(),
            source,
        })?;
        Self::from_toml_str(&text).map_err(|message| TrainError::RunConfig { path: path.into(), message })
    }

    /// `steps` as the phases' total, when there are phases (and their total is defined).
    pub fn steps_from_phases(&mut self) {
        if let Some(total) = phases::phase_ends(&self.phases).and_then(|e| e.last().copied()) {
            self.steps = total;
        }
    }

    /// This run's phase `i` (below `phases.len()`): its sequence length and batch in `data`, no
    /// phases of its own.
    pub fn phase(&self, i: usize) -> Self {
        let mut cfg = self.clone();
        let p = self.phases[i];
        cfg.data.seq = p.seq;
        cfg.data.batch = p.batch.unwrap_or(self.data.batch);
        cfg.phases.clear();
        cfg
    }

    /// Checks the phases: their total is `steps`, each is a valid run of its shape, and the run
    /// can restart its workers at a boundary (the local transport).
    fn validate_phases(&self) -> Result<()> {
        let Some(ends) = phases::phase_ends(&self.phases) else {
            return Err(TrainError::option("phases", "the phases' steps overflow when added up"));
        };
        let total = *ends.last().expect("not empty");
        if total != self.steps {
            return Err(TrainError::option(
                "steps",
                format!("the phases add up to {total} steps; steps must be {total} (or left out), got {}", self.steps),
            ));
        }
        if self.parallel.transport != TransportKind::Local {
            return Err(TrainError::option(
                "phases",
                "a run in phases restarts its workers at each boundary, which needs transport local; under mpirun \
                 run each phase as its own job (--seq, --stop-after at the boundary, --resume with --allow-change seq)",
            ));
        }
        for (i, p) in self.phases.iter().enumerate() {
            if p.steps == 0 {
                return Err(TrainError::option(
                    "phases",
                    format!("phase {} ({}): needs at least 1 step", i + 1, p.describe()),
                ));
            }
            (self.phase(i).validate_shape())
                .map_err(|e| TrainError::option("phases", format!("phase {} ({}): {e}", i + 1, p.describe())))?;
        }
        Ok(())
    }

    /// Checks what depends on the step's shape (`seq` and `batch`): the data, the parallel
    /// layout, and multi-token prediction's `mtp_depth + 2` tokens per sequence.
    fn validate_shape(&self) -> Result<()> {
        self.data.validate()?;
        self.parallel.validate(self.data.batch)?;
        let c = self.parallel.context_parallel;
        if c > 1 {
            if self.data.seq % (2 * c) != 0 {
                return Err(TrainError::option(
                    "seq",
                    format!(
                        "must be a multiple of 2 x context_parallel = {} (two equal chunks per worker), got {}",
                        2 * c,
                        self.data.seq
                    ),
                ));
            }
            if self.model.capacity_factor.is_some() || self.model.force_balanced_routing {
                return Err(TrainError::option(
                    "context_parallel",
                    format!("1 with capacity_factor or force_balanced_routing (they act on a whole micro-batch's tokens, a worker of a ring holds part of them), got {c}"),
                ));
            }
        }
        let depth = self.model.mtp_depth;
        if depth > 0 && self.data.seq < depth + 2 {
            return Err(TrainError::option(
                "seq",
                format!(
                    "must be at least mtp_depth + 2 = {} tokens (module D predicts D + 1 tokens ahead), got {}",
                    depth + 2,
                    self.data.seq
                ),
            ));
        }
        Ok(())
    }

    /// Checks every section once; the error names the option and the allowed values.
    pub fn validate(&self) -> Result<()> {
        if self.steps == 0 {
            return Err(TrainError::option("steps", "must be at least 1"));
        }
        if self.log_every == 0 {
            return Err(TrainError::option("log_every", "must be at least 1"));
        }
        self.model.validate()?;
        self.optimizer.validate(self.steps)?;
        self.checkpoint.validate(self.steps)?;
        self.precision.validate()?;
        if self.phases.is_empty() {
            self.validate_shape()
        } else {
            // The phases' shapes replace `seq` and `batch`: each is checked as its own run.
            self.validate_phases()
        }
    }

    /// Micro-batches per step, the default filled in.
    pub fn micro_batches(&self) -> usize {
        self.parallel.micro_batches()
    }

    /// The last step this invocation runs (`stop_after`, else `steps`).
    pub fn last_step(&self) -> usize {
        self.checkpoint.stop_after.unwrap_or(self.steps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flat_keys_and_sections_give_the_same_config() {
        let flat = RunConfig::from_toml_str(
            "steps = 7\nlr = 0.01\nmodel_preset = \"tiny-gpt-oss\"\ndata = \"c.txt\"\ncheckpoint_every = 5\nplacement = \"ep\"\non_nonfinite = \"abort\"\n",
        )
        .unwrap();
        let nested = RunConfig::from_toml_str(
            "steps = 7\n[optimizer]\nlr = 0.01\n[model]\npreset = \"tiny-gpt-oss\"\n[data]\npath = \"c.txt\"\n[checkpoint]\nevery = 5\n[parallel]\nplacement = \"ep\"\n[precision]\non_nonfinite = \"abort\"\n",
        )
        .unwrap();
        assert_eq!(flat, nested);
        assert_eq!(flat.optimizer.lr, 0.01);
        assert_eq!(flat.data.path.as_deref(), Some(Path::new("c.txt")));
        assert_eq!(flat.parallel.placement, Placement::Ep);
        assert_eq!(flat.precision.on_nonfinite, NonFinitePolicy::Abort);
    }

    /// Every field of every section is reachable as `[section] key` and as its flat key, and both
    /// set the same value (a value other than the default where one can be made).
    #[test]
    fn every_field_is_reachable_in_its_section_and_as_a_flat_key() {
        let json = serde_json::to_value(RunConfig::default()).unwrap();
        let mut fields = 0;
        for (key, value) in json.as_object().unwrap() {
            let Some(section) = value.as_object() else {
                assert!(TOP_LEVEL.contains(&key.as_str()), "top-level `{key}` is not listed in TOP_LEVEL");
                continue;
            };
            let flat_keys =
                SECTIONS.iter().find(|(s, _)| s == key).unwrap_or_else(|| panic!("[{key}] is not listed")).1;
            for (inner, v) in section {
                let flat = flat_keys
                    .iter()
                    .find(|(_, i)| i == inner)
                    .map(|(f, _)| *f)
                    .unwrap_or_else(|| panic!("`{key}.{inner}` has no flat key"));
                // A value of the field's type, changed from the default where possible.
                let candidates: Vec<String> = match v {
                    serde_json::Value::Bool(b) => vec![(!b).to_string()],
                    serde_json::Value::Number(n) if n.is_u64() => vec![(n.as_u64().unwrap() + 1).to_string()],
                    serde_json::Value::Number(n) => vec![format!("{:?}", n.as_f64().unwrap() + 0.5)],
                    serde_json::Value::String(s) => vec![format!("{s:?}")],
                    _ => vec![
                        "1".into(),
                        "0.5".into(),
                        "\"x\"".into(),
                        "[]".into(),
                        "true".into(),
                        "\"bf16\"".into(),
                        "\"balanced\"".into(),
                    ],
                };
                let (nested, text) = candidates
                    .iter()
                    .find_map(|t| RunConfig::from_toml_str(&format!("[{key}]\n{inner} = {t}\n")).ok().map(|c| (c, t)))
                    .unwrap_or_else(|| panic!("no value of `{key}.{inner}` parses: {candidates:?}"));
                let flat_cfg = RunConfig::from_toml_str(&format!("{flat} = {text}\n"))
                    .unwrap_or_else(|e| panic!("flat `{flat}` = {text} is refused: {e}"));
                assert_eq!(flat_cfg, nested, "`{flat}` and `{key}.{inner}` = {text}");
                if !matches!(v, serde_json::Value::String(_) | serde_json::Value::Array(_)) {
                    assert_ne!(nested, RunConfig::default(), "`{key}.{inner}` = {text} changes nothing");
                }
                fields += 1;
            }
        }
        assert!(fields > 40, "{fields} fields checked");
    }

    #[test]
    fn unknown_keys_and_test_hooks_are_refused_by_name() {
        let e = RunConfig::from_toml_str("learning_rate = 1.0").unwrap_err();
        assert!(e.contains("learning_rate") && e.contains("lr"), "{e}");
        let e = RunConfig::from_toml_str("[optimizer]\nlearning_rate = 1.0").unwrap_err();
        assert!(e.contains("learning_rate"), "{e}");
        let e = RunConfig::from_toml_str("[fail_worker]\nworker = 1\nstep = 1\n").unwrap_err();
        assert!(e.contains("testing hook") && e.contains(faults::FAULTS_ENV), "{e}");
        let e = RunConfig::from_toml_str("lr = 0.1\n[optimizer]\nlr = 0.2\n").unwrap_err();
        assert!(e.contains("twice"), "{e}");
    }

    #[test]
    fn every_section_validates_its_own_fields() {
        let mut c = RunConfig::default();
        c.optimizer.beta2 = 1.0;
        assert!(c.validate().unwrap_err().to_string().contains("beta2"));
        let mut c = RunConfig::default();
        c.data.batch = 6;
        c.parallel.micro_batches = Some(4);
        assert!(c.validate().unwrap_err().to_string().contains("micro_batches"));
        let mut c = RunConfig::default();
        c.checkpoint.stop_after = Some(301);
        assert!(c.validate().unwrap_err().to_string().contains("stop_after"));
        let c =
            RunConfig::from_toml_str("[data]\ndocument_mask = \"off\"\ndocument_positions = \"restart\"\n").unwrap();
        assert!(c.validate().unwrap_err().to_string().contains("document_positions"));
        let c = RunConfig::from_toml_str("document_mask = \"on\"\ndocument_positions = \"restart\"\n").unwrap();
        assert_eq!((c.data.document_mask, c.data.document_positions), (DocumentMask::On, DocumentPositions::Restart));
        assert!(c.data.masks_documents());
        let e = RunConfig::from_toml_str("[data]\ndocument_mask = \"yes\"\n").unwrap_err();
        assert!(e.contains("document_mask") || e.contains("auto"), "{e}");
    }
}
