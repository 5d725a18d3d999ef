//! GPT-OSS (`GptOssForCausalLM` in transformers), natively in Burn.
//!
//! Differences from Qwen3-MoE, each a building block: attention with projection biases and learned
//! per-head **sinks**, layers alternating sliding-window and full attention (`layer_types`), YaRN
//! RoPE; a router with a bias that takes the top-k of the raw logits and softmaxes over the k chosen;
//! experts with biases, a fused `gate_up_proj` `[E, M, 2I]` (gate = even columns, up = odd columns),
//! gate clamped to `<= limit`, up to `[-limit, limit]`, `out = (up + 1) * gate * sigmoid(alpha * gate)`.
//!
//! Checkpoint names: `model.embed_tokens.weight`, `model.layers.{i}.input_layernorm.weight`,
//! `model.layers.{i}.self_attn.{q,k,v,o}_proj.{weight,bias}`, `model.layers.{i}.self_attn.sinks`,
//! `model.layers.{i}.post_attention_layernorm.weight`, `model.layers.{i}.mlp.router.{weight,bias}`,
//! `model.layers.{i}.mlp.experts.{gate_up_proj,gate_up_proj_bias,down_proj,down_proj_bias}` (or the
//! released MXFP4 form `*_blocks` + `*_scales`, dequantised on load), `model.norm.weight`,
//! `lm_head.weight`.

use std::path::Path;

use burn::module::{Module, Param};
use burn::tensor::activation::softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::attention::{AttentionOptions, AttentionShape, GqaAttention};
use crate::decoder::{CausalLm, DecoderLayer, FamilyConfig};
use crate::error::{ModelError, Result};
use crate::hf_json::{expect_model_type, parse_raw, positive, read_config};
use crate::moe::{gather_chosen, map_groups, top_k_ids, Experts, Router, RouterOutput, SparseMoeBlock};
use crate::nn::normal_init;
use crate::rope::{Rope, RopeScaling};
use crate::weights::{CheckpointReader, TensorSink};

/// Attention kind of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerType {
    /// Causal attention over a window of `sliding_window` keys.
    SlidingAttention,
    /// Causal attention over the whole prefix.
    FullAttention,
}

/// A validated GPT-OSS configuration, field names as in transformers' `GptOssConfig`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GptOssConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Model width M.
    pub hidden_size: usize,
    /// Intermediate size I of each expert.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (divides the query heads).
    pub num_key_value_heads: usize,
    /// Per-head dimension.
    pub head_dim: usize,
    /// Experts per layer (`num_local_experts`).
    pub num_local_experts: usize,
    /// Experts per token.
    pub num_experts_per_tok: usize,
    /// Window of the sliding layers.
    pub sliding_window: usize,
    /// Attention kind per layer (default: sliding on even layers, full on odd ones).
    pub layer_types: Vec<LayerType>,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// RoPE scaling (default: YaRN, factor 32, original context 4096, no truncation).
    pub rope_scaling: RopeScaling,
    /// Longest position configured.
    pub max_position_embeddings: usize,
    /// `lm_head` shares the embedding.
    pub tie_word_embeddings: bool,
    /// Projection biases.
    pub attention_bias: bool,
    /// `alpha` of the expert activation.
    pub swiglu_alpha: f64,
    /// Clamp limit of the expert activation.
    pub swiglu_limit: f64,
    /// Coefficient of the load-balancing loss.
    pub router_aux_loss_coef: f64,
    /// Whether transformers adds the aux loss.
    pub output_router_logits: bool,
    /// Standard deviation of the normal initialiser.
    pub initializer_range: f64,
}

#[derive(Debug, Deserialize)]
struct RawConfig {
    model_type: Option<String>,
    vocab_size: Option<i64>,
    hidden_size: Option<i64>,
    intermediate_size: Option<i64>,
    num_hidden_layers: Option<i64>,
    num_attention_heads: Option<i64>,
    num_key_value_heads: Option<i64>,
    head_dim: Option<i64>,
    #[serde(alias = "num_experts")]
    num_local_experts: Option<i64>,
    num_experts_per_tok: Option<i64>,
    sliding_window: Option<i64>,
    layer_types: Option<Vec<LayerType>>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    max_position_embeddings: Option<i64>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    swiglu_alpha: Option<f64>,
    swiglu_limit: Option<f64>,
    router_aux_loss_coef: Option<f64>,
    output_router_logits: Option<bool>,
    initializer_range: Option<f64>,
}

