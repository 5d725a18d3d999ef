//! Discrete-event simulation of a [`Schedule`] on its modelled resources.
//!
//! Resources: the GPUs of each worker (one compute op at a time, shared by its compute streams,
//! backward streams first), and each worker's network port in two directions (egress, ingress;
//! one for both where the worker is `half_duplex`).
//! Transfers are flows: a send uses the sender's egress and the receiver's ingress, a collective
//! both of its own worker's, and flows sharing a port split it max-min fairly (progressive
//! filling), so a port is never idle while a flow through it could move.
//! Streams run one op at a time; an ordered stream in program order, a dynamic stream
//! earliest-ready first. Receives complete when their send does, or `duration_s` (a link's
//! latency) after it.
//!
//! [`simulate`] returns start and end times per op; [`SimReport::from_trace`] turns them into the
//! step time, bubble time, exposed (non-overlapped) communication and per-resource utilisation.
//! One file per concept: the event loop (here), the network model ([`network`]), the program it
//! runs ([`program`]), the report ([`report`]); the planner's oracle that simulates is the
//! allocator's ([`crate::allocator::oracle`]).

mod network;
mod program;
pub mod report;

use network::*;
pub(crate) use program::*;
pub use report::*;

use crate::error::{CoreError, Result};
use crate::schedule::{OpId, Schedule};
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
                // The sender's egress and the receiver's ingress: its one port when it is half
                // duplex (a collective, peer = itself, keeps both of its own).
                let peer = info.peer as usize;
                let ingress =
                    if peer != st.worker && program.workers()[peer].half_duplex { 2 * peer } else { 2 * peer + 1 };
                let ps = [2 * st.worker, ingress];
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::{OpKind, ScheduleBuilder, StreamKind as K, Transfer, WorkerRole};

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
    fn a_half_duplex_worker_s_sends_and_receives_share_its_port() {
        // W0 and W1 send each other 1 s of data at once: 1 s with a port each way, 2 s when each
        // worker's one port carries both directions.
        for (half, want) in [(false, 1.0), (true, 2.0)] {
            let mut b = stages(2, 1e9);
            let send = |to| OpKind::Send { to, transfer: crate::schedule::Transfer::M2n, backward: false };
            let s0 = b.op(0, K::Comm, send(1), 0, 0, 0, vec![], 1.0, 0.0, 1.0);
            let s1 = b.op(1, K::Comm, send(0), 0, 0, 0, vec![], 1.0, 0.0, 1.0);
            let mut sched = b.finish().unwrap();
            sched.workers.iter_mut().for_each(|w| w.half_duplex = half);
            let trace = simulate(&sched).unwrap();
            assert!(
                (trace.end[s0] - want).abs() < 1e-9 && (trace.end[s1] - want).abs() < 1e-9,
                "{half}: {:?}",
                trace.end
            );
        }
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
