//! Each fused CPU operation against a reference written in plain Burn operations: outputs and the
//! gradients of every input, on awkward shapes (sequence not a multiple of the 64-row tile,
//! grouped-query ratios 1/2/4, windows shorter and longer than the sequence, value dim != key
//! dim, strided inputs, rows of odd width), plus AdamW against its closed form and the switches
//! that turn the fused path off.
//!
//! Each path runs its backward before the other's forward, and the tests run one at a time
//! ([`serial`]): a graph can lose its leaves when another test thread runs a backward meanwhile
//! (Burn 0.21's autodiff cleanup; the attention test failed about one run in 13 when they ran
//! side by side). The workspace now patches that sweep (`vendor/burn-autodiff`); the tests stay
//! serial, which costs little.
#![cfg(feature = "flex")]

use burn::backend::{Autodiff, Flex};
use burn::tensor::activation::{log_softmax, silu};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Int, Tensor, TensorData};
use disagmoe_kernels::cpu;
use disagmoe_kernels::documents::Documents;

type B = Autodiff<Flex>;

/// Holds the other tests of this file off while one runs (see the module doc).
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn values<const D: usize>(t: Tensor<impl Backend, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec::<f32>().unwrap()
}

#[track_caller]
fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let worst = got.iter().zip(want).map(|(a, b)| (a - b).abs() / (1.0 + b.abs())).fold(0f32, f32::max);
    assert!(worst <= tol, "{what}: worst relative difference {worst:e} > {tol:e}");
}

fn rand<const D: usize>(shape: [usize; D], seed: u64) -> Tensor<B, D> {
    let device = Default::default();
    <B as Backend>::seed(&device, seed);
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), &device)
}

#[test]
fn attention_matches_the_reference_with_gradients() {
    let _serial = serial();
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
        // k arrives as a strided view (as after a transpose), v contiguous.
        let k_base = rand([b, g, s, d], seed + 1).require_grad();
        // One view per path: a backward pass consumes the graph nodes it walks.
        let k = || k_base.clone().swap_dims(1, 2);
        let v = rand([b, s, g, e], seed + 2).require_grad();
        let sinks = rand([h], seed + 4).require_grad();
        let sinks_arg = || with_sinks.then(|| sinks.clone());
        let probe = rand([b, s, h, e], seed + 3);
        let scale = 0.37;
        let fused = cpu::attention(q.clone(), k(), v.clone(), sinks_arg(), scale, window, None)
            .expect("applies to Autodiff<Flex>");
        let gf = (fused.clone() * probe.clone()).sum().backward();
        let reference =
            disagmoe_kernels::reference::attention(q.clone(), k(), v.clone(), sinks_arg(), scale, window, None);
        let gr = (reference.clone() * probe).sum().backward();
        let what = format!("case {i} {:?}", cases[i]);
        assert_close(&format!("{what} output"), &values(fused.clone()), &values(reference.clone()), 2e-5);
        assert_close(&format!("{what} dq"), &values(q.grad(&gf).unwrap()), &values(q.grad(&gr).unwrap()), 5e-5);
        assert_close(
            &format!("{what} dk"),
            &values(k_base.grad(&gf).unwrap()),
            &values(k_base.grad(&gr).unwrap()),
            5e-5,
        );
        assert_close(&format!("{what} dv"), &values(v.grad(&gf).unwrap()), &values(v.grad(&gr).unwrap()), 5e-5);
        if with_sinks {
            let (a, r) = (sinks.grad(&gf).unwrap(), sinks.grad(&gr).unwrap());
            assert_close(&format!("{what} dsinks"), &values(a), &values(r), 5e-5);
        } else {
            assert!(sinks.grad(&gf).is_none());
        }
    }
}

