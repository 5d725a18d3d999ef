//! The `#[cube]` kernels. Every float kernel is generic over the storage type `F` (f32, f16,
//! bf16: `#[define(F)]`, chosen at launch from the tensor's dtype) and accumulates in f32; index
//! tensors are `u32` (ours) or the backend's int type `I`. Inputs are contiguous row-major.
//!
//! Shapes and layouts are documented on each kernel; the launchers in the sibling modules
//! check them before launching.

use cubecl::prelude::*;

// "No score yet" in the online softmax is -1e30 (finite: WGSL has no -inf literal).

// ---------------------------------------------------------------- token dispatch and combine

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

// ---------------------------------------------------------------- grouped expert FFN

/// Grouped matrix product over expert segments of rows:
/// `c[r, n] (+)= sum_k a[r, k] B_e(k, n) (+ bias_e(n))` for the rows `r` of expert `e`, where
/// `B_e(k, n) = b[b_off + e b_se + k b_sk + n b_sn]` (any layout: `x W^T`, `x W`, interleaved
/// columns) and `bias_e(n) = bias[bias_off + e bias_se + n bias_sn]`.
///
/// Tiles of 64 x 64 outputs, 256 units with 4 x 4 outputs each, a 16-deep slice of `a` and `B`
/// staged in shared memory per step. The row tiles are listed by the host: tile `x` covers rows
/// `tile_row[x] .. min(tile_row[x] + 64, tile_end[x])` of expert `tile_expert[x]`, so experts
/// with no token cost nothing and no tile straddles two experts.
#[cube(launch)]
pub fn grouped_mm<F: Float>(
    a: &Tensor<F>,
    b: &Tensor<F>,
    bias: &Tensor<F>,
    c: &mut Tensor<F>,
    tile_expert: &Tensor<u32>,
    tile_row: &Tensor<u32>,
    tile_end: &Tensor<u32>,
    k_dim: u32,
    n_dim: u32,
    b_off: u32,
    b_se: u32,
    b_sk: u32,
    b_sn: u32,
    bias_off: u32,
    bias_se: u32,
    bias_sn: u32,
    #[comptime] has_bias: bool,
    #[comptime] accumulate: bool,
    #[comptime] b_k_contiguous: bool,
    #[define(F)] _dtype: StorageType,
) {
    let tile = CUBE_POS_X as usize;
    let n0 = (CUBE_POS_Y as usize) * 64;
    let e = tile_expert[tile] as usize;
    let r0 = tile_row[tile] as usize;
    let r_end = tile_end[tile] as usize;
    let kd = k_dim as usize;
    let nd = n_dim as usize;
    let b_sk = b_sk as usize;
    let b_sn = b_sn as usize;
    let b_base = (b_off as usize) + e * (b_se as usize);

    let tx = (UNIT_POS % 16) as usize;
    let ty = (UNIT_POS / 16) as usize;
    let unit = UNIT_POS as usize;

    let mut sa = SharedMemory::<f32>::new(16usize * 64usize);
    let mut sb = SharedMemory::<f32>::new(16usize * 64usize);
    let mut acc = Array::<f32>::new(16usize);
    let mut bf = Array::<f32>::new(4usize);
    #[unroll]
    for i in 0..16usize {
        acc[i] = 0.0f32;
    }

    let mut k0 = 0usize;
    while k0 < kd {
        // a: 64 rows x 16 k, 4 values per unit, k fastest (contiguous in `a`).
        #[unroll]
        for t in 0..4usize {
            let idx = unit + t * 256;
            let mm = idx / 16;
            let kk = idx % 16;
            let r = r0 + mm;
            let kx = k0 + kk;
            let inside = r < r_end && kx < kd;
            let at = select(inside, r * kd + kx, 0usize);
            let v = f32::cast_from(a[at]);
            sa[kk * 64 + mm] = select(inside, v, 0.0f32);
        }
        // B: 16 k x 64 n, the contiguous one of k and n fastest across units (coalesced).
        #[unroll]
        for t in 0..4usize {
            let idx = unit + t * 256;
            let mut kk = idx / 64;
            let mut nn = idx % 64;
            if b_k_contiguous {
                kk = idx % 16;
                nn = idx / 16;
            }
            let kx = k0 + kk;
            let nx = n0 + nn;
            let inside = kx < kd && nx < nd;
            let at = select(inside, b_base + kx * b_sk + nx * b_sn, 0usize);
            let v = f32::cast_from(b[at]);
            sb[kk * 64 + nn] = select(inside, v, 0.0f32);
        }
        sync_cube();
        #[unroll]
        for kk in 0..16usize {
            #[unroll]
            for j in 0..4usize {
                bf[j] = sb[kk * 64 + tx + 16 * j];
            }
            #[unroll]
            for i in 0..4usize {
                let av = sa[kk * 64 + ty + 16 * i];
                #[unroll]
                for j in 0..4usize {
                    acc[i * 4 + j] += av * bf[j];
                }
            }
        }
        sync_cube();
        k0 += 16;
    }

    #[unroll]
    for i in 0..4usize {
        let r = r0 + ty + 16 * i;
        #[unroll]
        for j in 0..4usize {
            let n = n0 + tx + 16 * j;
            if r < r_end && n < nd {
                let mut v = acc[i * 4 + j];
                if has_bias {
                    let at = (bias_off as usize) + e * (bias_se as usize) + n * (bias_sn as usize);
                    v += f32::cast_from(bias[at]);
                }
                let at = r * nd + n;
                if accumulate {
                    v += f32::cast_from(c[at]);
                }
                c[at] = F::cast_from(v);
            }
        }
    }
}

