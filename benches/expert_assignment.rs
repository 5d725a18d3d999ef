//! What planning a micro-batch's dispatch costs an attention worker (`DispatchPlan::routed`: each
//! routed copy to a holder, the tokens and ids of each share), with the contiguous split and with
//! EPLB's balanced placement and redundant replicas, where each replicated expert's copies are
//! split by `exchange::assign_copies`' min-max flow. A DeepSeek-V3-like layer per expert group: 64
//! experts over 8 holders, top-8, 4096 tokens per micro-batch, routing drawn from a Zipf(1.2) load;
//! 8 redundant replicas.
//!
//!     cargo bench -p disagmoe --bench expert_assignment

use criterion::{criterion_group, criterion_main, Criterion};
use disagmoe::core::experts::{sample_routing, ExpertLoad, ExpertMap};
use disagmoe::train::runtime::exchange::DispatchPlan;
use disagmoe::train::runtime::layout::Layout;

const EXPERTS: usize = 64;
const HOLDERS: usize = 8;
const TOP_K: usize = 8;
const TOKENS: usize = 4096;
const WIDTH: usize = 7168;

fn bench(c: &mut Criterion) {
    let shares = ExpertLoad::Zipf(1.2).shares(0, EXPERTS).expect("shares");
    let ids = sample_routing(&shares, TOP_K, TOKENS, 11);
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
