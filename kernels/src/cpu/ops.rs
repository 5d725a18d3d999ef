//! The fused CPU operations on plain `f32` buffers (row-major, contiguous): forward and backward of
//! causal attention, RMSNorm, the SwiGLU activation, rotary embedding and next-token
//! cross-entropy. Work is split over rows or heads with rayon; matrix products go to the `gemm`
//! crate (the one Burn's flex backend uses), one single-threaded call per tile.

use gemm::{gemm, Parallelism};
use rayon::prelude::*;

use super::vector;

/// Query rows per tile of the attention loops: a tile's keys stop at its last row (causality).
const BLOCK: usize = 64;

/// A pointer that tasks writing disjoint elements share.
#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);
// SAFETY: every use below writes element sets that are disjoint between tasks.
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

/// `dst[m x n] (+)= beta * lhs[m x k] * rhs[k x n]`, all strides in elements.
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
        Parallelism::None,
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
pub fn attention_forward(q: &[f32], k: &[f32], v: &[f32], a: AttnShape) -> (Vec<f32>, Vec<f32>) {
    let AttnShape { batch, seq: s, heads: h, kv_heads: g, qk_dim: d, v_dim: e, scale, .. } = a;
    let n = h / g;
    let mut out = vec![0f32; batch * s * h * e];
    let mut probs = vec![0f32; batch * h * s * s];
    let out_ptr = SyncPtr(out.as_mut_ptr());
    probs.par_chunks_mut(s * s).enumerate().for_each(|(bh, p)| {
        let out_ptr = out_ptr;
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
                let m = vector::max(&row[rl..rh]);
                let sum = vector::exp_shifted_sum(&mut row[rl..rh], m);
                vector::scale(&mut row[rl..rh], 1.0 / sum);
            }
            unsafe {
                mm(
                    i1 - i0,
                    e,
                    hk - lo,
                    out_ptr.0.add(((bi * s + i0) * h + hi) * e),
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
/// the gradients of q, k and v (in their layouts).
pub fn attention_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    probs: &[f32],
    dout: &[f32],
    a: AttnShape,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let AttnShape { batch, seq: s, heads: h, kv_heads: g, qk_dim: d, v_dim: e, scale, .. } = a;
    let n = h / g;
    let mut dq = vec![0f32; batch * s * h * d];
    let mut dk = vec![0f32; batch * s * g * d];
    let mut dv = vec![0f32; batch * s * g * e];
    let (dq_ptr, dk_ptr, dv_ptr) = (SyncPtr(dq.as_mut_ptr()), SyncPtr(dk.as_mut_ptr()), SyncPtr(dv.as_mut_ptr()));
    (0..batch * g).into_par_iter().for_each(|bg| {
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
                    vector::softmax_backward_row(&p[i * s + rl..i * s + rh], &mut row[rl..rh]);
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
    });
    (dq, dk, dv)
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

/// `silu(g) * u`, elementwise.
pub fn swiglu_forward(g: &[f32], u: &[f32]) -> Vec<f32> {
    let mut out = vec![0f32; g.len()];
    const CHUNK: usize = 16 * 1024;
    out.par_chunks_mut(CHUNK).enumerate().for_each(|(t, o)| {
        let span = t * CHUNK..t * CHUNK + o.len();
        vector::swiglu(&g[span.clone()], &u[span], o);
    });
    out
}

/// Backward of `silu(g) * u`: `(dg, du)`.
pub fn swiglu_backward(g: &[f32], u: &[f32], dh: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let mut dg = vec![0f32; g.len()];
    let mut du = vec![0f32; g.len()];
    const CHUNK: usize = 16 * 1024;
    dg.par_chunks_mut(CHUNK).zip(du.par_chunks_mut(CHUNK)).enumerate().for_each(|(t, (a, b))| {
        let span = t * CHUNK..t * CHUNK + a.len();
        vector::swiglu_backward(&g[span.clone()], &u[span.clone()], &dh[span], a, b);
    });
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
    // SAFETY: gemm with read_dst false writes all rows x d_out elements.
    unsafe {
        written(rows * d_out, |y| {
            if d_in == 0 {
                std::ptr::write_bytes(y, 0, rows * d_out);
                return;
            }
            gemm(
                rows,
                d_out,
                d_in,
                y,
                1,
                d_out as isize,
                false,
                x.as_ptr(),
                1,
                d_in as isize,
                w.as_ptr(),
                d_in as isize,
                1,
                0.0,
                1.0,
                false,
                false,
                false,
                parallelism(rows, d_out, d_in),
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
    let mm_into = |m: usize,
                   n: usize,
                   k: usize,
                   lhs: *const f32,
                   lhs_rs: isize,
                   lhs_cs: isize,
                   rhs: *const f32,
                   rhs_rs: isize,
                   rhs_cs: isize| {
        // SAFETY: gemm with read_dst false writes all m x n elements; operands are in bounds.
        unsafe {
            written(m * n, |dst| {
                if k == 0 {
                    std::ptr::write_bytes(dst, 0, m * n);
                    return;
                }
                gemm(
                    m,
                    n,
                    k,
                    dst,
                    1,
                    n as isize,
                    false,
                    lhs,
                    lhs_cs,
                    lhs_rs,
                    rhs,
                    rhs_cs,
                    rhs_rs,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    parallelism(m, n, k),
                )
            })
        }
    };
    let dx = want.0.then(|| mm_into(rows, d_in, d_out, dy.as_ptr(), d_out as isize, 1, w.as_ptr(), d_in as isize, 1));
    let dw = want.1.then(|| mm_into(d_out, d_in, rows, dy.as_ptr(), 1, d_out as isize, x.as_ptr(), d_in as isize, 1));
    (dx, dw)
}
