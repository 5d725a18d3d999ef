//! Step 1 of the layer: the [`Router`] trait, the softmax top-k router, and where the chosen
//! expert ids live ([`ExpertIds`]: on the host, or on the device of a CubeCL backend).

use burn::module::{Module, Param};
use burn::tensor::activation::softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

use crate::error::Result;
use crate::init::Init;
use crate::weights::{CheckpointReader, TensorSink};

/// Chooses `k` experts per token and their gate weights.
///
/// Implement this to add a routing rule; [`SparseMoeBlock`] is generic over it. Routers load and save
/// themselves relative to the MoE block's prefix (e.g. `model.layers.3.mlp`), since families name
/// them differently (`gate`, `router`).
pub trait Router<B: Backend> {
    /// Step 1 of the layer: scores, selection, gate weights.
    ///
    /// # Shapes
    /// - x: `[T, M]`
    fn route(&self, x: Tensor<B, 2>) -> RouterOutput<B>;
    /// Experts per token `k`.
    fn top_k(&self) -> usize;
    /// Loads the router's weights under the MoE block's prefix.
    fn load(&mut self, ckpt: &mut CheckpointReader, block_prefix: &str, device: &B::Device) -> Result<()>;
    /// Saves them under the names [`Router::load`] reads.
    fn save(&self, sink: &mut TensorSink, block_prefix: &str);
    /// Aux-loss-free balancing from a step's routed copies per expert; routers without a
    /// correction bias return `Ok(false)`.
    fn update_balance_bias(&mut self, _counts: &[usize], _rate: f64) -> Result<bool> {
        Ok(false)
    }
}

/// Linear router with softmax-then-top-k selection (Qwen3-MoE, Mixtral).
#[derive(Module, Debug)]
pub struct TopKRouter<B: Backend> {
    /// `[E, M]`, the checkpoint's `mlp.gate.weight`.
    pub weight: Param<Tensor<B, 2>>,
    /// Experts per token.
    pub top_k: usize,
    /// Renormalise the chosen probabilities to sum to one.
    pub norm_topk_prob: bool,
}

/// Times [`ExpertIds::to_host`] read ids from the device (all threads): a test of the claim
/// that routing on CubeCL backends brings back counts, never token ids.
static DEVICE_ID_READS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How many times routed expert ids have been read back from the device so far.
pub fn device_id_reads() -> usize {
    DEVICE_ID_READS.load(std::sync::atomic::Ordering::Relaxed)
}

/// MoE layer forwards whose sort, permute and combine ran on the device (all threads).
pub(super) static DEVICE_ROUTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How many MoE layer forwards have routed on the device so far.
pub fn device_routed_layers() -> usize {
    DEVICE_ROUTED.load(std::sync::atomic::Ordering::Relaxed)
}

/// The expert of each routed copy, token-major (`T k`, best first): on the host, or on the
/// device where the router chose there (CubeCL backends: `disagmoe_kernels::fused::top_k`), so
/// that the layer sorts, permutes and combines on the device and only counts come back.
#[derive(Debug, Clone)]
pub enum ExpertIds<B: Backend> {
    /// On the host.
    Host(Vec<usize>),
    /// `[T k]` on the device (`u32` elements).
    Device(Tensor<B, 1, Int>),
}

