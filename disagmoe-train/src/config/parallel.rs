//! `[parallel]`: where the model runs: one device, or attention and expert workers (AF-Pipe), or the
//! expert-parallel baseline; how many workers, micro-batches and links.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};

/// How a run is placed on workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    /// The plain model on one device.
    #[default]
    Single,
    /// Attention and experts on disjoint workers, pipelined (AF-Pipe).
    Disagg,
    /// Every worker holds attention and a shard of the experts; all-to-all dispatch (EP baseline).
    Ep,
}

impl Placement {
    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Placement::Single => "single",
            Placement::Disagg => "disagg",
            Placement::Ep => "ep",
        }
    }
}

/// How a disaggregated run's workers are split.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum AllocationMode {
    /// As given: `attn_workers`, `ffn_workers`, `groups`.
    #[default]
    Manual,
    /// Chosen by the planner and refined with measured step times.
    Auto,
}

/// How workers talk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum TransportKind {
    /// Threads of one process, channels between them.
    #[default]
    Local,
    /// One process per worker under `mpirun` (feature `mpi`).
    Mpi,
    /// GPU to GPU through NCCL, one process per worker under `mpirun` (feature `nccl`).
    Nccl,
}

/// Placement, workers, micro-batches and links of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ParallelOptions {
    /// Where the model runs: `single` (one device), `disagg` (AF-Pipe on attention and expert
    /// workers), `ep` (colocated expert-parallel baseline).
    pub placement: Placement,
    /// `disagg`: attention workers `M` in all (a multiple of `groups`).
    pub attn_workers: usize,
    /// `disagg`: expert workers `N` in all (a multiple of `groups`).
    pub ffn_workers: usize,
    /// `disagg`: groups `p`; group `g` holds layers `g, g+p, ...`.
    pub groups: usize,
    /// `disagg`: `manual` (the three counts above) or `auto` (the planner chooses them within
    /// `attn_workers + ffn_workers` workers and measured step times refine its choice).
    pub allocation: AllocationMode,
    /// `ep`: workers.
    pub workers: usize,
    /// Micro-batches per step (`batch` must be a multiple). Default: 1 for `single`, 4 for
    /// `disagg`, `workers` for `ep`. Each micro-batch's loss (with its own balance term) is
    /// averaged, so runs with the same value compare across placements.
    pub micro_batches: Option<usize>,
    /// `disagg`: micro-batches each embedding worker keeps in flight at most (started, backward not
    /// done; flag `--max-in-flight`, also `--in-flight`); default: as many as half the memory
    /// available holds (`runtime::activation_bytes` per micro-batch), at most all of the step's.
    #[serde(alias = "max_in_flight")]
    pub in_flight: Option<usize>,
    /// How workers talk: `local` (threads), `mpi` (processes under mpirun; feature `mpi`), `nccl`
    /// (processes under mpirun, messages through NCCL; feature `nccl`).
    pub transport: TransportKind,
    /// Emulate links of this many Gbit/s per worker (off when absent).
    pub link_gbps: Option<f64>,
    /// One-way latency of the emulated links, microseconds.
    pub link_latency_us: f64,
    /// Write a Chrome trace of every worker's streams here (distributed runs).
    pub trace: Option<PathBuf>,
    /// A worker that waits this long for any message ends the run with an error, seconds.
    pub comm_timeout_s: f64,
}

impl Default for ParallelOptions {
    fn default() -> Self {
        Self {
            placement: Placement::Single,
            attn_workers: 2,
            ffn_workers: 2,
            groups: 2,
            allocation: AllocationMode::Manual,
            workers: 4,
            micro_batches: None,
            in_flight: None,
            transport: TransportKind::Local,
            link_gbps: None,
            link_latency_us: 0.0,
            trace: None,
            comm_timeout_s: 60.0,
        }
    }
}

impl ParallelOptions {
    /// Micro-batches per step, the default filled in.
    pub fn micro_batches(&self) -> usize {
        self.micro_batches.unwrap_or(match self.placement {
            Placement::Single => 1,
            Placement::Disagg => 4,
            Placement::Ep => self.workers,
        })
    }

    /// The placement for people: `single`, `disagg 2+2 in 2 groups (mpi)`, `ep 4`.
    pub fn describe(&self) -> String {
        let transport = match self.transport {
            TransportKind::Local => "",
            TransportKind::Mpi => " (mpi)",
            TransportKind::Nccl => " (nccl)",
        };
        match self.placement {
            Placement::Single => "single".into(),
            Placement::Disagg => {
                format!("disagg {}+{} in {} groups{transport}", self.attn_workers, self.ffn_workers, self.groups)
            }
            Placement::Ep => format!("ep {}{transport}", self.workers),
        }
    }

    /// Whether the run is distributed over workers.
    pub fn distributed(&self) -> bool {
        self.placement != Placement::Single
    }

    /// Checks the section for a batch of `batch` sequences.
    pub fn validate(&self, batch: usize) -> Result<()> {
        let mbs = self.micro_batches();
        if mbs == 0 || batch % mbs != 0 {
            return Err(TrainError::option("micro_batches", format!("must divide batch ({batch}) evenly, got {mbs}")));
        }
        for (field, v) in [
            ("attn_workers", self.attn_workers),
            ("ffn_workers", self.ffn_workers),
            ("groups", self.groups),
            ("workers", self.workers),
        ] {
            if v == 0 {
                return Err(TrainError::option(field, "must be at least 1"));
            }
        }
        if self.allocation == AllocationMode::Auto && self.placement != Placement::Disagg {
            return Err(TrainError::option("allocation", "auto needs placement disagg"));
        }
        if self.allocation == AllocationMode::Auto && self.transport != TransportKind::Local {
            return Err(TrainError::option(
                "allocation",
                "auto measures its candidates in this process and needs transport local; run the counts it chooses under mpirun with allocation manual",
            ));
        }
        if self.in_flight == Some(0) {
            return Err(TrainError::option("in_flight", "must be at least 1"));
        }
        if let Some(g) = self.link_gbps {
            if !(g.is_finite() && g > 0.0) {
                return Err(TrainError::option("link_gbps", format!("must be a finite number > 0, got {g}")));
            }
        }
        if !(self.link_latency_us.is_finite() && self.link_latency_us >= 0.0) {
            return Err(TrainError::option("link_latency_us", format!("must be >= 0, got {}", self.link_latency_us)));
        }
        if !(self.comm_timeout_s.is_finite() && self.comm_timeout_s > 0.0) {
            return Err(TrainError::option("comm_timeout_s", format!("must be > 0, got {}", self.comm_timeout_s)));
        }
        if self.placement == Placement::Single && (self.link_gbps.is_some() || self.trace.is_some()) {
            return Err(TrainError::option(
                if self.trace.is_some() { "trace" } else { "link_gbps" },
                "needs placement disagg or ep (a single device has no links)",
            ));
        }
        Ok(())
    }
}
