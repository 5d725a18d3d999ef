//! The `mpi` transport: one process per worker, started by `mpirun -np <workers>` (any MPI; CI uses
//! Debian's OpenMPI). MPI rank = worker rank. The `nccl` transport starts the same way and only
//! moves the envelopes differently ([`super::nccl`]); the engine picks the endpoint and the
//! reducer of the run's transport (`engine.rs`).
//!
//! Each process builds the model from the seed, keeps its own part and drops the rest. Its endpoint
//! has two communication threads: one sends (so a large send never holds up compute), one receives
//! with `MPI_Recv` from any source and hands envelopes to the worker, stamping each frame's sender
//! in the endpoint's [`Liveness`]. Envelopes travel as bincode. Heartbeats do not queue behind the
//! data: the heartbeat thread sends them itself with `MPI_Isend` (at most one outstanding per peer,
//! so a peer that cannot be reached costs one small buffer, and never holds up the beats to the
//! others). When a worker fails it tells the others (an `Abort` message) and the job ends with
//! `MPI_Abort`; if a process dies outright, `mpirun` ends the job.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use mpi::collective::{CommunicatorCollectives, SystemOperation};
use mpi::datatype::Equivalence;
use mpi::environment::Universe;
use mpi::point_to_point::{Destination, MatchedReceiveVec, Source};
use mpi::request::{Request, StaticScope};
use mpi::topology::Color;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::Threading;

use super::collectives::{block_rounds, max_chunk_elements, BlockHalf, LibraryCollectives};
use super::msg::{Envelope, Msg};
use super::transport::{
    receive_within, Beacon, Delivery, Endpoint, Liveness, Reassembly, TAG_HEAD, TAG_PIECE, TAG_WHOLE,
};
use crate::config::RunConfig;
use crate::error::{Result, TrainError};

static WORLD_RANK: AtomicUsize = AtomicUsize::new(0);

/// Bytes queued for the send thread, bounded by `DISAGMOE_OUTBOX_BYTES` (default 1 GiB; a message
/// larger than the bound goes alone).
#[derive(Default)]
struct Backlog {
    bytes: Mutex<usize>,
    freed: Condvar,
}

impl Backlog {
    fn limit() -> usize {
        std::env::var("DISAGMOE_OUTBOX_BYTES").ok().and_then(|v| v.parse().ok()).unwrap_or(1 << 30)
    }

    fn acquire(&self, n: usize) {
        let limit = Self::limit();
        let mut queued = self.bytes.lock().expect("backlog lock");
        while *queued > 0 && *queued + n > limit {
            queued = self.freed.wait(queued).expect("backlog lock");
        }
        *queued += n;
    }

    fn release(&self, n: usize) {
        let mut queued = self.bytes.lock().expect("backlog lock");
        *queued = queued.saturating_sub(n);
        self.freed.notify_all();
    }
}

/// This process's MPI rank (0 before MPI was started).
pub fn world_rank() -> usize {
    WORLD_RANK.load(Ordering::SeqCst)
}

/// Tag of a heartbeat frame (a whole envelope, sent outside the send thread's order).
const TAG_BEAT: i32 = 4;

