//! How the routed tokens of a layer spread over its experts, and how the experts are placed on the
//! expert workers that hold them: what decides the busiest expert worker, the stage AF-Pipe waits
//! for.
//!
//! - [`ExpertLoad`]: each expert's share of a layer's routed copies: uniform (the cost model's
//!   old assumption), Zipf with exponent `s`, or measured from a run's `metrics.jsonl`.
//! - [`ExpertMap`]: which workers hold a replica of which expert. `contiguous` is the runtime's
//!   split into contiguous ranges (`Layout::expert_range`); `balanced` is DeepSeek's EPLB: the
//!   `R` redundant slots go one at a time to the expert with the largest load per replica, then
//!   replicas are packed heaviest first onto the least loaded worker with a free slot that does not
//!   hold the expert yet, every worker getting the same number of slots (within one).
//! - A replicated expert's copies share its tokens evenly (the planner's assumption; the runtime's
//!   per-step assignment can only do better on a given micro-batch).

use std::collections::BTreeMap;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{CoreError, Result};

/// How a layer's routed copies spread over its experts.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum ExpertLoad {
    /// Every expert the same share.
    #[default]
    Uniform,
    /// Share of the expert of rank `r` (1 = hottest) proportional to `r^-s`; which expert holds
    /// which rank is a fixed pseudo-random permutation per layer (seeded by the layer index), so
    /// hot experts land anywhere, as trained routers put them.
    Zipf(f64),
    /// Shares measured per MoE layer (model layer index -> one share per expert, summing to 1).
    Measured(BTreeMap<usize, Vec<f64>>),
}

impl ExpertLoad {
    /// The accepted spellings, for error messages.
    pub const SPELLINGS: &'static str = "uniform, zipf:S with S > 0 (e.g. zipf:1.2), or a run's metrics.jsonl";

    /// The shares of `layer`'s `experts` experts (sum 1).
    pub fn shares(&self, layer: usize, experts: usize) -> Result<Vec<f64>> {
        let e = experts.max(1);
        match self {
            ExpertLoad::Uniform => Ok(vec![1.0 / e as f64; e]),
            ExpertLoad::Zipf(s) => {
                let weights: Vec<f64> = (1..=e).map(|r| (r as f64).powf(-s)).collect();
                let total: f64 = weights.iter().sum();
                let mut shares = vec![0.0; e];
                for (rank, expert) in permutation(e, layer as u64).into_iter().enumerate() {
                    shares[expert] = weights[rank] / total;
                }
                Ok(shares)
            }
            ExpertLoad::Measured(layers) => {
                let shares = layers.get(&layer).ok_or_else(|| CoreError::InvalidField {
                    field: "expert_load".into(),
                    value: format!("measured for layers {:?}", layers.keys().collect::<Vec<_>>()),
                    allowed: format!("a measurement of every MoE layer of the model (layer {layer} has none)"),
                })?;
                if shares.len() != experts {
                    return Err(CoreError::InvalidField {
                        field: "expert_load".into(),
                        value: format!("{} experts measured in layer {layer}", shares.len()),
                        allowed: format!("the model's {experts} experts per layer"),
                    });
                }
                Ok(shares.clone())
            }
        }
    }

    /// Its name in reports (`uniform`, `zipf:1.2`, `measured`).
    pub fn name(&self) -> String {
        match self {
            ExpertLoad::Uniform => "uniform".into(),
            ExpertLoad::Zipf(s) => format!("zipf:{s}"),
            ExpertLoad::Measured(_) => "measured".into(),
        }
    }

    /// A load for the command line: `uniform`, `zipf:S`, or the path of a run's `metrics.jsonl`.
    pub fn from_arg(spec: &str) -> Result<Self> {
        let path = std::path::Path::new(spec);
        if spec == "uniform" || spec.starts_with("zipf:") {
            return spec.parse();
        }
        if !path.exists() {
            return Err(CoreError::InvalidField {
                field: "expert_load".into(),
                value: format!("{spec} (no such file)"),
                allowed: Self::SPELLINGS.into(),
            });
        }
        let text = std::fs::read_to_string(path)
            .map_err(|source| crate::error::CoreError::Io { path: spec.to_string(), source })?;
        ExpertLoad::from_metrics_jsonl(&text)
    }

