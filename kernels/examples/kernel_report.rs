//! Achieved rates of the CubeCL kernels against ceilings measured in the same run: a large copy
//! (GB/s) and a large dense matrix product through Burn's own matmul (TFLOP/s), in the same dtype.
//! `scripts/gpu-check.sh` runs it on an NVIDIA GPU (`--features cuda,report`); `--small` runs tiny
//! shapes anywhere (e.g. on lavapipe) to check that the report itself works.
//!
//! ```text
//! cargo run --release -p disagmoe-kernels --features report --example kernel_report -- [--small] [--dtype f32|f16|bf16] [--json FILE]
//! ```
//!
//! Targets (issue #6, at the large shapes on an H200): grouped expert MLP >= 60% of the dense
//! matmul rate, attention forward >= 50%, permute >= 70% of the copy bandwidth.

#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn main() {
    report::main()
}

#[cfg(not(any(feature = "wgpu", feature = "cuda")))]
fn main() {
    eprintln!("kernel_report needs a CubeCL runtime: --features wgpu (default) or --features cuda");
    std::process::exit(2);
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod report {
    use std::time::Instant;

    use burn::tensor::backend::Backend;
    use burn::tensor::{DType, FloatDType, Tensor};
    use disagmoe_kernels::{cube, reference};

    #[cfg(feature = "cuda")]
    type K = cube::CudaCube;
    #[cfg(all(feature = "wgpu", not(feature = "cuda")))]
    type K = cube::WgpuCube;

    struct Args {
        small: bool,
        dtype: FloatDType,
        json: Option<String>,
    }

    fn parse() -> Result<Args, String> {
        let mut a = Args { small: false, dtype: FloatDType::F32, json: None };
        let mut it = std::env::args().skip(1);
        while let Some(x) = it.next() {
            match x.as_str() {
                "--small" => a.small = true,
                "--dtype" => {
                    a.dtype = match it.next().as_deref() {
                        Some("f32") => FloatDType::F32,
                        Some("f16") => FloatDType::F16,
                        Some("bf16") => FloatDType::BF16,
                        other => return Err(format!("--dtype {other:?}: allowed values are f32, f16, bf16")),
                    }
                }
                "--json" => a.json = Some(it.next().ok_or("--json needs a file name")?),
                "--help" | "-h" => {
                    return Err("usage: kernel_report [--small] [--dtype f32|f16|bf16] [--json FILE]".into());
                }
                other => return Err(format!("unknown argument {other:?} (allowed: --small, --dtype, --json)")),
            }
        }
        Ok(a)
    }

    fn sync() {
        <K as Backend>::sync(&Default::default()).expect("device sync");
    }

    /// Median seconds of `runs` calls after one warm-up.
    fn time<T>(runs: usize, mut f: impl FnMut() -> T) -> f64 {
        let keep = f();
        sync();
        drop(keep);
        let mut ts: Vec<f64> = (0..runs)
            .map(|_| {
                let t0 = Instant::now();
                let keep = f();
                sync();
                let dt = t0.elapsed().as_secs_f64();
                drop(keep);
                dt
            })
            .collect();
        ts.sort_by(f64::total_cmp);
        ts[ts.len() / 2]
    }

    fn rand<const D: usize>(shape: [usize; D], seed: u64, dtype: FloatDType) -> Tensor<K, D> {
        let device = Default::default();
        <K as Backend>::seed(&device, seed);
        let t: Tensor<K, D> = Tensor::random(shape, burn::tensor::Distribution::Uniform(-0.5, 0.5), &device);
        if dtype == FloatDType::F32 {
            t
        } else {
            t.cast(dtype)
        }
    }

    struct Row {
        name: String,
        shape: String,
        ms: f64,
        rate: f64,
        unit: &'static str,
        ceiling: f64,
        target: Option<f64>,
    }

    pub fn main() {
        let args = match parse() {
            Ok(a) => a,
            Err(e) => {
                eprintln!("{e}");
                std::process::exit(2);
            }
        };
        let dt = args.dtype;
        let bytes = match dt {
            FloatDType::F32 => 4.0,
            _ => 2.0,
        };
        if !<K as Backend>::supports_dtype(&Default::default(), DType::from(dt)) {
            eprintln!("this device has no {dt:?}; allowed here: f32");
            std::process::exit(2);
        }
        let runs = if args.small { 3 } else { 10 };
        let mut rows = Vec::new();

        // Ceilings: a copy (read + write) and a dense product.
        let n_copy = if args.small { 1 << 22 } else { 1 << 28 };
        let x = rand([n_copy], 1, dt);
        let s = time(runs, || x.clone().mul_scalar(1.0));
        let copy_gbs = 2.0 * n_copy as f64 * bytes / s / 1e9;
        rows.push(Row {
            name: "copy (ceiling)".into(),
            shape: format!("{n_copy}"),
            ms: s * 1e3,
            rate: copy_gbs,
            unit: "GB/s",
            ceiling: copy_gbs,
            target: None,
        });
        drop(x);
        let n = if args.small { 256 } else { 8192 };
        let (a, b) = (rand([n, n], 2, dt), rand([n, n], 3, dt));
        let s = time(runs, || a.clone().matmul(b.clone()));
        let mm_tflops = 2.0 * (n as f64).powi(3) / s / 1e12;
        rows.push(Row {
            name: "dense matmul (ceiling)".into(),
            shape: format!("{n}x{n}x{n}"),
            ms: s * 1e3,
            rate: mm_tflops,
            unit: "TFLOP/s",
            ceiling: mm_tflops,
            target: None,
        });
        drop((a, b));

        // Grouped expert MLP (forward), routing spread evenly.
        let (t, m, i, e, k) = if args.small { (512, 256, 128, 8, 2) } else { (16_384, 4096, 1536, 64, 8) };
        let rows_n = t * k;
        let counts: Vec<usize> = (0..e).map(|x| rows_n / e + usize::from(x < rows_n % e)).collect();
        let xs = rand([rows_n, m], 4, dt);
        let (g, u, d) = (rand([e, i, m], 5, dt), rand([e, i, m], 6, dt), rand([e, m, i], 7, dt));
        let s = time(runs, || {
            cube::swiglu_experts_stacked(xs.clone(), &counts, g.clone(), u.clone(), d.clone()).expect("kernel applies")
        });
        let flops = 2.0 * rows_n as f64 * m as f64 * i as f64 * 3.0;
        rows.push(Row {
            name: "grouped expert MLP fwd".into(),
            shape: format!("T{t} k{k} M{m} I{i} E{e}"),
            ms: s * 1e3,
            rate: flops / s / 1e12,
            unit: "TFLOP/s",
            ceiling: mm_tflops,
            target: Some(0.6),
        });
        // The same experts through CubeCL's (autotuned, tensor-core) matmul one expert after
        // another: what `cube::probe` weighs our grouped kernels against.
        let per_expert: Vec<_> = (0..e)
            .map(|j| {
                let one = |w: &Tensor<K, 3>, r, c| w.clone().narrow(0, j, 1).reshape([r, c]);
                (one(&g, i, m), one(&u, i, m), one(&d, m, i))
            })
            .collect();
        let s_mm = time(runs, || disagmoe_kernels::reference::swiglu_experts(xs.clone(), &counts, &per_expert));
        rows.push(Row {
            name: format!("expert MLP fwd, matmul per expert ({} faster)", if s_mm < s { "matmul" } else { "grouped" }),
            shape: format!("T{t} k{k} M{m} I{i} E{e}"),
            ms: s_mm * 1e3,
            rate: flops / s_mm / 1e12,
            unit: "TFLOP/s",
            ceiling: mm_tflops,
            target: None,
        });
        drop((xs, g, u, d, per_expert));

        // Attention forward, causal.
        let (bsz, seq, h, gq, hd) = if args.small { (1, 256, 4, 2, 64) } else { (1, 8192, 32, 8, 128) };
        let (q, kk, v) =
            (rand([bsz, seq, h, hd], 8, dt), rand([bsz, seq, gq, hd], 9, dt), rand([bsz, seq, gq, hd], 10, dt));
        let scale = 1.0 / (hd as f64).sqrt();
        let s = time(runs, || {
            cube::attention(q.clone(), kk.clone(), v.clone(), None, scale, None, None).expect("kernel applies")
        });
        let flops = 4.0 * bsz as f64 * h as f64 * (seq as f64).powi(2) * hd as f64 / 2.0;
        rows.push(Row {
            name: "attention fwd (causal)".into(),
            shape: format!("B{bsz} S{seq} H{h} G{gq} D{hd}"),
            ms: s * 1e3,
            rate: flops / s / 1e12,
            unit: "TFLOP/s",
            ceiling: mm_tflops,
            target: Some(0.5),
        });
        if args.small {
            // The reference beside it, for scale.
            let s = time(runs, || reference::attention(q.clone(), kk.clone(), v.clone(), None, scale, None, None));
            rows.push(Row {
                name: "attention fwd, reference".into(),
                shape: format!("B{bsz} S{seq} H{h} G{gq} D{hd}"),
                ms: s * 1e3,
                rate: flops / s / 1e12,
                unit: "TFLOP/s",
                ceiling: mm_tflops,
                target: None,
            });
        }
        drop((q, kk, v));

        // Permute (token rows into expert order).
        let ids: Vec<usize> = (0..t * k).map(|x| (x * 7 + x / 3) % e).collect();
        let (_, slots) = reference::route(&ids, e);
        let x = rand([t, m], 11, dt);
        let s = time(runs, || cube::permute_rows(x.clone(), &slots, k).expect("kernel applies"));
        let moved = 2.0 * (t * k * m) as f64 * bytes;
        rows.push(Row {
            name: "permute".into(),
            shape: format!("T{t} k{k} M{m}"),
            ms: s * 1e3,
            rate: moved / s / 1e9,
            unit: "GB/s",
            ceiling: copy_gbs,
            target: Some(0.7),
        });

        let device = format!("{:?}", burn::tensor::Device::<K>::default());
        println!(
            "runtime: {}, device: {device}, dtype {dt:?}, {} shapes, median of {runs}",
            if cfg!(feature = "cuda") { "cuda" } else { "wgpu" },
            if args.small { "small" } else { "large" }
        );
        println!(
            "{:<28} {:<26} {:>10} {:>12} {:>8} {:>9} {:>7}",
            "kernel", "shape", "ms", "rate", "unit", "% ceiling", "target"
        );
        let mut json = Vec::new();
        for r in &rows {
            let pct = 100.0 * r.rate / r.ceiling;
            let target = r.target.map_or("-".to_string(), |t| {
                format!("{:.0}% {}", t * 100.0, if pct >= t * 100.0 { "ok" } else { "MISS" })
            });
            println!(
                "{:<28} {:<26} {:>10.3} {:>12.3} {:>8} {:>8.1}% {:>7}",
                r.name, r.shape, r.ms, r.rate, r.unit, pct, target
            );
            json.push(format!(
                "{{\"kernel\":\"{}\",\"shape\":\"{}\",\"ms\":{:.4},\"rate\":{:.4},\"unit\":\"{}\",\"percent_of_ceiling\":{:.2},\"target_percent\":{}}}",
                r.name,
                r.shape,
                r.ms,
                r.rate,
                r.unit,
                pct,
                r.target.map_or("null".to_string(), |t| format!("{}", t * 100.0))
            ));
        }
        if let Some(path) = args.json {
            let text = format!(
                "{{\"device\":\"{}\",\"dtype\":\"{dt:?}\",\"rows\":[{}]}}\n",
                device.replace('"', "'"),
                json.join(",")
            );
            if let Err(e) = std::fs::write(&path, text) {
                eprintln!("cannot write {path}: {e}");
                std::process::exit(1);
            }
        }
    }
}
