//! A checkpoint's `state.json` and `manifest.json` are read back from disk, possibly damaged:
//! any bytes as either parse to a checked value or an error, never a panic; a state that parses
//! is compared with a run's settings as a resume does; a manifest that parses is verified against
//! a checkpoint directory (it can only name files inside it).
#![no_main]

use disagmoe_train::checkpoint::{verify_checkpoint, Manifest, RunSettings, TrainState};
use libfuzzer_sys::fuzz_target;

fn settings() -> RunSettings {
    RunSettings {
        seed: 0,
        seq: 32,
        batch: 8,
        data: "bundled".into(),
        tokenizer: "bytes".into(),
        eval_fraction: 0.02,
        steps: 10,
        lr: 3e-3,
        min_lr: 3e-4,
        warmup_steps: 1,
        weight_decay: 0.1,
        betas_eps: [0.9, 0.95, 1e-8],
        grad_clip: 1.0,
        model: serde_json::json!({"model_type": "qwen3_moe"}),
        micro_batches: 4,
        optimizer_state_dtype: disagmoe_train::config::StateDtype::F32,
        document_mask: false,
        document_positions: disagmoe_train::config::DocumentPositions::Continue,
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(state) = TrainState::parse(text) {
        assert_eq!(state.losses.len(), state.step);
        if let Some(was) = &state.settings {
            let _ = was.check_resume(&settings(), &[], std::path::Path::new("step-00000001"));
            let _ = was.check_resume(&settings(), &["schedule".into(), "steps".into()], std::path::Path::new("x"));
        }
    }
    if let Ok(manifest) = Manifest::parse(text) {
        for (name, sum) in &manifest.files {
            assert!(!name.starts_with('/') && !name.split('/').any(|p| p == ".." || p.is_empty()));
            assert_eq!(sum.len(), 64);
        }
        let dir = std::env::temp_dir().join(format!("disagmoe-fuzz-ckpt-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("exp_avg")).unwrap();
        std::fs::write(dir.join("exp_avg").join("a.safetensors"), b"abc").unwrap();
        std::fs::write(dir.join("manifest.json"), data).unwrap();
        let _ = verify_checkpoint(&dir);
    }
});
