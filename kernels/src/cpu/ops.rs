//! The fused CPU operations on plain `f32` buffers (row-major, contiguous): forward and backward of
//! causal attention, RMSNorm, the SwiGLU activation, rotary embedding and next-token
//! cross-entropy. Work is split over rows or heads with rayon; matrix products go to the `gemm`
//! crate (the one Burn's flex backend uses), one single-threaded call per tile.

use gemm::{gemm, Parallelism};
use rayon::prelude::*;

use super::vector;
use crate::order::{expert_key, tree_sum, Term, SHARED_KEY};

/// Query rows per tile of the attention loops: a tile's keys stop at its last row (causality).
const BLOCK: usize = 64;

/// A pointer that tasks writing disjoint elements share.
#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);
// SAFETY: every use below writes element sets that are disjoint between tasks.
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

impl SyncPtr {
    /// The pointer (a method, so that closures capture the whole `Send` wrapper).
    fn ptr(self) -> *mut f32 {
        self.0
    }
}

/// `dst[m x n] (+)= beta * lhs[m x k] * rhs[k x n]`, all strides in elements, on this thread.
#[allow(clippy::too_many_arguments)]
#[inline]
unsafe fn mm(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_rs: usize,
    accumulate: bool,
    lhs: *const f32,
    lhs_rs: isize,
    lhs_cs: isize,
    rhs: *const f32,
    rhs_rs: isize,
    rhs_cs: isize,
    beta: f32,
) {
    mm_par(m, n, k, dst, dst_rs, accumulate, lhs, lhs_rs, lhs_cs, rhs, rhs_rs, rhs_cs, beta, Parallelism::None)
}

/// [`mm`] with a choice of parallelism.
#[allow(clippy::too_many_arguments)]
#[inline]
unsafe fn mm_par(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_rs: usize,
    accumulate: bool,
    lhs: *const f32,
    lhs_rs: isize,
    lhs_cs: isize,
    rhs: *const f32,
    rhs_rs: isize,
    rhs_cs: isize,
    beta: f32,
    parallelism: Parallelism,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                std::ptr::write_bytes(dst.add(i * dst_rs), 0, n);
            }
        }
        return;
    }
    gemm(
        m,
        n,
        k,
        dst,
        1,
        dst_rs as isize,
        accumulate,
        lhs,
        lhs_cs,
        lhs_rs,
        rhs,
        rhs_cs,
        rhs_rs,
        1.0,
        beta,
        false,
        false,
        false,
        parallelism,
    )
}

/// Shape of an attention call; q `[B, S, H, D]`, k `[B, S, G, D]`, v `[B, S, G, E]`,
/// output `[B, S, H, E]`, probabilities `[B, H, S, S]`.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub batch: usize,
    pub seq: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub qk_dim: usize,
    pub v_dim: usize,
    /// A query sees keys `q - window < k <= q`; `None` = all earlier keys.
    pub window: Option<usize>,
    pub scale: f32,
}

impl AttnShape {
    /// Keys row `i` sees: `[lo, i + 1)`.
    fn row_keys(&self, i: usize) -> (usize, usize) {
        (self.window.map_or(0, |w| (i + 1).saturating_sub(w)), i + 1)
    }

    /// Keys the tile of rows `[i0, i1)` touches.
    fn tile_keys(&self, i0: usize, i1: usize) -> (usize, usize) {
        (self.row_keys(i0).0, i1)
    }
}

