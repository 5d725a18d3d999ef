//! Adaptive allocation: how many GPUs and NICs each attention group and each expert group gets,
//! and how many group pairs there are.
//!
//! The search has three steps, each in its own module:
//! 1. [`AllocationProblem::new`] turns the cost model into a finite list of *options* per side:
//!    `(groups p, GPUs per group, NICs per group)` with the side's busy time per step, its memory
//!    footprint (options that do not fit are dropped, and remembered for the error message) and
//!    the bytes it exchanges.
//! 2. [`milp::solve_milp`] picks one option per side with a mixed-integer linear program that
//!    minimises the slowest pipeline stage subject to the GPU, NIC and node constraints
//!    (formulation in `docs/allocator.md`); [`AllocationProblem::enumerate`] is the exhaustive
//!    reference it is tested against.
//! 3. [`search::local_search`] refines the MILP's answer over neighbouring allocations with a
//!    [`search::StepTimeOracle`] (the simulator now, measured step times later).

pub mod milp;
pub mod oracle;
pub mod search;

use crate::cost::{Apart, ContextParallel, CostModel, Sides};
use crate::error::{CoreError, Result};
use serde::{Deserialize, Serialize};

/// A disaggregated placement: `groups` pairs of (attention group, expert group); pair `g` holds
/// layers `g, g + groups, g + 2 groups, ...`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Allocation {
    /// Number of group pairs `p`.
    pub groups: usize,
    /// GPUs of one attention group `a`.
    pub attention_gpus_per_group: usize,
    /// GPUs of one expert group `f`.
    pub ffn_gpus_per_group: usize,
    /// NICs of one attention group.
    pub attention_nics_per_group: usize,
    /// NICs of one expert group.
    pub ffn_nics_per_group: usize,
    /// GPUs of an attention group that split each sequence (context parallelism; 1: none).
    #[serde(default = "one")]
    pub context_parallel: usize,
}

/// Serde's default of a context-parallel size: none.
pub(crate) fn one() -> usize {
    1
}

impl Allocation {
    /// Attention GPUs over all groups.
    pub fn attention_gpus(&self) -> usize {
        self.groups * self.attention_gpus_per_group
    }
    /// Expert GPUs over all groups.
    pub fn ffn_gpus(&self) -> usize {
        self.groups * self.ffn_gpus_per_group
    }
    /// Attention NICs over all groups.
    pub fn attention_nics(&self) -> usize {
        self.groups * self.attention_nics_per_group
    }
    /// Expert NICs over all groups.
    pub fn ffn_nics(&self) -> usize {
        self.groups * self.ffn_nics_per_group
    }
    /// Fraction of the used GPUs that run attention.
    pub fn attention_share(&self) -> f64 {
        self.attention_gpus() as f64 / (self.attention_gpus() + self.ffn_gpus()) as f64
    }
}

/// One choice for one side.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SideOption {
    /// Number of group pairs.
    pub groups: usize,
    /// GPUs per group.
    pub gpus: usize,
    /// NICs per group.
    pub nics: usize,
    /// GPUs of a group that split each sequence (attention options; 1 for expert options).
    #[serde(default = "one")]
    pub context_parallel: usize,
    /// Compute busy time of the busiest group per step (forward + backward of every micro-batch
    /// on its layers, plus the attention side's gradient all-reduce), seconds.
    pub busy_s: f64,
    /// Port bandwidth of the group, bytes/s.
    pub port_bw: f64,
    /// Bytes the busiest group exchanges per micro-batch, both directions of forward and backward
    /// (expert options only; it depends on the expert group size through the fan-out).
    pub exchange_bytes: f64,
    /// The same averaged over the groups (expert options only): the attention port of some group
    /// carries at least this much, whatever the ring's layer order.
    pub mean_exchange_bytes: f64,
    /// Peak memory per GPU, bytes.
    pub memory: f64,
}

