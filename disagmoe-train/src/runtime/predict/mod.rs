//! Predicting a run of the runtime with the simulator of `disagmoe-core` ("one schedule, two
//! engines").
//!
//! [`schedule`] builds, from a run's [`Layout`], the [`Schedule`] that `run_step` executes:
//! - per worker, its tasks on three compute streams, one per ready queue of the scheduler in its
//!   priority ([`Queue::PRIORITY`], [`Task::queue`]): backward tasks
//!   (the head's and each layer's, micro-batches in increasing order per [`BackwardKind`] key, the
//!   keys of the scheduler's backward order, [`Task::backward_key`]), then expert forward, then
//!   attention forward, each earliest-ready first (the rules of [`super::scheduler`]);
//! - the in-flight window: micro-batch `i + K` of an embedding worker starts when the layer-0
//!   backward of its micro-batch `i` ends ([`Task::releases_window`]);
//! - one send per message that leaves a worker (dispatch, combine, residual and their gradients),
//!   on the sender's port one at a time for the link's per-message cost plus its bytes at the
//!   link's rate, received the link's latency after its last byte (the emulated link of
//!   `--link-gbps`/`--link-latency-us`, or one fitted to a real network, [`network`], whose ports
//!   may be half duplex); messages to oneself never leave;
//! - with context parallelism (`Layout::context_parallel` `C > 1`), units instead of micro-batches
//!   for the attention and expert tasks, and each attention stage's tasks as the scheduler runs
//!   them (`C` forward, two backward): the projection half sends its block of keys and values to the ring's
//!   other units (`keys-values`, a [`Transfer::Ring`] send, to ring rank `r + 1` first) and the
//!   ring half is a task per other block, each after the one before and its block; the own
//!   block's attention is an op of its own after its task's sends (a span of its own in the
//!   trace: [`Task::own_block_name`]; the simulator may run another ready op of the stream
//!   between the two, where the runtime runs them as one task); in
//!   the backward the ring half's backward sends the blocks' gradients back (`grad-keys-values`)
//!   and the projection half's backward waits for them; the head waits for every unit of its
//!   micro-batch, the window counts each embedding worker's units;
//! - the end of the step: every worker's all-reduces after the last backward task of all (their
//!   bytes on the link, one latency per message of the ring), then its optimizer step.
//!
//! Durations and message sizes come from a [`Calibration`]: a short traced run of the same
//! configuration without link emulation (`--trace`; [`crate::launch::calibrate`] runs one), whose
//! tasks, messages and end-of-step spans give the medians of the steps after the first. What the schedule does not hold (the
//! coordinator's per-step round trip, the hand-over of batches) is the calibration's measured
//! step minus its own simulated step, added to every prediction as `overhead_s`.

use std::collections::HashMap;

use disagmoe_core::schedule::{OpId, OpKind, Schedule, ScheduleBuilder, StreamKind, Transfer, WorkerRole, NO_LAYER};
use disagmoe_core::simulator;

mod calibration;
pub mod network;
pub use calibration::Calibration;
pub use network::NetLink;

use super::layout::Layout;
use super::scheduler::{BackwardKind, Queue, Task};
use crate::config::Placement;
use crate::error::{Result, TrainError};

/// The simulator's compute stream of a scheduler queue.
fn stream(q: Queue) -> StreamKind {
    match q {
        Queue::Backward => StreamKind::BackwardCompute,
        Queue::ExpertForward => StreamKind::ExpertForwardCompute,
        Queue::Forward => StreamKind::ForwardCompute,
    }
}

/// What the simulator predicts for a run.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Prediction {
    /// Step wall time, seconds (the simulated step plus the calibration's overhead).
    pub step_s: f64,
    /// Time workers sat waiting on communication, summed over workers, seconds per step.
    pub exposed_comm_s: f64,
    /// Task compute, summed over workers, seconds per step.
    pub compute_s: f64,
}

/// Predicts a run of `layout` with `in_flight` micro-batches per embedding worker over `link`
/// (`None`: messages arrive at once; an emulated link converts with `.into()`).
pub fn predict(layout: &Layout, cal: &Calibration, in_flight: usize, link: Option<NetLink>) -> Result<Prediction> {
    let sched = schedule(layout, cal, in_flight, link)?;
    let (_, report) = simulator::run(&sched).map_err(|e| TrainError::option("placement", e.to_string()))?;
    let compute_s = sched
        .ops
        .iter()
        .filter(|o| {
            matches!(
                o.kind,
                OpKind::AttentionForward
                    | OpKind::AttentionBackward
                    | OpKind::ExpertForward
                    | OpKind::ExpertBackward
                    | OpKind::HeadBackward
            )
        })
        .map(|o| o.duration_s)
        .sum();
    Ok(Prediction {
        step_s: report.step_s + cal.overhead_s,
        exposed_comm_s: report.workers.iter().map(|w| w.exposed_comm_s).sum(),
        compute_s,
    })
}