/// Attention within documents computed the independent way: each document of each row alone
/// (plain causal attention over its own slice), put back in place.
fn each_document_alone(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    sinks: Option<Tensor<B, 1>>,
    scale: f64,
    window: Option<usize>,
    docs: &Documents,
) -> Tensor<B, 4> {
    let s = docs.seq();
    let rows = (0..docs.batch())
        .map(|b| {
            let edges: Vec<usize> = std::iter::once(0).chain(docs.cuts(b)).chain(std::iter::once(s)).collect();
            let parts = edges
                .windows(2)
                .map(|w| {
                    let part = |x: &Tensor<B, 4>| x.clone().narrow(0, b, 1).narrow(1, w[0], w[1] - w[0]);
                    disagmoe_kernels::reference::attention(
                        part(&q),
                        part(&k),
                        part(&v),
                        sinks.clone(),
                        scale,
                        window,
                        None,
                    )
                })
                .collect();
            Tensor::cat(parts, 1)
        })
        .collect();
    Tensor::cat(rows, 0)
}

#[test]
fn attention_within_documents_matches_each_document_alone_with_gradients() {
    let _serial = serial();
    // (batch, seq, heads, kv heads, qk dim, v dim, window, sinks, each row's document cuts):
    // documents shorter and longer than the 64-row tile, cuts on and off its edges, a one-token
    // document, a row of one document, windows shorter than a document.
    let cases: [(usize, usize, usize, usize, usize, usize, Option<usize>, bool, Vec<Vec<usize>>); 6] = [
        (2, 70, 4, 2, 8, 8, None, false, vec![vec![5, 6, 40], vec![]]),
        (1, 137, 4, 4, 6, 10, None, false, vec![vec![64, 65, 128]]),
        (2, 70, 8, 2, 8, 8, Some(5), true, vec![vec![3, 33], vec![69]]),
        (1, 131, 4, 1, 16, 12, Some(40), false, vec![vec![1, 70, 100]]),
        (1, 67, 8, 2, 6, 6, Some(3), true, vec![vec![10, 11, 12, 50]]),
        (3, 33, 2, 1, 4, 4, None, true, vec![vec![16], vec![1, 2, 3], vec![32]]),
    ];
    for (i, (b, s, h, g, d, e, window, with_sinks, cuts)) in cases.iter().cloned().enumerate() {
        let docs = Documents::new(s, &cuts).unwrap();
        let seed = 100 + 10 * i as u64;
        let q = rand([b, s, h, d], seed).require_grad();
        let k = rand([b, s, g, d], seed + 1).require_grad();
        let v = rand([b, s, g, e], seed + 2).require_grad();
        let sinks = rand([h], seed + 4).require_grad();
        let sinks_arg = || with_sinks.then(|| sinks.clone());
        let probe = rand([b, s, h, e], seed + 3);
        let scale = 0.37;
        let what = format!(
            "case {i} (b {b}, s {s}, h {h}/{g}, d {d}/{e}, window {window:?}, sinks {with_sinks}, cuts {cuts:?})"
        );
        let alone = each_document_alone(q.clone(), k.clone(), v.clone(), sinks_arg(), scale, window, &docs);
        let ga = (alone.clone() * probe.clone()).sum().backward();
        let fused = cpu::attention(q.clone(), k.clone(), v.clone(), sinks_arg(), scale, window, Some(&docs))
            .expect("applies to Autodiff<Flex>");
        let gf = (fused.clone() * probe.clone()).sum().backward();
        let masked = disagmoe_kernels::reference::attention(
            q.clone(),
            k.clone(),
            v.clone(),
            sinks_arg(),
            scale,
            window,
            Some(&docs),
        );
        let gm = (masked.clone() * probe).sum().backward();
        for (path, out, grads) in [("fused", &fused, &gf), ("masked reference", &masked, &gm)] {
            assert_close(&format!("{what} {path} output"), &values(out.clone()), &values(alone.clone()), 2e-5);
            for (name, x) in [("dq", &q), ("dk", &k), ("dv", &v)] {
                let (got, want) = (x.grad(grads).unwrap(), x.grad(&ga).unwrap());
                assert_close(&format!("{what} {path} {name}"), &values(got), &values(want), 5e-5);
            }
            if with_sinks {
                let (got, want) = (sinks.grad(grads).unwrap(), sinks.grad(&ga).unwrap());
                assert_close(&format!("{what} {path} dsinks"), &values(got), &values(want), 5e-5);
            }
        }
    }
    // A mask of whole rows is no mask.
    let (q, k) = (rand([2, 9, 2, 4], 1), rand([2, 9, 1, 4], 2));
    let whole = Documents::whole(2, 9);
    let with = cpu::attention(q.clone(), k.clone(), k.clone(), None, 0.5, None, Some(&whole)).unwrap();
    let without = cpu::attention(q.clone(), k.clone(), k.clone(), None, 0.5, None, None).unwrap();
    assert_eq!(values(with), values(without));
    // A mask of another shape is refused (the caller falls back to the reference, which panics
    // on it: a bug, not input).
    assert!(cpu::attention(q, k.clone(), k, None, 0.5, None, Some(&Documents::whole(2, 8))).is_none());
}

