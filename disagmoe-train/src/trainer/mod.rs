//! The one training loop, for every placement: resume, step, update, report, checkpoint, summary.
//!
//! What runs a step is a [`StepEngine`]: the single-device engine ([`crate::single`]) or the
//! distributed runtime; the loop knows neither. [`crate::launch`] picks the
//! engine for the run's placement and hands it here.

pub mod engine;
pub mod report;

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::time::Instant;

pub use self::engine::{EngineInfo, FinalReport, StateBytes, StepEngine, StepReport, StepTiming};
use self::report::{step_metrics, Progress};
pub use self::report::{throughput, TrainSummary};
use crate::checkpoint::{latest_checkpoint, read_state, verify_checkpoint, RunSettings, TrainState};
use crate::config::RunConfig;
use crate::data::blend::RunData;
use crate::data::Batch;
use crate::error::{Result, TrainError};
use crate::loss_scale::LossScaleState;
use crate::metrics::{JsonlWriter, StepMetrics};

/// Where a run resumes: the newest complete checkpoint of `checkpoint.resume` and its state; none
/// for a fresh run, after checking that the checkpoint directory holds no other run's checkpoints.
pub fn resume_point(cfg: &RunConfig) -> Result<Option<(PathBuf, TrainState)>> {
    let Some(dir) = &cfg.checkpoint.resume else {
        if let Some(dir) = cfg.checkpoint.directory() {
            if let Some(existing) = latest_checkpoint(&dir)? {
                return Err(TrainError::Checkpoint {
                    path: dir.clone(),
                    message: format!(
                        "already holds checkpoints of a run (newest: {}); pass --resume {} to continue it, or choose another --checkpoint-dir",
                        existing.display(),
                        dir.display()
                    ),
                });
            }
        }
        return Ok(None);
    };
    let path = latest_checkpoint(dir)?.ok_or_else(|| TrainError::Checkpoint {
        path: dir.clone(),
        message: "holds no complete checkpoint to resume from (expected step-<n> directories with a manifest)".into(),
    })?;
    verify_checkpoint(&path)?;
    let state = read_state(&path)?;
    match &state.settings {
        Some(was) => was.check_resume(&RunSettings::of(cfg)?, &cfg.checkpoint.allow_change, &path)?,
        None if state.seed != cfg.seed && !cfg.checkpoint.allow_change.iter().any(|c| c == "seed") => {
            return Err(TrainError::Checkpoint {
                path: path.clone(),
                message: format!(
                    "was written by a run with --seed {}, this run has --seed {}; pass --seed {} to continue that run, or --allow-change seed to change it on purpose",
                    state.seed, cfg.seed, state.seed
                ),
            });
        }
        None => {}
    }
    if state.step >= cfg.steps {
        return Err(TrainError::option(
            "steps",
            format!(
                "the checkpoint {} is at step {}; steps must be larger to continue, got {}",
                path.display(),
                state.step,
                cfg.steps
            ),
        ));
    }
    tracing::info!(checkpoint = %path.display(), step = state.step, "resuming");
    Ok(Some((path, state)))
}

/// Where the data continues for a run resumed from `state` at sequence length `seq`: the same
/// position, or, when the checkpoint's run read windows of another length (a phase boundary,
/// `--allow-change seq`), the window of the new length holding the same count of tokens read in
/// the epoch (rounded down).
pub fn position_at_seq(state: &TrainState, seq: usize) -> crate::data::DataPosition {
    let mut position = state.data;
    if let Some(was) = state.settings.as_ref().map(|s| s.seq).filter(|&was| was != seq && seq > 0) {
        position.cursor = ((position.cursor as u128 * was as u128) / seq as u128) as usize;
    }
    position
}

/// What the loop has seen so far.
struct History {
    losses: Vec<f64>,
    skipped: usize,
    step_s: Vec<f64>,
    timing: StepTiming,
    /// Each MoE layer-step's `worker_imbalance`.
    imbalance: Vec<f64>,
    rebalances: Vec<crate::metrics::Rebalance>,
}

