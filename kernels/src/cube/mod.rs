//! CubeCL kernels for the three hot spots of MoE training, as Burn custom operations with their
//! autodiff backward, for Burn's CubeCL backends (`CubeBackend` on WebGPU/Vulkan with feature
//! `wgpu`, on CUDA with feature `cuda`) and `Autodiff` over them:
//!
//! - [`route`], [`permute_rows`], [`combine_rows`]: token dispatch (a stable counting sort of the
//!   router's top-k ids on the device) and the gather/weighted-sum that move tokens into expert
//!   order and back; every backward is a gather, no atomics;
//! - [`swiglu_experts`], [`gpt_oss_experts`]: the whole expert MLP over variable-size groups of
//!   rows (gate and up projections, the activation, the down projection; biases; GPT-OSS's
//!   clamped SwiGLU) with input and weight gradients, as tiled grouped matrix products;
//! - [`attention`]: flash attention, forward and backward (recomputing the probabilities from the
//!   saved log-sum-exp), causal, grouped-query, sliding windows, per-head sinks, value head dim
//!   different from the key head dim (MLA); and one block of ring attention ([`attention_block`]:
//!   a chunk of queries over a chunk of keys, with the block's log-sum-exp as a second output).
//!
//! Each family's `#[cube]` kernels sit beside their launchers (`route/kernels.rs`,
//! `experts/kernels.rs`, `attention/kernels.rs`); they are generic over f32/f16/bf16 storage and
//! accumulate in f32. Each function returns `None` when it does not apply (the backend is not a
//! CubeCL one, the kernels are switched off with [`crate::set_enabled`] or
//! `DISAGMOE_KERNELS=reference`, or the shapes are outside what the kernel handles); the caller
//! then runs its reference composition of Burn operations. Burn's `fusion` wrapper is not
//! supported: the training crates build the GPU backends without it.

mod attention;
mod experts;
pub mod probe;
#[cfg(feature = "cuda")]
pub mod raw;
mod route;

use std::any::TypeId;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape, Tensor, TensorPrimitive};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::CubeElement;

pub use attention::{attention, attention_block};
pub use experts::{gpt_oss_experts, swiglu_experts, swiglu_experts_stacked};
pub use route::{
    combine_rows, combine_rows_routed, permute_rows, permute_rows_routed, route, sequence_counts, top_k, Routing,
};

/// Burn's CubeCL backend on WebGPU/Vulkan (what `burn::backend::Wgpu` is without `fusion`).
#[cfg(feature = "wgpu")]
pub type WgpuCube = CubeBackend<burn::backend::wgpu::WgpuRuntime, f32, i32, u32>;
/// Burn's CubeCL backend on CUDA (what `burn::backend::Cuda` is without `fusion`).
#[cfg(feature = "cuda")]
pub type CudaCube = CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;