#[test]
fn attention_refuses_what_it_does_not_handle() {
    let _serial = serial();
    let q = rand([1, 4, 3, 8], 1);
    let k = rand([1, 4, 2, 8], 2); // 3 heads over 2 kv heads
    assert!(cpu::attention(q.clone(), k.clone(), k.clone(), None, 1.0, None, None).is_none());
    let k = rand([1, 4, 1, 8], 2);
    assert!(cpu::attention(q.clone(), k.clone(), k.clone(), None, 1.0, Some(0), None).is_none());
    assert!(
        cpu::attention(q, k.clone(), k, Some(rand([2], 3)), 1.0, None, None).is_none(),
        "sinks of the wrong length"
    );
}

#[test]
fn rms_norm_matches_the_reference_with_gradients() {
    let _serial = serial();
    for (shape, eps) in [([3, 5, 37], 1e-6), ([2, 1, 8], 1e-2)] {
        let x = rand(shape, 4).require_grad();
        let w = rand([shape[2]], 5).require_grad();
        let probe = rand(shape, 6);
        let fused = cpu::rms_norm(x.clone(), w.clone(), eps).unwrap();
        let gf = (fused.clone() * probe.clone()).sum().backward();
        let inv = x.clone().square().mean_dim(2).add_scalar(eps).sqrt().recip();
        let reference = x.clone() * inv * w.clone().unsqueeze::<3>();
        let gr = (reference.clone() * probe).sum().backward();
        assert_close("rms output", &values(fused.clone()), &values(reference.clone()), 1e-5);
        assert_close("rms dx", &values(x.grad(&gf).unwrap()), &values(x.grad(&gr).unwrap()), 2e-5);
        assert_close("rms dw", &values(w.grad(&gf).unwrap()), &values(w.grad(&gr).unwrap()), 2e-5);
    }
}

#[test]
fn swiglu_matches_the_reference_with_gradients() {
    let _serial = serial();
    let g = rand([67, 33], 7).mul_scalar(4.0).require_grad(); // wide range: both sigmoid tails
    let u = rand([67, 33], 8).require_grad();
    let probe = rand([67, 33], 9);
    let fused = cpu::swiglu(g.clone(), u.clone()).unwrap();
    let gf = (fused.clone() * probe.clone()).sum().backward();
    let reference = silu(g.clone()) * u.clone();
    let gr = (reference.clone() * probe).sum().backward();
    assert_close("swiglu output", &values(fused.clone()), &values(reference.clone()), 1e-6);
    assert_close("swiglu dg", &values(g.grad(&gf).unwrap()), &values(g.grad(&gr).unwrap()), 1e-5);
    assert_close("swiglu du", &values(u.grad(&gf).unwrap()), &values(u.grad(&gr).unwrap()), 1e-5);
}

#[test]
fn rope_matches_the_reference_with_gradients() {
    let _serial = serial();
    let (b, s, h, d) = (2, 9, 3, 8);
    let x = rand([b, s, h, d], 10).require_grad();
    let cos = rand([1, 1, s, d], 11);
    let sin = rand([1, 1, s, d], 12);
    let probe = rand([b, s, h, d], 13);
    let fused = cpu::rope(x.clone(), cos.clone(), sin.clone()).unwrap();
    let gf = (fused.clone() * probe.clone()).sum().backward();
    // Reference in [B, H, S, D]: x * cos + rotate_half(x) * sin.
    let xt = x.clone().swap_dims(1, 2);
    let x1 = xt.clone().narrow(3, 0, d / 2);
    let x2 = xt.clone().narrow(3, d / 2, d / 2);
    let reference = (xt * cos + Tensor::cat(vec![x2.neg(), x1], 3) * sin).swap_dims(1, 2);
    let gr = (reference.clone() * probe).sum().backward();
    assert_close("rope output", &values(fused.clone()), &values(reference.clone()), 1e-6);
    assert_close("rope dx", &values(x.grad(&gf).unwrap()), &values(x.grad(&gr).unwrap()), 1e-6);
}

