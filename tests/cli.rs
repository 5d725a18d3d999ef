//! End-to-end tests of the `disagmoe` command: forward against transformers' logits, a short
//! training run, run-config files, and clear errors on bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_disagmoe"))
}

/// `disagmoe forward --model-dir DIR --input-ids IDS --out OUT`.
fn forward(dir: &Path, ids: &Path, out: &Path) -> Output {
    bin().arg("forward").arg("--model-dir").arg(dir).arg("--input-ids").arg(ids).arg("--out").arg(out).output().unwrap()
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/qwen3_moe").join(name)
}

fn stdout_last_json(out: &Output) -> serde_json::Value {
    let text = String::from_utf8_lossy(&out.stdout);
    let last =
        text.lines().last().unwrap_or_else(|| panic!("no stdout; stderr: {}", String::from_utf8_lossy(&out.stderr)));
    serde_json::from_str(last).unwrap_or_else(|e| panic!("last line is not JSON ({e}): {last}"))
}

fn read_f32(path: &Path, name: &str) -> (Vec<usize>, Vec<f32>) {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), safetensors::Dtype::F32);
    (t.shape().to_vec(), t.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect())
}

fn reference_ids(dir: &Path) -> Vec<Vec<i64>> {
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("input_ids").unwrap();
    let s = t.shape()[1];
    let v: Vec<i64> = t.data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
    v.chunks(s).map(<[i64]>::to_vec).collect()
}

fn fails_with(out: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "expected exit 2; stderr: {err}");
    assert!(err.contains(needle), "stderr should mention {needle:?}: {err}");
    assert!(!err.contains("panicked") && !err.contains("RUST_BACKTRACE"), "no panic: {err}");
}

#[test]
fn forward_matches_transformers_logits_and_loss() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures");
    for dir in [
        fixture("gqa2_norm_topk"),
        fixture("gqa4_no_norm_tied_window"),
        root.join("gpt_oss/gqa2_window_yarn_clamp"),
        root.join("gpt_oss/mxfp4"),
        root.join("deepseek_v3/qlora_yarn_interleave"),
        root.join("deepseek_v3/plain_q_groups_tied"),
    ] {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let tmp = tempfile::tempdir().unwrap();
        let ids = tmp.path().join("ids.json");
        std::fs::write(&ids, serde_json::to_string(&reference_ids(&dir)).unwrap()).unwrap();
        let logits = tmp.path().join("out/logits.safetensors");
        let out = forward(&dir, &ids, &logits);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let (shape, ours) = read_f32(&logits, "logits");
        let (ref_shape, reference) = read_f32(&dir.join("reference.safetensors"), "logits");
        assert_eq!(shape, ref_shape);
        let num: f64 = ours.iter().zip(&reference).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
        let den: f64 = reference.iter().map(|b| (*b as f64).powi(2)).sum();
        // Ten times the worst measured over the parity fixtures (5.2e-7).
        assert!((num / den).sqrt() <= 5e-6, "{name}: logits relative error {}", (num / den).sqrt());
        let loss = stdout_last_json(&out)["loss"].as_f64().unwrap();
        let (_, lm) = read_f32(&dir.join("reference.safetensors"), "lm_loss");
        assert!((loss - lm[0] as f64).abs() < 1e-4, "{name}: loss {loss} vs transformers' {}", lm[0]);
    }
}

