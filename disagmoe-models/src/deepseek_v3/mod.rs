//! DeepSeek-V3 and DeepSeekMoE-style models (`DeepseekV3ForCausalLM` in transformers), natively in Burn.
//!
//! A model is a sequence of (attention block, expert block) pairs plus embedding and head; it knows
//! nothing about devices, ranks or transports. Attention is multi-head latent attention
//! ([`crate::mla`]); the first `first_k_dense_replace` layers have a dense SwiGLU MLP, the others
//! routed SwiGLU experts chosen by the [`DeepseekRouter`] plus always-on shared experts.
//!
//! Checkpoint names: `model.embed_tokens.weight`, `model.layers.{i}.input_layernorm.weight`,
//! `model.layers.{i}.self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}.weight`,
//! `model.layers.{i}.self_attn.{kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}.weight`
//! (plus `.bias` of `q_a_proj`, `kv_a_proj_with_mqa`, `o_proj` with `attention_bias`),
//! `model.layers.{i}.post_attention_layernorm.weight`, dense layers
//! `model.layers.{i}.mlp.{gate,up,down}_proj.weight`, MoE layers `model.layers.{i}.mlp.gate.weight`,
//! `model.layers.{i}.mlp.gate.e_score_correction_bias` (a buffer),
//! `model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight` (or the fused
//! `mlp.experts.{gate_up_proj, down_proj}`), `model.layers.{i}.mlp.shared_experts.{gate,up,down}_proj.weight`,
//! `model.norm.weight`, `lm_head.weight` (absent when tied). Hub checkpoints also hold the
//! multi-token-prediction layer(s) at `model.layers.{num_hidden_layers}.*`; they are skipped on load.
//!
//! Balancing: transformers' deepseek_v3 computes no auxiliary loss, so [`DeepseekV3ForCausalLM::loss`]
//! returns `aux_loss: None`; balance comes from [`DeepseekV3ForCausalLM::update_router_biases`]
//! (aux-loss-free bias updates from the step's expert load).

pub mod config;

use std::path::Path;

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

pub use self::config::{DeepseekV3Config, ScoringFunc};
use crate::causal_lm::{
    input_ids, lm_logits, load_stack, next_token_cross_entropy, save_stack, CausalLmOutput, HfCheckpoint, LossParts,
};
use crate::deepseek_router::{DeepseekRouter, DeepseekRouterConfig};
use crate::error::{ModelError, Result};
use crate::mla::{MlaAttention, MlaShape};
use crate::moe::{RouterStats, SparseMoeBlock, SwiGluExperts, SwiGluMlp};
use crate::nn::{Embedding, Linear, RmsNorm};
use crate::rope::Rope;
use crate::weights::{CheckpointReader, TensorSink};

/// A DeepSeek MoE block: group-limited router, routed SwiGLU experts, shared experts.
pub type DeepseekMoe<B> = SparseMoeBlock<B, DeepseekRouter<B>, SwiGluExperts<B>>;

/// The expert block of one layer: routed plus shared experts, or a dense MLP in the first layers.
#[derive(Module, Debug)]
pub struct DeepseekFeedForward<B: Backend> {
    /// Present on MoE layers (`layer >= first_k_dense_replace`).
    pub moe: Option<DeepseekMoe<B>>,
    /// Present on the first `first_k_dense_replace` layers.
    pub dense: Option<SwiGluMlp<B>>,
}

/// One decoder layer: pre-norm MLA and pre-norm feed-forward, each with a residual.
#[derive(Module, Debug)]
pub struct DeepseekV3DecoderLayer<B: Backend> {
    /// Norm before attention.
    pub input_layernorm: RmsNorm<B>,
    /// Attention block.
    pub self_attn: MlaAttention<B>,
    /// Norm before the feed-forward.
    pub post_attention_layernorm: RmsNorm<B>,
    /// Expert block.
    pub mlp: DeepseekFeedForward<B>,
}

