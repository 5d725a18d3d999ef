//! What a run tells its user: the progress bar or log lines while it runs, one metrics line per
//! step, and the summary at the end.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;

use super::engine::{EngineInfo, StepReport};
use crate::metrics::{ExpertLoad, StepMetrics};

/// The last line a run prints: what a user or a script wants to know.
#[derive(Debug, Clone, Serialize)]
pub struct TrainSummary {
    /// Loss of the first step.
    pub first_loss: f64,
    /// Loss of the last step.
    pub last_loss: f64,
    /// Loss of every step.
    pub losses: Vec<f64>,
    /// Held-out loss of the last evaluation (`--eval-every`), when there was one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f64>,
    /// Tokens per second after warm-up: over the steps after the first when two or more ran (the
    /// first step pays one-time costs: first touch of every buffer, optimizer moments, thread
    /// pool start), else over the one step. The usual throughput figure; [`tokens_per_s_all`]
    /// counts every step.
    ///
    /// [`tokens_per_s_all`]: TrainSummary::tokens_per_s_all
    pub tokens_per_s: f64,
    /// Tokens per second over every step, the first included.
    pub tokens_per_s_all: f64,
    /// Training FLOPs per token of the model at this sequence length (the products the planner's
    /// cost model counts: projections, attention scores, experts, head).
    pub flops_per_token: f64,
    /// `flops_per_token x tokens_per_s`, in TFLOP/s: the model FLOP rate the run reached (divide by
    /// the devices' peak for the model FLOP utilisation).
    pub model_tflops_per_s: f64,
    /// Wall time of the first step, seconds.
    pub first_step_s: f64,
    /// Steps run.
    pub steps: usize,
    /// Steps whose update was skipped for non-finite gradients.
    pub skipped_steps: usize,
    /// Backend the run used.
    pub backend: String,
    /// Parameters of the model.
    pub params: usize,
    /// Parameters each worker holds, by rank (`[params]` on one device).
    pub params_per_rank: Vec<usize>,
    /// Peak resident memory of each worker's process, MB, by rank (each process measures its own;
    /// under `local` the workers share one process and report it).
    pub peak_rss_mb_per_rank: Vec<f64>,
    /// Bytes of parameters, gradients and optimizer state each worker held at most (at a step's
    /// end), by rank, counted from its live tensors ([`crate::trainer::StateBytes`]).
    #[serde(default)]
    pub state_bytes_per_rank: Vec<u64>,
    /// The same, by kind.
    #[serde(default)]
    pub state_per_rank: Vec<crate::trainer::StateBytes>,
    /// Wall time of the training loop in seconds.
    pub train_s: f64,
    /// Which implementation each family of operations ran in this process (`attention`,
    /// `experts`, `dispatch`, `norms`, `linear`, `loss`, `optimizer` -> `flash`, `grouped`,
    /// `matmul`, `device`, `fused-cpu` or `reference`, several joined by `+`, most calls first;
    /// [`disagmoe_kernels::usage`]). Under MPI, this rank's.
    pub kernels: std::collections::BTreeMap<String, String>,
    /// Sum of squares of all parameters after the last step (compares runs and resumes).
    pub param_checksum: f64,
    /// Step of the checkpoint the run resumed from.
    pub resumed_from_step: Option<usize>,
    /// The run ended before `steps` (`stop_after` or a signal); a checkpoint holds its state.
    pub stopped_early: bool,
    /// The last checkpoint written.
    pub checkpoint: Option<PathBuf>,
    /// `single`, `disagg` or `ep`.
    pub placement: String,
    /// Workers (1 for `single`).
    pub workers: usize,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// Mean wall time of a step, seconds.
    pub step_s: f64,
    /// Mean per step of the time compute streams sat waiting for data (task inputs and gradient
    /// all-reduce), summed over workers.
    pub exposed_comm_s: f64,
    /// The part of `exposed_comm_s` during which the awaited data was already on the wire.
    pub in_flight_wait_s: f64,
    /// Mean per step of the time compute streams computed, summed over workers.
    pub compute_s: f64,
    /// Mean per step of the time transfers spent on emulated links, summed over workers (0 without
    /// `link_gbps`).
    pub link_s: f64,
    /// Mean per step and worker of the bytes sent (see [`crate::trainer::StepTiming::bytes_sent`]).
    pub bytes_sent_per_worker: f64,
    /// Of them, the token exchange's messages (dispatch, combine, residual and their gradients),
    /// as packed in the exchange's precision.
    pub exchange_bytes_per_worker: f64,
    /// The same by message kind.
    pub exchange_bytes_by_kind_per_worker: crate::metrics::ExchangeBytes,
    /// Mean per step of the bytes of the exchange's payloads copied from the workers' tensors to
    /// host memory, summed over workers (on a GPU: read back over PCIe). 0 when they stay on the
    /// device (`--exchange-payloads`) and on one device.
    pub payload_host_bytes: f64,
    /// What the exchange's payloads travel in (distributed runs): `f32`, `bf16`, or `fp8 dispatch,
    /// bf16 combine, bf16 gradients`.
    pub exchange_dtype: Option<String>,
    /// CPU threads each worker computed with.
    pub threads_per_worker: usize,
    /// Micro-batches each embedding worker kept in flight (distributed runs).
    pub in_flight: Option<usize>,
    /// The explicit expert placement at the run's end (MoE layer -> the experts of each of its
    /// holders), when the run placed experts by a table (`--redundant-experts`,
    /// `--expert-placement balanced`; `--rebalance-every` changes it during the run).
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub expert_placement: std::collections::BTreeMap<usize, Vec<Vec<usize>>>,
    /// Mean over the steps and MoE layers of `metrics.jsonl`'s `worker_imbalance` (the busiest
    /// expert worker's routed copies over the workers' mean, per micro-batch); distributed runs
    /// with MoE layers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker_imbalance: Option<f64>,
    /// The re-placements of the experts during the run (`rebalance_every`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rebalances: Option<crate::metrics::RebalanceSummary>,
    /// Each phase of a run in phases (`phases`): its shape, its placement and its speed. The
    /// throughput, timing, memory and exchange figures above are the last phase's; the steps,
    /// losses, checkpoint and resume fields are the whole run's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub phases: Vec<crate::phases::PhaseSummary>,
}