#[test]
fn cross_entropy_matches_the_reference_with_gradients() {
    let _serial = serial();
    let (b, s, v) = (2, 7, 50);
    let logits = rand([b, s, v], 14).mul_scalar(3.0).require_grad();
    let labels: Vec<usize> = (0..b * (s - 1)).map(|i| (i * 17 + 3) % v).collect();
    let ids = Tensor::<B, 2, Int>::from_data(
        TensorData::new(labels.iter().map(|&l| l as i64).collect::<Vec<_>>(), [b, s - 1]),
        &Default::default(),
    );
    let fused = cpu::next_token_cross_entropy(logits.clone(), &labels, None).unwrap();
    let gf = fused.clone().mul_scalar(2.5).backward();
    let n = b * (s - 1);
    let logp = log_softmax(logits.clone().narrow(1, 0, s - 1).reshape([n, v]), 1);
    let reference = logp.gather(1, ids.reshape([n, 1])).mean().neg();
    let gr = reference.clone().mul_scalar(2.5).backward();
    assert_close("ce loss", &values(fused.clone()), &values(reference.clone()), 1e-6);
    // A scaled loss checks that the incoming gradient is applied.
    assert_close("ce dlogits", &values(logits.grad(&gf).unwrap()), &values(logits.grad(&gr).unwrap()), 1e-6);
    assert!(cpu::next_token_cross_entropy(logits.clone(), &labels[1..], None).is_none(), "wrong label count");
    let mut bad = labels.clone();
    bad[0] = v;
    assert!(cpu::next_token_cross_entropy(logits.clone(), &bad, None).is_none(), "label outside the vocabulary");

    // Ignored targets (a document mask's): the mean is over the others, their logits get no
    // gradient; a mask of the wrong length is refused; nothing counted is a zero loss.
    let ignore: Vec<bool> = (0..n).map(|i| i % 3 == 1 || i == 4).collect();
    let fused = cpu::next_token_cross_entropy(logits.clone(), &labels, Some(&ignore)).unwrap();
    let gf = fused.clone().mul_scalar(2.5).backward();
    let keep: Vec<f32> = ignore.iter().map(|&i| if i { 0.0 } else { 1.0 }).collect();
    let kept = keep.iter().sum::<f32>() as f64;
    let keep = Tensor::<B, 2>::from_data(TensorData::new(keep, [n, 1]), &Default::default());
    let ids = Tensor::<B, 2, Int>::from_data(
        TensorData::new(labels.iter().map(|&l| l as i64).collect::<Vec<_>>(), [n, 1]),
        &Default::default(),
    );
    let logp = log_softmax(logits.clone().narrow(1, 0, s - 1).reshape([n, v]), 1);
    let reference = (logp.gather(1, ids) * keep).sum().div_scalar(kept).neg();
    let gr = reference.clone().mul_scalar(2.5).backward();
    assert_close("masked ce loss", &values(fused), &values(reference), 1e-6);
    assert_close("masked ce dlogits", &values(logits.grad(&gf).unwrap()), &values(logits.grad(&gr).unwrap()), 1e-6);
    assert!(cpu::next_token_cross_entropy(logits.clone(), &labels, Some(&ignore[1..])).is_none(), "mask length");
    let all = cpu::next_token_cross_entropy(logits.clone(), &labels, Some(&vec![true; n])).unwrap();
    let g = all.clone().backward();
    assert_eq!(values(all), [0.0]);
    assert!(values(logits.grad(&g).unwrap()).iter().all(|&x| x == 0.0), "no gradient where nothing counts");
}

