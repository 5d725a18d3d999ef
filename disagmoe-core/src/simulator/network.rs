//! The modelled network of a simulated step: each worker's port in two directions, transfers as
//! flows that share a port max-min fairly (progressive filling).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::*;
use crate::schedule::OpId;

/// A transfer in flight: its ports, the seconds of work left at full speed as of `since`, and its
/// rate (fraction of full speed).
pub(super) struct Flow {
    pub(super) op: OpId,
    pub(super) ports: [usize; 2],
    pub(super) left: f64,
    pub(super) since: f64,
    pub(super) rate: f64,
    /// Bumped whenever the finish time changes, so older entries of the finish heap are stale.
    pub(super) version: u64,
    /// Whether the finish heap holds an entry of the current version.
    pub(super) queued: bool,
    pub(super) live: bool,
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
pub(super) struct Network {
    pub(super) flows: Vec<Flow>,
    pub(super) free: Vec<usize>,
    pub(super) by_port: Vec<Vec<usize>>,
    /// Ports carrying three flows or more.
    pub(super) crowded: usize,
    /// Whether every rate is the local one (no port was crowded at the last rebalance).
    pub(super) rates_local: bool,
    pub(super) finish: BinaryHeap<Reverse<(Time, usize, u64)>>,
    // Scratch of `rebalance`, kept to avoid allocating per event.
    pub(super) port_seen: Vec<bool>,
    pub(super) flow_seen: Vec<bool>,
    pub(super) cap: Vec<f64>,
    pub(super) count: Vec<usize>,
    pub(super) queue: Vec<usize>,
    pub(super) members: Vec<usize>,
    pub(super) old_rates: Vec<f64>,
    pub(super) frozen: Vec<bool>,
}

impl Network {
    pub(super) fn new(n_ports: usize) -> Self {
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
    pub(super) fn start(&mut self, op: OpId, ports: [usize; 2], secs: f64, now: f64) -> usize {
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
    pub(super) fn rebalance(&mut self, touched: &[usize], now: f64) {
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
    pub(super) fn set_rate(&mut self, k: usize, rate: f64, now: f64) {
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
    pub(super) fn next_finish(&mut self) -> Option<f64> {
        while let Some(&Reverse((Time(t), k, v))) = self.finish.peek() {
            if self.flows[k].live && self.flows[k].version == v {
                return Some(t);
            }
            self.finish.pop();
        }
        None
    }

    /// Removes the flows that finish by `t`, appending their ops to `done` and ports to `freed`.
    pub(super) fn finish_until(&mut self, t: f64, done: &mut Vec<OpId>, freed: &mut Vec<usize>) {
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
