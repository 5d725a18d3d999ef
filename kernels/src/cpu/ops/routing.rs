//! Token dispatch and combine on the host: rows permuted into expert order, and each token's
//! expert outputs summed back in the canonical order of [`crate::order`].

use rayon::prelude::*;

use crate::cpu::vector;
use crate::order::{expert_key, tree_sum, Term, SHARED_KEY};

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
