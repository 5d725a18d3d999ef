//! Random well-formed envelopes of every message kind, for the codec's property test and its fuzz
//! target (`fuzz/fuzz_targets/envelope_decode.rs`): what a sender may legally put on the wire.
//!
//! Values and sizes are spread over their whole range on purpose: integers by bit width first
//! (so ids near 0, which are one varint byte, are as likely as ones near `u32::MAX`), and in half
//! of the envelopes every integer is below 251 (one varint byte that decodes to 4 or 8: the
//! messages whose decoded size most exceeds their bytes); lengths by size class (empty, a few,
//! hundreds, thousands, tens of thousands, and now and then a multi-MiB tensor); tensors of any
//! width, zero columns included; floats from raw bits (subnormals, infinities and both zeros
//! included; NaN left out so that `==` can compare, its bits round-trip like any other's). An
//! exchange tensor travels as f32, bf16 or fp8 (any block size, codes of any bits, scales as any
//! float).

use disagmoe_models::LayerRouting;

use super::msg::{
    AuxSums, Envelope, ExpertTensor, HostTensor, LayerAux, LayerCoefficients, Msg, Packed, ReduceData, ShardReport,
};
use super::trace::TraceEvent;

/// Where the random choices come from: a seeded generator in tests, the fuzzer's bytes in fuzzing.
pub trait Choices {
    /// The next 64 random bits.
    fn next_u64(&mut self) -> u64;
}

impl<F: FnMut() -> u64> Choices for F {
    fn next_u64(&mut self) -> u64 {
        self()
    }
}

/// The largest tensor a sample holds, in values (6 MiB of f32), and how often one that large comes
/// (1 in `LARGE_ONE_IN` tensors): large enough to cross every size class of the decoder's limit
/// and the MPI transport's pieces, rare enough that thousands of samples stay quick.
pub const LARGE_VALUES: usize = 3 << 19;
const LARGE_ONE_IN: u64 = 64;

/// Draws samples from `choices`.
pub struct Sampler<C> {
    choices: C,
    /// Every integer of the envelope being drawn is one varint byte (below 251).
    small_ints: bool,
}

