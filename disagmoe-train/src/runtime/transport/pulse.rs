//! A worker's pulse: what it is doing and since when, told to its peers by a heartbeat thread that
//! is also the worker's watchdog.
//!
//! **Time-outs are about progress on due work, not silence.** A worker marks each unit of work it
//! starts (a task of the step, the step's end, a checkpoint: [`Pulse::working_on`]) and every wait
//! for its peers. While it is busy, its heartbeat tells every peer so every `timeout / 4` (at most
//! 5 s), with how long the current unit has taken; a peer waiting for data keeps waiting while
//! heartbeats come ([`super::Port::recv`]). The watchdog ends the run, with one line naming the
//! worker and what it owed, when
//! - the worker has spent more than [`BUSY_LIMIT_TIMEOUTS`] time-outs on one unit of work (a stuck
//!   compute thread; a worker that keeps finishing tasks is never suspected, however long it has
//!   been busy), or
//! - it has waited inside a collective that blocks on its peers (an MPI all-reduce) for longer
//!   than any member may be busy before joining, plus one time-out: a member never joined it (a
//!   deadlocked collective; a wait in the port has its own time-out).
//!
//! - it has waited inside such a collective for more than one time-out while a peer has said
//!   nothing at all for more than one time-out ([`Liveness`]): that peer cannot be reached.
//!
//! It tells every peer (an `Abort` naming this worker and the unit), and a worker that is a process
//! of its own (MPI) ends the job too (`MPI_Abort`), as the stuck thread never returns to do it.
//!
//! **Who cannot be reached.** The heartbeat also speaks while its worker waits (an `Alive`, which
//! is not progress: two waiting workers must not keep each other waiting for ever), so every live
//! peer is heard from at least every `timeout / 4`. Where the transport keeps a [`Liveness`] (the
//! receiving side stamps every frame by its sender, also while the worker is blocked elsewhere), a
//! worker that stalls names the peers it has not heard from: one peer silent is that peer's link
//! or process; every peer silent is this worker's own link.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{now_us, Beacon};
use crate::runtime::msg::{Envelope, Msg};

/// How long a worker may spend on one unit of work, in multiples of the time-out, before its
/// watchdog reports it as hung (30 x the default 60 s: half an hour; a first step's autotuning or
/// a big checkpoint write fits).
pub const BUSY_LIMIT_TIMEOUTS: u32 = 30;

/// Whether a worker is busy (computing, writing, reducing) or waiting for its peers, what it is
/// doing, for its heartbeat and its watchdog.
#[derive(Debug, Default)]
pub struct Pulse {
    /// [`now_us`] when the worker started its current unit of work or last stopped waiting; 0
    /// while it waits.
    busy_since_us: AtomicU64,
    /// [`now_us`] when the worker entered a collective that blocks on its peers; 0 outside one.
    collective_since_us: AtomicU64,
    /// The current unit of work, in words (`fwd experts L1 mb0 of step 2`).
    doing: Mutex<String>,
    /// The collective it waits in, in words (`an all-reduce over workers [0, 1]`).
    collective: Mutex<String>,
}

impl Pulse {
    /// The worker stops waiting (keeps the earlier start if it was busy already).
    pub fn busy(&self) {
        let _ = self.busy_since_us.compare_exchange(0, now_us().max(1), Ordering::Relaxed, Ordering::Relaxed);
    }

    /// The worker waits for messages (a peer's progress, not its own).
    pub fn idle(&self) {
        self.busy_since_us.store(0, Ordering::Relaxed);
    }

    /// The worker starts a unit of work, `what` (progress: the time without any starts again).
    pub fn working_on(&self, what: String) {
        *self.doing.lock().unwrap_or_else(|e| e.into_inner()) = what;
        self.busy_since_us.store(now_us().max(1), Ordering::Relaxed);
    }

    /// Runs `wait` (something that blocks on the peers) marked as waiting, then busy again.
    pub fn waiting<T>(&self, wait: impl FnOnce() -> T) -> T {
        self.idle();
        let got = wait();
        self.busy();
        got
    }

