//! Who holds what and who computes which micro-batch: the placement of a distributed run, defined
//! once for the runtime (`disagmoe-train`'s workers, its prediction) and the schedule builders
//! ([`crate::schedule::afpipe`]).
//!
//! - `disagg` (AF-Pipe): workers `0..M` are attention workers, `M..M+N` expert workers; both are cut
//!   into `p` groups. Attention group `g` holds layers `g, g+p, ...` (attention, norms, router) and
//!   group 0 also the embedding, final norm and head; its `M/p` workers are data parallel (micro-batch
//!   `m` goes to worker `m mod M/p` of each group). Expert group `g` holds the experts of the same
//!   layers, split into contiguous ranges over its `N/p` workers (expert parallel), or placed by an
//!   explicit table with replicas of hot experts ([`Layout::set_expert_map`]); the first worker of
//!   a group also holds shared experts and dense MLPs.
//! - `ep` (the colocated baseline): each of `W` workers holds every attention layer and the ends (data
//!   parallel) and `1/W` of every layer's experts; micro-batch `m` belongs to worker `m mod W`;
//!   worker 0 also holds shared experts and dense MLPs.
//! - **context parallelism** (`disagg` only, [`Layout::with_context_parallel`]): each attention
//!   group's workers form rings of `C`, and each sequence of a micro-batch is cut over the `C`
//!   workers of one ring (two chunks each: `disagmoe_kernels::ring`). The runtime's unit of work
//!   is then a **unit** `u = mb * C + r`, the tokens of micro-batch `mb` that ring rank `r`
//!   holds: units go through the attention stages and the token exchange as micro-batches do
//!   without context parallelism (with `C = 1` a unit is a micro-batch), and the head of `mb`
//!   gathers its `C` units on ring rank 0.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::error::{CoreError, Result};
use crate::experts::{expert_runs, ExpertMap};

/// How a run is placed on workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    /// The plain model on one device.
    #[default]
    Single,
    /// Attention and experts on disjoint workers, pipelined (AF-Pipe).
    Disagg,
    /// Every worker holds attention and a shard of the experts; all-to-all dispatch (EP baseline).
    Ep,
}

impl Placement {
    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Placement::Single => "single",
            Placement::Disagg => "disagg",
            Placement::Ep => "ep",
        }
    }
}

/// The attention and expert group of `layer` among `groups`: the one placement rule of AF-Pipe
/// (layer `l` belongs to group `l % p`), used by [`Layout`] and the schedule builders.
pub fn layer_group(layer: usize, groups: usize) -> usize {
    layer % groups
}

fn invalid(field: &str, value: usize, allowed: String) -> CoreError {
    CoreError::InvalidField { field: field.into(), value: value.to_string(), allowed }
}

/// The placement of a distributed run, resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct Layout {
    /// `disagg` or `ep`.
    pub placement: Placement,
    /// Decoder layers.
    pub layers: usize,
    /// Routed experts per layer.
    pub experts: usize,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// Groups `p` (1 for `ep`).
    pub groups: usize,
    /// Attention workers per group (`ep`: all workers).
    pub attn_per_group: usize,
    /// Expert workers per group (`ep`: all workers).
    pub ffn_per_group: usize,
    /// Attention workers in all (`ep`: 0, every worker does both).
    pub attn_workers: usize,
    /// Workers in all.
    pub workers: usize,
    /// Layers with shared experts (their first holder gets every token); set by the runner.
    pub shared_experts: Vec<bool>,
    /// Layers with routed experts (the others are dense); set by the runner.
    pub sparse: Vec<bool>,
    /// Per layer, which experts each of its holders holds when that is not the contiguous split
    /// of [`Layout::expert_range`] (`None`, or no entry): a balanced placement with redundant
    /// replicas of hot experts ([`Layout::set_expert_map`]); set by the runner.
    pub expert_maps: Vec<Option<ExpertMap>>,
    /// Context parallelism `C`: the attention workers a sequence is cut over (1: none).
    pub context_parallel: usize,
}

impl Layout {
    /// AF-Pipe over `attn` attention and `ffn` expert workers in `groups` groups.
    pub fn disagg(
        layers: usize,
        experts: usize,
        micro_batches: usize,
        attn: usize,
        ffn: usize,
        groups: usize,
    ) -> Result<Self> {
        if groups == 0 || groups > layers {
            return Err(invalid("groups", groups, format!("must be between 1 and the model's {layers} layers")));
        }
        for (field, n) in [("attn_workers", attn), ("ffn_workers", ffn)] {
            if n == 0 || n % groups != 0 {
                return Err(invalid(field, n, format!("must be a positive multiple of groups ({groups})")));
            }
        }
        Ok(Self {
            placement: Placement::Disagg,
            layers,
            experts,
            micro_batches,
            groups,
            attn_per_group: attn / groups,
            ffn_per_group: ffn / groups,
            attn_workers: attn,
            workers: attn + ffn,
            shared_experts: vec![false; layers],
            sparse: vec![true; layers],
            expert_maps: vec![None; layers],
            context_parallel: 1,
        })
    }

