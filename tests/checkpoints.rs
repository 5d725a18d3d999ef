//! Training checkpoints of distributed runs, through the `disagmoe` command: a run stopped and
//! resumed under the same placement is bit-identical to a straight run; a checkpoint resumes under
//! any other placement (resharded) within 1e-5; a worker killed while a checkpoint is written never
//! leaves a checkpoint that is chosen and does not verify; a resume under other settings is
//! refused; a signal finishes the step, checkpoints and exits 0; a step with a non-finite gradient
//! leaves every weight and moment as it was on every worker (or ends every worker); under `mpirun`,
//! a job that keeps losing ranks at random moments and resuming ends where an uninterrupted one
//! ends.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

#[path = "support/mpirun.rs"]
mod mpirun;

/// Runs a job to its end, bounded (an `mpirun` stuck in its own shutdown is killed: see
/// `tests/support/mpirun.rs`).
fn run_bounded(mut cmd: Command) -> Output {
    mpirun::wait_job(cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap(), Duration::from_secs(600))
}

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_disagmoe"))
}

const RUN: &[&str] = &["train", "--quiet"];
/// The size of most runs here: 8 sequences of 32 tokens in 4 micro-batches.
const SMALL: &[&str] = &["--batch", "8", "--seq", "32", "--micro-batches", "4"];
/// The tiny presets' default batch (8 x 128 tokens; ep's messages near 64 KiB and over, where
/// `--placement ep` under MPI once failed to decode them).
const DEFAULT_SIZE: &[&str] = &[];
const PRESETS: [&str; 2] = ["tiny-qwen3-moe", "tiny-deepseek-v3"];
const SINGLE: &[&str] = &["--placement", "single"];
const DISAGG: &[&str] = &["--placement", "disagg", "--attn-workers", "2", "--ffn-workers", "2", "--groups", "2"];
const DISAGG_2_4: &[&str] = &["--placement", "disagg", "--attn-workers", "2", "--ffn-workers", "4", "--groups", "2"];
const EP: &[&str] = &["--placement", "ep", "--workers", "4"];
const DISAGG_4_2: &[&str] = &["--placement", "disagg", "--attn-workers", "4", "--ffn-workers", "2", "--groups", "2"];
const DISAGG_1_3: &[&str] = &["--placement", "disagg", "--attn-workers", "1", "--ffn-workers", "3", "--groups", "1"];
/// Every family's tiny preset: GPT-OSS's stacked fused experts and DeepSeek's shared experts
/// reshard differently from the per-expert tensors of the others.
const ALL_FAMILIES: [&str; 6] =
    ["tiny-qwen3-moe", "tiny-gpt-oss", "tiny-deepseek-v3", "tiny-deepseek-moe", "tiny-mixtral", "tiny-olmoe"];

fn summary(out: &Output) -> serde_json::Value {
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "run failed ({:?}): {}\n{}", out.status, String::from_utf8_lossy(&out.stderr), text);
    let last =
        text.lines().last().unwrap_or_else(|| panic!("no stdout; stderr: {}", String::from_utf8_lossy(&out.stderr)));
    serde_json::from_str(last).unwrap_or_else(|e| panic!("last line is not JSON ({e}): {last}"))
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `disagmoe train` of `preset` for `steps` steps under `placement` with `extra` flags.
fn train(preset: &str, steps: usize, placement: &[&str], extra: &[&str]) -> Output {
    bin()
        .args(RUN)
        .args(SMALL)
        .args(["--steps", &steps.to_string(), "--model-preset", preset])
        .args(placement)
        .args(extra)
        .output()
        .unwrap()
}

fn checkpoints(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|r| r.map(|e| e.unwrap().file_name().to_string_lossy().to_string()).collect())
        .unwrap_or_default();
    v.retain(|n| n.starts_with("step-"));
    v.sort();
    v
}

/// Every tensor of a saved model directory.
fn tensors(dir: &Path) -> BTreeMap<String, Vec<f32>> {
    let mut reader = disagmoe::models::CheckpointReader::open(dir).unwrap_or_else(|e| panic!("{dir:?}: {e}"));
    reader.names().into_iter().map(|n| (n.clone(), reader.read_f32(&n).unwrap().1)).collect()
}

fn losses(s: &serde_json::Value) -> Vec<f64> {
    s["losses"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect()
}

/// Every tensor of two models is the same, bit for bit.
fn assert_bit_identical(what: &str, got: &Path, want: &Path) {
    let (g, w) = (tensors(got), tensors(want));
    assert_eq!(g.keys().collect::<Vec<_>>(), w.keys().collect::<Vec<_>>(), "{what}: the same tensors");
    for (name, b) in &w {
        let a = &g[name];
        let same = a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "{what}: {name} differs");
    }
}

/// Every tensor of two models agrees within `tol` (||a - b|| / ||b|| per tensor); returns the worst.
fn assert_close(what: &str, got: &Path, want: &Path, tol: f64) -> f64 {
    let (g, w) = (tensors(got), tensors(want));
    assert_eq!(g.keys().collect::<Vec<_>>(), w.keys().collect::<Vec<_>>(), "{what}: the same tensors");
    let mut worst = (0f64, String::new());
    for (name, b) in &w {
        let a = &g[name];
        let diff: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum::<f64>().sqrt();
        let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum::<f64>().sqrt().max(1e-30);
        if diff / norm > worst.0 {
            worst = (diff / norm, name.clone());
        }
    }
    eprintln!("{what}: worst relative error {:.2e} ({})", worst.0, worst.1);
    assert!(worst.0 <= tol, "{what}: {} differs by {:.2e} relative (tolerance {tol:.0e})", worst.1, worst.0);
    worst.0
}

/// The steps of a metrics file, in order.
fn metric_steps(out: &Path) -> Vec<u64> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["step"].as_u64().unwrap())
        .collect()
}

/// A launcher of distributed runs: in-process threads, or `mpirun -np <workers>` with `--transport
/// mpi`.
#[derive(Clone, Copy)]
enum Launch {
    Local,
    Mpi,
}

