//! The `#[cube]` kernels of flash attention, forward and backward.
//!
//! Every float kernel is generic over the storage type `F` (f32, f16, bf16: `#[define(F)]`,
//! chosen at launch from the tensor's dtype) and accumulates in f32; index tensors are `u32`
//! (ours) or the backend's int type `I`. Inputs are contiguous row-major. Shapes and layouts are
//! documented on each kernel; the launchers in the parent module check them before launching.

use cubecl::prelude::*;

/// What the attention kernels know of a call at run time: the query rows and key rows of the call,
/// the sequence positions of the first of each and the sequence's length (a whole sequence: rows
/// = keys = seq, both from 0; one block of ring attention: a chunk of queries over a chunk of
/// keys), the query heads, the key/value head groups (`heads / groups` queries share one), the
/// sliding window (0: none), the score scale, and the log-sum-exp of a row that sees no key.
#[derive(CubeType, CubeLaunch, Clone, Copy)]
pub struct Heads {
    pub rows: u32,
    pub keys: u32,
    pub q_start: u32,
    pub k_start: u32,
    pub seq: u32,
    pub heads: u32,
    pub groups: u32,
    pub window: u32,
    pub scale: f32,
    pub empty: f32,
}

// "No score yet" in the online softmax is -1e30 (finite: WGSL has no -inf literal).

/// Stages `width` values of `src` from `base` into shared memory at `at`, as f32.
#[cube]
fn stage_row<F: Float>(src: &Tensor<F>, base: usize, dst: &mut SharedMemory<f32>, at: usize, #[comptime] width: usize) {
    for c in 0..width {
        dst[at + c] = f32::cast_from(src[base + c]);
    }
}

