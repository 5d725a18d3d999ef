//! Fault injection, for tests only: never part of a run's TOML or flags.
//!
//! The test suite sets a [`FaultPlan`] through the environment variable [`FAULTS_ENV`] (JSON), which
//! the command reads once ([`FaultPlan::from_env`]); library users build one in code. A run config
//! file that names a fault key is refused.

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};

/// The environment variable a test puts its [`FaultPlan`] in, as JSON.
pub const FAULTS_ENV: &str = "DISAGMOE_TEST_FAULTS";

/// Multiply one parameter's gradient by NaN at one step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultInjection {
    /// Step (1-based) at which to inject.
    pub step: usize,
    /// Hugging Face name of the parameter whose gradient becomes NaN.
    pub tensor: String,
}

/// One worker fails at one step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerFault {
    /// The worker's rank.
    pub worker: usize,
    /// Step (1-based).
    pub step: usize,
    /// Tasks it completes in that step before failing.
    #[serde(default)]
    pub after_tasks: usize,
    /// Die without a word: the process exits at once (MPI), or the thread ends without telling the
    /// others (local), who then notice by their time-out.
    #[serde(default)]
    pub exit: bool,
}

/// One worker computes for a long time (sleeps in its first task of one step), longer than the
/// communication time-out: a long compute is not a stall.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlowWorker {
    /// The worker's rank.
    pub worker: usize,
    /// Step (1-based).
    pub step: usize,
    /// Seconds it spends.
    pub seconds: f64,
}

/// Where in writing a checkpoint a worker is killed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckpointMoment {
    /// After its model tensors, before its moments.
    Writing,
    /// After all its files, before reporting them.
    Written,
    /// Rank 0: after the indexes, before `state.json`, the manifest and the rename.
    Indexed,
    /// Rank 0: after the rename, before pruning and telling the others.
    Committed,
}

/// One worker is killed (SIGKILL, the whole process) while a checkpoint is written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointKill {
    /// The worker's rank.
    pub worker: usize,
    /// The checkpoint's step.
    pub step: usize,
    /// When.
    pub at: CheckpointMoment,
}

impl CheckpointKill {
    /// Kills this process if `rank` is the worker and this is the moment.
    pub fn maybe(&self, rank: usize, step: usize, at: CheckpointMoment) {
        if self.worker == rank && self.step == step && self.at == at {
            eprintln!("worker {rank}: killed while writing the checkpoint of step {step} ({at:?}; fault injection)");
            // SAFETY: sends a signal to this process; no memory is touched.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
        }
    }
}

/// The faults a test injects into a run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FaultPlan {
    /// Make one gradient NaN at one step (under every placement: where the tensor is held).
    pub inject_nonfinite: Option<FaultInjection>,
    /// One worker of a distributed run fails.
    pub fail_worker: Option<WorkerFault>,
    /// One worker is killed while a checkpoint is written.
    pub kill_in_checkpoint: Option<CheckpointKill>,
    /// One worker takes long over one task.
    pub slow_worker: Option<SlowWorker>,
    /// One worker stays away from the end of one step (its all-reduces) for `seconds`, waiting
    /// without a word: a member that never joins a collective.
    pub absent_worker: Option<SlowWorker>,
}

impl FaultPlan {
    /// The plan in [`FAULTS_ENV`], or none.
    pub fn from_env() -> Result<Self> {
        match std::env::var(FAULTS_ENV) {
            Ok(text) if !text.trim().is_empty() => serde_json::from_str(&text)
                .map_err(|e| TrainError::option(FAULTS_ENV, format!("is not a fault plan ({e}); testing only"))),
            _ => Ok(Self::default()),
        }
    }

    /// Whether any fault is planned.
    pub fn any(&self) -> bool {
        self.inject_nonfinite.is_some()
            || self.fail_worker.is_some()
            || self.kill_in_checkpoint.is_some()
            || self.slow_worker.is_some()
            || self.absent_worker.is_some()
    }
}