/// The weight gradient of [`grouped_mm()`]: `out_e(n, k) = sum_{r of e} g[r, n] a[r, k]`, written at
/// `out[o_off + e o_se + n o_sn + k o_sk]` (the weight's own layout). Tiles of 64 x 64 outputs per
/// expert, rows reduced 16 at a time through shared memory; an expert with no rows gets zeros.
#[cube(launch)]
pub fn grouped_mm_tn<F: Float>(
    g: &Tensor<F>,
    a: &Tensor<F>,
    out: &mut Tensor<F>,
    offsets: &Tensor<u32>,
    n_dim: u32,
    k_dim: u32,
    o_off: u32,
    o_se: u32,
    o_sn: u32,
    o_sk: u32,
    #[define(F)] _dtype: StorageType,
) {
    let n0 = (CUBE_POS_X as usize) * 64;
    let k0 = (CUBE_POS_Y as usize) * 64;
    let e = CUBE_POS_Z as usize;
    let r_start = offsets[e] as usize;
    let r_end = offsets[e + 1] as usize;
    let nd = n_dim as usize;
    let kd = k_dim as usize;

    let tx = (UNIT_POS % 16) as usize;
    let ty = (UNIT_POS / 16) as usize;
    let unit = UNIT_POS as usize;

    let mut sg = SharedMemory::<f32>::new(16usize * 64usize);
    let mut sa = SharedMemory::<f32>::new(16usize * 64usize);
    let mut acc = Array::<f32>::new(16usize);
    let mut af = Array::<f32>::new(4usize);
    #[unroll]
    for i in 0..16usize {
        acc[i] = 0.0f32;
    }

    let mut r0 = r_start;
    while r0 < r_end {
        #[unroll]
        for t in 0..4usize {
            let idx = unit + t * 256;
            let rr = idx / 64;
            let cc = idx % 64;
            let r = r0 + rr;
            let n = n0 + cc;
            let kx = k0 + cc;
            let in_g = r < r_end && n < nd;
            let in_a = r < r_end && kx < kd;
            let gv = f32::cast_from(g[select(in_g, r * nd + n, 0usize)]);
            let av = f32::cast_from(a[select(in_a, r * kd + kx, 0usize)]);
            sg[rr * 64 + cc] = select(in_g, gv, 0.0f32);
            sa[rr * 64 + cc] = select(in_a, av, 0.0f32);
        }
        sync_cube();
        #[unroll]
        for rr in 0..16usize {
            #[unroll]
            for j in 0..4usize {
                af[j] = sa[rr * 64 + tx + 16 * j];
            }
            #[unroll]
            for i in 0..4usize {
                let gv = sg[rr * 64 + ty + 16 * i];
                #[unroll]
                for j in 0..4usize {
                    acc[i * 4 + j] += gv * af[j];
                }
            }
        }
        sync_cube();
        r0 += 16;
    }

    let o_off = o_off as usize;
    let o_se = o_se as usize;
    let o_sn = o_sn as usize;
    let o_sk = o_sk as usize;
    #[unroll]
    for i in 0..4usize {
        let n = n0 + ty + 16 * i;
        #[unroll]
        for j in 0..4usize {
            let kx = k0 + tx + 16 * j;
            if n < nd && kx < kd {
                out[o_off + e * o_se + n * o_sn + kx * o_sk] = F::cast_from(acc[i * 4 + j]);
            }
        }
    }
}

