//! GPT-OSS's router (biased logits, top-k, softmax over the k chosen) and experts (fused
//! `[E, M, 2I]` gate/up with interleaved columns, biases, clamped SwiGLU), with the MXFP4
//! dequantisation of the released expert weights.

use burn::module::{Module, Param};
use burn::tensor::activation::softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use crate::error::{ModelError, Result};
use crate::init::Init;
use crate::moe::{choose_top_k, Experts, Router, RouterOutput};
use crate::weights::{CheckpointReader, TensorSink};

/// GPT-OSS router: `logits = x W^T + b`, top-k of the logits, softmax over the k chosen.
#[derive(Module, Debug)]
pub struct GptOssRouter<B: Backend> {
    /// `[E, M]`
    pub weight: Param<Tensor<B, 2>>,
    /// `[E]`
    pub bias: Param<Tensor<B, 1>>,
    top_k: usize,
}

impl<B: Backend> GptOssRouter<B> {
    /// A router over `experts` experts of width `hidden`: normal(0, std) weight and bias, as
    /// transformers initialises them (`init` is scoped to the MoE block; names `router.{weight,bias}`).
    pub fn new(hidden: usize, experts: usize, top_k: usize, init: &Init<B>) -> Self {
        let init = init.child("router");
        Self {
            weight: Param::from_tensor(init.normal("weight", [experts, hidden])),
            bias: Param::from_tensor(init.normal("bias", [experts])),
            top_k,
        }
    }
}

impl<B: Backend> Router<B> for GptOssRouter<B> {
    fn route(&self, x: Tensor<B, 2>) -> RouterOutput<B> {
        let logits = x.matmul(self.weight.val().transpose()) + self.bias.val().unsqueeze::<2>(); // [T, E]
        let ids = choose_top_k(&logits, self.top_k);
        let weights = softmax(ids.gather(logits.clone(), self.top_k), 1); // [T, k]
        RouterOutput { probs: softmax(logits.clone(), 1), weights, ids, logits }
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
    /// Global index of the first expert (row) held.
    #[module(skip)]
    first: usize,
}

impl<B: Backend> GptOssExperts<B> {
    /// Experts `range` (global indices) of a layer of width `hidden` and intermediate size `inter`:
    /// normal(0, std) weights, zero biases (`init` is scoped to `...mlp.experts`); each expert's
    /// rows are drawn as the same rows of the whole layer would be.
    pub fn new(range: std::ops::Range<usize>, hidden: usize, inter: usize, alpha: f64, limit: f64, init: &Init<B>) -> Self {
        let (n, first) = (range.len(), range.start);
        Self {
            gate_up_proj: Param::from_tensor(init.normal_rows("gate_up_proj", [n, hidden, 2 * inter], first)),
            gate_up_proj_bias: Param::from_tensor(init.zeros([n, 2 * inter])),
            down_proj: Param::from_tensor(init.normal_rows("down_proj", [n, inter, hidden], first)),
            down_proj_bias: Param::from_tensor(init.zeros([n, hidden])),
            alpha,
            limit,
            first,
        }
    }

    /// Global index of the first expert held.
    pub fn first_expert(&self) -> usize {
        self.first
    }
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
        let (gu, gub, dp, dpb) =
            (self.gate_up_proj.val(), self.gate_up_proj_bias.val(), self.down_proj.val(), self.down_proj_bias.val());
        // The grouped kernel where there is one (CubeCL backends), chosen in disagmoe_kernels::fused;
        // else its reference.
        disagmoe_kernels::fused::gpt_oss_experts(
            xs.clone(),
            counts,
            gu.clone(),
            gub.clone(),
            dp.clone(),
            dpb.clone(),
            self.alpha,
            self.limit,
        )
        .unwrap_or_else(|| disagmoe_kernels::reference::gpt_oss_experts(xs, counts, gu, gub, dp, dpb, self.alpha, self.limit))
    }

    /// Reads the rows of the experts held (from the full `[E, ...]` tensors, or the MXFP4 blocks
    /// and scales of those experts only).
    fn load(&mut self, ckpt: &mut CheckpointReader, prefix: &str, device: &B::Device) -> Result<()> {
        let [n, m, two_i] = self.gate_up_proj.dims();
        let (i, first) = (two_i / 2, self.first);
        self.gate_up_proj =
            Param::from_tensor(load_maybe_mxfp4(ckpt, &format!("{prefix}.gate_up_proj"), [n, m, two_i], first, device)?);
        self.gate_up_proj_bias =
            Param::from_tensor(ckpt.tensor_rows(&format!("{prefix}.gate_up_proj_bias"), [n, two_i], first, device)?);
        self.down_proj =
            Param::from_tensor(load_maybe_mxfp4(ckpt, &format!("{prefix}.down_proj"), [n, i, m], first, device)?);
        self.down_proj_bias =
            Param::from_tensor(ckpt.tensor_rows(&format!("{prefix}.down_proj_bias"), [n, m], first, device)?);
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
            first: self.first + start,
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
    first: usize,
    device: &B::Device,
) -> Result<Tensor<B, 3>> {
    let (blocks_name, scales_name) = (format!("{name}_blocks"), format!("{name}_scales"));
    if ckpt.contains(name) || !ckpt.contains(&blocks_name) {
        return ckpt.tensor_rows(name, shape, first, device);
    }
    let (bshape, blocks) = ckpt.read_rows_u8(&blocks_name, first, shape[0])?;
    let (sshape, scales) = ckpt.read_rows_u8(&scales_name, first, shape[0])?;
    if bshape.len() != 4 || sshape != bshape[..3] {
        return Err(ModelError::ShapeMismatch {
            name: scales_name,
            found: sshape,
            expected: bshape[..3.min(bshape.len())].to_vec(),
        });
    }
    let mut rows_shape = bshape.clone();
    rows_shape[0] = shape[0];
    let (found, values) = dequantize_mxfp4(&blocks, &rows_shape, &scales);
    if found != shape {
        let mut expected = shape.to_vec();
        expected[0] = bshape[0];
        return Err(ModelError::ShapeMismatch { name: blocks_name, found: bshape, expected });
    }
    Ok(Tensor::from_data(TensorData::new(values, shape), device))
}
