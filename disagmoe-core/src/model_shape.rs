//! Model shapes: the dimensions of an MoE transformer that the cost model needs, never its weights.
//!
//! A model is `layers` pairs of (attention block, FFN block) plus embedding and head. The FFN block
//! of a layer is either dense (the first `first_k_dense_replace` layers of DeepSeek) or a mixture of
//! `experts` routed experts (top-`top_k`) plus optional shared experts. Shapes come from a built-in
//! preset ([`ModelShape::preset`]), a JSON file of this type ([`ModelShape::from_json_file`]), or a
//! Hugging Face `config.json` read by the model family in `disagmoe-models` (each family describes
//! itself to the planner; this crate knows no family).

use crate::error::{check_nonzero, invalid, CoreError, Result};
use serde::{Deserialize, Serialize};

/// How a model's publisher counts its active parameters (what [`ParamCounts::active`] reports).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActiveCounting {
    /// The input embedding and the head both count (Qwen, DeepSeek, Mistral, OLMoE).
    #[default]
    WithInputEmbedding,
    /// The head counts, the input embedding (a lookup) does not (OpenAI's GPT-OSS).
    HeadOnly,
}

/// The attention block of one layer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum AttentionShape {
    /// Grouped-query attention (multi-head when `kv_heads == heads`).
    Gqa {
        /// Query heads.
        heads: usize,
        /// Key/value heads.
        kv_heads: usize,
        /// Dimension of one head.
        head_dim: usize,
        /// Biases on q, k, v and o projections (GPT-OSS).
        bias: bool,
        /// RMSNorm on q and k per head (Qwen3).
        qk_norm: bool,
        /// Learned per-head attention sink logits (GPT-OSS).
        sinks: bool,
    },
    /// Multi-head latent attention (DeepSeek-V2/V3).
    Mla {
        /// Heads.
        heads: usize,
        /// Rank of the query compression; `None` means a plain `q_proj`.
        q_lora_rank: Option<usize>,
        /// Rank of the joint key/value compression.
        kv_lora_rank: usize,
        /// Per-head query/key dimension without rotary embedding.
        qk_nope_head_dim: usize,
        /// Per-head query/key dimension with rotary embedding (key part shared by all heads).
        qk_rope_head_dim: usize,
        /// Per-head value dimension.
        v_head_dim: usize,
    },
}

/// Sliding-window attention on some layers: layer `i` uses a window of `window` tokens when
/// `i % period == 0` and full causal attention otherwise (GPT-OSS: window 128, period 2).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SlidingWindow {
    /// Window length in tokens.
    pub window: usize,
    /// Every `period`-th layer, starting at layer 0, is windowed.
    pub period: usize,
}

/// The mixture-of-experts block.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeShape {
    /// Routed experts per MoE layer.
    pub experts: usize,
    /// Experts chosen per token.
    pub top_k: usize,
    /// Intermediate size of one routed expert.
    pub intermediate: usize,
    /// Shared experts (always active), each of size `intermediate`.
    pub shared_experts: usize,
    /// Expert projections carry biases (GPT-OSS).
    pub expert_bias: bool,
    /// The router has a bias (GPT-OSS) or a selection bias (DeepSeek-V3 `e_score_correction_bias`).
    pub router_bias: bool,
}

/// The shape of a whole model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelShape {
    /// Name, e.g. `qwen3-235b-a22b`.
    pub name: String,
    /// Transformer layers.
    pub layers: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Input embedding and output head share weights.
    pub tied_embeddings: bool,
    /// Attention block (identical in every layer).
    pub attention: AttentionShape,
    /// Sliding-window pattern, if any.
    pub sliding_window: Option<SlidingWindow>,
    /// MoE block of the sparse layers.
    pub moe: MoeShape,
    /// Indices of layers whose FFN is a dense SwiGLU MLP instead of experts.
    pub dense_layers: Vec<usize>,
    /// Intermediate size of the dense MLP layers (unused when `dense_layers` is empty).
    pub dense_intermediate: usize,
    /// How the publisher counts active parameters.
    #[serde(default)]
    pub active_counting: ActiveCounting,
}

