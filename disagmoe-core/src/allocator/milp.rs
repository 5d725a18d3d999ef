//! The allocation MILP (formulation and notation in `docs/allocator.md`).
//!
//! One binary `y_i` per attention option and `z_j` per expert option; continuous `T` (the slowest
//! stage, seconds) and `D` (gigabytes exchanged per step). Minimise `T` subject to
//! - one option per side, and both sides agreeing on the number of group pairs `p`;
//! - total GPUs: `sum_i y_i p_i a_i + sum_j z_j p_j f_j <= G`;
//! - NICs follow GPUs (node boundaries): `sum_i y_i (n_i - r a_i) + sum_j z_j (n_j - r f_j) <= 0`;
//! - (sides on two pools of a mixed cluster instead: each side's GPUs within its pool's `G_A`,
//!   `G_F`, and each side's NICs within its own GPUs' share, `r_A` and `r_F`);
//! - stage times: `T >= sum_i y_i busy_i`, `T >= sum_j z_j busy_j`, `T >= sum_j z_j D_j / bw_j`;
//! - the attention port carries the expert side's volume `D = sum_j z_j D_j`: for each distinct
//!   attention bandwidth `bw`, `T >= D / bw - (D_max / bw) (1 - sum_{i: bw_i = bw} y_i)` (big-M
//!   linearisation of the product of the two choices).
//!
//! - the objective is `T + 0.001 U` with `U >= busy` of both sides (ties between network-bound
//!   answers go to the one with the better-balanced compute).
//!
//! Memory never enters as a row: options that do not fit were dropped when the problem was built,
//! which is also where an infeasible request is diagnosed.

use super::{Allocation, AllocationProblem, TIE_BREAK};
use crate::error::{CoreError, Result};
use good_lp::{constraint, variable, variables, Expression, Solution, SolverModel, Variable};
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// The MILP's answer.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MilpSolution {
    /// The chosen allocation.
    pub allocation: Allocation,
    /// The slowest stage's busy time per step, seconds.
    pub bottleneck_s: f64,
    /// The objective (bottleneck plus the compute tie-break), seconds.
    pub objective_s: f64,
    /// Wall-clock solve time, seconds.
    pub solve_s: f64,
    /// Binary variables in the model.
    pub binaries: usize,
}

/// Solves the allocation MILP with microlp (or HiGHS with the `highs` feature).
///
/// The group-count dimension is decomposed: one MILP per candidate `p` (in increasing order),
/// each bounded above by the best objective found so far, so that later sub-problems that cannot
/// improve are proven infeasible quickly. The answer equals the monolithic MILP's.
pub fn solve_milp(problem: &AllocationProblem) -> Result<MilpSolution> {
    let mut ps: Vec<usize> = problem.attention.iter().map(|o| o.groups).collect();
    ps.sort_unstable();
    ps.dedup();
    solve_over(problem, &ps, Instant::now())
}

/// Relative margin within which a group count's best pair counts as tying the best overall.
const PRUNE_MARGIN: f64 = 1e-6;

/// [`solve_milp`] without the sub-MILPs that cannot hold its answer: the best pair of each group
/// count (`AllocationProblem::best_per_group_count`, exact, milliseconds) bounds what that
/// count's sub-MILP can reach, so only the counts whose best is within `PRUNE_MARGIN` of the best
/// overall are solved, in increasing order as [`solve_milp`] solves them. Same answer (the
/// first group count reaching the optimum); `binaries` counts the sub-MILPs solved. What `plan`
/// runs: at 1024 GPUs one sub-MILP of the 19 instead of all.
pub fn solve_milp_pruned(problem: &AllocationProblem) -> Result<MilpSolution> {
    let start = Instant::now();
    let per_count = problem.best_per_group_count();
    let Some(best) = per_count.iter().map(|(_, t)| *t).reduce(f64::min) else {
        return solve_milp(problem); // no compatible pair: the full MILP diagnoses it
    };
    let mut ps: Vec<usize> =
        per_count.iter().filter(|(_, t)| *t <= best * (1.0 + PRUNE_MARGIN)).map(|(a, _)| a.groups).collect();
    ps.sort_unstable();
    solve_over(problem, &ps, start)
}

fn solve_over(problem: &AllocationProblem, ps: &[usize], start: Instant) -> Result<MilpSolution> {
    let mut best: Option<(usize, usize, f64)> = None;
    let mut binaries = 0;
    for &p in ps {
        let a_idx: Vec<usize> = (0..problem.attention.len()).filter(|&i| problem.attention[i].groups == p).collect();
        let f_idx: Vec<usize> = (0..problem.ffn.len()).filter(|&j| problem.ffn[j].groups == p).collect();
        if a_idx.is_empty() || f_idx.is_empty() {
            continue;
        }
        binaries += a_idx.len() + f_idx.len();
        if let Some(found) = solve_sub(problem, &a_idx, &f_idx, best.map(|b| b.2))? {
            best = Some(found);
        }
    }
    let (i, j, _) = best.ok_or_else(|| CoreError::Infeasible {
        constraint: "total_gpus / nics_follow_gpus".into(),
        detail: "no pair of memory-feasible options fits the GPU and NIC totals together".into(),
    })?;
    let (a, f) = (&problem.attention[i], &problem.ffn[j]);
    Ok(MilpSolution {
        allocation: AllocationProblem::allocation(a, f),
        bottleneck_s: problem.stage_times(a, f).bottleneck_s(),
        objective_s: problem.stage_times(a, f).objective(),
        solve_s: start.elapsed().as_secs_f64(),
        binaries,
    })
}

