//! Training checkpoints: everything needed to continue a run exactly where it stopped, under the
//! placement that wrote it or any other.
//!
//! A checkpoint is a directory `step-<8 digits>` inside the checkpoint directory, laid out the same
//! way whatever placement wrote it:
//! - the model, as a Hugging Face directory (f32): `config.json` and `model.safetensors` (one
//!   device), or one file per worker plus the stacked expert files and
//!   `model.safetensors.index.json` (a distributed run, see `runtime::shards`); transformers loads
//!   it either way;
//! - `exp_avg/`, `exp_avg_sq/`: AdamW's two moments, each laid out exactly as the model (the same
//!   tensor names and shapes, the same files), so that any placement reads its rows of the moments
//!   the way it reads its rows of the weights;
//! - `state.json`: [`TrainState`] (step, optimizer steps, data position, losses so far, and the
//!   run's settings, which a resume checks);
//! - `manifest.json`: the SHA-256 of every other file (paths relative to the checkpoint), written
//!   last.
//!
//! **Commit.** Everything is written into `.step-<n>.partial/`, each file synced by its writer. In
//! a distributed run every worker writes its own tensors and moments and reports them durable to
//! rank 0, which alone writes the indexes, `state.json` and the manifest ([`commit`]): it syncs the
//! directories, moves an existing `step-<n>` aside, renames the partial directory into place, syncs
//! the parent, and only then removes the old copy and prunes older checkpoints. A crash at any
//! moment (even SIGKILL of one worker) leaves the previous checkpoints untouched and at worst a
//! partial directory, which is never picked up; [`latest_checkpoint`] also skips any checkpoint
//! whose files do not match its manifest.
//!
//! The only randomness of a run is the seeded initialisation and the data order, a function of
//! `(seed, epoch)`, so the seed and the data position are the RNG state. Checkpoints of earlier
//! versions (`optimizer.safetensors` with flattened moments) still resume on one device.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use burn::tensor::backend::AutodiffBackend;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use disagmoe_models::{CheckpointReader, HfCheckpoint, MoeCausalLm};

use crate::config::RunConfig;
use crate::data::DataPosition;
use crate::error::{Result, TrainError};
use crate::optim::{AdamW, Moment};

/// Format tag of the manifest.
pub const FORMAT: &str = "disagmoe-checkpoint-v2";

/// Where a run is: what a checkpoint needs besides the weights and moments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    /// Steps completed.
    pub step: usize,
    /// Updates the optimizer has applied (fewer than `step` when some were skipped).
    pub optimizer_steps: u64,
    /// Position of the next batch.
    pub data: DataPosition,
    /// Loss of every completed step (a non-finite one, whose update was skipped, is written as
    /// `null` and read back as NaN).
    #[serde(deserialize_with = "losses_with_gaps")]
    pub losses: Vec<f64>,
    /// Steps skipped for non-finite values.
    pub skipped_steps: usize,
    /// Seed of the run (initialisation and data order).
    pub seed: u64,
    /// Steps the run was configured for (the learning-rate schedule spans these).
    pub total_steps: usize,
    /// The settings of the run that wrote it (absent in checkpoints of earlier versions).
    #[serde(default)]
    pub settings: Option<RunSettings>,
    /// The placement that wrote it, for people (`single`, `disagg 2+2 in 2 groups`, `ep 4`).
    #[serde(default)]
    pub written_by: Option<String>,
    /// f16's loss scaler (absent for other precisions and in older checkpoints).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<crate::loss_scale::LossScaleState>,
}

/// Reads losses where a non-finite one was written as `null` (JSON has no NaN).
fn losses_with_gaps<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Vec<f64>, D::Error> {
    let v: Vec<Option<f64>> = Deserialize::deserialize(d)?;
    Ok(v.into_iter().map(|x| x.unwrap_or(f64::NAN)).collect())
}

