//! Training through the CubeCL kernels on Burn's WebGPU/Vulkan backend (in CI: Mesa's lavapipe,
//! a CPU Vulkan driver) gives the reference path's losses. Run with `--features wgpu`.
#![cfg(all(feature = "wgpu", not(feature = "cuda")))]

use burn::backend::Autodiff;
use disagmoe_kernels::cube::{ops_run, WgpuCube};
use disagmoe_train::trainer::{train, RunConfig};

type B = Autodiff<WgpuCube>;

fn run(preset: &str, kernels: bool) -> Vec<f64> {
    disagmoe_kernels::set_enabled(kernels);
    let cfg = RunConfig {
        model_preset: Some(preset.to_string()),
        steps: 4,
        batch: 2,
        seq: 48,
        progress: false,
        ..Default::default()
    };
    let before = ops_run();
    let (summary, _) = train::<B>(&cfg, &Default::default()).expect("training runs");
    let used = ops_run() - before;
    if kernels {
        assert!(used > 0, "{preset}: the kernels were not used");
    } else {
        assert_eq!(used, 0, "{preset}: the reference run used the kernels");
    }
    summary.losses
}

// One test (the kernel switch is process-wide), the families one after another.
#[test]
fn tiny_models_train_through_the_kernels_with_the_reference_losses() {
    assert_eq!(disagmoe_train::backend::BACKEND_NAME, "wgpu");
    for preset in ["tiny-qwen3-moe", "tiny-gpt-oss", "tiny-deepseek-v3"] {
        let with = run(preset, true);
        let without = run(preset, false);
        disagmoe_kernels::set_enabled(true);
        assert_eq!(with.len(), without.len());
        for (step, (a, b)) in with.iter().zip(&without).enumerate() {
            assert!(
                (a - b).abs() <= 2e-3 * b.abs().max(1.0),
                "{preset} step {step}: kernels {a} vs reference {b} (all: {with:?} vs {without:?})"
            );
        }
        assert!(with.last() < with.first(), "{preset}: loss does not fall: {with:?}");
        eprintln!("{preset}: kernels {with:?}, reference {without:?}");
    }
}