#[test]
fn linear_matches_the_reference_with_gradients() {
    let _serial = serial();
    for (rows, d_in, d_out) in [(13, 37, 29), (1, 5, 3), (300, 64, 96)] {
        let x = rand([rows, d_in], 15).require_grad();
        let w = rand([d_out, d_in], 16).require_grad();
        let probe = rand([rows, d_out], 17);
        let fused = cpu::linear(x.clone(), w.clone()).unwrap();
        let gf = (fused.clone() * probe.clone()).sum().backward();
        let reference = x.clone().matmul(w.clone().transpose());
        let gr = (reference.clone() * probe).sum().backward();
        assert_close("linear output", &values(fused.clone()), &values(reference.clone()), 1e-5);
        assert_close("linear dx", &values(x.grad(&gf).unwrap()), &values(x.grad(&gr).unwrap()), 1e-5);
        assert_close("linear dw", &values(w.grad(&gf).unwrap()), &values(w.grad(&gr).unwrap()), 1e-5);
    }
    // An input that needs no gradient gets none.
    let x = rand([4, 6], 18);
    let w = rand([3, 6], 19).require_grad();
    let g = cpu::linear(x.clone(), w.clone()).unwrap().sum().backward();
    assert!(x.grad(&g).is_none());
    assert!(w.grad(&g).is_some());
}

#[test]
fn adamw_matches_its_closed_form_with_a_transposed_gradient() {
    let _serial = serial();
    let (rows, cols) = (7, 5);
    let device = Default::default();
    let p0: Vec<f32> = (0..rows * cols).map(|i| (i as f32 * 0.37).sin()).collect();
    let g_t: Vec<f32> = (0..rows * cols).map(|i| (i as f32 * 0.11).cos()).collect(); // [cols, rows]
    let m0: Vec<f32> = (0..rows * cols).map(|i| 0.01 * i as f32).collect();
    let v0: Vec<f32> = (0..rows * cols).map(|i| 0.001 * i as f32).collect();
    let s = cpu::AdamWScalars {
        grad_scale: 0.5,
        beta1: 0.9,
        one_minus_beta1: 0.1,
        beta2: 0.95,
        one_minus_beta2: 0.05,
        bc1: 1.0 - 0.9f32.powi(3),
        bc2: 1.0 - 0.95f32.powi(3),
        eps: 1e-8,
        lr: 0.01,
        decay: 1.0 - 0.01 * 0.1,
    };
    let p = Tensor::<Flex, 2>::from_data(TensorData::new(p0.clone(), [rows, cols]), &device);
    let g = Tensor::<Flex, 2>::from_data(TensorData::new(g_t.clone(), [cols, rows]), &device).transpose();
    let m = Tensor::<Flex, 1>::from_data(TensorData::new(m0.clone(), [rows * cols]), &device);
    let v = Tensor::<Flex, 1>::from_data(TensorData::new(v0.clone(), [rows * cols]), &device);
    let (p1, m1, v1) = cpu::adamw(p, g, Some((m, v)), s).unwrap();
    let (mut pw, mut mw, mut vw) = (vec![0f32; rows * cols], vec![0f32; rows * cols], vec![0f32; rows * cols]);
    for r in 0..rows {
        for c in 0..cols {
            let i = r * cols + c;
            let g = g_t[c * rows + r] * s.grad_scale;
            mw[i] = m0[i] * s.beta1 + g * s.one_minus_beta1;
            vw[i] = v0[i] * s.beta2 + g * g * s.one_minus_beta2;
            pw[i] = p0[i] * s.decay - (mw[i] / s.bc1) / ((vw[i] / s.bc2).sqrt() + s.eps) * s.lr;
        }
    }
    assert_close("adamw p", &values(p1), &pw, 1e-6);
    assert_close("adamw m", &values(m1), &mw, 1e-6);
    assert_close("adamw v", &values(v1), &vw, 1e-6);
    // Fresh moments start at zero; the autodiff backend is not the optimizer's and is refused.
    let p = Tensor::<Flex, 1>::from_data(TensorData::new(vec![1.0f32, 2.0], [2]), &device);
    let g = Tensor::<Flex, 1>::from_data(TensorData::new(vec![0.5f32, -0.5], [2]), &device);
    let (_, m, _) = cpu::adamw(p, g, None, s).unwrap();
    assert_close("fresh m", &values(m), &[0.025, -0.025], 1e-6);
    let pa = rand([2], 1);
    assert!(cpu::adamw(pa.clone(), pa, None, s).is_none());
}

