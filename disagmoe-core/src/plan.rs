//! The two entry points behind `disagmoe plan` and `disagmoe simulate`.
//!
//! [`plan`] runs the whole allocation pipeline (options, MILP, local search with the simulator
//! as oracle) and reports the chosen allocation with the model's parameter and FLOP counts.
//! [`simulate_schedules`] builds AF-Pipe (on the planned allocation) and the requested baselines,
//! simulates each and reports AF-Pipe's speedup over each.

use crate::allocator::milp::{solve_milp_pruned, MilpSolution};
use crate::allocator::oracle::SimulatorOracle;
use crate::allocator::search::{local_search, Candidate, SearchResult, StepTimeOracle};
use crate::allocator::{Allocation, AllocationProblem};
use crate::cost::CostModel;
use crate::error::{invalid, Result};
use crate::experts::{ExpertBalance, ExpertPlacement};
use crate::schedule::afpipe::{afpipe_window, build_afpipe};
use crate::schedule::baselines::{build_baseline, ep_layout, Baseline};
use crate::schedule::Schedule;
use crate::simulator::{run, SimReport, Trace};
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// Starting points of the local search: the MILP's answer and the best answers for other group
/// counts.
pub const MULTI_STARTS: usize = 4;

/// Oracle evaluations the local search may spend by default.
pub const DEFAULT_SEARCH_EVALS: usize = 32;

/// What `disagmoe plan` prints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanReport {
    /// Model name.
    pub model: String,
    /// Cluster name.
    pub cluster: String,
    /// Sequence length.
    pub seq: usize,
    /// Sequences per micro-batch.
    pub micro_batch: usize,
    /// Sequences per step.
    pub global_batch: usize,
    /// Attention GPUs over all groups.
    pub attention_gpus: usize,
    /// Expert GPUs over all groups.
    pub ffn_gpus: usize,
    /// Attention NICs over all groups.
    pub attention_nics: usize,
    /// Expert NICs over all groups.
    pub ffn_nics: usize,
    /// Number of (attention, expert) group pairs.
    pub groups: usize,
    /// GPUs of an attention group that split each sequence (context parallelism; 1: none).
    #[serde(default = "crate::allocator::one")]
    pub context_parallel: usize,
    /// How the context-parallel size was chosen (`auto`, a fixed size, or `dealt`: whole
    /// micro-batches per GPU, as `disagmoe train` runs).
    #[serde(default = "auto")]
    pub context_parallel_choice: String,
    /// The allocation per group.
    pub allocation: Allocation,
    /// Micro-batches in flight in the AF-Pipe schedule.
    pub in_flight: usize,
    /// Whether the AF-Pipe schedule recomputes activations.
    pub recompute: bool,
    /// Simulated step time of the chosen allocation, seconds.
    pub predicted_step_s: f64,
    /// Roofline bottleneck of the MILP's answer, seconds per step.
    pub milp_bottleneck_s: f64,
    /// Wall time of option building + MILP + local search, seconds.
    pub solve_s: f64,
    /// Wall time of the MILP alone, seconds.
    pub milp_s: f64,
    /// Total parameters.
    pub params_total: f64,
    /// Active parameters per token (family convention).
    pub params_active: f64,
    /// Training FLOPs per token at this sequence length.
    pub flops_per_token: f64,
    /// Every allocation considered with its predicted step time (only with `explain`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub candidates: Option<Vec<Candidate>>,
    /// The expert side's balance on the chosen allocation (absent under uniform load with the
    /// contiguous split, where it is even by construction).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_balance: Option<BalanceReport>,
}

fn auto() -> String {
    "auto".into()
}

/// How even the expert GPUs' loads are on a planned allocation, with the placement asked for and
/// with the plain contiguous split (no redundant experts) of the same load.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BalanceReport {
    /// The expert load (`uniform`, `zipf:S`, `measured`).
    pub load: String,
    /// The placement asked for.
    pub placement: ExpertPlacement,
    /// Redundant replicas per MoE layer.
    pub redundant_experts: usize,
    /// Busiest expert GPU's share of a layer's copies over the mean share, averaged over MoE layers.
    pub imbalance: f64,
    /// The same with the contiguous split and no redundant experts.
    pub imbalance_contiguous: f64,
    /// Simulated step of the chosen allocation with the contiguous split and no redundant experts.
    pub step_contiguous_s: f64,
}

