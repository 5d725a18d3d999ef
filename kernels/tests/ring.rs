//! Ring attention (context parallelism's schedule, `disagmoe_kernels::ring`) against the whole
//! attention of `reference`: outputs and the gradients of q, k, v and the sinks, over odd
//! lengths, 2 to 4 workers, grouped-query ratios 1 and 2, value dim != key dim, sliding windows
//! shorter and longer than a chunk, sinks, and document masks; and the ring as workers with graphs
//! of their own would run it, the gradients of the blocks they received sent back to the owners.
#![cfg(feature = "flex")]

use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use disagmoe_kernels::documents::Documents;
use disagmoe_kernels::reference;
use disagmoe_kernels::ring::{
    chunk_partials, chunks, finish, held_positions, partial, ring_attention, split_queries, worker_attention,
    worker_partial, Block, Mask, Partial,
};

type B = Autodiff<Flex>;

fn values<const D: usize>(t: Tensor<impl Backend, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec::<f32>().unwrap()
}

/// Standard normal values from `seed` (Box-Muller over xorshift), from a generator of their own:
/// the backend's seed is one for the process, and the tests run in parallel threads.
fn rand<const D: usize>(shape: [usize; D], seed: u64) -> Tensor<B, D> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    let mut uniform = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n)
        .map(|_| {
            let (u, v) = (uniform(), uniform());
            ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
        })
        .collect();
    Tensor::from_data(TensorData::new(values, shape), &Default::default())
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

/// The fused CPU block (`disagmoe_kernels::cpu::attention_block`, what `partial` runs on flex)
/// against `partial` composed of Burn's operations: the output, the log-sum-exp, and the
/// gradients of q, k and v through both (the log-sum-exp's gradient is what the merge of blocks
/// sends back), over blocks on and off the diagonal, blocks of several row tiles, windows that
/// empty some rows, documents, and a block no query sees.
#[test]
fn the_fused_block_is_the_composed_block_forward_and_backward() {
    let (b, h, g, d, e) = (2, 4, 2, 8, 6);
    let s = 200;
    let docs = Documents::new(s, &[vec![7, 23, 120], vec![30, 170]]).unwrap();
    let mut cases = 0;
    for (q_at, k_at, window, cut) in [
        // Blocks of several row tiles (64 rows each).
        (60..200, 0..150, Some(70), true),
        (100..180, 100..180, None, false),
        (10..20, 10..20, None, false),
        (30..40, 0..10, None, false),
        (30..40, 12..25, Some(12), false),
        (20..33, 3..19, None, true),
        (25..35, 5..12, Some(6), true),
        (5..15, 20..30, None, false),
    ] {
        let what = format!("queries {q_at:?}, keys {k_at:?}, window {window:?}, documents {cut}");
        let mask = Mask { window, docs: cut.then_some(&docs) };
        let (qpos, kpos): (Vec<usize>, Vec<usize>) = (q_at.clone().collect(), k_at.clone().collect());
        let (sq, tk) = (qpos.len(), kpos.len());
        let (wo, wl) = (rand([b, sq, h, e], 7), rand([b, h, sq, 1], 8));
        let mut runs = Vec::new();
        for fused in [false, true] {
            disagmoe_kernels::set_enabled_for_thread(Some(fused));
            let seed = (q_at.start * 100 + k_at.start) as u64;
            let q = rand([b, sq, h, d], seed).require_grad();
            let k = rand([b, tk, g, d], seed + 1).require_grad();
            let v = rand([b, tk, g, e], seed + 2).require_grad();
            let (out, lse) = partial(q.clone(), k.clone(), v.clone(), 0.35, mask, &qpos, &kpos);
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
            let err = worst(got, want);
            assert!(err <= 2e-6, "{what}: {name} differs by {err:e}");
        }
        cases += 1;
    }
    assert_eq!(cases, 8);
}

