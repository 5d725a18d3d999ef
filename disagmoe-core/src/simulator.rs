//! Discrete-event simulation of a [`Schedule`] on its modelled resources.
//!
//! Resources: the GPUs of each worker (one compute op at a time, shared by its compute streams,
//! backward streams first), and each worker's network port in two directions (egress, ingress).
//! Transfers are flows: a send uses the sender's egress and the receiver's ingress, a collective
//! both of its own worker's, and flows sharing a port split it max-min fairly (progressive
//! filling), so a port is never idle while a flow through it could move.
//! Streams run one op at a time; an ordered stream in program order, a dynamic stream
//! earliest-ready first. Receives complete when their send does, or `duration_s` (a link's
//! latency) after it.
//!
//! [`simulate`] returns start and end times per op; [`SimReport::from_trace`] turns them into the
//! step time, bubble time, exposed (non-overlapped) communication and per-resource utilisation.

use crate::allocator::search::StepTimeOracle;
use crate::allocator::Allocation;
use crate::cost::CostModel;
use crate::error::{CoreError, Result};
use crate::schedule::{Dependents, OpId, OpKind, Schedule};
use serde::{Deserialize, Serialize};
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Start and end time of every op.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Trace {
    /// Start time per op, seconds.
    pub start: Vec<f64>,
    /// End time per op, seconds.
    pub end: Vec<f64>,
    /// Completion time of the last op.
    pub step_s: f64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Time(f64);
impl Eq for Time {}
impl PartialOrd for Time {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Time {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

struct StreamState {
    worker: usize,
    compute: bool,
    ordered: bool,
    /// Program order (ordered streams only).
    ops: Vec<OpId>,
    pos: usize,
    heap: BinaryHeap<Reverse<(Time, OpId)>>,
    busy: bool,
}

/// A transfer in flight: its ports, the seconds of work left at full speed as of `since`, and its
/// rate (fraction of full speed).
struct Flow {
    op: OpId,
    ports: [usize; 2],
    left: f64,
    since: f64,
    rate: f64,
    /// Bumped whenever the finish time changes, so older entries of the finish heap are stale.
    version: u64,
    /// Whether the finish heap holds an entry of the current version.
    queued: bool,
    live: bool,
}

/// The flows in flight and their max-min fair rates.
///
/// Flows live in slots indexed per port, so the flows whose rate can change when a flow starts or
/// finishes (those connected to its ports through shared ports) are found by a search over that
/// component alone, and finish times sit in a heap refreshed only for the flows whose rate was
/// recomputed. An event therefore costs the size of its component, not of the whole network.
///
/// While no port carries more than two flows (AF-Pipe's ring almost always: each worker sends
/// activations and gradients on two streams, to two neighbours), the max-min fair rate of a flow
/// is local: 1/2 if one of its ports is shared, else 1 (progressive filling freezes every flow
/// of a shared port at 1/2 in turn, and the flows alone on both ports at 1). An event then
/// recomputes only the flows through the ports it touched, whose sharing it changed; the rates
/// are the same, bit for bit, as the component's progressive filling gives.
struct Network {
    flows: Vec<Flow>,
    free: Vec<usize>,
    by_port: Vec<Vec<usize>>,
    /// Ports carrying three flows or more.
    crowded: usize,
    /// Whether every rate is the local one (no port was crowded at the last rebalance).
    rates_local: bool,
    finish: BinaryHeap<Reverse<(Time, usize, u64)>>,
    // Scratch of `rebalance`, kept to avoid allocating per event.
    port_seen: Vec<bool>,
    flow_seen: Vec<bool>,
    cap: Vec<f64>,
    count: Vec<usize>,
    queue: Vec<usize>,
    members: Vec<usize>,
    old_rates: Vec<f64>,
    frozen: Vec<bool>,
}

impl Network {
    fn new(n_ports: usize) -> Self {
        Self {
            flows: Vec::new(),
            free: Vec::new(),
            by_port: vec![Vec::new(); n_ports],
            crowded: 0,
            rates_local: true,
            finish: BinaryHeap::new(),
            port_seen: vec![false; n_ports],
            flow_seen: Vec::new(),
            cap: vec![1.0; n_ports],
            count: vec![0; n_ports],
            queue: Vec::new(),
            members: Vec::new(),
            old_rates: Vec::new(),
            frozen: Vec::new(),
        }
    }

    /// Adds a flow of `secs` seconds at full speed; its rate is set by the next `rebalance` of
    /// one of its ports.
    fn start(&mut self, op: OpId, ports: [usize; 2], secs: f64, now: f64) -> usize {
        let flow = Flow { op, ports, left: secs, since: now, rate: 1.0, version: 0, queued: false, live: true };
        let slot = match self.free.pop() {
            Some(slot) => {
                let version = self.flows[slot].version + 1;
                self.flows[slot] = Flow { version, ..flow };
                slot
            }
            None => {
                self.flows.push(flow);
                self.flow_seen.push(false);
                self.flows.len() - 1
            }
        };
        for p in ports {
            self.by_port[p].push(slot);
            if self.by_port[p].len() == 3 {
                self.crowded += 1;
            }
        }
        slot
    }

    /// Recomputes the rates of the flows connected (through shared ports) to the `touched`
    /// ports; flows elsewhere keep their rates, which are unaffected.
    fn rebalance(&mut self, touched: &[usize], now: f64) {
        if self.crowded == 0 && self.rates_local {
            for &p in touched {
                for i in 0..self.by_port[p].len() {
                    let k = self.by_port[p][i];
                    let shared = self.flows[k].ports.iter().any(|&q| self.by_port[q].len() > 1);
                    self.set_rate(k, if shared { 0.5 } else { 1.0 }, now);
                }
            }
            return;
        }
        self.rates_local = self.crowded == 0;
        // 1. The component: breadth-first over ports and the flows through them.
        let (flows, by_port) = (&mut self.flows, &self.by_port);
        let (queue, members) = (&mut self.queue, &mut self.members);
        let (port_seen, flow_seen) = (&mut self.port_seen, &mut self.flow_seen);
        queue.clear();
        members.clear();
        for &p in touched {
            if !std::mem::replace(&mut port_seen[p], true) {
                queue.push(p);
            }
        }
        let mut i = 0;
        while i < queue.len() {
            for &k in &by_port[queue[i]] {
                if !std::mem::replace(&mut flow_seen[k], true) {
                    members.push(k);
                    for q in flows[k].ports {
                        if !std::mem::replace(&mut port_seen[q], true) {
                            queue.push(q);
                        }
                    }
                }
            }
            i += 1;
        }
        for &p in queue.iter() {
            port_seen[p] = false;
        }
        // 2. New rates. A flow whose rate changed is brought up to now at its old rate and gets
        // a new finish time; the others keep theirs.
        let old = &mut self.old_rates;
        old.clear();
        old.extend(members.iter().map(|&k| flows[k].rate));
        fill(flows, members, &mut self.cap, &mut self.count, &mut self.frozen);
        for i in 0..members.len() {
            let (k, was) = (self.members[i], self.old_rates[i]);
            self.flow_seen[k] = false;
            let rate = std::mem::replace(&mut self.flows[k].rate, was);
            self.set_rate(k, rate, now);
        }
    }

    /// Gives flow `k` its new `rate` as of `now`: when it changed (or the flow is new), the work
    /// done at the old rate is counted and the finish time requeued.
    fn set_rate(&mut self, k: usize, rate: f64, now: f64) {
        let f = &mut self.flows[k];
        if f.rate != rate || !f.queued {
            f.left = (f.left - f.rate * (now - f.since)).max(0.0);
            f.since = now;
            f.rate = rate;
            f.version += 1;
            f.queued = true;
            self.finish.push(Reverse((Time(now + f.left / f.rate), k, f.version)));
        }
    }

    /// When the next flow finishes.
    fn next_finish(&mut self) -> Option<f64> {
        while let Some(&Reverse((Time(t), k, v))) = self.finish.peek() {
            if self.flows[k].live && self.flows[k].version == v {
                return Some(t);
            }
            self.finish.pop();
        }
        None
    }

    /// Removes the flows that finish by `t`, appending their ops to `done` and ports to `freed`.
    fn finish_until(&mut self, t: f64, done: &mut Vec<OpId>, freed: &mut Vec<usize>) {
        while self.next_finish().is_some_and(|tf| tf <= t) {
            let Some(Reverse((_, k, _))) = self.finish.pop() else { break };
            let f = &mut self.flows[k];
            f.live = false;
            done.push(f.op);
            freed.extend(f.ports);
            for p in f.ports {
                let list = &mut self.by_port[p];
                if let Some(i) = list.iter().position(|&x| x == k) {
                    list.swap_remove(i);
                    if list.len() == 2 {
                        self.crowded -= 1;
                    }
                }
            }
            self.free.push(k);
        }
    }
}

/// Max-min fair rates of the flows `members` sharing unit-capacity ports, by progressive
/// filling: the tightest port fixes the rate of every unfrozen flow through it, until all are
/// frozen. `cap`, `count` (per port) and `frozen` are scratch.
fn fill(flows: &mut [Flow], members: &[usize], cap: &mut [f64], count: &mut [usize], frozen: &mut Vec<bool>) {
    for &k in members {
        for p in flows[k].ports {
            cap[p] = 1.0;
            count[p] = 0;
        }
    }
    for &k in members {
        for p in flows[k].ports {
            count[p] += 1;
        }
    }
    frozen.clear();
    frozen.resize(members.len(), false);
    let mut left = members.len();
    while left > 0 {
        let (mut best, mut share) = (usize::MAX, f64::INFINITY);
        for (&k, _) in members.iter().zip(frozen.iter()).filter(|(_, z)| !**z) {
            for p in flows[k].ports {
                let s = cap[p] / count[p] as f64;
                if s < share {
                    share = s;
                    best = p;
                }
            }
        }
        let share = share.clamp(0.0, 1.0);
        for (i, &k) in members.iter().enumerate() {
            if !frozen[i] && flows[k].ports.contains(&best) {
                flows[k].rate = share.max(1e-12);
                frozen[i] = true;
                left -= 1;
                for p in flows[k].ports {
                    cap[p] -= share;
                    count[p] -= 1;
                }
            }
        }
    }
}

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

/// Runs the schedule to completion. Fails if some ops can never start (a deadlock in the
/// program order), naming the first stuck op.
///
/// Communication ops are flows that share their ports max-min fairly (a send uses the sender's
/// egress and the receiver's ingress, a collective both of its worker's); an op's `duration_s` is
/// its time alone on idle ports.
pub fn simulate(schedule: &Schedule) -> Result<Trace> {
    let n = schedule.ops.len();
    let mut trace = Trace { start: vec![f64::NAN; n], end: vec![f64::NAN; n], step_s: 0.0 };
    trace.step_s = run_program(&mut Listed::new(schedule)?, Some(&mut trace))?;
    Ok(trace)
}

/// The step time of `program` (the completion time of its last op), and the start and end of
/// every op into `trace` when given. Fails on a deadlock, naming the first op that never ran.
pub(crate) fn run_program<P: Program>(program: &mut P, mut trace: Option<&mut Trace>) -> Result<f64> {
    let n = program.len();
    let n_workers = program.workers().len();
    let mut stream_index = vec![vec![]; n_workers];
    let mut streams: Vec<StreamState> = Vec::new();
    for (w, worker) in program.workers().iter().enumerate() {
        for s in &worker.streams {
            stream_index[w].push(streams.len());
            streams.push(StreamState {
                worker: w,
                compute: s.kind.is_compute(),
                ordered: s.ordered,
                ops: if s.ordered { s.ops.clone() } else { Vec::new() },
                pos: 0,
                heap: BinaryHeap::new(),
                busy: false,
            });
        }
    }
    let mut gpu_busy = vec![false; n_workers];
    let mut done = vec![false; n];
    let mut compute_events: BinaryHeap<Reverse<(Time, OpId)>> = BinaryHeap::new();
    // Receives with a latency (`duration_s`): they complete that long after their send.
    let mut arrivals: BinaryHeap<Reverse<(Time, OpId)>> = BinaryHeap::new();
    let mut network = Network::new(2 * n_workers);
    let mut dirty: Vec<usize> = Vec::new();
    let mut is_dirty = vec![false; streams.len()];
    let mut completed = 0usize;
    let mut now = 0.0f64;
    let mut step_s = 0.0f64;
    // Scratch reused from event to event.
    let (mut touched, mut finished, mut freed): (Vec<usize>, Vec<OpId>, Vec<usize>) =
        (Vec::new(), Vec::new(), Vec::new());
    // An op's start and end, into the trace when there is one.
    let record_start = |trace: &mut Option<&mut Trace>, op: OpId, t: f64| {
        if let Some(tr) = trace.as_deref_mut() {
            tr.start[op] = t;
        }
    };

    let mut ready_list: Vec<OpId> = (0..n).filter(|&i| program.is_ready(i)).collect();
    loop {
        // 1. Newly ready ops: receives complete at once, others queue in their stream.
        while let Some(i) = ready_list.pop() {
            let info = program.op(i);
            if info.recv {
                record_start(&mut trace, i, now);
                if info.secs > 0.0 {
                    arrivals.push(Reverse((Time(now + info.secs), i)));
                    continue;
                }
                if let Some(tr) = trace.as_deref_mut() {
                    tr.end[i] = now;
                }
                done[i] = true;
                completed += 1;
                step_s = now;
                program.release(i, &mut ready_list);
            } else {
                let s = info.stream as usize;
                if !streams[s].ordered {
                    streams[s].heap.push(Reverse((Time(now), i)));
                }
                if !std::mem::replace(&mut is_dirty[s], true) {
                    dirty.push(s);
                }
            }
        }
        // 2. Start what can start (compute streams of a worker in listed order: backward first).
        dirty.sort_unstable();
        touched.clear();
        for &s in &dirty {
            is_dirty[s] = false;
            let st = &mut streams[s];
            if st.busy || (st.compute && gpu_busy[st.worker]) {
                continue;
            }
            let cand = if st.ordered {
                st.ops.get(st.pos).copied().filter(|&op| program.is_ready(op))
            } else {
                st.heap.pop().map(|Reverse((_, op))| op)
            };
            let Some(op) = cand else { continue };
            st.busy = true;
            record_start(&mut trace, op, now);
            let info = program.op(op);
            if st.compute {
                gpu_busy[st.worker] = true;
                compute_events.push(Reverse((Time(now + info.secs), op)));
            } else {
                let ps = [2 * st.worker, 2 * info.peer as usize + 1];
                touched.extend(ps);
                network.start(op, ps, info.secs, now);
            }
        }
        dirty.clear();
        if !touched.is_empty() {
            network.rebalance(&touched, now);
        }
        // 3. Next event: a compute op or a flow finishing.
        let next_compute = compute_events.peek().map(|Reverse((Time(t), _))| *t);
        let next_arrival = arrivals.peek().map_or(f64::INFINITY, |Reverse((Time(t), _))| *t);
        let next_flow = network.next_finish().unwrap_or(f64::INFINITY).min(next_arrival);
        let t = match next_compute {
            Some(c) => c.min(next_flow),
            None if next_flow.is_finite() => next_flow,
            None => break,
        };
        now = t;
        let eps = 1e-12 * now.max(1.0);
        finished.clear();
        freed.clear();
        network.finish_until(now + eps, &mut finished, &mut freed);
        if !freed.is_empty() {
            network.rebalance(&freed, now);
        }
        while let Some(Reverse((Time(ct), op))) = compute_events.peek().copied() {
            if ct > now + eps {
                break;
            }
            compute_events.pop();
            finished.push(op);
        }
        while let Some(Reverse((Time(at), op))) = arrivals.peek().copied() {
            if at > now + eps {
                break;
            }
            arrivals.pop();
            if let Some(tr) = trace.as_deref_mut() {
                tr.end[op] = now;
            }
            done[op] = true;
            completed += 1;
            step_s = now;
            program.release(op, &mut ready_list);
        }
        // 4. Completions: free the stream (and GPU), release dependents.
        for &op in &finished {
            if let Some(tr) = trace.as_deref_mut() {
                tr.end[op] = now;
            }
            done[op] = true;
            completed += 1;
            step_s = now;
            let s = program.op(op).stream as usize;
            let st = &mut streams[s];
            st.busy = false;
            if st.ordered {
                st.pos += 1;
            }
            let (compute, worker) = (st.compute, st.worker);
            if !std::mem::replace(&mut is_dirty[s], true) {
                dirty.push(s);
            }
            if compute {
                gpu_busy[worker] = false;
                for &x in &stream_index[worker] {
                    if streams[x].compute && !std::mem::replace(&mut is_dirty[x], true) {
                        dirty.push(x);
                    }
                }
            }
            program.release(op, &mut ready_list);
        }
    }
    if completed != n {
        let stuck = (0..n).find(|&i| !done[i]).unwrap_or(0);
        return Err(CoreError::InvalidSchedule {
            schedule: program.name().to_string(),
            detail: format!(
                "deadlock: {} of {n} ops never ran; first: op {stuck} ({})",
                n - completed,
                program.describe(stuck)
            ),
        });
    }
    Ok(step_s)
}

/// Utilisation of one worker's resources.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerUsage {
    /// Worker name.
    pub worker: String,
    /// GPUs of the worker.
    pub gpus: usize,
    /// Fraction of the step its GPUs compute.
    pub compute_utilisation: f64,
    /// Fraction of the step its port moves data (either direction).
    pub port_utilisation: f64,
    /// Time its GPUs idle while communication its compute waits on is pending, seconds (see
    /// [`SimReport::from_trace`]).
    pub exposed_comm_s: f64,
    /// Time neither computing nor communicating, seconds.
    pub bubble_s: f64,
}

/// What a simulated step looks like.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimReport {
    /// Schedule name.
    pub schedule: String,
    /// Step time, seconds.
    pub step_s: f64,
    /// GPU-weighted mean of the workers' exposed communication, seconds.
    pub exposed_comm_s: f64,
    /// Exposed communication of the bottleneck worker (the one that computes longest): how much
    /// communication lengthens the step beyond the busiest GPUs' compute, seconds.
    pub bottleneck_exposed_comm_s: f64,
    /// GPU-weighted mean of the workers' idle (bubble) time, seconds.
    pub bubble_s: f64,
    /// GPU-weighted mean compute utilisation.
    pub compute_utilisation: f64,
    /// Per worker.
    pub workers: Vec<WorkerUsage>,
}

/// Measure of the union of intervals.
fn union_len(mut iv: Vec<(f64, f64)>) -> (f64, Vec<(f64, f64)>) {
    iv.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut merged: Vec<(f64, f64)> = Vec::new();
    for (s, e) in iv {
        match merged.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => merged.push((s, e)),
        }
    }
    (merged.iter().map(|(s, e)| e - s).sum(), merged)
}

