//! Fused operations for Burn's CPU backend `flex`, with their autodiff backward.
//!
//! Burn runs a layer as a chain of small tensor operations, each a pass over memory and a fresh
//! allocation, most of them on one thread; its autodiff records each one. On a CPU that chain, not
//! the matrix products, is where a training step's time went. These operations do one pass
//! each, over rows or heads in parallel, and record one autodiff node:
//!
//! - [`attention`]: causal (optionally windowed) grouped-query attention in the `[B, S, H, D]`
//!   layout the projections produce, so no head transpose is ever copied; tiles of 64 query rows
//!   stop at their last key, softmax in place, probabilities kept for the backward;
//! - [`rms_norm`], [`swiglu`] (`silu(g) * u`), [`rope`] (half-split rotary embedding);
//! - [`next_token_cross_entropy`]: loss and its gradient in one pass over the logits.
//!
//! Each function returns `None` when it does not apply: the backend is not `Flex` or
//! `Autodiff<Flex>`, the tensors are not f32, the shapes are outside what it handles, or fused
//! operations are switched off ([`set_enabled`], [`set_enabled_for_thread`], or the environment
//! variable `DISAGMOE_KERNELS=reference`). The caller then runs its reference composition of
//! Burn operations, which stays the definition the tests hold these to.

mod ops;
pub mod vector;

use std::any::TypeId;
use std::sync::{Arc, Mutex};

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::Autodiff;
use burn::backend::flex::{Flex, FlexTensor};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor, TensorData, TensorPrimitive};

pub use ops::{AttnShape, ExpertsShape, GptOssShape};
pub use vector::AdamWScalars;

type Ad = Autodiff<Flex>;

use crate::documents::Documents;
use crate::{cast, Kind};
pub use crate::{enabled, set_enabled, set_enabled_for_thread};

/// The one place that decides whether a backend gets the fused operations.
fn kind<B: Backend>() -> Option<Kind> {
    if !enabled() {
        return None;
    }
    if TypeId::of::<B>() == TypeId::of::<Ad>() {
        Some(Kind::Autodiff)
    } else if TypeId::of::<B>() == TypeId::of::<Flex>() {
        Some(Kind::Plain)
    } else {
        None
    }
}

/// Whether the fused operations apply to backend `B` on this thread.
pub fn available<B: Backend>() -> bool {
    kind::<B>().is_some()
}

/// One input of a fused operation: its values (contiguous f32) and, under autodiff, its node.
struct Input {
    values: FlexTensor,
    node: Option<FloatTensor<Ad>>,
}

impl Input {
    fn data(&self) -> &[f32] {
        self.values.as_slice::<f32>().expect("contiguous f32, checked on entry")
    }
}

fn take<B: Backend, const D: usize>(kind: Kind, t: Tensor<B, D>) -> Option<Input> {
    let (values, node) = match kind {
        Kind::Autodiff => {
            let prim: FloatTensor<Ad> = cast::<_, Tensor<Ad, D>>(t).into_primitive().tensor();
            (prim.primitive.clone(), Some(prim))
        }
        Kind::Plain => (cast::<_, Tensor<Flex, D>>(t).into_primitive().tensor(), None),
    };
    if values.dtype() != DType::F32 {
        return None;
    }
    let values = values.to_contiguous();
    values.as_slice::<f32>()?;
    Some(Input { values, node })
}

fn flex(values: Vec<f32>, shape: &[usize]) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape.to_vec()))
}

/// The backward of a fused operation: from the output gradient and which inputs want a
/// gradient, the input gradients.
type BackwardFn<const N: usize> = Box<dyn FnOnce(&[f32], [bool; N]) -> [Option<FlexTensor>; N] + Send>;

/// The backward of a fused operation, kept until the graph runs it.
#[derive(Clone)]
struct Pending<const N: usize>(Arc<Mutex<Option<BackwardFn<N>>>>);

impl<const N: usize> std::fmt::Debug for Pending<N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("fused backward")
    }
}

#[derive(Debug)]
struct Fused<const N: usize>;