impl Launch {
    fn train(self, preset: &str, steps: usize, placement: &[&str], extra: &[&str]) -> Output {
        self.train_sized(SMALL, preset, steps, placement, extra)
    }

    fn train_sized(self, size: &[&str], preset: &str, steps: usize, placement: &[&str], extra: &[&str]) -> Output {
        run_bounded(self.command_sized(size, preset, steps, placement, extra, &[]))
    }

    fn command(self, preset: &str, steps: usize, placement: &[&str], extra: &[&str], env: &[(&str, &str)]) -> Command {
        self.command_sized(SMALL, preset, steps, placement, extra, env)
    }

    fn command_sized(
        self,
        size: &[&str],
        preset: &str,
        steps: usize,
        placement: &[&str],
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Command {
        let workers = workers(placement);
        let mut cmd = match self {
            Launch::Mpi if workers > 1 => {
                let mut c = Command::new("mpirun");
                c.args(["--oversubscribe", "-np", &workers.to_string()])
                    .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
                    .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
                    .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
                    .arg(env!("CARGO_BIN_EXE_disagmoe"));
                c
            }
            _ => bin(),
        };
        cmd.args(RUN)
            .args(size)
            .args(["--steps", &steps.to_string(), "--model-preset", preset])
            .args(placement)
            .args(extra);
        if matches!(self, Launch::Mpi) && workers > 1 {
            cmd.args(["--transport", "mpi"]);
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd
    }
}

/// Workers of a placement's arguments.
fn workers(args: &[&str]) -> usize {
    let value = |flag: &str| args.iter().position(|a| *a == flag).map(|i| args[i + 1].parse::<usize>().unwrap());
    match args.iter().position(|a| *a == "--placement").map(|i| args[i + 1]) {
        Some("single") | None => 1,
        Some("ep") => value("--workers").unwrap_or(4),
        _ => value("--attn-workers").unwrap_or(2) + value("--ffn-workers").unwrap_or(2),
    }
}

/// 10 steps straight vs `--stop-after 5` then `--resume` under the same placement (disagg 2+2 at
/// the small size): the same losses and every tensor bit-identical; the metrics name every step
/// once.
fn same_placement_is_bit_identical(launch: Launch, tmp: &Path) {
    for preset in PRESETS {
        stop_and_resume_bit_identically(launch, &tmp.join("disagg"), preset, DISAGG, SMALL, 10);
    }
}

/// `steps` steps straight vs `--stop-after` then `--resume` of `placement` at `size`: the same
/// losses and every tensor bit-identical; the metrics name every step once.
fn stop_and_resume_bit_identically(
    launch: Launch,
    tmp: &Path,
    preset: &str,
    placement: &[&str],
    size: &[&str],
    steps: usize,
) {
    assert!(steps >= 4, "a checkpoint, a stop after it and a step lost after the stop");
    std::fs::create_dir_all(tmp).unwrap();
    let (every, stop) = (steps / 2, steps / 2 + 2);
    let dir = |n: &str| tmp.join(format!("{preset}-{n}"));
    let train = |extra: &[&str]| summary(&launch.train_sized(size, preset, steps, placement, extra));
    let straight = train(&["--out", path(&dir("straight"))]);
    let ck = dir("ck");
    let out = dir("out");
    let (every_s, stop_s) = (every.to_string(), stop.to_string());
    let first = train(&[
        "--stop-after",
        &stop_s,
        "--checkpoint-every",
        &every_s,
        "--checkpoint-dir",
        path(&ck),
        "--out",
        path(&out),
    ]);
    assert_eq!(first["steps"], stop as u64);
    let name = |step: usize| format!("step-{step:08}");
    assert_eq!(checkpoints(&ck), [name(every), name(stop)]);
    // As if the job had died after its last step before that step's checkpoint: it resumes from
    // the one before, and the metrics of the steps in between are not left twice.
    std::fs::remove_dir_all(ck.join(name(stop))).unwrap();
    let resumed = train(&["--resume", path(&ck), "--out", path(&out)]);
    assert_eq!(resumed["resumed_from_step"], every as u64);
    assert_eq!(resumed["losses"], straight["losses"], "{preset}: losses of steps 1-{steps}");
    assert_eq!(resumed["param_checksum"], straight["param_checksum"], "{preset}");
    assert_bit_identical(preset, &out.join("final"), &dir("straight").join("final"));
    assert_eq!(metric_steps(&out), (1..=steps as u64).collect::<Vec<_>>(), "{preset}: every step once");
}

/// A checkpoint of one placement resumes under another: losses of steps 6-10 and every tensor
/// within 1e-5 of the straight run of the first placement. Returns the worst tensor error.
fn resharded_resume(launch: Launch, tmp: &Path, preset: &str, from: &[&str], to: &[&str], name: &str) -> f64 {
    let dir = |n: &str| tmp.join(format!("{preset}-{name}-{n}"));
    let straight = summary(&launch.train(preset, 10, from, &["--out", path(&dir("straight"))]));
    let ck = dir("ck");
    summary(&launch.train(preset, 10, from, &["--stop-after", "5", "--checkpoint-dir", path(&ck)]));
    let resumed = summary(&launch.train(preset, 10, to, &["--resume", path(&ck), "--out", path(&dir("resumed"))]));
    assert_eq!(resumed["resumed_from_step"], 5);
    let (a, b) = (losses(&resumed), losses(&straight));
    assert_eq!(a[..5], b[..5], "{preset} {name}: steps 1-5 come from the checkpoint");
    for (i, (x, y)) in a.iter().zip(&b).enumerate().skip(5) {
        assert!((x - y).abs() / y.abs() <= 1e-5, "{preset} {name}: step {} loss {x} vs {y}", i + 1);
    }
    // Weights: about ten times the worst measured over the six families and four transitions
    // (1.4e-7, tiny-deepseek-moe disagg 2+2 -> disagg 1+3; 2026-12-02).
    assert_close(&format!("{preset} {name}"), &dir("resumed").join("final"), &dir("straight").join("final"), 2e-6)
}

#[test]
fn stop_and_resume_under_the_same_placement_is_bit_identical() {
    let tmp = tempfile::tempdir().unwrap();
    same_placement_is_bit_identical(Launch::Local, tmp.path());
}

#[test]
fn checkpoints_resume_under_any_other_placement() {
    let tmp = tempfile::tempdir().unwrap();
    for preset in ALL_FAMILIES {
        resharded_resume(Launch::Local, tmp.path(), preset, DISAGG, EP, "disagg 2+2 -> ep 4");
        resharded_resume(Launch::Local, tmp.path(), preset, EP, SINGLE, "ep 4 -> single");
        resharded_resume(Launch::Local, tmp.path(), preset, DISAGG, DISAGG_1_3, "disagg 2+2 -> disagg 1+3");
        resharded_resume(Launch::Local, tmp.path(), preset, SINGLE, DISAGG_2_4, "single -> disagg 2+4 in 2 groups");
        // The distributed optimizer's shards over 4 copies -> 2 copies per group.
        resharded_resume(Launch::Local, tmp.path(), preset, EP, DISAGG_4_2, "ep 4 -> disagg 4+2 in 2 groups");
    }
}

/// Multi-token prediction (issue 38): a DeepSeek-V3 run with its MTP module stops and resumes bit
/// for bit under disagg 2+2 (the module's weights and both moments in the checkpoint, under the
/// Hub's layer names), and its checkpoint resumes under ep 4 (every worker a copy of the module)
/// within the resharding bound.
#[test]
fn multi_token_prediction_stops_and_resumes_exactly_and_reshards() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| tmp.path().join(n);
    let preset = "tiny-deepseek-v3";
    let train = |placement: &[&str], extra: &[&str]| {
        summary(&Launch::Local.train(preset, 6, placement, &[&["--mtp-depth", "1"][..], extra].concat()))
    };
    let straight = train(DISAGG, &["--out", path(&dir("straight"))]);
    let ck = dir("ck");
    train(DISAGG, &["--stop-after", "3", "--checkpoint-dir", path(&ck)]);
    let step = ck.join("step-00000003");
    for d in [step.clone(), step.join("exp_avg"), step.join("exp_avg_sq")] {
        assert!(tensors(&d).contains_key("model.layers.4.eh_proj.weight"), "{d:?} holds the MTP layer");
    }
    // (Each resume checkpoints elsewhere, so that both start from step 3.)
    let resumed =
        train(DISAGG, &["--resume", path(&ck), "--out", path(&dir("resumed")), "--checkpoint-dir", path(&dir("ck-a"))]);
    assert_eq!(resumed["losses"], straight["losses"]);
    assert_bit_identical("MTP disagg 2+2", &dir("resumed").join("final"), &dir("straight").join("final"));
    let ep = train(EP, &["--resume", path(&ck), "--out", path(&dir("ep")), "--checkpoint-dir", path(&dir("ck-b"))]);
    let (a, b) = (losses(&ep), losses(&straight));
    for (i, (x, y)) in a.iter().zip(&b).enumerate().skip(3) {
        assert!((x - y).abs() / y.abs() <= 1e-5, "MTP disagg 2+2 -> ep 4: step {} loss {x} vs {y}", i + 1);
    }
    assert_close("MTP disagg 2+2 -> ep 4", &dir("ep").join("final"), &dir("straight").join("final"), 2e-6);
}

/// A placement with redundant experts (EPLB's balanced placement for a Zipf(1.2) load, two extra
/// replicas per layer): stopped and resumed the same way, the same run to the bit; its checkpoint
/// (a replicated expert written once, stacked rows from several runs of one holder) resumes under
/// a contiguous placement, and a contiguous one's under replicas, within the resharding bound.
/// Per-expert modules (Qwen3-MoE) and stacked fused experts (GPT-OSS).
#[test]
fn redundant_experts_stop_resume_and_reshard() {
    let tmp = tempfile::tempdir().unwrap();
    let replicated: &[&str] =
        &["--placement", "ep", "--workers", "4", "--redundant-experts", "2", "--expert-load", "zipf:1.2"];
    let disagg_replicated: &[&str] = &[
        "--placement",
        "disagg",
        "--attn-workers",
        "1",
        "--ffn-workers",
        "3",
        "--groups",
        "1",
        "--redundant-experts",
        "2",
        "--expert-load",
        "zipf:1.2",
    ];
    for preset in ["tiny-qwen3-moe", "tiny-gpt-oss"] {
        stop_and_resume_bit_identically(Launch::Local, &tmp.path().join("same"), preset, replicated, SMALL, 8);
        resharded_resume(Launch::Local, tmp.path(), preset, replicated, DISAGG, "ep 4 with replicas -> disagg 2+2");
        resharded_resume(
            Launch::Local,
            tmp.path(),
            preset,
            DISAGG,
            disagg_replicated,
            "disagg 2+2 -> disagg 1+3 with replicas",
        );
    }
}

/// A checkpoint keeps the expert placement it was written under (`expert_placement.json`): a
/// resume with the same placement options continues under it, bit for bit, even when the load
/// file it was computed from has changed since (as a run's own growing metrics.jsonl does); a
/// resume with other options places the experts anew (resharded: the same math). The placement is
/// in the summary and on the first step of each start in metrics.jsonl.
#[test]
fn a_resume_keeps_the_checkpoint_s_expert_placement_unless_its_options_change() {
    let tmp = tempfile::tempdir().unwrap();
    let preset = "tiny-qwen3-moe";
    let load = tmp.path().join("load.jsonl");
    // A measured load: 8 experts in each of the 4 MoE layers, expert e with (e + 1)^3 copies, or
    // the reverse.
    let write_load = |reverse: bool| {
        let counts: Vec<usize> = (0..8).map(|e| if reverse { 8 - e } else { e + 1 }).map(|x| x * x * x).collect();
        let layers: Vec<serde_json::Value> =
            (0..4).map(|l| serde_json::json!({"layer": l, "tokens_per_expert": counts})).collect();
        std::fs::write(&load, serde_json::json!({"expert_load": layers}).to_string() + "\n").unwrap();
    };
    write_load(false);
    let ep: &[&str] =
        &["--placement", "ep", "--workers", "4", "--redundant-experts", "2", "--expert-load", path(&load)];
    let dir = |n: &str| tmp.path().join(n);
    let straight = summary(&train(preset, 6, ep, &["--out", path(&dir("straight"))]));
    let placed = straight["expert_placement"].clone();
    assert_eq!(placed.as_object().map(|m| m.len()), Some(4), "{placed}");
    let ck = dir("ck");
    let first = summary(&train(
        preset,
        6,
        ep,
        &["--stop-after", "4", "--checkpoint-every", "2", "--checkpoint-dir", path(&ck), "--out", path(&dir("out"))],
    ));
    assert_eq!(first["expert_placement"], placed);
    assert!(ck.join("step-00000004/expert_placement.json").is_file());
    // The load file changes (its hot experts are now the others): the resume keeps the placement.
    write_load(true);
    let ck_again = dir("ck-again");
    assert!(Command::new("cp").arg("-r").arg(&ck).arg(&ck_again).status().unwrap().success());
    let resumed = summary(&train(preset, 6, ep, &["--resume", path(&ck), "--out", path(&dir("out"))]));
    assert_eq!(resumed["expert_placement"], placed, "the checkpoint's placement");
    assert_eq!(resumed["losses"], straight["losses"]);
    assert_eq!(resumed["param_checksum"], straight["param_checksum"]);
    assert_bit_identical(preset, &dir("out").join("final"), &dir("straight").join("final"));
    let records: Vec<serde_json::Value> = std::fs::read_to_string(dir("out").join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let marked: Vec<u64> =
        records.iter().filter(|r| r.get("expert_placement").is_some()).map(|r| r["step"].as_u64().unwrap()).collect();
    assert_eq!(marked, [1, 5], "the first step of each start");
    assert_eq!(records[4]["expert_placement"], placed);
    // Other options: placed anew from the (changed) load, the same math within tolerance.
    let other: &[&str] =
        &["--placement", "ep", "--workers", "4", "--redundant-experts", "1", "--expert-load", path(&load)];
    let anew = summary(&train(preset, 6, other, &["--resume", path(&ck_again), "--out", path(&dir("anew"))]));
    assert_ne!(anew["expert_placement"], placed);
    for (a, b) in losses(&anew).iter().zip(losses(&straight)) {
        assert!((a - b).abs() < 1e-5, "{:?} vs {:?}", losses(&anew), losses(&straight));
    }
}

/// Rebalancing during a run (`--rebalance-every 2`) resumes exactly from any step: the checkpoint
/// keeps the placement in effect and the moving average of the expert loads the next re-placement
/// starts from (`expert_placement.json`), so a resume from the step after a re-placement (3) or
/// from one that made one (4) continues bit for bit as the uninterrupted run: the same losses,
/// placements and final model.
#[test]
fn rebalancing_resumes_exactly_in_the_middle_of_its_schedule() {
    let tmp = tempfile::tempdir().unwrap();
    let preset = "tiny-gpt-oss";
    let opts: &[&str] = &[DISAGG_1_3, &["--redundant-experts", "2", "--rebalance-every", "2"]].concat();
    let dir = |n: &str| tmp.path().join(n);
    let straight = summary(&train(preset, 7, opts, &["--out", path(&dir("straight"))]));
    let records = |out: &Path| -> Vec<serde_json::Value> {
        let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
    };
    let placements = |r: &[serde_json::Value]| -> Vec<(u64, serde_json::Value)> {
        r.iter().filter_map(|r| Some((r["step"].as_u64()?, r.get("expert_placement")?.clone()))).collect()
    };
    let want = placements(&records(&dir("straight")));
    let ck = dir("ck");
    summary(&train(
        preset,
        7,
        opts,
        &["--stop-after", "4", "--checkpoint-every", "1", "--checkpoint-dir", path(&ck), "--out", path(&dir("first"))],
    ));
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ck.join("step-00000003/expert_placement.json")).unwrap())
            .unwrap();
    assert_eq!(saved["loads"].as_object().map(|m| m.len()), Some(4), "the moving average of each MoE layer: {saved}");
    for from in [3, 4] {
        // A directory holding the checkpoint of step `from` only.
        let ck_from = dir(&format!("ck-{from}"));
        std::fs::create_dir_all(&ck_from).unwrap();
        let name = format!("step-{from:08}");
        assert!(Command::new("cp").arg("-r").arg(ck.join(&name)).arg(&ck_from).status().unwrap().success());
        let out = dir(&format!("resumed-{from}"));
        let resumed = summary(&train(preset, 7, opts, &["--resume", path(&ck_from), "--out", path(&out)]));
        let what = format!("resumed from step {from}");
        assert_eq!(resumed["losses"], straight["losses"], "{what}");
        assert_eq!(resumed["param_checksum"], straight["param_checksum"], "{what}");
        assert_eq!(resumed["expert_placement"], straight["expert_placement"], "{what}");
        assert_bit_identical(&what, &out.join("final"), &dir("straight").join("final"));
        // The placements from the resume on are the straight run's: on the first step the one in
        // effect after it (the checkpoint's, unless that step re-places), then those of the same
        // re-placements.
        let got = placements(&records(&out));
        let first = from as u64 + 1;
        let mut expected: Vec<_> = want.iter().filter(|(s, _)| *s >= first).cloned().collect();
        if expected.first().map(|(s, _)| *s) != Some(first) {
            let in_effect = want.iter().rev().find(|(s, _)| *s < first).map(|(_, p)| p.clone()).unwrap();
            expected.insert(0, (first, in_effect));
        }
        assert_eq!(got, expected, "{what}");
    }
}

