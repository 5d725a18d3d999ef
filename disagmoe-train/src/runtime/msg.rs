//! The runtime's vocabulary: every message workers send each other ([`Msg`]), what travels in them
//! (host tensors, the balance-loss sums, all-reduce values, the reports of written files), and
//! each message's checks. Bytes, ports and links are the transport's ([`super::transport`]); this
//! module holds no tensor of a backend and depends on no other module of the runtime but the
//! trace events it carries.
//!
//! A payload of the token exchange is host data ([`HostTensor`], packed for the wire as
//! [`Packed`]) or, between workers of one process on one device, a tensor left where it was
//! computed ([`DeviceTensor`]): this module sees it only through [`DeviceRows`], the operations
//! the exchange needs, which the worker implements for its backend.
//!
//! A message is checked twice on its way in, both here: [`Msg::check`] when it is decoded (its
//! tensors fill their shapes, a share's rows, gate weights and ids agree), and [`Msg::admit`]
//! when a worker takes it (its sender, micro-batch, layer and tokens fit the run).

use std::any::Any;
use std::sync::Arc;

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

/// What the token exchange does with a payload left on a device ([`DeviceTensor`]): the worker
/// implements it for its backend's tensors, so that the exchange (rows of a share, sums of the
/// holders' shares) runs there without this module knowing the backend. Every tensor is 2-D,
/// `[rows, cols]`, and every operation returns a tensor on the same device.
pub trait DeviceRows: Send + Sync {
    /// The tensor, for the worker to take back (`Any::downcast_ref`).
    fn as_any(&self) -> &dyn Any;
    /// Bytes per value as held (4 for f32, 2 for bf16).
    fn elem_bytes(&self) -> usize;
    /// The rows `rows`, in that order.
    fn select(&self, rows: &[u32]) -> DeviceTensor;
    /// `self + other`, elementwise (one rounding per value, as on the host).
    fn add(&self, other: &DeviceTensor) -> DeviceTensor;
    /// `self` with `values[i]` added to row `rows[i]` (the rows distinct).
    fn add_rows(&self, rows: &[u32], values: &DeviceTensor) -> DeviceTensor;
    /// Zeros of `shape` on the same device.
    fn zeros(&self, shape: [usize; 2]) -> DeviceTensor;
    /// A host tensor put on the same device.
    fn upload(&self, h: &HostTensor) -> DeviceTensor;
    /// The tensor in `dtype` for another worker (see [`Packed::pack`]): cast on the device where
    /// it can hold the dtype, packed on the host otherwise (read back, and counted so).
    fn pack(&self, dtype: ExchangeDtype) -> Packed;
    /// The receiver's own copy, in f32 (what a packed tensor holds, exactly), made on the calling
    /// thread's stream and finished before this returns, so that the sender's buffer is read by
    /// nobody once the receiver drops it. Workers share one device but not its streams: CubeCL
    /// orders a read on one stream after the writes of another (read after write), not a buffer's
    /// reuse by its owner after another stream's still-queued read (write after read), which made
    /// disagg 2+2 on four `wgpu:0` drift from one device by 1e-3 in three steps before the copy.
    fn own(&self) -> DeviceTensor;
    /// The values on the host (read back, and counted so).
    fn to_host(&self) -> HostTensor;
    /// The values in device memory for a transport that moves them itself (NCCL), finished on
    /// the calling thread's stream; `None` on a backend without such memory (all but CUDA).
    fn device_bytes(&self) -> Option<std::result::Result<DeviceBytes, String>> {
        None
    }
}

/// A payload's values in device memory, contiguous: their address and size, and what keeps the
/// memory alive while a transport reads or writes it.
pub struct DeviceBytes {
    /// Device address of the first byte.
    pub ptr: u64,
    /// Bytes.
    pub bytes: usize,
    /// The owner of the memory.
    pub keep: Box<dyn Any + Send>,
}

/// New device payloads for a transport to write into: what a receiving worker's backend gives
/// the `nccl` transport.
pub trait DeviceAlloc: Send + Sync {
    /// A payload of `shape` whose memory is allocated (its values not set), ready for another
    /// stream to write, with that memory.
    fn alloc(&self, shape: &RemoteShape) -> std::result::Result<(DeviceTensor, DeviceBytes), String>;
    /// The CUDA device ordinal the payloads live on (the transport's own buffers and streams must
    /// be on the same GPU); `None` when it is not a CUDA device.
    fn cuda_ordinal(&self) -> Option<usize>;
}

