//! Causal grouped-query self-attention, with the variants the families need: per-head RMSNorm on q
//! and k before RoPE (Qwen3), projection biases and learned per-head attention sinks (GPT-OSS), and a
//! sliding window per layer.
//!
//! Notation: B batch, S sequence, H query heads, G key/value heads (H % G == 0), D head dim,
//! M model width.

use burn::module::{Module, Param};
use burn::tensor::activation::softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, Tensor, TensorData};

use crate::error::Result;
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

/// Which variant of attention a layer uses.
#[derive(Debug, Clone, Copy)]
pub struct AttentionOptions {
    /// q/k/v/o projections have biases.
    pub bias: bool,
    /// RMSNorm (with this epsilon) over each q and k head before RoPE (Qwen3).
    pub qk_norm_eps: Option<f64>,
    /// A learned logit per head joins every softmax and is dropped after it (GPT-OSS sinks).
    pub sinks: bool,
}

/// Grouped-query attention: q/k/v/o projections, optional q/k head norms, RoPE, causal (optionally
/// windowed) softmax with optional sinks.
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
    /// RMSNorm over D, applied to each query head (Qwen3).
    pub q_norm: Option<RmsNorm<B>>,
    /// RMSNorm over D, applied to each key head (Qwen3).
    pub k_norm: Option<RmsNorm<B>>,
    /// `[H]` learned sink logits (GPT-OSS).
    pub sinks: Option<Param<Tensor<B, 1>>>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    window: Option<usize>,
}

impl<B: Backend> GqaAttention<B> {
    /// A freshly initialised layer.
    pub fn new(shape: AttentionShape, options: AttentionOptions, std: f64, device: &B::Device) -> Self {
        let AttentionShape { hidden, heads, kv_heads, head_dim, window } = shape;
        let bias = options.bias;
        Self {
            q_proj: Linear::new(hidden, heads * head_dim, bias, std, device),
            k_proj: Linear::new(hidden, kv_heads * head_dim, bias, std, device),
            v_proj: Linear::new(hidden, kv_heads * head_dim, bias, std, device),
            o_proj: Linear::new(heads * head_dim, hidden, bias, std, device),
            q_norm: options.qk_norm_eps.map(|eps| RmsNorm::new(head_dim, eps, device)),
            k_norm: options.qk_norm_eps.map(|eps| RmsNorm::new(head_dim, eps, device)),
            sinks: options.sinks.then(|| Param::from_tensor(crate::nn::normal_init([heads], std, device))),
            heads,
            kv_heads,
            head_dim,
            window,
        }
    }

    /// # Shapes
    /// - x: `[B, S, M]`; cos, sin: `[1, 1, S, D]`
    /// - output: `[B, S, M]`
    pub fn forward(&self, x: Tensor<B, 3>, cos: Tensor<B, 4>, sin: Tensor<B, 4>) -> Tensor<B, 3> {
        let [b, s, _] = x.dims();
        let (h, g, d) = (self.heads, self.kv_heads, self.head_dim);
        // 1. Project and split heads; normalise q and k per head where the family does.
        let mut q = self.q_proj.forward(x.clone()).reshape([b, s, h, d]); // [B, S, H, D]
        let mut k = self.k_proj.forward(x.clone()).reshape([b, s, g, d]); // [B, S, G, D]
        let v = self.v_proj.forward(x).reshape([b, s, g, d]); // [B, S, G, D]
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            q = qn.forward(q);
            k = kn.forward(k);
        }
        let scale = (d as f64).powf(-0.5);
        if disagmoe_kernels::fused::available::<B>() {
            // Fused path (chosen in disagmoe_kernels::fused): everything stays in [B, S, heads, D].
            // Rotary embedding fused where there is a fused one (CPU), else Burn's in this layout.
            let sinks = self.sinks.as_ref().map(|p| p.val());
            let rope = |x: Tensor<B, 4>| {
                disagmoe_kernels::fused::rope(x.clone(), cos.clone(), sin.clone())
                    .unwrap_or_else(|| apply_rotary(x, cos.clone().swap_dims(1, 2), sin.clone().swap_dims(1, 2)))
            };
            let fused = disagmoe_kernels::fused::attention(
                rope(q.clone()),
                rope(k.clone()),
                v.clone(),
                sinks,
                scale,
                self.window,
            );
            if let Some(out) = fused {
                return self.o_proj.forward(out.reshape([b, s, h * d]));
            }
        }
        // [B, H, S, D], [B, G, S, D], [B, G, S, D]
        let (q, k, v) = (q.swap_dims(1, 2), k.swap_dims(1, 2), v.swap_dims(1, 2));
        // 2. Rotary embedding on q and k.
        let q = apply_rotary(q, cos.clone(), sin.clone());
        let k = apply_rotary(k, cos, sin);
        // 3. Share each key/value head among H/G query heads.
        let k = repeat_kv(k, h / g); // [B, H, S, D]
        let v = repeat_kv(v, h / g); // [B, H, S, D]
                                     // 4. Scaled scores, causal (and window) mask, softmax.
        let scores = q.matmul(k.swap_dims(2, 3)).mul_scalar(scale); // [B, H, S, S]
        let mask = causal_mask::<B>(s, self.window, &scores.device()); // [S, S], true = hidden
        let scores = scores.mask_fill(mask.unsqueeze::<4>().expand([b, h, s, s]), -1.0e9);
        let probs = match &self.sinks {
            // The sink is one more logit per head and query; its probability mass is dropped.
            Some(sinks) => {
                let sink = sinks.val().reshape([1, h, 1, 1]).expand([b, h, s, 1]);
                softmax(Tensor::cat(vec![scores, sink], 3), 3).narrow(3, 0, s) // [B, H, S, S]
            }
            None => softmax(scores, 3),
        };
        // 5. Weighted values, merge heads, output projection.
        let out = probs.matmul(v).swap_dims(1, 2).reshape([b, s, h * d]); // [B, S, H*D]
        self.o_proj.forward(out)
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

/// `[B, G, S, D] -> [B, G*n, S, D]`, each key/value head repeated for `n` consecutive query heads.
pub fn repeat_kv<B: Backend>(x: Tensor<B, 4>, n: usize) -> Tensor<B, 4> {
    if n == 1 {
        return x;
    }
    let [b, g, s, d] = x.dims();
    x.unsqueeze_dim::<5>(2).expand([b, g, n, s, d]).reshape([b, g * n, s, d])
}

/// `[S, S]` mask, true where query `i` may not see key `j`: `j > i`, or `i - j >= window`.
pub fn causal_mask<B: Backend>(s: usize, window: Option<usize>, device: &B::Device) -> Tensor<B, 2, Bool> {
    let w = window.unwrap_or(usize::MAX);
    let hidden: Vec<bool> = (0..s * s)
        .map(|ij| {
            let (i, j) = (ij / s, ij % s);
            j > i || i - j >= w
        })
        .collect();
    Tensor::from_data(TensorData::new(hidden, [s, s]), device)
}