/// The heartbeats of one process in flight: per peer, the one `MPI_Isend` not known to be done and
/// its buffer (a leaked box, taken back once MPI is done with it).
struct Beats {
    world: SimpleCommunicator,
    pending: Vec<Option<(Request<'static, [u8]>, *mut [u8])>>,
}

// SAFETY: the requests and buffers are used by one thread at a time (the heartbeat thread, after
// the endpoint made them on another), and MPI_THREAD_MULTIPLE lets any thread test a request.
unsafe impl Send for Beats {}

impl Beats {
    /// Sends `bytes` to `dst` unless the previous beat to `dst` is still on its way (a peer that
    /// does not take them in: one is enough).
    fn send(&mut self, dst: usize, bytes: Vec<u8>) {
        if let Some((request, buf)) = self.pending[dst].take() {
            match request.test() {
                // SAFETY: MPI is done with the buffer, which came from `Box::into_raw` below.
                Ok(_) => drop(unsafe { Box::from_raw(buf) }),
                Err(request) => {
                    self.pending[dst] = Some((request, buf));
                    return;
                }
            }
        }
        let buf = Box::into_raw(bytes.into_boxed_slice());
        // SAFETY: the box stays alive (leaked) until MPI is done reading it; nothing writes to it.
        let shared: &'static [u8] = unsafe { &*buf };
        let request = self.world.process_at_rank(dst as i32).immediate_send_with_tag(StaticScope, shared, TAG_BEAT);
        self.pending[dst] = Some((request, buf));
    }
}

impl Drop for Beats {
    /// Beats still on their way stay with MPI: their requests and buffers are left to the end of
    /// the process (a request dropped unfinished would panic; a buffer freed under MPI is unsound).
    fn drop(&mut self) {
        for (request, _buf) in self.pending.drain(..).flatten() {
            std::mem::forget(request);
        }
    }
}

/// A worker's MPI connection.
pub struct MpiEndpoint {
    rank: usize,
    size: usize,
    liveness: Arc<Liveness>,
    outbox: Option<Sender<(usize, Vec<u8>)>>,
    /// Bytes handed to the send thread and not sent yet (backpressure).
    queued: Arc<Backlog>,
    inbox: Receiver<Delivery>,
    /// Keeps the inbox open while no receive thread is running (a worker alone, or closing).
    _inbox_open: Sender<Delivery>,
    sender: Option<JoinHandle<()>>,
    receiver: Option<JoinHandle<()>>,
}

impl MpiEndpoint {
    /// This rank's endpoint: its send and receive threads on the world communicator.
    pub fn start() -> Self {
        let world = SimpleCommunicator::world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        let (outbox, outgoing) = channel::<(usize, Vec<u8>)>();
        let (inbox_tx, inbox) = channel::<Delivery>();
        let queued = Arc::new(Backlog::default());
        let sent = queued.clone();
        let sender = std::thread::Builder::new()
            .name("mpi-send".into())
            .spawn(move || {
                let world = SimpleCommunicator::world();
                let chunk = max_chunk_elements(1);
                for (dst, bytes) in outgoing {
                    let peer = world.process_at_rank(dst as i32);
                    if bytes.len() <= chunk {
                        peer.send_with_tag(&bytes[..], TAG_WHOLE);
                    } else {
                        // Longer than one MPI message may be: its length, then its chunks, in order
                        // (MPI keeps the order of one sender's messages).
                        peer.send_with_tag(&(bytes.len() as u64).to_le_bytes()[..], TAG_HEAD);
                        for piece in bytes.chunks(chunk) {
                            peer.send_with_tag(piece, TAG_PIECE);
                        }
                    }
                    sent.release(bytes.len());
                }
            })
            .expect("spawn the MPI send thread");
        let deliver = inbox_tx.clone();
        let liveness = Liveness::new(size);
        let alive = liveness.clone();
        let receiver = std::thread::Builder::new()
            .name("mpi-recv".into())
            .spawn(move || {
                let world = SimpleCommunicator::world();
                let mut pieces = Reassembly::default();
                // A message this rank cannot take ends the run at once, naming its sender.
                let fail = |src: i32, cause: String| {
                    let _ = deliver.send(Err(TrainError::Worker {
                        worker: rank,
                        cause: format!("a message from worker {src} cannot be taken: {cause}"),
                    }));
                };
                loop {
                    // Probe, then take the matched message, marking whose it is meanwhile (a
                    // transfer cut midway blocks here, and names its sender).
                    let probed = world.any_process().matched_probe();
                    let src = probed.1.source_rank();
                    alive.receiving(Some(src as usize));
                    let (bytes, status) = probed.matched_receive_vec::<u8>();
                    alive.receiving(None);
                    alive.heard(src as usize);
                    let frame = match status.tag() {
                        TAG_BEAT => Ok(Some(bytes)),
                        tag => pieces.take(src, tag, bytes),
                    };
                    let whole = match frame {
                        Ok(Some(whole)) => whole,
                        Ok(None) => continue,
                        Err(e) => break fail(src, e),
                    };
                    match Envelope::from_bytes(&whole) {
                        Ok(env) if matches!(env.msg, Msg::Shutdown) => break,
                        Ok(env) => {
                            if deliver.send(Ok(env)).is_err() {
                                break;
                            }
                        }
                        Err(e) => break fail(src, format!("undecodable: {e}")),
                    }
                }
            })
            .expect("spawn the MPI receive thread");
        Self {
            rank,
            size,
            liveness,
            outbox: Some(outbox),
            queued,
            inbox,
            _inbox_open: inbox_tx,
            sender: Some(sender),
            receiver: Some(receiver),
        }
    }
}

impl Drop for MpiEndpoint {
    /// Flushes the send thread and stops the receive thread.
    fn drop(&mut self) {
        if let Some(outbox) = self.outbox.take() {
            let stop = Envelope { src: self.rank, step: 0, sent_us: 0, deliver_us: 0, msg: Msg::Shutdown };
            let _ = outbox.send((self.rank, stop.to_bytes()));
        }
        if let Some(h) = self.sender.take() {
            let _ = h.join();
        }
        if let Some(h) = self.receiver.take() {
            let _ = h.join();
        }
    }
}

impl Endpoint for MpiEndpoint {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn transmit(&mut self, dst: usize, env: Envelope) -> Result<()> {
        let outbox = self.outbox.as_ref().ok_or_else(|| TrainError::Worker {
            worker: self.rank,
            cause: "sent after the endpoint was closed".into(),
        })?;
        let bytes = env.to_bytes();
        // Backpressure: a worker far ahead of its network waits here instead of queueing without
        // limit (the send thread drains on its own, so this always ends).
        self.queued.acquire(bytes.len());
        outbox
            .send((dst, bytes))
            .map_err(|_| TrainError::Worker { worker: self.rank, cause: "the MPI send thread has stopped".into() })
    }
    fn arrive(&mut self, timeout: Duration) -> Result<Option<Envelope>> {
        receive_within(&self.inbox, self.rank, timeout, "the MPI receive thread and this worker's sends")
    }
    fn beacon(&self) -> Option<Beacon> {
        self.outbox.as_ref()?;
        let mut beats = Beats { world: SimpleCommunicator::world(), pending: (0..self.size).map(|_| None).collect() };
        Some(Box::new(move |dst, env| {
            beats.send(dst, env.to_bytes());
            true
        }))
    }
    fn liveness(&self) -> Option<Arc<Liveness>> {
        Some(self.liveness.clone())
    }
    fn end_job(&self) -> fn(i32) -> ! {
        |code| SimpleCommunicator::world().abort(code)
    }
}

/// Open MPI's TCP transport sends a message above its eager limit (64 KiB by default) by
/// rendezvous, and the receiver's go-ahead waits behind its own outgoing transfer: with a send
/// thread and a receive thread per rank, a link busy both ways then carries one direction at a
/// time (measured with `net-bench` between network namespaces: an exchange of k x 1 MiB each way
/// took about 2k - 1 one-way times; with the limit at 2 MiB, 1.1-1.2 k; disagg 1+1 at 100 Mbit/s
/// 0.45x the wall time, `docs/runtime.md`). So, unless the job chose either limit itself (`mpirun
/// --mca btl_tcp_eager_limit ...` reaches a rank as these variables), messages up to this many
/// bytes go eagerly. Other MPIs ignore the variables; shared memory and NCCL are unaffected.
pub const TCP_EAGER_LIMIT: usize = 16 << 20;

/// Sets Open MPI's TCP eager limits to [`TCP_EAGER_LIMIT`] where the job has not set them (read by
/// `MPI_Init`, so before it; the process has no other thread reading its environment yet).
fn default_tcp_eager_limit() {
    let vars = ["OMPI_MCA_btl_tcp_eager_limit", "OMPI_MCA_btl_tcp_rndv_eager_limit"];
    if vars.iter().all(|v| std::env::var_os(v).is_none()) {
        for v in vars {
            std::env::set_var(v, TCP_EAGER_LIMIT.to_string());
        }
    }
}

pub(crate) fn start_mpi() -> Result<Universe> {
    default_tcp_eager_limit();
    let (universe, threading) = mpi::initialize_with_threading(Threading::Multiple).ok_or_else(|| {
        TrainError::option("transport", "MPI is already initialised in this process; run one training per process")
    })?;
    if threading != Threading::Multiple {
        return Err(TrainError::option(
            "transport",
            format!("the MPI library gives thread support {threading:?}; the mpi transport needs MPI_THREAD_MULTIPLE"),
        ));
    }
    Ok(universe)
}

/// The MPI communicators a worker sums over: a duplicate of the world for the global sums, its
/// attention group's copies (a split of the world by group), and the groups of holders of a
/// replicated expert it belongs to (one split each).
pub struct MpiGroups {
    world: SimpleCommunicator,
    replicas: Option<(Vec<usize>, SimpleCommunicator)>,
    experts: Vec<(Vec<usize>, SimpleCommunicator)>,
}

impl MpiGroups {
    /// Every process calls it at the same point (it splits the world collectively): `replicas` are
    /// the ranks whose attention-side parameters are copies of this rank's (empty for pure expert
    /// workers); `expert_groups` are the run's groups of holders of a replicated expert
    /// (`Layout::expert_replica_groups`, the same list on every process).
    pub fn new(replicas: &[usize], expert_groups: &[Vec<usize>]) -> Self {
        let world = SimpleCommunicator::world();
        let color = if replicas.len() > 1 { Color::with_value(replicas[0] as i32) } else { Color::undefined() };
        let split = world.split_by_color(color);
        let replicas = split.filter(|_| replicas.len() > 1).map(|c| (replicas.to_vec(), c));
        let experts = Self::split_expert_groups(&world, expert_groups);
        Self { world: world.duplicate(), replicas, experts }
    }

