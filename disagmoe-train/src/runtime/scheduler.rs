//! Which task a worker runs next: the AF-Pipe schedule of one step, without a tensor.
//!
//! A worker's loop is "receive, tell the scheduler ([`Scheduler::on_message`]), run what it
//! returns ([`Scheduler::next`]), tell it the task is done ([`Scheduler::done`])". A task becomes
//! ready when all its inputs are there:
//!
//! | task            | ready when                                                      | sends                                   |
//! |-----------------|-----------------------------------------------------------------|-----------------------------------------|
//! | attention fwd l | embedding (l = 0), or residual + every holder's combine of l-1  | dispatch to l's holders, residual to l+1 |
//! | expert fwd l    | a dispatch arrives                                              | combine to l+1's attention worker       |
//! | head            | residual + every holder's combine of the last layer             | loss; grads to the last layer           |
//! | expert bwd l    | the gradient of its combine arrives                             | grad-dispatch to l's attention worker   |
//! | attention bwd l | grad-residual + every holder's grad-dispatch of l               | grads to l-1's attention and holders    |
//!
//! The rules, each written once here (the prediction of `compare --predict` builds its schedule
//! from the same [`Queue`] priority, [`BackwardKind`] keys and window rule, [`super::predict`]):
//! - **priority** ([`Queue::PRIORITY`]): backward work first (in the [`BackwardOrder`]), then
//!   expert forwards, then attention forwards, each in the order it became ready, so gradients
//!   flow out while new micro-batches come in;
//! - **backward order**: the head's backward and each layer's (attention or experts) run
//!   micro-batches in increasing order, so every parameter's gradient is the sum of the same terms
//!   in the same order whatever order the messages arrived in (a run is bit-reproducible, which an
//!   exact resume needs). It never deadlocks: the lowest waiting micro-batch of a layer depends
//!   only on lower or equal micro-batches;
//! - **in-flight window**: an embedding worker starts `in_flight` of its micro-batches, and the
//!   next one whenever the layer-0 attention backward of one ends;
//! - **end**: the step's tasks are done when every backward task of the worker has run (the
//!   head's backward is part of the head task and is not counted).
//!
//! With context parallelism (`Layout::context_parallel` `C > 1`) the attention tasks work on
//! units (a ring worker's tokens of a micro-batch, `Layout::units`) and each attention stage is
//! `C` tasks forward and two backward, because a unit's attention needs the keys and values of
//! the `C - 1` other units of its ring (the attention over its own block is computed in the
//! first task each way, while the blocks or their gradients travel; each other block's is merged
//! on in a task of its own as soon as it and the blocks before it in ring order are in, while
//! the later ones travel: `worker/ring.rs`):
//!
//! | task              | ready when                                              | sends                               |
//! |-------------------|---------------------------------------------------------|-------------------------------------|
//! | attention fwd l   | as above, for the unit                                  | its keys and values to the ring     |
//! | ring fwd l, block i (`1..C`) | the stage's task before it ran (attention fwd l, or block i - 1) and ring rank r - i's block is here | the last (i = C - 1): as attention fwd l above |
//! | head              | every unit of the micro-batch has its inputs            | loss; grads to each unit's layer    |
//! | attention bwd l   | as above, for the unit                                  | the blocks' gradients to their owners |
//! | ring bwd l        | attention bwd l ran and the `C - 1` gradients of its block are here | grads to l-1's attention and holders |
//!
//! The ring's backward tasks have a backward-order key of their own; the window opens on a
//! unit's layer-0 attention backward, as without context parallelism.

use std::collections::{HashMap, VecDeque};

use super::layout::Layout;
use super::msg::Msg;