/// Forward: returns the output `[B, S, H, E]` and the probabilities `[B, H, S, S]` (zero outside
/// each row's keys), which the backward reuses.
///
/// With `sinks` (`[H]`), each head's sink logit joins every row's softmax and its probability
/// mass is dropped (GPT-OSS).
pub fn attention_forward(q: &[f32], k: &[f32], v: &[f32], sinks: Option<&[f32]>, a: AttnShape) -> (Vec<f32>, Vec<f32>) {
    let AttnShape { batch, seq: s, heads: h, kv_heads: g, qk_dim: d, v_dim: e, scale, .. } = a;
    let n = h / g;
    let mut out = vec![0f32; batch * s * h * e];
    let mut probs = vec![0f32; batch * h * s * s];
    let out_ptr = SyncPtr(out.as_mut_ptr());
    probs.par_chunks_mut(s * s).enumerate().for_each(|(bh, p)| {
        let (bi, hi) = (bh / h, bh % h);
        let gi = hi / n;
        let q0 = (bi * s * h + hi) * d;
        let k0 = (bi * s * g + gi) * d;
        let v0 = (bi * s * g + gi) * e;
        for i0 in (0..s).step_by(BLOCK) {
            let i1 = (i0 + BLOCK).min(s);
            let (lo, hk) = a.tile_keys(i0, i1);
            // SAFETY: all offsets stay inside the buffers (shapes checked by the caller); this
            // task alone writes rows of head `hi` in batch `bi` of `out`, and its own `p`.
            unsafe {
                mm(
                    i1 - i0,
                    hk - lo,
                    d,
                    p.as_mut_ptr().add(i0 * s + lo),
                    s,
                    false,
                    q.as_ptr().add(q0 + i0 * h * d),
                    (h * d) as isize,
                    1,
                    k.as_ptr().add(k0 + lo * g * d),
                    1,
                    (g * d) as isize,
                    scale,
                );
            }
            for i in i0..i1 {
                let row = &mut p[i * s..(i + 1) * s];
                let (rl, rh) = a.row_keys(i);
                row[lo..rl].fill(0.0);
                row[rh..hk].fill(0.0);
                let sink = sinks.map(|x| x[hi]);
                let m = vector::max(&row[rl..rh]).max(sink.unwrap_or(f32::NEG_INFINITY));
                let mut sum = vector::exp_shifted_sum(&mut row[rl..rh], m);
                if let Some(x) = sink {
                    sum += vector::exp(x - m);
                }
                vector::scale(&mut row[rl..rh], 1.0 / sum);
            }
            unsafe {
                mm(
                    i1 - i0,
                    e,
                    hk - lo,
                    out_ptr.ptr().add(((bi * s + i0) * h + hi) * e),
                    h * e,
                    false,
                    p.as_ptr().add(i0 * s + lo),
                    s as isize,
                    1,
                    v.as_ptr().add(v0 + lo * g * e),
                    (g * e) as isize,
                    1,
                    1.0,
                );
            }
        }
    });
    (out, probs)
}

