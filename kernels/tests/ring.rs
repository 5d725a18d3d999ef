//! Ring attention (context parallelism's schedule, `disagmoe_kernels::ring`) against the whole
//! attention of `reference`: outputs and the gradients of q, k, v and the sinks, over odd
//! lengths, 2 to 4 workers, grouped-query ratios 1 and 2, value dim != key dim, sliding windows
//! shorter and longer than a chunk, sinks, and document masks.
#![cfg(feature = "flex")]

use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};
use disagmoe_kernels::documents::Documents;
use disagmoe_kernels::reference;
use disagmoe_kernels::ring::{ring_attention, Mask};

type B = Autodiff<Flex>;

fn values<const D: usize>(t: Tensor<impl Backend, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec::<f32>().unwrap()
}

fn rand<const D: usize>(shape: [usize; D], seed: u64) -> Tensor<B, D> {
    B::seed(&Default::default(), seed);
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), &Default::default())
}

/// Largest `|a - b| / (1 + |b|)`.
fn worst(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter().zip(want).map(|(a, b)| (a - b).abs() / (1.0 + b.abs())).fold(0.0, f32::max)
}

#[test]
fn ring_attention_is_the_whole_attention_forward_and_backward() {
    let mut cases = 0;
    for (s, c, h, g, window, sinks, cut) in [
        (13, 2, 4, 2, None, false, false),
        (13, 3, 4, 4, None, true, false),
        (21, 4, 4, 2, Some(5), false, false),
        (17, 2, 2, 1, Some(3), true, true),
        (9, 4, 4, 2, Some(40), false, true),
        (31, 3, 4, 2, None, true, true),
    ] {
        let (b, d, e) = (2, 8, 6);
        let docs = cut.then(|| Documents::new(s, &[vec![3, s / 2 + 1], vec![s - 2]]).unwrap());
        let mask = Mask { window, docs: docs.as_ref() };
        let what = format!("S {s}, C {c}, H {h}/G {g}, window {window:?}, sinks {sinks}, documents {cut}");
        let leaves = || {
            let seed = (s * 100 + c) as u64;
            let q = rand([b, s, h, d], seed).require_grad();
            let k = rand([b, s, g, d], seed + 1).require_grad();
            let v = rand([b, s, g, e], seed + 2).require_grad();
            let sk = sinks.then(|| rand([h], seed + 3).require_grad());
            (q, k, v, sk)
        };
        let weights = rand([b, s, h, e], 99);
        let scale = 1.0 / (d as f64).sqrt();
        let mut grads = Vec::new();
        let mut outs = Vec::new();
        for ring in [false, true] {
            let (q, k, v, sk) = leaves();
            let out = if ring {
                ring_attention(q.clone(), k.clone(), v.clone(), sk.clone(), scale, mask, c).unwrap()
            } else {
                reference::attention(q.clone(), k.clone(), v.clone(), sk.clone(), scale, window, docs.as_ref())
            };
            outs.push(values(out.clone()));
            let g = (out * weights.clone()).sum().backward();
            let mut each = vec![values(q.grad(&g).unwrap()), values(k.grad(&g).unwrap()), values(v.grad(&g).unwrap())];
            if let Some(sk) = sk {
                each.push(values(sk.grad(&g).unwrap()));
            }
            grads.push(each);
        }
        let err = worst(&outs[1], &outs[0]);
        assert!(err <= 1e-5, "{what}: output differs by {err:e}");
        for (name, (got, want)) in ["q", "k", "v", "sinks"].iter().zip(grads[1].iter().zip(&grads[0])) {
            let err = worst(got, want);
            assert!(err <= 1e-5, "{what}: gradient of {name} differs by {err:e}");
        }
        cases += 1;
    }
    assert_eq!(cases, 6);
}

#[test]
fn too_short_a_sequence_is_refused_naming_the_workers() {
    let q = rand([1, 5, 2, 4], 1);
    let k = rand([1, 5, 2, 4], 2);
    let e = ring_attention(q, k.clone(), k, None, 0.5, Mask { window: None, docs: None }, 3).unwrap_err();
    assert!(e.contains("3 workers") && e.contains("at least 6 tokens"), "{e}");
}
