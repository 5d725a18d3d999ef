//! Flash attention (forward and recomputing backward) as one autodiff operation.

mod kernels;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use burn_cubecl::tensor::CubeTensor;

use burn_cubecl::CubeRuntime;

use super::{contiguous, elemwise, empty, finish, on_cube, prim, take, upload_u32, wrap, Cube, Input, Kind};
use crate::documents::Documents;

/// Largest head dim the kernels keep per unit in registers.
pub const MAX_HEAD_DIM: usize = 256;

/// Causal grouped-query attention in the projection layout, optionally windowed and with
/// per-head sinks; value head dim may differ from the query/key head dim. Same contract as
/// `crate::cpu::attention`: query `i` sees keys `i - window < j <= i`; the sink is one more logit
/// per head in the softmax's denominator, with no value; with `docs`, a query sees only keys of
/// its own document (key tiles wholly outside it are skipped).
///
/// # Shapes
/// - q: `[B, S, H, D]`, k: `[B, S, G, D]`, v: `[B, S, G, E]` with `H % G == 0`; sinks: `[H]`;
///   docs over `[B, S]`
/// - output: `[B, S, H, E]`
pub fn attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    sinks: Option<Tensor<B, 1>>,
    scale: f64,
    window: Option<usize>,
    docs: Option<&Documents>,
) -> Option<Tensor<B, 4>> {
    on_cube!(B, attention_on(q, k, v, sinks, scale, window, docs))
}

/// One block of ring attention (`crate::ring::partial`) as [`crate::cpu::attention_block`]:
/// queries at positions `q_start..q_start + Sq` over keys at `k_start..k_start + Tk` of sequences
/// of `seq` tokens, causal, windowed and within documents as [`attention`], without sinks; the
/// output `[B, Sq, H, E]` normalised over the block's keys and its log-sum-exp `[B, H, Sq, 1]`
/// (`empty` for a row that sees no key, whose output is 0), both differentiable, through the
/// flash kernels: nothing of size `Sq x Tk` is kept, the backward recomputes the probabilities
/// from the log-sum-exp. f32 only (`None` otherwise: the ring composes the block).
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
    at: [usize; 3],
    empty: f32,
) -> Option<(Tensor<B, 4>, Tensor<B, 4>)> {
    on_cube!(B, attention_block_on(q, k, v, scale, window, docs, at, empty))
}

#[derive(Clone, Debug)]
struct Dims {
    b: usize,
    /// Query rows and key rows of the call.
    sq: usize,
    tk: usize,
    /// The positions of the first query and the first key, and the sequence's length.
    q_start: usize,
    k_start: usize,
    seq: usize,
    h: usize,
    g: usize,
    d: usize,
    e: usize,
    window: usize,
    tile: usize,
    scale: f32,
    /// The log-sum-exp of a row that sees no key.
    empty: f32,
    /// Every token's document start, then end (`Documents::bounds`), when masked.
    docs: Option<std::sync::Arc<[u32]>>,
}

impl Dims {
    /// What the kernels read at run time.
    fn heads<R: cubecl::Runtime>(&self) -> kernels::HeadsLaunch<R> {
        kernels::HeadsLaunch::new(
            self.sq as u32,
            self.tk as u32,
            self.q_start as u32,
            self.k_start as u32,
            self.seq as u32,
            self.h as u32,
            self.g as u32,
            self.window as u32,
            self.scale,
            self.empty,
        )
    }
}

/// The largest key/value tile of `tile` rows (64 down to 8) whose staging fits the device's shared
/// memory and cube size; `None` when even 8 does not.
fn tile_for<R: CubeRuntime>(like: &CubeTensor<R>, d: usize, e: usize) -> Option<usize> {
    let props = like.client.properties().hardware.clone();
    let shared = props.max_shared_memory_size.min(48 * 1024);
    let fits = |tile: usize| tile * (d + e + 2) * 4 <= shared && tile <= props.max_units_per_cube as usize;
    [64, 32, 16, 8].into_iter().find(|&t| fits(t))
}