/// The finite allocation problem derived from a cost model.
#[derive(Debug, Clone)]
pub struct AllocationProblem {
    /// Options for the attention side.
    pub attention: Vec<SideOption>,
    /// Options for the expert side.
    pub ffn: Vec<SideOption>,
    /// GPUs in the cluster.
    pub total_gpus: usize,
    /// NICs per GPU (the "NICs follow GPUs" ratio of a group pair).
    pub nics_per_gpu: f64,
    /// Whether NICs are a resource at all (false on a one-node cluster: everything is NVLink).
    pub uses_nics: bool,
    /// Micro-batches per step.
    pub micro_batches: f64,
    /// Set when the two sides are on different pools: each side within its own pool's GPUs and
    /// NICs.
    pub apart: Option<Apart>,
    /// NICs per GPU of the attention side's pool and of the expert side's (both
    /// `nics_per_gpu` on one pool).
    pub side_nics_per_gpu: [f64; 2],
    /// Smallest memory overshoot seen among dropped options, per side (for error messages).
    shortfall: [Option<Shortfall>; 2],
}

/// The smaller of two footprints (without and with recomputation).
fn smaller([a, b]: [crate::cost::MemoryParts; 2]) -> crate::cost::MemoryParts {
    if b.total() < a.total() {
        b
    } else {
        a
    }
}

/// The smallest footprint of one side that did not fit.
#[derive(Debug, Clone, Copy)]
struct Shortfall {
    need: crate::cost::MemoryParts,
    usable: f64,
    groups: usize,
    gpus: usize,
}

/// The value of one allocation under the roofline model.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StageTimes {
    /// Attention compute per step (busiest group).
    pub attention_s: f64,
    /// Expert compute per step (busiest group).
    pub ffn_s: f64,
    /// Attention port busy time per step.
    pub attention_comm_s: f64,
    /// Expert port busy time per step.
    pub ffn_comm_s: f64,
}

impl StageTimes {
    /// The slowest stage.
    pub fn bottleneck_s(&self) -> f64 {
        self.attention_s.max(self.ffn_s).max(self.attention_comm_s).max(self.ffn_comm_s)
    }

    /// The MILP's objective: the slowest stage, ties broken towards the smaller compute
    /// bottleneck (so that a network-bound job still balances attention against experts).
    pub fn objective(&self) -> f64 {
        self.bottleneck_s() + TIE_BREAK * self.attention_s.max(self.ffn_s)
    }
}

/// Weight of the compute bottleneck in the objective, small enough never to trade stage time.
pub const TIE_BREAK: f64 = 1e-3;

/// Group sizes that respect node boundaries: divisors of the node size (several groups share a
/// node, packing exactly) or whole multiples of it.
pub fn group_sizes(gpus_per_node: usize, max: usize) -> Vec<usize> {
    let mut s: Vec<usize> = (1..gpus_per_node).filter(|d| gpus_per_node.is_multiple_of(*d) && *d <= max).collect();
    s.extend((1..).map(|m| m * gpus_per_node).take_while(|&x| x <= max));
    s
}

/// Group-pair counts tried: for each distinct number of layers per group, the smallest `p`
/// giving it (a larger `p` with the same layers per group only spreads the same work thinner).
pub fn group_counts(layers: usize, max: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut last = usize::MAX;
    for p in 1..=layers.min(max) {
        let per = layers.div_ceil(p);
        if per != last {
            out.push(p);
            last = per;
        }
    }
    out
}

impl AllocationProblem {
    /// Builds the option lists. `max_groups` caps `p` (default: the layer count).
    pub fn new(cost: &CostModel, max_groups: Option<usize>) -> Result<Self> {
        Self::new_on(Sides::one(cost), max_groups)
    }