/// A payload of the token exchange left on the device that computed it: it travels only within
/// a process (the local transport hands it over as it is), never on a wire.
#[derive(Clone)]
pub struct DeviceTensor {
    /// `[rows, cols]`.
    pub shape: [usize; 2],
    /// The tensor, behind the exchange's operations.
    pub rows: Arc<dyn DeviceRows>,
}

impl DeviceTensor {
    /// Bytes of its values as held.
    pub fn bytes(&self) -> usize {
        self.shape[0] * self.shape[1] * self.rows.elem_bytes()
    }
}

impl std::fmt::Debug for DeviceTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceTensor({:?}, {} bytes a value)", self.shape, self.rows.elem_bytes())
    }
}

/// The same tensor (a device payload is never compared by value).
impl PartialEq for DeviceTensor {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.rows, &other.rows)
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
    /// A device tensor whose values travel beside the message, in a device transport's buffers
    /// ([`Msg::detach_device`], `transport::rounds`); only a message taken apart for that carries
    /// one, and [`Self::check`] refuses it anywhere else.
    Remote(RemoteShape),
    /// A tensor left on its device (in-process only: it cannot be encoded for a wire). Last: serde
    /// numbers the variants it decodes without the skipped one.
    #[serde(skip)]
    Device(DeviceTensor),
}

/// What a receiver needs to take in a device payload that travels beside its message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteShape {
    /// `[rows, cols]`.
    pub shape: [usize; 2],
    /// Bytes per value: 4 (f32) or 2 (bf16).
    pub elem_bytes: u8,
}

