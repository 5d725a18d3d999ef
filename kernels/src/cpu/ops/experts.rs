//! The grouped SwiGLU experts: each expert's rows through gate, up and down products, side by
//! side over the pool when there are enough experts, else one after another with pooled products.

use gemm::Parallelism;
use rayon::prelude::*;

use super::rows::{swiglu_backward_into, swiglu_into};
use super::{mm_par, parallelism, Out, SyncPtr, View};
use crate::cpu::vector;

/// Shape of a grouped SwiGLU expert call: `counts[e]` consecutive rows of `xs` `[N, M]` go through
/// expert `e` (`gate`, `up`: `[E, I, M]`, `down`: `[E, M, I]`, PyTorch's layout).
#[derive(Debug, Clone)]
pub struct ExpertsShape {
    pub counts: Vec<usize>,
    pub width: usize,
    pub inter: usize,
}

impl ExpertsShape {
    fn starts(&self) -> Vec<usize> {
        self.counts
            .iter()
            .scan(0, |acc, &c| {
                let s = *acc;
                *acc += c;
                Some(s)
            })
            .collect()
    }

    /// Experts run side by side (one thread each) when there are enough of them to share out;
    /// otherwise one after another, each product spread over the pool.
    fn across_experts(&self) -> bool {
        self.counts.iter().filter(|&&c| c > 0).count() >= 2 * rayon::current_num_threads()
    }
}

/// Forward of the grouped SwiGLU experts: `ys` `[N, M]` and the saved `g`, `u`, `h` (`[N, I]`).
pub fn experts_forward(xs: &[f32], gate: &[f32], up: &[f32], down: &[f32], e: &ExpertsShape) -> [Vec<f32>; 4] {
    let (m, i) = (e.width, e.inter);
    let n: usize = e.counts.iter().sum();
    let (mut ys, mut g, mut u, mut h) = (vec![0f32; n * m], vec![0f32; n * i], vec![0f32; n * i], vec![0f32; n * i]);
    let (yp, gp, up_, hp) =
        (SyncPtr(ys.as_mut_ptr()), SyncPtr(g.as_mut_ptr()), SyncPtr(u.as_mut_ptr()), SyncPtr(h.as_mut_ptr()));
    let starts = e.starts();
    let across = e.across_experts();
    let run = |x: usize| {
        let (yp, gp, up_, hp) = (yp, gp, up_, hp);
        let (r0, c) = (starts[x], e.counts[x]);
        if c == 0 {
            return;
        }
        let par = if across { Parallelism::None } else { parallelism(c, i, m) };
        // SAFETY: expert `x` alone writes rows r0..r0+c of ys, g, u, h; reads are in bounds.
        unsafe {
            let xr = xs.as_ptr().add(r0 * m);
            let wg = gate.as_ptr().add(x * i * m);
            let wu = up.as_ptr().add(x * i * m);
            let wd = down.as_ptr().add(x * m * i);
            mm_par(c, i, m, Out::set(gp.0.add(r0 * i), i), View::rows(xr, m), View::rows(wg, m).t(), 1.0, par);
            mm_par(c, i, m, Out::set(up_.0.add(r0 * i), i), View::rows(xr, m), View::rows(wu, m).t(), 1.0, par);
            let gs = std::slice::from_raw_parts(gp.0.add(r0 * i), c * i);
            let us = std::slice::from_raw_parts(up_.0.add(r0 * i), c * i);
            let hs = std::slice::from_raw_parts_mut(hp.0.add(r0 * i), c * i);
            if across {
                vector::swiglu(gs, us, hs);
            } else {
                swiglu_into(gs, us, hs);
            }
            mm_par(
                c,
                m,
                i,
                Out::set(yp.0.add(r0 * m), m),
                View::rows(hp.0.add(r0 * i), i),
                View::rows(wd, i).t(),
                1.0,
                par,
            );
        }
    };
    if across {
        (0..e.counts.len()).into_par_iter().for_each(run);
    } else {
        (0..e.counts.len()).for_each(run);
    }
    [ys, g, u, h]
}