impl History {
    fn record(&mut self, m: &StepMetrics) {
        self.losses.push(m.loss);
        self.skipped += m.skipped as usize;
        self.step_s.push(m.step_s);
        self.timing.exposed_comm_s += m.exposed_comm_s;
        self.timing.in_flight_wait_s += m.in_flight_wait_s;
        self.timing.compute_s += m.compute_s;
        self.timing.link_s += m.link_s;
        self.timing.bytes_sent += m.bytes_sent;
        self.timing.exchange_bytes.add(&m.exchange_bytes);
        self.timing.payload_host_bytes += m.payload_host_bytes;
        self.imbalance.extend(m.expert_load.iter().filter_map(|l| l.worker_imbalance));
        self.rebalances.extend(m.rebalance.clone());
    }
}

/// Trains with `engine` from `resumed` (or step 1) to `stop_after`/`steps`, or until `stop` is set
/// (then it finishes the step and checkpoints); returns the summary.
pub fn run(
    cfg: &RunConfig,
    engine: &mut dyn StepEngine,
    resumed: Option<TrainState>,
    stop: &AtomicBool,
) -> Result<TrainSummary> {
    let info = engine.info();
    // Every process of a run evaluates together (its workers take part in each pass), so with
    // evaluation on each one reads the corpus to know the held-out windows.
    let mut data =
        if info.needs_data || cfg.data.eval_every > 0 { Some(RunData::for_run(cfg, info.vocab_size)?) } else { None };
    if let (Some(d), Some(s)) = (&mut data, &resumed) {
        d.seek(position_at_seq(s, cfg.data.seq));
    }
    if let (Some(d), true) = (&data, cfg.data.eval_every > 0) {
        for source in d.sources() {
            let d = &source.data;
            if d.eval_windows() < cfg.data.batch {
                return Err(TrainError::Corpus {
                    path: source.label.clone().into(),
                    message: format!(
                        "holds out {} windows of {} tokens at eval_fraction {} ({} for training), fewer than one batch \
                         ({}) to evaluate: raise --eval-fraction or use more text",
                        d.eval_windows(),
                        cfg.data.seq,
                        cfg.data.eval_fraction,
                        d.windows(),
                        cfg.data.batch
                    ),
                });
            }
        }
    }
    let mut metrics = match (&cfg.out, info.primary) {
        (Some(dir), true) => {
            let path = dir.join("metrics.jsonl");
            // A resumed run rewrites the steps after its checkpoint: none appears twice.
            if let Some(s) = &resumed {
                crate::metrics::truncate_after(&path, s.step)?;
            }
            Some(JsonlWriter::append(&path)?)
        }
        _ => None,
    };
    let mut tensorboard = match (&cfg.tensorboard, info.primary) {
        (Some(dir), true) => Some(crate::tensorboard::TensorBoard::create(dir)?),
        _ => None,
    };
    if let Some(d) = &data {
        tracing::info!(
            model = info.model_type,
            backend = crate::BACKEND_NAME,
            params = info.params,
            placement = info.placement,
            corpus = d.describe(),
            corpus_tokens = d.num_tokens(),
            windows = d.windows(),
            "training"
        );
    }
    let (first_step, last_step) = (resumed.as_ref().map_or(1, |s| s.step + 1), cfg.last_step());
    let lr_schedule = cfg.optimizer.lr_schedule(cfg.steps);
    let tokens = cfg.data.tokens_per_step();
    let progress = Progress::new(cfg.progress && info.primary, cfg.log_every, cfg.steps, first_step);
    let mut seen = History {
        losses: resumed.as_ref().map(|s| s.losses.clone()).unwrap_or_default(),
        skipped: resumed.as_ref().map_or(0, |s| s.skipped_steps),
        step_s: Vec::new(),
        timing: StepTiming::default(),
        imbalance: Vec::new(),
        rebalances: Vec::new(),
    };
    let mut scaler = cfg.precision.loss_scaler(resumed.as_ref().and_then(|s| s.loss_scale));
    let (start, mut done, mut last_checkpoint) = (Instant::now(), first_step - 1, None);
    let mut eval_loss = None;
    // The expert placement in effect (a rebalance changes it).
    let mut placement_now = info.expert_placement.clone();
    for step in first_step..=last_step {
        let t0 = Instant::now();
        let (batch, per_source) = match data.as_mut().filter(|_| info.needs_data) {
            Some(d) => d.next_windows(cfg.data.batch),
            None => (Batch::empty(), Vec::new()),
        };
        let lr = lr_schedule.at(step);
        let loss_scale = scaler.scale();
        let report = engine.step(step, &batch, lr, loss_scale, stop)?;
        scaler.update(report.skipped);
        let mut record = step_metrics(step, &report, &info, lr, tokens, t0.elapsed().as_secs_f64());
        record.loss_scale = scaler.state().map(|_| loss_scale);
        if step == first_step && !info.expert_placement.is_empty() && record.expert_placement.is_none() {
            record.expert_placement = Some(info.expert_placement.clone());
        }
        if let Some(placement) = &record.expert_placement {
            placement_now = placement.clone();
        }
        if let Some(d) = data.as_ref().filter(|d| d.is_blend() && !per_source.is_empty()) {
            let labels = d.sources().iter().map(|s| s.label.clone());
            record.tokens_per_source =
                Some(labels.zip(&per_source).map(|(l, &n)| (l, (n * cfg.data.seq) as u64)).collect());
        }
        let eval_due = cfg.data.eval_every > 0 && (step % cfg.data.eval_every == 0 || step == last_step);
        if let (true, Some(d)) = (eval_due, &data) {
            let (loss, per_source) = evaluate(engine, d, cfg, info.needs_data)?;
            record.eval_loss = Some(loss);
            record.eval_loss_per_source = d.is_blend().then_some(per_source);
            record.eval_perplexity = Some(loss.exp());
            eval_loss = Some(loss);
        }
        seen.record(&record);
        if let Some(w) = &mut metrics {
            w.write(&record)?;
        }
        if let Some(tb) = &mut tensorboard {
            tb.write(&record)?;
        }
        progress.step(&record, tokens);
        done = step;
        let interrupted = report.stop;
        let due = cfg.checkpoint.every > 0 && step % cfg.checkpoint.every == 0;
        if let (Some(dir), true) = (cfg.checkpoint.directory(), due || step == last_step || interrupted) {
            last_checkpoint = Some(save(cfg, engine, &dir, step, data.as_ref(), &seen, scaler.state())?);
        }
        if interrupted {
            tracing::warn!(step, "stopped by signal after finishing the step");
            break;
        }
    }
    progress.finish();
    let train_s = start.elapsed().as_secs_f64();
    let final_dir = cfg.out.as_ref().map(|d| d.join("final"));
    let FinalReport { param_checksum, peak_rss_mb_per_rank, state_per_rank } = engine.finish(final_dir.as_deref())?;
    if let (Some(dir), true) = (&final_dir, info.primary) {
        copy_tokenizer(cfg, dir)?;
    }
    // What each rank holds at the end: the last re-placement's count, else the start's.
    let params_per_rank = (seen.rebalances.last().map(|r| r.params_per_rank.clone()))
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| info.params_per_rank.clone());
    if info.primary && cfg.progress && info.workers > 1 {
        // What each worker held and how much memory its process needed at most.
        for (rank, name) in info.worker_names.iter().enumerate() {
            let params = params_per_rank.get(rank).copied().unwrap_or(0);
            let rss = peak_rss_mb_per_rank.get(rank).copied().unwrap_or(0.0);
            let state = state_per_rank.get(rank).map_or(0.0, |s| s.total() as f64 / 1e6);
            eprintln!(
                "{name}: {:.2}M parameters, {state:.1} MB of weights, gradients and optimizer state, peak RSS {rss:.0} MB",
                params as f64 / 1e6
            );
        }
    }
    let steps_run = done + 1 - first_step;
    let (tokens_per_s, tokens_per_s_all, first_step_s) = throughput(&seen.step_s, tokens);
    let per_step = |x: f64| x / steps_run.max(1) as f64;
    Ok(TrainSummary {
        first_loss: seen.losses.first().copied().unwrap_or(f64::NAN),
        last_loss: seen.losses.last().copied().unwrap_or(f64::NAN),
        tokens_per_s,
        tokens_per_s_all,
        flops_per_token: info.flops_per_token,
        model_tflops_per_s: info.flops_per_token * tokens_per_s / 1e12,
        first_step_s,
        steps: done,
        skipped_steps: seen.skipped,
        backend: crate::BACKEND_NAME.into(),
        params: info.params,
        params_per_rank,
        peak_rss_mb_per_rank,
        state_bytes_per_rank: state_per_rank.iter().map(StateBytes::total).collect(),
        state_per_rank,
        train_s,
        param_checksum,
        kernels: Default::default(),
        resumed_from_step: resumed.as_ref().map(|s| s.step),
        stopped_early: done < cfg.steps,
        checkpoint: last_checkpoint,
        placement: info.placement.into(),
        workers: info.workers,
        micro_batches: cfg.micro_batches(),
        step_s: per_step(seen.step_s.iter().sum()),
        exposed_comm_s: per_step(seen.timing.exposed_comm_s),
        in_flight_wait_s: per_step(seen.timing.in_flight_wait_s),
        compute_s: per_step(seen.timing.compute_s),
        link_s: per_step(seen.timing.link_s),
        bytes_sent_per_worker: per_step(seen.timing.bytes_sent) / info.workers.max(1) as f64,
        exchange_bytes_per_worker: per_step(seen.timing.exchange_bytes.total()) / info.workers.max(1) as f64,
        exchange_bytes_by_kind_per_worker: seen
            .timing
            .exchange_bytes
            .scaled(per_step(1.0) / info.workers.max(1) as f64),
        payload_host_bytes: per_step(seen.timing.payload_host_bytes),
        exchange_dtype: cfg
            .parallel
            .distributed()
            .then(|| cfg.parallel.exchange_precision(cfg.precision.compute).describe()),
        threads_per_worker: cfg.parallel.threads_per_worker(),
        in_flight: cfg.parallel.distributed().then_some(info.in_flight),
        expert_placement: placement_now,
        worker_imbalance: (!seen.imbalance.is_empty())
            .then(|| seen.imbalance.iter().sum::<f64>() / seen.imbalance.len() as f64),
        rebalances: crate::metrics::RebalanceSummary::of(&seen.rebalances),
        losses: seen.losses,
        eval_loss,
        phases: Vec::new(),
    })
}

