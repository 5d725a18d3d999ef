//! The AF-Pipe runtime: disaggregated training on attention and expert workers, and the colocated
//! expert-parallel baseline, over a transport. It is a step engine of the training loop
//! ([`crate::trainer::StepEngine`]), which is all it knows of the trainer.
//!
//! [`start`] deals the model's pieces ([`disagmoe_models::stages`]) to workers by
//! [`layout::Layout`] and starts every worker of this process ([`engine::Distributed`]): all of
//! them as threads (`local`), or this process's one under `mpirun` (`mpi`, `nccl`). Each worker
//! builds (or reads) only what it holds ([`part`]). Each step, every worker runs its message loop
//! ([`worker::Worker`]): messages of [`msg`]'s vocabulary through its [`transport`] port, the order
//! of its tasks from the [`scheduler`], the token exchange of [`exchange`] and the sums of
//! [`collectives`];
//! every worker sees the same step outcome after the step's global reduction, so the loop's report
//! is the same whoever prints it. The final model is written by every worker ([`shards`]).

pub mod collectives;
pub mod engine;
pub mod exchange;
pub mod layout;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod msg;
#[cfg(feature = "nccl")]
pub mod nccl;
#[cfg(feature = "mpi")]
pub mod netbench;
pub mod part;
pub mod predict;
pub mod scheduler;
pub mod shards;
pub mod trace;
pub mod transport;
#[cfg(feature = "wire")]
pub mod wire_samples;
pub mod worker;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;

use disagmoe_models::{AuxLoss, FamilyConfig, FamilyVisitor, ModelConfig, Recompute, TrainModule};

use self::layout::Layout;
use self::part::WeightSource;
use self::transport::LinkModel;
use self::worker::StepSettings;
use crate::checkpoint::TrainState;
use crate::config::{ExchangePayloads, NonFinitePolicy, Placement, RunConfig, TransportKind};
use crate::error::{Result, TrainError};
use crate::trainer::StepEngine;

/// The resolved layout of a run config (`disagg` or `ep`) for a model of `layers` layers of
/// `experts` routed experts.
pub fn layout_of(cfg: &RunConfig, layers: usize, experts: usize) -> Result<Layout> {
    let p = &cfg.parallel;
    let mbs = cfg.micro_batches();
    match p.placement {
        Placement::Disagg => Layout::disagg(layers, experts, mbs, p.attn_workers, p.ffn_workers, p.groups)
            .and_then(|l| l.with_context_parallel(p.context_parallel))
            .map_err(layout::option_error),
        Placement::Ep => Layout::ep(layers, experts, mbs, p.workers).map_err(layout::option_error),
        Placement::Single => Err(TrainError::option("placement", "the runtime runs `disagg` or `ep`")),
    }
}

/// Places every MoE layer's experts as `[parallel]` asks: the contiguous ranges (nothing to do),
/// or EPLB's balanced placement of `E + redundant_experts` slots for the `expert_load`
/// (`disagmoe_core::experts::ExpertMap::balanced`), every process computing the same one.
pub fn place_experts(cfg: &RunConfig, layout: &mut Layout) -> Result<()> {
    use disagmoe_core::experts::{ExpertMap, ExpertPlacement};
    let p = &cfg.parallel;
    if p.expert_placement() == ExpertPlacement::Contiguous {
        return Ok(());
    }
    let load = p.expert_load()?;
    let sparse: Vec<usize> = (0..layout.layers).filter(|&l| layout.sparse[l]).collect();
    for l in sparse {
        let shares = load.shares(l, layout.experts).map_err(layout::option_error)?;
        let holders = layout.ffn_holders(l).len();
        let map = ExpertMap::balanced(&shares, holders, p.redundant_experts).map_err(layout::option_error)?;
        layout.set_expert_map(l, map).map_err(layout::option_error)?;
    }
    Ok(())
}

/// The file of a checkpoint that holds the expert placement it was written under (written when a
/// layer's experts are placed by an explicit table).
pub const PLACEMENT_FILE: &str = "expert_placement.json";

