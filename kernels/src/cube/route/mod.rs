//! Token dispatch: the device-side counting sort of the router's choices, and the permute /
//! combine operations that move token rows into expert order and back.

mod kernels;

use burn::backend::autodiff::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Tensor};
use burn_cubecl::tensor::CubeTensor;

use super::{elemwise, empty, finish, on_cube, take, upload_u32, zeros, Cube, Input, Kind};
pub use crate::Routing;

/// Slots per block of the counting sort's histogram pass.
const BLOCK: usize = 256;
/// Most experts [`route`] sorts (one cube scans the per-expert totals in shared memory).
pub const MAX_ROUTED_EXPERTS: usize = 1024;

/// A stable counting sort of the router's choices by expert, on the device: from the token-major
/// expert ids (`ids[t k + j]`, each in `0..experts`) the per-expert counts and offsets and the
/// permutation both ways. Ties keep slot order, so it agrees with the host-side sort exactly.
///
/// Three passes: per-(expert, block of 256 slots) counts; one cube turns them into each block's
/// first position (prefix sums over blocks, then over experts); each (expert, block) places its
/// slots in order. `None` off CubeCL backends or for more than `MAX_ROUTED_EXPERTS` experts.
/// Ids outside `0..experts` are not placed (the caller's router guarantees the range).
///
/// # Shapes
/// - ids: `[N]` -> counts `[E]`, offsets `[E + 1]`, dest `[N]`, src `[N]`
pub fn route<B: Backend>(ids: Tensor<B, 1, Int>, experts: usize) -> Option<Routing<B>> {
    on_cube!(B, route_on(ids, experts))
}

fn int_in<B: Backend, C: Cube>(kind: Kind, t: Tensor<B, 1, Int>) -> CubeTensor<C::R> {
    match kind {
        Kind::Plain => super::cast::<_, Tensor<C, 1, Int>>(t).into_primitive(),
        Kind::Autodiff => super::cast::<_, Tensor<Autodiff<C>, 1, Int>>(t).into_primitive(),
    }
}

fn int_out<B: Backend, C: Cube>(kind: Kind, t: CubeTensor<C::R>) -> Tensor<B, 1, Int> {
    match kind {
        Kind::Plain => super::cast(Tensor::<C, 1, Int>::from_primitive(t)),
        Kind::Autodiff => super::cast(Tensor::<Autodiff<C>, 1, Int>::from_primitive(t)),
    }
}

fn route_on<B: Backend, C: Cube>(kind: Kind, ids: Tensor<B, 1, Int>, experts: usize) -> Option<Routing<B>> {
    if experts == 0 || experts > MAX_ROUTED_EXPERTS {
        return None;
    }
    let n = ids.dims()[0];
    let nblocks = n.div_ceil(BLOCK).max(1);
    // The kernels' u32 arithmetic: a slot plus one block, and every (expert, block) count.
    let fits = |x: Option<usize>| x.is_some_and(|x| x <= u32::MAX as usize);
    if !fits(n.checked_add(BLOCK)) || !fits(experts.checked_mul(nblocks)) {
        return None;
    }
    let ids = super::contiguous(int_in::<B, C>(kind, ids));
    let dtype = ids.dtype;
    let hist = empty(&ids, &[experts * nblocks], burn::tensor::DType::U32);
    let counts = empty(&ids, &[experts], dtype);
    let offsets = empty(&ids, &[experts + 1], dtype);
    let dest = empty(&ids, &[n.max(1)], dtype);
    let src = empty(&ids, &[n.max(1)], dtype);
    let client = ids.client.clone();
    let (count, dim) = elemwise(&ids, experts * nblocks);
    kernels::route_hist::launch::<C::R>(
        &client,
        count.clone(),
        dim,
        ids.clone().into_tensor_arg(),
        hist.clone().into_tensor_arg(),
        n as u32,
        experts as u32,
        BLOCK as u32,
        dtype.into(),
    );
    let units = client.properties().hardware.max_units_per_cube.clamp(1, 256);
    kernels::route_scan::launch::<C::R>(
        &client,
        cubecl::CubeCount::Static(1, 1, 1),
        cubecl::CubeDim::new_1d(units),
        hist.clone().into_tensor_arg(),
        counts.clone().into_tensor_arg(),
        offsets.clone().into_tensor_arg(),
        nblocks as u32,
        experts as u32,
        dtype.into(),
    );
    kernels::route_scatter::launch::<C::R>(
        &client,
        count,
        dim,
        ids.into_tensor_arg(),
        hist.into_tensor_arg(),
        dest.clone().into_tensor_arg(),
        src.clone().into_tensor_arg(),
        n as u32,
        experts as u32,
        BLOCK as u32,
        dtype.into(),
    );
    let (dest, src) = if n == 0 {
        // Keep the documented `[0]` shapes for an empty batch.
        (empty(&dest, &[0], dtype), empty(&src, &[0], dtype))
    } else {
        (dest, src)
    };
    Some(Routing {
        counts: int_out::<B, C>(kind, counts),
        offsets: int_out::<B, C>(kind, offsets),
        dest: int_out::<B, C>(kind, dest),
        src: int_out::<B, C>(kind, src),
    })
}