/// A CubeCL backend: its tensors are [`CubeTensor`]s of runtime `R`.
pub trait Cube: Backend<FloatTensorPrimitive = CubeTensor<Self::R>, IntTensorPrimitive = CubeTensor<Self::R>> {
    /// The CubeCL runtime.
    type R: CubeRuntime;
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> Cube for CubeBackend<R, F, I, BT> {
    type R = R;
}

pub(crate) use crate::{cast, Kind};

/// Whether `B` is `C` or `Autodiff<C>`.
pub(crate) fn kind_of<B: Backend, C: Cube>() -> Option<Kind> {
    if TypeId::of::<B>() == TypeId::of::<C>() {
        Some(Kind::Plain)
    } else if TypeId::of::<B>() == TypeId::of::<Autodiff<C>>() {
        Some(Kind::Autodiff)
    } else {
        None
    }
}

/// Runs `$f::<B, C>(kind, args)` for the CubeCL backend `C` that `B` is (plain or under
/// autodiff); `None` when `B` is none of them or the kernels are switched off.
macro_rules! on_cube {
    ($B:ident, $f:ident($($a:expr),* $(,)?)) => {{
        if !crate::enabled() {
            return None;
        }
        #[cfg(feature = "wgpu")]
        if let Some(kind) = $crate::cube::kind_of::<$B, $crate::cube::WgpuCube>() {
            return $f::<$B, $crate::cube::WgpuCube>(kind, $($a),*);
        }
        #[cfg(feature = "cuda")]
        if let Some(kind) = $crate::cube::kind_of::<$B, $crate::cube::CudaCube>() {
            return $f::<$B, $crate::cube::CudaCube>(kind, $($a),*);
        }
        None
    }};
}
pub(crate) use on_cube;

/// Whether the CubeCL kernels apply to backend `B` on this thread.
pub fn available<B: Backend>() -> bool {
    #[cfg(feature = "wgpu")]
    let wgpu = kind_of::<B, WgpuCube>().is_some();
    #[cfg(not(feature = "wgpu"))]
    let wgpu = false;
    #[cfg(feature = "cuda")]
    let cuda = kind_of::<B, CudaCube>().is_some();
    #[cfg(not(feature = "cuda"))]
    let cuda = false;
    crate::enabled() && (wgpu || cuda)
}

/// One float input of an operation: its values (contiguous) and, under autodiff, its node.
pub(crate) struct Input<C: Cube> {
    pub(crate) t: CubeTensor<C::R>,
    node: Option<FloatTensor<Autodiff<C>>>,
}

fn is_float(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
}

pub(crate) fn take<B: Backend, C: Cube, const D: usize>(kind: Kind, t: Tensor<B, D>) -> Option<Input<C>> {
    let (t, node) = match kind {
        Kind::Autodiff => {
            let prim: FloatTensor<Autodiff<C>> = cast::<_, Tensor<Autodiff<C>, D>>(t).into_primitive().tensor();
            (prim.primitive.clone(), Some(prim))
        }
        Kind::Plain => (cast::<_, Tensor<C, D>>(t).into_primitive().tensor(), None),
    };
    // Float storage this runtime has (WGSL has no bf16; f16 needs `shader-f16`), and sizes the
    // kernels' 32-bit indexing reaches.
    if !is_float(t.dtype) || t.qparams.is_some() || !supports(&t) {
        return None;
    }
    if t.meta.shape().num_elements() > u32::MAX as usize {
        return None;
    }
    Some(Input { t: contiguous(t), node })
}

/// Whether the runtime computes in `t`'s dtype (the test Burn's own `supports_dtype` makes).
fn supports<R: CubeRuntime>(t: &CubeTensor<R>) -> bool {
    use cubecl::ir::features::TypeUsage;
    let usage = t.client.properties().type_usage(t.dtype.into());
    usage.is_superset(TypeUsage::Buffer | TypeUsage::Conversion | TypeUsage::Arithmetic)
}

pub(crate) fn contiguous<R: CubeRuntime>(t: CubeTensor<R>) -> CubeTensor<R> {
    if t.is_contiguous() {
        t
    } else {
        burn_cubecl::kernel::into_contiguous(t)
    }
}

/// The backward of an operation: from the output gradient and which inputs want a gradient, the
/// input gradients.
type BackwardFn<R, const N: usize> = Box<dyn FnOnce(CubeTensor<R>, [bool; N]) -> [Option<CubeTensor<R>>; N] + Send>;

/// The backward of an operation, kept until the graph runs it.
struct Pending<R: CubeRuntime, const N: usize>(Arc<Mutex<Option<BackwardFn<R, N>>>>);

impl<R: CubeRuntime, const N: usize> Clone for Pending<R, N> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<R: CubeRuntime, const N: usize> std::fmt::Debug for Pending<R, N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("cubecl kernel backward")
    }
}

#[derive(Debug)]
struct KernelOp<const N: usize>;

impl<C: Cube, const N: usize> Backward<C, N> for KernelOp<N> {
    type State = Pending<C::R, N>;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = contiguous(grads.consume::<C>(&ops.node));
        let f = ops.state.0.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(f) = f else { return };
        let wanted = ops.parents.each_ref().map(Option::is_some);
        let outs = f(grad, wanted);
        for (parent, g) in ops.parents.into_iter().zip(outs) {
            if let (Some(node), Some(g)) = (parent, g) {
                grads.register::<C>(node.id, g);
            }
        }
    }
}