impl<B: Backend> DeepseekV3DecoderLayer<B> {
    fn new(c: &DeepseekV3Config, layer: usize, device: &B::Device) -> Self {
        let std = c.initializer_range;
        let shape = MlaShape {
            hidden: c.hidden_size,
            heads: c.num_attention_heads,
            q_lora_rank: c.q_lora_rank,
            kv_lora_rank: c.kv_lora_rank,
            qk_nope_head_dim: c.qk_nope_head_dim,
            qk_rope_head_dim: c.qk_rope_head_dim,
            v_head_dim: c.v_head_dim,
            bias: c.attention_bias,
            rope_interleave: c.rope_interleave,
            softmax_scale: c.softmax_scale(),
        };
        let mlp = if c.is_sparse_layer(layer) {
            let router = DeepseekRouterConfig {
                hidden: c.hidden_size,
                experts: c.n_routed_experts,
                top_k: c.num_experts_per_tok,
                n_group: c.n_group,
                topk_group: c.topk_group,
                norm_topk_prob: c.norm_topk_prob,
                routed_scaling_factor: c.routed_scaling_factor,
                scoring: c.scoring_func,
            };
            let mut moe = SparseMoeBlock::new(
                DeepseekRouter::new(router, std, device),
                SwiGluExperts::new(c.n_routed_experts, c.hidden_size, c.moe_intermediate_size, std, device),
            );
            moe.shared_experts = (c.n_shared_experts > 0)
                .then(|| SwiGluMlp::new(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts, std, device));
            DeepseekFeedForward { moe: Some(moe), dense: None }
        } else {
            DeepseekFeedForward {
                moe: None,
                dense: Some(SwiGluMlp::new(c.hidden_size, c.intermediate_size, std, device)),
            }
        };
        Self {
            input_layernorm: RmsNorm::new(c.hidden_size, c.rms_norm_eps, device),
            self_attn: MlaAttention::new(shape, std, device),
            post_attention_layernorm: RmsNorm::new(c.hidden_size, c.rms_norm_eps, device),
            mlp,
        }
    }

    /// The attention half: `x + mla(norm(x))`.
    ///
    /// # Shapes
    /// - x: `[B, S, M]`; cos, sin: `[1, 1, S, Dr]` -> `[B, S, M]`
    pub fn attention_block(&self, x: Tensor<B, 3>, cos: Tensor<B, 4>, sin: Tensor<B, 4>) -> Tensor<B, 3> {
        x.clone() + self.self_attn.forward(self.input_layernorm.forward(x), cos, sin)
    }

    /// The expert half: `x + ffn(norm(x))`, with router statistics on MoE layers.
    ///
    /// # Shapes
    /// - x: `[B, S, M]` -> `[B, S, M]`
    pub fn expert_block(&self, x: Tensor<B, 3>) -> (Tensor<B, 3>, Option<RouterStats<B>>) {
        let h = self.post_attention_layernorm.forward(x.clone());
        let (y, stats) = match (&self.mlp.moe, &self.mlp.dense) {
            (Some(moe), _) => {
                let (y, stats) = moe.forward(h);
                (y, Some(stats))
            }
            (None, Some(mlp)) => (mlp.forward(h), None),
            (None, None) => unreachable!("a feed-forward block is sparse or dense"),
        };
        (x + y, stats)
    }

    fn load(&mut self, ckpt: &mut CheckpointReader, prefix: &str, device: &B::Device) -> Result<()> {
        self.input_layernorm.load(ckpt, &format!("{prefix}.input_layernorm"), device)?;
        self.self_attn.load(ckpt, &format!("{prefix}.self_attn"), device)?;
        self.post_attention_layernorm.load(ckpt, &format!("{prefix}.post_attention_layernorm"), device)?;
        match (&mut self.mlp.moe, &mut self.mlp.dense) {
            (Some(moe), _) => moe.load(ckpt, &format!("{prefix}.mlp"), device),
            (None, Some(mlp)) => mlp.load(ckpt, &format!("{prefix}.mlp"), device),
            (None, None) => Ok(()),
        }
    }

