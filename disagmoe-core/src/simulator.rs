//! Discrete-event simulation of a [`Schedule`] on its modelled resources.
//!
//! Resources: the GPUs of each worker (one compute op at a time, shared by its compute streams,
//! backward streams first), and each worker's network port in two directions (egress, ingress).
//! Transfers are flows: a send uses the sender's egress and the receiver's ingress, a collective
//! both of its own worker's, and flows sharing a port split it max-min fairly (progressive
//! filling), so a port is never idle while a flow through it could move.
//! Streams run one op at a time; an ordered stream in program order, a dynamic stream
//! earliest-ready first. Receives complete when their send does.
//!
//! [`simulate`] returns start and end times per op; [`SimReport::from_trace`] turns them into the
//! step time, bubble time, exposed (non-overlapped) communication and per-resource utilisation.

use crate::allocator::search::StepTimeOracle;
use crate::allocator::Allocation;
use crate::cost::CostModel;
use crate::error::{CoreError, Result};
use crate::schedule::{OpId, OpKind, Schedule};
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
    ops: Vec<OpId>,
    pos: usize,
    heap: BinaryHeap<Reverse<(Time, OpId)>>,
    busy: bool,
}

/// Port index of worker `w`'s egress (`2w`) or ingress (`2w + 1`).
fn ports(schedule: &Schedule, op: OpId) -> [usize; 2] {
    let o = &schedule.ops[op];
    match o.kind {
        OpKind::Send { to, .. } => [2 * o.worker, 2 * to + 1],
        _ => [2 * o.worker, 2 * o.worker + 1],
    }
}

/// A transfer in flight: its ports and the seconds of work left at full speed.
struct Flow {
    op: OpId,
    ports: [usize; 2],
    left: f64,
    rate: f64,
}

