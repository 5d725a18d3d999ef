//! The cost model: FLOPs, memory traffic, communication volume and memory footprint of each
//! component (attention side, expert side) per micro-batch, and the time each takes on a GPU.
//!
//! # Notation
//! - `S` sequence length, `B` sequences per pipeline micro-batch, `T = B * S` tokens per micro-batch.
//! - `H` hidden size, `E` routed experts, `k` top-k, `I` expert intermediate size.
//! - `a` / `f`: GPUs of one attention / expert (FFN) group; `p`: number of group pairs; layer `l`
//!   lives on pair `l mod p`.
//!
//! Forward FLOPs of a linear layer are `2 * params * tokens`; backward costs twice the forward.
//! Attention scores add `2 * heads * (d_qk + d_v) * context` per token, with the causal (and,
//! for windowed layers, windowed) mean context of [`ModelShape::mean_context`].
//! A GPU's time for a piece of work is the roofline `max(flops / sustained FLOP/s,
//! bytes / sustained HBM bandwidth)`; weights are read once per visit, so small micro-batches are
//! memory-bound.
//!
//! The expert side is timed by its busiest GPU, whose share of a layer's routed copies comes from
//! the expert load and placement of [`CostModel::expert_balance`] (uniform and contiguous by
//! default: `ceil(E / f) / E`). Exchange volumes stay those of uniform routing.

use crate::error::{check_nonzero, invalid, Result};
use crate::exchange::ExchangePrecision;
use crate::experts::{Busiest, ExpertBalance};
use crate::hardware::Cluster;
use crate::model_shape::{AttentionShape, ModelShape};
use serde::{Deserialize, Serialize};

/// The shape of one training step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Workload {
    /// Sequence length `S` (tokens).
    pub seq: usize,
    /// Sequences per pipeline micro-batch `B` (split over the GPUs of an attention group).
    pub micro_batch: usize,
    /// Sequences per optimizer step (a multiple of `micro_batch`).
    pub global_batch: usize,
}

impl Workload {
    /// Checks the fields; `global_batch` must be a positive multiple of `micro_batch`.
    pub fn validate(&self) -> Result<()> {
        check_nonzero("workload.seq", self.seq)?;
        check_nonzero("workload.micro_batch", self.micro_batch)?;
        if self.global_batch == 0 || !self.global_batch.is_multiple_of(self.micro_batch) {
            return Err(invalid(
                "workload.global_batch",
                self.global_batch,
                &format!("a positive multiple of micro_batch = {}", self.micro_batch),
            ));
        }
        Ok(())
    }

    /// Micro-batches per step `M`.
    pub fn micro_batches(&self) -> usize {
        self.global_batch / self.micro_batch
    }

    /// Tokens per micro-batch `T`.
    pub fn tokens_per_micro_batch(&self) -> f64 {
        (self.seq * self.micro_batch) as f64
    }
}

/// How an attention group shares a micro-batch among its GPUs (`plan --context-parallel`).
///
/// Without context parallelism a GPU holds whole sequences: `a / C` data-parallel replicas of an
/// attention group take whole sequences of the micro-batch, and the `C` GPUs of a replica split
/// each of its sequences into load-balanced causal chunks (ring attention: K/V blocks pass around
/// the `C` GPUs, overlapped with each block's compute).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ContextParallel {
    /// Each attention group size gets the smallest context-parallel size `C` whose `a / C`
    /// replicas divide the micro-batch's sequences evenly (so every GPU computes `T / a` tokens):
    /// `C = 1` where the micro-batch has sequences enough, more at long sequences (the default).
    #[default]
    Auto,
    /// Every attention group splits each sequence over this many GPUs (`1`: none; group sizes
    /// must be multiples of it).
    Fixed(usize),
    /// Whole micro-batches dealt to an attention group's GPUs in turn, as `disagmoe train`'s
    /// runtime does without `--context-parallel` (what `--allocation auto` plans for then; with
    /// `--context-parallel C` it plans for [`ContextParallel::Fixed`]): a GPU computes `T / a` of
    /// the group's tokens on average and no sequence is split.
    Dealt,
}

impl ContextParallel {
    /// The context-parallel size of an attention group of `gpus` GPUs under `workload`, `None`
    /// when this choice has none for that size (a fixed `C` that does not divide it, or chunks
    /// shorter than a token: each GPU holds two chunks of a sequence).
    pub fn size_for(self, gpus: usize, workload: &Workload) -> Option<usize> {
        let fits = |c: usize| c >= 1 && gpus.is_multiple_of(c) && (c == 1 || c.saturating_mul(2) <= workload.seq);
        match self {
            Self::Dealt => Some(1),
            Self::Fixed(c) => fits(c).then_some(c),
            Self::Auto => (1..=gpus).filter(|&c| fits(c)).find(|&c| workload.micro_batch.is_multiple_of(gpus / c)),
        }
    }

    /// The command-line spelling: `auto`, a size, or `dealt`.
    pub fn name(self) -> String {
        match self {
            Self::Auto => "auto".into(),
            Self::Fixed(c) => c.to_string(),
            Self::Dealt => "dealt".into(),
        }
    }
}

impl std::str::FromStr for ContextParallel {
    type Err = crate::error::CoreError;

    /// `auto`, `dealt`, or a context-parallel size of at least 1.
    fn from_str(s: &str) -> Result<Self> {
        match s.trim() {
            "auto" => Ok(Self::Auto),
            "dealt" => Ok(Self::Dealt),
            v => match v.parse::<usize>() {
                Ok(c) if c >= 1 => Ok(Self::Fixed(c)),
                _ => Err(invalid(
                    "context_parallel",
                    s,
                    "auto, dealt (whole micro-batches per GPU, as `disagmoe train` runs), or a size of at least 1 (1: none)",
                )),
            },
        }
    }
}

/// Bytes per element of each kind of training state (mixed precision with Adam).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Precision {
    /// Parameters (bf16: 2).
    pub param_bytes: f64,
    /// Gradients (fp32 accumulation: 4).
    pub grad_bytes: f64,
    /// Optimizer state per parameter (fp32 master, Adam m and v: 12).
    pub optimizer_bytes: f64,
    /// Activations and transferred tokens (bf16: 2).
    pub activation_bytes: f64,
    /// Gradients as all-reduced (bf16: 2).
    pub grad_comm_bytes: f64,
    /// What the token exchange's messages travel in (dispatch, combine, gradients; bf16 by default,
    /// `plan --exchange-dtype`): the M2N/N2M transfers of AF-Pipe and the baselines' all-to-alls.
    #[serde(default = "bf16_exchange")]
    pub exchange: ExchangePrecision,
}