fn attention_on<B: Backend, C: Cube>(
    kind: Kind,
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    sinks: Option<Tensor<B, 1>>,
    scale: f64,
    window: Option<usize>,
    docs: Option<&Documents>,
) -> Option<Tensor<B, 4>> {
    let [b, s, h, d] = q.dims();
    if docs.is_some_and(|x| (x.batch(), x.seq()) != (b, s)) {
        return None;
    }
    let [kb, ks, g, kd] = k.dims();
    let [vb, vs, vg, e] = v.dims();
    if [kb, ks, kd] != [b, s, d] || [vb, vs, vg] != [b, s, g] || g == 0 || h % g != 0 {
        return None;
    }
    if b == 0 || s == 0 || d == 0 || e == 0 || d > MAX_HEAD_DIM || e > MAX_HEAD_DIM || window == Some(0) {
        return None;
    }
    if sinks.as_ref().is_some_and(|x| x.dims() != [h]) || s > u32::MAX as usize / 2 {
        return None;
    }
    let window = window.filter(|&w| w < s).unwrap_or(0);
    let (q, k, v) = (take::<B, C, 4>(kind, q)?, take::<B, C, 4>(kind, k)?, take::<B, C, 4>(kind, v)?);
    let dtype = q.t.dtype;
    if k.t.dtype != dtype || v.t.dtype != dtype {
        return None;
    }
    let tile = tile_for(&q.t, d, e)?;
    let docs = docs.filter(|x| !x.is_whole()).map(|x| x.bounds().into());
    let dims = Dims {
        b,
        sq: s,
        tk: s,
        q_start: 0,
        k_start: 0,
        seq: s,
        h,
        g,
        d,
        e,
        window,
        tile,
        scale: scale as f32,
        empty: -1.0e30,
        docs,
    };
    match sinks {
        Some(sinks) => {
            let sinks = take::<B, C, 1>(kind, sinks)?;
            if sinks.t.dtype != dtype {
                return None;
            }
            Some(run::<B, C, 4>(kind, [q, k, v, sinks], dims))
        }
        None => Some(run::<B, C, 3>(kind, [q, k, v], dims)),
    }
}

#[allow(clippy::too_many_arguments)]
fn attention_block_on<B: Backend, C: Cube>(
    kind: Kind,
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    scale: f64,
    window: Option<usize>,
    docs: Option<&Documents>,
    [seq, q_start, k_start]: [usize; 3],
    empty: f32,
) -> Option<(Tensor<B, 4>, Tensor<B, 4>)> {
    if !crate::ring::block_fits([q.dims(), k.dims(), v.dims()], window, docs, [seq, q_start, k_start]) {
        return None;
    }
    let ([b, sq, h, d], [_, tk, g, _], [.., e]) = (q.dims(), k.dims(), v.dims());
    // What the kernels' registers and 32-bit indexing reach.
    if b == 0 || d == 0 || e == 0 || d > MAX_HEAD_DIM || e > MAX_HEAD_DIM || seq > u32::MAX as usize / 2 {
        return None;
    }
    let (q, k, v) = (take::<B, C, 4>(kind, q)?, take::<B, C, 4>(kind, k)?, take::<B, C, 4>(kind, v)?);
    // The output and the log-sum-exp travel as one f32 tensor (below).
    if [q.t.dtype, k.t.dtype, v.t.dtype] != [DType::F32; 3] {
        return None;
    }
    let tile = tile_for(&q.t, d, e)?;
    let window = window.filter(|&w| w < seq).unwrap_or(0);
    let docs = docs.filter(|x| !x.is_whole()).map(|x| x.bounds().into());
    let x = Dims { b, sq, tk, q_start, k_start, seq, h, g, d, e, window, tile, scale: scale as f32, empty, docs };
    let flash = Flash::new(&q.t, &k.t, &v.t, None, x.clone());
    let (o, lse) = flash.forward();
    // One node of two outputs: the output and the log-sum-exp side by side, `[B, Sq, H, E + 1]`.
    let lse_rows = wrap::<C, 3>(lse.clone()).swap_dims(1, 2).reshape([b, sq, h, 1]);
    let packed = prim(Tensor::cat(vec![wrap::<C, 4>(o.clone()), lse_rows], 3));
    let both: Tensor<B, 4> = finish::<B, C, 4, 3>(kind, [&q, &k, &v], packed, move |dpacked, wanted| {
        let dpacked = wrap::<C, 4>(dpacked);
        let d_o = contiguous(prim(dpacked.clone().narrow(3, 0, e)));
        let dlse = contiguous(prim(dpacked.narrow(3, e, 1).reshape([b, sq, h]).swap_dims(1, 2)));
        let delta = flash.delta(&o, &d_o, Some(&dlse));
        let (dq, _) = if wanted[0] { flash.backward_q(&d_o, &lse, &delta, false) } else { (None, None) };
        let (dk, dv) = if wanted[1] || wanted[2] { flash.backward_kv(&d_o, &lse, &delta) } else { (None, None) };
        [dq, dk.filter(|_| wanted[1]), dv.filter(|_| wanted[2])]
    });
    let out = both.clone().narrow(3, 0, e);
    let lse = both.narrow(3, e, 1).swap_dims(1, 2); // [B, H, Sq, 1]
    Some((out, lse))
}