/// Max-min fair rates (fractions of full speed) of the flows sharing unit-capacity ports.
fn fair_rates(flows: &mut [Flow], n_ports: usize) {
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

/// Recomputes the rates of the flows connected (through shared ports) to `touched` ports; flows
/// elsewhere keep their rates, which are unaffected.
fn rebalance(flows: &mut [Flow], touched: &[usize]) {
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
    let mut sub: Vec<Flow> = members
        .iter()
        .map(|&k| Flow { op: flows[k].op, ports: flows[k].ports.map(local), left: flows[k].left, rate: 0.0 })
        .collect();
    fair_rates(&mut sub, ports.len());
    for (k, f) in members.iter().zip(sub) {
        flows[*k].rate = f.rate;
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
    let mut remaining: Vec<usize> = schedule.ops.iter().map(|o| o.deps.len()).collect();
    let mut dependents: Vec<Vec<OpId>> = vec![Vec::new(); n];
    for (i, o) in schedule.ops.iter().enumerate() {
        for &d in &o.deps {
            dependents[d].push(i);
        }
    }
    let mut stream_index = vec![vec![]; schedule.workers.len()];
    let mut streams: Vec<StreamState> = Vec::new();
    for (w, worker) in schedule.workers.iter().enumerate() {
        for s in &worker.streams {
            stream_index[w].push(streams.len());
            streams.push(StreamState {
                worker: w,
                compute: s.kind.is_compute(),
                ordered: s.ordered,
                ops: s.ops.clone(),
                pos: 0,
                heap: BinaryHeap::new(),
                busy: false,
            });
        }
    }
    let stream_of = |op: OpId| stream_index[schedule.ops[op].worker][schedule.ops[op].stream];
    let is_recv = |op: OpId| matches!(schedule.ops[op].kind, OpKind::Recv { .. });
    let mut gpu_busy = vec![false; schedule.workers.len()];
    let mut start = vec![f64::NAN; n];
    let mut end = vec![f64::NAN; n];
    let mut compute_events: BinaryHeap<Reverse<(Time, OpId)>> = BinaryHeap::new();
    let mut flows: Vec<Flow> = Vec::new();
    let mut dirty: Vec<usize> = Vec::new();
    let mut is_dirty = vec![false; streams.len()];
    let mut completed = 0usize;
    let mut now = 0.0f64;

    let mut ready_list: Vec<OpId> = (0..n).filter(|&i| remaining[i] == 0).collect();
    loop {
        // 1. Newly ready ops: receives complete at once, others queue in their stream.
        while let Some(i) = ready_list.pop() {
            if is_recv(i) {
                start[i] = now;
                end[i] = now;
                completed += 1;
                for &j in &dependents[i] {
                    remaining[j] -= 1;
                    if remaining[j] == 0 {
                        ready_list.push(j);
                    }
                }
            } else {
                let s = stream_of(i);
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
        let mut touched: Vec<usize> = Vec::new();
        for s in std::mem::take(&mut dirty) {
            is_dirty[s] = false;
            let st = &mut streams[s];
            if st.busy || (st.compute && gpu_busy[st.worker]) {
                continue;
            }
            let cand = if st.ordered {
                st.ops.get(st.pos).copied().filter(|&op| remaining[op] == 0)
            } else {
                st.heap.pop().map(|Reverse((_, op))| op)
            };
            let Some(op) = cand else { continue };
            st.busy = true;
            start[op] = now;
            let secs = schedule.ops[op].duration_s.max(0.0);
            if st.compute {
                gpu_busy[st.worker] = true;
                compute_events.push(Reverse((Time(now + secs), op)));
            } else {
                let ps = ports(schedule, op);
                touched.extend(ps);
                flows.push(Flow { op, ports: ps, left: secs, rate: 1.0 });
            }
        }
        if !touched.is_empty() {
            rebalance(&mut flows, &touched);
        }
        // 3. Next event: a compute op or a flow finishing.
        let next_compute = compute_events.peek().map(|Reverse((Time(t), _))| *t);
        let next_flow = flows.iter().map(|f| now + f.left / f.rate).fold(f64::INFINITY, f64::min);
        let t = match next_compute {
            Some(c) => c.min(next_flow),
            None if next_flow.is_finite() => next_flow,
            None => break,
        };
        let dt = t - now;
        now = t;
        let mut finished: Vec<OpId> = Vec::new();
        for f in &mut flows {
            f.left -= f.rate * dt;
        }
        let eps = 1e-12 * now.max(1.0);
        let mut freed: Vec<usize> = Vec::new();
        flows.retain(|f| {
            if f.left <= eps {
                finished.push(f.op);
                freed.extend(f.ports);
                false
            } else {
                true
            }
        });
        if !freed.is_empty() {
            rebalance(&mut flows, &freed);
        }
        while let Some(Reverse((Time(ct), op))) = compute_events.peek().copied() {
            if ct > now + eps {
                break;
            }
            compute_events.pop();
            finished.push(op);
        }
        // 4. Completions: free the stream (and GPU), release dependents.
        for op in finished {
            end[op] = now;
            completed += 1;
            let s = stream_of(op);
            let st = &mut streams[s];
            st.busy = false;
            if st.ordered {
                st.pos += 1;
            }
            let mut wake = vec![s];
            if st.compute {
                gpu_busy[st.worker] = false;
                wake.extend(stream_index[st.worker].iter().copied().filter(|&x| streams[x].compute));
            }
            for x in wake {
                if !std::mem::replace(&mut is_dirty[x], true) {
                    dirty.push(x);
                }
            }
            for &j in &dependents[op] {
                remaining[j] -= 1;
                if remaining[j] == 0 {
                    ready_list.push(j);
                }
            }
        }
    }
    if completed != n {
        let stuck = (0..n).find(|&i| end[i].is_nan()).unwrap_or(0);
        let o = &schedule.ops[stuck];
        return Err(CoreError::InvalidSchedule {
            schedule: schedule.name.clone(),
            detail: format!(
                "deadlock: {} of {n} ops never ran; first: op {stuck} ({} of micro-batch {} layer {} on {})",
                n - completed,
                o.kind.label(),
                o.micro_batch,
                o.layer,
                schedule.workers[o.worker].name
            ),
        });
    }
    let step_s = end.iter().copied().fold(0.0, f64::max);
    Ok(Trace { start, end, step_s })
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
    /// Time communication is in flight while its GPUs are idle, seconds.
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
    pub fn from_trace(schedule: &Schedule, trace: &Trace) -> Self {
        let w = schedule.workers.len();
        let mut compute: Vec<Vec<(f64, f64)>> = vec![Vec::new(); w];
        let mut comm: Vec<Vec<(f64, f64)>> = vec![Vec::new(); w];
        for (i, o) in schedule.ops.iter().enumerate() {
            let iv = (trace.start[i], trace.end[i]);
            if iv.1 <= iv.0 {
                continue;
            }
            match o.kind {
                OpKind::Recv { .. } => {}
                OpKind::Send { to, .. } => {
                    comm[o.worker].push(iv);
                    comm[to].push(iv);
                }
                k if k.is_comm() => comm[o.worker].push(iv),
                _ => compute[o.worker].push(iv),
            }
        }
        let step = trace.step_s.max(f64::MIN_POSITIVE);
        let mut workers = Vec::new();
        for (i, worker) in schedule.workers.iter().enumerate() {
            let (busy, cm) = union_len(std::mem::take(&mut compute[i]));
            let (port, mm) = union_len(std::mem::take(&mut comm[i]));
            let exposed = difference_len(&mm, &cm);
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

/// Step-time oracle that builds the AF-Pipe schedule of an allocation and simulates it.
#[derive(Debug, Clone)]
pub struct SimulatorOracle {
    /// The cost model the schedules are built from.
    pub cost: CostModel,
}

impl StepTimeOracle for SimulatorOracle {
    fn step_time(&mut self, allocation: &Allocation) -> Result<f64> {
        let schedule = crate::schedule::afpipe::build_afpipe(&self.cost, allocation)?;
        Ok(simulate(&schedule)?.step_s)
    }
    fn name(&self) -> &str {
        "simulator"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::{ScheduleBuilder, StreamKind as K, WorkerRole};

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

    #[test]
    fn max_min_rates_give_the_spare_capacity_to_unconstrained_flows() {
        // Flow a: ports 0,1; flow b: ports 0,2; flow c: ports 3,1. Port 0 and 1 are shared.
        let mut flows = vec![
            Flow { op: 0, ports: [0, 1], left: 1.0, rate: 0.0 },
            Flow { op: 1, ports: [0, 2], left: 1.0, rate: 0.0 },
            Flow { op: 2, ports: [3, 1], left: 1.0, rate: 0.0 },
        ];
        fair_rates(&mut flows, 4);
        for f in &flows {
            assert!((f.rate - 0.5).abs() < 1e-12, "{}", f.rate);
        }
        let mut flows = vec![
            Flow { op: 0, ports: [0, 1], left: 1.0, rate: 0.0 },
            Flow { op: 1, ports: [2, 3], left: 1.0, rate: 0.0 },
        ];
        fair_rates(&mut flows, 4);
        assert!(flows.iter().all(|f| (f.rate - 1.0).abs() < 1e-12));
    }

    #[test]
    fn interval_difference_is_exact() {
        let (_, a) = union_len(vec![(0.0, 4.0), (6.0, 8.0)]);
        let (_, b) = union_len(vec![(1.0, 2.0), (3.0, 7.0)]);
        assert!((difference_len(&a, &b) - 3.0).abs() < 1e-12);
    }
}