/// An explicit expert placement as a checkpoint keeps it: the options it was computed from and each
/// MoE layer's experts per holder.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedPlacement {
    /// The `[parallel]` options the placement was computed from (`placement_options`).
    pub options: String,
    /// Layer -> for each of its expert holders, the experts it holds.
    pub layers: std::collections::BTreeMap<usize, Vec<Vec<usize>>>,
    /// With `rebalance_every`: each MoE layer's moving average of its experts' shares of the
    /// routed copies, as it stood when the checkpoint was written (the next re-placement's input).
    /// Written as decimal strings (Rust's shortest round-trip form, parsed back exactly): JSON
    /// numbers would come back within a unit in the last place, and a resume must continue with
    /// the same bits.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty", with = "exact_loads")]
    pub loads: std::collections::BTreeMap<usize, Vec<f64>>,
}

/// [`SavedPlacement::loads`] as decimal strings.
mod exact_loads {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(loads: &BTreeMap<usize, Vec<f64>>, s: S) -> Result<S::Ok, S::Error> {
        let text: BTreeMap<usize, Vec<String>> =
            loads.iter().map(|(l, v)| (*l, v.iter().map(f64::to_string).collect())).collect();
        text.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<usize, Vec<f64>>, D::Error> {
        let text = BTreeMap::<usize, Vec<String>>::deserialize(d)?;
        let parse = |x: &String| x.parse::<f64>().map_err(|e| serde::de::Error::custom(format!("load {x:?}: {e}")));
        text.into_iter().map(|(l, v)| Ok((l, v.iter().map(parse).collect::<Result<_, _>>()?))).collect()
    }
}

/// Each MoE layer's moving average of its experts' shares of the routed copies.
pub type ExpertLoads = std::collections::BTreeMap<usize, Vec<f64>>;

/// The options an explicit placement is computed from, in words: a resume whose options are the
/// same keeps the checkpoint's placement (so it continues exactly, even if the load file has
/// grown since), one whose options differ places the experts anew.
pub fn placement_options(cfg: &RunConfig) -> String {
    let p = &cfg.parallel;
    format!(
        "expert_placement {} redundant_experts {} expert_load {}",
        p.expert_placement().name(),
        p.redundant_experts,
        p.expert_load.as_deref().unwrap_or("uniform")
    )
}

/// The explicit placements of `layout` (empty when every layer is contiguous).
pub fn explicit_placement(layout: &Layout) -> std::collections::BTreeMap<usize, Vec<Vec<usize>>> {
    (layout.expert_maps.iter().enumerate()).filter_map(|(l, m)| m.as_ref().map(|m| (l, m.slots.clone()))).collect()
}

/// At a resume from `checkpoint`: keeps the placement it was written under when the run's
/// placement options are the ones it was computed from and it fits this layout (the same holders
/// per layer); otherwise the experts stay as [`place_experts`] placed them (resharded on load), and
/// the log says why. Returns the moving average of the expert loads saved with a placement kept
/// (empty otherwise).
pub fn restore_placement(cfg: &RunConfig, layout: &mut Layout, checkpoint: &std::path::Path) -> Result<ExpertLoads> {
    let path = checkpoint.join(PLACEMENT_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(ExpertLoads::new()),
        Err(source) => return Err(TrainError::Io { action: "cannot read", path, source }),
    };
    let saved: SavedPlacement = serde_json::from_str(&text)
        .map_err(|e| TrainError::Checkpoint { path: path.clone(), message: format!("not an expert placement: {e}") })?;
    let options = placement_options(cfg);
    if saved.options != options
        || cfg.parallel.expert_placement() == disagmoe_core::experts::ExpertPlacement::Contiguous
    {
        tracing::info!(was = saved.options, now = options, "placing the experts anew: the placement options changed");
        return Ok(ExpertLoads::new());
    }
    let mut restored = layout.clone();
    for (&l, slots) in &saved.layers {
        let experts = layout.experts;
        let mut replicas = vec![0; experts];
        slots.iter().flatten().filter(|&&e| e < experts).for_each(|&e| replicas[e] += 1);
        let map = disagmoe_core::experts::ExpertMap { slots: slots.clone(), replicas };
        if l >= layout.layers || !layout.sparse[l] || restored.set_expert_map(l, map).is_err() {
            tracing::info!(layer = l, "placing the experts anew: the checkpoint's placement does not fit this layout");
            return Ok(ExpertLoads::new());
        }
    }
    *layout = restored;
    // A moving average is kept only if it fits the layout's MoE layers and experts.
    let fits = saved.loads.iter().all(|(&l, v)| l < layout.layers && layout.sparse[l] && v.len() == layout.experts);
    Ok(if fits { saved.loads } else { ExpertLoads::new() })
}

/// Everything a worker needs besides its endpoint and its part.
pub(crate) struct Shared<B: AutodiffBackend> {
    pub(crate) cfg: RunConfig,
    pub(crate) layout: Layout,
    pub(crate) settings: StepSettings,
    pub(crate) rope: (Tensor<B, 4>, Tensor<B, 4>),
    /// Where the weights come from.
    pub(crate) source: WeightSource,
    /// The model's `config.json` (rank 0 writes it with the final model).
    pub(crate) hf_config: serde_json::Value,
    /// The checkpoint the run resumes from (its moments are read too) and its optimizer steps.
    pub(crate) resume: Option<(PathBuf, u64)>,
}

/// Bytes of activations one micro-batch of `tokens` tokens keeps alive on an attention worker
/// holding `layers` layers (inputs, norms, projections, attention output and residual of each,
/// about 16 floats per token and width, or only the input, 1, when the attention stages are
/// recomputed; the head's logits and their gradient). An estimate: the memory budget of the
/// in-flight window, documented in ARCHITECTURE.md.
pub fn activation_bytes(tokens: usize, hidden: usize, layers: usize, vocab: usize, recompute: Recompute) -> usize {
    let per_layer = if recompute.attention() { 1 } else { 16 };
    tokens * 4 * (per_layer * hidden * layers.max(1) + 2 * vocab)
}

/// Micro-batches each embedding worker keeps in flight: `in_flight` when given (refused when a
/// worker owns fewer micro-batches, as it could not be honoured); else 1 for `ep` (no overlap), and
/// for `disagg` as many as half the memory available to this process holds, shared by the workers
/// it runs (at least one, at most all of the worker's micro-batches).
fn in_flight_window(cfg: &RunConfig, layout: &Layout, hidden: usize, vocab: usize) -> Result<usize> {
    let own = layout.fewest_owned_micro_batches();
    if let Some(n) = cfg.parallel.in_flight {
        if n > own {
            return Err(TrainError::option(
                "in_flight",
                format!(
                    "must be from 1 to {own}: under {} with {} micro-batches each embedding worker owns {own} (with context parallelism: units, its shares of micro-batches), got {n}",
                    cfg.parallel.describe(),
                    layout.micro_batches
                ),
            ));
        }
        return Ok(n);
    }
    if cfg.parallel.placement == Placement::Ep {
        return Ok(1);
    }
    // A unit's tokens: a micro-batch's, or a ring worker's share of them.
    let tokens = cfg.data.batch / cfg.micro_batches() * cfg.data.seq / layout.context_parallel;
    let per_mb = activation_bytes(tokens, hidden, layout.attn_layers(0).len(), vocab, cfg.memory.recompute).max(1);
    let budget = crate::metrics::available_memory_bytes() / 2 / cfg.parallel.workers_here();
    Ok((budget / per_mb).clamp(1, own))
}

fn step_settings(cfg: &RunConfig, with_aux: bool, aux: Option<AuxLoss>, in_flight: usize) -> StepSettings {
    StepSettings {
        mb_rows: cfg.data.batch / cfg.micro_batches(),
        seq: cfg.data.seq,
        aux: aux.filter(|_| with_aux),
        grad_clip: cfg.optimizer.grad_clip,
        bias_update_rate: cfg.model.bias_update_rate(),
        abort_on_nonfinite: cfg.precision.on_nonfinite == NonFinitePolicy::Abort,
        timeout: Duration::from_secs_f64(cfg.parallel.comm_timeout_s),
        fail_at: None,
        slow_at: None,
        absent_at: None,
        poison_at: cfg.faults.inject_nonfinite.as_ref().map(|f| (f.step, f.tensor.clone())),
        own_process: cfg.parallel.transport != TransportKind::Local,
        in_flight,
        routing: cfg.model.routing(),
        mtp: cfg.model.mtp(),
        recompute: cfg.memory.recompute,
        exchange: cfg.parallel.exchange_precision(cfg.precision.compute),
        device_payloads: false,
        distributed_optimizer: cfg.parallel.distributed_optimizer,
        bf16_weights: crate::optim::bf16_weights(cfg.precision.compute),
        placement_options: placement_options(cfg),
        rebalance_every: cfg.parallel.rebalance_every,
        redundant_experts: cfg.parallel.redundant_experts,
        expert_loads: ExpertLoads::new(),
    }
}

/// Whether the exchange's payloads stay on the device (`exchange_payloads`): `auto` keeps them
/// there on a GPU backend when every worker of the process computes on one device; `device`
/// asks for it on any backend and is refused when the workers' devices differ (a tensor of one
/// device is no input on another without a copy through the host).
fn payloads_on_device<B: AutodiffBackend>(cfg: &RunConfig, devices: &[B::Device]) -> Result<bool> {
    let gpu = disagmoe_kernels::device_backend::<B>();
    match (cfg.parallel.transport, cfg.parallel.exchange_payloads) {
        (_, ExchangePayloads::Host) | (TransportKind::Mpi, _) => return Ok(false),
        // NCCL moves them from device to device (one GPU per rank).
        (TransportKind::Nccl, ExchangePayloads::Auto) => return Ok(gpu),
        (TransportKind::Nccl, ExchangePayloads::Device) if !gpu => {
            return Err(TrainError::option(
                "exchange_payloads",
                "device under nccl needs the CUDA backend (a build with --features nccl computes on it); allowed: auto, host",
            ))
        }
        (TransportKind::Nccl, ExchangePayloads::Device) => return Ok(true),
        (TransportKind::Local, _) => {}
    }
    let one_device = devices.iter().all(|d| d == &devices[0]);
    match cfg.parallel.exchange_payloads {
        ExchangePayloads::Host => Ok(false),
        ExchangePayloads::Auto => Ok(one_device && gpu),
        ExchangePayloads::Device if !one_device => Err(TrainError::option(
            "exchange_payloads",
            format!(
                "device needs every worker on one device, and the run lists {} different ones ({devices:?}); allowed: auto, host",
                devices.iter().enumerate().filter(|(i, d)| !devices[..*i].contains(d)).count()
            ),
        )),
        ExchangePayloads::Device => Ok(true),
    }
}

/// Whether this process prints the run's summary: always, except on MPI ranks other than 0.
pub fn is_primary(cfg: &RunConfig) -> bool {
    match cfg.parallel.transport {
        #[cfg(feature = "mpi")]
        TransportKind::Mpi | TransportKind::Nccl if cfg.parallel.distributed() => mpi::world_rank() == 0,
        _ => true,
    }
}

/// The emulated link of a run config (`link_gbps`, `link_latency_us`), if any.
pub fn link_model(cfg: &RunConfig) -> Option<LinkModel> {
    cfg.parallel.link_gbps.map(|gbps| LinkModel { gbps, latency_us: cfg.parallel.link_latency_us })
}

/// Checks the options a distributed run cannot honour yet.
fn check_distributed(cfg: &RunConfig) -> Result<()> {
    match cfg.parallel.transport {
        TransportKind::Local => Ok(()),
        #[cfg(feature = "mpi")]
        TransportKind::Mpi => Ok(()),
        #[cfg(not(feature = "mpi"))]
        TransportKind::Mpi => Err(TrainError::option(
            "transport",
            "mpi needs a build with the `mpi` feature (cargo build --features mpi); allowed here: local",
        )),
        #[cfg(feature = "nccl")]
        TransportKind::Nccl => Ok(()),
        #[cfg(not(feature = "nccl"))]
        TransportKind::Nccl => Err(TrainError::option(
            "transport",
            "nccl needs a build with the `nccl` feature (cargo build --features nccl, on a machine with CUDA); allowed here: local, mpi (feature mpi)",
        )),
    }
}

/// Starts the workers of a `disagg` or `ep` run that live in this process and returns them as the
/// run's step engine: from the checkpoint `resume` (written by any placement) when given, each
/// worker reading only its tensors and moments. Workers compute on `devices` (not empty): local
/// workers round-robin by rank, an MPI rank on the one of its node-local rank.
pub fn start<B: AutodiffBackend>(
    cfg: &RunConfig,
    devices: &[B::Device],
    resume: Option<&(PathBuf, TrainState)>,
) -> Result<Box<dyn StepEngine>> {
    let model = match resume {
        Some((path, _)) => {
            if crate::checkpoint::is_legacy(path) {
                return Err(TrainError::Checkpoint {
                    path: path.clone(),
                    message: "was written by an earlier version (optimizer.safetensors); resume it with --placement single, whose next checkpoint any placement can resume".into(),
                });
            }
            cfg.model.with_mtp(ModelConfig::from_file(path.join("config.json"))?)?
        }
        None => cfg.model.resolve()?,
    };
    model.visit(Starter::<B> { cfg, devices, resume })
}

/// [`start`] with the family's concrete types.
struct Starter<'a, B: AutodiffBackend> {
    cfg: &'a RunConfig,
    devices: &'a [B::Device],
    resume: Option<&'a (PathBuf, TrainState)>,
}

