//! Each CubeCL kernel against its reference in plain Burn operations, forward and backward, on
//! the runtime present: Burn's WebGPU/Vulkan backend (`--features wgpu`, the default; on a
//! machine without a GPU that is Mesa's lavapipe, a CPU driver: the figures then say how the two
//! paths compare there, not what a GPU does) or CUDA (`--features cuda`). The GPU figures against
//! measured ceilings come from `scripts/gpu-check.sh`.
//!
//! `cargo bench -p disagmoe-kernels --bench cube`

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use criterion::{criterion_group, criterion_main, Criterion};
use disagmoe_kernels::{cube, reference};

#[cfg(feature = "cuda")]
type Inner = cube::CudaCube;
#[cfg(all(feature = "wgpu", not(feature = "cuda")))]
type Inner = cube::WgpuCube;
type B = Autodiff<Inner>;

fn rand<const D: usize>(shape: [usize; D], seed: u64) -> Tensor<B, D> {
    let n: usize = shape.iter().product();
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    let v: Vec<f32> = (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 11) as f64 / (1u64 << 53) as f64 - 0.5) as f32
        })
        .collect();
    Tensor::from_data(TensorData::new(v, shape), &Default::default())
}

/// Forward, a scalar loss and the backward, then waits for the device.
fn step(out: Tensor<B, 2>) {
    let grads = out.sum().backward();
    drop(grads);
    <Inner as Backend>::sync(&Default::default()).expect("device sync");
}

fn attention(c: &mut Criterion) {
    // (batch, seq, heads, kv heads, head dim)
    let (b, s, h, g, d) = (1, 256, 8, 2, 64);
    let q = rand([b, s, h, d], 1).require_grad();
    let k = rand([b, s, g, d], 2).require_grad();
    let v = rand([b, s, g, d], 3).require_grad();
    let scale = 1.0 / (d as f64).sqrt();
    let mut group = c.benchmark_group(format!("attention_fwd_bwd/b{b}_s{s}_h{h}_g{g}_d{d}"));
    group.sample_size(10);
    group.bench_function("kernel", |bench| {
        bench.iter(|| {
            let o = cube::attention(q.clone(), k.clone(), v.clone(), None, scale, None, None).expect("kernel applies");
            step(o.reshape([b * s, h * d]))
        })
    });
    group.bench_function("reference", |bench| {
        bench.iter(|| {
            step(reference::attention(q.clone(), k.clone(), v.clone(), None, scale, None, None).reshape([b * s, h * d]))
        })
    });
    group.finish();
}

fn experts(c: &mut Criterion) {
    // rows (tokens x top-k), hidden, expert size, experts
    let (n, m, i, e) = (1024, 256, 256, 8);
    let counts: Vec<usize> = (0..e).map(|x| if x == e - 1 { n - (e - 1) * (n / e) } else { n / e }).collect();
    let xs = rand([n, m], 4).require_grad();
    let weights: Vec<_> = (0..e as u64)
        .map(|x| {
            (
                rand([i, m], 10 + x).require_grad(),
                rand([i, m], 20 + x).require_grad(),
                rand([m, i], 30 + x).require_grad(),
            )
        })
        .collect();
    let mut group = c.benchmark_group(format!("swiglu_experts_fwd_bwd/n{n}_m{m}_i{i}_e{e}"));
    group.sample_size(10);
    group.bench_function("kernel", |bench| {
        bench.iter(|| step(cube::swiglu_experts(xs.clone(), &counts, &weights).expect("kernel applies")))
    });
    group.bench_function("reference", |bench| {
        bench.iter(|| step(reference::swiglu_experts(xs.clone(), &counts, &weights)))
    });
    group.finish();
}

fn dispatch(c: &mut Criterion) {
    // tokens, top-k, hidden, experts
    let (t, k, m, e) = (2048, 4, 256, 16);
    let ids: Vec<usize> = (0..t * k).map(|s| (s * 7 + s / 5) % e).collect();
    let (_, slots) = reference::route(&ids, e);
    let x = rand([t, m], 5).require_grad();
    let w = rand([t, k], 6).require_grad();
    let mut group = c.benchmark_group(format!("permute_combine_fwd_bwd/t{t}_k{k}_m{m}"));
    group.sample_size(10);
    group.bench_function("kernel", |bench| {
        bench.iter(|| {
            let xs = cube::permute_rows(x.clone(), &slots, k).expect("kernel applies");
            step(cube::combine_rows(xs, w.clone(), &slots).expect("kernel applies"))
        })
    });
    group.bench_function("reference", |bench| {
        bench.iter(|| {
            let xs = reference::permute_rows(x.clone(), &slots, k);
            step(reference::combine_rows(xs, w.clone(), &slots))
        })
    });
    group.finish();
    let ids_t = Tensor::<Inner, 1, burn::tensor::Int>::from_data(
        TensorData::new(ids.iter().map(|&x| x as i32).collect::<Vec<_>>(), [t * k]),
        &Default::default(),
    );
    let mut group = c.benchmark_group(format!("route/n{}_e{e}", t * k));
    group.sample_size(10);
    group.bench_function("kernel", |bench| {
        bench.iter(|| {
            let r = cube::route(ids_t.clone(), e).expect("kernel applies");
            <Inner as Backend>::sync(&Default::default()).expect("device sync");
            r
        })
    });
    group.bench_function("host_sort_and_upload", |bench| {
        bench.iter(|| {
            let host = ids_t.clone().into_data().convert::<i64>().to_vec::<i64>().unwrap();
            let ids: Vec<usize> = host.into_iter().map(|x| x as usize).collect();
            let (_, slots) = reference::route(&ids, e);
            let v: Vec<i32> = slots.iter().map(|&s| s as i32).collect();
            let up = Tensor::<Inner, 1, burn::tensor::Int>::from_data(TensorData::new(v, [t * k]), &Default::default());
            <Inner as Backend>::sync(&Default::default()).expect("device sync");
            up
        })
    });
    group.finish();
}

criterion_group!(benches, attention, experts, dispatch);
criterion_main!(benches);