/// Parameter counts of a model.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ParamCounts {
    /// All parameters.
    pub total: f64,
    /// Parameters used per token, counted the way the model's authors publish it
    /// ([`ModelShape::active_counting`]).
    pub active: f64,
    /// Parameters used per token excluding the input embedding (a lookup without FLOPs).
    pub active_compute: f64,
    /// Attention blocks of all layers, including their norms.
    pub attention: f64,
    /// Routed experts of all layers.
    pub routed_experts: f64,
    /// Shared experts and dense MLPs of all layers.
    pub dense_ffn: f64,
    /// Routers of all MoE layers.
    pub router: f64,
    /// Input embedding, final norm and output head.
    pub embedding_and_head: f64,
}

/// Built-in model presets.
pub const MODEL_PRESETS: &[&str] = &[
    "qwen3-235b-a22b",
    "qwen3-30b-a3b",
    "gpt-oss-120b",
    "gpt-oss-20b",
    "deepseek-v3",
    "deepseek-moe-16b",
    "mixtral-8x7b",
    "mixtral-8x22b",
    "olmoe-1b-7b",
];

/// Mixtral (Mistral AI): GQA with 8 KV heads of 128, 8 SwiGLU experts, top-2, every layer routed.
fn mixtral(name: &str, layers: usize, hidden: usize, heads: usize, intermediate: usize, vocab: usize) -> ModelShape {
    ModelShape {
        name: name.into(),
        layers,
        hidden,
        vocab,
        tied_embeddings: false,
        attention: AttentionShape::Gqa { heads, kv_heads: 8, head_dim: 128, bias: false, qk_norm: false, sinks: false },
        sliding_window: None,
        moe: MoeShape { experts: 8, top_k: 2, intermediate, shared_experts: 0, expert_bias: false, router_bias: false },
        dense_layers: vec![],
        dense_intermediate: 0,
        active_counting: ActiveCounting::WithInputEmbedding,
    }
}

fn qwen3(name: &str, layers: usize, hidden: usize, heads: usize, intermediate: usize) -> ModelShape {
    ModelShape {
        name: name.into(),
        layers,
        hidden,
        vocab: 151_936,
        tied_embeddings: false,
        attention: AttentionShape::Gqa { heads, kv_heads: 4, head_dim: 128, bias: false, qk_norm: true, sinks: false },
        sliding_window: None,
        moe: MoeShape {
            experts: 128,
            top_k: 8,
            intermediate,
            shared_experts: 0,
            expert_bias: false,
            router_bias: false,
        },
        dense_layers: vec![],
        dense_intermediate: 0,
        active_counting: ActiveCounting::WithInputEmbedding,
    }
}

fn gpt_oss(name: &str, layers: usize, experts: usize) -> ModelShape {
    ModelShape {
        name: name.into(),
        layers,
        hidden: 2880,
        vocab: 201_088,
        tied_embeddings: false,
        attention: AttentionShape::Gqa {
            heads: 64,
            kv_heads: 8,
            head_dim: 64,
            bias: true,
            qk_norm: false,
            sinks: true,
        },
        sliding_window: Some(SlidingWindow { window: 128, period: 2 }),
        active_counting: ActiveCounting::HeadOnly,
        moe: MoeShape {
            experts,
            top_k: 4,
            intermediate: 2880,
            shared_experts: 0,
            expert_bias: true,
            router_bias: true,
        },
        dense_layers: vec![],
        dense_intermediate: 0,
    }
}