impl TrainState {
    /// Parses `state.json` and checks that it describes a run that can be continued: a loss for
    /// every completed step, no more optimizer updates or skipped steps than steps, no more steps
    /// than the run was configured for, and the same seed in the state and its settings. The
    /// error names what is wrong.
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        let state: Self = serde_json::from_str(text).map_err(|e| format!("state.json: {e}"))?;
        let step = state.step;
        let problem = if state.losses.len() != step {
            Some(format!("{} losses recorded for {step} steps", state.losses.len()))
        } else if state.optimizer_steps > step as u64 {
            Some(format!("{} optimizer updates in {step} steps", state.optimizer_steps))
        } else if state.skipped_steps > step {
            Some(format!("{} skipped steps of {step}", state.skipped_steps))
        } else if step > state.total_steps {
            Some(format!("step {step} beyond the run's {} steps", state.total_steps))
        } else if state.settings.as_ref().is_some_and(|s| s.seed != state.seed || s.steps != state.total_steps) {
            Some("the settings' seed or steps differ from the state's".to_string())
        } else {
            None
        };
        match problem {
            Some(p) => Err(format!("state.json is inconsistent: {p}")),
            None => Ok(state),
        }
    }
}

/// The settings that make a run that run: a resume under different ones is refused unless the
/// change is allowed by name (`--allow-change`). The placement, workers and transport are not
/// among them (resuming under another is resharding).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunSettings {
    /// `--seed`.
    pub seed: u64,
    /// `--seq`.
    pub seq: usize,
    /// `--batch`.
    pub batch: usize,
    /// `--data` (the corpus file, or the bundled corpus).
    pub data: String,
    /// `--tokenizer` (a tokenizer.json, or the default).
    pub tokenizer: String,
    /// `--eval-fraction`: the held-out windows are not trained on (checkpoints from before the
    /// split held none out).
    #[serde(default)]
    pub eval_fraction: f64,
    /// `--steps`.
    pub steps: usize,
    /// `--lr`.
    pub lr: f64,
    /// `--min-lr`.
    pub min_lr: f64,
    /// `--warmup-steps`, resolved.
    pub warmup_steps: usize,
    /// `--weight-decay`.
    pub weight_decay: f64,
    /// AdamW's betas and epsilon.
    pub betas_eps: [f64; 3],
    /// `--grad-clip`.
    pub grad_clip: f64,
    /// The model: its family and shape.
    pub model: serde_json::Value,
    /// Micro-batches per step (a change is reported, not refused: the balance loss is per
    /// micro-batch, so it changes the objective slightly).
    pub micro_batches: usize,
    /// `--optimizer-state-dtype` (checkpoints from before it kept f32 moments).
    #[serde(default)]
    pub optimizer_state_dtype: crate::config::StateDtype,
    /// Whether windows were masked by document, `--document-mask` resolved (checkpoints from
    /// before it trained unmasked).
    #[serde(default)]
    pub document_mask: bool,
    /// `--document-positions` (checkpoints from before it continued positions).
    #[serde(default)]
    pub document_positions: crate::config::DocumentPositions,
}

/// Settings a resume may change on request, as `--allow-change` takes them.
pub const CHANGEABLE: &[&str] = &["seed", "seq", "batch", "data", "steps", "schedule", "optimizer_state_dtype"];

impl RunSettings {
    /// The settings of `cfg` (its model resolved without building it).
    pub fn of(cfg: &RunConfig) -> Result<Self> {
        let model = cfg.model.resolve()?;
        let shape = model.model_shape("");
        let o = &cfg.optimizer;
        let schedule = o.lr_schedule(cfg.steps);
        Ok(Self {
            seed: cfg.seed,
            seq: cfg.data.seq,
            batch: cfg.data.batch,
            data: cfg.data.describe(),
            tokenizer: cfg.data.tokenizer.as_ref().map_or_else(|| "default".into(), |p| p.display().to_string()),
            eval_fraction: cfg.data.eval_fraction,
            steps: cfg.steps,
            lr: o.lr,
            min_lr: o.min_lr,
            warmup_steps: schedule.warmup,
            weight_decay: o.weight_decay,
            betas_eps: [o.beta1, o.beta2, o.eps],
            grad_clip: o.grad_clip,
            model: serde_json::json!({"model_type": model.model_type(), "shape": shape}),
            micro_batches: cfg.micro_batches(),
            optimizer_state_dtype: o.state_dtype,
            document_mask: cfg.data.masks_documents(),
            document_positions: cfg.data.document_positions,
        })
    }

