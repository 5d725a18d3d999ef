//! Starting a run: the step engine its placement asks for (one device, or this process's workers of
//! a distributed run), then the training loop. The one place that knows both the loop and the
//! engines.

use std::sync::atomic::AtomicBool;

use burn::tensor::backend::AutodiffBackend;
use disagmoe_models::{FamilyConfig, TrainModule};

use crate::config::{AllocationMode, Precision, RunConfig};
use crate::error::{Result, TrainError};
use crate::runtime::predict::{Calibrated, Calibration};
use crate::single::SingleDevice;
use crate::trainer::{resume_point, StepEngine, TrainSummary};

/// Runs a training job and returns its summary.
pub fn train<B: AutodiffBackend>(cfg: &RunConfig, device: &B::Device) -> Result<TrainSummary> {
    train_until::<B>(cfg, device, &AtomicBool::new(false))
}

/// [`train`], finishing the current step and checkpointing when `stop` becomes true (the CLI sets
/// it on SIGINT/SIGTERM).
pub fn train_until<B: AutodiffBackend>(cfg: &RunConfig, device: &B::Device, stop: &AtomicBool) -> Result<TrainSummary> {
    train_on::<B>(cfg, std::slice::from_ref(device), stop)
}

/// [`train_until`] on several devices (`--devices`): one device's run computes on the first;
/// distributed workers take them round-robin by rank (an MPI rank: the one of its node-local
/// rank). `devices` must not be empty.
///
/// With `allocation = auto` the worker counts are the planner's choice, refined by measuring short
/// runs of the candidates on these devices ([`crate::allocate`]); the run trains that choice. A
/// run in phases trains them one after the other ([`crate::phases`]), each planned for its shape.
pub fn train_on<B: AutodiffBackend>(cfg: &RunConfig, devices: &[B::Device], stop: &AtomicBool) -> Result<TrainSummary> {
    cfg.validate()?;
    if devices.is_empty() {
        return Err(TrainError::option("devices", "needs at least one device"));
    }
    let choose = |c: &RunConfig| -> Result<RunConfig> {
        if c.parallel.allocation != AllocationMode::Auto {
            return Ok(c.clone());
        }
        let shape = c.model.resolve()?.model_shape("the run's model");
        let probe = AtomicBool::new(false);
        crate::allocate::choose::<B>(c, shape, &devices[0], |p| train_on::<B>(p, devices, &probe))
    };
    if !cfg.phases.is_empty() {
        return crate::phases::run_phases(cfg, stop, choose, |c, stop| train_on::<B>(c, devices, stop));
    }
    if cfg.parallel.allocation == AllocationMode::Auto {
        return train_on::<B>(&choose(cfg)?, devices, stop);
    }
    for d in devices {
        crate::backend::probe::<B>(d)?;
    }
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    disagmoe_kernels::cube::probe::check_env().map_err(|e| TrainError::option("DISAGMOE_EXPERT_PRODUCTS", e))?;
    crate::backend::keep_freed_memory();
    // One device computes on every core unless told otherwise; distributed workers get their own
    // pools (`runtime::engine`).
    let pool = if let (false, Some(threads)) = (cfg.parallel.distributed(), cfg.parallel.threads_per_worker) {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).stack_size(64 << 20).build().map_err(|e| {
            crate::error::TrainError::option("threads_per_worker", format!("cannot start {threads} threads: {e}"))
        })?;
        Some(pool)
    } else {
        None
    };
    let out = match pool {
        Some(pool) => pool.install(|| run::<B>(cfg, devices, stop)),
        None => run::<B>(cfg, devices, stop),
    };
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    for m in disagmoe_kernels::cube::probe::measured().into_iter().filter(|m| !m.cached) {
        tracing::info!(
            class = %m.class,
            grouped_ms = m.grouped_s * 1e3,
            matmul_ms = m.matmul_s * 1e3,
            chosen = ?m.chosen,
            "expert products measured"
        );
    }
    out
}

