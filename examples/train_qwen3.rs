//! Train a small Qwen3-MoE on the bundled public-domain corpus, on CPU, with no arguments.
//!
//! ```text
//! cargo run --release --example train_qwen3                 # 300 steps, about a minute on 2 cores
//! cargo run --release --example train_qwen3 -- --steps 60   # any `disagmoe train` option works
//! ```
//!
//! It shows progress on stderr and ends with the same JSON line as `disagmoe train`
//! (`first_loss`, `last_loss`, `losses`, `tokens_per_s`, `steps`, ...).

fn main() {
    disagmoe::cli::example_main(
        "train_qwen3",
        "Train the embedded tiny Qwen3-MoE on the bundled corpus",
        "tiny-qwen3-moe",
    );
}