fn bf16_exchange() -> ExchangePrecision {
    ExchangePrecision::BF16
}

/// The runtime's (`disagmoe train`) under `--precision bf16`, see [`Precision::runtime_bf16`].
impl Default for Precision {
    fn default() -> Self {
        Self::runtime_bf16()
    }
}

impl Precision {
    /// What `disagmoe train` holds under `--precision f32` (`low_products: false`) or `f16`
    /// (`true`): f32 weights (the products cast them), f32 gradients, AdamW's two f32 moments (8
    /// bytes, sharded over a parameter's copies by the distributed optimizer; the f32 weights are
    /// their own master copy), gradients all-reduced in f32, activations and the exchange in the
    /// products' dtype.
    pub fn runtime(low_products: bool) -> Self {
        let low = if low_products { 2.0 } else { 4.0 };
        Self {
            param_bytes: 4.0,
            grad_bytes: 4.0,
            optimizer_bytes: 8.0,
            activation_bytes: low,
            grad_comm_bytes: 4.0,
            exchange: if low_products { ExchangePrecision::BF16 } else { ExchangePrecision::F32 },
        }
    }

    /// What `disagmoe train` holds under `--precision bf16`: bf16 working weights, gradients taken
    /// out of each backward in f32 and added and reduced in f32, an f32 master copy and AdamW's two
    /// f32 moments in the optimizer (12 bytes, sharded over a parameter's copies by the
    /// distributed optimizer); activations and the exchange as [`Precision::runtime`] with low
    /// products. The routers' weights and the vectors (norms, biases) stay f32, a small part of a
    /// model the planner counts as bf16.
    pub fn runtime_bf16() -> Self {
        Self { param_bytes: 2.0, optimizer_bytes: 12.0, ..Self::runtime(true) }
    }

    /// The runtime's with AdamW's two moments kept in bf16 (`--optimizer-state-dtype bf16`: 4
    /// bytes of moments per parameter instead of 8; a master copy stays f32).
    pub fn with_bf16_moments(mut self) -> Self {
        self.optimizer_bytes -= 4.0;
        self
    }

    /// Megatron-Core's mixed precision with its distributed optimizer (the paper's setting): bf16
    /// weights, f32 gradients, an f32 master copy and two f32 moments (12 bytes, sharded), bf16
    /// gradient all-reduce and activations.
    pub fn megatron() -> Self {
        Self {
            param_bytes: 2.0,
            grad_bytes: 4.0,
            optimizer_bytes: 12.0,
            activation_bytes: 2.0,
            grad_comm_bytes: 2.0,
            exchange: ExchangePrecision::BF16,
        }
    }
}

/// One GPU's memory by kind, bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct MemoryParts {
    /// Weights.
    pub params: f64,
    /// Gradients.
    pub grads: f64,
    /// Optimizer state (its shard).
    pub optimizer: f64,
    /// Activations kept for backward.
    pub activations: f64,
}

impl MemoryParts {
    /// All of it.
    pub fn total(&self) -> f64 {
        self.params + self.grads + self.optimizer + self.activations
    }

    /// Weights, gradients and optimizer state without activations.
    pub fn state(&self) -> f64 {
        self.params + self.grads + self.optimizer
    }

    /// Each part in GB, for messages: `weights 1.2 GB + gradients ... + activations ...`.
    pub fn describe(&self) -> String {
        format!(
            "weights {:.1} GB + gradients {:.1} GB + optimizer state {:.1} GB + activations {:.1} GB",
            self.params / 1e9,
            self.grads / 1e9,
            self.optimizer / 1e9,
            self.activations / 1e9
        )
    }
}

/// One of the token exchange's transfers, for its payload's dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExchangeTransfer {
    /// Forward M2N (attention -> experts): token activations.
    Dispatch,
    /// Forward N2M (experts -> attention): expert outputs.
    Combine,
    /// Either backward transfer: gradients.
    Gradient,
}

/// Work of one GPU for one operation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Work {
    /// Floating-point operations.
    pub flops: f64,
    /// Bytes read or written in HBM.
    pub hbm_bytes: f64,
}

impl Work {
    /// Backward of this forward work: twice the FLOPs (input and weight gradients), twice the
    /// traffic.
    pub fn backward(self) -> Work {
        Work { flops: 2.0 * self.flops, hbm_bytes: 2.0 * self.hbm_bytes }
    }

    /// [`Self::backward`], plus this forward again when `recompute` (activation recomputation).
    pub fn backward_recomputing(self, recompute: bool) -> Work {
        let g = self.backward();
        if recompute {
            Work { flops: g.flops + self.flops, hbm_bytes: g.hbm_bytes + self.hbm_bytes }
        } else {
            g
        }
    }

    /// Splits the work into `n` equal pieces, each still reading `weight_bytes` of weights when
    /// `reread_weights` (chunked execution re-reads every chunk's weights).
    pub fn chunk(self, n: usize, weight_bytes: f64, reread_weights: bool) -> Work {
        let n = n.max(1) as f64;
        let act = (self.hbm_bytes - weight_bytes).max(0.0) / n;
        let w = if reread_weights { weight_bytes } else { weight_bytes / n };
        Work { flops: self.flops / n, hbm_bytes: act + w }
    }
}

/// The hardware each side of a disaggregated placement runs on: one cost model for both on a
/// cluster of identical nodes ([`Sides::one`]); on a cluster of several node kinds
/// ([`crate::pools::MixedCluster`]) the attention side's pool and the expert side's, which may
/// differ ([`Apart`]).
#[derive(Debug, Clone, Copy)]
pub struct Sides<'a> {
    /// Cost model of the attention side (its pool's GPU, node and NICs).
    pub attention: &'a CostModel,
    /// Cost model of the expert side.
    pub ffn: &'a CostModel,
    /// Set when the two sides are on different pools.
    pub apart: Option<Apart>,
}