impl GptOssConfig {
    /// Reads and validates `config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        read_config(path.as_ref(), Self::from_json_str)
    }

    /// Parses and validates a `config.json` text (transformers 4.x or current spelling).
    pub fn from_json_str(text: &str) -> Result<Self> {
        let raw: RawConfig = parse_raw(text)?;
        expect_model_type(raw.model_type.as_deref(), "gpt_oss")?;
        let hidden_size = positive("hidden_size", raw.hidden_size, Some(2880))?;
        let heads = positive("num_attention_heads", raw.num_attention_heads, Some(64))?;
        let kv = positive("num_key_value_heads", raw.num_key_value_heads, Some(heads as i64))?;
        if heads % kv != 0 {
            return Err(ModelError::config(
                "num_key_value_heads",
                format!("must divide num_attention_heads ({heads}), got {kv}"),
            ));
        }
        let head_dim = positive("head_dim", raw.head_dim, Some((hidden_size / heads) as i64))?;
        if head_dim % 2 != 0 {
            return Err(ModelError::config("head_dim", format!("must be even for rotary embeddings, got {head_dim}")));
        }
        let layers = positive("num_hidden_layers", raw.num_hidden_layers, Some(36))?;
        let experts = positive("num_local_experts", raw.num_local_experts, Some(128))?;
        let top_k = positive("num_experts_per_tok", raw.num_experts_per_tok, Some(4))?;
        if top_k > experts {
            return Err(ModelError::config(
                "num_experts_per_tok",
                format!("must be between 1 and num_local_experts ({experts}), got {top_k}"),
            ));
        }
        let layer_types = match raw.layer_types {
            Some(t) if t.len() != layers => {
                return Err(ModelError::config(
                    "layer_types",
                    format!("must list one type per layer ({layers}), got {}", t.len()),
                ))
            }
            Some(t) => t,
            None => (0..layers)
                .map(|i| if (i + 1) % 2 == 1 { LayerType::SlidingAttention } else { LayerType::FullAttention })
                .collect(),
        };
        let default_yarn = json!({"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                  "truncate": false, "original_max_position_embeddings": 4096});
        let (theta_in, rope_scaling) = match (&raw.rope_parameters, &raw.rope_scaling) {
            (Some(p), _) if !p.is_null() => RopeScaling::from_hf("rope_parameters", p)?,
            (_, Some(s)) => RopeScaling::from_hf("rope_scaling", s)?,
            _ => RopeScaling::from_hf("rope_parameters", &default_yarn)?,
        };
        let rope_theta = theta_in.or(raw.rope_theta).unwrap_or(150000.0);
        let swiglu_limit = raw.swiglu_limit.unwrap_or(7.0);
        if !(swiglu_limit > 0.0) {
            return Err(ModelError::config("swiglu_limit", format!("must be > 0, got {swiglu_limit}")));
        }
        Ok(Self {
            vocab_size: positive("vocab_size", raw.vocab_size, Some(201088))?,
            hidden_size,
            intermediate_size: positive("intermediate_size", raw.intermediate_size, Some(2880))?,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            head_dim,
            num_local_experts: experts,
            num_experts_per_tok: top_k,
            sliding_window: positive("sliding_window", raw.sliding_window, Some(128))?,
            layer_types,
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-5),
            rope_theta,
            rope_scaling,
            max_position_embeddings: positive("max_position_embeddings", raw.max_position_embeddings, Some(131072))?,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            attention_bias: raw.attention_bias.unwrap_or(true),
            swiglu_alpha: raw.swiglu_alpha.unwrap_or(1.702),
            swiglu_limit,
            router_aux_loss_coef: raw.router_aux_loss_coef.unwrap_or(0.001),
            output_router_logits: raw.output_router_logits.unwrap_or(false),
            initializer_range: raw.initializer_range.unwrap_or(0.02),
        })
    }

    /// The configuration as a transformers `config.json`.
    pub fn to_hf_json(&self) -> Value {
        let mut rope = self.rope_scaling.to_hf();
        if let Some(o) = rope.as_object_mut() {
            o.insert("rope_theta".into(), json!(self.rope_theta));
        }
        json!({
            "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "num_local_experts": self.num_local_experts,
            "num_experts_per_tok": self.num_experts_per_tok, "sliding_window": self.sliding_window,
            "layer_types": self.layer_types, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": if rope.is_null() { Value::Null } else { rope },
            "max_position_embeddings": self.max_position_embeddings, "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias, "swiglu_alpha": self.swiglu_alpha, "swiglu_limit": self.swiglu_limit,
            "router_aux_loss_coef": self.router_aux_loss_coef, "output_router_logits": self.output_router_logits,
            "initializer_range": self.initializer_range, "hidden_act": "silu", "torch_dtype": "float32",
        })
    }
}

