//! Fused operations and kernels for DisagMoE as Burn custom operations with autodiff, each beside
//! a reference written in plain Burn tensor operations (in the models), chosen in one place
//! ([`fused`]).
//!
//! - [`cpu`] (feature `flex`): attention, RMSNorm, SwiGLU, rotary embedding, linear, grouped
//!   experts, token permute/combine, cross-entropy and AdamW for Burn's CPU backend, each one pass
//!   over memory, parallel over rows or heads.
//! - [`cube`] (features `wgpu`, `cuda`): CubeCL kernels for token dispatch (a device-side stable
//!   counting sort, permute, combine), the grouped expert MLP (SwiGLU and GPT-OSS's clamped
//!   variant with biases) and flash attention (causal, GQA, windows, sinks, MLA's head dims),
//!   forward and backward, on every CubeCL runtime (CUDA, Vulkan/WebGPU; Mesa's lavapipe in CI).
//!
//! This crate must not know about device groups, ranks or transports.

use std::cell::Cell;
use std::sync::atomic::{AtomicU8, Ordering};

#[cfg(feature = "flex")]
pub mod cpu;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub mod cube;
pub mod documents;
pub mod order;
pub mod precision;
pub mod reference;
pub mod ring;
pub mod usage;

/// How a backend matched an operation: the plain backend, or `Autodiff` over it.
#[cfg(any(feature = "flex", feature = "wgpu", feature = "cuda"))]
#[derive(Clone, Copy, PartialEq, Debug)]
pub(crate) enum Kind {
    Plain,
    Autodiff,
}

/// Moves `x` into type `U`, which the caller's `TypeId` check established is the same type.
#[cfg(any(feature = "flex", feature = "wgpu", feature = "cuda"))]
pub(crate) fn cast<T: 'static, U: 'static>(x: T) -> U {
    *(Box::new(x) as Box<dyn std::any::Any>)
        .downcast::<U>()
        .unwrap_or_else(|_| unreachable!("backend type checked before the cast"))
}

// 0 = not read yet, 1 = on, 2 = off.
static ENABLED: AtomicU8 = AtomicU8::new(0);

thread_local! {
    static THREAD_OVERRIDE: Cell<Option<bool>> = const { Cell::new(None) };
}

/// Switches the fused operations and kernels on or off for the whole process (default: on,
/// unless the environment variable `DISAGMOE_KERNELS` is `reference`). Off, every model runs its
/// reference composition of Burn operations.
pub fn set_enabled(on: bool) {
    ENABLED.store(if on { 1 } else { 2 }, Ordering::Relaxed);
}

/// Overrides [`set_enabled`] on the calling thread (`None` removes the override). Tests use it to
/// run the reference and the kernel path side by side.
pub fn set_enabled_for_thread(on: Option<bool>) {
    THREAD_OVERRIDE.with(|c| c.set(on));
}

/// Whether the fused operations and kernels are used on this thread.
pub fn enabled() -> bool {
    if let Some(on) = THREAD_OVERRIDE.with(Cell::get) {
        return on;
    }
    match ENABLED.load(Ordering::Relaxed) {
        1 => true,
        2 => false,
        _ => {
            let on = std::env::var("DISAGMOE_KERNELS").map(|v| v != "reference").unwrap_or(true);
            set_enabled(on);
            on
        }
    }
}

/// Whether `B` (plain or under autodiff) is one of this build's CubeCL backends (WebGPU/Vulkan,
/// CUDA): a backend whose tensors live in a device's memory, whether or not the kernels are
/// switched on. The runtime keeps the token exchange's payloads there.
pub fn device_backend<B: burn::tensor::backend::Backend>() -> bool {
    #[cfg(feature = "wgpu")]
    if cube::kind_of::<B, cube::WgpuCube>().is_some() {
        return true;
    }
    #[cfg(feature = "cuda")]
    if cube::kind_of::<B, cube::CudaCube>().is_some() {
        return true;
    }
    false
}

