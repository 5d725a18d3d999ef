//! Mixture-of-experts block: router, grouped experts, and the load-balancing loss, one file per
//! concept: [`experts`], [`router`], [`routing`] (options acting on any router), [`dispatch`],
//! [`block`].
//!
//! # Notation
//! - `T`: tokens in the micro-batch (batch x sequence, flattened)
//! - `M`: model width (hidden size)
//! - `E`: routed experts; `k`: experts chosen per token (top-k)
//! - `N = T * k`: routed token copies; copies are sorted by expert so that expert `e` sees one
//!   contiguous block of `counts[e]` rows
//!
//! The layer reads `route -> dispatch -> compute -> combine`, one named step each:
//! 1. [`TopKRouter::route`]: logits `[T, E]`, softmax in f32, top-k, optional renormalisation;
//! 2. [`Dispatch::new`]: a stable counting sort of the `N` copies by expert (the group sizes
//!    decide the shapes of the per-expert matmuls); on CubeCL backends the router's top-k, this
//!    sort, the permute and the combine run on the device ([`ExpertIds::Device`]) and only the
//!    counts per expert and sequence come back to the host;
//! 3. [`Experts::forward_grouped`]: one matmul chain per expert over its contiguous rows;
//! 4. [`Dispatch::combine`]: gate-weighted sum of each token's `k` outputs back in token order.
//!
//! Experts are behind the [`Experts`] trait, so a new expert type plugs into [`SparseMoeBlock`]
//! without touching the router or the layer.

pub mod block;
pub mod dispatch;
pub mod experts;
pub mod router;
pub mod routing;

pub use block::*;
pub use dispatch::*;
pub use experts::*;
pub use router::*;
pub use routing::*;
