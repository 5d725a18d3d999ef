//! Each CubeCL kernel against a reference written in plain Burn operations, on Burn's WebGPU/
//! Vulkan runtime (in CI: Mesa's lavapipe, a CPU Vulkan driver) or on CUDA: outputs and the
//! gradients of every input, on awkward cases (experts with no token, one expert with every
//! token, sizes that are not multiples of the 64-wide tiles, sequences not a multiple of the
//! attention tile, GQA ratios 1/2/4, windows shorter than the sequence, sinks on and off, value
//! head dim != key head dim), in f32 and, where the runtime has it, f16.
//!
//! Each path runs its backward before the other's forward: two live graphs sharing input nodes
//! can lose their leaves when another test thread runs a backward (Burn 0.21's autodiff cleanup).
#![cfg(any(feature = "wgpu", feature = "cuda"))]

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Int, Tensor, TensorData};
use disagmoe_kernels::documents::Documents;
use disagmoe_kernels::ring::{partial, ring_attention, Mask};
use disagmoe_kernels::{cube, reference};

#[cfg(feature = "cuda")]
type Inner = cube::CudaCube;
#[cfg(all(feature = "wgpu", not(feature = "cuda")))]
type Inner = cube::WgpuCube;
type B = Autodiff<Inner>;

fn values<const D: usize>(t: Tensor<impl Backend, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec::<f32>().unwrap()
}

#[track_caller]
fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let worst = got.iter().zip(want).map(|(a, b)| (a - b).abs() / (1.0 + b.abs())).fold(0f32, f32::max);
    eprintln!("{what}: worst relative difference {worst:.2e} (tolerance {tol:.1e})");
    assert!(worst <= tol, "{what}: worst relative difference {worst:e} > {tol:e}");
    assert!(got.iter().all(|x| x.is_finite()), "{what}: not finite");
}

fn device() -> burn::tensor::Device<B> {
    Default::default()
}

/// The device of this runtime, checked to answer, and the one-at-a-time lock: on a CPU driver,
/// tests in parallel only fight over the same cores. A machine without a Vulkan driver never gets
/// here (the tests are ignored, see `build-support/probe.rs`); one whose driver does not answer
/// is a failure, not a skip.
fn runtime_present(test: &str) -> std::sync::MutexGuard<'static, ()> {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let guard = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let probe = std::panic::catch_unwind(|| {
        let t = Tensor::<Inner, 1>::from_data(TensorData::new(vec![1.0f32, 2.0], [2]), &Default::default());
        values(t.add_scalar(1.0))
    });
    match probe {
        Ok(v) if v == [2.0, 3.0] => guard,
        other => panic!("{test}: a Vulkan/CUDA driver is installed but no CubeCL device answers ({other:?})"),
    }
}

/// Deterministic pseudo-random values (the same on every runtime).
fn rand<const D: usize>(shape: [usize; D], seed: u64) -> Tensor<B, D> {
    let n: usize = shape.iter().product();
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    let v: Vec<f32> = (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32 * 1.7
        })
        .collect();
    Tensor::from_data(TensorData::new(v, shape), &device())
}

/// f16's machine epsilon (2^-10): one rounding of a value to f16 is off by at most half of it.
const F16_EPS: f32 = 9.765_625e-4;
/// The output of an f16 kernel that accumulates in f32, against an f32 reference on the same
/// rounded inputs: its own rounding to f16 (eps / 2) and a little of the f32 sums' (measured on
/// lavapipe: attention 0.24 eps).
const F16_OUTPUT_TOL: f32 = F16_EPS;
/// Gradients: the f16 incoming gradient and saved forward values add one rounding each
/// (measured: 0.47 eps).
const F16_GRAD_TOL: f32 = 2.0 * F16_EPS;
/// Two products with an f16 intermediate between them (the experts' `h = silu(g) * u`, with `g`
/// and `u` rounded too): each of the I terms of the second product carries the intermediate's
/// rounding, and cancellation between them can make it large relative to the output (measured:
/// 4.7 eps).
const F16_CHAINED_TOL: f32 = 8.0 * F16_EPS;

/// The f16 tests are ignored where the build script's probe found no Vulkan driver with f16
/// (`disagmoe_no_f16`, build-support/probe.rs); where it found one, the runtime must have it.
fn f16_runtime(test: &str) {
    assert!(
        <Inner as Backend>::supports_dtype(&device(), DType::F16),
        "{test}: the build's probe found a Vulkan driver with f16 (vulkaninfo), but this runtime's device has no f16"
    );
}

