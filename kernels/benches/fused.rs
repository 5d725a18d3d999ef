//! Fused CPU operations against their reference compositions of Burn operations, forward and
//! backward, at the shapes of the issue-#8 model (batch 4 x 256 tokens, 8 query / 2 key-value
//! heads of 32, width 256, vocabulary 4096): `cargo bench -p disagmoe-kernels --features flex`.

use burn::backend::{Autodiff, Flex};
use burn::tensor::activation::{log_softmax, silu, softmax};
use burn::tensor::{Bool, Distribution, Int, Tensor, TensorData};
use criterion::{criterion_group, criterion_main, Criterion};
use disagmoe_kernels::cpu;

type B = Autodiff<Flex>;

const BATCH: usize = 4;
const SEQ: usize = 256;
const HEADS: usize = 8;
const KV: usize = 2;
const DIM: usize = 32;
const WIDTH: usize = 256;
const VOCAB: usize = 4096;

fn rand<const D: usize>(shape: [usize; D]) -> Tensor<B, D> {
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), &Default::default()).require_grad()
}

fn reference_attention(q: Tensor<B, 4>, k: Tensor<B, 4>, v: Tensor<B, 4>) -> Tensor<B, 4> {
    let n = HEADS / KV;
    let rep = |x: Tensor<B, 4>| {
        let x = x.swap_dims(1, 2); // [B, G, S, D]
        x.unsqueeze_dim::<5>(2).expand([BATCH, KV, n, SEQ, DIM]).reshape([BATCH, HEADS, SEQ, DIM])
    };
    let q = q.swap_dims(1, 2);
    let (k, v) = (rep(k), rep(v));
    let scores = q.matmul(k.swap_dims(2, 3)).mul_scalar((DIM as f64).powf(-0.5));
    let mask: Vec<bool> = (0..SEQ * SEQ).map(|ij| ij % SEQ > ij / SEQ).collect();
    let mask = Tensor::<B, 2, Bool>::from_data(TensorData::new(mask, [SEQ, SEQ]), &Default::default());
    let scores = scores.mask_fill(mask.unsqueeze::<4>().expand([BATCH, HEADS, SEQ, SEQ]), -1.0e9);
    softmax(scores, 3).matmul(v).swap_dims(1, 2)
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("fwd+bwd");
    g.sample_size(20);
    let (q, k, v) = (rand([BATCH, SEQ, HEADS, DIM]), rand([BATCH, SEQ, KV, DIM]), rand([BATCH, SEQ, KV, DIM]));
    g.bench_function("attention/fused", |b| {
        b.iter(|| {
            let o = cpu::attention(q.clone(), k.clone(), v.clone(), None, (DIM as f64).powf(-0.5), None, None).unwrap();
            o.sum().backward()
        })
    });
    g.bench_function("attention/reference", |b| {
        b.iter(|| reference_attention(q.clone(), k.clone(), v.clone()).sum().backward())
    });

    let x = rand([BATCH, SEQ, WIDTH]);
    let w = rand([WIDTH]);
    g.bench_function("rms_norm/fused", |b| {
        b.iter(|| cpu::rms_norm(x.clone(), w.clone(), 1e-6).unwrap().sum().backward())
    });
    g.bench_function("rms_norm/reference", |b| {
        b.iter(|| {
            let inv = x.clone().square().mean_dim(2).add_scalar(1e-6).sqrt().recip();
            (x.clone() * inv * w.clone().unsqueeze::<3>()).sum().backward()
        })
    });

    let (gt, ut) = (rand([2 * BATCH * SEQ, WIDTH]), rand([2 * BATCH * SEQ, WIDTH]));
    g.bench_function("swiglu/fused", |b| b.iter(|| cpu::swiglu(gt.clone(), ut.clone()).unwrap().sum().backward()));
    g.bench_function("swiglu/reference", |b| b.iter(|| (silu(gt.clone()) * ut.clone()).sum().backward()));

    let logits = rand([BATCH, SEQ, VOCAB]);
    let labels: Vec<usize> = (0..BATCH * (SEQ - 1)).map(|i| (i * 7919) % VOCAB).collect();
    let ids = Tensor::<B, 2, Int>::from_data(
        TensorData::new(labels.iter().map(|&l| l as i64).collect::<Vec<_>>(), [BATCH, SEQ - 1]),
        &Default::default(),
    );
    g.bench_function("cross_entropy/fused", |b| {
        b.iter(|| cpu::next_token_cross_entropy(logits.clone(), &labels, None).unwrap().backward())
    });
    g.bench_function("cross_entropy/reference", |b| {
        b.iter(|| {
            let n = BATCH * (SEQ - 1);
            let logp = log_softmax(logits.clone().narrow(1, 0, SEQ - 1).reshape([n, VOCAB]), 1);
            logp.gather(1, ids.clone().reshape([n, 1])).mean().neg().backward()
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