    /// The mean share of each expert over the steps of a run's `metrics.jsonl` (each step's
    /// `expert_load[].tokens_per_expert` normalised, then averaged; steps that routed no copy of a
    /// layer are left out of its mean).
    pub fn from_metrics_jsonl(text: &str) -> Result<Self> {
        let mut sums: BTreeMap<usize, (Vec<f64>, usize)> = BTreeMap::new();
        for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let record: MetricsLine = serde_json::from_str(line).map_err(|e| CoreError::InvalidField {
                field: "expert_load".into(),
                value: format!("line {} of the metrics file", i + 1),
                allowed: format!("one JSON object per line with `expert_load` (as `disagmoe train` writes): {e}"),
            })?;
            for layer in record.expert_load {
                let total: usize = layer.tokens_per_expert.iter().sum();
                if total == 0 {
                    continue;
                }
                let (sum, n) = sums.entry(layer.layer).or_insert_with(|| (vec![0.0; layer.tokens_per_expert.len()], 0));
                if sum.len() != layer.tokens_per_expert.len() {
                    return Err(CoreError::InvalidField {
                        field: "expert_load".into(),
                        value: format!(
                            "layer {} with {} and {} experts",
                            layer.layer,
                            sum.len(),
                            layer.tokens_per_expert.len()
                        ),
                        allowed: "the same number of experts in every step".into(),
                    });
                }
                for (s, &c) in sum.iter_mut().zip(&layer.tokens_per_expert) {
                    *s += c as f64 / total as f64;
                }
                *n += 1;
            }
        }
        if sums.is_empty() {
            return Err(CoreError::InvalidField {
                field: "expert_load".into(),
                value: "a metrics file without routed tokens".into(),
                allowed: "the metrics.jsonl of a run of an MoE model".into(),
            });
        }
        Ok(ExpertLoad::Measured(
            sums.into_iter().map(|(l, (sum, n))| (l, sum.into_iter().map(|s| s / n as f64).collect())).collect(),
        ))
    }
}

impl FromStr for ExpertLoad {
    type Err = CoreError;

    /// `uniform` or `zipf:S` (a metrics file is read by the caller: [`ExpertLoad::from_metrics_jsonl`]).
    fn from_str(s: &str) -> Result<Self> {
        let bad = || CoreError::InvalidField {
            field: "expert_load".into(),
            value: s.into(),
            allowed: Self::SPELLINGS.into(),
        };
        match s {
            "uniform" => Ok(ExpertLoad::Uniform),
            _ => {
                let exponent = s.strip_prefix("zipf:").ok_or_else(bad)?;
                let exponent: f64 = exponent.parse().map_err(|_| bad())?;
                if exponent.is_finite() && exponent > 0.0 {
                    Ok(ExpertLoad::Zipf(exponent))
                } else {
                    Err(bad())
                }
            }
        }
    }
}

#[derive(Deserialize)]
struct MetricsLine {
    #[serde(default)]
    expert_load: Vec<MetricsLayer>,
}

#[derive(Deserialize)]
struct MetricsLayer {
    layer: usize,
    tokens_per_expert: Vec<usize>,
}