    /// One communicator per group of holders of a replicated expert this process belongs to
    /// (one collective split of `world` per group, in the list's order).
    fn split_expert_groups(
        world: &SimpleCommunicator,
        expert_groups: &[Vec<usize>],
    ) -> Vec<(Vec<usize>, SimpleCommunicator)> {
        let me = world.rank() as usize;
        expert_groups
            .iter()
            .filter_map(|group| {
                let member = group.contains(&me);
                let color = if member { Color::with_value(0) } else { Color::undefined() };
                world.split_by_color(color).filter(|_| member).map(|c| (group.clone(), c))
            })
            .collect()
    }

    /// The groups of holders of a replicated expert changed (a rebalance): their communicators
    /// anew. Every process calls it at the same point with the same list.
    pub fn set_expert_groups(&mut self, expert_groups: &[Vec<usize>]) {
        self.experts = Self::split_expert_groups(&self.world, expert_groups);
    }

    /// Sums `data` over `group` (every worker, or this worker's copies) with `MPI_Allreduce`, in
    /// chunks of at most [`max_chunk_elements`].
    pub fn all_reduce<T: Equivalence + Copy + Default>(&self, group: &[usize], data: &mut [T]) -> Result<()> {
        let comm = self.communicator(group)?;
        let chunk = max_chunk_elements(std::mem::size_of::<T>());
        let mut recv = vec![T::default(); chunk.min(data.len())];
        for part in data.chunks_mut(chunk) {
            let recv = &mut recv[..part.len()];
            comm.all_reduce_into(&*part, recv, SystemOperation::sum());
            part.copy_from_slice(recv);
        }
        Ok(())
    }

