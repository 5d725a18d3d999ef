//! Plans one job and prints the chosen allocation and how long planning took.
//!
//! `cargo run -p disagmoe-core --release --example plan -- [MODEL] [CLUSTER] [SEQ]`
//! (defaults: `qwen3-235b-a22b h800x16 8192`; 64K tokens per micro-batch, two micro-batches per
//! GPU per step, as in `docs/paper-reproduction.md`).

use disagmoe_core::cost::{CostModel, Workload};
use disagmoe_core::hardware::Cluster;
use disagmoe_core::model_shape::ModelShape;
use disagmoe_core::plan::{plan, DEFAULT_SEARCH_EVALS};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, default: &str| args.get(i).cloned().unwrap_or_else(|| default.to_string());
    let (model, cluster, seq) = (arg(0, "qwen3-235b-a22b"), arg(1, "h800x16"), arg(2, "8192").parse::<usize>()?);
    let cluster = Cluster::preset(&cluster)?;
    let micro_batch = (65_536 / seq).max(1);
    let workload = Workload { seq, micro_batch, global_batch: 2 * cluster.total_gpus() * micro_batch };
    let cost = CostModel::new(ModelShape::preset(&model)?, cluster, workload)?;
    let report = plan(&cost, true, DEFAULT_SEARCH_EVALS)?;
    println!(
        "{} on {} at {seq}: {} pairs x (A {} GPU/{} NIC, F {} GPU/{} NIC), step {:.3} s",
        report.model,
        report.cluster,
        report.groups,
        report.allocation.attention_gpus_per_group,
        report.allocation.attention_nics_per_group,
        report.allocation.ffn_gpus_per_group,
        report.allocation.ffn_nics_per_group,
        report.predicted_step_s,
    );
    let candidates = report.candidates.as_deref().unwrap_or_default();
    for c in candidates {
        let a = &c.allocation;
        println!(
            "  considered {} x (A {}/{}, F {}/{}): roofline {:.3} s, simulated {:.3} s",
            a.groups,
            a.attention_gpus_per_group,
            a.attention_nics_per_group,
            a.ffn_gpus_per_group,
            a.ffn_nics_per_group,
            c.roofline_s,
            c.predicted_step_s
        );
    }
    let simulated = candidates.len();
    println!("solved in {:.3} s (MILP {:.3} s), {simulated} allocations simulated", report.solve_s, report.milp_s);
    Ok(())
}