#[test]
#[cfg_attr(
    all(disagmoe_no_vulkan, not(feature = "cuda")),
    ignore = "no Vulkan driver on this machine (apt-get install mesa-vulkan-drivers)"
)]
fn attention_matches_the_reference_with_gradients() {
    let _one = runtime_present("attention_matches_the_reference_with_gradients");
    // (batch, seq, heads, kv heads, qk dim, v dim, window, sinks)
    let cases = [
        (2, 70, 4, 4, 8, 8, None, false),
        (1, 130, 4, 2, 16, 12, None, false),
        (2, 70, 8, 2, 8, 8, Some(5), false),
        (1, 67, 4, 1, 6, 10, Some(100), false),
        (1, 1, 2, 1, 4, 4, None, false),
        (2, 70, 4, 2, 8, 8, None, true),
        (1, 67, 8, 2, 6, 6, Some(3), true),
    ];
    for (i, &(b, s, h, g, d, e, window, with_sinks)) in cases.iter().enumerate() {
        let seed = 10 * i as u64;
        let q = rand([b, s, h, d], seed).require_grad();
        let k = rand([b, s, g, d], seed + 1).require_grad();
        let v = rand([b, s, g, e], seed + 2).require_grad();
        let sinks = with_sinks.then(|| rand([h], seed + 3).require_grad());
        let scale = 1.0 / (d as f64).sqrt();
        let probe = rand([b, s, h, e], seed + 4);
        let what = format!("case {i} {:?}", cases[i]);
        let got = cube::attention(q.clone(), k.clone(), v.clone(), sinks.clone(), scale, window, None).unwrap();
        let gk = (got.clone() * probe.clone()).sum().backward();
        let want = reference::attention(q.clone(), k.clone(), v.clone(), sinks.clone(), scale, window, None);
        let gr = (want.clone() * probe).sum().backward();
        assert_close(&format!("{what} output"), &values(got.clone()), &values(want.clone()), 1e-4);
        for (name, x) in [("dq", &q), ("dk", &k), ("dv", &v)] {
            assert_close(&format!("{what} {name}"), &values(x.grad(&gk).unwrap()), &values(x.grad(&gr).unwrap()), 2e-4);
        }
        if let Some(sk) = &sinks {
            assert_close(
                &format!("{what} dsinks"),
                &values(sk.grad(&gk).unwrap()),
                &values(sk.grad(&gr).unwrap()),
                2e-4,
            );
        }
    }
}

#[test]
#[cfg_attr(
    all(disagmoe_no_vulkan, not(feature = "cuda")),
    ignore = "no Vulkan driver on this machine (apt-get install mesa-vulkan-drivers)"
)]
fn attention_within_documents_matches_the_masked_reference_with_gradients() {
    let _one = runtime_present("attention_within_documents_matches_the_masked_reference_with_gradients");
    // The masked reference is checked against each document run alone in `fused_vs_reference`.
    // (batch, seq, heads, kv heads, qk dim, v dim, window, sinks, each row's document cuts):
    // documents across and inside the kernels' tiles, a one-token document, windows.
    let cases: [(usize, usize, usize, usize, usize, usize, Option<usize>, bool, Vec<Vec<usize>>); 4] = [
        (2, 70, 4, 2, 8, 8, None, false, vec![vec![5, 6, 40], vec![]]),
        (1, 137, 4, 4, 6, 10, None, true, vec![vec![64, 65, 128]]),
        (2, 70, 8, 2, 8, 8, Some(5), true, vec![vec![3, 33], vec![69]]),
        (1, 131, 4, 1, 16, 12, Some(40), false, vec![vec![1, 70, 100]]),
    ];
    for (i, (b, s, h, g, d, e, window, with_sinks, cuts)) in cases.iter().cloned().enumerate() {
        let docs = Documents::new(s, &cuts).unwrap();
        let seed = 100 + 10 * i as u64;
        let q = rand([b, s, h, d], seed).require_grad();
        let k = rand([b, s, g, d], seed + 1).require_grad();
        let v = rand([b, s, g, e], seed + 2).require_grad();
        let sinks = with_sinks.then(|| rand([h], seed + 3).require_grad());
        let scale = 1.0 / (d as f64).sqrt();
        let probe = rand([b, s, h, e], seed + 4);
        let what = format!("documents case {i} {:?}", cases[i]);
        let got = cube::attention(q.clone(), k.clone(), v.clone(), sinks.clone(), scale, window, Some(&docs)).unwrap();
        let gk = (got.clone() * probe.clone()).sum().backward();
        let want = reference::attention(q.clone(), k.clone(), v.clone(), sinks.clone(), scale, window, Some(&docs));
        let gr = (want.clone() * probe).sum().backward();
        assert_close(&format!("{what} output"), &values(got.clone()), &values(want.clone()), 1e-4);
        for (name, x) in [("dq", &q), ("dk", &k), ("dv", &v)] {
            assert_close(&format!("{what} {name}"), &values(x.grad(&gk).unwrap()), &values(x.grad(&gr).unwrap()), 2e-4);
        }
        if let Some(sk) = &sinks {
            let (a, r) = (sk.grad(&gk).unwrap(), sk.grad(&gr).unwrap());
            assert_close(&format!("{what} dsinks"), &values(a), &values(r), 2e-4);
        }
    }
}