impl<const N: usize> Backward<Flex, N> for Fused<N> {
    type State = Pending<N>;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<Flex>(&ops.node).to_contiguous();
        let f = ops.state.0.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(f) = f else { return };
        let wanted = ops.parents.each_ref().map(Option::is_some);
        let outs = f(grad.as_slice::<f32>().expect("f32 gradient"), wanted);
        for (parent, g) in ops.parents.into_iter().zip(outs) {
            if let (Some(node), Some(g)) = (parent, g) {
                grads.register::<Flex>(node.id, g);
            }
        }
    }
}

/// Wraps a fused forward's output as a tensor of `B`, recording `backward` when any input is
/// tracked.
fn finish<B: Backend, const D: usize, const N: usize>(
    kind: Kind,
    inputs: [&Input; N],
    out: FlexTensor,
    backward: impl FnOnce(&[f32], [bool; N]) -> [Option<FlexTensor>; N] + Send + 'static,
) -> Tensor<B, D> {
    match kind {
        Kind::Plain => cast(Tensor::<Flex, D>::from_primitive(TensorPrimitive::Float(out))),
        Kind::Autodiff => {
            let nodes = inputs.map(|i| i.node.as_ref().expect("autodiff input").node.clone());
            let prim = match Fused::<N>.prepare::<NoCheckpointing>(nodes).compute_bound().stateful() {
                OpsKind::Tracked(prep) => prep.finish(Pending(Arc::new(Mutex::new(Some(Box::new(backward))))), out),
                OpsKind::UnTracked(prep) => prep.finish(out),
            };
            cast(Tensor::<Ad, D>::from_primitive(TensorPrimitive::Float(prim)))
        }
    }
}

/// GPT-OSS's experts over rows of `xs` grouped by `counts`, in the checkpoint's fused layout: the
/// same as [`crate::reference::gpt_oss_experts`], as one autodiff node whose backward writes each
/// weight gradient once (the reference's slice per expert makes a full-size gradient per expert).
///
/// # Shapes
/// - xs: `[N, M]` with `N = sum(counts)`; gate_up: `[E, M, 2I]` (gate/up columns interleaved);
///   gate_up_bias: `[E, 2I]`; down: `[E, I, M]`; down_bias: `[E, M]`
/// - output: `[N, M]`
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
) -> Option<Tensor<B, 2>> {
    let kind = kind::<B>()?;
    let [n, m] = xs.dims();
    let [ne, gm, two_i] = gate_up.dims();
    let i = two_i / 2;
    let shapes_ok = gm == m
        && two_i % 2 == 0
        && gate_up_bias.dims() == [ne, two_i]
        && down.dims() == [ne, i, m]
        && down_bias.dims() == [ne, m];
    if !shapes_ok || counts.len() != ne || counts.iter().sum::<usize>() != n || n == 0 {
        return None;
    }
    let shape = GptOssShape {
        experts: ExpertsShape { counts: counts.to_vec(), width: m, inter: i },
        alpha: alpha as f32,
        limit: limit as f32,
    };
    let inputs =
        [take(kind, xs)?, take(kind, gate_up)?, take(kind, gate_up_bias)?, take(kind, down)?, take(kind, down_bias)?];
    let [xs, gu, gub, d, db] = &inputs;
    let [ys, pre, act] = ops::gpt_oss_forward(xs.data(), gu.data(), gub.data(), d.data(), db.data(), &shape);
    let out = flex(ys, &[n, m]);
    let saved = (xs.values.clone(), gu.values.clone(), d.values.clone());
    Some(finish::<B, 2, 5>(kind, [xs, gu, gub, d, db], out, move |dys, _| {
        let (xv, guv, dv) = &saved;
        fn sl(t: &FlexTensor) -> &[f32] {
            t.as_slice::<f32>().expect("f32")
        }
        let [dxs, dgu, dgub, dd, ddb] = ops::gpt_oss_backward(sl(xv), sl(guv), sl(dv), &pre, &act, dys, &shape);
        [
            Some(flex(dxs, &[n, m])),
            Some(flex(dgu, &[ne, m, two_i])),
            Some(flex(dgub, &[ne, two_i])),
            Some(flex(dd, &[ne, i, m])),
            Some(flex(ddb, &[ne, m])),
        ]
    }))
}