/// Two sides on different pools: each side has its own pool's GPUs, every token exchange crosses
/// the pools' NICs (even a one-node pool's), and a side borrows no NIC of the other pool.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Apart {
    /// GPUs of the attention side's pool.
    pub attention_gpus: usize,
    /// GPUs of the expert side's pool.
    pub ffn_gpus: usize,
    /// Bandwidth between the two pools, bytes/s per direction, shared by every group pair's
    /// exchange (`None`: the fabric is not the limit, the NICs are).
    pub link_bandwidth: Option<f64>,
}

impl<'a> Sides<'a> {
    /// Both sides on `cost`'s cluster.
    pub fn one(cost: &'a CostModel) -> Self {
        Self { attention: cost, ffn: cost, apart: None }
    }

    /// Port bandwidth of an attention group (`attention: true`) or an expert group of `gpus` GPUs
    /// and `nics` NICs when `groups` group pairs exchange at once: [`CostModel::group_bandwidth`]
    /// on one pool; across pools the NICs, each pair's fair share of the pools' link at most.
    pub fn port_bandwidth(&self, attention: bool, gpus: usize, nics: usize, groups: usize) -> f64 {
        let cost = if attention { self.attention } else { self.ffn };
        match self.apart {
            None => cost.group_bandwidth(gpus, nics),
            Some(apart) => {
                let nic = nics as f64 * cost.cluster.node.sustained_nic();
                match apart.link_bandwidth {
                    Some(link) => nic.min(link / groups.max(1) as f64),
                    None => nic,
                }
            }
        }
    }

    /// Seconds to move `bytes` between an attention and an expert group with port bandwidths
    /// `src_bw` and `dst_bw` ([`CostModel::transfer_time`]; across pools the larger latency).
    pub fn transfer_time(&self, bytes: f64, src_bw: f64, dst_bw: f64) -> f64 {
        if self.apart.is_none() {
            return self.attention.transfer_time(bytes, src_bw, dst_bw);
        }
        let latency = self.attention.cluster.node.latency_s.max(self.ffn.cluster.node.latency_s);
        latency + bytes / src_bw.min(dst_bw)
    }
}

/// Cost model of one model on one cluster for one workload.
#[derive(Debug, Clone)]
pub struct CostModel {
    /// The model.
    pub model: ModelShape,
    /// The cluster.
    pub cluster: Cluster,
    /// The step shape.
    pub workload: Workload,
    /// Byte sizes.
    pub precision: Precision,
    /// How attention groups share a micro-batch (context parallelism).
    pub context_parallel: ContextParallel,
    /// Expert load and placement (set through [`CostModel::with_expert_balance`], which checks it
    /// against the model).
    expert_balance: ExpertBalance,
}

impl CostModel {
    /// Validates the three descriptions and builds the model.
    pub fn new(model: ModelShape, cluster: Cluster, workload: Workload) -> Result<Self> {
        model.validate()?;
        cluster.validate()?;
        workload.validate()?;
        Ok(Self {
            model,
            cluster,
            workload,
            precision: Precision::default(),
            context_parallel: ContextParallel::default(),
            expert_balance: ExpertBalance::default(),
        })
    }

    /// The same model with expert load and placement `balance`, refused when it does not fit the
    /// model (a measured load without one of its MoE layers or with another expert count;
    /// redundant experts without the balanced placement).
    pub fn with_expert_balance(mut self, balance: ExpertBalance) -> Result<Self> {
        balance.validate()?;
        let most = self.model.moe.experts.saturating_mul(self.cluster.total_gpus().saturating_sub(1));
        if balance.redundant > most {
            return Err(invalid(
                "redundant_experts",
                &balance.redundant.to_string(),
                &format!("at most {most}: one replica of each of the {} experts per GPU", self.model.moe.experts),
            ));
        }
        for l in (0..self.model.layers).filter(|&l| !self.model.is_dense(l)) {
            balance.load.shares(l, self.model.moe.experts)?;
        }
        self.expert_balance = balance;
        Ok(self)
    }

    /// The expert load and placement the expert side is timed with.
    pub fn expert_balance(&self) -> &ExpertBalance {
        &self.expert_balance
    }

    /// The busiest of `gpus` GPUs holding MoE layer `layer`'s experts.
    pub fn busiest_expert_gpu(&self, layer: usize, gpus: usize) -> Busiest {
        self.expert_balance
            .busiest(layer, self.model.moe.experts, gpus)
            .expect("the expert load was checked against every MoE layer by with_expert_balance")
    }

    /// The busiest expert GPU's load over what uniform routing and the contiguous split give it
    /// (1.0 by default), averaged over the MoE layers of expert group `group` of `p`.
    fn ffn_load_factor(&self, group: usize, p: usize, gpus: usize) -> f64 {
        let e = self.model.moe.experts.max(1);
        let uniform = e.div_ceil(gpus.max(1)) as f64 / e as f64;
        let factors: Vec<f64> = (group..self.model.layers)
            .step_by(p.max(1))
            .filter(|&l| !self.model.is_dense(l))
            .map(|l| self.busiest_expert_gpu(l, gpus).share / uniform)
            .collect();
        if factors.is_empty() {
            1.0
        } else {
            factors.iter().sum::<f64>() / factors.len() as f64
        }
    }

    /// Seconds a GPU needs for `work` (roofline of compute and HBM).
    pub fn gpu_time(&self, work: Work) -> f64 {
        (work.flops / self.cluster.gpu.sustained_flops()).max(work.hbm_bytes / self.cluster.gpu.sustained_hbm())
    }

    /// Linear (projection) parameters of the attention block, router included (the router lives
    /// with attention on A-workers).
    fn attention_linear_params(&self) -> f64 {
        self.model.attention_params() - 2.0 * self.model.hidden as f64
    }

    /// Attention score FLOPs per token per unit of context (QK^T and AV).
    fn score_flops_per_context(&self) -> f64 {
        match &self.model.attention {
            AttentionShape::Gqa { heads, head_dim, .. } => 4.0 * (heads * head_dim) as f64,
            AttentionShape::Mla { heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, .. } => {
                2.0 * (*heads * (qk_nope_head_dim + qk_rope_head_dim + v_head_dim)) as f64
            }
        }
    }

