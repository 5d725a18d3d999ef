//! The runtime's vocabulary: every message workers send each other ([`Msg`]), what travels in them
//! (host tensors, the balance-loss sums, all-reduce values, the reports of written files), and
//! each message's checks. Bytes, ports and links are the transport's ([`super::transport`]); this
//! module holds no tensor of a backend and depends on no other module of the runtime but the
//! trace events it carries.
//!
//! A message is checked twice on its way in, both here: [`Msg::check`] when it is decoded (its
//! tensors fill their shapes, a share's rows, gate weights and ids agree), and [`Msg::admit`]
//! when a worker takes it (its sender, micro-batch, layer and tokens fit the run).

use serde::{Deserialize, Serialize};

use disagmoe_core::exchange::{ExchangeDtype, ExchangePrecision, FP8_BLOCK};
use disagmoe_models::LayerRouting;

use super::trace::TraceEvent;

/// A dense f32 tensor on the host, as it travels.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct HostTensor {
    /// Dimensions.
    pub shape: Vec<usize>,
    /// Row-major values.
    pub data: Vec<f32>,
}

impl HostTensor {
    /// Rows (the first dimension; 0 for an empty tensor).
    pub fn rows(&self) -> usize {
        self.shape.first().copied().unwrap_or(0)
    }
}

/// A tensor of the token exchange as it travels: f32 as computed, or packed into a lower
/// precision on its way to another worker ([`Packed::pack`], see `disagmoe_core::exchange`): bf16
/// (rounded to nearest even), or float8 e4m3 with one f32 scale per block of `block` values of a
/// row (the last block of a row may be shorter). A block's scale maps its largest magnitude to
/// e4m3's largest finite value (448), so no value saturates; a block holding a NaN or an infinity
/// unpacks as NaN (the run's non-finite check sees it). Packed values travel as raw little-endian
/// bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Packed {
    /// f32 values as computed.
    F32(HostTensor),
    /// bfloat16 values, 2 bytes each.
    Bf16 {
        /// Dimensions.
        shape: Vec<usize>,
        /// Row-major values' bits, little-endian.
        #[serde(with = "serde_bytes")]
        bits: Vec<u8>,
    },
    /// float8 e4m3 values, a byte each, and their scales.
    Fp8 {
        /// Dimensions.
        shape: Vec<usize>,
        /// Values of a row per scale.
        block: u32,
        /// Row-major e4m3 codes.
        #[serde(with = "serde_bytes")]
        codes: Vec<u8>,
        /// Per row, one scale per block: a value is `code x scale`.
        scales: Vec<f32>,
    },
}

impl From<HostTensor> for Packed {
    fn from(t: HostTensor) -> Self {
        Packed::F32(t)
    }
}

impl Packed {
    /// Dimensions.
    pub fn shape(&self) -> &[usize] {
        match self {
            Packed::F32(t) => &t.shape,
            Packed::Bf16 { shape, .. } | Packed::Fp8 { shape, .. } => shape,
        }
    }

    /// Rows (the first dimension; 0 for an empty tensor).
    pub fn rows(&self) -> usize {
        self.shape().first().copied().unwrap_or(0)
    }

    /// Bytes on the wire: values and scales.
    pub fn bytes(&self) -> usize {
        match self {
            Packed::F32(t) => t.data.len() * 4,
            Packed::Bf16 { bits, .. } => bits.len(),
            Packed::Fp8 { codes, scales, .. } => codes.len() + scales.len() * 4,
        }
    }

