//! The AF-Pipe runtime: disaggregated training on attention and expert workers, and the colocated
//! expert-parallel baseline, over a transport. It is a step engine of the training loop
//! ([`crate::trainer::StepEngine`]), which is all it knows of the trainer.
//!
//! [`start`] takes the model apart ([`disagmoe_models::stages`]), deals the pieces to workers by
//! [`layout::Layout`], and starts every worker of this process ([`engine::Distributed`]): all of
//! them as threads (`local`), or this process's one under `mpirun` (`mpi`, `nccl`). Each step, every
//! worker runs its message loop ([`worker::Worker`]); every worker sees the same step outcome after
//! the step's global reduction, so the loop's report is the same whoever prints it.

pub mod engine;
pub mod layout;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod trace;
pub mod transport;
pub mod worker;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use burn::module::{Module, ParamId};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;

use disagmoe_models::decoder::AttentionLayer;
use disagmoe_models::stages::Stages;
use disagmoe_models::{
    AuxLoss, Experts, FamilyConfig, FamilyModel, FamilyVisitor, HfCheckpoint, ModelConfig, Router, TrainModule,
};

use self::layout::Layout;
use self::transport::LinkModel;
use self::worker::{Fork, StepSettings, WorkerPart};
use crate::config::{NonFinitePolicy, Placement, RunConfig, TransportKind};
use crate::error::{Result, TrainError};
use crate::single::with_aux_loss;
use crate::trainer::StepEngine;

/// The resolved layout of a run config (`disagg` or `ep`) for a model of `layers` layers of
/// `experts` routed experts.
pub fn layout_of(cfg: &RunConfig, layers: usize, experts: usize) -> Result<Layout> {
    let p = &cfg.parallel;
    let mbs = cfg.micro_batches();
    match p.placement {
        Placement::Disagg => Layout::disagg(layers, experts, mbs, p.attn_workers, p.ffn_workers, p.groups),
        Placement::Ep => Layout::ep(layers, experts, mbs, p.workers),
        Placement::Single => Err(TrainError::option("placement", "the runtime runs `disagg` or `ep`")),
    }
}

/// The part of the model `rank` holds.
pub(crate) fn part_for<B, A, R, X>(
    stages: &Stages<B, A, R, X>,
    layout: &Layout,
    rank: usize,
    device: &B::Device,
) -> Result<WorkerPart<B, A, R, X>>
where
    B: AutodiffBackend,
    A: TrainModule<B> + AttentionLayer<B>,
    R: TrainModule<B> + Router<B>,
    X: TrainModule<B> + Experts<B>,
{
    let ends = layout.holds_ends(rank).then(|| stages.ends.clone());
    let attention = layout.attn_layers(rank).into_iter().map(|l| stages.attention[l].clone()).collect();
    let mut experts = Vec::new();
    for (l, i) in layout.ffn_layers(rank) {
        experts.push(stages.experts[l].clone().shard(layout.expert_range(i), i == 0)?);
    }
    Ok(WorkerPart { ends, attention, experts }.map(&mut Fork { device }))
}

/// Everything a worker needs besides its endpoint and its part.
pub(crate) struct Shared<B: AutodiffBackend> {
    pub(crate) cfg: RunConfig,
    pub(crate) layout: Layout,
    pub(crate) settings: StepSettings,
    pub(crate) rope: (Tensor<B, 4>, Tensor<B, 4>),
    /// Checkpoint name of every parameter of the whole model.
    pub(crate) param_names: HashMap<ParamId, String>,
}

fn step_settings(cfg: &RunConfig, with_aux: bool, aux: Option<AuxLoss>) -> StepSettings {
    StepSettings {
        mb_rows: cfg.data.batch / cfg.micro_batches(),
        seq: cfg.data.seq,
        aux: aux.filter(|_| with_aux),
        grad_clip: cfg.optimizer.grad_clip,
        bias_update_rate: cfg.model.bias_update_rate(),
        abort_on_nonfinite: cfg.precision.on_nonfinite == NonFinitePolicy::Abort,
        timeout: Duration::from_secs_f64(cfg.parallel.comm_timeout_s),
        fail_at: None,
        own_process: cfg.parallel.transport != TransportKind::Local,
        in_flight: cfg.parallel.in_flight.unwrap_or(usize::MAX),
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

pub(crate) fn link_model(cfg: &RunConfig) -> Option<LinkModel> {
    cfg.parallel.link_gbps.map(|gbps| LinkModel { gbps, latency_us: cfg.parallel.link_latency_us })
}

/// Checks the options a distributed run cannot honour yet.
fn check_distributed(cfg: &RunConfig) -> Result<()> {
    let unsupported = [
        ("checkpoint_dir", cfg.checkpoint.dir.is_some()),
        ("resume", cfg.checkpoint.resume.is_some()),
        ("stop_after", cfg.checkpoint.stop_after.is_some()),
        ("inject_nonfinite", cfg.faults.inject_nonfinite.is_some()),
    ];
    if let Some((field, _)) = unsupported.iter().find(|(_, set)| *set) {
        return Err(TrainError::option(
            *field,
            format!(
                "is only supported with placement single for now, got placement {}",
                cfg.parallel.placement.name()
            ),
        ));
    }
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
/// run's step engine.
pub fn start<B: AutodiffBackend>(cfg: &RunConfig, device: &B::Device) -> Result<Box<dyn StepEngine>> {
    check_distributed(cfg)?;
    let model = cfg.model.resolve()?;
    model.visit(Starter::<B> { cfg, device, model: &model })
}

/// [`start`] with the family's concrete types.
struct Starter<'a, B: AutodiffBackend> {
    cfg: &'a RunConfig,
    device: &'a B::Device,
    model: &'a ModelConfig,
}

impl<B: AutodiffBackend> FamilyVisitor<B> for Starter<'_, B> {
    type Output = Result<Box<dyn StepEngine>>;

    fn visit<C: FamilyConfig>(self, config: &C) -> Self::Output
    where
        C::Attention<B>: TrainModule<B>,
        C::Router<B>: TrainModule<B>,
        C::Experts<B>: TrainModule<B>,
    {
        let Self { cfg, device, model } = self;
        let whole = match &cfg.model.dir {
            Some(dir) => FamilyModel::<B, C>::from_pretrained(dir, device)?,
            None => FamilyModel::<B, C>::init(config.clone(), cfg.seed, device),
        };
        let params = whole.num_params();
        let param_names = whole.state_dict_names();
        let stages = whole.into_stages();
        let mut layout = layout_of(cfg, stages.attention.len(), config.routed_experts())?;
        layout.shared_experts = stages.experts.iter().map(|x| x.shared_experts.is_some()).collect();
        layout.sparse = (0..layout.layers).map(|l| config.is_sparse_layer(l)).collect();
        let rope = stages.rope.tables::<B>(cfg.data.seq, device);
        let shared = Arc::new(Shared {
            cfg: cfg.clone(),
            settings: step_settings(cfg, with_aux_loss(cfg, model), stages.aux_loss),
            layout,
            rope,
            param_names,
        });
        let facts = engine::RunFacts {
            params,
            model_type: model.model_type(),
            vocab_size: model.vocab_size(),
            hf_config: model.to_hf_json(),
        };
        engine::Distributed::start(shared, stages, facts, device)
    }
}