/// A worker killed (SIGKILL) at `at` while the checkpoint of step 4 is written: the newest complete
/// checkpoint verifies and the run resumes from it to the same end as a straight run, bit for bit.
fn killed_while_checkpointing(launch: Launch, tmp: &Path) {
    let preset = "tiny-qwen3-moe";
    let straight_out = tmp.join("straight");
    let straight = summary(&launch.train(preset, 6, DISAGG, &["--out", path(&straight_out)]));
    for (worker, at) in [(1, "writing"), (3, "written"), (0, "indexed"), (0, "committed")] {
        let ck = tmp.join(format!("ck-{worker}-{at}"));
        let faults = format!(r#"{{"kill_in_checkpoint": {{"worker": {worker}, "step": 4, "at": "{at}"}}}}"#);
        let cmd = launch.command(
            preset,
            6,
            DISAGG,
            &["--checkpoint-every", "2", "--checkpoint-dir", path(&ck)],
            &[("DISAGMOE_TEST_FAULTS", &faults)],
        );
        let out = run_bounded(cmd);
        assert!(!out.status.success(), "{at}: the run was killed");
        let complete = checkpoints(&ck);
        let want: &[&str] = if at == "committed" { &["step-00000002", "step-00000004"] } else { &["step-00000002"] };
        assert_eq!(complete, want, "{at}: only committed checkpoints look complete");
        let resume_out = tmp.join(format!("out-{worker}-{at}"));
        let resumed = summary(&launch.train(preset, 6, DISAGG, &["--resume", path(&ck), "--out", path(&resume_out)]));
        let from = if at == "committed" { 4 } else { 2 };
        assert_eq!(resumed["resumed_from_step"], from, "{at}");
        assert_eq!(resumed["losses"], straight["losses"], "{at}");
        assert_bit_identical(at, &resume_out.join("final"), &straight_out.join("final"));
    }
}

#[test]
fn a_worker_killed_while_checkpointing_never_leaves_a_checkpoint_that_is_chosen_and_bad() {
    let tmp = tempfile::tempdir().unwrap();
    killed_while_checkpointing(Launch::Local, tmp.path());
}

/// Disagg with two attention copies in one group (a poisoned attention-side gradient reaches the
/// other copy through their all-reduce, as a real one would).
const DISAGG_COPIES: &[&str] = &["--placement", "disagg", "--attn-workers", "2", "--ffn-workers", "2", "--groups", "1"];

/// Where a non-finite gradient is injected (test-only hook), by placement: an attention-side tensor
/// replicated over copies, a per-expert tensor one worker holds, and GPT-OSS's stacked experts
/// whose rows every ep worker holds a share of.
const NON_FINITE_CASES: [(&str, &str, &[&str], &str); 4] = [
    ("single", "tiny-qwen3-moe", SINGLE, "model.layers.1.mlp.gate.weight"),
    ("disagg 2+2 in one group", "tiny-qwen3-moe", DISAGG_COPIES, "model.layers.1.mlp.gate.weight"),
    ("ep 4, one expert", "tiny-qwen3-moe", EP, "model.layers.1.mlp.experts.5.down_proj.weight"),
    ("ep 4, stacked experts", "tiny-gpt-oss", EP, "model.layers.2.mlp.experts.gate_up_proj"),
];

/// A gradient made NaN at step 3 of 4 (`inject_nonfinite`, set through the environment): under
/// `skip` (the default) the update of step 3 is skipped on every worker, so the checkpoints of
/// steps 2 and 3 hold the same weights and AdamW moments bit for bit; metrics.jsonl and the
/// summary count the skipped step, and step 4 updates again. Under `abort` every process ends
/// with one error line naming the step and the workers that hold the tensor (in-process, the one
/// line names the tensor too), none panics.
fn non_finite_gradients_skip_or_abort(launch: Launch, tmp: &Path) {
    for (name, preset, placement, tensor) in NON_FINITE_CASES {
        let dir = tmp.join(name.replace([' ', ','], "-"));
        let (ck, out) = (dir.join("ck"), dir.join("out"));
        let faults = format!(r#"{{"inject_nonfinite": {{"step": 3, "tensor": "{tensor}"}}}}"#);
        let env = [("DISAGMOE_TEST_FAULTS", faults.as_str())];
        let every = ["--checkpoint-dir", path(&ck), "--checkpoint-every", "1", "--keep-checkpoints", "4"];
        let s = summary(&run_bounded(launch.command(
            preset,
            4,
            placement,
            &[&every[..], &["--out", path(&out)]].concat(),
            &env,
        )));
        assert_eq!(s["skipped_steps"], 1, "{name}: {s}");
        assert!(losses(&s).iter().all(|l| l.is_finite()), "{name}: only a gradient was poisoned: {s}");
        let skipped: Vec<bool> = std::fs::read_to_string(out.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["skipped"].as_bool().unwrap())
            .collect();
        assert_eq!(skipped, [false, false, true, false], "{name}: metrics.jsonl's skipped flags");
        let step = |n: usize| ck.join(format!("step-{n:08}"));
        for part in ["", "exp_avg", "exp_avg_sq"] {
            let what = format!("{name}: {} after the skipped step 3", if part.is_empty() { "weights" } else { part });
            assert_bit_identical(&what, &step(3).join(part), &step(2).join(part));
        }
        let (before, after) = (tensors(&step(3)), tensors(&step(4)));
        let moved = before.iter().filter(|(n, v)| after[*n] != **v).count();
        assert!(moved > 0, "{name}: step 4 updates the weights again");

        let abort = run_bounded(launch.command(preset, 4, placement, &["--on-nonfinite", "abort"], &env));
        let err = String::from_utf8_lossy(&abort.stderr);
        assert!(!abort.status.success(), "{name}: abort mode fails the run: {err}");
        assert!(!err.contains("panicked"), "{name}: no panic: {err}");
        let lines: Vec<&str> = err.lines().filter(|l| l.contains("non-finite")).collect();
        assert!(
            !lines.is_empty() && lines.iter().all(|l| l.contains("non-finite gradient at step 3")),
            "{name}: {err}"
        );
        // Every process's line says which workers hold the tensor (only a holder can name it).
        if workers(placement) > 1 {
            assert!(lines.iter().all(|l| l.contains("(held by worker")), "{name}: {err}");
        }
        if matches!(launch, Launch::Local) {
            assert_eq!(lines.len(), 1, "{name}: one line: {err}");
            assert!(lines[0].contains(tensor), "{name}: the line names the tensor: {err}");
        }
    }
}

#[test]
fn non_finite_gradients_are_skipped_on_every_worker_or_abort_every_worker() {
    let tmp = tempfile::tempdir().unwrap();
    non_finite_gradients_skip_or_abort(Launch::Local, tmp.path());
}

#[test]
fn a_resume_under_other_settings_is_refused_naming_them() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    let preset = "tiny-qwen3-moe";
    let resume = |steps: &str, seq: &str, extra: &[&str]| {
        bin()
            .args(["train", "--quiet", "--batch", "8", "--micro-batches", "4", "--model-preset", preset])
            .args(["--steps", steps, "--seq", seq, "--resume", path(&ck)])
            .args(EP)
            .args(extra)
            .output()
            .unwrap()
    };
    summary(&train(preset, 4, DISAGG, &["--stop-after", "2", "--checkpoint-dir", path(&ck)]));
    for (out, named, now) in [
        (resume("4", "32", &["--seed", "7"]), "--seed 42", "--seed 7"),
        (resume("4", "16", &[]), "--seq 32", "--seq 16"),
        (resume("8", "32", &[]), "--steps 4", "--steps 8"),
        // f32 moments rounded to bf16 would not continue the run the checkpoint was part of.
        (
            resume("4", "32", &["--optimizer-state-dtype", "bf16"]),
            "--optimizer-state-dtype f32",
            "--optimizer-state-dtype bf16",
        ),
    ] {
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{now}: {err}");
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{now}: one line: {err}");
        assert!(lines[0].contains(named) && lines[0].contains(now), "{now}: {err}");
        assert!(lines[0].contains("--allow-change"), "{now}: says how to accept the change: {err}");
    }
    // A deliberate change, said so: extending the run (under another placement too).
    let s = summary(&resume("5", "32", &["--allow-change", "steps"]));
    assert_eq!(s["steps"], 5);
    // Moments to bf16 on purpose (and one more step).
    let bf16 =
        ["--optimizer-state-dtype", "bf16", "--allow-change", "optimizer_state_dtype", "--allow-change", "steps"];
    let s = summary(&resume("6", "32", &bf16));
    assert_eq!((s["steps"].as_u64(), s["resumed_from_step"].as_u64()), (Some(6), Some(5)));
    let out = resume("6", "32", &["--allow-change", "placement"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("allowed: seed, seq, batch, data, steps, schedule, optimizer_state_dtype"));
}

/// AdamW's moments in bf16 (`--optimizer-state-dtype bf16`), sharded by the distributed optimizer
/// (disagg 4+2 in two groups): stopped and resumed, the same run to the bit (a checkpoint holds the
/// bf16 values exactly, in f32).
#[test]
fn bf16_moments_stop_and_resume_bit_identically() {
    let tmp = tempfile::tempdir().unwrap();
    let placement = [DISAGG_4_2, &["--optimizer-state-dtype", "bf16"]].concat();
    stop_and_resume_bit_identically(Launch::Local, tmp.path(), "tiny-qwen3-moe", &placement, SMALL, 6);
}

/// bf16 working weights (`--precision bf16`): a checkpoint holds the f32 master weights (under
/// disagg 4+2 in two groups, gathered from the distributed optimizer's shards), so stopped and
/// resumed is the same run to the bit, on one device and on six workers.
#[test]
fn bf16_weights_stop_and_resume_bit_identically() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, placement) in [("single", SINGLE), ("disagg", DISAGG_4_2)] {
        let placement = [placement, &["--precision", "bf16"]].concat();
        stop_and_resume_bit_identically(Launch::Local, &tmp.path().join(name), "tiny-qwen3-moe", &placement, SMALL, 6);
    }
}