/// The expert-sorted order of `N = T k` routed copies, computed on the device (see
/// `cube::route`): what the models keep on the device instead of sorting token ids on the host.
#[derive(Debug, Clone)]
pub struct Routing<B: burn::tensor::backend::Backend> {
    /// Copies per expert, `[E]`.
    pub counts: burn::tensor::Tensor<B, 1, burn::tensor::Int>,
    /// Where each expert's rows start, `[E + 1]` (the last entry is `N`).
    pub offsets: burn::tensor::Tensor<B, 1, burn::tensor::Int>,
    /// For each token-major slot `t k + j`, its sorted position, `[N]`.
    pub dest: burn::tensor::Tensor<B, 1, burn::tensor::Int>,
    /// For each sorted position, the slot it came from, `[N]` (what
    /// `disagmoe_models::moe::Dispatch::slots` holds).
    pub src: burn::tensor::Tensor<B, 1, burn::tensor::Int>,
}

/// The dispatch the models call: each function runs the fused operation when it applies to the
/// backend `B` (see [`cpu`]) and returns `None` otherwise, so the caller runs its reference.
pub mod fused {
    use burn::tensor::backend::Backend;
    use burn::tensor::{Int, Tensor};

    use crate::usage::{record, tally, Family, Implementation};

    /// What a family's `Some` ran on backend `B`: our CPU operation or `on_cube`.
    fn ours<B: Backend>(on_cube: Implementation) -> Implementation {
        if cpu_available::<B>() {
            Implementation::FusedCpu
        } else {
            on_cube
        }
    }

    /// Counts an expert call: ours when `Some`; else CubeCL's matmul when the measurement chose
    /// it, the reference when nothing applied.
    #[allow(unused_variables)]
    fn tally_experts<B: Backend, T>(call: impl FnOnce() -> Option<T>) -> Option<T> {
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        let _ = crate::cube::probe::take_last_choice();
        let result = call();
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        let matmul = result.is_none()
            && cube_available::<B>()
            && crate::cube::probe::take_last_choice() == Some(crate::cube::probe::ExpertProducts::Matmul);
        #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
        let matmul = false;
        if matmul {
            record(Family::Experts, Implementation::Matmul);
            return result;
        }
        tally(Family::Experts, ours::<B>(Implementation::Grouped), result)
    }

    /// Whether the fused CPU operations apply to backend `B` on this thread.
    pub fn cpu_available<B: Backend>() -> bool {
        #[cfg(feature = "flex")]
        {
            crate::cpu::available::<B>()
        }
        #[cfg(not(feature = "flex"))]
        {
            false
        }
    }

    /// Whether the CubeCL kernels apply to backend `B` on this thread.
    pub fn cube_available<B: Backend>() -> bool {
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        {
            crate::cube::available::<B>()
        }
        #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
        {
            false
        }
    }

    /// Whether any fused operation or kernel applies to backend `B` on this thread.
    pub fn available<B: Backend>() -> bool {
        cpu_available::<B>() || cube_available::<B>()
    }

    /// Runs the CubeCL kernel `$name` when `B` is a CubeCL backend.
    macro_rules! cube_or_none {
        ($($name:ident)::+($($a:expr),*)) => {{
            #[cfg(any(feature = "wgpu", feature = "cuda"))]
            {
                if cube_available::<B>() {
                    return crate::cube::$($name)::+($($a),*);
                }
            }
            None
        }};
    }