    /// Refuses a resume whose settings `now` differ from these (the checkpoint's) where the change
    /// is not in `allowed`; the error names the setting, both values, and the flags that settle it.
    pub fn check_resume(&self, now: &Self, allowed: &[String], checkpoint: &Path) -> Result<()> {
        let allows = |name: &str| allowed.iter().any(|a| a == name);
        let show = |v: &dyn std::fmt::Display| v.to_string();
        let on_off = |b: bool| if b { "on" } else { "off" };
        // (allow-change name, flag, checkpoint's value, this run's value)
        let pairs: Vec<(&str, &str, String, String)> = vec![
            ("seed", "--seed", show(&self.seed), show(&now.seed)),
            ("seq", "--seq", show(&self.seq), show(&now.seq)),
            ("batch", "--batch", show(&self.batch), show(&now.batch)),
            ("data", "--data", self.data.clone(), now.data.clone()),
            ("data", "--tokenizer", self.tokenizer.clone(), now.tokenizer.clone()),
            ("data", "--eval-fraction", show(&self.eval_fraction), show(&now.eval_fraction)),
            ("data", "--document-mask", on_off(self.document_mask).into(), on_off(now.document_mask).into()),
            (
                "data",
                "--document-positions",
                self.document_positions.name().into(),
                now.document_positions.name().into(),
            ),
            ("steps", "--steps", show(&self.steps), show(&now.steps)),
            ("schedule", "--lr", show(&self.lr), show(&now.lr)),
            ("schedule", "--min-lr", show(&self.min_lr), show(&now.min_lr)),
            ("schedule", "--warmup-steps", show(&self.warmup_steps), show(&now.warmup_steps)),
            ("schedule", "--weight-decay", show(&self.weight_decay), show(&now.weight_decay)),
            ("schedule", "beta1/beta2/eps", format!("{:?}", self.betas_eps), format!("{:?}", now.betas_eps)),
            ("schedule", "--grad-clip", show(&self.grad_clip), show(&now.grad_clip)),
            // Moments rounded to bf16, or bf16 moments continued in f32: not the run the
            // checkpoint was part of.
            (
                "optimizer_state_dtype",
                "--optimizer-state-dtype",
                self.optimizer_state_dtype.name().into(),
                now.optimizer_state_dtype.name().into(),
            ),
        ];
        // A warm-up left at its default follows --steps: with the steps change allowed, it changes
        // with them (reported) rather than counting as a schedule change.
        let default = crate::config::optimizer::default_warmup;
        let warmup_follows_steps = allows("steps")
            && self.warmup_steps != now.warmup_steps
            && self.warmup_steps == default(self.steps)
            && now.warmup_steps == default(now.steps);
        if warmup_follows_steps {
            tracing::warn!(
                was = self.warmup_steps,
                now = now.warmup_steps,
                "the default warm-up follows --steps; pass --warmup-steps to keep it"
            );
        }
        for (name, flag, was, is) in pairs {
            if was != is && !allows(name) && !(flag == "--warmup-steps" && warmup_follows_steps) {
                let extend = if name == "steps" {
                    " (to extend the run; the learning-rate schedule then spans the new count)"
                } else {
                    ""
                };
                return Err(TrainError::Checkpoint {
                    path: checkpoint.into(),
                    message: format!(
                        "was written by a run with {flag} {was}, this run has {flag} {is}; pass {flag} {was} to continue that run, or --allow-change {name} to change it on purpose{extend}"
                    ),
                });
            }
        }
        if self.model != now.model {
            let (was, is) = describe_model_difference(&self.model, &now.model);
            return Err(TrainError::Checkpoint {
                path: checkpoint.into(),
                message: format!(
                    "holds a different model ({was}; this run: {is}); pass the --model-preset, --model-config or --model-dir the run started with"
                ),
            });
        }
        if self.micro_batches != now.micro_batches {
            tracing::warn!(
                was = self.micro_batches,
                now = now.micro_batches,
                "micro-batches per step changed on resume: the balance loss is computed per micro-batch, so the objective changes slightly"
            );
        }
        Ok(())
    }
}