/// One block of ring attention through the flash kernels (`cube::attention_block`, what
/// `ring::partial` runs on a CubeCL backend) against the block composed of Burn's operations
/// (kernels off): the output, the log-sum-exp, and the gradients of q, k and v through both (the
/// log-sum-exp's gradient is what the merge of blocks sends back), over blocks on and off the
/// diagonal, blocks of several tiles, windows that empty some rows, documents, and a block no
/// query sees; then a whole ring of 2 and 3 workers against the whole attention.
#[test]
#[cfg_attr(
    all(disagmoe_no_vulkan, not(feature = "cuda")),
    ignore = "no Vulkan driver on this machine (apt-get install mesa-vulkan-drivers)"
)]
fn the_flash_block_of_ring_attention_is_the_composed_block_with_gradients() {
    let _one = runtime_present("the_flash_block_of_ring_attention_is_the_composed_block_with_gradients");
    let (b, h, g, d, e) = (2, 4, 2, 8, 6);
    let s = 200;
    let docs = Documents::new(s, &[vec![7, 23, 120], vec![30, 170]]).unwrap();
    let mut cases = 0;
    for (q_at, k_at, window, cut) in [
        (60..200, 0..150, Some(70), true),
        (100..180, 100..180, None, false),
        (10..20, 10..20, None, false),
        (30..40, 0..10, None, false),
        (30..40, 12..25, Some(12), false),
        (20..33, 3..19, None, true),
        (25..35, 5..12, Some(6), true),
        (5..15, 20..30, None, false),
        (130..200, 0..70, None, false),
    ] {
        let what = format!("queries {q_at:?}, keys {k_at:?}, window {window:?}, documents {cut}");
        let mask = Mask { window, docs: cut.then_some(&docs) };
        let (qpos, kpos): (Vec<usize>, Vec<usize>) = (q_at.clone().collect(), k_at.clone().collect());
        let (sq, tk) = (qpos.len(), kpos.len());
        let (wo, wl) = (rand([b, sq, h, e], 7), rand([b, h, sq, 1], 8));
        let mut runs = Vec::new();
        for flash in [false, true] {
            disagmoe_kernels::set_enabled_for_thread(Some(flash));
            let seed = (q_at.start * 100 + k_at.start) as u64;
            let q = rand([b, sq, h, d], seed).require_grad();
            let k = rand([b, tk, g, d], seed + 1).require_grad();
            let v = rand([b, tk, g, e], seed + 2).require_grad();
            let before = cube::ops_run();
            let (out, lse) = partial(q.clone(), k.clone(), v.clone(), 0.35, mask, &qpos, &kpos);
            assert_eq!(cube::ops_run() - before, usize::from(flash), "{what}: the kernel ran");
            // Rows that see no key carry the same stand-in log-sum-exp either way.
            let seen = lse.clone().greater_elem(-1.0e29).float();
            let objective = (out.clone() * wo.clone()).sum() + (lse.clone() * seen * wl.clone()).sum();
            let grads = objective.backward();
            runs.push([
                values(out),
                values(lse),
                values(q.grad(&grads).unwrap()),
                values(k.grad(&grads).unwrap()),
                values(v.grad(&grads).unwrap()),
            ]);
        }
        disagmoe_kernels::set_enabled_for_thread(None);
        for (name, (got, want)) in ["output", "log-sum-exp", "dq", "dk", "dv"].iter().zip(runs[1].iter().zip(&runs[0]))
        {
            // Measured on lavapipe: 6.7e-7.
            assert_close(&format!("{what} {name}"), got, want, 5e-6);
        }
        cases += 1;
    }
    assert_eq!(cases, 9);
    // Whole rings over the flash blocks: 2 workers (windows, documents), 3 workers (sinks)
    // (measured on lavapipe: 9.5e-7).
    for (c, window, cut, with_sinks) in [(2, Some(30), true, false), (3, None, false, true)] {
        let what = format!("ring of {c}, window {window:?}, documents {cut}, sinks {with_sinks}");
        let s = 101;
        let docs = Documents::new(s, &[vec![40], vec![]]).unwrap();
        let docs = cut.then_some(&docs);
        let seed = 500 + c as u64;
        let q = rand([b, s, h, d], seed).require_grad();
        let k = rand([b, s, g, d], seed + 1).require_grad();
        let v = rand([b, s, g, e], seed + 2).require_grad();
        let sinks = with_sinks.then(|| rand([h], seed + 3).require_grad());
        let probe = rand([b, s, h, e], seed + 4);
        let got =
            ring_attention(q.clone(), k.clone(), v.clone(), sinks.clone(), 0.35, Mask { window, docs }, c).unwrap();
        let gk = (got.clone() * probe.clone()).sum().backward();
        let want = reference::attention(q.clone(), k.clone(), v.clone(), sinks.clone(), 0.35, window, docs);
        let gr = (want.clone() * probe).sum().backward();
        assert_close(&format!("{what} output"), &values(got), &values(want), 1e-5);
        for (name, x) in [("dq", &q), ("dk", &k), ("dv", &v)] {
            assert_close(&format!("{what} {name}"), &values(x.grad(&gk).unwrap()), &values(x.grad(&gr).unwrap()), 1e-5);
        }
        if let Some(sk) = &sinks {
            assert_close(
                &format!("{what} dsinks"),
                &values(sk.grad(&gk).unwrap()),
                &values(sk.grad(&gr).unwrap()),
                1e-5,
            );
        }
    }
}

