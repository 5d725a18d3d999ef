//! Multi-head latent attention (MLA, DeepSeek-V2/V3), causal, as transformers' `DeepseekV3Attention`.
//!
//! # Notation
//! B batch, S sequence, M model width, H heads, `Dn` = `qk_nope_head_dim`, `Dr` = `qk_rope_head_dim`,
//! `Dq = Dn + Dr`, `Dv` = `v_head_dim`, `Rq` = `q_lora_rank`, `Rkv` = `kv_lora_rank`.
//!
//! Queries come from `q_proj` (`[H*Dq, M]`) or from a low-rank path `q_b_proj(norm(q_a_proj(x)))`.
//! Keys and values come from one compressed latent: `kv_a_proj_with_mqa` gives `[Rkv + Dr]` per token;
//! the first `Rkv` are normalised and expanded by `kv_b_proj` to each head's `Dn` key part and `Dv`
//! value; the last `Dr` are one rotary key part **shared by every head**. RoPE touches only the `Dr`
//! dims of q and k (stored as interleaved pairs when `rope_interleave`).

use std::ops::Range;

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use disagmoe_kernels::ring::{chunk_partials, finish, Block, Mask, Partial};

use crate::decoder::{RingBlock, RingProjection};
use crate::error::Result;
use crate::init::Init;
use crate::kv_cache::{append, attention_at, LayerCache};
use crate::nn::{Linear, RmsNorm};
use crate::rope::{apply_rotary, deinterleave};
use crate::weights::{CheckpointReader, TensorSink};

/// Epsilon of the q and kv latent norms: transformers builds them with `DeepseekV3RMSNorm(rank)`,
/// i.e. its default 1e-6, whatever `rms_norm_eps` says.
pub const LATENT_NORM_EPS: f64 = 1e-6;

/// Shape and options of one MLA layer.
#[derive(Debug, Clone, Copy)]
pub struct MlaShape {
    /// Model width M.
    pub hidden: usize,
    /// Heads H.
    pub heads: usize,
    /// Query latent rank `Rq`; `None`: a plain `q_proj`.
    pub q_lora_rank: Option<usize>,
    /// Key/value latent rank `Rkv`.
    pub kv_lora_rank: usize,
    /// Per-head q/k dims without RoPE `Dn`.
    pub qk_nope_head_dim: usize,
    /// Per-head q/k dims with RoPE `Dr` (even).
    pub qk_rope_head_dim: usize,
    /// Per-head value dim `Dv`.
    pub v_head_dim: usize,
    /// `q_a_proj`, `kv_a_proj_with_mqa` and `o_proj` have biases.
    pub bias: bool,
    /// Rope dims are stored as interleaved pairs.
    pub rope_interleave: bool,
    /// Multiplies `q . k` before the softmax (`Dq^-0.5`, times YaRN's `mscale^2` where configured).
    pub softmax_scale: f64,
}

/// The query path: a plain projection, or a normalised low-rank one.
#[derive(Module, Debug)]
pub struct MlaQuery<B: Backend> {
    /// `q_proj`, `[H*Dq, M]` (when `q_lora_rank` is `None`).
    pub q_proj: Option<Linear<B>>,
    /// `q_a_proj`, `[Rq, M]`.
    pub q_a_proj: Option<Linear<B>>,
    /// `q_a_layernorm`, over `Rq`.
    pub q_a_layernorm: Option<RmsNorm<B>>,
    /// `q_b_proj`, `[H*Dq, Rq]`.
    pub q_b_proj: Option<Linear<B>>,
}

/// Multi-head latent attention.
#[derive(Module, Debug)]
pub struct MlaAttention<B: Backend> {
    /// Query projections.
    pub query: MlaQuery<B>,
    /// `kv_a_proj_with_mqa`, `[Rkv + Dr, M]`.
    pub kv_a_proj_with_mqa: Linear<B>,
    /// `kv_a_layernorm`, over `Rkv`.
    pub kv_a_layernorm: RmsNorm<B>,
    /// `kv_b_proj`, `[H*(Dn + Dv), Rkv]`.
    pub kv_b_proj: Linear<B>,
    /// `o_proj`, `[M, H*Dv]`.
    pub o_proj: Linear<B>,
    #[module(skip)]
    shape: MlaShape,
}