impl BalanceReport {
    /// The balance of `cost`'s expert load and placement on `alloc`, beside the contiguous split's
    /// (`None` when the load is uniform and the split contiguous).
    pub fn of(cost: &CostModel, alloc: &Allocation) -> Result<Option<Self>> {
        let balance = cost.expert_balance().clone();
        if balance == ExpertBalance::default() {
            return Ok(None);
        }
        let contiguous =
            ExpertBalance { load: balance.load.clone(), placement: ExpertPlacement::Contiguous, redundant: 0 };
        let plain = cost.clone().with_expert_balance(contiguous.clone())?;
        let (report, _) = simulate_schedules(&plain, &["afpipe".to_string()], Some(*alloc))?;
        let step_contiguous_s = report
            .schedules
            .first()
            .map(|r| r.step_s)
            .ok_or_else(|| invalid("allocation", &format!("{alloc:?}"), "an allocation AF-Pipe can be built on"))?;
        let f = alloc.ffn_gpus_per_group;
        Ok(Some(BalanceReport {
            load: balance.load.name(),
            placement: balance.placement,
            redundant_experts: balance.redundant,
            imbalance: mean_imbalance(cost, &balance, f)?,
            imbalance_contiguous: mean_imbalance(cost, &contiguous, f)?,
            step_contiguous_s,
        }))
    }
}

/// [`ExpertBalance::imbalance`] averaged over `cost`'s MoE layers on `f` expert GPUs.
pub fn mean_imbalance(cost: &CostModel, balance: &ExpertBalance, f: usize) -> Result<f64> {
    let m = &cost.model;
    let layers: Vec<usize> = (0..m.layers).filter(|&l| !m.is_dense(l)).collect();
    let mut sum = 0.0;
    for &l in &layers {
        sum += balance.imbalance(l, m.moe.experts, f)?;
    }
    Ok(if layers.is_empty() { 1.0 } else { sum / layers.len() as f64 })
}

/// Plans the allocation for `cost`'s model, cluster and workload.
pub fn plan(cost: &CostModel, explain: bool, search_evals: usize) -> Result<PlanReport> {
    let start = Instant::now();
    let problem = AllocationProblem::new(cost, None)?;
    let (milp, search) = solve_and_search(&problem, &mut SimulatorOracle::new(cost.clone()), search_evals)?;
    let solve_s = start.elapsed().as_secs_f64();
    let best = search.best.allocation;
    let (in_flight, recompute) = afpipe_window(cost, &best);
    let params = cost.model.param_counts();
    Ok(PlanReport {
        model: cost.model.name.clone(),
        cluster: cost.cluster.name.clone(),
        seq: cost.workload.seq,
        micro_batch: cost.workload.micro_batch,
        global_batch: cost.workload.global_batch,
        attention_gpus: best.attention_gpus(),
        ffn_gpus: best.ffn_gpus(),
        attention_nics: best.attention_nics(),
        ffn_nics: best.ffn_nics(),
        groups: best.groups,
        context_parallel: best.context_parallel,
        context_parallel_choice: cost.context_parallel.name(),
        allocation: best,
        in_flight,
        recompute,
        predicted_step_s: search.best.predicted_step_s,
        milp_bottleneck_s: milp.bottleneck_s,
        solve_s,
        milp_s: milp.solve_s,
        params_total: params.total,
        params_active: params.active,
        flops_per_token: cost.flops_per_token(),
        candidates: explain.then_some(search.candidates),
        expert_balance: BalanceReport::of(cost, &best)?,
    })
}

/// The MILP's answer, then the multi-start local search from it (the global optimum first, then
/// the best answers for other group counts) with `oracle`, spending at most `search_evals` calls.
pub fn solve_and_search(
    problem: &AllocationProblem,
    oracle: &mut dyn StepTimeOracle,
    search_evals: usize,
) -> Result<(MilpSolution, SearchResult)> {
    let milp = solve_milp_pruned(problem)?;
    let mut starts = vec![milp.allocation];
    starts.extend(
        problem
            .best_per_group_count()
            .into_iter()
            .map(|(a, _)| a)
            .filter(|a| *a != milp.allocation)
            .take(MULTI_STARTS - 1),
    );
    let search = local_search(problem, &starts, oracle, search_evals.max(1))?;
    Ok((milp, search))
}

/// One simulated schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScheduleResult {
    /// Schedule name.
    pub schedule: String,
    /// Step time, seconds.
    pub step_s: f64,
    /// Exposed communication (GPU-weighted mean of communication in flight while the GPUs idle),
    /// seconds.
    pub exposed_comm_s: f64,
    /// Exposed communication of the bottleneck worker (the one with the most compute), seconds.
    pub bottleneck_exposed_comm_s: f64,
    /// Bubble (GPU-weighted mean), seconds.
    pub bubble_s: f64,
    /// Compute utilisation (GPU-weighted mean).
    pub compute_utilisation: f64,
    /// The layout the schedule ran on, in words.
    pub layout: String,
    /// AF-Pipe's speedup over this schedule (`step_s / afpipe step_s`), when AF-Pipe ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub afpipe_speedup: Option<f64>,
    /// Fraction of this schedule's exposed communication that AF-Pipe removes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub afpipe_exposed_comm_reduction: Option<f64>,
    /// The same for the bottleneck worker's exposed communication.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub afpipe_bottleneck_exposed_comm_reduction: Option<f64>,
}