/// [`train_until`] of a model family given by its configuration type: a family defined outside the
/// crates (a new expert, router or attention type behind the traits of `disagmoe_models`) trains
/// with the same loop, data, checkpoints and metrics. `config` replaces the run's model option;
/// the placement must be `disagg` or `ep` (the runtime builds each worker's part from `C`), and
/// `--resume` and `--model-dir` read tensors under the names `C`'s types save. With
/// `allocation = auto` the worker counts are chosen as in [`train_on`], each candidate measured
/// on family `C`.
pub fn train_family<B, C>(cfg: &RunConfig, config: C, device: &B::Device, stop: &AtomicBool) -> Result<TrainSummary>
where
    B: AutodiffBackend,
    C: FamilyConfig,
    C::Attention<B>: TrainModule<B>,
    C::Router<B>: TrainModule<B>,
    C::Experts<B>: TrainModule<B>,
{
    cfg.validate()?;
    if !cfg.parallel.distributed() {
        return Err(crate::error::TrainError::option(
            "placement",
            format!(
                "a family defined outside the crates ({}) trains under disagg or ep (the runtime is generic \
                 over the family); allowed: disagg, ep",
                C::MODEL_TYPE
            ),
        ));
    }
    let choose = |c: &RunConfig| -> Result<RunConfig> {
        if c.parallel.allocation != AllocationMode::Auto {
            return Ok(c.clone());
        }
        let probe = AtomicBool::new(false);
        crate::allocate::choose::<B>(c, config.model_shape("the run's model"), device, |p| {
            train_family::<B, C>(p, config.clone(), device, &probe)
        })
    };
    if !cfg.phases.is_empty() {
        return crate::phases::run_phases(cfg, stop, choose, |c, stop| {
            train_family::<B, C>(c, config.clone(), device, stop)
        });
    }
    if cfg.parallel.allocation == AllocationMode::Auto {
        return train_family::<B, C>(&choose(cfg)?, config, device, stop);
    }
    check_precision::<B>(cfg, device)?;
    crate::backend::keep_freed_memory();
    let resumed = resume_point(cfg)?;
    let mut engine =
        crate::runtime::start_family::<B, C>(cfg, &config, std::slice::from_ref(device), resumed.as_ref())?;
    with_kernel_usage::<B>(device, || crate::trainer::run(cfg, engine.as_mut(), resumed.map(|(_, state)| state), stop))
}

/// Runs `train` and records in its summary which implementation each family of operations ran
/// ([`disagmoe_kernels::usage`]); on a CubeCL backend whose kernels all fell back to the
/// reference, warns once per process on stderr.
fn with_kernel_usage<B: AutodiffBackend>(
    device: &B::Device,
    train: impl FnOnce() -> Result<TrainSummary>,
) -> Result<TrainSummary> {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let before = disagmoe_kernels::usage::snapshot();
    let mut summary = train()?;
    summary.kernels = disagmoe_kernels::usage::snapshot().since(&before);
    if let Some(warning) = fallback_warning(&B::name(device), disagmoe_kernels::enabled(), &summary.kernels) {
        if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
            eprintln!("{warning}");
        }
    }
    Ok(summary)
}

/// The warning for a run on backend `name` (Burn's `Backend::name`) whose CubeCL kernels, switched
/// on, all fell back to the reference (`kernels`: the summary's), if that is what happened.
fn fallback_warning(name: &str, enabled: bool, kernels: &std::collections::BTreeMap<String, String>) -> Option<String> {
    (name.contains("cubecl") && enabled && disagmoe_kernels::usage::all_fell_back(kernels)).then(|| {
        format!(
            "warning: on {name} every CubeCL kernel fell back to the reference composition ({}): the backend type is \
             not one the kernels are built for (Burn's fusion?) or the tensors are past what they index",
            serde_json::to_string(kernels).unwrap_or_default()
        )
    })
}

/// Refuses a product precision the backend lacks on `device`, naming what it has.
pub(crate) fn check_precision<B: AutodiffBackend>(cfg: &RunConfig, device: &B::Device) -> Result<()> {
    let p = cfg.precision.compute;
    if p.supported::<B>(device) {
        return Ok(());
    }
    let has: Vec<&str> = [Precision::F32, Precision::Bf16, Precision::F16]
        .iter()
        .filter(|q| q.supported::<B>(device))
        .map(|q| q.name())
        .collect();
    Err(TrainError::option(
        "precision",
        format!("{p} is not supported by the {} backend on this device; it has: {}", B::name(device), has.join(", ")),
    ))
}

