//! Any bytes as a safetensors file: opening it and reading every tensor (as f32, or raw u8 for
//! MXFP4 blocks) returns values or errors, never panics.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dir = std::env::temp_dir().join(format!("disagmoe-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.safetensors");
    std::fs::write(&path, data).unwrap();
    if let Ok(mut reader) = disagmoe_models::CheckpointReader::open_file(&path) {
        for name in reader.names() {
            let _ = reader.read_f32(&name);
            let _ = reader.read_u8(&name);
        }
    }
});
