//! Fused operations for DisagMoE as Burn custom operations with autodiff, each beside a
//! reference written in plain Burn tensor operations (in the models), chosen in one place.
//!
//! - [`cpu`] (feature `flex`): attention, RMSNorm, SwiGLU, rotary embedding and cross-entropy for
//!   Burn's CPU backend, each one pass over memory, parallel over rows or heads.
//! - CubeCL kernels for GPUs (token dispatch, grouped experts, flash attention) are not written yet
//!   (their own issue).
//!
//! This crate must not know about device groups, ranks or transports.

#[cfg(feature = "flex")]
pub mod cpu;

/// The dispatch the models call: each function runs the fused operation when it applies to the
/// backend `B` (see [`cpu`]) and returns `None` otherwise, so the caller runs its reference.
pub mod fused {
    use burn::tensor::backend::Backend;
    use burn::tensor::Tensor;

    /// Whether the fused operations apply to backend `B` on this thread.
    pub fn available<B: Backend>() -> bool {
        #[cfg(feature = "flex")]
        {
            crate::cpu::available::<B>()
        }
        #[cfg(not(feature = "flex"))]
        {
            false
        }
    }

    macro_rules! forward {
        ($(#[$m:meta])* fn $name:ident<$($g:ident $(: $bound:path)?),* $(; const $c:ident: usize)?>($($a:ident: $t:ty),*) -> $ret:ty) => {
            $(#[$m])*
            #[allow(unused_variables)]
            pub fn $name<$($g $(: $bound)?),* $(, const $c: usize)?>($($a: $t),*) -> Option<$ret> {
                #[cfg(feature = "flex")]
                {
                    crate::cpu::$name($($a),*)
                }
                #[cfg(not(feature = "flex"))]
                {
                    None
                }
            }
        };
    }

    forward!(
        /// See [`crate::cpu::attention`]: q `[B, S, H, D]`, k `[B, S, G, D]`, v `[B, S, G, E]`, sinks `[H]` -> `[B, S, H, E]`.
        fn attention<B: Backend>(q: Tensor<B, 4>, k: Tensor<B, 4>, v: Tensor<B, 4>, sinks: Option<Tensor<B, 1>>, scale: f64, window: Option<usize>) -> Tensor<B, 4>
    );
    forward!(
        /// See [`crate::cpu::linear`]: `x w^T`, x `[rows, in]`, w `[out, in]`.
        fn linear<B: Backend>(x: Tensor<B, 2>, w: Tensor<B, 2>) -> Tensor<B, 2>
    );
    forward!(
        /// See [`crate::cpu::permute_rows`]: `[T, M] -> [T k, M]`, row `p` = token `slots[p] / k`.
        fn permute_rows<B: Backend>(x: Tensor<B, 2>, slots: &[usize], k: usize) -> Tensor<B, 2>
    );
    forward!(
        /// See [`crate::cpu::combine_rows`]: gate-weighted sum of each token's `k` expert rows.
        fn combine_rows<B: Backend>(ys: Tensor<B, 2>, weights: Tensor<B, 2>, slots: &[usize]) -> Tensor<B, 2>
    );
    forward!(
        /// See [`crate::cpu::rms_norm`].
        fn rms_norm<B: Backend; const D: usize>(x: Tensor<B, D>, w: Tensor<B, 1>, eps: f64) -> Tensor<B, D>
    );
    forward!(
        /// See [`crate::cpu::swiglu`].
        fn swiglu<B: Backend; const D: usize>(g: Tensor<B, D>, u: Tensor<B, D>) -> Tensor<B, D>
    );
    forward!(
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
        crate::cpu::adamw(param, grad, moments, s)
    }
    /// See [`crate::cpu::swiglu_experts`]: rows of `xs` grouped by `counts`, per expert
    /// `(gate [I, M], up [I, M], down [M, I])`.
    #[allow(unused_variables, clippy::type_complexity)]
    pub fn swiglu_experts<B: Backend>(
        xs: Tensor<B, 2>,
        counts: &[usize],
        experts: &[(Tensor<B, 2>, Tensor<B, 2>, Tensor<B, 2>)],
    ) -> Option<Tensor<B, 2>> {
        #[cfg(feature = "flex")]
        {
            crate::cpu::swiglu_experts(xs, counts, experts)
        }
        #[cfg(not(feature = "flex"))]
        {
            None
        }
    }

    /// See [`crate::cpu::sum_squares`].
    pub fn sum_squares<B: Backend, const D: usize>(x: &Tensor<B, D>) -> Option<f64> {
        #[cfg(feature = "flex")]
        {
            crate::cpu::sum_squares(x)
        }
        #[cfg(not(feature = "flex"))]
        {
            let _ = x;
            None
        }
    }
    forward!(
        /// See [`crate::cpu::next_token_cross_entropy`].
        fn next_token_cross_entropy<B: Backend>(logits: Tensor<B, 3>, labels: &[usize]) -> Tensor<B, 1>
    );
}