    /// The colocated expert-parallel baseline on `workers` workers.
    pub fn ep(layers: usize, experts: usize, micro_batches: usize, workers: usize) -> Result<Self> {
        if workers == 0 {
            return Err(invalid("workers", workers, "must be at least 1".into()));
        }
        if micro_batches % workers != 0 {
            return Err(invalid(
                "micro_batches",
                micro_batches,
                format!("must be a multiple of workers ({workers}) with placement ep"),
            ));
        }
        Ok(Self {
            placement: Placement::Ep,
            layers,
            experts,
            micro_batches,
            groups: 1,
            attn_per_group: workers,
            ffn_per_group: workers,
            attn_workers: 0,
            workers,
            shared_experts: vec![false; layers],
            sparse: vec![true; layers],
            expert_maps: vec![None; layers],
            context_parallel: 1,
        })
    }

    /// The same layout with each sequence cut over rings of `c` attention workers (see the
    /// module doc); refused under `ep`, or unless `c` divides the attention workers of a group.
    pub fn with_context_parallel(mut self, c: usize) -> Result<Self> {
        if c == 0 {
            return Err(invalid("context_parallel", c, "must be at least 1".into()));
        }
        if c > 1 && self.placement != Placement::Disagg {
            return Err(invalid(
                "context_parallel",
                c,
                "1 with placement ep (context parallelism needs disagg)".into(),
            ));
        }
        if self.attn_per_group % c != 0 {
            return Err(invalid(
                "context_parallel",
                c,
                format!("a divisor of the attention workers per group ({})", self.attn_per_group),
            ));
        }
        self.context_parallel = c;
        Ok(self)
    }

    /// Units of a step: micro-batches times [`Layout::context_parallel`] (see the module doc).
    pub fn units(&self) -> usize {
        self.micro_batches * self.context_parallel
    }

    /// The micro-batch of unit `unit` and the ring rank that holds it.
    pub fn unit_of(&self, unit: usize) -> (usize, usize) {
        (unit / self.context_parallel, unit % self.context_parallel)
    }

    /// The units of the same micro-batch as `unit` (its ring), in ring-rank order, itself included.
    pub fn ring_units(&self, unit: usize) -> std::ops::Range<usize> {
        let first = unit - unit % self.context_parallel;
        first..first + self.context_parallel
    }

    /// The worker that runs the attention of `layer` for unit `unit` (without context parallelism,
    /// a unit is a micro-batch).
    pub fn attn_worker(&self, unit: usize, layer: usize) -> usize {
        match self.placement {
            Placement::Ep => unit % self.workers,
            _ => {
                let (mb, r) = self.unit_of(unit);
                let rings = self.attn_per_group / self.context_parallel;
                layer_group(layer, self.groups) * self.attn_per_group + (mb % rings) * self.context_parallel + r
            }
        }
    }

    /// The worker that computes micro-batch `mb`'s loss: the one that embeds its first unit.
    pub fn head_worker(&self, mb: usize) -> usize {
        self.attn_worker(mb * self.context_parallel, 0)
    }

    /// Units whose attention `worker` runs at `layer`, ascending.
    pub fn attn_units(&self, worker: usize, layer: usize) -> Vec<usize> {
        (0..self.units()).filter(|&u| self.attn_worker(u, layer) == worker).collect()
    }

    /// The workers holding `layer`'s experts, in expert order; the first also holds shared experts
    /// and the dense MLP.
    pub fn ffn_holders(&self, layer: usize) -> Vec<usize> {
        match self.placement {
            Placement::Ep => (0..self.workers).collect(),
            _ => {
                let first = self.attn_workers + layer_group(layer, self.groups) * self.ffn_per_group;
                (first..first + self.ffn_per_group).collect()
            }
        }
    }

    /// Routed experts of holder `index` (of [`Layout::ffn_holders`]): contiguous, sizes differ by at
    /// most one; empty when there are more holders than experts.
    pub fn expert_range(&self, index: usize) -> Range<usize> {
        let n = self.ffn_per_group;
        (index * self.experts / n)..((index + 1) * self.experts / n)
    }