/// The `k` largest scores of each row, on the device: `ids[t k + j]` (`u32` elements) is the
/// column of row `t`'s `j`-th largest, ties to the lower column, as the host's
/// `disagmoe_models::moe::top_k_rows` orders them (except that -0 and 0 tie here, and NaN
/// scores have no order). `None` off CubeCL backends, for an empty batch, or for `k` outside
/// `1..=E`.
///
/// # Shapes
/// - scores: `[T, E]` -> `[T k]`
pub fn top_k<B: Backend>(scores: Tensor<B, 2>, k: usize) -> Option<Tensor<B, 1, Int>> {
    on_cube!(B, top_k_on(scores, k))
}

fn top_k_on<B: Backend, C: Cube>(kind: Kind, scores: Tensor<B, 2>, k: usize) -> Option<Tensor<B, 1, Int>> {
    let [t, e] = scores.dims();
    if t == 0 || k == 0 || k > e || t * e > u32::MAX as usize {
        return None;
    }
    let scores = take::<B, C, 2>(kind, scores.detach())?;
    let ids = empty(&scores.t, &[t * k], DType::U32);
    let (count, dim) = elemwise(&scores.t, t);
    kernels::top_k_rows::launch::<C::R>(
        &scores.t.client,
        count,
        dim,
        scores.t.clone().into_tensor_arg(),
        ids.clone().into_tensor_arg(),
        t as u32,
        e as u32,
        k as u32,
        scores.t.dtype.into(),
    );
    Some(int_out::<B, C>(kind, ids))
}

/// Routed copies per expert and sequence, on the device: `counts[e B + b]` (`u32` elements) is
/// how many of sequence `b`'s `per_sequence` token-major slots chose expert `e` (the last
/// sequence may be shorter). What the balance losses and load metrics read, without the ids.
/// `None` off CubeCL backends or for `per_sequence == 0`.
///
/// # Shapes
/// - ids: `[N]` -> `[E * ceil(N / per_sequence)]`
pub fn sequence_counts<B: Backend>(
    ids: Tensor<B, 1, Int>,
    experts: usize,
    per_sequence: usize,
) -> Option<Tensor<B, 1, Int>> {
    on_cube!(B, sequence_counts_on(ids, experts, per_sequence))
}

fn sequence_counts_on<B: Backend, C: Cube>(
    kind: Kind,
    ids: Tensor<B, 1, Int>,
    experts: usize,
    per_sequence: usize,
) -> Option<Tensor<B, 1, Int>> {
    let n = ids.dims()[0];
    // The kernel's u32 arithmetic: a slot plus one sequence, and every (expert, sequence) count.
    let fits = |x: Option<usize>| x.is_some_and(|x| x <= u32::MAX as usize);
    if per_sequence == 0 || experts == 0 || n == 0 || !fits(n.checked_add(per_sequence)) {
        return None;
    }
    let sequences = n.div_ceil(per_sequence);
    if !fits(experts.checked_mul(sequences)) {
        return None;
    }
    let ids = super::contiguous(int_in::<B, C>(kind, ids));
    let counts = empty(&ids, &[experts * sequences], DType::U32);
    let (count, dim) = elemwise(&ids, experts * sequences);
    let dtype = ids.dtype;
    kernels::route_hist::launch::<C::R>(
        &ids.client.clone(),
        count,
        dim,
        ids.into_tensor_arg(),
        counts.clone().into_tensor_arg(),
        n as u32,
        experts as u32,
        per_sequence as u32,
        dtype.into(),
    );
    Some(int_out::<B, C>(kind, counts))
}

/// A routing's permutation both ways as `u32` index tensors (the kernels' index type): `(src,
/// dest)`, `None` unless both hold `n` entries. Whether every copy was placed (every id in
/// `0..experts`) is not checked here, as it would read the device back: the callers know it from
/// the counts.
fn routed_indices<B: Backend, C: Cube>(
    kind: Kind,
    routing: &Routing<B>,
    n: usize,
) -> Option<(CubeTensor<C::R>, CubeTensor<C::R>)> {
    if routing.src.dims()[0] != n || routing.dest.dims()[0] != n {
        return None;
    }
    let as_u32 = |t: &Tensor<B, 1, Int>| {
        let t = t.clone();
        let t = if t.dtype() == DType::U32 { t } else { t.cast(burn::tensor::IntDType::U32) };
        super::contiguous(int_in::<B, C>(kind, t))
    };
    Some((as_u32(&routing.src), as_u32(&routing.dest)))
}

