//! Checkpoints, exact resume, signals, SIGKILL during a checkpoint, and numeric faults, through the
//! `disagmoe` command.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_disagmoe"))
}

const SMALL: [&str; 6] = ["--batch", "2", "--seq", "32", "--quiet", "--seed=3"];

fn summary(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "exit {:?}: {}", out.status, String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.lines().last().expect("a summary line")).unwrap()
}

fn train(args: &[&str], extra: &[&Path]) -> Output {
    let mut c = bin();
    c.arg("train").args(SMALL).args(args);
    for p in extra {
        c.arg(p);
    }
    c.output().unwrap()
}

fn checkpoints(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|r| {
            r.map(|e| e.unwrap().path())
                .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("step-"))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn stop_after_then_resume_is_bit_identical_to_a_straight_run() {
    let tmp = tempfile::tempdir().unwrap();
    // The bundled text, token shards written by `disagmoe tokenize`, and a Megatron pair: a resumed
    // run continues on the same windows.
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/megatron");
    let shards = tmp.path().join("shards");
    let out = bin()
        .args(["tokenize", "--quiet", "--shard-tokens", "20000", "--input"])
        .arg(fixtures.join("docs.jsonl"))
        .arg("--out")
        .arg(&shards)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let megatron = fixtures.join("docs_text_document");
    for (name, data) in [("bundled", None), ("shards", Some(shards.as_path())), ("megatron", Some(megatron.as_path()))]
    {
        let ck = tmp.path().join(format!("ck-{name}"));
        let with_data = |args: &[&str]| {
            // Before `args`, whose last flag takes the path that `train` appends.
            let mut a: Vec<String> = data.map(|d| vec!["--data".into(), d.display().to_string()]).unwrap_or_default();
            a.extend(args.iter().map(|s| s.to_string()));
            a
        };
        let run = |args: Vec<String>, extra: &[&Path]| {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            summary(&train(&args, extra))
        };
        let straight = run(with_data(&["--steps", "10"]), &[]);
        let first = run(with_data(&["--steps", "10", "--stop-after", "5", "--checkpoint-dir"]), &[&ck]);
        assert_eq!(first["steps"], 5, "{name}");
        assert_eq!(first["stopped_early"], true, "{name}");
        let resumed = run(with_data(&["--steps", "10", "--resume"]), &[&ck]);
        assert_eq!(resumed["resumed_from_step"], 5, "{name}");
        assert_eq!(resumed["losses"], straight["losses"], "{name}: losses of steps 1-10");
        assert_eq!(resumed["param_checksum"], straight["param_checksum"], "{name}");
        assert_eq!(checkpoints(&ck).len(), 2, "{name}: step 5 and the final step 10");
    }
}

#[test]
fn keeps_the_newest_checkpoints_and_skips_damaged_ones() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    summary(&train(
        &["--steps", "5", "--checkpoint-every", "1", "--keep-checkpoints", "2", "--checkpoint-dir"],
        &[&ck],
    ));
    let kept = checkpoints(&ck);
    assert_eq!(
        kept.iter().map(|p| p.file_name().unwrap().to_string_lossy().to_string()).collect::<Vec<_>>(),
        ["step-00000004", "step-00000005"]
    );
    // Corrupt the newest: resume falls back to step 4 and says so.
    let weights = kept[1].join("model.safetensors");
    let mut bytes = std::fs::read(&weights).unwrap();
    let n = bytes.len();
    bytes[n - 3] ^= 0x5a;
    std::fs::write(&weights, bytes).unwrap();
    // (A longer run than the checkpoint's: a change of --steps, said so.)
    let out = train(&["--steps", "6", "--allow-change", "steps", "--resume"], &[&ck]);
    let s = summary(&out);
    assert_eq!(s["resumed_from_step"], 4);
    assert!(String::from_utf8_lossy(&out.stderr).contains("skipping damaged checkpoint"));
    // Nothing usable at all: a clear error.
    let empty = tmp.path().join("none");
    std::fs::create_dir_all(&empty).unwrap();
    let out = train(&["--steps", "6", "--resume"], &[&empty]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("holds no complete checkpoint"));
}