/// `(tokens_per_s, tokens_per_s_all, first_step_s)` from the wall time of each step (see
/// [`TrainSummary::tokens_per_s`]).
pub fn throughput(step_s: &[f64], tokens_per_step: usize) -> (f64, f64, f64) {
    let rate = |s: &[f64]| (s.len() * tokens_per_step) as f64 / s.iter().sum::<f64>().max(1e-9);
    let all = rate(step_s);
    let steady = if step_s.len() >= 2 { rate(&step_s[1..]) } else { all };
    (steady, all, step_s.first().copied().unwrap_or(0.0))
}

/// One metrics line from a step's report.
pub(crate) fn step_metrics(
    step: usize,
    report: &StepReport,
    info: &EngineInfo,
    lr: f64,
    tokens: usize,
    step_s: f64,
) -> StepMetrics {
    let t = report.timing;
    StepMetrics {
        step,
        loss: report.loss,
        lm_loss: report.lm_loss,
        aux_loss: report.aux_loss,
        z_loss: report.z_loss,
        mtp_loss: report.mtp_loss,
        lr,
        grad_norm: report.grad_norm,
        skipped: report.skipped,
        loss_scale: None,
        tokens,
        step_s,
        tokens_per_s: tokens as f64 / step_s.max(1e-12),
        exposed_comm_s: t.exposed_comm_s,
        in_flight_wait_s: t.in_flight_wait_s,
        compute_s: t.compute_s,
        link_s: t.link_s,
        bytes_sent: t.bytes_sent,
        exchange_bytes: t.exchange_bytes,
        payload_host_bytes: t.payload_host_bytes,
        expert_load: report
            .expert_counts
            .iter()
            .zip(&info.sparse_layers)
            .enumerate()
            .map(|(i, (c, &l))| ExpertLoad {
                dropped: report.dropped.get(i).copied().unwrap_or(0),
                worker_imbalance: report.worker_imbalance.get(i).copied(),
                ..ExpertLoad::from_counts(l, c)
            })
            .collect(),
        eval_loss: None,
        eval_perplexity: None,
        tokens_per_source: None,
        eval_loss_per_source: None,
        expert_placement: report.rebalance.as_ref().map(|(_, placement)| placement.clone()),
        rebalance: report.rebalance.as_ref().map(|(r, _)| r.clone()),
    }
}

/// The progress bar on a terminal, else a log line every `log_every` steps; silent when off.
pub(crate) struct Progress {
    bar: ProgressBar,
    interactive: bool,
    enabled: bool,
    log_every: usize,
    steps: usize,
    first_step: usize,
    start: Instant,
}

impl Progress {
    pub(crate) fn new(enabled: bool, log_every: usize, steps: usize, first_step: usize) -> Self {
        let interactive = enabled && std::io::stderr().is_terminal();
        let bar = ProgressBar::with_draw_target(
            Some(steps as u64),
            if interactive { ProgressDrawTarget::stderr() } else { ProgressDrawTarget::hidden() },
        );
        bar.set_style(
            ProgressStyle::with_template("{spinner} [{elapsed_precise}, eta {eta}] {bar:30} {pos}/{len} {msg}")
                .expect("valid template")
                .progress_chars("=> "),
        );
        bar.set_position(first_step as u64 - 1);
        Self { bar, interactive, enabled, log_every, steps, first_step, start: Instant::now() }
    }

