//! Flash attention (forward and recomputing backward) as one autodiff operation.

mod kernels;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use burn_cubecl::tensor::CubeTensor;

use super::{elemwise, empty, finish, on_cube, prim, take, upload_u32, wrap, Cube, Input, Kind};
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

#[derive(Clone, Debug)]
struct Dims {
    b: usize,
    s: usize,
    h: usize,
    g: usize,
    d: usize,
    e: usize,
    window: usize,
    tile: usize,
    scale: f32,
    /// Every token's document start, then end (`Documents::bounds`), when masked.
    docs: Option<std::sync::Arc<[u32]>>,
}

impl Dims {
    /// What the kernels read at run time.
    fn heads<R: cubecl::Runtime>(&self) -> kernels::HeadsLaunch<R> {
        kernels::HeadsLaunch::new(self.s as u32, self.h as u32, self.g as u32, self.window as u32, self.scale)
    }
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
    let props = q.t.client.properties().hardware.clone();
    let shared = props.max_shared_memory_size.min(48 * 1024);
    let mut tile = 64usize;
    while tile > 8 && (tile * (d + e + 2) * 4 > shared || tile > props.max_units_per_cube as usize) {
        tile /= 2;
    }
    if tile * (d + e + 2) * 4 > shared || tile > props.max_units_per_cube as usize {
        return None; // even the smallest tile does not fit this device
    }
    let docs = docs.filter(|x| !x.is_whole()).map(|x| x.bounds().into());
    let dims = Dims { b, s, h, g, d, e, window, tile, scale: scale as f32, docs };
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

fn run<B: Backend, C: Cube, const N: usize>(kind: Kind, inputs: [Input<C>; N], x: Dims) -> Tensor<B, 4> {
    let has_sinks = N == 4;
    let (q, k, v) = (inputs[0].t.clone(), inputs[1].t.clone(), inputs[2].t.clone());
    let sinks = if has_sinks { inputs[3].t.clone() } else { q.clone() };
    let has_docs = x.docs.is_some();
    let docs = upload_u32(&q, x.docs.as_deref().unwrap_or(&[]));
    let dtype = q.dtype;
    let client = q.client.clone();
    let o = empty(&q, &[x.b, x.s, x.h, x.e], dtype);
    let lse = empty(&q, &[x.b, x.h, x.s], DType::F32);
    let grid = cubecl::CubeCount::Static(x.s.div_ceil(x.tile) as u32, x.h as u32, x.b as u32);
    let unit = cubecl::CubeDim::new_1d(x.tile as u32);
    kernels::flash_fwd::launch::<C::R>(
        &client,
        grid.clone(),
        unit,
        q.clone().into_tensor_arg(),
        k.clone().into_tensor_arg(),
        v.clone().into_tensor_arg(),
        sinks.clone().into_tensor_arg(),
        docs.clone().into_tensor_arg(),
        o.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        x.heads(),
        x.d,
        x.e,
        x.tile,
        has_sinks,
        has_docs,
        dtype.into(),
    );
    let o_saved = o.clone();
    let refs: [&Input<C>; N] = std::array::from_fn(|j| &inputs[j]);
    finish::<B, C, 4, N>(kind, refs, o, move |d_o, wanted| {
        let mut grads: [Option<CubeTensor<C::R>>; N] = std::array::from_fn(|_| None);
        let delta = empty(&q, &[x.b, x.h, x.s], DType::F32);
        let (count, dim) = elemwise(&q, x.b * x.h * x.s);
        kernels::flash_delta::launch::<C::R>(
            &client,
            count,
            dim,
            o_saved.into_tensor_arg(),
            d_o.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            x.s as u32,
            x.h as u32,
            x.e as u32,
            dtype.into(),
        );
        let sink_wanted = has_sinks && wanted[N - 1];
        if wanted[0] || sink_wanted {
            let dq = empty(&q, &[x.b, x.s, x.h, x.d], dtype);
            let dsink = empty(&q, &[if has_sinks { x.b * x.h * x.s } else { 1 }], DType::F32);
            kernels::flash_bwd_q::launch::<C::R>(
                &client,
                grid.clone(),
                unit,
                q.clone().into_tensor_arg(),
                k.clone().into_tensor_arg(),
                v.clone().into_tensor_arg(),
                sinks.clone().into_tensor_arg(),
                docs.clone().into_tensor_arg(),
                d_o.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                delta.clone().into_tensor_arg(),
                dq.clone().into_tensor_arg(),
                dsink.clone().into_tensor_arg(),
                x.heads(),
                x.d,
                x.e,
                x.tile,
                has_sinks,
                has_docs,
                dtype.into(),
            );
            if wanted[0] {
                grads[0] = Some(dq);
            }
            if sink_wanted {
                // Sum each head's per-row shares over batch and sequence.
                let rows: Tensor<C, 3> = wrap::<C, 1>(dsink).reshape([x.b, x.h, x.s]);
                let per_head = rows.sum_dim(2).sum_dim(0).reshape([x.h]);
                let per_head = if dtype == DType::F32 { per_head } else { per_head.cast(dtype) };
                grads[N - 1] = Some(prim(per_head));
            }
        }
        if wanted[1] || wanted[2] {
            let dk = empty(&q, &[x.b, x.s, x.g, x.d], dtype);
            let dv = empty(&q, &[x.b, x.s, x.g, x.e], dtype);
            kernels::flash_bwd_kv::launch::<C::R>(
                &client,
                cubecl::CubeCount::Static(x.s.div_ceil(x.tile) as u32, x.g as u32, x.b as u32),
                unit,
                q.into_tensor_arg(),
                k.into_tensor_arg(),
                v.into_tensor_arg(),
                docs.into_tensor_arg(),
                d_o.into_tensor_arg(),
                lse.into_tensor_arg(),
                delta.into_tensor_arg(),
                dk.clone().into_tensor_arg(),
                dv.clone().into_tensor_arg(),
                x.heads(),
                x.d,
                x.e,
                x.tile,
                has_docs,
                dtype.into(),
            );
            grads[1] = wanted[1].then_some(dk);
            grads[2] = wanted[2].then_some(dv);
        }
        grads
    })
}
