//! The grouped expert MLP: for `E` experts with variable row counts, gate and up projections,
//! the activation and the down projection in one autodiff operation, as tiled grouped matrix
//! products over the experts' row segments (no per-expert launches, no padding to a capacity).

mod kernels;

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use burn_cubecl::tensor::CubeTensor;

use super::{elemwise, empty, finish, on_cube, take, upload_u32, zeros, Cube, Input, Kind};

/// Rows (and output columns) per tile of the grouped products.
const TILE: usize = 64;

/// Where an expert's weight matrix lives inside one of the operation's inputs:
/// `B_e(k, n) = input[off + e se + k sk + n sn]`, `k` the reduced dimension.
#[derive(Clone, Copy, Debug)]
struct Mat {
    input: usize,
    off: usize,
    se: usize,
    sk: usize,
    sn: usize,
}

impl Mat {
    /// The same matrix read transposed (`k` and `n` swapped).
    fn t(self) -> Self {
        Self { sk: self.sn, sn: self.sk, ..self }
    }

    /// The kernels' view of it (the element offsets; which input it is stays here).
    fn at<R: cubecl::Runtime>(self) -> kernels::ExpertMatLaunch<R> {
        kernels::ExpertMatLaunch::new(self.off as u32, self.se as u32, self.sk as u32, self.sn as u32)
    }
}

/// Where an expert's bias lives: `bias_e(n) = input[off + e se + n sn]`.
#[derive(Clone, Copy, Debug)]
struct Bias {
    input: usize,
    off: usize,
    se: usize,
    sn: usize,
}

impl Bias {
    /// The kernels' view of it.
    fn at<R: cubecl::Runtime>(self) -> kernels::ExpertVecLaunch<R> {
        kernels::ExpertVecLaunch::new(self.off as u32, self.se as u32, self.sn as u32)
    }
}

/// The expert MLP: hidden width `m`, intermediate `i`, its weights and the activation.
#[derive(Clone, Copy, Debug)]
struct Mlp {
    m: usize,
    i: usize,
    gate: Mat,
    up: Mat,
    down: Mat,
    /// Gate, up and down biases.
    biases: Option<[Bias; 3]>,
    /// GPT-OSS's clamped SwiGLU `(alpha, limit)`; `None` = plain SwiGLU.
    clamped: Option<(f32, f32)>,
}

/// `E` SwiGLU experts over rows grouped by `counts`: `down(silu(gate x) * up x)` per expert.
/// Same contract as `crate::cpu::swiglu_experts`; the per-expert weights are stacked into
/// `[E, I, M]` / `[E, M, I]` for the kernels (a copy, differentiable).
///
/// # Shapes
/// - xs: `[N, M]` grouped by `counts` (sum = N); per expert gate `[I, M]`, up `[I, M]`,
///   down `[M, I]` -> `[N, M]`
#[allow(clippy::type_complexity)]
pub fn swiglu_experts<B: Backend>(
    xs: Tensor<B, 2>,
    counts: &[usize],
    experts: &[(Tensor<B, 2>, Tensor<B, 2>, Tensor<B, 2>)],
) -> Option<Tensor<B, 2>> {
    on_cube!(B, swiglu_on(xs, counts, experts))
}

#[allow(clippy::type_complexity)]
fn swiglu_on<B: Backend, C: Cube>(
    kind: Kind,
    xs: Tensor<B, 2>,
    counts: &[usize],
    experts: &[(Tensor<B, 2>, Tensor<B, 2>, Tensor<B, 2>)],
) -> Option<Tensor<B, 2>> {
    let e = experts.len();
    if e == 0 || counts.len() != e {
        return None;
    }
    let [i, m] = experts[0].0.dims();
    if experts.iter().any(|(g, u, d)| g.dims() != [i, m] || u.dims() != [i, m] || d.dims() != [m, i]) {
        return None;
    }
    let stack = |f: fn(&(Tensor<B, 2>, Tensor<B, 2>, Tensor<B, 2>)) -> Tensor<B, 2>| {
        Tensor::stack::<3>(experts.iter().map(f).collect(), 0)
    };
    let gate = stack(|x| x.0.clone()); // [E, I, M]
    let up = stack(|x| x.1.clone()); // [E, I, M]
    let down = stack(|x| x.2.clone()); // [E, M, I]
    stacked_on::<B, C>(kind, xs, counts, gate, up, down)
}

