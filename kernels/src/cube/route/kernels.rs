//! The `#[cube]` kernels of token dispatch and combine: the counting sort of routed ids, top-k,
//! row permutation and the weighted combine with their backwards.
//!
//! Every float kernel is generic over the storage type `F` (f32, f16, bf16: `#[define(F)]`,
//! chosen at launch from the tensor's dtype) and accumulates in f32; index tensors are `u32`
//! (ours) or the backend's int type `I`. Inputs are contiguous row-major. Shapes and layouts are
//! documented on each kernel; the launchers in the parent module check them before launching.

use cubecl::prelude::*;

/// Counting-sort pass 1: `hist[e * nblocks + b]` = how many of the ids in block `b` (of `block`
/// slots) are `e`. One unit per `(e, b)`.
#[cube(launch)]
pub fn route_hist<I: Numeric>(
    ids: &Tensor<I>,
    hist: &mut Tensor<u32>,
    slots: u32,
    experts: u32,
    block: u32,
    #[define(I)] _dtype: StorageType,
) {
    let nblocks = (slots + block - 1) / block;
    let unit = ABSOLUTE_POS as u32;
    if unit < experts * nblocks {
        let e = unit / nblocks;
        let b = unit % nblocks;
        let start = b * block;
        let mut end = start + block;
        if end > slots {
            end = slots;
        }
        let mut c = 0u32;
        for s in start..end {
            if u32::cast_from(ids[s as usize]) == e {
                c += 1;
            }
        }
        hist[unit as usize] = c;
    }
}

/// The `k` largest of each row of `scores` (`[rows, cols]`): `ids[r k + j]` is the column of the
/// `j`-th largest, ties to the lower column (the order of the host's `top_k_rows`). One unit per
/// row; `O(k^2 cols)` comparisons, small next to the router's matmul for the usual `k <= 8`.
#[cube(launch)]
pub fn top_k_rows<F: Float>(
    scores: &Tensor<F>,
    ids: &mut Tensor<u32>,
    rows: u32,
    cols: u32,
    k: u32,
    #[define(F)] _dtype: StorageType,
) {
    let r = ABSOLUTE_POS as u32;
    if r < rows {
        for j in 0..k {
            let mut best = 0.0f32;
            let mut found = false;
            let mut pick = 0u32;
            for e in 0..cols {
                let mut taken = false;
                for i in 0..j {
                    if ids[(r * k + i) as usize] == e {
                        taken = true;
                    }
                }
                let v = f32::cast_from(scores[(r * cols + e) as usize]);
                if !taken && (!found || v > best) {
                    best = v;
                    pick = e;
                    found = true;
                }
            }
            ids[(r * k + j) as usize] = pick;
        }
    }
}

/// Counting-sort pass 2 (one cube): turns `hist` into each `(e, b)`'s first sorted position and
/// writes `counts[e]` and `offsets[e]` (`offsets[experts]` = total). At most 1024 experts.
#[cube(launch)]
pub fn route_scan<I: Numeric>(
    hist: &mut Tensor<u32>,
    counts: &mut Tensor<I>,
    offsets: &mut Tensor<I>,
    nblocks: u32,
    experts: u32,
    #[define(I)] _dtype: StorageType,
) {
    let mut totals = SharedMemory::<u32>::new(1024usize);
    let mut e = UNIT_POS;
    while e < experts {
        let mut run = 0u32;
        for b in 0..nblocks {
            let at = (e * nblocks + b) as usize;
            let h = hist[at];
            hist[at] = run;
            run += h;
        }
        totals[e as usize] = run;
        counts[e as usize] = I::cast_from(run);
        e += CUBE_DIM;
    }
    sync_cube();
    if UNIT_POS == 0 {
        let mut acc = 0u32;
        for x in 0..experts {
            let t = totals[x as usize];
            totals[x as usize] = acc;
            offsets[x as usize] = I::cast_from(acc);
            acc += t;
        }
        offsets[experts as usize] = I::cast_from(acc);
    }
    sync_cube();
    let mut e2 = UNIT_POS;
    while e2 < experts {
        let base = totals[e2 as usize];
        for b in 0..nblocks {
            let at = (e2 * nblocks + b) as usize;
            hist[at] += base;
        }
        e2 += CUBE_DIM;
    }
}

/// Counting-sort pass 3: each `(e, b)` walks its block in order and places its slots, so the
/// sort is stable. `dest[slot]` = sorted position, `src[position]` = slot.
#[cube(launch)]
pub fn route_scatter<I: Numeric>(
    ids: &Tensor<I>,
    hist: &Tensor<u32>,
    dest: &mut Tensor<I>,
    src: &mut Tensor<I>,
    slots: u32,
    experts: u32,
    block: u32,
    #[define(I)] _dtype: StorageType,
) {
    let nblocks = (slots + block - 1) / block;
    let unit = ABSOLUTE_POS as u32;
    if unit < experts * nblocks {
        let e = unit / nblocks;
        let b = unit % nblocks;
        let start = b * block;
        let mut end = start + block;
        if end > slots {
            end = slots;
        }
        let mut pos = hist[unit as usize];
        for s in start..end {
            if u32::cast_from(ids[s as usize]) == e {
                dest[s as usize] = I::cast_from(pos);
                src[pos as usize] = I::cast_from(s);
                pos += 1;
            }
        }
    }
}

