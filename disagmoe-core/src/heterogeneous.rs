//! Planning on a cluster of several node kinds ([`MixedCluster`]): which pool holds attention,
//! which holds the experts, and how many GPUs and NICs each group gets.
//!
//! [`plan_mixed`] plans every way of giving the two sides pools and keeps the fastest:
//! - **apart**: attention on pool `i`, experts on pool `j != i`. The options of each side are
//!   costed on its own pool's GPU ([`crate::cost::Sides`]), sized by its pool's nodes and fitted in
//!   its pool's memory; the MILP keeps each side within its pool's GPUs and NICs; the local search
//!   simulates each worker on its own hardware, the exchange crossing both pools' NICs.
//! - **one pool**: both sides on pool `i` (the other pools idle), today's planner on that pool.
//! - **as its slowest**: both sides spread over the whole cluster as if every GPU were the
//!   slowest kind ([`MixedCluster::slowest`]): a placement that ignores the kinds.
//!
//! The baselines (Megatron 1F1B, Tutel, Comet, DualPipe) give every GPU the same role, so they run
//! on [`MixedCluster::slowest`] too: a synchronous step waits for its slowest rank.
//!
//! Not modelled: a side spread over two pools (each side lives in one pool), and pools whose
//! traffic to each other is slower than their NICs unless `pool_link_bandwidth` says so (then
//! each group pair gets an equal share of it).

use crate::allocator::oracle::SimulatorOracle;
use crate::allocator::{Allocation, AllocationProblem};
use crate::cost::{Apart, CostModel};
use crate::error::{CoreError, Result};
use crate::plan::{simulate_schedules, solve_and_search, ScheduleFailure, ScheduleResult, SCHEDULE_NAMES};
use crate::pools::MixedCluster;
use crate::roofline::{component_roofline, inflection_sequence, Component, ComponentRoofline};
use crate::schedule::afpipe::afpipe_window_on;
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// Which pools the two sides run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Roles {
    /// Attention on one pool, experts on another (indices into the cluster's pools).
    Apart {
        /// Pool of the attention side.
        attention: usize,
        /// Pool of the expert side.
        ffn: usize,
    },
    /// Both sides on one pool, the others idle.
    OnePool {
        /// The pool.
        pool: usize,
    },
    /// Both sides over the whole cluster, every GPU as the slowest kind.
    Slowest,
}

impl Roles {
    /// In words, with the pools' names.
    pub fn describe(&self, mixed: &MixedCluster) -> String {
        let name = |i: usize| mixed.pools[i].name.as_str();
        match *self {
            Roles::Apart { attention, ffn } => format!("attention on {}, experts on {}", name(attention), name(ffn)),
            Roles::OnePool { pool } => format!("both on {} (the rest idle)", name(pool)),
            Roles::Slowest => "both over all pools, as the slowest kind".to_string(),
        }
    }

    /// Every assignment of a cluster of `pools` pools: apart in both directions, each pool alone,
    /// and the whole cluster as its slowest.
    pub fn all(pools: usize) -> Vec<Roles> {
        let mut v = Vec::new();
        for i in 0..pools {
            for j in (0..pools).filter(|&j| j != i) {
                v.push(Roles::Apart { attention: i, ffn: j });
            }
        }
        v.extend((0..pools).map(|pool| Roles::OnePool { pool }));
        v.push(Roles::Slowest);
        v
    }
}

/// The plan of one role assignment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RolePlan {
    /// The allocation per group (GPUs and NICs of the side's own pool).
    pub allocation: Allocation,
    /// Simulated step time, seconds.
    pub predicted_step_s: f64,
    /// Roofline bottleneck of the MILP's answer, seconds per step.
    pub milp_bottleneck_s: f64,
    /// Micro-batches in flight.
    pub in_flight: usize,
    /// Whether activations are recomputed.
    pub recompute: bool,
}

/// One role assignment and what came of it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoleOutcome {
    /// The assignment.
    pub roles: Roles,
    /// The assignment in words.
    pub description: String,
    /// Its plan, when one exists.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub plan: Option<RolePlan>,
    /// Why there is none (e.g. the model does not fit the pool's memory).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Why a pool suits a side: each side's roofline on one node of the pool (its GPUs and NICs) at