/// Causal grouped-query attention in the projection layout, optionally with per-head sinks.
///
/// # Shapes
/// - q: `[B, S, H, D]`, k: `[B, S, G, D]`, v: `[B, S, G, E]` with `H % G == 0`; sinks: `[H]`
/// - output: `[B, S, H, E]`
///
/// `softmax(q k^T * scale)` over keys `q - window < k <= q` (all earlier keys without a window),
/// within the query's document with `docs`; with sinks, head `h`'s logit `sinks[h]` joins every
/// row's softmax and its mass is dropped.
pub fn attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    sinks: Option<Tensor<B, 1>>,
    scale: f64,
    window: Option<usize>,
    docs: Option<&Documents>,
) -> Option<Tensor<B, 4>> {
    let kind = kind::<B>()?;
    let ([b, s, h, d], [kb, ks, g, kd], [vb, vs, vg, e]) = (q.dims(), k.dims(), v.dims());
    if g == 0 || h % g != 0 || (kb, ks, kd) != (b, s, d) || (vb, vs, vg) != (b, s, g) || window == Some(0) {
        return None;
    }
    if sinks.as_ref().is_some_and(|t| t.dims() != [h]) || docs.is_some_and(|d| (d.batch(), d.seq()) != (b, s)) {
        return None;
    }
    let starts: Option<Vec<u32>> = docs.filter(|d| !d.is_whole()).map(|d| d.bounds()[..b * s].to_vec());
    let shape = AttnShape { batch: b, seq: s, heads: h, kv_heads: g, qk_dim: d, v_dim: e, window, scale: scale as f32 };
    let (q, k, v) = (take(kind, q)?, take(kind, k)?, take(kind, v)?);
    let sinks = match sinks {
        Some(t) => Some(take(kind, t)?),
        None => None,
    };
    let (out, probs) =
        ops::attention_forward(q.data(), k.data(), v.data(), sinks.as_ref().map(Input::data), starts.as_deref(), shape);
    let out = flex(out, &[b, s, h, e]);
    let (qv, kv, vv) = (q.values.clone(), k.values.clone(), v.values.clone());
    let backward = move |dout: &[f32]| {
        ops::attention_backward(
            qv.as_slice::<f32>().expect("f32"),
            kv.as_slice::<f32>().expect("f32"),
            vv.as_slice::<f32>().expect("f32"),
            &probs,
            dout,
            starts.as_deref(),
            shape,
        )
    };
    let grads =
        move |dq, dk, dv| [Some(flex(dq, &[b, s, h, d])), Some(flex(dk, &[b, s, g, d])), Some(flex(dv, &[b, s, g, e]))];
    Some(match &sinks {
        None => finish::<B, 4, 3>(kind, [&q, &k, &v], out, move |dout, _| {
            let (dq, dk, dv, _) = backward(dout);
            grads(dq, dk, dv)
        }),
        Some(sk) => finish::<B, 4, 4>(kind, [&q, &k, &v, sk], out, move |dout, _| {
            let (dq, dk, dv, ds) = backward(dout);
            let [a, b2, c] = grads(dq, dk, dv);
            [a, b2, c, Some(flex(ds, &[h]))]
        }),
    })
}