/// A task of a worker's step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Task {
    /// Attention stage `layer` of micro-batch `mb` (layer 0 from the embedding).
    AttnFwd {
        /// Micro-batch.
        mb: usize,
        /// Layer.
        layer: usize,
    },
    /// This holder's share of `layer`'s experts on the dispatch from attention worker `src`.
    FfnFwd {
        /// Micro-batch.
        mb: usize,
        /// Layer.
        layer: usize,
        /// The attention worker that dispatched it.
        src: usize,
    },
    /// The loss of micro-batch `mb` and its backward through the head.
    Head {
        /// Micro-batch.
        mb: usize,
    },
    /// The backward of this holder's share of `layer`.
    FfnBwd {
        /// Micro-batch.
        mb: usize,
        /// Layer.
        layer: usize,
    },
    /// The backward of attention stage `layer` (with context parallelism: of its ring half).
    AttnBwd {
        /// Micro-batch.
        mb: usize,
        /// Layer.
        layer: usize,
    },
    /// Context parallelism: the ring half of attention stage `layer` of unit `mb`, one task per
    /// block of the other units' keys and values, in ring order: block `i` (`1..C`) is ring rank
    /// `r - i`'s, its attention merged onto that over the blocks before it (the own block's
    /// first); the last also computes the output projection, the norm and the router.
    RingFwd {
        /// Unit.
        mb: usize,
        /// Layer.
        layer: usize,
        /// The block's distance back along the ring, `1..C`.
        block: usize,
    },
    /// Context parallelism: the backward of the projection half of attention stage `layer` of
    /// unit `mb`, once the gradients of its keys and values are back from the ring.
    RingBwd {
        /// Unit.
        mb: usize,
        /// Layer.
        layer: usize,
    },
}

/// A worker's ready queues; [`Scheduler::next`] serves them in the order of [`Queue::PRIORITY`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Queue {
    /// The head's, the experts' and attention's backward tasks.
    Backward = 0,
    /// Expert forwards.
    ExpertForward = 1,
    /// Attention forwards.
    Forward = 2,
}

impl Queue {
    /// The order the queues are served in: the one priority rule of the schedule.
    pub const PRIORITY: [Queue; 3] = [Queue::Backward, Queue::ExpertForward, Queue::Forward];
}

/// The three kinds of backward work a worker orders by micro-batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BackwardKind {
    /// The head's (loss) backward.
    Head,
    /// An attention stage's backward.
    Attention,
    /// An expert stage's backward.
    Experts,
    /// The backward of an attention stage's projection half (context parallelism).
    Ring,
}

impl Task {
    /// The backward order's key of a backward task: its kind and layer (the head's: layer 0) and
    /// its micro-batch; `None` for a forward task.
    pub fn backward_key(&self) -> Option<((BackwardKind, usize), usize)> {
        match *self {
            Task::Head { mb } => Some(((BackwardKind::Head, 0), mb)),
            Task::AttnBwd { mb, layer } => Some(((BackwardKind::Attention, layer), mb)),
            Task::FfnBwd { mb, layer } => Some(((BackwardKind::Experts, layer), mb)),
            Task::RingBwd { mb, layer } => Some(((BackwardKind::Ring, layer), mb)),
            Task::AttnFwd { .. } | Task::FfnFwd { .. } | Task::RingFwd { .. } => None,
        }
    }

    /// The ready queue the task waits in.
    pub fn queue(&self) -> Queue {
        match self {
            Task::Head { .. } | Task::FfnBwd { .. } | Task::AttnBwd { .. } | Task::RingBwd { .. } => Queue::Backward,
            Task::FfnFwd { .. } => Queue::ExpertForward,
            Task::AttnFwd { .. } | Task::RingFwd { .. } => Queue::Forward,
        }
    }

    /// Whether the task counts among the step's backward tasks (the end rule).
    pub fn counts_as_backward(&self) -> bool {
        matches!(self, Task::AttnBwd { .. } | Task::FfnBwd { .. } | Task::RingBwd { .. })
    }

    /// Whether the end of the task opens the in-flight window for the next micro-batch.
    pub fn releases_window(&self) -> bool {
        matches!(self, Task::AttnBwd { layer: 0, .. })
    }

