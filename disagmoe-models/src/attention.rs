//! Causal grouped-query self-attention, with the variants the families need: RMSNorm on q and k
//! before RoPE, per head (Qwen3) or over the whole projection (OLMoE), clipping of q/k/v (OLMoE),
//! projection biases and learned per-head attention sinks (GPT-OSS), and a sliding window per layer
//! (GPT-OSS, Mixtral).
//!
//! Notation: B batch, S sequence, H query heads, G key/value heads (H % G == 0), D head dim,
//! M model width.

use std::ops::Range;

use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use disagmoe_kernels::ring::{chunk_partials, finish, Block, Mask, Partial};

use crate::decoder::{RingBlock, RingProjection};
use crate::error::Result;
use crate::init::Init;
use crate::kv_cache::{append, attention_at, LayerCache};
use crate::nn::{Linear, RmsNorm};
use crate::rope::apply_rotary;
use crate::weights::{CheckpointReader, TensorSink};

/// Shape of one attention layer.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    /// Model width M.
    pub hidden: usize,
    /// Query heads H.
    pub heads: usize,
    /// Key/value heads G.
    pub kv_heads: usize,
    /// Head dim D.
    pub head_dim: usize,
    /// Sliding window (a query sees keys `q - window < k <= q`), or full causal attention.
    pub window: Option<usize>,
}

/// Where a layer normalises queries and keys before RoPE.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum QkNorm {
    /// No normalisation.
    None,
    /// RMSNorm over each head's `D` values, one weight of `[D]` shared by the heads (Qwen3).
    PerHead {
        /// Epsilon.
        eps: f64,
    },
    /// RMSNorm over the whole projection (`[H*D]` for q, `[G*D]` for k), one weight per value
    /// (OLMoE).
    Full {
        /// Epsilon.
        eps: f64,
    },
}

/// Which variant of attention a layer uses.
#[derive(Debug, Clone, Copy)]
pub struct AttentionOptions {
    /// q/k/v/o projections have biases.
    pub bias: bool,
    /// Normalisation of q and k before RoPE.
    pub qk_norm: QkNorm,
    /// Clamp q, k and v to `[-c, c]` after the projections (and norms) (OLMoE's `clip_qkv`).
    pub clip_qkv: Option<f64>,
    /// A learned logit per head joins every softmax and is dropped after it (GPT-OSS sinks).
    pub sinks: bool,
}

impl AttentionOptions {
    /// Plain attention: no biases, norms, clipping or sinks (Mixtral, DeepSeekMoE).
    pub fn plain() -> Self {
        Self { bias: false, qk_norm: QkNorm::None, clip_qkv: None, sinks: false }
    }
}

/// Grouped-query attention: q/k/v/o projections, optional q/k norms and clipping, RoPE, causal
/// (optionally windowed) softmax with optional sinks.
#[derive(Module, Debug)]
pub struct GqaAttention<B: Backend> {
    /// `[H*D, M]`
    pub q_proj: Linear<B>,
    /// `[G*D, M]`
    pub k_proj: Linear<B>,
    /// `[G*D, M]`
    pub v_proj: Linear<B>,
    /// `[M, H*D]`
    pub o_proj: Linear<B>,
    /// RMSNorm of the queries (over `D` per head, or over `H*D`).
    pub q_norm: Option<RmsNorm<B>>,
    /// RMSNorm of the keys (over `D` per head, or over `G*D`).
    pub k_norm: Option<RmsNorm<B>>,
    /// `[H]` learned sink logits (GPT-OSS).
    pub sinks: Option<Param<Tensor<B, 1>>>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    window: Option<usize>,
    clip_qkv: Option<f64>,
    /// The norms span the whole projection ([`QkNorm::Full`]) rather than each head.
    full_qk_norm: bool,
}

impl<B: Backend> GqaAttention<B> {
    /// A freshly initialised layer: normal(0, std) projections and sinks, norms at one, biases zero.
    pub fn new(shape: AttentionShape, options: AttentionOptions, init: &Init<B>) -> Self {
        let AttentionShape { hidden, heads, kv_heads, head_dim, window } = shape;
        let bias = options.bias;
        let (q_norm, k_norm) = match options.qk_norm {
            QkNorm::None => (None, None),
            QkNorm::PerHead { eps } => (
                Some(RmsNorm::new(head_dim, eps, &init.child("q_norm"))),
                Some(RmsNorm::new(head_dim, eps, &init.child("k_norm"))),
            ),
            QkNorm::Full { eps } => (
                Some(RmsNorm::new(heads * head_dim, eps, &init.child("q_norm"))),
                Some(RmsNorm::new(kv_heads * head_dim, eps, &init.child("k_norm"))),
            ),
        };
        Self {
            q_proj: Linear::new(hidden, heads * head_dim, bias, &init.child("q_proj")),
            k_proj: Linear::new(hidden, kv_heads * head_dim, bias, &init.child("k_proj")),
            v_proj: Linear::new(hidden, kv_heads * head_dim, bias, &init.child("v_proj")),
            o_proj: Linear::new(heads * head_dim, hidden, bias, &init.child("o_proj")),
            q_norm,
            k_norm,
            sinks: options.sinks.then(|| Param::from_tensor(init.normal("sinks", [heads]))),
            heads,
            kv_heads,
            head_dim,
            window,
            clip_qkv: options.clip_qkv,
            full_qk_norm: matches!(options.qk_norm, QkNorm::Full { .. }),
        }
    }