    /// The option lists with each side on its own hardware: attention options costed on
    /// `sides.attention`'s pool and sized by its nodes, expert options on `sides.ffn`'s; across
    /// pools ([`Apart`]) a side's groups fit in its own pool's GPUs and NICs.
    pub fn new_on(sides: Sides<'_>, max_groups: Option<usize>) -> Result<Self> {
        let cost = sides.attention;
        let fc = sides.ffn;
        let c = &cost.cluster;
        let m = &cost.model;
        let mb = cost.workload.micro_batches() as f64;
        let (g_total, uses_nics, max_p) = match sides.apart {
            None => (c.total_gpus(), c.nodes > 1, c.total_gpus() / 2),
            Some(ap) => (ap.attention_gpus + ap.ffn_gpus, true, ap.attention_gpus.min(ap.ffn_gpus)),
        };
        // The largest group of each side for `p` pairs: on one pool, what the other side leaves
        // (at least one GPU); across pools, the side's own pool.
        let side_max = |attention: bool, p: usize| match sides.apart {
            None => (g_total / p).saturating_sub(1),
            Some(ap) => (if attention { ap.attention_gpus } else { ap.ffn_gpus }) / p,
        };
        let usable = c.gpu.usable_memory();
        let ffn_usable = fc.cluster.gpu.usable_memory();
        let node = c.node.gpus_per_node;
        let ffn_node = fc.cluster.node.gpus_per_node;
        let mut shortfall: [Option<Shortfall>; 2] = [None, None];
        let mut note = |side: usize, need: crate::cost::MemoryParts, groups: usize, gpus: usize| {
            let s = &mut shortfall[side];
            if s.is_none_or(|best| need.total() < best.need.total()) {
                let usable = if side == 0 { usable } else { ffn_usable };
                *s = Some(Shortfall { need, usable, groups, gpus });
            }
        };
        let (mut attention, mut ffn) = (Vec::new(), Vec::new());
        let side_nics_per_gpu = [c.nics_per_gpu(), fc.cluster.nics_per_gpu()];
        for p in group_counts(m.layers, max_groups.unwrap_or(m.layers).min(max_p)) {
            let in_flight = cost.workload.micro_batches().min(4 * p);
            let groups: Vec<Vec<usize>> = (0..p).map(|g| (g..m.layers).step_by(p).collect()).collect();
            let nic_choices = |gpus: usize, side: usize| -> Vec<usize> {
                if !uses_nics {
                    return vec![0];
                }
                // NICs per GPU from 1/4 to 2 in steps of 1/4: a group that spreads over nodes it
                // shares with the other side may borrow their NICs (PXN); the pair as a whole
                // never holds more NICs than its GPUs bring (constraint `nics_follow_gpus`).
                // Across pools there is no one to borrow from: up to the side's own NICs.
                let most = if sides.apart.is_some() { 4 } else { 8 };
                let mut v: Vec<usize> = (1..=most)
                    .map(|q| ((gpus as f64 * side_nics_per_gpu[side] * q as f64 / 4.0).round() as usize).max(1))
                    .collect();
                v.dedup();
                v
            };
            for a in group_sizes(node, side_max(true, p)) {
                let Some(cp) = cost.context_parallel.size_for(a, &cost.workload) else {
                    continue;
                };
                let need = smaller([false, true].map(|rc| cost.attention_memory_parts(p, a, cp, in_flight, rc)));
                let mem = need.total();
                if mem > usable {
                    note(0, need, p, a);
                    continue;
                }
                let compute: f64 = groups
                    .iter()
                    .enumerate()
                    .map(|(g, ls)| {
                        let layers: f64 = ls
                            .iter()
                            .map(|&l| {
                                let (fwd, bwd) = cost.attention_layer_s(l, a, cp, false);
                                fwd + bwd
                            })
                            .sum();
                        let head = if g == m.layers % p {
                            let w = cost.head_forward(a, cp);
                            cost.gpu_time(w) + cost.gpu_time(w.backward())
                        } else {
                            0.0
                        };
                        layers + head
                    })
                    .fold(0.0, f64::max);
                for nics in nic_choices(a, 0) {
                    let ar = cost.all_reduce_time(cost.attention_grad_bytes(p), a, nics);
                    attention.push(SideOption {
                        groups: p,
                        gpus: a,
                        nics,
                        context_parallel: cp,
                        busy_s: mb * compute + ar,
                        port_bw: sides.port_bandwidth(true, a, nics, p),
                        exchange_bytes: 0.0,
                        mean_exchange_bytes: 0.0,
                        memory: mem,
                    });
                }
            }
            for f in group_sizes(ffn_node, side_max(false, p)) {
                if f > m.moe.experts {
                    continue;
                }
                let need = smaller([false, true].map(|rc| fc.ffn_memory_parts(p, f, in_flight, rc)));
                let mem = need.total();
                if mem > ffn_usable {
                    note(1, need, p, f);
                    continue;
                }
                let compute = groups
                    .iter()
                    .map(|ls| {
                        ls.iter()
                            .map(|&l| {
                                let w = fc.ffn_forward(l, f);
                                fc.gpu_time(w) + fc.gpu_time(w.backward())
                            })
                            .sum::<f64>()
                    })
                    .fold(0.0, f64::max);
                let per_group: Vec<f64> = groups
                    .iter()
                    .map(|ls| ls.iter().map(|&l| fc.m2n_bytes(l, f) + fc.n2m_bytes(l, f)).sum::<f64>())
                    .collect();
                let bytes = per_group.iter().copied().fold(0.0, f64::max);
                let mean_bytes = per_group.iter().sum::<f64>() / p as f64;
                for nics in nic_choices(f, 1) {
                    ffn.push(SideOption {
                        groups: p,
                        gpus: f,
                        nics,
                        context_parallel: 1,
                        busy_s: mb * compute,
                        port_bw: sides.port_bandwidth(false, f, nics, p),
                        exchange_bytes: bytes,
                        mean_exchange_bytes: mean_bytes,
                        memory: mem,
                    });
                }
            }
        }
        let mut problem = Self {
            attention,
            ffn,
            total_gpus: g_total,
            nics_per_gpu: c.nics_per_gpu(),
            uses_nics,
            micro_batches: mb,
            apart: sides.apart,
            side_nics_per_gpu,
            shortfall,
        };
        problem.prune_dominated();
        problem.diagnose(cost)?;
        Ok(problem)
    }

