//! Any bytes as `config.json`: parsing and validation return a value or an error, never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(config) = disagmoe_models::ModelConfig::from_json_str(text) {
            // A parsed config must describe itself consistently.
            let _ = config.to_hf_json();
            let _ = config.sparse_layers();
        }
    }
});