/// Bias gradient: `out[o_off + e o_se + n o_sn] = sum_{r of e} g[r, n]`. One unit per `(e, n)`.
#[cube(launch)]
pub fn segment_col_sum<F: Float>(
    g: &Tensor<F>,
    out: &mut Tensor<F>,
    offsets: &Tensor<u32>,
    experts: u32,
    n_dim: u32,
    o_off: u32,
    o_se: u32,
    o_sn: u32,
    #[define(F)] _dtype: StorageType,
) {
    let nd = n_dim as usize;
    if ABSOLUTE_POS < (experts as usize) * nd {
        let e = ABSOLUTE_POS / nd;
        let n = ABSOLUTE_POS % nd;
        let mut acc = 0.0f32;
        let start = offsets[e] as usize;
        let end = offsets[e + 1] as usize;
        for r in start..end {
            acc += f32::cast_from(g[r * nd + n]);
        }
        let at = (o_off as usize) + e * (o_se as usize) + n * (o_sn as usize);
        out[at] = F::cast_from(acc);
    }
}

#[cube]
fn sigmoid(x: f32) -> f32 {
    1.0f32 / (1.0f32 + (0.0f32 - x).exp())
}

/// The expert activation, elementwise over `[rows, I]`: SwiGLU `silu(g) u` (`clamped = false`) or
/// GPT-OSS's `(clamp(u, -limit, limit) + 1) min(g, limit) sigmoid(alpha min(g, limit))`.
#[cube(launch)]
pub fn expert_act<F: Float>(
    hg: &Tensor<F>,
    hu: &Tensor<F>,
    out: &mut Tensor<F>,
    alpha: f32,
    limit: f32,
    #[comptime] clamped: bool,
    #[define(F)] _dtype: StorageType,
) {
    if ABSOLUTE_POS < out.len() {
        let g = f32::cast_from(hg[ABSOLUTE_POS]);
        let u = f32::cast_from(hu[ABSOLUTE_POS]);
        if clamped {
            let gc = select(g > limit, limit, g);
            let uc = select(u > limit, limit, select(u < 0.0f32 - limit, 0.0f32 - limit, u));
            out[ABSOLUTE_POS] = F::cast_from((uc + 1.0f32) * gc * sigmoid(alpha * gc));
        } else {
            out[ABSOLUTE_POS] = F::cast_from(g * sigmoid(g) * u);
        }
    }
}

/// Backward of [`expert_act()`]: `(dhg, dhu)` from `da`. Clamping passes the gradient where the
/// input is inside the range, bounds included (Burn's and torch's convention).
#[cube(launch)]
pub fn expert_act_grad<F: Float>(
    hg: &Tensor<F>,
    hu: &Tensor<F>,
    da: &Tensor<F>,
    dhg: &mut Tensor<F>,
    dhu: &mut Tensor<F>,
    alpha: f32,
    limit: f32,
    #[comptime] clamped: bool,
    #[define(F)] _dtype: StorageType,
) {
    if ABSOLUTE_POS < da.len() {
        let g = f32::cast_from(hg[ABSOLUTE_POS]);
        let u = f32::cast_from(hu[ABSOLUTE_POS]);
        let d = f32::cast_from(da[ABSOLUTE_POS]);
        if clamped {
            let g_in = g <= limit;
            let gc = select(g_in, g, limit);
            let u_in = u >= 0.0f32 - limit && u <= limit;
            let uc = select(u > limit, limit, select(u < 0.0f32 - limit, 0.0f32 - limit, u));
            let s = sigmoid(alpha * gc);
            let glu = gc * s;
            let dgc = d * (uc + 1.0f32) * (s + alpha * gc * s * (1.0f32 - s));
            dhg[ABSOLUTE_POS] = F::cast_from(select(g_in, dgc, 0.0f32));
            dhu[ABSOLUTE_POS] = F::cast_from(select(u_in, d * glu, 0.0f32));
        } else {
            let s = sigmoid(g);
            let silu = g * s;
            dhg[ABSOLUTE_POS] = F::cast_from(d * u * s * (1.0f32 + g * (1.0f32 - s)));
            dhu[ABSOLUTE_POS] = F::cast_from(d * silu);
        }
    }
}

// ---------------------------------------------------------------- attention