/// Measure of `a \ b` for merged interval lists.
fn difference_len(a: &[(f64, f64)], b: &[(f64, f64)]) -> f64 {
    let mut total = 0.0;
    let mut j = 0;
    for &(s, e) in a {
        let mut cur = s;
        while j < b.len() && b[j].1 <= cur {
            j += 1;
        }
        let mut k = j;
        while cur < e {
            match b.get(k) {
                Some(&(bs, be)) if bs < e => {
                    if bs > cur {
                        total += bs - cur;
                    }
                    cur = cur.max(be);
                    k += 1;
                }
                _ => {
                    total += e - cur;
                    cur = e;
                }
            }
        }
    }
    total
}

impl SimReport {
    /// Summarises a trace of `schedule`.
    ///
    /// Exposed communication has one definition for every schedule: the time a worker's GPUs
    /// idle while communication that its own compute waits on is pending, from the moment the
    /// data is ready to go (queueing behind other transfers on the port counts) until it has
    /// arrived. A transfer is waited on by the worker whose compute op consumes it, directly or
    /// through a chain of communication ops (a receive feeding a dispatch, say); a send's
    /// sender does not wait on it. A gradient all-reduce is waited on by its own worker (the
    /// optimizer step needs it).
    pub fn from_trace(schedule: &Schedule, trace: &Trace) -> Self {
        let w = schedule.workers.len();
        let mut compute: Vec<Vec<(f64, f64)>> = vec![Vec::new(); w];
        let mut port: Vec<Vec<(f64, f64)>> = vec![Vec::new(); w];
        let mut waited: Vec<Vec<(f64, f64)>> = vec![Vec::new(); w];
        let ready = |i: OpId| schedule.ops[i].deps.iter().map(|&d| trace.end[d]).fold(0.0, f64::max);
        // Comm op `c` waited on by worker `wk`, once per (worker, op).
        let mut seen: std::collections::HashSet<(usize, OpId)> = std::collections::HashSet::new();
        let mut stack: Vec<OpId> = Vec::new();
        for (i, o) in schedule.ops.iter().enumerate() {
            let iv = (trace.start[i], trace.end[i]);
            match o.kind {
                OpKind::Recv { .. } => {}
                OpKind::Send { to, .. } if iv.1 > iv.0 => {
                    port[o.worker].push(iv);
                    port[to].push(iv);
                }
                OpKind::AllReduce => {
                    if iv.1 > iv.0 {
                        port[o.worker].push(iv);
                        waited[o.worker].push((ready(i), iv.1));
                    }
                }
                k if k.is_comm() => {
                    if iv.1 > iv.0 {
                        port[o.worker].push(iv);
                    }
                }
                _ => {
                    if iv.1 > iv.0 {
                        compute[o.worker].push(iv);
                    }
                    // Walk back through the communication this compute op waits on.
                    let wk = o.worker;
                    stack.extend(o.deps.iter().copied().filter(|&d| schedule.ops[d].kind.is_comm()));
                    while let Some(c) = stack.pop() {
                        if !seen.insert((wk, c)) {
                            continue;
                        }
                        // A receive waits only when it has a latency (from its send's end).
                        if trace.end[c] > ready(c) {
                            waited[wk].push((ready(c), trace.end[c]));
                        }
                        stack.extend(schedule.ops[c].deps.iter().copied().filter(|&d| schedule.ops[d].kind.is_comm()));
                    }
                }
            }
        }
        let step = trace.step_s.max(f64::MIN_POSITIVE);
        let mut workers = Vec::new();
        for (i, worker) in schedule.workers.iter().enumerate() {
            let (busy, cm) = union_len(std::mem::take(&mut compute[i]));
            let (port, _) = union_len(std::mem::take(&mut port[i]));
            let (_, wm) = union_len(std::mem::take(&mut waited[i]));
            let exposed = difference_len(&wm, &cm);
            workers.push(WorkerUsage {
                worker: worker.name.clone(),
                gpus: worker.gpus,
                compute_utilisation: busy / step,
                port_utilisation: port / step,
                exposed_comm_s: exposed,
                bubble_s: (step - busy - exposed).max(0.0),
            });
        }
        let gpus: f64 = workers.iter().map(|u| u.gpus as f64).sum::<f64>().max(1.0);
        let mean = |f: &dyn Fn(&WorkerUsage) -> f64| workers.iter().map(|u| u.gpus as f64 * f(u)).sum::<f64>() / gpus;
        let bottleneck = workers
            .iter()
            .max_by(|x, y| x.compute_utilisation.total_cmp(&y.compute_utilisation))
            .map_or(0.0, |u| u.exposed_comm_s);
        Self {
            schedule: schedule.name.clone(),
            step_s: trace.step_s,
            exposed_comm_s: mean(&|u| u.exposed_comm_s),
            bottleneck_exposed_comm_s: bottleneck,
            bubble_s: mean(&|u| u.bubble_s),
            compute_utilisation: mean(&|u| u.compute_utilisation),
            workers,
        }
    }
}