    /// Activation bytes kept for backward per token by one attention block.
    pub fn attention_activation_per_token(&self) -> f64 {
        let h = self.model.hidden as f64;
        let (q, kv) = match &self.model.attention {
            AttentionShape::Gqa { heads, kv_heads, head_dim, .. } => {
                ((heads * head_dim) as f64, (kv_heads * head_dim) as f64)
            }
            AttentionShape::Mla { heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, .. } => (
                (heads * (qk_nope_head_dim + qk_rope_head_dim)) as f64,
                (*kv_lora_rank + heads * (qk_nope_head_dim + v_head_dim)) as f64 / 2.0,
            ),
        };
        // Input, normed input, q, k, v, attention output, residual: bf16.
        self.precision.activation_bytes * (3.0 * h + 2.0 * q + 2.0 * kv)
    }

    /// Tokens of one micro-batch one GPU of an attention group of `gpus` GPUs computes, the group
    /// splitting each sequence over `cp` of them ([`ContextParallel`]): `ceil(B / (a / C)) S / C`,
    /// which is `T / a` when the replicas divide the sequences evenly (`T / a` on average when
    /// micro-batches are dealt whole).
    pub fn attention_tokens_per_gpu(&self, gpus: usize, cp: usize) -> f64 {
        let w = &self.workload;
        if self.context_parallel == ContextParallel::Dealt {
            return w.tokens_per_micro_batch() / gpus.max(1) as f64;
        }
        let cp = cp.max(1);
        let replicas = (gpus / cp).max(1);
        w.micro_batch.div_ceil(replicas) as f64 * w.seq as f64 / cp as f64
    }

    /// Forward work of one GPU of an attention group of `gpus` GPUs for layer `layer` on one
    /// micro-batch, each sequence split over `cp` of them (its tokens:
    /// [`Self::attention_tokens_per_gpu`]; load-balanced chunks give every GPU of a ring the
    /// same causal context on average).
    pub fn attention_forward(&self, layer: usize, gpus: usize, cp: usize) -> Work {
        let tokens = self.attention_tokens_per_gpu(gpus, cp);
        let ctx = self.model.mean_context(layer, self.workload.seq);
        let linear = self.attention_linear_params() + self.model.router_params();
        let flops = tokens * (2.0 * linear + self.score_flops_per_context() * ctx);
        let weights = self.precision.param_bytes * (linear + 2.0 * self.model.hidden as f64);
        let act = tokens * self.attention_activation_per_token() * 2.0;
        Work { flops, hbm_bytes: weights + act }
    }

    /// Forward work of the final norm, output head and loss on one GPU of a group of `gpus`
    /// splitting sequences over `cp`.
    pub fn head_forward(&self, gpus: usize, cp: usize) -> Work {
        let tokens = self.attention_tokens_per_gpu(gpus, cp);
        let table = (self.model.vocab * self.model.hidden) as f64;
        Work {
            flops: tokens * 2.0 * table,
            hbm_bytes: self.precision.param_bytes * table + tokens * self.model.vocab as f64 * 4.0,
        }
    }

    /// K/V values per token an attention layer passes around a context-parallel ring: GQA's keys
    /// and values; MLA's keys and values as its heads use them (`heads x (d_qk + d_v)`, what
    /// `disagmoe_kernels::ring` takes).
    pub fn ring_kv_width(&self) -> f64 {
        match &self.model.attention {
            AttentionShape::Gqa { kv_heads, head_dim, .. } => 2.0 * (kv_heads * head_dim) as f64,
            AttentionShape::Mla { heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, .. } => {
                (*heads * (qk_nope_head_dim + qk_rope_head_dim + v_head_dim)) as f64
            }
        }
    }

    /// Bytes one GPU of a context-parallel ring of `cp` receives for layer `layer` on one
    /// micro-batch in the forward: its K/V block from each of the other `cp - 1` GPUs (a windowed
    /// layer whose window is shorter than the sequence needs only the `window` keys before each of
    /// its two chunks, one step); the backward passes the blocks and their gradients, twice this.
    pub fn ring_bytes(&self, layer: usize, gpus: usize, cp: usize) -> f64 {
        if cp <= 1 {
            return 0.0;
        }
        let tokens = self.attention_tokens_per_gpu(gpus, cp);
        let received = match self.model.short_window(layer, self.workload.seq) {
            Some(w) => tokens.min(2.0 * w as f64),
            None => (cp - 1) as f64 * tokens,
        };
        received * self.ring_kv_width() * self.precision.activation_bytes
    }

    /// Seconds of one GPU's ring transfers for layer `layer` on one micro-batch (forward, or
    /// `backward`: twice the bytes): one latency per step and the bytes over NVLink when the ring
    /// fits in a node, else over the GPU's share of the node's NICs.
    pub fn ring_time(&self, layer: usize, gpus: usize, cp: usize, backward: bool) -> f64 {
        if cp <= 1 {
            return 0.0;
        }
        let node = &self.cluster.node;
        let windowed = self.model.short_window(layer, self.workload.seq).is_some();
        let steps = if windowed { 1.0 } else { (cp - 1) as f64 };
        let bw = if cp <= node.gpus_per_node {
            node.sustained_nvlink()
        } else {
            node.sustained_nic() * self.cluster.nics_per_gpu()
        };
        let bytes = self.ring_bytes(layer, gpus, cp) * if backward { 2.0 } else { 1.0 };
        steps * node.latency_s + bytes / bw
    }

    /// Seconds of one GPU of an attention group for layer `layer` on one micro-batch, forward and
    /// backward (`recompute`: the backward runs the forward again): the roofline of its work, or
    /// the ring's transfers when they take longer (each block's transfer overlaps the previous
    /// block's compute).
    pub fn attention_layer_s(&self, layer: usize, gpus: usize, cp: usize, recompute: bool) -> (f64, f64) {
        let w = self.attention_forward(layer, gpus, cp);
        let bwd = w.backward_recomputing(recompute);
        let ring = |backward: bool| self.ring_time(layer, gpus, cp, backward);
        let recomputed_ring = if recompute { ring(false) } else { 0.0 };
        (self.gpu_time(w).max(ring(false)), self.gpu_time(bwd).max(ring(true) + recomputed_ring))
    }