    macro_rules! forward {
        ($family:expr, $(#[$m:meta])* fn $name:ident<$($g:ident $(: $bound:path)?),* $(; const $c:ident: usize)?>($($a:ident: $t:ty),*) -> $ret:ty) => {
            $(#[$m])*
            #[allow(unused_variables)]
            pub fn $name<$($g $(: $bound)?),* $(, const $c: usize)?>($($a: $t),*) -> Option<$ret> {
                #[cfg(feature = "flex")]
                let out = crate::cpu::$name($($a),*);
                #[cfg(not(feature = "flex"))]
                let out = None;
                tally($family, Implementation::FusedCpu, out)
            }
        };
    }

    /// Causal (optionally windowed, optionally within documents) grouped-query attention with
    /// optional per-head sinks: q `[B, S, H, D]`, k `[B, S, G, D]`, v `[B, S, G, E]`, sinks `[H]`,
    /// docs over `[B, S]` -> `[B, S, H, E]`
    /// (`crate::cpu::attention` on flex, `crate::cube::attention` on CubeCL backends; under a
    /// low [`crate::precision`], the CubeCL kernel on operands in the low dtype where it measured
    /// faster than the composition, `crate::cube::probe::attention_where_faster`).
    #[allow(unused_variables)]
    pub fn attention<B: Backend>(
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        sinks: Option<Tensor<B, 1>>,
        scale: f64,
        window: Option<usize>,
        docs: Option<&crate::documents::Documents>,
    ) -> Option<Tensor<B, 4>> {
        let low = crate::precision::low();
        let out = (|| {
            if low {
                // The CPU operation is f32 only; the CubeCL kernel runs on operands in the low
                // dtype where it measured faster than the composition (`crate::cube::probe`).
                return cube_or_none!(probe::attention_where_faster(q, k, v, sinks, scale, window, docs));
            }
            #[cfg(feature = "flex")]
            if cpu_available::<B>() {
                return crate::cpu::attention(q, k, v, sinks, scale, window, docs);
            }
            cube_or_none!(attention(q, k, v, sinks, scale, window, docs))
        })();
        let how = if low { Implementation::Flash } else { ours::<B>(Implementation::Flash) };
        tally(Family::Attention, how, out)
    }
    /// One block of ring attention with its log-sum-exp: our CPU operation on the flex backend
    /// ([`crate::cpu::attention_block`]), the flash kernels on CubeCL backends
    /// (`crate::cube::attention_block`), both in f32; `None` elsewhere and under a low
    /// [`crate::precision`] (the ring composes the block from Burn's operations,
    /// `crate::ring::partial`).
    #[allow(clippy::too_many_arguments, unused_variables)]
    pub fn attention_block<B: Backend>(
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        scale: f64,
        window: Option<usize>,
        docs: Option<&crate::documents::Documents>,
        at: [usize; 3],
        empty: f32,
    ) -> Option<(Tensor<B, 4>, Tensor<B, 4>)> {
        let out = (|| {
            if crate::precision::low() {
                return None;
            }
            #[cfg(feature = "flex")]
            if cpu_available::<B>() {
                return crate::cpu::attention_block(q, k, v, scale, window, docs, at, empty);
            }
            cube_or_none!(attention_block(q, k, v, scale, window, docs, at, empty))
        })();
        tally(Family::Attention, ours::<B>(Implementation::Flash), out)
    }
    /// See [`crate::cpu::linear`]: `x w^T`, x `[rows, in]`, w `[out, in]` (f32 products only:
    /// `None` under a low [`crate::precision`]).
    #[allow(unused_variables)]
    pub fn linear<B: Backend>(x: Tensor<B, 2>, w: Tensor<B, 2>) -> Option<Tensor<B, 2>> {
        let out = (|| {
            #[cfg(feature = "flex")]
            if !crate::precision::low() {
                return crate::cpu::linear(x, w);
            }
            None
        })();
        tally(Family::Linear, Implementation::FusedCpu, out)
    }

    /// Token rows into expert order: `[T, M] -> [N, M]`, row `p` = token `slots[p] / k`, where
    /// `slots` lists routed copies `t k + j` (all `T k`, or one holder's) and `experts[t k + j]`
    /// is each copy's expert, followed by `x` itself when `with_base` (`[N + T, M]`: the shared
    /// experts' input, so that its gradient joins the same sum) (`crate::cpu::permute_rows` /
    /// `crate::cube::permute_rows`, the latter for all copies only). On the CPU the backward adds
    /// a token's rows in the canonical order of [`crate::order`].
    #[allow(unused_variables)]
    pub fn permute_rows<B: Backend>(
        x: Tensor<B, 2>,
        slots: &[usize],
        k: usize,
        experts: &[usize],
        with_base: bool,
    ) -> Option<Tensor<B, 2>> {
        let out = (|| {
            #[cfg(feature = "flex")]
            if cpu_available::<B>() {
                return crate::cpu::permute_rows(x, slots, k, experts, with_base);
            }
            #[cfg(any(feature = "wgpu", feature = "cuda"))]
            if cube_available::<B>() {
                return crate::cube::permute_rows(x.clone(), slots, k).map(|xs| {
                    if with_base {
                        Tensor::cat(vec![xs, x], 0)
                    } else {
                        xs
                    }
                });
            }
            None
        })();
        tally(Family::Dispatch, ours::<B>(Implementation::Device), out)
    }

    /// Gate-weighted sum of each token's expert rows back in token order, plus `base` (the shared
    /// experts' output) when given; slots and experts as in [`permute_rows`]
    /// (`crate::cpu::combine_rows` / `crate::cube::combine_rows`). On the CPU the terms are added
    /// in the canonical order of [`crate::order`].
    #[allow(unused_variables)]
    pub fn combine_rows<B: Backend>(
        ys: Tensor<B, 2>,
        weights: Tensor<B, 2>,
        slots: &[usize],
        experts: &[usize],
        base: Option<Tensor<B, 2>>,
    ) -> Option<Tensor<B, 2>> {
        let out = (|| {
            #[cfg(feature = "flex")]
            if cpu_available::<B>() {
                return crate::cpu::combine_rows(ys, weights, slots, experts, base);
            }
            #[cfg(any(feature = "wgpu", feature = "cuda"))]
            if cube_available::<B>() {
                return crate::cube::combine_rows(ys, weights, slots).map(|out| match base {
                    Some(base) => out + base,
                    None => out,
                });
            }
            None
        })();
        tally(Family::Dispatch, ours::<B>(Implementation::Device), out)
    }

    /// The `k` largest scores of each row of `[T, E]`, on the device: `[T k]` column ids
    /// (`u32`), best first, ties to the lower column (`crate::cube::top_k`; CubeCL backends).
    #[allow(unused_variables)]
    pub fn top_k<B: Backend>(scores: Tensor<B, 2>, k: usize) -> Option<Tensor<B, 1, Int>> {
        device_only::<B, _>((|| cube_or_none!(top_k(scores, k)))())
    }

    /// Counts a device-only dispatch operation on a CubeCL backend (elsewhere the host routes and
    /// nothing is counted here).
    fn device_only<B: Backend, T>(out: Option<T>) -> Option<T> {
        if cube_available::<B>() {
            return tally(Family::Dispatch, Implementation::Device, out);
        }
        out
    }

    /// A stable counting sort of `[N]` expert ids on the device (`crate::cube::route`; CubeCL
    /// backends).
    #[allow(unused_variables)]
    pub fn route<B: Backend>(ids: Tensor<B, 1, Int>, experts: usize) -> Option<crate::Routing<B>> {
        device_only::<B, _>((|| cube_or_none!(route(ids, experts)))())
    }

    /// Routed copies per expert and sequence of `per_sequence` slots, `[E * sequences]`
    /// e-major (`crate::cube::sequence_counts`; CubeCL backends).
    #[allow(unused_variables)]
    pub fn sequence_counts<B: Backend>(
        ids: Tensor<B, 1, Int>,
        experts: usize,
        per_sequence: usize,
    ) -> Option<Tensor<B, 1, Int>> {
        device_only::<B, _>((|| cube_or_none!(sequence_counts(ids, experts, per_sequence)))())
    }

    /// [`permute_rows`] in the order of a device-side [`route`] of all copies, followed by `x`
    /// when `with_base` (`crate::cube::permute_rows_routed`; CubeCL backends).
    #[allow(unused_variables)]
    pub fn permute_routed<B: Backend>(
        x: Tensor<B, 2>,
        routing: &crate::Routing<B>,
        k: usize,
        with_base: bool,
    ) -> Option<Tensor<B, 2>> {
        let base = with_base.then(|| x.clone());
        let xs: Option<Tensor<B, 2>> = (|| cube_or_none!(permute_rows_routed(x, routing, k)))();
        let xs = tally(Family::Dispatch, Implementation::Device, xs);
        xs.map(|xs| match base {
            Some(x) => Tensor::cat(vec![xs, x], 0),
            None => xs,
        })
    }

    /// [`combine_rows`] in the order of a device-side [`route`] of all copies, plus `base` when
    /// given (`crate::cube::combine_rows_routed`; CubeCL backends).
    #[allow(unused_variables)]
    pub fn combine_routed<B: Backend>(
        ys: Tensor<B, 2>,
        weights: Tensor<B, 2>,
        routing: &crate::Routing<B>,
        base: Option<Tensor<B, 2>>,
    ) -> Option<Tensor<B, 2>> {
        let out: Option<Tensor<B, 2>> = (|| cube_or_none!(combine_rows_routed(ys, weights, routing)))();
        let out = tally(Family::Dispatch, Implementation::Device, out);
        out.map(|out| match base {
            Some(base) => out + base,
            None => out,
        })
    }

    /// GPT-OSS's experts (clamped SwiGLU, biases, interleaved gate/up columns) over rows grouped
    /// by `counts` (`crate::cpu::gpt_oss_experts` in f32 / `crate::cube::gpt_oss_experts` where it
    /// is faster than CubeCL's matmul expert by expert, measured: `crate::cube::probe`).
    #[allow(clippy::too_many_arguments, unused_variables)]
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
        tally_experts::<B, _>(|| {
            #[cfg(feature = "flex")]
            if cpu_available::<B>() {
                // Our CPU experts compute in f32 only.
                if crate::precision::low() {
                    return None;
                }
                return crate::cpu::gpt_oss_experts(xs, counts, gate_up, gate_up_bias, down, down_bias, alpha, limit);
            }
            cube_or_none!(probe::gpt_oss_experts_where_faster(
                xs,
                counts,
                gate_up,
                gate_up_bias,
                down,
                down_bias,
                alpha,
                limit
            ))
        })
    }
    forward!(
        Family::Norms,
        /// See [`crate::cpu::rms_norm`].
        fn rms_norm<B: Backend; const D: usize>(x: Tensor<B, D>, w: Tensor<B, 1>, eps: f64) -> Tensor<B, D>
    );
    forward!(
        Family::Norms,
        /// See [`crate::cpu::swiglu`].
        fn swiglu<B: Backend; const D: usize>(g: Tensor<B, D>, u: Tensor<B, D>) -> Tensor<B, D>
    );
    forward!(
        Family::Norms,
        /// See [`crate::cpu::rope`]: x `[B, S, H, D]`, cos/sin `[1, 1, S, D]`.
        fn rope<B: Backend>(x: Tensor<B, 4>, cos: Tensor<B, 4>, sin: Tensor<B, 4>) -> Tensor<B, 4>
    );
    /// See [`crate::cpu::adamw`] (the scalars: [`crate::cpu::AdamWScalars`]).
    #[cfg(feature = "flex")]
    pub fn adamw<B: Backend, const D: usize>(
        param: Tensor<B, D>,
        grad: Tensor<B, D>,
        moments: Option<(Tensor<B, 1>, Tensor<B, 1>)>,
        s: crate::cpu::AdamWScalars,
    ) -> Option<(Tensor<B, D>, Tensor<B, 1>, Tensor<B, 1>)> {
        tally(Family::Optimizer, Implementation::FusedCpu, crate::cpu::adamw(param, grad, moments, s))
    }
    /// `E` SwiGLU experts over rows of `xs` grouped by `counts`, per expert
    /// `(gate [I, M], up [I, M], down [M, I])` (`crate::cpu::swiglu_experts` in f32 /
    /// `crate::cube::swiglu_experts` where it is faster than CubeCL's matmul expert by expert,
    /// measured: `crate::cube::probe`).
    #[allow(unused_variables, clippy::type_complexity)]
    pub fn swiglu_experts<B: Backend>(
        xs: Tensor<B, 2>,
        counts: &[usize],
        experts: &[(Tensor<B, 2>, Tensor<B, 2>, Tensor<B, 2>)],
    ) -> Option<Tensor<B, 2>> {
        tally_experts::<B, _>(|| {
            #[cfg(feature = "flex")]
            if cpu_available::<B>() {
                // Our CPU experts compute in f32 only.
                if crate::precision::low() {
                    return None;
                }
                return crate::cpu::swiglu_experts(xs, counts, experts);
            }
            cube_or_none!(probe::swiglu_experts_where_faster(xs, counts, experts))
        })
    }

    /// See [`crate::cpu::sum_squares`].
    pub fn sum_squares<B: Backend, const D: usize>(x: &Tensor<B, D>) -> Option<f64> {
        #[cfg(feature = "flex")]
        let out = crate::cpu::sum_squares(x);
        #[cfg(not(feature = "flex"))]
        let out = {
            let _ = x;
            None
        };
        tally(Family::Optimizer, Implementation::FusedCpu, out)
    }
    forward!(
        Family::Loss,
        /// See [`crate::cpu::next_token_cross_entropy`].
        fn next_token_cross_entropy<B: Backend>(logits: Tensor<B, 3>, labels: &[usize], ignore: Option<&[bool]>) -> Tensor<B, 1>
    );
}