/// The mean held-out loss, over the same windows every time: the first `eval_batches` full
/// batches of held-out windows (at least one: checked at start), as training reads batches; for a
/// blend, that of each source, and their mean weighted as the blend (the blend's expected loss).
/// Every process calls it together; one without data (no embedding worker, nor an attention
/// worker under a document mask) passes an empty batch.
fn evaluate(
    engine: &mut dyn StepEngine,
    data: &RunData,
    cfg: &RunConfig,
    with_rows: bool,
) -> Result<(f64, std::collections::BTreeMap<String, f64>)> {
    let (mut mean, mut per_source) = (0.0, std::collections::BTreeMap::new());
    for source in data.sources() {
        let d = &source.data;
        let batches = cfg.data.eval_batches.min(d.eval_windows() / cfg.data.batch);
        let mut sum = 0.0;
        for b in 0..batches {
            let batch =
                if with_rows { d.eval_batch(b * cfg.data.batch..(b + 1) * cfg.data.batch) } else { Batch::empty() };
            sum += engine.evaluate(&batch)?;
        }
        let loss = sum / batches as f64;
        mean += source.weight * loss;
        per_source.insert(source.label.clone(), loss);
    }
    Ok((mean, per_source))
}

/// Puts the run's `tokenizer.json` (`--tokenizer`, else the starting checkpoint's) next to the
/// final model, so that `generate` and transformers read the model with the tokenizer it learned.
fn copy_tokenizer(cfg: &RunConfig, final_dir: &Path) -> Result<()> {
    let Some(source) = crate::data::tokenizer_file(cfg.data.tokenizer.as_deref(), cfg.model.dir.as_deref()) else {
        return Ok(());
    };
    let target = final_dir.join("tokenizer.json");
    let text = std::fs::read(&source).map_err(|source_err| TrainError::Io {
        action: "cannot read the tokenizer",
        path: source.clone(),
        source: source_err,
    })?;
    Ok(disagmoe_models::weights::write_atomically(&target, |tmp| std::fs::write(tmp, &text))?)
}

/// Writes a checkpoint of the run after `step`.
fn save(
    cfg: &RunConfig,
    engine: &mut dyn StepEngine,
    dir: &Path,
    step: usize,
    data: Option<&RunData>,
    seen: &History,
    loss_scale: Option<LossScaleState>,
) -> Result<PathBuf> {
    let state = TrainState {
        step,
        optimizer_steps: engine.optimizer_steps(),
        data: data.map(|d| d.position()).unwrap_or_default(),
        losses: seen.losses.clone(),
        skipped_steps: seen.skipped,
        seed: cfg.seed,
        total_steps: cfg.steps,
        settings: Some(RunSettings::of(cfg)?),
        written_by: Some(cfg.parallel.describe()),
        loss_scale,
    };
    engine.save_checkpoint(dir, &state, cfg.checkpoint.keep)
}
