//! Local search over neighbouring allocations, driven by a step-time oracle.
//!
//! The roofline MILP misses costs such as pipeline fill and drain, blocking between streams and
//! latency; an oracle that knows them (the simulator, or measured step times) judges the MILP's
//! answer and its neighbours, and the search moves while a neighbour is faster.

use super::{Allocation, AllocationProblem};
use crate::error::Result;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// Something that can tell how long a training step takes with a given allocation.
pub trait StepTimeOracle {
    /// Step time in seconds.
    fn step_time(&mut self, allocation: &Allocation) -> Result<f64>;
    /// Step times of several allocations, in order. The default asks one at a time; an oracle
    /// that can judge allocations independently (the simulator) may answer them concurrently.
    fn step_times(&mut self, allocations: &[Allocation]) -> Result<Vec<f64>> {
        allocations.iter().map(|a| self.step_time(a)).collect()
    }
    /// Whether every step time this oracle reports is at least
    /// [`AllocationProblem::step_lower_bound`] (true of the simulator, which runs the modelled
    /// ops; not assumed of measurements). The search then skips allocations that cannot win.
    fn respects_lower_bound(&self) -> bool {
        false
    }
    /// Short name for reports (`simulator`, `measured`).
    fn name(&self) -> &str;
}

/// One allocation the search looked at.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    /// The allocation.
    pub allocation: Allocation,
    /// Bottleneck stage time per step under the roofline model, seconds.
    pub roofline_s: f64,
    /// Step time from the oracle, seconds.
    pub predicted_step_s: f64,
}

/// The result of a local search.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SearchResult {
    /// The best candidate.
    pub best: Candidate,
    /// Every candidate evaluated, in evaluation order.
    pub candidates: Vec<Candidate>,
}