/// Routing drawn from `shares`: for each of `tokens` tokens, `k` distinct experts, each drawn by
/// the shares of the experts not chosen yet (SplitMix64 seeded by `seed`), token-major. The shares
/// of the copies are flatter than `shares` where an expert's share exceeds `1 / k` (a token
/// chooses an expert at most once). For tests and benchmarks of placements and assignments.
pub fn sample_routing(shares: &[f64], k: usize, tokens: usize, seed: u64) -> Vec<usize> {
    let e = shares.len();
    let k = k.min(e);
    let mut state = seed;
    let mut uniform = || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut ids = Vec::with_capacity(tokens * k);
    let mut chosen = vec![false; e];
    for _ in 0..tokens {
        chosen.iter_mut().for_each(|c| *c = false);
        for _ in 0..k {
            let left: f64 = (0..e).filter(|&x| !chosen[x]).map(|x| shares[x]).sum();
            let mut u = uniform() * left;
            let pick = (0..e).filter(|&x| !chosen[x]).find(|&x| {
                u -= shares[x];
                u <= 0.0
            });
            // Rounding can leave `u` a hair above zero after the last expert: the last one left.
            let x = pick.or_else(|| (0..e).rev().find(|&x| !chosen[x])).expect("k <= E experts to choose from");
            chosen[x] = true;
            ids.push(x);
        }
    }
    ids
}

/// A fixed permutation of `0..n` (Fisher-Yates over SplitMix64 seeded by `seed`).
fn permutation(n: usize, seed: u64) -> Vec<usize> {
    let mut state = seed ^ 0x5EED_0F_E8E2_7A11;
    let mut next = || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut p: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        p.swap(i, j);
    }
    p
}

/// How experts are placed on a layer's expert workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExpertPlacement {
    /// Contiguous ranges, sizes within one (the runtime's split); no redundant experts.
    #[default]
    Contiguous,
    /// EPLB: redundant replicas of the heaviest experts, packed to even the workers' loads.
    Balanced,
}

impl ExpertPlacement {
    /// The names the command line accepts.
    pub const NAMES: [&'static str; 2] = ["contiguous", "balanced"];

    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            ExpertPlacement::Contiguous => "contiguous",
            ExpertPlacement::Balanced => "balanced",
        }
    }
}

impl FromStr for ExpertPlacement {
    type Err = CoreError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "contiguous" => Ok(ExpertPlacement::Contiguous),
            "balanced" => Ok(ExpertPlacement::Balanced),
            _ => Err(CoreError::InvalidField {
                field: "expert_placement".into(),
                value: s.into(),
                allowed: format!("one of {}", Self::NAMES.join(", ")),
            }),
        }
    }
}

/// Which expert workers hold which experts of one layer.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertMap {
    /// For each worker, the experts it holds a replica of (ascending).
    pub slots: Vec<Vec<usize>>,
    /// For each expert, how many workers hold it.
    pub replicas: Vec<usize>,
}

impl ExpertMap {
    /// Contiguous ranges over `workers` (`Layout::expert_range`'s split: worker `w` holds
    /// `w E / n .. (w + 1) E / n`).
    pub fn contiguous(experts: usize, workers: usize) -> Self {
        let n = workers.max(1);
        let slots = (0..n).map(|w| (w * experts / n..(w + 1) * experts / n).collect()).collect();
        ExpertMap { slots, replicas: vec![1; experts] }
    }

