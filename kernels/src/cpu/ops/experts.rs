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

/// Shape of a GPT-OSS expert call: `counts[e]` consecutive rows of `xs` `[N, M]` go through expert
/// `e` (`gate_up` `[E, M, 2I]` with gate/up columns interleaved, `gate_up_bias` `[E, 2I]`, `down`
/// `[E, I, M]`, `down_bias` `[E, M]`: the checkpoint's fused layout) and its clamped SwiGLU.
#[derive(Debug, Clone)]
pub struct GptOssShape {
    pub experts: ExpertsShape,
    /// The GLU's sigmoid scale (1.702).
    pub alpha: f32,
    /// The clamp of gate (above) and up (both sides): 7.
    pub limit: f32,
}

impl GptOssShape {
    /// `(up + 1) * gate * sigmoid(alpha * gate)` of one row of interleaved pre-activations, gate
    /// clamped to `<= limit`, up to `[-limit, limit]`.
    fn activate(&self, pre: &[f32], act: &mut [f32]) {
        for (a, gu) in act.iter_mut().zip(pre.chunks_exact(2)) {
            let (g, u) = (gu[0].min(self.limit), gu[1].clamp(-self.limit, self.limit));
            *a = (u + 1.0) * g * sigmoid(self.alpha * g);
        }
    }