/// [`swiglu_experts`] with the experts' weights already stacked (no copy): gate and up
/// `[E, I, M]`, down `[E, M, I]`.
///
/// # Shapes
/// - xs: `[N, M]` grouped by `counts` -> `[N, M]`
pub fn swiglu_experts_stacked<B: Backend>(
    xs: Tensor<B, 2>,
    counts: &[usize],
    gate: Tensor<B, 3>,
    up: Tensor<B, 3>,
    down: Tensor<B, 3>,
) -> Option<Tensor<B, 2>> {
    on_cube!(B, stacked_on(xs, counts, gate, up, down))
}

fn stacked_on<B: Backend, C: Cube>(
    kind: Kind,
    xs: Tensor<B, 2>,
    counts: &[usize],
    gate: Tensor<B, 3>,
    up: Tensor<B, 3>,
    down: Tensor<B, 3>,
) -> Option<Tensor<B, 2>> {
    let [e, i, m] = gate.dims();
    if e == 0 || counts.len() != e || up.dims() != [e, i, m] || down.dims() != [e, m, i] {
        return None;
    }
    let inputs = [
        take::<B, C, 2>(kind, xs)?,
        take::<B, C, 3>(kind, gate)?,
        take::<B, C, 3>(kind, up)?,
        take::<B, C, 3>(kind, down)?,
    ];
    let w_in = Mat { input: 1, off: 0, se: i * m, sk: 1, sn: m }; // B(k = M, n = I) = W[n][k]
    let spec = Mlp {
        m,
        i,
        gate: w_in,
        up: Mat { input: 2, ..w_in },
        down: Mat { input: 3, off: 0, se: m * i, sk: 1, sn: i }, // B(k = I, n = M) = W[n][k]
        biases: None,
        clamped: None,
    };
    grouped_mlp::<B, C, 4>(kind, inputs, counts, spec)
}

/// GPT-OSS's experts over rows grouped by `counts`: `gate_up = x W_gu + b_gu` with gate and up
/// columns interleaved (`gate = gate_up[..., 0::2]`, `up = gate_up[..., 1::2]`),
/// `h = (clamp(up, -limit, limit) + 1) * g sigmoid(alpha g)` with `g = min(gate, limit)`, and
/// `y = h W_d + b_d`, in the checkpoint's own layout (no copies of the weights).
///
/// # Shapes
/// - xs: `[N, M]`; gate_up: `[E, M, 2I]`; gate_up_bias: `[E, 2I]`; down: `[E, I, M]`;
///   down_bias: `[E, M]` -> `[N, M]`
#[allow(clippy::too_many_arguments)]
pub fn gpt_oss_experts<B: Backend>(
    xs: Tensor<B, 2>,
    counts: &[usize],
    gate_up: Tensor<B, 3>,
    gate_up_bias: Tensor<B, 2>,
    down: Tensor<B, 3>,
    down_bias: Tensor<B, 2>,
    alpha: f64,
    limit: f64,
) -> Option<Tensor<B, 2>> {
    on_cube!(B, gpt_oss_on(xs, counts, gate_up, gate_up_bias, down, down_bias, alpha, limit))
}

#[allow(clippy::too_many_arguments)]
fn gpt_oss_on<B: Backend, C: Cube>(
    kind: Kind,
    xs: Tensor<B, 2>,
    counts: &[usize],
    gate_up: Tensor<B, 3>,
    gate_up_bias: Tensor<B, 2>,
    down: Tensor<B, 3>,
    down_bias: Tensor<B, 2>,
    alpha: f64,
    limit: f64,
) -> Option<Tensor<B, 2>> {
    let [e, m, two_i] = gate_up.dims();
    let i = two_i / 2;
    if e == 0 || two_i % 2 != 0 || counts.len() != e || gate_up_bias.dims() != [e, two_i] {
        return None;
    }
    if down.dims() != [e, i, m] || down_bias.dims() != [e, m] {
        return None;
    }
    let inputs = [
        take::<B, C, 2>(kind, xs)?,
        take::<B, C, 3>(kind, gate_up)?,
        take::<B, C, 2>(kind, gate_up_bias)?,
        take::<B, C, 3>(kind, down)?,
        take::<B, C, 2>(kind, down_bias)?,
    ];
    let gate = Mat { input: 1, off: 0, se: m * two_i, sk: two_i, sn: 2 };
    let gate_b = Bias { input: 2, off: 0, se: two_i, sn: 2 };
    let spec = Mlp {
        m,
        i,
        gate,
        up: Mat { off: 1, ..gate },
        down: Mat { input: 3, off: 0, se: i * m, sk: m, sn: 1 },
        biases: Some([gate_b, Bias { off: 1, ..gate_b }, Bias { input: 4, off: 0, se: m, sn: 1 }]),
        clamped: Some((alpha as f32, limit as f32)),
    };
    grouped_mlp::<B, C, 5>(kind, inputs, counts, spec)
}