    /// Drops options another option of the same side and group count beats on every count:
    /// no more GPUs, no more NICs, no larger NIC surplus, no slower, no more bytes.
    fn prune_dominated(&mut self) {
        let prune = |opts: &mut Vec<SideOption>, r: f64| {
            let keep: Vec<bool> = opts
                .iter()
                .map(|o| {
                    !opts.iter().any(|d| {
                        let surplus = |x: &SideOption| x.nics as f64 - r * x.gpus as f64;
                        let no_worse = d.groups == o.groups
                            && d.gpus <= o.gpus
                            && d.nics <= o.nics
                            && surplus(d) <= surplus(o) + 1e-9
                            && d.busy_s <= o.busy_s
                            && d.port_bw >= o.port_bw
                            && d.exchange_bytes <= o.exchange_bytes;
                        let better = d.gpus < o.gpus
                            || d.nics < o.nics
                            || d.busy_s < o.busy_s
                            || d.exchange_bytes < o.exchange_bytes;
                        no_worse && better
                    })
                })
                .collect();
            let mut it = keep.iter();
            opts.retain(|_| *it.next().unwrap());
        };
        prune(&mut self.attention, self.side_nics_per_gpu[0]);
        prune(&mut self.ffn, self.side_nics_per_gpu[1]);
    }

