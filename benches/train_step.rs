//! One training step of the issue-#8 model (`benches/qwen3-moe-cpu.json`: 4 layers, 16 experts
//! top-2, batch 4 x 256 tokens) on the default CPU backend: forward, loss with the aux term,
//! backward, gradient norm, AdamW. `fused` uses the fused CPU operations (the default), `reference`
//! the plain Burn compositions they replace.
//!
//!     cargo bench -p disagmoe --bench train_step

use burn::optim::GradientsParams;
use criterion::{criterion_group, criterion_main, Criterion};
use disagmoe::kernels::cpu;
use disagmoe::models::{ModelConfig, MoeCausalLm};
use disagmoe::train::backend::TrainBackend;
use disagmoe::train::optim::{grad_norm, AdamW};
use disagmoe::train::RunConfig;

const BATCH: usize = 4;
const SEQ: usize = 256;

fn step(
    model: MoeCausalLm<TrainBackend>,
    opt: &mut AdamW<TrainBackend>,
    rows: &[Vec<i64>],
) -> MoeCausalLm<TrainBackend> {
    let device = Default::default();
    let ids = model.input_ids(rows, &device).expect("token ids in the vocabulary");
    let out = model.forward(ids.clone());
    let loss = model.loss(&out, ids, true);
    let mut grads = GradientsParams::from_grads(loss.total.backward(), &model);
    let norm = grad_norm::<TrainBackend, _>(&model, &grads).total;
    let scale = if norm > 1.0 { 1.0 / (norm + 1e-6) } else { 1.0 };
    opt.step(model, &mut grads, 3e-4, scale)
}

fn bench(c: &mut Criterion) {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/qwen3-moe-cpu.json");
    let config = ModelConfig::from_file(path).expect("benches/qwen3-moe-cpu.json");
    let vocab = 4096;
    let rows: Vec<Vec<i64>> =
        (0..BATCH).map(|b| (0..SEQ).map(|t| ((b * 7919 + t * 104_729) % vocab) as i64).collect()).collect();
    disagmoe::train::backend::keep_freed_memory(); // as the trainer does
    let mut group = c.benchmark_group("train_step");
    group.sample_size(10);
    for (name, fused) in [("fused", true), ("reference", false)] {
        cpu::set_enabled_for_thread(Some(fused));
        let mut model = Some(config.init::<TrainBackend>(42, &Default::default()));
        let mut opt = AdamW::new(RunConfig::default().optimizer.adamw());
        group.bench_function(name, |b| {
            b.iter(|| {
                let m = model.take().expect("model");
                model = Some(step(m, &mut opt, &rows));
            })
        });
    }
    cpu::set_enabled_for_thread(None);
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