    /// [`Pulse::waiting`] for a collective that blocks on its peers outside the port (`what`, e.g.
    /// an MPI all-reduce over a group): the watchdog bounds it.
    pub fn in_collective<T>(&self, what: String, wait: impl FnOnce() -> T) -> T {
        *self.collective.lock().unwrap_or_else(|e| e.into_inner()) = what;
        self.collective_since_us.store(now_us().max(1), Ordering::Relaxed);
        let got = self.waiting(wait);
        self.collective_since_us.store(0, Ordering::Relaxed);
        got
    }

    /// How long the worker has been on its current unit of work, or `None` while it waits.
    pub fn busy_for_us(&self) -> Option<u64> {
        since(&self.busy_since_us)
    }

    /// How long the worker has waited in a collective, or `None` outside one.
    fn in_collective_for_us(&self) -> Option<u64> {
        since(&self.collective_since_us)
    }

    /// The current unit of work, in words.
    pub fn doing(&self) -> String {
        self.doing.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// What the watchdog finds wrong, if anything: the worker has been on one unit of work longer
    /// than `limit_us`, in a collective longer than `limit_us + timeout_us`, or in one longer than
    /// `timeout_us` while `unreachable` names a peer silent as long.
    fn verdict(&self, limit_us: u64, timeout_us: u64, unreachable: impl FnOnce() -> Option<String>) -> Option<String> {
        let limit = format!("more than {BUSY_LIMIT_TIMEOUTS} x --comm-timeout-s");
        if let Some(busy) = self.busy_for_us().filter(|&b| b > limit_us) {
            return Some(format!("no progress for {:.1} s on {} ({limit}): it hangs", busy as f64 / 1e6, self.doing()));
        }
        let waited = self.in_collective_for_us().filter(|&w| w > timeout_us)?;
        if let Some(gone) = unreachable() {
            return Some(format!(
                "waited {:.1} s inside {} during {}: {gone}",
                waited as f64 / 1e6,
                self.collective.lock().unwrap_or_else(|e| e.into_inner()),
                self.doing()
            ));
        }
        if waited <= limit_us + timeout_us {
            return None;
        }
        Some(format!(
            "waited {:.1} s inside {} during {} ({limit}, longer than any member may be busy before joining): a member never joined it, the collective is deadlocked",
            waited as f64 / 1e6,
            self.collective.lock().unwrap_or_else(|e| e.into_inner()),
            self.doing()
        ))
    }
}

fn since(stamp: &AtomicU64) -> Option<u64> {
    match stamp.load(Ordering::Relaxed) {
        0 => None,
        t => Some(now_us().saturating_sub(t)),
    }
}

/// When a worker last heard from each peer, stamped by its transport's receiving side (a thread of
/// its own, so the stamps go on while the worker is blocked in a collective), and the peer whose
/// message is being taken in right now (a transfer cut midway blocks the receiving side on it).
#[derive(Debug)]
pub struct Liveness {
    /// [`now_us`] of the last frame from each rank (the start for those not heard from yet).
    heard_us: Vec<AtomicU64>,
    /// The rank a message is being received from, plus one (0: none), and since when.
    receiving: AtomicU64,
    receiving_since_us: AtomicU64,
}

impl Liveness {
    /// The stamps of a job of `size` workers, every peer heard from now.
    pub fn new(size: usize) -> Arc<Self> {
        let now = now_us();
        Arc::new(Self {
            heard_us: (0..size).map(|_| AtomicU64::new(now)).collect(),
            receiving: AtomicU64::new(0),
            receiving_since_us: AtomicU64::new(0),
        })
    }

    /// A frame from `src` has arrived.
    pub fn heard(&self, src: usize) {
        if let Some(h) = self.heard_us.get(src) {
            h.store(now_us(), Ordering::Relaxed);
        }
    }

    /// The receiving side starts taking in a message from `src` (`None`: it is done).
    pub fn receiving(&self, src: Option<usize>) {
        self.receiving_since_us.store(now_us(), Ordering::Relaxed);
        self.receiving.store(src.map_or(0, |s| s as u64 + 1), Ordering::Relaxed);
    }