    /// The name of the task in traces and calibrations (`fwd attn L0 mb3`).
    pub fn name(&self) -> String {
        match *self {
            Task::AttnFwd { mb, layer } => format!("fwd attn L{layer} mb{mb}"),
            Task::FfnFwd { mb, layer, .. } => format!("fwd experts L{layer} mb{mb}"),
            Task::Head { mb } => format!("head mb{mb}"),
            Task::FfnBwd { mb, layer } => format!("bwd experts L{layer} mb{mb}"),
            Task::AttnBwd { mb, layer } => format!("bwd attn L{layer} mb{mb}"),
            Task::RingFwd { mb, layer, block } => format!("fwd ring{block} L{layer} unit{mb}"),
            Task::RingBwd { mb, layer } => format!("bwd ring L{layer} unit{mb}"),
        }
    }

    /// Context parallelism: the name in traces and calibrations of the part of this task (the
    /// projection half forward, the ring half backward) that computes the attention over the
    /// unit's own block, after its block or the received blocks' gradients are sent
    /// (`fwd own L0 unit3`); `None` for other tasks.
    pub fn own_block_name(&self) -> Option<String> {
        match *self {
            Task::AttnFwd { mb, layer } => Some(format!("fwd own L{layer} unit{mb}")),
            Task::AttnBwd { mb, layer } => Some(format!("bwd own L{layer} unit{mb}")),
            _ => None,
        }
    }

    /// The trace category: `forward` or `backward` (the head's task ends in its backward).
    pub fn category(&self) -> &'static str {
        match self {
            Task::AttnFwd { .. } | Task::FfnFwd { .. } | Task::RingFwd { .. } => "forward",
            _ => "backward",
        }
    }
}

/// What the scheduler needs to know of an arrived message of the token exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrival {
    /// A dispatch of (`mb`, `layer`) from attention worker `src`.
    Dispatch {
        /// Micro-batch.
        mb: usize,
        /// Layer.
        layer: usize,
        /// Sender.
        src: usize,
    },
    /// A holder's share of `layer`'s output (an input of `layer + 1`).
    Combine {
        /// Micro-batch.
        mb: usize,
        /// Layer that produced it.
        layer: usize,
    },
    /// The residual stream out of `layer`.
    Residual {
        /// Micro-batch.
        mb: usize,
        /// Layer that produced it.
        layer: usize,
    },
    /// The gradient of this holder's share of `layer`.
    GradCombine {
        /// Micro-batch.
        mb: usize,
        /// Layer.
        layer: usize,
    },
    /// The gradient of `layer`'s residual.
    GradResidual {
        /// Micro-batch.
        mb: usize,
        /// Layer.
        layer: usize,
    },
    /// A holder's gradients of its dispatch of `layer`.
    GradDispatch {
        /// Micro-batch.
        mb: usize,
        /// Layer.
        layer: usize,
    },
    /// Context parallelism: unit `from`'s block of keys and values of `layer` for unit `mb`'s
    /// attention.
    Kv {
        /// The receiving unit.
        mb: usize,
        /// Layer.
        layer: usize,
        /// The sending unit.
        from: usize,
    },
    /// Context parallelism: a gradient of unit `mb`'s block of keys and values of `layer`.
    GradKv {
        /// The owning unit.
        mb: usize,
        /// Layer.
        layer: usize,
    },
}

impl Arrival {
    /// The arrival a message from `src` is, if it belongs to the token exchange.
    pub fn of(msg: &Msg, src: usize) -> Option<Self> {
        Some(match *msg {
            Msg::Dispatch { mb, layer, .. } => Arrival::Dispatch { mb, layer, src },
            Msg::Combine { mb, layer, .. } => Arrival::Combine { mb, layer },
            Msg::Residual { mb, layer, .. } => Arrival::Residual { mb, layer },
            Msg::GradCombine { mb, layer, .. } => Arrival::GradCombine { mb, layer },
            Msg::GradResidual { mb, layer, .. } => Arrival::GradResidual { mb, layer },
            Msg::GradDispatch { mb, layer, .. } => Arrival::GradDispatch { mb, layer },
            Msg::Kv { mb, layer, to, .. } => Arrival::Kv { mb: to, layer, from: mb },
            Msg::GradKv { mb, layer, .. } => Arrival::GradKv { mb, layer },
            _ => return None,
        })
    }
}

