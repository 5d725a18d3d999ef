//! The `#[cube]` kernels of the grouped expert FFN: the grouped products, the per-expert column
//! sums (bias gradients) and the activations.
//!
//! Every float kernel is generic over the storage type `F` (f32, f16, bf16: `#[define(F)]`,
//! chosen at launch from the tensor's dtype) and accumulates in f32; index tensors are `u32`
//! (ours) or the backend's int type `I`. Inputs are contiguous row-major. Shapes and layouts are
//! documented on each kernel; the launchers in the parent module check them before launching.

use cubecl::prelude::*;

/// Where expert `e`'s matrix element `(k, n)` sits in a flat tensor: `off + e se + k sk + n sn`
/// (any layout: `x W^T`, `x W`, interleaved columns).
#[derive(CubeType, CubeLaunch, Clone, Copy)]
pub struct ExpertMat {
    pub off: u32,
    pub se: u32,
    pub sk: u32,
    pub sn: u32,
}

/// Where expert `e`'s vector element `n` (a bias) sits in a flat tensor: `off + e se + n sn`.
#[derive(CubeType, CubeLaunch, Clone, Copy)]
pub struct ExpertVec {
    pub off: u32,
    pub se: u32,
    pub sn: u32,
}

/// Grouped matrix product over expert segments of rows:
/// `c[r, n] (+)= sum_k a[r, k] B_e(k, n) (+ bias_e(n))` for the rows `r` of expert `e`, where
/// `B_e(k, n)` is `b` read through `b_at` and `bias_e(n)` is `bias` read through `bias_at`.
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
    b_at: ExpertMat,
    bias_at: ExpertVec,
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
    let b_sk = b_at.sk as usize;
    let b_sn = b_at.sn as usize;
    let b_base = (b_at.off as usize) + e * (b_at.se as usize);

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
                    let at = (bias_at.off as usize) + e * (bias_at.se as usize) + n * (bias_at.sn as usize);
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

/// The weight gradient of [`grouped_mm()`]: `out_e(n, k) = sum_{r of e} g[r, n] a[r, k]`, written to
/// `out` at `out_at`'s `(k, n)` (the weight's own layout). Tiles of 64 x 64 outputs per
/// expert, rows reduced 16 at a time through shared memory; an expert with no rows gets zeros.
#[cube(launch)]
pub fn grouped_mm_tn<F: Float>(
    g: &Tensor<F>,
    a: &Tensor<F>,
    out: &mut Tensor<F>,
    offsets: &Tensor<u32>,
    n_dim: u32,
    k_dim: u32,
    out_at: ExpertMat,
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

    let o_off = out_at.off as usize;
    let o_se = out_at.se as usize;
    let o_sn = out_at.sn as usize;
    let o_sk = out_at.sk as usize;
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

/// Bias gradient: `out` at `out_at`'s `n` for expert `e` is `sum_{r of e} g[r, n]`. One unit per `(e, n)`.
#[cube(launch)]
pub fn segment_col_sum<F: Float>(
    g: &Tensor<F>,
    out: &mut Tensor<F>,
    offsets: &Tensor<u32>,
    experts: u32,
    n_dim: u32,
    out_at: ExpertVec,
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
        let at = (out_at.off as usize) + e * (out_at.se as usize) + n * (out_at.sn as usize);
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
