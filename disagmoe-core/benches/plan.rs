//! How long `disagmoe plan` takes on the paper's 128-GPU cluster and on 1024 GPUs (the issue's
//! "plan for 128 GPUs in under 1 s, 1024 GPUs in under 10 s").
//!
//! `plan_full/*`: the whole `plan` (options, MILP, multi-start local search with the simulator as
//! oracle, default evaluation budget) for Qwen3-235B-A22B at 8K on 16 x 8 and 128 x 8 H800.
//! `plan_milp/*`: options and MILP alone, for comparison.
//! `plan_mixed/1024`: `plan` on a mixed cluster of 1024 GPUs (64 x 8 H100 + 64 x 8 H20), the
//! same model and workload: every role assignment's options and lower bound, and the MILP and
//! local search of those that can still win (`MixedScope::Choose`, what `disagmoe plan` runs).
//!
//! Run: `cargo bench -p disagmoe-core --bench plan` (needs no Burn).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use disagmoe_core::allocator::milp::solve_milp;
use disagmoe_core::allocator::AllocationProblem;
use disagmoe_core::cost::{CostModel, Workload};
use disagmoe_core::hardware::Cluster;
use disagmoe_core::heterogeneous::{plan_mixed, MixedScope};
use disagmoe_core::model_shape::ModelShape;
use disagmoe_core::plan::{plan, DEFAULT_SEARCH_EVALS};
use disagmoe_core::pools::MixedCluster;
use std::hint::black_box;

/// The paper-reproduction workload: 64K tokens per micro-batch, two micro-batches per GPU per step.
fn cost(model: &str, cluster: &str, seq: usize) -> CostModel {
    let cluster = Cluster::preset(cluster).expect("preset");
    let mb = (65_536 / seq).max(1);
    let workload = Workload { seq, micro_batch: mb, global_batch: 2 * cluster.total_gpus() * mb };
    CostModel::new(ModelShape::preset(model).expect("preset"), cluster, workload).expect("valid")
}

fn bench_plan(c: &mut Criterion) {
    let clusters = [(128, "h800x16"), (1024, "h800x128")];
    let mut group = c.benchmark_group("plan_full");
    group.sample_size(10);
    for (gpus, cluster) in clusters {
        let cm = cost("qwen3-235b-a22b", cluster, 8192);
        group.bench_with_input(BenchmarkId::from_parameter(gpus), &cm, |b, cm| {
            b.iter(|| plan(black_box(cm), false, DEFAULT_SEARCH_EVALS).expect("plans"))
        });
    }
    group.finish();
    let mut group = c.benchmark_group("plan_milp");
    group.sample_size(10);
    for (gpus, cluster) in clusters {
        let cm = cost("qwen3-235b-a22b", cluster, 8192);
        group.bench_with_input(BenchmarkId::from_parameter(gpus), &cm, |b, cm| {
            b.iter(|| {
                let problem = AllocationProblem::new(black_box(cm), None).expect("feasible");
                solve_milp(&problem).expect("solves")
            })
        });
    }
    group.finish();
    let mut group = c.benchmark_group("plan_mixed");
    group.sample_size(10);
    let mixed = MixedCluster::preset("h100x64+h20x64").expect("preset");
    let mb = 65_536 / 8192;
    let workload = Workload { seq: 8192, micro_batch: mb, global_batch: 2 * mixed.total_gpus() * mb };
    let template = CostModel::new(ModelShape::preset("qwen3-235b-a22b").expect("preset"), mixed.slowest(), workload)
        .expect("valid");
    group.bench_function(BenchmarkId::from_parameter(mixed.total_gpus()), |b| {
        b.iter(|| {
            plan_mixed(black_box(&template), &mixed, MixedScope::Choose, false, DEFAULT_SEARCH_EVALS).expect("plans")
        })
    });
    group.finish();
}

criterion_group!(benches, bench_plan);
criterion_main!(benches);
