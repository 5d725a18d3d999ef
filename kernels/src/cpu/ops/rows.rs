//! The row-wise and elementwise operations: RMSNorm, the SwiGLU activation, rotary embedding,
//! next-token cross-entropy. Rows (or chunks of elements) are split over the rayon pool.

use rayon::prelude::*;

use super::rows_per_task;
use crate::cpu::vector;

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
pub(super) fn swiglu_into(g: &[f32], u: &[f32], out: &mut [f32]) {
    out.par_chunks_mut(CHUNK).enumerate().for_each(|(t, o)| {
        let span = t * CHUNK..t * CHUNK + o.len();
        vector::swiglu(&g[span.clone()], &u[span], o);
    });
}

/// Backward of `silu(g) * u` into `dg`, `du`, in parallel chunks.
pub(super) fn swiglu_backward_into(g: &[f32], u: &[f32], dh: &[f32], dg: &mut [f32], du: &mut [f32]) {
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
/// after each position), over the targets `ignore` (`[B, S - 1]`) does not mark; returns the loss
/// and the gradient of the loss w.r.t. the logits (`(softmax - onehot) / N` on the `N` counted
/// positions, zero elsewhere). With nothing counted, the loss and its gradient are zero.
pub fn cross_entropy(
    logits: &[f32],
    labels: &[usize],
    ignore: Option<&[bool]>,
    batch: usize,
    seq: usize,
    vocab: usize,
) -> (f64, Vec<f32>) {
    let counted = |i: usize| ignore.is_none_or(|m| !m[i]);
    let n = (0..batch * (seq - 1)).filter(|&i| counted(i)).count();
    let mut grad = vec![0f32; logits.len()];
    if n == 0 {
        return (0.0, grad);
    }
    let losses: Vec<f64> = grad
        .par_chunks_mut(vocab)
        .enumerate()
        .map(|(row, gr)| {
            let (b, t) = (row / seq, row % seq);
            if t + 1 == seq || !counted(b * (seq - 1) + t) {
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