/// The chunk of the op that computes the attention over a unit's own block ([`Build::split_task`]).
const OWN_CHUNK: u16 = u16::MAX;

/// Adds ops to a [`ScheduleBuilder`] from calibrated durations and sizes.
struct Build<'a> {
    b: ScheduleBuilder,
    cal: &'a Calibration,
    /// Every port's link (`None`: messages arrive at once).
    link: Option<NetLink>,
    /// The link's latency, seconds (0 without one).
    latency_s: f64,
}

impl Build<'_> {
    /// Worker `w`'s `task` on `stream`, as op `kind` with its calibrated duration.
    fn task(&mut self, w: usize, task: Task) -> Result<OpId> {
        let kind = match task {
            Task::AttnFwd { .. } | Task::RingFwd { .. } => OpKind::AttentionForward,
            Task::FfnFwd { .. } => OpKind::ExpertForward,
            Task::Head { .. } => OpKind::HeadBackward,
            Task::FfnBwd { .. } => OpKind::ExpertBackward,
            Task::AttnBwd { .. } | Task::RingBwd { .. } => OpKind::AttentionBackward,
        };
        let (mb, layer) = match task {
            Task::AttnFwd { mb, layer } | Task::FfnFwd { mb, layer, .. } | Task::RingFwd { mb, layer, .. } => {
                (mb, layer as u32)
            }
            Task::FfnBwd { mb, layer } | Task::AttnBwd { mb, layer } | Task::RingBwd { mb, layer } => {
                (mb, layer as u32)
            }
            Task::Head { mb } => (mb, NO_LAYER),
        };
        // A context-parallel attention stage's ring half is its chunk 1 backward, and chunk `i`
        // forward for its block `i` back along the ring.
        let chunk = match task {
            Task::RingFwd { block, .. } => block as u16,
            Task::RingBwd { .. } => 1,
            _ => 0,
        };
        let name = task.name();
        let secs = *self.cal.tasks.get(&(w, name.clone())).ok_or_else(|| {
            TrainError::option("placement", format!("the calibration run has no task `{name}` on worker {w}"))
        })?;
        Ok(self.b.op(w, stream(task.queue()), kind, mb, layer, chunk, Vec::new(), secs, 0.0, 0.0))
    }

    /// Worker `w`'s `task` (an attention task of a context-parallel stage) split where the
    /// runtime sends: the task up to its sends, and the attention over the unit's own block after
    /// them (its own op, after the first, [`OWN_CHUNK`]), each with its calibrated duration.
    /// `None` for the second where the calibration has no span of it (a trace from before it was
    /// traced apart): the task is then one op.
    fn split_task(&mut self, w: usize, task: Task) -> Result<(OpId, Option<OpId>)> {
        let op = self.task(w, task)?;
        let Some(secs) = task.own_block_name().and_then(|n| self.cal.tasks.get(&(w, n)).copied()) else {
            return Ok((op, None));
        };
        let first = &mut self.b.schedule.ops[op];
        first.duration_s = (first.duration_s - secs).max(0.0);
        let (kind, mb, layer) = (first.kind, first.micro_batch as usize, first.layer);
        Ok((op, Some(self.b.op(w, stream(task.queue()), kind, mb, layer, OWN_CHUNK, vec![op], secs, 0.0, 0.0))))
    }

    fn after(&mut self, op: OpId, deps: impl IntoIterator<Item = OpId>) {
        self.b.schedule.ops[op].deps.extend(deps);
    }

    /// The message `kind` of (`mb`, `layer`) from `from` (produced by `src`) to `to`: the op its
    /// consumer waits on (`src` itself for a message to oneself).
    fn message(&mut self, kind: &str, mb: usize, layer: usize, from: usize, to: usize, src: OpId) -> Result<OpId> {
        if from == to {
            return Ok(src);
        }
        let name = format!("{kind} L{layer} mb{mb} -> {to}");
        let bytes = *self.cal.messages.get(&(from, name.clone())).ok_or_else(|| {
            TrainError::option("placement", format!("the calibration run has no message `{name}` from worker {from}"))
        })?;
        let backward = kind.starts_with("grad");
        let transfer = match kind {
            "keys-values" | "grad-keys-values" => Transfer::Ring,
            k if k.ends_with("dispatch") => Transfer::M2n,
            _ => Transfer::N2m,
        };
        let secs = self.link.map_or(0.0, |l| l.send_s(bytes));
        let kind = OpKind::Send { to, transfer, backward };
        let send = self.b.op(from, StreamKind::Comm, kind, mb, layer as u32, 0, vec![src], secs, 0.0, bytes);
        let recv = OpKind::Recv { from };
        Ok(self.b.op(to, StreamKind::Recv, recv, mb, layer as u32, 0, vec![send], self.latency_s, 0.0, bytes))
    }
}

