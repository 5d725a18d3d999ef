//! CubeCL kernels for DisagMoE as Burn custom backend operations: token dispatch and combine,
//! grouped expert FFN, and flash-style attention, each beside a reference in plain Burn tensor ops.
//!
//! **Not written yet** (its own issue). Until then the models use their plain Burn paths
//! (`disagmoe_models::moe` for dispatch and grouped experts, `disagmoe_models::attention` for
//! attention), which are also the references the kernels will be tested against.
//!
//! This crate must not know about device groups, ranks or transports.