impl RemoteShape {
    /// Bytes of the values.
    pub fn bytes(&self) -> usize {
        self.shape[0] * self.shape[1] * self.elem_bytes as usize
    }
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
            Packed::Device(t) => &t.shape,
            Packed::Remote(r) => &r.shape,
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
            Packed::Device(t) => t.bytes(),
            Packed::Remote(r) => r.bytes(),
        }
    }

    /// Whether the values fill the shape exactly (and an fp8 tensor has a scale per block of each
    /// row); its rows when they do.
    pub fn check(&self) -> std::result::Result<usize, String> {
        match self {
            // Made by this process's workers: its shape is the tensor's.
            Packed::Device(t) => return Ok(t.shape[0]),
            Packed::Remote(_) => return Err(
                "a device payload without its values (it travels beside its message, which was not put back together)"
                    .into(),
            ),
            _ => {}
        }
        let shape = self.shape();
        let size = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).filter(|_| !shape.is_empty());
        let (values, scales_ok) = match self {
            Packed::F32(t) => (t.data.len(), true),
            Packed::Bf16 { bits, .. } => (bits.len() / 2, bits.len() % 2 == 0),
            Packed::Device(_) | Packed::Remote(_) => unreachable!("returned above"),
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

    /// The tensor in `dtype` (an f32 tensor packed, on the host or on its device; one already
    /// packed is left as it is).
    pub fn pack(self, dtype: ExchangeDtype) -> Packed {
        if let Packed::Device(t) = &self {
            return if t.rows.elem_bytes() == 4 { t.rows.pack(dtype) } else { self };
        }
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

    /// In f32 where it is, the receiver's own: a packed host tensor unpacked ([`Self::unpack`]),
    /// a device tensor copied (cast back) on the receiver's stream ([`DeviceRows::own`]).
    pub fn unpacked(self) -> Packed {
        match self {
            Packed::F32(_) => self,
            Packed::Device(t) => Packed::Device(t.rows.own()),
            other => Packed::F32(other.unpack()),
        }
    }

    /// The f32 values on the host (a packed tensor's exactly as its dtype holds them; a device
    /// tensor's read back).
    pub fn unpack(self) -> HostTensor {
        match self {
            Packed::F32(t) => t,
            Packed::Device(t) => t.rows.to_host(),
            Packed::Remote(r) => unreachable!("checked: a remote payload is put back before use ({r:?})"),
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

impl AuxSums {
    /// Adds the sums of another part of the same micro-batch (context parallelism: a ring
    /// worker's tokens): per routed layer, the routed copies, tokens and score sums. The balance
    /// losses are functions of these sums, so a micro-batch's loss is that of its parts' sums.
    pub fn merge(&mut self, other: AuxSums) {
        if self.layers.is_empty() {
            *self = other;
            return;
        }
        for (a, b) in self.layers.iter_mut().zip(other.layers) {
            debug_assert_eq!(a.layer, b.layer, "the parts of a micro-batch pass the same layers");
            a.routing.tokens += b.routing.tokens;
            a.routing.counts.iter_mut().zip(&b.routing.counts).for_each(|(x, y)| *x += y);
            a.prob_sum.iter_mut().zip(&b.prob_sum).for_each(|(x, y)| *x += y);
        }
    }
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
        /// Under an explicit expert placement (`Layout::set_expert_map`), the lowest and highest
        /// key (`disagmoe_kernels::order`) of the terms this share adds for each token, `2 n`
        /// values: where each token's row sits in the order of addition. Empty otherwise (the
        /// holder's range key places every row).
        spans: Vec<u32>,
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
    /// "Still here, waiting": sent by a worker's heartbeat while it waits, so that its peers know
    /// it can be reached (not progress: a peer waiting on it keeps its time-out).
    Alive,
    /// Rebalancing the experts: a new holder of `expert` of `layer` asks its first old holder for
    /// it (one expert in transit per receiver).
    ExpertWanted {
        /// Layer.
        layer: usize,
        /// Global expert id.
        expert: usize,
    },
    /// Rebalancing the experts: some of the parameters and AdamW moments of one expert of a layer
    /// (an expert travels as one message per tensor, so that none is larger than its largest).
    ExpertMoved {
        /// Layer.
        layer: usize,
        /// Global expert id.
        expert: usize,
        /// Its tensors (rows of a tensor stacked over experts, or whole per-expert tensors).
        tensors: Vec<ExpertTensor>,
        /// The expert's last message.
        last: bool,
    },
    /// Context parallelism, forward (appended last: a variant's index is its tag on the wire): a ring worker's block of keys and values (its
    /// `AttentionLayer::ring_project` payload, `[B T, W]`) for `layer`, from unit `mb` to unit
    /// `to` of the same micro-batch.
    Kv {
        /// The sender's unit.
        mb: usize,
        /// Layer.
        layer: usize,
        /// The receiver's unit.
        to: usize,
        /// `[B T, W]`
        kv: Packed,
    },
    /// Context parallelism, backward: the gradient of unit `mb`'s block of keys and values from
    /// the attention of unit `from` (which received it in a [`Msg::Kv`]).
    GradKv {
        /// The owner's unit (the block's).
        mb: usize,
        /// Layer.
        layer: usize,
        /// The unit whose attention computed it.
        from: usize,
        /// `[B T, W]`
        g: Packed,
    },
}

/// One tensor of a moved expert: the rows (along dimension 0) `first..` of the tensor `name`
/// of shape `shape`, the whole tensor when `first` is 0 and the values fill it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpertTensor {
    /// 0: the parameter, 1: AdamW's first moment, 2: its second.
    pub which: u8,
    /// Checkpoint name of the tensor.
    pub name: String,
    /// Shape of the whole tensor.
    pub shape: Vec<usize>,
    /// First row held.
    pub first: usize,
    /// The values, whole rows.
    pub values: Vec<f32>,
}

impl ExpertTensor {
    /// Whether the values are whole rows of the shape, within it.
    fn check(&self) -> std::result::Result<(), String> {
        let row = self.shape.iter().skip(1).try_fold(1usize, |a, &d| a.checked_mul(d));
        let rows = self.shape.first().copied().unwrap_or(1);
        let fits = match row {
            _ if self.shape.is_empty() => self.first == 0 && self.values.len() == 1,
            Some(row) if row > 0 && self.values.len() % row == 0 => {
                self.first.checked_add(self.values.len() / row).is_some_and(|end| end <= rows)
            }
            _ => false,
        };
        if self.which > 2 || !fits {
            return Err(format!(
                "moved expert tensor `{}` ({} values from row {} of {:?}, kind {})",
                self.name,
                self.values.len(),
                self.first,
                self.shape,
                self.which
            ));
        }
        Ok(())
    }
}

impl Msg {
    /// Bytes a real transfer would move (payload only).
    pub fn payload_bytes(&self) -> usize {
        let t = |h: &Packed| h.bytes();
        match self {
            Msg::Dispatch { tokens, y, weights, ids, .. } => {
                tokens.len() * 4 + t(y) + weights.as_ref().map(t).unwrap_or(0) + ids.len() * 4
            }
            Msg::Combine { tokens, spans, out, .. } => tokens.len() * 4 + spans.len() * 4 + t(out),
            Msg::Residual { x, aux, .. } => {
                t(x) + aux.layers.iter().map(|l| l.routing.counts.len() * 4 + l.prob_sum.len() * 8).sum::<usize>()
            }
            Msg::GradCombine { g, .. } => t(g),
            Msg::GradResidual { g, aux_coef, .. } => t(g) + aux_coef.iter().map(|c| c.values.len() * 4).sum::<usize>(),
            Msg::GradDispatch { gy, gw, .. } => t(gy) + gw.as_ref().map(t).unwrap_or(0),
            Msg::Kv { kv: x, .. } | Msg::GradKv { g: x, .. } => t(x),
            Msg::Reduce { data, .. } => data.bytes(),
            Msg::Abort { cause, .. } => cause.len(),
            Msg::Trace(events) => events.len() * 64,
            Msg::Shards(r) => r.iter().flat_map(|r| &r.files).map(|(t, f)| t.len() + f.len()).sum(),
            Msg::Shutdown | Msg::Heartbeat { .. } | Msg::Alive | Msg::ExpertWanted { .. } => 0,
            Msg::ExpertMoved { tensors, .. } => tensors.iter().map(|t| t.values.len() * 4).sum(),
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
            Msg::Combine { tokens, spans, out, .. } => {
                if !spans.is_empty() && spans.len() != 2 * tokens.len() {
                    return Err(format!("combine: {} key spans for {} tokens", spans.len(), tokens.len()));
                }
                rows("combine", out, tokens.len())
            }
            Msg::Residual { x, .. } => tensor("residual", x).map(drop),
            Msg::Kv { kv: x, .. } => tensor("keys and values", x).map(drop),
            Msg::GradKv { g: x, .. } => tensor("gradient of keys and values", x).map(drop),
            Msg::GradCombine { g, .. } | Msg::GradResidual { g, .. } => tensor("gradient", g).map(drop),
            Msg::GradDispatch { gy, gw, .. } => {
                let n = tensor("gradient of a dispatch", gy)?;
                gw.as_ref().map_or(Ok(()), |w| rows("gradient of gate weights", w, n))
            }
            Msg::ExpertMoved { tensors, .. } => tensors.iter().try_for_each(ExpertTensor::check),
            _ => Ok(()),
        }
    }

    /// The message as it leaves for another worker: each tensor of the token exchange packed in
    /// its kind's dtype (dispatched activations in `dispatch`; the holders' outputs, the residual,
    /// gate weights and the ring's keys and values in `combine`; gradients in `grads`); any other
    /// message as it is.
    pub fn pack(self, p: &ExchangePrecision) -> Msg {
        let (d, c, g) = (p.dispatch, p.combine, p.grads);
        match self {
            Msg::Dispatch { mb, layer, tokens, y, weights, ids } => {
                Msg::Dispatch { mb, layer, tokens, y: y.pack(d), weights: weights.map(|w| w.pack(c)), ids }
            }
            Msg::Combine { mb, layer, tokens, spans, out } => {
                Msg::Combine { mb, layer, tokens, spans, out: out.pack(c) }
            }
            Msg::Residual { mb, layer, x, aux } => Msg::Residual { mb, layer, x: x.pack(c), aux },
            Msg::GradCombine { mb, layer, g: t } => Msg::GradCombine { mb, layer, g: t.pack(g) },
            Msg::GradResidual { mb, layer, g: t, aux_coef } => Msg::GradResidual { mb, layer, g: t.pack(g), aux_coef },
            Msg::GradDispatch { mb, layer, gy, gw } => {
                Msg::GradDispatch { mb, layer, gy: gy.pack(g), gw: gw.map(|w| w.pack(g)) }
            }
            Msg::Kv { mb, layer, to, kv } => Msg::Kv { mb, layer, to, kv: kv.pack(c) },
            Msg::GradKv { mb, layer, from, g: t } => Msg::GradKv { mb, layer, from, g: t.pack(g) },
            other => other,
        }
    }

    /// The message's payloads, in a fixed order (a dispatch's expert inputs, then its gate weights;
    /// a gradient of a dispatch's inputs, then of its gate weights).
    fn payloads_mut(&mut self) -> Vec<&mut Packed> {
        match self {
            Msg::Dispatch { y, weights, .. } => std::iter::once(y).chain(weights.as_mut()).collect(),
            Msg::Combine { out: t, .. }
            | Msg::Residual { x: t, .. }
            | Msg::GradCombine { g: t, .. }
            | Msg::GradResidual { g: t, .. }
            | Msg::Kv { kv: t, .. }
            | Msg::GradKv { g: t, .. } => vec![t],
            Msg::GradDispatch { gy, gw, .. } => std::iter::once(gy).chain(gw.as_mut()).collect(),
            _ => Vec::new(),
        }
    }

    /// Takes the device payloads out for a transport that moves them apart (in this order), each
    /// replaced by its [`Packed::Remote`] shape; host payloads stay in the message.
    pub fn detach_device(&mut self) -> Vec<DeviceTensor> {
        let mut out = Vec::new();
        for p in self.payloads_mut() {
            if let Packed::Device(t) = p {
                let remote = RemoteShape { shape: t.shape, elem_bytes: t.rows.elem_bytes() as u8 };
                out.push(t.clone());
                *p = Packed::Remote(remote);
            }
        }
        out
    }

    /// The shapes of the payloads that travel beside the message, in order.
    pub fn remote_shapes(&mut self) -> Vec<RemoteShape> {
        let shape = |p: &mut Packed| match p {
            Packed::Remote(r) => Some(*r),
            _ => None,
        };
        self.payloads_mut().into_iter().filter_map(shape).collect()
    }

    /// Puts device payloads back ([`Self::detach_device`]'s order); refused when they are not as
    /// many as the message expects or of other shapes.
    pub fn attach_device(&mut self, tensors: Vec<DeviceTensor>) -> std::result::Result<(), String> {
        let mut tensors = tensors.into_iter();
        for p in self.payloads_mut() {
            if let Packed::Remote(r) = p {
                let t = tensors.next().ok_or("fewer device payloads than the message has")?;
                if t.shape != r.shape || t.rows.elem_bytes() != r.elem_bytes as usize {
                    return Err(format!("a device payload of {:?} for a place of {r:?}", t.shape));
                }
                *p = Packed::Device(t);
            }
        }
        match tensors.next() {
            Some(_) => Err("more device payloads than the message has".into()),
            None => Ok(()),
        }
    }

    /// A token-exchange message's kind, its field's place in `metrics::ExchangeBytes` (dispatch,
    /// combine, residual, then their gradients, then the ring's keys and values and their
    /// gradients); `None` for any other message.
    pub fn exchange_kind(&self) -> Option<usize> {
        match self {
            Msg::Dispatch { .. } => Some(0),
            Msg::Combine { .. } => Some(1),
            Msg::Residual { .. } => Some(2),
            Msg::GradCombine { .. } => Some(3),
            Msg::GradResidual { .. } => Some(4),
            Msg::GradDispatch { .. } => Some(5),
            Msg::Kv { .. } => Some(6),
            Msg::GradKv { .. } => Some(7),
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
            | Msg::GradDispatch { mb, layer, .. }
            | Msg::Kv { mb, layer, .. }
            | Msg::GradKv { mb, layer, .. } => Some((*mb, *layer)),
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
            Msg::Kv { .. } => "keys-values",
            Msg::GradKv { .. } => "grad-keys-values",
            Msg::Reduce { .. } => "reduce",
            Msg::Abort { .. } => "abort",
            Msg::Trace(_) => "trace",
            Msg::Shards(_) => "shards",
            Msg::Shutdown => "shutdown",
            Msg::Heartbeat { .. } => "heartbeat",
            Msg::Alive => "alive",
            Msg::ExpertWanted { .. } => "expert-wanted",
            Msg::ExpertMoved { .. } => "expert-moved",
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
    /// Units per step (micro-batches times the context parallelism; `Layout::units`).
    pub micro_batches: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Tokens of a unit.
    pub tokens: usize,
    /// Units of a micro-batch (context parallelism; 1 without).
    pub ring: usize,
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
        let other = match *self {
            Msg::Kv { to, .. } => to,
            Msg::GradKv { from, .. } => from,
            _ => mb,
        };
        if mb.max(other) >= run.micro_batches || layer >= run.layers {
            return Err(format!(
                "{} of micro-batch {mb}, layer {layer} (the run has {} and {})",
                self.kind(),
                run.micro_batches,
                run.layers
            ));
        }
        if let Msg::Kv { kv: p, .. } | Msg::GradKv { g: p, .. } = self {
            // A block of the ring: between two units of one micro-batch, a row per token.
            let ring = run.ring.max(1);
            if other == mb || other / ring != mb / ring {
                return Err(format!("{} between units {mb} and {other}, not two of one ring of {ring}", self.kind()));
            }
            if p.shape().len() != 2 || p.shape()[0] != run.tokens {
                return Err(format!("{} of shape {:?} for a unit of {} tokens", self.kind(), p.shape(), run.tokens));
            }
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

/// A "device" that keeps its tensors in host memory and computes as a device would (whole-tensor
/// operations): the exchange's and the transports' device paths checked against their host paths.
#[cfg(test)]
pub(crate) mod mem_device {
    use super::*;

    /// A tensor of the memory device.
    pub(crate) struct MemRows(pub(crate) HostTensor);

    /// `t` as a device payload.
    pub(crate) fn mem(t: HostTensor) -> DeviceTensor {
        DeviceTensor { shape: [t.shape[0], t.shape[1]], rows: Arc::new(MemRows(t)) }
    }

    /// The values of a memory-device payload.
    pub(crate) fn mem_of(d: &DeviceTensor) -> &HostTensor {
        &d.rows.as_any().downcast_ref::<MemRows>().expect("a MemRows").0
    }

    impl DeviceRows for MemRows {
        fn as_any(&self) -> &dyn Any {
            self
        }
        fn elem_bytes(&self) -> usize {
            4
        }
        fn select(&self, rows: &[u32]) -> DeviceTensor {
            let m = self.0.shape[1];
            let data = rows.iter().flat_map(|&r| self.0.data[r as usize * m..(r as usize + 1) * m].to_vec()).collect();
            mem(HostTensor { shape: vec![rows.len(), m], data })
        }
        fn add(&self, other: &DeviceTensor) -> DeviceTensor {
            let data = self.0.data.iter().zip(&mem_of(other).data).map(|(a, b)| a + b).collect();
            mem(HostTensor { shape: self.0.shape.clone(), data })
        }
        fn add_rows(&self, rows: &[u32], values: &DeviceTensor) -> DeviceTensor {
            let (mut t, m) = (self.0.clone(), self.0.shape[1]);
            for (i, &r) in rows.iter().enumerate() {
                let src = &mem_of(values).data[i * m..(i + 1) * m];
                t.data[r as usize * m..(r as usize + 1) * m].iter_mut().zip(src).for_each(|(d, s)| *d += s);
            }
            mem(t)
        }
        fn zeros(&self, shape: [usize; 2]) -> DeviceTensor {
            mem(HostTensor { shape: shape.to_vec(), data: vec![0.0; shape[0] * shape[1]] })
        }
        fn upload(&self, h: &HostTensor) -> DeviceTensor {
            mem(h.clone())
        }
        fn pack(&self, dtype: ExchangeDtype) -> Packed {
            Packed::F32(self.0.clone()).pack(dtype)
        }
        fn own(&self) -> DeviceTensor {
            mem(self.0.clone())
        }
        fn to_host(&self) -> HostTensor {
            self.0.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_that_does_not_fit_the_run_is_refused_by_name() {
        let run = RunBounds { workers: 4, micro_batches: 2, layers: 3, tokens: 8, ring: 2 };
        let t = |rows: usize| Packed::from(HostTensor { shape: vec![rows, 2], data: vec![0.0; rows * 2] });
        let combine = |mb, layer, tokens: Vec<u32>| {
            let out = t(tokens.len());
            Msg::Combine { mb, layer, tokens, spans: Vec::new(), out }
        };
        assert_eq!(combine(1, 2, vec![0, 7]).admit(3, &run), Ok(()));
        assert_eq!(Msg::Kv { mb: 1, layer: 2, to: 0, kv: t(8) }.admit(3, &run), Ok(()));
        assert_eq!(Msg::Shutdown.admit(3, &run), Ok(()));
        for (what, msg, src, says) in [
            ("sender", Msg::Shutdown, 4, "worker 4 is not one of the run's 4"),
            ("micro-batch", combine(2, 0, vec![0]), 0, "combine of micro-batch 2, layer 0 (the run has 2 and 3)"),
            ("layer", Msg::GradCombine { mb: 0, layer: 3, g: t(1) }, 0, "layer 3"),
            ("token", combine(0, 0, vec![1, 8]), 0, "combine names token 8 of a micro-batch of 8"),
            ("ring", Msg::Kv { mb: 0, layer: 0, to: 0, kv: t(8) }, 0, "not two of one ring of 2"),
            ("block", Msg::GradKv { mb: 1, layer: 0, from: 0, g: t(7) }, 0, "of shape [7, 2] for a unit of 8 tokens"),
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
