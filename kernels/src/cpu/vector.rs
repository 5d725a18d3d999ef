//! Row primitives the fused CPU operations are built from, written so that LLVM vectorises them:
//! fixed-width accumulators instead of serial reductions, and a branch-free `exp`.
//!
//! Each public function picks, once per call, the AVX2+FMA build of its body when the CPU has it
//! (the crate itself is compiled for baseline x86-64), else the portable build.

/// `e^x` in f32 by Cephes' method: `x = n ln2 + r`, `|r| <= ln2/2`, a degree-6 polynomial in `r`,
/// times `2^n` built in the exponent bits. Relative error about 1e-7 (2 ulp) on `[-87, 88]`;
/// inputs below clamp to `e^-87.3` (~1e-38), which softmax and sigmoid treat as zero anyway.
/// What overflows stays visible: above `ln(f32::MAX)` (88.72, +inf included) the result is +inf,
/// and NaN gives NaN (so the non-finite checks see them).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LN_MAX: f32 = 88.722_84;
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding and subtracting it rounds to nearest
    let x_in = x;
    // NaN passes through the clamp and the polynomial.
    let x = x.clamp(-87.336_55, 88.376_26);
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = x - n * C1 - n * C2;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5; // Cephes: 5.0000001201e-1, whose nearest f32 is 0.5
    let y = p * r * r + r + 1.0;
    let bits = ((n as i32 + 127) as u32) << 23;
    let out = y * f32::from_bits(bits);
    // A select, not a branch: the loops that call this still vectorise.
    if x_in > LN_MAX {
        f32::INFINITY
    } else {
        out
    }
}

/// `1 / (1 + e^-x)`.
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

