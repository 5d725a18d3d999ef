//! Causal attention (grouped heads, sliding window, sink logits) forward and backward, tiled
//! over query rows; each (batch, head) or (batch, head group) is one rayon task.

use rayon::prelude::*;

use super::{mm, Out, SyncPtr, View};
use crate::cpu::vector;

/// Query rows per tile of the attention loops: a tile's keys stop at its last row (causality).
const BLOCK: usize = 64;

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
    /// Keys row `i` of batch row `b` sees: `[lo, i + 1)`, `lo` the later of the window's start
    /// and (with `starts`, each token's document start `[B * S]`) the document's.
    fn row_keys(&self, starts: Option<&[u32]>, b: usize, i: usize) -> (usize, usize) {
        let lo = self.window.map_or(0, |w| (i + 1).saturating_sub(w));
        let doc = starts.map_or(0, |st| st[b * self.seq + i] as usize);
        (lo.max(doc), i + 1)
    }

    /// Keys the tile of rows `[i0, i1)` touches (both bounds grow with the row, so the first
    /// row's is the lowest: tiles before it, wholly masked, are skipped).
    fn tile_keys(&self, starts: Option<&[u32]>, b: usize, i0: usize, i1: usize) -> (usize, usize) {
        (self.row_keys(starts, b, i0).0, i1)
    }
}

