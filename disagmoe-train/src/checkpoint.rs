//! Training checkpoints: everything needed to continue a run exactly where it stopped.
//!
//! A checkpoint is a directory `step-<8 digits>` inside the checkpoint directory:
//! - `config.json`, `model.safetensors`: the model, as a Hugging Face checkpoint (f32);
//! - `optimizer.safetensors`: AdamW moments `exp_avg.<name>`, `exp_avg_sq.<name>` (f32);
//! - `state.json`: [`TrainState`] (step, optimizer steps, data position, losses so far, seed);
//! - `manifest.json`: the SHA-256 of every other file, written last.
//!
//! It is written into `.step-<n>.partial`, every file synced, then renamed into place, so a crash
//! (even SIGKILL) leaves either the previous checkpoints untouched or a partial directory that is
//! never picked up. Loading verifies every checksum; [`latest_checkpoint`] skips incomplete or
//! corrupted checkpoints. The last `keep` checkpoints are kept. The only randomness of a run is the
//! seeded initialisation and the data order, a function of `(seed, epoch)`, so the seed and the data
//! position are the RNG state.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use burn::tensor::backend::AutodiffBackend;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use disagmoe_models::{CheckpointReader, HfCheckpoint, MoeCausalLm, TensorSink};

use crate::data::DataPosition;
use crate::error::{Result, TrainError};
use crate::optim::AdamW;

/// Where a run is: what a checkpoint needs besides the weights and moments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    /// Steps completed.
    pub step: usize,
    /// Updates the optimizer has applied (fewer than `step` when some were skipped).
    pub optimizer_steps: u64,
    /// Position of the next batch.
    pub data: DataPosition,
    /// Loss of every completed step.
    pub losses: Vec<f64>,
    /// Steps skipped for non-finite values.
    pub skipped_steps: usize,
    /// Seed of the run (initialisation and data order).
    pub seed: u64,
    /// Steps the run was configured for (the learning-rate schedule spans these).
    pub total_steps: usize,
}

fn io<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> TrainError + 'a {
    move |source| TrainError::Io { action, path: path.into(), source }
}

fn sha256_file(path: &Path) -> Result<String> {
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

fn step_dir_name(step: usize) -> String {
    format!("step-{step:08}")
}

/// Writes a checkpoint of `step` into `dir` and keeps only the newest `keep`; returns its path.
pub fn save_checkpoint<B: AutodiffBackend>(
    dir: &Path,
    model: &MoeCausalLm<B>,
    optimizer: &AdamW<B>,
    state: &TrainState,
    keep: usize,
) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).map_err(io("cannot create checkpoint directory", dir))?;
    let final_dir = dir.join(step_dir_name(state.step));
    let tmp = dir.join(format!(".{}.partial", step_dir_name(state.step)));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io("cannot remove stale partial checkpoint", &tmp))?;
    }
    std::fs::create_dir_all(&tmp).map_err(io("cannot create", &tmp))?;
    // 1. Weights and config (each file atomically, synced).
    model.save_pretrained(&tmp, usize::MAX)?;
    // 2. Optimizer moments.
    let mut moments = TensorSink::new();
    optimizer.export_moments(&model.state_dict_names(), &mut moments);
    let opt_dir = tmp.join("optimizer");
    moments.write(&opt_dir, usize::MAX)?;
    std::fs::rename(opt_dir.join("model.safetensors"), tmp.join("optimizer.safetensors"))
        .map_err(io("cannot move", &opt_dir))?;
    std::fs::remove_dir_all(&opt_dir).map_err(io("cannot remove", &opt_dir))?;
    // 3. State.
    let state_path = tmp.join("state.json");
    disagmoe_models::weights::write_atomically(&state_path, |t| {
        std::fs::write(t, serde_json::to_vec_pretty(state).expect("state serialises"))
    })?;
    // 4. Manifest last: checksums of everything above.
    let mut files = BTreeMap::new();
    for entry in std::fs::read_dir(&tmp).map_err(io("cannot list", &tmp))? {
        let path = entry.map_err(io("cannot list", &tmp))?.path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        files.insert(name, sha256_file(&path)?);
    }
    let manifest = serde_json::json!({"format": "disagmoe-checkpoint-v1", "step": state.step, "sha256": files});
    disagmoe_models::weights::write_atomically(&tmp.join("manifest.json"), |t| {
        std::fs::write(t, serde_json::to_vec_pretty(&manifest).expect("manifest serialises"))
    })?;
    // 5. Into place, then make the rename durable.
    if final_dir.exists() {
        std::fs::remove_dir_all(&final_dir).map_err(io("cannot replace", &final_dir))?;
    }
    std::fs::rename(&tmp, &final_dir).map_err(io("cannot move checkpoint into place", &final_dir))?;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    prune(dir, keep)?;
    Ok(final_dir)
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

/// Checks every file of a checkpoint against its manifest.
pub fn verify_checkpoint(path: &Path) -> Result<()> {
    let manifest_path = path.join("manifest.json");
    let text =
        std::fs::read_to_string(&manifest_path).map_err(io("cannot read checkpoint manifest", &manifest_path))?;
    let manifest: serde_json::Value = serde_json::from_str(&text).map_err(|e| TrainError::Checkpoint {
        path: manifest_path.clone(),
        message: format!("manifest is not valid JSON: {e}"),
    })?;
    let files = manifest.get("sha256").and_then(|f| f.as_object()).ok_or_else(|| TrainError::Checkpoint {
        path: manifest_path.clone(),
        message: "manifest has no `sha256` table".into(),
    })?;
    for (name, want) in files {
        let file = path.join(name);
        let got = sha256_file(&file)?;
        if Some(got.as_str()) != want.as_str() {
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
    serde_json::from_str(&text)
        .map_err(|e| TrainError::Checkpoint { path: state_path.clone(), message: format!("state.json: {e}") })
}

/// Loads a verified checkpoint: the model, the optimizer moments into `optimizer`, and the state.
pub fn load_checkpoint<B: AutodiffBackend>(
    path: &Path,
    optimizer: &mut AdamW<B>,
    device: &B::Device,
) -> Result<(MoeCausalLm<B>, TrainState)> {
    verify_checkpoint(path)?;
    let model = MoeCausalLm::<B>::from_pretrained(path, device)?;
    let state = read_state(path)?;
    let mut reader = CheckpointReader::open_file(path.join("optimizer.safetensors"))?;
    optimizer.import_moments(&mut reader, &model.state_dict_names(), device)?;
    optimizer.set_steps_taken(state.optimizer_steps);
    Ok((model, state))
}
