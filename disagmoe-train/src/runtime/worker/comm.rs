//! The worker's communication: its port, the messages kept for later, its trace, and the meters
//! of a step (waits, compute, link time, bytes).
//!
//! Every wait of the compute stream for data is exposed communication (`exposed_comm_s`); each is
//! also split at the arrival that ends it: the part after the message was sent waited for data on
//! the wire (`in_flight_wait_s`), the part before for data a peer had not computed yet.

use std::ops::Sub;

use disagmoe_core::exchange::ExchangePrecision;

use crate::error::{Result, TrainError};
use crate::runtime::collectives::Transit;
use crate::runtime::msg::{Envelope, Msg, ReduceData};
use crate::runtime::trace::{Tracer, COMM, COMPUTE};
use crate::runtime::transport::{now_us, Port, Pulse};

/// What a worker measured so far, microseconds and bytes; a step's share is the difference of two
/// readings.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct StepMeters {
    /// Waits for data already on the wire.
    pub(crate) wait_wire_us: u64,
    /// Waits for data a peer had not computed yet.
    pub(crate) wait_peer_us: u64,
    /// Compute.
    pub(crate) compute_us: u64,
    /// Time the worker's messages occupied the (emulated) link.
    pub(crate) link_us: u64,
    /// Bytes sent: messages of the token exchange, and each all-reduce as a ring sends it
    /// (2(n-1)/n of the data per member), whatever reduces it.
    pub(crate) bytes_sent: u64,
    /// Of them, the token exchange's (packed payloads), by kind (`Msg::exchange_kind`).
    pub(crate) exchange_bytes: [u64; 8],
    /// Payload bytes copied from the backend's tensors to the host (`super::payload`).
    pub(crate) payload_host_bytes: u64,
}

impl Sub for StepMeters {
    type Output = StepMeters;

    fn sub(self, start: StepMeters) -> StepMeters {
        StepMeters {
            wait_wire_us: self.wait_wire_us - start.wait_wire_us,
            wait_peer_us: self.wait_peer_us - start.wait_peer_us,
            compute_us: self.compute_us - start.compute_us,
            link_us: self.link_us - start.link_us,
            bytes_sent: self.bytes_sent - start.bytes_sent,
            exchange_bytes: std::array::from_fn(|i| self.exchange_bytes[i] - start.exchange_bytes[i]),
            payload_host_bytes: self.payload_host_bytes - start.payload_host_bytes,
        }
    }
}

/// A worker's side of the transport.
pub(crate) struct Comm {
    pub(crate) rank: usize,
    /// Workers of the run.
    pub(crate) workers: usize,
    /// The pass whose messages are taken now (later passes' are kept).
    pub(crate) step: usize,
    port: Port,
    /// Messages of a later pass, and all-reduce chunks not asked for yet.
    pub(crate) later: Vec<Envelope>,
    /// Longest wait for any message before the worker gives up on its peers.
    timeout: std::time::Duration,
    pub(crate) tracer: Tracer,
    pub(crate) meters: StepMeters,
    /// What the exchange's payloads travel in between workers.
    exchange: ExchangePrecision,
}

impl Comm {
    pub(crate) fn new(
        port: Port,
        workers: usize,
        timeout: std::time::Duration,
        trace: bool,
        exchange: ExchangePrecision,
    ) -> Self {
        let rank = port.rank();
        Self {
            rank,
            workers,
            step: 0,
            port,
            later: Vec::new(),
            timeout,
            tracer: Tracer::new(trace, rank),
            meters: StepMeters::default(),
            exchange,
        }
    }

    /// Sends `msg` to `dst`, traced; a message of the token exchange to another worker is packed
    /// in the run's exchange precision ([`Msg::pack`]) and its bytes counted (a message to oneself
    /// never leaves and stays f32; all-reduces are counted by the worker's `all_reduce`, whatever
    /// carries them).
    pub(crate) fn send(&mut self, dst: usize, msg: Msg) -> Result<()> {
        let leaves = msg.exchange_kind().filter(|_| dst != self.rank);
        let msg = if leaves.is_some() { msg.pack(&self.exchange) } else { msg };
        let (kind, at, bytes) = (msg.kind(), msg.at(), msg.payload_bytes() as u64);
        if let Some(k) = leaves {
            self.meters.bytes_sent += bytes;
            self.meters.exchange_bytes[k] += bytes;
        }
        let (sent, delivered, wire) = self.port.send(dst, self.step, msg)?;
        self.meters.link_us += wire;
        let name = || match at {
            Some((mb, layer)) => format!("{kind} L{layer} mb{mb} -> {dst}"),
            None => format!("{kind} -> {dst}"),
        };
        self.tracer.span_bytes(name, "send", COMM, sent, delivered, bytes);
        Ok(())
    }