    /// Whether the values fill the shape exactly (and an fp8 tensor has a scale per block of each
    /// row); its rows when they do.
    pub fn check(&self) -> std::result::Result<usize, String> {
        let shape = self.shape();
        let size = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).filter(|_| !shape.is_empty());
        let (values, scales_ok) = match self {
            Packed::F32(t) => (t.data.len(), true),
            Packed::Bf16 { bits, .. } => (bits.len() / 2, bits.len() % 2 == 0),
            Packed::Fp8 { block, codes, scales, .. } => {
                let width = *shape.last().unwrap_or(&0);
                let rows = if width == 0 { 0 } else { codes.len() / width };
                let blocks = (*block > 0).then(|| width.div_ceil(*block as usize));
                (codes.len(), blocks.and_then(|b| rows.checked_mul(b)) == Some(scales.len()))
            }
        };
        match size {
            Some(n) if n == values && scales_ok => Ok(self.rows()),
            _ => Err(format!("{} values for shape {:?}", values, shape)),
        }
    }

    /// The tensor in `dtype` (an f32 tensor packed; one already packed is left as it is).
    pub fn pack(self, dtype: ExchangeDtype) -> Packed {
        let Packed::F32(HostTensor { shape, data }) = self else { return self };
        match dtype {
            ExchangeDtype::F32 => Packed::F32(HostTensor { shape, data }),
            ExchangeDtype::Bf16 => {
                let bits = data.iter().flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes()).collect();
                Packed::Bf16 { shape, bits }
            }
            ExchangeDtype::Fp8 => {
                let width = shape.last().copied().unwrap_or(0).max(1);
                let block = FP8_BLOCK.min(width);
                let mut codes = Vec::with_capacity(data.len());
                let mut scales = Vec::with_capacity(data.len().div_ceil(block));
                for row in data.chunks(width) {
                    for part in row.chunks(block) {
                        let scale = fp8_scale(part);
                        scales.push(scale);
                        codes.extend(part.iter().map(|&v| float8::F8E4M3::from_f32(v / scale).to_bits()));
                    }
                }
                Packed::Fp8 { shape, block: block as u32, codes, scales }
            }
        }
    }

    /// The f32 values (a packed tensor's exactly as its dtype holds them).
    pub fn unpack(self) -> HostTensor {
        match self {
            Packed::F32(t) => t,
            Packed::Bf16 { shape, bits } => {
                let data = bits
                    .chunks_exact(2)
                    .map(|b| half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
                    .collect();
                HostTensor { shape, data }
            }
            Packed::Fp8 { shape, block, codes, scales } => {
                let width = shape.last().copied().unwrap_or(0).max(1);
                let mut data = Vec::with_capacity(codes.len());
                let mut scale = scales.iter();
                for row in codes.chunks(width) {
                    for part in row.chunks(block as usize) {
                        let s = *scale.next().expect("checked: a scale per block");
                        data.extend(part.iter().map(|&c| float8::F8E4M3::from_bits(c).to_f32() * s));
                    }
                }
                HostTensor { shape, data }
            }
        }
    }
}

/// The scale of an fp8 block: its largest magnitude over e4m3's largest finite value (1 for a
/// block of zeros; NaN when the block holds a NaN or an infinity, so that it unpacks as NaN).
fn fp8_scale(part: &[f32]) -> f32 {
    let mut amax = 0f32;
    for &v in part {
        if !v.is_finite() {
            return f32::NAN;
        }
        amax = amax.max(v.abs());
    }
    if amax == 0.0 {
        1.0
    } else {
        // A scale that would flush to zero or overflow (magnitudes near f32's ends) stays usable:
        // the smallest normal scale still maps amax within e4m3's range.
        (amax / float8::F8E4M3::MAX.to_f32()).max(f32::MIN_POSITIVE)
    }
}

/// One routed layer's share of the balance loss of a micro-batch: its routing and the sums of its
/// router's scores per sequence.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct LayerAux {
    /// The layer.
    pub layer: usize,
    /// Routed copies per sequence and expert.
    pub routing: LayerRouting,
    /// `[B, E]` sums of the router's scores per sequence and expert.
    pub prob_sum: Vec<f64>,
}

/// What the balance loss needs, carried along the layers of a micro-batch's forward pass.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct AuxSums {
    /// The routed layers so far, in order.
    pub layers: Vec<LayerAux>,
}

/// The gradient of the loss with respect to one routed layer's score sums (`[B, E]`), the
/// coefficient and the micro-batch weight included.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct LayerCoefficients {
    /// The layer.
    pub layer: usize,
    /// `[B, E]` row-major.
    pub values: Vec<f32>,
}