/// The schedule the runtime executes for `layout` (see the module doc).
pub fn schedule(layout: &Layout, cal: &Calibration, in_flight: usize, link: Option<NetLink>) -> Result<Schedule> {
    let (workers, layers, mbs) = (layout.workers, layout.layers, layout.micro_batches);
    // As the scheduler: a window of 0 starts one.
    let in_flight = in_flight.max(1);
    if cal.end_of_step_s.len() != workers {
        return Err(TrainError::option(
            "workers",
            format!("the calibration has {} workers, the run {workers}", cal.end_of_step_s.len()),
        ));
    }
    let rate = link.map(|l| l.bytes_per_s());
    let latency_s = link.map_or(0.0, |l| l.latency_us * 1e-6);
    let mut x = Build { b: ScheduleBuilder::new(&format!("runtime {:?}", layout.placement)), cal, link, latency_s };
    // Compute streams in the scheduler's priority (the simulator serves a worker's streams in
    // the order listed), then the link's.
    let mut streams: Vec<(StreamKind, bool)> = Queue::PRIORITY.iter().map(|&q| (stream(q), false)).collect();
    streams.extend([(StreamKind::Comm, false), (StreamKind::Recv, false)]);
    for w in 0..workers {
        let role = match layout.placement {
            Placement::Disagg if w < layout.attn_workers => WorkerRole::Attention { group: w / layout.attn_per_group },
            Placement::Disagg => WorkerRole::Ffn { group: (w - layout.attn_workers) / layout.ffn_per_group },
            _ => WorkerRole::Stage { stage: w },
        };
        x.b.worker(layout.worker_name(w), role, 1, 1, rate.unwrap_or(0.0), &streams);
    }
    // The last backward task per (worker, backward key) so far: the scheduler runs each key's
    // micro-batches in order. Layer-0 backward per micro-batch: the in-flight window.
    let mut last_bwd: HashMap<(usize, (BackwardKind, usize)), OpId> = HashMap::new();
    let mut layer0_bwd: HashMap<usize, OpId> = HashMap::new();
    let mut all_bwd = Vec::new();
    let c = layout.context_parallel;
    let owned: Vec<Vec<usize>> = (0..workers).map(|w| layout.own_units(w)).collect();
    for m in 0..mbs {
        let head_w = layout.head_worker(m);
        let ring: Vec<usize> = layout.ring_units(m * c).collect();
        // Forward, per layer and unit of the micro-batch (without context parallelism, the one
        // unit is the micro-batch): attention; with context parallelism its block of keys and
        // values to the ring's other units, its own block's attention, and the ring half a task
        // per other block as each is here; dispatch to
        // every holder, expert forward, combine and residual to the next layer's attention worker
        // (the head's after the last layer). A unit starts when the window of its embedding
        // worker has room.
        let mut inputs: Vec<Vec<OpId>> = ring
            .iter()
            .map(|&u| {
                let e = layout.attn_worker(u, 0);
                let pos = owned[e].iter().position(|&o| o == u).unwrap_or(0);
                if pos >= in_flight {
                    vec![layer0_bwd[&owned[e][pos - in_flight]]]
                } else {
                    Vec::new()
                }
            })
            .collect();
        for l in 0..layers {
            // With context parallelism the projection half's sends, then its own block's attention.
            let (mut fwd, mut own) = (Vec::with_capacity(c), Vec::with_capacity(c));
            for (i, &u) in ring.iter().enumerate() {
                let a = layout.attn_worker(u, l);
                let task = Task::AttnFwd { mb: u, layer: l };
                let (af, own_op) = if c > 1 { x.split_task(a, task)? } else { (x.task(a, task)?, None) };
                x.after(af, std::mem::take(&mut inputs[i]));
                fwd.push(af);
                own.push(own_op.unwrap_or(af));
            }
            // Each unit's block round the ring, to ring rank r + 1 first (the scheduler's order).
            let mut blocks: HashMap<(usize, usize), OpId> = HashMap::new();
            for (j, &v) in ring.iter().enumerate().filter(|_| c > 1) {
                for d in 1..c {
                    let (i, a) = ((j + d) % c, layout.attn_worker(ring[(j + d) % c], l));
                    blocks.insert((i, d), x.message("keys-values", v, l, layout.attn_worker(v, l), a, fwd[j])?);
                }
            }
            for (i, &u) in ring.iter().enumerate() {
                let a = layout.attn_worker(u, l);
                // The ring half: a task per other block, in ring order (r - 1, r - 2, ...).
                let mut out = own[i];
                for d in 1..c {
                    let rf = x.task(a, Task::RingFwd { mb: u, layer: l, block: d })?;
                    x.after(rf, [out, blocks[&(i, d)]]);
                    out = rf;
                }
                let next = if l + 1 < layers { layout.attn_worker(u, l + 1) } else { head_w };
                for h in layout.ffn_holders(l) {
                    let d = x.message("dispatch", u, l, a, h, out)?;
                    let ff = x.task(h, Task::FfnFwd { mb: u, layer: l, src: a })?;
                    x.after(ff, [d]);
                    inputs[i].push(x.message("combine", u, l, h, next, ff)?);
                }
                inputs[i].push(x.message("residual", u, l, a, next, out)?);
            }
        }
        let head = x.task(head_w, Task::Head { mb: m })?;
        x.after(head, inputs.concat());
        // `op` after the key's op before it; the next after `end` (the task's last op).
        let mut ordered = |x: &mut Build, op: OpId, end: OpId, w: usize, task: Task| {
            let (key, _) = task.backward_key().expect("a backward task");
            if let Some(prev) = last_bwd.insert((w, key), end) {
                x.after(op, [prev]);
            }
        };
        ordered(&mut x, head, head, head_w, Task::Head { mb: m });
        all_bwd.push(head);
        // Backward: the gradient of each layer's output goes to its attention worker (residual)
        // and to its holders (their rows); their input gradients back to the attention worker;
        // with context parallelism the ring half's backward sends the gradients of the blocks it
        // received to their owners, whose projection half's backward waits for them.
        let mut src: Vec<(OpId, usize)> = vec![(head, head_w); c];
        for l in (0..layers).rev() {
            let mut bwd = Vec::with_capacity(c);
            for (i, &u) in ring.iter().enumerate() {
                let a = layout.attn_worker(u, l);
                let (s, s_w) = src[i];
                let mut deps = vec![x.message("grad-residual", u, l, s_w, a, s)?];
                for h in layout.ffn_holders(l) {
                    let gc = x.message("grad-combine", u, l, s_w, h, s)?;
                    let task = Task::FfnBwd { mb: u, layer: l };
                    let fb = x.task(h, task)?;
                    x.after(fb, [gc]);
                    ordered(&mut x, fb, fb, h, task);
                    all_bwd.push(fb);
                    deps.push(x.message("grad-dispatch", u, l, h, a, fb)?);
                }
                let task = Task::AttnBwd { mb: u, layer: l };
                // With context parallelism the received blocks' gradients are sent, then the own
                // block's backward runs (the task ends, and the next one of its key waits, after it).
                let (ab, own_op) = if c > 1 { x.split_task(a, task)? } else { (x.task(a, task)?, None) };
                x.after(ab, deps);
                let end = own_op.unwrap_or(ab);
                ordered(&mut x, ab, end, a, task);
                all_bwd.extend(own_op);
                all_bwd.push(ab);
                bwd.push((ab, end));
                src[i] = (ab, a);
            }
            if c > 1 {
                for (i, &u) in ring.iter().enumerate() {
                    let a = layout.attn_worker(u, l);
                    let mut deps = vec![bwd[i].1];
                    for (j, &v) in ring.iter().enumerate().filter(|&(j, _)| j != i) {
                        deps.push(x.message("grad-keys-values", u, l, layout.attn_worker(v, l), a, bwd[j].0)?);
                    }
                    let task = Task::RingBwd { mb: u, layer: l };
                    let rb = x.task(a, task)?;
                    x.after(rb, deps);
                    ordered(&mut x, rb, rb, a, task);
                    all_bwd.push(rb);
                    src[i] = (rb, a);
                }
            }
            if l == 0 {
                for (i, &u) in ring.iter().enumerate() {
                    layer0_bwd.insert(u, bwd[i].1);
                }
            }
        }
    }
    // End of step: the all-reduces start when every worker's backward is done (they include the
    // global sums every worker takes part in), then each worker's optimizer step.
    for w in 0..workers {
        let secs = x.link.map_or(0.0, |l| {
            cal.reduce_bytes[w] / l.bytes_per_s() + cal.reduce_messages[w] * (x.latency_s + l.per_message_us * 1e-6)
        });
        let ar = x.b.op(w, StreamKind::Comm, OpKind::AllReduce, 0, NO_LAYER, 0, all_bwd.clone(), secs, 0.0, 0.0);
        x.b.op(w, stream(Queue::Backward), OpKind::Optimizer, 0, NO_LAYER, 0, vec![ar], cal.end_of_step_s[w], 0.0, 0.0);
    }
    let mut sched = x.b.finish().map_err(|e| TrainError::option("placement", e.to_string()))?;
    let half_duplex = link.is_some_and(|l| l.half_duplex);
    sched.workers.iter_mut().for_each(|w| w.half_duplex = half_duplex);
    Ok(sched)
}

