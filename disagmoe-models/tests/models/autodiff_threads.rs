//! Gradients stay exact while other threads run their own backward passes.
//!
//! Burn 0.21's `backward()` ends with a sweep of every autodiff graph in the process; a graph
//! another thread was building could look unused to it for a moment (`cat` drops its inputs'
//! reference counts before it registers its own node) and lose steps, so a gradient came out
//! short without an error (tracel-ai/burn#5573). The threads transport runs one worker per thread,
//! each with its own forward and backward, so this is the runtime's case. The workspace patches
//! burn-autodiff (`vendor/burn-autodiff`, `mod owner` in `src/runtime/graph.rs`): a sweep visits
//! only its own thread's graphs and those of ended threads.
//!
//! Without the patch this test failed in about 5% of its rounds (row-by-row products joined by
//! `cat`, three threads), i.e. in every run of it.

use burn::backend::{Autodiff, Flex};
use burn::tensor::activation::silu;
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};

type B = Autodiff<Flex>;

fn values<const D: usize>(t: Tensor<impl Backend, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec::<f32>().unwrap()
}

fn random<const D: usize>(shape: [usize; D]) -> Tensor<Flex, D> {
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), &Default::default())
}

/// Output and gradients (input, then every weight) of a SwiGLU MLP applied row by row, each row
/// to its own expert, the rows joined by `cat`: fresh leaves on every call.
fn row_by_row(xs: &Tensor<Flex, 2>, weights: &[[Tensor<Flex, 2>; 3]], probe: &Tensor<Flex, 2>) -> Vec<Vec<f32>> {
    let leaf = |t: &Tensor<Flex, 2>| Tensor::<B, 2>::from_inner(t.clone()).require_grad();
    let x = leaf(xs);
    let w: Vec<[Tensor<B, 2>; 3]> = weights.iter().map(|ws| ws.each_ref().map(leaf)).collect();
    let rows: Vec<Tensor<B, 2>> = (0..xs.dims()[0])
        .map(|t| {
            let [g, u, d] = &w[t % w.len()];
            let xt = x.clone().narrow(0, t, 1);
            let h = silu(xt.clone().matmul(g.clone().transpose())) * xt.matmul(u.clone().transpose());
            h.matmul(d.clone().transpose())
        })
        .collect();
    let y = Tensor::cat(rows, 0);
    let grads = (y.clone() * Tensor::from_inner(probe.clone())).sum().backward();
    let mut out = vec![values(y), values(x.grad(&grads).expect("input gradient"))];
    for ws in &w {
        out.extend(ws.iter().map(|p| values(p.grad(&grads).expect("weight gradient"))));
    }
    out
}

#[test]
fn gradients_are_exact_while_other_threads_run_backward() {
    const THREADS: usize = 3;
    const ROUNDS: usize = 100;
    let handles: Vec<_> = (0..THREADS)
        .map(|_| {
            std::thread::spawn(|| {
                let mut wrong = Vec::new();
                for round in 0..ROUNDS {
                    let (rows, width, inter, experts) = (12, 16, 12, 4);
                    let xs = random([rows, width]);
                    let weights: Vec<[Tensor<Flex, 2>; 3]> = (0..experts)
                        .map(|_| {
                            [random([inter, width]), random([inter, width]), random([width, inter])]
                                .map(|w| w.mul_scalar(0.3))
                        })
                        .collect();
                    let probe = random([rows, width]);
                    // The same computation twice on the same values: each must give the same
                    // bits (one thread, one order of operations), unless a step was lost.
                    let first = row_by_row(&xs, &weights, &probe);
                    let second = row_by_row(&xs, &weights, &probe);
                    for (i, (a, b)) in first.iter().zip(&second).enumerate() {
                        if a != b {
                            let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
                            wrong.push(format!("round {round}, tensor {i}: differs by up to {worst:e}"));
                        }
                    }
                }
                wrong
            })
        })
        .collect();
    let wrong: Vec<String> = handles.into_iter().flat_map(|h| h.join().expect("worker thread")).collect();
    assert!(wrong.is_empty(), "{} tensors of {} rounds came out different: {:?}", wrong.len(), THREADS * ROUNDS, wrong);
}