    /// Queries, keys and values of `x`, projected, normalised and clipped where the family does,
    /// and rotated (positions of `cos`, `sin`).
    ///
    /// # Shapes
    /// - x: `[B, S, M]`; cos, sin: `[1, 1, S, D]`
    /// - output: q `[B, S, H, D]`, k and v `[B, S, G, D]`
    fn qkv(&self, x: Tensor<B, 3>, cos: Tensor<B, 4>, sin: Tensor<B, 4>) -> (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>) {
        let [b, s, _] = x.dims();
        let (h, g, d) = (self.heads, self.kv_heads, self.head_dim);
        // 1. Project; normalise q and k (over the whole projection, or per head below) and clip
        //    where the family does.
        let mut q = self.q_proj.forward(x.clone()); // [B, S, H*D]
        let mut k = self.k_proj.forward(x.clone()); // [B, S, G*D]
        let mut v = self.v_proj.forward(x); // [B, S, G*D]
        if let (Some(qn), Some(kn), true) = (&self.q_norm, &self.k_norm, self.full_qk_norm) {
            q = qn.forward(q);
            k = kn.forward(k);
        }
        let mut q = q.reshape([b, s, h, d]); // [B, S, H, D]
        let mut k = k.reshape([b, s, g, d]); // [B, S, G, D]
        if let (Some(qn), Some(kn), false) = (&self.q_norm, &self.k_norm, self.full_qk_norm) {
            q = qn.forward(q);
            k = kn.forward(k);
        }
        if let Some(c) = self.clip_qkv {
            q = q.clamp(-c, c);
            k = k.clamp(-c, c);
            v = v.clamp(-c, c);
        }
        let v = v.reshape([b, s, g, d]); // [B, S, G, D]
                                         // 2. Rotary embedding on q and k, in the projections' layout (fused where there is a fused
                                         //    one: the CPU operations).
        let rope = |x: Tensor<B, 4>| {
            disagmoe_kernels::fused::rope(x.clone(), cos.clone(), sin.clone())
                .unwrap_or_else(|| apply_rotary(x, cos.clone().swap_dims(1, 2), sin.clone().swap_dims(1, 2)))
        };
        (rope(q), rope(k), v)
    }