macro_rules! multiversion {
    ($(#[$meta:meta])* pub fn $name:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        pub fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                    // SAFETY: the CPU supports the features the function was compiled for.
                    return unsafe { avx2($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}

multiversion! {
    /// Largest element (`-inf` for an empty slice).
    pub fn max(xs: &[f32]) -> f32 {
        let mut acc = [f32::NEG_INFINITY; 8];
        let chunks = xs.chunks_exact(8);
        let tail = chunks.remainder();
        for c in chunks {
            for l in 0..8 {
                acc[l] = acc[l].max(c[l]);
            }
        }
        let mut m = acc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        for &x in tail {
            m = m.max(x);
        }
        m
    }
}

multiversion! {
    /// `xs[i] = e^(xs[i] - shift)`; returns the sum of the new values.
    pub fn exp_shifted_sum(xs: &mut [f32], shift: f32) -> f32 {
        let mut acc = [0f32; 8];
        let mut chunks = xs.chunks_exact_mut(8);
        for c in &mut chunks {
            for l in 0..8 {
                c[l] = exp(c[l] - shift);
                acc[l] += c[l];
            }
        }
        let mut s: f32 = acc.iter().sum();
        for x in chunks.into_remainder() {
            *x = exp(*x - shift);
            s += *x;
        }
        s
    }
}

multiversion! {
    /// `xs[i] *= a`.
    pub fn scale(xs: &mut [f32], a: f32) {
        for x in xs {
            *x *= a;
        }
    }
}

multiversion! {
    /// `sum_i a[i] * b[i]`.
    pub fn dot(a: &[f32], b: &[f32]) -> f32 {
        let mut acc = [0f32; 8];
        let n = a.len().min(b.len());
        let (a, b) = (&a[..n], &b[..n]);
        let ca = a.chunks_exact(8);
        let cb = b.chunks_exact(8);
        let (ta, tb) = (ca.remainder(), cb.remainder());
        for (x, y) in ca.zip(cb) {
            for l in 0..8 {
                acc[l] += x[l] * y[l];
            }
        }
        let mut s: f32 = acc.iter().sum();
        for (x, y) in ta.iter().zip(tb) {
            s += x * y;
        }
        s
    }
}

multiversion! {
    /// Softmax backward on one row, in place: `d[i] = p[i] * (d[i] - sum_j p[j] d[j])`; returns
    /// `(sum_j p[j] d[j], sum_j p[j])` (the second is below one when a sink took some mass).
    pub fn softmax_backward_row(p: &[f32], d: &mut [f32]) -> (f32, f32) {
        let mut acc = [0f32; 8];
        let mut mass = [0f32; 8];
        let cp = p.chunks_exact(8);
        let cd = d.chunks_exact(8);
        let (tp, td) = (cp.remainder(), cd.remainder());
        for (x, y) in cp.zip(cd) {
            for l in 0..8 {
                acc[l] += x[l] * y[l];
                mass[l] += x[l];
            }
        }
        let mut s: f32 = acc.iter().sum();
        let mut total: f32 = mass.iter().sum();
        for (x, y) in tp.iter().zip(td) {
            s += x * y;
            total += x;
        }
        for (x, &q) in d.iter_mut().zip(p) {
            *x = q * (*x - s);
        }
        (s, total)
    }
}

multiversion! {
    /// RMSNorm of one row: `out = x * r * w` with `r = 1 / sqrt(mean(x^2) + eps)`; returns `r`.
    pub fn rms_norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) -> f32 {
        let mut acc = [0f32; 8];
        let cx = x.chunks_exact(8);
        let tail = cx.remainder();
        for c in cx {
            for l in 0..8 {
                acc[l] += c[l] * c[l];
            }
        }
        let mut ss: f32 = acc.iter().sum();
        for v in tail {
            ss += v * v;
        }
        let r = 1.0 / (ss / x.len() as f32 + eps).sqrt();
        for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
            *o = v * r * g;
        }
        r
    }
}

multiversion! {
    /// RMSNorm backward of one row: writes `dx` and adds `dy * x * r` into `dw`.
    /// `dx = r * g - x * r^3 * sum(g * x) / n` with `g = dy * w`.
    pub fn rms_norm_backward_row(x: &[f32], w: &[f32], dy: &[f32], r: f32, dx: &mut [f32], dw: &mut [f32]) {
        let n = x.len();
        let mut acc = [0f32; 8];
        let mut i = 0;
        while i + 8 <= n {
            for l in 0..8 {
                acc[l] += dy[i + l] * w[i + l] * x[i + l];
            }
            i += 8;
        }
        let mut s: f32 = acc.iter().sum();
        while i < n {
            s += dy[i] * w[i] * x[i];
            i += 1;
        }
        let c = r * r * r * s / n as f32;
        for j in 0..n {
            dx[j] = r * dy[j] * w[j] - x[j] * c;
            dw[j] += dy[j] * x[j] * r;
        }
    }
}

multiversion! {
    /// `out = silu(g) * u`.
    pub fn swiglu(g: &[f32], u: &[f32], out: &mut [f32]) {
        for ((o, &a), &b) in out.iter_mut().zip(g).zip(u) {
            *o = a * sigmoid(a) * b;
        }
    }
}

multiversion! {
    /// Backward of `silu(g) * u`: `dg = dh * u * s * (1 + g (1 - s))`, `du = dh * g * s`, `s = sigmoid(g)`.
    pub fn swiglu_backward(g: &[f32], u: &[f32], dh: &[f32], dg: &mut [f32], du: &mut [f32]) {
        for i in 0..g.len() {
            let s = sigmoid(g[i]);
            dg[i] = dh[i] * u[i] * s * (1.0 + g[i] * (1.0 - s));
            du[i] = dh[i] * g[i] * s;
        }
    }
}

multiversion! {
    /// Half-split rotary embedding of one head vector: `out = x * cos + rotate_half(x) * sin`, or
    /// its transpose (the backward) when `inverse`: `dx = dy * cos + rotate_half^T(dy * sin)`.
    pub fn rope_row(x: &[f32], cos: &[f32], sin: &[f32], inverse: bool, out: &mut [f32]) {
        let h = x.len() / 2;
        let (x1, x2) = x.split_at(h);
        let (o1, o2) = out.split_at_mut(h);
        let (c1, c2) = cos.split_at(h);
        let (s1, s2) = sin.split_at(h);
        if inverse {
            for i in 0..h {
                o1[i] = x1[i] * c1[i] + x2[i] * s2[i];
                o2[i] = x2[i] * c2[i] - x1[i] * s1[i];
            }
        } else {
            for i in 0..h {
                o1[i] = x1[i] * c1[i] - x2[i] * s1[i];
                o2[i] = x2[i] * c2[i] + x1[i] * s2[i];
            }
        }
    }
}

/// The scalars of one AdamW update (as f32, the way Burn's scalar ops apply them).
#[derive(Debug, Clone, Copy)]
pub struct AdamWScalars {
    /// Gradient multiplier (clipping); 1 for none.
    pub grad_scale: f32,
    pub beta1: f32,
    pub one_minus_beta1: f32,
    pub beta2: f32,
    pub one_minus_beta2: f32,
    /// Bias corrections `1 - beta^t`.
    pub bc1: f32,
    pub bc2: f32,
    pub eps: f32,
    pub lr: f32,
    /// `1 - lr * weight_decay` (1 where no decay applies).
    pub decay: f32,
}

multiversion! {
    /// AdamW on a run of elements, in place:
    /// `m = b1 m + (1 - b1) g`, `v = b2 v + (1 - b2) g^2`,
    /// `p = p * decay - lr * (m / bc1) / (sqrt(v / bc2) + eps)`.
    pub fn adamw(p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], s: AdamWScalars) {
        for i in 0..p.len() {
            let gi = if s.grad_scale != 1.0 { g[i] * s.grad_scale } else { g[i] };
            let mi = m[i] * s.beta1 + gi * s.one_minus_beta1;
            let vi = v[i] * s.beta2 + gi * gi * s.one_minus_beta2;
            m[i] = mi;
            v[i] = vi;
            p[i] = p[i] * s.decay - (mi / s.bc1) / ((vi / s.bc2).sqrt() + s.eps) * s.lr;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_std_to_a_few_ulp() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let got = exp(x) as f64;
            let want = (x as f64).exp();
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp(-1000.0), exp(-87.336_55));
        assert!(exp(-1000.0) < 1e-37);
        assert!((exp(0.0) - 1.0).abs() < 1e-7);
        // Overflow and NaN stay visible; the range just below overflow stays finite.
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(89.0), f32::INFINITY);
        assert!(exp(88.5).is_finite() && exp(88.5) > 1e38);
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(exp(f32::NEG_INFINITY), exp(-87.336_55));
        assert_eq!(sigmoid(f32::NEG_INFINITY), 0.0);
        assert_eq!(sigmoid(f32::INFINITY), 1.0);
        let mut row = [0.0f32, f32::NAN, 1.0];
        assert!(exp_shifted_sum(&mut row, 0.0).is_nan());
    }

    #[test]
    fn reductions_cover_the_tail() {
        let xs: Vec<f32> = (0..19).map(|i| (i as f32 * 0.7).sin()).collect();
        let m = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        assert_eq!(max(&xs), m);
        let d: f32 = xs.iter().map(|x| x * x).sum();
        assert!((dot(&xs, &xs) - d).abs() < 1e-5);
        let mut e = xs.clone();
        let s = exp_shifted_sum(&mut e, m);
        let want: f32 = xs.iter().map(|x| (x - m).exp()).sum();
        assert!((s - want).abs() < 1e-5);
        assert!(e.iter().zip(&xs).all(|(a, x)| (a - (x - m).exp()).abs() < 1e-6));
    }
}