/// One block of ring attention (`crate::ring::partial`): queries at positions
/// `q_start..q_start + Sq` over keys at `k_start..k_start + Tk` of sequences of `seq` tokens,
/// causal, windowed and within documents as [`attention`], without sinks. Returns the output
/// `[B, Sq, H, E]` normalised over the block's keys and its log-sum-exp `[B, H, Sq, 1]` (`empty`
/// for a row that sees no key, whose output is 0), both differentiable; the probabilities kept for
/// the backward are the block's, `[B, H, Sq, Tk]`.
///
/// # Shapes
/// - q: `[B, Sq, H, D]`, k: `[B, Tk, G, D]`, v: `[B, Tk, G, E]` with `H % G == 0`; docs over
///   `[B, seq]`
#[allow(clippy::too_many_arguments)]
pub fn attention_block<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    scale: f64,
    window: Option<usize>,
    docs: Option<&Documents>,
    [seq, q_start, k_start]: [usize; 3],
    empty: f32,
) -> Option<(Tensor<B, 4>, Tensor<B, 4>)> {
    let kind = kind::<B>()?;
    if !crate::ring::block_fits([q.dims(), k.dims(), v.dims()], window, docs, [seq, q_start, k_start]) {
        return None;
    }
    let ([b, sq, h, d], [_, tk, g, _], [.., e]) = (q.dims(), k.dims(), v.dims());
    let starts: Option<Vec<u32>> = docs.filter(|d| !d.is_whole()).map(|d| d.bounds()[..b * seq].to_vec());
    let shape = ops::BlockShape {
        batch: b,
        seq,
        q_start,
        sq,
        k_start,
        tk,
        heads: h,
        kv_heads: g,
        qk_dim: d,
        v_dim: e,
        window,
        scale: scale as f32,
        empty,
    };
    let (qi, ki, vi) = (take(kind, q)?, take(kind, k)?, take(kind, v)?);
    let (out, probs, lse) = ops::attention_block_forward(qi.data(), ki.data(), vi.data(), starts.as_deref(), shape);
    // One node of two outputs: the output and the log-sum-exp side by side, `[B, Sq, H, E + 1]`.
    let mut packed = Vec::with_capacity(b * sq * h * (e + 1));
    for bi in 0..b {
        for i in 0..sq {
            for hi in 0..h {
                let at = ((bi * sq + i) * h + hi) * e;
                packed.extend_from_slice(&out[at..at + e]);
                packed.push(lse[(bi * h + hi) * sq + i]);
            }
        }
    }
    let (qv, kv, vv) = (qi.values.clone(), ki.values.clone(), vi.values.clone());
    let both = finish::<B, 4, 3>(kind, [&qi, &ki, &vi], flex(packed, &[b, sq, h, e + 1]), move |dpacked, _| {
        let mut dout = Vec::with_capacity(b * sq * h * e);
        let mut dlse = vec![0f32; b * h * sq];
        for (r, row) in dpacked.chunks_exact(e + 1).enumerate() {
            let (bi, i, hi) = (r / (sq * h), (r / h) % sq, r % h);
            dout.extend_from_slice(&row[..e]);
            dlse[(bi * h + hi) * sq + i] = row[e];
        }
        let (dq, dk, dv) = ops::attention_block_backward(
            qv.as_slice::<f32>().expect("f32"),
            kv.as_slice::<f32>().expect("f32"),
            vv.as_slice::<f32>().expect("f32"),
            &probs,
            &dout,
            &dlse,
            starts.as_deref(),
            shape,
        );
        [Some(flex(dq, &[b, sq, h, d])), Some(flex(dk, &[b, tk, g, d])), Some(flex(dv, &[b, tk, g, e]))]
    });
    let out = both.clone().narrow(3, 0, e);
    let lse = both.narrow(3, e, 1).swap_dims(1, 2); // [B, H, Sq, 1]
    Some((out, lse))
}

/// RMSNorm over the last dimension: `x / sqrt(mean(x^2) + eps) * w`.
///
/// # Shapes
/// - x: `[..., N]`, w: `[N]` -> `[..., N]`
pub fn rms_norm<B: Backend, const D: usize>(x: Tensor<B, D>, w: Tensor<B, 1>, eps: f64) -> Option<Tensor<B, D>> {
    let kind = kind::<B>()?;
    let shape = x.dims();
    let [n] = w.dims();
    if shape[D - 1] != n || n == 0 {
        return None;
    }
    let (x, w) = (take(kind, x)?, take(kind, w)?);
    let (out, inv) = ops::rms_norm_forward(x.data(), w.data(), eps as f32);
    let out = flex(out, &shape);
    let (xv, wv) = (x.values.clone(), w.values.clone());
    Some(finish::<B, D, 2>(kind, [&x, &w], out, move |dy, _| {
        let (dx, dw) =
            ops::rms_norm_backward(xv.as_slice::<f32>().expect("f32"), wv.as_slice::<f32>().expect("f32"), &inv, dy);
        [Some(flex(dx, &shape)), Some(flex(dw, &[n]))]
    }))
}