/// Stages `width` values of `src` from `base` into shared memory at `at`, as f32.
#[cube]
fn stage_row<F: Float>(src: &Tensor<F>, base: usize, dst: &mut SharedMemory<f32>, at: usize, #[comptime] width: usize) {
    for c in 0..width {
        dst[at + c] = f32::cast_from(src[base + c]);
    }
}

/// Flash-attention forward. q `[B, S, H, D]`, k `[B, S, G, D]`, v `[B, S, G, E]` -> o
/// `[B, S, H, E]` and the row log-sum-exp `lse [B, H, S]` (f32, with the scale folded in).
///
/// One cube per `(query tile, head, batch)`, one unit per query row; key/value tiles of `tile`
/// rows are staged in shared memory; each row keeps its running max, sum and output in registers
/// (online softmax), so nothing of size `S x S` exists. Keys visible to query `i`:
/// `i - window < j <= i` (`window = 0`: all `j <= i`). With sinks, head `h`'s sink logit joins
/// the softmax denominator (the running state starts at `m = sink, l = 1`).
#[cube(launch)]
pub fn flash_fwd<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    sinks: &Tensor<F>,
    o: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    seq: u32,
    n_heads: u32,
    n_groups: u32,
    win: u32,
    scale: f32,
    #[comptime] d: usize,
    #[comptime] e: usize,
    #[comptime] tile: usize,
    #[comptime] has_sinks: bool,
    #[define(F)] _dtype: StorageType,
) {
    let neg = f32::new(-1.0e30);
    let s_len = seq as usize;
    let heads = n_heads as usize;
    let groups = n_groups as usize;
    let window = win as usize;
    let qt = CUBE_POS_X as usize;
    let h = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let g = h / (heads / groups);
    let u = UNIT_POS as usize;
    let i = qt * tile + u;
    let valid = i < s_len;
    let ic = select(valid, i, s_len - 1);

    let mut qr = Array::<f32>::new(d);
    let q_base = ((b * s_len + ic) * heads + h) * d;
    for c in 0..d {
        qr[c] = f32::cast_from(q[q_base + c]) * scale;
    }
    let mut acc = Array::<f32>::new(e);
    for c in 0..e {
        acc[c] = 0.0f32;
    }
    let mut sc = Array::<f32>::new(tile);
    let mut m = neg;
    let mut l = 0.0f32;
    if has_sinks {
        m = f32::cast_from(sinks[h]);
        l = 1.0f32;
    }

    let mut ks = SharedMemory::<f32>::new(tile * d);
    let mut vs = SharedMemory::<f32>::new(tile * e);

    let first = qt * tile;
    let mut hi = first + tile;
    if hi > s_len {
        hi = s_len;
    }
    let mut lo = 0usize;
    if window > 0 && first + 1 > window {
        lo = first + 1 - window;
    }
    let mut kt = lo / tile;
    let kt_end = (hi + tile - 1) / tile;
    while kt < kt_end {
        let j_load = kt * tile + u;
        let jc = select(j_load < s_len, j_load, s_len - 1);
        let k_base = ((b * s_len + jc) * groups + g) * d;
        let v_base = ((b * s_len + jc) * groups + g) * e;
        stage_row::<F>(k, k_base, &mut ks, u * d, d);
        stage_row::<F>(v, v_base, &mut vs, u * e, e);
        sync_cube();
        if valid {
            let mut tmax = neg;
            for jt in 0..tile {
                let j = kt * tile + jt;
                let visible = j <= i && (window == 0 || i < j + window);
                let mut s = neg;
                if visible {
                    s = 0.0f32;
                    for c in 0..d {
                        s += qr[c] * ks[jt * d + c];
                    }
                }
                sc[jt] = s;
                tmax = select(s > tmax, s, tmax);
            }
            if tmax > neg {
                let m_new = select(tmax > m, tmax, m);
                let corr = (m - m_new).exp();
                l *= corr;
                for c in 0..e {
                    acc[c] *= corr;
                }
                for jt in 0..tile {
                    if sc[jt] > neg {
                        let p = (sc[jt] - m_new).exp();
                        l += p;
                        for c in 0..e {
                            acc[c] += p * vs[jt * e + c];
                        }
                    }
                }
                m = m_new;
            }
        }
        sync_cube();
        kt += 1;
    }

    if valid {
        let inv = select(l > 0.0f32, 1.0f32 / l, 0.0f32);
        let o_base = ((b * s_len + i) * heads + h) * e;
        for c in 0..e {
            o[o_base + c] = F::cast_from(acc[c] * inv);
        }
        lse[(b * heads + h) * s_len + i] = m + l.ln();
    }
}

