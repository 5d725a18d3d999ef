//! `disagmoe net-bench` (time a real network under mpirun and fit the prediction's link model to
//! it) and `disagmoe predict` (the simulator's prediction of one run, from a calibration and a
//! link: a fitted one, or the emulated one of the run's options).

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;

use disagmoe_train::runtime;
#[cfg(feature = "mpi")]
use disagmoe_train::runtime::predict::network::fit;
use disagmoe_train::runtime::predict::network::Fitted;
use disagmoe_train::runtime::predict::{Calibrated, NetLink};
use disagmoe_train::TrainBackend;

use crate::cli::TrainArgs;

/// `disagmoe net-bench`.
#[derive(Debug, Clone, Args)]
pub struct NetBenchArgs {
    /// Message sizes to time, bytes (1 to 67108864), comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1024usize, 16384, 131072, 1048576])]
    pub sizes: Vec<usize>,
    /// Timed rounds per size (the medians and the spread are reported).
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// Also write the report (fitted link, every sample beside the model) to this JSON file, which
    /// `disagmoe predict --link-fit` reads.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
}

/// What `net-bench` prints: the ranks it ran on, the settings, the fit.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct NetBenchReport {
    pub ranks: usize,
    pub repeats: usize,
    #[serde(flatten)]
    pub fitted: Fitted,
}

/// Runs the benchmark under mpirun; rank 0 prints a table on stderr and the report as one JSON
/// line on stdout (and into `--out`).
#[cfg(feature = "mpi")]
pub fn run_net_bench(args: &NetBenchArgs) -> anyhow::Result<()> {
    use runtime::netbench::{run, BenchSettings};
    let settings = BenchSettings { sizes: args.sizes.clone(), repeats: args.repeats };
    let Some((ranks, samples)) = run(&settings)? else { return Ok(()) };
    let fitted = match fit(&samples) {
        Ok(f) => f,
        Err(e) => {
            // What was measured, then why no link fits it.
            eprintln!("{:<14} {:>5} {:>10} {:>12} {:>22}", "pattern", "peers", "bytes", "measured_s", "(min-max)");
            for s in &samples {
                let spread = format!("({:.6}-{:.6})", s.min_s, s.max_s);
                eprintln!("{:<14} {:>5} {:>10} {:>12.6} {:>22}", s.pattern.name(), s.peers, s.bytes, s.seconds, spread);
            }
            return Err(e.into());
        }
    };
    eprintln!(
        "{:<14} {:>5} {:>10} {:>12} {:>22} {:>12} {:>8}",
        "pattern", "peers", "bytes", "measured_s", "(min-max)", "model_s", "error"
    );
    for r in &fitted.rows {
        let s = &r.sample;
        eprintln!(
            "{:<14} {:>5} {:>10} {:>12.6} {:>22} {:>12.6} {:>7.1}%{}",
            s.pattern.name(),
            s.peers,
            s.bytes,
            s.seconds,
            format!("({:.6}-{:.6})", s.min_s, s.max_s),
            r.model_s,
            100.0 * r.error,
            if r.fitted { "" } else { "  (held out)" }
        );
    }
    let l = fitted.link;
    eprintln!(
        "fitted link: {:.1} Mbit/s, latency {:.0} us, {:.0} us per message; worst error {:.1}% fitted, {} held-out incasts, {} held-out exchanges",
        l.gbps * 1e3,
        l.latency_us,
        l.per_message_us,
        100.0 * fitted.fit_error,
        fitted.incast_error.map_or("no".to_string(), |e| format!("{:.1}% on the", 100.0 * e)),
        fitted.exchange_error.map_or("no".to_string(), |e| format!("{:.1}% on the", 100.0 * e)),
    );
    let report = NetBenchReport { ranks, repeats: args.repeats, fitted };
    let json = serde_json::to_string(&report)?;
    if let Some(path) = &args.out {
        std::fs::write(path, format!("{json}\n")).with_context(|| format!("cannot write {}", path.display()))?;
    }
    println!("{json}");
    Ok(())
}