    /// Expected number of distinct expert ranks a token is sent to when the `E` experts are
    /// sharded evenly over `f` ranks and the `k` chosen are uniformly random (1 for dense layers).
    pub fn destinations_per_token(&self, layer: usize, f: usize) -> f64 {
        if self.model.is_dense(layer) || f <= 1 {
            return 1.0;
        }
        let (e, k) = (self.model.moe.experts as f64, self.model.moe.top_k as f64);
        let per_rank = (e / f as f64).max(1.0);
        // P(rank not hit) = C(E - E/f, k) / C(E, k).
        let mut miss = 1.0;
        for i in 0..self.model.moe.top_k {
            miss *= ((e - per_rank - i as f64) / (e - i as f64)).max(0.0);
        }
        let ranks = (f as f64).min(e);
        (ranks * (1.0 - miss)).clamp(1.0, k.min(ranks))
    }

    /// Forward work of the busiest GPU of an expert group of `gpus` GPUs for layer `layer` on one
    /// micro-batch: its routed experts (by default `ceil(E / f)` of them, tokens routed uniformly
    /// over experts; see [`CostModel::busiest_expert_gpu`]) plus shared experts or the dense MLP
    /// (split by tokens).
    pub fn ffn_forward(&self, layer: usize, gpus: usize) -> Work {
        let t = self.workload.tokens_per_micro_batch();
        let g = gpus as f64;
        let h = self.model.hidden as f64;
        let act_b = self.precision.activation_bytes;
        let dense = self.model.ffn_dense_params(layer)
            - if self.model.is_dense(layer) { 0.0 } else { self.model.router_params() };
        let (routed_tokens, local_experts, inter) = if self.model.is_dense(layer) {
            (0.0, 0.0, self.model.dense_intermediate as f64)
        } else {
            // The busiest rank: uniform routing over contiguous ranges gives it ceil(E / f)
            // experts and their share of the routed tokens; a skewed load or a balanced placement
            // with redundant replicas gives it what `expert_balance` says.
            let busiest = self.busiest_expert_gpu(layer, gpus);
            let assignments = t * self.model.moe.top_k as f64 * busiest.share;
            let local = (busiest.experts as f64).min(assignments.max(1.0));
            (assignments, local, self.model.moe.intermediate as f64)
        };
        let flops = 2.0 * routed_tokens * self.model.expert_params() + 2.0 * (t / g) * dense;
        let weights = self.precision.param_bytes * (local_experts * self.model.expert_params() + dense);
        // Each routed token row: input, gate, up, activation, output.
        let act = (routed_tokens + t / g) * act_b * (2.0 * h + 3.0 * inter);
        Work { flops, hbm_bytes: weights + act }
    }

    /// Weight bytes read by [`Self::ffn_forward`] (what chunked execution re-reads per chunk).
    pub fn ffn_weight_bytes(&self, layer: usize, gpus: usize) -> f64 {
        let w = self.ffn_forward(layer, gpus);
        let mut none = self.clone();
        none.precision.param_bytes = 0.0;
        w.hbm_bytes - none.ffn_forward(layer, gpus).hbm_bytes
    }

    /// Bytes on the wire of one value of the exchange's `transfer`, its scales included
    /// (`disagmoe_core::exchange`; 2 for bf16).
    pub fn exchange_value_bytes(&self, transfer: ExchangeTransfer) -> f64 {
        let e = self.precision.exchange;
        let dtype = match transfer {
            ExchangeTransfer::Dispatch => e.dispatch,
            ExchangeTransfer::Combine => e.combine,
            ExchangeTransfer::Gradient => e.grads,
        };
        dtype.row_bytes(self.model.hidden) / self.model.hidden as f64
    }

    /// Bytes one micro-batch moves from an attention group to an expert group of `f` ranks in
    /// layer `layer` in `transfer`: each token once per destination rank, in the dtype of the
    /// transfer (M2N: the dispatch; N2M: the combine; their gradients).
    pub fn exchange_bytes(&self, layer: usize, f: usize, transfer: ExchangeTransfer) -> f64 {
        self.workload.tokens_per_micro_batch()
            * self.destinations_per_token(layer, f)
            * self.model.hidden as f64
            * self.exchange_value_bytes(transfer)
    }

    /// [`Self::exchange_bytes`] of the forward M2N (the dispatch).
    pub fn m2n_bytes(&self, layer: usize, f: usize) -> f64 {
        self.exchange_bytes(layer, f, ExchangeTransfer::Dispatch)
    }

    /// [`Self::exchange_bytes`] of the forward N2M (the combine).
    pub fn n2m_bytes(&self, layer: usize, f: usize) -> f64 {
        self.exchange_bytes(layer, f, ExchangeTransfer::Combine)
    }

    /// Bandwidth, bytes/s, of a group's port to the other groups: `gpus` x NVLink on a one-node
    /// cluster, `nics` x NIC bandwidth otherwise.
    pub fn group_bandwidth(&self, gpus: usize, nics: usize) -> f64 {
        if self.cluster.nodes == 1 {
            gpus as f64 * self.cluster.node.sustained_nvlink()
        } else {
            nics as f64 * self.cluster.node.sustained_nic()
        }
    }

    /// Seconds to move `bytes` between two groups with port bandwidths `src_bw` and `dst_bw`.
    pub fn transfer_time(&self, bytes: f64, src_bw: f64, dst_bw: f64) -> f64 {
        self.cluster.node.latency_s + bytes / src_bw.min(dst_bw)
    }

    /// Seconds of one EP all-to-all (dispatch or combine) for one micro-batch on an EP group of
    /// `ep` ranks, each holding `tokens_per_rank` tokens; Megatron's all-to-all dispatcher sends
    /// one copy per (token, chosen expert). Ranks beyond one node go through the rank's share of
    /// the node's NICs.
    /// `transfer` sets the payload's dtype (the exchange's precision).
    pub fn ep_all_to_all_time(&self, layer: usize, ep: usize, tokens_per_rank: f64, transfer: ExchangeTransfer) -> f64 {
        if ep <= 1 {
            return 0.0;
        }
        let copies = if self.model.is_dense(layer) { 0.0 } else { self.model.moe.top_k as f64 };
        let bytes = tokens_per_rank * copies * self.model.hidden as f64 * self.exchange_value_bytes(transfer);
        let node = &self.cluster.node;
        let ep_f = ep as f64;
        let local = (ep.min(node.gpus_per_node) as f64 - 1.0) / ep_f;
        let remote = (ep_f - ep.min(node.gpus_per_node) as f64) / ep_f;
        let nic_per_gpu = node.sustained_nic() * self.cluster.nics_per_gpu();
        let t = (bytes * local / node.sustained_nvlink()).max(bytes * remote / nic_per_gpu);
        node.latency_s * (ep_f.log2().ceil() + 1.0) + t
    }

