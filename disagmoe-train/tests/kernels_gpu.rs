//! Training through the CubeCL kernels on Burn's WebGPU/Vulkan backend (in CI: Mesa's lavapipe,
//! a CPU Vulkan driver) gives the reference path's losses. Part of `cargo test --workspace`: the
//! trainer is generic over the backend, so this test trains on `Autodiff<WgpuCube>` whatever
//! backend the crate's features choose for the CLI.

use burn::backend::Autodiff;
use disagmoe_kernels::cube::{ops_run, WgpuCube};
use disagmoe_train::{train, RunConfig};

type B = Autodiff<WgpuCube>;

fn run(preset: &str, kernels: bool) -> Vec<f64> {
    disagmoe_kernels::set_enabled(kernels);
    let mut cfg = RunConfig { steps: 4, progress: false, ..Default::default() };
    cfg.model.preset = Some(preset.to_string());
    (cfg.data.batch, cfg.data.seq) = (2, 48);
    let device = Default::default();
    let probe =
        std::panic::catch_unwind(|| burn::tensor::Tensor::<WgpuCube, 1>::ones([2], &device).sum().into_scalar());
    // Without a Vulkan driver this test is ignored (build-support/probe.rs); with one, a device
    // that does not answer is a failure.
    assert!(
        matches!(probe, Ok(x) if x == 2.0),
        "a Vulkan driver is installed but no WebGPU/Vulkan device answers ({probe:?})"
    );
    let before = ops_run();
    let summary = train::<B>(&cfg, &device).expect("training runs");
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
#[cfg_attr(disagmoe_no_vulkan, ignore = "no Vulkan driver on this machine (apt-get install mesa-vulkan-drivers)")]
fn tiny_models_train_through_the_kernels_with_the_reference_losses() {
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
