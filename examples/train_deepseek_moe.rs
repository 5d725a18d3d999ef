//! Train a small DeepSeekMoE (the architecture of DeepSeekMoE-16B: plain multi-head attention,
//! fine-grained routed experts plus shared experts, a dense first layer, the per-sequence expert
//! balance loss) on the bundled public-domain corpus, on CPU, with no arguments.
//!
//! ```text
//! cargo run --release --example train_deepseek_moe
//! cargo run --release --example train_deepseek_moe -- --steps 60 --placement disagg
//! ```
//!
//! It shows progress on stderr and ends with the same JSON line as `disagmoe train`.

fn main() {
    disagmoe::cli::example_main(
        "train_deepseek_moe",
        "Train the embedded tiny DeepSeekMoE on the bundled corpus",
        "tiny-deepseek-moe",
    );
}
