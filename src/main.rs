//! The `disagmoe` command.

use clap::{Parser, Subcommand};
use disagmoe::cli::{init_logging, report, run_compare, run_forward, run_train, CompareArgs, ForwardArgs, TrainArgs};
use disagmoe::cli_generate::{run_eval, run_generate, EvalArgs, GenerateArgs};
use disagmoe::cli_net::{run_net_bench, run_predict, NetBenchArgs, PredictArgs};
use disagmoe::cli_plan::{run_plan, run_reproduce, run_simulate, PlanArgs, ReproduceArgs, SimulateArgs};
use disagmoe::cli_tokenize::{run_tokenize, TokenizeArgs};
use disagmoe::plot::{run_plot, PlotArgs};

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
    /// Tokenize text, JSONL and Parquet documents once into token shards that
    /// `train --data DIR` streams windows from; prints a JSON report.
    Tokenize(TokenizeArgs),
    /// Continue a prompt with a checkpoint (KV cache; greedy, or sampled with temperature and
    /// top-p).
    Generate(GenerateArgs),
    /// The loss and perplexity of a checkpoint on the held-out windows of a corpus (or all of
    /// them).
    Eval(EvalArgs),
    /// Train under ep and disagg side by side (emulated links) and compare step time and exposed
    /// communication.
    Compare(CompareArgs),
    /// Time the network under mpirun (ping-pong, bursts, incasts of the exchange's message sizes)
    /// and fit the link model `predict` uses; prints a JSON report.
    NetBench(NetBenchArgs),
    /// The simulator's prediction of one run (step time, exposed communication) from a
    /// calibration and a link: fitted by net-bench, or the emulated one.
    Predict(PredictArgs),
    /// Choose GPUs and NICs per attention/expert group (roofline MILP + simulated local search).
    Plan(PlanArgs),
    /// Simulate AF-Pipe and the baselines (1f1b-interleaved, tutel, comet, dualpipe).
    Simulate(SimulateArgs),
    /// Regenerate docs/paper-reproduction.md by simulation.
    ReproducePaper(ReproduceArgs),
    /// Plot runs from their metrics.jsonl as SVG files: loss, throughput, learning rate and a
    /// heat map of each layer's expert load over the steps; prints a JSON report.
    Plot(PlotArgs),
}

fn main() {
    let cli = Cli::parse();
    init_logging(
        matches!(&cli.command, Command::Train(a) if a.quiet)
            || matches!(&cli.command, Command::Compare(a) if a.train.quiet)
            || matches!(&cli.command, Command::Predict(a) if a.train.quiet),
    );
    let result = match &cli.command {
        Command::Forward(args) => run_forward(args).map(|_| ()),
        Command::Train(args) => run_train(args).map(|_| ()),
        Command::Tokenize(args) => run_tokenize(args).map(|_| ()),
        Command::Generate(args) => run_generate(args).map(|_| ()),
        Command::Eval(args) => run_eval(args).map(|_| ()),
        Command::Compare(args) => run_compare(args).map(|_| ()),
        Command::NetBench(args) => run_net_bench(args),
        Command::Predict(args) => run_predict(args).map(|_| ()),
        Command::Plan(args) => run_plan(args),
        Command::Simulate(args) => run_simulate(args),
        Command::ReproducePaper(args) => run_reproduce(args),
        Command::Plot(args) => {
            run_plot(args).map(|r| println!("{}", serde_json::to_string(&r).expect("report serialises")))
        }
    };
    if let Err(e) = result {
        std::process::exit(report(&e));
    }
}
