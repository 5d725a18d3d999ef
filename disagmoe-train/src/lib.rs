//! Training for DisagMoE: the run configuration, the one training loop, and the step engines it
//! drives (one device, or the AF-Pipe runtime on attention and expert workers).
//!
//! Entry points: [`RunConfig`] (every option of a run by section, TOML or flags, validated once)
//! and [`train`] (returns a [`TrainSummary`]). The loop ([`trainer`]) runs any [`StepEngine`]:
//! [`single::SingleDevice`] or the distributed runtime ([`runtime`]); [`launch`] picks one for the
//! run's placement (after [`allocate`] has chosen the worker counts of `allocation = auto`). The backend is chosen at build time in [`backend`].
//!
//! **Only this crate communicates** (the runtime's workers and transports); models come from
//! `disagmoe-models` and know nothing about where they run. **The loop does not know the runtime,
//! and the runtime knows the loop only through the step-engine trait.**

pub mod allocate;
pub mod backend;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod error;
pub mod launch;
pub mod loss_scale;
pub mod metrics;
pub mod optim;
pub mod phases;
pub mod runtime;
pub mod single;
pub mod tensorboard;
pub mod trainer;

pub use backend::{DefaultBackend, TrainBackend, BACKEND_NAME};
pub use config::{
    AllocationMode, DocumentMask, DocumentPositions, ExchangeDtype, ExchangePayloads, ExpertPlacement, FaultInjection,
    FaultPlan, NonFinitePolicy, Placement, Precision, Recompute, RunConfig, TransportKind, WorkerFault,
};
pub use error::{Result, TrainError};
pub use launch::{train, train_family, train_on, train_until};
pub use runtime::is_primary;
pub use single::build_model;
pub use trainer::{StepEngine, TrainSummary};