#[test]
fn sum_squares_reads_strided_views() {
    let _serial = serial();
    let device = Default::default();
    let x =
        Tensor::<Flex, 2>::from_data(TensorData::new((0..12).map(|i| i as f32).collect::<Vec<_>>(), [3, 4]), &device);
    let want: f64 = (0..12).map(|i| (i * i) as f64).sum();
    assert_eq!(cpu::sum_squares(&x), Some(want));
    assert_eq!(cpu::sum_squares(&x.clone().transpose()), Some(want));
    assert_eq!(
        cpu::sum_squares(&x.narrow(1, 1, 2)),
        Some((1..12).filter(|i| i % 4 == 1 || i % 4 == 2).map(|i| (i * i) as f64).sum())
    );
}

#[test]
fn the_switches_turn_the_fused_path_off() {
    let _serial = serial();
    let x = rand([2, 4], 20);
    let w = rand([3, 4], 21);
    assert!(cpu::linear(x.clone(), w.clone()).is_some());
    cpu::set_enabled_for_thread(Some(false));
    assert!(cpu::linear(x.clone(), w.clone()).is_none());
    assert!(!disagmoe_kernels::fused::available::<B>());
    cpu::set_enabled_for_thread(None);
    assert!(disagmoe_kernels::fused::available::<B>());
}

