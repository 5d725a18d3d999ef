//! Multi-token prediction (DeepSeek-V3 technical report, section 2.2): `D` modules after the main
//! model, module `k` predicting the token `k + 1` places ahead from the previous depth's
//! representation and the embedding of the token `k` places ahead.
//!
//! ```text
//! h^0_i = norm(h_L)_i                                      // the main model's final (normed) hidden state
//! h^k_i = block_k(eh_proj_k([enorm_k(embed(t_{i+k})); hnorm_k(h^{k-1}_i)]))   for i in 0..S-k
//! p^k_i = head(shared_head.norm_k(h^k_i))                  // predicts t_{i+k+1}
//! L_MTP = coef / D * sum_k CE(p^k, t_{k+1..})
//! ```
//!
//! The embedding and the output head are the main model's (shared, as in the report); `block_k`
//! is a whole decoder layer of the family (DeepSeek-V3: MLA and a routed MoE layer with shared
//! experts). The concatenation puts the embedding first, as the Hub checkpoints' `eh_proj` expects
//! (and vLLM's `deepseek_mtp.py` and Megatron-Core's `MultiTokenPredictionLayer` compute); the
//! report writes the hidden state first. Module `k > 1` takes the previous module's block output
//! before its `shared_head.norm`, as vLLM does.
//!
//! Checkpoint names (the Hub's layout, module `k` at layer `L + k - 1`): `model.layers.{l}.enorm`,
//! `.hnorm`, `.eh_proj`, the decoder layer's own names (`.input_layernorm`, `.self_attn.*`,
//! `.post_attention_layernorm`, `.mlp.*`), `.shared_head.norm`, and the copies of the shared
//! tensors `.embed_tokens.weight` and `.shared_head.head.weight`, written from the main model's
//! embedding and head and checked against them when read.

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};
use disagmoe_kernels::documents::Documents;

use crate::causal_lm::{lm_logits, next_token_cross_entropy};
use crate::decoder::{init_layer, AttentionLayer, DecoderLayer};
use crate::error::{ModelError, Result};
use crate::families::FamilyConfig;
use crate::init::Init;
use crate::moe::{Experts, Router, RouterStats};
use crate::nn::{Embedding, Linear, RmsNorm};
use crate::weights::{CheckpointReader, TensorSink};

/// The multi-token prediction of a run: how many modules, and the weight of their loss.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct MtpSettings {
    /// Modules `D` (0: none).
    pub depth: usize,
    /// `coef` of `L_MTP = coef / D * sum_k L_k`, added to the loss.
    pub loss_coef: f64,
}

impl MtpSettings {
    /// Megatron-Core's default weight of the MTP loss (`--mtp-loss-scaling-factor`).
    pub const DEFAULT_LOSS_COEF: f64 = 0.1;
}

/// One multi-token prediction module.
#[derive(Module, Debug)]
pub struct MtpLayer<B: Backend, A: Module<B>, R: Module<B>, X: Module<B>> {
    /// Norm of the next token's embedding (`enorm`).
    pub enorm: RmsNorm<B>,
    /// Norm of the previous depth's hidden state (`hnorm`).
    pub hnorm: RmsNorm<B>,
    /// `[M, 2M]` projection of the concatenation (`eh_proj`).
    pub eh_proj: Linear<B>,
    /// The module's decoder layer.
    pub block: DecoderLayer<B, A, R, X>,
    /// Norm before the shared head (`shared_head.norm`).
    pub head_norm: RmsNorm<B>,
    /// Its checkpoint layer index (`L + k - 1`).
    #[module(skip)]
    pub layer: usize,
}

/// What the modules of one micro-batch give.
#[derive(Debug, Clone)]
pub struct MtpOutput<B: Backend> {
    /// `(1 / D) sum_k L_k`, `[1]` (before `coef`).
    pub loss: Tensor<B, 1>,
    /// Each module's router statistics (routed blocks), in depth order.
    pub router_stats: Vec<RouterStats<B>>,
}