    /// Seconds of a ring all-reduce of `bytes` over `ranks` GPUs, on NVLink within a node and
    /// with `nics` NICs shared by the group otherwise.
    pub fn all_reduce_time(&self, bytes: f64, ranks: usize, nics: usize) -> f64 {
        if ranks <= 1 {
            return 0.0;
        }
        let node = &self.cluster.node;
        let per_rank_bw = if ranks <= node.gpus_per_node {
            node.sustained_nvlink()
        } else {
            (nics as f64 * node.sustained_nic() / ranks as f64).min(node.sustained_nvlink())
        };
        let r = ranks as f64;
        2.0 * (r - 1.0) / r * bytes / per_rank_bw + 2.0 * (r - 1.0) * node.latency_s
    }

    /// Parameters held by every GPU of attention group `group` of `p` (attention blocks and
    /// routers of its layers; the embedding, final norm and head on group 0, as the runtime
    /// places them).
    pub fn attention_group_params(&self, group: usize, p: usize) -> f64 {
        let m = &self.model;
        let mut params: f64 = (group..m.layers)
            .step_by(p)
            .map(|l| m.attention_params() + if m.is_dense(l) { 0.0 } else { m.router_params() })
            .sum();
        let table = (m.vocab * m.hidden) as f64;
        if group == 0 {
            params += table + m.hidden as f64;
            if !m.tied_embeddings {
                params += table;
            }
        }
        params
    }

    /// Parameters of expert group `group` of `p`, over all its GPUs (routed experts sharded, their
    /// redundant replicas included; shared experts and dense MLPs counted once: they are split by
    /// tokens, replicated).
    pub fn ffn_group_params(&self, group: usize, p: usize, gpus: usize) -> (f64, f64) {
        let m = &self.model;
        let (mut sharded, mut replicated) = (0.0, 0.0);
        for l in (group..m.layers).step_by(p) {
            if m.is_dense(l) {
                replicated += m.mlp_params(m.dense_intermediate, false);
            } else {
                sharded += self.expert_balance.slots(m.moe.experts, gpus) as f64 * m.expert_params();
                replicated += m.moe.shared_experts as f64 * m.mlp_params(m.moe.intermediate, false);
            }
        }
        (sharded / gpus as f64, replicated)
    }

    /// Bytes of training state per parameter when the optimizer state is sharded over `shards`.
    pub fn state_bytes(&self, shards: usize) -> f64 {
        let pr = &self.precision;
        pr.param_bytes + pr.grad_bytes + pr.optimizer_bytes / shards.max(1) as f64
    }

    /// The state of `params` parameters whose optimizer state is sharded over `shards` copies.
    pub fn state_parts(&self, params: f64, shards: usize) -> MemoryParts {
        let pr = &self.precision;
        MemoryParts {
            params: params * pr.param_bytes,
            grads: params * pr.grad_bytes,
            optimizer: params * pr.optimizer_bytes / shards.max(1) as f64,
            activations: 0.0,
        }
    }

    /// Peak memory of one attention GPU (group of `a` splitting sequences over `cp`, `p` pairs)
    /// with `in_flight` micro-batches whose activations are alive, each holding on average half of
    /// the group's layers. With `recompute`, only each layer's input is kept and backward
    /// recomputes the forward.
    pub fn attention_memory(&self, p: usize, a: usize, cp: usize, in_flight: usize, recompute: bool) -> f64 {
        self.attention_memory_parts(p, a, cp, in_flight, recompute).total()
    }

    /// [`Self::attention_memory`] by kind: the `a` GPUs of a group hold copies of its
    /// parameters, whose optimizer state the distributed optimizer shards over them; a
    /// context-parallel ring adds the two K/V blocks of the layer it runs (one computed on, one
    /// arriving).
    pub fn attention_memory_parts(
        &self,
        p: usize,
        a: usize,
        cp: usize,
        in_flight: usize,
        recompute: bool,
    ) -> MemoryParts {
        let worst = (0..p).map(|g| self.attention_group_params(g, p)).fold(0.0, f64::max);
        let layers = self.model.layers.div_ceil(p) as f64;
        let tokens = self.attention_tokens_per_gpu(a, cp);
        let per_token = if recompute { self.checkpoint_per_token() } else { self.attention_activation_per_token() };
        let ring = if cp > 1 { 2.0 * tokens * self.ring_kv_width() * self.precision.activation_bytes } else { 0.0 };
        let act = in_flight as f64 * (layers / 2.0).max(1.0) * tokens * per_token + ring;
        MemoryParts { activations: act, ..self.state_parts(worst, a) }
    }

    /// Bytes kept per token per layer under full recomputation (the layer input).
    pub fn checkpoint_per_token(&self) -> f64 {
        self.model.hidden as f64 * self.precision.activation_bytes
    }

    /// Activation bytes kept for backward per token by one expert block (all `k` copies).
    pub fn ffn_activation_per_token(&self) -> f64 {
        let m = &self.model;
        self.precision.activation_bytes
            * (m.moe.top_k as f64 * (m.hidden + 3 * m.moe.intermediate) as f64
                + (m.moe.shared_experts * 3 * m.moe.intermediate) as f64)
    }

    /// Peak memory of one expert GPU (group of `f`, `p` pairs) with `in_flight` live micro-batches.
    pub fn ffn_memory(&self, p: usize, f: usize, in_flight: usize, recompute: bool) -> f64 {
        self.ffn_memory_parts(p, f, in_flight, recompute).total()
    }

