//! `[parallel]`: where the model runs: one device, or attention and expert workers (AF-Pipe), or the
//! expert-parallel baseline; how many workers, micro-batches and links.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};

/// The most workers of one kind (attention, expert, ep) and groups a run may name (ranks).
pub const MAX_WORKERS: usize = 1 << 16;
/// The most workers one process runs as threads (`transport = local`).
pub const MAX_LOCAL_WORKERS: usize = 1024;
/// The most CPU threads a worker may be given.
pub const MAX_THREADS: usize = 4096;

/// The emulated link's rate, Gbit/s: from 1 Mbit/s to 100 Tbit/s.
pub const LINK_GBPS: (f64, f64) = (0.001, 100_000.0);

/// The emulated link's latency at most, microseconds (one second).
pub const MAX_LINK_LATENCY_US: f64 = 1e6;

/// The communication time-out, seconds: from a millisecond to a day.
pub const MIN_COMM_TIMEOUT_S: f64 = 1e-3;
/// See [`MIN_COMM_TIMEOUT_S`].
pub const MAX_COMM_TIMEOUT_S: f64 = 86_400.0;

/// This process's rank among the job's ranks on its node, as the MPI launcher says (Open MPI,
/// MPICH/Hydra, MVAPICH, Slurm); `None` when none says (not under a launcher).
pub fn node_local_rank() -> Option<usize> {
    ["OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"]
        .iter()
        .find_map(|k| std::env::var(k).ok()?.parse::<usize>().ok())
}

/// Ranks of this job on this node, as the MPI launcher says (Open MPI, MPICH/Hydra, Slurm); 1
/// when none says.
fn node_ranks() -> usize {
    ["OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"]
        .iter()
        .find_map(|k| std::env::var(k).ok()?.parse::<usize>().ok())
        .unwrap_or(1)
        .max(1)
}

pub use disagmoe_core::exchange::{ExchangeDtype, ExchangePrecision};
pub use disagmoe_core::experts::{ExpertLoad, ExpertPlacement};
pub use disagmoe_core::layout::Placement;

use super::Precision;

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

/// Where the token exchange's payloads live between workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ExchangePayloads {
    /// On the device that computed them where the backend has one (WebGPU/Vulkan, CUDA), the
    /// transport is `local` and every worker is on the same device, or the transport is `nccl`;
    /// on the host otherwise.
    #[default]
    Auto,
    /// Host data, read back from the device and uploaded again (the path a process transport
    /// takes; for comparisons).
    Host,
    /// Tensors left on the device, whatever the backend (a CPU backend's "device" is the host's
    /// memory): needs transport `local` with one device for every worker, or `nccl` (device to
    /// device, the CUDA backend).
    Device,
}

impl ExchangePayloads {
    /// The names the options accept.
    pub const NAMES: [&'static str; 3] = ["auto", "host", "device"];

    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Host => "host",
            Self::Device => "device",
        }
    }
}