#[test]
fn token_permute_and_combine_match_the_reference_with_gradients() {
    let _serial = serial();
    // 5 tokens, k = 2, 3 experts: expert 1 gets nothing, expert 2 gets five copies.
    let (t, k, m) = (5, 2, 7);
    let ids = [0usize, 2, 2, 0, 2, 0, 2, 0, 0, 2];
    let mut order: Vec<usize> = (0..t * k).collect();
    order.sort_by_key(|&s| ids[s]); // stable: a counting sort by expert
    let slots = order;
    let x = rand([t, m], 30).require_grad();
    let w = rand([t, k], 31).require_grad();
    let tokens = Tensor::<B, 1, Int>::from_data(
        TensorData::new(slots.iter().map(|&s| (s / k) as i64).collect::<Vec<_>>(), [t * k]),
        &Default::default(),
    );
    let probe = rand([t * k, m], 32);
    let fused = cpu::permute_rows(x.clone(), &slots, k, &ids, false).unwrap();
    let gf = (fused.clone() * probe.clone()).sum().backward();
    let reference = x.clone().select(0, tokens.clone());
    let gr = (reference.clone() * probe).sum().backward();
    assert_close("permute output", &values(fused.clone()), &values(reference.clone()), 0.0);
    assert_close("permute dx", &values(x.grad(&gf).unwrap()), &values(x.grad(&gr).unwrap()), 1e-6);

    let ys = rand([t * k, m], 33).require_grad();
    let probe = rand([t, m], 34);
    let fused = cpu::combine_rows(ys.clone(), w.clone(), &slots, &ids, None).unwrap();
    let gf = (fused.clone() * probe.clone()).sum().backward();
    let slot_idx = Tensor::<B, 1, Int>::from_data(
        TensorData::new(slots.iter().map(|&s| s as i64).collect::<Vec<_>>(), [t * k]),
        &Default::default(),
    );
    let wr = w.clone().reshape([t * k]).select(0, slot_idx).reshape([t * k, 1]);
    let reference = Tensor::<B, 2>::zeros([t, m], &Default::default()).select_assign(
        0,
        tokens,
        ys.clone() * wr,
        burn::tensor::IndexingUpdateOp::Add,
    );
    let gr = (reference.clone() * probe).sum().backward();
    assert_close("combine output", &values(fused.clone()), &values(reference.clone()), 1e-6);
    assert_close("combine dys", &values(ys.grad(&gf).unwrap()), &values(ys.grad(&gr).unwrap()), 1e-6);
    assert_close("combine dw", &values(w.grad(&gf).unwrap()), &values(w.grad(&gr).unwrap()), 1e-5);

    // One holder's copies (expert 2's) and a base (shared experts) added: the reference plus the
    // base; the other copies' gates get no gradient.
    let mine: Vec<usize> = slots.iter().copied().filter(|&s| ids[s] == 2).collect();
    let n = mine.len();
    let fused = cpu::permute_rows(x.clone(), &mine, k, &ids, false).unwrap();
    let gf = (fused.clone() * rand([n, m], 35)).sum().backward();
    let reference = disagmoe_kernels::reference::permute_rows(x.clone(), &mine, k);
    let gr = (reference.clone() * rand([n, m], 35)).sum().backward();
    assert_close("holder permute output", &values(fused), &values(reference), 0.0);
    assert_close("holder permute dx", &values(x.grad(&gf).unwrap()), &values(x.grad(&gr).unwrap()), 1e-6);
    // With the shared experts' input behind the copies: `x` itself, its gradient joins the sum.
    let fused = cpu::permute_rows(x.clone(), &mine, k, &ids, true).unwrap();
    let probe = rand([n + t, m], 39);
    let gf = (fused.clone() * probe.clone()).sum().backward();
    let reference = Tensor::cat(vec![disagmoe_kernels::reference::permute_rows(x.clone(), &mine, k), x.clone()], 0);
    let gr = (reference.clone() * probe).sum().backward();
    assert_close("permute with base output", &values(fused), &values(reference), 0.0);
    assert_close("permute with base dx", &values(x.grad(&gf).unwrap()), &values(x.grad(&gr).unwrap()), 1e-6);
    let ys = rand([n, m], 36).require_grad();
    let base = rand([t, m], 37).require_grad();
    let probe = rand([t, m], 38);
    let fused = cpu::combine_rows(ys.clone(), w.clone(), &mine, &ids, Some(base.clone())).unwrap();
    let gf = (fused.clone() * probe.clone()).sum().backward();
    let reference = disagmoe_kernels::reference::combine_rows(ys.clone(), w.clone(), &mine) + base.clone();
    let gr = (reference.clone() * probe).sum().backward();
    assert_close("holder combine output", &values(fused), &values(reference), 1e-6);
    assert_close("holder combine dys", &values(ys.grad(&gf).unwrap()), &values(ys.grad(&gr).unwrap()), 1e-6);
    assert_close("holder combine dbase", &values(base.grad(&gf).unwrap()), &values(base.grad(&gr).unwrap()), 0.0);
    let (dw_f, dw_r) = (values(w.grad(&gf).unwrap()), values(w.grad(&gr).unwrap()));
    assert_close("holder combine dw", &dw_f, &dw_r, 1e-5);
    assert!(ids.iter().zip(&dw_f).all(|(&e, &d)| e == 2 || d == 0.0), "other holders' gates: {dw_f:?}");

    // A copy listed twice, or experts that do not name every copy: refused.
    let mut bad = slots.clone();
    bad[0] = bad[1];
    assert!(cpu::permute_rows(x.clone(), &bad, k, &ids, false).is_none());
    assert!(cpu::permute_rows(x, &slots, k, &ids[1..], false).is_none());
}

#[test]
fn grouped_experts_match_the_per_expert_reference_with_gradients() {
    let _serial = serial();
    let (m, i) = (12, 10);
    // Experts that get no row, one that gets most, rows not a multiple of any tile; enough
    // experts for the side-by-side path and few for the one-after-another path.
    for counts in [vec![0usize, 37, 0, 3, 1], vec![0, 0, 41], vec![5, 4, 3, 2, 1, 6, 7, 1]] {
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
        let fused = cpu::swiglu_experts(xs.clone(), &counts, &experts).unwrap();
        let gf = (fused.clone() * probe.clone()).sum().backward();
        let mut outs = Vec::new();
        let mut start = 0;
        for (e, &c) in counts.iter().enumerate() {
            if c > 0 {
                let x = xs.clone().narrow(0, start, c);
                let (g, u, d) = &experts[e];
                let h = silu(x.clone().matmul(g.clone().transpose())) * x.matmul(u.clone().transpose());
                outs.push(h.matmul(d.clone().transpose()));
            }
            start += c;
        }
        let reference = Tensor::cat(outs, 0);
        let gr = (reference.clone() * probe).sum().backward();
        assert_close(&format!("{counts:?} output"), &values(fused.clone()), &values(reference.clone()), 1e-5);
        assert_close("experts dxs", &values(xs.grad(&gf).unwrap()), &values(xs.grad(&gr).unwrap()), 2e-5);
        for (e, (g, u, d)) in experts.iter().enumerate() {
            for (name, p) in [("gate", g), ("up", u), ("down", d)] {
                match (p.grad(&gf), p.grad(&gr)) {
                    (Some(a), Some(b)) => assert_close(&format!("expert {e} {name}"), &values(a), &values(b), 2e-5),
                    (None, None) => assert_eq!(counts[e], 0, "expert {e} with rows got no gradient"),
                    (a, b) => panic!("expert {e} {name}: fused {} vs reference {}", a.is_some(), b.is_some()),
                }
            }
        }
    }
}