/// The flash kernels of one call: its inputs (contiguous), its document bounds on the device and
/// its shape; each method launches one kernel.
struct Flash<R: CubeRuntime> {
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    /// The sinks, or `q` as a placeholder the kernels do not read.
    sinks: CubeTensor<R>,
    has_sinks: bool,
    docs: CubeTensor<R>,
    x: Dims,
}

impl<R: CubeRuntime> Flash<R> {
    fn new(q: &CubeTensor<R>, k: &CubeTensor<R>, v: &CubeTensor<R>, sinks: Option<&CubeTensor<R>>, x: Dims) -> Self {
        let docs = upload_u32(q, x.docs.as_deref().unwrap_or(&[]));
        Self {
            q: q.clone(),
            k: k.clone(),
            v: v.clone(),
            sinks: sinks.unwrap_or(q).clone(),
            has_sinks: sinks.is_some(),
            docs,
            x,
        }
    }

    fn dtype(&self) -> DType {
        self.q.dtype
    }

    /// One cube per query tile, head and batch row.
    fn query_grid(&self) -> cubecl::CubeCount {
        cubecl::CubeCount::Static(self.x.sq.div_ceil(self.x.tile) as u32, self.x.h as u32, self.x.b as u32)
    }

    fn unit(&self) -> cubecl::CubeDim {
        cubecl::CubeDim::new_1d(self.x.tile as u32)
    }

    /// The output `[B, Sq, H, E]` and the log-sum-exp `[B, H, Sq]` (f32).
    fn forward(&self) -> (CubeTensor<R>, CubeTensor<R>) {
        let x = &self.x;
        let o = empty(&self.q, &[x.b, x.sq, x.h, x.e], self.dtype());
        let lse = empty(&self.q, &[x.b, x.h, x.sq], DType::F32);
        kernels::flash_fwd::launch::<R>(
            &self.q.client,
            self.query_grid(),
            self.unit(),
            self.q.clone().into_tensor_arg(),
            self.k.clone().into_tensor_arg(),
            self.v.clone().into_tensor_arg(),
            self.sinks.clone().into_tensor_arg(),
            self.docs.clone().into_tensor_arg(),
            o.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            x.heads(),
            x.d,
            x.e,
            x.tile,
            self.has_sinks,
            x.docs.is_some(),
            self.dtype().into(),
        );
        (o, lse)
    }

    /// The rows' `delta` `[B, H, Sq]` (f32), less the log-sum-exp's gradient where it is one.
    fn delta(&self, o: &CubeTensor<R>, d_o: &CubeTensor<R>, dlse: Option<&CubeTensor<R>>) -> CubeTensor<R> {
        let x = &self.x;
        let delta = empty(&self.q, &[x.b, x.h, x.sq], DType::F32);
        // Without one, a buffer of its own that the kernel does not read (not `delta`, which it
        // writes: one binding read and written would alias).
        let unread = empty(&self.q, &[1], DType::F32);
        let (count, dim) = elemwise(&self.q, x.b * x.h * x.sq);
        kernels::flash_delta::launch::<R>(
            &self.q.client,
            count,
            dim,
            o.clone().into_tensor_arg(),
            d_o.clone().into_tensor_arg(),
            dlse.unwrap_or(&unread).clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            x.sq as u32,
            x.h as u32,
            x.e as u32,
            dlse.is_some(),
            self.dtype().into(),
        );
        delta
    }