/// Backward: from the forward's inputs, its probabilities and the output gradient `[B, S, H, E]`,
/// the gradients of q, k and v (in their layouts) and of the sink logits `[H]` (whose
/// probability in row `i` is `1 - sum_j p[i, j]`; their gradient is `-sum_i p_sink(i) * sum_j
/// p[i, j] dp[i, j]`).
pub fn attention_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    probs: &[f32],
    dout: &[f32],
    a: AttnShape,
) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let AttnShape { batch, seq: s, heads: h, kv_heads: g, qk_dim: d, v_dim: e, scale, .. } = a;
    let n = h / g;
    let mut dq = vec![0f32; batch * s * h * d];
    let mut dk = vec![0f32; batch * s * g * d];
    let mut dv = vec![0f32; batch * s * g * e];
    let (dq_ptr, dk_ptr, dv_ptr) = (SyncPtr(dq.as_mut_ptr()), SyncPtr(dk.as_mut_ptr()), SyncPtr(dv.as_mut_ptr()));
    let dsinks = (0..batch * g).into_par_iter().map(|bg| {
        let mut dsink = vec![0f32; h];
        let (dq_ptr, dk_ptr, dv_ptr) = (dq_ptr, dk_ptr, dv_ptr);
        let (bi, gi) = (bg / g, bg % g);
        let k0 = (bi * s * g + gi) * d;
        let v0 = (bi * s * g + gi) * e;
        let mut ds = vec![0f32; s * s];
        for hi in gi * n..(gi + 1) * n {
            let p = &probs[(bi * h + hi) * s * s..(bi * h + hi + 1) * s * s];
            let q0 = (bi * s * h + hi) * d;
            let o0 = (bi * s * h + hi) * e;
            for i0 in (0..s).step_by(BLOCK) {
                let i1 = (i0 + BLOCK).min(s);
                let rows = i1 - i0;
                let (lo, hk) = a.tile_keys(i0, i1);
                // SAFETY: offsets inside the buffers; this task alone writes the dq rows of the
                // heads of group `gi` in batch `bi`, and the dk/dv rows of that group.
                unsafe {
                    // dP = dO V^T
                    mm(
                        rows,
                        hk - lo,
                        e,
                        ds.as_mut_ptr().add(i0 * s + lo),
                        s,
                        false,
                        dout.as_ptr().add(o0 + i0 * h * e),
                        (h * e) as isize,
                        1,
                        v.as_ptr().add(v0 + lo * g * e),
                        1,
                        (g * e) as isize,
                        1.0,
                    );
                }
                for i in i0..i1 {
                    let (rl, rh) = a.row_keys(i);
                    let row = &mut ds[i * s..(i + 1) * s];
                    row[lo..rl].fill(0.0);
                    row[rh..hk].fill(0.0);
                    let (dot, mass) = vector::softmax_backward_row(&p[i * s + rl..i * s + rh], &mut row[rl..rh]);
                    dsink[hi] -= (1.0 - mass) * dot;
                }
                unsafe {
                    // dQ = scale dS K
                    mm(
                        rows,
                        d,
                        hk - lo,
                        dq_ptr.0.add(q0 + i0 * h * d),
                        h * d,
                        false,
                        ds.as_ptr().add(i0 * s + lo),
                        s as isize,
                        1,
                        k.as_ptr().add(k0 + lo * g * d),
                        (g * d) as isize,
                        1,
                        scale,
                    );
                    // dK += scale dS^T Q
                    mm(
                        hk - lo,
                        d,
                        rows,
                        dk_ptr.0.add(k0 + lo * g * d),
                        g * d,
                        true,
                        ds.as_ptr().add(i0 * s + lo),
                        1,
                        s as isize,
                        q.as_ptr().add(q0 + i0 * h * d),
                        (h * d) as isize,
                        1,
                        scale,
                    );
                    // dV += P^T dO
                    mm(
                        hk - lo,
                        e,
                        rows,
                        dv_ptr.0.add(v0 + lo * g * e),
                        g * e,
                        true,
                        p.as_ptr().add(i0 * s + lo),
                        1,
                        s as isize,
                        dout.as_ptr().add(o0 + i0 * h * e),
                        (h * e) as isize,
                        1,
                        1.0,
                    );
                }
            }
        }
        dsink
    });
    let dsink = dsinks.reduce(
        || vec![0f32; h],
        |mut a, b| {
            a.iter_mut().zip(&b).for_each(|(x, y)| *x += y);
            a
        },
    );
    (dq, dk, dv, dsink)
}

/// Rows per parallel task of the row-wise operations.
fn rows_per_task(rows: usize, width: usize) -> usize {
    // ~32K elements per task: enough work to amortise the task, enough tasks to balance.
    (32 * 1024 / width.max(1)).clamp(1, rows.max(1))
}

/// RMSNorm over the last dimension of `x` (`[rows, dim]`): the output and each row's `1/rms`.
pub fn rms_norm_forward(x: &[f32], w: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>) {
    let dim = w.len();
    let rows = x.len() / dim;
    let mut out = vec![0f32; x.len()];
    let mut inv = vec![0f32; rows];
    let per = rows_per_task(rows, dim);
    out.par_chunks_mut(per * dim).zip(inv.par_chunks_mut(per)).enumerate().for_each(|(t, (o, r))| {
        for (j, rj) in r.iter_mut().enumerate() {
            let row = (t * per + j) * dim;
            *rj = vector::rms_norm_row(&x[row..row + dim], w, eps, &mut o[j * dim..(j + 1) * dim]);
        }
    });
    (out, inv)
}

/// RMSNorm backward: `dx` and `dw`.
pub fn rms_norm_backward(x: &[f32], w: &[f32], inv: &[f32], dy: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let dim = w.len();
    let rows = x.len() / dim;
    let mut dx = vec![0f32; x.len()];
    let per = rows_per_task(rows, dim);
    let dw = dx
        .par_chunks_mut(per * dim)
        .enumerate()
        .map(|(t, dxc)| {
            let mut dw = vec![0f32; dim];
            for j in 0..dxc.len() / dim {
                let r = t * per + j;
                let span = r * dim..(r + 1) * dim;
                vector::rms_norm_backward_row(
                    &x[span.clone()],
                    w,
                    &dy[span],
                    inv[r],
                    &mut dxc[j * dim..(j + 1) * dim],
                    &mut dw,
                );
            }
            dw
        })
        .reduce(
            || vec![0f32; dim],
            |mut a, b| {
                a.iter_mut().zip(&b).for_each(|(x, y)| *x += y);
                a
            },
        );
    (dx, dw)
}