/// GPT-OSS router: `logits = x W^T + b`, top-k of the logits, softmax over the k chosen.
#[derive(Module, Debug)]
pub struct GptOssRouter<B: Backend> {
    /// `[E, M]`
    pub weight: Param<Tensor<B, 2>>,
    /// `[E]`
    pub bias: Param<Tensor<B, 1>>,
    top_k: usize,
}

impl<B: Backend> Router<B> for GptOssRouter<B> {
    fn route(&self, x: Tensor<B, 2>) -> RouterOutput<B> {
        let logits = x.matmul(self.weight.val().transpose()) + self.bias.val().unsqueeze::<2>(); // [T, E]
        let ids = top_k_ids(&logits, self.top_k);
        let weights = softmax(gather_chosen(logits.clone(), &ids, self.top_k), 1); // [T, k]
        RouterOutput { probs: softmax(logits, 1), weights, ids }
    }
    fn top_k(&self) -> usize {
        self.top_k
    }
    fn load(&mut self, ckpt: &mut CheckpointReader, block_prefix: &str, device: &B::Device) -> Result<()> {
        let [e, m] = self.weight.dims();
        self.weight =
            Param::from_tensor(ckpt.tensor::<B, 2>(&format!("{block_prefix}.router.weight"), [e, m], device)?);
        self.bias = Param::from_tensor(ckpt.tensor::<B, 1>(&format!("{block_prefix}.router.bias"), [e], device)?);
        Ok(())
    }
    fn save(&self, sink: &mut TensorSink, block_prefix: &str) {
        sink.put_param(format!("{block_prefix}.router.weight"), &self.weight);
        sink.put_param(format!("{block_prefix}.router.bias"), &self.bias);
    }
}

/// GPT-OSS experts in the checkpoint's fused layout.
#[derive(Module, Debug)]
pub struct GptOssExperts<B: Backend> {
    /// `[E, M, 2I]`, columns interleaved gate, up, gate, up, ...
    pub gate_up_proj: Param<Tensor<B, 3>>,
    /// `[E, 2I]`
    pub gate_up_proj_bias: Param<Tensor<B, 2>>,
    /// `[E, I, M]`
    pub down_proj: Param<Tensor<B, 3>>,
    /// `[E, M]`
    pub down_proj_bias: Param<Tensor<B, 2>>,
    alpha: f64,
    limit: f64,
}

/// GPT-OSS's clamped SwiGLU on fused gate/up activations.
///
/// # Shapes
/// - gate_up: `[N, 2I]` (gate = even columns, up = odd columns) -> `[N, I]`
pub fn clamped_swiglu<B: Backend>(gate_up: Tensor<B, 2>, alpha: f64, limit: f64) -> Tensor<B, 2> {
    // One definition, shared with the kernels' tests and benches.
    disagmoe_kernels::reference::clamped_swiglu(gate_up, alpha, limit)
}

impl<B: Backend> Experts<B> for GptOssExperts<B> {
    fn num_experts(&self) -> usize {
        self.gate_up_proj.dims()[0]
    }

    fn forward_grouped(&self, xs: Tensor<B, 2>, counts: &[usize]) -> Tensor<B, 2> {
        let [_, m, two_i] = self.gate_up_proj.dims();
        let i = two_i / 2;
        let (gu, gub, dp, dpb) =
            (self.gate_up_proj.val(), self.gate_up_proj_bias.val(), self.down_proj.val(), self.down_proj_bias.val());
        // The grouped kernel where there is one (CubeCL backends), chosen in disagmoe_kernels::fused.
        if let Some(ys) = disagmoe_kernels::fused::gpt_oss_experts(
            xs.clone(),
            counts,
            gu.clone(),
            gub.clone(),
            dp.clone(),
            dpb.clone(),
            self.alpha,
            self.limit,
        ) {
            return ys;
        }
        map_groups(xs, counts, |e, x| {
            let w = gu.clone().narrow(0, e, 1).reshape([m, two_i]);
            let b = gub.clone().narrow(0, e, 1); // [1, 2I]
            let h = clamped_swiglu(x.matmul(w) + b, self.alpha, self.limit); // [n, I]
            h.matmul(dp.clone().narrow(0, e, 1).reshape([i, m])) + dpb.clone().narrow(0, e, 1)
        })
    }