    /// This worker starts a unit of work, `what` (its watchdog's progress mark).
    pub(crate) fn working_on(&self, what: String) {
        self.port.pulse().working_on(what);
    }

    /// This worker waits without a word (the test-only fault of a member that never joins).
    pub(crate) fn idle(&self) {
        self.port.pulse().idle();
    }

    /// A message that has arrived already, if any.
    pub(crate) fn poll(&mut self) -> Result<Option<Envelope>> {
        self.port.recv(std::time::Duration::ZERO)
    }

    /// Waits for the next message, counting the wait as exposed communication (the part after the
    /// message was sent as time on the wire); a worker that hears nothing for the time-out stops.
    pub(crate) fn wait_for_message(&mut self, at: impl FnOnce() -> String) -> Result<Envelope> {
        let t0 = now_us();
        let env = match self.port.recv(self.timeout)? {
            Some(env) => env,
            None => return Err(self.stalled(at())),
        };
        let t1 = now_us();
        let in_flight_from = env.sent_us.clamp(t0, t1);
        self.meters.wait_wire_us += t1 - in_flight_from;
        self.meters.wait_peer_us += in_flight_from - t0;
        self.tracer.span(|| format!("wait ({})", env.msg.kind()), "wait", COMPUTE, t0, t1);
        Ok(env)
    }

    /// Sends `msg` to worker 0; worker 0 returns it with every other worker's message of the same
    /// kind (the others return an empty list).
    pub(crate) fn collect_on_zero(&mut self, msg: Msg, what: &str) -> Result<Vec<Msg>> {
        if self.rank != 0 {
            self.send(0, msg)?;
            return Ok(Vec::new());
        }
        let kind = std::mem::discriminant(&msg);
        let mut all = vec![msg];
        let (early, mut later): (Vec<Envelope>, Vec<Envelope>) =
            std::mem::take(&mut self.later).into_iter().partition(|e| std::mem::discriminant(&e.msg) == kind);
        all.extend(early.into_iter().map(|e| e.msg));
        while all.len() < self.workers {
            let env = match self.port.recv(self.timeout)? {
                Some(env) => env,
                None => return Err(self.stalled(format!("gathering {what}"))),
            };
            match env.msg {
                Msg::Abort { worker, cause } => return Err(TrainError::Worker { worker, cause }),
                m if std::mem::discriminant(&m) == kind => all.push(m),
                m => later.push(Envelope { msg: m, ..env }),
            }
        }
        self.later.extend(later);
        Ok(all)
    }

    /// The error of a wait `at` that heard nothing for the time-out, naming the peers silent for
    /// half of it (heartbeats included: a live peer speaks every quarter) where the transport
    /// can tell.
    fn stalled(&self, at: String) -> TrainError {
        TrainError::Stalled {
            worker: self.rank,
            seconds: self.timeout.as_secs_f64(),
            at,
            unreachable: self.port.unreachable(self.timeout / 2),
        }
    }

    /// Tells every other worker that this one failed.
    pub(crate) fn abort(&mut self, cause: &str) {
        for w in (0..self.workers).filter(|&w| w != self.rank) {
            let _ = self.port.send(w, self.step, Msg::Abort { worker: self.rank, cause: cause.into() });
        }
    }
}

/// The ring's chunks travel as `Reduce` messages through the port, tagged by the all-reduce's
/// number; chunks of other all-reduces and messages of the token exchange that come meanwhile are
/// kept for later.
impl Transit for Comm {
    fn send_chunk(&mut self, dst: usize, op: u64, seq: u64, data: ReduceData) -> Result<()> {
        self.send(dst, Msg::Reduce { op, seq, data })
    }

    fn recv_chunk(&mut self, src: usize, op: u64, seq: u64) -> Result<ReduceData> {
        loop {
            let found = self.later.iter().position(|e| {
                e.src == src && matches!(&e.msg, Msg::Reduce { op: o, seq: s, .. } if *o == op && *s == seq)
            });
            if let Some(pos) = found {
                let Msg::Reduce { data, .. } = self.later.remove(pos).msg else { unreachable!("matched a reduce") };
                return Ok(data);
            }
            let step = self.step;
            let env = self.wait_for_message(|| format!("in an all-reduce of step {step} for worker {src}'s part"))?;
            if let Msg::Abort { worker, cause } = env.msg {
                return Err(TrainError::Worker { worker, cause });
            }
            self.later.push(env);
        }
    }

    fn pulse(&self) -> &Pulse {
        self.port.pulse()
    }
}
