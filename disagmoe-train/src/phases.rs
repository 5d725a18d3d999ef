//! A run in phases (`[[phases]]`, `--phases`): each phase trains its steps at its own sequence
//! length and batch; at a boundary the run writes a checkpoint, plans the next phase (with
//! `allocation = auto`, the planner's choice for the new shape, refined by measurement as
//! [`crate::allocate`] does) and continues from the checkpoint under it: the resharding resume, so
//! the losses do not depend on the splits chosen.
//!
//! The boundary checkpoints go to the run's checkpoint directory (`checkpoint.dir`, else the
//! directory resumed from), or, without one, to a directory of their own under the system's
//! temporary directory, removed when the run ends (kept, and named in a warning and the summary,
//! when the run stopped early: it holds the state to resume).

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use serde::{Deserialize, Serialize};

use crate::checkpoint::{latest_checkpoint, read_state, ScratchDir, TrainState};
use crate::config::phases::phase_ends;
use crate::config::RunConfig;
use crate::error::{Result, TrainError};
use crate::trainer::TrainSummary;

/// What one phase of a run trained, in the run's summary.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PhaseSummary {
    /// The phase's number, from 1.
    pub phase: usize,
    /// Its first and last step trained in this run.
    pub first_step: usize,
    /// The last step trained (below the phase's end when the run stopped early).
    pub last_step: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Sequences per step.
    pub batch: usize,
    /// The placement it trained under (`disagg 2+2 in 2 groups`).
    pub placement: String,
    /// Attention workers (disagg).
    pub attn_workers: usize,
    /// Expert workers (disagg).
    pub ffn_workers: usize,
    /// Group pairs (disagg).
    pub groups: usize,
    /// Whether the planner chose the split (`allocation = auto`).
    pub planned: bool,
    /// Mean step time of the phase's steps after its first (of all, when it trained one),
    /// seconds.
    pub step_s: f64,
    /// Its tokens per second over the same steps.
    pub tokens_per_s: f64,
}

/// The state of the newest complete checkpoint in `dir`, if there is one.
fn latest_state(dir: &Path) -> Result<Option<TrainState>> {
    latest_checkpoint(dir)?.map(|path| read_state(&path)).transpose()
}