    fn save(&self, sink: &mut TensorSink, prefix: &str) {
        self.input_layernorm.save(sink, &format!("{prefix}.input_layernorm"));
        self.self_attn.save(sink, &format!("{prefix}.self_attn"));
        self.post_attention_layernorm.save(sink, &format!("{prefix}.post_attention_layernorm"));
        if let Some(moe) = &self.mlp.moe {
            moe.save(sink, &format!("{prefix}.mlp"));
        }
        if let Some(mlp) = &self.mlp.dense {
            mlp.save(sink, &format!("{prefix}.mlp"));
        }
    }
}

/// DeepSeek-V3 causal language model.
#[derive(Module, Debug)]
pub struct DeepseekV3ForCausalLM<B: Backend> {
    /// `model.embed_tokens`
    pub embed_tokens: Embedding<B>,
    /// `model.layers`
    pub layers: Vec<DeepseekV3DecoderLayer<B>>,
    /// `model.norm`
    pub norm: RmsNorm<B>,
    /// `lm_head` (absent when tied to the embedding).
    pub lm_head: Option<Linear<B>>,
    #[module(skip)]
    config: DeepseekV3Config,
    #[module(skip)]
    rope: Rope,
}

impl DeepseekV3Config {
    /// A freshly initialised model (normal(0, `initializer_range`) weights, norms at one, zero
    /// correction biases), as transformers initialises it.
    pub fn init<B: Backend>(&self, device: &B::Device) -> DeepseekV3ForCausalLM<B> {
        let std = self.initializer_range;
        DeepseekV3ForCausalLM {
            embed_tokens: Embedding::new(self.vocab_size, self.hidden_size, std, device),
            layers: (0..self.num_hidden_layers).map(|l| DeepseekV3DecoderLayer::new(self, l, device)).collect(),
            norm: RmsNorm::new(self.hidden_size, self.rms_norm_eps, device),
            lm_head: (!self.tie_word_embeddings)
                .then(|| Linear::new(self.hidden_size, self.vocab_size, false, std, device)),
            config: self.clone(),
            rope: Rope::new(self.qk_rope_head_dim, self.rope_theta, &self.rope_scaling),
        }
    }
}

impl<B: Backend> HfCheckpoint<B> for DeepseekV3ForCausalLM<B> {
    fn init_from_config(path: &Path, device: &B::Device) -> Result<Self> {
        Ok(DeepseekV3Config::from_file(path)?.init(device))
    }

    fn hf_config(&self) -> serde_json::Value {
        self.config.to_hf_json()
    }

    /// Also loads the routers' correction biases.
    fn load_weights(&mut self, ckpt: &mut CheckpointReader, device: &B::Device) -> Result<()> {
        let stack = (&mut self.embed_tokens, self.layers.as_mut_slice(), &mut self.norm, self.lm_head.as_mut());
        load_stack(stack, ckpt, device, |layer, ckpt, prefix| layer.load(ckpt, prefix, device))
    }

    /// Includes the routers' correction biases, which never receive gradients.
    fn save_into(&self, sink: &mut TensorSink) {
        let stack = (&self.embed_tokens, self.layers.as_slice(), &self.norm, self.lm_head.as_ref());
        save_stack(stack, sink, |layer, sink, prefix| layer.save(sink, prefix));
    }

    /// Multi-token-prediction layers (`model.layers.{num_hidden_layers}.*` and beyond) are skipped
    /// with one log line.
    fn report_unused(&self, unused: Vec<String>) {
        let layers = self.config.num_hidden_layers;
        let (mtp, other): (Vec<String>, Vec<String>) = unused.into_iter().partition(|n| is_mtp_tensor(n, layers));
        if !mtp.is_empty() {
            tracing::info!(count = mtp.len(), layer = layers, "skipping the multi-token-prediction layer tensors");
        }
        if let Some(first) = other.first() {
            tracing::warn!(count = other.len(), first = %first, "checkpoint tensors not used by the model");
        }
    }
}

