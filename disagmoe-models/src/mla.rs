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

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use crate::error::Result;
use crate::init::Init;
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

    /// # Shapes
    /// - x: `[B, S, M]`; cos, sin: `[1, 1, S, Dr]`
    /// - output: `[B, S, M]`
    pub fn forward(&self, x: Tensor<B, 3>, cos: Tensor<B, 4>, sin: Tensor<B, 4>) -> Tensor<B, 3> {
        let [b, s, _] = x.dims();
        let MlaShape { heads: h, kv_lora_rank: r, qk_nope_head_dim: dn, qk_rope_head_dim: dr, v_head_dim: dv, .. } =
            self.shape;
        let dq = dn + dr;
        // 1. Queries, split into the plain and the rotary part.
        let q = match &self.query {
            MlaQuery { q_proj: Some(p), .. } => p.forward(x.clone()),
            MlaQuery { q_a_proj: Some(a), q_a_layernorm: Some(n), q_b_proj: Some(bp), .. } => {
                bp.forward(n.forward(a.forward(x.clone())))
            }
            _ => unreachable!("MLA has a plain or a low-rank query path"),
        }; // [B, S, H*Dq]
        let q = q.reshape([b, s, h, dq]).swap_dims(1, 2); // [B, H, S, Dq]
        let q_pass = q.clone().narrow(3, 0, dn); // [B, H, S, Dn]
        let q_rot = q.narrow(3, dn, dr); // [B, H, S, Dr]
                                         // 2. The compressed latent and the shared rotary key.
        let ckv = self.kv_a_proj_with_mqa.forward(x); // [B, S, Rkv + Dr]
        let kv_latent = self.kv_a_layernorm.forward(ckv.clone().narrow(2, 0, r)); // [B, S, Rkv]
        let k_rot = ckv.narrow(2, r, dr).reshape([b, 1, s, dr]); // [B, 1, S, Dr]
                                                                 // 3. RoPE on the rotary parts.
        let q_rot = self.rotate(q_rot, cos.clone(), sin.clone()); // [B, H, S, Dr]
        let k_rot = self.rotate(k_rot, cos, sin); // [B, 1, S, Dr]
                                                  // 4. Expand the latent to per-head keys and values; every head shares k_rot.
        let kv = self.kv_b_proj.forward(kv_latent).reshape([b, s, h, dn + dv]).swap_dims(1, 2); // [B, H, S, Dn+Dv]
        let k_nope = kv.clone().narrow(3, 0, dn); // [B, H, S, Dn]
        let v = kv.narrow(3, dn, dv); // [B, H, S, Dv]
        let k = Tensor::cat(vec![k_nope, k_rot.expand([b, h, s, dr])], 3); // [B, H, S, Dq]
        let q = Tensor::cat(vec![q_pass, q_rot], 3); // [B, H, S, Dq]
                                                     // 5-6. Causal attention with the per-head dims (fused where `disagmoe_kernels::fused` has an
                                                     //      operation or kernel for this backend, else its reference), merge heads, project.
        let (qs, ks, vs) = (q.swap_dims(1, 2), k.swap_dims(1, 2), v.swap_dims(1, 2)); // [B, S, H, *]
        let scale = self.shape.softmax_scale;
        let out = disagmoe_kernels::fused::attention(qs.clone(), ks.clone(), vs.clone(), None, scale, None)
            .unwrap_or_else(|| disagmoe_kernels::reference::attention(qs, ks, vs, None, scale, None)); // [B, S, H, Dv]
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