    /// Shows step `m.step`'s outcome.
    pub(crate) fn step(&self, m: &StepMetrics, tokens_per_step: usize) {
        let done = m.step + 1 - self.first_step;
        let rate = (done * tokens_per_step) as f64 / self.start.elapsed().as_secs_f64().max(1e-9);
        self.bar.set_message(format!("loss {:.4} | lr {:.2e} | {rate:.0} tok/s", m.loss, m.lr));
        self.bar.inc(1);
        let due = m.step % self.log_every == 0 || m.step == 1 || m.step == self.steps || m.eval_loss.is_some();
        if self.enabled && !self.interactive && due {
            let worst = m.expert_load.iter().map(|l| l.max_mean_ratio).fold(0.0, f64::max);
            let dead: usize = m.expert_load.iter().map(|l| l.dead_experts).sum();
            let comm = if m.exposed_comm_s > 0.0 || m.link_s > 0.0 {
                format!(" exposed comm {:.3}s (on the wire {:.3}s)", m.exposed_comm_s, m.in_flight_wait_s)
            } else {
                String::new()
            };
            let eta = self.start.elapsed().as_secs_f64() / done as f64 * self.steps.saturating_sub(m.step) as f64;
            let eval = m.eval_loss.map_or_else(String::new, |l| format!(" eval {l:.4} (ppl {:.2})", l.exp()));
            eprintln!(
                "step {:>5}/{} loss {:.4} lm {:.4}{eval} lr {:.2e} grad_norm {:.3} load max/mean {worst:.2} dead {dead} {rate:.0} tok/s step {:.3}s eta {}{comm}",
                m.step, self.steps, m.loss, m.lm_loss, m.lr, m.grad_norm, m.step_s, human_duration(eta)
            );
        } else if self.enabled && self.interactive {
            if let Some(l) = m.eval_loss {
                let per_source: Vec<String> =
                    m.eval_loss_per_source.iter().flatten().map(|(s, l)| format!("{s} {l:.4}")).collect();
                let per_source = if per_source.is_empty() {
                    String::new()
                } else {
                    format!("; per source: {}", per_source.join(", "))
                };
                self.bar.println(format!(
                    "step {:>5}: eval loss {l:.4} (perplexity {:.2}){per_source}",
                    m.step,
                    l.exp()
                ));
            }
        }
    }

    pub(crate) fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// `1h 02m`, `3m 05s`, `12s`.
pub fn human_duration(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    match (s / 3600, (s % 3600) / 60, s % 60) {
        (0, 0, sec) => format!("{sec}s"),
        (0, m, sec) => format!("{m}m {sec:02}s"),
        (h, m, _) => format!("{h}h {m:02}m"),
    }
}

impl TrainSummary {
    /// A few lines for a person at a terminal: steps, loss, speed, time, and where the model,
    /// metrics and checkpoint went (`out`: the run's `--out`).
    pub fn for_people(&self, out: Option<&std::path::Path>) -> String {
        let mut lines = vec![format!(
            "trained {} steps{} on {} ({}{})",
            self.steps,
            if self.stopped_early { " (stopped early)" } else { "" },
            self.backend,
            self.placement,
            if self.workers > 1 { format!(", {} workers", self.workers) } else { String::new() }
        )];
        let pct = 100.0 * self.last_loss / self.first_loss;
        lines.push(format!("  loss       {:.4} -> {:.4} ({pct:.0}% of the first)", self.first_loss, self.last_loss));
        if let Some(l) = self.eval_loss {
            lines.push(format!("  eval loss  {l:.4} (perplexity {:.2}, held-out windows)", l.exp()));
        }
        if self.skipped_steps > 0 {
            lines.push(format!("  skipped    {} steps (non-finite gradients)", self.skipped_steps));
        }
        lines.push(format!(
            "  speed      {:.0} tokens/s, {:.3} s per step, {:.2}M parameters",
            self.tokens_per_s,
            self.step_s,
            self.params as f64 / 1e6
        ));
        // A run in phases: each phase's shape, split and speed (the speed line is the last phase's).
        for p in &self.phases {
            lines.push(format!(
                "  {:<11}steps {}-{}, {} x {} tokens, {}{}, {:.3} s per step",
                format!("phase {}", p.phase),
                p.first_step,
                p.last_step,
                p.batch,
                p.seq,
                p.placement,
                if p.planned { " (planned)" } else { "" },
                p.step_s
            ));
        }
        lines.push(format!("  time       {}", human_duration(self.train_s)));
        if let Some(out) = out {
            lines.push(format!("  model      {}", out.join("final").display()));
            lines.push(format!("  metrics    {}", out.join("metrics.jsonl").display()));
        }
        if let Some(ck) = &self.checkpoint {
            lines.push(format!("  checkpoint {}", ck.display()));
        }
        lines.join("\n")
    }
}
