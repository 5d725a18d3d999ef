//! What a simulated step looks like: step time, bubbles, exposed communication and utilisation
//! per worker ([`SimReport`]), and [`run`], a simulation with its summary.

use serde::{Deserialize, Serialize};

use super::*;
use crate::error::Result;
use crate::schedule::{OpId, OpKind, Schedule};

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
pub(super) fn union_len(mut iv: Vec<(f64, f64)>) -> (f64, Vec<(f64, f64)>) {
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
pub(super) fn difference_len(a: &[(f64, f64)], b: &[(f64, f64)]) -> f64 {
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
