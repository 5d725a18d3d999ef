//! The fused CPU operations on plain `f32` buffers (row-major, contiguous), by family:
//! [`attention`] (causal attention forward and backward), [`rows`] (RMSNorm, SwiGLU, rotary
//! embedding, cross-entropy), [`linear`], [`experts`] (the grouped SwiGLU experts and GPT-OSS's
//! clamped ones), [`routing`]
//! (token dispatch and combine) and [`optim`] (AdamW, squared norms). Work is split over rows or
//! heads with rayon; matrix products go to the `gemm` crate (the one Burn's flex backend uses)
//! through [`mm`] on matrix views.

mod attention;
mod experts;
mod linear;
mod optim;
mod routing;
mod rows;

use gemm::{gemm, Parallelism};

pub use attention::{
    attention_backward, attention_block_backward, attention_block_forward, attention_forward, AttnShape, BlockShape,
};
pub use experts::{experts_backward, experts_forward, gpt_oss_backward, gpt_oss_forward, ExpertsShape, GptOssShape};
pub use linear::{linear_backward, linear_forward};
pub use optim::{adamw, sum_squares};
pub use routing::{combine_rows, combine_rows_backward, permute_rows, permute_rows_backward};
pub use rows::{cross_entropy, rms_norm_backward, rms_norm_forward, rope, swiglu_backward, swiglu_forward};

/// A pointer that tasks writing disjoint elements share.
#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);
// SAFETY: every use below writes element sets that are disjoint between tasks.
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

impl SyncPtr {
    /// The pointer (a method, so that closures capture the whole `Send` wrapper).
    fn ptr(self) -> *mut f32 {
        self.0
    }
}

/// A matrix read in place: element `(i, j)` at `ptr + i rs + j cs` (strides in elements).
#[derive(Clone, Copy)]
struct View {
    ptr: *const f32,
    rs: isize,
    cs: isize,
}

impl View {
    /// The row-major matrix at `ptr` whose rows are `stride` elements apart.
    fn rows(ptr: *const f32, stride: usize) -> Self {
        View { ptr, rs: stride as isize, cs: 1 }
    }

    /// The transpose, read from the same elements.
    fn t(self) -> Self {
        View { ptr: self.ptr, rs: self.cs, cs: self.rs }
    }
}

/// Where a product goes: a row-major matrix at `ptr` with rows `rs` elements apart, overwritten
/// or added to.
#[derive(Clone, Copy)]
struct Out {
    ptr: *mut f32,
    rs: usize,
    accumulate: bool,
}

impl Out {
    /// `dst = product`.
    fn set(ptr: *mut f32, rs: usize) -> Self {
        Out { ptr, rs, accumulate: false }
    }

    /// `dst += product`.
    fn add(ptr: *mut f32, rs: usize) -> Self {
        Out { ptr, rs, accumulate: true }
    }
}

/// `dst[m x n] (+)= beta * lhs[m x k] * rhs[k x n]` on this thread.
///
/// # Safety
/// Every element the views and `dst` address for these sizes is in bounds, and no other thread
/// writes `dst`'s elements meanwhile.
#[inline]
unsafe fn mm(m: usize, n: usize, k: usize, dst: Out, lhs: View, rhs: View, beta: f32) {
    mm_par(m, n, k, dst, lhs, rhs, beta, Parallelism::None)
}

/// [`mm`] with a choice of parallelism.
///
/// # Safety
/// As [`mm`].
#[allow(clippy::too_many_arguments)]
#[inline]
unsafe fn mm_par(m: usize, n: usize, k: usize, dst: Out, lhs: View, rhs: View, beta: f32, parallelism: Parallelism) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !dst.accumulate {
            for i in 0..m {
                std::ptr::write_bytes(dst.ptr.add(i * dst.rs), 0, n);
            }
        }
        return;
    }
    gemm(
        m,
        n,
        k,
        dst.ptr,
        1,
        dst.rs as isize,
        dst.accumulate,
        lhs.ptr,
        lhs.cs,
        lhs.rs,
        rhs.ptr,
        rhs.cs,
        rhs.rs,
        1.0,
        beta,
        false,
        false,
        false,
        parallelism,
    )
}

/// Parallelism for one product of `m x n x k`: the pool for anything but tiny ones (Burn's flex
/// runs products under 192^3 on the calling thread alone).
fn parallelism(m: usize, n: usize, k: usize) -> Parallelism {
    if m.saturating_mul(n).saturating_mul(k) >= 32 * 32 * 32 {
        Parallelism::Rayon(0)
    } else {
        Parallelism::None
    }
}

/// Rows per parallel task of the row-wise operations.
fn rows_per_task(rows: usize, width: usize) -> usize {
    // ~32K elements per task: enough work to amortise the task, enough tasks to balance.
    (32 * 1024 / width.max(1)).clamp(1, rows.max(1))
}

/// A vector of `n` elements that `fill` initialises completely (e.g. a gemm with `read_dst`
/// false): no zeroing pass first.
///
/// # Safety
/// `fill` must write every one of the `n` elements through the pointer.
unsafe fn written(n: usize, fill: impl FnOnce(*mut f32)) -> Vec<f32> {
    let mut v: Vec<f32> = Vec::with_capacity(n);
    fill(v.spare_capacity_mut().as_mut_ptr().cast::<f32>());
    v.set_len(n);
    v
}