#[test]
#[cfg_attr(
    all(any(disagmoe_no_vulkan, disagmoe_no_f16), not(feature = "cuda")),
    ignore = "no Vulkan driver with f16 on this machine (apt-get install mesa-vulkan-drivers vulkan-tools: vulkaninfo tells)"
)]
fn attention_in_half_precision_accumulates_in_f32() {
    let _one = runtime_present("attention_in_half_precision_accumulates_in_f32");
    f16_runtime("attention_in_half_precision_accumulates_in_f32");
    let (b, s, h, g, d) = (1, 70, 4, 2, 16);
    let half = |t: Tensor<B, 4>| t.cast(FloatDType::F16);
    let (q, k, v) = (rand([b, s, h, d], 1), rand([b, s, g, d], 2), rand([b, s, g, d], 3));
    let (q, k, v) = (half(q).require_grad(), half(k).require_grad(), half(v).require_grad());
    // The f32 reference computed from the same rounded inputs: what is left is the kernel's own
    // rounding (its f16 output and f16 intermediates; it accumulates in f32).
    let full = |t: &Tensor<B, 4>| t.clone().cast(FloatDType::F32).detach().require_grad();
    let (q32, k32, v32) = (full(&q), full(&k), full(&v));
    let got = cube::attention(q.clone(), k.clone(), v.clone(), None, 0.25, Some(9), None).unwrap();
    let grads = got.clone().sum().backward();
    assert_eq!(got.dtype(), DType::F16);
    let want = reference::attention(q32.clone(), k32.clone(), v32.clone(), None, 0.25, Some(9), None);
    let want_grads = want.clone().sum().backward();
    assert_close("f16 attention", &values(got.clone()), &values(want.clone()), F16_OUTPUT_TOL);
    for (name, x, x32) in [("dq", &q, &q32), ("dk", &k, &k32), ("dv", &v, &v32)] {
        let dx = x.grad(&grads).unwrap();
        assert_eq!(dx.dtype(), DType::F16, "{name}");
        let want = values(x32.grad(&want_grads).unwrap());
        assert_close(&format!("f16 attention {name}"), &values(dx), &want, F16_GRAD_TOL);
    }
}

#[test]
#[cfg_attr(
    all(disagmoe_no_vulkan, not(feature = "cuda")),
    ignore = "no Vulkan driver on this machine (apt-get install mesa-vulkan-drivers)"
)]
fn attention_refuses_what_it_does_not_handle() {
    let _one = runtime_present("attention_refuses_what_it_does_not_handle");
    let q = rand([1, 4, 3, 8], 1);
    let k = rand([1, 4, 2, 8], 2); // 3 heads over 2 kv heads
    assert!(cube::attention(q.clone(), k.clone(), k.clone(), None, 1.0, None, None).is_none());
    let k = rand([1, 4, 1, 300], 3); // head dim over the register budget
    let q = rand([1, 4, 1, 300], 4);
    assert!(cube::attention(q, k.clone(), k, None, 1.0, None, None).is_none());
}

fn ints(t: Tensor<B, 1, Int>) -> Vec<usize> {
    t.into_data().convert::<i64>().to_vec::<i64>().unwrap().into_iter().map(|x| x as usize).collect()
}

#[test]
#[cfg_attr(
    all(disagmoe_no_vulkan, not(feature = "cuda")),
    ignore = "no Vulkan driver on this machine (apt-get install mesa-vulkan-drivers)"
)]
fn routing_is_the_stable_counting_sort() {
    let _one = runtime_present("routing_is_the_stable_counting_sort");
    // (tokens, k, experts, rule): expert 1 gets nothing; one expert gets everything; more slots
    // than one 256-slot block, not a multiple of it.
    let cases: [(usize, usize, usize, fn(usize) -> usize); 4] = [
        (5, 2, 3, |s| [0, 2, 2, 0, 2, 0, 2, 0, 0, 2][s]),
        (300, 2, 8, |_| 5),
        (777, 3, 64, |s| (s * 7919 + s / 3) % 61),
        (1, 1, 1, |_| 0),
    ];
    for (t, k, experts, rule) in cases {
        let ids: Vec<usize> = (0..t * k).map(rule).collect();
        let tensor = Tensor::<B, 1, Int>::from_data(
            TensorData::new(ids.iter().map(|&x| x as i32).collect::<Vec<_>>(), [t * k]),
            &device(),
        );
        let r = cube::route(tensor, experts).unwrap();
        let (counts, order) = reference::route(&ids, experts);
        assert_eq!(ints(r.counts), counts, "counts ({t}, {k}, {experts})");
        let mut offsets = vec![0];
        for c in &counts {
            offsets.push(offsets.last().unwrap() + c);
        }
        assert_eq!(ints(r.offsets), offsets, "offsets");
        assert_eq!(ints(r.src), order, "src (stable)");
        let dest = ints(r.dest);
        for (p, &s) in order.iter().enumerate() {
            assert_eq!(dest[s], p, "dest is the inverse");
        }
    }
}

#[test]
#[cfg_attr(
    all(disagmoe_no_vulkan, not(feature = "cuda")),
    ignore = "no Vulkan driver on this machine (apt-get install mesa-vulkan-drivers)"
)]
fn token_permute_and_combine_match_the_reference_with_gradients() {
    let _one = runtime_present("token_permute_and_combine_match_the_reference_with_gradients");
    for (t, k, m, experts) in [(5, 2, 7, 3), (97, 4, 130, 6)] {
        let ids: Vec<usize> =
            (0..t * k).map(|s| if experts == 3 { [0, 2][s % 2] } else { (s * 5 + s / 7) % experts }).collect();
        let (_, slots) = reference::route(&ids, experts);
        let x = rand([t, m], 30).require_grad();
        let w = rand([t, k], 31).require_grad();
        let probe = rand([t * k, m], 32);
        let got = cube::permute_rows(x.clone(), &slots, k).unwrap();
        let gk = (got.clone() * probe.clone()).sum().backward();
        let want = reference::permute_rows(x.clone(), &slots, k);
        let gr = (want.clone() * probe).sum().backward();
        assert_close("permute output", &values(got.clone()), &values(want.clone()), 0.0);
        assert_close("permute dx", &values(x.grad(&gk).unwrap()), &values(x.grad(&gr).unwrap()), 1e-5);

        let ys = rand([t * k, m], 33).require_grad();
        let probe = rand([t, m], 34);
        let got = cube::combine_rows(ys.clone(), w.clone(), &slots).unwrap();
        let gk = (got.clone() * probe.clone()).sum().backward();
        let want = reference::combine_rows(ys.clone(), w.clone(), &slots);
        let gr = (want.clone() * probe).sum().backward();
        assert_close("combine output", &values(got.clone()), &values(want.clone()), 1e-5);
        assert_close("combine dys", &values(ys.grad(&gk).unwrap()), &values(ys.grad(&gr).unwrap()), 1e-5);
        assert_close("combine dw", &values(w.grad(&gk).unwrap()), &values(w.grad(&gr).unwrap()), 1e-4);
        let mut bad = slots.clone();
        bad[0] = bad[1];
        assert!(cube::permute_rows(x, &bad, k).is_none(), "not a permutation: refused");
    }
}