/// The first field in which two model descriptions differ, as `field value` for each.
fn describe_model_difference(a: &serde_json::Value, b: &serde_json::Value) -> (String, String) {
    fn walk(path: &str, a: &serde_json::Value, b: &serde_json::Value) -> Option<(String, String)> {
        match (a, b) {
            (serde_json::Value::Object(x), serde_json::Value::Object(y)) => {
                for (k, va) in x {
                    let vb = y.get(k).unwrap_or(&serde_json::Value::Null);
                    if va != vb {
                        let p = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
                        return walk(&p, va, vb).or(Some((format!("{p} {va}"), format!("{p} {vb}"))));
                    }
                }
                None
            }
            _ if a != b => Some((format!("{path} {a}"), format!("{path} {b}"))),
            _ => None,
        }
    }
    walk("", a, b).unwrap_or_else(|| (a.to_string(), b.to_string()))
}

/// A fresh directory under the system's temporary directory, removed when dropped (also when
/// the work using it fails) unless [`ScratchDir::keep`] takes it.
pub(crate) struct ScratchDir(Option<PathBuf>);

impl ScratchDir {
    /// Creates `<temp>/<prefix>-<pid>-<nanos>`; `action` names it in the error
    /// (`cannot create ...`).
    pub(crate) fn create(prefix: &str, action: &'static str) -> Result<Self> {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let dir = std::env::temp_dir().join(format!("{prefix}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(io(action, &dir))?;
        Ok(Self(Some(dir)))
    }

    /// Its path.
    pub(crate) fn path(&self) -> &Path {
        self.0.as_deref().expect("kept only by `keep`, which consumes it")
    }

    /// Keeps the directory: it is not removed, and its path is returned.
    pub(crate) fn keep(mut self) -> PathBuf {
        self.0.take().expect("not kept yet")
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        if let Some(dir) = &self.0 {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

fn io<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> TrainError + 'a {
    move |source| TrainError::Io { action, path: path.into(), source }
}

/// SHA-256 of a file, as lowercase hex (read in 1 MiB blocks).
pub(crate) fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).map_err(io("cannot open", path))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io("cannot read", path))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(format!("{:x}", h.finalize()))
}

/// Makes a directory's entries (created, renamed or removed files) durable.
fn sync_dir(path: &Path) -> Result<()> {
    std::fs::File::open(path).and_then(|d| d.sync_all()).map_err(io("cannot sync directory", path))
}

/// The name of step `step`'s checkpoint directory.
pub fn step_dir_name(step: usize) -> String {
    format!("step-{step:08}")
}

/// Where step `step`'s checkpoint is written before it is committed.
pub fn partial_dir(dir: &Path, step: usize) -> PathBuf {
    dir.join(format!(".{}.partial", step_dir_name(step)))
}

/// The directory of one moment inside a checkpoint.
pub fn moment_dir(checkpoint: &Path, moment: Moment) -> PathBuf {
    checkpoint.join(moment.name())
}