#[test]
fn sigterm_finishes_the_step_checkpoints_and_exits_zero() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, placement) in [("disagg", DISAGG), ("ep", EP)] {
        let ck = tmp.path().join(name);
        let child = bin()
            .args(RUN)
            .args(["--steps", "100000", "--model-preset", "tiny-qwen3-moe", "--checkpoint-dir", path(&ck)])
            .args(placement)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(3000));
        assert!(Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap().success());
        let t0 = Instant::now();
        let out = child.wait_with_output().unwrap();
        assert!(t0.elapsed() < Duration::from_secs(60), "{name}: it ended soon after the signal");
        let s = summary(&out);
        assert_eq!(s["stopped_early"], true, "{name}");
        let steps = s["steps"].as_u64().unwrap();
        assert_eq!(checkpoints(&ck).last().map(String::as_str), Some(format!("step-{steps:08}").as_str()), "{name}");
    }
}

/// The checkpoint of a disaggregated run is a Hugging Face directory (config, index, shards) with
/// the moments laid out the same way beside it, and the state names the run's settings.
#[test]
fn a_distributed_checkpoint_is_a_hugging_face_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    summary(&train("tiny-gpt-oss", 2, DISAGG, &["--checkpoint-dir", path(&ck)]));
    let step: PathBuf = ck.join("step-00000002");
    for f in [
        "config.json",
        "model.safetensors.index.json",
        "state.json",
        "manifest.json",
        "exp_avg/model.safetensors.index.json",
        "exp_avg_sq/config.json",
    ] {
        assert!(step.join(f).exists(), "{f}");
    }
    let names = tensors(&step);
    assert_eq!(tensors(&step.join("exp_avg")).keys().collect::<Vec<_>>(), names.keys().collect::<Vec<_>>());
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(step.join("state.json")).unwrap()).unwrap();
    assert_eq!(state["written_by"], "disagg 2+2 in 2 groups");
    assert_eq!(state["settings"]["seq"], 32);
}