/// Elements per task of the elementwise operations.
const CHUNK: usize = 16 * 1024;

/// `out = silu(g) * u`, elementwise, in parallel chunks.
fn swiglu_into(g: &[f32], u: &[f32], out: &mut [f32]) {
    out.par_chunks_mut(CHUNK).enumerate().for_each(|(t, o)| {
        let span = t * CHUNK..t * CHUNK + o.len();
        vector::swiglu(&g[span.clone()], &u[span], o);
    });
}

/// Backward of `silu(g) * u` into `dg`, `du`, in parallel chunks.
fn swiglu_backward_into(g: &[f32], u: &[f32], dh: &[f32], dg: &mut [f32], du: &mut [f32]) {
    dg.par_chunks_mut(CHUNK).zip(du.par_chunks_mut(CHUNK)).enumerate().for_each(|(t, (a, b))| {
        let span = t * CHUNK..t * CHUNK + a.len();
        vector::swiglu_backward(&g[span.clone()], &u[span.clone()], &dh[span], a, b);
    });
}

/// `silu(g) * u`, elementwise.
pub fn swiglu_forward(g: &[f32], u: &[f32]) -> Vec<f32> {
    let mut out = vec![0f32; g.len()];
    swiglu_into(g, u, &mut out);
    out
}

/// Backward of `silu(g) * u`: `(dg, du)`.
pub fn swiglu_backward(g: &[f32], u: &[f32], dh: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let mut dg = vec![0f32; g.len()];
    let mut du = vec![0f32; g.len()];
    swiglu_backward_into(g, u, dh, &mut dg, &mut du);
    (dg, du)
}

/// Half-split rotary embedding of `x` `[B, S, H, D]` with tables `[S, D]` (or its transpose, the
/// backward, when `inverse`).
pub fn rope(x: &[f32], cos: &[f32], sin: &[f32], seq: usize, heads: usize, inverse: bool) -> Vec<f32> {
    let d = cos.len() / seq;
    let mut out = vec![0f32; x.len()];
    let rows = x.len() / d;
    let per = rows_per_task(rows, d);
    out.par_chunks_mut(per * d).enumerate().for_each(|(t, o)| {
        for j in 0..o.len() / d {
            let r = t * per + j;
            let pos = (r / heads) % seq;
            let table = pos * d..(pos + 1) * d;
            vector::rope_row(
                &x[r * d..(r + 1) * d],
                &cos[table.clone()],
                &sin[table],
                inverse,
                &mut o[j * d..(j + 1) * d],
            );
        }
    });
    out
}

/// Mean next-token cross-entropy over `logits` `[B, S, V]` with `labels` `[B, S - 1]` (the token
/// after each position); returns the loss and the gradient of the loss w.r.t. the logits
/// (`(softmax - onehot) / N` on the first `S - 1` positions, zero on the last).
pub fn cross_entropy(logits: &[f32], labels: &[usize], batch: usize, seq: usize, vocab: usize) -> (f64, Vec<f32>) {
    let n = batch * (seq - 1);
    let mut grad = vec![0f32; logits.len()];
    let losses: Vec<f64> = grad
        .par_chunks_mut(vocab)
        .enumerate()
        .map(|(row, gr)| {
            let (b, t) = (row / seq, row % seq);
            if t + 1 == seq {
                return 0.0;
            }
            let label = labels[b * (seq - 1) + t];
            let x = &logits[row * vocab..(row + 1) * vocab];
            let m = vector::max(x);
            gr.copy_from_slice(x);
            let sum = vector::exp_shifted_sum(gr, m);
            vector::scale(gr, 1.0 / (sum * n as f32));
            gr[label] -= 1.0 / n as f32;
            (m as f64 + (sum as f64).ln()) - x[label] as f64
        })
        .collect();
    (losses.iter().sum::<f64>() / n as f64, grad)
}