/// Simulates `schedule` and summarises it.
pub fn run(schedule: &Schedule) -> Result<(Trace, SimReport)> {
    let trace = simulate(schedule)?;
    let report = SimReport::from_trace(schedule, &trace);
    Ok((trace, report))
}

/// Step-time oracle that simulates the AF-Pipe program of an allocation
/// ([`crate::schedule::afpipe::AfPipe::step_time`]: the step time of `build_afpipe`'s schedule, bit
/// for bit, without listing its ops).
#[derive(Debug, Clone)]
pub struct SimulatorOracle {
    /// The cost model the schedules are built from.
    pub cost: CostModel,
}

impl StepTimeOracle for SimulatorOracle {
    fn step_time(&mut self, allocation: &Allocation) -> Result<f64> {
        crate::schedule::afpipe::AfPipe::new(&self.cost, allocation)?.step_time()
    }
    /// Simulates the allocations on all available cores (each simulation is sequential).
    fn step_times(&mut self, allocations: &[Allocation]) -> Result<Vec<f64>> {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(allocations.len());
        if threads <= 1 {
            return allocations.iter().map(|a| self.step_time(a)).collect();
        }
        let cost = &self.cost;
        let next = std::sync::atomic::AtomicUsize::new(0);
        let mut times: Vec<Option<Result<f64>>> = (0..allocations.len()).map(|_| None).collect();
        let done: Vec<Vec<(usize, Result<f64>)>> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    scope.spawn(|| {
                        let mut out = Vec::new();
                        loop {
                            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            let Some(a) = allocations.get(i) else { break out };
                            out.push((i, SimulatorOracle { cost: cost.clone() }.step_time(a)));
                        }
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().expect("a simulation thread panicked")).collect()
        });
        for (i, t) in done.into_iter().flatten() {
            times[i] = Some(t);
        }
        times.into_iter().map(|t| t.expect("every allocation simulated")).collect()
    }
    fn respects_lower_bound(&self) -> bool {
        true
    }
    fn name(&self) -> &str {
        "simulator"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::{ScheduleBuilder, StreamKind as K, Transfer, WorkerRole};

    fn two_workers() -> ScheduleBuilder {
        let mut b = ScheduleBuilder::new("t");
        for g in 0..2 {
            b.worker(
                format!("W{g}"),
                WorkerRole::Stage { stage: g },
                1,
                1,
                1e9,
                &[(K::Compute, true), (K::Comm, true), (K::Recv, false)],
            );
        }
        b
    }

    #[test]
    fn overlapped_send_is_not_exposed_and_blocking_send_is() {
        // W0: compute 1s, send 1s (to W1) overlapped with a second compute of 1s.
        let mut b = two_workers();
        let c0 = b.op(0, K::Compute, OpKind::AttentionForward, 0, 0, 0, vec![], 1.0, 0.0, 0.0);
        let s = b.op(
            0,
            K::Comm,
            OpKind::Send { to: 1, transfer: crate::schedule::Transfer::M2n, backward: false },
            0,
            0,
            0,
            vec![c0],
            1.0,
            0.0,
            1.0,
        );
        let _c1 = b.op(0, K::Compute, OpKind::AttentionForward, 1, 0, 0, vec![c0], 1.0, 0.0, 0.0);
        let r = b.op(1, K::Recv, OpKind::Recv { from: 0 }, 0, 0, 0, vec![s], 0.0, 0.0, 0.0);
        let _c2 = b.op(1, K::Compute, OpKind::ExpertForward, 0, 0, 0, vec![r], 1.0, 0.0, 0.0);
        let sched = b.finish().unwrap();
        let (trace, rep) = run(&sched).unwrap();
        assert_eq!(trace.step_s, 3.0);
        assert_eq!(rep.workers[0].exposed_comm_s, 0.0);
        // W1 waits for the transfer with idle GPU: 1 s exposed, 1 s idle before it.
        assert_eq!(rep.workers[1].exposed_comm_s, 1.0);
        assert_eq!(rep.workers[1].bubble_s, 1.0);
    }

    #[test]
    fn a_program_order_that_waits_on_itself_is_reported_as_deadlock() {
        let mut b = two_workers();
        // Ordered stream: op 1 listed first but depends on op 2 which is listed after it.
        let first = b.op(0, K::Compute, OpKind::AttentionForward, 0, 0, 0, vec![], 1.0, 0.0, 0.0);
        let second = b.op(0, K::Compute, OpKind::AttentionForward, 1, 0, 0, vec![], 1.0, 0.0, 0.0);
        b.schedule.ops[first].deps.push(second);
        let e = simulate(&b.schedule).unwrap_err().to_string();
        assert!(e.contains("deadlock"), "{e}");
    }

    #[test]
    fn two_sends_into_one_port_share_it_fairly() {
        // W0 and W1 each send 1 s of data to W2 at once: the shared ingress halves both rates.
        let mut b = ScheduleBuilder::new("t");
        for g in 0..3 {
            b.worker(
                format!("W{g}"),
                WorkerRole::Stage { stage: g },
                1,
                1,
                1e9,
                &[(K::Compute, true), (K::Comm, true), (K::Recv, false)],
            );
        }
        let send = |to| OpKind::Send { to, transfer: crate::schedule::Transfer::M2n, backward: false };
        let s0 = b.op(0, K::Comm, send(2), 0, 0, 0, vec![], 1.0, 0.0, 1.0);
        let s1 = b.op(1, K::Comm, send(2), 0, 0, 0, vec![], 1.0, 0.0, 1.0);
        // A third, independent send W1 -> W0 after the first: starts at 2 s alone.
        let s2 = b.op(1, K::Comm, send(0), 1, 0, 0, vec![], 0.5, 0.0, 1.0);
        let trace = simulate(&b.finish().unwrap()).unwrap();
        assert!((trace.end[s0] - 2.0).abs() < 1e-9 && (trace.end[s1] - 2.0).abs() < 1e-9, "{:?}", trace.end);
        assert!((trace.end[s2] - 2.5).abs() < 1e-9);
    }

    /// Rates of `flows` (port pairs) after one rebalance of every port.
    fn rates_of(flows: &[[usize; 2]], n_ports: usize) -> Vec<f64> {
        let mut net = Network::new(n_ports);
        let slots: Vec<usize> = flows.iter().enumerate().map(|(op, &ports)| net.start(op, ports, 1.0, 0.0)).collect();
        net.rebalance(&(0..n_ports).collect::<Vec<_>>(), 0.0);
        slots.iter().map(|&k| net.flows[k].rate).collect()
    }

    #[test]
    fn max_min_rates_give_the_spare_capacity_to_unconstrained_flows() {
        // Flow a: ports 0,1; flow b: ports 0,2; flow c: ports 3,1. Port 0 and 1 are shared.
        for rate in rates_of(&[[0, 1], [0, 2], [3, 1]], 4) {
            assert!((rate - 0.5).abs() < 1e-12, "{rate}");
        }
        assert!(rates_of(&[[0, 1], [2, 3]], 4).iter().all(|r| (r - 1.0).abs() < 1e-12));
    }

    /// The flow of the reference rebalancing.
    struct RefFlow {
        op: OpId,
        ports: [usize; 2],
        left: f64,
        rate: f64,
    }

    /// Reference: max-min fair rates (fractions of full speed) of the flows sharing unit-capacity ports.
    fn reference_fair_rates(flows: &mut [RefFlow], n_ports: usize) {
        let mut cap = vec![1.0f64; n_ports];
        let mut count = vec![0usize; n_ports];
        for f in flows.iter() {
            for &p in &f.ports {
                count[p] += 1;
            }
        }
        let mut frozen = vec![false; flows.len()];
        let mut left = flows.len();
        while left > 0 {
            // The tightest port fixes the rate of every unfrozen flow through it.
            let (mut best, mut share) = (usize::MAX, f64::INFINITY);
            for f in flows.iter().zip(&frozen).filter(|(_, z)| !**z).map(|(f, _)| f) {
                for &p in &f.ports {
                    let s = cap[p] / count[p] as f64;
                    if s < share {
                        share = s;
                        best = p;
                    }
                }
            }
            let share = share.clamp(0.0, 1.0);
            for (k, f) in flows.iter_mut().enumerate() {
                if !frozen[k] && f.ports.contains(&best) {
                    f.rate = share.max(1e-12);
                    frozen[k] = true;
                    left -= 1;
                    for &p in &f.ports {
                        cap[p] -= share;
                        count[p] -= 1;
                    }
                }
            }
        }
    }

    /// Reference: recomputes the rates of the flows connected (through shared ports) to `touched` ports; flows
    /// elsewhere keep their rates, which are unaffected.
    fn reference_rebalance(flows: &mut [RefFlow], touched: &[usize]) {
        let mut ports: Vec<usize> = touched.to_vec();
        let mut members: Vec<usize> = Vec::new();
        loop {
            let before = members.len();
            for (k, f) in flows.iter().enumerate() {
                if !members.contains(&k) && f.ports.iter().any(|p| ports.contains(p)) {
                    members.push(k);
                    ports.extend(f.ports);
                }
            }
            if members.len() == before {
                break;
            }
        }
        if members.is_empty() {
            return;
        }
        ports.sort_unstable();
        ports.dedup();
        let local = |p: usize| ports.binary_search(&p).expect("port of a member");
        let mut sub: Vec<RefFlow> = members
            .iter()
            .map(|&k| RefFlow { op: flows[k].op, ports: flows[k].ports.map(local), left: flows[k].left, rate: 0.0 })
            .collect();
        reference_fair_rates(&mut sub, ports.len());
        for (k, f) in members.iter().zip(sub) {
            flows[*k].rate = f.rate;
        }
    }

    #[test]
    fn component_rebalance_agrees_with_the_reference_on_random_flows() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |n: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n as u64) as usize
        };
        for case in 0..200 {
            let n_ports = 2 + next(30);
            let ports: Vec<[usize; 2]> =
                (0..1 + next(40)).map(|_| [next(n_ports), next(n_ports)]).filter(|p| p[0] != p[1]).collect();
            let touched: Vec<usize> = (0..1 + next(3)).map(|_| next(n_ports)).collect();
            let mut reference: Vec<RefFlow> =
                ports.iter().enumerate().map(|(op, &ports)| RefFlow { op, ports, left: 1.0, rate: 0.5 }).collect();
            reference_rebalance(&mut reference, &touched);
            let mut net = Network::new(n_ports);
            for (op, &p) in ports.iter().enumerate() {
                let k = net.start(op, p, 1.0, 0.0);
                net.flows[k].rate = 0.5;
            }
            // Rates set by hand, not max-min fair: the component's progressive filling is tested.
            net.rates_local = false;
            net.rebalance(&touched, 0.0);
            for (f, r) in net.flows.iter().zip(&reference) {
                assert!((f.rate - r.rate).abs() < 1e-12, "case {case}: flow {} rate {} vs {}", f.op, f.rate, r.rate);
            }
        }
    }

    /// Flows start and finish at random, mostly on ports that carry fewer than two flows (the
    /// local rates) and sometimes on any port (a crowded one, then back): after every event
    /// each rate is the max-min fair rate of the whole network.
    #[test]
    fn rates_stay_max_min_fair_through_starts_and_finishes() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = |n: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n as u64) as usize
        };
        let (mut crowded_events, mut local_events) = (0, 0);
        for case in 0..100 {
            let n_ports = 4 + next(10);
            let mut net = Network::new(n_ports);
            let mut now = 0.0;
            let mut op = 0;
            for event in 0..60 {
                let touched: Vec<usize> = if net.next_finish().is_none() || next(10) < 6 {
                    let pick = |next: &mut dyn FnMut(usize) -> usize, net: &Network| loop {
                        let p = next(n_ports);
                        if next(10) < 2 || net.by_port[p].len() < 2 {
                            break p;
                        }
                    };
                    let a = pick(&mut next, &net);
                    let b = loop {
                        let b = pick(&mut next, &net);
                        if b != a {
                            break b;
                        }
                    };
                    net.start(op, [a, b], 0.1 + next(100) as f64 / 100.0, now);
                    op += 1;
                    vec![a, b]
                } else {
                    now = net.next_finish().unwrap();
                    let (mut done, mut freed) = (Vec::new(), Vec::new());
                    net.finish_until(now, &mut done, &mut freed);
                    freed
                };
                if net.crowded > 0 {
                    crowded_events += 1;
                } else {
                    local_events += 1;
                }
                net.rebalance(&touched, now);
                let live: Vec<usize> = (0..net.flows.len()).filter(|&k| net.flows[k].live).collect();
                let mut reference: Vec<RefFlow> = live
                    .iter()
                    .map(|&k| RefFlow { op: net.flows[k].op, ports: net.flows[k].ports, left: 1.0, rate: 0.0 })
                    .collect();
                reference_fair_rates(&mut reference, n_ports);
                for (&k, r) in live.iter().zip(&reference) {
                    let rate = net.flows[k].rate;
                    assert!(
                        (rate - r.rate).abs() < 1e-12,
                        "case {case} event {event}: flow {} rate {rate} vs {}",
                        r.op,
                        r.rate
                    );
                }
            }
        }
        assert!(crowded_events > 500 && local_events > 500, "{crowded_events} crowded, {local_events} local");
    }

    #[test]
    fn interval_difference_is_exact() {
        let (_, a) = union_len(vec![(0.0, 4.0), (6.0, 8.0)]);
        let (_, b) = union_len(vec![(1.0, 2.0), (3.0, 7.0)]);
        assert!((difference_len(&a, &b) - 3.0).abs() < 1e-12);
    }

    /// `n` workers with one ordered compute stream, a communication stream and receives.
    fn stages(n: usize, port_bw: f64) -> ScheduleBuilder {
        let mut b = ScheduleBuilder::new("t");
        for g in 0..n {
            b.worker(
                format!("S{g}"),
                WorkerRole::Stage { stage: g },
                1,
                1,
                port_bw,
                &[(K::Compute, true), (K::Comm, true), (K::Recv, false)],
            );
        }
        b
    }

    #[test]
    fn a_two_stage_pipeline_ends_after_the_fill_and_m_runs_of_the_slower_stage() {
        // m micro-batches through stages of a and b seconds: a + b + (m - 1) max(a, b).
        for (a, bt, m) in [(1.0, 2.0, 5usize), (2.0, 1.0, 5), (1.5, 1.5, 7), (0.25, 3.0, 1)] {
            let mut b = stages(2, 1e9);
            let mut last = 0;
            for i in 0..m {
                let first = b.op(0, K::Compute, OpKind::AttentionForward, i, 0, 0, vec![], a, 0.0, 0.0);
                last = b.op(1, K::Compute, OpKind::ExpertForward, i, 0, 0, vec![first], bt, 0.0, 0.0);
            }
            let sched = b.finish().unwrap();
            let (trace, rep) = run(&sched).unwrap();
            let want = a + bt + (m - 1) as f64 * f64::max(a, bt);
            assert!((trace.step_s - want).abs() < 1e-9, "a {a} b {bt} m {m}: {} vs {want}", trace.step_s);
            assert_eq!(trace.end[last], trace.step_s);
            // Each stage idles for the rest of the step: no communication, all bubble.
            assert!((rep.workers[0].bubble_s - (want - m as f64 * a)).abs() < 1e-9);
            assert!((rep.workers[1].bubble_s - (want - m as f64 * bt)).abs() < 1e-9);
        }
    }

    #[test]
    fn a_transfer_of_b_bytes_takes_b_over_the_rate_plus_the_latency() {
        let shape = crate::model_shape::ModelShape::preset("qwen3-30b-a3b").unwrap();
        let cluster = crate::hardware::Cluster::preset("h800x16").unwrap();
        let workload = crate::cost::Workload { seq: 4096, micro_batch: 1, global_batch: 16 };
        let cost = crate::cost::CostModel::new(shape, cluster, workload).unwrap();
        let latency = cost.cluster.node.latency_s;
        assert!(latency > 0.0);
        let bytes = 3.0e8;
        // Sender 50 GB/s, receiver 25 GB/s: the slower port sets the rate.
        let mut b = ScheduleBuilder::new("t");
        for (g, bw) in [50e9, 25e9].into_iter().enumerate() {
            b.worker(
                format!("W{g}"),
                WorkerRole::Stage { stage: g },
                1,
                1,
                bw,
                &[(K::Compute, true), (K::Comm, true), (K::Recv, false)],
            );
        }
        let c = b.op(0, K::Compute, OpKind::AttentionForward, 0, 0, 0, vec![], 0.5, 0.0, 0.0);
        let r1 = b.transfer(&cost, 0, 1, Transfer::M2n, false, 0, 0, vec![c], bytes);
        // A second transfer queued behind the first on the same port: one more of the same.
        let r2 = b.transfer(&cost, 0, 1, Transfer::M2n, false, 1, 0, vec![c], bytes);
        let e = b.op(1, K::Compute, OpKind::ExpertForward, 0, 0, 0, vec![r1, r2], 0.0, 0.0, 0.0);
        let sched = b.finish().unwrap();
        let (trace, rep) = run(&sched).unwrap();
        let one = bytes / 25e9 + latency;
        assert!((trace.end[r1] - (0.5 + one)).abs() < 1e-12, "{} vs {}", trace.end[r1], 0.5 + one);
        assert!((trace.end[r2] - (0.5 + 2.0 * one)).abs() < 1e-12);
        assert!((trace.end[e] - (0.5 + 2.0 * one)).abs() < 1e-12);
        // The receiver waits on both transfers with nothing to compute: all of it is exposed.
        assert!((rep.workers[1].exposed_comm_s - 2.0 * one).abs() < 1e-9, "{:?}", rep.workers[1]);
        assert_eq!(rep.workers[0].exposed_comm_s, 0.0);
    }

    #[test]
    fn a_receive_latency_delays_the_consumer_without_holding_the_port() {
        // Two 1 s sends back to back on W0's port, each received 0.25 s after its last byte.
        let mut b = two_workers();
        let send = OpKind::Send { to: 1, transfer: Transfer::M2n, backward: false };
        let s1 = b.op(0, K::Comm, send, 0, 0, 0, vec![], 1.0, 0.0, 1.0);
        let s2 = b.op(0, K::Comm, send, 1, 0, 0, vec![], 1.0, 0.0, 1.0);
        let r1 = b.op(1, K::Recv, OpKind::Recv { from: 0 }, 0, 0, 0, vec![s1], 0.25, 0.0, 1.0);
        let r2 = b.op(1, K::Recv, OpKind::Recv { from: 0 }, 1, 0, 0, vec![s2], 0.25, 0.0, 1.0);
        let c1 = b.op(1, K::Compute, OpKind::ExpertForward, 0, 0, 0, vec![r1], 0.5, 0.0, 0.0);
        let c2 = b.op(1, K::Compute, OpKind::ExpertForward, 1, 0, 0, vec![r2, c1], 0.5, 0.0, 0.0);
        let sched = b.finish().unwrap();
        let (trace, rep) = run(&sched).unwrap();
        assert_eq!((trace.end[s1], trace.end[s2]), (1.0, 2.0), "the port is free again after the bytes");
        assert_eq!((trace.end[r1], trace.end[r2]), (1.25, 2.25));
        assert_eq!((trace.start[c1], trace.start[c2], trace.step_s), (1.25, 2.25, 2.75));
        // W1 idles 1.25 s for the first message, then 0.5 s more for the second (it computes
        // from 1.25 to 1.75): all of it exposed.
        assert!((rep.workers[1].exposed_comm_s - 1.75).abs() < 1e-12, "{:?}", rep.workers[1]);
    }

    #[test]
    fn one_f_one_b_leaves_a_bubble_of_p_minus_1_over_m_plus_p_minus_1() {
        // p stages, m micro-batches, forward f and backward b seconds per stage; 1F1B: stage s
        // warms up with p - 1 - s forwards, alternates one forward and one backward, then drains.
        for (p, m, f, bw) in [(4usize, 8usize, 1.0, 2.0), (2, 3, 1.0, 1.0), (5, 16, 0.5, 1.0), (3, 3, 1.0, 2.0)] {
            let mut b = stages(p, 1e9);
            let mut fwd = vec![vec![usize::MAX; m]; p];
            let mut bwd = vec![vec![usize::MAX; m]; p];
            // Ops are created in an order where every dependency exists: forwards stage by stage,
            // backwards from the last stage; each stage's program order is set afterwards.
            for s in 0..p {
                for i in 0..m {
                    let deps = if s == 0 { vec![] } else { vec![fwd[s - 1][i]] };
                    fwd[s][i] = b.op(s, K::Compute, OpKind::AttentionForward, i, s as u32, 0, deps, f, 0.0, 0.0);
                }
            }
            for s in (0..p).rev() {
                for i in 0..m {
                    let mut deps = vec![fwd[s][i]];
                    if s + 1 < p {
                        deps.push(bwd[s + 1][i]);
                    }
                    bwd[s][i] = b.op(s, K::Compute, OpKind::AttentionBackward, i, s as u32, 0, deps, bw, 0.0, 0.0);
                }
            }
            for s in 0..p {
                let warm = (p - 1 - s).min(m);
                let mut order: Vec<OpId> = fwd[s][..warm].to_vec();
                for i in 0..m {
                    if warm + i < m {
                        order.push(fwd[s][warm + i]);
                    }
                    order.push(bwd[s][i]);
                }
                let stream = b.stream_of(s, K::Compute);
                b.schedule.workers[s].streams[stream].ops = order;
            }
            let sched = b.finish().unwrap();
            let (trace, rep) = run(&sched).unwrap();
            let want = (m + p - 1) as f64 * (f + bw);
            assert!((trace.step_s - want).abs() < 1e-9, "p {p} m {m}: step {} vs {want}", trace.step_s);
            let fraction = rep.bubble_s / trace.step_s;
            let analytic = (p - 1) as f64 / (m + p - 1) as f64;
            assert!((fraction - analytic).abs() < 1e-9, "p {p} m {m}: bubble {fraction} vs {analytic}");
        }
    }
}