/// `delta[b, h, i] = sum_c do[b, i, h, c] o[b, i, h, c]` (f32), the row term of the softmax
/// backward. One unit per row.
#[cube(launch)]
pub fn flash_delta<F: Float>(
    o: &Tensor<F>,
    d_o: &Tensor<F>,
    delta: &mut Tensor<f32>,
    s_len: u32,
    heads: u32,
    e: u32,
    #[define(F)] _dtype: StorageType,
) {
    if ABSOLUTE_POS < delta.len() {
        let s = s_len as usize;
        let hh = heads as usize;
        let ee = e as usize;
        let i = ABSOLUTE_POS % s;
        let h = (ABSOLUTE_POS / s) % hh;
        let b = ABSOLUTE_POS / (s * hh);
        let base = ((b * s + i) * hh + h) * ee;
        let mut acc = 0.0f32;
        for c in 0..ee {
            acc += f32::cast_from(o[base + c]) * f32::cast_from(d_o[base + c]);
        }
        delta[ABSOLUTE_POS] = acc;
    }
}

/// Flash-attention backward for the queries (recomputing the probabilities from `lse`):
/// `dq_i = scale sum_j p_ij (do_i . v_j - delta_i) k_j`; with sinks also each row's share of the
/// sink gradient, `dsink[b, h, i] = -exp(sink_h - lse_i) delta_i` (summed by the caller).
/// Same grid and tiling as [`flash_fwd()`].
#[cube(launch)]
pub fn flash_bwd_q<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    sinks: &Tensor<F>,
    d_o: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dq: &mut Tensor<F>,
    dsink: &mut Tensor<f32>,
    seq: u32,
    n_heads: u32,
    n_groups: u32,
    win: u32,
    scale: f32,
    #[comptime] d: usize,
    #[comptime] e: usize,
    #[comptime] tile: usize,
    #[comptime] has_sinks: bool,
    #[define(F)] _dtype: StorageType,
) {
    let s_len = seq as usize;
    let heads = n_heads as usize;
    let groups = n_groups as usize;
    let window = win as usize;
    let qt = CUBE_POS_X as usize;
    let h = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let g = h / (heads / groups);
    let u = UNIT_POS as usize;
    let i = qt * tile + u;
    let valid = i < s_len;
    let ic = select(valid, i, s_len - 1);

    let mut qr = Array::<f32>::new(d);
    let mut dqr = Array::<f32>::new(d);
    let q_base = ((b * s_len + ic) * heads + h) * d;
    for c in 0..d {
        qr[c] = f32::cast_from(q[q_base + c]) * scale;
        dqr[c] = 0.0f32;
    }
    let mut dor = Array::<f32>::new(e);
    let o_base = ((b * s_len + ic) * heads + h) * e;
    for c in 0..e {
        dor[c] = f32::cast_from(d_o[o_base + c]);
    }
    let row = (b * heads + h) * s_len + ic;
    let lse_i = lse[row];
    let delta_i = delta[row];

    let mut ks = SharedMemory::<f32>::new(tile * d);
    let mut vs = SharedMemory::<f32>::new(tile * e);

    let first = qt * tile;
    let mut hi = first + tile;
    if hi > s_len {
        hi = s_len;
    }
    let mut lo = 0usize;
    if window > 0 && first + 1 > window {
        lo = first + 1 - window;
    }
    let mut kt = lo / tile;
    let kt_end = (hi + tile - 1) / tile;
    while kt < kt_end {
        let j_load = kt * tile + u;
        let jc = select(j_load < s_len, j_load, s_len - 1);
        let k_base = ((b * s_len + jc) * groups + g) * d;
        let v_base = ((b * s_len + jc) * groups + g) * e;
        stage_row::<F>(k, k_base, &mut ks, u * d, d);
        stage_row::<F>(v, v_base, &mut vs, u * e, e);
        sync_cube();
        if valid {
            for jt in 0..tile {
                let j = kt * tile + jt;
                let visible = j <= i && (window == 0 || i < j + window);
                if visible {
                    let mut s = 0.0f32;
                    for c in 0..d {
                        s += qr[c] * ks[jt * d + c];
                    }
                    let p = (s - lse_i).exp();
                    let mut dp = 0.0f32;
                    for c in 0..e {
                        dp += dor[c] * vs[jt * e + c];
                    }
                    let ds = p * (dp - delta_i);
                    for c in 0..d {
                        dqr[c] += ds * ks[jt * d + c];
                    }
                }
            }
        }
        sync_cube();
        kt += 1;
    }

    if valid {
        for c in 0..d {
            dq[q_base + c] = F::cast_from(dqr[c] * scale);
        }
        if has_sinks {
            let sink = f32::cast_from(sinks[h]);
            dsink[row] = 0.0f32 - (sink - lse_i).exp() * delta_i;
        }
    }
}

