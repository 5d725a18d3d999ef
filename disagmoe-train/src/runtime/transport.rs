//! Moving token batches between workers: the [`Endpoint`] trait, its messages, the in-process
//! `local` transport, and link emulation.
//!
//! A send never blocks the compute stream: the endpoint hands the message to the transport (a
//! channel here, a communication thread for MPI) and returns. Link emulation stamps each message
//! with the time a link of the given speed would deliver it (the sender's NIC sends one message at a
//! time, FIFO), and the receiving endpoint holds it back until then, so transfers take wall time
//! without spending CPU. Messages a worker sends to itself never touch the link.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use disagmoe_models::LayerRouting;

use super::collectives::ReduceData;
use super::shards::ShardReport;

use crate::error::{Result, TrainError};

/// Microseconds on the machine's monotonic clock (`CLOCK_MONOTONIC`): it never steps back or
/// jumps with the wall clock, and every process of a machine reads the same one, so a time stamped
/// by one worker (a message's send or delivery time) means the same to another on that machine.
/// Across machines only differences taken within one process are used (and a sender's stamp is
/// clamped into the receiver's wait), so clocks of different machines never meet.
pub fn now_us() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC exists on every Linux and macOS.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_MONOTONIC) failed");
    ts.tv_sec as u64 * 1_000_000 + ts.tv_nsec as u64 / 1_000
}

/// A dense f32 tensor on the host, as it travels.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
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
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct LayerAux {
    /// The layer.
    pub layer: usize,
    /// Routed copies per sequence and expert.
    pub routing: LayerRouting,
    /// `[B, E]` sums of the router's scores per sequence and expert.
    pub prob_sum: Vec<f64>,
}

/// What the balance loss needs, carried along the layers of a micro-batch's forward pass.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct AuxSums {
    /// The routed layers so far, in order.
    pub layers: Vec<LayerAux>,
}

/// The gradient of the loss with respect to one routed layer's score sums (`[B, E]`), the
/// coefficient and the micro-batch weight included.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct LayerCoefficients {
    /// The layer.
    pub layer: usize,
    /// `[B, E]` row-major.
    pub values: Vec<f32>,
}

/// What workers send each other.
#[derive(Debug, Clone, Serialize, Deserialize)]
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
    Trace(Vec<super::trace::TraceEvent>),
    /// The files a worker wrote of the final model, reported to rank 0.
    Shards(Vec<ShardReport>),
    /// Stops an endpoint's receiving thread.
    Shutdown,
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
            Msg::Shutdown => 0,
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
        }
    }
}

/// A message with its routing and timing.
#[derive(Debug, Clone, Serialize, Deserialize)]
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

#[cfg(feature = "mpi")]
impl Envelope {
    /// The envelope as bytes for a process transport (bincode).
    pub fn to_bytes(&self) -> Vec<u8> {
        bincode::serde::encode_to_vec(self, bincode::config::standard()).expect("envelopes serialise")
    }

    /// An envelope from [`Envelope::to_bytes`]; the decoder's complaint if the bytes are not one.
    pub fn from_bytes(bytes: &[u8]) -> std::result::Result<Self, String> {
        match bincode::serde::decode_from_slice(bytes, bincode::config::standard()) {
            Ok((env, used)) if used == bytes.len() => Ok(env),
            Ok((_, used)) => Err(format!("{} bytes left over after an envelope of {used}", bytes.len() - used)),
            Err(e) => Err(format!("{e} ({} bytes)", bytes.len())),
        }
    }
}

/// An emulated link: every worker's NIC sends and receives at `gbps` gigabits per second, one
/// message at a time each way, and a message arrives `latency_us` after its last byte left (and
/// not before the receiving NIC has taken in all of it).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LinkModel {
    /// Bandwidth per worker, Gbit/s.
    pub gbps: f64,
    /// One-way latency, microseconds.
    pub latency_us: f64,
}

impl LinkModel {
    /// Microseconds to put `bytes` on the wire.
    pub fn transfer_us(&self, bytes: usize) -> f64 {
        bytes as f64 * 8.0 / (self.gbps * 1e3)
    }
}