fn run<B: AutodiffBackend>(cfg: &RunConfig, devices: &[B::Device], stop: &AtomicBool) -> Result<TrainSummary> {
    for d in devices {
        check_precision::<B>(cfg, d)?;
    }
    // The products of the models on this thread (one device; distributed workers set their own).
    disagmoe_kernels::precision::set_precision_for_thread(Some(cfg.precision.compute));
    let out = run_engine::<B>(cfg, devices, stop);
    disagmoe_kernels::precision::set_precision_for_thread(None);
    out
}

fn run_engine<B: AutodiffBackend>(cfg: &RunConfig, devices: &[B::Device], stop: &AtomicBool) -> Result<TrainSummary> {
    // A checkpoint resumes under any placement, whichever wrote it.
    let resumed = resume_point(cfg)?;
    let mut engine: Box<dyn StepEngine> = if cfg.parallel.distributed() {
        crate::runtime::start::<B>(cfg, devices, resumed.as_ref())?
    } else {
        Box::new(SingleDevice::<B>::new(cfg, &devices[0], resumed.as_ref().map(|(path, _)| path.as_path()))?)
    };
    with_kernel_usage::<B>(&devices[0], || {
        crate::trainer::run(cfg, engine.as_mut(), resumed.map(|(_, state)| state), stop)
    })
}

/// Calibrates the simulator's model of a run ([`crate::runtime::predict`]): runs `cfg` for `steps`
/// steps traced, without link emulation, writing nothing else (no output directory, checkpoints or
/// evaluation), and reads the durations and sizes from its trace.
pub fn calibrate<B: AutodiffBackend>(cfg: &RunConfig, device: &B::Device, steps: usize) -> Result<Calibrated> {
    if steps < 2 {
        return Err(TrainError::option("calibration_steps", format!("must be at least 2, got {steps}")));
    }
    let dir = crate::checkpoint::ScratchDir::create("disagmoe-calibration", "cannot create calibration directory")?;
    let trace = dir.path().join("trace.json");
    // A run in phases is calibrated on its first phase's shape.
    let mut c = if cfg.phases.is_empty() { cfg.clone() } else { cfg.phase(0) };
    c.steps = steps;
    c.out = None;
    c.progress = false;
    c.checkpoint = Default::default();
    c.data.eval_every = 0;
    c.parallel.link_gbps = None;
    c.parallel.trace = Some(trace.clone());
    let summary = train::<B>(&c, device)?;
    calibrated_from_trace(&c, &trace, summary.in_flight.unwrap_or(1))
}

/// The simulator's model of `cfg`'s run from `trace`, a trace of it run without link emulation
/// with `in_flight` micro-batches in flight (by [`calibrate`], or by any earlier run).
pub fn calibrated_from_trace(cfg: &RunConfig, trace: &std::path::Path, in_flight: usize) -> Result<Calibrated> {
    let model = cfg.model.resolve()?;
    let experts = model.model_shape("calibration").moe.experts;
    let layout = crate::runtime::layout_of(cfg, model.dims().num_hidden_layers, experts)?;
    let calibration = Calibration::from_trace(trace, layout.workers)?.with_overhead(&layout, in_flight)?;
    Ok(Calibrated { layout, calibration, in_flight })
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_cubecl_run_whose_kernels_all_fell_back_is_warned_of() {
        let used = |pairs: &[(&str, &str)]| pairs.iter().map(|(f, i)| (f.to_string(), i.to_string())).collect();
        let fell = used(&[("attention", "reference"), ("experts", "reference"), ("norms", "reference")]);
        let w = super::fallback_warning("autodiff<fusion<cubecl<cuda>>>", true, &fell).expect("warned");
        assert!(
            w.starts_with("warning: ")
                && w.contains("fusion<cubecl<cuda>>")
                && w.contains("\"attention\":\"reference\""),
            "{w}"
        );
        assert_eq!(super::fallback_warning("autodiff<flex>", true, &fell), None, "not a CubeCL backend");
        assert_eq!(super::fallback_warning("autodiff<cubecl<wgpu>>", false, &fell), None, "switched off on purpose");
        let ran = used(&[("attention", "flash"), ("experts", "matmul")]);
        assert_eq!(super::fallback_warning("autodiff<cubecl<wgpu>>", true, &ran), None);
    }
}