/// The micro-batches each backward key has still to run, in order (see the module doc).
#[derive(Debug, Default)]
pub struct BackwardOrder {
    next: HashMap<(BackwardKind, usize), VecDeque<usize>>,
}

impl BackwardOrder {
    /// The order of worker `rank`'s backward tasks in a step of `layout`.
    pub fn of(layout: &Layout, rank: usize) -> Self {
        let mut next = HashMap::new();
        next.insert(
            (BackwardKind::Head, 0),
            (0..layout.micro_batches).filter(|&m| layout.head_worker(m) == rank).collect(),
        );
        for l in layout.attn_layers(rank) {
            let units: VecDeque<usize> = layout.attn_units(rank, l).into();
            if layout.context_parallel > 1 {
                next.insert((BackwardKind::Ring, l), units.clone());
            }
            next.insert((BackwardKind::Attention, l), units);
        }
        for (l, _) in layout.ffn_layers(rank) {
            next.insert((BackwardKind::Experts, l), (0..layout.units()).collect());
        }
        Self { next }
    }

    /// The micro-batches of `key` still to run, in their order (empty for a key the worker has
    /// no task of).
    pub fn queue(&self, key: (BackwardKind, usize)) -> Vec<usize> {
        self.next.get(&key).map(|q| q.iter().copied().collect()).unwrap_or_default()
    }

    /// Whether `task` may run now.
    pub fn allows(&self, task: &Task) -> bool {
        match task.backward_key() {
            Some((key, mb)) => self.next.get(&key).and_then(|q| q.front()) == Some(&mb),
            None => true,
        }
    }

    /// Records that `task` runs.
    fn ran(&mut self, task: &Task) {
        if let Some((key, _)) = task.backward_key() {
            if let Some(q) = self.next.get_mut(&key) {
                q.pop_front();
            }
        }
    }

    /// Backward tasks of the step still to run, the head's included.
    fn left(&self) -> usize {
        self.next.values().map(VecDeque::len).sum()
    }
}

/// The inputs of an attention stage (or the head) or of its backward received so far: the
/// residual (or its gradient) and the holders' shares (or their gradients).
#[derive(Debug, Clone, Copy, Default)]
struct Gathered {
    residual: bool,
    shares: usize,
}

impl Gathered {
    fn complete(&self, holders: usize) -> bool {
        self.residual && self.shares == holders
    }
}

/// The backward of a context-parallel projection half: whether the ring half's backward ran,
/// and the gradients of the unit's block received so far.
#[derive(Debug, Clone, Copy, Default)]
struct RingInputs {
    ran: bool,
    got: usize,
}

/// A context-parallel ring half's progress: the blocks here whose task is not ready yet (by
/// distance back along the ring), and the stage's tasks that ran (the projection half's first: 0
/// until it ran).
#[derive(Debug, Clone, Default)]
struct RingBlocks {
    here: std::collections::BTreeSet<usize>,
    ran: usize,
}