impl<B, A, R, X> MtpLayer<B, A, R, X>
where
    B: Backend,
    A: Module<B> + AttentionLayer<B>,
    R: Module<B> + Router<B>,
    X: Module<B> + Experts<B>,
{
    /// Module `k` (1-based) of a family's model, from `init` (rooted at the model).
    pub fn init<C>(config: &C, k: usize, init: &Init<B>) -> Self
    where
        C: FamilyConfig<Attention<B> = A, Router<B> = R, Experts<B> = X>,
    {
        let d = config.dims();
        let layer = d.num_hidden_layers + k - 1;
        let at = init.child(format!("model.layers.{layer}"));
        let norm = |name: &str| RmsNorm::new(d.hidden_size, d.rms_norm_eps, &at.child(name));
        Self {
            enorm: norm("enorm"),
            hnorm: norm("hnorm"),
            eh_proj: Linear::new(2 * d.hidden_size, d.hidden_size, false, &at.child("eh_proj")),
            block: init_layer(config, layer, init),
            head_norm: norm("shared_head.norm"),
            layer,
        }
    }

    /// The module's hidden states at positions `0..n` from the previous depth's and the embedding
    /// of the tokens `k` places ahead, with its router statistics.
    ///
    /// Attention stays within each document of `docs` when given.
    ///
    /// # Shapes
    /// - prev, next_embed: `[B, n, M]`; cos, sin: `[1, 1, n, rotary dim]`; docs over `[B, n]`
    /// - output: `[B, n, M]`
    pub fn forward(
        &self,
        prev: Tensor<B, 3>,
        next_embed: Tensor<B, 3>,
        cos: Tensor<B, 4>,
        sin: Tensor<B, 4>,
        docs: Option<&Documents>,
    ) -> (Tensor<B, 3>, Option<RouterStats<B>>) {
        let x = Tensor::cat(vec![self.enorm.forward(next_embed), self.hnorm.forward(prev)], 2); // [B, n, 2M]
        let x = self.eh_proj.forward(x); // [B, n, M]
        let x = self.block.attention_block(x, cos, sin, docs);
        self.block.expert_block(x)
    }

    /// The routed block's router, mutably (aux-loss-free bias updates).
    pub fn router_mut(&mut self) -> Option<&mut R> {
        self.block.mlp.moe_mut().map(|m| &mut m.gate)
    }

    /// The routed block's router options.
    pub fn set_routing(&mut self, routing: crate::moe::RoutingOptions) {
        if let Some(moe) = self.block.mlp.moe_mut() {
            moe.routing = routing;
        }
    }

    fn load(&mut self, ckpt: &mut CheckpointReader, device: &B::Device) -> Result<()> {
        let prefix = format!("model.layers.{}", self.layer);
        self.enorm.load(ckpt, &format!("{prefix}.enorm"), device)?;
        self.hnorm.load(ckpt, &format!("{prefix}.hnorm"), device)?;
        self.eh_proj.load(ckpt, &format!("{prefix}.eh_proj"), device)?;
        self.block.load(ckpt, &prefix, device)?;
        self.head_norm.load(ckpt, &format!("{prefix}.shared_head.norm"), device)
    }

    fn save(&self, sink: &mut TensorSink) {
        let prefix = format!("model.layers.{}", self.layer);
        self.enorm.save(sink, &format!("{prefix}.enorm"));
        self.hnorm.save(sink, &format!("{prefix}.hnorm"));
        self.eh_proj.save(sink, &format!("{prefix}.eh_proj"));
        self.block.save(sink, &prefix);
        self.head_norm.save(sink, &format!("{prefix}.shared_head.norm"));
    }
}

/// The modules `1..=depth` of a family's model, freshly initialised from `init`.
pub fn init_mtp<B: Backend, C: FamilyConfig>(
    config: &C,
    init: &Init<B>,
) -> Vec<MtpLayer<B, C::Attention<B>, C::Router<B>, C::Experts<B>>> {
    (1..=config.mtp().depth).map(|k| MtpLayer::init(config, k, init)).collect()
}