/// One worker's connection to the others.
pub trait Endpoint: Send {
    /// This worker's rank.
    fn rank(&self) -> usize;
    /// Number of workers.
    fn size(&self) -> usize;
    /// Hands `env` to the transport for another worker `dst` (never waits for the receiver;
    /// [`Port`] keeps messages to oneself).
    fn transmit(&mut self, dst: usize, env: Envelope) -> Result<()>;
    /// The next envelope that arrived, waiting at most `timeout`; `None` on time-out.
    fn arrive(&mut self, timeout: Duration) -> Result<Option<Envelope>>;
}

/// Link emulation and delivery order on top of any [`Endpoint`]: what workers use.
pub struct Port {
    inner: Box<dyn Endpoint>,
    link: Option<LinkModel>,
    nic_free_us: f64,
    rx_free_us: f64,
    due: BinaryHeap<Reverse<(u64, u64)>>,
    held: HashMap<u64, Envelope>,
    seq: u64,
}

impl Port {
    /// Wraps an endpoint; `link` turns on emulation.
    pub fn new(inner: Box<dyn Endpoint>, link: Option<LinkModel>) -> Self {
        Self { inner, link, nic_free_us: 0.0, rx_free_us: 0.0, due: BinaryHeap::new(), held: HashMap::new(), seq: 0 }
    }

    /// This worker's rank.
    pub fn rank(&self) -> usize {
        self.inner.rank()
    }

    /// Number of workers.
    pub fn size(&self) -> usize {
        self.inner.size()
    }

    /// Sends `msg` to `dst`; returns the times it was sent and delivered and the microseconds it
    /// occupied the sender's link (queueing excluded). Messages to oneself and the run's
    /// bookkeeping (aborts, trace events, the reports of the written model) skip the emulated link.
    pub fn send(&mut self, dst: usize, step: usize, msg: Msg) -> Result<(u64, u64, u64)> {
        let now = now_us();
        let (deliver, wire) = match self.link {
            Some(link) if dst != self.rank() && !matches!(msg, Msg::Abort { .. } | Msg::Trace(_) | Msg::Shards(_)) => {
                let start = (now as f64).max(self.nic_free_us);
                let wire = link.transfer_us(msg.payload_bytes());
                self.nic_free_us = start + wire;
                ((self.nic_free_us + link.latency_us) as u64, wire as u64)
            }
            _ => (now, 0),
        };
        let env = Envelope { src: self.rank(), step, sent_us: now, deliver_us: deliver, msg };
        if dst == self.rank() {
            // A message to oneself never leaves the worker, whatever the transport.
            self.hold(env);
        } else {
            self.inner.transmit(dst, env)?;
        }
        Ok((now, deliver, wire))
    }

    /// Holds an envelope until its delivery time (the receiving NIC takes messages in one at a
    /// time, in the order they came).
    fn hold(&mut self, mut env: Envelope) {
        if let Some(link) = self.link.filter(|_| env.deliver_us > env.sent_us) {
            let wire = link.transfer_us(env.msg.payload_bytes());
            let tx_start = env.deliver_us as f64 - link.latency_us - wire;
            self.rx_free_us = tx_start.max(self.rx_free_us) + wire;
            env.deliver_us = env.deliver_us.max((self.rx_free_us + link.latency_us) as u64);
        }
        self.seq += 1;
        self.due.push(Reverse((env.deliver_us, self.seq)));
        self.held.insert(self.seq, env);
    }

    /// The next delivered envelope (in delivery-time order), waiting at most `timeout` (zero: just
    /// look); `None` on time-out. A message that has arrived but is still on the emulated wire is
    /// waited for past the time-out: it is not a stall.
    pub fn recv(&mut self, timeout: Duration) -> Result<Option<Envelope>> {
        let deadline = now_us() + timeout.as_micros() as u64;
        loop {
            while let Some(env) = self.inner.arrive(Duration::ZERO)? {
                self.hold(env);
            }
            let now = now_us();
            let next_due = self.due.peek().map(|Reverse((due, _))| *due);
            if let (Some(due), Some(&Reverse((_, seq)))) = (next_due, self.due.peek()) {
                if due <= now {
                    self.due.pop();
                    return Ok(self.held.remove(&seq));
                }
            }
            if now >= deadline && (next_due.is_none() || timeout.is_zero()) {
                return Ok(None);
            }
            let until = match next_due {
                Some(due) if now >= deadline => due,
                Some(due) => due.min(deadline),
                None => deadline,
            };
            if let Some(env) = self.inner.arrive(Duration::from_micros(until.saturating_sub(now).max(1)))? {
                self.hold(env);
            }
        }
    }
}

