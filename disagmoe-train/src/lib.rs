//! Training for DisagMoE: data, optimizer, single-device trainer, metrics.
//!
//! Entry points: [`RunConfig`] (every option of a run, TOML or flags, validated once) and [`train`]
//! (one device; returns a [`TrainSummary`]). The backend is chosen at build time in [`backend`].
//!
//! **Only this crate communicates** (the AF-Pipe runtime, workers and transports: [`runtime`]);
//! models come from `disagmoe-models` and know nothing about where they run.

pub mod backend;
pub mod checkpoint;
pub mod data;
pub mod error;
pub mod metrics;
pub mod optim;
pub mod runtime;
pub mod trainer;

pub use backend::{DefaultBackend, TrainBackend, BACKEND_NAME};
pub use error::{Result, TrainError};
pub use runtime::layout::Placement;
pub use runtime::{train_distributed, TransportKind, WorkerFault};
pub use trainer::{
    build_model, model_preset, train, train_until, AllocationMode, FaultInjection, NonFinitePolicy, RunConfig,
    TrainSummary, DEFAULT_MODEL_CONFIG, MODEL_PRESETS,
};
