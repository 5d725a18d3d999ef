//! # disagmoe
//!
//! A Rust-native training framework for Mixture-of-Experts language models implementing DisagMoE:
//! attention and expert layers on disjoint device groups, an AF-Pipe pipeline that overlaps the
//! many-to-many token exchange with compute, and a roofline/MILP allocator that sizes the groups.
//!
//! This crate is the facade: it re-exports the workspace crates and holds the command-line front
//! end shared by the `disagmoe` binary and the examples.
//!
//! - [`core`]: cost model, roofline, placement, allocator, schedules, simulator (no tensor code);
//! - [`models`]: the MoE model families in Burn, Hugging Face config and safetensors I/O;
//! - [`kernels`]: CubeCL kernels as Burn custom operations;
//! - [`train`]: data, optimizer, trainer, metrics, and the AF-Pipe runtime.

pub use disagmoe_core as core;
pub use disagmoe_kernels as kernels;
pub use disagmoe_models as models;
pub use disagmoe_train as train;

/// `train`, `forward`, `compare`: clap arguments mapped onto `RunConfig`.
pub mod cli;
/// `generate`: text from a checkpoint through the KV cache.
pub mod cli_generate;
/// `net-bench`, `predict`: a real network timed and fitted, and the simulator's prediction of a run.
pub mod cli_net;
/// `plan`, `simulate`, `reproduce-paper`: argument structs and runners over `disagmoe-core`.
pub mod cli_plan;
/// `tokenize`: documents into token shards.
pub mod cli_tokenize;
/// `plot`: SVG curves and expert-load heat maps of runs from their `metrics.jsonl`.
pub mod plot;
