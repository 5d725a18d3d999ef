//! Train a small GPT-OSS (sinks, alternating sliding-window layers, YaRN, clamped SwiGLU experts)
//! on the bundled public-domain corpus, on CPU, with no arguments.
//!
//! ```text
//! cargo run --release --example train_gpt_oss
//! cargo run --release --example train_gpt_oss -- --steps 60
//! ```
//!
//! Ends with the same JSON line as `disagmoe train`.

use clap::Parser;
use disagmoe::cli::{init_logging, report, run_example, TrainArgs};

#[derive(Debug, Parser)]
#[command(name = "train_gpt_oss", about = "Train the embedded tiny GPT-OSS on the bundled corpus")]
struct Cli {
    #[command(flatten)]
    train: TrainArgs,
}

fn main() {
    let cli = Cli::parse();
    init_logging(cli.train.quiet);
    if let Err(e) = run_example(cli.train, "tiny-gpt-oss") {
        std::process::exit(report(&e));
    }
}