/// Neighbours of an allocation: one step up or down in each option dimension (group size of
/// either side, NICs of either side, number of group pairs), moved GPUs between the sides, kept
/// only when feasible.
pub fn neighbours(problem: &AllocationProblem, alloc: &Allocation) -> Vec<Allocation> {
    let sizes = |opts: &[super::SideOption], p: usize| {
        let mut v: Vec<usize> = opts.iter().filter(|o| o.groups == p).map(|o| o.gpus).collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    let step = |v: &[usize], x: usize, d: i64| -> Option<usize> {
        let i = v.iter().position(|&y| y == x)? as i64 + d;
        v.get(usize::try_from(i).ok()?).copied()
    };
    let mut ps: Vec<usize> = problem.attention.iter().map(|o| o.groups).collect();
    ps.sort_unstable();
    ps.dedup();
    let mut out = Vec::new();
    let a_sizes = sizes(&problem.attention, alloc.groups);
    let f_sizes = sizes(&problem.ffn, alloc.groups);
    for d in [-1i64, 1] {
        let mut push = |n: Allocation| out.push(n);
        if let Some(a) = step(&a_sizes, alloc.attention_gpus_per_group, d) {
            push(Allocation { attention_gpus_per_group: a, ..*alloc });
            if let Some(f) = step(&f_sizes, alloc.ffn_gpus_per_group, -d) {
                push(Allocation { attention_gpus_per_group: a, ffn_gpus_per_group: f, ..*alloc });
            }
        }
        if let Some(f) = step(&f_sizes, alloc.ffn_gpus_per_group, d) {
            push(Allocation { ffn_gpus_per_group: f, ..*alloc });
        }
        if problem.uses_nics {
            let nics = |opts: &[super::SideOption], gpus: usize| {
                let mut v: Vec<usize> =
                    opts.iter().filter(|o| o.groups == alloc.groups && o.gpus == gpus).map(|o| o.nics).collect();
                v.sort_unstable();
                v.dedup();
                v
            };
            let an = nics(&problem.attention, alloc.attention_gpus_per_group);
            let fnics = nics(&problem.ffn, alloc.ffn_gpus_per_group);
            if let Some(n) = step(&an, alloc.attention_nics_per_group, d) {
                push(Allocation { attention_nics_per_group: n, ..*alloc });
                if let Some(m) = step(&fnics, alloc.ffn_nics_per_group, -d) {
                    push(Allocation { attention_nics_per_group: n, ffn_nics_per_group: m, ..*alloc });
                }
            }
            if let Some(n) = step(&fnics, alloc.ffn_nics_per_group, d) {
                push(Allocation { ffn_nics_per_group: n, ..*alloc });
            }
        }
        if let Some(p) = step(&ps, alloc.groups, d) {
            push(Allocation { groups: p, ..*alloc });
        }
    }
    // An attention group size has one context-parallel size ([`crate::cost::ContextParallel`]):
    // a neighbour of another size takes its own.
    for n in &mut out {
        if let Some(o) = problem.attention.iter().find(|o| o.groups == n.groups && o.gpus == n.attention_gpus_per_group)
        {
            n.context_parallel = o.context_parallel;
        }
    }
    out.retain(|n| problem.options_of(n).is_some());
    out.sort_by_key(|n| {
        (n.groups, n.attention_gpus_per_group, n.ffn_gpus_per_group, n.attention_nics_per_group, n.ffn_nics_per_group)
    });
    out.dedup();
    out
}

/// Hill-climbs from the best of `starts`: evaluates every start, then every neighbour of the
/// current best with the oracle, moves to the best neighbour while it is faster, and stops after
/// `max_evals` oracle calls or at a local optimum. `starts` must not be empty.
///
/// With an oracle that [respects the lower bound](StepTimeOracle::respects_lower_bound), a
/// neighbour whose [`AllocationProblem::step_lower_bound`] is not below the current best step
/// time cannot improve on it and is not evaluated (nor counted against the budget). The starts,
/// and then the neighbours of each step, go to the oracle as one batch
/// ([`StepTimeOracle::step_times`]).
pub fn local_search(
    problem: &AllocationProblem,
    starts: &[Allocation],
    oracle: &mut dyn StepTimeOracle,
    max_evals: usize,
) -> Result<SearchResult> {
    let mut seen: HashMap<Allocation, Candidate> = HashMap::new();
    let mut order: Vec<Candidate> = Vec::new();
    let prune = oracle.respects_lower_bound();
    // Asks the oracle, in one batch, for the allocations not seen yet whose lower bound is below
    // `bound` (the others cannot beat the incumbent), while the budget lasts.
    let mut evaluate = |allocs: &[Allocation], bound: f64, seen: &mut HashMap<Allocation, Candidate>| -> Result<()> {
        let mut todo: Vec<(Allocation, f64)> = Vec::new();
        for &alloc in allocs {
            if order.len() + todo.len() >= max_evals {
                break;
            }
            if seen.contains_key(&alloc) || todo.iter().any(|(t, _)| *t == alloc) {
                continue;
            }
            let (a, f) = problem.options_of(&alloc).expect("starts and neighbours are feasible");
            if !prune || problem.step_lower_bound(&a, &f) < bound {
                todo.push((alloc, problem.stage_times(&a, &f).bottleneck_s()));
            }
        }
        let allocations: Vec<Allocation> = todo.iter().map(|(a, _)| *a).collect();
        for ((allocation, roofline_s), predicted_step_s) in todo.into_iter().zip(oracle.step_times(&allocations)?) {
            let c = Candidate { allocation, roofline_s, predicted_step_s };
            seen.insert(allocation, c);
            order.push(c);
        }
        Ok(())
    };
    // The best of `allocs` that were evaluated and beat `incumbent` (first of equals).
    let best_of = |allocs: &[Allocation], incumbent: f64, seen: &HashMap<Allocation, Candidate>| {
        let mut best: Option<Candidate> = None;
        for c in allocs.iter().filter_map(|a| seen.get(a)) {
            if c.predicted_step_s < best.map_or(incumbent, |b| b.predicted_step_s) {
                best = Some(*c);
            }
        }
        best
    };
    evaluate(starts, f64::INFINITY, &mut seen)?;
    let mut best = best_of(starts, f64::INFINITY, &seen).expect("the first start is evaluated");
    loop {
        let around = neighbours(problem, &best.allocation);
        evaluate(&around, best.predicted_step_s, &mut seen)?;
        match best_of(&around, best.predicted_step_s, &seen) {
            Some(c) => best = c,
            None => break,
        }
    }
    Ok(SearchResult { best, candidates: order })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::{CostModel, Workload};
    use crate::hardware::Cluster;
    use crate::model_shape::ModelShape;

    /// An oracle that likes big attention groups and few NICs, and counts its calls.
    struct Likes {
        calls: usize,
    }
    impl StepTimeOracle for Likes {
        fn step_time(&mut self, a: &Allocation) -> Result<f64> {
            self.calls += 1;
            Ok(1.0 / a.attention_gpus() as f64 + 1e-3 * (a.attention_nics() + a.ffn_nics()) as f64)
        }
        fn name(&self) -> &str {
            "likes"
        }
    }

    fn problem() -> AllocationProblem {
        let w = Workload { seq: 4096, micro_batch: 4, global_batch: 64 };
        let cost = CostModel::new(ModelShape::preset("qwen3-30b-a3b").unwrap(), Cluster::preset("h100x4").unwrap(), w)
            .unwrap();
        AllocationProblem::new(&cost, None).unwrap()
    }

    #[test]
    fn hill_climbing_reaches_a_local_optimum_of_the_oracle_within_budget() {
        let problem = problem();
        let start = crate::allocator::milp::solve_milp(&problem).unwrap().allocation;
        let mut oracle = Likes { calls: 0 };
        let result = local_search(&problem, &[start], &mut oracle, 200).unwrap();
        assert_eq!(result.candidates[0].allocation, start);
        assert!(result.best.predicted_step_s <= result.candidates[0].predicted_step_s);
        for n in neighbours(&problem, &result.best.allocation) {
            assert!(oracle.step_time(&n).unwrap() >= result.best.predicted_step_s, "{n:?} beats the answer");
        }
        let mut tight = Likes { calls: 0 };
        let limited = local_search(&problem, &[start], &mut tight, 3).unwrap();
        assert!(tight.calls <= 3 && limited.candidates.len() <= 3, "{} calls", tight.calls);
    }

    #[test]
    fn simulated_step_times_respect_the_lower_bound_the_search_prunes_with() {
        let w = Workload { seq: 4096, micro_batch: 4, global_batch: 64 };
        let cost = CostModel::new(ModelShape::preset("qwen3-30b-a3b").unwrap(), Cluster::preset("h100x4").unwrap(), w)
            .unwrap();
        let problem = AllocationProblem::new(&cost, None).unwrap();
        let mut oracle = crate::allocator::oracle::SimulatorOracle::new(cost);
        assert!(oracle.respects_lower_bound());
        let pairs: Vec<_> = problem
            .attention
            .iter()
            .flat_map(|a| problem.ffn.iter().filter(|f| problem.compatible(a, f)).map(move |f| (*a, *f)))
            .step_by(5)
            .collect();
        assert!(pairs.len() >= 10, "{} pairs", pairs.len());
        for (a, f) in pairs {
            let step = oracle.step_time(&AllocationProblem::allocation(&a, &f)).unwrap();
            let bound = problem.step_lower_bound(&a, &f);
            assert!(step >= bound * (1.0 - 1e-9), "{a:?} {f:?}: simulated {step} below the bound {bound}");
        }
    }

    #[test]
    fn neighbours_are_feasible_and_differ_from_the_allocation() {
        let problem = problem();
        let start = crate::allocator::milp::solve_milp(&problem).unwrap().allocation;
        let ns = neighbours(&problem, &start);
        assert!(!ns.is_empty());
        assert!(ns.iter().all(|n| *n != start && problem.options_of(n).is_some()));
    }
}