/// The host's top-k order: descending, ties to the lower column.
fn host_top_k(values: &[f32], cols: usize, k: usize) -> Vec<usize> {
    values
        .chunks(cols)
        .flat_map(|row| {
            let mut order: Vec<usize> = (0..cols).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            order.truncate(k);
            order
        })
        .collect()
}

#[test]
#[cfg_attr(
    all(disagmoe_no_vulkan, not(feature = "cuda")),
    ignore = "no Vulkan driver on this machine (apt-get install mesa-vulkan-drivers)"
)]
fn routing_on_the_device_chooses_sorts_counts_and_moves_tokens_as_the_host_does() {
    let _one = runtime_present("routing_on_the_device_chooses_sorts_counts_and_moves_tokens_as_the_host_does");
    // (sequences, tokens per sequence, experts, k): ties (values rounded to a coarse grid),
    // k = E, one expert, more slots than a 256-slot block.
    for (b, s, e, k) in [(2, 5, 4, 2), (3, 7, 6, 6), (1, 3, 1, 1), (4, 97, 16, 4)] {
        let t = b * s;
        let scores = rand([t, e], 40 + e as u64);
        // A coarse grid makes ties between columns of a row (`+ 0`: no -0, which the host's
        // total order puts below 0 and the kernel's comparison does not).
        let scores = ((scores * 4.0).round() / 4.0).add_scalar(0.0);
        let host_scores = values(scores.clone());
        let ids = cube::top_k(scores.clone(), k).expect("top-k applies");
        let want_ids = host_top_k(&host_scores, e, k);
        assert_eq!(ints(ids.clone()), want_ids, "top-k ({b}, {s}, {e}, {k})");

        // Counts per sequence, e-major.
        let counts = ints(cube::sequence_counts(ids.clone(), e, s * k).expect("counts apply"));
        for seq in 0..b {
            for x in 0..e {
                let want = want_ids[seq * s * k..(seq + 1) * s * k].iter().filter(|&&i| i == x).count();
                assert_eq!(counts[x * b + seq], want, "count of expert {x} in sequence {seq}");
            }
        }

        // Permute and combine in the device sort's order equal the host-slot kernels, gradients
        // included.
        let routing = cube::route(ids.clone(), e).expect("route applies");
        let (_, slots) = reference::route(&want_ids, e);
        let m = 9;
        let x = rand([t, m], 41).require_grad();
        let probe = rand([t * k, m], 42);
        let got = cube::permute_rows_routed(x.clone(), &routing, k).expect("permute applies");
        let gd = (got.clone() * probe.clone()).sum().backward();
        let want = cube::permute_rows(x.clone(), &slots, k).unwrap();
        let gh = (want.clone() * probe).sum().backward();
        assert_close("routed permute", &values(got), &values(want), 0.0);
        assert_close("routed permute dx", &values(x.grad(&gd).unwrap()), &values(x.grad(&gh).unwrap()), 0.0);
        let ys = rand([t * k, m], 43).require_grad();
        let w = rand([t, k], 44).require_grad();
        let probe = rand([t, m], 45);
        let got = cube::combine_rows_routed(ys.clone(), w.clone(), &routing).expect("combine applies");
        let gd = (got.clone() * probe.clone()).sum().backward();
        let want = cube::combine_rows(ys.clone(), w.clone(), &slots).unwrap();
        let gh = (want.clone() * probe).sum().backward();
        assert_close("routed combine", &values(got), &values(want), 0.0);
        assert_close("routed combine dys", &values(ys.grad(&gd).unwrap()), &values(ys.grad(&gh).unwrap()), 0.0);
        assert_close("routed combine dw", &values(w.grad(&gd).unwrap()), &values(w.grad(&gh).unwrap()), 0.0);
    }
    // A routing of the backend's own int ids (not the `u32` of `top_k`) is cast for the kernels;
    // the round robin of forced balance is built on the device the same way.
    let (t, k, e, m) = (6, 2, 3, 5);
    let robin = Tensor::<B, 1, Int>::arange(0..(t * k) as i64, &device()).remainder_scalar(e as i64);
    assert_eq!(ints(robin.clone().cast(DType::U32)), (0..t * k).map(|s| s % e).collect::<Vec<_>>());
    let routing = cube::route(robin, e).expect("route applies");
    let (_, slots) = reference::route(&(0..t * k).map(|s| s % e).collect::<Vec<_>>(), e);
    let x = rand([t, m], 47);
    let got = cube::permute_rows_routed(x.clone(), &routing, k).expect("permute applies");
    assert_close("permute by int ids", &values(got), &values(cube::permute_rows(x, &slots, k).unwrap()), 0.0);
    assert!(cube::top_k(rand([3, 4], 46), 5).is_none(), "k above the experts: refused");
    assert!(cube::top_k(rand([3, 4], 46), 0).is_none(), "k = 0: refused");
}

