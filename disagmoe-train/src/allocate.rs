//! `allocation = auto`: the planner's choice of attention workers, expert workers and groups for
//! this machine, refined with measured step times. [`crate::train_on`] and
//! [`crate::train_family`] resolve it before they train, so a library caller gets the same choice
//! as the command line.
//!
//! The budget is `attn_workers + ffn_workers` workers. The machine is described to the planner as
//! one node of that many "GPUs": each gets `1/W` of the matmul rate measured here on the run's
//! backend (the workers share the cores), `1/W` of the memory, and the emulated link
//! (`link_gbps`, or a fast local one) between them. The MILP's answer starts `disagmoe-core`'s
//! local search, whose oracle trains [`PROBE_STEPS`] steps of each candidate and reports its
//! steady step time: the steps after the first (the first pays one-time costs: first touch of
//! every buffer, optimizer moments, thread pools). The fastest wins.

use std::time::Instant;

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Distribution, Tensor};

use disagmoe_core::allocator::milp::solve_milp_pruned;
use disagmoe_core::allocator::search::{local_search, StepTimeOracle};
use disagmoe_core::allocator::{Allocation, AllocationProblem};
use disagmoe_core::cost::{ContextParallel, CostModel, Workload};
use disagmoe_core::hardware::{Cluster, GpuSpec, NodeSpec};
use disagmoe_core::model_shape::ModelShape;

use crate::config::{AllocationMode, Placement, Recompute, RunConfig};
use crate::error::{Result, TrainError};
use crate::trainer::TrainSummary;

/// Steps each measured candidate trains (its score is the mean of the steps after the first).
pub const PROBE_STEPS: usize = 3;
/// Candidates measured at most, the planner's start included.
pub const MAX_PROBES: usize = 6;

fn planner_error(what: &str, e: impl std::fmt::Display) -> TrainError {
    TrainError::option("allocation", format!("auto: {what}: {e}"))
}

/// f32 matmul rate of this machine on `device` with all its cores, FLOP/s.
fn measured_matmul_rate<B: AutodiffBackend>(device: &B::Device) -> f64 {
    let n = 384;
    let a = Tensor::<B::InnerBackend, 2>::random([n, n], Distribution::Default, device);
    let b = Tensor::<B::InnerBackend, 2>::random([n, n], Distribution::Default, device);
    let _ = a.clone().matmul(b.clone()).into_data(); // warm-up
    let reps = 8;
    let t0 = Instant::now();
    for _ in 0..reps {
        let _ = a.clone().matmul(b.clone()).into_data();
    }
    (2 * n * n * n * reps) as f64 / t0.elapsed().as_secs_f64()
}

/// The planner's view of `workers` workers sharing a machine of matmul rate `rate`.
fn local_cluster(workers: usize, rate: f64, cfg: &RunConfig) -> Cluster {
    let link_bytes = cfg.parallel.link_gbps.map(|g| g * 1e9 / 8.0).unwrap_or(10e9);
    Cluster {
        name: format!("local-{workers}-workers"),
        gpu: GpuSpec {
            name: "cpu worker".into(),
            peak_bf16_flops: rate / workers as f64,
            hbm_bandwidth: 20e9 / workers as f64,
            hbm_bytes: 16e9 / workers as f64,
            compute_efficiency: 1.0,
            hbm_efficiency: 1.0,
            usable_memory_fraction: 1.0,
        },
        node: NodeSpec {
            gpus_per_node: workers,
            nvlink_bandwidth: link_bytes,
            nics_per_node: 1,
            nic_bandwidth: link_bytes,
            network_efficiency: 1.0,
            latency_s: cfg.parallel.link_latency_us * 1e-6,
        },
        nodes: 1,
    }
}

/// `cfg` with allocation `a`'s counts (`placement disagg`, `allocation manual`).
fn config_of(cfg: &RunConfig, a: &Allocation) -> RunConfig {
    let mut cfg = cfg.clone();
    cfg.parallel.placement = Placement::Disagg;
    cfg.parallel.allocation = AllocationMode::Manual;
    cfg.parallel.attn_workers = a.attention_gpus();
    cfg.parallel.ffn_workers = a.ffn_gpus();
    cfg.parallel.groups = a.groups;
    cfg
}

/// The steady step time of a probe: the mean over the steps after the first.
pub fn steady_step_s(summary: &TrainSummary, tokens_per_step: usize) -> f64 {
    match summary.tokens_per_s {
        r if r > 0.0 && r.is_finite() => tokens_per_step as f64 / r,
        _ => f64::INFINITY,
    }
}

/// Trains a few steps of a candidate allocation with `measure` and reports its steady step time.
struct MeasuredOracle<'a, F> {
    cfg: &'a RunConfig,
    measure: F,
}