static OPS_RUN: AtomicUsize = AtomicUsize::new(0);

/// How many kernel operations (attention, experts, permute, combine) this process has run, for
/// checks that training goes through the kernels.
pub fn ops_run() -> usize {
    OPS_RUN.load(Ordering::Relaxed)
}

/// Wraps an operation's output as a tensor of `B`, recording `backward` when any input is
/// tracked.
pub(crate) fn finish<B: Backend, C: Cube, const D: usize, const N: usize>(
    kind: Kind,
    inputs: [&Input<C>; N],
    out: CubeTensor<C::R>,
    backward: impl FnOnce(CubeTensor<C::R>, [bool; N]) -> [Option<CubeTensor<C::R>>; N] + Send + 'static,
) -> Tensor<B, D> {
    OPS_RUN.fetch_add(1, Ordering::Relaxed);
    match kind {
        Kind::Plain => cast(Tensor::<C, D>::from_primitive(TensorPrimitive::Float(out))),
        Kind::Autodiff => {
            let nodes = inputs.map(|i| i.node.as_ref().expect("autodiff input").node.clone());
            let prim = match KernelOp::<N>.prepare::<NoCheckpointing>(nodes).compute_bound().stateful() {
                OpsKind::Tracked(prep) => {
                    let f: BackwardFn<C::R, N> = Box::new(backward);
                    prep.finish(Pending(Arc::new(Mutex::new(Some(f)))), out)
                }
                OpsKind::UnTracked(prep) => prep.finish(out),
            };
            cast(Tensor::<Autodiff<C>, D>::from_primitive(TensorPrimitive::Float(prim)))
        }
    }
}

/// An uninitialised contiguous tensor on `like`'s device.
pub(crate) fn empty<R: CubeRuntime>(like: &CubeTensor<R>, shape: &[usize], dtype: DType) -> CubeTensor<R> {
    burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        Shape::from(shape.to_vec()),
        dtype,
    )
}

/// A zero-filled contiguous tensor on `like`'s device.
pub(crate) fn zeros<R: CubeRuntime>(like: &CubeTensor<R>, shape: &[usize], dtype: DType) -> CubeTensor<R> {
    burn_cubecl::ops::numeric::zeros_client(
        like.client.clone(),
        like.device.clone(),
        Shape::from(shape.to_vec()),
        dtype,
    )
}

/// Uploads `u32` values (at least one element, so empty lists still bind a buffer).
pub(crate) fn upload_u32<R: CubeRuntime>(like: &CubeTensor<R>, values: &[u32]) -> CubeTensor<R> {
    let one = [0u32];
    let v = if values.is_empty() { &one[..] } else { values };
    let handle = like.client.create_from_slice(u32::as_bytes(v));
    CubeTensor::new_contiguous(like.client.clone(), like.device.clone(), Shape::new([v.len()]), handle, DType::U32)
}

/// Elementwise launch geometry for `n` units.
pub(crate) fn elemwise<R: CubeRuntime>(like: &CubeTensor<R>, n: usize) -> (cubecl::CubeCount, cubecl::CubeDim) {
    let n = n.max(1);
    let dim = cubecl::CubeDim::new(&like.client, n);
    (cubecl::calculate_cube_count_elemwise(&like.client, n, dim), dim)
}

/// Converts a Burn tensor of backend `C` to its primitive.
pub(crate) fn prim<C: Cube, const D: usize>(t: Tensor<C, D>) -> CubeTensor<C::R> {
    t.into_primitive().tensor()
}

/// Wraps a primitive as a Burn tensor of backend `C` (for the small glue steps done with Burn's
/// own operations: sums, casts).
pub(crate) fn wrap<C: Cube, const D: usize>(t: CubeTensor<C::R>) -> Tensor<C, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}