    /// The MPI communicator of `group` (every worker, this worker's copies, or the holders of a
    /// replicated expert).
    fn communicator(&self, group: &[usize]) -> Result<&SimpleCommunicator> {
        match &self.replicas {
            Some((ranks, comm)) if ranks == group => Ok(comm),
            _ if group.len() == self.world.size() as usize => Ok(&self.world),
            _ if self.experts.iter().any(|(g, _)| g == group) => {
                Ok(&self.experts.iter().find(|(g, _)| g == group).expect("found").1)
            }
            _ => Err(TrainError::Worker {
                worker: self.world.rank() as usize,
                cause: format!("no MPI communicator for the group {group:?}"),
            }),
        }
    }

    /// Every member of `group` ends with `bytes` of the group's first member (NCCL's unique ids
    /// travel this way).
    pub fn broadcast_from_first(&self, group: &[usize], bytes: &mut [u8]) -> Result<()> {
        use mpi::collective::Root;
        self.communicator(group)?.process_at_rank(0).broadcast_into(bytes);
        Ok(())
    }

    /// This worker's copies, when it has any (the group of its attention-side all-reduce).
    pub fn replicas(&self) -> Option<&[usize]> {
        self.replicas.as_ref().map(|(r, _)| r.as_slice())
    }

    /// The groups of holders of a replicated expert this worker belongs to, in the run's order.
    pub fn expert_groups(&self) -> impl Iterator<Item = &[usize]> {
        self.experts.iter().map(|(g, _)| g.as_slice())
    }