/// AdamW over a whole parameter, in place, in parallel chunks. `grad(i0, out)` fills `out` with
/// the gradient elements `i0..i0 + out.len()` (so a transposed gradient is read without first
/// copying it whole).
pub fn adamw(
    p: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    grad: &(dyn Fn(usize, &mut [f32]) + Sync),
    s: vector::AdamWScalars,
) {
    const CHUNK: usize = 16 * 1024;
    p.par_chunks_mut(CHUNK).zip(m.par_chunks_mut(CHUNK)).zip(v.par_chunks_mut(CHUNK)).enumerate().for_each(
        |(t, ((pc, mc), vc))| {
            let mut g = vec![0f32; pc.len()];
            grad(t * CHUNK, &mut g);
            vector::adamw(pc, mc, vc, &g, s);
        },
    );
}

/// `sum(x^2)` in f64 (f32 products summed per chunk, chunks summed in f64).
pub fn sum_squares(x: &[f32]) -> f64 {
    x.par_chunks(16 * 1024).map(|c| vector::dot(c, c) as f64).sum()
}

/// A vector of `n` elements that `fill` initialises completely (e.g. a gemm with `read_dst`
/// false): no zeroing pass first.
///
/// # Safety
/// `fill` must write every one of the `n` elements through the pointer.
pub unsafe fn written(n: usize, fill: impl FnOnce(*mut f32)) -> Vec<f32> {
    let mut v: Vec<f32> = Vec::with_capacity(n);
    fill(v.spare_capacity_mut().as_mut_ptr().cast::<f32>());
    v.set_len(n);
    v
}

/// Parallelism for one product of `m x n x k`: the pool for anything but tiny ones (Burn's flex
/// runs products under 192^3 on the calling thread alone).
fn parallelism(m: usize, n: usize, k: usize) -> Parallelism {
    if m.saturating_mul(n).saturating_mul(k) >= 32 * 32 * 32 {
        Parallelism::Rayon(0)
    } else {
        Parallelism::None
    }
}

/// `y = x w^T`: x `[rows, in]`, w `[out, in]` (PyTorch's layout) -> `[rows, out]`.
pub fn linear_forward(x: &[f32], w: &[f32], rows: usize, d_in: usize, d_out: usize) -> Vec<f32> {
    // SAFETY: a product that does not accumulate writes all rows x d_out elements (zeros when
    // d_in is 0); operands are in bounds.
    unsafe {
        written(rows * d_out, |y| {
            let par = parallelism(rows, d_out, d_in);
            mm_par(
                rows,
                d_out,
                d_in,
                y,
                d_out,
                false,
                x.as_ptr(),
                d_in as isize,
                1,
                w.as_ptr(),
                1,
                d_in as isize,
                1.0,
                par,
            )
        })
    }
}

/// Backward of [`linear_forward`]: `dx = dy w` (`[rows, in]`), `dw = dy^T x` (`[out, in]`), each
/// only when asked for.
pub fn linear_backward(
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    rows: usize,
    d_in: usize,
    d_out: usize,
    want: (bool, bool),
) -> (Option<Vec<f32>>, Option<Vec<f32>>) {
    // SAFETY (both): a product that does not accumulate writes every element of its output.
    let dx = want.0.then(|| unsafe {
        written(rows * d_in, |dst| {
            let par = parallelism(rows, d_in, d_out);
            mm_par(
                rows,
                d_in,
                d_out,
                dst,
                d_in,
                false,
                dy.as_ptr(),
                d_out as isize,
                1,
                w.as_ptr(),
                d_in as isize,
                1,
                1.0,
                par,
            )
        })
    });
    let dw = want.1.then(|| unsafe {
        written(d_out * d_in, |dst| {
            let par = parallelism(d_out, d_in, rows);
            mm_par(
                d_out,
                d_in,
                rows,
                dst,
                d_in,
                false,
                dy.as_ptr(),
                1,
                d_out as isize,
                x.as_ptr(),
                d_in as isize,
                1,
                1.0,
                par,
            )
        })
    });
    (dx, dw)
}

/// Shape of a grouped SwiGLU expert call: `counts[e]` consecutive rows of `xs` `[N, M]` go through
/// expert `e` (`gate`, `up`: `[E, I, M]`, `down`: `[E, M, I]`, PyTorch's layout).
#[derive(Debug, Clone)]
pub struct ExpertsShape {
    pub counts: Vec<usize>,
    pub width: usize,
    pub inter: usize,
}