impl<C: Choices> Sampler<C> {
    /// A sampler drawing from `choices`.
    pub fn new(choices: C) -> Self {
        Self { choices, small_ints: false }
    }

    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.choices.next_u64() % n
        }
    }

    /// An integer of at most `bits` bits, its width drawn first.
    fn int(&mut self, bits: u32) -> u64 {
        if self.small_ints {
            return self.below(251);
        }
        let width = self.below(u64::from(bits) + 1) as u32;
        match width {
            0 => 0,
            64 => self.choices.next_u64(),
            w => self.choices.next_u64() & ((1u64 << w) - 1),
        }
    }

    fn usize(&mut self) -> usize {
        self.int(usize::BITS) as usize
    }

    fn u32(&mut self) -> u32 {
        self.int(32) as u32
    }

    /// A length: empty, a few, up to 64, up to 4096, up to 65536, or (rarely) up to `large`;
    /// never more than `large`.
    fn len(&mut self, large: usize) -> usize {
        let n = match self.below(LARGE_ONE_IN) {
            0 => self.below(large as u64 + 1) as usize,
            c => match c % 5 {
                0 => 0,
                1 => 1 + self.below(3) as usize,
                2 => self.below(65) as usize,
                3 => self.below(4097) as usize,
                _ => self.below(65537) as usize,
            },
        };
        n.min(large)
    }

    fn f32(&mut self) -> f32 {
        let v = f32::from_bits(self.choices.next_u64() as u32);
        if v.is_nan() {
            f32::INFINITY
        } else {
            v
        }
    }

    fn f64(&mut self) -> f64 {
        let v = f64::from_bits(self.choices.next_u64());
        if v.is_nan() {
            f64::NEG_INFINITY
        } else {
            v
        }
    }

    fn f32s(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f32()).collect()
    }

    fn u32s(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| self.u32()).collect()
    }

    fn string(&mut self) -> String {
        let n = self.len(1 << 12);
        (0..n).map(|_| char::from_u32(self.below(0x11_0000) as u32).unwrap_or('\u{fffd}')).collect()
    }

    /// A tensor of `rows` rows (a row count of `None`: any shape of rank 1 to 4).
    fn tensor(&mut self, rows: Option<usize>) -> HostTensor {
        let total = self.len(LARGE_VALUES);
        let shape = match rows {
            Some(0) => vec![0, self.below(9) as usize],
            Some(r) => match self.below(4) {
                0 => vec![r, 0],
                1 => vec![r, 1 + self.below(4) as usize],
                _ => vec![r, (total / r).max(1)],
            },
            None => {
                let rank = 1 + self.below(4) as usize;
                let mut shape = vec![1; rank];
                shape[0] = total;
                // Split the total into the first two dimensions when it divides.
                if rank > 1 {
                    let d = 1 + self.below(8) as usize;
                    if total % d == 0 {
                        shape[0] = total / d;
                        shape[1] = d;
                    }
                }
                shape
            }
        };
        let data = self.f32s(shape.iter().product());
        HostTensor { shape, data }
    }

    /// An exchange tensor of `rows` rows (see [`Self::tensor`]) as f32, bf16 or fp8.
    fn packed(&mut self, rows: Option<usize>) -> Packed {
        let t = self.tensor(rows);
        match self.below(3) {
            0 => t.into(),
            1 => {
                let bits = t.data.iter().flat_map(|v| (self.u32() as u16 ^ v.to_bits() as u16).to_le_bytes()).collect();
                Packed::Bf16 { shape: t.shape, bits }
            }
            _ => {
                let width = t.shape.last().copied().unwrap_or(0);
                let block = 1 + self.below(300) as usize;
                let blocks = t.data.len().checked_div(width).unwrap_or(0) * width.div_ceil(block);
                let codes = t.data.iter().map(|v| v.to_bits() as u8).collect();
                Packed::Fp8 { shape: t.shape, block: block as u32, codes, scales: self.f32s(blocks) }
            }
        }
    }

    fn routing(&mut self) -> LayerRouting {
        let (sequences, experts) = (self.below(9) as usize, self.below(65) as usize);
        LayerRouting {
            sequences,
            tokens: self.usize(),
            experts,
            top_k: self.usize(),
            counts: self.u32s(sequences * experts),
        }
    }

    fn aux(&mut self) -> AuxSums {
        let n = self.below(4) as usize;
        AuxSums {
            layers: (0..n)
                .map(|_| {
                    let routing = self.routing();
                    let m = routing.sequences * routing.experts;
                    LayerAux { layer: self.usize(), routing, prob_sum: (0..m).map(|_| self.f64()).collect() }
                })
                .collect(),
        }
    }

    /// A token list and its rows: `n` token indices.
    fn tokens(&mut self) -> Vec<u32> {
        let n = self.len(1 << 17);
        self.u32s(n)
    }

    /// A gate-weight tensor `[n, k]` (k from 1 to 8).
    fn weights(&mut self, n: usize) -> Packed {
        let k = 1 + self.below(8) as usize;
        let w = HostTensor { shape: vec![n, k], data: self.f32s(n * k) };
        match self.below(2) {
            0 => w.into(),
            _ => Packed::from(w).pack(disagmoe_core::exchange::ExchangeDtype::Bf16),
        }
    }

    /// One message of kind `kind` (`0..KINDS`).
    pub fn msg(&mut self, kind: usize) -> Msg {
        let (mb, layer) = (self.usize(), self.usize());
        match kind % KINDS {
            0 => {
                let tokens = self.tokens();
                let n = tokens.len();
                let y = self.packed(Some(n));
                let (weights, ids) = match self.below(2) {
                    0 => (None, Vec::new()),
                    _ => {
                        let w = self.weights(n);
                        let ids = self.u32s(n * w.shape()[1]);
                        (Some(w), ids)
                    }
                };
                Msg::Dispatch { mb, layer, tokens, y, weights, ids }
            }
            1 => {
                let tokens = self.tokens();
                let out = self.packed(Some(tokens.len()));
                let spans = if self.below(2) == 0 { Vec::new() } else { self.u32s(2 * tokens.len()) };
                Msg::Combine { mb, layer, tokens, spans, out }
            }
            2 => Msg::Residual { mb, layer, x: self.packed(None), aux: self.aux() },
            3 => Msg::GradCombine { mb, layer, g: self.packed(None) },
            4 => {
                let g = self.packed(None);
                let n = self.below(4) as usize;
                let aux_coef = (0..n)
                    .map(|_| {
                        let m = self.len(4096);
                        LayerCoefficients { layer: self.usize(), values: self.f32s(m) }
                    })
                    .collect();
                Msg::GradResidual { mb, layer, g, aux_coef }
            }
            5 => {
                let gy = self.packed(None);
                let gw = match self.below(2) {
                    0 => None,
                    _ => Some(self.weights(gy.rows())),
                };
                Msg::GradDispatch { mb, layer, gy, gw }
            }
            6 => {
                let n = self.len(LARGE_VALUES);
                let data = match self.below(2) {
                    0 => ReduceData::F32(self.f32s(n)),
                    _ => ReduceData::F64((0..n / 2).map(|_| self.f64()).collect()),
                };
                Msg::Reduce { op: self.int(64), seq: self.int(64), data }
            }
            7 => Msg::Abort { worker: self.usize(), cause: self.string() },
            8 => {
                let n = self.len(4096);
                Msg::Trace(
                    (0..n)
                        .map(|_| TraceEvent {
                            name: self.string(),
                            cat: self.string(),
                            ts: self.int(64),
                            dur: self.int(64),
                            pid: self.usize(),
                            tid: self.u32(),
                            bytes: self.int(64),
                        })
                        .collect(),
                )
            }
            9 => {
                let n = self.below(5) as usize;
                Msg::Shards(
                    (0..n)
                        .map(|_| {
                            let m = self.len(256);
                            ShardReport {
                                files: (0..m).map(|_| (self.string(), self.string())).collect(),
                                bytes: self.usize(),
                            }
                        })
                        .collect(),
                )
            }
            10 => Msg::Shutdown,
            11 => Msg::Heartbeat { busy_us: self.int(64) },
            12 => Msg::Alive,
            13 => Msg::ExpertWanted { layer, expert: self.usize() },
            15 => Msg::Kv { mb, layer, to: self.usize(), kv: self.packed(None) },
            16 => Msg::GradKv { mb, layer, from: self.usize(), g: self.packed(None) },
            _ => {
                let n = self.below(4) as usize;
                let tensors = (0..n)
                    .map(|_| {
                        let row = 1 + self.below(8) as usize;
                        let rows = 1 + self.below(4) as usize;
                        let first = self.below(3) as usize;
                        ExpertTensor {
                            which: self.below(3) as u8,
                            name: self.string(),
                            shape: vec![first + rows, row],
                            first,
                            values: self.f32s(rows * row),
                        }
                    })
                    .collect();
                Msg::ExpertMoved { layer, expert: mb, tensors, last: self.below(2) == 0 }
            }
        }
    }

    /// An envelope holding a message of kind `kind`.
    pub fn envelope(&mut self, kind: usize) -> Envelope {
        self.small_ints = self.below(2) == 0;
        Envelope {
            src: self.usize(),
            step: self.usize(),
            sent_us: self.int(64),
            deliver_us: self.int(64),
            msg: self.msg(kind),
        }
    }
}

/// How many message kinds [`Sampler::msg`] draws from (every variant of [`Msg`]).
pub const KINDS: usize = 17;