/// Phase 0 of a checkpoint: an empty `.step-<n>.partial` (a stale one from a crash removed).
pub fn begin(dir: &Path, step: usize) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).map_err(io("cannot create checkpoint directory", dir))?;
    let tmp = partial_dir(dir, step);
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io("cannot remove stale partial checkpoint", &tmp))?;
    }
    for d in [tmp.clone(), moment_dir(&tmp, Moment::First), moment_dir(&tmp, Moment::Second)] {
        std::fs::create_dir_all(&d).map_err(io("cannot create", &d))?;
    }
    Ok(tmp)
}

/// Every file under `root` (relative paths, `/`-separated), sorted.
fn files_under(root: &Path) -> Result<Vec<String>> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).map_err(io("cannot list", &d))? {
            let path = entry.map_err(io("cannot list", &d))?.path();
            if path.is_dir() {
                stack.push(path);
            } else {
                let rel = path.strip_prefix(root).expect("under the root");
                out.push(rel.components().map(|c| c.as_os_str().to_string_lossy()).collect::<Vec<_>>().join("/"));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Phase 2 of a checkpoint, once every file of `partial` is written and synced: `state.json`, the
/// manifest, the directories synced, the checkpoint moved into place (see the module docs), and
/// the checkpoints but the newest `keep` removed. Returns the checkpoint's path.
pub fn commit(dir: &Path, partial: &Path, state: &TrainState, keep: usize) -> Result<PathBuf> {
    let state_path = partial.join("state.json");
    disagmoe_models::weights::write_atomically(&state_path, |t| {
        std::fs::write(t, serde_json::to_vec_pretty(state).expect("state serialises"))
    })?;
    let mut files = BTreeMap::new();
    for name in files_under(partial)? {
        if name != "manifest.json" {
            files.insert(name.clone(), sha256_file(&partial.join(&name))?);
        }
    }
    let manifest = serde_json::json!({"format": FORMAT, "step": state.step, "sha256": files});
    disagmoe_models::weights::write_atomically(&partial.join("manifest.json"), |t| {
        std::fs::write(t, serde_json::to_vec_pretty(&manifest).expect("manifest serialises"))
    })?;
    for d in [moment_dir(partial, Moment::First), moment_dir(partial, Moment::Second), partial.to_path_buf()] {
        if d.exists() {
            sync_dir(&d)?;
        }
    }
    let final_dir = dir.join(step_dir_name(state.step));
    // Replacing a checkpoint of the same step: the old one moves aside (a name never picked up)
    // and goes only once the new one is in place.
    let aside = dir.join(format!(".{}.replaced", step_dir_name(state.step)));
    if final_dir.exists() {
        if aside.exists() {
            std::fs::remove_dir_all(&aside).map_err(io("cannot remove", &aside))?;
        }
        std::fs::rename(&final_dir, &aside).map_err(io("cannot move aside", &final_dir))?;
    }
    std::fs::rename(partial, &final_dir).map_err(io("cannot move checkpoint into place", &final_dir))?;
    sync_dir(dir)?;
    if aside.exists() {
        std::fs::remove_dir_all(&aside).map_err(io("cannot remove replaced checkpoint", &aside))?;
    }
    prune(dir, keep)?;
    Ok(final_dir)
}

/// Writes a checkpoint of a one-device run (`model` and `optimizer` after `state.step`) into
/// `dir` and keeps the newest `keep`; returns its path.
pub fn save_checkpoint<B: AutodiffBackend>(
    dir: &Path,
    model: &MoeCausalLm<B>,
    optimizer: &AdamW<B>,
    state: &TrainState,
    keep: usize,
) -> Result<PathBuf> {
    let tmp = begin(dir, state.step)?;
    // The f32 master weights where the model holds bf16 working copies.
    optimizer.masters_as(model.clone()).save_pretrained(&tmp, usize::MAX)?;
    for moment in Moment::BOTH {
        optimizer.moments_as(model.clone(), moment).save_pretrained(moment_dir(&tmp, moment), usize::MAX)?;
    }
    commit(dir, &tmp, state, keep)
}

fn complete_checkpoints(dir: &Path) -> Result<Vec<(usize, PathBuf)>> {
    let mut out = Vec::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => {
            return Err(TrainError::Io { action: "cannot list checkpoint directory", path: dir.into(), source: e })
        }
    };
    for entry in entries {
        let path = entry.map_err(io("cannot list", dir))?.path();
        let name = path.file_name().unwrap_or_default().to_string_lossy().to_string();
        if let Some(step) = name.strip_prefix("step-").and_then(|s| s.parse::<usize>().ok()) {
            if path.join("manifest.json").exists() {
                out.push((step, path));
            }
        }
    }
    out.sort();
    Ok(out)
}

fn prune(dir: &Path, keep: usize) -> Result<()> {
    let all = complete_checkpoints(dir)?;
    for (_, path) in all.iter().take(all.len().saturating_sub(keep.max(1))) {
        std::fs::remove_dir_all(path).map_err(io("cannot remove old checkpoint", path))?;
    }
    Ok(())
}

/// A checkpoint's manifest: the SHA-256 of every other file, by its path relative to the
/// checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    /// `(relative path, lower-case hex SHA-256)`, sorted by path.
    pub files: Vec<(String, String)>,
}