impl ExpertsShape {
    fn starts(&self) -> Vec<usize> {
        self.counts
            .iter()
            .scan(0, |acc, &c| {
                let s = *acc;
                *acc += c;
                Some(s)
            })
            .collect()
    }

    /// Experts run side by side (one thread each) when there are enough of them to share out;
    /// otherwise one after another, each product spread over the pool.
    fn across_experts(&self) -> bool {
        self.counts.iter().filter(|&&c| c > 0).count() >= 2 * rayon::current_num_threads()
    }
}

/// Forward of the grouped SwiGLU experts: `ys` `[N, M]` and the saved `g`, `u`, `h` (`[N, I]`).
pub fn experts_forward(xs: &[f32], gate: &[f32], up: &[f32], down: &[f32], e: &ExpertsShape) -> [Vec<f32>; 4] {
    let (m, i) = (e.width, e.inter);
    let n: usize = e.counts.iter().sum();
    let (mut ys, mut g, mut u, mut h) = (vec![0f32; n * m], vec![0f32; n * i], vec![0f32; n * i], vec![0f32; n * i]);
    let (yp, gp, up_, hp) =
        (SyncPtr(ys.as_mut_ptr()), SyncPtr(g.as_mut_ptr()), SyncPtr(u.as_mut_ptr()), SyncPtr(h.as_mut_ptr()));
    let starts = e.starts();
    let across = e.across_experts();
    let run = |x: usize| {
        let (yp, gp, up_, hp) = (yp, gp, up_, hp);
        let (r0, c) = (starts[x], e.counts[x]);
        if c == 0 {
            return;
        }
        let par = if across { Parallelism::None } else { parallelism(c, i, m) };
        // SAFETY: expert `x` alone writes rows r0..r0+c of ys, g, u, h; reads are in bounds.
        unsafe {
            let xr = xs.as_ptr().add(r0 * m);
            let wg = gate.as_ptr().add(x * i * m);
            let wu = up.as_ptr().add(x * i * m);
            let wd = down.as_ptr().add(x * m * i);
            mm_par(c, i, m, gp.0.add(r0 * i), i, false, xr, m as isize, 1, wg, 1, m as isize, 1.0, par);
            mm_par(c, i, m, up_.0.add(r0 * i), i, false, xr, m as isize, 1, wu, 1, m as isize, 1.0, par);
            let gs = std::slice::from_raw_parts(gp.0.add(r0 * i), c * i);
            let us = std::slice::from_raw_parts(up_.0.add(r0 * i), c * i);
            let hs = std::slice::from_raw_parts_mut(hp.0.add(r0 * i), c * i);
            if across {
                vector::swiglu(gs, us, hs);
            } else {
                swiglu_into(gs, us, hs);
            }
            mm_par(c, m, i, yp.0.add(r0 * m), m, false, hp.0.add(r0 * i), i as isize, 1, wd, 1, i as isize, 1.0, par);
        }
    };
    if across {
        (0..e.counts.len()).into_par_iter().for_each(run);
    } else {
        (0..e.counts.len()).for_each(run);
    }
    [ys, g, u, h]
}

