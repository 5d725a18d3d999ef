//! The operations of [`crate::cube`] (and [`crate::cpu`]) written in plain Burn tensor operations,
//! for any backend: the one definition of each. The models (`disagmoe-models`) run them wherever
//! [`crate::fused`] has no fused operation for the backend, and the kernels are tested against and
//! benchmarked beside them. Their matrix products go through [`crate::precision::matmul`] (the
//! low precision of a mixed-precision run, f32 otherwise).

use crate::documents::Documents;
use crate::precision::matmul;
use burn::tensor::activation::{sigmoid, silu, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, Int, Tensor, TensorData};

/// Causal (optionally windowed: query `i` sees keys `i - window < j <= i`) grouped-query
/// attention with optional per-head sinks (one more logit per head, its probability dropped),
/// optionally within documents (query `i` of row `b` also needs `j >= docs.start(b, i)`).
///
/// # Shapes
/// - q: `[B, S, H, D]`, k: `[B, S, G, D]`, v: `[B, S, G, E]`, sinks: `[H]` -> `[B, S, H, E]`;
///   docs over `[B, S]`
pub fn attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    sinks: Option<Tensor<B, 1>>,
    scale: f64,
    window: Option<usize>,
    docs: Option<&Documents>,
) -> Tensor<B, 4> {
    masked(q, k, v, sinks, scale, window, 0, 0, docs)
}

/// [`attention`] of queries at positions `q_start..` over keys at positions `k_start..` (a query
/// at `p` sees keys `p - window < j <= p`): incremental decoding, where the keys are the cached
/// ones plus the new.
///
/// # Shapes
/// - q: `[B, S, H, D]`, k: `[B, T, G, D]`, v: `[B, T, G, E]`, sinks: `[H]` -> `[B, S, H, E]`
#[allow(clippy::too_many_arguments)]
pub fn attention_at<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    sinks: Option<Tensor<B, 1>>,
    scale: f64,
    window: Option<usize>,
    q_start: usize,
    k_start: usize,
) -> Tensor<B, 4> {
    masked(q, k, v, sinks, scale, window, q_start, k_start, None)
}

/// Keys or values `[B, T, G, D]` of `G` groups repeated for the `H` query heads (grouped-query
/// attention), heads first: `[B, H, T, D]`.
pub(crate) fn heads<B: Backend>(x: Tensor<B, 4>, h: usize) -> Tensor<B, 4> {
    let [b, t, g, d] = x.dims();
    x.swap_dims(1, 2).unsqueeze_dim::<5>(2).expand([b, g, h / g, t, d]).reshape([b, h, t, d])
}

#[allow(clippy::too_many_arguments)]
fn masked<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    sinks: Option<Tensor<B, 1>>,
    scale: f64,
    window: Option<usize>,
    q_start: usize,
    k_start: usize,
    docs: Option<&Documents>,
) -> Tensor<B, 4> {
    let [b, s, h, _] = q.dims();
    let t = k.dims()[1];
    let device = q.device();
    let (q, k, v) = (q.swap_dims(1, 2), heads(k, h), heads(v, h));
    let scores = matmul(q, k.swap_dims(2, 3)).mul_scalar(scale); // [B, H, S, T], f32
    let w = window.unwrap_or(usize::MAX);
    let rows = if docs.is_some() { b } else { 1 };
    let mask: Vec<bool> = (0..rows * s * t)
        .map(|bij| {
            let (bi, ij) = (bij / (s * t), bij % (s * t));
            let (qp, kp) = (q_start + ij / t, k_start + ij % t);
            let other_document = docs.is_some_and(|d| kp < d.start(bi, qp));
            kp > qp || qp - kp >= w || other_document
        })
        .collect();
    let mask = Tensor::<B, 4, Bool>::from_data(TensorData::new(mask, [rows, 1, s, t]), &device);
    let scores = scores.mask_fill(mask.expand([b, h, s, t]), -1.0e9);
    let probs = match sinks {
        Some(sinks) => {
            let sink = sinks.reshape([1, h, 1, 1]).expand([b, h, s, 1]);
            softmax(Tensor::cat(vec![scores, sink], 3), 3).narrow(3, 0, t)
        }
        None => softmax(scores, 3),
    };
    matmul(probs, v).swap_dims(1, 2)
}

/// The stable counting sort of token-major expert ids: rows per expert, and for each sorted
/// position the slot `t k + j` it came from.
pub fn route(ids: &[usize], experts: usize) -> (Vec<usize>, Vec<usize>) {
    let mut counts = vec![0usize; experts];
    for &e in ids {
        counts[e] += 1;
    }
    let mut slots: Vec<usize> = (0..ids.len()).collect();
    slots.sort_by_key(|&s| ids[s]);
    (counts, slots)
}