/// What workers send each other.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Msg {
    /// Attention -> expert holder (M2N): the tokens of micro-batch `mb` this holder serves at
    /// `layer`, each once, with the gate weights and expert ids of all `k` choices.
    Dispatch {
        /// Micro-batch.
        mb: usize,
        /// Layer.
        layer: usize,
        /// Token indices within the micro-batch.
        tokens: Vec<u32>,
        /// `[n, M]` expert inputs.
        y: Packed,
        /// `[n, k]` gate weights (routed layers).
        weights: Option<Packed>,
        /// `n * k` global expert ids.
        ids: Vec<u32>,
    },
    /// Expert holder -> the next layer's attention worker (N2M): this holder's share of the output.
    Combine {
        /// Micro-batch.
        mb: usize,
        /// Layer that produced it.
        layer: usize,
        /// Token indices within the micro-batch.
        tokens: Vec<u32>,
        /// `[n, M]`
        out: Packed,
    },
    /// Attention worker -> the next layer's attention worker: the residual stream.
    Residual {
        /// Micro-batch.
        mb: usize,
        /// Layer that produced it.
        layer: usize,
        /// `[T, M]`
        x: Packed,
        /// Load-balancing sums so far.
        aux: AuxSums,
    },
    /// Backward, to an expert holder: the gradient of its share of `layer`'s output.
    GradCombine {
        /// Micro-batch.
        mb: usize,
        /// Layer.
        layer: usize,
        /// `[n, M]`, rows as in the holder's `Combine`.
        g: Packed,
    },
    /// Backward, to `layer`'s attention worker: the gradient of its residual, and the gradient of
    /// the loss with respect to each expert's summed router probability (empty without aux loss).
    GradResidual {
        /// Micro-batch.
        mb: usize,
        /// Layer.
        layer: usize,
        /// `[T, M]`
        g: Packed,
        /// Per routed layer, the gradient of the loss with respect to its score sums (empty
        /// without a balance loss).
        aux_coef: Vec<LayerCoefficients>,
    },
    /// Backward, expert holder -> attention worker: gradients of the expert inputs and gate weights.
    GradDispatch {
        /// Micro-batch.
        mb: usize,
        /// Layer.
        layer: usize,
        /// `[n, M]`
        gy: Packed,
        /// `[n, k]`
        gw: Option<Packed>,
    },
    /// A chunk of a ring all-reduce.
    Reduce {
        /// Which all-reduce (the worker's count of them).
        op: u64,
        /// Which chunk of it (round and index).
        seq: u64,
        /// The values.
        data: ReduceData,
    },
    /// The run is over because `worker` failed.
    Abort {
        /// The failed worker.
        worker: usize,
        /// Why.
        cause: String,
    },
    /// Trace events of a worker, gathered at the end.
    Trace(Vec<TraceEvent>),
    /// The files a worker wrote of the final model, reported to rank 0.
    Shards(Vec<ShardReport>),
    /// Stops an endpoint's receiving thread.
    Shutdown,
    /// "Still computing": sent by a worker's heartbeat while it is busy (not waiting for
    /// messages), so that a peer waiting on it knows a long compute from a stall. [`Port::recv`]
    /// takes it in and never hands it to the worker.
    Heartbeat {
        /// How long the sender has been busy, microseconds.
        busy_us: u64,
    },
}

impl Msg {
    /// Bytes a real transfer would move (payload only).
    pub fn payload_bytes(&self) -> usize {
        let t = |h: &Packed| h.bytes();
        match self {
            Msg::Dispatch { tokens, y, weights, ids, .. } => {
                tokens.len() * 4 + t(y) + weights.as_ref().map(t).unwrap_or(0) + ids.len() * 4
            }
            Msg::Combine { tokens, out, .. } => tokens.len() * 4 + t(out),
            Msg::Residual { x, aux, .. } => {
                t(x) + aux.layers.iter().map(|l| l.routing.counts.len() * 4 + l.prob_sum.len() * 8).sum::<usize>()
            }
            Msg::GradCombine { g, .. } => t(g),
            Msg::GradResidual { g, aux_coef, .. } => t(g) + aux_coef.iter().map(|c| c.values.len() * 4).sum::<usize>(),
            Msg::GradDispatch { gy, gw, .. } => t(gy) + gw.as_ref().map(t).unwrap_or(0),
            Msg::Reduce { data, .. } => data.bytes(),
            Msg::Abort { cause, .. } => cause.len(),
            Msg::Trace(events) => events.len() * 64,
            Msg::Shards(r) => r.iter().flat_map(|r| &r.files).map(|(t, f)| t.len() + f.len()).sum(),
            Msg::Shutdown | Msg::Heartbeat { .. } => 0,
        }
    }

