//! Train a small Qwen3-MoE on the bundled public-domain corpus, on CPU, with no arguments.
//!
//! ```text
//! cargo run --release --example train_qwen3                 # 300 steps, about a minute on 2 cores
//! cargo run --release --example train_qwen3 -- --steps 60   # any `disagmoe train` option works
//! ```
//!
//! It shows progress on stderr and ends with the same JSON line as `disagmoe train`
//! (`first_loss`, `last_loss`, `losses`, `tokens_per_s`, `steps`, ...).

use clap::Parser;
use disagmoe::cli::{init_logging, report, run_example, TrainArgs};

#[derive(Debug, Parser)]
#[command(name = "train_qwen3", about = "Train the embedded tiny Qwen3-MoE on the bundled corpus")]
struct Cli {
    #[command(flatten)]
    train: TrainArgs,
}

fn main() {
    let cli = Cli::parse();
    init_logging(cli.train.quiet);
    if let Err(e) = run_example(cli.train, "tiny-qwen3-moe") {
        std::process::exit(report(&e));
    }
}
