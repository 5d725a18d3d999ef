//! Simulates AF-Pipe (on the planned allocation) and the baselines for one job and prints, per
//! schedule, the step time and each worker's compute utilisation and exposed communication.
//!
//! `cargo run -p disagmoe-core --release --example simulate -- [MODEL] [CLUSTER] [SEQ]`
//! (defaults: `gpt-oss-120b h800x16 8192`, the workload of `docs/paper-reproduction.md`).

use disagmoe_core::cost::{CostModel, Workload};
use disagmoe_core::hardware::Cluster;
use disagmoe_core::model_shape::ModelShape;
use disagmoe_core::plan::{simulate_schedules, SCHEDULE_NAMES};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, default: &str| args.get(i).cloned().unwrap_or_else(|| default.to_string());
    let (model, cluster, seq) = (arg(0, "gpt-oss-120b"), arg(1, "h800x16"), arg(2, "8192").parse::<usize>()?);
    let cluster = Cluster::preset(&cluster)?;
    let micro_batch = (65_536 / seq).max(1);
    let workload = Workload { seq, micro_batch, global_batch: 2 * cluster.total_gpus() * micro_batch };
    let cost = CostModel::new(ModelShape::preset(&model)?, cluster, workload)?;
    let names: Vec<String> = SCHEDULE_NAMES.iter().map(|s| s.to_string()).collect();
    let (report, sims) = simulate_schedules(&cost, &names, None)?;
    for (r, sim) in report.schedules.iter().zip(&sims) {
        println!(
            "{:<17} step {:7.3} s, exposed comm {:6.3} s (bottleneck {:6.3} s), bubble {:6.3} s  [{}]",
            r.schedule, r.step_s, r.exposed_comm_s, r.bottleneck_exposed_comm_s, r.bubble_s, r.layout
        );
        for w in &sim.report.workers {
            println!(
                "    {:<8} {:4} GPUs: compute {:5.1}%, port {:5.1}%, exposed comm {:6.3} s, bubble {:6.3} s",
                w.worker,
                w.gpus,
                100.0 * w.compute_utilisation,
                100.0 * w.port_utilisation,
                w.exposed_comm_s,
                w.bubble_s
            );
        }
    }
    for f in &report.failures {
        println!("{:<17} not built: {}", f.schedule, f.error);
    }
    Ok(())
}
