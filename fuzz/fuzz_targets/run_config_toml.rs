//! Any UTF-8 text as a `--run-config` TOML file (`RunConfig::from_toml_str`, what
//! `RunConfig::from_toml_file` parses a file's text with): a config or an error, never a panic, and
//! never the test-only faults (a file cannot set them). A config that parses is validated
//! (`RunConfig::validate`), an error or nothing, never a panic. One that validates gives what a run
//! derives from it without a panic (micro-batches, the last step, tokens per step, the placement in
//! words, the workers of this process, the learning-rate schedule at its first, last and turning
//! steps, the settings a checkpoint records when the model is a preset; each phase's, for a run in
//! phases), and written back as TOML (by sections) parses to the same config.
#![no_main]

use disagmoe_train::checkpoint::RunSettings;
use disagmoe_train::config::FaultPlan;
use disagmoe_train::RunConfig;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(cfg) = RunConfig::from_toml_str(text) else { return };
    assert_eq!(cfg.faults, FaultPlan::default(), "a run config sets no fault");
    if cfg.validate().is_err() {
        return;
    }
    // A run in phases runs each phase as a run of its shape.
    let runs: Vec<RunConfig> =
        if cfg.phases.is_empty() { vec![cfg.clone()] } else { (0..cfg.phases.len()).map(|i| cfg.phase(i)).collect() };
    let mbs = cfg.micro_batches();
    for run in &runs {
        assert!(mbs >= 1 && run.data.batch % mbs == 0);
        assert!(run.data.tokens_per_step() >= 2);
        assert_eq!(run.steps, cfg.steps, "the schedule spans the whole run");
    }
    let last = cfg.last_step();
    assert!((1..=cfg.steps).contains(&last));
    let _ = cfg.parallel.describe();
    let _ = cfg.parallel.workers_here();
    let schedule = cfg.optimizer.lr_schedule(cfg.steps);
    assert!(schedule.warmup <= cfg.steps);
    for step in [1, schedule.warmup, schedule.warmup.saturating_add(1), last, cfg.steps] {
        let lr = schedule.at(step.max(1));
        assert!(lr >= 0.0 && lr <= cfg.optimizer.lr * (1.0 + 1e-12), "lr {lr} at step {step}");
    }
    if cfg.model.dir.is_none() && cfg.model.config.is_none() {
        for run in &runs {
            let settings = RunSettings::of(run).expect("a valid config's preset resolves");
            assert_eq!(settings.micro_batches, mbs);
        }
    }
    let written = toml::to_string(&cfg).expect("a valid config writes as TOML");
    let back = RunConfig::from_toml_str(&written).unwrap_or_else(|e| panic!("{e}\nin\n{written}"));
    assert!(back == cfg, "written back as\n{written}\nit parses to another config");
});