    /// The gradient of [`GptOssShape::activate`] with respect to the interleaved pre-activations;
    /// nothing passes a clamp that bit (`gate > limit`, `|up| > limit`), as Burn's clamps do.
    fn activate_backward(&self, pre: &[f32], dact: &[f32], dpre: &mut [f32]) {
        for ((d, gu), dgu) in dact.iter().zip(pre.chunks_exact(2)).zip(dpre.chunks_exact_mut(2)) {
            let (g, u) = (gu[0], gu[1]);
            let (gc, uc) = (g.min(self.limit), u.clamp(-self.limit, self.limit));
            let s = sigmoid(self.alpha * gc);
            let dglu = (uc + 1.0) * (s + self.alpha * gc * s * (1.0 - s));
            dgu[0] = if g > self.limit { 0.0 } else { d * dglu };
            dgu[1] = if u > self.limit || u < -self.limit { 0.0 } else { d * gc * s };
        }
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Adds `bias` (`[w]`) to each of `rows` rows of `out` (`[rows, w]`).
fn add_bias(out: &mut [f32], bias: &[f32]) {
    for row in out.chunks_exact_mut(bias.len()) {
        for (o, b) in row.iter_mut().zip(bias) {
            *o += b;
        }
    }
}

/// Adds the column sums of `rows` (`[r, w]`) to `sums` (`[w]`).
fn add_column_sums(sums: &mut [f32], rows: &[f32]) {
    for row in rows.chunks_exact(sums.len()) {
        for (s, x) in sums.iter_mut().zip(row) {
            *s += x;
        }
    }
}

/// Forward of GPT-OSS's experts: `ys` `[N, M]` and the saved pre-activations `[N, 2I]` and
/// activations `[N, I]`.
pub fn gpt_oss_forward(
    xs: &[f32],
    gate_up: &[f32],
    gate_up_bias: &[f32],
    down: &[f32],
    down_bias: &[f32],
    s: &GptOssShape,
) -> [Vec<f32>; 3] {
    let e = &s.experts;
    let (m, i) = (e.width, e.inter);
    let n: usize = e.counts.iter().sum();
    let (mut ys, mut pre, mut act) = (vec![0f32; n * m], vec![0f32; n * 2 * i], vec![0f32; n * i]);
    let (yp, pp, ap) = (SyncPtr(ys.as_mut_ptr()), SyncPtr(pre.as_mut_ptr()), SyncPtr(act.as_mut_ptr()));
    let starts = e.starts();
    let across = e.across_experts();
    let run = |x: usize| {
        let (yp, pp, ap) = (yp, pp, ap);
        let (r0, c) = (starts[x], e.counts[x]);
        if c == 0 {
            return;
        }
        let par = if across { Parallelism::None } else { parallelism(c, 2 * i, m) };
        // SAFETY: expert `x` alone writes rows r0..r0+c of ys, pre and act; reads are in bounds.
        unsafe {
            let xr = xs.as_ptr().add(r0 * m);
            let wgu = gate_up.as_ptr().add(x * m * 2 * i);
            let wd = down.as_ptr().add(x * i * m);
            let pre = std::slice::from_raw_parts_mut(pp.ptr().add(r0 * 2 * i), c * 2 * i);
            mm_par(c, 2 * i, m, Out::set(pre.as_mut_ptr(), 2 * i), View::rows(xr, m), View::rows(wgu, 2 * i), 1.0, par);
            add_bias(pre, &gate_up_bias[x * 2 * i..(x + 1) * 2 * i]);
            let act = std::slice::from_raw_parts_mut(ap.ptr().add(r0 * i), c * i);
            for (a, p) in act.chunks_exact_mut(i).zip(pre.chunks_exact(2 * i)) {
                s.activate(p, a);
            }
            let ys = std::slice::from_raw_parts_mut(yp.ptr().add(r0 * m), c * m);
            mm_par(c, m, i, Out::set(ys.as_mut_ptr(), m), View::rows(act.as_ptr(), i), View::rows(wd, m), 1.0, par);
            add_bias(ys, &down_bias[x * m..(x + 1) * m]);
        }
    };
    if across {
        (0..e.counts.len()).into_par_iter().for_each(run);
    } else {
        (0..e.counts.len()).for_each(run);
    }
    [ys, pre, act]
}

/// Backward of [`gpt_oss_forward`]: `dxs` `[N, M]` and the gradients of `gate_up` `[E, M, 2I]`,
/// `gate_up_bias` `[E, 2I]`, `down` `[E, I, M]` and `down_bias` `[E, M]` (zero for experts without
/// rows). Each weight gradient is written once, expert by expert: the cost follows the experts held.
#[allow(clippy::too_many_arguments)]
pub fn gpt_oss_backward(
    xs: &[f32],
    gate_up: &[f32],
    down: &[f32],
    pre: &[f32],
    act: &[f32],
    dys: &[f32],
    s: &GptOssShape,
) -> [Vec<f32>; 5] {
    let e = &s.experts;
    let (m, i, ne) = (e.width, e.inter, e.counts.len());
    let n: usize = e.counts.iter().sum();
    let mut dxs = vec![0f32; n * m];
    let (mut dgu, mut dgub) = (vec![0f32; ne * m * 2 * i], vec![0f32; ne * 2 * i]);
    let (mut dd, mut ddb) = (vec![0f32; ne * i * m], vec![0f32; ne * m]);
    let ptrs = [&mut dxs, &mut dgu, &mut dgub, &mut dd, &mut ddb].map(|v| SyncPtr(v.as_mut_ptr()));
    let starts = e.starts();
    let across = e.across_experts();
    let run = |x: usize| {
        let [dxp, dgup, dgubp, ddp, ddbp] = ptrs;
        let (r0, c) = (starts[x], e.counts[x]);
        if c == 0 {
            return;
        }
        let par = if across { Parallelism::None } else { parallelism(c, 2 * i, m) };
        let mut dact = vec![0f32; c * i];
        let mut dpre = vec![0f32; c * 2 * i];
        // SAFETY: expert `x` alone writes rows r0..r0+c of dxs and its own slices of the weight
        // and bias gradients.
        unsafe {
            let xr = xs.as_ptr().add(r0 * m);
            let dy = dys.as_ptr().add(r0 * m);
            let wgu = gate_up.as_ptr().add(x * m * 2 * i);
            let wd = down.as_ptr().add(x * i * m);
            let act = act.as_ptr().add(r0 * i);
            // dAct = dY Wd^T; dWd = Act^T dY; dbd = sum of dY's rows
            mm_par(c, i, m, Out::set(dact.as_mut_ptr(), i), View::rows(dy, m), View::rows(wd, m).t(), 1.0, par);
            mm_par(i, m, c, Out::set(ddp.ptr().add(x * i * m), m), View::rows(act, i).t(), View::rows(dy, m), 1.0, par);
            add_column_sums(
                std::slice::from_raw_parts_mut(ddbp.ptr().add(x * m), m),
                std::slice::from_raw_parts(dy, c * m),
            );
            let pre = &pre[r0 * 2 * i..(r0 + c) * 2 * i];
            for ((dp, p), da) in dpre.chunks_exact_mut(2 * i).zip(pre.chunks_exact(2 * i)).zip(dact.chunks_exact(i)) {
                s.activate_backward(p, da, dp);
            }
            // dX = dPre Wgu^T; dWgu = X^T dPre; dbgu = sum of dPre's rows
            let dpre_v = View::rows(dpre.as_ptr(), 2 * i);
            mm_par(c, m, 2 * i, Out::set(dxp.ptr().add(r0 * m), m), dpre_v, View::rows(wgu, 2 * i).t(), 1.0, par);
            mm_par(
                m,
                2 * i,
                c,
                Out::set(dgup.ptr().add(x * m * 2 * i), 2 * i),
                View::rows(xr, m).t(),
                dpre_v,
                1.0,
                par,
            );
            add_column_sums(std::slice::from_raw_parts_mut(dgubp.ptr().add(x * 2 * i), 2 * i), &dpre);
        }
    };
    if across {
        (0..ne).into_par_iter().for_each(run);
    } else {
        (0..ne).for_each(run);
    }
    [dxs, dgu, dgub, dd, ddb]
}
