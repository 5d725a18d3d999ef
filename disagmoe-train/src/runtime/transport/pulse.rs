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
//! It tells every peer (an `Abort` naming this worker and the unit), and a worker that is a process
//! of its own (MPI) ends that process too, as the stuck thread never returns to do it.

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
    /// than `limit_us`, or in a collective longer than `limit_us + timeout_us`.
    fn verdict(&self, limit_us: u64, timeout_us: u64) -> Option<String> {
        let limit = format!("more than {BUSY_LIMIT_TIMEOUTS} x --comm-timeout-s");
        if let Some(busy) = self.busy_for_us().filter(|&b| b > limit_us) {
            return Some(format!("no progress for {:.1} s on {} ({limit}): it hangs", busy as f64 / 1e6, self.doing()));
        }
        let waited = self.in_collective_for_us().filter(|&w| w > limit_us + timeout_us)?;
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

/// The heartbeat and watchdog thread of one worker (see the module doc).
pub(super) struct Heartbeat {
    stop: Option<Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Where the heartbeat thread runs: the worker's rank among `size`, its pulse, the run's time-out,
/// and whether the worker is a process of its own (then a hang ends the process).
pub(super) struct Watch {
    pub(super) rank: usize,
    pub(super) size: usize,
    pub(super) pulse: Arc<Pulse>,
    pub(super) timeout: Duration,
    pub(super) own_process: bool,
}

impl Heartbeat {
    pub(super) fn start(mut beacon: Beacon, watch: Watch) -> Self {
        let Watch { rank, size, pulse, timeout, own_process } = watch;
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
                    if let Some(cause) = pulse.verdict(limit_us, timeout_us) {
                        send_all(&|| Msg::Abort { worker: rank, cause: cause.clone() });
                        if own_process {
                            eprintln!("error: worker {rank}: {cause}");
                            std::process::exit(2);
                        }
                        return;
                    }
                    let Some(busy_us) = pulse.busy_for_us() else { continue };
                    if !send_all(&|| Msg::Heartbeat { busy_us }) {
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
        let verdict = pulse.verdict(10_000, 1_000).expect("30 ms on one task is over a 10 ms limit");
        assert!(verdict.contains("no progress") && verdict.contains("fwd experts L1 mb0 of step 2"), "{verdict}");
        // A new unit of work is progress.
        pulse.working_on("bwd experts L1 mb0 of step 2".into());
        assert_eq!(pulse.verdict(10_000, 1_000), None);
        // Waiting is not a lack of progress of this worker, unless it is inside a collective for
        // longer than the limit and a time-out.
        pulse.idle();
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(pulse.verdict(10_000, 1_000), None);
        pulse.working_on("the end of step 2".into());
        let verdict = pulse.in_collective("an all-reduce over workers [0, 1]".into(), || {
            std::thread::sleep(Duration::from_millis(30));
            pulse.verdict(10_000, 1_000)
        });
        let verdict = verdict.expect("30 ms inside an all-reduce is over 11 ms");
        assert!(verdict.contains("never joined") && verdict.contains("the end of step 2"), "{verdict}");
        assert!(verdict.contains("inside an all-reduce over workers [0, 1]"), "{verdict}");
        assert_eq!(pulse.verdict(10_000_000, 1_000), None, "out of the collective, busy again for a moment");
    }
}
