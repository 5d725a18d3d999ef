//! Incremental decoding: what each attention layer keeps of the tokens it has seen, so that a new
//! token costs one pass over its own position instead of the whole sequence.
//!
//! - Grouped-query attention keeps its keys and values after the norms and RoPE; a layer with a
//!   sliding window keeps only its window (what a later query can still see).
//! - Multi-head latent attention keeps the compressed latent (after its norm) and the rotated key
//!   part every head shares: `Rkv + Dr` values per token instead of `H * (Dq + Dv)`; the per-head
//!   keys and values are expanded from it at each step.
//! - Any other attention type ([`crate::decoder::AttentionLayer`]'s default) keeps its inputs and
//!   reruns itself over all of them: exact, not fast.
//!
//! Cached decoding equals the full forward pass over the whole sequence (tested per family in
//! `tests/models/generate.rs`).

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

/// What one attention layer keeps.
#[derive(Debug, Clone, Default)]
pub enum LayerCache<B: Backend> {
    /// Nothing seen yet.
    #[default]
    Empty,
    /// Keys and values after norms, clipping and RoPE, `[B, T, G, D]` and `[B, T, G, Dv]`; `start`
    /// is the position of the first one kept.
    Keys {
        /// `[B, T, G, D]`
        k: Tensor<B, 4>,
        /// `[B, T, G, Dv]`
        v: Tensor<B, 4>,
        /// Position of row 0.
        start: usize,
    },
    /// MLA: the normalised latent `[B, T, Rkv]` and the rotated shared key `[B, T, Dr]` of every
    /// position from 0.
    Latent {
        /// `[B, T, Rkv]`
        latent: Tensor<B, 3>,
        /// `[B, T, Dr]`
        k_rot: Tensor<B, 3>,
    },
    /// The layer's inputs `[B, T, M]` from position 0 (attention types without a cache of their own).
    Inputs(Tensor<B, 3>),
}

impl<B: Backend> LayerCache<B> {
    /// Positions whose keys the layer holds (a windowed layer: at most its window).
    pub fn held(&self) -> usize {
        match self {
            LayerCache::Empty => 0,
            LayerCache::Keys { k, .. } => k.dims()[1],
            LayerCache::Latent { latent, .. } => latent.dims()[1],
            LayerCache::Inputs(x) => x.dims()[1],
        }
    }
}

/// The cache of a whole model: one [`LayerCache`] per decoder layer and the number of positions
/// seen.
#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    /// One per decoder layer.
    pub layers: Vec<LayerCache<B>>,
    /// Positions seen so far (the position of the next token).
    pub len: usize,
}

impl<B: Backend> KvCache<B> {
    /// An empty cache for `layers` decoder layers.
    pub fn new(layers: usize) -> Self {
        Self { layers: vec![LayerCache::Empty; layers], len: 0 }
    }
}

/// Attention of new queries over cached and new keys: the one reference definition
/// ([`disagmoe_kernels::reference::attention_at`]).
pub use disagmoe_kernels::reference::attention_at;

/// Appends `new` to `old` along the positions (dim 1).
pub(crate) fn append<const D: usize, B: Backend>(old: Option<Tensor<B, D>>, new: Tensor<B, D>) -> Tensor<B, D> {
    match old {
        Some(old) => Tensor::cat(vec![old, new], 1),
        None => new,
    }
}