    /// Whether the message is well formed: every tensor's values fill its shape exactly, and a
    /// share's rows, gate weights and expert ids agree with its token list. A message that is not
    /// (a damaged or foreign one) is refused before anything indexes into it.
    pub fn check(&self) -> std::result::Result<(), String> {
        let tensor = |what: &str, h: &Packed| h.check().map_err(|e| format!("{what}: {e}"));
        let rows = |what: &str, h: &Packed, n: usize| match tensor(what, h)? {
            r if r == n => Ok(()),
            r => Err(format!("{what}: {r} rows for {n} tokens")),
        };
        match self {
            Msg::Dispatch { tokens, y, weights, ids, .. } => {
                rows("dispatch y", y, tokens.len())?;
                if let Some(w) = weights {
                    rows("dispatch weights", w, tokens.len())?;
                    let k = w.shape().get(1).copied().unwrap_or(0);
                    if w.shape().len() != 2 || ids.len() != tokens.len() * k {
                        return Err(format!("dispatch: {} expert ids for {} tokens x {k}", ids.len(), tokens.len()));
                    }
                }
                Ok(())
            }
            Msg::Combine { tokens, out, .. } => rows("combine", out, tokens.len()),
            Msg::Residual { x, .. } => tensor("residual", x).map(drop),
            Msg::GradCombine { g, .. } | Msg::GradResidual { g, .. } => tensor("gradient", g).map(drop),
            Msg::GradDispatch { gy, gw, .. } => {
                let n = tensor("gradient of a dispatch", gy)?;
                gw.as_ref().map_or(Ok(()), |w| rows("gradient of gate weights", w, n))
            }
            _ => Ok(()),
        }
    }

    /// The message as it leaves for another worker: each tensor of the token exchange packed in
    /// its kind's dtype (dispatched activations in `dispatch`; the holders' outputs, the residual
    /// and gate weights in `combine`; gradients in `grads`); any other message as it is.
    pub fn pack(self, p: &ExchangePrecision) -> Msg {
        let (d, c, g) = (p.dispatch, p.combine, p.grads);
        match self {
            Msg::Dispatch { mb, layer, tokens, y, weights, ids } => {
                Msg::Dispatch { mb, layer, tokens, y: y.pack(d), weights: weights.map(|w| w.pack(c)), ids }
            }
            Msg::Combine { mb, layer, tokens, out } => Msg::Combine { mb, layer, tokens, out: out.pack(c) },
            Msg::Residual { mb, layer, x, aux } => Msg::Residual { mb, layer, x: x.pack(c), aux },
            Msg::GradCombine { mb, layer, g: t } => Msg::GradCombine { mb, layer, g: t.pack(g) },
            Msg::GradResidual { mb, layer, g: t, aux_coef } => Msg::GradResidual { mb, layer, g: t.pack(g), aux_coef },
            Msg::GradDispatch { mb, layer, gy, gw } => {
                Msg::GradDispatch { mb, layer, gy: gy.pack(g), gw: gw.map(|w| w.pack(g)) }
            }
            other => other,
        }
    }

    /// A token-exchange message's kind, its field's place in `metrics::ExchangeBytes` (dispatch,
    /// combine, residual, then their gradients); `None` for any other message.
    pub fn exchange_kind(&self) -> Option<usize> {
        match self {
            Msg::Dispatch { .. } => Some(0),
            Msg::Combine { .. } => Some(1),
            Msg::Residual { .. } => Some(2),
            Msg::GradCombine { .. } => Some(3),
            Msg::GradResidual { .. } => Some(4),
            Msg::GradDispatch { .. } => Some(5),
            _ => None,
        }
    }

    /// The micro-batch and layer a token-exchange message belongs to.
    pub fn at(&self) -> Option<(usize, usize)> {
        match self {
            Msg::Dispatch { mb, layer, .. }
            | Msg::Combine { mb, layer, .. }
            | Msg::Residual { mb, layer, .. }
            | Msg::GradCombine { mb, layer, .. }
            | Msg::GradResidual { mb, layer, .. }
            | Msg::GradDispatch { mb, layer, .. } => Some((*mb, *layer)),
            _ => None,
        }
    }