/// A calibrated configuration: what [`predict`] needs besides the link and the window.
#[derive(Debug, Clone)]
pub struct Calibrated {
    /// The run's layout.
    pub layout: Layout,
    /// Measured durations and sizes.
    pub calibration: Calibration,
    /// The calibration run's in-flight window.
    pub in_flight: usize,
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    /// One layer, two micro-batches, one attention and one expert worker; attention forward 1 s,
    /// expert forward 3 s, head 0.5 s, expert backward 4 s, attention backward 2 s, end of step
    /// 0.25 s; every message 1000 bytes.
    fn one_layer() -> (Layout, Calibration) {
        let layout = Layout::disagg(1, 2, 2, 1, 1, 1).unwrap();
        let mut cal = Calibration { end_of_step_s: vec![0.25; 2], reduce_messages: vec![0.0; 2], ..Default::default() };
        cal.reduce_bytes = vec![0.0; 2];
        for m in 0..2 {
            for (w, name, s) in [
                (0, format!("fwd attn L0 mb{m}"), 1.0),
                (1, format!("fwd experts L0 mb{m}"), 3.0),
                (0, format!("head mb{m}"), 0.5),
                (1, format!("bwd experts L0 mb{m}"), 4.0),
                (0, format!("bwd attn L0 mb{m}"), 2.0),
            ] {
                cal.tasks.insert((w, name), s);
            }
            for (w, kind, to) in
                [(0, "dispatch", 1), (1, "combine", 0), (0, "grad-combine", 1), (1, "grad-dispatch", 0)]
            {
                cal.messages.insert((w, format!("{kind} L0 mb{m} -> {to}")), 1000.0);
            }
        }
        (layout, cal)
    }