    /// The peers worker `rank` has heard nothing from for more than `quiet_us`, in words (`None`
    /// when every peer has spoken since): the one a message stopped arriving from midway; else a
    /// single silent peer, or several; or, when every peer is silent, this worker's own link.
    pub fn unreachable(&self, rank: usize, quiet_us: u64) -> Option<String> {
        let now = now_us();
        let secs = |us: u64| us as f64 / 1e6;
        if let Some(src) = self.receiving.load(Ordering::Relaxed).checked_sub(1) {
            let since = now.saturating_sub(self.receiving_since_us.load(Ordering::Relaxed));
            if since > quiet_us {
                return Some(format!(
                    "worker {src} cannot be reached: a message from it stopped arriving midway {:.1} s ago (its link is down or its process is gone)",
                    secs(since)
                ));
            }
        }
        let silent: Vec<(usize, u64)> = (0..self.heard_us.len())
            .filter(|&p| p != rank)
            .map(|p| (p, now.saturating_sub(self.heard_us[p].load(Ordering::Relaxed))))
            .filter(|&(_, quiet)| quiet > quiet_us)
            .collect();
        let least = secs(silent.iter().map(|&(_, q)| q).min()?);
        let names = silent.iter().map(|(p, _)| p.to_string()).collect::<Vec<_>>().join(", ");
        Some(match silent.len() {
            n if n + 1 == self.heard_us.len() && n > 1 => format!(
                "no word from any peer (workers {names}) for {least:.1} s or more, heartbeats included: this worker's own link is down, or every peer is gone"
            ),
            1 => format!(
                "worker {names} cannot be reached: no word from it for {least:.1} s, heartbeats included (its link is down or its process is gone)"
            ),
            _ => format!(
                "workers {names} cannot be reached: no word from them for {least:.1} s or more, heartbeats included (their links are down or their processes are gone)"
            ),
        })
    }
}

/// The heartbeat and watchdog thread of one worker (see the module doc).
pub(super) struct Heartbeat {
    stop: Option<Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Where the heartbeat thread runs: the worker's rank among `size`, its pulse, the run's time-out,
/// the transport's [`Liveness`] if it keeps one, and how a hang ends the job when the worker is a
/// process of its own (`None`: the worker is a thread; its peers are told and end the run).
pub(super) struct Watch {
    pub(super) rank: usize,
    pub(super) size: usize,
    pub(super) pulse: Arc<Pulse>,
    pub(super) timeout: Duration,
    pub(super) liveness: Option<Arc<Liveness>>,
    pub(super) end_job: Option<fn(i32) -> !>,
}

impl Heartbeat {
    pub(super) fn start(mut beacon: Beacon, watch: Watch) -> Self {
        let Watch { rank, size, pulse, timeout, liveness, end_job } = watch;
        let interval = (timeout / 4).clamp(Duration::from_millis(1), Duration::from_secs(5));
        let limit_us = (timeout * BUSY_LIMIT_TIMEOUTS).as_micros() as u64;
        let timeout_us = timeout.as_micros() as u64;
        let (stop, stopped) = channel::<()>();
        let thread = std::thread::Builder::new()
            .name(format!("heartbeat-{rank}"))
            .spawn(move || {
                let mut send_all = |msg: &dyn Fn() -> Msg| {
                    let now = now_us();
                    (0..size).filter(|&d| d != rank).all(|dst| {
                        beacon(dst, Envelope { src: rank, step: 0, sent_us: now, deliver_us: now, msg: msg() })
                    })
                };
                while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(interval) {
                    let unreachable = || liveness.as_ref().and_then(|l| l.unreachable(rank, timeout_us));
                    if let Some(cause) = pulse.verdict(limit_us, timeout_us, unreachable) {
                        send_all(&|| Msg::Abort { worker: rank, cause: cause.clone() });
                        if let Some(end_job) = end_job {
                            eprintln!("error: worker {rank}: {cause}");
                            end_job(2);
                        }
                        return;
                    }
                    // Busy: progress; waiting: only a sign of life.
                    let beat = pulse.busy_for_us().map_or(Msg::Alive, |busy_us| Msg::Heartbeat { busy_us });
                    if !send_all(&|| beat.clone()) {
                        return;
                    }
                }
            })
            .expect("spawn a heartbeat thread");
        Self { stop: Some(stop), thread: Some(thread) }
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_watchdog_counts_time_on_one_unit_of_work_not_time_busy() {
        let pulse = Pulse::default();
        pulse.working_on("fwd experts L1 mb0 of step 2".into());
        std::thread::sleep(Duration::from_millis(30));
        let verdict = pulse.verdict(10_000, 1_000, || None).expect("30 ms on one task is over a 10 ms limit");
        assert!(verdict.contains("no progress") && verdict.contains("fwd experts L1 mb0 of step 2"), "{verdict}");
        // A new unit of work is progress.
        pulse.working_on("bwd experts L1 mb0 of step 2".into());
        assert_eq!(pulse.verdict(10_000, 1_000, || None), None);
        // Waiting is not a lack of progress of this worker, unless it is inside a collective for
        // longer than the limit and a time-out.
        pulse.idle();
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(pulse.verdict(10_000, 1_000, || None), None);
        pulse.working_on("the end of step 2".into());
        let verdict = pulse.in_collective("an all-reduce over workers [0, 1]".into(), || {
            std::thread::sleep(Duration::from_millis(30));
            pulse.verdict(10_000, 1_000, || None)
        });
        let verdict = verdict.expect("30 ms inside an all-reduce is over 11 ms");
        assert!(verdict.contains("never joined") && verdict.contains("the end of step 2"), "{verdict}");
        assert!(verdict.contains("inside an all-reduce over workers [0, 1]"), "{verdict}");
        assert_eq!(pulse.verdict(10_000_000, 1_000, || None), None, "out of the collective, busy again for a moment");
    }

    /// Who cannot be reached: one silent peer by name, every peer silent as this worker's own
    /// link, a transfer stuck midway by its sender; nobody while every peer has spoken.
    #[test]
    fn liveness_names_the_peers_silent_for_longer_than_asked() {
        let alive = Liveness::new(4);
        assert_eq!(alive.unreachable(0, 10_000), None, "everyone heard from at the start");
        std::thread::sleep(Duration::from_millis(30));
        alive.heard(2);
        alive.heard(3);
        let line = alive.unreachable(0, 10_000).expect("worker 1 silent for 30 ms");
        assert!(line.starts_with("worker 1 cannot be reached: no word from it for 0.0"), "{line}");
        // Worker 1's own view: every peer silent but 2 and 3 just spoke; then all of them silent.
        assert!(alive.unreachable(1, 10_000).unwrap().starts_with("worker 0 cannot be reached"));
        std::thread::sleep(Duration::from_millis(30));
        let line = alive.unreachable(1, 10_000).unwrap();
        assert!(line.starts_with("no word from any peer (workers 0, 2, 3)") && line.contains("own link"), "{line}");
        let line = alive.unreachable(2, 10_000).unwrap();
        assert!(line.starts_with("workers 0, 1, 3 cannot be reached") || line.contains("any peer"), "{line}");
        // A message from worker 3 is being taken in and has stalled: worker 3 is named.
        for p in 0..4 {
            alive.heard(p);
        }
        alive.receiving(Some(3));
        assert_eq!(alive.unreachable(0, 10_000), None);
        std::thread::sleep(Duration::from_millis(30));
        let line = alive.unreachable(0, 10_000).unwrap();
        assert!(line.starts_with("worker 3 cannot be reached: a message from it stopped arriving midway"), "{line}");
        alive.receiving(None);
        assert!(alive.unreachable(0, 100_000).is_none());
    }

    /// Inside a collective, a peer silent for a time-out ends the wait at once (not after the
    /// busy limit), naming the peer and the collective.
    #[test]
    fn a_collective_waiting_on_a_silent_peer_is_ended_after_one_time_out() {
        let pulse = Pulse::default();
        pulse.working_on("the end of step 4".into());
        let verdict = pulse.in_collective("an all-reduce over workers [0, 1]".into(), || {
            assert_eq!(pulse.verdict(10_000_000, 1_000, || Some("worker 1 cannot be reached".into())), None);
            std::thread::sleep(Duration::from_millis(5));
            let no_one = pulse.verdict(10_000_000, 1_000, || None);
            (no_one, pulse.verdict(10_000_000, 1_000, || Some("worker 1 cannot be reached".into())))
        });
        assert_eq!(verdict.0, None, "everyone alive: members may be busy up to the limit");
        let line = verdict.1.expect("a silent member after a time-out");
        assert!(
            line.contains("inside an all-reduce over workers [0, 1] during the end of step 4: worker 1 cannot"),
            "{line}"
        );
    }
}