/// The dtype names in a safetensors file's header, and the `torch_dtype` of `config.json`.
fn saved_dtypes(dir: &Path) -> (Vec<String>, String) {
    let mut dtypes = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let p = entry.unwrap().path();
        if p.extension().is_some_and(|e| e == "safetensors") {
            let bytes = std::fs::read(&p).unwrap();
            let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
            for (name, t) in header.as_object().unwrap() {
                if name != "__metadata__" {
                    dtypes.push(t["dtype"].as_str().unwrap().to_owned());
                }
            }
        }
    }
    dtypes.sort();
    dtypes.dedup();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    (dtypes, config["torch_dtype"].as_str().unwrap_or_default().to_owned())
}

/// `--save-dtype bf16|f16`: the final model, written by one device or by every worker of a
/// disaggregated run (GPT-OSS: stacked expert rows written by their holders), is the f32 model
/// rounded to nearest even, says so in `config.json`, and trains on from `--model-dir`.
#[test]
fn the_final_model_saved_in_bf16_or_f16_is_the_f32_model_rounded() {
    let tmp = tempfile::tempdir().unwrap();
    for (placement, name) in [(SINGLE, "single"), (DISAGG, "disagg")] {
        let out = |dtype: &str| tmp.path().join(format!("{name}-{dtype}"));
        for dtype in ["f32", "bf16", "f16"] {
            summary(&train("tiny-gpt-oss", 2, placement, &["--out", path(&out(dtype)), "--save-dtype", dtype]));
        }
        let full = tensors(&out("f32").join("final"));
        for (dtype, header, torch) in [("bf16", "BF16", "bfloat16"), ("f16", "F16", "float16")] {
            let dir = out(dtype).join("final");
            assert_eq!(saved_dtypes(&dir), (vec![header.to_owned()], torch.to_owned()), "{name} {dtype}");
            let low = tensors(&dir);
            assert_eq!(low.keys().collect::<Vec<_>>(), full.keys().collect::<Vec<_>>(), "{name} {dtype}");
            for (tensor, values) in &full {
                let round = |x: f32| match dtype {
                    "bf16" => half::bf16::from_f32(x).to_f32(),
                    _ => half::f16::from_f32(x).to_f32(),
                };
                let want: Vec<f32> = values.iter().map(|&x| round(x)).collect();
                assert!(low[tensor] == want, "{name} {dtype}: {tensor} is not the f32 values rounded");
            }
        }
        assert_eq!(saved_dtypes(&out("f32").join("final")), (vec!["F32".to_owned()], "float32".to_owned()));
        let from = out("bf16").join("final");
        summary(&train("tiny-gpt-oss", 1, SINGLE, &["--model-dir", path(&from)]));
    }
}