/// The SwiGLU activation `silu(g) * u`, elementwise.
pub fn swiglu<B: Backend, const D: usize>(g: Tensor<B, D>, u: Tensor<B, D>) -> Option<Tensor<B, D>> {
    let kind = kind::<B>()?;
    let shape = g.dims();
    if u.dims() != shape {
        return None;
    }
    let (g, u) = (take(kind, g)?, take(kind, u)?);
    let out = flex(ops::swiglu_forward(g.data(), u.data()), &shape);
    let (gv, uv) = (g.values.clone(), u.values.clone());
    Some(finish::<B, D, 2>(kind, [&g, &u], out, move |dh, _| {
        let (dg, du) = ops::swiglu_backward(gv.as_slice::<f32>().expect("f32"), uv.as_slice::<f32>().expect("f32"), dh);
        [Some(flex(dg, &shape)), Some(flex(du, &shape))]
    }))
}

/// Half-split rotary embedding (`x * cos + rotate_half(x) * sin`) in the projection layout.
///
/// # Shapes
/// - x: `[B, S, H, D]`; cos, sin: `[1, 1, S, D]` (constants: no gradient flows into them)
pub fn rope<B: Backend>(x: Tensor<B, 4>, cos: Tensor<B, 4>, sin: Tensor<B, 4>) -> Option<Tensor<B, 4>> {
    let kind = kind::<B>()?;
    let shape = x.dims();
    let [_, s, h, d] = shape;
    if cos.dims() != [1, 1, s, d] || sin.dims() != [1, 1, s, d] || d % 2 != 0 {
        return None;
    }
    let x = take(kind, x)?;
    let (cos, sin) = (take(kind, cos.detach())?, take(kind, sin.detach())?);
    let out = flex(ops::rope(x.data(), cos.data(), sin.data(), s, h, false), &shape);
    let (cv, sv) = (cos.values.clone(), sin.values.clone());
    Some(finish::<B, 4, 1>(kind, [&x], out, move |dy, _| {
        let dx = ops::rope(dy, cv.as_slice::<f32>().expect("f32"), sv.as_slice::<f32>().expect("f32"), s, h, true);
        [Some(flex(dx, &shape))]
    }))
}

/// Mean next-token cross-entropy: position `t` of each sequence predicts `labels[b][t]` (the
/// token at `t + 1`); the last position predicts nothing, nor do the positions `ignore` marks
/// (the mean is over the others).
///
/// # Shapes
/// - logits: `[B, S, V]`; labels, ignore: `B * (S - 1)` token ids and marks, row-major
/// - output: `[1]`
pub fn next_token_cross_entropy<B: Backend>(
    logits: Tensor<B, 3>,
    labels: &[usize],
    ignore: Option<&[bool]>,
) -> Option<Tensor<B, 1>> {
    let kind = kind::<B>()?;
    let shape = logits.dims();
    let [b, s, v] = shape;
    let n = b * s.saturating_sub(1);
    if s < 2 || labels.len() != n || labels.iter().any(|&l| l >= v) || ignore.is_some_and(|m| m.len() != n) {
        return None;
    }
    let logits = take(kind, logits)?;
    let (loss, grad) = ops::cross_entropy(logits.data(), labels, ignore, b, s, v);
    let out = flex(vec![loss as f32], &[1]);
    Some(finish::<B, 1, 1>(kind, [&logits], out, move |dl, _| {
        let mut grad = grad;
        let scale = dl[0];
        if scale != 1.0 {
            vector::scale(&mut grad, scale);
        }
        [Some(flex(grad, &shape))]
    }))
}