    #[test]
    fn the_in_flight_window_and_the_backward_priority_shape_the_step() {
        let (layout, cal) = one_layer();
        // One in flight: the two micro-batches run one after the other, 10.5 s each, then the
        // optimizer.
        let one = predict(&layout, &cal, 1, None).unwrap();
        assert_eq!(one.step_s, 21.25);
        assert_eq!(one.compute_s, 2.0 * 10.5);
        // Two in flight: the second micro-batch's attention runs under the first's experts; the
        // expert worker takes the second forward (ready at 2 s) before the first backward (ready
        // at 4.5 s), then backward in micro-batch order: 1, 2 | 2, 5 | 4, 4.5 | 7, 7.5 | 7, 11 |
        // 11, 13 | 11, 15 | 15, 17 and the optimizer to 17.25.
        assert_eq!(predict(&layout, &cal, 2, None).unwrap().step_s, 17.25);
    }

    #[test]
    fn a_link_adds_bytes_over_the_rate_and_the_latency_per_message_on_the_path() {
        let (layout, cal) = one_layer();
        // 1000 bytes at 16 kbit/s: 0.5 s on the wire, 0.1 s latency: four messages on the
        // critical path of each micro-batch, 0.6 s each.
        let link = NetLink { gbps: 16e-6, latency_us: 1e5, per_message_us: 0.0, half_duplex: false };
        let p = predict(&layout, &cal, 1, Some(link)).unwrap();
        assert!((p.step_s - (21.25 + 2.0 * 4.0 * 0.6)).abs() < 1e-9, "{p:?}");
        // Each worker waits 0.6 s on each of its two incoming messages per micro-batch.
        assert!((p.exposed_comm_s - 2.0 * 2.0 * 2.0 * 0.6).abs() < 1e-9, "{p:?}");
        // The calibration's overhead is added as measured.
        // A per-message cost (a fitted link's) holds the sender's port as long again per message.
        let costly = NetLink { per_message_us: 1e5, ..link };
        let q = predict(&layout, &cal, 1, Some(costly)).unwrap();
        assert!((q.step_s - (p.step_s + 2.0 * 4.0 * 0.1)).abs() < 1e-9, "{q:?}");
        let cal = Calibration { overhead_s: 0.125, ..cal };
        assert!((predict(&layout, &cal, 1, Some(link)).unwrap().step_s - (p.step_s + 0.125)).abs() < 1e-9);
    }