/// Flash-attention forward. q `[B, Sq, H, D]`, k `[B, Tk, G, D]`, v `[B, Tk, G, E]` -> o
/// `[B, Sq, H, E]` and the row log-sum-exp `lse [B, H, Sq]` (f32, with the scale folded in;
/// `shape.empty` for a row that sees no key, whose output is 0).
///
/// One cube per `(query tile, head, batch)`, one unit per query row; key/value tiles of `tile`
/// rows are staged in shared memory; each row keeps its running max, sum and output in registers
/// (online softmax), so nothing of size `Sq x Tk` exists. Query row `i` is at position `p =
/// q_start + i` of the sequence, key row `j` at `t = k_start + j`; keys visible to it: `p - window
/// < t <= p` (`window = 0`: all `t <= p`), and with `has_docs` also `t >= docs[b seq + p]`
/// (`docs`: every token's document start `[B * seq]`, then its end `[B * seq]`); key tiles outside
/// the query tile's reach are skipped. With sinks, head `h`'s sink logit joins the softmax
/// denominator (the running state starts at `m = sink, l = 1`).
#[cube(launch)]
pub fn flash_fwd<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    sinks: &Tensor<F>,
    docs: &Tensor<u32>,
    o: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    shape: Heads,
    #[comptime] d: usize,
    #[comptime] e: usize,
    #[comptime] tile: usize,
    #[comptime] has_sinks: bool,
    #[comptime] has_docs: bool,
    #[define(F)] _dtype: StorageType,
) {
    let neg = f32::new(-1.0e30);
    let sq = shape.rows as usize;
    let tk = shape.keys as usize;
    let q0 = shape.q_start as usize;
    let k0 = shape.k_start as usize;
    let seq = shape.seq as usize;
    let heads = shape.heads as usize;
    let groups = shape.groups as usize;
    let window = shape.window as usize;
    let scale = shape.scale;
    let qt = CUBE_POS_X as usize;
    let h = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let g = h / (heads / groups);
    let u = UNIT_POS as usize;
    let i = qt * tile + u;
    let valid = i < sq;
    let ic = select(valid, i, sq - 1);
    let pos = q0 + i;

    let mut qr = Array::<f32>::new(d);
    let q_base = ((b * sq + ic) * heads + h) * d;
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

    // The key rows the query tile can see: from the first query's window or document start to
    // the last query's position.
    let first = qt * tile;
    let mut last = first + tile;
    if last > sq {
        last = sq;
    }
    let mut hi = 0usize;
    if q0 + last > k0 {
        hi = q0 + last - k0;
    }
    if hi > tk {
        hi = tk;
    }
    let mut lo_pos = 0usize;
    if window > 0 && q0 + first + 1 > window {
        lo_pos = q0 + first + 1 - window;
    }
    let mut doc_i = 0usize;
    if has_docs {
        let doc_first = docs[b * seq + q0 + first] as usize;
        if doc_first > lo_pos {
            lo_pos = doc_first;
        }
        doc_i = docs[b * seq + q0 + ic] as usize;
    }
    let mut lo = 0usize;
    if lo_pos > k0 {
        lo = lo_pos - k0;
    }
    let mut kt = lo / tile;
    let kt_end = (hi + tile - 1) / tile;
    while kt < kt_end {
        let j_load = kt * tile + u;
        let jc = select(j_load < tk, j_load, tk - 1);
        let k_base = ((b * tk + jc) * groups + g) * d;
        let v_base = ((b * tk + jc) * groups + g) * e;
        stage_row::<F>(k, k_base, &mut ks, u * d, d);
        stage_row::<F>(v, v_base, &mut vs, u * e, e);
        sync_cube();
        if valid {
            let mut tmax = neg;
            for jt in 0..tile {
                let j = kt * tile + jt;
                let t = k0 + j;
                let visible = j < tk && t <= pos && (window == 0 || pos < t + window) && t >= doc_i;
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
        let seen = l > 0.0f32;
        let inv = select(seen, 1.0f32 / l, 0.0f32);
        let o_base = ((b * sq + i) * heads + h) * e;
        for c in 0..e {
            o[o_base + c] = F::cast_from(acc[c] * inv);
        }
        lse[(b * heads + h) * sq + i] = select(seen, m + l.ln(), shape.empty);
    }
}

/// `delta[b, h, i] = sum_c do[b, i, h, c] o[b, i, h, c]` (f32), the row term of the softmax
/// backward; with `has_dlse`, less the gradient of the row's log-sum-exp `dlse [B, H, S]` (a block
/// of ring attention, whose log-sum-exp is an output: `ds = p (dp - delta + dlse)`). One unit per
/// row.
#[cube(launch)]
pub fn flash_delta<F: Float>(
    o: &Tensor<F>,
    d_o: &Tensor<F>,
    dlse: &Tensor<f32>,
    delta: &mut Tensor<f32>,
    s_len: u32,
    heads: u32,
    e: u32,
    #[comptime] has_dlse: bool,
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
        if has_dlse {
            acc -= dlse[ABSOLUTE_POS];
        }
        delta[ABSOLUTE_POS] = acc;
    }
}

/// Flash-attention backward for the queries (recomputing the probabilities from `lse`):
/// `dq_i = scale sum_j p_ij (do_i . v_j - delta_i) k_j`; with sinks also each row's share of the
/// sink gradient, `dsink[b, h, i] = -exp(sink_h - lse_i) delta_i` (summed by the caller).
/// Same grid, tiling and positions as [`flash_fwd()`].
#[cube(launch)]
pub fn flash_bwd_q<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    sinks: &Tensor<F>,
    docs: &Tensor<u32>,
    d_o: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dq: &mut Tensor<F>,
    dsink: &mut Tensor<f32>,
    shape: Heads,
    #[comptime] d: usize,
    #[comptime] e: usize,
    #[comptime] tile: usize,
    #[comptime] has_sinks: bool,
    #[comptime] has_docs: bool,
    #[define(F)] _dtype: StorageType,
) {
    let sq = shape.rows as usize;
    let tk = shape.keys as usize;
    let q0 = shape.q_start as usize;
    let k0 = shape.k_start as usize;
    let seq = shape.seq as usize;
    let heads = shape.heads as usize;
    let groups = shape.groups as usize;
    let window = shape.window as usize;
    let scale = shape.scale;
    let qt = CUBE_POS_X as usize;
    let h = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let g = h / (heads / groups);
    let u = UNIT_POS as usize;
    let i = qt * tile + u;
    let valid = i < sq;
    let ic = select(valid, i, sq - 1);
    let pos = q0 + i;

    let mut qr = Array::<f32>::new(d);
    let mut dqr = Array::<f32>::new(d);
    let q_base = ((b * sq + ic) * heads + h) * d;
    for c in 0..d {
        qr[c] = f32::cast_from(q[q_base + c]) * scale;
        dqr[c] = 0.0f32;
    }
    let mut dor = Array::<f32>::new(e);
    let o_base = ((b * sq + ic) * heads + h) * e;
    for c in 0..e {
        dor[c] = f32::cast_from(d_o[o_base + c]);
    }
    let row = (b * heads + h) * sq + ic;
    let lse_i = lse[row];
    let delta_i = delta[row];

    let mut ks = SharedMemory::<f32>::new(tile * d);
    let mut vs = SharedMemory::<f32>::new(tile * e);

    // The key rows the query tile can see: from the first query's window or document start to
    // the last query's position.
    let first = qt * tile;
    let mut last = first + tile;
    if last > sq {
        last = sq;
    }
    let mut hi = 0usize;
    if q0 + last > k0 {
        hi = q0 + last - k0;
    }
    if hi > tk {
        hi = tk;
    }
    let mut lo_pos = 0usize;
    if window > 0 && q0 + first + 1 > window {
        lo_pos = q0 + first + 1 - window;
    }
    let mut doc_i = 0usize;
    if has_docs {
        let doc_first = docs[b * seq + q0 + first] as usize;
        if doc_first > lo_pos {
            lo_pos = doc_first;
        }
        doc_i = docs[b * seq + q0 + ic] as usize;
    }
    let mut lo = 0usize;
    if lo_pos > k0 {
        lo = lo_pos - k0;
    }
    let mut kt = lo / tile;
    let kt_end = (hi + tile - 1) / tile;
    while kt < kt_end {
        let j_load = kt * tile + u;
        let jc = select(j_load < tk, j_load, tk - 1);
        let k_base = ((b * tk + jc) * groups + g) * d;
        let v_base = ((b * tk + jc) * groups + g) * e;
        stage_row::<F>(k, k_base, &mut ks, u * d, d);
        stage_row::<F>(v, v_base, &mut vs, u * e, e);
        sync_cube();
        if valid {
            for jt in 0..tile {
                let j = kt * tile + jt;
                let t = k0 + j;
                let visible = j < tk && t <= pos && (window == 0 || pos < t + window) && t >= doc_i;
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
/// `dv_j = sum_i p_ij do_i`, `dk_j = scale sum_i p_ij (do_i . v_j - delta_i) q_i`. Positions as in
/// [`flash_fwd()`]; with `has_docs`, only queries of key `j`'s document (positions before
/// `docs[B seq + b seq + t]`, its end) see it, and query tiles past the key tile's last document
/// end are skipped.
#[cube(launch)]
pub fn flash_bwd_kv<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    docs: &Tensor<u32>,
    d_o: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    shape: Heads,
    #[comptime] d: usize,
    #[comptime] e: usize,
    #[comptime] tile: usize,
    #[comptime] has_docs: bool,
    #[define(F)] _dtype: StorageType,
) {
    let sq = shape.rows as usize;
    let tk = shape.keys as usize;
    let q0 = shape.q_start as usize;
    let k0 = shape.k_start as usize;
    let seq = shape.seq as usize;
    let heads = shape.heads as usize;
    let groups = shape.groups as usize;
    let window = shape.window as usize;
    let scale = shape.scale;
    let kt = CUBE_POS_X as usize;
    let g = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let per_group = heads / groups;
    let u = UNIT_POS as usize;
    let j = kt * tile + u;
    let valid = j < tk;
    let jc = select(valid, j, tk - 1);
    let t = k0 + j;

    let mut kr = Array::<f32>::new(d);
    let mut dkr = Array::<f32>::new(d);
    let k_base = ((b * tk + jc) * groups + g) * d;
    for c in 0..d {
        kr[c] = f32::cast_from(k[k_base + c]) * scale;
        dkr[c] = 0.0f32;
    }
    let mut vr = Array::<f32>::new(e);
    let mut dvr = Array::<f32>::new(e);
    let v_base = ((b * tk + jc) * groups + g) * e;
    for c in 0..e {
        vr[c] = f32::cast_from(v[v_base + c]);
        dvr[c] = 0.0f32;
    }

    let mut qs = SharedMemory::<f32>::new(tile * d);
    let mut dos = SharedMemory::<f32>::new(tile * e);
    let mut ls = SharedMemory::<f32>::new(tile);
    let mut ds_ = SharedMemory::<f32>::new(tile);

    // Queries that can see this key tile: positions from its first key to its last key +
    // window - 1, and before its last key's document end.
    let first = kt * tile;
    let mut qt_first = 0usize;
    if k0 + first > q0 {
        qt_first = (k0 + first - q0) / tile;
    }
    let mut hi_pos = q0 + sq;
    if window > 0 {
        let last_key = k0 + first + tile - 1;
        if last_key + window < hi_pos {
            hi_pos = last_key + window;
        }
    }
    let ends = docs.len() / 2;
    let mut doc_end_j = seq;
    if has_docs {
        let mut last = first + tile - 1;
        if last >= tk {
            last = tk - 1;
        }
        let tile_end = docs[ends + b * seq + k0 + last] as usize;
        if tile_end < hi_pos {
            hi_pos = tile_end;
        }
        doc_end_j = docs[ends + b * seq + k0 + jc] as usize;
    }
    let mut hi = 0usize;
    if hi_pos > q0 {
        hi = hi_pos - q0;
    }
    let qt_end = (hi + tile - 1) / tile;
    for hh in 0..per_group {
        let h = g * per_group + hh;
        let mut qt = qt_first;
        while qt < qt_end {
            let i_load = qt * tile + u;
            let icl = select(i_load < sq, i_load, sq - 1);
            let q_base = ((b * sq + icl) * heads + h) * d;
            let o_base = ((b * sq + icl) * heads + h) * e;
            stage_row::<F>(q, q_base, &mut qs, u * d, d);
            stage_row::<F>(d_o, o_base, &mut dos, u * e, e);
            let row = (b * heads + h) * sq + icl;
            ls[u] = lse[row];
            ds_[u] = delta[row];
            sync_cube();
            if valid {
                for it in 0..tile {
                    let i = qt * tile + it;
                    let pos = q0 + i;
                    let visible = i < sq && t <= pos && (window == 0 || pos < t + window) && pos < doc_end_j;
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
