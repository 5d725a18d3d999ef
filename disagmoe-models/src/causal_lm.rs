//! What every causal LM family shares: input checking, the tied or untied head, the loss with its
//! load-balancing term, and writing a Hugging Face checkpoint directory.

use std::collections::HashMap;
use std::path::Path;

use burn::module::ParamId;
use burn::tensor::activation::log_softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

use disagmoe_kernels::documents::Documents;

use crate::balance::AuxLoss;
use crate::error::{ModelError, Result};
use crate::moe::{check_token_ids, RouterStats};
use crate::mtp::MtpOutput;
use crate::nn::{Embedding, Linear};
use crate::weights::{write_atomically, CheckpointReader, SaveDtype, TensorSink};

/// What a forward pass returns.
#[derive(Debug, Clone)]
pub struct CausalLmOutput<B: Backend> {
    /// `[B, S, V]` next-token logits.
    pub logits: Tensor<B, 3>,
    /// One entry per sparse layer, in layer order.
    pub router_stats: Vec<RouterStats<B>>,
    /// The multi-token prediction modules' loss and router statistics, when the model has them.
    pub mtp: Option<MtpOutput<B>>,
    /// The documents attention stayed within (`None`: each row is one sequence); the loss
    /// ignores the targets that begin another document.
    pub documents: Option<Documents>,
}

/// The parts of the training loss.
#[derive(Debug, Clone)]
pub struct LossParts<B: Backend> {
    /// Mean next-token cross-entropy, `[1]`.
    pub lm_loss: Tensor<B, 1>,
    /// Balance loss (before its coefficient), when the model has MoE layers and it is on.
    pub aux_loss: Option<Tensor<B, 1>>,
    /// Router z-loss summed over the MoE layers (before its coefficient), when on.
    pub z_loss: Option<Tensor<B, 1>>,
    /// The multi-token prediction loss `(1 / D) sum_k L_k` (before its coefficient), when trained.
    pub mtp_loss: Option<Tensor<B, 1>>,
    /// `lm_loss + coefficient * aux_loss (+ the z-loss and MTP terms)`, `[1]`.
    pub total: Tensor<B, 1>,
}

/// Token ids as a `[batch, seq]` tensor, checked: non-empty, rectangular, inside `0..vocab`.
pub fn input_ids<B: Backend>(rows: &[Vec<i64>], vocab: usize, device: &B::Device) -> Result<Tensor<B, 2, Int>> {
    let b = rows.len();
    let s = rows.first().map(Vec::len).unwrap_or(0);
    if b == 0 || s == 0 {
        return Err(ModelError::InvalidInput("input ids must be a non-empty list of non-empty lists".into()));
    }
    if let Some((i, r)) = rows.iter().enumerate().find(|(_, r)| r.len() != s) {
        return Err(ModelError::InvalidInput(format!(
            "row {i} has {} ids, row 0 has {s}: rows must have equal length",
            r.len()
        )));
    }
    let flat: Vec<i64> = rows.iter().flatten().copied().collect();
    check_token_ids(&flat, vocab)?;
    Ok(Tensor::from_data(TensorData::new(flat, [b, s]), device))
}

/// Logits from final hidden states: the LM head, or the embedding matrix when tied.
///
/// # Shapes
/// - x: `[B, S, M]` -> `[B, S, V]`
pub fn lm_logits<B: Backend>(x: Tensor<B, 3>, head: Option<&Linear<B>>, embed: &Embedding<B>) -> Tensor<B, 3> {
    match head {
        Some(head) => head.forward(x),
        None => disagmoe_kernels::precision::matmul(x, embed.weight.val().transpose().unsqueeze::<3>()),
    }
}

/// Mean cross-entropy of `logits[:, :-1]` against `ids[:, 1:]`, over the targets `ignore` does
/// not mark (a document mask's [`Documents::crosses`]; with every target ignored, zero).
///
/// # Shapes
/// - logits: `[B, S, V]`; ids: `[B, S]`; ignore: `B * (S - 1)` marks, row-major -> `[1]`
pub fn next_token_cross_entropy<B: Backend>(
    logits: Tensor<B, 3>,
    ids: Tensor<B, 2, Int>,
    ignore: Option<&[bool]>,
) -> Tensor<B, 1> {
    let [b, s, v] = logits.dims();
    if disagmoe_kernels::fused::cpu_available::<B>() && s >= 2 {
        let labels: Option<Vec<usize>> = ids
            .clone()
            .narrow(1, 1, s - 1)
            .into_data()
            .convert::<i64>()
            .to_vec::<i64>()
            .ok()
            .map(|l| l.into_iter().map(|t| t as usize).collect());
        if let Some(loss) =
            labels.and_then(|l| disagmoe_kernels::fused::next_token_cross_entropy(logits.clone(), &l, ignore))
        {
            return loss;
        }
    }
    let n = b * (s - 1);
    let logp = log_softmax(logits.narrow(1, 0, s - 1).reshape([n, v]), 1); // [N, V]
    let labels = ids.narrow(1, 1, s - 1).reshape([n, 1]);
    let picked = logp.gather(1, labels); // [N, 1]
    match ignore {
        None => picked.mean().neg(),
        Some(ignore) => {
            assert_eq!(ignore.len(), n, "one ignore mark per target");
            let keep: Vec<f32> = ignore.iter().map(|&i| if i { 0.0 } else { 1.0 }).collect();
            let counted = keep.iter().filter(|&&k| k > 0.0).count().max(1);
            let keep = Tensor::<B, 2>::from_data(TensorData::new(keep, [n, 1]), &picked.device());
            (picked * keep).sum().div_scalar(counted as f64).neg()
        }
    }
}

