//! What the event loop runs: a [`Program`] (workers, streams, ops and their dependents), from a
//! listed [`Schedule`] ([`Listed`]) or computed op by op (`schedule::afpipe::AfPipe`).

use crate::error::{CoreError, Result};
use crate::schedule::{Dependents, OpId, OpKind, Schedule};

/// What the event loop reads of an op.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct OpInfo {
    /// Duration (a receive's latency), at least 0.
    pub secs: f64,
    /// Index of its stream among all workers' streams (in worker order, then stream order).
    pub stream: u32,
    /// The worker whose ingress a transfer uses: the receiver of a send, else its own worker
    /// (ports: worker `w`'s egress is `2w`, its ingress `2w + 1`).
    pub peer: u32,
    /// Whether it is a receive (completes with its send, plus its latency).
    pub recv: bool,
}

/// What the simulator runs: workers with their streams, and per op what the event loop reads and
/// which ops wait for it. A [`Schedule`] lists its ops ([`Listed`]);
/// [`crate::schedule::afpipe::AfPipe`] computes them from an op's index, so the planner's oracle
/// simulates AF-Pipe without building millions of ops.
pub(crate) trait Program {
    /// The schedule's name, for errors.
    fn name(&self) -> &str;
    /// Workers and their streams (the op lists of ordered streams are read; dynamic streams'
    /// are not).
    fn workers(&self) -> &[crate::schedule::Worker];
    /// Number of ops.
    fn len(&self) -> usize;
    /// What the event loop reads of `op`.
    fn op(&self, op: OpId) -> OpInfo;
    /// Whether every dependency of `op` has completed.
    fn is_ready(&self, op: OpId) -> bool;
    /// Counts `op` as done for each op that depends on it, in index order; pushes those left
    /// with nothing to wait for onto `ready`.
    fn release(&mut self, op: OpId, ready: &mut Vec<OpId>);
    /// `op` in words, for errors.
    fn describe(&self, op: OpId) -> String;
}

/// A [`Schedule`]'s ops packed for the event loop (the schedule's ops are large and the loop
/// visits them out of order, a cache miss each), with their dependents.
pub(crate) struct Listed<'a> {
    schedule: &'a Schedule,
    ops: Vec<(OpInfo, u32)>,
    dependents: Dependents,
}

impl<'a> Listed<'a> {
    /// Packs `schedule`; an error for a dependency on a missing op or counts past 32 bits.
    pub(crate) fn new(schedule: &'a Schedule) -> Result<Self> {
        let dependents = Dependents::of(schedule)?;
        let mut first_stream = Vec::with_capacity(schedule.workers.len());
        let mut streams = 0usize;
        for w in &schedule.workers {
            first_stream.push(streams);
            streams += w.streams.len();
        }
        let too_many = |what: &str| CoreError::InvalidSchedule {
            schedule: schedule.name.clone(),
            detail: format!("more than {} {what}", u32::MAX),
        };
        if streams > u32::MAX as usize || schedule.workers.len() > u32::MAX as usize {
            return Err(too_many("streams or workers"));
        }
        let mut ops = Vec::with_capacity(schedule.ops.len());
        for o in &schedule.ops {
            let peer = match o.kind {
                OpKind::Send { to, .. } => to,
                _ => o.worker,
            };
            let info = OpInfo {
                secs: o.duration_s.max(0.0),
                stream: (first_stream[o.worker] + o.stream) as u32,
                peer: u32::try_from(peer).map_err(|_| too_many("workers"))?,
                recv: matches!(o.kind, OpKind::Recv { .. }),
            };
            ops.push((info, o.deps.len() as u32));
        }
        Ok(Self { schedule, ops, dependents })
    }
}

impl Program for Listed<'_> {
    fn name(&self) -> &str {
        &self.schedule.name
    }
    fn workers(&self) -> &[crate::schedule::Worker] {
        &self.schedule.workers
    }
    fn len(&self) -> usize {
        self.ops.len()
    }
    fn op(&self, op: OpId) -> OpInfo {
        self.ops[op].0
    }
    fn is_ready(&self, op: OpId) -> bool {
        self.ops[op].1 == 0
    }
    fn release(&mut self, op: OpId, ready: &mut Vec<OpId>) {
        for &j in self.dependents.of_op(op) {
            let j = j as usize;
            self.ops[j].1 -= 1;
            if self.ops[j].1 == 0 {
                ready.push(j);
            }
        }
    }
    fn describe(&self, op: OpId) -> String {
        let o = &self.schedule.ops[op];
        format!(
            "{} of micro-batch {} layer {} on {}",
            o.kind.label(),
            o.micro_batch,
            o.layer,
            self.schedule.workers[o.worker].name
        )
    }
}