impl ModelShape {
    /// A built-in preset by name (see [`MODEL_PRESETS`]).
    pub fn preset(name: &str) -> Result<Self> {
        let shape = match name.to_ascii_lowercase().as_str() {
            "qwen3-235b-a22b" => qwen3("qwen3-235b-a22b", 94, 4096, 64, 1536),
            "qwen3-30b-a3b" => qwen3("qwen3-30b-a3b", 48, 2048, 32, 768),
            "gpt-oss-120b" => gpt_oss("gpt-oss-120b", 36, 128),
            "gpt-oss-20b" => gpt_oss("gpt-oss-20b", 24, 32),
            "deepseek-v3" => ModelShape {
                name: "deepseek-v3".into(),
                layers: 61,
                hidden: 7168,
                vocab: 129_280,
                tied_embeddings: false,
                attention: AttentionShape::Mla {
                    heads: 128,
                    q_lora_rank: Some(1536),
                    kv_lora_rank: 512,
                    qk_nope_head_dim: 128,
                    qk_rope_head_dim: 64,
                    v_head_dim: 128,
                },
                sliding_window: None,
                moe: MoeShape {
                    experts: 256,
                    top_k: 8,
                    intermediate: 2048,
                    shared_experts: 1,
                    expert_bias: false,
                    router_bias: true,
                },
                dense_layers: vec![0, 1, 2],
                dense_intermediate: 18_432,
                active_counting: ActiveCounting::WithInputEmbedding,
            },
            "deepseek-moe-16b" => ModelShape {
                name: "deepseek-moe-16b".into(),
                layers: 28,
                hidden: 2048,
                vocab: 102_400,
                tied_embeddings: false,
                attention: AttentionShape::Gqa {
                    heads: 16,
                    kv_heads: 16,
                    head_dim: 128,
                    bias: false,
                    qk_norm: false,
                    sinks: false,
                },
                sliding_window: None,
                moe: MoeShape {
                    experts: 64,
                    top_k: 6,
                    intermediate: 1408,
                    shared_experts: 2,
                    expert_bias: false,
                    router_bias: false,
                },
                dense_layers: vec![0],
                dense_intermediate: 10_944,
                active_counting: ActiveCounting::WithInputEmbedding,
            },
            "mixtral-8x7b" => mixtral("mixtral-8x7b", 32, 4096, 32, 14_336, 32_000),
            "mixtral-8x22b" => mixtral("mixtral-8x22b", 56, 6144, 48, 16_384, 32_768),
            "olmoe-1b-7b" => ModelShape {
                name: "olmoe-1b-7b".into(),
                layers: 16,
                hidden: 2048,
                vocab: 50_304,
                tied_embeddings: false,
                attention: AttentionShape::Gqa {
                    heads: 16,
                    kv_heads: 16,
                    head_dim: 128,
                    bias: false,
                    qk_norm: true,
                    sinks: false,
                },
                sliding_window: None,
                moe: MoeShape {
                    experts: 64,
                    top_k: 8,
                    intermediate: 1024,
                    shared_experts: 0,
                    expert_bias: false,
                    router_bias: false,
                },
                dense_layers: vec![],
                dense_intermediate: 0,
                active_counting: ActiveCounting::WithInputEmbedding,
            },
            _ => {
                return Err(CoreError::UnknownPreset {
                    kind: "model",
                    name: name.to_string(),
                    known: MODEL_PRESETS.join(", "),
                })
            }
        };
        Ok(shape)
    }