    /// EPLB's placement of `shares.len()` experts and `redundant` extra replicas on `workers`
    /// workers (see the module doc). Refused when `redundant` exceeds one replica of every expert
    /// per worker (`E (f - 1)`).
    pub fn balanced(shares: &[f64], workers: usize, redundant: usize) -> Result<Self> {
        let (e, n) = (shares.len(), workers.max(1));
        if redundant > e.saturating_mul(n - 1) {
            return Err(CoreError::InvalidField {
                field: "redundant_experts".into(),
                value: redundant.to_string(),
                allowed: format!(
                    "at most {} with {e} experts on {n} worker{} (one replica of each per worker)",
                    e * (n - 1),
                    if n == 1 { "" } else { "s" }
                ),
            });
        }
        let slots_total = e + redundant;
        // 1. Replicate: each redundant slot to the expert with the most load per replica.
        let mut replicas = vec![1usize; e];
        for _ in 0..redundant {
            let best = (0..e)
                .filter(|&x| replicas[x] < n)
                .max_by(|&a, &b| {
                    let (la, lb) = (shares[a] / replicas[a] as f64, shares[b] / replicas[b] as f64);
                    la.total_cmp(&lb).then(b.cmp(&a))
                })
                .expect("fewer than E (n - 1) redundant slots leave an expert with room");
            replicas[best] += 1;
        }
        // 2. Pack: heaviest replica first onto the least loaded worker with a free slot that does
        // not hold its expert; capacities as even as the slot count allows.
        let mut items: Vec<(f64, usize)> =
            (0..e).flat_map(|x| std::iter::repeat_n((shares[x] / replicas[x] as f64, x), replicas[x])).collect();
        items.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let capacity: Vec<usize> = (0..n).map(|w| slots_total / n + usize::from(w < slots_total % n)).collect();
        let mut slots: Vec<Vec<usize>> = vec![Vec::new(); n];
        let mut load = vec![0.0f64; n];
        let least = |slots: &[Vec<usize>], load: &[f64], x: usize, distinct: bool| {
            (0..n)
                .filter(|&w| slots[w].len() < capacity[w] && !(distinct && slots[w].contains(&x)))
                .min_by(|&a, &b| load[a].total_cmp(&load[b]).then(a.cmp(&b)))
        };
        for (weight, x) in items {
            // The free slots left can all sit on workers that hold `x` already (rare: light experts
            // are packed last and have one replica); two replicas on one worker then act as one
            // with both shares, which `worker_loads` counts right.
            let w = least(&slots, &load, x, true)
                .or_else(|| least(&slots, &load, x, false))
                .expect("capacities add up to the replicas");
            slots[w].push(x);
            load[w] += weight;
        }
        for s in &mut slots {
            s.sort_unstable();
        }
        Ok(ExpertMap { slots, replicas })
    }

    /// This placement with its workers' slot lists relabelled so that as many experts as any
    /// relabelling allows stay on the worker that held them in `previous` (a placement of the
    /// same workers): the experts a re-placement has to move. The workers are interchangeable
    /// bins of EPLB's packing, so every worker's load and slot count are a permutation of this
    /// placement's: the balance is the same. Solved exactly as the assignment problem's linear
    /// program (its constraint matrix is totally unimodular, so the optimum is a permutation);
    /// deterministic for the same inputs. `previous` of another worker count is ignored.
    pub fn keeping(self, previous: &ExpertMap) -> Result<Self> {
        use good_lp::{variable, variables, Expression, Solution, SolverModel};
        let n = self.slots.len();
        if previous.slots.len() != n || n <= 1 {
            return Ok(self);
        }
        let distinct = |s: &[usize]| {
            let mut v = s.to_vec();
            v.dedup();
            v
        };
        let (old, new): (Vec<Vec<usize>>, Vec<Vec<usize>>) =
            (previous.slots.iter().map(|s| distinct(s)).collect(), self.slots.iter().map(|s| distinct(s)).collect());
        let kept = |i: usize, j: usize| new[j].iter().filter(|e| old[i].contains(e)).count() as f64;
        let mut vars = variables!();
        let x: Vec<Vec<good_lp::Variable>> =
            (0..n).map(|_| (0..n).map(|_| vars.add(variable().min(0.0).max(1.0))).collect()).collect();
        let objective: Expression =
            (0..n).flat_map(|i| (0..n).map(move |j| (i, j))).map(|(i, j)| kept(i, j) * x[i][j]).sum();
        let mut model = vars.maximise(objective).using(good_lp::microlp);
        for i in 0..n {
            model = model.with(x[i].iter().copied().sum::<Expression>().eq(1.0));
            model = model.with((0..n).map(|j| x[j][i]).sum::<Expression>().eq(1.0));
        }
        let solution = model.solve().map_err(|e| CoreError::Solver(format!("keeping experts in place: {e}")))?;
        // Worker i takes the new slot list j it is assigned.
        let picks: Vec<Option<usize>> = x.iter().map(|row| row.iter().position(|v| solution.value(*v) > 0.5)).collect();
        let mut seen = vec![false; n];
        let mut slots = Vec::with_capacity(n);
        for j in picks {
            match j {
                Some(j) if !seen[j] => {
                    seen[j] = true;
                    slots.push(self.slots[j].clone());
                }
                _ => {
                    return Err(CoreError::Solver("keeping experts in place: the solution is not a permutation".into()))
                }
            }
        }
        Ok(ExpertMap { slots, replicas: self.replicas })
    }