    fn load(&mut self, ckpt: &mut CheckpointReader, prefix: &str, device: &B::Device) -> Result<()> {
        let [e, m, two_i] = self.gate_up_proj.dims();
        let i = two_i / 2;
        self.gate_up_proj =
            Param::from_tensor(load_maybe_mxfp4(ckpt, &format!("{prefix}.gate_up_proj"), [e, m, two_i], device)?);
        self.gate_up_proj_bias =
            Param::from_tensor(ckpt.tensor(&format!("{prefix}.gate_up_proj_bias"), [e, two_i], device)?);
        self.down_proj = Param::from_tensor(load_maybe_mxfp4(ckpt, &format!("{prefix}.down_proj"), [e, i, m], device)?);
        self.down_proj_bias = Param::from_tensor(ckpt.tensor(&format!("{prefix}.down_proj_bias"), [e, m], device)?);
        Ok(())
    }

    fn save(&self, sink: &mut TensorSink, prefix: &str) {
        sink.put_param(format!("{prefix}.gate_up_proj"), &self.gate_up_proj);
        sink.put_param(format!("{prefix}.gate_up_proj_bias"), &self.gate_up_proj_bias);
        sink.put_param(format!("{prefix}.down_proj"), &self.down_proj);
        sink.put_param(format!("{prefix}.down_proj_bias"), &self.down_proj_bias);
    }

    fn fused(&self) -> bool {
        true
    }

    fn shard(self, range: std::ops::Range<usize>) -> Result<Self> {
        let e = self.num_experts();
        if range.end > e {
            return Err(ModelError::InvalidInput(format!("expert shard {range:?} of {e} experts")));
        }
        let (start, n) = (range.start, range.len());
        // A fresh leaf of the rows kept (through the host: a narrowed view is not a leaf), under the
        // fused tensor's id so the shard is still known by its checkpoint name.
        fn rows<B: Backend, const D: usize>(p: &Param<Tensor<B, D>>, start: usize, n: usize) -> Param<Tensor<B, D>> {
            let t = p.val().narrow(0, start, n);
            Param::initialized(p.id, Tensor::from_data(t.to_data(), &t.device()).require_grad())
        }
        Ok(Self {
            gate_up_proj: rows(&self.gate_up_proj, start, n),
            gate_up_proj_bias: rows(&self.gate_up_proj_bias, start, n),
            down_proj: rows(&self.down_proj, start, n),
            down_proj_bias: rows(&self.down_proj_bias, start, n),
            alpha: self.alpha,
            limit: self.limit,
        })
    }
}

/// The 16 values of an FP4 (E2M1) code, as transformers' `FP4_VALUES`.
pub const FP4_VALUES: [f32; 16] =
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// Dequantises MXFP4 expert weights as transformers does: `blocks` `[E, R, G, 16]` (two 4-bit codes
/// per byte, low nibble first), `scales` `[E, R, G]` (biased-127 exponents of 32-value groups) give
/// `[E, R, G*32]`, returned transposed to `[E, G*32, R]`.
pub fn dequantize_mxfp4(blocks: &[u8], block_shape: &[usize], scales: &[u8]) -> (Vec<usize>, Vec<f32>) {
    let (e, r, g, b) = (block_shape[0], block_shape[1], block_shape[2], block_shape[3]);
    let cols = g * b * 2;
    let mut out = vec![0f32; e * r * cols];
    for ei in 0..e {
        for ri in 0..r {
            for gi in 0..g {
                let scale = 2f32.powi(scales[(ei * r + ri) * g + gi] as i32 - 127);
                for bi in 0..b {
                    let byte = blocks[((ei * r + ri) * g + gi) * b + bi];
                    let c = gi * b * 2 + bi * 2;
                    // [E, R, C] -> transposed [E, C, R]
                    out[(ei * cols + c) * r + ri] = FP4_VALUES[(byte & 0x0f) as usize] * scale;
                    out[(ei * cols + c + 1) * r + ri] = FP4_VALUES[(byte >> 4) as usize] * scale;
                }
            }
        }
    }
    (vec![e, cols, r], out)
}

