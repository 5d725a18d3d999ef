//! Re-planning over a run's phases: a run that changes its step shape (4K tokens for N steps,
//! then 16K, then 32K, as long-context extension does) may change its attention/expert split at
//! each boundary. [`plan_phases`] plans every phase on its own and compares the whole schedule
//! with the best single split kept throughout, all simulated.
//!
//! A split is the group count and each group's GPUs and NICs; the context-parallel size is not
//! part of it (how an attention group shares a micro-batch follows each phase's shape, as
//! `--context-parallel` says). The single split is the best, summed over the phases, of the
//! [`SINGLE_CANDIDATES_PER_PHASE`] best splits each phase's search evaluated (its MILP answer,
//! its multi-start points and their neighbours) that fit in memory in every phase: the planner
//! does not search the joint problem beyond those. What a
//! switch costs (a checkpoint written and read back under the new placement) is not in the
//! totals; [`PhasedPlan::switches`] counts them.

use crate::allocator::oracle::SimulatorOracle;
use crate::allocator::search::StepTimeOracle;
use crate::allocator::{Allocation, AllocationProblem};
use crate::cost::{CostModel, Workload};
use crate::error::{invalid, Result};
use crate::heterogeneous::{oracle_for, Roles};
use crate::plan::solve_and_search;
use crate::pools::MixedCluster;
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// Candidates per phase, best first, that the single split is chosen among.
pub const SINGLE_CANDIDATES_PER_PHASE: usize = 8;

/// One phase of a run: its step shape and how many steps it lasts.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Phase {
    /// The phase's step shape.
    pub workload: Workload,
    /// Optimizer steps of the phase.
    pub steps: usize,
}

impl Phase {
    /// Phases given as `SEQxSTEPS` lengths that keep the tokens per micro-batch and per step of
    /// `keep` (so a phase at twice the sequence length has half the sequences); refused when a
    /// phase's sequence length does not divide those tokens into whole sequences.
    pub fn keeping_tokens(keep: Workload, phases: &[(usize, usize)]) -> Result<Vec<Phase>> {
        if phases.is_empty() {
            return Err(invalid("phases", "(none)", "at least one SEQxSTEPS phase"));
        }
        let micro_tokens = keep.seq.saturating_mul(keep.micro_batch);
        let step_tokens = keep.seq.saturating_mul(keep.global_batch);
        phases
            .iter()
            .map(|&(seq, steps)| {
                let name = format!("{seq}x{steps}");
                if steps == 0 {
                    return Err(invalid("phases", &name, "at least 1 step per phase"));
                }
                if seq == 0 || micro_tokens % seq != 0 || step_tokens % seq != 0 {
                    return Err(invalid(
                        "phases",
                        &name,
                        &format!(
                            "a sequence length that divides the {micro_tokens} tokens per micro-batch and the \
                             {step_tokens} per step of --seq x --micro-batch / --global-batch (every phase keeps them)"
                        ),
                    ));
                }
                let workload = Workload { seq, micro_batch: micro_tokens / seq, global_batch: step_tokens / seq };
                workload.validate()?;
                Ok(Phase { workload, steps })
            })
            .collect()
    }
}

/// The plan of one phase.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PhasePlan {
    /// The phase.
    pub phase: Phase,
    /// On a mixed cluster: the pools the two sides run on in this phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub roles: Option<Roles>,
    /// The same in words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub roles_description: Option<String>,
    /// The allocation planned for it alone.
    pub allocation: Allocation,
    /// Its simulated step time, seconds.
    pub step_s: f64,
    /// The single split's simulated step time in this phase, seconds (absent when there is none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub single_step_s: Option<f64>,
}

/// What `disagmoe plan --phases` prints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PhasedPlan {
    /// Model name.
    pub model: String,
    /// Cluster name.
    pub cluster: String,
    /// Each phase's plan, in order.
    pub phases: Vec<PhasePlan>,
    /// Simulated time of the whole schedule re-planned at each boundary, seconds.
    pub replanned_s: f64,
    /// The best split kept for the whole schedule, as the first phase runs it (absent when none
    /// of the candidates fits in every phase: the schedule cannot run without re-planning).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub single: Option<Allocation>,
    /// On a mixed cluster: the single split's role assignment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub single_roles: Option<Roles>,
    /// The same in words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub single_roles_description: Option<String>,
    /// Its simulated time for the whole schedule, seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub single_s: Option<f64>,
    /// `single_s / replanned_s`: the simulated gain of re-planning (1.0: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gain: Option<f64>,
    /// Boundaries at which the re-planned split (or, on a mixed cluster, the roles) changes (a
    /// change of context-parallel size alone is not one).
    pub switches: usize,
    /// Distinct splits compared for the single split (those that fit in every phase).
    pub single_candidates: usize,
    /// Wall time of the whole comparison, seconds.
    pub solve_s: f64,
}