/// The gradient of `p`, zeros where autodiff has none (an expert that got no row).
fn grad_or_zeros<const D: usize>(
    p: &Tensor<B, D>,
    g: &<B as burn::tensor::backend::AutodiffBackend>::Gradients,
) -> Vec<f32> {
    match p.grad(g) {
        Some(x) => values(x),
        None => vec![0.0; p.shape().num_elements()],
    }
}

#[test]
#[cfg_attr(
    all(disagmoe_no_vulkan, not(feature = "cuda")),
    ignore = "no Vulkan driver on this machine (apt-get install mesa-vulkan-drivers)"
)]
fn swiglu_experts_match_the_per_expert_reference_with_gradients() {
    let _one = runtime_present("swiglu_experts_match_the_per_expert_reference_with_gradients");
    // Hidden and intermediate sizes that are not multiples of the 64-wide tiles; experts with no
    // row, one expert with every row, many row tiles for one expert.
    let (m, i) = (40, 72);
    for counts in [vec![0usize, 37, 0, 3, 1], vec![0, 0, 141], vec![5, 4, 3, 2, 1, 6, 7, 1]] {
        let n: usize = counts.iter().sum();
        let xs = rand([n, m], 40).require_grad();
        let experts: Vec<_> = (0..counts.len() as u64)
            .map(|e| {
                (
                    rand([i, m], 50 + e).mul_scalar(0.3).require_grad(),
                    rand([i, m], 70 + e).mul_scalar(0.3).require_grad(),
                    rand([m, i], 90 + e).mul_scalar(0.3).require_grad(),
                )
            })
            .collect();
        let probe = rand([n, m], 41);
        let got = cube::swiglu_experts(xs.clone(), &counts, &experts).unwrap();
        let gk = (got.clone() * probe.clone()).sum().backward();
        let want = reference::swiglu_experts(xs.clone(), &counts, &experts);
        let gr = (want.clone() * probe).sum().backward();
        assert_close(&format!("{counts:?} output"), &values(got.clone()), &values(want.clone()), 1e-4);
        assert_close("experts dxs", &values(xs.grad(&gk).unwrap()), &values(xs.grad(&gr).unwrap()), 1e-4);
        for (e, (g, u, d)) in experts.iter().enumerate() {
            for (name, p) in [("gate", g), ("up", u), ("down", d)] {
                assert_close(
                    &format!("{counts:?} expert {e} {name}"),
                    &grad_or_zeros(p, &gk),
                    &grad_or_zeros(p, &gr),
                    1e-4,
                );
            }
        }
    }
}

#[test]
#[cfg_attr(
    all(disagmoe_no_vulkan, not(feature = "cuda")),
    ignore = "no Vulkan driver on this machine (apt-get install mesa-vulkan-drivers)"
)]
fn gpt_oss_experts_match_the_reference_with_gradients() {
    let _one = runtime_present("gpt_oss_experts_match_the_reference_with_gradients");
    let (m, i, alpha, limit) = (24, 36, 1.702, 1.5);
    for counts in [vec![0usize, 70, 0, 5], vec![3, 1, 9, 2]] {
        let (e, n) = (counts.len(), counts.iter().sum::<usize>());
        let xs = rand([n, m], 60).require_grad();
        let gu = rand([e, m, 2 * i], 61).mul_scalar(0.4).require_grad();
        let gub = rand([e, 2 * i], 62).mul_scalar(0.4).require_grad();
        let dp = rand([e, i, m], 63).mul_scalar(0.4).require_grad();
        let dpb = rand([e, m], 64).mul_scalar(0.4).require_grad();
        let probe = rand([n, m], 65);
        let got =
            cube::gpt_oss_experts(xs.clone(), &counts, gu.clone(), gub.clone(), dp.clone(), dpb.clone(), alpha, limit)
                .unwrap();
        let gk = (got.clone() * probe.clone()).sum().backward();
        let want = reference::gpt_oss_experts(
            xs.clone(),
            &counts,
            gu.clone(),
            gub.clone(),
            dp.clone(),
            dpb.clone(),
            alpha,
            limit,
        );
        let gr = (want.clone() * probe).sum().backward();
        assert_close(&format!("{counts:?} output"), &values(got.clone()), &values(want.clone()), 1e-4);
        assert_close("dxs", &values(xs.grad(&gk).unwrap()), &values(xs.grad(&gr).unwrap()), 1e-4);
        assert_close("d gate_up", &grad_or_zeros(&gu, &gk), &grad_or_zeros(&gu, &gr), 1e-4);
        assert_close("d gate_up_bias", &grad_or_zeros(&gub, &gk), &grad_or_zeros(&gub, &gr), 1e-4);
        assert_close("d down", &grad_or_zeros(&dp, &gk), &grad_or_zeros(&dp, &gr), 1e-4);
        assert_close("d down_bias", &grad_or_zeros(&dpb, &gk), &grad_or_zeros(&dpb, &gr), 1e-4);
    }
}