/// One worker's schedule of one step (see the module doc).
#[derive(Debug)]
pub struct Scheduler {
    layers: usize,
    /// Context parallelism `C`.
    ring: usize,
    /// Holders of each layer's experts.
    holders: Vec<usize>,
    /// Ready tasks by [`Queue`].
    ready: [VecDeque<Task>; 3],
    /// Owned micro-batches not started yet.
    waiting: VecDeque<usize>,
    /// Backward tasks (attention and experts) still to run.
    bwd_left: usize,
    order: BackwardOrder,
    inputs: HashMap<(usize, usize), Gathered>,
    grad_inputs: HashMap<(usize, usize), Gathered>,
    /// Per micro-batch, its units whose head inputs are all here.
    head_units: HashMap<usize, usize>,
    /// Per (unit, layer), the ring half's blocks, and its backward's inputs.
    ring_fwd: HashMap<(usize, usize), RingBlocks>,
    ring_bwd: HashMap<(usize, usize), RingInputs>,
}

impl Scheduler {
    /// Worker `rank`'s schedule of a step of `layout`, `in_flight` of its micro-batches started.
    pub fn new(layout: &Layout, rank: usize, in_flight: usize) -> Self {
        // Backward: the ring half's and the projection half's with context parallelism.
        let halves = if layout.context_parallel > 1 { 2 } else { 1 };
        let attn: usize = layout.attn_layers(rank).iter().map(|&l| layout.attn_units(rank, l).len() * halves).sum();
        let mut waiting: VecDeque<usize> = layout.own_units(rank).into();
        let started = in_flight.max(1).min(waiting.len());
        let mut ready: [VecDeque<Task>; 3] = Default::default();
        ready[Queue::Forward as usize] = waiting.drain(..started).map(|mb| Task::AttnFwd { mb, layer: 0 }).collect();
        Self {
            layers: layout.layers,
            ring: layout.context_parallel,
            holders: (0..layout.layers).map(|l| layout.ffn_holders(l).len()).collect(),
            ready,
            waiting,
            bwd_left: attn + layout.units() * layout.ffn_layers(rank).len(),
            order: BackwardOrder::of(layout, rank),
            inputs: HashMap::new(),
            grad_inputs: HashMap::new(),
            head_units: HashMap::new(),
            ring_fwd: HashMap::new(),
            ring_bwd: HashMap::new(),
        }
    }

    /// Takes in an arrived message; a task whose inputs are now all here becomes ready.
    pub fn on_message(&mut self, arrival: Arrival) {
        match arrival {
            Arrival::Dispatch { mb, layer, src } => self.ready(Task::FfnFwd { mb, layer, src }),
            Arrival::GradCombine { mb, layer } => self.ready(Task::FfnBwd { mb, layer }),
            Arrival::Combine { mb, layer } | Arrival::Residual { mb, layer } => {
                let got = self.inputs.entry((mb, layer + 1)).or_default();
                match arrival {
                    Arrival::Residual { .. } => got.residual = true,
                    _ => got.shares += 1,
                }
                if got.complete(self.holders[layer]) {
                    self.inputs.remove(&(mb, layer + 1));
                    if layer + 1 == self.layers {
                        // The head waits for every unit of its micro-batch.
                        let m = mb / self.ring;
                        let units = self.head_units.entry(m).or_default();
                        *units += 1;
                        if *units == self.ring {
                            self.head_units.remove(&m);
                            self.ready(Task::Head { mb: m });
                        }
                    } else {
                        self.ready(Task::AttnFwd { mb, layer: layer + 1 });
                    }
                }
            }
            Arrival::GradResidual { mb, layer } | Arrival::GradDispatch { mb, layer } => {
                let got = self.grad_inputs.entry((mb, layer)).or_default();
                match arrival {
                    Arrival::GradResidual { .. } => got.residual = true,
                    _ => got.shares += 1,
                }
                if got.complete(self.holders[layer]) {
                    self.grad_inputs.remove(&(mb, layer));
                    self.ready(Task::AttnBwd { mb, layer });
                }
            }
            Arrival::Kv { mb, layer, from } => {
                let c = self.ring;
                let back = (mb % c + c - from % c) % c;
                self.ring_fwd.entry((mb, layer)).or_default().here.insert(back);
                self.ring_next(mb, layer);
            }
            Arrival::GradKv { mb, layer } => self.ring_grad(mb, layer, false),
        }
    }