/// the planned workload, and the sequence length from which the side turns compute-bound.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolRooflines {
    /// The pool.
    pub pool: String,
    /// Its GPU.
    pub gpu: String,
    /// Attention on one node.
    pub attention: ComponentRoofline,
    /// Experts on one node.
    pub ffn: ComponentRoofline,
    /// Smallest power-of-two sequence at which attention on a node is compute-bound.
    pub attention_inflection_seq: Option<usize>,
    /// The same for the experts.
    pub ffn_inflection_seq: Option<usize>,
}

/// What `disagmoe plan` prints for a mixed cluster.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MixedPlanReport {
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
    /// Every role assignment, in [`Roles::all`]'s order.
    pub roles: Vec<RoleOutcome>,
    /// Index in `roles` of the fastest.
    pub chosen: usize,
    /// The baselines on the cluster as its slowest.
    pub baselines: Vec<ScheduleResult>,
    /// Baselines that could not be built.
    pub baseline_failures: Vec<ScheduleFailure>,
    /// Each pool's rooflines (with `explain`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rooflines: Option<Vec<PoolRooflines>>,
    /// Wall time of the whole plan, seconds.
    pub solve_s: f64,
}

impl MixedPlanReport {
    /// The chosen assignment's plan.
    pub fn best(&self) -> (&RoleOutcome, &RolePlan) {
        let r = &self.roles[self.chosen];
        (r, r.plan.as_ref().expect("the chosen assignment has a plan"))
    }

    /// The plan of an assignment, if it has one.
    pub fn step_of(&self, roles: Roles) -> Option<f64> {
        self.roles.iter().find(|r| r.roles == roles)?.plan.as_ref().map(|p| p.predicted_step_s)
    }
}

/// `template` on another cluster (same model, workload, precision, context parallelism, expert
/// balance).
fn on(template: &CostModel, cluster: crate::hardware::Cluster) -> CostModel {
    let mut c = template.clone();
    c.cluster = cluster;
    c
}

/// The simulator of one role assignment: the attention side's cost model, and the expert side's
/// with the pools' sizes when the two are apart ([`SimulatorOracle::sides`] is the hardware the
/// options are built on).
pub(crate) fn oracle_for(template: &CostModel, mixed: &MixedCluster, roles: Roles) -> SimulatorOracle {
    match roles {
        Roles::Apart { attention, ffn } => SimulatorOracle {
            cost: on(template, mixed.pools[attention].cluster()),
            experts: Some((
                on(template, mixed.pools[ffn].cluster()),
                Apart {
                    attention_gpus: mixed.pools[attention].gpus(),
                    ffn_gpus: mixed.pools[ffn].gpus(),
                    link_bandwidth: mixed.pool_link_bandwidth,
                },
            )),
        },
        Roles::OnePool { pool } => SimulatorOracle::new(on(template, mixed.pools[pool].cluster())),
        Roles::Slowest => SimulatorOracle::new(on(template, mixed.slowest())),
    }
}

/// The MILP and local search of one assignment's problem with its simulator.
fn plan_role(oracle: &mut SimulatorOracle, problem: &AllocationProblem, evals: usize) -> Result<RolePlan> {
    let (milp, search) = solve_and_search(problem, oracle, evals)?;
    let best = search.best.allocation;
    let (in_flight, recompute) = afpipe_window_on(oracle.sides(), &best);
    Ok(RolePlan {
        allocation: best,
        predicted_step_s: search.best.predicted_step_s,
        milp_bottleneck_s: milp.bottleneck_s,
        in_flight,
        recompute,
    })
}

/// The smallest [`AllocationProblem::step_lower_bound`] over the problem's feasible pairs: no
/// simulated step of this assignment is shorter.
fn lower_bound(problem: &AllocationProblem) -> f64 {
    let mut best = f64::INFINITY;
    for a in &problem.attention {
        for f in problem.ffn.iter().filter(|f| problem.compatible(a, f)) {
            best = best.min(problem.step_lower_bound(a, f));
        }
    }
    best
}