    /// Places `layer`'s experts on its holders by `map` (one slot list per holder of
    /// [`Layout::ffn_holders`], in that order); refused unless every expert is held somewhere and
    /// every id is an expert of the layer. An expert listed twice for one holder is held once.
    pub fn set_expert_map(&mut self, layer: usize, mut map: ExpertMap) -> Result<()> {
        let holders = self.ffn_holders(layer).len();
        let e = self.experts;
        if map.slots.len() != holders {
            return Err(invalid(
                "expert_map",
                map.slots.len(),
                format!("one slot list per holder of layer {layer} ({holders})"),
            ));
        }
        for s in &mut map.slots {
            s.sort_unstable();
            s.dedup();
            if let Some(&bad) = s.iter().find(|&&x| x >= e) {
                return Err(invalid("expert_map", bad, format!("expert ids below the layer's {e} experts")));
            }
        }
        map.replicas = (0..e).map(|x| map.slots.iter().filter(|s| s.contains(&x)).count()).collect();
        if let Some(x) = (0..e).find(|&x| map.replicas[x] == 0) {
            return Err(invalid("expert_map", x, format!("a placement holding every one of layer {layer}'s experts")));
        }
        if self.expert_maps.len() < self.layers {
            self.expert_maps.resize(self.layers, None);
        }
        self.expert_maps[layer] = Some(map);
        Ok(())
    }

    /// The explicit placement of `layer`'s experts, if it has one.
    fn expert_map(&self, layer: usize) -> Option<&ExpertMap> {
        self.expert_maps.get(layer).and_then(Option::as_ref)
    }

    /// Routed experts (global ids, ascending) holder `index` (of [`Layout::ffn_holders`]) of
    /// `layer` holds: its [`Layout::expert_range`], or its slots of an explicit placement.
    pub fn held_experts(&self, layer: usize, index: usize) -> Vec<usize> {
        match self.expert_map(layer) {
            Some(map) => map.slots[index].clone(),
            None => self.expert_range(index).collect(),
        }
    }

    /// How many holders of `layer` hold expert `e` (1 without an explicit placement).
    pub fn expert_replicas(&self, layer: usize, e: usize) -> usize {
        self.expert_map(layer).map_or(1, |m| m.replicas[e])
    }

    /// The holders (ranks, ascending) of `layer` that hold expert `e`.
    pub fn expert_holders(&self, layer: usize, e: usize) -> Vec<usize> {
        let holders = self.ffn_holders(layer);
        (0..holders.len()).filter(|&i| self.held_experts(layer, i).contains(&e)).map(|i| holders[i]).collect()
    }

    /// The experts holder `index` of `layer` holds as contiguous runs, each replicated expert in a
    /// run of its own (its gradients are summed with its replicas').
    pub fn expert_runs(&self, layer: usize, index: usize) -> Vec<Range<usize>> {
        expert_runs(&self.held_experts(layer, index), |e| self.expert_replicas(layer, e) > 1)
    }

    /// The distinct groups of holders (ranks, ascending) that share a replicated expert, over every
    /// layer, in ascending order: the groups a replicated expert's gradients are summed over.
    pub fn expert_replica_groups(&self) -> Vec<Vec<usize>> {
        let mut groups: Vec<Vec<usize>> = (0..self.layers)
            .filter(|&l| self.expert_map(l).is_some())
            .flat_map(|l| {
                (0..self.experts)
                    .filter(move |&e| self.expert_replicas(l, e) > 1)
                    .map(move |e| self.expert_holders(l, e))
            })
            .collect();
        groups.sort();
        groups.dedup();
        groups
    }

    /// Whether any layer has an expert held by more than one holder.
    pub fn has_replicas(&self) -> bool {
        self.expert_maps.iter().flatten().any(|m| m.replicas.iter().any(|&r| r > 1))
    }

    /// Layers whose attention `worker` holds.
    pub fn attn_layers(&self, worker: usize) -> Vec<usize> {
        match self.placement {
            Placement::Ep => (0..self.layers).collect(),
            _ if worker >= self.attn_workers => Vec::new(),
            _ => (0..self.layers).filter(|&l| layer_group(l, self.groups) == worker / self.attn_per_group).collect(),
        }
    }

    /// Layers whose experts `worker` holds, with its index among the holders.
    pub fn ffn_layers(&self, worker: usize) -> Vec<(usize, usize)> {
        (0..self.layers).filter_map(|l| self.ffn_holders(l).iter().position(|&w| w == worker).map(|i| (l, i))).collect()
    }

    /// Whether `worker` holds the embedding, final norm and head.
    pub fn holds_ends(&self, worker: usize) -> bool {
        match self.placement {
            Placement::Ep => true,
            _ => worker < self.attn_per_group,
        }
    }

    /// The workers whose attention-side parameters are copies of `worker`'s (itself included,
    /// first the one that counts them once); empty for pure expert workers.
    pub fn replicas(&self, worker: usize) -> Vec<usize> {
        match self.placement {
            Placement::Ep => (0..self.workers).collect(),
            _ if worker >= self.attn_workers => Vec::new(),
            _ => {
                let g = worker / self.attn_per_group;
                (g * self.attn_per_group..(g + 1) * self.attn_per_group).collect()
            }
        }
    }