    /// The ring half's next task is ready once the stage's task before it ran (the projection
    /// half, or the block before) and its block is here: blocks are merged in ring order,
    /// whatever order they arrive in, so a run has the same bits.
    fn ring_next(&mut self, mb: usize, layer: usize) {
        let blocks = self.ring_fwd.entry((mb, layer)).or_default();
        let next = blocks.ran;
        if next > 0 && blocks.here.remove(&next) {
            self.ready(Task::RingFwd { mb, layer, block: next });
        }
    }

    /// A task of a context-parallel attention stage's forward ran.
    fn ring_ran(&mut self, mb: usize, layer: usize) {
        let blocks = self.ring_fwd.entry((mb, layer)).or_default();
        blocks.ran += 1;
        if blocks.ran == self.ring {
            self.ring_fwd.remove(&(mb, layer));
        } else {
            self.ring_next(mb, layer);
        }
    }

    /// The projection half's backward input: the ring half's backward ran (`ran`), or a gradient
    /// of the unit's block came; it is ready once both are complete.
    fn ring_grad(&mut self, mb: usize, layer: usize, ran: bool) {
        let got = self.ring_bwd.entry((mb, layer)).or_default();
        if ran {
            got.ran = true;
        } else {
            got.got += 1;
        }
        if got.ran && got.got == self.ring - 1 {
            self.ring_bwd.remove(&(mb, layer));
            self.ready(Task::RingBwd { mb, layer });
        }
    }

    /// The task to run now, by the priority and the backward order; `None` while the worker has
    /// to wait for a message.
    pub fn next(&mut self) -> Option<Task> {
        let (ready, order) = (&mut self.ready, &self.order);
        let task = Queue::PRIORITY.iter().find_map(|&q| {
            let queue = &mut ready[q as usize];
            let i = queue.iter().position(|t| order.allows(t))?;
            queue.remove(i)
        })?;
        self.order.ran(&task);
        Some(task)
    }

    /// Puts a task whose inputs are all here in its queue.
    fn ready(&mut self, task: Task) {
        self.ready[task.queue() as usize].push_back(task);
    }

    /// Records that `task` (returned by [`Scheduler::next`]) has run.
    pub fn done(&mut self, task: Task) {
        if task.counts_as_backward() {
            self.bwd_left -= 1;
        }
        if self.ring > 1 {
            match task {
                Task::AttnFwd { mb, layer } | Task::RingFwd { mb, layer, .. } => self.ring_ran(mb, layer),
                Task::AttnBwd { mb, layer } => self.ring_grad(mb, layer, true),
                _ => {}
            }
        }
        if task.releases_window() {
            if let Some(mb) = self.waiting.pop_front() {
                self.ready(Task::AttnFwd { mb, layer: 0 });
            }
        }
    }

    /// Whether the worker's tasks of the step are all done.
    pub fn finished(&self) -> bool {
        self.bwd_left == 0
    }