impl<F: FnMut(&RunConfig) -> Result<TrainSummary>> StepTimeOracle for MeasuredOracle<'_, F> {
    fn step_time(&mut self, a: &Allocation) -> disagmoe_core::error::Result<f64> {
        let mut cfg = config_of(self.cfg, a);
        cfg.steps = PROBE_STEPS;
        cfg.optimizer.warmup_steps = None;
        cfg.progress = false;
        // Probes leave nothing behind: no metrics, model, checkpoints or trace of their own, no
        // injected faults, no resume.
        cfg.out = None;
        cfg.checkpoint.dir = None;
        cfg.checkpoint.resume = None;
        cfg.checkpoint.stop_after = None;
        cfg.parallel.trace = None;
        cfg.faults = Default::default();
        let tokens = cfg.data.batch * cfg.data.seq;
        // A candidate the runtime refuses (or that fails) is simply not chosen.
        let step_s = match (self.measure)(&cfg) {
            Ok(s) => steady_step_s(&s, tokens),
            Err(e) => {
                tracing::warn!(
                    attn = a.attention_gpus(),
                    ffn = a.ffn_gpus(),
                    groups = a.groups,
                    "candidate failed: {e}"
                );
                f64::INFINITY
            }
        };
        tracing::info!(
            attn_workers = a.attention_gpus(),
            ffn_workers = a.ffn_gpus(),
            groups = a.groups,
            step_s,
            "measured candidate"
        );
        Ok(step_s)
    }

    fn name(&self) -> &str {
        "measured"
    }
}

/// The planner's bytes per element for what this run holds (`disagmoe_core::cost::Precision::runtime`
/// under `--precision f32` and `f16`, `runtime_bf16` under `bf16`), with its exchange dtypes.
pub fn runtime_precision(cfg: &RunConfig) -> disagmoe_core::cost::Precision {
    let compute = cfg.precision.compute;
    let mut p = match compute {
        crate::config::Precision::Bf16 => disagmoe_core::cost::Precision::runtime_bf16(),
        other => disagmoe_core::cost::Precision::runtime(other != crate::config::Precision::F32),
    };
    p.exchange = cfg.parallel.exchange_precision(compute);
    if cfg.optimizer.state_dtype == crate::config::StateDtype::Bf16 {
        p = p.with_bf16_moments();
    }
    p
}

/// The run config with the chosen `attn_workers`, `ffn_workers` and `groups` (`placement disagg`,
/// `allocation manual`) for a model of `shape`, each candidate measured by `measure` (a short run
/// of the same job on `device`'s backend).
pub fn choose<B: AutodiffBackend>(
    cfg: &RunConfig,
    shape: ModelShape,
    device: &B::Device,
    measure: impl FnMut(&RunConfig) -> Result<TrainSummary>,
) -> Result<RunConfig> {
    let workers = cfg.parallel.attn_workers + cfg.parallel.ffn_workers;
    shape.validate().map_err(|e| planner_error("describing the model to the planner", e))?;
    let mbs = cfg.micro_batches();
    let workload = Workload { seq: cfg.data.seq, micro_batch: cfg.data.batch / mbs, global_batch: cfg.data.batch };
    let cluster = local_cluster(workers, measured_matmul_rate::<B>(device), cfg);
    let mut cost =
        CostModel::new(shape, cluster, workload).map_err(|e| planner_error("the planner's cost model", e))?;
    cost.precision = runtime_precision(cfg);
    // The runtime deals whole micro-batches to an attention group's workers in turn, or splits
    // each sequence over rings of the `context_parallel` asked for (then the plan's groups are
    // multiples of it; a neighbour the runtime refuses is not chosen).
    cost.context_parallel = match cfg.parallel.context_parallel {
        c if c > 1 => ContextParallel::Fixed(c),
        _ => ContextParallel::Dealt,
    };
    let problem = AllocationProblem::new(&cost, None).map_err(|e| planner_error("the allocation problem", e))?;
    let milp = solve_milp_pruned(&problem).map_err(|e| planner_error("the planner's MILP", e))?;
    tracing::info!(
        attn_workers = milp.allocation.attention_gpus(),
        ffn_workers = milp.allocation.ffn_gpus(),
        groups = milp.allocation.groups,
        predicted_s = milp.bottleneck_s,
        "planner's choice; refining with measured step times"
    );
    let mut oracle = MeasuredOracle { cfg, measure };
    let search = local_search(&problem, &[milp.allocation], &mut oracle, MAX_PROBES)
        .map_err(|e| planner_error("the measured search", e))?;
    if !search.best.predicted_step_s.is_finite() {
        return Err(TrainError::option(
            "allocation",
            format!("auto: no candidate allocation of {workers} workers could run; give attn_workers, ffn_workers and groups by hand (allocation manual)"),
        ));
    }
    let best = search.best.allocation;
    tracing::info!(
        attn_workers = best.attention_gpus(),
        ffn_workers = best.ffn_gpus(),
        groups = best.groups,
        step_s = search.best.predicted_step_s,
        candidates = search.candidates.len(),
        "allocation chosen"
    );
    let mut chosen = config_of(cfg, &best);
    if chosen.parallel.in_flight.is_none() {
        // The planner's in-flight window for this allocation (what its memory model admits), at
        // most the micro-batches each embedding worker of the chosen layout owns: a worker cannot
        // keep in flight more than it starts.
        let (window, recompute) = disagmoe_core::schedule::afpipe::afpipe_window(&cost, &best);
        let own =
            crate::runtime::layout_of(&chosen, cost.model.layers, cost.model.moe.experts)?.fewest_owned_micro_batches();
        let in_flight = window.clamp(1, own);
        chosen.parallel.in_flight = Some(in_flight);
        tracing::info!(in_flight, planner_window = window, owned = own, "in-flight micro-batches from the planner");
        // A window the memory holds only with recomputation comes with it (the planner's memory
        // model keeps each layer's input alone: full recomputation).
        if recompute && chosen.memory.recompute == Recompute::None {
            chosen.memory.recompute = Recompute::Full;
            tracing::info!("recompute full: the planner's in-flight window fits in memory only with it");
        }
    }
    Ok(chosen)
}