    #[test]
    fn a_calibration_that_does_not_fit_the_run_is_refused_by_name() {
        let (_, cal) = one_layer();
        let two_layers = Layout::disagg(2, 2, 2, 1, 1, 1).unwrap();
        let e = predict(&two_layers, &cal, 1, None).unwrap_err().to_string();
        assert!(e.contains("no task `fwd attn L1 mb0` on worker 0"), "{e}");
        let ep = Layout::ep(1, 2, 2, 2).unwrap();
        let e = predict(&ep, &cal, 1, None).unwrap_err().to_string();
        assert!(e.contains("no task"), "{e}");
    }

    #[test]
    fn a_trace_calibrates_from_the_steps_after_the_first() {
        // Two workers, three steps; step 0 is slower and left out.
        let mut events = Vec::new();
        let mut ev = |name: &str, cat: &str, pid: usize, ts: u64, dur: u64, bytes: u64| {
            let mut e =
                serde_json::json!({"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": pid, "tid": 0});
            if bytes > 0 {
                e["args"] = serde_json::json!({"bytes": bytes});
            }
            events.push(e);
        };
        for (step, t0, fwd) in [(0u64, 0u64, 900u64), (1, 10_000, 100), (2, 20_000, 300)] {
            ev("fwd attn L0 mb0", "forward", 0, t0, fwd, 0);
            ev("dispatch L0 mb0 -> 1", "send", 0, t0 + fwd, 5, 1000 + step);
            ev("fwd experts L0 mb0", "forward", 1, t0 + 1000, 200, 0);
            ev("reduce -> 1", "send", 0, t0 + 2000, 1, 64);
            ev("reduce -> 1", "send", 0, t0 + 2001, 1, 64);
            ev("all-reduce + optimizer", "optimizer", 0, t0 + 2000, 500, 0);
            ev("all-reduce + optimizer", "optimizer", 1, t0 + 2000, 700 + step, 0);
            ev("wait (dispatch)", "wait", 1, t0, 1000, 0);
        }
        let dir = std::env::temp_dir().join(format!("disagmoe-calibration-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("trace.json");
        std::fs::write(&path, serde_json::json!({"traceEvents": events}).to_string()).unwrap();
        let cal = Calibration::from_trace(&path, 2).unwrap();
        assert_eq!(cal.steps, 2);
        assert!((cal.tasks[&(0, "fwd attn L0 mb0".to_string())] - 200e-6).abs() < 1e-12, "median of 100 and 300 us");
        assert_eq!(cal.messages[&(0, "dispatch L0 mb0 -> 1".to_string())], 1001.5);
        assert_eq!((cal.reduce_messages.clone(), cal.reduce_bytes.clone()), (vec![2.0, 0.0], vec![128.0, 0.0]));
        assert!((cal.end_of_step_s[1] - 701.5e-6).abs() < 1e-12);
        // Worker 1's steps end at 2700, 12701 and 22702 us, worker 0's 10000 us apart.
        assert!((cal.step_s - 10_001e-6).abs() < 1e-12, "{}", cal.step_s);
        let e = Calibration::from_trace(&path, 1).unwrap_err().to_string();
        assert!(e.contains("an event of worker 1 in a run of 1"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A calibration that times every task of `layout` at 1 s and sizes every message at 1000
    /// bytes (more entries than the schedule asks for).
    fn uniform(layout: &Layout) -> Calibration {
        let w = layout.workers;
        let mut cal = Calibration {
            end_of_step_s: vec![0.25; w],
            reduce_messages: vec![0.0; w],
            reduce_bytes: vec![0.0; w],
            ..Default::default()
        };
        for worker in 0..w {
            for mb in 0..layout.micro_batches {
                cal.tasks.insert((worker, Task::Head { mb }.name()), 1.0);
            }
            for mb in 0..layout.units() {
                for layer in 0..layout.layers {
                    for t in [
                        Task::AttnFwd { mb, layer },
                        Task::FfnFwd { mb, layer, src: 0 },
                        Task::FfnBwd { mb, layer },
                        Task::AttnBwd { mb, layer },
                        Task::RingBwd { mb, layer },
                    ] {
                        cal.tasks.insert((worker, t.name()), 1.0);
                    }
                    for block in 1..layout.context_parallel {
                        cal.tasks.insert((worker, Task::RingFwd { mb, layer, block }.name()), 1.0);
                    }
                    for t in [Task::AttnFwd { mb, layer }, Task::AttnBwd { mb, layer }] {
                        cal.tasks.insert((worker, t.own_block_name().unwrap()), 0.5);
                    }
                    for to in 0..w {
                        for kind in [
                            "dispatch",
                            "combine",
                            "residual",
                            "grad-combine",
                            "grad-residual",
                            "grad-dispatch",
                            "keys-values",
                            "grad-keys-values",
                        ] {
                            cal.messages.insert((worker, format!("{kind} L{layer} mb{mb} -> {to}")), 1000.0);
                        }
                    }
                }
            }
        }
        cal
    }

    /// The order the prediction assumes is the scheduler's: on five layouts (two with context
    /// parallelism), each worker's backward ops of one [`BackwardKind`] key run its micro-batches
    /// (units) in the order of the scheduler's [`super::super::scheduler::BackwardOrder`], each
    /// after the one before, and an embedding worker's unit `i + K` starts after the layer-0
    /// backward of its `i`.
    #[test]
    fn the_predicted_schedule_orders_tasks_by_the_scheduler_s_rules() {
        use super::super::scheduler::BackwardOrder;
        let cp = |l: Layout, c| l.with_context_parallel(c).unwrap();
        for (layout, window) in [
            (Layout::disagg(2, 4, 4, 2, 2, 1).unwrap(), 2),
            (Layout::disagg(4, 8, 4, 2, 2, 2).unwrap(), 1),
            (Layout::ep(3, 4, 4, 2).unwrap(), 1),
            (cp(Layout::disagg(2, 4, 4, 2, 2, 1).unwrap(), 2), 2),
            (cp(Layout::disagg(3, 8, 3, 4, 2, 2).unwrap(), 2), 1),
            (cp(Layout::disagg(3, 8, 6, 8, 4, 2).unwrap(), 4), 2),
        ] {
            let sched = schedule(&layout, &uniform(&layout), window, None).unwrap();
            let task_of = |op: &disagmoe_core::schedule::Op| {
                let (mb, layer, ring) = (op.micro_batch as usize, op.layer as usize, op.chunk >= 1);
                match op.kind {
                    _ if op.chunk == OWN_CHUNK => None,
                    OpKind::AttentionForward if ring => Some(Task::RingFwd { mb, layer, block: op.chunk as usize }),
                    OpKind::AttentionForward => Some(Task::AttnFwd { mb, layer }),
                    OpKind::HeadBackward => Some(Task::Head { mb }),
                    OpKind::ExpertBackward => Some(Task::FfnBwd { mb, layer }),
                    OpKind::AttentionBackward if ring => Some(Task::RingBwd { mb, layer }),
                    OpKind::AttentionBackward => Some(Task::AttnBwd { mb, layer }),
                    _ => None,
                }
            };
            // `op` waits for `prev`, or for the own block's op after it.
            let waits = |op: usize, prev: usize| {
                let deps = &sched.ops[op].deps;
                deps.contains(&prev)
                    || deps.iter().any(|&d| sched.ops[d].chunk == OWN_CHUNK && sched.ops[d].deps.contains(&prev))
            };
            let c = layout.context_parallel;
            if c > 1 {
                let own = sched.ops.iter().filter(|op| op.chunk == OWN_CHUNK).count();
                assert_eq!(own, 2 * layout.units() * layout.layers, "the own block's op of every attention task");
            }
            for w in 0..layout.workers {
                let order = BackwardOrder::of(&layout, w);
                let mine: Vec<(usize, Task)> = (sched.ops.iter().enumerate())
                    .filter(|(_, op)| op.worker == w)
                    .filter_map(|(i, op)| task_of(op).map(|t| (i, t)))
                    .collect();
                let mut by_key: HashMap<(BackwardKind, usize), Vec<(usize, usize)>> = HashMap::new();
                for &(i, t) in &mine {
                    if let Some((key, mb)) = t.backward_key() {
                        by_key.entry(key).or_default().push((mb, i));
                    }
                }
                for (key, mut ops) in by_key {
                    ops.sort_unstable();
                    let mbs: Vec<usize> = ops.iter().map(|&(mb, _)| mb).collect();
                    assert_eq!(mbs, order.queue(key), "worker {w} {key:?}: the scheduler's micro-batches");
                    for pair in ops.windows(2) {
                        assert!(waits(pair[1].1, pair[0].1), "worker {w} {key:?}: {pair:?} chained");
                    }
                }
                let own = layout.own_units(w);
                let op_of = |t: Task| mine.iter().find(|&&(_, x)| x == t).map(|&(i, _)| i).unwrap();
                for (i, &mb) in own.iter().enumerate().skip(window) {
                    let released = op_of(Task::AttnBwd { mb: own[i - window], layer: 0 });
                    let start = op_of(Task::AttnFwd { mb, layer: 0 });
                    assert!(waits(start, released), "worker {w}: the window before mb {mb}");
                }
                // A ring half's task per other block, each after the stage's task before it and
                // the block's arrival from ring rank r - i.
                for &(i, t) in &mine {
                    let Task::RingFwd { mb, layer, block } = t else { continue };
                    let before = if block == 1 {
                        Task::AttnFwd { mb, layer }
                    } else {
                        Task::RingFwd { mb, layer, block: block - 1 }
                    };
                    let deps = &sched.ops[i].deps;
                    assert!(waits(i, op_of(before)), "worker {w}: {t:?} after {before:?}");
                    let sender = layout.attn_worker(mb - mb % c + (mb % c + c - block) % c, layer);
                    let from_sender = |d: &OpId| {
                        matches!(sched.ops[*d].kind, OpKind::Recv { from } if from == sender)
                            || (sender == w
                                && sched.ops[*d].kind == OpKind::AttentionForward
                                && sched.ops[*d].chunk == 0)
                    };
                    assert!(deps.len() == 2 && deps.iter().any(from_sender), "worker {w}: {t:?} waits for its block");
                }
            }
        }
    }

    /// The traced runs of `fixtures/predict/` (`benches/afpipe-compare.json`, 8 x 32 tokens in 4
    /// micro-batches, 2 steps), their layouts and in-flight windows.
    fn traced_runs() -> Vec<(&'static str, Layout, usize)> {
        vec![
            ("disagg-2-2-groups-2", Layout::disagg(4, 8, 4, 2, 2, 2).unwrap(), 4),
            ("disagg-1-1", Layout::disagg(4, 8, 4, 1, 1, 1).unwrap(), 4),
            ("ep-2", Layout::ep(4, 8, 4, 2).unwrap(), 1),
        ]
    }

    fn fixture(name: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/predict").join(format!("{name}.json"))
    }

    const LINKS: [Option<NetLink>; 3] = [
        None,
        Some(NetLink { gbps: 0.2, latency_us: 20.0, per_message_us: 0.0, half_duplex: false }),
        Some(NetLink { gbps: 1.0, latency_us: 5.0, per_message_us: 0.0, half_duplex: false }),
    ];

    /// Same traces in, same predictions out: the traced runs' calibrations give, at every window
    /// and over three links, the predictions the code before the runtime's split into layers gave
    /// (`fixtures/predict/expected.json`, bit for bit, with the same number of ops).
    #[test]
    fn compare_predict_gives_the_predictions_of_before_from_the_same_traces() {
        let text = std::fs::read_to_string(fixture("expected")).unwrap();
        let expected: serde_json::Value = serde_json::from_str(&text).unwrap();
        let rows = expected["predictions"].as_array().unwrap();
        let mut checked = 0;
        for (name, layout, window) in traced_runs() {
            let cal = Calibration::from_trace(&fixture(name), layout.workers).unwrap();
            let cal = cal.with_overhead(&layout, window).unwrap();
            for link in LINKS {
                for w in 1..=window {
                    let want = rows
                        .iter()
                        .find(|r| {
                            let l = &r["link"];
                            r["run"] == name
                                && r["in_flight"] == w
                                && link.map(|k| (k.gbps, k.latency_us))
                                    == l["gbps"].as_f64().map(|g| (g, l["latency_us"].as_f64().unwrap()))
                        })
                        .unwrap_or_else(|| panic!("{name} {link:?} {w}: no expected prediction"));
                    let p = predict(&layout, &cal, w, link).unwrap();
                    let bits = |key: &str| f64::from_bits(want[key].as_u64().unwrap());
                    let at = format!("{name}, link {link:?}, {w} in flight");
                    assert_eq!(
                        p.step_s.to_bits(),
                        want["step_s_bits"].as_u64().unwrap(),
                        "{at}: step {} vs {}",
                        p.step_s,
                        bits("step_s_bits")
                    );
                    assert_eq!(
                        p.exposed_comm_s.to_bits(),
                        want["exposed_comm_s_bits"].as_u64().unwrap(),
                        "{at}: exposed"
                    );
                    assert_eq!(p.compute_s.to_bits(), want["compute_s_bits"].as_u64().unwrap(), "{at}: compute");
                    let ops = schedule(&layout, &cal, w, link).unwrap().ops.len() as u64;
                    assert_eq!(ops, want["ops"].as_u64().unwrap(), "{at}: ops");
                    checked += 1;
                }
            }
        }
        assert_eq!(checked, rows.len(), "every expected prediction checked");
    }
}