/// Backward of [`experts_forward`]: `dxs` `[N, M]`, `dgate`, `dup` `[E, I, M]`, `ddown` `[E, M, I]`
/// (zero for experts without rows; the caller gives those no gradient).
#[allow(clippy::too_many_arguments)]
pub fn experts_backward(
    xs: &[f32],
    gate: &[f32],
    up: &[f32],
    down: &[f32],
    g: &[f32],
    u: &[f32],
    h: &[f32],
    dys: &[f32],
    e: &ExpertsShape,
) -> [Vec<f32>; 4] {
    let (m, i, ne) = (e.width, e.inter, e.counts.len());
    let n: usize = e.counts.iter().sum();
    let mut dxs = vec![0f32; n * m];
    let (mut dg_w, mut du_w, mut dd_w) = (vec![0f32; ne * i * m], vec![0f32; ne * i * m], vec![0f32; ne * m * i]);
    let ptrs =
        (SyncPtr(dxs.as_mut_ptr()), SyncPtr(dg_w.as_mut_ptr()), SyncPtr(du_w.as_mut_ptr()), SyncPtr(dd_w.as_mut_ptr()));
    let starts = e.starts();
    let across = e.across_experts();
    let run = |x: usize| {
        let (dxp, dgwp, duwp, ddwp) = ptrs;
        let (r0, c) = (starts[x], e.counts[x]);
        if c == 0 {
            return;
        }
        let par = if across { Parallelism::None } else { parallelism(c, i, m) };
        let mut dh = vec![0f32; c * i];
        let mut dgl = vec![0f32; c * i];
        let mut dul = vec![0f32; c * i];
        // SAFETY: expert `x` alone writes rows r0..r0+c of dxs and its own weight-gradient slices.
        unsafe {
            let xr = xs.as_ptr().add(r0 * m);
            let dy = dys.as_ptr().add(r0 * m);
            let wg = gate.as_ptr().add(x * i * m);
            let wu = up.as_ptr().add(x * i * m);
            let wd = down.as_ptr().add(x * m * i);
            // dH = dY Wd; dWd = dY^T H
            mm_par(c, i, m, dh.as_mut_ptr(), i, false, dy, m as isize, 1, wd, i as isize, 1, 1.0, par);
            mm_par(
                m,
                i,
                c,
                ddwp.0.add(x * m * i),
                i,
                false,
                dy,
                1,
                m as isize,
                h.as_ptr().add(r0 * i),
                i as isize,
                1,
                1.0,
                par,
            );
            let (gs, us) = (&g[r0 * i..(r0 + c) * i], &u[r0 * i..(r0 + c) * i]);
            if across {
                vector::swiglu_backward(gs, us, &dh, &mut dgl, &mut dul);
            } else {
                swiglu_backward_into(gs, us, &dh, &mut dgl, &mut dul);
            }
            // dX = dG Wg + dU Wu; dWg = dG^T X; dWu = dU^T X
            mm_par(c, m, i, dxp.0.add(r0 * m), m, false, dgl.as_ptr(), i as isize, 1, wg, m as isize, 1, 1.0, par);
            mm_par(c, m, i, dxp.0.add(r0 * m), m, true, dul.as_ptr(), i as isize, 1, wu, m as isize, 1, 1.0, par);
            mm_par(i, m, c, dgwp.0.add(x * i * m), m, false, dgl.as_ptr(), 1, i as isize, xr, m as isize, 1, 1.0, par);
            mm_par(i, m, c, duwp.0.add(x * i * m), m, false, dul.as_ptr(), 1, i as isize, xr, m as isize, 1, 1.0, par);
        }
    };
    if across {
        (0..ne).into_par_iter().for_each(run);
    } else {
        (0..ne).for_each(run);
    }
    [dxs, dg_w, du_w, dd_w]
}

/// Token dispatch: `out[p] = x[slots[p] / k]` (`x` `[T, M]`, `out` `[N, M]`, `slots` the routed
/// copies `t k + j` in expert order, each at most once), followed by `x` itself when `with_base`
/// (the shared experts' input; `out` `[N + T, M]`).
pub fn permute_rows(x: &[f32], slots: &[usize], k: usize, m: usize, with_base: bool) -> Vec<f32> {
    let n = slots.len();
    let mut out = vec![0f32; n * m];
    out.par_chunks_mut(m * 64).enumerate().for_each(|(c, o)| {
        for (r, row) in o.chunks_mut(m).enumerate() {
            let t = slots[c * 64 + r] / k;
            row.copy_from_slice(&x[t * m..(t + 1) * m]);
        }
    });
    if with_base {
        out.extend_from_slice(x);
    }
    out
}