    /// Backward tasks still to run (the head's included), for a stalled worker's error.
    pub fn backward_left(&self) -> usize {
        self.order.left()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every worker of `layout` with its scheduler: each round, every worker runs one ready task,
    /// whose messages reach their receivers at the round's end, in an order shuffled by `seed`
    /// (0: as sent). Returns each worker's tasks in the order it ran them.
    fn drive(layout: &Layout, in_flight: usize, seed: u64) -> Vec<Vec<Task>> {
        let (w, c) = (layout.workers, layout.context_parallel);
        let mut s: Vec<Scheduler> = (0..w).map(|r| Scheduler::new(layout, r, in_flight)).collect();
        let mut ran = vec![Vec::new(); w];
        let next_attn = |u: usize, l: usize| {
            if l + 1 == layout.layers {
                layout.head_worker(u / c)
            } else {
                layout.attn_worker(u, l + 1)
            }
        };
        let mut state = seed;
        for _round in 0..10_000 {
            if s.iter().all(Scheduler::finished) {
                return ran;
            }
            let mut sent = Vec::new();
            for (r, sched) in s.iter_mut().enumerate() {
                let Some(task) = sched.next() else { continue };
                ran[r].push(task);
                let grads_back = |sent: &mut Vec<(usize, Arrival)>, u: usize, l: usize| {
                    for h in layout.ffn_holders(l) {
                        sent.push((h, Arrival::GradCombine { mb: u, layer: l }));
                    }
                    sent.push((layout.attn_worker(u, l), Arrival::GradResidual { mb: u, layer: l }));
                };
                match task {
                    Task::AttnFwd { mb, layer } if c > 1 => {
                        for v in layout.ring_units(mb).filter(|&v| v != mb) {
                            sent.push((layout.attn_worker(v, layer), Arrival::Kv { mb: v, layer, from: mb }));
                        }
                    }
                    Task::RingFwd { block, .. } if block + 1 < c => {}
                    Task::AttnFwd { mb, layer } | Task::RingFwd { mb, layer, .. } => {
                        for h in layout.ffn_holders(layer) {
                            sent.push((h, Arrival::Dispatch { mb, layer, src: r }));
                        }
                        sent.push((next_attn(mb, layer), Arrival::Residual { mb, layer }));
                    }
                    Task::FfnFwd { mb, layer, .. } => sent.push((next_attn(mb, layer), Arrival::Combine { mb, layer })),
                    Task::Head { mb } => {
                        for u in mb * c..(mb + 1) * c {
                            grads_back(&mut sent, u, layout.layers - 1);
                        }
                    }
                    Task::AttnBwd { mb, layer } if c > 1 => {
                        for v in layout.ring_units(mb).filter(|&v| v != mb) {
                            sent.push((layout.attn_worker(v, layer), Arrival::GradKv { mb: v, layer }));
                        }
                    }
                    Task::AttnBwd { mb, layer } | Task::RingBwd { mb, layer } => {
                        if layer > 0 {
                            grads_back(&mut sent, mb, layer - 1);
                        }
                    }
                    Task::FfnBwd { mb, layer } => {
                        sent.push((layout.attn_worker(mb, layer), Arrival::GradDispatch { mb, layer }))
                    }
                }
                sched.done(task);
            }
            // A seeded shuffle of the round's deliveries (xorshift).
            for i in (1..sent.len()).rev() {
                if seed == 0 {
                    break;
                }
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                sent.swap(i, (state % (i as u64 + 1)) as usize);
            }
            for (dst, a) in sent {
                s[dst].on_message(a);
            }
        }
        panic!("the schedule did not finish: {:?}", s.iter().map(Scheduler::backward_left).collect::<Vec<_>>());
    }

    #[test]
    fn every_task_runs_once_backward_tasks_in_micro_batch_order_within_the_window() {
        let cp = |l: Layout, c| l.with_context_parallel(c).unwrap();
        let layouts = [
            (Layout::disagg(2, 4, 4, 2, 2, 1).unwrap(), 2, 0),
            (Layout::disagg(4, 8, 4, 2, 2, 2).unwrap(), 1, 0),
            (Layout::ep(3, 4, 4, 2).unwrap(), 1, 0),
            (cp(Layout::disagg(2, 4, 4, 2, 2, 1).unwrap(), 2), 2, 0),
            (cp(Layout::disagg(3, 4, 4, 4, 2, 1).unwrap(), 2), 2, 7),
            (cp(Layout::disagg(4, 8, 6, 8, 4, 2).unwrap(), 4), 3, 11),
            (cp(Layout::disagg(4, 8, 4, 8, 2, 2).unwrap(), 2), 1, 5),
        ];
        for (layout, window, seed) in layouts {
            let ran = drive(&layout, window, seed);
            for (r, tasks) in ran.iter().enumerate() {
                // Each backward key runs its micro-batches in increasing order, each once.
                let mut by_key: HashMap<(BackwardKind, usize), Vec<usize>> = HashMap::new();
                for t in tasks {
                    if let Some((key, mb)) = t.backward_key() {
                        by_key.entry(key).or_default().push(mb);
                    }
                }
                let want = BackwardOrder::of(&layout, r);
                assert_eq!(by_key.len(), want.next.values().filter(|q| !q.is_empty()).count(), "worker {r}");
                for (key, mbs) in &by_key {
                    assert_eq!(mbs, &Vec::from(want.next[key].clone()), "worker {r} {key:?}");
                }
                // The window: unit i + K starts after unit i's layer-0 backward.
                let own = layout.own_units(r);
                let at = |t: Task| tasks.iter().position(|&x| x == t).unwrap();
                for (i, &mb) in own.iter().enumerate().skip(window) {
                    let released = Task::AttnBwd { mb: own[i - window], layer: 0 };
                    assert!(at(released) < at(Task::AttnFwd { mb, layer: 0 }), "worker {r} mb {mb}");
                }
                // Every forward task of the worker ran, once.
                let fwd = tasks.iter().filter(|t| t.backward_key().is_none()).count();
                let halves = layout.context_parallel; // the projection half, then a task per other block
                let attn: usize = layout.attn_layers(r).iter().map(|&l| layout.attn_units(r, l).len() * halves).sum();
                assert_eq!(fwd, attn + layout.units() * layout.ffn_layers(r).len(), "worker {r}");
                // A ring half's task runs after the stage's task before it: the projection half or
                // the block before (forward), the ring half (backward).
                for (i, t) in tasks.iter().enumerate() {
                    let before = match *t {
                        Task::RingFwd { mb, layer, block: 1 } => Task::AttnFwd { mb, layer },
                        Task::RingFwd { mb, layer, block } => Task::RingFwd { mb, layer, block: block - 1 },
                        Task::RingBwd { mb, layer } => Task::AttnBwd { mb, layer },
                        _ => continue,
                    };
                    assert!(at(before) < i, "worker {r}: {t:?}");
                }
            }
        }
    }

    #[test]
    fn backward_work_goes_before_expert_forwards_before_attention_forwards() {
        let layout = Layout::disagg(1, 2, 2, 1, 1, 1).unwrap();
        let mut s = Scheduler::new(&layout, 1, 2);
        // The expert worker: a dispatch of mb 1, then the gradient of mb 0's combine.
        s.on_message(Arrival::Dispatch { mb: 1, layer: 0, src: 0 });
        s.on_message(Arrival::GradCombine { mb: 0, layer: 0 });
        assert_eq!(s.next(), Some(Task::FfnBwd { mb: 0, layer: 0 }));
        // mb 1's backward waits for mb 0's... which has run: the forward goes next.
        assert_eq!(s.next(), Some(Task::FfnFwd { mb: 1, layer: 0, src: 0 }));
        assert_eq!(s.next(), None);
        // The attention worker: mb 1's gradients before mb 0's are held back.
        let mut a = Scheduler::new(&layout, 0, 2);
        assert_eq!(a.next(), Some(Task::AttnFwd { mb: 0, layer: 0 }));
        a.on_message(Arrival::GradResidual { mb: 1, layer: 0 });
        a.on_message(Arrival::GradDispatch { mb: 1, layer: 0 });
        assert_eq!(a.next(), Some(Task::AttnFwd { mb: 1, layer: 0 }), "mb 1's backward waits for mb 0's");
        a.on_message(Arrival::GradDispatch { mb: 0, layer: 0 });
        assert_eq!(a.next(), None, "mb 0's residual gradient is missing");
        a.on_message(Arrival::GradResidual { mb: 0, layer: 0 });
        assert_eq!(a.next(), Some(Task::AttnBwd { mb: 0, layer: 0 }));
        assert_eq!(a.next(), Some(Task::AttnBwd { mb: 1, layer: 0 }));
    }
}
