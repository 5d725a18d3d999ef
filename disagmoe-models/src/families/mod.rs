//! The model families and their one registration point.
//!
//! A family is a folder here with the same layout: `mod.rs` (what the family is, its checkpoint
//! names, its embedded presets), `config.rs` (its `config.json`, both key spellings, validated) and
//! `model.rs` (its [`FamilyConfig`]: which attention, router and experts each layer gets). The
//! shared decoder ([`crate::decoder`]) does the rest: building, loading and saving by checkpoint
//! name, the forward pass, the loss, and taking the model apart for the runtime
//! ([`crate::stages`]).
//!
//! **Adding a family** is a new folder plus one line in the `families!` list at the bottom of
//! this file. From that list follow: [`ModelConfig`] (parsing any `config.json` by `model_type`),
//! [`MoeCausalLm`] (a model of any family, with its methods), [`SUPPORTED_MODEL_TYPES`],
//! [`model_presets`] (the embedded tiny configurations), [`ModelConfig::model_shape`] (what the
//! planner in `disagmoe-core` reads) and [`ModelConfig::visit`] (how code generic over the family,
//! such as the distributed runtime, is reached with the concrete types).

use std::ops::Range;
use std::path::Path;

use burn::module::{AutodiffModule, Module, ModuleDisplay};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor};
use disagmoe_core::model_shape::ModelShape;
use disagmoe_kernels::documents::Documents;

use crate::balance::AuxLoss;
use crate::causal_lm::{CausalLmOutput, HfCheckpoint, LossParts};
use crate::decoder::{AttentionLayer, FamilyModel};
use crate::error::{ModelError, Result};
use crate::init::Init;
use crate::kv_cache::KvCache;
use crate::moe::{Experts, Router};
use crate::mtp::MtpSettings;
use crate::recompute::{MicroBatchLoss, Recompute};
use crate::rope::Rope;
use crate::weights::{CheckpointReader, TensorSink};

/// The sizes every family has.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelDims {
    /// Vocabulary size (rows of `embed_tokens`, columns of `lm_head`).
    pub vocab_size: usize,
    /// Model width M.
    pub hidden_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Intermediate size of the dense SwiGLU MLP of dense layers (unused by families without any).
    pub dense_intermediate_size: usize,
    /// Epsilon of the layer norms.
    pub rms_norm_eps: f64,
    /// Standard deviation of the normal initialiser.
    pub initializer_range: f64,
    /// `lm_head` shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// The padding token, whose embedding row starts at zero and is not trained (PyTorch's
    /// `padding_idx`, which transformers sets to `pad_token_id`).
    pub pad_token_id: Option<usize>,
}