/// `slots` (sorted position -> token-major slot) as `u32`, with its inverse; `None` when it is not
/// a permutation of `0..n`.
fn permutation(slots: &[usize], n: usize) -> Option<(Vec<u32>, Vec<u32>)> {
    if slots.len() != n || n > u32::MAX as usize {
        return None;
    }
    let mut dest = vec![u32::MAX; n];
    for (p, &s) in slots.iter().enumerate() {
        if s >= n || dest[s] != u32::MAX {
            return None;
        }
        dest[s] = p as u32;
    }
    Some((slots.iter().map(|&s| s as u32).collect(), dest))
}

/// Gathers each token once per chosen expert, in expert order: row `p` of the output is token
/// `slots[p] / k`. Backward: each token's gradient is the sum of its `k` rows' (a gather).
///
/// # Shapes
/// - x: `[T, M]`, slots: a permutation of `0..T k` -> `[T k, M]`
pub fn permute_rows<B: Backend>(x: Tensor<B, 2>, slots: &[usize], k: usize) -> Option<Tensor<B, 2>> {
    on_cube!(B, permute_on(x, slots, k))
}

/// [`permute_rows`] in the order of a device-side [`route`] of all `T k` copies (its `src` and
/// `dest`): no index crosses to or from the host.
///
/// The routing must place every copy (its ids all in `0..experts`, so its counts sum to `T k`);
/// for one that does not, rows are read from unplaced entries and the result is meaningless.
///
/// # Shapes
/// - x: `[T, M]`, routing of `T k` copies -> `[T k, M]`
pub fn permute_rows_routed<B: Backend>(x: Tensor<B, 2>, routing: &Routing<B>, k: usize) -> Option<Tensor<B, 2>> {
    on_cube!(B, permute_routed_on(x, routing, k))
}

fn permute_on<B: Backend, C: Cube>(kind: Kind, x: Tensor<B, 2>, slots: &[usize], k: usize) -> Option<Tensor<B, 2>> {
    let [t, m] = x.dims();
    let n = t * k;
    if k == 0 || n == 0 || m == 0 {
        return None;
    }
    let (src, dest) = permutation(slots, n)?;
    let x = take::<B, C, 2>(kind, x)?;
    let (src, dest) = (upload_u32(&x.t, &src), upload_u32(&x.t, &dest));
    Some(permute_with::<B, C>(kind, x, src, dest, t, k))
}

fn permute_routed_on<B: Backend, C: Cube>(
    kind: Kind,
    x: Tensor<B, 2>,
    routing: &Routing<B>,
    k: usize,
) -> Option<Tensor<B, 2>> {
    let [t, m] = x.dims();
    if k == 0 || t * k == 0 || m == 0 {
        return None;
    }
    let (src, dest) = routed_indices::<B, C>(kind, routing, t * k)?;
    let x = take::<B, C, 2>(kind, x)?;
    Some(permute_with::<B, C>(kind, x, src, dest, t, k))
}

/// The permute kernel and its backward, from `u32` index tensors.
fn permute_with<B: Backend, C: Cube>(
    kind: Kind,
    x: Input<C>,
    src: CubeTensor<C::R>,
    dest: CubeTensor<C::R>,
    t: usize,
    k: usize,
) -> Tensor<B, 2> {
    let m = x.t.meta.shape()[1];
    let n = t * k;
    let dtype = x.t.dtype;
    let out = empty(&x.t, &[n, m], dtype);
    let (count, dim) = elemwise(&x.t, n * m);
    kernels::permute_rows::launch::<C::R>(
        &x.t.client,
        count,
        dim,
        x.t.clone().into_tensor_arg(),
        src.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        m as u32,
        k as u32,
        dtype.into(),
    );
    finish::<B, C, 2, 1>(kind, [&x], out, move |dy, wanted| {
        if !wanted[0] {
            return [None];
        }
        let dx = empty(&dy, &[t, m], dtype);
        let (count, dim) = elemwise(&dy, t * m);
        kernels::unpermute_sum::launch::<C::R>(
            &dy.client.clone(),
            count,
            dim,
            dy.into_tensor_arg(),
            dest.into_tensor_arg(),
            dx.clone().into_tensor_arg(),
            m as u32,
            k as u32,
            dtype.into(),
        );
        [Some(dx)]
    })
}

/// Weights each expert output row by its gate and sums each token's `k` rows back in token
/// order. Backward: the rows' gradient (gate times the token's gradient) and the gates'
/// (a dot product per slot).
///
/// # Shapes
/// - ys: `[T k, M]` in expert order; weights: `[T, k]`; slots as in [`permute_rows`] -> `[T, M]`
pub fn combine_rows<B: Backend>(ys: Tensor<B, 2>, weights: Tensor<B, 2>, slots: &[usize]) -> Option<Tensor<B, 2>> {
    on_cube!(B, combine_on(ys, weights, slots))
}

