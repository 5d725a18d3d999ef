//! `--recompute`: every setting trains to the losses of keeping every activation (the gradients are
//! the same up to the order of their sums), and a placement that cannot honour it refuses it.

use std::process::{Command, Output};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_disagmoe"))
}

fn summary(out: &Output) -> serde_json::Value {
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "run failed: {}\n{}", String::from_utf8_lossy(&out.stderr), text);
    let last = text.lines().last().expect("a summary line");
    serde_json::from_str(last).unwrap_or_else(|e| panic!("last line is not JSON ({e}): {last}"))
}

fn losses(v: &serde_json::Value) -> Vec<f64> {
    v["losses"].as_array().unwrap().iter().map(|l| l.as_f64().unwrap()).collect()
}

fn train(preset: &str, recompute: &str, extra: &[&str]) -> Vec<f64> {
    let out = bin()
        .args(["train", "--model-preset", preset, "--steps", "5", "--batch", "4", "--seq", "24", "--quiet"])
        .args(["--micro-batches", "2", "--router-z-loss-coef", "1e-3", "--recompute", recompute])
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

#[test]
fn placements_that_cannot_recompute_refuse_it_by_name() {
    let out = bin()
        .args(["train", "--model-preset", "tiny-qwen3-moe", "--steps", "1", "--batch", "4", "--seq", "16"])
        .args(["--quiet", "--placement", "disagg", "--recompute", "full"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("recompute") && err.contains("single"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let out = bin().args(["train", "--model-preset", "tiny-qwen3-moe", "--recompute", "some"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("none, experts, attention, full"), "{err}");
}
