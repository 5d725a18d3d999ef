//! The crate's integration tests, one module per subject, in one test binary: each was a binary of
//! its own, and each of those compiled the models over the test backends again (about 90 s apiece
//! at the test profile's opt-level, most of `cargo test`'s build of this crate). One binary
//! compiles them once. A test is named by its module: `cargo test -p disagmoe-models --test models
//! parity::` runs the Qwen3-MoE parity tests.

mod common;

mod autodiff_threads;
mod documents;
mod generate;
mod moe;
mod parity;
mod parity_deepseek;
mod parity_families;
mod parity_mtp;
mod recompute;
mod shapes;
