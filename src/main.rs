//! The `disagmoe` command.

use clap::{Parser, Subcommand};
use disagmoe::cli::{init_logging, report, run_forward, run_train, ForwardArgs, TrainArgs};

/// DisagMoE: disaggregated attention/expert training for Mixture-of-Experts models.
#[derive(Debug, Parser)]
#[command(name = "disagmoe", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a checkpoint on token ids: write the logits, print the next-token loss.
    Forward(ForwardArgs),
    /// Train a model (the embedded default with no model option) and print a JSON summary.
    Train(TrainArgs),
}

fn main() {
    init_logging();
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Forward(args) => run_forward(args).map(|_| ()),
        Command::Train(args) => run_train(args).map(|_| ()),
    };
    if let Err(e) = result {
        std::process::exit(report(&e));
    }
}