#[test]
#[cfg_attr(
    all(any(disagmoe_no_vulkan, disagmoe_no_f16), not(feature = "cuda")),
    ignore = "no Vulkan driver with f16 on this machine (apt-get install mesa-vulkan-drivers vulkan-tools: vulkaninfo tells)"
)]
fn experts_in_half_precision_accumulate_in_f32() {
    let _one = runtime_present("experts_in_half_precision_accumulate_in_f32");
    f16_runtime("experts_in_half_precision_accumulate_in_f32");
    let (m, i, counts) = (40, 72, vec![0usize, 90, 7]);
    let n: usize = counts.iter().sum();
    let xs = rand([n, m], 1);
    let experts: Vec<_> = (0..3u64)
        .map(|e| {
            (
                rand([i, m], 10 + e).mul_scalar(0.3),
                rand([i, m], 20 + e).mul_scalar(0.3),
                rand([m, i], 30 + e).mul_scalar(0.3),
            )
        })
        .collect();
    // The f32 reference (plain Burn operations, not the kernel) from the same rounded inputs.
    let half = |t: &Tensor<B, 2>| t.clone().cast(FloatDType::F16).cast(FloatDType::F32);
    let halves: Vec<_> = experts.iter().map(|(g, u, d)| (half(g), half(u), half(d))).collect();
    let want = reference::swiglu_experts(half(&xs), &counts, &halves);
    let h16 = |t: &Tensor<B, 2>| t.clone().cast(FloatDType::F16);
    let e16: Vec<_> = experts.iter().map(|(g, u, d)| (h16(g), h16(u), h16(d))).collect();
    let got = cube::swiglu_experts(h16(&xs), &counts, &e16).unwrap();
    assert_eq!(got.dtype(), DType::F16);
    assert_close("f16 experts", &values(got), &values(want), F16_CHAINED_TOL);
}

#[test]
#[cfg_attr(
    all(disagmoe_no_vulkan, not(feature = "cuda")),
    ignore = "no Vulkan driver on this machine (apt-get install mesa-vulkan-drivers)"
)]
fn the_switches_turn_the_kernels_off() {
    let _one = runtime_present("the_switches_turn_the_kernels_off");
    let q = rand([1, 4, 2, 8], 1);
    disagmoe_kernels::set_enabled_for_thread(Some(false));
    assert!(cube::attention(q.clone(), q.clone(), q.clone(), None, 1.0, None, None).is_none());
    assert!(!disagmoe_kernels::fused::available::<B>());
    disagmoe_kernels::set_enabled_for_thread(None);
    assert!(disagmoe_kernels::fused::available::<B>());
    assert!(cube::attention(q.clone(), q.clone(), q, None, 1.0, None, None).is_some());
}

#[test]
#[cfg_attr(
    all(disagmoe_no_vulkan, not(feature = "cuda")),
    ignore = "no Vulkan driver on this machine (apt-get install mesa-vulkan-drivers)"
)]
fn the_products_are_chosen_by_measurement_and_either_way_gives_the_reference() {
    let _one = runtime_present("the_products_are_chosen_by_measurement_and_either_way_gives_the_reference");
    products_are_chosen_by_measurement(&[(disagmoe_kernels::precision::Precision::F32, "f32", 1e-4)], false);
}

#[test]
#[cfg_attr(
    all(any(disagmoe_no_vulkan, disagmoe_no_f16), not(feature = "cuda")),
    ignore = "no Vulkan driver with f16 on this machine (apt-get install mesa-vulkan-drivers vulkan-tools: vulkaninfo tells)"
)]
fn the_products_in_f16_are_chosen_by_measurement_and_either_way_give_the_reference() {
    let test = "the_products_in_f16_are_chosen_by_measurement_and_either_way_give_the_reference";
    let _one = runtime_present(test);
    f16_runtime(test);
    products_are_chosen_by_measurement(&[(disagmoe_kernels::precision::Precision::F16, "f16", F16_CHAINED_TOL)], true);
}