    /// Each worker's share of the layer's routed copies (a replica takes an even part of its
    /// expert's share).
    pub fn worker_loads(&self, shares: &[f64]) -> Vec<f64> {
        self.slots.iter().map(|s| s.iter().map(|&x| shares[x] / self.replicas[x] as f64).sum()).collect()
    }
}

/// The routed experts `held` (global ids, any order, repeats ignored) as ascending contiguous runs,
/// the experts for which `alone` holds each in a run of its own.
pub fn expert_runs(held: &[usize], alone: impl Fn(usize) -> bool) -> Vec<std::ops::Range<usize>> {
    let mut ids = held.to_vec();
    ids.sort_unstable();
    ids.dedup();
    let mut runs: Vec<std::ops::Range<usize>> = Vec::new();
    for e in ids {
        match runs.last_mut() {
            Some(r) if r.end == e && !alone(e) && !alone(r.start) => r.end = e + 1,
            _ => runs.push(e..e + 1),
        }
    }
    runs
}

/// The expert side of a plan: the load, the placement policy and the redundant replicas per layer.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ExpertBalance {
    /// How routed copies spread over experts.
    pub load: ExpertLoad,
    /// How experts are placed.
    pub placement: ExpertPlacement,
    /// Extra replicas per MoE layer (with `balanced`).
    pub redundant: usize,
}

/// The busiest worker of a layer's expert group.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Busiest {
    /// Its share of the layer's routed copies.
    pub share: f64,
    /// The experts it holds a replica of.
    pub experts: usize,
}

impl ExpertBalance {
    /// Checks the combination (`redundant` needs `balanced`).
    pub fn validate(&self) -> Result<()> {
        if self.redundant > 0 && self.placement == ExpertPlacement::Contiguous {
            return Err(CoreError::InvalidField {
                field: "redundant_experts".into(),
                value: self.redundant.to_string(),
                allowed: "0 with the contiguous expert placement (redundant replicas need `balanced`)".into(),
            });
        }
        Ok(())
    }

    /// The busiest of `workers` workers holding `layer`'s `experts` experts (uniform load and the
    /// contiguous split: `ceil(E / f) / E` of the copies on `ceil(E / f)` experts, in closed form).
    /// Redundant replicas are capped as in [`Self::slots`].
    pub fn busiest(&self, layer: usize, experts: usize, workers: usize) -> Result<Busiest> {
        let n = workers.max(1);
        if self.load == ExpertLoad::Uniform && self.placement == ExpertPlacement::Contiguous {
            let local = experts.div_ceil(n);
            return Ok(Busiest { share: local as f64 / experts.max(1) as f64, experts: local });
        }
        let shares = self.load.shares(layer, experts)?;
        let map = match self.placement {
            ExpertPlacement::Contiguous => ExpertMap::contiguous(experts, n),
            ExpertPlacement::Balanced => ExpertMap::balanced(&shares, n, self.slots(experts, n) - experts)?,
        };
        let loads = map.worker_loads(&shares);
        let w = (0..n).max_by(|&a, &b| loads[a].total_cmp(&loads[b]).then(b.cmp(&a))).unwrap_or(0);
        Ok(Busiest { share: loads[w], experts: map.slots[w].len() })
    }

    /// Expert replicas of a layer over all `workers` workers: `E + R`, `R` capped at one replica of
    /// each expert per worker (beyond that replicas buy nothing; one worker: none at all).
    pub fn slots(&self, experts: usize, workers: usize) -> usize {
        experts + self.redundant.min(experts * (workers.max(1) - 1))
    }