impl std::str::FromStr for ExchangePayloads {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "host" => Ok(Self::Host),
            "device" => Ok(Self::Device),
            _ => Err(format!("unknown exchange payloads {s:?} (allowed: {})", Self::NAMES.join(", "))),
        }
    }
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
    /// Micro-batches each embedding worker keeps in flight at most (started, backward not done;
    /// flag `--in-flight`, also `--max-in-flight`); at most the micro-batches a worker owns.
    /// `disagg` default: as many as half the memory available holds (`runtime::activation_bytes`
    /// per micro-batch). `ep` default: 1 (no overlap); 2 overlaps one micro-batch's all-to-all
    /// with another's compute (ping-pong).
    #[serde(alias = "max_in_flight")]
    pub in_flight: Option<usize>,
    /// CPU threads each worker computes with (its own thread pool, so a worker's compute time is
    /// not spent waiting for another's threads). Default: the machine's cores shared evenly by the
    /// workers of this process (under `mpirun`, by the ranks on this node), at least 1.
    pub threads_per_worker: Option<usize>,
    /// The devices workers compute on (`cpu`, `cuda:N`, `wgpu:N`; repeats allowed): local workers
    /// take them round-robin by rank, an MPI rank the one of its node-local rank. Empty: the
    /// backend's default device (with CUDA: every GPU of the node).
    pub devices: Vec<String>,
    /// How workers talk: `local` (threads), `mpi` (processes under mpirun; feature `mpi`), `nccl`
    /// (processes under mpirun, messages through NCCL; feature `nccl`).
    pub transport: TransportKind,
    /// Emulate links of this many Gbit/s per worker (off when absent).
    pub link_gbps: Option<f64>,
    /// One-way latency of the emulated links, microseconds.
    pub link_latency_us: f64,
    /// Write a Chrome trace of every worker's streams here (distributed runs).
    pub trace: Option<PathBuf>,
    /// A worker that waits this long with no message arriving and no peer busy (busy workers
    /// send heartbeats) ends the run with an error, seconds; a peer busy for more than 30 times
    /// this is reported as hung.
    pub comm_timeout_s: f64,
    /// What the token exchange's payloads travel in between workers: `f32`, `bf16`, or `fp8`
    /// (dispatched activations in float8 e4m3 with a scale per 128 values of a token, the combine
    /// in bf16). Default: the compute precision's (f32 under f32, bf16 under bf16 and f16). See
    /// `disagmoe_core::exchange`.
    pub exchange_dtype: Option<ExchangeDtype>,
    /// The exchange's gradient messages: `f32` or `bf16` (never fp8). Default: bf16 when the
    /// exchange is bf16 or fp8, f32 otherwise.
    pub exchange_grad_dtype: Option<ExchangeDtype>,
    /// Where the exchange's payloads live between workers: `auto` (on the device under transport
    /// `local` with one GPU device for every worker, else on the host), `host`, or `device`.
    pub exchange_payloads: ExchangePayloads,
    /// Parameters several workers hold in copies (an attention group's data-parallel copies;
    /// `ep`'s attention and ends) are updated in shards: gradients reduce-scattered, each copy
    /// keeping AdamW's moments of its shard only, the updated weights all-gathered (Megatron-Core's
    /// distributed optimizer). Default on; off all-reduces the gradients and every copy keeps every
    /// moment.
    pub distributed_optimizer: bool,
    /// Redundant replicas of hot experts per MoE layer (`disagg`, `ep`): a layer's expert workers
    /// hold `E + R` expert slots, the heaviest experts (by `expert_load`) in several, each copy of
    /// a replicated expert computing some of its tokens (an even split per micro-batch), its
    /// gradients summed over its copies. Needs `expert_placement = balanced` (its default then).
    pub redundant_experts: usize,
    /// How a layer's experts are placed on its expert workers: `contiguous` (ranges of experts) or
    /// `balanced` (DeepSeek's EPLB: replicate the heaviest experts, pack the copies so every worker
    /// gets the same load). Default: `balanced` with `redundant_experts`, else `contiguous`.
    pub expert_placement: Option<ExpertPlacement>,
    /// The expert load a `balanced` placement evens: `uniform`, `zipf:S`, or the path of an earlier
    /// run's `metrics.jsonl` (its measured loads). Default: uniform.
    pub expert_load: Option<String>,
    /// Re-place the experts every this many steps (0: never): a `balanced` placement computed
    /// anew from the measured expert loads (a moving average over the steps so far, decay
    /// [`LOAD_EMA_DECAY`] per step), the experts that change holder moved with their optimizer
    /// state between expert workers. Needs `expert_placement = balanced`.
    pub rebalance_every: usize,
    /// Context parallelism (`disagg`): each sequence of a micro-batch cut over this many attention
    /// workers of its group, two chunks each (one from the front, its mirror from the back), the
    /// attention computed as ring attention with the keys and values passed among them. Divides
    /// the attention workers per group; `seq` a multiple of `2 C`. 1: none.
    pub context_parallel: usize,
}