    /// A short name for traces.
    pub fn kind(&self) -> &'static str {
        match self {
            Msg::Dispatch { .. } => "dispatch",
            Msg::Combine { .. } => "combine",
            Msg::Residual { .. } => "residual",
            Msg::GradCombine { .. } => "grad-combine",
            Msg::GradResidual { .. } => "grad-residual",
            Msg::GradDispatch { .. } => "grad-dispatch",
            Msg::Reduce { .. } => "reduce",
            Msg::Abort { .. } => "abort",
            Msg::Trace(_) => "trace",
            Msg::Shards(_) => "shards",
            Msg::Shutdown => "shutdown",
            Msg::Heartbeat { .. } => "heartbeat",
        }
    }
}

/// A message with its routing and timing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    /// Sending worker.
    pub src: usize,
    /// Training step it belongs to.
    pub step: usize,
    /// When it was sent ([`now_us`]).
    pub sent_us: u64,
    /// When the emulated link delivers it (= `sent_us` without emulation).
    pub deliver_us: u64,
    /// The message.
    pub msg: Msg,
}

/// The values of an all-reduce as they travel between workers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ReduceData {
    /// Gradients and counts.
    F32(Vec<f32>),
    /// Losses, norms, timings.
    F64(Vec<f64>),
}

impl ReduceData {
    /// Bytes a real transfer moves.
    pub fn bytes(&self) -> usize {
        match self {
            ReduceData::F32(v) => v.len() * 4,
            ReduceData::F64(v) => v.len() * 8,
        }
    }
}

/// What a worker wrote: the file of each tensor, and the bytes of tensor data it wrote.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ShardReport {
    /// `(tensor name, file name)`.
    pub files: Vec<(String, String)>,
    /// Bytes of tensor data written by this worker.
    pub bytes: usize,
}

/// What a message of a step must fit to be taken: the run's workers, micro-batches, layers and
/// tokens per micro-batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunBounds {
    /// Workers of the run (senders are `0..workers`).
    pub workers: usize,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Tokens of a micro-batch.
    pub tokens: usize,
}