/// `out[p, c] = x[src[p] / k, c]`: each token once per chosen expert, in expert order.
#[cube(launch)]
pub fn permute_rows<F: Float>(
    x: &Tensor<F>,
    src: &Tensor<u32>,
    out: &mut Tensor<F>,
    width: u32,
    k: u32,
    #[define(F)] _dtype: StorageType,
) {
    let w = width as usize;
    if ABSOLUTE_POS < out.len() {
        let p = ABSOLUTE_POS / w;
        let c = ABSOLUTE_POS % w;
        let token = (src[p] / k) as usize;
        out[ABSOLUTE_POS] = x[token * w + c];
    }
}

/// Backward of [`permute_rows()`]: `dx[t, c] = sum_j dy[dest[t k + j], c]` (a gather, no atomics).
#[cube(launch)]
pub fn unpermute_sum<F: Float>(
    dy: &Tensor<F>,
    dest: &Tensor<u32>,
    dx: &mut Tensor<F>,
    width: u32,
    k: u32,
    #[define(F)] _dtype: StorageType,
) {
    let w = width as usize;
    let kk = k as usize;
    if ABSOLUTE_POS < dx.len() {
        let t = ABSOLUTE_POS / w;
        let c = ABSOLUTE_POS % w;
        let mut acc = 0.0f32;
        for j in 0..kk {
            let p = dest[t * kk + j] as usize;
            acc += f32::cast_from(dy[p * w + c]);
        }
        dx[ABSOLUTE_POS] = F::cast_from(acc);
    }
}

/// `out[t, c] = sum_j w[t k + j] ys[dest[t k + j], c]`: the gate-weighted sum back in token order.
#[cube(launch)]
pub fn combine_rows<F: Float>(
    ys: &Tensor<F>,
    weights: &Tensor<F>,
    dest: &Tensor<u32>,
    out: &mut Tensor<F>,
    width: u32,
    k: u32,
    #[define(F)] _dtype: StorageType,
) {
    let w = width as usize;
    let kk = k as usize;
    if ABSOLUTE_POS < out.len() {
        let t = ABSOLUTE_POS / w;
        let c = ABSOLUTE_POS % w;
        let mut acc = 0.0f32;
        for j in 0..kk {
            let slot = t * kk + j;
            let p = dest[slot] as usize;
            acc += f32::cast_from(weights[slot]) * f32::cast_from(ys[p * w + c]);
        }
        out[ABSOLUTE_POS] = F::cast_from(acc);
    }
}

/// Backward of [`combine_rows()`] for the expert rows: `dys[p, c] = w[src[p]] dout[src[p] / k, c]`.
#[cube(launch)]
pub fn combine_grad_rows<F: Float>(
    dout: &Tensor<F>,
    weights: &Tensor<F>,
    src: &Tensor<u32>,
    dys: &mut Tensor<F>,
    width: u32,
    k: u32,
    #[define(F)] _dtype: StorageType,
) {
    let w = width as usize;
    if ABSOLUTE_POS < dys.len() {
        let p = ABSOLUTE_POS / w;
        let c = ABSOLUTE_POS % w;
        let slot = src[p];
        let t = (slot / k) as usize;
        let g = f32::cast_from(weights[slot as usize]) * f32::cast_from(dout[t * w + c]);
        dys[ABSOLUTE_POS] = F::cast_from(g);
    }
}

/// Backward of [`combine_rows()`] for the gate weights: `dw[s] = <dout[s / k], ys[dest[s]]>`. One
/// cube of `units` units per slot, partial sums in shared memory added by the first unit.
#[cube(launch)]
pub fn combine_grad_weights<F: Float>(
    dout: &Tensor<F>,
    ys: &Tensor<F>,
    dest: &Tensor<u32>,
    dw: &mut Tensor<F>,
    width: u32,
    k: u32,
    #[comptime] units: usize,
    #[define(F)] _dtype: StorageType,
) {
    let slot = (CUBE_POS_X + CUBE_POS_Y * CUBE_COUNT_X) as usize;
    let n = dw.len();
    let valid = slot < n;
    let s = select(valid, slot, 0usize);
    let w = width as usize;
    let t = s / (k as usize);
    let p = dest[s] as usize;
    let mut part = SharedMemory::<f32>::new(units);
    let mut acc = 0.0f32;
    let mut c = UNIT_POS as usize;
    while c < w {
        acc += f32::cast_from(dout[t * w + c]) * f32::cast_from(ys[p * w + c]);
        c += units;
    }
    part[UNIT_POS as usize] = acc;
    sync_cube();
    if UNIT_POS == 0 && valid {
        let mut total = 0.0f32;
        for x in 0..units {
            total += part[x];
        }
        dw[s] = F::cast_from(total);
    }
}
