//! Train a small Qwen3-MoE on the bundled public-domain corpus, on CPU, with no arguments.
//!
//! ```text
//! cargo run --release --example train_qwen3                 # 300 steps, a few minutes on 2 cores
//! cargo run --release --example train_qwen3 -- --steps 60   # any `disagmoe train` option works
//! ```
//!
//! It shows progress on stderr and ends with the same JSON line as `disagmoe train`
//! (`first_loss`, `last_loss`, `losses`, `tokens_per_s`, `steps`, ...).

use clap::Parser;
use disagmoe::cli::{init_logging, report, run_train, TrainArgs};

#[derive(Debug, Parser)]
#[command(name = "train_qwen3", about = "Train the embedded tiny Qwen3-MoE on the bundled corpus")]
struct Cli {
    #[command(flatten)]
    train: TrainArgs,
}

fn main() {
    init_logging();
    let cli = Cli::parse();
    match run_train(&cli.train) {
        Ok(summary) => {
            let ratio = summary.last_loss / summary.first_loss;
            eprintln!(
                "loss {:.3} -> {:.3} ({:.0}% of the first) in {} steps, {:.0} tokens/s on {}",
                summary.first_loss,
                summary.last_loss,
                100.0 * ratio,
                summary.steps,
                summary.tokens_per_s,
                summary.backend
            );
        }
        Err(e) => std::process::exit(report(&e)),
    }
}