/// What a family provides. Everything else (building, loading, saving, the forward pass, the loss,
/// splitting for the runtime) is written once over it.
pub trait FamilyConfig: Clone + std::fmt::Debug + PartialEq + Send + Sync + 'static {
    /// `model_type` in `config.json`.
    const MODEL_TYPE: &'static str;
    /// Checkpoint name of a layer's feed-forward module (`mlp`; Mixtral: `block_sparse_moe`).
    const FFN_NAME: &'static str = "mlp";
    /// The attention layer.
    type Attention<B: Backend>: Module<B> + ModuleDisplay + AttentionLayer<B>;
    /// The router of the routed layers.
    type Router<B: Backend>: Module<B> + ModuleDisplay + Router<B>;
    /// The routed experts of a layer (or a contiguous range of them).
    type Experts<B: Backend>: Module<B> + ModuleDisplay + Experts<B>;

    /// Parses and validates a `config.json` text (every key spelling the family has in the wild).
    fn from_json_str(text: &str) -> Result<Self>;
    /// The configuration as transformers writes `config.json`.
    fn to_hf_json(&self) -> serde_json::Value;
    /// The sizes every family has.
    fn dims(&self) -> ModelDims;
    /// The longest sequence the model is configured for (`max_position_embeddings`), when it has
    /// one: generation refuses to go past it.
    fn max_positions(&self) -> Option<usize> {
        None
    }
    /// The rotary embedding of the attention layers.
    fn rope(&self) -> Rope;
    /// Whether layer `layer` routes tokens to experts (else it has the dense MLP).
    fn is_sparse_layer(&self, layer: usize) -> bool;
    /// Routed experts per routed layer `E`.
    fn routed_experts(&self) -> usize;
    /// Intermediate size of the shared experts' one SwiGLU MLP, when the family has shared experts.
    fn shared_expert_intermediate(&self) -> Option<usize> {
        None
    }
    /// The attention of `layer`, freshly initialised (`init` is scoped to `...self_attn`).
    fn attention<B: Backend>(&self, layer: usize, init: &Init<B>) -> Self::Attention<B>;
    /// The router of routed layer `layer` (`init` is scoped to the feed-forward module).
    fn router<B: Backend>(&self, layer: usize, init: &Init<B>) -> Self::Router<B>;
    /// Experts `range` (global ids) of routed layer `layer` (`init` is scoped to `...experts`).
    fn experts<B: Backend>(&self, layer: usize, range: Range<usize>, init: &Init<B>) -> Self::Experts<B>;
    /// The balance loss and its coefficient, or `None` when the family has none (DeepSeek-V3:
    /// aux-loss-free balancing only).
    fn aux_loss(&self) -> Option<AuxLoss>;
    /// Whether training adds the balance loss unless told otherwise (transformers adds the Switch
    /// loss only with `output_router_logits`; DeepSeekMoE whenever `aux_loss_alpha > 0`).
    fn aux_loss_by_default(&self) -> bool;
    /// The shape the planner in `disagmoe-core` works with.
    fn model_shape(&self, name: &str) -> ModelShape;
    /// The multi-token prediction the model trains (default: none).
    fn mtp(&self) -> MtpSettings {
        MtpSettings::default()
    }
    /// Sets the multi-token prediction to train; families without MTP modules refuse a depth
    /// above 0.
    fn set_mtp(&mut self, mtp: MtpSettings) -> Result<()> {
        if mtp.depth == 0 {
            return Ok(());
        }
        Err(ModelError::config(
            "mtp_depth",
            format!("{} has no multi-token prediction module; allowed: 0 (only deepseek_v3 has one)", Self::MODEL_TYPE),
        ))
    }
    /// Reports checkpoint tensors the model did not read (default: one warning).
    fn report_unused(&self, unused: Vec<String>) {
        if let Some(first) = unused.first() {
            tracing::warn!(count = unused.len(), first = %first, "checkpoint tensors not used by the model");
        }
    }
}

/// A module that trains: autodiff, printable, and movable to a worker thread.
pub trait TrainModule<B: AutodiffBackend>:
    AutodiffModule<B, InnerModule: ModuleDisplay> + ModuleDisplay + Send + 'static
{
}

impl<B: AutodiffBackend, M> TrainModule<B> for M
where
    M: AutodiffModule<B> + ModuleDisplay + Send + 'static,
    M::InnerModule: ModuleDisplay,
{
}

/// Code written once over the family (the distributed runtime) implements this; [`ModelConfig::visit`]
/// calls it with the concrete configuration type, on an autodiff backend.
pub trait FamilyVisitor<B: AutodiffBackend> {
    /// What the visit returns.
    type Output;
    /// Runs with the family `C`.
    fn visit<C: FamilyConfig>(self, config: &C) -> Self::Output
    where
        C::Attention<B>: TrainModule<B>,
        C::Router<B>: TrainModule<B>,
        C::Experts<B>: TrainModule<B>;
}

/// An embedded configuration: `(name, config.json text)`.
pub type Preset = (&'static str, &'static str);

fn parse_model_type(text: &str) -> Result<Option<String>> {
    let v: serde_json::Value = serde_json::from_str(text).map_err(|source| ModelError::ConfigParse {
        path: "config.json".into(),
        field: String::new(),
        source,
    })?;
    Ok(v.get("model_type").and_then(|t| t.as_str()).map(str::to_owned))
}

