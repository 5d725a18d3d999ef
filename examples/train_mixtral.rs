//! Train a small Mixtral (GQA attention, eight SwiGLU experts with top-2 softmax routing in every
//! layer, the Switch balance loss) on the bundled public-domain corpus, on CPU, with no arguments.
//!
//! ```text
//! cargo run --release --example train_mixtral
//! cargo run --release --example train_mixtral -- --steps 60 --placement ep --workers 2
//! ```
//!
//! It shows progress on stderr and ends with the same JSON line as `disagmoe train`.

fn main() {
    disagmoe::cli::example_main(
        "train_mixtral",
        "Train the embedded tiny Mixtral on the bundled corpus",
        "tiny-mixtral",
    );
}