/// [`combine_rows`] in the order of a device-side [`route`] of all `T k` copies, which must all
/// be placed, as for [`permute_rows_routed`].
///
/// # Shapes
/// - ys: `[T k, M]` in expert order; weights: `[T, k]` -> `[T, M]`
pub fn combine_rows_routed<B: Backend>(
    ys: Tensor<B, 2>,
    weights: Tensor<B, 2>,
    routing: &Routing<B>,
) -> Option<Tensor<B, 2>> {
    on_cube!(B, combine_routed_on(ys, weights, routing))
}

fn combine_on<B: Backend, C: Cube>(
    kind: Kind,
    ys: Tensor<B, 2>,
    weights: Tensor<B, 2>,
    slots: &[usize],
) -> Option<Tensor<B, 2>> {
    let [n, m] = ys.dims();
    let [t, k] = weights.dims();
    if n != t * k || n == 0 || m == 0 {
        return None;
    }
    let (src, dest) = permutation(slots, n)?;
    let ys = take::<B, C, 2>(kind, ys)?;
    let w = take::<B, C, 2>(kind, weights)?;
    if w.t.dtype != ys.t.dtype {
        return None;
    }
    let (src, dest) = (upload_u32(&ys.t, &src), upload_u32(&ys.t, &dest));
    Some(combine_with::<B, C>(kind, ys, w, src, dest))
}

fn combine_routed_on<B: Backend, C: Cube>(
    kind: Kind,
    ys: Tensor<B, 2>,
    weights: Tensor<B, 2>,
    routing: &Routing<B>,
) -> Option<Tensor<B, 2>> {
    let [n, m] = ys.dims();
    let [t, k] = weights.dims();
    if n != t * k || n == 0 || m == 0 {
        return None;
    }
    let (src, dest) = routed_indices::<B, C>(kind, routing, n)?;
    let ys = take::<B, C, 2>(kind, ys)?;
    let w = take::<B, C, 2>(kind, weights)?;
    if w.t.dtype != ys.t.dtype {
        return None;
    }
    Some(combine_with::<B, C>(kind, ys, w, src, dest))
}

/// The combine kernel and its backward, from `u32` index tensors.
fn combine_with<B: Backend, C: Cube>(
    kind: Kind,
    ys: Input<C>,
    w: Input<C>,
    src: CubeTensor<C::R>,
    dest: CubeTensor<C::R>,
) -> Tensor<B, 2> {
    let (n, m) = (ys.t.meta.shape()[0], ys.t.meta.shape()[1]);
    let (t, k) = (w.t.meta.shape()[0], w.t.meta.shape()[1]);
    let dtype = ys.t.dtype;
    let out = empty(&ys.t, &[t, m], dtype);
    let (count, dim) = elemwise(&ys.t, t * m);
    kernels::combine_rows::launch::<C::R>(
        &ys.t.client,
        count,
        dim,
        ys.t.clone().into_tensor_arg(),
        w.t.clone().into_tensor_arg(),
        dest.clone().into_tensor_arg(),
        out.clone().into_tensor_arg(),
        m as u32,
        k as u32,
        dtype.into(),
    );
    let (ys_saved, w_saved) = (ys.t.clone(), w.t.clone());
    finish::<B, C, 2, 2>(kind, [&ys, &w], out, move |dout, wanted| {
        let client = dout.client.clone();
        let dys = wanted[0].then(|| {
            let dys = empty(&dout, &[n, m], dtype);
            let (count, dim) = elemwise(&dout, n * m);
            kernels::combine_grad_rows::launch::<C::R>(
                &client,
                count,
                dim,
                dout.clone().into_tensor_arg(),
                w_saved.clone().into_tensor_arg(),
                src.clone().into_tensor_arg(),
                dys.clone().into_tensor_arg(),
                m as u32,
                k as u32,
                dtype.into(),
            );
            dys
        });
        let dw = wanted[1].then(|| {
            let dw = zeros(&dout, &[t, k], dtype);
            const UNITS: usize = 64;
            let x = n.min(65_535);
            let y = n.div_ceil(x);
            kernels::combine_grad_weights::launch::<C::R>(
                &client,
                cubecl::CubeCount::Static(x as u32, y as u32, 1),
                cubecl::CubeDim::new_1d(UNITS as u32),
                dout.clone().into_tensor_arg(),
                ys_saved.clone().into_tensor_arg(),
                dest.clone().into_tensor_arg(),
                dw.clone().into_tensor_arg(),
                m as u32,
                k as u32,
                UNITS,
                dtype.into(),
            );
            dw
        });
        [dys, dw]
    })
}
