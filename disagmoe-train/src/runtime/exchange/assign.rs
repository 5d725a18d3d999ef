//! Which holder computes each routed copy of a micro-batch ([`assign_copies`]): the one holder of
//! an expert, or, for an expert with replicas on several holders, the replica that evens the
//! holders' work on this micro-batch (DeepSeek's LPLB: a small optimisation per batch).
//!
//! The copies of unreplicated experts are fixed; the copies of each replicated expert `e` (`c_e`
//! of them) may go to any of its holders `H_e`. The assignment minimises the largest number of
//! copies any holder computes, exactly: the smallest `T` for which the flow network
//! `source -> e (c_e) -> h in H_e -> sink (T - fixed_h)` carries every replicated copy, found by
//! bisection over `T` with a max-flow per probe (a few experts and holders: microseconds). Its
//! flows say how many copies of `e` each replica takes; the copies are dealt in token order, the
//! lower holder first, so the assignment is a function of the routing alone and runs reproduce.

use crate::runtime::layout::Layout;

/// For each routed copy `t k + j` of `ids` (`DROPPED` or any id of no expert: `None`), the index (in
/// [`Layout::ffn_holders`]) of the holder of `layer` that computes it (see the module doc).
pub fn assign_copies(layout: &Layout, layer: usize, ids: &[usize]) -> Vec<Option<usize>> {
    let (e, n) = (layout.experts, layout.ffn_holders(layer).len());
    // Holder indices of each expert.
    let mut holders_of: Vec<Vec<usize>> = vec![Vec::new(); e];
    for h in 0..n {
        for x in layout.held_experts(layer, h) {
            holders_of[x].push(h);
        }
    }
    let mut owner: Vec<Option<usize>> =
        ids.iter().map(|&x| holders_of.get(x).and_then(|hs| hs.first().copied())).collect();
    let replicated: Vec<usize> = (0..e).filter(|&x| holders_of[x].len() > 1).collect();
    if replicated.is_empty() {
        return owner;
    }
    let mut fixed = vec![0usize; n];
    let mut copies = vec![0usize; e];
    for (&x, o) in ids.iter().zip(&owner) {
        match holders_of.get(x) {
            Some(hs) if hs.len() > 1 => copies[x] += 1,
            _ => {
                if let Some(h) = o {
                    fixed[*h] += 1;
                }
            }
        }
    }
    let demand: Vec<(usize, &[usize])> =
        replicated.iter().filter(|&&x| copies[x] > 0).map(|&x| (copies[x], holders_of[x].as_slice())).collect();
    let flows = balance(&fixed, &demand);
    // Deal each replicated expert's copies in token order, its holders in ascending order.
    let mut left: Vec<Vec<usize>> = vec![Vec::new(); e];
    for (&x, f) in replicated.iter().filter(|&&x| copies[x] > 0).zip(flows) {
        left[x] = f;
    }
    for (&x, o) in ids.iter().zip(owner.iter_mut()) {
        let Some(hs) = holders_of.get(x).filter(|hs| hs.len() > 1) else { continue };
        let i = left[x].iter().position(|&c| c > 0).expect("the flows carry every copy");
        left[x][i] -= 1;
        *o = Some(hs[i]);
    }
    owner
}

