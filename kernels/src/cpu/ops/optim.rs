//! The optimizer's pass over a parameter and the squared norm that gradient clipping needs.

use rayon::prelude::*;

use crate::cpu::vector;

/// AdamW over a whole parameter, in place, in parallel chunks. `grad(i0, out)` fills `out` with
/// the gradient elements `i0..i0 + out.len()` (so a transposed gradient is read without first
/// copying it whole).
pub fn adamw(
    p: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    grad: &(dyn Fn(usize, &mut [f32]) + Sync),
    s: vector::AdamWScalars,
) {
    const CHUNK: usize = 16 * 1024;
    p.par_chunks_mut(CHUNK).zip(m.par_chunks_mut(CHUNK)).zip(v.par_chunks_mut(CHUNK)).enumerate().for_each(
        |(t, ((pc, mc), vc))| {
            let mut g = vec![0f32; pc.len()];
            grad(t * CHUNK, &mut g);
            vector::adamw(pc, mc, vc, &g, s);
        },
    );
}

/// `sum(x^2)` in f64 (f32 products summed per chunk, chunks summed in f64).
pub fn sum_squares(x: &[f32]) -> f64 {
    x.par_chunks(16 * 1024).map(|c| vector::dot(c, c) as f64).sum()
}