/// Trains `cfg` phase by phase: `plan` gives each phase's run config (the phase's own with its
/// allocation resolved), `train` trains it from the previous phase's checkpoint; returns the last
/// phase's summary (every step's loss, from the checkpoints) with each phase's [`PhaseSummary`].
/// A stop request (`stop`) ends the run at the end of the phase's current step, as in any run;
/// at a boundary, before the next phase is planned. `cfg` is validated by the caller
/// ([`crate::train_on`], [`crate::train_family`]).
pub(crate) fn run_phases(
    cfg: &RunConfig,
    stop: &AtomicBool,
    mut plan: impl FnMut(&RunConfig) -> Result<RunConfig>,
    mut train: impl FnMut(&RunConfig, &AtomicBool) -> Result<TrainSummary>,
) -> Result<TrainSummary> {
    if cfg.phases.is_empty() {
        return Err(TrainError::option("phases", "a run in phases needs at least one phase"));
    }
    let ends = phase_ends(&cfg.phases).expect("validated");
    let (scratch, dir) = match cfg.checkpoint.directory() {
        Some(dir) => (None, dir),
        None => {
            let scratch = ScratchDir::create(
                "disagmoe-phases",
                "cannot create the directory of the phases' boundary checkpoints",
            )?;
            let dir = scratch.path().to_path_buf();
            (Some(scratch), dir)
        }
    };
    // Where a resumed run stands: the phase after the checkpoint's step.
    let resumed = match &cfg.checkpoint.resume {
        Some(d) => latest_state(d)?,
        None => None,
    };
    let resumed_at = resumed.as_ref().map(|s| s.step);
    let last = cfg.last_step();
    let start = resumed_at.unwrap_or(0);
    if start >= last {
        return Err(TrainError::option(
            "steps",
            format!(
                "the checkpoint to resume is at step {start} and this run ends at step {last} (steps, or stop_after): \
                 nothing to train; raise steps (with --allow-change steps) or stop_after"
            ),
        ));
    }
    let first_phase = ends.iter().position(|&e| e > start).expect("start is below the last step");
    let mut records = Vec::new();
    let mut summary: Option<TrainSummary> = None;
    for (k, &end) in ends.iter().enumerate().skip(first_phase) {
        let from = summary.as_ref().map_or(start, |s| s.steps);
        if from >= last || (summary.is_some() && stop.load(Ordering::SeqCst)) {
            break;
        }
        let mut phase = cfg.phase(k);
        phase.checkpoint.dir = Some(dir.clone());
        phase.checkpoint.stop_after = Some(end.min(last)).filter(|&s| s < cfg.steps);
        if summary.is_some() {
            phase.checkpoint.resume = Some(dir.clone());
        }
        // A checkpoint at the previous phase's end was written at that phase's shape: this
        // run's own, or the one resumed when it was (its settings say so).
        let at_boundary = k > 0 && from == ends[k - 1];
        let previous_shape = |s: &TrainState| {
            let was = cfg.phase(k - 1);
            s.settings.as_ref().is_some_and(|r| r.seq == was.data.seq && r.batch == was.data.batch)
        };
        if at_boundary && (summary.is_some() || resumed.as_ref().is_some_and(previous_shape)) {
            for change in ["seq", "batch"] {
                if !phase.checkpoint.allow_change.iter().any(|c| c == change) {
                    phase.checkpoint.allow_change.push(change.into());
                }
            }
        }
        let planned = plan(&phase)?;
        tracing::info!(
            phase = k + 1,
            seq = planned.data.seq,
            batch = planned.data.batch,
            first_step = from + 1,
            last_step = end.min(last),
            placement = %planned.parallel.describe(),
            "phase"
        );
        let s = train(&planned, stop)?;
        // The next phase resumes the newest checkpoint of `dir`: it must be this one's last.
        let written = latest_state(&dir)?.map(|state| state.step);
        if written != Some(s.steps) {
            return Err(TrainError::Checkpoint {
                path: dir.clone(),
                message: format!(
                    "phase {} ended at step {} but the newest checkpoint here is at step {}; a run in phases \
                     needs a checkpoint directory of its own",
                    k + 1,
                    s.steps,
                    written.map_or("(none)".to_string(), |w| w.to_string())
                ),
            });
        }
        let tokens = planned.data.tokens_per_step() as f64;
        records.push(PhaseSummary {
            phase: k + 1,
            first_step: from + 1,
            last_step: s.steps,
            seq: planned.data.seq,
            batch: planned.data.batch,
            placement: planned.parallel.describe(),
            attn_workers: planned.parallel.attn_workers,
            ffn_workers: planned.parallel.ffn_workers,
            groups: planned.parallel.groups,
            planned: cfg.parallel.allocation == crate::config::AllocationMode::Auto,
            step_s: if s.tokens_per_s > 0.0 { tokens / s.tokens_per_s } else { s.step_s },
            tokens_per_s: s.tokens_per_s,
        });
        let stopped = s.steps < end.min(last);
        summary = Some(s);
        if stopped {
            break;
        }
    }
    let mut summary = summary.expect("the first phase trains: start is below the last step");
    summary.resumed_from_step = resumed_at;
    summary.stopped_early = summary.steps < cfg.steps;
    match scratch {
        // Stopped early without a checkpoint directory: the scratch directory holds the state to
        // resume, so it stays.
        Some(dir) if summary.stopped_early => {
            let dir = dir.keep();
            tracing::warn!(dir = %dir.display(), "stopped early: the checkpoint stays here; pass --resume with it to continue");
        }
        // The boundary checkpoints go with the scratch directory (removed as this returns).
        Some(_) => summary.checkpoint = None,
        None => {}
    }
    summary.phases = records;
    Ok(summary)
}