/// Cross-entropy plus the coefficient times the balance loss (when `aux` is given and there are
/// MoE layers), as transformers' `*ForCausalLM.forward` adds them, plus `z_loss_coef` times the
/// layers' router z-losses when the layers computed them.
pub fn causal_lm_loss<B: Backend>(
    out: &CausalLmOutput<B>,
    ids: Tensor<B, 2, Int>,
    aux: Option<AuxLoss>,
    z_loss_coef: f64,
) -> LossParts<B> {
    let ignore = out.documents.as_ref().map(Documents::crosses);
    let lm_loss = next_token_cross_entropy(out.logits.clone(), ids, ignore.as_deref());
    let aux_loss = aux.and_then(|a| a.kind.loss(&out.router_stats));
    let mut total = match (&aux_loss, aux) {
        (Some(loss), Some(a)) => lm_loss.clone() + loss.clone().mul_scalar(a.coef),
        _ => lm_loss.clone(),
    };
    let z_loss = out.router_stats.iter().filter_map(|s| s.z_loss.clone()).reduce(|a, b| a + b);
    if let Some(z) = &z_loss {
        total = total + z.clone().mul_scalar(z_loss_coef);
    }
    LossParts { lm_loss, aux_loss, z_loss, mtp_loss: None, total }
}

/// Writes a Hugging Face checkpoint directory: the weights in `dtype` (sharded past
/// `max_shard_bytes`) and `config.json` (its `torch_dtype` saying `dtype`), each file atomically.
pub fn write_pretrained(
    dir: &Path,
    weights: &TensorSink,
    config: &serde_json::Value,
    max_shard_bytes: usize,
    dtype: SaveDtype,
) -> Result<()> {
    weights.write_as(dir, max_shard_bytes, dtype)?;
    let mut config = config.clone();
    dtype.mark_config(&mut config);
    let text = serde_json::to_vec_pretty(&config).expect("config serialises");
    write_atomically(&dir.join("config.json"), |tmp| std::fs::write(tmp, &text))
}

/// Hugging Face checkpoint I/O that every family shares: a family says how to build itself from a
/// `config.json`, how to load its weights and under which names it saves them; loading a directory,
/// naming parameters and saving a directory follow.
pub trait HfCheckpoint<B: Backend>: Sized {
    /// Parses the `config.json` at `path` and builds a freshly initialised model of that shape.
    fn init_from_config(path: &Path, device: &B::Device) -> Result<Self>;

    /// The model's `config.json`, as transformers writes it.
    fn hf_config(&self) -> serde_json::Value;

    /// Replaces every parameter with the checkpoint's tensor of the same Hugging Face name.
    fn load_weights(&mut self, ckpt: &mut CheckpointReader, device: &B::Device) -> Result<()>;

    /// Puts every parameter into `sink` under its Hugging Face name.
    fn save_into(&self, sink: &mut TensorSink);

    /// Reports checkpoint tensors the model did not read (default: one warning).
    fn report_unused(&self, unused: Vec<String>) {
        if let Some(first) = unused.first() {
            tracing::warn!(count = unused.len(), first = %first, "checkpoint tensors not used by the model");
        }
    }

    /// Loads `config.json` and the safetensors weights of a checkpoint directory.
    fn from_pretrained(dir: impl AsRef<Path>, device: &B::Device) -> Result<Self> {
        let dir = dir.as_ref();
        let mut model = Self::init_from_config(&dir.join("config.json"), device)?;
        let mut ckpt = CheckpointReader::open(dir)?;
        model.load_weights(&mut ckpt, device)?;
        model.report_unused(ckpt.unused());
        Ok(model)
    }

    /// Every parameter under its Hugging Face name, with its values.
    fn state_dict(&self) -> TensorSink {
        let mut sink = TensorSink::new();
        self.save_into(&mut sink);
        sink
    }

    /// Hugging Face name of each parameter id (reads no values).
    fn state_dict_names(&self) -> HashMap<ParamId, String> {
        let mut sink = TensorSink::names_only();
        self.save_into(&mut sink);
        sink.names_by_id()
    }

    /// Writes `config.json` and f32 safetensors (sharded past `max_shard_bytes`) that
    /// transformers' `from_pretrained` loads.
    fn save_pretrained(&self, dir: impl AsRef<Path>, max_shard_bytes: usize) -> Result<()> {
        self.save_pretrained_as(dir, max_shard_bytes, SaveDtype::F32)
    }

    /// [`HfCheckpoint::save_pretrained`] with the weights in `dtype`.
    fn save_pretrained_as(&self, dir: impl AsRef<Path>, max_shard_bytes: usize, dtype: SaveDtype) -> Result<()> {
        write_pretrained(dir.as_ref(), &self.state_dict(), &self.hf_config(), max_shard_bytes, dtype)
    }
}