/// Plans each of `phases` on `template`'s model and cluster (its precision, context parallelism
/// and expert balance; its workload replaced by each phase's) and compares re-planning at each
/// boundary with the best single split (see the module's documentation). A phase's plan is
/// [`crate::plan::plan`]'s for its shape, or a candidate another phase's search found that the
/// simulator times faster in this phase.
pub fn plan_phases(template: &CostModel, phases: &[Phase], search_evals: usize) -> Result<PhasedPlan> {
    plan_phases_on(template, None, phases, search_evals)
}

/// [`plan_phases`] on a cluster of several node kinds when `mixed` is given: in every phase each
/// role assignment ([`Roles::all`]) is planned, the fastest is the phase's plan (so the roles may
/// change at a boundary, as the split may), and the single split keeps both the roles and the
/// split throughout. `template`'s cluster is unused then.
pub fn plan_phases_on(
    template: &CostModel,
    mixed: Option<&MixedCluster>,
    phases: &[Phase],
    search_evals: usize,
) -> Result<PhasedPlan> {
    if phases.is_empty() {
        return Err(invalid("phases", "(none)", "at least one phase"));
    }
    if let Some(m) = mixed {
        m.validate()?;
    }
    let start = Instant::now();
    let describe = |roles: Option<Roles>| roles.zip(mixed).map(|(r, m)| r.describe(m));
    let settings: Vec<Option<Roles>> = match mixed {
        Some(m) => Roles::all(m.pools.len()).into_iter().map(Some).collect(),
        None => vec![None],
    };
    // Per phase, per setting: its simulator and problem (none where nothing fits).
    let mut built: Vec<Vec<Option<(SimulatorOracle, AllocationProblem)>>> = Vec::with_capacity(phases.len());
    let mut plans = Vec::with_capacity(phases.len());
    // (setting, allocation) candidates, best first within each phase.
    let mut pool: Vec<(usize, Allocation)> = Vec::new();
    for phase in phases {
        phase.workload.validate()?;
        let mut cost = template.clone();
        cost.workload = phase.workload;
        let mut row = Vec::with_capacity(settings.len());
        let mut seen: Vec<(usize, Allocation, f64)> = Vec::new();
        let mut last_error = None;
        for (j, roles) in settings.iter().enumerate() {
            let mut oracle = match (mixed, roles) {
                (Some(m), Some(r)) => oracle_for(&cost, m, *r),
                _ => SimulatorOracle::new(cost.clone()),
            };
            let searched = AllocationProblem::new_on(oracle.sides(), None)
                .and_then(|problem| Ok((solve_and_search(&problem, &mut oracle, search_evals)?.1, problem)));
            match searched {
                Ok((search, problem)) => {
                    let finite = search.candidates.iter().filter(|c| c.predicted_step_s.is_finite());
                    seen.extend(finite.map(|c| (j, c.allocation, c.predicted_step_s)));
                    row.push(Some((oracle, problem)));
                }
                Err(e) => {
                    last_error = Some(e);
                    row.push(None);
                }
            }
        }
        seen.sort_by(|x, y| x.2.total_cmp(&y.2));
        let Some(&(j, allocation, step_s)) = seen.first() else {
            return Err(last_error.unwrap_or_else(|| {
                invalid("phases", &format!("{} tokens", phase.workload.seq), "a phase with a runnable allocation")
            }));
        };
        for &(j, a, _) in seen.iter().take(SINGLE_CANDIDATES_PER_PHASE) {
            if !pool.iter().any(|&(k, b)| k == j && same_split(a, b)) {
                pool.push((j, a));
            }
        }
        plans.push(PhasePlan {
            phase: *phase,
            roles: settings[j],
            roles_description: describe(settings[j]),
            allocation,
            step_s,
            single_step_s: None,
        });
        built.push(row);
    }
    // Each candidate split that fits in every phase, timed in each (with the phase's own
    // context-parallel size for it: how a group shares a micro-batch follows the phase's shape).
    let mut runnable: Vec<(usize, Vec<Allocation>)> = Vec::new();
    for (j, a) in pool {
        let per_phase: Option<Vec<Allocation>> =
            built.iter().map(|row| row[j].as_ref().and_then(|(_, p)| in_problem(p, a))).collect();
        runnable.extend(per_phase.map(|v| (j, v)));
    }
    let mut totals = vec![0.0; runnable.len()];
    let mut times = vec![Vec::with_capacity(phases.len()); runnable.len()];
    for (k, phase) in phases.iter().enumerate() {
        for (j, slot) in built[k].iter_mut().enumerate() {
            let Some((oracle, _)) = slot else { continue };
            let which: Vec<usize> = (0..runnable.len()).filter(|&i| runnable[i].0 == j).collect();
            let these: Vec<Allocation> = which.iter().map(|&i| runnable[i].1[k]).collect();
            for (&i, t) in which.iter().zip(oracle.step_times(&these)?) {
                totals[i] += t * phase.steps as f64;
                times[i].push(t);
            }
        }
    }
    // A phase whose search missed a candidate another phase found faster here takes that one.
    for (k, plan) in plans.iter_mut().enumerate() {
        for ((j, a), t) in runnable.iter().zip(&times) {
            if t[k] < plan.step_s {
                (plan.allocation, plan.step_s, plan.roles) = (a[k], t[k], settings[*j]);
                plan.roles_description = describe(settings[*j]);
            }
        }
    }
    let best = (0..runnable.len()).filter(|&i| totals[i].is_finite()).min_by(|&i, &j| totals[i].total_cmp(&totals[j]));
    let replanned_s: f64 = plans.iter().map(|p| p.step_s * p.phase.steps as f64).sum();
    if let Some(i) = best {
        for (p, &s) in plans.iter_mut().zip(&times[i]) {
            p.single_step_s = Some(s);
        }
    }
    let switches =
        plans.windows(2).filter(|w| w[0].roles != w[1].roles || !same_split(w[0].allocation, w[1].allocation)).count();
    Ok(PhasedPlan {
        model: template.model.name.clone(),
        cluster: mixed.map_or_else(|| template.cluster.name.clone(), |m| m.name.clone()),
        replanned_s,
        single: best.map(|i| runnable[i].1[0]),
        single_roles: best.and_then(|i| settings[runnable[i].0]),
        single_roles_description: best.and_then(|i| describe(settings[runnable[i].0])),
        single_s: best.map(|i| totals[i]),
        gain: best.map(|i| totals[i] / replanned_s),
        switches,
        single_candidates: runnable.len(),
        phases: plans,
        solve_s: start.elapsed().as_secs_f64(),
    })
}