fn index<B: Backend>(values: impl Iterator<Item = usize>, device: &B::Device) -> Tensor<B, 1, Int> {
    let v: Vec<i64> = values.map(|x| x as i64).collect();
    let n = v.len();
    Tensor::from_data(TensorData::new(v, [n]), device)
}

/// Row `p` = token `slots[p] / k`.
///
/// # Shapes
/// - x: `[T, M]` -> `[T k, M]`
pub fn permute_rows<B: Backend>(x: Tensor<B, 2>, slots: &[usize], k: usize) -> Tensor<B, 2> {
    let device = x.device();
    x.select(0, index::<B>(slots.iter().map(|s| s / k), &device))
}

/// Gate-weighted sum of each token's `k` rows back in token order.
///
/// # Shapes
/// - ys: `[T k, M]`; weights: `[T, k]` -> `[T, M]`
pub fn combine_rows<B: Backend>(ys: Tensor<B, 2>, weights: Tensor<B, 2>, slots: &[usize]) -> Tensor<B, 2> {
    let [t, k] = weights.dims();
    let [n, m] = ys.dims();
    let device = ys.device();
    let w = weights.reshape([t * k]).select(0, index::<B>(slots.iter().copied(), &device)).reshape([n, 1]);
    let tokens = index::<B>(slots.iter().map(|s| s / k), &device);
    Tensor::zeros([t, m], &device).select_assign(0, tokens, ys * w, burn::tensor::IndexingUpdateOp::Add)
}

fn per_expert<B: Backend>(
    xs: Tensor<B, 2>,
    counts: &[usize],
    mut f: impl FnMut(usize, Tensor<B, 2>) -> Tensor<B, 2>,
) -> Tensor<B, 2> {
    let mut outs = Vec::new();
    let mut start = 0;
    for (e, &c) in counts.iter().enumerate() {
        if c > 0 {
            outs.push(f(e, xs.clone().narrow(0, start, c)));
        }
        start += c;
    }
    Tensor::cat(outs, 0)
}

/// SwiGLU experts one after another: `down(silu(x gate^T) * x up^T)`.
///
/// # Shapes
/// - xs: `[N, M]` grouped by `counts`; per expert gate/up `[I, M]`, down `[M, I]` -> `[N, M]`
#[allow(clippy::type_complexity)]
pub fn swiglu_experts<B: Backend>(
    xs: Tensor<B, 2>,
    counts: &[usize],
    experts: &[(Tensor<B, 2>, Tensor<B, 2>, Tensor<B, 2>)],
) -> Tensor<B, 2> {
    per_expert(xs, counts, |e, x| {
        let (g, u, d) = &experts[e];
        let h = silu(matmul(x.clone(), g.clone().transpose())) * matmul(x, u.clone().transpose());
        matmul(h, d.clone().transpose())
    })
}

/// GPT-OSS's clamped SwiGLU over interleaved gate/up columns (as the model computes it).
pub fn clamped_swiglu<B: Backend>(gate_up: Tensor<B, 2>, alpha: f64, limit: f64) -> Tensor<B, 2> {
    let [n, two_i] = gate_up.dims();
    let pairs = gate_up.reshape([n, two_i / 2, 2]);
    let gate = pairs.clone().narrow(2, 0, 1).reshape([n, two_i / 2]).clamp_max(limit);
    let up = pairs.narrow(2, 1, 1).reshape([n, two_i / 2]).clamp(-limit, limit);
    let glu = gate.clone() * sigmoid(gate.mul_scalar(alpha));
    up.add_scalar(1.0) * glu
}

/// GPT-OSS's experts one after another.
///
/// # Shapes
/// - xs: `[N, M]`; gate_up: `[E, M, 2I]`; gate_up_bias: `[E, 2I]`; down: `[E, I, M]`;
///   down_bias: `[E, M]` -> `[N, M]`
#[allow(clippy::too_many_arguments)]
pub fn gpt_oss_experts<B: Backend>(
    xs: Tensor<B, 2>,
    counts: &[usize],
    gate_up: Tensor<B, 3>,
    gate_up_bias: Tensor<B, 2>,
    down: Tensor<B, 3>,
    down_bias: Tensor<B, 2>,
    alpha: f64,
    limit: f64,
) -> Tensor<B, 2> {
    let [_, m, two_i] = gate_up.dims();
    let i = two_i / 2;
    per_expert(xs, counts, |e, x| {
        let w = gate_up.clone().narrow(0, e, 1).reshape([m, two_i]);
        let h = clamped_swiglu(matmul(x, w) + gate_up_bias.clone().narrow(0, e, 1), alpha, limit);
        matmul(h, down.clone().narrow(0, e, 1).reshape([i, m])) + down_bias.clone().narrow(0, e, 1)
    })
}