/// How much of [`plan_mixed`] to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MixedScope {
    /// Choose the placement: an assignment whose lower bound is not below the best simulated step
    /// so far is not searched (its outcome says so), and no baseline runs.
    Choose,
    /// Plan every assignment and simulate the baselines (for comparisons).
    Compare,
}

/// Plans `template`'s model and workload on `mixed`: every [`Roles`] assignment (tried in the
/// order of their roofline lower bounds), the fastest chosen; with [`MixedScope::Compare`] every
/// assignment planned and the baselines simulated on the cluster as its slowest; with `explain`,
/// each pool's rooflines. Fails when no assignment has a plan (with the last error), and with
/// [`MixedScope::Compare`] when the baselines cannot be simulated.
pub fn plan_mixed(
    template: &CostModel,
    mixed: &MixedCluster,
    scope: MixedScope,
    explain: bool,
    evals: usize,
) -> Result<MixedPlanReport> {
    let start = Instant::now();
    mixed.validate()?;
    let all = Roles::all(mixed.pools.len());
    let mut outcomes: Vec<RoleOutcome> = all
        .iter()
        .map(|r| RoleOutcome { roles: *r, description: r.describe(mixed), plan: None, error: None })
        .collect();
    let mut built = Vec::new();
    let mut last_error = None;
    for (i, r) in all.iter().enumerate() {
        let oracle = oracle_for(template, mixed, *r);
        match AllocationProblem::new_on(oracle.sides(), None) {
            Ok(problem) => {
                let bound = lower_bound(&problem);
                built.push((i, oracle, problem, bound));
            }
            Err(e) => {
                outcomes[i].error = Some(e.to_string());
                last_error = Some(e);
            }
        }
    }
    built.sort_by(|x, y| x.3.total_cmp(&y.3));
    let mut incumbent = f64::INFINITY;
    for (i, oracle, problem, bound) in &mut built {
        if !bound.is_finite() {
            let e = CoreError::Infeasible {
                constraint: "nics".into(),
                detail: format!(
                    "{}: no attention and expert option fit together within their pools' GPUs and NICs \
                     (a group's NICs come from its own GPUs' nodes)",
                    outcomes[*i].description
                ),
            };
            outcomes[*i].error = Some(e.to_string());
            last_error = Some(e);
            continue;
        }
        if scope == MixedScope::Choose && *bound >= incumbent {
            outcomes[*i].error = Some(format!(
                "not searched: its lower bound {bound:.3} s is not below the best step found, {incumbent:.3} s"
            ));
            continue;
        }
        match plan_role(oracle, problem, evals) {
            Ok(plan) => {
                incumbent = incumbent.min(plan.predicted_step_s);
                outcomes[*i].plan = Some(plan);
            }
            Err(e) => {
                outcomes[*i].error = Some(e.to_string());
                last_error = Some(e);
            }
        }
    }
    let chosen = outcomes
        .iter()
        .enumerate()
        .filter_map(|(i, r)| r.plan.as_ref().map(|p| (i, p.predicted_step_s)))
        .min_by(|x, y| x.1.total_cmp(&y.1))
        .map(|(i, _)| i);
    let Some(chosen) = chosen else {
        return Err(last_error.expect("every assignment failed with an error"));
    };
    let (baselines, baseline_failures) = if scope == MixedScope::Compare {
        let names: Vec<String> = SCHEDULE_NAMES.iter().filter(|n| **n != "afpipe").map(|n| n.to_string()).collect();
        let (sim, _) = simulate_schedules(&on(template, mixed.slowest()), &names, None)?;
        (sim.schedules, sim.failures)
    } else {
        (Vec::new(), Vec::new())
    };
    let rooflines = explain.then(|| {
        mixed
            .pools
            .iter()
            .map(|pool| {
                let c = on(template, pool.cluster());
                let (g, n) = (pool.node.gpus_per_node, pool.node.nics_per_node);
                PoolRooflines {
                    pool: pool.name.clone(),
                    gpu: pool.gpu.name.clone(),
                    attention: component_roofline(&c, Component::Attention, g, n, g),
                    ffn: component_roofline(&c, Component::Ffn, g, n, g),
                    attention_inflection_seq: inflection_sequence(&c, Component::Attention, g, n, g),
                    ffn_inflection_seq: inflection_sequence(&c, Component::Ffn, g, n, g),
                }
            })
            .collect()
    });
    Ok(MixedPlanReport {
        model: template.model.name.clone(),
        cluster: mixed.name.clone(),
        seq: template.workload.seq,
        micro_batch: template.workload.micro_batch,
        global_batch: template.workload.global_batch,
        roles: outcomes,
        chosen,
        baselines,
        baseline_failures,
        rooflines,
        solve_s: start.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::Sides;
    use crate::cost::Workload;
    use crate::hardware::Cluster;
    use crate::model_shape::ModelShape;

    fn template(model: &str, mixed: &MixedCluster, seq: usize) -> CostModel {
        let mb = (65_536 / seq).max(1);
        let w = Workload { seq, micro_batch: mb, global_batch: 2 * mixed.total_gpus() * mb };
        let mut c = CostModel::new(ModelShape::preset(model).unwrap(), mixed.slowest(), w).unwrap();
        c.precision = crate::cost::Precision::megatron();
        c
    }

    #[test]
    fn two_pools_of_one_kind_apart_cost_what_their_parts_cost() {
        // Two identical pools: the apart plan's workers are timed on the same GPU as the one-pool
        // plan's, so each side's busy time per option is the homogeneous model's.
        let mixed = MixedCluster::preset("h100x2+h100x2").unwrap();
        let t = template("qwen3-30b-a3b", &mixed, 4096);
        let whole = on(&t, Cluster::preset("h100x4").unwrap());
        let pool = on(&t, mixed.pools[0].cluster());
        let apart = Apart { attention_gpus: 16, ffn_gpus: 16, link_bandwidth: None };
        let sides = Sides { attention: &pool, ffn: &pool, apart: Some(apart) };
        let split = AllocationProblem::new_on(sides, None).unwrap();
        let one = AllocationProblem::new(&whole, None).unwrap();
        let mut matched = 0;
        for o in &split.attention {
            if let Some(h) = one.attention.iter().find(|h| (h.groups, h.gpus, h.nics) == (o.groups, o.gpus, o.nics)) {
                assert!((h.busy_s - o.busy_s).abs() <= 1e-12 * h.busy_s, "{o:?} vs {h:?}");
                assert_eq!(h.memory, o.memory);
                matched += 1;
            }
            assert!(o.groups * o.gpus <= 16 && o.nics as f64 <= o.gpus as f64 + 1e-9, "{o:?}");
        }
        assert!(matched > 0);
        for (a, f) in split.attention.iter().flat_map(|a| split.ffn.iter().map(move |f| (a, f))) {
            if split.compatible(a, f) {
                assert!(a.groups * a.gpus <= 16 && f.groups * f.gpus <= 16);
            }
        }
        // The MILP agrees with enumeration on the apart problem.
        let milp = crate::allocator::milp::solve_milp(&split).unwrap();
        let (_, best) = split.enumerate().unwrap();
        assert!((milp.objective_s - best).abs() <= 1e-9 * best, "{} vs {best}", milp.objective_s);
    }

    #[test]
    fn compute_rich_and_memory_rich_pools_split_the_roles_and_the_apart_simulation_uses_each_gpu() {
        let mixed = MixedCluster::preset("h100x2+h20x2").unwrap();
        let t = template("qwen3-30b-a3b", &mixed, 16384);
        let report = plan_mixed(&t, &mixed, MixedScope::Compare, true, 8).unwrap();
        assert_eq!(report.roles.len(), 5);
        let (chosen, best) = report.best();
        assert!(report
            .roles
            .iter()
            .filter_map(|r| r.plan.as_ref())
            .all(|p| p.predicted_step_s >= best.predicted_step_s));
        // Long sequences are attention-heavy: the H100s (6.7x the H20's FLOPs) take attention
        // when the sides are apart, and that beats the other direction.
        let fwd = report.step_of(Roles::Apart { attention: 0, ffn: 1 }).unwrap();
        let back = report.step_of(Roles::Apart { attention: 1, ffn: 0 }).unwrap();
        assert!(fwd < back, "H100 attention {fwd} s vs H20 attention {back} s");
        assert!(chosen.plan.is_some());
        // Simulating the same allocation with the H20s on both sides is slower: the simulator
        // times the attention workers on the H100.
        let alloc = report.roles[0].plan.as_ref().unwrap().allocation;
        let (h100, h20) = (on(&t, mixed.pools[0].cluster()), on(&t, mixed.pools[1].cluster()));
        let apart = Apart { attention_gpus: 16, ffn_gpus: 16, link_bandwidth: None };
        let step = |a: &CostModel, f: &CostModel| {
            crate::schedule::afpipe::AfPipe::on(Sides { attention: a, ffn: f, apart: Some(apart) }, &alloc)
                .unwrap()
                .step_time()
                .unwrap()
        };
        assert!(step(&h100, &h20) < step(&h20, &h20));
        let roof = report.rooflines.as_ref().unwrap();
        assert_eq!(roof.len(), 2);
        assert!(roof[0].attention.compute_s < roof[1].attention.compute_s);
        assert!(!report.baselines.is_empty());
        // Choosing alone skips the assignments that cannot win, and chooses the same.
        let quick = plan_mixed(&t, &mixed, MixedScope::Choose, false, 8).unwrap();
        assert_eq!(quick.best().1, best);
        assert!(quick.baselines.is_empty() && quick.rooflines.is_none());
        for (q, r) in quick.roles.iter().zip(&report.roles) {
            match (&q.plan, &r.plan) {
                (Some(a), Some(b)) => assert_eq!(a, b),
                (None, Some(b)) => {
                    let e = q.error.as_deref().unwrap();
                    assert!(e.contains("not searched") && b.predicted_step_s >= best.predicted_step_s, "{e}");
                }
                (a, b) => assert_eq!(a.is_some(), b.is_some(), "{q:?} vs {r:?}"),
            }
        }
    }

    #[test]
    fn apart_steps_respect_the_lower_bound_the_search_and_the_role_pruning_use() {
        use crate::allocator::search::StepTimeOracle;
        let mut mixed = MixedCluster::preset("h100x2+h20x2").unwrap();
        mixed.pool_link_bandwidth = Some(40e9);
        let t = template("qwen3-30b-a3b", &mixed, 8192);
        for roles in [Roles::Apart { attention: 0, ffn: 1 }, Roles::Apart { attention: 1, ffn: 0 }] {
            let mut oracle = oracle_for(&t, &mixed, roles);
            let problem = AllocationProblem::new_on(oracle.sides(), None).unwrap();
            let pairs: Vec<_> = problem
                .attention
                .iter()
                .flat_map(|a| problem.ffn.iter().filter(|f| problem.compatible(a, f)).map(move |f| (*a, *f)))
                .step_by(2)
                .collect();
            assert!(pairs.len() >= 10, "{} pairs", pairs.len());
            let floor = lower_bound(&problem);
            for (a, f) in pairs {
                let step = oracle.step_time(&AllocationProblem::allocation(&a, &f)).unwrap();
                let bound = problem.step_lower_bound(&a, &f);
                assert!(step >= bound * (1.0 - 1e-9) && bound >= floor, "{roles:?} {a:?} {f:?}: {step} vs {bound}");
            }
        }
    }

    #[test]
    fn a_slow_link_between_pools_slows_the_apart_plan() {
        let mut mixed = MixedCluster::preset("h100x2+h20x2").unwrap();
        let t = template("qwen3-30b-a3b", &mixed, 4096);
        let apart = Roles::Apart { attention: 0, ffn: 1 };
        let step = |mixed: &MixedCluster| {
            let mut oracle = oracle_for(&t, mixed, apart);
            let problem = AllocationProblem::new_on(oracle.sides(), None).unwrap();
            plan_role(&mut oracle, &problem, 8).unwrap().predicted_step_s
        };
        let fast = step(&mixed);
        mixed.pool_link_bandwidth = Some(5e9);
        let slow = step(&mixed);
        assert!(slow > fast, "{slow} vs {fast}");
    }
}