    /// [`Self::ffn_memory`] by kind, for the group's first GPU, the fullest: its share of the
    /// routed experts and, as the runtime places them, the group's shared experts and dense MLPs
    /// (one holder, no copies: nothing to shard the optimizer state over).
    pub fn ffn_memory_parts(&self, p: usize, f: usize, in_flight: usize, recompute: bool) -> MemoryParts {
        let held = (0..p)
            .map(|g| {
                let (sharded, replicated) = self.ffn_group_params(g, p, f);
                sharded + replicated
            })
            .fold(0.0, f64::max);
        let layers = self.model.layers.div_ceil(p) as f64;
        let t = self.workload.tokens_per_micro_batch();
        let per_token = if recompute { self.checkpoint_per_token() } else { self.ffn_activation_per_token() };
        // The busiest GPU's activations grow with its share of the copies.
        let load = (0..p).map(|g| self.ffn_load_factor(g, p, f)).fold(0.0, f64::max);
        let act = in_flight as f64 * (layers / 2.0).max(1.0) * t / f as f64 * per_token * load;
        MemoryParts { activations: act, ..self.state_parts(held, 1) }
    }

    /// Gradient bytes all-reduced by an attention group per step.
    pub fn attention_grad_bytes(&self, p: usize) -> f64 {
        (0..p).map(|g| self.attention_group_params(g, p)).fold(0.0, f64::max) * self.precision.grad_comm_bytes
    }

    /// Training FLOPs (forward + backward) per token at this sequence length.
    pub fn flops_per_token(&self) -> f64 {
        let t = self.workload.tokens_per_micro_batch();
        let fwd: f64 = (0..self.model.layers)
            .map(|l| self.attention_forward(l, 1, 1).flops + self.ffn_forward(l, 1).flops)
            .sum::<f64>()
            + self.head_forward(1, 1).flops;
        3.0 * fwd / t
    }
}