/// One AdamW update of a parameter on the plain `Flex` backend (the optimizer works on the inner
/// backend): returns the new parameter and moments (flattened, `[n]`). Moments start at zero when
/// `None`. The gradient may be a strided view (the gradient of a transposed weight is one); it is
/// read in place.
pub fn adamw<B: Backend, const D: usize>(
    param: Tensor<B, D>,
    grad: Tensor<B, D>,
    moments: Option<(Tensor<B, 1>, Tensor<B, 1>)>,
    s: AdamWScalars,
) -> Option<(Tensor<B, D>, Tensor<B, 1>, Tensor<B, 1>)> {
    if kind::<B>()? != Kind::Plain {
        return None;
    }
    let shape = param.dims();
    if grad.dims() != shape {
        return None;
    }
    let n: usize = shape.iter().product();
    let f32s = param.dtype() == DType::F32 && grad.dtype() == DType::F32;
    let moments_ok = moments
        .as_ref()
        .is_none_or(|(m, v)| m.dims() == [n] && v.dims() == [n] && m.dtype() == DType::F32 && v.dtype() == DType::F32);
    if !f32s || !moments_ok {
        return None;
    }
    // Nothing below returns None: the inputs are consumed.
    let prim = |t: Tensor<Flex, D>| t.into_primitive().tensor();
    let mut p = prim(cast(param)).to_contiguous();
    let g = prim(cast(grad));
    let (mut m, mut v) = match moments {
        Some((m, v)) => (
            cast::<_, Tensor<Flex, 1>>(m).into_primitive().tensor().to_contiguous(),
            cast::<_, Tensor<Flex, 1>>(v).into_primitive().tensor().to_contiguous(),
        ),
        None => (flex(vec![0f32; n], &[n]), flex(vec![0f32; n], &[n])),
    };
    // A 2-D view (contiguous or transposed) is read through its strides; anything else is copied.
    let g = match (D, g.layout().as_2d_strides()) {
        (2, Some(_)) => g,
        _ => g.to_contiguous(),
    };
    let (rows, cols, rs, cs) = match g.layout().as_2d_strides() {
        Some(x) if D == 2 => x,
        _ => (1, n, n as isize, 1),
    };
    let (start, data) = (g.layout().start_offset(), g.storage::<f32>());
    let read = move |i0: usize, out: &mut [f32]| {
        for (k, o) in out.iter_mut().enumerate() {
            let i = i0 + k;
            let (r, c) = (i / cols, i % cols);
            *o = data[(start as isize + r as isize * rs + c as isize * cs) as usize];
        }
    };
    let contiguous = |i0: usize, out: &mut [f32]| {
        out.copy_from_slice(&data[start + i0..start + i0 + out.len()]);
    };
    let unit = cs == 1 && rs == cols as isize;
    debug_assert_eq!(rows * cols, n);
    ops::adamw(
        p.storage_mut::<f32>(),
        m.storage_mut::<f32>(),
        v.storage_mut::<f32>(),
        if unit { &contiguous } else { &read },
        s,
    );
    let out = |t: FlexTensor| Tensor::<Flex, 1>::from_primitive(TensorPrimitive::Float(t));
    let p = cast(Tensor::<Flex, 1>::from_primitive(TensorPrimitive::Float(p)).reshape(shape));
    Some((p, cast(out(m)), cast(out(v))))
}

/// `sum(x^2)` of a tensor of the plain `Flex` backend, accumulated in f64, in parallel; reads
/// strided views in place when they are 2-D.
pub fn sum_squares<B: Backend, const D: usize>(x: &Tensor<B, D>) -> Option<f64> {
    if kind::<B>()? != Kind::Plain || x.dtype() != DType::F32 {
        return None;
    }
    let t: FlexTensor = cast::<_, Tensor<Flex, D>>(x.clone()).into_primitive().tensor();
    let t = if t.layout().is_contiguous() { t } else { t.to_contiguous() };
    let (start, n) = (t.layout().start_offset(), t.layout().num_elements());
    Some(ops::sum_squares(&t.storage::<f32>()[start..start + n]))
}