impl<B: Backend> DeepseekV3ForCausalLM<B> {
    /// The model's configuration.
    pub fn config(&self) -> &DeepseekV3Config {
        &self.config
    }

    /// Token ids as a `[batch, seq]` tensor, checked against the vocabulary.
    pub fn input_ids(&self, rows: &[Vec<i64>], device: &B::Device) -> Result<Tensor<B, 2, Int>> {
        input_ids(rows, self.config.vocab_size, device)
    }

    /// The forward pass.
    ///
    /// # Shapes
    /// - ids: `[B, S]` -> logits `[B, S, V]`
    pub fn forward(&self, ids: Tensor<B, 2, Int>) -> CausalLmOutput<B> {
        let [_, s] = ids.dims();
        let device = ids.device();
        // 1. Embed.
        let mut x = self.embed_tokens.forward(ids); // [B, S, M]
        let (cos, sin) = self.rope.tables::<B>(s, &device); // [1, 1, S, Dr]
                                                            // 2. (attention block, expert block) pairs.
        let mut router_stats = Vec::new();
        for layer in &self.layers {
            x = layer.attention_block(x, cos.clone(), sin.clone());
            let (y, stats) = layer.expert_block(x);
            x = y;
            router_stats.extend(stats);
        }
        // 3. Final norm and head.
        let x = self.norm.forward(x); // [B, S, M]
        let logits = lm_logits(x, self.lm_head.as_ref(), &self.embed_tokens); // [B, S, V]
        CausalLmOutput { logits, router_stats }
    }

    /// The training loss of a forward pass over `ids`: next-token cross-entropy (labels = inputs
    /// shifted by one). transformers' deepseek_v3 adds no auxiliary loss, so `aux_loss` is `None`
    /// whatever `with_aux` says; balancing is aux-loss-free ([`Self::update_router_biases`]).
    pub fn loss(&self, out: &CausalLmOutput<B>, ids: Tensor<B, 2, Int>, with_aux: bool) -> LossParts<B> {
        let _ = with_aux;
        let lm_loss = next_token_cross_entropy(out.logits.clone(), ids);
        LossParts { lm_loss: lm_loss.clone(), aux_loss: None, total: lm_loss }
    }

    /// The router of each MoE layer, in layer order.
    pub fn routers(&self) -> impl Iterator<Item = &DeepseekRouter<B>> {
        self.layers.iter().filter_map(|l| l.mlp.moe.as_ref().map(|m| &m.gate))
    }

    /// Aux-loss-free balancing: updates each MoE layer's correction bias from its expert load,
    /// `counts[l]` being the routed copies per expert of the `l`-th MoE layer (the order of
    /// [`CausalLmOutput::router_stats`]), with `b += rate * sign(mean_load - load)`.
    pub fn update_router_biases(&mut self, counts: &[Vec<usize>], rate: f64) -> Result<()> {
        let moe_layers = self.routers().count();
        if counts.len() != moe_layers {
            return Err(ModelError::InvalidInput(format!(
                "update_router_biases: {} count vectors for {moe_layers} MoE layers",
                counts.len()
            )));
        }
        let routers = self.layers.iter_mut().filter_map(|l| l.mlp.moe.as_mut().map(|m| &mut m.gate));
        for (router, c) in routers.zip(counts) {
            router.update_bias(c, rate)?;
        }
        Ok(())
    }
}

/// Whether `name` belongs to a multi-token-prediction layer (`model.layers.{l}.` with `l >= layers`).
fn is_mtp_tensor(name: &str, layers: usize) -> bool {
    name.strip_prefix("model.layers.")
        .and_then(|rest| rest.split('.').next())
        .and_then(|l| l.parse::<usize>().ok())
        .is_some_and(|l| l >= layers)
}