    /// Units `worker` embeds, in the order it starts them (micro-batches without context
    /// parallelism).
    pub fn own_units(&self, worker: usize) -> Vec<usize> {
        self.attn_units(worker, 0)
    }

    /// Micro-batches `worker` embeds a unit of (whose token rows it reads), ascending.
    pub fn own_micro_batches(&self, worker: usize) -> Vec<usize> {
        let mut mbs: Vec<usize> = self.own_units(worker).into_iter().map(|u| self.unit_of(u).0).collect();
        mbs.dedup();
        mbs
    }

    /// The fewest units an embedding worker owns (the largest in-flight window every embedding
    /// worker can fill).
    pub fn fewest_owned_micro_batches(&self) -> usize {
        (0..self.workers).map(|w| self.own_units(w).len()).filter(|&n| n > 0).min().unwrap_or(1)
    }

    /// A name for logs and traces: `attn g0.w1`, `ffn g1.w0`, `ep 2`.
    pub fn worker_name(&self, worker: usize) -> String {
        match self.placement {
            Placement::Ep => format!("ep worker {worker}"),
            _ if worker < self.attn_workers => {
                format!("attention g{}.w{} (rank {worker})", worker / self.attn_per_group, worker % self.attn_per_group)
            }
            _ => {
                let f = worker - self.attn_workers;
                format!("experts g{}.w{} (rank {worker})", f / self.ffn_per_group, f % self.ffn_per_group)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disagg_deals_layers_round_robin_and_splits_experts() {
        let l = Layout::disagg(4, 8, 4, 4, 4, 2).unwrap();
        assert_eq!(l.workers, 8);
        assert_eq!(l.attn_layers(0), vec![0, 2]);
        assert_eq!(l.attn_layers(3), vec![1, 3]);
        assert_eq!(l.attn_worker(3, 1), 3);
        assert_eq!(l.attn_worker(2, 2), 0);
        assert_eq!(l.ffn_holders(1), vec![6, 7]);
        assert_eq!(l.ffn_layers(6), vec![(1, 0), (3, 0)]);
        assert_eq!(l.expert_range(1), 4..8);
        assert!(l.holds_ends(1) && !l.holds_ends(2));
        assert_eq!(l.replicas(3), vec![2, 3]);
        assert!(l.replicas(5).is_empty());
        assert_eq!(l.own_micro_batches(1), vec![1, 3]);
    }

    #[test]
    fn context_parallel_rings_share_a_micro_batch_and_the_head_is_ring_rank_0() {
        // 2 groups of 4 attention workers, rings of 2: micro-batch m on ring m % 2 of each group.
        let l = Layout::disagg(4, 8, 4, 8, 4, 2).unwrap().with_context_parallel(2).unwrap();
        assert_eq!(l.units(), 8);
        assert_eq!(l.unit_of(5), (2, 1));
        assert_eq!(l.ring_units(5), 4..6);
        // Unit 5 (mb 2, rank 1): ring 0 of group 1 at layer 1, worker 4 + 0 * 2 + 1.
        assert_eq!(l.attn_worker(5, 1), 5);
        assert_eq!(l.attn_worker(3, 0), 3, "mb 1 on ring 1 of group 0, rank 1");
        assert_eq!(l.head_worker(1), 2);
        assert_eq!(l.own_units(2), vec![2, 6]);
        assert_eq!(l.own_micro_batches(3), vec![1, 3]);
        assert_eq!(l.attn_units(6, 3), vec![2, 6]);
        assert_eq!(l.fewest_owned_micro_batches(), 2);
        // Without context parallelism a unit is a micro-batch.
        let plain = Layout::disagg(4, 8, 4, 8, 4, 2).unwrap();
        assert!((0..4).all(|m| plain.attn_worker(m, 1) == 4 + m));
        assert_eq!(plain.clone().with_context_parallel(1).unwrap(), plain);
    }

    #[test]
    fn bad_layouts_say_what_is_allowed() {
        let e = Layout::disagg(4, 8, 4, 6, 2, 2).unwrap().with_context_parallel(2).unwrap_err().to_string();
        assert!(e.contains("divisor of the attention workers per group (3)"), "{e}");
        assert!(Layout::ep(4, 8, 4, 4).unwrap().with_context_parallel(2).unwrap_err().to_string().contains("disagg"));
        assert!(Layout::disagg(4, 8, 4, 3, 2, 2).unwrap_err().to_string().contains("attn_workers"));
        assert!(Layout::disagg(4, 8, 4, 2, 2, 5).unwrap_err().to_string().contains("between 1 and"));
        assert!(Layout::ep(4, 8, 6, 4).unwrap_err().to_string().contains("multiple of workers"));
    }
}