/// The expert products in each of `precisions` (and, with `attention`, flash attention in f16)
/// measured both ways, the faster chosen, both ways giving the reference, the measurements cached.
fn products_are_chosen_by_measurement(
    precisions: &[(disagmoe_kernels::precision::Precision, &str, f32)],
    attention: bool,
) {
    assert_eq!(cube::probe::forced(), None, "{} is set: this test measures", cube::probe::ENV);
    // A cache of our own (the only test here that goes through the probe): measured afresh, and
    // the measurement written there.
    let cache = std::env::temp_dir().join(format!("disagmoe-probe-test-{}", std::process::id()));
    std::env::set_var("DISAGMOE_CACHE_DIR", &cache);
    let (m, i, counts) = (48, 80, vec![9usize, 0, 30, 2]);
    let n: usize = counts.iter().sum();
    let xs = rand([n, m], 3);
    let experts: Vec<_> = (0..4u64)
        .map(|e| (rand([i, m], 5 + e).mul_scalar(0.3), rand([i, m], 9 + e).mul_scalar(0.3), rand([m, i], 13 + e)))
        .collect();
    for &(precision, name, tol) in precisions {
        disagmoe_kernels::precision::set_precision_for_thread(Some(precision));
        let want = reference::swiglu_experts(xs.clone(), &counts, &experts);
        let got = disagmoe_kernels::fused::swiglu_experts(xs.clone(), &counts, &experts);
        // The class of this layer was measured once, both ways, and the faster one chosen.
        let measured = cube::probe::measured();
        let m_class = measured
            .iter()
            .find(|r| r.class.contains("SwiGLU experts") && r.class.contains(&format!(", {name}, width {m},")))
            .unwrap_or_else(|| panic!("no measurement for {name}: {measured:?}"));
        eprintln!("{m_class:?}");
        assert!(m_class.grouped_s > 0.0 && m_class.matmul_s > 0.0, "{m_class:?}");
        let faster = if m_class.grouped_s <= m_class.matmul_s {
            cube::probe::ExpertProducts::Grouped
        } else {
            cube::probe::ExpertProducts::Matmul
        };
        assert_eq!(m_class.chosen, faster);
        // Ours when chosen (in f32 out of the low precision's products), else `None`: the caller's
        // reference composition, CubeCL's matmul expert by expert.
        match (m_class.chosen, got) {
            (cube::probe::ExpertProducts::Grouped, Some(got)) => {
                assert_eq!(got.dtype(), DType::F32);
                assert_close(&format!("{name} chosen grouped kernels"), &values(got), &values(want.clone()), tol);
            }
            (cube::probe::ExpertProducts::Matmul, None) => {}
            (chosen, got) => panic!("{name}: chose {chosen:?} but the kernels returned {:?}", got.map(|t| t.dims())),
        }
        // Each way on purpose: ours (out in f32 whatever the product dtype), or none.
        cube::probe::force_for_thread(Some(cube::probe::ExpertProducts::Grouped));
        let ours = disagmoe_kernels::fused::swiglu_experts(xs.clone(), &counts, &experts).expect("our kernels apply");
        assert_eq!(ours.dtype(), DType::F32);
        assert_close(&format!("{name} grouped kernels"), &values(ours), &values(want.clone()), tol);
        cube::probe::force_for_thread(Some(cube::probe::ExpertProducts::Matmul));
        assert!(disagmoe_kernels::fused::swiglu_experts(xs.clone(), &counts, &experts).is_none());
        cube::probe::force_for_thread(None);
        // Measured once: the same class again is not measured again.
        let again = disagmoe_kernels::fused::swiglu_experts(xs.clone(), &counts, &experts);
        assert_eq!(again.is_some(), m_class.chosen == cube::probe::ExpertProducts::Grouped);
        assert_eq!(cube::probe::measured().len(), measured.len());
        assert!(!m_class.cached, "measured by this process");
    }
    // Attention under a low precision: the flash kernel on f16 operands (f32 out) or the
    // composition, chosen the same way.
    if attention {
        let (b, s, h, g, d) = (1, 70, 4, 2, 16);
        let (q, k, v) = (rand([b, s, h, d], 51), rand([b, s, g, d], 52), rand([b, s, g, d], 53));
        let sinks = Some(rand([h], 54));
        let attend =
            || disagmoe_kernels::fused::attention(q.clone(), k.clone(), v.clone(), sinks.clone(), 0.25, Some(9), None);
        let want = reference::attention(q.clone(), k.clone(), v.clone(), sinks.clone(), 0.25, Some(9), None);
        disagmoe_kernels::precision::set_precision_for_thread(Some(disagmoe_kernels::precision::Precision::F16));
        let got = attend();
        let measured = cube::probe::measured();
        let a_class = measured
            .iter()
            .find(|r| r.class.starts_with("attention") && r.class.contains(", f16, 4 heads of 16,"))
            .unwrap_or_else(|| panic!("no attention measurement: {measured:?}"));
        eprintln!("{a_class:?}");
        let faster = if a_class.grouped_s <= a_class.matmul_s {
            cube::probe::ExpertProducts::Grouped
        } else {
            cube::probe::ExpertProducts::Matmul
        };
        assert_eq!(a_class.chosen, faster);
        assert_eq!(got.is_some(), a_class.chosen == cube::probe::ExpertProducts::Grouped);
        cube::probe::force_for_thread(Some(cube::probe::ExpertProducts::Grouped));
        let ours = attend().expect("the kernel applies");
        assert_eq!(ours.dtype(), DType::F32);
        // q, k, v and the sinks rounded to f16, everything after in f32 (measured 6.3e-4).
        assert_close("f16 flash attention against f32", &values(ours), &values(want), 2.0 * F16_EPS);
        cube::probe::force_for_thread(Some(cube::probe::ExpertProducts::Matmul));
        assert!(attend().is_none(), "the composition: the caller's reference");
        cube::probe::force_for_thread(None);
        assert_eq!(cube::probe::measured().len(), measured.len(), "measured once");
    }
    disagmoe_kernels::precision::set_precision_for_thread(None);
    // Kept for the next process: one line per class this call measured (the cache directory is
    // this process's; another test's classes may be there too).
    let lines = std::fs::read_to_string(cube::probe::cache_file().unwrap()).unwrap();
    let ours = cube::probe::measured().into_iter().filter(|m| {
        precisions.iter().any(|(_, name, _)| m.class.contains(&format!(", {name}, ")))
            && (attention || !m.class.starts_with("attention"))
    });
    let mut count = 0;
    for m in ours {
        count += 1;
        let saved = lines.lines().filter(|l| l.rsplit('\t').next() == Some(m.class.as_str())).count();
        assert_eq!(saved, 1, "{}: {lines}", m.class);
    }
    assert!(count >= precisions.len(), "every precision's expert class was measured: {lines}");
    let _ = std::fs::remove_dir_all(cache);
}