/// Training FLOPs (forward + backward) per token of `model` at sequence length `seq`: the
/// products the cost model counts (attention projections and scores, experts and dense MLPs, the
/// head), which depend on the model and the sequence only, not on the cluster (a reference
/// cluster fills that argument). What `disagmoe train` reports as `flops_per_token`.
pub fn training_flops_per_token(model: &ModelShape, seq: usize) -> Result<f64> {
    let cluster = crate::hardware::Cluster::preset("h100x1")?;
    let workload = Workload { seq, micro_batch: 1, global_batch: 1 };
    Ok(CostModel::new(model.clone(), cluster, workload)?.flops_per_token())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn training_flops_per_token_does_not_depend_on_the_cluster() {
        let model = ModelShape::preset("qwen3-30b-a3b").unwrap();
        let w = Workload { seq: 4096, micro_batch: 2, global_batch: 64 };
        let on = |c: &str| CostModel::new(model.clone(), crate::hardware::Cluster::preset(c).unwrap(), w).unwrap();
        let f = training_flops_per_token(&model, 4096).unwrap();
        assert_eq!(f, on("a100x2").flops_per_token());
        assert_eq!(f, on("h800x16").flops_per_token());
        // About 6 x the active parameters (3.3B) plus attention's scores.
        let active = model.param_counts().active;
        assert!(f > 6.0 * active * 0.8 && f < 6.0 * active * 3.0, "{f} vs 6 x {active}");
    }

    fn cm(model: &str, seq: usize) -> CostModel {
        let w = Workload { seq, micro_batch: 1, global_batch: 64 };
        CostModel::new(ModelShape::preset(model).unwrap(), Cluster::preset("h800x16").unwrap(), w).unwrap()
    }

    #[test]
    fn flops_per_token_is_six_times_active_params_plus_attention_term() {
        let c = cm("qwen3-235b-a22b", 4096);
        let p = c.model.param_counts();
        let linear = 6.0 * p.active_compute;
        let fpt = c.flops_per_token();
        // The quadratic term adds 6 * L * 2 * heads * hd * (S+1)/2 ... positive, modest at 4K.
        assert!(fpt > linear && fpt < 1.5 * linear, "{fpt:e} vs 6N = {linear:e}");
        // Attention FLOPs per token grow with sequence length, expert FLOPs do not.
        let long = cm("qwen3-235b-a22b", 32768);
        assert!(long.attention_forward(0, 1, 1).flops / 8.0 > c.attention_forward(0, 1, 1).flops);
        assert!((long.ffn_forward(0, 1).flops / 8.0 - c.ffn_forward(0, 1).flops).abs() < 1.0);
    }

    #[test]
    fn destinations_per_token_grows_from_one_to_top_k() {
        let c = cm("qwen3-235b-a22b", 4096);
        assert_eq!(c.destinations_per_token(0, 1), 1.0);
        let d8 = c.destinations_per_token(0, 8);
        let d128 = c.destinations_per_token(0, 128);
        assert!(d8 > 4.0 && d8 < 8.0, "{d8}");
        assert!((d128 - 8.0).abs() < 1e-9, "{d128}");
        assert!(c.destinations_per_token(0, 16) < d128);
    }

    #[test]
    fn the_exchange_dtype_sets_each_transfers_bytes() {
        let mut c = cm("qwen3-235b-a22b", 4096); // hidden 4096: 32 fp8 blocks a token
        let bf16 = c.m2n_bytes(0, 8);
        assert_eq!((c.n2m_bytes(0, 8), c.exchange_bytes(0, 8, ExchangeTransfer::Gradient)), (bf16, bf16));
        let t = c.ep_all_to_all_time(0, 8, 4096.0, ExchangeTransfer::Dispatch);
        c.precision.exchange = ExchangePrecision::of(crate::exchange::ExchangeDtype::Fp8);
        assert!((c.m2n_bytes(0, 8) / bf16 - (1.0 + 4.0 / 128.0) / 2.0).abs() < 1e-12);
        assert_eq!((c.n2m_bytes(0, 8), c.exchange_bytes(0, 8, ExchangeTransfer::Gradient)), (bf16, bf16));
        assert!(c.ep_all_to_all_time(0, 8, 4096.0, ExchangeTransfer::Dispatch) < t);
        assert_eq!(c.ep_all_to_all_time(0, 8, 4096.0, ExchangeTransfer::Combine), t);
        c.precision.exchange = ExchangePrecision::F32;
        assert_eq!(c.m2n_bytes(0, 8), 2.0 * bf16);
    }

    #[test]
    fn context_parallelism_splits_sequences_only_where_a_micro_batch_has_too_few() {
        let w = |seq: usize, micro_batch: usize| Workload { seq, micro_batch, global_batch: 64 * micro_batch };
        let auto = ContextParallel::Auto;
        assert_eq!(auto.size_for(8, &w(4096, 16)), Some(1));
        assert_eq!(auto.size_for(8, &w(32768, 2)), Some(4));
        // 4 GPUs and 6 sequences: 2 replicas of 2 (3 sequences each), not 4 replicas (2 of them
        // holding 2 sequences and the others 1).
        assert_eq!(auto.size_for(4, &w(4096, 6)), Some(2));
        // One sequence of 8 tokens over 8 GPUs would leave chunks of half a token.
        assert_eq!(auto.size_for(8, &w(8, 1)), None);
        assert_eq!(ContextParallel::Fixed(3).size_for(8, &w(4096, 2)), None);
        assert_eq!(ContextParallel::Fixed(2).size_for(8, &w(4096, 2)), Some(2));
        assert_eq!(ContextParallel::Dealt.size_for(8, &w(32768, 1)), Some(1));
        for (arg, want) in [("auto", auto), ("4", ContextParallel::Fixed(4)), ("dealt", ContextParallel::Dealt)] {
            assert_eq!(arg.parse::<ContextParallel>().unwrap(), want);
            assert_eq!(want.name(), arg);
        }
        for bad in ["0", "two", ""] {
            let e = bad.parse::<ContextParallel>().unwrap_err().to_string();
            assert!(e.contains("context_parallel") && e.contains("auto, dealt"), "{bad}: {e}");
        }
    }

    #[test]
    fn a_gpu_computes_its_share_of_tokens_with_context_parallelism_and_whole_sequences_without() {
        let w = Workload { seq: 32768, micro_batch: 2, global_batch: 64 };
        let model = ModelShape::preset("gpt-oss-120b").unwrap();
        let mut c = CostModel::new(model, Cluster::preset("h800x16").unwrap(), w).unwrap();
        let t = w.tokens_per_micro_batch();
        assert_eq!(c.attention_tokens_per_gpu(8, 4), t / 8.0);
        // Without it, 2 of the 8 GPUs hold a sequence each and 6 wait.
        assert_eq!(c.attention_tokens_per_gpu(8, 1), 32768.0);
        let (with, without) =
            (c.attention_memory_parts(1, 8, 4, 2, false), c.attention_memory_parts(1, 8, 1, 2, false));
        assert_eq!(with.state(), without.state());
        let ring = 2.0 * (t / 8.0) * c.ring_kv_width() * c.precision.activation_bytes;
        assert!((with.activations - ring - without.activations / 4.0).abs() < 1e-6 * with.activations);
        // Dealt whole micro-batches: T / a on average, no ring.
        c.context_parallel = ContextParallel::Dealt;
        assert_eq!(c.attention_tokens_per_gpu(8, 1), t / 8.0);
        assert_eq!(c.attention_forward(1, 8, 1), {
            let mut split = c.clone();
            split.context_parallel = ContextParallel::Auto;
            split.attention_forward(1, 8, 4)
        });
    }

    #[test]
    fn the_ring_passes_every_other_gpus_kv_block_and_a_short_window_needs_one_step() {
        let w = Workload { seq: 32768, micro_batch: 1, global_batch: 64 };
        let model = ModelShape::preset("gpt-oss-120b").unwrap();
        let c = CostModel::new(model, Cluster::preset("h800x16").unwrap(), w).unwrap();
        let width = 2.0 * 8.0 * 64.0; // GPT-OSS: 8 KV heads of 64
        assert_eq!(c.ring_kv_width(), width);
        let act = c.precision.activation_bytes;
        // Layer 1 attends to the whole sequence, layer 0 within 128 tokens.
        assert_eq!(c.ring_bytes(1, 8, 8), 7.0 * 4096.0 * width * act);
        assert_eq!(c.ring_bytes(0, 8, 8), 256.0 * width * act);
        assert_eq!((c.ring_bytes(1, 8, 1), c.ring_time(1, 8, 1, false)), (0.0, 0.0));
        let node = &c.cluster.node;
        let fwd = c.ring_time(1, 8, 8, false);
        assert!((fwd - (7.0 * node.latency_s + c.ring_bytes(1, 8, 8) / node.sustained_nvlink())).abs() < 1e-15);
        let bwd = c.ring_time(1, 8, 8, true);
        assert!((bwd - (7.0 * node.latency_s + 2.0 * c.ring_bytes(1, 8, 8) / node.sustained_nvlink())).abs() < 1e-15);
        // A ring of 16 leaves the 8-GPU node: the GPU's NIC share is the slower link.
        let nic = node.sustained_nic() * c.cluster.nics_per_gpu();
        let across = c.ring_time(1, 16, 16, false);
        assert!((across - (15.0 * node.latency_s + c.ring_bytes(1, 16, 16) / nic)).abs() < 1e-15);
        // The layer takes its compute or its transfers, whichever is longer.
        for cp in [1, 8, 16] {
            let (f, b) = c.attention_layer_s(1, cp, cp, false);
            let work = c.attention_forward(1, cp, cp);
            assert_eq!(f, c.gpu_time(work).max(c.ring_time(1, cp, cp, false)));
            assert_eq!(b, c.gpu_time(work.backward()).max(c.ring_time(1, cp, cp, true)));
        }
    }

    #[test]
    fn workload_validation_names_the_field() {
        let e = Workload { seq: 4096, micro_batch: 3, global_batch: 64 }.validate().unwrap_err().to_string();
        assert!(e.contains("workload.global_batch") && e.contains("multiple of micro_batch = 3"), "{e}");
    }

    #[test]
    fn memory_falls_with_more_groups_and_more_expert_gpus() {
        let c = cm("qwen3-235b-a22b", 4096);
        assert!(c.attention_memory(4, 8, 1, 4, false) < c.attention_memory(1, 8, 1, 4, false));
        assert!(c.ffn_memory(1, 64, 4, false) < c.ffn_memory(1, 32, 4, false));
    }
}