/// Forward: returns the output `[B, S, H, E]` and the probabilities `[B, H, S, S]` (zero outside
/// each row's keys), which the backward reuses.
///
/// With `sinks` (`[H]`), each head's sink logit joins every row's softmax and its probability
/// mass is dropped (GPT-OSS). With `starts` (`[B * S]`, each token's document start), a row sees
/// only keys of its own document.
pub fn attention_forward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    sinks: Option<&[f32]>,
    starts: Option<&[u32]>,
    a: AttnShape,
) -> (Vec<f32>, Vec<f32>) {
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
            let (lo, hk) = a.tile_keys(starts, bi, i0, i1);
            // SAFETY: all offsets stay inside the buffers (shapes checked by the caller); this
            // task alone writes rows of head `hi` in batch `bi` of `out`, and its own `p`.
            unsafe {
                mm(
                    i1 - i0,
                    hk - lo,
                    d,
                    Out::set(p.as_mut_ptr().add(i0 * s + lo), s),
                    View::rows(q.as_ptr().add(q0 + i0 * h * d), h * d),
                    View::rows(k.as_ptr().add(k0 + lo * g * d), g * d).t(),
                    scale,
                );
            }
            for i in i0..i1 {
                let row = &mut p[i * s..(i + 1) * s];
                let (rl, rh) = a.row_keys(starts, bi, i);
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
                    Out::set(out_ptr.ptr().add(((bi * s + i0) * h + hi) * e), h * e),
                    View::rows(p.as_ptr().add(i0 * s + lo), s),
                    View::rows(v.as_ptr().add(v0 + lo * g * e), g * e),
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
/// p[i, j] dp[i, j]`). `starts` as in [`attention_forward`].
pub fn attention_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    probs: &[f32],
    dout: &[f32],
    starts: Option<&[u32]>,
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
                let (lo, hk) = a.tile_keys(starts, bi, i0, i1);
                // SAFETY: offsets inside the buffers; this task alone writes the dq rows of the
                // heads of group `gi` in batch `bi`, and the dk/dv rows of that group.
                unsafe {
                    // dP = dO V^T
                    mm(
                        rows,
                        hk - lo,
                        e,
                        Out::set(ds.as_mut_ptr().add(i0 * s + lo), s),
                        View::rows(dout.as_ptr().add(o0 + i0 * h * e), h * e),
                        View::rows(v.as_ptr().add(v0 + lo * g * e), g * e).t(),
                        1.0,
                    );
                }
                for i in i0..i1 {
                    let (rl, rh) = a.row_keys(starts, bi, i);
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
                        Out::set(dq_ptr.0.add(q0 + i0 * h * d), h * d),
                        View::rows(ds.as_ptr().add(i0 * s + lo), s),
                        View::rows(k.as_ptr().add(k0 + lo * g * d), g * d),
                        scale,
                    );
                    // dK += scale dS^T Q
                    mm(
                        hk - lo,
                        d,
                        rows,
                        Out::add(dk_ptr.0.add(k0 + lo * g * d), g * d),
                        View::rows(ds.as_ptr().add(i0 * s + lo), s).t(),
                        View::rows(q.as_ptr().add(q0 + i0 * h * d), h * d),
                        scale,
                    );
                    // dV += P^T dO
                    mm(
                        hk - lo,
                        e,
                        rows,
                        Out::add(dv_ptr.0.add(v0 + lo * g * e), g * e),
                        View::rows(p.as_ptr().add(i0 * s + lo), s).t(),
                        View::rows(dout.as_ptr().add(o0 + i0 * h * e), h * e),
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

/// Shape of one block of ring attention (`crate::ring::partial`): queries at positions
/// `q_start..q_start + sq` of sequences of `seq` tokens over keys at `k_start..k_start + tk`;
/// q `[B, Sq, H, D]`, k `[B, Tk, G, D]`, v `[B, Tk, G, E]`, output `[B, Sq, H, E]`, probabilities
/// `[B, H, Sq, Tk]`, log-sum-exp `[B, H, Sq]`.
#[derive(Debug, Clone, Copy)]
pub struct BlockShape {
    pub batch: usize,
    /// Tokens of a whole sequence (the documents' `starts` are over them).
    pub seq: usize,
    pub q_start: usize,
    pub sq: usize,
    pub k_start: usize,
    pub tk: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub qk_dim: usize,
    pub v_dim: usize,
    /// A query at `p` sees keys `p - window < k <= p`; `None` = all earlier keys.
    pub window: Option<usize>,
    pub scale: f32,
    /// The log-sum-exp of a row that sees no key of the block.
    pub empty: f32,
}

impl BlockShape {
    /// The block's keys (indices into it) row `i` of batch row `b` sees, `[lo, hi)`, maybe
    /// empty; both bounds grow with `i` (the window's and the document's starts do).
    fn row_keys(&self, starts: Option<&[u32]>, b: usize, i: usize) -> (usize, usize) {
        let p = self.q_start + i;
        let lo = self.window.map_or(0, |w| (p + 1).saturating_sub(w));
        let lo = starts.map_or(lo, |st| lo.max(st[b * self.seq + p] as usize));
        let clamp = |x: usize| x.clamp(self.k_start, self.k_start + self.tk) - self.k_start;
        let (lo, hi) = (clamp(lo), clamp(p + 1));
        (lo, hi.max(lo))
    }

    /// Keys the tile of rows `[i0, i1)` touches.
    fn tile_keys(&self, starts: Option<&[u32]>, b: usize, i0: usize, i1: usize) -> (usize, usize) {
        (self.row_keys(starts, b, i0).0, self.row_keys(starts, b, i1 - 1).1)
    }
}

/// One block's forward: the output `[B, Sq, H, E]` (normalised over the block's keys), the
/// probabilities `[B, H, Sq, Tk]` (zero outside each row's keys; the backward reuses them) and the
/// log-sum-exp `[B, H, Sq]` (`empty` for a row that sees no key, whose output is 0).
pub fn attention_block_forward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    starts: Option<&[u32]>,
    a: BlockShape,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let BlockShape { batch, sq, tk, heads: h, kv_heads: g, qk_dim: d, v_dim: e, scale, .. } = a;
    let n = h / g;
    let mut out = vec![0f32; batch * sq * h * e];
    let mut probs = vec![0f32; batch * h * sq * tk];
    let mut lse = vec![a.empty; batch * h * sq];
    let out_ptr = SyncPtr(out.as_mut_ptr());
    probs.par_chunks_mut(sq * tk).zip(lse.par_chunks_mut(sq)).enumerate().for_each(|(bh, (p, l))| {
        let (bi, hi) = (bh / h, bh % h);
        let gi = hi / n;
        let q0 = (bi * sq * h + hi) * d;
        let k0 = (bi * tk * g + gi) * d;
        let v0 = (bi * tk * g + gi) * e;
        for i0 in (0..sq).step_by(BLOCK) {
            let i1 = (i0 + BLOCK).min(sq);
            let (lo, hk) = a.tile_keys(starts, bi, i0, i1);
            if lo >= hk {
                continue;
            }
            // SAFETY: all offsets stay inside the buffers (shapes checked by the caller); this
            // task alone writes rows of head `hi` in batch `bi` of `out`, and its own `p`.
            unsafe {
                mm(
                    i1 - i0,
                    hk - lo,
                    d,
                    Out::set(p.as_mut_ptr().add(i0 * tk + lo), tk),
                    View::rows(q.as_ptr().add(q0 + i0 * h * d), h * d),
                    View::rows(k.as_ptr().add(k0 + lo * g * d), g * d).t(),
                    scale,
                );
            }
            for i in i0..i1 {
                let row = &mut p[i * tk..(i + 1) * tk];
                let (rl, rh) = a.row_keys(starts, bi, i);
                row[lo..rl.max(lo)].fill(0.0);
                row[rh.max(lo).min(hk)..hk].fill(0.0);
                if rl >= rh {
                    row[lo..hk].fill(0.0);
                    continue;
                }
                let m = vector::max(&row[rl..rh]);
                let sum = vector::exp_shifted_sum(&mut row[rl..rh], m);
                vector::scale(&mut row[rl..rh], 1.0 / sum);
                l[i] = m + sum.ln();
            }
            unsafe {
                mm(
                    i1 - i0,
                    e,
                    hk - lo,
                    Out::set(out_ptr.ptr().add(((bi * sq + i0) * h + hi) * e), h * e),
                    View::rows(p.as_ptr().add(i0 * tk + lo), tk),
                    View::rows(v.as_ptr().add(v0 + lo * g * e), g * e),
                    1.0,
                );
            }
        }
    });
    (out, probs, lse)
}

/// One block's backward: from the forward's inputs and probabilities, the gradients of the
/// output `[B, Sq, H, E]` and of the log-sum-exp `[B, H, Sq]`, the gradients of q, k and v (in
/// their layouts). The log-sum-exp's gradient with respect to a row's scores is its
/// probabilities, so each row's score gradient is `p * (dP - <p, dP> + dlse)`.
#[allow(clippy::too_many_arguments)]
pub fn attention_block_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    probs: &[f32],
    dout: &[f32],
    dlse: &[f32],
    starts: Option<&[u32]>,
    a: BlockShape,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let BlockShape { batch, sq, tk, heads: h, kv_heads: g, qk_dim: d, v_dim: e, scale, .. } = a;
    let n = h / g;
    let mut dq = vec![0f32; batch * sq * h * d];
    let mut dk = vec![0f32; batch * tk * g * d];
    let mut dv = vec![0f32; batch * tk * g * e];
    let (dq_ptr, dk_ptr, dv_ptr) = (SyncPtr(dq.as_mut_ptr()), SyncPtr(dk.as_mut_ptr()), SyncPtr(dv.as_mut_ptr()));
    (0..batch * g).into_par_iter().for_each(|bg| {
        let (dq_ptr, dk_ptr, dv_ptr) = (dq_ptr, dk_ptr, dv_ptr);
        let (bi, gi) = (bg / g, bg % g);
        let k0 = (bi * tk * g + gi) * d;
        let v0 = (bi * tk * g + gi) * e;
        let mut ds = vec![0f32; sq * tk];
        for hi in gi * n..(gi + 1) * n {
            let p = &probs[(bi * h + hi) * sq * tk..(bi * h + hi + 1) * sq * tk];
            let dl = &dlse[(bi * h + hi) * sq..(bi * h + hi + 1) * sq];
            let q0 = (bi * sq * h + hi) * d;
            let o0 = (bi * sq * h + hi) * e;
            for i0 in (0..sq).step_by(BLOCK) {
                let i1 = (i0 + BLOCK).min(sq);
                let rows = i1 - i0;
                let (lo, hk) = a.tile_keys(starts, bi, i0, i1);
                if lo >= hk {
                    continue;
                }
                // SAFETY: offsets inside the buffers; this task alone writes the dq rows of the
                // heads of group `gi` in batch `bi`, and the dk/dv rows of that group.
                unsafe {
                    // dP = dO V^T
                    mm(
                        rows,
                        hk - lo,
                        e,
                        Out::set(ds.as_mut_ptr().add(i0 * tk + lo), tk),
                        View::rows(dout.as_ptr().add(o0 + i0 * h * e), h * e),
                        View::rows(v.as_ptr().add(v0 + lo * g * e), g * e).t(),
                        1.0,
                    );
                }
                for i in i0..i1 {
                    let (rl, rh) = a.row_keys(starts, bi, i);
                    let row = &mut ds[i * tk..(i + 1) * tk];
                    if rl >= rh {
                        row[lo..hk].fill(0.0);
                        continue;
                    }
                    row[lo..rl].fill(0.0);
                    row[rh..hk].fill(0.0);
                    let pr = &p[i * tk + rl..i * tk + rh];
                    vector::softmax_backward_row(pr, &mut row[rl..rh]);
                    for (x, &pj) in row[rl..rh].iter_mut().zip(pr) {
                        *x += pj * dl[i];
                    }
                }
                unsafe {
                    // dQ = scale dS K
                    mm(
                        rows,
                        d,
                        hk - lo,
                        Out::set(dq_ptr.0.add(q0 + i0 * h * d), h * d),
                        View::rows(ds.as_ptr().add(i0 * tk + lo), tk),
                        View::rows(k.as_ptr().add(k0 + lo * g * d), g * d),
                        scale,
                    );
                    // dK += scale dS^T Q
                    mm(
                        hk - lo,
                        d,
                        rows,
                        Out::add(dk_ptr.0.add(k0 + lo * g * d), g * d),
                        View::rows(ds.as_ptr().add(i0 * tk + lo), tk).t(),
                        View::rows(q.as_ptr().add(q0 + i0 * h * d), h * d),
                        scale,
                    );
                    // dV += P^T dO
                    mm(
                        hk - lo,
                        e,
                        rows,
                        Out::add(dv_ptr.0.add(v0 + lo * g * e), g * e),
                        View::rows(p.as_ptr().add(i0 * tk + lo), tk).t(),
                        View::rows(dout.as_ptr().add(o0 + i0 * h * e), h * e),
                        1.0,
                    );
                }
            }
        }
    });
    (dq, dk, dv)
}
