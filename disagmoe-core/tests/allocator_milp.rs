//! The MILP's answer equals exhaustive enumeration, and requests that cannot fit say why.

use disagmoe_core::allocator::milp::{solve_milp, solve_milp_pruned};
use disagmoe_core::allocator::AllocationProblem;
use disagmoe_core::cost::{CostModel, Workload};
use disagmoe_core::error::CoreError;
use disagmoe_core::hardware::Cluster;
use disagmoe_core::model_shape::{AttentionShape, ModelShape, MoeShape};

/// A tiny deterministic generator (xorshift) so the cases are reproducible without a dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[(self.next() % xs.len() as u64) as usize]
    }
}

fn random_case(rng: &mut Rng) -> CostModel {
    let heads = rng.pick(&[8, 16, 32]);
    let model = ModelShape {
        name: "random".into(),
        layers: rng.pick(&[2, 3, 4, 6, 8, 12]),
        hidden: rng.pick(&[1024, 2048, 4096]),
        vocab: 32_000,
        tied_embeddings: false,
        attention: AttentionShape::Gqa {
            heads,
            kv_heads: heads / 4,
            head_dim: 128,
            bias: false,
            qk_norm: true,
            sinks: false,
        },
        sliding_window: None,
        moe: MoeShape {
            experts: rng.pick(&[8, 16, 32, 64]),
            top_k: rng.pick(&[1, 2, 4]),
            intermediate: rng.pick(&[512, 1024, 2048]),
            shared_experts: 0,
            expert_bias: false,
            router_bias: false,
        },
        dense_layers: vec![],
        dense_intermediate: 0,
        active_counting: Default::default(),
    };
    let mut cluster =
        Cluster::preset(&format!("{}x{}", rng.pick(&["h800", "a100", "h200"]), rng.pick(&[1, 1, 2, 3, 4]))).unwrap();
    cluster.node.gpus_per_node = rng.pick(&[4, 8]);
    cluster.node.nics_per_node = rng.pick(&[2, 4, 8]);
    let seq = rng.pick(&[1024, 4096, 16384]);
    let micro_batch = rng.pick(&[1, 2, 4]);
    let workload = Workload { seq, micro_batch, global_batch: micro_batch * rng.pick(&[4, 16, 32]) };
    CostModel::new(model, cluster, workload).unwrap()
}

#[test]
fn milp_optimum_equals_exhaustive_enumeration_on_random_small_clusters() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut solved = 0;
    for case in 0..60 {
        let cost = random_case(&mut rng);
        let problem = match AllocationProblem::new(&cost, None) {
            Ok(p) => p,
            Err(CoreError::Infeasible { .. }) => continue,
            Err(e) => panic!("case {case}: {e}"),
        };
        let (alloc, best) = problem.enumerate().expect("diagnosed feasible");
        let milp = solve_milp(&problem).unwrap_or_else(|e| panic!("case {case}: {e}"));
        let rel = (milp.objective_s - best).abs() / best;
        assert!(
            rel < 1e-6,
            "case {case}: MILP {:?} = {} s, enumeration {:?} = {} s ({} A options, {} F options)",
            milp.allocation,
            milp.objective_s,
            alloc,
            best,
            problem.attention.len(),
            problem.ffn.len()
        );
        let (a, f) = problem.options_of(&milp.allocation).expect("MILP answer is feasible");
        assert!(problem.compatible(&a, &f));
        // Solving only the group counts whose best pair can tie the optimum gives the same answer.
        let pruned = solve_milp_pruned(&problem).unwrap_or_else(|e| panic!("case {case}: {e}"));
        // The same optimum; among allocations that tie on it (NICs a compute-bound group does
        // not need), either solve may return another.
        let (pa, pf) = problem.options_of(&pruned.allocation).expect("pruned MILP answer is feasible");
        let tie = (problem.stage_times(&pa, &pf).objective() - best).abs() / best;
        assert!(
            pruned.allocation == milp.allocation || tie < 1e-9,
            "case {case}: pruned MILP {:?} ({tie:e} from the optimum) vs {:?}",
            pruned.allocation,
            milp.allocation
        );
        assert!((pruned.objective_s - milp.objective_s).abs() <= 1e-9 * best, "case {case}");
        assert!(pruned.binaries <= milp.binaries, "case {case}");
        solved += 1;
    }
    assert!(solved >= 40, "only {solved} of 60 random cases were feasible");
}

#[test]
fn a_model_too_big_for_the_cluster_names_the_memory_constraint_and_the_shortfall() {
    let cost = CostModel::new(
        ModelShape::preset("deepseek-v3").unwrap(),
        Cluster::preset("h800x2").unwrap(),
        Workload { seq: 4096, micro_batch: 1, global_batch: 16 },
    )
    .unwrap();
    let e = AllocationProblem::new(&cost, None).unwrap_err().to_string();
    assert!(e.contains("memory_") && e.contains("short by") && e.contains("GB"), "{e}");
}

#[test]
fn per_group_count_optima_include_the_global_optimum_first() {
    let mut rng = Rng(0xDEAD_BEEF_1234_5678);
    for _ in 0..20 {
        let cost = random_case(&mut rng);
        let Ok(problem) = AllocationProblem::new(&cost, None) else { continue };
        let per_p = problem.best_per_group_count();
        let (_, best) = problem.enumerate().unwrap();
        assert!((per_p[0].1 - best).abs() <= 1e-12 * best, "{per_p:?} vs {best}");
        let mut ps: Vec<usize> = per_p.iter().map(|(a, _)| a.groups).collect();
        ps.sort_unstable();
        ps.dedup();
        assert_eq!(ps.len(), per_p.len(), "one entry per group count");
    }
}
