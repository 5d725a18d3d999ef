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
        y: HostTensor,
        /// `[n, k]` gate weights (routed layers).
        weights: Option<HostTensor>,
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
        out: HostTensor,
    },
    /// Attention worker -> the next layer's attention worker: the residual stream.
    Residual {
        /// Micro-batch.
        mb: usize,
        /// Layer that produced it.
        layer: usize,
        /// `[T, M]`
        x: HostTensor,
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
        g: HostTensor,
    },
    /// Backward, to `layer`'s attention worker: the gradient of its residual, and the gradient of
    /// the loss with respect to each expert's summed router probability (empty without aux loss).
    GradResidual {
        /// Micro-batch.
        mb: usize,
        /// Layer.
        layer: usize,
        /// `[T, M]`
        g: HostTensor,
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
        gy: HostTensor,
        /// `[n, k]`
        gw: Option<HostTensor>,
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
        let t = |h: &HostTensor| h.data.len() * 4;
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
        let tensor = |what: &str, h: &HostTensor| -> std::result::Result<usize, String> {
            let size = h.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            match size {
                Some(n) if n == h.data.len() && !h.shape.is_empty() => Ok(h.rows()),
                _ => Err(format!("{}: {} values for shape {:?}", what, h.data.len(), h.shape)),
            }
        };
        let rows = |what: &str, h: &HostTensor, n: usize| match tensor(what, h)? {
            r if r == n => Ok(()),
            r => Err(format!("{what}: {r} rows for {n} tokens")),
        };
        match self {
            Msg::Dispatch { tokens, y, weights, ids, .. } => {
                rows("dispatch y", y, tokens.len())?;
                if let Some(w) = weights {
                    rows("dispatch weights", w, tokens.len())?;
                    let k = w.shape.get(1).copied().unwrap_or(0);
                    if w.shape.len() != 2 || ids.len() != tokens.len() * k {
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
        let t = |rows: usize| HostTensor { shape: vec![rows, 2], data: vec![0.0; rows * 2] };
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
}