#[test]
fn gpt_oss_experts_match_the_per_expert_reference_with_gradients() {
    let _serial = serial();
    // A small clamp limit, so that gates above it and ups on both sides of it occur; experts
    // without rows; few experts with rows (one after another) and many (side by side).
    let (m, i, alpha, limit) = (24, 18, 1.702, 1.5);
    for counts in [vec![0usize, 70, 0, 5], vec![3, 1, 9, 2, 0, 4, 6, 1]] {
        let (e, n) = (counts.len(), counts.iter().sum::<usize>());
        let xs = rand([n, m], 60).require_grad();
        let gu = rand([e, m, 2 * i], 61).mul_scalar(0.4).require_grad();
        let gub = rand([e, 2 * i], 62).mul_scalar(0.4).require_grad();
        let dp = rand([e, i, m], 63).mul_scalar(0.4).require_grad();
        let dpb = rand([e, m], 64).mul_scalar(0.4).require_grad();
        let probe = rand([n, m], 65);
        let fused =
            cpu::gpt_oss_experts(xs.clone(), &counts, gu.clone(), gub.clone(), dp.clone(), dpb.clone(), alpha, limit)
                .unwrap();
        let gf = (fused.clone() * probe.clone()).sum().backward();
        let reference = disagmoe_kernels::reference::gpt_oss_experts(
            xs.clone(),
            &counts,
            gu.clone(),
            gub.clone(),
            dp.clone(),
            dpb.clone(),
            alpha,
            limit,
        );
        let gr = (reference.clone() * probe).sum().backward();
        // The clamps bite: some pre-activations lie beyond the limit.
        let pre =
            values(xs.clone().narrow(0, 0, counts[0].max(1)).matmul(gu.clone().narrow(0, 0, 1).reshape([m, 2 * i])));
        assert!(pre.iter().any(|v| v.abs() > limit as f32), "{counts:?}: no value beyond the clamp");
        assert_close(&format!("{counts:?} output"), &values(fused.clone()), &values(reference.clone()), 1e-5);
        assert_close("dxs", &values(xs.grad(&gf).unwrap()), &values(xs.grad(&gr).unwrap()), 2e-5);
        for (name, p) in [("gate_up", &gu), ("down", &dp)] {
            assert_close(
                &format!("{counts:?} d {name}"),
                &values(p.grad(&gf).unwrap()),
                &values(p.grad(&gr).unwrap()),
                2e-5,
            );
        }
        for (name, p) in [("gate_up_bias", &gub), ("down_bias", &dpb)] {
            assert_close(
                &format!("{counts:?} d {name}"),
                &values(p.grad(&gf).unwrap()),
                &values(p.grad(&gr).unwrap()),
                2e-5,
            );
        }
    }
    // Shapes it does not handle go to the reference.
    let xs = rand([3, 24], 1);
    let (gu, gub, dp, dpb) = (rand([2, 24, 36], 2), rand([2, 36], 3), rand([2, 18, 24], 4), rand([2, 24], 5));
    assert!(cpu::gpt_oss_experts(xs.clone(), &[1, 1], gu.clone(), gub.clone(), dp.clone(), dpb.clone(), 1.702, 7.0)
        .is_none());
    assert!(cpu::gpt_oss_experts(xs, &[2, 1], gu, gub, dp.narrow(2, 0, 20), dpb, 1.702, 7.0).is_none());
}