#[test]
fn train_runs_writes_metrics_and_a_loadable_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run.toml");
    std::fs::write(&run, "steps = 3\nbatch = 2\nseq = 32\nlr = 0.002\nwarmup_steps = 1\n").unwrap();
    let out = bin()
        .args(["train", "--quiet", "--run-config"])
        .arg(&run)
        .args(["--steps", "4", "--out"])
        .arg(tmp.path().join("out"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let summary = stdout_last_json(&out);
    assert_eq!(summary["steps"], 4, "the flag overrides the file");
    assert_eq!(summary["losses"].as_array().unwrap().len(), 4);
    for key in ["first_loss", "last_loss", "tokens_per_s"] {
        assert!(summary[key].as_f64().unwrap() > 0.0, "{key}");
    }
    // Which implementation each family ran: on the CPU backend, our fused operations.
    let kernels = &summary["kernels"];
    for family in ["attention", "experts", "dispatch", "norms", "loss", "optimizer"] {
        assert_eq!(kernels[family], "fused-cpu", "{family}: {kernels}");
    }
    let metrics = std::fs::read_to_string(tmp.path().join("out/metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = metrics.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 4);
    assert_eq!(lines[0]["tokens"], 64);
    assert_eq!(lines[0]["expert_load"].as_array().unwrap().len(), 4, "one load record per MoE layer");
    // The final checkpoint loads again and continues training; with the kernels switched off the
    // summary says every family ran the reference.
    let out = bin()
        .env("DISAGMOE_KERNELS", "reference")
        .args(["train", "--quiet", "--json", "--steps", "1", "--batch", "1", "--seq", "16", "--model-dir"])
        .arg(tmp.path().join("out/final"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let kernels = &stdout_last_json(&out)["kernels"];
    for family in ["attention", "experts", "dispatch", "norms"] {
        assert_eq!(kernels[family], "reference", "{family}: {kernels}");
    }
}

#[test]
fn same_seed_same_losses() {
    let run = || {
        let out = bin()
            .args(["train", "--quiet", "--steps", "3", "--batch", "2", "--seq", "24", "--seed", "5"])
            .output()
            .unwrap();
        assert!(out.status.success());
        stdout_last_json(&out)["losses"].clone()
    };
    assert_eq!(run(), run());
}

#[test]
fn bad_input_gets_one_clear_message() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path();

    // Missing checkpoint directory.
    let out = bin()
        .args(["forward", "--model-dir", "/nonexistent/ckpt", "--input-ids", "x.json", "--out", "y"])
        .output()
        .unwrap();
    fails_with(&out, "x.json");

    // Ids that are not a list of lists, ragged rows, ids past the vocabulary.
    let dir = fixture("mha_top1");
    for (text, needle) in [
        ("{\"ids\": 3}", "expected a JSON list of equal-length lists"),
        ("[[1, 2, 3], [4, 5]]", "rows must have equal length"),
        ("[[1, 2, 80]]", "outside the vocabulary 0..80"),
    ] {
        let ids = p.join("ids.json");
        std::fs::write(&ids, text).unwrap();
        let out = forward(&dir, &ids, &p.join("l.st"));
        fails_with(&out, needle);
        assert!(!p.join("l.st").exists(), "no output file on failure");
    }

    // Inconsistent model configs name the field.
    for (patch, needle) in [
        (r#""num_experts_per_tok": 9"#, "num_experts_per_tok"),
        (r#""num_key_value_heads": 3"#, "num_key_value_heads"),
        (r#""hidden_size": -4"#, "hidden_size"),
        (r#""hidden_size": "wide""#, "hidden_size"),
    ] {
        let base = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("disagmoe-models/src/families/qwen3_moe/tiny.json"),
        )
        .unwrap();
        let key = patch.split(':').next().unwrap();
        let line = base.lines().find(|l| l.trim_start().starts_with(key)).unwrap();
        let comma = if line.trim_end().ends_with(',') { "," } else { "" };
        let cfg = p.join("bad.json");
        std::fs::write(&cfg, base.replace(line, &format!("  {patch}{comma}"))).unwrap();
        let out = bin().args(["train", "--quiet", "--steps", "1", "--model-config"]).arg(&cfg).output().unwrap();
        fails_with(&out, needle);
    }

    // Bad options and run configs.
    let out = bin().args(["train", "--quiet", "--lr=-1"]).output().unwrap();
    fails_with(&out, "lr");
    let run = p.join("run.toml");
    std::fs::write(&run, "stepz = 3\n").unwrap();
    let out = bin().args(["train", "--quiet", "--run-config"]).arg(&run).output().unwrap();
    fails_with(&out, "stepz");

    // Empty corpus.
    let empty = p.join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let out = bin().args(["train", "--quiet", "--steps", "1", "--data"]).arg(&empty).output().unwrap();
    fails_with(&out, "is empty");
}

#[test]
fn hf_tokenizer_json_is_used_when_given() {
    let tok = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tokenizer/tokenizer.json");
    let tmp = tempfile::tempdir().unwrap();
    let base = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("disagmoe-models/src/families/qwen3_moe/tiny.json"),
    )
    .unwrap();
    let cfg = tmp.path().join("config.json");
    std::fs::write(&cfg, base.replace("\"vocab_size\": 256", "\"vocab_size\": 384")).unwrap();
    let out = bin()
        .args(["train", "--quiet", "--steps", "2", "--batch", "2", "--seq", "16", "--model-config"])
        .arg(&cfg)
        .arg("--tokenizer")
        .arg(&tok)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let first = stdout_last_json(&out)["first_loss"].as_f64().unwrap();
    assert!((first - (384f64).ln()).abs() < 0.3, "a fresh model starts near ln(384): {first}");
    // With --out, the final model carries the tokenizer it was trained with, and generate uses it.
    let out_dir = tmp.path().join("out");
    let out = bin()
        .args(["train", "--quiet", "--steps", "1", "--batch", "2", "--seq", "16", "--model-config"])
        .arg(&cfg)
        .arg("--tokenizer")
        .arg(&tok)
        .arg("--out")
        .arg(&out_dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read(out_dir.join("final/tokenizer.json")).unwrap(), std::fs::read(&tok).unwrap());
    let out = bin()
        .args(["generate", "--json", "--temperature", "0", "--max-new-tokens", "4", "--prompt", "In the beginning"])
        .arg("--model-dir")
        .arg(out_dir.join("final"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let g = stdout_last_json(&out);
    assert!(g["tokenizer"].as_str().unwrap().contains("tokenizer.json"), "{g}");
    assert!(g["prompt_tokens"].as_array().unwrap().len() < "In the beginning".len(), "not bytes: {g}");
    // The default model's 256 ids cannot hold this tokenizer's 384.
    let out = bin().args(["train", "--quiet", "--steps", "1", "--tokenizer"]).arg(&tok).output().unwrap();
    fails_with(&out, "outside the model's vocabulary 0..256");
}

#[test]
fn damaged_checkpoints_are_clear_errors() {
    let src = fixture("mha_top1");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let ids = tmp.path().join("ids.json");
    std::fs::write(&ids, "[[1, 2, 3]]").unwrap();
    let out = tmp.path().join("o");
    let forward = || forward(&dir, &ids, &out);
    // Truncated file.
    std::fs::write(dir.join("model.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    fails_with(&forward(), "model.safetensors");
    // Garbage header.
    std::fs::write(dir.join("model.safetensors"), b"not a safetensors file at all").unwrap();
    fails_with(&forward(), "malformed safetensors file");
    // No weights at all.
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    fails_with(&forward(), "no checkpoint found");
    // A config that does not match the weights: a misshapen tensor is named.
    std::fs::write(dir.join("model.safetensors"), &bytes).unwrap();
    let cfg = std::fs::read_to_string(src.join("config.json"))
        .unwrap()
        .replace("\"moe_intermediate_size\": 16", "\"moe_intermediate_size\": 17");
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    fails_with(&forward(), "has shape [16, 40], expected [17, 40]");
}

#[test]
fn every_preset_learns_within_60_steps() {
    let presets =
        ["tiny-qwen3-moe", "tiny-gpt-oss", "tiny-deepseek-v3", "tiny-deepseek-moe", "tiny-mixtral", "tiny-olmoe"];
    for preset in presets {
        let out = bin()
            .args(["train", "--quiet", "--model-preset", preset, "--steps", "60", "--batch", "4", "--seq", "64"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{preset}: {}", String::from_utf8_lossy(&out.stderr));
        let s = stdout_last_json(&out);
        let (first, last) = (s["first_loss"].as_f64().unwrap(), s["last_loss"].as_f64().unwrap());
        assert!(last < 0.85 * first, "{preset}: loss {first} -> {last} did not fall below 85%");
    }
    let out = bin().args(["train", "--quiet", "--model-preset", "huge"]).output().unwrap();
    fails_with(&out, "allowed: [\"tiny-qwen3-moe\"");
}

/// DeepSeek-V3 with its multi-token prediction module (issue 38): the loss (LM + 0.1 x MTP) and
/// the MTP loss itself fall below 85% of their first values within 60 steps; a family without
/// MTP modules, and a coefficient without a module, are refused in one line.
#[test]
fn deepseek_v3_with_multi_token_prediction_learns_within_60_steps() {
    let dir = tempfile::tempdir().unwrap();
    let out = bin()
        .args(["train", "--quiet", "--model-preset", "tiny-deepseek-v3", "--steps", "60", "--batch", "4"])
        .args(["--seq", "64", "--mtp-depth", "1", "--out", dir.path().to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let s = stdout_last_json(&out);
    let (first, last) = (s["first_loss"].as_f64().unwrap(), s["last_loss"].as_f64().unwrap());
    assert!(last < 0.85 * first, "loss {first} -> {last} did not fall below 85%");
    let text = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
    let steps: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let mtp = |m: &serde_json::Value| m["mtp_loss"].as_f64().unwrap_or_else(|| panic!("no mtp_loss in {m}"));
    let (a, b) = (mtp(&steps[0]), mtp(steps.last().unwrap()));
    assert!(b < 0.85 * a, "MTP loss {a} -> {b} did not fall below 85%");
    for m in &steps {
        let (loss, lm) = (m["loss"].as_f64().unwrap(), m["lm_loss"].as_f64().unwrap());
        assert!((loss - lm - 0.1 * mtp(m)).abs() < 1e-5 * loss, "loss = lm + 0.1 x mtp: {m}");
    }
    let train = |args: &[&str]| bin().args(["train", "--quiet", "--steps", "1"]).args(args).output().unwrap();
    fails_with(
        &train(&["--model-preset", "tiny-qwen3-moe", "--mtp-depth", "1"]),
        "qwen3_moe has no multi-token prediction module; allowed: 0",
    );
    fails_with(&train(&["--model-preset", "tiny-deepseek-v3", "--mtp-loss-coef", "0.3"]), "mtp_depth is 0");
    fails_with(&train(&["--model-preset", "tiny-deepseek-v3", "--mtp-depth", "9"]), "must be in 0..=8");
    fails_with(&train(&["--model-preset", "tiny-deepseek-v3", "--mtp-depth", "3", "--seq", "4"]), "mtp_depth + 2");
}

/// On a terminal (a pseudo-terminal from `script`) `train` ends with a few lines for people
/// instead of the JSON line; `--json` brings the JSON back as the last line. (Without a terminal
/// the JSON is the last line, as every other test here relies on.)
#[test]
fn a_terminal_gets_a_summary_for_people_and_json_on_request() {
    if Command::new("script").arg("--version").output().is_err() {
        panic!("`script` (util-linux) is needed to give the command a terminal: apt-get install util-linux");
    }
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().join("run");
    let command = |extra: &str| {
        format!(
            "{} train --steps 3 --batch 4 --seq 32 --model-preset tiny-qwen3-moe --quiet --out {} {extra}",
            env!("CARGO_BIN_EXE_disagmoe"),
            out_dir.display()
        )
    };
    let on_terminal = |extra: &str| {
        let out = Command::new("script").args(["-qec", &command(extra), "/dev/null"]).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
        String::from_utf8_lossy(&out.stdout).replace('\r', "")
    };
    let text = on_terminal("");
    assert!(text.contains("trained 3 steps") && text.contains("% of the first"), "{text}");
    assert!(text.contains(&format!("metrics    {}", out_dir.join("metrics.jsonl").display())), "{text}");
    assert!(!text.lines().any(|l| l.trim_start().starts_with('{')), "no JSON line on a terminal: {text}");
    let text = on_terminal("--json");
    let last = text.lines().rev().find(|l| !l.trim().is_empty()).unwrap();
    let v: serde_json::Value = serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {text}"));
    assert_eq!(v["steps"], 3);
}

#[test]
fn generate_continues_a_prompt_greedily_or_seeded_and_refuses_bad_options() {
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().join("out");
    let out = bin()
        .args(["train", "--quiet", "--steps", "3", "--batch", "2", "--seq", "32", "--out"])
        .arg(&out_dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let model = out_dir.join("final");
    let generate = |extra: &[&str]| {
        bin()
            .args(["generate", "--prompt", "And God said"])
            .arg("--model-dir")
            .arg(&model)
            .args(extra)
            .output()
            .unwrap()
    };
    let json = |extra: &[&str]| {
        let out = generate(&[&["--json", "--ignore-eos", "--max-new-tokens", "12"], extra].concat());
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        stdout_last_json(&out)
    };
    let greedy = json(&["--temperature", "0"]);
    assert_eq!(greedy["tokens"].as_array().unwrap().len(), 12);
    assert_eq!(json(&["--temperature", "0"])["tokens"], greedy["tokens"], "greedy is deterministic");
    // Byte-level: the prompt's ids are its bytes and the text is the new tokens' bytes.
    let bytes: Vec<u8> = greedy["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u8).collect();
    assert_eq!(greedy["text"].as_str().unwrap(), String::from_utf8_lossy(&bytes));
    assert_eq!(greedy["prompt_tokens"].as_array().unwrap().len(), "And God said".len());
    let sampled = json(&["--temperature", "1.0", "--top-p", "0.9", "--seed", "5"]);
    assert_eq!(json(&["--temperature", "1.0", "--top-p", "0.9", "--seed", "5"])["tokens"], sampled["tokens"], "seeded");
    // Without --json the text streams after the prompt.
    let out = generate(&["--temperature", "0", "--ignore-eos", "--max-new-tokens", "12"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.trim_end_matches('\n'), format!("And God said{}", greedy["text"].as_str().unwrap()));
    // Bad options and models are named.
    fails_with(&generate(&["--temperature", "-1"]), "temperature -1 is not allowed");
    fails_with(&generate(&["--top-p", "0"]), "top_p 0 is not allowed");
    // Any huge count of new tokens is refused up front, by the model's positions (it used to abort
    // the process reserving the output).
    fails_with(&generate(&["--max-new-tokens", "1000000000000000000"]), "max_position_embeddings");
    fails_with(
        &bin().args(["generate", "--prompt", "x", "--model-dir"]).arg(fixture("mha_top1")).output().unwrap(),
        "--tokenizer",
    );
    fails_with(
        &bin().args(["generate", "--prompt", "x", "--model-dir"]).arg(tmp.path().join("none")).output().unwrap(),
        "none",
    );
    let empty = bin().args(["generate", "--prompt", "", "--model-dir"]).arg(&model).output().unwrap();
    fails_with(&empty, "--prompt is empty");
}

#[test]
fn eval_every_and_disagmoe_eval_report_the_held_out_loss() {
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().join("out");
    // Every full batch of held-out windows in each evaluation (1000 batches cover the split), so
    // that `disagmoe eval` with the same --batch reads the same windows.
    let out = bin()
        .args(["train", "--quiet", "--steps", "6", "--batch", "4", "--seq", "32", "--eval-every", "3"])
        .args(["--eval-batches", "1000", "--out"])
        .arg(&out_dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let summary = stdout_last_json(&out);
    let metrics = std::fs::read_to_string(out_dir.join("metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = metrics.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let evaluated: Vec<u64> =
        lines.iter().filter(|l| l.get("eval_loss").is_some()).map(|l| l["step"].as_u64().unwrap()).collect();
    assert_eq!(evaluated, [3, 6]);
    let last = &lines[5];
    let eval_loss = last["eval_loss"].as_f64().unwrap();
    assert!((last["eval_perplexity"].as_f64().unwrap() - eval_loss.exp()).abs() < 1e-9 * eval_loss.exp());
    assert_eq!(summary["eval_loss"].as_f64(), Some(eval_loss));
    // The saved model on the same held-out windows gives the same loss.
    let out =
        bin().args(["eval", "--seq", "32", "--batch", "4", "--model-dir"]).arg(out_dir.join("final")).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report = stdout_last_json(&out);
    assert_eq!(report["split"], "held-out");
    assert!((report["loss"].as_f64().unwrap() - eval_loss).abs() < 1e-5, "{report} vs {eval_loss}");
    assert_eq!(report["tokens"].as_u64().unwrap(), report["windows"].as_u64().unwrap() * 31);
    // --whole: every window of another text (1000 bytes: 31 windows of 32).
    let text = tmp.path().join("test.txt");
    std::fs::write(&text, "In the beginning. ".repeat(56).chars().take(1000).collect::<String>()).unwrap();
    let whole = bin()
        .args(["eval", "--seq", "32", "--whole", "--data"])
        .arg(&text)
        .arg("--model-dir")
        .arg(out_dir.join("final"))
        .output()
        .unwrap();
    let whole = stdout_last_json(&whole);
    assert_eq!((whole["windows"].as_u64(), whole["split"].as_str()), (Some(31), Some("whole")), "{whole}");
    // Bad settings are named.
    let train = |extra: &[&str]| bin().args(["train", "--quiet", "--steps", "2"]).args(extra).output().unwrap();
    fails_with(&train(&["--eval-fraction", "0.7"]), "eval_fraction");
    fails_with(&train(&["--eval-every", "1", "--eval-fraction", "0"]), "eval_fraction must be above 0");
    fails_with(&train(&["--eval-every", "1", "--eval-fraction", "0.0001"]), "fewer than one batch");
    // The router options too.
    fails_with(&train(&["--capacity-factor", "0"]), "`capacity_factor`: must be a number > 0");
    fails_with(&train(&["--router-z-loss-coef", "2"]), "`router_z_loss_coef`: must be in 0..=1");
}

/// What every numeric option and run-config key is fed: zero, negative, not a number, infinite,
/// and past every signed 64-bit integer.
const EXTREMES: [&str; 5] = ["0", "-1", "NaN", "inf", "9223372036854775808"];

/// Runs `cmd` for at most `limit`: its exit code (`None`: still running at the limit, then killed)
/// and its stderr.
fn run_bounded(mut cmd: Command, limit: std::time::Duration) -> (Option<i32>, String) {
    use std::io::Read;
    let mut child = cmd
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the binary starts");
    let mut stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let t0 = std::time::Instant::now();
    let code = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status.code().unwrap_or(-1));
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    (code, reader.join().unwrap())
}

/// A run fed an extreme value either runs (exit 0: `Ok(false)`) or is refused with exit 2 and one
/// error line (clap's usage hints may follow it: `Ok(true)`); never a panic, an abort or a hang
/// (`Err`, what went wrong).
fn refused_or_ran(what: &str, code: Option<i32>, err: &str) -> Result<bool, String> {
    let bad = err.contains("panicked") || err.contains("backtrace") || err.contains("memory allocation");
    let head: String = err.lines().take(3).collect::<Vec<_>>().join(" | ");
    match code {
        Some(0) if !bad => Ok(false),
        Some(2) if !bad => {
            let first = err.lines().next().unwrap_or("");
            let errors = err.lines().filter(|l| l.starts_with("error")).count();
            if first.starts_with("error: ") && errors == 1 {
                Ok(true)
            } else {
                Err(format!("{what}: exit 2 without exactly one error line first: {head}"))
            }
        }
        other => Err(format!("{what}: exit {other:?} (None: still running after the limit): {head}")),
    }
}

/// Counts the refusals; collects what went wrong.
fn tally(result: Result<bool, String>, refused: &mut usize, failures: &mut Vec<String>) {
    match result {
        Ok(r) => *refused += r as usize,
        Err(e) => failures.push(e),
    }
}

/// The `--name <VALUE>` options of a subcommand, from its `--help`.
fn value_options(sub: &str) -> Vec<String> {
    let out = bin().args([sub, "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout).to_string();
    help.lines()
        .filter_map(|l| {
            let l = l.trim_start().trim_start_matches("-h, ");
            let (name, rest) = l.strip_prefix("--")?.split_once(' ')?;
            rest.starts_with('<').then(|| name.to_string())
        })
        .collect()
}

/// Every numeric option of every command, fed each extreme (alone, the others at small valid
/// values), is refused with exit 2 and one line, or runs; the lists below name every option that
/// takes a value, so a new one has to be put in one of them.
#[test]
fn every_numeric_option_at_its_extremes_is_refused_in_one_line_or_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path();
    let limit = std::time::Duration::from_secs(120);
    // A model and a corpus for the commands that read them.
    let model_out = p.join("model");
    let out = bin()
        .args(["train", "--quiet", "--steps", "1", "--batch", "2", "--seq", "16", "--out"])
        .arg(&model_out)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let model = model_out.join("final").to_string_lossy().to_string();
    let text = p.join("corpus.txt");
    std::fs::write(&text, "In the beginning was the word, and the word was with the text.\n".repeat(40)).unwrap();
    let text = text.to_string_lossy().to_string();
    let run_dir = p.join("run").to_string_lossy().to_string();

    let train_numeric = [
        "steps",
        "batch",
        "seq",
        "eval-fraction",
        "eval-every",
        "eval-batches",
        "lr",
        "min-lr",
        "warmup-steps",
        "weight-decay",
        "grad-clip",
        "seed",
        "aux-loss",
        "log-every",
        "checkpoint-every",
        "keep-checkpoints",
        "stop-after",
        "bias-update-rate",
        "router-z-loss-coef",
        "capacity-factor",
        "attn-workers",
        "ffn-workers",
        "groups",
        "workers",
        "micro-batches",
        "in-flight",
        "context-parallel",
        "threads-per-worker",
        "link-gbps",
        "link-latency-us",
        "comm-timeout-s",
        "redundant-experts",
        "rebalance-every",
        "mtp-depth",
        "mtp-loss-coef",
    ];
    let train_other = [
        "run-config",
        "tensorboard",
        "model-config",
        "model-dir",
        "model-preset",
        "data",
        "tokenizer",
        "out",
        "checkpoint-dir",
        "resume",
        "allow-change",
        "precision",
        "recompute",
        "save-dtype",
        "on-nonfinite",
        "placement",
        "allocation",
        "devices",
        "transport",
        "trace",
        "exchange-dtype",
        "exchange-grad-dtype",
        "exchange-payloads",
        "distributed-optimizer",
        "optimizer-state-dtype",
        "expert-placement",
        "expert-load",
        "document-mask",
        "document-positions",
        "phases",
    ];
    // (command, numeric options, other options, the base arguments: small valid values)
    let train_base: Vec<(&str, &str)> =
        vec![("steps", "1"), ("batch", "4"), ("seq", "8"), ("stop-after", "1"), ("out", &run_dir)];
    let commands: Vec<(&str, Vec<&str>, Vec<&str>, Vec<(&str, &str)>)> = vec![
        ("train", train_numeric.to_vec(), train_other.to_vec(), train_base.clone()),
        (
            "generate",
            vec!["max-new-tokens", "temperature", "top-p", "seed"],
            vec!["model-dir", "prompt", "tokenizer"],
            vec![("model-dir", &model), ("prompt", "In the"), ("max-new-tokens", "2")],
        ),
        (
            "eval",
            vec!["seq", "batch", "eval-fraction"],
            vec!["model-dir", "data", "tokenizer", "document-mask", "document-positions"],
            vec![("model-dir", &model), ("seq", "8"), ("batch", "2")],
        ),
        (
            "plan",
            vec!["seq", "micro-batch", "global-batch", "search-evals", "redundant-experts", "context-parallel"],
            vec![
                "model",
                "cluster",
                "roofline-svg",
                "exchange-dtype",
                "precision",
                "optimizer-state-dtype",
                "expert-load",
                "expert-placement",
                "phases",
            ],
            vec![("model", "mixtral-8x7b"), ("cluster", "h100x2"), ("seq", "4096"), ("search-evals", "2")],
        ),
        (
            "simulate",
            vec!["seq", "micro-batch", "global-batch", "redundant-experts", "context-parallel"],
            vec![
                "model",
                "cluster",
                "schedules",
                "timeline-dir",
                "exchange-dtype",
                "precision",
                "optimizer-state-dtype",
                "expert-load",
                "expert-placement",
            ],
            vec![("model", "mixtral-8x7b"), ("cluster", "h100x2"), ("seq", "4096")],
        ),
        (
            "tokenize",
            vec!["shard-tokens"],
            vec!["input", "out", "tokenizer", "text-field", "eos"],
            vec![("input", &text), ("out", &run_dir)],
        ),
    ];
    let (mut refused, mut cases, mut failures) = (0, 0, Vec::new());
    for (sub, numeric, other, base) in &commands {
        let listed: Vec<&str> = numeric.iter().chain(other).copied().collect();
        for opt in value_options(sub) {
            assert!(listed.contains(&opt.as_str()), "`{sub} --{opt}` takes a value: list it as numeric or not");
        }
        for opt in numeric {
            // Under every placement for the options that only a distributed run reads.
            let placements: &[&str] = match *opt {
                "attn-workers" | "ffn-workers" | "groups" | "workers" | "micro-batches" | "in-flight"
                | "context-parallel" | "threads-per-worker" | "link-gbps" | "link-latency-us" | "comm-timeout-s"
                | "redundant-experts" => &["single", "ep", "disagg"],
                _ => &["default"],
            };
            for placement in placements {
                for v in EXTREMES {
                    let _ = std::fs::remove_dir_all(&run_dir);
                    let mut cmd = bin();
                    cmd.arg(sub);
                    if *sub == "train" {
                        cmd.args(["--quiet", "--json"]);
                    }
                    if *placement != "default" {
                        cmd.args(["--placement", placement]);
                    }
                    for (k, b) in base.iter().filter(|(k, _)| k != opt) {
                        cmd.arg(format!("--{k}")).arg(b);
                    }
                    cmd.arg(format!("--{opt}={v}"));
                    let what = format!("{sub} --{opt}={v} ({placement})");
                    let (code, err) = run_bounded(cmd, limit);
                    tally(refused_or_ran(&what, code, &err), &mut refused, &mut failures);
                    cases += 1;
                }
            }
        }
    }
    eprintln!("{cases} option cases, {refused} refused");
    assert!(failures.is_empty(), "{} of {cases} cases went wrong:\n{}", failures.len(), failures.join("\n"));
    assert!(refused > cases / 3, "most extremes are refused ({refused} of {cases})");
}

/// Every numeric key of a run config (by section), fed each extreme in TOML (integers past 2^63
/// are TOML's own error; `nan`, `inf` and 1e300 are floats), is refused with exit 2 and one line,
/// or runs.
#[test]
fn every_numeric_run_config_key_at_its_extremes_is_refused_in_one_line_or_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path();
    let limit = std::time::Duration::from_secs(120);
    let run_dir = p.join("run");
    let defaults = serde_json::to_value(disagmoe::train::RunConfig::default()).unwrap();
    let sections = defaults.as_object().unwrap();
    let section_of =
        |key: &str| sections.iter().find(|(_, v)| v.get(key).is_some()).map(|(s, _)| s.clone()).expect("a section");
    // Small valid values for the rest: (section, key, value); "" is the top level.
    let base = [
        (String::new(), "steps".to_string(), "1".to_string()),
        (section_of("batch"), "batch".into(), "4".into()),
        (section_of("seq"), "seq".into(), "8".into()),
        (section_of("stop_after"), "stop_after".into(), "1".into()),
    ];
    let mut keys: Vec<(String, String)> = Vec::new();
    for (section, value) in sections {
        let fields: Vec<(String, serde_json::Value)> = match value.as_object() {
            Some(o) => o.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            None => vec![(section.clone(), value.clone())],
        };
        let top = value.as_object().is_none();
        for (key, v) in fields {
            let doc =
                |val: &str| if top { format!("{key} = {val}\n") } else { format!("[{section}]\n{key} = {val}\n") };
            // Numbers, and unset options that take one.
            let numeric =
                v.is_number() || (v.is_null() && disagmoe::train::RunConfig::from_toml_str(&doc("1")).is_ok());
            if numeric {
                keys.push((if top { String::new() } else { section.clone() }, key));
            }
        }
    }
    assert!(keys.len() >= 30, "numeric keys found: {keys:?}");
    let (mut refused, mut cases, mut failures) = (0, 0, Vec::new());
    for (section, key) in &keys {
        for v in ["0", "-1", "nan", "inf", "-inf", "1e300", "9223372036854775807", "9223372036854775808"] {
            let mut by_section: std::collections::BTreeMap<String, Vec<String>> = Default::default();
            for (s, k, b) in base.iter().filter(|(s, k, _)| !(s == section && k == key)) {
                by_section.entry(s.clone()).or_default().push(format!("{k} = {b}"));
            }
            by_section.entry(section.clone()).or_default().push(format!("{key} = {v}"));
            let mut doc = by_section.remove("").unwrap_or_default().join("\n") + "\n";
            for (s, lines) in by_section {
                doc += &format!("[{s}]\n{}\n", lines.join("\n"));
            }
            let file = p.join("run.toml");
            std::fs::write(&file, &doc).unwrap();
            let _ = std::fs::remove_dir_all(&run_dir);
            let mut cmd = bin();
            cmd.args(["train", "--quiet", "--json", "--run-config"]).arg(&file).arg("--out").arg(&run_dir);
            let what = format!("run config [{section}] {key} = {v}");
            let (code, err) = run_bounded(cmd, limit);
            tally(refused_or_ran(&what, code, &err), &mut refused, &mut failures);
            cases += 1;
        }
    }
    eprintln!("{cases} key cases over {} keys, {refused} refused", keys.len());
    assert!(failures.is_empty(), "{} of {cases} cases went wrong:\n{}", failures.len(), failures.join("\n"));
    assert!(refused > cases / 2, "most extremes are refused ({refused} of {cases})");
}

/// `plan` on a cluster of two node kinds: every role assignment, the fastest chosen, the
/// baselines on the cluster as its slowest, each pool's rooflines; what it cannot do is refused in
/// one line.
#[test]
fn plan_on_a_mixed_cluster_gives_the_sides_pools_and_refuses_what_it_cannot_do() {
    let job = ["--model", "qwen3-30b-a3b", "--seq", "16384", "--micro-batch", "4"];
    let out = bin()
        .arg("plan")
        .args(job)
        .args(["--search-evals", "4", "--cluster", "h100x2+h20x2", "--compare", "--explain", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let roles = v["roles"].as_array().unwrap();
    assert_eq!(roles.len(), 5, "{v}");
    let chosen = &roles[v["chosen"].as_u64().unwrap() as usize];
    let best = chosen["plan"]["predicted_step_s"].as_f64().unwrap();
    for r in roles {
        if let Some(s) = r["plan"]["predicted_step_s"].as_f64() {
            assert!(s >= best, "{r}");
        }
    }
    assert!(!v["baselines"].as_array().unwrap().is_empty(), "{v}");
    assert_eq!(v["rooflines"].as_array().unwrap().len(), 2);
    let text = bin().arg("plan").args(job).args(["--search-evals", "4", "--cluster", "h100x2+h20x2"]).output().unwrap();
    let text = String::from_utf8_lossy(&text.stdout).to_string();
    assert!(text.contains("chosen: ") && text.contains("role assignments"), "{text}");

    for (args, says) in [
        (vec!["simulate", "--cluster", "h100x2+h20x2"], "plan --compare"),
        (vec!["plan", "--cluster", "h100x2", "--compare"], "several node kinds"),
        (vec!["plan", "--cluster", "h100x2+v100x2"], "h20"),
        (vec!["plan", "--cluster", "h100x2+h20x2-0nic"], "NICs"),
        (vec!["plan", "--cluster", "h100x2+h20x2", "--roofline-svg", "r.svg"], "--explain"),
    ] {
        let out = bin().arg(args[0]).args(job).args(&args[1..]).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.starts_with("error: ") && err.lines().count() <= 2 && err.contains(says), "{args:?}: {err}");
    }
}

/// `plan --phases`: each phase planned for its shape (keeping the tokens per micro-batch and per
/// step), compared with the best split kept throughout; what does not go with it is refused.
#[test]
fn plan_in_phases_compares_re_planning_with_one_split_and_refuses_what_it_cannot_do() {
    let job = ["--model", "qwen3-30b-a3b", "--seq", "4096", "--micro-batch", "8", "--global-batch", "128"];
    let phases = ["--search-evals", "8", "--phases", "4096x100,16384x20,32768x10"];
    let out = bin().arg("plan").args(job).args(["--cluster", "h100x2"]).args(phases).arg("--json").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let p = v["phases"].as_array().unwrap();
    assert_eq!(p.len(), 3, "{v}");
    let shape = |i: usize, k: &str| p[i]["phase"]["workload"][k].as_u64().unwrap();
    assert_eq!([shape(2, "seq"), shape(2, "micro_batch"), shape(2, "global_batch")], [32768, 1, 16], "{v}");
    let replanned: f64 = p.iter().map(|x| x["step_s"].as_f64().unwrap() * x["phase"]["steps"].as_f64().unwrap()).sum();
    assert!((v["replanned_s"].as_f64().unwrap() - replanned).abs() <= 1e-9 * replanned, "{v}");
    if let Some(g) = v["gain"].as_f64() {
        assert!(g >= 1.0 - 1e-12, "re-planning is never slower than the single split: {v}");
    }
    let text = bin().arg("plan").args(job).args(["--cluster", "h100x2"]).args(phases).output().unwrap();
    let text = String::from_utf8_lossy(&text.stdout).to_string();
    assert!(text.contains("re-planned at each boundary") && text.contains("32768 tokens x 1 sequences"), "{text}");
    // On two node kinds each phase also chooses the pools' roles.
    let out =
        bin().arg("plan").args(job).args(["--cluster", "h100x2+h20x2"]).args(phases).arg("--json").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["phases"].as_array().unwrap().iter().all(|p| p["roles_description"].is_string()), "{v}");
    for (extra, says) in [
        (vec!["--cluster", "h100x2", "--phases", "65536x1"], "divides"),
        (vec!["--cluster", "h100x2", "--phases", "4096x0"], "at least 1 step"),
        (vec!["--cluster", "h100x2", "--phases", "4096x1", "--compare"], "does not go with --phases"),
        (vec!["--cluster", "h100x2", "--phases", "4096x1", "--explain"], "does not go with --phases"),
        (vec!["--cluster", "h100x2", "--phases", "4096"], "SEQxSTEPS"),
    ] {
        let out = bin().arg("plan").args(job).args(&extra).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {err}");
        assert!(err.starts_with("error: ") && err.contains(says) && !err.contains("panicked"), "{extra:?}: {err}");
    }
    // `train --phases`: what does not make a run in phases is refused in one line.
    for (extra, says) in [
        (vec!["--phases", "64x2,abc"], "not a phase"),
        (vec!["--phases", "64x2", "--seq", "64"], "leave --seq out"),
        (vec!["--phases", "64x2,32x1", "--steps", "5"], "add up to 3"),
        (vec!["--phases", "64x2,32x1x0"], "phase 2"),
    ] {
        let out = bin().args(["train", "--quiet", "--json", "--batch", "4"]).args(&extra).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {err}");
        assert!(err.starts_with("error: ") && err.lines().count() <= 2 && err.contains(says), "{extra:?}: {err}");
    }
}