/// The min-max split of the replicated copies: for each `(copies, holders)` of `demand`, how many
/// of its copies each of its holders takes (in the order of `holders`), so that the largest
/// `fixed[h] + taken[h]` is as small as it can be.
pub fn balance(fixed: &[usize], demand: &[(usize, &[usize])]) -> Vec<Vec<usize>> {
    let total: usize = demand.iter().map(|d| d.0).sum();
    let top = fixed.iter().copied().max().unwrap_or(0);
    // The smallest feasible bound, by bisection (feasible at `top + total`).
    let (mut lo, mut hi) = (top.max((fixed.iter().sum::<usize>() + total).div_ceil(fixed.len().max(1))), top + total);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if max_flow(fixed, demand, mid).0 == total {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    let (carried, flows) = max_flow(fixed, demand, lo);
    debug_assert_eq!(carried, total);
    flows
}

/// The max-flow of `source -> demand d (d.0) -> its holders -> sink (bound - fixed[h])`, by
/// augmenting paths; returns the flow and the flow on each (demand, holder) edge.
fn max_flow(fixed: &[usize], demand: &[(usize, &[usize])], bound: usize) -> (usize, Vec<Vec<usize>>) {
    let mut flow: Vec<Vec<usize>> = demand.iter().map(|d| vec![0; d.1.len()]).collect();
    let mut sent = vec![0usize; demand.len()];
    let mut into = vec![0usize; fixed.len()];
    let room = |h: usize, into: &[usize]| bound.saturating_sub(fixed[h]).saturating_sub(into[h]);
    loop {
        // Breadth-first over the residual graph from the demands with copies left: demand ->
        // holder (always open), holder -> demand (back along a positive flow).
        let mut prev_holder: Vec<Option<(usize, usize)>> = vec![None; fixed.len()]; // holder <- (demand, edge)
        let mut prev_demand: Vec<Option<(usize, usize)>> = vec![None; demand.len()]; // demand <- (holder, edge)
        let mut seen_demand = vec![false; demand.len()];
        let mut queue: std::collections::VecDeque<usize> =
            (0..demand.len()).filter(|&d| sent[d] < demand[d].0).collect();
        queue.iter().for_each(|&d| seen_demand[d] = true);
        let mut end = None;
        while let Some(d) = queue.pop_front() {
            for (i, &h) in demand[d].1.iter().enumerate() {
                if prev_holder[h].is_some() {
                    continue;
                }
                prev_holder[h] = Some((d, i));
                if room(h, &into) > 0 {
                    end = Some(h);
                    break;
                }
                for (d2, dem) in demand.iter().enumerate() {
                    if let Some(j) = dem.1.iter().position(|&x| x == h).filter(|&j| flow[d2][j] > 0 && !seen_demand[d2])
                    {
                        seen_demand[d2] = true;
                        prev_demand[d2] = Some((h, j));
                        queue.push_back(d2);
                    }
                }
            }
            if end.is_some() {
                break;
            }
        }
        let Some(h_end) = end else { break };
        // The path's bottleneck, then the augmentation.
        let mut amount = room(h_end, &into);
        let mut h = h_end;
        loop {
            let (d, _) = prev_holder[h].expect("on the path");
            match prev_demand[d] {
                Some((h2, j)) => {
                    amount = amount.min(flow[d][j]);
                    h = h2;
                }
                None => {
                    amount = amount.min(demand[d].0 - sent[d]);
                    break;
                }
            }
        }
        into[h_end] += amount;
        let mut h = h_end;
        loop {
            let (d, i) = prev_holder[h].expect("on the path");
            flow[d][i] += amount;
            match prev_demand[d] {
                Some((h2, j)) => {
                    flow[d][j] -= amount;
                    h = h2;
                }
                None => {
                    sent[d] += amount;
                    break;
                }
            }
        }
    }
    (sent.iter().sum(), flow)
}

#[cfg(test)]
mod tests {
    use super::*;
    use disagmoe_core::experts::ExpertMap;

    /// The best bound by brute force over every split of the replicated copies.
    fn brute(fixed: &[usize], demand: &[(usize, &[usize])]) -> usize {
        fn go(fixed: &mut Vec<usize>, demand: &[(usize, &[usize])]) -> usize {
            let Some(((c, hs), rest)) = demand.split_first() else { return fixed.iter().copied().max().unwrap_or(0) };
            let mut best = usize::MAX;
            let splits = |c: usize, k: usize| -> Vec<Vec<usize>> {
                let mut out = vec![vec![]];
                for i in 0..k {
                    out = out
                        .into_iter()
                        .flat_map(|s: Vec<usize>| {
                            let used: usize = s.iter().sum();
                            let range = if i + 1 == k { (c - used)..=(c - used) } else { 0..=(c - used) };
                            range.map(move |x| [s.clone(), vec![x]].concat())
                        })
                        .collect();
                }
                out
            };
            for s in splits(*c, hs.len()) {
                hs.iter().zip(&s).for_each(|(&h, &x)| fixed[h] += x);
                best = best.min(go(fixed, rest));
                hs.iter().zip(&s).for_each(|(&h, &x)| fixed[h] -= x);
            }
            best
        }
        go(&mut fixed.to_vec(), demand)
    }

    #[test]
    fn the_split_is_the_best_min_max() {
        let cases: Vec<(Vec<usize>, Vec<(usize, Vec<usize>)>)> = vec![
            (vec![5, 0, 0], vec![(6, vec![0, 1])]),
            (vec![9, 1, 4, 0], vec![(7, vec![0, 2]), (5, vec![2, 3]), (3, vec![1, 3])]),
            (vec![0, 0], vec![(1, vec![0, 1])]),
            (vec![3, 3, 3], vec![(4, vec![0, 1]), (4, vec![1, 2]), (2, vec![0, 2])]),
            (vec![12, 0, 0, 0], vec![(2, vec![0, 1])]),
        ];
        for (fixed, demand) in cases {
            let demand: Vec<(usize, &[usize])> = demand.iter().map(|(c, h)| (*c, h.as_slice())).collect();
            let flows = balance(&fixed, &demand);
            let mut load = fixed.clone();
            for ((c, hs), f) in demand.iter().zip(&flows) {
                assert_eq!(f.iter().sum::<usize>(), *c, "every copy placed");
                hs.iter().zip(f).for_each(|(&h, &x)| load[h] += x);
            }
            assert_eq!(load.iter().copied().max().unwrap(), brute(&fixed, &demand), "{fixed:?} {demand:?}");
        }
    }

    #[test]
    fn replicated_copies_go_where_they_even_the_holders() {
        // 4 experts on 2 holders; expert 0 on both.
        let mut layout = Layout::ep(1, 4, 2, 2).unwrap();
        layout.set_expert_map(0, ExpertMap { slots: vec![vec![0, 1], vec![0, 2, 3]], replicas: vec![] }).unwrap();
        // 6 tokens, k = 1: four copies of expert 0, one of 1, one of 3, one dropped.
        let ids = [0, 0, 1, 0, 3, 0, usize::MAX];
        let owner = assign_copies(&layout, 0, &ids);
        // Fixed: holder 0 one copy (expert 1), holder 1 one (expert 3); expert 0's four split 2/2,
        // dealt in token order, the lower holder first.
        assert_eq!(owner, vec![Some(0), Some(0), Some(0), Some(1), Some(1), Some(1), None]);
        // The same routing, the same assignment.
        assert_eq!(assign_copies(&layout, 0, &ids), owner);
        // Without replicas every copy goes to its expert's one holder.
        let plain = Layout::ep(1, 4, 2, 2).unwrap();
        assert_eq!(assign_copies(&plain, 0, &ids), vec![Some(0), Some(0), Some(0), Some(0), Some(1), Some(0), None]);
    }

    /// Routing drawn from a Zipf(1.2) load (16 experts, top-4, 1024 tokens) over 4 holders: the
    /// contiguous split leaves the busiest holder far above the mean; EPLB's placement for the
    /// measured load with 2 redundant experts and this assignment bring it to within 10% of it.
    #[test]
    fn a_balanced_placement_with_two_replicas_evens_a_zipf_load() {
        use disagmoe_core::experts::ExpertLoad;
        let (e, k, tokens, holders) = (16usize, 4usize, 1024usize, 4usize);
        let shares = ExpertLoad::Zipf(1.2).shares(0, e).unwrap();
        let ids = disagmoe_core::experts::sample_routing(&shares, k, tokens, 7);
        let imbalance = |layout: &Layout| {
            let mut copies = vec![0usize; holders];
            assign_copies(layout, 0, &ids).into_iter().flatten().for_each(|h| copies[h] += 1);
            *copies.iter().max().unwrap() as f64 * holders as f64 / (tokens * k) as f64
        };
        // The placement for the load the routing has (as a run measures it: top-k without repeats
        // flattens the hottest experts' shares).
        let mut measured = vec![0.0; e];
        ids.iter().for_each(|&x| measured[x] += 1.0 / (tokens * k) as f64);
        let contiguous = Layout::ep(1, e, holders, holders).unwrap();
        let mut balanced = contiguous.clone();
        balanced.set_expert_map(0, ExpertMap::balanced(&measured, holders, 2).unwrap()).unwrap();
        let (before, after) = (imbalance(&contiguous), imbalance(&balanced));
        eprintln!("busiest holder over the mean: contiguous {before:.3}, balanced with 2 replicas {after:.3}");
        assert!(before > 1.3, "the contiguous split is uneven: {before}");
        assert!(after <= 1.10, "balanced with 2 replicas: {after} (contiguous {before})");
    }
}