#[test]
fn sigkill_while_checkpointing_leaves_the_previous_checkpoint_loadable() {
    let tmp = tempfile::tempdir().unwrap();
    // Checkpoint every step so that a kill lands during a write often; kill at several moments.
    for delay_ms in [0u64, 7, 19] {
        let ck = tmp.path().join(format!("ck{delay_ms}"));
        let mut child = bin()
            .arg("train")
            .args(SMALL)
            .args(["--steps", "400", "--checkpoint-every", "1", "--keep-checkpoints", "2", "--checkpoint-dir"])
            .arg(&ck)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let t0 = Instant::now();
        while checkpoints(&ck).len() < 2 && t0.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(delay_ms));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        // Whatever was being written, the newest complete checkpoint verifies and training resumes.
        let out = train(&["--steps", "401", "--stop-after", "401", "--allow-change", "steps", "--resume"], &[&ck]);
        let s = summary(&out);
        assert!(s["resumed_from_step"].as_u64().unwrap() >= 1);
    }
    // A half-written checkpoint (no manifest) is never picked up.
    let ck = tmp.path().join("ck19");
    let newest = checkpoints(&ck).last().unwrap().clone();
    let fake = ck.join("step-00009999");
    std::fs::create_dir_all(&fake).unwrap();
    std::fs::copy(newest.join("model.safetensors"), fake.join("model.safetensors")).unwrap();
    let s =
        summary(&train(&["--steps", "10000", "--stop-after", "402", "--allow-change", "steps", "--resume"], &[&ck]));
    assert_ne!(s["resumed_from_step"], 9999);
}

#[test]
fn sigint_finishes_the_step_checkpoints_and_exits_zero() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    let child = bin()
        .arg("train")
        .args(SMALL)
        .args(["--steps", "100000", "--checkpoint-dir"])
        .arg(&ck)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let status = Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    assert!(status.success());
    let out = child.wait_with_output().unwrap();
    let s = summary(&out);
    assert_eq!(s["stopped_early"], true);
    let steps = s["steps"].as_u64().unwrap();
    let last = checkpoints(&ck).last().cloned().expect("a checkpoint was written");
    assert_eq!(last.file_name().unwrap().to_string_lossy(), format!("step-{steps:08}"));
}

#[test]
fn non_finite_gradients_are_skipped_or_abort_naming_the_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let tensor = "model.layers.1.mlp.gate.weight";
    // Fault injection is a test-only hook: it comes from the environment, never from a run config.
    let faults = format!(r#"{{"inject_nonfinite": {{"step": 3, "tensor": "{tensor}"}}}}"#);
    let run = tmp.path().join("run.toml");
    std::fs::write(&run, format!("steps = 5\n[inject_nonfinite]\nstep = 3\ntensor = \"{tensor}\"\n")).unwrap();
    let refused = train(&["--run-config"], &[&run]);
    assert_eq!(refused.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("testing hook"));
    let with_faults = |args: &[&str]| {
        let mut cmd = bin();
        cmd.args(["train", "--quiet", "--steps", "5", "--batch", "2", "--seq", "16"]).args(args);
        cmd.env("DISAGMOE_TEST_FAULTS", &faults).output().unwrap()
    };
    let skip = summary(&with_faults(&[]));
    assert_eq!(skip["skipped_steps"], 1);
    assert!(skip["param_checksum"].as_f64().unwrap().is_finite(), "the skipped update left the weights finite");
    let out = with_faults(&["--on-nonfinite", "abort"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("non-finite gradient at step 3") && err.contains(tensor), "{err}");
}

#[test]
fn a_fresh_run_never_overwrites_another_runs_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    summary(&train(&["--steps", "2", "--checkpoint-dir"], &[&ck]));
    let out = train(&["--steps", "2", "--checkpoint-dir"], &[&ck]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--resume"), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(checkpoints(&ck).len(), 1);
}