    /// Every worker of the job.
    pub fn everyone(&self) -> Vec<usize> {
        (0..self.world.size() as usize).collect()
    }
}

/// Blocked on the peers inside a collective, the worker is not busy, and its watchdog bounds the
/// wait (see the port's pulse): the blanket `AllReduce` of [`LibraryCollectives`] says so.
impl LibraryCollectives for MpiGroups {
    fn all_reduce_f32(&mut self, group: &[usize], data: &mut [f32]) -> Result<()> {
        self.all_reduce(group, data)
    }
    fn all_reduce_f64(&mut self, group: &[usize], data: &mut [f64]) -> Result<()> {
        self.all_reduce(group, data)
    }
    /// `MPI_Reduce_scatter_block` / `MPI_Allgather`.
    fn block_half(&mut self, group: &[usize], data: &mut [f32], half: BlockHalf) -> Result<()> {
        let comm = self.communicator(group)?;
        let pos = comm.rank() as usize;
        block_rounds(group.len(), pos, data, half, |send, recv| {
            match half {
                BlockHalf::ReduceScatter => comm.reduce_scatter_block_into(send, recv, SystemOperation::sum()),
                BlockHalf::AllGather => comm.all_gather_into(send, recv),
            }
            Ok(())
        })
    }
    fn regroup_expert_groups(&mut self, groups: &[Vec<usize>]) -> Result<()> {
        self.set_expert_groups(groups);
        Ok(())
    }
}

/// This process's place in an MPI job: the MPI environment (finalised when dropped) and its rank.
pub struct Process {
    universe: Universe,
    rank: usize,
}

impl Process {
    /// Starts MPI and checks that `mpirun` started as many processes as the run has workers.
    pub fn start(cfg: &RunConfig, workers: usize) -> Result<Self> {
        let universe = start_mpi()?;
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        WORLD_RANK.store(rank, Ordering::SeqCst);
        if size != workers {
            let err = TrainError::option(
                "transport",
                format!(
                    "mpirun started {size} processes but placement {} needs {workers} workers (mpirun -np {workers})",
                    cfg.parallel.placement.name(),
                ),
            );
            drop(universe);
            return Err(err);
        }
        Ok(Self { universe, rank })
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The world communicator of the job.
    pub fn world(&self) -> SimpleCommunicator {
        self.universe.world()
    }

    /// Ends the whole job: prints the error and aborts every process (the others have been told, so
    /// nothing waits for this rank).
    pub fn abort(&self, e: &TrainError) -> ! {
        eprintln!("error: {e}");
        self.universe.world().abort(2)
    }

    /// Waits for every process (the end of a run).
    pub fn barrier(&self) {
        self.universe.world().barrier();
    }
}