/// The weight the expert loads' moving average keeps of its past at each step (`rebalance_every`):
/// the new step's shares count 1 - this.
pub const LOAD_EMA_DECAY: f64 = 0.8;

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
            threads_per_worker: None,
            devices: Vec::new(),
            transport: TransportKind::Local,
            link_gbps: None,
            link_latency_us: 0.0,
            trace: None,
            comm_timeout_s: 60.0,
            exchange_dtype: None,
            exchange_grad_dtype: None,
            exchange_payloads: ExchangePayloads::Auto,
            distributed_optimizer: true,
            redundant_experts: 0,
            expert_placement: None,
            expert_load: None,
            rebalance_every: 0,
            context_parallel: 1,
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

    /// Workers this process runs: 1 on one device or under `mpirun`, every worker with threads.
    pub fn workers_here(&self) -> usize {
        match (self.placement, self.transport) {
            (Placement::Single, _) | (_, TransportKind::Mpi | TransportKind::Nccl) => 1,
            (Placement::Disagg, TransportKind::Local) => self.attn_workers.saturating_add(self.ffn_workers),
            (Placement::Ep, TransportKind::Local) => self.workers,
        }
    }

    /// CPU threads per worker: `threads_per_worker`, or the cores this process may use shared by
    /// its workers. Under `mpirun` a process bound to cores (`--bind-to core`) uses those; an
    /// unbound one shares the node's cores with the other ranks on the node.
    pub fn threads_per_worker(&self) -> usize {
        self.threads_per_worker.unwrap_or_else(|| {
            // The cores this process may run on (its affinity mask), and the node's.
            let usable = std::thread::available_parallelism().map_or(1, |n| n.get());
            // SAFETY: sysconf has no preconditions.
            let online = usize::try_from(unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }).unwrap_or(usable);
            let ranks_here = match self.transport {
                TransportKind::Local => 1,
                _ if usable < online => 1,
                _ => node_ranks(),
            };
            (usable / (self.workers_here() * ranks_here)).max(1)
        })
    }

    /// What each kind of exchange message travels in, for a run computing in `compute` (checked
    /// by [`Self::validate`]; an invalid choice reads as f32 here).
    pub fn exchange_precision(&self, compute: Precision) -> ExchangePrecision {
        let dtype = self.exchange_dtype.unwrap_or(match compute {
            Precision::F32 => ExchangeDtype::F32,
            Precision::Bf16 | Precision::F16 => ExchangeDtype::Bf16,
        });
        ExchangePrecision::new(dtype, self.exchange_grad_dtype).unwrap_or(ExchangePrecision::F32)
    }

    /// The expert placement, the default filled in.
    pub fn expert_placement(&self) -> ExpertPlacement {
        self.expert_placement.unwrap_or(if self.redundant_experts > 0 {
            ExpertPlacement::Balanced
        } else {
            ExpertPlacement::Contiguous
        })
    }

    /// The load a balanced placement evens (`expert_load` read: a metrics file is read here).
    pub fn expert_load(&self) -> Result<ExpertLoad> {
        match &self.expert_load {
            None => Ok(ExpertLoad::Uniform),
            Some(spec) => ExpertLoad::from_arg(spec).map_err(|e| TrainError::option("expert_load", e.to_string())),
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
            if v > MAX_WORKERS {
                return Err(TrainError::option(field, format!("must be at most {MAX_WORKERS}, got {v}")));
            }
        }
        if self.transport == TransportKind::Local && self.workers_here() > MAX_LOCAL_WORKERS {
            return Err(TrainError::option(
                "transport",
                format!(
                    "local runs every worker as threads of this process, at most {MAX_LOCAL_WORKERS}; {} workers need mpi (one process each)",
                    self.workers_here()
                ),
            ));
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
        let c = self.context_parallel;
        if c == 0 {
            return Err(TrainError::option("context_parallel", "must be at least 1"));
        }
        if c > 1 && self.placement != Placement::Disagg {
            return Err(TrainError::option(
                "context_parallel",
                format!(
                    "needs placement disagg (attention workers of a group share a sequence), got {c} with {}",
                    self.placement.name()
                ),
            ));
        }
        let per_group = match self.attn_workers % self.groups.max(1) {
            0 => self.attn_workers / self.groups.max(1),
            _ => 0,
        };
        // Under allocation auto the planner chooses the counts (groups of multiples of `c`).
        let manual = self.allocation == AllocationMode::Manual;
        if c > 1 && self.placement == Placement::Disagg && manual && (per_group == 0 || per_group % c != 0) {
            return Err(TrainError::option(
                "context_parallel",
                format!(
                    "must divide the attention workers per group ({} / {} groups), got {c}",
                    self.attn_workers, self.groups
                ),
            ));
        }
        if let Some(t) = self.threads_per_worker {
            if !(1..=MAX_THREADS).contains(&t) {
                return Err(TrainError::option(
                    "threads_per_worker",
                    format!("must be from 1 to {MAX_THREADS}, got {t}"),
                ));
            }
        }
        if let Some(g) = self.link_gbps {
            if !(LINK_GBPS.0..=LINK_GBPS.1).contains(&g) {
                return Err(TrainError::option(
                    "link_gbps",
                    format!("must be from {} (1 Mbit/s) to {} Gbit/s, got {g}", LINK_GBPS.0, LINK_GBPS.1),
                ));
            }
        }
        if !(0.0..=MAX_LINK_LATENCY_US).contains(&self.link_latency_us) {
            return Err(TrainError::option(
                "link_latency_us",
                format!("must be from 0 to {MAX_LINK_LATENCY_US} (one second), got {}", self.link_latency_us),
            ));
        }
        if !(self.comm_timeout_s >= MIN_COMM_TIMEOUT_S && self.comm_timeout_s <= MAX_COMM_TIMEOUT_S) {
            return Err(TrainError::option(
                "comm_timeout_s",
                format!(
                    "must be from {MIN_COMM_TIMEOUT_S} to {MAX_COMM_TIMEOUT_S} seconds (a day), got {}",
                    self.comm_timeout_s
                ),
            ));
        }
        if self.exchange_payloads == ExchangePayloads::Device && self.transport == TransportKind::Mpi {
            return Err(TrainError::option(
                "exchange_payloads",
                "device needs transport local (one process's device memory) or nccl (device to device); allowed with mpi: auto, host",
            ));
        }
        if self.redundant_experts > 0 && self.expert_placement() == ExpertPlacement::Contiguous {
            return Err(TrainError::option(
                "redundant_experts",
                format!(
                    "needs expert_placement balanced (contiguous places each expert once), got {}",
                    self.redundant_experts
                ),
            ));
        }
        if self.expert_load.is_some() {
            self.expert_load()?;
            if self.expert_placement() == ExpertPlacement::Contiguous {
                return Err(TrainError::option(
                    "expert_load",
                    "is what a balanced placement evens; set expert_placement balanced (or redundant_experts) for it to be used",
                ));
            }
        }
        if !self.distributed()
            && (self.redundant_experts > 0
                || self.expert_placement.is_some()
                || self.expert_load.is_some()
                || self.rebalance_every > 0)
        {
            let field = if self.rebalance_every > 0 {
                "rebalance_every"
            } else if self.redundant_experts > 0 {
                "redundant_experts"
            } else if self.expert_placement.is_some() {
                "expert_placement"
            } else {
                "expert_load"
            };
            return Err(TrainError::option(field, "needs placement disagg or ep (one device holds every expert once)"));
        }
        if self.rebalance_every > 0 && self.expert_placement() == ExpertPlacement::Contiguous {
            return Err(TrainError::option(
                "rebalance_every",
                format!(
                    "needs expert_placement balanced (a contiguous placement never changes), got {}",
                    self.rebalance_every
                ),
            ));
        }
        // The dtypes are parsed already: only the gradients' can be refused.
        ExchangePrecision::new(ExchangeDtype::Bf16, self.exchange_grad_dtype)
            .map_err(|e| TrainError::option("exchange_grad_dtype", e))?;
        if self.placement == Placement::Single && (self.link_gbps.is_some() || self.trace.is_some()) {
            return Err(TrainError::option(
                if self.trace.is_some() { "trace" } else { "link_gbps" },
                "needs placement disagg or ep (a single device has no links)",
            ));
        }
        Ok(())
    }
}