impl Manifest {
    /// Parses `manifest.json`. Every path must be relative and stay inside the checkpoint
    /// (`/`-separated names of letters, digits, `.`, `-` and `_`, none of them `.` or `..`), every
    /// checksum 64 hex digits: a damaged or hostile manifest is refused, never followed outside
    /// the checkpoint (where a name like `/dev/zero` would hash forever).
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        let manifest: serde_json::Value =
            serde_json::from_str(text).map_err(|e| format!("manifest is not valid JSON: {e}"))?;
        let table = manifest.get("sha256").and_then(|f| f.as_object()).ok_or("manifest has no `sha256` table")?;
        let plain = |part: &str| {
            !part.is_empty()
                && part != "."
                && part != ".."
                && part.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
        };
        let mut files = Vec::with_capacity(table.len());
        for (name, sum) in table {
            if name.len() > 4096 || !name.split('/').all(plain) {
                return Err(format!(
                    "manifest names {name:?}: a file must be a relative path inside the checkpoint \
                     (names of letters, digits, `.`, `-`, `_` separated by `/`)"
                ));
            }
            let sum = sum.as_str().filter(|s| s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit()));
            let Some(sum) = sum else {
                return Err(format!("manifest's checksum of {name:?} is not 64 hex digits"));
            };
            files.push((name.clone(), sum.to_ascii_lowercase()));
        }
        Ok(Self { files })
    }
}

/// Checks every file of a checkpoint against its manifest.
pub fn verify_checkpoint(path: &Path) -> Result<()> {
    let manifest_path = path.join("manifest.json");
    let text =
        std::fs::read_to_string(&manifest_path).map_err(io("cannot read checkpoint manifest", &manifest_path))?;
    let manifest =
        Manifest::parse(&text).map_err(|message| TrainError::Checkpoint { path: manifest_path.clone(), message })?;
    for (name, want) in &manifest.files {
        let file = path.join(name);
        if !std::fs::symlink_metadata(&file).map(|m| m.is_file()).unwrap_or(false) {
            return Err(TrainError::Checkpoint {
                path: file,
                message: "listed in the manifest but not a regular file of the checkpoint".into(),
            });
        }
        let got = sha256_file(&file)?;
        if got != *want {
            return Err(TrainError::Checkpoint {
                path: file,
                message: "checksum does not match the manifest (corrupted file)".into(),
            });
        }
    }
    Ok(())
}

/// The newest checkpoint in `dir` that is complete and whose checksums verify; damaged ones are
/// skipped with a warning.
pub fn latest_checkpoint(dir: &Path) -> Result<Option<PathBuf>> {
    for (_, path) in complete_checkpoints(dir)?.into_iter().rev() {
        match verify_checkpoint(&path) {
            Ok(()) => return Ok(Some(path)),
            Err(e) => tracing::warn!(checkpoint = %path.display(), error = %e, "skipping damaged checkpoint"),
        }
    }
    Ok(None)
}