/// Backward of [`experts_forward`]: `dxs` `[N, M]`, `dgate`, `dup` `[E, I, M]`, `ddown` `[E, M, I]`
/// (zero for experts without rows; the caller gives those no gradient).
#[allow(clippy::too_many_arguments)]
pub fn experts_backward(
    xs: &[f32],
    gate: &[f32],
    up: &[f32],
    down: &[f32],
    g: &[f32],
    u: &[f32],
    h: &[f32],
    dys: &[f32],
    e: &ExpertsShape,
) -> [Vec<f32>; 4] {
    let (m, i, ne) = (e.width, e.inter, e.counts.len());
    let n: usize = e.counts.iter().sum();
    let mut dxs = vec![0f32; n * m];
    let (mut dg_w, mut du_w, mut dd_w) = (vec![0f32; ne * i * m], vec![0f32; ne * i * m], vec![0f32; ne * m * i]);
    let ptrs =
        (SyncPtr(dxs.as_mut_ptr()), SyncPtr(dg_w.as_mut_ptr()), SyncPtr(du_w.as_mut_ptr()), SyncPtr(dd_w.as_mut_ptr()));
    let starts = e.starts();
    let across = e.across_experts();
    let run = |x: usize| {
        let (dxp, dgwp, duwp, ddwp) = ptrs;
        let (r0, c) = (starts[x], e.counts[x]);
        if c == 0 {
            return;
        }
        let par = if across { Parallelism::None } else { parallelism(c, i, m) };
        let mut dh = vec![0f32; c * i];
        let mut dgl = vec![0f32; c * i];
        let mut dul = vec![0f32; c * i];
        // SAFETY: expert `x` alone writes rows r0..r0+c of dxs and its own weight-gradient slices.
        unsafe {
            let xr = xs.as_ptr().add(r0 * m);
            let dy = dys.as_ptr().add(r0 * m);
            let wg = gate.as_ptr().add(x * i * m);
            let wu = up.as_ptr().add(x * i * m);
            let wd = down.as_ptr().add(x * m * i);
            // dH = dY Wd; dWd = dY^T H
            mm_par(c, i, m, Out::set(dh.as_mut_ptr(), i), View::rows(dy, m), View::rows(wd, i), 1.0, par);
            mm_par(
                m,
                i,
                c,
                Out::set(ddwp.0.add(x * m * i), i),
                View::rows(dy, m).t(),
                View::rows(h.as_ptr().add(r0 * i), i),
                1.0,
                par,
            );
            let (gs, us) = (&g[r0 * i..(r0 + c) * i], &u[r0 * i..(r0 + c) * i]);
            if across {
                vector::swiglu_backward(gs, us, &dh, &mut dgl, &mut dul);
            } else {
                swiglu_backward_into(gs, us, &dh, &mut dgl, &mut dul);
            }
            // dX = dG Wg + dU Wu; dWg = dG^T X; dWu = dU^T X
            mm_par(c, m, i, Out::set(dxp.0.add(r0 * m), m), View::rows(dgl.as_ptr(), i), View::rows(wg, m), 1.0, par);
            mm_par(c, m, i, Out::add(dxp.0.add(r0 * m), m), View::rows(dul.as_ptr(), i), View::rows(wu, m), 1.0, par);
            mm_par(
                i,
                m,
                c,
                Out::set(dgwp.0.add(x * i * m), m),
                View::rows(dgl.as_ptr(), i).t(),
                View::rows(xr, m),
                1.0,
                par,
            );
            mm_par(
                i,
                m,
                c,
                Out::set(duwp.0.add(x * i * m), m),
                View::rows(dul.as_ptr(), i).t(),
                View::rows(xr, m),
                1.0,
                par,
            );
        }
    };
    if across {
        (0..ne).into_par_iter().for_each(run);
    } else {
        (0..ne).for_each(run);
    }
    [dxs, dg_w, du_w, dd_w]
}