    /// The queries' gradient and, with `sink_rows` (sinks only), each row's share of the sinks'
    /// `[B * H * Sq]` (f32).
    fn backward_q(
        &self,
        d_o: &CubeTensor<R>,
        lse: &CubeTensor<R>,
        delta: &CubeTensor<R>,
        sink_rows: bool,
    ) -> (Option<CubeTensor<R>>, Option<CubeTensor<R>>) {
        let x = &self.x;
        let dq = empty(&self.q, &[x.b, x.sq, x.h, x.d], self.dtype());
        let dsink = empty(&self.q, &[if sink_rows { x.b * x.h * x.sq } else { 1 }], DType::F32);
        kernels::flash_bwd_q::launch::<R>(
            &self.q.client,
            self.query_grid(),
            self.unit(),
            self.q.clone().into_tensor_arg(),
            self.k.clone().into_tensor_arg(),
            self.v.clone().into_tensor_arg(),
            self.sinks.clone().into_tensor_arg(),
            self.docs.clone().into_tensor_arg(),
            d_o.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            dq.clone().into_tensor_arg(),
            dsink.clone().into_tensor_arg(),
            x.heads(),
            x.d,
            x.e,
            x.tile,
            self.has_sinks && sink_rows,
            x.docs.is_some(),
            self.dtype().into(),
        );
        (Some(dq), sink_rows.then_some(dsink))
    }

    /// The keys' and values' gradients.
    fn backward_kv(
        &self,
        d_o: &CubeTensor<R>,
        lse: &CubeTensor<R>,
        delta: &CubeTensor<R>,
    ) -> (Option<CubeTensor<R>>, Option<CubeTensor<R>>) {
        let x = &self.x;
        let dk = empty(&self.q, &[x.b, x.tk, x.g, x.d], self.dtype());
        let dv = empty(&self.q, &[x.b, x.tk, x.g, x.e], self.dtype());
        kernels::flash_bwd_kv::launch::<R>(
            &self.q.client,
            cubecl::CubeCount::Static(x.tk.div_ceil(x.tile) as u32, x.g as u32, x.b as u32),
            self.unit(),
            self.q.clone().into_tensor_arg(),
            self.k.clone().into_tensor_arg(),
            self.v.clone().into_tensor_arg(),
            self.docs.clone().into_tensor_arg(),
            d_o.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            dk.clone().into_tensor_arg(),
            dv.clone().into_tensor_arg(),
            x.heads(),
            x.d,
            x.e,
            x.tile,
            x.docs.is_some(),
            self.dtype().into(),
        );
        (Some(dk), Some(dv))
    }
}

fn run<B: Backend, C: Cube, const N: usize>(kind: Kind, inputs: [Input<C>; N], x: Dims) -> Tensor<B, 4> {
    let has_sinks = N == 4;
    let flash = Flash::new(&inputs[0].t, &inputs[1].t, &inputs[2].t, has_sinks.then(|| &inputs[3].t), x.clone());
    let (o, lse) = flash.forward();
    let dtype = flash.dtype();
    let o_saved = o.clone();
    let refs: [&Input<C>; N] = std::array::from_fn(|j| &inputs[j]);
    finish::<B, C, 4, N>(kind, refs, o, move |d_o, wanted| {
        let mut grads: [Option<CubeTensor<C::R>>; N] = std::array::from_fn(|_| None);
        let delta = flash.delta(&o_saved, &d_o, None);
        let sink_wanted = has_sinks && wanted[N - 1];
        if wanted[0] || sink_wanted {
            let (dq, dsink) = flash.backward_q(&d_o, &lse, &delta, sink_wanted);
            if wanted[0] {
                grads[0] = dq;
            }
            if let Some(dsink) = dsink {
                // Sum each head's per-row shares over batch and sequence.
                let rows: Tensor<C, 3> = wrap::<C, 1>(dsink).reshape([x.b, x.h, x.sq]);
                let per_head = rows.sum_dim(2).sum_dim(0).reshape([x.h]);
                let per_head = if dtype == DType::F32 { per_head } else { per_head.cast(dtype) };
                grads[N - 1] = Some(prim(per_head));
            }
        }
        if wanted[1] || wanted[2] {
            let (dk, dv) = flash.backward_kv(&d_o, &lse, &delta);
            grads[1] = dk.filter(|_| wanted[1]);
            grads[2] = dv.filter(|_| wanted[2]);
        }
        grads
    })
}
