//! What planning a micro-batch's dispatch costs an attention worker (`DispatchPlan::routed`: each
//! routed copy to a holder, the tokens and ids of each share), with the contiguous split and with
//! EPLB's balanced placement and redundant replicas, where each replicated expert's copies are
//! split by `exchange::assign_copies`' min-max flow. A DeepSeek-V3-like layer per expert group: 64
//! experts over 8 holders, top-8, 4096 tokens per micro-batch, routing drawn from a Zipf(1.2) load;
//! 8 redundant replicas.
//!
//!     cargo bench -p disagmoe --bench expert_assignment

use criterion::{criterion_group, criterion_main, Criterion};
use disagmoe::core::experts::{ExpertLoad, ExpertMap};
use disagmoe::train::runtime::exchange::DispatchPlan;
use disagmoe::train::runtime::layout::Layout;

const EXPERTS: usize = 64;
const HOLDERS: usize = 8;
const TOP_K: usize = 8;
const TOKENS: usize = 4096;
const WIDTH: usize = 7168;

/// `TOKENS` tokens' `TOP_K` distinct experts drawn from `shares` (a fixed SplitMix64 stream).
fn routing(shares: &[f64]) -> Vec<usize> {
    let mut state = 11u64;
    let mut uniform = || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut ids = Vec::with_capacity(TOKENS * TOP_K);
    for _ in 0..TOKENS {
        let mut chosen: Vec<usize> = Vec::with_capacity(TOP_K);
        while chosen.len() < TOP_K {
            let left: f64 = (0..EXPERTS).filter(|x| !chosen.contains(x)).map(|x| shares[x]).sum();
            let mut u = uniform() * left;
            let pick = (0..EXPERTS).filter(|x| !chosen.contains(x)).find(|&x| {
                u -= shares[x];
                u <= 0.0
            });
            chosen.push(pick.unwrap_or_else(|| (0..EXPERTS).rev().find(|x| !chosen.contains(x)).expect("room")));
        }
        ids.extend(chosen);
    }
    ids
}

fn bench(c: &mut Criterion) {
    let shares = ExpertLoad::Zipf(1.2).shares(0, EXPERTS).expect("shares");
    let ids = routing(&shares);
    let mut measured = vec![0.0; EXPERTS];
    ids.iter().for_each(|&x| measured[x] += 1.0 / ids.len() as f64);
    let contiguous = Layout::ep(1, EXPERTS, HOLDERS, HOLDERS).expect("layout");
    let mut balanced = contiguous.clone();
    let map = ExpertMap::balanced(&measured, HOLDERS, 8).expect("placement");
    balanced.set_expert_map(0, map).expect("placement");
    let mut group = c.benchmark_group("dispatch_plan");
    for (name, layout) in [("contiguous", &contiguous), ("balanced_8_replicas", &balanced)] {
        let plan = DispatchPlan::routed(0, 0, layout, &ids, TOP_K, TOKENS, WIDTH);
        let (max, sum) = (plan.copies.iter().max().copied().unwrap_or(0), plan.copies.iter().sum::<usize>());
        eprintln!("{name}: busiest holder {:.3}x the mean", max as f64 * HOLDERS as f64 / sum as f64);
        group.bench_function(name, |b| b.iter(|| DispatchPlan::routed(0, 0, layout, &ids, TOP_K, TOKENS, WIDTH)));
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