#[test]
fn too_short_a_sequence_is_refused_naming_the_workers() {
    let q = rand([1, 5, 2, 4], 1);
    let k = rand([1, 5, 2, 4], 2);
    let e = ring_attention(q, k.clone(), k, None, 0.5, Mask { window: None, docs: None }, 3).unwrap_err();
    assert!(e.contains("3 workers") && e.contains("at least 6 tokens"), "{e}");
}

/// `part` (`[b, positions.len(), row]` values) put at `positions` of `full` (`[b, s, row]`).
fn place(full: &mut [f32], part: &[f32], b: usize, s: usize, positions: &[usize], row: usize) {
    let t = positions.len();
    for bi in 0..b {
        for (i, &p) in positions.iter().enumerate() {
            let (from, to) = ((bi * t + i) * row, (bi * s + p) * row);
            full[to..to + row].copy_from_slice(&part[from..from + row]);
        }
    }
}

/// The ring's messages, as workers with graphs of their own exchange them: worker `r` holds the
/// queries, keys and values of its two chunks (leaves of its graph) and attends over its own
/// block first (while the block travels); it receives a copy of every other worker's block, and
/// attends over those onto its own block's result in a second graph (leaves: copies of the
/// queries and of that result, and the received blocks), its output the same bits as one call
/// over every block (and block by block, as the runtime's tasks merge them). After the second
/// graph's backward, the gradient of each received copy goes
/// back to the block's owner, which adds them to its own from the first graph's backward. The
/// queries', keys' and values' gradients so gathered, and the sinks' summed over the workers (a
/// parameter each holds), are the whole attention's.
#[test]
fn workers_with_graphs_of_their_own_get_the_whole_attention_gradients_from_the_blocks_sent_back() {
    let mut cases = 0;
    for (s, c, h, g, window, sinks, cut) in [
        (13, 2, 4, 2, None, false, false),
        (21, 4, 4, 2, Some(5), true, true),
        (19, 3, 2, 1, None, true, true),
        (16, 2, 4, 4, Some(40), false, true),
    ] {
        let (b, d, e) = (2, 8, 6);
        let docs = cut.then(|| Documents::new(s, &[vec![3, s / 2 + 1], vec![s - 2]]).unwrap());
        let mask = Mask { window, docs: docs.as_ref() };
        let what = format!("S {s}, C {c}, H {h}/G {g}, window {window:?}, sinks {sinks}, documents {cut}");
        let seed = (s * 100 + c) as u64 + 7;
        let (q, k, v) = (rand([b, s, h, d], seed), rand([b, s, g, d], seed + 1), rand([b, s, g, e], seed + 2));
        let sk = sinks.then(|| rand([h], seed + 3));
        let weights = rand([b, s, h, e], 98);
        let scale = 1.0 / (d as f64).sqrt();

        // The whole attention.
        let leaf = |x: &Tensor<B, 4>| x.clone().detach().require_grad();
        let (wq, wk, wv) = (leaf(&q), leaf(&k), leaf(&v));
        let wsk = sk.clone().map(|t| t.detach().require_grad());
        let out = reference::attention(wq.clone(), wk.clone(), wv.clone(), wsk.clone(), scale, window, docs.as_ref());
        let grads = (out.clone() * weights.clone()).sum().backward();
        let want_out = values(out);
        let want =
            [values(wq.grad(&grads).unwrap()), values(wk.grad(&grads).unwrap()), values(wv.grad(&grads).unwrap())];
        let want_sinks = wsk.map(|t| values(t.grad(&grads).unwrap()));

        // The ring: what each worker holds, leaves of its own graph.
        let held = chunks(s, c).unwrap();
        let positions: Vec<Vec<usize>> = (0..c).map(|r| held_positions(s, c, r).unwrap()).collect();
        let at = |x: &Tensor<B, 4>, r: usize| x.clone().detach().select(1, index_of(&positions[r])).require_grad();
        let own: Vec<Block<B>> = (0..c).map(|r| Block { k: at(&k, r), v: at(&v, r), held: held[r].clone() }).collect();
        let (mut got_out, mut got) =
            (vec![0.0; want_out.len()], [vec![0.0; b * s * h * d], vec![0.0; b * s * g * d], vec![0.0; b * s * g * e]]);
        // Per owner: the gradients of its keys and values from every worker's backward (its own
        // among them), in worker order.
        let mut back: Vec<Vec<(Vec<f32>, Vec<f32>)>> = vec![Vec::new(); c];
        let mut got_sinks = want_sinks.as_ref().map(|w| vec![0.0f32; w.len()]);
        for r in 0..c {
            let qr = at(&q, r);
            let skr = sk.clone().map(|t| t.detach().require_grad());
            // Step i brings worker r - i's block: its own, then copies received.
            let ring: Vec<Block<B>> = (0..c)
                .map(|i| {
                    let o = (r + c - i) % c;
                    if o == r {
                        own[r].clone()
                    } else {
                        Block { k: leaf(&own[o].k), v: leaf(&own[o].v), held: held[o].clone() }
                    }
                })
                .collect();
            // The own block while the others travel (the first graph), the rest onto it (the second).
            let first = worker_partial(qr.clone(), &held[r], &ring[..1], None, scale, mask).unwrap();
            let (q2, out2, lse2) = (leaf(&qr), leaf(&first.out), leaf(&first.lse));
            let start = Partial { out: out2.clone(), lse: lse2.clone() };
            let rest = worker_partial(q2.clone(), &held[r], &ring[1..], Some(start), scale, mask).unwrap();
            let out = finish(rest, skr.clone());
            let whole = values(worker_attention(qr.clone(), &held[r], &ring, skr.clone(), scale, mask).unwrap());
            assert_eq!(values(out.clone()), whole, "{what}: worker {r}: in two pieces, the same bits");
            // Block by block, as the runtime's tasks merge them (each chunk's attention so far
            // kept): the same bits again.
            let qs = split_queries(qr.clone(), &held[r]);
            let mut acc = chunk_partials(&qs, &held[r], &ring[..1], None, scale, mask).unwrap();
            for block in &ring[1..] {
                acc = chunk_partials(&qs, &held[r], std::slice::from_ref(block), Some(acc), scale, mask).unwrap();
            }
            let by_block = values(finish(Partial::join(acc), skr.clone()));
            assert_eq!(by_block, whole, "{what}: worker {r}: block by block, the same bits");
            let wr = weights.clone().detach().select(1, index_of(&positions[r]));
            let grads = (out.clone() * wr).sum().backward();
            let (gout, glse) = (out2.grad(&grads).unwrap(), lse2.grad(&grads).unwrap());
            let firsts = ((first.out * Tensor::from_inner(gout)).sum() + (first.lse * Tensor::from_inner(glse)).sum())
                .backward();
            let mut gq = values(q2.grad(&grads).unwrap());
            gq.iter_mut().zip(values(qr.grad(&firsts).unwrap())).for_each(|(a, x)| *a += x);
            place(&mut got_out, &values(out), b, s, &positions[r], h * e);
            place(&mut got[0], &gq, b, s, &positions[r], h * d);
            for (i, block) in ring.iter().enumerate() {
                let o = (r + c - i) % c;
                let from = if i == 0 { &firsts } else { &grads };
                let gk = block.k.grad(from).map(values).unwrap_or_else(|| vec![0.0; b * positions[o].len() * g * d]);
                let gv = block.v.grad(from).map(values).unwrap_or_else(|| vec![0.0; b * positions[o].len() * g * e]);
                back[o].push((gk, gv));
            }
            if let (Some(acc), Some(skr)) = (got_sinks.as_mut(), skr) {
                for (a, x) in acc.iter_mut().zip(values(skr.grad(&grads).unwrap())) {
                    *a += x;
                }
            }
        }
        for (o, parts) in back.iter().enumerate() {
            assert_eq!(parts.len(), c, "{what}: worker {o}'s block went to every worker once");
            let (mut gk, mut gv) = (parts[0].0.clone(), parts[0].1.clone());
            for (pk, pv) in &parts[1..] {
                gk.iter_mut().zip(pk).for_each(|(a, x)| *a += x);
                gv.iter_mut().zip(pv).for_each(|(a, x)| *a += x);
            }
            place(&mut got[1], &gk, b, s, &positions[o], g * d);
            place(&mut got[2], &gv, b, s, &positions[o], g * e);
        }
        let err = worst(&got_out, &want_out);
        assert!(err <= 1e-5, "{what}: output differs by {err:e}");
        for (name, (got, want)) in ["q", "k", "v"].iter().zip(got.iter().zip(&want)) {
            let err = worst(got, want);
            assert!(err <= 1e-5, "{what}: gradient of {name} differs by {err:e}");
        }
        if let (Some(got), Some(want)) = (got_sinks, want_sinks) {
            let err = worst(&got, &want);
            assert!(err <= 1e-5, "{what}: gradient of the sinks differs by {err:e}");
        }
        cases += 1;
    }
    assert_eq!(cases, 4);
}