/// The [`TrainState`] of a checkpoint (`state.json`).
pub fn read_state(path: &Path) -> Result<TrainState> {
    let state_path = path.join("state.json");
    let text = std::fs::read_to_string(&state_path).map_err(io("cannot read", &state_path))?;
    TrainState::parse(&text).map_err(|message| TrainError::Checkpoint { path: state_path.clone(), message })
}

/// The single file of flattened moments of checkpoints written before v2.
const LEGACY_MOMENTS: &str = "optimizer.safetensors";

/// Whether `path` is a checkpoint of an earlier version (moments in one file, flattened), which
/// only a one-device run can resume.
pub fn is_legacy(path: &Path) -> bool {
    path.join(LEGACY_MOMENTS).exists() && !moment_dir(path, Moment::First).exists()
}

/// Loads a verified checkpoint on one device: the model, the optimizer moments into `optimizer`,
/// and the state. Any placement may have written it.
pub fn load_checkpoint<B: AutodiffBackend>(
    path: &Path,
    mtp: disagmoe_models::MtpSettings,
    optimizer: &mut AdamW<B>,
    device: &B::Device,
) -> Result<(MoeCausalLm<B>, TrainState)> {
    verify_checkpoint(path)?;
    let model = MoeCausalLm::<B>::from_pretrained_with(path, mtp, device)?;
    let state = read_state(path)?;
    if is_legacy(path) {
        let mut reader = CheckpointReader::open_file(path.join(LEGACY_MOMENTS))?;
        optimizer.import_moments(&mut reader, &model.state_dict_names(), device)?;
    } else {
        let m = MoeCausalLm::<B>::from_pretrained_with(moment_dir(path, Moment::First), mtp, device)?;
        let v = MoeCausalLm::<B>::from_pretrained_with(moment_dir(path, Moment::Second), mtp, device)?;
        optimizer.import_moment_modules(&model, &m, &v)?;
    }
    optimizer.set_steps_taken(state.optimizer_steps);
    Ok((model, state))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifests_name_only_files_inside_the_checkpoint() {
        let sum = "ab".repeat(32);
        let m = |name: &str, sum: &str| Manifest::parse(&format!(r#"{{"sha256": {{"{name}": "{sum}"}}}}"#));
        assert_eq!(m("exp_avg/model-00001.safetensors", &sum).unwrap().files[0].0, "exp_avg/model-00001.safetensors");
        for bad in ["/dev/zero", "../x", "a/../../x", "a//b", "", "./a", "a b"] {
            let e = m(bad, &sum).unwrap_err();
            assert!(e.contains("relative path inside the checkpoint"), "{bad}: {e}");
        }
        assert!(m("a", "xyz").unwrap_err().contains("64 hex digits"));
        assert!(Manifest::parse("{}").unwrap_err().contains("no `sha256`"));
        assert!(Manifest::parse("[").unwrap_err().contains("not valid JSON"));
    }

    #[test]
    fn state_json_keeps_non_finite_losses_and_must_add_up() {
        let state = TrainState {
            step: 2,
            optimizer_steps: 1,
            data: DataPosition::default(),
            losses: vec![f64::NAN, 3.5],
            skipped_steps: 1,
            seed: 7,
            total_steps: 4,
            settings: None,
            written_by: None,
            loss_scale: None,
        };
        let text = serde_json::to_string(&state).unwrap();
        let back = TrainState::parse(&text).unwrap();
        assert!(back.losses[0].is_nan() && back.losses[1] == 3.5, "{text}");
        for (field, value, says) in [
            ("losses", serde_json::json!([1.0]), "1 losses recorded for 2 steps"),
            ("optimizer_steps", serde_json::json!(3), "3 optimizer updates"),
            ("skipped_steps", serde_json::json!(5), "5 skipped steps"),
            ("total_steps", serde_json::json!(1), "beyond the run's 1 steps"),
        ] {
            let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
            v[field] = value;
            let e = TrainState::parse(&v.to_string()).unwrap_err();
            assert!(e.contains(says), "{field}: {e}");
        }
        assert!(TrainState::parse("{").unwrap_err().starts_with("state.json"));
    }

    fn settings(steps: usize, warmup_steps: usize) -> RunSettings {
        RunSettings {
            seed: 1,
            seq: 32,
            batch: 8,
            data: "corpus".into(),
            tokenizer: "default".into(),
            eval_fraction: 0.02,
            steps,
            lr: 1e-3,
            min_lr: 1e-4,
            warmup_steps,
            weight_decay: 0.1,
            betas_eps: [0.9, 0.95, 1e-8],
            grad_clip: 1.0,
            model: serde_json::json!({"model_type": "qwen3_moe", "shape": {"layers": 2}}),
            micro_batches: 4,
            optimizer_state_dtype: crate::config::StateDtype::F32,
            document_mask: false,
            document_positions: crate::config::DocumentPositions::Continue,
        }
    }

    fn check(was: &RunSettings, now: &RunSettings, allowed: &[&str]) -> std::result::Result<(), String> {
        let allowed: Vec<String> = allowed.iter().map(|s| s.to_string()).collect();
        was.check_resume(now, &allowed, Path::new("ck/step-00000005")).map_err(|e| e.to_string())
    }

    #[test]
    fn a_changed_setting_is_refused_naming_it_unless_allowed() {
        let was = settings(400, 40);
        let mut now = settings(400, 40);
        now.seed = 2;
        let err = check(&was, &now, &[]).unwrap_err();
        assert!(err.contains("--seed 1") && err.contains("--seed 2") && err.contains("--allow-change seed"), "{err}");
        assert!(check(&was, &now, &["seed"]).is_ok());
        let mut now = settings(400, 40);
        now.model = serde_json::json!({"model_type": "qwen3_moe", "shape": {"layers": 3}});
        let err = check(&was, &now, &["seed", "seq", "batch", "data", "steps", "schedule"]).unwrap_err();
        assert!(err.contains("layers 2") && err.contains("layers 3"), "{err}");
        // Masking by document, or restarting positions, is another run too.
        let mut now = settings(400, 40);
        now.document_mask = true;
        let err = check(&was, &now, &[]).unwrap_err();
        assert!(err.contains("--document-mask off") && err.contains("--allow-change data"), "{err}");
        assert!(check(&was, &now, &["data"]).is_ok());
        now.document_positions = crate::config::DocumentPositions::Restart;
        let err = check(&was, &now, &["seed"]).unwrap_err();
        assert!(err.contains("--document-mask off"), "{err}");
        // A checkpoint from before the settings trained unmasked.
        let mut old = serde_json::to_value(&was).unwrap();
        old.as_object_mut().unwrap().retain(|k, _| !k.starts_with("document_"));
        assert_eq!(serde_json::from_value::<RunSettings>(old).unwrap(), was);
    }

    #[test]
    fn a_default_warmup_follows_an_allowed_steps_change_and_an_explicit_one_does_not() {
        let was = settings(400, crate::config::optimizer::default_warmup(400));
        let now = settings(10_000, crate::config::optimizer::default_warmup(10_000));
        assert!(check(&was, &now, &[]).unwrap_err().contains("--steps 400"));
        assert!(check(&was, &now, &["steps"]).is_ok());
        // An explicit warm-up that differs is a schedule change.
        let now = settings(10_000, 7);
        let err = check(&was, &now, &["steps"]).unwrap_err();
        assert!(err.contains("--warmup-steps 40") && err.contains("--allow-change schedule"), "{err}");
        assert!(check(&was, &now, &["steps", "schedule"]).is_ok());
    }
}
