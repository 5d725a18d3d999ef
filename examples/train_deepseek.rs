//! Train a small DeepSeek-V3 (multi-head latent attention, sigmoid group-limited routing with
//! aux-loss-free bias balancing, shared experts, a dense first layer)
//! on the bundled public-domain corpus, on CPU, with no arguments.
//!
//! ```text
//! cargo run --release --example train_deepseek
//! cargo run --release --example train_deepseek -- --steps 60
//! ```
//!
//! Ends with the same JSON line as `disagmoe train`.

use clap::Parser;
use disagmoe::cli::{init_logging, report, run_example, TrainArgs};

#[derive(Debug, Parser)]
#[command(name = "train_deepseek", about = "Train the embedded tiny DeepSeek-V3 on the bundled corpus")]
struct Cli {
    #[command(flatten)]
    train: TrainArgs,
}

fn main() {
    let cli = Cli::parse();
    init_logging(cli.train.quiet);
    if let Err(e) = run_example(cli.train, "tiny-deepseek-v3") {
        std::process::exit(report(&e));
    }
}