/// The positions as an index tensor.
fn index_of(positions: &[usize]) -> Tensor<B, 1, Int> {
    Tensor::from_data(
        TensorData::new(positions.iter().map(|&p| p as i64).collect(), [positions.len()]),
        &Default::default(),
    )
}

#[test]
fn a_worker_outside_the_ring_and_blocks_that_do_not_fit_are_refused() {
    let e = held_positions(12, 3, 3).unwrap_err();
    assert!(e.contains("worker 3") && e.contains("ring of 3"), "{e}");
    assert_eq!(held_positions(10, 2, 1).unwrap(), vec![3, 4, 5, 6, 7]);
    // Worker 1 of 2 over 10 tokens holds 3..6 and 6..8 (5 positions); worker 0 holds 0..3 and 8..10.
    let mask = Mask { window: None, docs: None };
    let held = [3..6, 6..8];
    let block = |n: usize, held: [std::ops::Range<usize>; 2]| Block {
        k: rand([1, n, 2, 4], 1),
        v: rand([1, n, 2, 4], 2),
        held,
    };
    let attend = |q: usize, blocks: &[Block<B>], held: &[std::ops::Range<usize>; 2]| {
        worker_attention(rand([1, q, 2, 4], 3), held, blocks, None, 0.5, mask).map(|_| ()).unwrap_err()
    };
    let e = attend(6, &[block(5, held.clone())], &held);
    assert!(e.contains("queries over 6 positions") && e.contains("(5 positions)"), "{e}");
    let e = attend(5, &[block(5, held.clone()), block(4, [0..3, 8..10])], &held);
    assert!(e.contains("keys over 4 and values over 4 positions"), "{e}");
    let e = attend(5, &[block(5, [0..3, 8..10])], &held);
    assert!(e.contains("no block holds this worker's own chunks"), "{e}");
    let e = attend(5, &[], &held);
    assert!(e.contains("no block holds"), "{e}");
    let e = attend(3, &[block(3, [0..3, 3..3])], &[0..3, 3..3]);
    assert!(e.contains("two non-empty chunks"), "{e}");
    assert!(worker_attention(rand([1, 5, 2, 4], 3), &held, &[block(5, held.clone())], None, 0.5, mask).is_ok());
    // Onto a start: the other blocks only, the start the shape of the queries'.
    let start = |t: usize| Partial { out: rand([1, t, 2, 4], 4), lse: rand([1, 2, t, 1], 5) };
    let onto =
        |t: usize| worker_partial(rand([1, 5, 2, 4], 3), &held, &[block(5, [0..3, 8..10])], Some(start(t)), 0.5, mask);
    assert!(onto(5).is_ok());
    let e = onto(4).map(|_| ()).unwrap_err();
    assert!(e.contains("a start of outputs [1, 4, 2, 4]") && e.contains("queries [1, 5, 2, 4]"), "{e}");
    let twice = worker_partial(rand([1, 5, 2, 4], 3), &held, &[block(5, held.clone())], Some(start(5)), 0.5, mask);
    let e = twice.map(|_| ()).unwrap_err();
    assert!(e.contains("the start already holds it"), "{e}");
}