/// Flash-attention backward for the keys and values: one cube per `(key tile, group, batch)`,
/// one unit per key row, looping over the group's heads and the query tiles that can see the
/// key tile (staged in shared memory with their `lse` and `delta`):
/// `dv_j = sum_i p_ij do_i`, `dk_j = scale sum_i p_ij (do_i . v_j - delta_i) q_i`.
#[cube(launch)]
pub fn flash_bwd_kv<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    d_o: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    seq: u32,
    n_heads: u32,
    n_groups: u32,
    win: u32,
    scale: f32,
    #[comptime] d: usize,
    #[comptime] e: usize,
    #[comptime] tile: usize,
    #[define(F)] _dtype: StorageType,
) {
    let s_len = seq as usize;
    let heads = n_heads as usize;
    let groups = n_groups as usize;
    let window = win as usize;
    let kt = CUBE_POS_X as usize;
    let g = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let per_group = heads / groups;
    let u = UNIT_POS as usize;
    let j = kt * tile + u;
    let valid = j < s_len;
    let jc = select(valid, j, s_len - 1);

    let mut kr = Array::<f32>::new(d);
    let mut dkr = Array::<f32>::new(d);
    let k_base = ((b * s_len + jc) * groups + g) * d;
    for c in 0..d {
        kr[c] = f32::cast_from(k[k_base + c]) * scale;
        dkr[c] = 0.0f32;
    }
    let mut vr = Array::<f32>::new(e);
    let mut dvr = Array::<f32>::new(e);
    let v_base = ((b * s_len + jc) * groups + g) * e;
    for c in 0..e {
        vr[c] = f32::cast_from(v[v_base + c]);
        dvr[c] = 0.0f32;
    }

    let mut qs = SharedMemory::<f32>::new(tile * d);
    let mut dos = SharedMemory::<f32>::new(tile * e);
    let mut ls = SharedMemory::<f32>::new(tile);
    let mut ds_ = SharedMemory::<f32>::new(tile);

    // Queries that can see this key tile: from its first key to its last key + window - 1.
    let first = kt * tile;
    let mut hi = s_len;
    if window > 0 {
        let last_key = first + tile - 1;
        if last_key + window < s_len {
            hi = last_key + window;
        }
    }
    let qt_end = (hi + tile - 1) / tile;
    for hh in 0..per_group {
        let h = g * per_group + hh;
        let mut qt = kt;
        while qt < qt_end {
            let i_load = qt * tile + u;
            let icl = select(i_load < s_len, i_load, s_len - 1);
            let q_base = ((b * s_len + icl) * heads + h) * d;
            let o_base = ((b * s_len + icl) * heads + h) * e;
            stage_row::<F>(q, q_base, &mut qs, u * d, d);
            stage_row::<F>(d_o, o_base, &mut dos, u * e, e);
            let row = (b * heads + h) * s_len + icl;
            ls[u] = lse[row];
            ds_[u] = delta[row];
            sync_cube();
            if valid {
                for it in 0..tile {
                    let i = qt * tile + it;
                    let visible = i < s_len && j <= i && (window == 0 || i < j + window);
                    if visible {
                        let mut s = 0.0f32;
                        for c in 0..d {
                            s += kr[c] * qs[it * d + c];
                        }
                        let p = (s - ls[it]).exp();
                        let mut dp = 0.0f32;
                        for c in 0..e {
                            let dov = dos[it * e + c];
                            dvr[c] += p * dov;
                            dp += dov * vr[c];
                        }
                        let dsc = p * (dp - ds_[it]);
                        for c in 0..d {
                            dkr[c] += dsc * qs[it * d + c];
                        }
                    }
                }
            }
            sync_cube();
            qt += 1;
        }
    }

    if valid {
        for c in 0..d {
            dk[k_base + c] = F::cast_from(dkr[c] * scale);
        }
        for c in 0..e {
            dv[v_base + c] = F::cast_from(dvr[c]);
        }
    }
}
