use disagmoe_core::allocator::Allocation;
use disagmoe_core::cost::{CostModel, Workload};
use disagmoe_core::hardware::Cluster;
use disagmoe_core::model_shape::ModelShape;
use std::time::Instant;
fn main() {
    let seq = 8192;
    let mb = 65536 / seq;
    let a = Allocation {
        groups: 19,
        attention_gpus_per_group: 32,
        ffn_gpus_per_group: 16,
        attention_nics_per_group: 24,
        ffn_nics_per_group: 24,
    };
    let cluster = Cluster::preset("h800x128").unwrap();
    let w = Workload { seq, micro_batch: mb, global_batch: 2 * cluster.total_gpus() * mb };
    let cm = CostModel::new(ModelShape::preset("qwen3-235b-a22b").unwrap(), cluster, w).unwrap();
    for _ in 0..3 {
        let t = Instant::now();
        let s = disagmoe_core::schedule::afpipe::build_afpipe(&cm, &a).unwrap();
        let tb = t.elapsed();
        let t = Instant::now();
        let tr = disagmoe_core::simulator::simulate(&s).unwrap();
        println!("build {:?} sim {:?} step={:.12} ops {}", tb, t.elapsed(), tr.step_s, s.ops.len());
    }
}
