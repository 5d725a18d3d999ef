//! Train a small DeepSeek-V3 (multi-head latent attention, sigmoid group-limited routing with
//! aux-loss-free bias balancing, shared experts, a dense first layer) on the bundled
//! public-domain corpus, on CPU, with no arguments.
//!
//! ```text
//! cargo run --release --example train_deepseek
//! cargo run --release --example train_deepseek -- --steps 60
//! ```
//!
//! It shows progress on stderr and ends with the same JSON line as `disagmoe train`
//! (`first_loss`, `last_loss`, `losses`, `tokens_per_s`, `steps`, ...).

fn main() {
    disagmoe::cli::example_main(
        "train_deepseek",
        "Train the embedded tiny DeepSeek-V3 on the bundled corpus",
        "tiny-deepseek-v3",
    );
}