impl<B: Backend> MlaAttention<B> {
    /// A freshly initialised layer (normal(0, std) weights, norms at one, biases zero).
    pub fn new(shape: MlaShape, init: &Init<B>) -> Self {
        let MlaShape {
            hidden: m,
            heads: h,
            kv_lora_rank: r,
            qk_nope_head_dim: dn,
            qk_rope_head_dim: dr,
            v_head_dim: dv,
            bias,
            ..
        } = shape;
        let dq = dn + dr;
        let query = match shape.q_lora_rank {
            None => MlaQuery {
                q_proj: Some(Linear::new(m, h * dq, false, &init.child("q_proj"))),
                q_a_proj: None,
                q_a_layernorm: None,
                q_b_proj: None,
            },
            Some(rq) => MlaQuery {
                q_proj: None,
                q_a_proj: Some(Linear::new(m, rq, bias, &init.child("q_a_proj"))),
                q_a_layernorm: Some(RmsNorm::new(rq, LATENT_NORM_EPS, &init.child("q_a_layernorm"))),
                q_b_proj: Some(Linear::new(rq, h * dq, false, &init.child("q_b_proj"))),
            },
        };
        Self {
            query,
            kv_a_proj_with_mqa: Linear::new(m, r + dr, bias, &init.child("kv_a_proj_with_mqa")),
            kv_a_layernorm: RmsNorm::new(r, LATENT_NORM_EPS, &init.child("kv_a_layernorm")),
            kv_b_proj: Linear::new(r, h * (dn + dv), false, &init.child("kv_b_proj")),
            o_proj: Linear::new(h * dv, m, bias, &init.child("o_proj")),
            shape,
        }
    }

    /// The layer's shape.
    pub fn shape(&self) -> &MlaShape {
        &self.shape
    }

    fn rotate(&self, x: Tensor<B, 4>, cos: Tensor<B, 4>, sin: Tensor<B, 4>) -> Tensor<B, 4> {
        // Interleaved pairs rotated in place equal de-interleaving, then the half-split rotation.
        let x = if self.shape.rope_interleave { deinterleave(x) } else { x };
        apply_rotary(x, cos, sin)
    }

    /// Queries of `x` with their rotary part rotated (positions of `cos`, `sin`).
    ///
    /// # Shapes
    /// - x: `[B, S, M]`; cos, sin: `[1, 1, S, Dr]` -> `[B, H, S, Dq]`
    fn queries(&self, x: Tensor<B, 3>, cos: Tensor<B, 4>, sin: Tensor<B, 4>) -> Tensor<B, 4> {
        let [b, s, _] = x.dims();
        let MlaShape { heads: h, qk_nope_head_dim: dn, qk_rope_head_dim: dr, .. } = self.shape;
        let dq = dn + dr;
        let q = match &self.query {
            MlaQuery { q_proj: Some(p), .. } => p.forward(x),
            MlaQuery { q_a_proj: Some(a), q_a_layernorm: Some(n), q_b_proj: Some(bp), .. } => {
                bp.forward(n.forward(a.forward(x)))
            }
            _ => unreachable!("MLA has a plain or a low-rank query path"),
        }; // [B, S, H*Dq]
        let q = q.reshape([b, s, h, dq]).swap_dims(1, 2); // [B, H, S, Dq]
        let q_pass = q.clone().narrow(3, 0, dn); // [B, H, S, Dn]
        let q_rot = self.rotate(q.narrow(3, dn, dr), cos, sin); // [B, H, S, Dr]
        Tensor::cat(vec![q_pass, q_rot], 3)
    }