/// One sub-MILP over the given options; `None` when infeasible or not better than `upper`.
fn solve_sub(
    problem: &AllocationProblem,
    a_idx: &[usize],
    f_idx: &[usize],
    upper: Option<f64>,
) -> Result<Option<(usize, usize, f64)>> {
    let mut vars = variables!();
    let t = vars.add(variable().min(0.0));
    let u = vars.add(variable().min(0.0));
    let d = vars.add(variable().min(0.0));
    let y: Vec<Variable> = a_idx.iter().map(|_| vars.add(variable().binary())).collect();
    let z: Vec<Variable> = f_idx.iter().map(|_| vars.add(variable().binary())).collect();
    let mb = problem.micro_batches;
    let gb = |bytes: f64| mb * bytes / 1e9;
    let ao = |k: usize| &problem.attention[a_idx[k]];
    let fo = |k: usize| &problem.ffn[f_idx[k]];
    let sum = |vs: &[Variable], coef: &dyn Fn(usize) -> f64| -> Expression {
        vs.iter().enumerate().map(|(i, v)| coef(i) * *v).sum()
    };

    let mut rows = vec![constraint!(sum(&y, &|_| 1.0) == 1.0), constraint!(sum(&z, &|_| 1.0) == 1.0)];
    let attention_gpus = sum(&y, &|i| (ao(i).groups * ao(i).gpus) as f64);
    let ffn_gpus = sum(&z, &|j| (fo(j).groups * fo(j).gpus) as f64);
    if let Some(apart) = problem.apart {
        // Each side within its own pool's GPUs, and its NICs within the GPUs' share of them.
        rows.push(constraint!(attention_gpus <= apart.attention_gpus as f64));
        rows.push(constraint!(ffn_gpus <= apart.ffn_gpus as f64));
        let [ra, rf] = problem.side_nics_per_gpu;
        rows.push(constraint!(sum(&y, &|i| ao(i).nics as f64 - ra * ao(i).gpus as f64) <= 1e-6));
        rows.push(constraint!(sum(&z, &|j| fo(j).nics as f64 - rf * fo(j).gpus as f64) <= 1e-6));
    } else {
        rows.push(constraint!(attention_gpus + ffn_gpus <= problem.total_gpus as f64));
    }
    if problem.uses_nics && problem.apart.is_none() {
        let r = problem.nics_per_gpu;
        let surplus = sum(&y, &|i| ao(i).nics as f64 - r * ao(i).gpus as f64)
            + sum(&z, &|j| fo(j).nics as f64 - r * fo(j).gpus as f64);
        rows.push(constraint!(surplus <= 1e-6));
    }
    rows.push(constraint!(u >= sum(&y, &|i| ao(i).busy_s)));
    rows.push(constraint!(u >= sum(&z, &|j| fo(j).busy_s)));
    rows.push(constraint!(t >= u));
    rows.push(constraint!(t >= sum(&z, &|j| gb(fo(j).exchange_bytes) / (fo(j).port_bw / 1e9))));
    rows.push(constraint!(d == sum(&z, &|j| gb(fo(j).exchange_bytes))));
    let d_max = (0..f_idx.len()).map(|j| gb(fo(j).exchange_bytes)).fold(0.0, f64::max);
    let mut bws: Vec<f64> = (0..a_idx.len()).map(|i| ao(i).port_bw).collect();
    bws.sort_by(f64::total_cmp);
    bws.dedup();
    for bw in bws {
        let bw_gb = bw / 1e9;
        let chosen = sum(&y, &|i| f64::from(ao(i).port_bw == bw));
        let big_m = d_max / bw_gb;
        rows.push(constraint!(t >= (1.0 / bw_gb) * d - big_m + big_m * chosen));
    }
    if let Some(upper) = upper {
        // Only strictly better answers are of interest.
        rows.push(constraint!(t + TIE_BREAK * u <= upper * (1.0 - 1e-9)));
    }

    #[cfg(feature = "highs")]
    let mut model = vars.minimise(t + TIE_BREAK * u).using(good_lp::highs);
    #[cfg(not(feature = "highs"))]
    let mut model = vars.minimise(t + TIE_BREAK * u).using(good_lp::microlp);
    for row in rows {
        model = model.with(row);
    }
    let solution = match model.solve() {
        Ok(s) => s,
        Err(good_lp::ResolutionError::Infeasible) => return Ok(None),
        Err(other) => return Err(CoreError::Solver(other.to_string())),
    };
    let pick = |vs: &[Variable]| vs.iter().position(|v| solution.value(*v) > 0.5);
    let (i, j) = pick(&y).zip(pick(&z)).ok_or_else(|| CoreError::Solver("solution selects no option".into()))?;
    let (i, j) = (a_idx[i], f_idx[j]);
    let exact = problem.stage_times(&problem.attention[i], &problem.ffn[j]).objective();
    Ok(Some((i, j, exact)))
}