    /// Fails with the constraint that makes the problem infeasible, and by how much.
    fn diagnose(&self, cost: &CostModel) -> Result<()> {
        let gb = |b: f64| b / 1e9;
        if let (true, true, ContextParallel::Fixed(c)) =
            (self.attention.is_empty(), self.shortfall[0].is_none(), cost.context_parallel)
        {
            let node = cost.cluster.node.gpus_per_node;
            let sizes = group_sizes(node, self.total_gpus.saturating_sub(1));
            return Err(CoreError::Infeasible {
                constraint: "context_parallel".into(),
                detail: format!(
                    "context parallelism {c} needs an attention group size that is a multiple of {c} and \
                     sequences of at least {} tokens (two chunks per GPU); group sizes here: {sizes:?} \
                     (divisors or multiples of the node's {node} GPUs), sequence {}; choose a size that divides one of \
                     those (or, in `plan`, --context-parallel auto)",
                    c.saturating_mul(2),
                    cost.workload.seq
                ),
            });
        }
        for (side, opts, name) in [(0, &self.attention, "memory_attention"), (1, &self.ffn, "memory_ffn")] {
            if opts.is_empty() {
                let what = if side == 0 { "attention" } else { "expert" };
                let detail = match self.shortfall[side] {
                    Some(s) => format!(
                        "the smallest footprint needs {:.1} GB per GPU, {:.1} GB usable (short by {:.1} GB): {} per {what} GPU with {} groups of {} {what} GPUs; add nodes or use a smaller micro-batch",
                        gb(s.need.total()),
                        gb(s.usable),
                        gb(s.need.total() - s.usable),
                        s.need.describe(),
                        s.groups,
                        s.gpus
                    ),
                    None => format!("no group size fits in {} GPUs (expert groups may not exceed the expert count)", self.total_gpus),
                };
                return Err(CoreError::Infeasible { constraint: name.to_string(), detail });
            }
        }
        if let Some(ap) = self.apart {
            // Each side's groups come from its own pool (the sizes were bounded by it); a pair must
            // still agree on the group count and keep each side within its own GPUs' NICs.
            let fits = self.attention.iter().any(|a| self.ffn.iter().any(|f| self.compatible(a, f)));
            return if fits {
                Ok(())
            } else {
                let [ra, rf] = self.side_nics_per_gpu;
                Err(CoreError::Infeasible {
                    constraint: "group_count / nics".into(),
                    detail: format!(
                        "no group count has an attention option (pool of {} GPUs, {ra} NICs per GPU) and an \
                         expert option (pool of {} GPUs, {rf} NICs per GPU) that fit in memory and within \
                         their own GPUs' NICs",
                        ap.attention_gpus, ap.ffn_gpus
                    ),
                })
            };
        }
        let smallest = |opts: &Vec<SideOption>, p: usize| opts.iter().filter(|o| o.groups == p).map(|o| o.gpus).min();
        let need = self
            .attention
            .iter()
            .map(|o| o.groups)
            .filter_map(|p| Some(p * (smallest(&self.attention, p)? + smallest(&self.ffn, p)?)))
            .min();
        match need {
            Some(n) if n <= self.total_gpus => Ok(()),
            Some(n) => Err(CoreError::Infeasible {
                constraint: "total_gpus".into(),
                detail: format!(
                    "the smallest memory-feasible placement needs {n} GPUs, the cluster has {} (short by {})",
                    self.total_gpus,
                    n - self.total_gpus
                ),
            }),
            None => Err(CoreError::Infeasible {
                constraint: "group_count".into(),
                detail: "no group count has both an attention and an expert option that fit in memory".into(),
            }),
        }
    }

    /// Whether two options form a feasible allocation.
    pub fn compatible(&self, a: &SideOption, f: &SideOption) -> bool {
        if let Some(ap) = self.apart {
            let [ra, rf] = self.side_nics_per_gpu;
            return a.groups == f.groups
                && a.groups * a.gpus <= ap.attention_gpus
                && a.groups * f.gpus <= ap.ffn_gpus
                && a.nics as f64 <= ra * a.gpus as f64 + 1e-9
                && f.nics as f64 <= rf * f.gpus as f64 + 1e-9;
        }
        a.groups == f.groups
            && a.groups * (a.gpus + f.gpus) <= self.total_gpus
            && (!self.uses_nics || (a.nics + f.nics) as f64 <= self.nics_per_gpu * (a.gpus + f.gpus) as f64 + 1e-9)
    }