/// The list of families: one line each, `Variant => folder::ConfigType`. Everything that dispatches
/// on the family is generated from it.
macro_rules! families {
    ($($(#[$doc:meta])* $variant:ident => $module:ident :: $config:ident;)*) => {
        $(pub mod $module;)*

        /// `model_type` values this crate reads.
        pub const SUPPORTED_MODEL_TYPES: &[&str] = &[$(<$module::$config as FamilyConfig>::MODEL_TYPE),*];

        /// The embedded configurations of every family (`--model-preset`), in family order.
        pub fn model_presets() -> Vec<Preset> {
            let mut all = Vec::new();
            $(all.extend_from_slice($module::PRESETS);)*
            all
        }

        /// A validated configuration of any supported family.
        #[derive(Debug, Clone, PartialEq)]
        pub enum ModelConfig {
            $($(#[$doc])* $variant($module::$config),)*
        }

        impl ModelConfig {
            /// Parses a `config.json` text, dispatching on `model_type`.
            pub fn from_json_str(text: &str) -> Result<Self> {
                let Some(model_type) = parse_model_type(text)? else {
                    return Err(ModelError::config("model_type", format!("is required; allowed: {SUPPORTED_MODEL_TYPES:?}")));
                };
                $(if model_type == <$module::$config as FamilyConfig>::MODEL_TYPE {
                    return Ok(Self::$variant(<$module::$config as FamilyConfig>::from_json_str(text)?));
                })*
                Err(ModelError::config(
                    "model_type",
                    format!("`{model_type}` is not supported; allowed: {SUPPORTED_MODEL_TYPES:?}"),
                ))
            }

            /// `model_type`.
            pub fn model_type(&self) -> &'static str {
                match self { $(Self::$variant(_) => <$module::$config as FamilyConfig>::MODEL_TYPE,)* }
            }

            /// The sizes every family has.
            pub fn dims(&self) -> ModelDims {
                match self { $(Self::$variant(c) => c.dims(),)* }
            }

            /// The longest sequence the model is configured for (`max_position_embeddings`).
            pub fn max_positions(&self) -> Option<usize> {
                match self { $(Self::$variant(c) => c.max_positions(),)* }
            }

            /// Whether layer `layer` routes tokens to experts.
            pub fn is_sparse_layer(&self, layer: usize) -> bool {
                match self { $(Self::$variant(c) => c.is_sparse_layer(layer),)* }
            }

            /// The balance loss and its coefficient, when the family has one.
            pub fn aux_loss(&self) -> Option<AuxLoss> {
                match self { $(Self::$variant(c) => c.aux_loss(),)* }
            }

            /// Whether training adds the balance loss unless told otherwise.
            pub fn aux_loss_by_default(&self) -> bool {
                match self { $(Self::$variant(c) => c.aux_loss_by_default(),)* }
            }

            /// The configuration as a transformers `config.json`.
            pub fn to_hf_json(&self) -> serde_json::Value {
                match self { $(Self::$variant(c) => c.to_hf_json(),)* }
            }

            /// The shape the planner works with, named `name`.
            pub fn model_shape(&self, name: &str) -> ModelShape {
                match self { $(Self::$variant(c) => c.model_shape(name),)* }
            }

            /// A freshly initialised model, every tensor drawn from (`seed`, its checkpoint name).
            pub fn init<B: Backend>(&self, seed: u64, device: &B::Device) -> MoeCausalLm<B> {
                match self { $(Self::$variant(c) => MoeCausalLm::$variant(FamilyModel::init(c.clone(), seed, device)),)* }
            }

            /// A model of this shape with placeholder (zero) weights, for a checkpoint to fill.
            pub fn placeholders<B: Backend>(&self, device: &B::Device) -> MoeCausalLm<B> {
                match self {
                    $(Self::$variant(c) => MoeCausalLm::$variant(FamilyModel::new(c.clone(), &Init::placeholders(device))),)*
                }
            }

            /// The multi-token prediction the model trains.
            pub fn mtp(&self) -> MtpSettings {
                match self { $(Self::$variant(c) => c.mtp(),)* }
            }

            /// The same configuration training `mtp` (refused by families without MTP modules).
            pub fn with_mtp(mut self, mtp: MtpSettings) -> Result<Self> {
                match &mut self { $(Self::$variant(c) => c.set_mtp(mtp)?,)* }
                Ok(self)
            }

            /// Calls `visitor` with the family's concrete configuration type.
            pub fn visit<B: AutodiffBackend, V: FamilyVisitor<B>>(&self, visitor: V) -> V::Output {
                match self { $(Self::$variant(c) => visitor.visit(c),)* }
            }
        }

        /// A causal LM of any supported family.
        #[derive(Module, Debug)]
        pub enum MoeCausalLm<B: Backend> {
            $($(#[$doc])* $variant(FamilyModel<B, $module::$config>),)*
        }

        impl<B: Backend> MoeCausalLm<B> {
            /// The model's configuration.
            pub fn config(&self) -> ModelConfig {
                match self { $(Self::$variant(m) => ModelConfig::$variant(m.config().clone()),)* }
            }

            /// Aux-loss-free balancing: moves the routers' correction biases from the expert load of
            /// the last step (`counts[l]` per MoE layer, in `router_stats` order). Routers without a
            /// correction bias ignore it. Returns whether anything was updated.
            pub fn update_router_biases(&mut self, counts: &[Vec<usize>], rate: f64) -> Result<bool> {
                match self { $(Self::$variant(m) => m.update_router_biases(counts, rate),)* }
            }

            /// Token ids as a `[batch, seq]` tensor, checked against the vocabulary.
            pub fn input_ids(&self, rows: &[Vec<i64>], device: &B::Device) -> Result<Tensor<B, 2, Int>> {
                match self { $(Self::$variant(m) => m.input_ids(rows, device),)* }
            }

            /// The forward pass: `[B, S]` ids -> `[B, S, V]` logits and router statistics.
            pub fn forward(&self, ids: Tensor<B, 2, Int>) -> CausalLmOutput<B> {
                match self { $(Self::$variant(m) => m.forward(ids),)* }
            }

            /// The forward pass of packed rows, attention within each document of `docs`
            /// ([`FamilyModel::forward_documents`]).
            pub fn forward_documents(&self, ids: Tensor<B, 2, Int>, docs: Option<&Documents>) -> CausalLmOutput<B> {
                match self { $(Self::$variant(m) => m.forward_documents(ids, docs),)* }
            }

            /// Sets the router options (z-loss, capacity, forced balance) of every MoE layer.
            pub fn set_routing(&mut self, routing: crate::moe::RoutingOptions) {
                match self { $(Self::$variant(m) => m.set_routing(routing),)* }
            }

            /// An empty cache for [`MoeCausalLm::forward_cached`].
            pub fn new_cache(&self) -> KvCache<B> {
                match self { $(Self::$variant(m) => m.new_cache(),)* }
            }

            /// The forward pass of new tokens after the positions `cache` has seen (incremental
            /// decoding): `[B, S]` ids -> `[B, S, V]` logits, equal to the last `S` positions of
            /// [`MoeCausalLm::forward`] over the whole sequence.
            pub fn forward_cached(&self, ids: Tensor<B, 2, Int>, cache: &mut KvCache<B>) -> Tensor<B, 3> {
                match self { $(Self::$variant(m) => m.forward_cached(ids, cache),)* }
            }

            /// The training loss of a forward pass.
            pub fn loss(&self, out: &CausalLmOutput<B>, ids: Tensor<B, 2, Int>, with_aux: bool) -> LossParts<B> {
                match self { $(Self::$variant(m) => m.loss(out, ids, with_aux),)* }
            }
        }

        impl<B: Backend> MoeCausalLm<B> {
            /// Loads a checkpoint directory as [`HfCheckpoint::from_pretrained`] does, with the
            /// multi-token prediction modules `mtp` asks for read from it too.
            pub fn from_pretrained_with(dir: impl AsRef<Path>, mtp: MtpSettings, device: &B::Device) -> Result<Self> {
                let dir = dir.as_ref();
                let mut model = ModelConfig::from_file(dir.join("config.json"))?.with_mtp(mtp)?.placeholders(device);
                let mut ckpt = CheckpointReader::open(dir)?;
                model.load_weights(&mut ckpt, device)?;
                model.report_unused(ckpt.unused());
                Ok(model)
            }

            /// The multi-token prediction the model trains.
            pub fn mtp(&self) -> MtpSettings {
                self.config().mtp()
            }
        }

        impl<B: AutodiffBackend> MoeCausalLm<B> {
            /// One micro-batch's loss and gradients block by block, dropping and recomputing the
            /// activations `recompute` names ([`FamilyModel::backward_recomputed`]); `inner` is
            /// this model's `valid()`.
            pub fn backward_recomputed(
                &self,
                inner: &MoeCausalLm<B::InnerBackend>,
                ids: Tensor<B, 2, Int>,
                docs: Option<&Documents>,
                with_aux: bool,
                recompute: Recompute,
                scale: f64,
                on_grads: &mut dyn FnMut(B::Gradients),
            ) -> Result<MicroBatchLoss> {
                match (self, inner) {
                    $((Self::$variant(m), MoeCausalLm::$variant(i)) => {
                        Ok(m.backward_recomputed(i, ids, docs, with_aux, recompute, scale, on_grads))
                    })*
                    _ => Err(ModelError::InvalidInput(
                        "backward_recomputed: `inner` is a model of another family".into(),
                    )),
                }
            }
        }

        impl<B: Backend> HfCheckpoint<B> for MoeCausalLm<B> {
            /// Dispatches on `model_type`.
            fn init_from_config(path: &Path, device: &B::Device) -> Result<Self> {
                Ok(ModelConfig::from_file(path)?.placeholders(device))
            }

            fn hf_config(&self) -> serde_json::Value {
                match self { $(Self::$variant(m) => m.config().to_hf_json(),)* }
            }

            fn load_weights(&mut self, ckpt: &mut CheckpointReader, device: &B::Device) -> Result<()> {
                match self { $(Self::$variant(m) => m.load_weights(ckpt, device),)* }
            }

            fn save_into(&self, sink: &mut TensorSink) {
                match self { $(Self::$variant(m) => m.save_into(sink),)* }
            }

            fn report_unused(&self, unused: Vec<String>) {
                match self { $(Self::$variant(m) => m.config().report_unused(unused),)* }
            }
        }
    };
}

impl ModelConfig {
    /// Reads and validates a `config.json` file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        crate::hf_json::read_config(path.as_ref(), Self::from_json_str)
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.dims().vocab_size
    }

    /// Indices of the layers with routed experts, in order.
    pub fn sparse_layers(&self) -> Vec<usize> {
        (0..self.dims().num_hidden_layers).filter(|&l| self.is_sparse_layer(l)).collect()
    }

    /// The `config.json` text of an embedded preset, or an error listing the presets.
    pub fn preset(name: &str) -> Result<Self> {
        let presets = model_presets();
        let (_, text) = presets.iter().find(|(n, _)| *n == name).ok_or_else(|| {
            let names: Vec<&str> = presets.iter().map(|(n, _)| *n).collect();
            ModelError::config("model_preset", format!("`{name}` is not a preset; allowed: {names:?}"))
        })?;
        Self::from_json_str(text)
    }
}

/// A [`FamilyModel`] of a family as a Hugging Face checkpoint.
impl<B: Backend, C: FamilyConfig> HfCheckpoint<B> for FamilyModel<B, C> {
    fn init_from_config(path: &Path, device: &B::Device) -> Result<Self> {
        let config = crate::hf_json::read_config(path, C::from_json_str)?;
        Ok(FamilyModel::new(config, &Init::placeholders(device)))
    }

    fn hf_config(&self) -> serde_json::Value {
        self.config().to_hf_json()
    }

    fn load_weights(&mut self, ckpt: &mut CheckpointReader, device: &B::Device) -> Result<()> {
        FamilyModel::load_weights(self, ckpt, device)
    }

    fn save_into(&self, sink: &mut TensorSink) {
        FamilyModel::save_into(self, sink)
    }

    fn report_unused(&self, unused: Vec<String>) {
        self.config().report_unused(unused)
    }
}

families! {
    /// Qwen3-MoE (`qwen3_moe`).
    Qwen3Moe => qwen3_moe::Qwen3MoeConfig;
    /// GPT-OSS (`gpt_oss`).
    GptOss => gpt_oss::GptOssConfig;
    /// DeepSeek-V3 (`deepseek_v3`).
    DeepseekV3 => deepseek_v3::DeepseekV3Config;
    /// DeepSeekMoE (`deepseek`).
    Deepseek => deepseek::DeepseekConfig;
    /// Mixtral (`mixtral`).
    Mixtral => mixtral::MixtralConfig;
    /// OLMoE (`olmoe`).
    Olmoe => olmoe::OlmoeConfig;
}