/// Calls `f(token, row, terms, scratch)` for every token row of `out` (`[T, M]`, `T = pos.len() / k`)
/// with the terms of its routed copies (`pos[t k + j]` the copy's row of `rows`, `usize::MAX` when
/// the copy is not here; `experts[t k + j]` its expert), in parallel over chunks of tokens.
#[allow(clippy::too_many_arguments)]
fn per_token_terms<'a>(
    out: &mut [f32],
    rows: &'a [f32],
    pos: &[usize],
    experts: &[usize],
    weights: Option<&[f32]>,
    k: usize,
    m: usize,
    f: impl Fn(usize, &mut [f32], &mut Vec<Term<'a>>, &mut Vec<f32>) + Sync,
) {
    out.par_chunks_mut(m * 64).enumerate().for_each(|(c, o)| {
        let (mut terms, mut scratch) = (Vec::with_capacity(k + 1), Vec::new());
        for (r, row) in o.chunks_mut(m).enumerate() {
            let tok = c * 64 + r;
            terms.clear();
            for slot in tok * k..(tok + 1) * k {
                if let Some(&p) = pos.get(slot).filter(|&&p| p != usize::MAX) {
                    let scale = weights.map(|w| w[slot]);
                    terms.push(Term { key: expert_key(experts[slot]), row: &rows[p * m..(p + 1) * m], scale });
                }
            }
            f(tok, row, &mut terms, &mut scratch);
        }
    });
}

/// Backward of [`permute_rows`]: `dx[t] = sum_j dout[pos[t k + j]]` over the copies here (`pos`
/// the inverse of `slots`, `usize::MAX` for a copy not here), plus the base row `dout[N + t]` when
/// `with_base`, added in the canonical order of [`crate::order`] (`experts[t k + j]` the copy's
/// expert).
pub fn permute_rows_backward(
    dout: &[f32],
    pos: &[usize],
    experts: &[usize],
    k: usize,
    m: usize,
    with_base: bool,
) -> Vec<f32> {
    let t = pos.len() / k;
    let n = dout.len() / m - if with_base { t } else { 0 };
    let mut dx = vec![0f32; t * m];
    per_token_terms(&mut dx, dout, pos, experts, None, k, m, |tok, row, terms, scratch| {
        if with_base {
            terms.push(Term { key: SHARED_KEY, row: &dout[(n + tok) * m..(n + tok + 1) * m], scale: None });
        }
        tree_sum(terms, row, scratch)
    });
    dx
}

/// Token combine: `out[t] = base[t] + sum_j w[t k + j] ys[pos[t k + j]]` (`ys` `[N, M]` in expert
/// order, `pos` as in [`permute_rows_backward`], `base` e.g. the shared experts' output), added in
/// the canonical order of [`crate::order`].
pub fn combine_rows(
    ys: &[f32],
    w: &[f32],
    pos: &[usize],
    experts: &[usize],
    base: Option<&[f32]>,
    k: usize,
    m: usize,
) -> Vec<f32> {
    let mut out = vec![0f32; pos.len() / k * m];
    per_token_terms(&mut out, ys, pos, experts, Some(w), k, m, |tok, row, terms, scratch| {
        if let Some(base) = base {
            terms.push(Term { key: SHARED_KEY, row: &base[tok * m..(tok + 1) * m], scale: None });
        }
        tree_sum(terms, row, scratch)
    });
    out
}

/// Backward of [`combine_rows`] for the expert rows and the gates: `dys[pos[t k + j]] = w[t k + j]
/// dout[t]`, `dw[t k + j] = dout[t] . ys[pos[t k + j]]` (0 for a copy not here). The base's
/// gradient is `dout` itself.
pub fn combine_rows_backward(
    ys: &[f32],
    w: &[f32],
    slots: &[usize],
    pos: &[usize],
    dout: &[f32],
    k: usize,
    m: usize,
) -> (Vec<f32>, Vec<f32>) {
    let mut dys = vec![0f32; slots.len() * m];
    dys.par_chunks_mut(m * 64).enumerate().for_each(|(c, o)| {
        for (r, row) in o.chunks_mut(m).enumerate() {
            let slot = slots[c * 64 + r];
            let (t, wj) = (slot / k, w[slot]);
            row.iter_mut().zip(&dout[t * m..(t + 1) * m]).for_each(|(a, b)| *a = wj * b);
        }
    });
    let mut dw = vec![0f32; pos.len()];
    dw.par_chunks_mut(1024).enumerate().for_each(|(c, o)| {
        for (r, d) in o.iter_mut().enumerate() {
            let slot = c * 1024 + r;
            let (t, p) = (slot / k, pos[slot]);
            if p != usize::MAX {
                *d = vector::dot(&dout[t * m..(t + 1) * m], &ys[p * m..(p + 1) * m]);
            }
        }
    });
    (dys, dw)
}