/// Under `mpirun`: ignored (and said so) when built without the `mpi` feature or on a machine
/// without `mpirun` (see build-support/probe.rs).
mod mpi {
    use super::*;
    use mpirun::{children, wait_job};

    #[test]
    #[cfg_attr(not(feature = "mpi"), ignore = "built without --features mpi (the MPI transport)")]
    #[cfg_attr(
        all(feature = "mpi", disagmoe_no_mpi),
        ignore = "no mpirun on this machine (apt-get install openmpi-bin)"
    )]
    fn mpi_stop_and_resume_is_bit_identical() {
        let tmp = tempfile::tempdir().unwrap();
        same_placement_is_bit_identical(Launch::Mpi, tmp.path());
    }

    #[test]
    #[cfg_attr(not(feature = "mpi"), ignore = "built without --features mpi (the MPI transport)")]
    #[cfg_attr(
        all(feature = "mpi", disagmoe_no_mpi),
        ignore = "no mpirun on this machine (apt-get install openmpi-bin)"
    )]
    fn mpi_checkpoints_resume_under_other_placements() {
        let tmp = tempfile::tempdir().unwrap();
        for preset in PRESETS {
            resharded_resume(Launch::Mpi, tmp.path(), preset, DISAGG, EP, "mpi disagg 2+2 -> mpi ep 4");
            resharded_resume(Launch::Mpi, tmp.path(), preset, EP, SINGLE, "mpi ep 4 -> single");
            resharded_resume(
                Launch::Mpi,
                tmp.path(),
                preset,
                SINGLE,
                DISAGG_2_4,
                "single -> mpi disagg 2+4 in 2 groups",
            );
        }
    }

    /// Expert parallelism under MPI at the tiny presets' default size (where its messages once
    /// failed to decode): stopped and resumed bit-identically, as local ep is, and within 1e-5 of
    /// local ep's model (not to the bit: `MPI_Allreduce` adds the data-parallel copies' gradients
    /// in its own order, the in-process ring in another).
    #[test]
    #[cfg_attr(not(feature = "mpi"), ignore = "built without --features mpi (the MPI transport)")]
    #[cfg_attr(
        all(feature = "mpi", disagmoe_no_mpi),
        ignore = "no mpirun on this machine (apt-get install openmpi-bin)"
    )]
    fn mpi_ep_at_the_default_size_stops_and_resumes_as_local_ep_does() {
        let tmp = tempfile::tempdir().unwrap();
        for preset in PRESETS {
            for (launch, name) in [(Launch::Mpi, "mpi"), (Launch::Local, "local")] {
                stop_and_resume_bit_identically(launch, &tmp.path().join(name), preset, EP, DEFAULT_SIZE, 4);
            }
            let final_of = |name: &str| tmp.path().join(name).join(format!("{preset}-out")).join("final");
            assert_close(&format!("{preset}: mpi ep vs local ep"), &final_of("mpi"), &final_of("local"), 1e-5);
        }
    }

    #[test]
    #[cfg_attr(not(feature = "mpi"), ignore = "built without --features mpi (the MPI transport)")]
    #[cfg_attr(
        all(feature = "mpi", disagmoe_no_mpi),
        ignore = "no mpirun on this machine (apt-get install openmpi-bin)"
    )]
    fn mpi_non_finite_gradients_are_skipped_on_every_rank_or_abort_every_rank() {
        let tmp = tempfile::tempdir().unwrap();
        non_finite_gradients_skip_or_abort(Launch::Mpi, tmp.path());
    }

    /// SIGUSR1 to `mpirun` (which forwards it to every rank; SIGTERM makes Open MPI kill them)
    /// finishes the step, checkpoints and exits 0.
    #[test]
    #[cfg_attr(not(feature = "mpi"), ignore = "built without --features mpi (the MPI transport)")]
    #[cfg_attr(
        all(feature = "mpi", disagmoe_no_mpi),
        ignore = "no mpirun on this machine (apt-get install openmpi-bin)"
    )]
    fn mpi_sigusr1_to_mpirun_finishes_the_step_checkpoints_and_exits_zero() {
        let tmp = tempfile::tempdir().unwrap();
        let (ck, out_dir) = (tmp.path().join("ck"), tmp.path().join("out"));
        let child = Launch::Mpi
            .command("tiny-qwen3-moe", 100_000, DISAGG, &["--checkpoint-dir", path(&ck), "--out", path(&out_dir)], &[])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Signal once a step is done: every rank has installed its handler by then.
        let t0 = Instant::now();
        while std::fs::read_to_string(out_dir.join("metrics.jsonl")).map_or(true, |m| m.is_empty()) {
            assert!(t0.elapsed() < Duration::from_secs(120), "no step within 2 minutes");
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(Command::new("kill").args(["-USR1", &child.id().to_string()]).status().unwrap().success());
        let out = wait_job(child, Duration::from_secs(300));
        let s = summary(&out);
        assert_eq!(s["stopped_early"], true);
        let steps = s["steps"].as_u64().unwrap();
        assert_eq!(checkpoints(&ck).last().map(String::as_str), Some(format!("step-{steps:08}").as_str()));
    }

    /// Chaos: a disagg 2+2 job of 60 steps under `mpirun`, checkpointing every 5, loses a random
    /// rank (SIGKILL) at a random moment, resumes from the newest checkpoint, and so on until it
    /// ends, with at least 5 kills; its losses and final model equal the uninterrupted run's, bit for bit. Seeded
    /// (`DISAGMOE_CHAOS_SEED`, default 7): the kill plan is printed and reproducible.
    #[test]
    #[cfg_attr(not(feature = "mpi"), ignore = "built without --features mpi (the MPI transport)")]
    #[cfg_attr(
        all(feature = "mpi", disagmoe_no_mpi),
        ignore = "no mpirun on this machine (apt-get install openmpi-bin)"
    )]
    fn mpi_chaos_kills_and_resumes_end_where_a_straight_run_ends() {
        const STEPS: usize = 60;
        const KILLS: usize = 5;
        let preset = "tiny-qwen3-moe";
        let seed: u64 = std::env::var("DISAGMOE_CHAOS_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(7);
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut rand = move |n: u64| {
            // xorshift64*: enough to spread the kills, the same for the same seed.
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) % n
        };
        let tmp = tempfile::tempdir().unwrap();
        let straight_out = tmp.path().join("straight");
        let straight = summary(&Launch::Mpi.train(preset, STEPS, DISAGG, &["--out", path(&straight_out)]));

        let (ck, out_dir) = (tmp.path().join("ck"), tmp.path().join("out"));
        let ck_args = ["--checkpoint-dir", path(&ck), "--checkpoint-every", "5", "--out", path(&out_dir)];
        let lines = || std::fs::read_to_string(out_dir.join("metrics.jsonl")).map_or(0, |m| m.lines().count());
        let (mut kills, mut launches) = (Vec::new(), 0);
        let last = loop {
            launches += 1;
            assert!(launches <= 40, "no end after {launches} launches; kills: {kills:?}");
            let mut args = ck_args.to_vec();
            if !checkpoints(&ck).is_empty() {
                args.extend(["--resume", path(&ck)]);
            }
            let mut child = Launch::Mpi
                .command(preset, STEPS, DISAGG, &args, &[])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            if kills.len() < KILLS {
                // Let 1-7 more steps happen (or none, a third of the time: a kill during start-up
                // or the resume), then wait up to 100 ms more and kill one rank: kills land before
                // and after checkpoints, and the job cannot finish before the fifth.
                let at_launch = lines();
                let more = if rand(3) == 0 { 0 } else { 1 + rand(7) as usize };
                let t0 = Instant::now();
                while (children(child.id()).len() < 4 || lines() < at_launch + more)
                    && child.try_wait().unwrap().is_none()
                {
                    assert!(t0.elapsed() < Duration::from_secs(120), "no progress within 2 minutes");
                    std::thread::sleep(Duration::from_millis(5));
                }
                std::thread::sleep(Duration::from_millis(rand(100)));
                let ranks = children(child.id());
                if child.try_wait().unwrap().is_none() && ranks.len() == 4 {
                    let victim = rand(4) as usize;
                    let _ = Command::new("kill").args(["-KILL", &ranks[victim].to_string()]).status();
                    let out = wait_job(child, Duration::from_secs(60));
                    assert!(!out.status.success(), "the job survived the loss of a rank");
                    let step = metric_steps_or_none(&out_dir);
                    eprintln!("kill {}: rank {victim} near step {step:?} ({more} steps in)", kills.len() + 1);
                    kills.push((victim, step));
                    continue;
                }
            }
            let out = wait_job(child, Duration::from_secs(600));
            break summary(&out);
        };
        eprintln!("seed {seed}: {} kills in {launches} launches: {kills:?}", kills.len());
        assert!(kills.len() >= KILLS, "only {} kills: {kills:?}", kills.len());
        assert_eq!(last["steps"], STEPS as u64);
        // A same-placement resume is bit-identical, so after every kill and resume as well: the
        // same losses of every step and every tensor to the bit. (Not checked: metrics.jsonl
        // once per step. A job killed before its first checkpoint starts afresh and appends to
        // the metrics of the killed launch.)
        assert_eq!(last["losses"], straight["losses"], "chaos vs straight: losses of steps 1-{STEPS}");
        assert_bit_identical("chaos vs straight", &out_dir.join("final"), &straight_out.join("final"));
    }

    /// The last step in a metrics file, if any.
    fn metric_steps_or_none(out: &Path) -> Option<u64> {
        std::fs::read_to_string(out.join("metrics.jsonl"))
            .ok()?
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["step"].as_u64())
            .last()
    }

    #[test]
    #[cfg_attr(not(feature = "mpi"), ignore = "built without --features mpi (the MPI transport)")]
    #[cfg_attr(
        all(feature = "mpi", disagmoe_no_mpi),
        ignore = "no mpirun on this machine (apt-get install openmpi-bin)"
    )]
    fn mpi_rank_killed_while_checkpointing() {
        let tmp = tempfile::tempdir().unwrap();
        killed_while_checkpointing(Launch::Mpi, tmp.path());
    }
}