/// A linear layer without bias in PyTorch's layout: `y = x w^T`.
///
/// # Shapes
/// - x: `[rows, in]`, w: `[out, in]` -> `[rows, out]`
pub fn linear<B: Backend>(x: Tensor<B, 2>, w: Tensor<B, 2>) -> Option<Tensor<B, 2>> {
    let kind = kind::<B>()?;
    let ([rows, d_in], [d_out, w_in]) = (x.dims(), w.dims());
    if w_in != d_in {
        return None;
    }
    let (x, w) = (take(kind, x)?, take(kind, w)?);
    let out = flex(ops::linear_forward(x.data(), w.data(), rows, d_in, d_out), &[rows, d_out]);
    let (xv, wv) = (x.values.clone(), w.values.clone());
    Some(finish::<B, 2, 2>(kind, [&x, &w], out, move |dy, [want_x, want_w]| {
        let (dx, dw) = ops::linear_backward(
            xv.as_slice::<f32>().expect("f32"),
            wv.as_slice::<f32>().expect("f32"),
            dy,
            rows,
            d_in,
            d_out,
            (want_x, want_w),
        );
        [dx.map(|d| flex(d, &[rows, d_in])), dw.map(|d| flex(d, &[d_out, d_in]))]
    }))
}

/// Grouped SwiGLU experts: rows `counts[e]` of `xs` (consecutive, in expert order) go through
/// expert `e`: `down(silu(gate(x)) * up(x))`, weights in PyTorch's layout. One autodiff node for
/// the whole layer; experts that get no row take no part (their weights get no gradient, as in
/// the per-expert reference). Experts run side by side when there are enough of them, else one
/// after another with each product spread over the pool.
///
/// # Shapes
/// - xs: `[N, M]` with `N = sum(counts)`; per expert gate, up: `[I, M]`, down: `[M, I]`
/// - output: `[N, M]`
#[allow(clippy::type_complexity)]
pub fn swiglu_experts<B: Backend>(
    xs: Tensor<B, 2>,
    counts: &[usize],
    experts: &[(Tensor<B, 2>, Tensor<B, 2>, Tensor<B, 2>)],
) -> Option<Tensor<B, 2>> {
    let kind = kind::<B>()?;
    let [n, m] = xs.dims();
    if counts.len() != experts.len() || counts.iter().sum::<usize>() != n || n == 0 {
        return None;
    }
    let [i, gm] = experts[0].0.dims();
    let shapes_ok = experts.iter().all(|(g, u, d)| g.dims() == [i, m] && u.dims() == [i, m] && d.dims() == [m, i]);
    if !shapes_ok || gm != m {
        return None;
    }
    let hit: Vec<usize> = (0..counts.len()).filter(|&e| counts[e] > 0).collect();
    let stack = |pick: fn(&(Tensor<B, 2>, Tensor<B, 2>, Tensor<B, 2>)) -> Tensor<B, 2>| {
        Tensor::stack::<3>(hit.iter().map(|&e| pick(&experts[e])).collect(), 0)
    };
    let (gate, up, down) = (stack(|w| w.0.clone()), stack(|w| w.1.clone()), stack(|w| w.2.clone()));
    let eh = hit.len();
    let shape = ExpertsShape { counts: hit.iter().map(|&e| counts[e]).collect(), width: m, inter: i };
    let (xs, gate, up, down) = (take(kind, xs)?, take(kind, gate)?, take(kind, up)?, take(kind, down)?);
    let [ys, g, u, h] = ops::experts_forward(xs.data(), gate.data(), up.data(), down.data(), &shape);
    let out = flex(ys, &[n, m]);
    let saved = (xs.values.clone(), gate.values.clone(), up.values.clone(), down.values.clone());
    Some(finish::<B, 2, 4>(kind, [&xs, &gate, &up, &down], out, move |dys, _| {
        let (xv, gv, uv, dv) = &saved;
        fn sl(t: &FlexTensor) -> &[f32] {
            t.as_slice::<f32>().expect("f32")
        }
        let [dxs, dg, du, dd] = ops::experts_backward(sl(xv), sl(gv), sl(uv), sl(dv), &g, &u, &h, dys, &shape);
        [
            Some(flex(dxs, &[n, m])),
            Some(flex(dg, &[eh, i, m])),
            Some(flex(du, &[eh, i, m])),
            Some(flex(dd, &[eh, m, i])),
        ]
    }))
}