    /// Within each document of `docs` when given.
    ///
    /// # Shapes
    /// - x: `[B, S, M]`; cos, sin: `[1, 1, S, D]`; docs over `[B, S]`
    /// - output: `[B, S, M]`
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        cos: Tensor<B, 4>,
        sin: Tensor<B, 4>,
        docs: Option<&disagmoe_kernels::documents::Documents>,
    ) -> Tensor<B, 3> {
        let [b, s, _] = x.dims();
        let (q, k, v) = self.qkv(x, cos, sin);
        let scale = (self.head_dim as f64).powf(-0.5);
        // 3. Causal (windowed) attention with sinks: the fused operation or kernel where
        //    `disagmoe_kernels::fused` has one, else its reference; 4. merge heads, project.
        let sinks = self.sinks.as_ref().map(|p| p.val());
        let out = disagmoe_kernels::fused::attention(
            q.clone(),
            k.clone(),
            v.clone(),
            sinks.clone(),
            scale,
            self.window,
            docs,
        )
        .unwrap_or_else(|| disagmoe_kernels::reference::attention(q, k, v, sinks, scale, self.window, docs)); // [B, S, H, D]
        self.o_proj.forward(out.reshape([b, s, self.heads * self.head_dim]))
    }

    /// Context parallelism's first half ([`crate::decoder::AttentionLayer::ring_project`]): the
    /// queries and the rotated keys and values as one `[B, T, 2 G D]` block.
    pub fn ring_project(&self, x: Tensor<B, 3>, cos: Tensor<B, 4>, sin: Tensor<B, 4>) -> RingProjection<B> {
        let [b, t, _] = x.dims();
        let (q, k, v) = self.qkv(x, cos, sin);
        let gd = self.kv_heads * self.head_dim;
        RingProjection { q, kv: Tensor::cat(vec![k.reshape([b, t, gd]), v.reshape([b, t, gd])], 2) }
    }

    /// A block of the ring as this layer's keys and values.
    fn ring_block(&self, RingBlock { kv, held }: RingBlock<B>) -> Block<B> {
        let [b, tk, _] = kv.dims();
        let (g, d) = (self.kv_heads, self.head_dim);
        let k = kv.clone().narrow(2, 0, g * d).reshape([b, tk, g, d]);
        let v = kv.narrow(2, g * d, g * d).reshape([b, tk, g, d]);
        Block { k, v, held }
    }

    /// Context parallelism's merge ([`crate::decoder::AttentionLayer::ring_merge`]): the attention
    /// of the queries of the worker's two chunks `q` over `blocks` onto `start`
    /// ([`chunk_partials`]), windowed as the layer is.
    pub fn ring_merge(
        &self,
        q: &[Tensor<B, 4>; 2],
        held: &[Range<usize>; 2],
        blocks: Vec<RingBlock<B>>,
        start: Option<[Partial<B>; 2]>,
        docs: Option<&disagmoe_kernels::documents::Documents>,
    ) -> [Partial<B>; 2] {
        let blocks: Vec<Block<B>> = blocks.into_iter().map(|b| self.ring_block(b)).collect();
        let scale = (self.head_dim as f64).powf(-0.5);
        let mask = Mask { window: self.window, docs };
        chunk_partials(q, held, &blocks, start, scale, mask)
            .unwrap_or_else(|e| panic!("the runtime hands ring attention its own chunks and blocks: {e}"))
    }

    /// Context parallelism's output ([`crate::decoder::AttentionLayer::ring_out`]): the attention
    /// over every block of the ring, `all`, with the sinks the layer has, projected.
    pub fn ring_out(&self, all: Partial<B>) -> Tensor<B, 3> {
        let [b, t, _, _] = all.out.dims();
        let out = finish(all, self.sinks.as_ref().map(|p| p.val()));
        self.o_proj.forward(out.reshape([b, t, self.heads * self.head_dim]))
    }

    /// [`GqaAttention::forward`] of new tokens at positions `past..past + S`, over them and the
    /// keys and values `cache` holds; the new ones join the cache (a windowed layer keeps only
    /// its last `window`).
    ///
    /// # Shapes
    /// - x: `[B, S, M]`; cos, sin: `[1, 1, past + S, D]` (every position so far)
    /// - output: `[B, S, M]`
    pub fn forward_cached(
        &self,
        x: Tensor<B, 3>,
        cos: Tensor<B, 4>,
        sin: Tensor<B, 4>,
        past: usize,
        cache: &mut LayerCache<B>,
    ) -> Tensor<B, 3> {
        let [b, s, _] = x.dims();
        let (q, k_new, v_new) = self.qkv(x, cos.narrow(2, past, s), sin.narrow(2, past, s));
        let (k_old, v_old, start) = match std::mem::take(cache) {
            LayerCache::Keys { k, v, start } => (Some(k), Some(v), start),
            _ => (None, None, past),
        };
        let (k, v) = (append(k_old, k_new), append(v_old, v_new)); // [B, T, G, D]
        let scale = (self.head_dim as f64).powf(-0.5);
        let sinks = self.sinks.as_ref().map(|p| p.val());
        let out = attention_at(q, k.clone(), v.clone(), sinks, scale, self.window, past, start); // [B, S, H, D]

        // A later query at `p >= past + S` sees keys after `p - window`: the last `window` suffice.
        let held = k.dims()[1];
        let drop = self.window.map_or(0, |w| held.saturating_sub(w));
        *cache = LayerCache::Keys {
            k: k.narrow(1, drop, held - drop),
            v: v.narrow(1, drop, held - drop),
            start: start + drop,
        };
        self.o_proj.forward(out.reshape([b, s, self.heads * self.head_dim]))
    }

    /// Loads `{prefix}.{q,k,v,o}_proj` and `{prefix}.{q,k}_norm`.
    pub fn load(&mut self, ckpt: &mut CheckpointReader, prefix: &str, device: &B::Device) -> Result<()> {
        self.q_proj.load(ckpt, &format!("{prefix}.q_proj"), device)?;
        self.k_proj.load(ckpt, &format!("{prefix}.k_proj"), device)?;
        self.v_proj.load(ckpt, &format!("{prefix}.v_proj"), device)?;
        self.o_proj.load(ckpt, &format!("{prefix}.o_proj"), device)?;
        if let (Some(qn), Some(kn)) = (&mut self.q_norm, &mut self.k_norm) {
            qn.load(ckpt, &format!("{prefix}.q_norm"), device)?;
            kn.load(ckpt, &format!("{prefix}.k_norm"), device)?;
        }
        if let Some(sinks) = &mut self.sinks {
            *sinks = Param::from_tensor(ckpt.tensor::<B, 1>(&format!("{prefix}.sinks"), [self.heads], device)?);
        }
        Ok(())
    }

    /// Saves under the names [`GqaAttention::load`] reads.
    pub fn save(&self, sink: &mut TensorSink, prefix: &str) {
        self.q_proj.save(sink, &format!("{prefix}.q_proj"));
        self.k_proj.save(sink, &format!("{prefix}.k_proj"));
        self.v_proj.save(sink, &format!("{prefix}.v_proj"));
        self.o_proj.save(sink, &format!("{prefix}.o_proj"));
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            qn.save(sink, &format!("{prefix}.q_norm"));
            kn.save(sink, &format!("{prefix}.k_norm"));
        }
        if let Some(sinks) = &self.sinks {
            sink.put_param(format!("{prefix}.sinks"), sinks);
        }
    }
}