    /// Stage times of a pair of options.
    pub fn stage_times(&self, a: &SideOption, f: &SideOption) -> StageTimes {
        let bytes = self.micro_batches * f.exchange_bytes;
        StageTimes {
            attention_s: a.busy_s,
            ffn_s: f.busy_s,
            attention_comm_s: bytes / a.port_bw,
            ffn_comm_s: bytes / f.port_bw,
        }
    }

    /// A lower bound of the simulated step time of a pair of options: the busiest group's
    /// compute (the simulator runs the same ops, plus any recomputation), the busiest expert
    /// port (it carries exactly `exchange_bytes` per micro-batch, and a transfer never runs faster
    /// than its slower port) and the attention ports' average load (the busiest carries at
    /// least that). The roofline's `attention_comm_s` is not a bound: which expert group feeds
    /// which attention port depends on the ring's layer order.
    pub fn step_lower_bound(&self, a: &SideOption, f: &SideOption) -> f64 {
        let t = self.stage_times(a, f);
        let attention_port = self.micro_batches * f.mean_exchange_bytes / a.port_bw;
        t.attention_s.max(t.ffn_s).max(t.ffn_comm_s).max(attention_port)
    }

    /// The allocation described by a pair of options.
    pub fn allocation(a: &SideOption, f: &SideOption) -> Allocation {
        Allocation {
            groups: a.groups,
            attention_gpus_per_group: a.gpus,
            ffn_gpus_per_group: f.gpus,
            attention_nics_per_group: a.nics,
            ffn_nics_per_group: f.nics,
            context_parallel: a.context_parallel,
        }
    }

    /// Looks up the options of an allocation, if it is one of the problem's.
    pub fn options_of(&self, alloc: &Allocation) -> Option<(SideOption, SideOption)> {
        let a = self.attention.iter().find(|o| {
            o.groups == alloc.groups
                && o.gpus == alloc.attention_gpus_per_group
                && o.nics == alloc.attention_nics_per_group
                && o.context_parallel == alloc.context_parallel
        })?;
        let f = self.ffn.iter().find(|o| {
            o.groups == alloc.groups && o.gpus == alloc.ffn_gpus_per_group && o.nics == alloc.ffn_nics_per_group
        })?;
        self.compatible(a, f).then_some((*a, *f))
    }

    /// The best allocation for each group count separately, best first (by enumeration within
    /// each `p`, which is cheap: only options of the same `p` pair up). These are the starting
    /// points of the multi-start local search.
    pub fn best_per_group_count(&self) -> Vec<(Allocation, f64)> {
        let mut best: Vec<(Allocation, f64)> = Vec::new();
        for a in &self.attention {
            for f in self.ffn.iter().filter(|f| self.compatible(a, f)) {
                let t = self.stage_times(a, f).objective();
                match best.iter_mut().find(|(b, _)| b.groups == a.groups) {
                    Some(slot) if t < slot.1 => *slot = (Self::allocation(a, f), t),
                    Some(_) => {}
                    None => best.push((Self::allocation(a, f), t)),
                }
            }
        }
        best.sort_by(|x, y| x.1.total_cmp(&y.1));
        best
    }

    /// Exhaustive reference: the best allocation and its objective, by trying every pair.
    pub fn enumerate(&self) -> Option<(Allocation, f64)> {
        let mut best: Option<(Allocation, f64)> = None;
        for a in &self.attention {
            for f in self.ffn.iter().filter(|f| self.compatible(a, f)) {
                let t = self.stage_times(a, f).objective();
                if best.is_none_or(|(_, b)| t < b) {
                    best = Some((Self::allocation(a, f), t));
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_sizes_respect_node_boundaries() {
        assert_eq!(group_sizes(8, 40), vec![1, 2, 4, 8, 16, 24, 32, 40]);
        assert_eq!(group_sizes(8, 3), vec![1, 2]);
    }

    #[test]
    fn group_counts_keep_the_smallest_p_per_layers_per_group() {
        // 10 layers: p=1 ->10, 2 ->5, 3 ->4, 4 ->3, 5 ->2, 10 ->1.
        assert_eq!(group_counts(10, 100), vec![1, 2, 3, 4, 5, 10]);
    }
}