    /// A shape saved as JSON (this type's serde form), validated.
    pub fn from_json_file(path: &std::path::Path) -> Result<Self> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| CoreError::Io { path: shown.clone(), source })?;
        let shape: Self = serde_json::from_str(&text).map_err(|source| CoreError::Json { path: shown, source })?;
        shape.validate()?;
        Ok(shape)
    }

    /// Checks every field; the error names the field and its allowed range.
    pub fn validate(&self) -> Result<()> {
        check_nonzero("model.layers", self.layers)?;
        check_nonzero("model.hidden", self.hidden)?;
        check_nonzero("model.vocab", self.vocab)?;
        check_nonzero("model.moe.experts", self.moe.experts)?;
        check_nonzero("model.moe.intermediate", self.moe.intermediate)?;
        if self.moe.top_k == 0 || self.moe.top_k > self.moe.experts {
            return Err(invalid(
                "model.moe.top_k",
                self.moe.top_k,
                &format!("1..={} (the number of experts)", self.moe.experts),
            ));
        }
        match &self.attention {
            AttentionShape::Gqa { heads, kv_heads, head_dim, .. } => {
                check_nonzero("model.attention.heads", *heads)?;
                check_nonzero("model.attention.head_dim", *head_dim)?;
                if *kv_heads == 0 || heads % kv_heads != 0 {
                    return Err(invalid(
                        "model.attention.kv_heads",
                        kv_heads,
                        &format!("a divisor of heads = {heads}"),
                    ));
                }
            }
            AttentionShape::Mla { heads, kv_lora_rank, v_head_dim, .. } => {
                check_nonzero("model.attention.heads", *heads)?;
                check_nonzero("model.attention.kv_lora_rank", *kv_lora_rank)?;
                check_nonzero("model.attention.v_head_dim", *v_head_dim)?;
            }
        }
        if let Some(&bad) = self.dense_layers.iter().find(|&&l| l >= self.layers) {
            return Err(invalid("model.dense_layers", bad, &format!("layer indices in 0..{}", self.layers)));
        }
        if !self.dense_layers.is_empty() {
            check_nonzero("model.dense_intermediate", self.dense_intermediate)?;
        }
        if let Some(sw) = &self.sliding_window {
            check_nonzero("model.sliding_window.window", sw.window)?;
            check_nonzero("model.sliding_window.period", sw.period)?;
        }
        Ok(())
    }

    /// Whether layer `layer` has a dense FFN instead of experts.
    pub fn is_dense(&self, layer: usize) -> bool {
        self.dense_layers.contains(&layer)
    }

    /// Layer `layer`'s sliding window when it is windowed and the window is shorter than a
    /// sequence of `seq` tokens (otherwise it attends causally to the whole sequence).
    pub fn short_window(&self, layer: usize, seq: usize) -> Option<usize> {
        self.sliding_window.as_ref().filter(|sw| layer.is_multiple_of(sw.period) && sw.window < seq).map(|sw| sw.window)
    }

    /// The attention span of a token at position `pos` averaged over a causal sequence of
    /// `seq` tokens in layer `layer`: `(seq + 1) / 2` for full attention, less with a window.
    pub fn mean_context(&self, layer: usize, seq: usize) -> f64 {
        let s = seq as f64;
        match self.short_window(layer, seq) {
            Some(w) => {
                let w = w as f64;
                // Positions < w see pos+1 tokens, the rest see w.
                (w * (w + 1.0) / 2.0 + (s - w) * w) / s
            }
            _ => (s + 1.0) / 2.0,
        }
    }

    /// Parameters of one attention block, norms included.
    pub fn attention_params(&self) -> f64 {
        let h = self.hidden as f64;
        let norms = 2.0 * h;
        norms
            + match &self.attention {
                AttentionShape::Gqa { heads, kv_heads, head_dim, bias, qk_norm, sinks } => {
                    let (q, kv) = ((heads * head_dim) as f64, (kv_heads * head_dim) as f64);
                    let mut p = h * (q + 2.0 * kv) + q * h;
                    if *bias {
                        p += q + 2.0 * kv + h;
                    }
                    if *qk_norm {
                        p += 2.0 * *head_dim as f64;
                    }
                    if *sinks {
                        p += *heads as f64;
                    }
                    p
                }
                AttentionShape::Mla {
                    heads,
                    q_lora_rank,
                    kv_lora_rank,
                    qk_nope_head_dim,
                    qk_rope_head_dim,
                    v_head_dim,
                } => {
                    let n = *heads as f64;
                    let qk = (qk_nope_head_dim + qk_rope_head_dim) as f64;
                    let q = match q_lora_rank {
                        Some(r) => h * *r as f64 + *r as f64 + *r as f64 * n * qk,
                        None => h * n * qk,
                    };
                    let kv_a = h * (kv_lora_rank + qk_rope_head_dim) as f64 + *kv_lora_rank as f64;
                    let kv_b = *kv_lora_rank as f64 * n * (qk_nope_head_dim + v_head_dim) as f64;
                    let o = n * *v_head_dim as f64 * h;
                    q + kv_a + kv_b + o
                }
            }
    }

    /// Parameters of one SwiGLU MLP of intermediate size `inter` (with biases when `bias`).
    pub fn mlp_params(&self, inter: usize, bias: bool) -> f64 {
        let (h, i) = (self.hidden as f64, inter as f64);
        3.0 * h * i + if bias { 2.0 * i + h } else { 0.0 }
    }

    /// Parameters of one routed expert.
    pub fn expert_params(&self) -> f64 {
        self.mlp_params(self.moe.intermediate, self.moe.expert_bias)
    }

    /// Parameters of one router.
    pub fn router_params(&self) -> f64 {
        let e = self.moe.experts as f64;
        self.hidden as f64 * e + if self.moe.router_bias { e } else { 0.0 }
    }

    /// Parameters of the FFN block of layer `layer` that every token uses (dense MLP, or router
    /// plus shared experts).
    pub fn ffn_dense_params(&self, layer: usize) -> f64 {
        if self.is_dense(layer) {
            self.mlp_params(self.dense_intermediate, false)
        } else {
            self.router_params() + self.moe.shared_experts as f64 * self.mlp_params(self.moe.intermediate, false)
        }
    }

    /// Parameter counts, total and active, with a breakdown by component.
    pub fn param_counts(&self) -> ParamCounts {
        let l = self.layers as f64;
        let moe_layers = (self.layers - self.dense_layers.len()) as f64;
        let attention = l * self.attention_params();
        let routed_experts = moe_layers * self.moe.experts as f64 * self.expert_params();
        let routed_active = moe_layers * self.moe.top_k as f64 * self.expert_params();
        let router = moe_layers * self.router_params();
        let dense_ffn = self.dense_layers.len() as f64 * self.mlp_params(self.dense_intermediate, false)
            + moe_layers * self.moe.shared_experts as f64 * self.mlp_params(self.moe.intermediate, false);
        let table = (self.vocab * self.hidden) as f64;
        let head = if self.tied_embeddings { 0.0 } else { table };
        let embedding_and_head = table + head + self.hidden as f64;
        let total = attention + routed_experts + router + dense_ffn + embedding_and_head;
        let active_compute = attention + routed_active + router + dense_ffn + table + self.hidden as f64;
        let active = match self.active_counting {
            ActiveCounting::HeadOnly => active_compute,
            ActiveCounting::WithInputEmbedding => active_compute + if self.tied_embeddings { 0.0 } else { table },
        };
        ParamCounts { total, active, active_compute, attention, routed_experts, dense_ffn, router, embedding_and_head }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Published totals and active counts (model cards), in billions.
    const PUBLISHED: &[(&str, f64, f64)] = &[
        ("qwen3-235b-a22b", 235.0, 22.0),
        ("qwen3-30b-a3b", 30.5, 3.3),
        ("gpt-oss-120b", 116.8, 5.1),
        ("gpt-oss-20b", 20.9, 3.6),
        ("deepseek-v3", 671.0, 37.0),
        ("deepseek-moe-16b", 16.4, 2.8),
        ("mixtral-8x7b", 46.7, 12.9),
        ("mixtral-8x22b", 141.0, 39.0),
        ("olmoe-1b-7b", 6.9, 1.3),
    ];

    #[test]
    fn preset_parameter_counts_are_within_two_percent_of_published() {
        for &(name, total, active) in PUBLISHED {
            let m = ModelShape::preset(name).unwrap();
            m.validate().unwrap();
            let p = m.param_counts();
            let (t, a) = (p.total / 1e9, p.active / 1e9);
            assert!((t / total - 1.0).abs() < 0.02, "{name}: total {t:.2}B vs published {total}B");
            assert!((a / active - 1.0).abs() < 0.02, "{name}: active {a:.2}B vs published {active}B");
        }
    }

    #[test]
    fn sliding_window_shortens_the_mean_context_of_windowed_layers_only() {
        let m = ModelShape::preset("gpt-oss-120b").unwrap();
        assert!(m.mean_context(0, 4096) < 130.0);
        assert!((m.mean_context(1, 4096) - 2048.5).abs() < 1e-9);
        // Shorter than the window: the window does not bind.
        assert!((m.mean_context(0, 100) - 50.5).abs() < 1e-9);
    }

    #[test]
    fn validation_names_the_field_and_range() {
        let mut m = ModelShape::preset("qwen3-30b-a3b").unwrap();
        m.moe.top_k = 200;
        let e = m.validate().unwrap_err().to_string();
        assert!(e.contains("model.moe.top_k") && e.contains("1..=128"), "{e}");
        let e = ModelShape::preset("llama").unwrap_err().to_string();
        assert!(e.contains("gpt-oss-120b"), "{e}");
    }
}
