//! `--allocation auto`: the planner's choice of attention workers, expert workers and groups for
//! this machine, refined with measured step times.
//!
//! The budget is `--attn-workers + --ffn-workers` workers. The machine is described to the planner
//! as one node of that many "GPUs": each gets `1/W` of the matmul rate measured here (the workers
//! share the cores), `1/W` of the memory, and the emulated link (`--link-gbps`, or a fast local
//! one) between them. The MILP's answer starts `disagmoe-core`'s local search, whose oracle trains
//! a few steps of each candidate and reports the measured mean step time; the fastest wins.

use std::time::Instant;

use anyhow::Context;
use burn::tensor::{Distribution, Tensor};
use disagmoe_core::allocator::milp::solve_milp_pruned;
use disagmoe_core::allocator::search::{local_search, StepTimeOracle};
use disagmoe_core::allocator::{Allocation, AllocationProblem};
use disagmoe_core::cost::{CostModel, Workload};
use disagmoe_core::hardware::{Cluster, GpuSpec, NodeSpec};
use disagmoe_train::{Placement, Recompute, RunConfig, TrainBackend};

/// Steps each measured candidate trains (their mean step time is its score).
pub const PROBE_STEPS: usize = 2;
/// Candidates measured at most, the planner's start included.
pub const MAX_PROBES: usize = 6;

/// f32 matmul rate of this machine with all its cores, FLOP/s.
fn measured_matmul_rate() -> f64 {
    let device = Default::default();
    let n = 384;
    let a = Tensor::<disagmoe_train::DefaultBackend, 2>::random([n, n], Distribution::Default, &device);
    let b = Tensor::<disagmoe_train::DefaultBackend, 2>::random([n, n], Distribution::Default, &device);
    let _ = a.clone().matmul(b.clone()).into_data(); // warm-up
    let reps = 8;
    let t0 = Instant::now();
    for _ in 0..reps {
        let _ = a.clone().matmul(b.clone()).into_data();
    }
    (2 * n * n * n * reps) as f64 / t0.elapsed().as_secs_f64()
}

/// The planner's view of `workers` workers on this machine.
fn local_cluster(workers: usize, cfg: &RunConfig) -> Cluster {
    let rate = measured_matmul_rate();
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

/// Trains a few steps of a candidate allocation and reports its mean step time.
struct MeasuredOracle<'a> {
    cfg: &'a RunConfig,
}

impl MeasuredOracle<'_> {
    fn config_of(&self, a: &Allocation) -> RunConfig {
        let mut cfg = self.cfg.clone();
        cfg.parallel.placement = Placement::Disagg;
        cfg.parallel.attn_workers = a.attention_gpus();
        cfg.parallel.ffn_workers = a.ffn_gpus();
        cfg.parallel.groups = a.groups;
        cfg
    }
}

impl StepTimeOracle for MeasuredOracle<'_> {
    fn step_time(&mut self, a: &Allocation) -> disagmoe_core::error::Result<f64> {
        let mut cfg = self.config_of(a);
        cfg.steps = PROBE_STEPS;
        cfg.optimizer.warmup_steps = None;
        cfg.progress = false;
        // Probes leave nothing behind: no metrics, model or trace of their own, no injected faults.
        cfg.out = None;
        cfg.parallel.trace = None;
        cfg.faults = Default::default();
        let device = Default::default();
        // A candidate the runtime refuses (or that fails) is simply not chosen.
        let step_s = match disagmoe_train::train::<TrainBackend>(&cfg, &device) {
            Ok(s) => s.step_s,
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

/// The run config with the chosen `attn_workers`, `ffn_workers` and `groups` (`--placement disagg`).
pub fn choose_allocation(cfg: &RunConfig) -> anyhow::Result<RunConfig> {
    let workers = cfg.parallel.attn_workers + cfg.parallel.ffn_workers;
    let shape = cfg.model.resolve()?.model_shape("the run's model");
    shape.validate().context("describing the model to the planner")?;
    let mbs = cfg.micro_batches();
    let workload = Workload { seq: cfg.data.seq, micro_batch: cfg.data.batch / mbs, global_batch: cfg.data.batch };
    let cost = CostModel::new(shape, local_cluster(workers, cfg), workload).context("the planner's cost model")?;
    let problem = AllocationProblem::new(&cost, None).context("the allocation problem")?;
    let milp = solve_milp_pruned(&problem).context("the planner's MILP")?;
    tracing::info!(
        attn_workers = milp.allocation.attention_gpus(),
        ffn_workers = milp.allocation.ffn_gpus(),
        groups = milp.allocation.groups,
        predicted_s = milp.bottleneck_s,
        "planner's choice; refining with measured step times"
    );
    let mut oracle = MeasuredOracle { cfg };
    let search = local_search(&problem, &[milp.allocation], &mut oracle, MAX_PROBES)?;
    if !search.best.predicted_step_s.is_finite() {
        anyhow::bail!("no candidate allocation of {workers} workers could run; give --attn-workers, --ffn-workers and --groups by hand");
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
    let mut chosen = oracle.config_of(&best);
    if chosen.parallel.in_flight.is_none() {
        // The planner's in-flight window for this allocation (what its memory model admits), at
        // most the micro-batches each embedding worker of the chosen layout owns: a worker cannot
        // keep in flight more than it starts.
        let (window, recompute) = disagmoe_core::schedule::afpipe::afpipe_window(&cost, &best);
        let own = disagmoe_train::runtime::layout_of(&chosen, cost.model.layers, cost.model.moe.experts)?
            .fewest_owned_micro_batches();
        let in_flight = window.clamp(1, own);
        chosen.parallel.in_flight = Some(in_flight);
        tracing::info!(in_flight, planner_window = window, owned = own, "in-flight micro-batches from the planner");
        // A window the memory holds only with recomputation comes with it (the planner's memory
        // model keeps each layer's input alone: full recomputation).
        if recompute && chosen.memory.recompute == Recompute::None {
            chosen.memory.recompute = Recompute::Full;
            tracing::info!("--recompute full: the planner's in-flight window fits in memory only with it");
        }
    }
    Ok(chosen)
}
