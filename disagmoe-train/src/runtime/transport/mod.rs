//! Moving messages between workers: the envelope's bytes (codec and reassembly of long ones), the
//! [`Endpoint`] trait, the in-process `local` transport, the worker's [`Port`] (heartbeats,
//! delivery order) and link emulation. What the messages are is [`super::msg`]'s.
//!
//! A send never blocks the compute stream: the endpoint hands the message to the transport (a
//! channel here, a communication thread for MPI) and returns. Link emulation stamps each message
//! with the time a link of the given speed would deliver it (the sender's NIC sends one message at a
//! time, FIFO), and the receiving endpoint holds it back until then, so transfers take wall time
//! without spending CPU. Messages a worker sends to itself never touch the link.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::msg::{Envelope, Msg};

#[cfg(feature = "wire")]
mod codec;
mod pulse;
#[cfg(feature = "wire")]
pub mod rounds;
use crate::error::{Result, TrainError};
#[cfg(feature = "wire")]
pub use codec::{Reassembly, CLAIM_PER_BYTE, CLAIM_SLACK, TAG_HEAD, TAG_PIECE, TAG_WHOLE};
use pulse::{Heartbeat, Watch};
pub use pulse::{Liveness, Pulse, BUSY_LIMIT_TIMEOUTS};

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
    /// A handle another thread sends heartbeats through (to a peer, bypassing link emulation
    /// and the metrics); `None` where the transport has none (then a wait's time-out is silence).
    fn beacon(&self) -> Option<Beacon> {
        None
    }
    /// When this worker last heard from each peer, where the transport keeps it (see
    /// [`Liveness`]); `None`: a stall cannot say who is silent.
    fn liveness(&self) -> Option<Arc<Liveness>> {
        None
    }
    /// Ends the whole job with an exit code, from any thread, when the worker is a process of its
    /// own (the watchdog's last resort; MPI's `MPI_Abort`).
    fn end_job(&self) -> fn(i32) -> ! {
        std::process::exit
    }
}

/// Sends an envelope to a peer from the heartbeat thread; `false` once the transport is gone.
pub type Beacon = Box<dyn FnMut(usize, Envelope) -> bool + Send>;

/// Link emulation and delivery order on top of any [`Endpoint`]: what workers use.
///
/// **Time-outs are about progress, not silence** ([`pulse`]): while its worker is busy, a port's
/// heartbeat thread tells every peer so; a wait ([`Port::recv`]) ends empty only after `timeout`
/// in which no message came and no peer said it was busy. A worker on one unit of work for more
/// than [`BUSY_LIMIT_TIMEOUTS`] time-outs is reported as hung by its own watchdog.
pub struct Port {
    // Dropped first: the heartbeat stops before the endpoint it sends through.
    _heartbeat: Option<Heartbeat>,
    pulse: Arc<Pulse>,
    liveness: Option<Arc<Liveness>>,
    inner: Box<dyn Endpoint>,
    link: Option<LinkModel>,
    nic_free_us: f64,
    rx_free_us: f64,
    due: BinaryHeap<Reverse<(u64, u64)>>,
    held: HashMap<u64, Envelope>,
    seq: u64,
}

impl Port {
    /// Wraps an endpoint; `link` turns on emulation; `timeout` is the run's communication
    /// time-out (it paces the heartbeat and bounds how long a worker may stay on one unit of
    /// work); `own_process`: the worker is a process of its own, which its watchdog ends on a hang.
    pub fn new(inner: Box<dyn Endpoint>, link: Option<LinkModel>, timeout: Duration, own_process: bool) -> Self {
        let pulse = Arc::new(Pulse::default());
        pulse.busy();
        let liveness = inner.liveness();
        let heartbeat = inner.beacon().map(|b| {
            let (rank, size, pulse, liveness) = (inner.rank(), inner.size(), pulse.clone(), liveness.clone());
            let end_job = own_process.then(|| inner.end_job());
            Heartbeat::start(b, Watch { rank, size, pulse, timeout, liveness, end_job })
        });
        Self {
            _heartbeat: heartbeat,
            pulse,
            liveness,
            inner,
            link,
            nic_free_us: 0.0,
            rx_free_us: 0.0,
            due: BinaryHeap::new(),
            held: HashMap::new(),
            seq: 0,
        }
    }

    /// What this worker's heartbeat reports: a worker that blocks outside [`Port::recv`] on its
    /// peers (an MPI collective) marks itself idle meanwhile.
    pub fn pulse(&self) -> &Pulse {
        &self.pulse
    }

    /// The peers this worker has heard nothing from for more than `quiet`, in words (see
    /// [`Liveness::unreachable`]); `None` when all have spoken or the transport keeps no stamps.
    pub fn unreachable(&self, quiet: Duration) -> Option<String> {
        self.liveness.as_ref()?.unreachable(self.rank(), quiet.as_micros() as u64)
    }

    /// Takes in an arrived envelope: a heartbeat is progress of its sender (a hung one is ended by
    /// its own watchdog), a sign of life only that; anything else is held for delivery.
    fn take_in(&mut self, env: Envelope, progress_at: &mut u64) {
        match env.msg {
            Msg::Heartbeat { .. } => *progress_at = now_us(),
            Msg::Alive => {}
            _ => self.hold(env),
        }
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

    /// The next delivered envelope (in delivery-time order); `None` once `timeout` has passed
    /// with no message and no peer busy (zero: just look). A message that has arrived but is
    /// still on the emulated wire is waited for past the time-out: it is not a stall.
    pub fn recv(&mut self, timeout: Duration) -> Result<Option<Envelope>> {
        let pulse = self.pulse.clone();
        pulse.waiting(|| self.wait(timeout))
    }

    fn wait(&mut self, timeout: Duration) -> Result<Option<Envelope>> {
        let timeout_us = timeout.as_micros() as u64;
        let mut progress_at = now_us();
        loop {
            while let Some(env) = self.inner.arrive(Duration::ZERO)? {
                self.take_in(env, &mut progress_at);
            }
            let now = now_us();
            let deadline = progress_at + timeout_us;
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
                self.take_in(env, &mut progress_at);
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
    fn beacon(&self) -> Option<Beacon> {
        let peers = self.peers.clone();
        Some(Box::new(move |dst, env| {
            let _ = peers[dst].send(Ok(env));
            true
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