fn load_maybe_mxfp4<B: Backend>(
    ckpt: &mut CheckpointReader,
    name: &str,
    shape: [usize; 3],
    device: &B::Device,
) -> Result<Tensor<B, 3>> {
    let (blocks_name, scales_name) = (format!("{name}_blocks"), format!("{name}_scales"));
    if ckpt.contains(name) || !ckpt.contains(&blocks_name) {
        return ckpt.tensor(name, shape, device);
    }
    let (bshape, blocks) = ckpt.read_u8(&blocks_name)?;
    let (sshape, scales) = ckpt.read_u8(&scales_name)?;
    if bshape.len() != 4 || sshape != bshape[..3] {
        return Err(ModelError::ShapeMismatch {
            name: scales_name,
            found: sshape,
            expected: bshape[..3.min(bshape.len())].to_vec(),
        });
    }
    let (found, values) = dequantize_mxfp4(&blocks, &bshape, &scales);
    if found != shape {
        return Err(ModelError::ShapeMismatch { name: blocks_name, found, expected: shape.to_vec() });
    }
    Ok(Tensor::from_data(TensorData::new(values, shape), device))
}

/// GPT-OSS's expert block: a biased router and fused experts on every layer.
pub type GptOssMoe<B> = SparseMoeBlock<B, GptOssRouter<B>, GptOssExperts<B>>;
/// One GPT-OSS decoder layer.
pub type GptOssDecoderLayer<B> = DecoderLayer<B, GqaAttention<B>, GptOssMoe<B>>;
/// GPT-OSS causal language model.
pub type GptOssForCausalLM<B> = CausalLm<B, GptOssConfig, GqaAttention<B>, GptOssMoe<B>>;

impl GptOssConfig {
    fn layer<B: Backend>(&self, l: usize, device: &B::Device) -> GptOssDecoderLayer<B> {
        let std = self.initializer_range;
        let (m, i, e) = (self.hidden_size, self.intermediate_size, self.num_local_experts);
        let attention = GqaAttention::new(
            AttentionShape {
                hidden: m,
                heads: self.num_attention_heads,
                kv_heads: self.num_key_value_heads,
                head_dim: self.head_dim,
                window: (self.layer_types[l] == LayerType::SlidingAttention).then_some(self.sliding_window),
            },
            AttentionOptions { bias: self.attention_bias, qk_norm_eps: None, sinks: true },
            std,
            device,
        );
        let moe = SparseMoeBlock::new(
            GptOssRouter {
                weight: Param::from_tensor(normal_init([e, m], std, device)),
                bias: Param::from_tensor(normal_init([e], std, device)),
                top_k: self.num_experts_per_tok,
            },
            GptOssExperts {
                gate_up_proj: Param::from_tensor(normal_init([e, m, 2 * i], std, device)),
                gate_up_proj_bias: Param::from_tensor(Tensor::zeros([e, 2 * i], device)),
                down_proj: Param::from_tensor(normal_init([e, i, m], std, device)),
                down_proj_bias: Param::from_tensor(Tensor::zeros([e, m], device)),
                alpha: self.swiglu_alpha,
                limit: self.swiglu_limit,
            },
        );
        DecoderLayer::new(m, self.rms_norm_eps, attention, moe, device)
    }
}

impl FamilyConfig for GptOssConfig {
    type Model<B: Backend> = GptOssForCausalLM<B>;

    fn from_file(path: &Path) -> Result<Self> {
        GptOssConfig::from_file(path)
    }

    /// Initialised as transformers does: normal(0, std) weights, sinks and router bias, zero
    /// expert biases, norms at one.
    fn init<B: Backend>(&self, device: &B::Device) -> GptOssForCausalLM<B> {
        let layers = (0..self.num_hidden_layers).map(|l| self.layer(l, device)).collect();
        let dims =
            (self.vocab_size, self.hidden_size, self.rms_norm_eps, self.initializer_range, self.tie_word_embeddings);
        CausalLm::assemble(
            self.clone(),
            Rope::new(self.head_dim, self.rope_theta, &self.rope_scaling),
            dims,
            layers,
            device,
        )
    }

    fn to_hf_json(&self) -> Value {
        GptOssConfig::to_hf_json(self)
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn aux_loss_coef(&self) -> Option<f64> {
        Some(self.router_aux_loss_coef)
    }
}
