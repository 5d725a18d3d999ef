//! Train a small GPT-OSS (sinks, alternating sliding-window layers, YaRN, clamped SwiGLU experts)
//! on the bundled public-domain corpus, on CPU, with no arguments.
//!
//! ```text
//! cargo run --release --example train_gpt_oss
//! cargo run --release --example train_gpt_oss -- --steps 60
//! ```
//!
//! It shows progress on stderr and ends with the same JSON line as `disagmoe train`
//! (`first_loss`, `last_loss`, `losses`, `tokens_per_s`, `steps`, ...).

fn main() {
    disagmoe::cli::example_main(
        "train_gpt_oss",
        "Train the embedded tiny GPT-OSS on the bundled corpus",
        "tiny-gpt-oss",
    );
}
