//! The dense linear layer `y = x w^T` and its backward, as pooled `gemm` products.

use super::{mm_par, parallelism, written, Out, View};

/// `y = x w^T`: x `[rows, in]`, w `[out, in]` (PyTorch's layout) -> `[rows, out]`.
pub fn linear_forward(x: &[f32], w: &[f32], rows: usize, d_in: usize, d_out: usize) -> Vec<f32> {
    // SAFETY: a product that does not accumulate writes all rows x d_out elements (zeros when
    // d_in is 0); operands are in bounds.
    unsafe {
        written(rows * d_out, |y| {
            let par = parallelism(rows, d_out, d_in);
            mm_par(
                rows,
                d_out,
                d_in,
                Out::set(y, d_out),
                View::rows(x.as_ptr(), d_in),
                View::rows(w.as_ptr(), d_in).t(),
                1.0,
                par,
            )
        })
    }
}

/// Backward of [`linear_forward`]: `dx = dy w` (`[rows, in]`), `dw = dy^T x` (`[out, in]`), each
/// only when asked for.
pub fn linear_backward(
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    rows: usize,
    d_in: usize,
    d_out: usize,
    want: (bool, bool),
) -> (Option<Vec<f32>>, Option<Vec<f32>>) {
    // SAFETY (both): a product that does not accumulate writes every element of its output.
    let dx = want.0.then(|| unsafe {
        written(rows * d_in, |dst| {
            let par = parallelism(rows, d_in, d_out);
            mm_par(
                rows,
                d_in,
                d_out,
                Out::set(dst, d_in),
                View::rows(dy.as_ptr(), d_out),
                View::rows(w.as_ptr(), d_in),
                1.0,
                par,
            )
        })
    });
    let dw = want.1.then(|| unsafe {
        written(d_out * d_in, |dst| {
            let par = parallelism(d_out, d_in, rows);
            mm_par(
                d_out,
                d_in,
                rows,
                Out::set(dst, d_in),
                View::rows(dy.as_ptr(), d_out).t(),
                View::rows(x.as_ptr(), d_in),
                1.0,
                par,
            )
        })
    });
    (dx, dw)
}