/// The row tiles of the grouped products: for each tile, its expert, first row and the end of
/// its expert's rows.
struct Tiles<R: burn_cubecl::CubeRuntime> {
    count: usize,
    expert: CubeTensor<R>,
    row: CubeTensor<R>,
    end: CubeTensor<R>,
    offsets: CubeTensor<R>,
}

fn tiles<R: burn_cubecl::CubeRuntime>(like: &CubeTensor<R>, counts: &[usize]) -> Tiles<R> {
    let (mut expert, mut row, mut end) = (Vec::new(), Vec::new(), Vec::new());
    let mut offsets = Vec::with_capacity(counts.len() + 1);
    let mut start = 0usize;
    for (e, &c) in counts.iter().enumerate() {
        offsets.push(start as u32);
        let mut r = start;
        while r < start + c {
            expert.push(e as u32);
            row.push(r as u32);
            end.push((start + c) as u32);
            r += TILE;
        }
        start += c;
    }
    offsets.push(start as u32);
    Tiles {
        count: expert.len(),
        expert: upload_u32(like, &expert),
        row: upload_u32(like, &row),
        end: upload_u32(like, &end),
        offsets: upload_u32(like, &offsets),
    }
}

/// `c (+)= a B (+ bias)` over the expert segments (see [`kernels::grouped_mm`]).
#[allow(clippy::too_many_arguments)]
fn mm<R: burn_cubecl::CubeRuntime>(
    tiles: &Tiles<R>,
    a: &CubeTensor<R>,
    k_dim: usize,
    b: &CubeTensor<R>,
    layout: Mat,
    bias: Option<(&CubeTensor<R>, Bias)>,
    c: &CubeTensor<R>,
    n_dim: usize,
    accumulate: bool,
) {
    if tiles.count == 0 {
        return;
    }
    let (bias_t, bl) = match bias {
        Some((t, v)) => (t.clone(), v),
        None => (a.clone(), Bias { input: 0, off: 0, se: 0, sn: 0 }),
    };
    kernels::grouped_mm::launch::<R>(
        &a.client,
        cubecl::CubeCount::Static(tiles.count as u32, n_dim.div_ceil(TILE) as u32, 1),
        cubecl::CubeDim::new_1d(256),
        a.clone().into_tensor_arg(),
        b.clone().into_tensor_arg(),
        bias_t.into_tensor_arg(),
        c.clone().into_tensor_arg(),
        tiles.expert.clone().into_tensor_arg(),
        tiles.row.clone().into_tensor_arg(),
        tiles.end.clone().into_tensor_arg(),
        k_dim as u32,
        n_dim as u32,
        layout.at(),
        bl.at(),
        bias.is_some(),
        accumulate,
        layout.sk == 1,
        a.dtype.into(),
    );
}

/// The weight gradient `out_e(n, k) = sum_r g[r, n] a[r, k]`, written where `layout` keeps
/// `B_e(k, n)`.
#[allow(clippy::too_many_arguments)]
fn mm_tn<R: burn_cubecl::CubeRuntime>(
    tiles: &Tiles<R>,
    experts: usize,
    g: &CubeTensor<R>,
    n_dim: usize,
    a: &CubeTensor<R>,
    k_dim: usize,
    out: &CubeTensor<R>,
    layout: Mat,
) {
    kernels::grouped_mm_tn::launch::<R>(
        &g.client,
        cubecl::CubeCount::Static(n_dim.div_ceil(TILE) as u32, k_dim.div_ceil(TILE) as u32, experts as u32),
        cubecl::CubeDim::new_1d(256),
        g.clone().into_tensor_arg(),
        a.clone().into_tensor_arg(),
        out.clone().into_tensor_arg(),
        tiles.offsets.clone().into_tensor_arg(),
        n_dim as u32,
        k_dim as u32,
        layout.at(),
        g.dtype.into(),
    );
}

fn col_sum<R: burn_cubecl::CubeRuntime>(
    tiles: &Tiles<R>,
    experts: usize,
    g: &CubeTensor<R>,
    n_dim: usize,
    out: &CubeTensor<R>,
    layout: Bias,
) {
    let (count, dim) = elemwise(g, experts * n_dim);
    kernels::segment_col_sum::launch::<R>(
        &g.client,
        count,
        dim,
        g.clone().into_tensor_arg(),
        out.clone().into_tensor_arg(),
        tiles.offsets.clone().into_tensor_arg(),
        experts as u32,
        n_dim as u32,
        layout.at(),
        g.dtype.into(),
    );
}