    /// The normalised latent and the rotated shared key of `x`: what a cache keeps.
    ///
    /// # Shapes
    /// - x: `[B, S, M]`; cos, sin: `[1, 1, S, Dr]` -> latent `[B, S, Rkv]`, k_rot `[B, S, Dr]`
    fn latent(&self, x: Tensor<B, 3>, cos: Tensor<B, 4>, sin: Tensor<B, 4>) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let [b, s, _] = x.dims();
        let MlaShape { kv_lora_rank: r, qk_rope_head_dim: dr, .. } = self.shape;
        let ckv = self.kv_a_proj_with_mqa.forward(x); // [B, S, Rkv + Dr]
        let kv_latent = self.kv_a_layernorm.forward(ckv.clone().narrow(2, 0, r)); // [B, S, Rkv]
        let k_rot = self.rotate(ckv.narrow(2, r, dr).reshape([b, 1, s, dr]), cos, sin); // [B, 1, S, Dr]
        (kv_latent, k_rot.reshape([b, s, dr]))
    }

    /// Per-head keys and values expanded from the latent; every head shares `k_rot`.
    ///
    /// # Shapes
    /// - latent: `[B, T, Rkv]`; k_rot: `[B, T, Dr]` -> k `[B, T, H, Dq]`, v `[B, T, H, Dv]`
    fn keys_values(&self, latent: Tensor<B, 3>, k_rot: Tensor<B, 3>) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let [b, t, _] = latent.dims();
        let MlaShape { heads: h, qk_nope_head_dim: dn, qk_rope_head_dim: dr, v_head_dim: dv, .. } = self.shape;
        let kv = self.kv_b_proj.forward(latent).reshape([b, t, h, dn + dv]); // [B, T, H, Dn+Dv]
        let k_nope = kv.clone().narrow(3, 0, dn); // [B, T, H, Dn]
        let v = kv.narrow(3, dn, dv); // [B, T, H, Dv]
        let k_rot = k_rot.reshape([b, t, 1, dr]).expand([b, t, h, dr]); // [B, T, H, Dr]
        (Tensor::cat(vec![k_nope, k_rot], 3), v)
    }

    /// Within each document of `docs` when given.
    ///
    /// # Shapes
    /// - x: `[B, S, M]`; cos, sin: `[1, 1, S, Dr]`; docs over `[B, S]`
    /// - output: `[B, S, M]`
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        cos: Tensor<B, 4>,
        sin: Tensor<B, 4>,
        docs: Option<&disagmoe_kernels::documents::Documents>,
    ) -> Tensor<B, 3> {
        let [b, s, _] = x.dims();
        let MlaShape { heads: h, v_head_dim: dv, .. } = self.shape;
        // 1. Queries; 2-3. the compressed latent and the shared rotary key, rotated; 4. per-head
        //    keys and values expanded from the latent.
        let q = self.queries(x.clone(), cos.clone(), sin.clone()).swap_dims(1, 2); // [B, S, H, Dq]
        let (latent, k_rot) = self.latent(x, cos, sin);
        let (k, v) = self.keys_values(latent, k_rot); // [B, S, H, *]

        // 5-6. Causal attention with the per-head dims (fused where `disagmoe_kernels::fused` has an
        //      operation or kernel for this backend, else its reference), merge heads, project.
        let scale = self.shape.softmax_scale;
        let out = disagmoe_kernels::fused::attention(q.clone(), k.clone(), v.clone(), None, scale, None, docs)
            .unwrap_or_else(|| disagmoe_kernels::reference::attention(q, k, v, None, scale, None, docs)); // [B, S, H, Dv]
        self.o_proj.forward(out.reshape([b, s, h * dv]))
    }

    /// Context parallelism's first half ([`crate::decoder::AttentionLayer::ring_project`]): the
    /// queries, and the normalised latent with the rotated shared key as one `[B, T, Rkv + Dr]`
    /// block (the compressed form goes round the ring; each worker expands it per head).
    pub fn ring_project(&self, x: Tensor<B, 3>, cos: Tensor<B, 4>, sin: Tensor<B, 4>) -> RingProjection<B> {
        let q = self.queries(x.clone(), cos.clone(), sin.clone()).swap_dims(1, 2); // [B, T, H, Dq]
        let (latent, k_rot) = self.latent(x, cos, sin);
        RingProjection { q, kv: Tensor::cat(vec![latent, k_rot], 2) }
    }

    /// Context parallelism's merge ([`crate::decoder::AttentionLayer::ring_merge`]): the attention
    /// of the queries of the worker's two chunks `q` over `blocks` (each expanded per
    /// head) onto `start` ([`chunk_partials`]).
    pub fn ring_merge(
        &self,
        q: &[Tensor<B, 4>; 2],
        held: &[Range<usize>; 2],
        blocks: Vec<RingBlock<B>>,
        start: Option<[Partial<B>; 2]>,
        docs: Option<&disagmoe_kernels::documents::Documents>,
    ) -> [Partial<B>; 2] {
        let MlaShape { kv_lora_rank: r, qk_rope_head_dim: dr, .. } = self.shape;
        let blocks: Vec<Block<B>> = blocks
            .into_iter()
            .map(|RingBlock { kv, held }| {
                let (k, v) = self.keys_values(kv.clone().narrow(2, 0, r), kv.narrow(2, r, dr));
                Block { k, v, held }
            })
            .collect();
        let mask = Mask { window: None, docs };
        chunk_partials(q, held, &blocks, start, self.shape.softmax_scale, mask)
            .unwrap_or_else(|e| panic!("the runtime hands ring attention its own chunks and blocks: {e}"))
    }

    /// Context parallelism's output ([`crate::decoder::AttentionLayer::ring_out`]).
    pub fn ring_out(&self, all: Partial<B>) -> Tensor<B, 3> {
        let [b, t, _, _] = all.out.dims();
        let MlaShape { heads: h, v_head_dim: dv, .. } = self.shape;
        self.o_proj.forward(finish(all, None).reshape([b, t, h * dv]))
    }

    /// [`MlaAttention::forward`] of new tokens at positions `past..past + S` over them and every
    /// earlier token, whose latent and rotated key `cache` holds (the new ones join it).
    ///
    /// # Shapes
    /// - x: `[B, S, M]`; cos, sin: `[1, 1, past + S, Dr]` (every position so far)
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
        let (cos, sin) = (cos.narrow(2, past, s), sin.narrow(2, past, s));
        let MlaShape { heads: h, v_head_dim: dv, .. } = self.shape;
        let q = self.queries(x.clone(), cos.clone(), sin.clone()).swap_dims(1, 2); // [B, S, H, Dq]
        let (latent_new, k_rot_new) = self.latent(x, cos, sin);
        let (latent_old, k_rot_old) = match std::mem::take(cache) {
            LayerCache::Latent { latent, k_rot } => (Some(latent), Some(k_rot)),
            _ => (None, None),
        };
        let (latent, k_rot) = (append(latent_old, latent_new), append(k_rot_old, k_rot_new)); // [B, T, *]
        let (k, v) = self.keys_values(latent.clone(), k_rot.clone()); // [B, T, H, *]
        let out = attention_at(q, k, v, None, self.shape.softmax_scale, None, past, 0); // [B, S, H, Dv]
        *cache = LayerCache::Latent { latent, k_rot };
        self.o_proj.forward(out.reshape([b, s, h * dv]))
    }

    /// Loads `{prefix}.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}`, `{prefix}.kv_a_proj_with_mqa`,
    /// `{prefix}.kv_a_layernorm`, `{prefix}.kv_b_proj` and `{prefix}.o_proj`.
    pub fn load(&mut self, ckpt: &mut CheckpointReader, prefix: &str, device: &B::Device) -> Result<()> {
        let q = &mut self.query;
        if let Some(p) = &mut q.q_proj {
            p.load(ckpt, &format!("{prefix}.q_proj"), device)?;
        }
        if let (Some(a), Some(n), Some(bp)) = (&mut q.q_a_proj, &mut q.q_a_layernorm, &mut q.q_b_proj) {
            a.load(ckpt, &format!("{prefix}.q_a_proj"), device)?;
            n.load(ckpt, &format!("{prefix}.q_a_layernorm"), device)?;
            bp.load(ckpt, &format!("{prefix}.q_b_proj"), device)?;
        }
        self.kv_a_proj_with_mqa.load(ckpt, &format!("{prefix}.kv_a_proj_with_mqa"), device)?;
        self.kv_a_layernorm.load(ckpt, &format!("{prefix}.kv_a_layernorm"), device)?;
        self.kv_b_proj.load(ckpt, &format!("{prefix}.kv_b_proj"), device)?;
        self.o_proj.load(ckpt, &format!("{prefix}.o_proj"), device)
    }

    /// Saves under the names [`MlaAttention::load`] reads.
    pub fn save(&self, sink: &mut TensorSink, prefix: &str) {
        let q = &self.query;
        if let Some(p) = &q.q_proj {
            p.save(sink, &format!("{prefix}.q_proj"));
        }
        if let (Some(a), Some(n), Some(bp)) = (&q.q_a_proj, &q.q_a_layernorm, &q.q_b_proj) {
            a.save(sink, &format!("{prefix}.q_a_proj"));
            n.save(sink, &format!("{prefix}.q_a_layernorm"));
            bp.save(sink, &format!("{prefix}.q_b_proj"));
        }
        self.kv_a_proj_with_mqa.save(sink, &format!("{prefix}.kv_a_proj_with_mqa"));
        self.kv_a_layernorm.save(sink, &format!("{prefix}.kv_a_layernorm"));
        self.kv_b_proj.save(sink, &format!("{prefix}.kv_b_proj"));
        self.o_proj.save(sink, &format!("{prefix}.o_proj"));
    }
}