    /// The busiest worker's share over the mean share (1.0: perfectly even).
    pub fn imbalance(&self, layer: usize, experts: usize, workers: usize) -> Result<f64> {
        let n = workers.max(1).min(self.slots(experts, workers).max(1));
        Ok(self.busiest(layer, experts, workers)?.share * n as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Experts `next` places on a worker that did not hold them in `prev`.
    fn moved(prev: &ExpertMap, next: &ExpertMap) -> usize {
        prev.slots.iter().zip(&next.slots).map(|(a, b)| b.iter().filter(|e| !a.contains(e)).count()).sum()
    }

    #[test]
    fn keeping_relabels_the_workers_to_move_the_fewest_experts_and_keeps_the_balance() {
        let shares = ExpertLoad::Zipf(1.2).shares(0, 16).unwrap();
        let placed = ExpertMap::balanced(&shares, 4, 2).unwrap();
        // The same placement with its workers listed in another order moves nothing once kept.
        let mut shuffled = placed.clone();
        shuffled.slots.rotate_left(1);
        assert!(moved(&placed, &shuffled) > 0);
        assert_eq!(shuffled.clone().keeping(&placed).unwrap(), placed);
        // For another load: the fewest moves over every relabelling (4! of them), the same loads.
        let other = ExpertMap::balanced(&ExpertLoad::Zipf(0.8).shares(1, 16).unwrap(), 4, 2).unwrap();
        let kept = other.clone().keeping(&placed).unwrap();
        let mut fewest = usize::MAX;
        let mut perm = [0, 1, 2, 3];
        loop {
            let relabelled =
                ExpertMap { slots: perm.iter().map(|&j| other.slots[j].clone()).collect(), ..other.clone() };
            fewest = fewest.min(moved(&placed, &relabelled));
            // The next permutation in lexicographic order.
            let Some(i) = (0..3).rev().find(|&i| perm[i] < perm[i + 1]) else { break };
            let j = (i + 1..4).rev().find(|&j| perm[j] > perm[i]).unwrap();
            perm.swap(i, j);
            perm[i + 1..].reverse();
        }
        assert_eq!(moved(&placed, &kept), fewest);
        let mut a = kept.worker_loads(&shares);
        let mut b = other.worker_loads(&shares);
        a.sort_by(f64::total_cmp);
        b.sort_by(f64::total_cmp);
        assert_eq!(a, b);
        assert_eq!(kept.replicas, other.replicas);
    }

    #[test]
    fn zipf_shares_sum_to_one_and_follow_the_exponent() {
        let s = ExpertLoad::Zipf(1.2).shares(3, 16).unwrap();
        assert!((s.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        let mut sorted = s.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        assert!((sorted[0] / sorted[1] - 2f64.powf(1.2)).abs() < 1e-9);
        // Another layer, another permutation; the same layer, the same one.
        assert_ne!(s, ExpertLoad::Zipf(1.2).shares(4, 16).unwrap());
        assert_eq!(s, ExpertLoad::Zipf(1.2).shares(3, 16).unwrap());
    }

    #[test]
    fn spellings_parse_and_bad_ones_name_the_allowed_values() {
        assert_eq!("uniform".parse::<ExpertLoad>().unwrap(), ExpertLoad::Uniform);
        assert_eq!("zipf:1.2".parse::<ExpertLoad>().unwrap(), ExpertLoad::Zipf(1.2));
        for bad in ["zipf", "zipf:0", "zipf:-1", "zipf:nan", "skewed"] {
            let e = bad.parse::<ExpertLoad>().unwrap_err().to_string();
            assert!(e.contains("zipf:S") && e.contains(bad), "{e}");
        }
        assert!("random".parse::<ExpertPlacement>().unwrap_err().to_string().contains("contiguous, balanced"));
    }

    #[test]
    fn runs_are_contiguous_and_isolate_the_replicated_experts() {
        assert_eq!(expert_runs(&[5, 0, 1, 2, 4, 1], |_| false), vec![0..3, 4..6]);
        assert_eq!(expert_runs(&[0, 1, 2, 4, 5], |e| e == 1), vec![0..1, 1..2, 2..3, 4..6]);
        assert!(expert_runs(&[], |_| true).is_empty());
    }

    #[test]
    fn contiguous_is_the_runtime_split() {
        let m = ExpertMap::contiguous(10, 4);
        assert_eq!(m.slots, vec![vec![0, 1], vec![2, 3, 4], vec![5, 6], vec![7, 8, 9]]);
        let b = ExpertBalance::default().busiest(0, 10, 4).unwrap();
        assert_eq!((b.share, b.experts), (0.3, 3));
    }

    #[test]
    fn balanced_placement_replicates_the_hot_experts_and_evens_the_workers() {
        // One very hot expert: without replicas its worker carries half the layer.
        let mut shares = vec![0.5];
        shares.extend(std::iter::repeat_n(0.5 / 7.0, 7));
        let plain = ExpertMap::contiguous(8, 4).worker_loads(&shares);
        assert!((plain.iter().cloned().fold(0.0, f64::max) - (0.5 + 0.5 / 7.0)).abs() < 1e-12);
        let m = ExpertMap::balanced(&shares, 4, 4).unwrap();
        assert_eq!(m.slots.iter().map(Vec::len).collect::<Vec<_>>(), vec![3; 4]);
        assert!(m.replicas[0] >= 3, "{:?}", m.replicas);
        for s in &m.slots {
            let mut d = s.clone();
            d.dedup();
            assert_eq!(&d, s, "an expert twice on one worker");
        }
        let loads = m.worker_loads(&shares);
        assert!((loads.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        let max = loads.iter().cloned().fold(0.0, f64::max);
        assert!(max < 0.30, "{loads:?}");
        // Every expert placed as many times as it has replicas.
        for x in 0..8 {
            assert_eq!(m.slots.iter().filter(|s| s.contains(&x)).count(), m.replicas[x]);
        }
    }

    #[test]
    fn zipf_loads_even_out_with_two_redundant_experts_per_layer() {
        let balance =
            |r| ExpertBalance { load: ExpertLoad::Zipf(1.2), placement: ExpertPlacement::Balanced, redundant: r };
        let contiguous = ExpertBalance { load: ExpertLoad::Zipf(1.2), ..Default::default() };
        for layer in 0..4 {
            let before = contiguous.imbalance(layer, 16, 4).unwrap();
            let after = balance(2).imbalance(layer, 16, 4).unwrap();
            assert!(after < before && after <= 1.10 + 1e-9, "layer {layer}: {before} -> {after}");
        }
    }

    #[test]
    fn impossible_requests_are_refused_by_name() {
        let e = ExpertMap::balanced(&[0.25; 4], 2, 5).unwrap_err().to_string();
        assert!(e.contains("redundant_experts") && e.contains("at most 4"), "{e}");
        let e = ExpertBalance { redundant: 2, ..Default::default() }.validate().unwrap_err().to_string();
        assert!(e.contains("balanced"), "{e}");
    }

    #[test]
    fn measured_loads_average_the_steps_of_a_metrics_file() {
        let text = r#"{"step":1,"expert_load":[{"layer":1,"tokens_per_expert":[3,1,0,0]}]}
{"step":2,"expert_load":[{"layer":1,"tokens_per_expert":[1,1,1,1]}]}
"#;
        let load = ExpertLoad::from_metrics_jsonl(text).unwrap();
        let s = load.shares(1, 4).unwrap();
        assert_eq!(s, vec![0.5, 0.25, 0.125, 0.125]);
        assert!(load.shares(0, 4).unwrap_err().to_string().contains("layer 0 has none"));
        assert!(load.shares(1, 8).unwrap_err().to_string().contains("8 experts"));
        assert!(ExpertLoad::from_metrics_jsonl("not json").is_err());
    }
}