impl<B: AutodiffBackend> FamilyVisitor<B> for Starter<'_, B> {
    type Output = Result<Box<dyn StepEngine>>;

    fn visit<C: FamilyConfig>(self, config: &C) -> Self::Output
    where
        C::Attention<B>: TrainModule<B>,
        C::Router<B>: TrainModule<B>,
        C::Experts<B>: TrainModule<B>,
    {
        let Self { cfg, devices, resume } = self;
        start_family::<B, C>(cfg, config, devices, resume)
    }
}

/// [`start`] for a model family given by its configuration type `C`: one of the crate's, or a
/// family defined outside the crates (new attention, router or expert types; see
/// `examples/custom_expert.rs`). Each worker builds (or reads) only its part.
pub fn start_family<B, C>(
    cfg: &RunConfig,
    config: &C,
    devices: &[B::Device],
    resume: Option<&(PathBuf, TrainState)>,
) -> Result<Box<dyn StepEngine>>
where
    B: AutodiffBackend,
    C: FamilyConfig,
    C::Attention<B>: TrainModule<B>,
    C::Router<B>: TrainModule<B>,
    C::Experts<B>: TrainModule<B>,
{
    check_distributed(cfg)?;
    let layers = config.dims().num_hidden_layers;
    let mut layout = layout_of(cfg, layers, config.routed_experts())?;
    layout.shared_experts =
        (0..layers).map(|l| config.is_sparse_layer(l) && config.shared_expert_intermediate().is_some()).collect();
    layout.sparse = (0..layers).map(|l| config.is_sparse_layer(l)).collect();
    place_experts(cfg, &mut layout)?;
    let mut loads = ExpertLoads::new();
    if let Some((path, _)) = resume {
        loads = restore_placement(cfg, &mut layout, path)?;
    }
    let rope = config.rope().tables::<B>(cfg.data.seq, &devices[0]);
    let source = match (resume, &cfg.model.dir) {
        (Some((path, _)), _) => WeightSource::Checkpoint(path.clone()),
        (None, Some(dir)) => WeightSource::Checkpoint(dir.clone()),
        (None, None) => WeightSource::Seed(cfg.seed),
    };
    let d = config.dims();
    let window = in_flight_window(cfg, &layout, d.hidden_size, d.vocab_size)?;
    let with_aux =
        cfg.model.with_aux_loss(config.aux_loss_by_default(), (0..layers).any(|l| config.is_sparse_layer(l)));
    let settings = StepSettings {
        device_payloads: payloads_on_device::<B>(cfg, devices)?,
        expert_loads: loads,
        ..step_settings(cfg, with_aux, config.aux_loss(), window)
    };
    let shared = Arc::new(Shared {
        cfg: cfg.clone(),
        settings,
        layout,
        rope,
        source,
        hf_config: config.to_hf_json(),
        resume: resume.map(|(path, state)| (path.clone(), state.optimizer_steps)),
    });
    let flops_per_token =
        disagmoe_core::cost::training_flops_per_token(&config.model_shape("the run's model"), cfg.data.seq)
            .unwrap_or(f64::NAN);
    let facts = engine::RunFacts { model_type: C::MODEL_TYPE, vocab_size: d.vocab_size, flops_per_token };
    engine::Distributed::start(shared, config.clone(), facts, devices)
}
