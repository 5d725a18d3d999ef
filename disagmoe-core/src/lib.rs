//! Planning for DisagMoE training: how long a step takes, and how to lay a mixture-of-experts
//! model out on a cluster when attention and experts live on disjoint GPU groups.
//!
//! The crate describes a job ([`hardware::Cluster`], [`model_shape::ModelShape`],
//! [`cost::Workload`]), models its costs ([`cost::CostModel`], [`roofline`]), chooses an
//! allocation of GPUs and NICs to attention and expert groups ([`allocator`]: a MILP, checked
//! against exhaustive enumeration, then local search driven by a
//! [`allocator::search::StepTimeOracle`]), builds schedules ([`schedule`]: AF-Pipe and the
//! Megatron 1F1B / Tutel / Comet / DualPipe baselines) and runs them in a discrete-event
//! [`simulator`] whose timelines [`report`] draws. [`layout`] is the placement of a distributed run
//! (who holds which layer, which experts and micro-batch), the one rule the schedule builders and
//! the runtime of `disagmoe-train` share. [`plan`] holds the two entry points behind
//! `disagmoe plan` and `disagmoe simulate`; [`reproduce`] writes `docs/paper-reproduction.md`.
//!
//! ```
//! use disagmoe_core::{cost::{CostModel, Workload}, hardware::Cluster, model_shape::ModelShape};
//! let cost = CostModel::new(
//!     ModelShape::preset("gpt-oss-20b")?,
//!     Cluster::preset("h100x2")?,
//!     Workload { seq: 4096, micro_batch: 4, global_batch: 64 },
//! )?;
//! let plan = disagmoe_core::plan::plan(&cost, false, 4)?;
//! assert!(plan.attention_gpus + plan.ffn_gpus <= 16);
//! println!("{} attention GPUs, {} expert GPUs, step {:.2} s", plan.attention_gpus, plan.ffn_gpus, plan.predicted_step_s);
//! # Ok::<(), disagmoe_core::error::CoreError>(())
//! ```
//!
//! **Design decision: schedules are plain data.** A [`schedule::Schedule`] is plain data (per
//! worker, ordered compute and communication ops with dependencies), executed here by the
//! simulator on modelled resources. The runtime in `disagmoe-train` does not execute these values
//! (its workers are event-driven over the same placement rules); what joins the two engines today
//! is the allocator's local search, whose [`allocator::search::StepTimeOracle`] may be the
//! simulator or step times measured by training (`--allocation auto`).
//!
//! **Architecture invariant:** this crate knows no tensors, devices or transports (no Burn, no
//! CubeCL, no MPI/NCCL); it depends only on serde, thiserror, toml, good_lp and plotters.

#![warn(missing_docs)]

pub mod allocator;
pub mod cost;
pub mod error;
pub mod exchange;
pub mod experts;
pub mod hardware;
pub mod heterogeneous;
pub mod layout;
pub mod model_shape;
pub mod phases;
pub mod plan;
pub mod pools;
pub mod report;
pub mod reproduce;
pub mod roofline;
pub mod schedule;
pub mod simulator;