fn grouped_mlp<B: Backend, C: Cube, const N: usize>(
    kind: Kind,
    inputs: [Input<C>; N],
    counts: &[usize],
    spec: Mlp,
) -> Option<Tensor<B, 2>> {
    let (m, i) = (spec.m, spec.i);
    let experts = counts.len();
    let rows: usize = counts.iter().sum();
    let xs = &inputs[0].t;
    let dtype = xs.dtype;
    if xs.meta.shape().dims::<2>() != [rows, m] || rows == 0 || m == 0 || i == 0 {
        return None;
    }
    if inputs.iter().any(|x| x.t.dtype != dtype) || rows > u32::MAX as usize {
        return None;
    }
    let t = tiles(xs, counts);
    let w = |mat: Mat| &inputs[mat.input].t;
    let bias = |j: usize| spec.biases.map(|b| (&inputs[b[j].input].t, b[j]));
    let (alpha, limit) = spec.clamped.unwrap_or((0.0, 0.0));

    let hg = empty(xs, &[rows, i], dtype);
    let hu = empty(xs, &[rows, i], dtype);
    mm(&t, xs, m, w(spec.gate), spec.gate, bias(0), &hg, i, false);
    mm(&t, xs, m, w(spec.up), spec.up, bias(1), &hu, i, false);
    let act = empty(xs, &[rows, i], dtype);
    let (count, dim) = elemwise(xs, rows * i);
    kernels::expert_act::launch::<C::R>(
        &xs.client,
        count,
        dim,
        hg.clone().into_tensor_arg(),
        hu.clone().into_tensor_arg(),
        act.clone().into_tensor_arg(),
        alpha,
        limit,
        spec.clamped.is_some(),
        dtype.into(),
    );
    let y = empty(xs, &[rows, m], dtype);
    mm(&t, &act, i, w(spec.down), spec.down, bias(2), &y, m, false);

    let saved: Vec<CubeTensor<C::R>> = inputs.iter().map(|x| x.t.clone()).collect();
    let shapes: Vec<Vec<usize>> = saved.iter().map(|x| x.meta.shape().to_vec()).collect();
    let refs: [&Input<C>; N] = std::array::from_fn(|j| &inputs[j]);
    Some(finish::<B, C, 2, N>(kind, refs, y, move |dy, wanted| {
        let xs = &saved[0];
        let w = |mat: Mat| &saved[mat.input];
        let mut grads: [Option<CubeTensor<C::R>>; N] = std::array::from_fn(|_| None);
        for j in 1..N {
            if wanted[j] {
                grads[j] = Some(zeros(xs, &shapes[j], dtype));
            }
        }
        // Down projection: its weight (and bias) gradient, and the activation's gradient.
        if let Some(gw) = &grads[spec.down.input] {
            mm_tn(&t, experts, &dy, m, &act, i, gw, spec.down);
        }
        if let Some(b) = spec.biases {
            if let Some(gb) = &grads[b[2].input] {
                col_sum(&t, experts, &dy, m, gb, b[2]);
            }
        }
        let da = empty(xs, &[rows, i], dtype);
        mm(&t, &dy, m, w(spec.down), spec.down.t(), None, &da, i, false);
        let (dhg, dhu) = (empty(xs, &[rows, i], dtype), empty(xs, &[rows, i], dtype));
        let (count, dim) = elemwise(xs, rows * i);
        kernels::expert_act_grad::launch::<C::R>(
            &xs.client,
            count,
            dim,
            hg.into_tensor_arg(),
            hu.into_tensor_arg(),
            da.into_tensor_arg(),
            dhg.clone().into_tensor_arg(),
            dhu.clone().into_tensor_arg(),
            alpha,
            limit,
            spec.clamped.is_some(),
            dtype.into(),
        );
        // Gate and up: weight and bias gradients, then the input's.
        for (j, (mat, dh)) in [(spec.gate, &dhg), (spec.up, &dhu)].into_iter().enumerate() {
            if let Some(gw) = &grads[mat.input] {
                mm_tn(&t, experts, dh, i, xs, m, gw, mat);
            }
            if let Some(b) = spec.biases {
                if let Some(gb) = &grads[b[j].input] {
                    col_sum(&t, experts, dh, i, gb, b[j]);
                }
            }
        }
        if wanted[0] {
            let dx = empty(xs, &[rows, m], dtype);
            mm(&t, &dhg, i, w(spec.gate), spec.gate.t(), None, &dx, m, false);
            mm(&t, &dhu, i, w(spec.up), spec.up.t(), None, &dx, m, true);
            grads[0] = Some(dx);
        }
        grads
    }))
}
