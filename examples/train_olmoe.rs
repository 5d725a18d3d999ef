//! Train a small OLMoE (q/k normalised over the whole projection, sixteen experts with top-4
//! routing in every layer, the Switch balance loss) on the bundled public-domain corpus, on CPU,
//! with no arguments.
//!
//! ```text
//! cargo run --release --example train_olmoe
//! cargo run --release --example train_olmoe -- --steps 60
//! ```
//!
//! It shows progress on stderr and ends with the same JSON line as `disagmoe train`.

fn main() {
    disagmoe::cli::example_main("train_olmoe", "Train the embedded tiny OLMoE on the bundled corpus", "tiny-olmoe");
}
