//! `--recompute`: every setting trains to the losses of keeping every activation (one device: the
//! gradients are the same up to the order of their sums; the runtime's workers: bit for bit).

#[path = "support/cli.rs"]
mod cli;
use cli::{bin, losses, summary};

fn train(preset: &str, recompute: &str, extra: &[&str]) -> Vec<f64> {
    train_batch(preset, recompute, &["--batch", "4", "--micro-batches", "2"], extra)
}

fn train_batch(preset: &str, recompute: &str, batch: &[&str], extra: &[&str]) -> Vec<f64> {
    let out = bin()
        .args(["train", "--model-preset", preset, "--steps", "5", "--seq", "24", "--quiet"])
        .args(batch)
        .args(["--router-z-loss-coef", "1e-3", "--recompute", recompute])
        .args(extra)
        .output()
        .unwrap();
    losses(&summary(&out))
}

#[test]
fn every_setting_trains_to_the_losses_of_keeping_every_activation() {
    for preset in ["tiny-qwen3-moe", "tiny-gpt-oss", "tiny-deepseek-v3", "tiny-deepseek-moe"] {
        let kept = train(preset, "none", &[]);
        for recompute in ["experts", "attention", "full"] {
            let got = train(preset, recompute, &[]);
            assert_eq!(got.len(), kept.len());
            for (step, (a, b)) in got.iter().zip(&kept).enumerate() {
                // Measured: at most 1.1e-6 relative over the 5 steps (DeepSeekMoE, attention).
                assert!((a - b).abs() <= 1e-5 * b.abs(), "{preset} {recompute} step {}: {a} vs {b}", step + 1);
            }
        }
    }
}

#[test]
fn f16_loss_scaling_goes_through_the_recomputed_backward() {
    let kept = train("tiny-qwen3-moe", "none", &["--precision", "f16"]);
    let got = train("tiny-qwen3-moe", "full", &["--precision", "f16"]);
    for (a, b) in got.iter().zip(&kept) {
        assert!((a - b).abs() <= 1e-4 * b.abs(), "f16 full: {a} vs {b}");
    }
}

/// The runtime's workers recompute their stages: the same run, bit for bit, whatever is
/// recomputed (the first forward computes the values the graph would, without it).
#[test]
fn workers_that_recompute_their_stages_give_the_same_run() {
    for (preset, placement) in [
        (
            "tiny-qwen3-moe",
            &["--placement", "disagg", "--attn-workers", "2", "--ffn-workers", "2", "--groups", "2"][..],
        ),
        ("tiny-deepseek-v3", &["--placement", "ep", "--workers", "4"][..]),
        ("tiny-gpt-oss", &["--placement", "disagg", "--attn-workers", "2", "--ffn-workers", "4", "--groups", "2"][..]),
    ] {
        let batch = ["--batch", "8", "--micro-batches", "4"];
        let kept = train_batch(preset, "none", &batch, placement);
        for recompute in ["experts", "attention", "full"] {
            assert_eq!(train_batch(preset, recompute, &batch, placement), kept, "{preset} {placement:?} {recompute}");
        }
    }
}

#[test]
fn an_unknown_setting_is_refused_with_the_allowed_ones() {
    let out = bin().args(["train", "--model-preset", "tiny-qwen3-moe", "--recompute", "some"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("none, experts, attention, full"), "{err}");
}