/// The checkpoint name of the main tensor each shared copy repeats: the embedding and the head
/// (the embedding when tied).
fn shared_copies(layer: usize, tied: bool) -> [(String, &'static str); 2] {
    [
        (format!("model.layers.{layer}.embed_tokens.weight"), "model.embed_tokens.weight"),
        (
            format!("model.layers.{layer}.shared_head.head.weight"),
            if tied { "model.embed_tokens.weight" } else { "lm_head.weight" },
        ),
    ]
}

/// Loads the modules' own tensors. Where the checkpoint also holds the copies of the shared
/// embedding and head, they are read and compared with the main model's (already loaded into
/// `embed` / `head`): the modules use the main model's, and a copy that differs is reported.
pub fn load_mtp<B, A, R, X>(
    mtp: &mut [MtpLayer<B, A, R, X>],
    ckpt: &mut CheckpointReader,
    embed: &Embedding<B>,
    head: Option<&Linear<B>>,
    device: &B::Device,
) -> Result<()>
where
    B: Backend,
    A: Module<B> + AttentionLayer<B>,
    R: Module<B> + Router<B>,
    X: Module<B> + Experts<B>,
{
    for (held, m) in mtp.iter_mut().enumerate() {
        let name = format!("model.layers.{}.eh_proj.weight", m.layer);
        if !ckpt.contains(&name) {
            return Err(ModelError::InvalidInput(format!(
                "the checkpoint has no multi-token prediction module at layer {} (no `{name}`): it holds {held}; \
                 train with --mtp-depth {held} or less",
                m.layer
            )));
        }
        m.load(ckpt, device)?;
        for (copy, main) in shared_copies(m.layer, head.is_none()) {
            if !ckpt.contains(&copy) {
                continue;
            }
            let (_, values) = ckpt.read_f32(&copy)?;
            let ours: Vec<f32> = match (main, head) {
                ("lm_head.weight", Some(h)) => h.weight.val(),
                _ => embed.weight.val(),
            }
            .into_data()
            .convert::<f32>()
            .to_vec()
            .expect("f32");
            let worst = values.iter().zip(&ours).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            if values.len() != ours.len() || worst > 0.0 {
                tracing::warn!(
                    tensor = %copy, shared_with = main, max_difference = worst,
                    "the multi-token prediction module shares the main model's tensor; this copy differs and is replaced by it"
                );
            }
        }
    }
    Ok(())
}

/// Saves the modules' tensors, and the copies of the shared embedding and head under the Hub's
/// names (plain tensors, not parameters: they are the main model's). Call after the main model's
/// embedding and head are in `sink`.
pub fn save_mtp<B, A, R, X>(mtp: &[MtpLayer<B, A, R, X>], sink: &mut TensorSink, tied: bool)
where
    B: Backend,
    A: Module<B> + AttentionLayer<B>,
    R: Module<B> + Router<B>,
    X: Module<B> + Experts<B>,
{
    for m in mtp {
        m.save(sink);
        for (copy, main) in shared_copies(m.layer, tied) {
            sink.put_copy(copy, main);
        }
    }
}

/// The multi-token prediction loss of a micro-batch: each module on the positions whose target
/// exists, through the shared embedding and head. `None` without modules, and for sequences too
/// short for the last module to have a target (fewer than `D + 2` tokens; a run refuses such a
/// `--seq`).
///
/// With `docs`, each module attends within the documents of the positions it covers, and its
/// loss ignores the targets in another document than their position ([`Documents::crosses_ahead`]).
///
/// # Shapes
/// - normed: `[B, S, M]` the main model's final normed hidden states; ids: `[B, S]`;
///   cos, sin: `[1, 1, S, rotary dim]`; docs over `[B, S]`
pub fn mtp_loss<B, A, R, X>(
    mtp: &[MtpLayer<B, A, R, X>],
    normed: Tensor<B, 3>,
    ids: Tensor<B, 2, Int>,
    embed: &Embedding<B>,
    head: Option<&Linear<B>>,
    cos: Tensor<B, 4>,
    sin: Tensor<B, 4>,
    docs: Option<&Documents>,
) -> Option<MtpOutput<B>>
where
    B: Backend,
    A: Module<B> + AttentionLayer<B>,
    R: Module<B> + Router<B>,
    X: Module<B> + Experts<B>,
{
    let [_, s] = ids.dims();
    if mtp.is_empty() || s < mtp.len() + 2 {
        return None;
    }
    let embedded = embed.forward(ids.clone()); // [B, S, M]
    let (mut prev, mut losses, mut router_stats) = (normed, Vec::new(), Vec::new());
    for (i, m) in mtp.iter().enumerate() {
        let (k, n) = (i + 1, s - i - 1); // module k covers positions 0..S-k
        let covered = docs.map(|d| d.prefix(n));
        let (out, stats) = m.forward(
            prev.narrow(1, 0, n),
            embedded.clone().narrow(1, k, n), // embed(t_{i+k})
            cos.clone().narrow(2, 0, n),
            sin.clone().narrow(2, 0, n),
            covered.as_ref(),
        );
        // [B, n, V]; position i predicts t_{i+k+1}: the next-token loss against the ids shifted by k.
        let logits = lm_logits(m.head_norm.forward(out.clone()), head, embed);
        let ignore = docs.map(|d| d.crosses_ahead(k));
        losses.push(next_token_cross_entropy(logits, ids.clone().narrow(1, k, n), ignore.as_deref()));
        router_stats.extend(stats);
        prev = out;
    }
    let depth = losses.len() as f64;
    let loss = losses.into_iter().reduce(|a, b| a + b).expect("a module").div_scalar(depth);
    Some(MtpOutput { loss, router_stats })
}