/// Where each routed copy `t k + j` of `0..copies` sits in `slots` (position -> copy), or
/// `usize::MAX` for a copy not there (another holder's, or dropped for capacity); `None` when a
/// slot is out of range or listed twice, or `experts` does not name each copy's expert.
fn positions(slots: &[usize], copies: usize, experts: &[usize]) -> Option<Vec<usize>> {
    let mut pos = vec![usize::MAX; copies];
    if experts.len() != copies {
        return None;
    }
    for (p, &s) in slots.iter().enumerate() {
        if s >= copies || pos[s] != usize::MAX {
            return None;
        }
        pos[s] = p;
    }
    Some(pos)
}

/// Token dispatch: row `p` of the output is token `slots[p] / k` of `x` (each token once per
/// chosen expert here, in expert order; `slots` lists routed copies `t k + j`, each at most once,
/// all of them or one holder's; `experts[t k + j]` is copy `t k + j`'s expert), followed by `x`
/// itself when `with_base` (the shared experts' input). The backward adds a token's rows in the
/// canonical order of [`crate::order`].
///
/// # Shapes
/// - x: `[T, M]` -> `[N, M]` (`[N + T, M]` with the base), `N = slots.len() <= T k`
pub fn permute_rows<B: Backend>(
    x: Tensor<B, 2>,
    slots: &[usize],
    k: usize,
    experts: &[usize],
    with_base: bool,
) -> Option<Tensor<B, 2>> {
    let kind = kind::<B>()?;
    let [t, m] = x.dims();
    if k == 0 || m == 0 {
        return None;
    }
    let pos = positions(slots, t * k, experts)?;
    let experts = experts.to_vec();
    let x = take(kind, x)?;
    let rows = slots.len() + if with_base { t } else { 0 };
    let out = flex(ops::permute_rows(x.data(), slots, k, m, with_base), &[rows, m]);
    Some(finish::<B, 2, 1>(kind, [&x], out, move |dout, _| {
        [Some(flex(ops::permute_rows_backward(dout, &pos, &experts, k, m, with_base), &[t, m]))]
    }))
}

/// Token combine: each token's expert outputs (rows of `ys` in expert order, slots and experts as
/// in [`permute_rows`]) weighted by its gates and added, with `base` (the shared experts'
/// output), in the canonical order of [`crate::order`].
///
/// # Shapes
/// - ys: `[N, M]`, weights: `[T, k]`, base: `[T, M]` -> `[T, M]`
pub fn combine_rows<B: Backend>(
    ys: Tensor<B, 2>,
    weights: Tensor<B, 2>,
    slots: &[usize],
    experts: &[usize],
    base: Option<Tensor<B, 2>>,
) -> Option<Tensor<B, 2>> {
    let kind = kind::<B>()?;
    let ([n, m], [t, k]) = (ys.dims(), weights.dims());
    if k == 0 || m == 0 || slots.len() != n || base.as_ref().is_some_and(|b| b.dims() != [t, m]) {
        return None;
    }
    let pos = positions(slots, t * k, experts)?;
    let (ys, w) = (take(kind, ys)?, take(kind, weights)?);
    let base = match base {
        Some(b) => Some(take(kind, b)?),
        None => None,
    };
    let out = ops::combine_rows(ys.data(), w.data(), &pos, experts, base.as_ref().map(|b| b.data()), k, m);
    let out = flex(out, &[t, m]);
    let (yv, wv) = (ys.values.clone(), w.values.clone());
    let slots = slots.to_vec();
    let grads = move |dout: &[f32]| {
        let (dys, dw) = ops::combine_rows_backward(
            yv.as_slice::<f32>().expect("f32"),
            wv.as_slice::<f32>().expect("f32"),
            &slots,
            &pos,
            dout,
            k,
            m,
        );
        (Some(flex(dys, &[n, m])), Some(flex(dw, &[t, k])))
    };
    Some(match base {
        None => finish::<B, 2, 2>(kind, [&ys, &w], out, move |dout, _| {
            let (dys, dw) = grads(dout);
            [dys, dw]
        }),
        Some(base) => finish::<B, 2, 3>(kind, [&ys, &w, &base], out, move |dout, _| {
            let (dys, dw) = grads(dout);
            [dys, dw, Some(flex(dout.to_vec(), &[t, m]))]
        }),
    })
}