impl<B: Backend> ExpertIds<B> {
    /// Routed copies `T k`.
    pub fn len(&self) -> usize {
        match self {
            Self::Host(ids) => ids.len(),
            Self::Device(ids) => ids.dims()[0],
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The ids on the host: borrowed when they are there, else read from the device (counted by
    /// [`device_id_reads`]: for the paths that need them, such as the runtime's host messages).
    pub fn to_host(&self) -> std::borrow::Cow<'_, [usize]> {
        match self {
            Self::Host(ids) => std::borrow::Cow::Borrowed(ids),
            Self::Device(ids) => {
                DEVICE_ID_READS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                std::borrow::Cow::Owned(
                    ids.to_data()
                        .convert::<i64>()
                        .to_vec::<i64>()
                        .expect("int ids")
                        .into_iter()
                        .map(|e| e as usize)
                        .collect(),
                )
            }
        }
    }

    /// The chosen scores, differentiable: `scores[t, ids[t k + j]]` (a gather on the device
    /// when the ids are there).
    ///
    /// # Shapes
    /// - scores: `[T, E]` -> `[T, k]`
    pub fn gather(&self, scores: Tensor<B, 2>, k: usize) -> Tensor<B, 2> {
        match self {
            Self::Host(ids) => gather_chosen(scores, ids, k),
            Self::Device(ids) => {
                let t = scores.dims()[0];
                scores.gather(1, ids.clone().reshape([t, k]))
            }
        }
    }
}

impl<B: Backend> From<Vec<usize>> for ExpertIds<B> {
    fn from(ids: Vec<usize>) -> Self {
        Self::Host(ids)
    }
}

/// The `k` highest scores of each row of `scores` (`[T, E]`), token-major, best first, ties to
/// the lower index: chosen on the device on CubeCL backends, else on the host ([`top_k_ids`]).
pub fn choose_top_k<B: Backend>(scores: &Tensor<B, 2>, k: usize) -> ExpertIds<B> {
    match disagmoe_kernels::fused::top_k(scores.clone(), k) {
        Some(ids) => ExpertIds::Device(ids),
        None => ExpertIds::Host(top_k_ids(scores, k)),
    }
}

/// What the router decided for a micro-batch.
#[derive(Debug, Clone)]
pub struct RouterOutput<B: Backend> {
    /// `[T, E]` full router probabilities (softmax over all experts), what the load-balancing loss
    /// averages.
    pub probs: Tensor<B, 2>,
    /// `[T, k]` gate weights of the chosen experts (renormalised when configured).
    pub weights: Tensor<B, 2>,
    /// `T * k` chosen expert ids, token-major (`ids[t * k + j]`), best first: on the device
    /// where the router chose there.
    pub ids: ExpertIds<B>,
    /// `[T, E]` the router's logits (before softmax or sigmoid), what the router z-loss reads.
    pub logits: Tensor<B, 2>,
}

impl<B: Backend> TopKRouter<B> {
    /// A router over `experts` experts for width `hidden`, its weight `{block}.gate.weight` (`init`
    /// is scoped to the MoE block).
    pub fn new(hidden: usize, experts: usize, top_k: usize, norm_topk_prob: bool, init: &Init<B>) -> Self {
        Self {
            weight: Param::from_tensor(init.child("gate").normal("weight", [experts, hidden])),
            top_k,
            norm_topk_prob,
        }
    }
}

impl<B: Backend> Router<B> for TopKRouter<B> {
    fn route(&self, x: Tensor<B, 2>) -> RouterOutput<B> {
        let logits = x.matmul(self.weight.val().transpose()); // [T, E]
        let probs = softmax(logits.clone(), 1); // [T, E]
        let ids = choose_top_k(&probs, self.top_k);
        let mut weights = ids.gather(probs.clone(), self.top_k); // [T, k]
        if self.norm_topk_prob {
            weights = weights.clone() / weights.sum_dim(1);
        }
        RouterOutput { probs, weights, ids, logits }
    }

    fn top_k(&self) -> usize {
        self.top_k
    }

    fn load(&mut self, ckpt: &mut CheckpointReader, block_prefix: &str, device: &B::Device) -> Result<()> {
        let [e, m] = self.weight.dims();
        self.weight =
            Param::from_tensor(ckpt.tensor::<B, 2>(&format!("{block_prefix}.gate.weight"), [e, m], device)?);
        Ok(())
    }

    fn save(&self, sink: &mut TensorSink, block_prefix: &str) {
        sink.put_param(format!("{block_prefix}.gate.weight"), &self.weight);
    }
}

/// Ids of the `k` highest scores of each row of `scores` (`[T, E]`), token-major, best first;
/// read on the host (the per-expert group sizes decide the shapes of the expert matmuls).
pub fn top_k_ids<B: Backend>(scores: &Tensor<B, 2>, k: usize) -> Vec<usize> {
    let [t, e] = scores.dims();
    let host = scores.to_data().convert::<f32>().to_vec::<f32>().expect("f32 router scores");
    top_k_rows(&host, t, e, k)
}

/// The scores of the chosen experts, differentiable: `scores[t, ids[t * k + j]]`.
///
/// # Shapes
/// - scores: `[T, E]`; ids: `T * k` -> `[T, k]`
pub fn gather_chosen<B: Backend>(scores: Tensor<B, 2>, ids: &[usize], k: usize) -> Tensor<B, 2> {
    let [t, _] = scores.dims();
    let idx = Tensor::<B, 2, Int>::from_data(
        TensorData::new(ids.iter().map(|&i| i as i64).collect::<Vec<_>>(), [t, k]),
        &scores.device(),
    );
    scores.gather(1, idx)
}

/// Indices of the `k` largest values of each row of a row-major `[rows, cols]` matrix, largest
/// first; ties go to the lower index.
pub fn top_k_rows(values: &[f32], rows: usize, cols: usize, k: usize) -> Vec<usize> {
    let mut out = Vec::with_capacity(rows * k);
    let mut order: Vec<usize> = Vec::with_capacity(cols);
    for r in 0..rows {
        let row = &values[r * cols..(r + 1) * cols];
        order.clear();
        order.extend(0..cols);
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        out.extend_from_slice(&order[..k]);
    }
    out
}