/// Without the `mpi` feature: says what is needed.
#[cfg(not(feature = "mpi"))]
pub fn run_net_bench(_: &NetBenchArgs) -> anyhow::Result<()> {
    Err(disagmoe_train::TrainError::option(
        "transport",
        "net-bench runs under mpirun and needs a build with the `mpi` feature (cargo build --release --features mpi)",
    )
    .into())
}

/// `disagmoe predict`.
#[derive(Debug, Clone, Args)]
pub struct PredictArgs {
    /// Every `disagmoe train` option: the run to predict (placement, workers, model, batch,
    /// micro-batches, in flight; `--link-gbps`/`--link-latency-us` as the link unless
    /// `--link-fit` is given).
    #[command(flatten)]
    pub train: TrainArgs,
    /// The link of a real network: a `disagmoe net-bench --out` report (its fitted rate, latency
    /// and per-message cost).
    #[arg(long, value_name = "FILE")]
    pub link_fit: Option<PathBuf>,
    /// Calibrate from this trace of the same configuration without link emulation (`disagmoe
    /// train ... --trace FILE`, under any transport; needs `--in-flight`, the window it ran
    /// with), instead of a calibration run here.
    #[arg(long, value_name = "TRACE.json")]
    pub calibration_trace: Option<PathBuf>,
    /// Steps of the calibration run here (the first is left out of its medians).
    #[arg(long, default_value_t = 4, value_name = "N")]
    pub calibration_steps: usize,
}

/// The prediction of one run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PredictReport {
    pub placement: String,
    pub workers: usize,
    pub in_flight: usize,
    /// The link predicted over (`None`: messages arrive at once), and where it came from.
    pub link: Option<NetLink>,
    pub link_source: String,
    pub predicted_step_s: f64,
    pub predicted_exposed_comm_s: f64,
    pub predicted_compute_s: f64,
    /// The calibration: its source, steps, steady step and overhead, seconds.
    pub calibration_source: String,
    pub calibration_steps: usize,
    pub calibration_step_s: f64,
    pub calibration_overhead_s: f64,
}

/// Predicts the run of `args` and prints the report as one JSON line.
pub fn run_predict(args: &PredictArgs) -> anyhow::Result<PredictReport> {
    let cfg = args.train.run_config()?;
    cfg.validate()?;
    let (link, link_source) = match &args.link_fit {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
            let report: NetBenchReport = serde_json::from_str(text.lines().last().unwrap_or(""))
                .with_context(|| format!("{} is not a `disagmoe net-bench --out` report", path.display()))?;
            (Some(report.fitted.link), format!("fitted: {}", path.display()))
        }
        None => match runtime::link_model(&cfg) {
            Some(l) => (Some(NetLink::from(l)), "emulated: --link-gbps/--link-latency-us".to_string()),
            None => (None, "none: messages arrive at once".to_string()),
        },
    };
    let Calibrated { layout, calibration, in_flight } = match &args.calibration_trace {
        Some(trace) => {
            let Some(in_flight) = cfg.parallel.in_flight else {
                bail!("--calibration-trace needs --in-flight N: the window the traced run had, and the one predicted")
            };
            disagmoe_train::launch::calibrated_from_trace(&cfg, trace, in_flight)?
        }
        None => {
            let device = Default::default();
            disagmoe_train::launch::calibrate::<TrainBackend>(&cfg, &device, args.calibration_steps)
                .context("the calibration run")?
        }
    };
    let p = runtime::predict::predict(&layout, &calibration, in_flight, link)?;
    let report = PredictReport {
        placement: cfg.parallel.placement.name().to_string(),
        workers: layout.workers,
        in_flight,
        link,
        link_source,
        predicted_step_s: p.step_s,
        predicted_exposed_comm_s: p.exposed_comm_s,
        predicted_compute_s: p.compute_s,
        calibration_source: match &args.calibration_trace {
            Some(t) => format!("trace: {}", t.display()),
            None => format!("a run here of {} steps", args.calibration_steps),
        },
        calibration_steps: calibration.steps,
        calibration_step_s: calibration.step_s,
        calibration_overhead_s: calibration.overhead_s,
    };
    println!("{}", serde_json::to_string(&report)?);
    Ok(report)
}