/// A schedule that could not be built (for example, it does not fit in memory).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScheduleFailure {
    /// Schedule name.
    pub schedule: String,
    /// Why.
    pub error: String,
}

/// What `disagmoe simulate` prints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimulateReport {
    /// Model name.
    pub model: String,
    /// Cluster name.
    pub cluster: String,
    /// Sequence length.
    pub seq: usize,
    /// AF-Pipe's allocation (planned).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allocation: Option<Allocation>,
    /// Schedules that ran.
    pub schedules: Vec<ScheduleResult>,
    /// Schedules that could not be built.
    pub failures: Vec<ScheduleFailure>,
}

/// Schedule names `simulate` accepts.
pub const SCHEDULE_NAMES: &[&str] = &["afpipe", "1f1b-interleaved", "tutel", "comet", "dualpipe"];

/// A built and simulated schedule, kept for pictures.
pub struct Simulated {
    /// The schedule.
    pub schedule: Schedule,
    /// Its trace.
    pub trace: Trace,
    /// Its summary.
    pub report: SimReport,
}

/// Builds and simulates the named schedules; AF-Pipe runs on `allocation` or, when `None`, on
/// the allocation [`plan`] chooses. Returns the report and the simulated schedules.
pub fn simulate_schedules(
    cost: &CostModel,
    names: &[String],
    allocation: Option<Allocation>,
) -> Result<(SimulateReport, Vec<Simulated>)> {
    for n in names {
        if !SCHEDULE_NAMES.contains(&n.as_str()) {
            return Err(invalid("schedules", n, &format!("a comma-separated subset of {}", SCHEDULE_NAMES.join(", "))));
        }
    }
    let mut results = Vec::new();
    let mut failures = Vec::new();
    let mut sims = Vec::new();
    let mut afpipe_alloc = None;
    for name in names {
        let built = if name == "afpipe" {
            let alloc = match allocation {
                Some(a) => a,
                None => plan(cost, false, DEFAULT_SEARCH_EVALS)?.allocation,
            };
            afpipe_alloc = Some(alloc);
            let (w, rc) = afpipe_window(cost, &alloc);
            build_afpipe(cost, &alloc).map(|s| {
                let layout = format!(
                    "{} pairs x (A {} GPU/{} NIC{}, F {} GPU/{} NIC), {w} in flight{}",
                    alloc.groups,
                    alloc.attention_gpus_per_group,
                    alloc.attention_nics_per_group,
                    if alloc.context_parallel > 1 { format!(", CP {}", alloc.context_parallel) } else { String::new() },
                    alloc.ffn_gpus_per_group,
                    alloc.ffn_nics_per_group,
                    if rc { ", recompute" } else { "" }
                );
                (s, layout)
            })
        } else {
            let b = Baseline::parse(name).expect("validated above");
            ep_layout(cost, b).and_then(|l| {
                let layout = format!(
                    "pp {} x dp {} (ep {}{}), {} chunk(s)/stage, {} micro-batches/rank{}",
                    l.pp,
                    l.dp,
                    l.ep,
                    if l.cp > 1 { format!(", cp {}", l.cp) } else { String::new() },
                    l.chunks,
                    l.micro_batches,
                    if l.recompute { ", recompute" } else { "" }
                );
                build_baseline(cost, b).map(|s| (s, layout))
            })
        };
        match built {
            Ok((schedule, layout)) => {
                let (trace, report) = run(&schedule)?;
                results.push(ScheduleResult {
                    schedule: name.clone(),
                    step_s: report.step_s,
                    exposed_comm_s: report.exposed_comm_s,
                    bottleneck_exposed_comm_s: report.bottleneck_exposed_comm_s,
                    bubble_s: report.bubble_s,
                    compute_utilisation: report.compute_utilisation,
                    layout,
                    afpipe_speedup: None,
                    afpipe_exposed_comm_reduction: None,
                    afpipe_bottleneck_exposed_comm_reduction: None,
                });
                sims.push(Simulated { schedule, trace, report });
            }
            Err(e) => failures.push(ScheduleFailure { schedule: name.clone(), error: e.to_string() }),
        }
    }
    if let Some(af) = results.iter().find(|r| r.schedule == "afpipe").cloned() {
        for r in results.iter_mut().filter(|r| r.schedule != "afpipe") {
            r.afpipe_speedup = Some(r.step_s / af.step_s);
            r.afpipe_exposed_comm_reduction = Some(1.0 - af.exposed_comm_s / r.exposed_comm_s.max(f64::MIN_POSITIVE));
            r.afpipe_bottleneck_exposed_comm_reduction =
                Some(1.0 - af.bottleneck_exposed_comm_s / r.bottleneck_exposed_comm_s.max(f64::MIN_POSITIVE));
        }
    }
    let report = SimulateReport {
        model: cost.model.name.clone(),
        cluster: cost.cluster.name.clone(),
        seq: cost.workload.seq,
        allocation: afpipe_alloc,
        schedules: results,
        failures,
    };
    Ok((report, sims))
}