impl Msg {
    /// Whether a message from `src` fits the run (a sender that is a worker; a micro-batch, layer
    /// and tokens within the run's): the reason when it does not, before anything indexes with it.
    /// Messages that carry no micro-batch only need a sender of the run.
    pub fn admit(&self, src: usize, run: &RunBounds) -> std::result::Result<(), String> {
        if src >= run.workers {
            return Err(format!("worker {src} is not one of the run's {}", run.workers));
        }
        let Some((mb, layer)) = self.at() else { return Ok(()) };
        if mb >= run.micro_batches || layer >= run.layers {
            return Err(format!(
                "{} of micro-batch {mb}, layer {layer} (the run has {} and {})",
                self.kind(),
                run.micro_batches,
                run.layers
            ));
        }
        let ids = match self {
            Msg::Dispatch { tokens, .. } | Msg::Combine { tokens, .. } => tokens.as_slice(),
            _ => &[],
        };
        match ids.iter().find(|&&t| t as usize >= run.tokens) {
            Some(t) => Err(format!("{} names token {t} of a micro-batch of {}", self.kind(), run.tokens)),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_that_does_not_fit_the_run_is_refused_by_name() {
        let run = RunBounds { workers: 4, micro_batches: 2, layers: 3, tokens: 8 };
        let t = |rows: usize| Packed::from(HostTensor { shape: vec![rows, 2], data: vec![0.0; rows * 2] });
        let combine = |mb, layer, tokens: Vec<u32>| {
            let out = t(tokens.len());
            Msg::Combine { mb, layer, tokens, out }
        };
        assert_eq!(combine(1, 2, vec![0, 7]).admit(3, &run), Ok(()));
        assert_eq!(Msg::Shutdown.admit(3, &run), Ok(()));
        for (what, msg, src, says) in [
            ("sender", Msg::Shutdown, 4, "worker 4 is not one of the run's 4"),
            ("micro-batch", combine(2, 0, vec![0]), 0, "combine of micro-batch 2, layer 0 (the run has 2 and 3)"),
            ("layer", Msg::GradCombine { mb: 0, layer: 3, g: t(1) }, 0, "layer 3"),
            ("token", combine(0, 0, vec![1, 8]), 0, "combine names token 8 of a micro-batch of 8"),
        ] {
            let e = msg.admit(src, &run).expect_err(what);
            assert!(e.contains(says), "{what}: {e}");
        }
    }

    /// bf16: half's rounding to nearest even, bit for bit, 2 bytes a value; fp8: within e4m3's
    /// relative step of each block's largest magnitude, 1 byte a value plus a scale per block.
    #[test]
    fn exchange_tensors_pack_in_bf16_and_fp8_and_unpack_to_what_those_formats_hold() {
        let width = 300usize; // blocks of 128, 128 and 44
        let data: Vec<f32> = (0..2 * width).map(|i| (i as f32 * 0.37).sin() * 10f32.powi(i as i32 % 7 - 3)).collect();
        let t = HostTensor { shape: vec![2, width], data: data.clone() };
        assert_eq!(Packed::from(t.clone()).pack(ExchangeDtype::F32), Packed::F32(t.clone()));

        let bf = Packed::from(t.clone()).pack(ExchangeDtype::Bf16);
        assert_eq!((bf.bytes(), bf.check()), (2 * data.len(), Ok(2)));
        let back = bf.unpack();
        assert_eq!(back.shape, t.shape);
        for (a, b) in data.iter().zip(&back.data) {
            assert_eq!(b.to_bits(), half::bf16::from_f32(*a).to_f32().to_bits());
        }
        // Ties go to even: 1 + 2^-8 is halfway between two bf16 values.
        let tie =
            Packed::from(HostTensor { shape: vec![2], data: vec![1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-8)] });
        assert_eq!(tie.pack(ExchangeDtype::Bf16).unpack().data, vec![1.0, 1.0 + 4.0 * 2f32.powi(-8)]);

        let f8 = Packed::from(t.clone()).pack(ExchangeDtype::Fp8);
        assert_eq!((f8.bytes(), f8.check()), (data.len() + 2 * 3 * 4, Ok(2)));
        let back = f8.unpack();
        for (row, got) in data.chunks(width).zip(back.data.chunks(width)) {
            for (block, got) in row.chunks(FP8_BLOCK).zip(got.chunks(FP8_BLOCK)) {
                let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
                for (a, b) in block.iter().zip(got) {
                    // e4m3 keeps 3 mantissa bits: half a step is 1/16 of the value, and values
                    // 2^-9 of the block's largest or below are subnormal there.
                    assert!((a - b).abs() <= a.abs() / 16.0 + amax * 2f32.powi(-18), "{a} -> {b}");
                }
                assert!(got.iter().fold(0f32, |m, v| m.max(v.abs())) == amax, "the largest stays exact");
            }
        }
        // Values far past e4m3's range (448) and far below it are scaled, not saturated or flushed;
        // zeros stay zeros; a non-finite value makes its block NaN (the others are untouched).
        let odd = HostTensor { shape: vec![4, 2], data: vec![1e30, -3e29, 1e-30, 5e-31, 0.0, 0.0, f32::INFINITY, 1.0] };
        let back = Packed::from(odd).pack(ExchangeDtype::Fp8).unpack().data;
        assert!((back[0] - 1e30).abs() <= 1e30 / 16.0 && (back[1] + 3e29).abs() <= 3e29 / 16.0, "{back:?}");
        assert!((back[2] - 1e-30).abs() <= 1e-30 / 16.0 && (back[3] - 5e-31).abs() <= 5e-31 / 16.0, "{back:?}");
        assert_eq!(&back[4..6], &[0.0, 0.0]);
        assert!(back[6].is_nan() && back[7].is_nan(), "{back:?}");
        // Only the exchange's tensors are packed, each kind in its dtype.
        let p = ExchangePrecision::new(ExchangeDtype::Fp8, None).unwrap();
        let dispatch = Msg::Dispatch {
            mb: 0,
            layer: 0,
            tokens: vec![0],
            y: HostTensor { shape: vec![1, 4], data: vec![1.0; 4] }.into(),
            weights: Some(HostTensor { shape: vec![1, 2], data: vec![0.5; 2] }.into()),
            ids: vec![0, 1],
        };
        let Msg::Dispatch { y, weights: Some(w), .. } = dispatch.pack(&p) else { unreachable!() };
        assert!(matches!((&y, &w), (Packed::Fp8 { .. }, Packed::Bf16 { .. })), "{y:?} {w:?}");
        let g = Msg::GradCombine { mb: 0, layer: 0, g: HostTensor { shape: vec![1, 4], data: vec![1.0; 4] }.into() };
        assert!(matches!(g.pack(&p), Msg::GradCombine { g: Packed::Bf16 { .. }, .. }));
        assert_eq!(Msg::Shutdown.pack(&p), Msg::Shutdown);
    }
}