/// What a receive thread hands its worker: an envelope, or why the transport cannot go on (an
/// undecodable message, a failed receive), which ends the run at once.
pub(crate) type Delivery = std::result::Result<Envelope, TrainError>;

/// The next envelope of a channel inbox within `timeout` (`None` on time-out); `what` names the
/// senders in the error when they have all gone.
pub(crate) fn receive_within(
    inbox: &Receiver<Delivery>,
    rank: usize,
    timeout: Duration,
    what: &str,
) -> Result<Option<Envelope>> {
    match inbox.recv_timeout(timeout) {
        Ok(Ok(env)) => Ok(Some(env)),
        Ok(Err(e)) => Err(e),
        Err(RecvTimeoutError::Timeout) => Ok(None),
        Err(RecvTimeoutError::Disconnected) => {
            Err(TrainError::Worker { worker: rank, cause: format!("{what} have stopped") })
        }
    }
}

/// The in-process transport: workers are threads, messages move through channels.
pub struct LocalEndpoint {
    rank: usize,
    peers: Vec<Sender<Delivery>>,
    inbox: Receiver<Delivery>,
}

/// Endpoints for `n` workers in this process.
pub fn local_endpoints(n: usize) -> Vec<LocalEndpoint> {
    let (senders, receivers): (Vec<_>, Vec<_>) = (0..n).map(|_| channel()).unzip();
    receivers
        .into_iter()
        .enumerate()
        .map(|(rank, inbox)| LocalEndpoint { rank, peers: senders.clone(), inbox })
        .collect()
}

impl Endpoint for LocalEndpoint {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.peers.len()
    }
    fn transmit(&mut self, dst: usize, env: Envelope) -> Result<()> {
        // A peer that has ended dropped its inbox; its own error is what the run reports.
        let _ = self.peers[dst].send(Ok(env));
        Ok(())
    }
    fn arrive(&mut self, timeout: Duration) -> Result<Option<Envelope>> {
        receive_within(&self.inbox, self.rank, timeout, "all peers")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(feature = "mpi")]
    fn envelopes_round_trip_and_damaged_bytes_are_refused_with_the_reason() {
        let env = Envelope { src: 3, step: 7, sent_us: 11, deliver_us: 13, msg: Msg::Shutdown };
        let bytes = env.to_bytes();
        let back = Envelope::from_bytes(&bytes).unwrap();
        assert_eq!((back.src, back.step, back.sent_us, back.deliver_us), (3, 7, 11, 13));
        assert!(matches!(back.msg, Msg::Shutdown));
        // Cut short, trailing bytes, nonsense: each an error, none a panic.
        for (what, damaged) in [
            ("cut", bytes[..bytes.len() - 1].to_vec()),
            ("trailing", [&bytes[..], &[0u8]].concat()),
            ("nonsense", vec![0xff; 64]),
            ("empty", Vec::new()),
        ] {
            let e = Envelope::from_bytes(&damaged).err().unwrap_or_else(|| panic!("{what}: decoded"));
            assert!(!e.is_empty(), "{what}");
        }
    }

    #[test]
    fn a_transport_failure_reaches_the_worker_as_an_error() {
        let (tx, rx) = channel::<Delivery>();
        tx.send(Err(TrainError::Worker { worker: 1, cause: "a message from worker 2 cannot be taken".into() }))
            .unwrap();
        let e = receive_within(&rx, 1, Duration::from_millis(10), "test").unwrap_err().to_string();
        assert!(e.contains("worker 2"), "{e}");
        assert!(receive_within(&rx, 1, Duration::from_millis(10), "test").unwrap().is_none());
        drop(tx);
        assert!(receive_within(&rx, 1, Duration::from_millis(10), "test").is_err());
    }
}