/// Whether two allocations place the same GPUs and NICs (their context-parallel sizes aside).
pub fn same_split(a: Allocation, b: Allocation) -> bool {
    Allocation { context_parallel: 1, ..a } == Allocation { context_parallel: 1, ..b }
}

/// `a`'s split as one of `problem`'s allocations: with the problem's context-parallel size for
/// it (the smallest when it offers several), if it fits there.
fn in_problem(problem: &AllocationProblem, a: Allocation) -> Option<Allocation> {
    let mut sizes: Vec<usize> = problem
        .attention
        .iter()
        .filter(|o| o.groups == a.groups && o.gpus == a.attention_gpus_per_group)
        .map(|o| o.context_parallel)
        .collect();
    sizes.sort_unstable();
    sizes.dedup();
    sizes.into_iter().map(|c| Allocation { context_parallel: c, ..a }).find(|c| problem.options_of(c).is_some())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hardware::Cluster;
    use crate::model_shape::ModelShape;

    fn template() -> CostModel {
        CostModel::new(
            ModelShape::preset("gpt-oss-20b").unwrap(),
            Cluster::preset("h100x2").unwrap(),
            Workload { seq: 4096, micro_batch: 8, global_batch: 128 },
        )
        .unwrap()
    }

    #[test]
    fn phases_keep_the_tokens_of_the_reference_shape_and_refuse_what_does_not_divide() {
        let keep = Workload { seq: 4096, micro_batch: 8, global_batch: 128 };
        let p = Phase::keeping_tokens(keep, &[(4096, 10), (16384, 5), (32768, 2)]).unwrap();
        assert_eq!(p[1].workload, Workload { seq: 16384, micro_batch: 2, global_batch: 32 });
        assert_eq!(p[2].workload, Workload { seq: 32768, micro_batch: 1, global_batch: 16 });
        let e = Phase::keeping_tokens(keep, &[(65536, 1)]).unwrap_err().to_string();
        assert!(e.contains("65536x1") && e.contains("32768 tokens per micro-batch"), "{e}");
        let e = Phase::keeping_tokens(keep, &[(4096, 0)]).unwrap_err().to_string();
        assert!(e.contains("at least 1 step"), "{e}");
        assert!(Phase::keeping_tokens(keep, &[]).is_err());
    }

    /// Each phase's plan is `plan`'s for that shape or faster; the single split is timed in every
    /// phase, is no better than re-planning in any phase, and one phase has nothing to re-plan.
    #[test]
    fn re_planning_is_compared_with_the_best_single_split() {
        let t = template();
        let phases = Phase::keeping_tokens(t.workload, &[(4096, 100), (16384, 20), (32768, 10)]).unwrap();
        let r = plan_phases(&t, &phases, 16).unwrap();
        assert_eq!(r.phases.len(), 3);
        for p in &r.phases {
            let mut c = t.clone();
            c.workload = p.phase.workload;
            let alone = crate::plan::plan(&c, false, 16).unwrap();
            assert!(p.step_s <= alone.predicted_step_s, "seq {}", p.phase.workload.seq);
            if p.step_s == alone.predicted_step_s {
                assert_eq!(alone.allocation, p.allocation, "seq {}", p.phase.workload.seq);
            }
        }
        let total: f64 = r.phases.iter().map(|p| p.step_s * p.phase.steps as f64).sum();
        assert!((r.replanned_s - total).abs() <= 1e-9 * total);
        let single = r.single_s.expect("a split fits every phase of a 20B model on 16 GPUs");
        let by_phase: f64 = r.phases.iter().map(|p| p.single_step_s.unwrap() * p.phase.steps as f64).sum();
        assert!((single - by_phase).abs() <= 1e-9 * single);
        // Every phase's plan is at least as fast as the single split there.
        assert!(r.phases.iter().all(|p| p.single_step_s.unwrap() >= p.step_s * (1.0 - 1e-12)));
        assert!(r.gain.unwrap() >= 1.0 - 1e-12);
        assert!(r.single_candidates >= 1);
        let one = plan_phases(&t, &phases[..1], 16).unwrap();
        assert_eq!(one.switches, 0);
        assert_eq!(one.single, Some(one.phases[0].allocation));
        assert!((one.gain.unwrap() - 1.0).abs() < 1e-12);
    }

    /// On a mixed cluster each phase plans every role assignment: its plan is `plan_mixed`'s
    /// choice for that shape (or faster), and the single split keeps its roles in every phase.
    #[test]
    fn on_a_mixed_cluster_each_phase_chooses_its_roles() {
        let mixed = MixedCluster::from_preset_or_file("h100x2+h20x2").unwrap();
        let mut t = CostModel::new(
            ModelShape::preset("qwen3-30b-a3b").unwrap(),
            mixed.slowest(),
            Workload { seq: 4096, micro_batch: 8, global_batch: 256 },
        )
        .unwrap();
        t.precision = crate::cost::Precision::megatron();
        let phases = Phase::keeping_tokens(t.workload, &[(4096, 50), (32768, 50)]).unwrap();
        let r = plan_phases_on(&t, Some(&mixed), &phases, 8).unwrap();
        assert_eq!(r.cluster, "h100x2+h20x2");
        for p in &r.phases {
            let mut c = t.clone();
            c.workload = p.phase.workload;
            let alone =
                crate::heterogeneous::plan_mixed(&c, &mixed, crate::heterogeneous::MixedScope::Compare, false, 8)
                    .unwrap();
            let (outcome, best) = alone.best();
            assert!(p.step_s <= best.predicted_step_s, "seq {}", p.phase.workload.seq);
            if p.step_s == best.predicted_step_s {
                assert_eq!(p.roles, Some(outcome.roles), "seq {}", p.phase.workload.seq);
            }
            assert!(p.roles_description.is_some());
        }
        if let (Some(roles), Some(gain)) = (r.single_roles, r.gain) {
            assert!(gain >= 1.0 - 1e-12);
            assert!(r.single_roles_description.is_some());
            let kept = r.phases.iter().all(|p| p.roles == Some(roles));
            assert!(kept || r.switches > 0);
        }
    }
}
