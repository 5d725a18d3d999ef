//! The `nccl` transport (feature `nccl` = `cuda` + `mpi`): one process per worker under `mpirun`,
//! bootstrapped over MPI; the messages of the token exchange move between GPUs with their
//! payloads read and written in place in the workers' device memory, and the all-reduces
//! (attention copies' gradients, the step's global sums) by `ncclAllReduce` ([`NcclGroups`]).
//!
//! **One communicator, rounds of grouped sends and receives** ([`super::transport::rounds`]): a
//! thread per rank runs rounds in lockstep with every other rank's: an MPI all-to-all of the
//! round's envelopes (their device payloads taken out, each leaving its shape), then one NCCL
//! group of `ncclSend`/`ncclRecv` of the payloads, which both sides know by then, posted per peer
//! in the same order. Nothing is posted that its peer does not post in the same round, so the
//! sends and receives of a communicator driven from one thread cannot wait on each other (many
//! two-rank communicators driven from threads, the earlier design, is a pattern NCCL warns can
//! deadlock). A payload is sent from the tensor the worker computed (contiguous, its stream
//! finished first: `disagmoe_kernels::cube::raw`) and received into a tensor allocated on the
//! receiver's device ([`DeviceAlloc`]); the worker then takes its own copy (`Inbox::keep`). Host
//! payloads (fp8 dispatches, empty shares) travel inside the envelope's bytes.
//!
//! NCCL refuses two ranks of one communicator on the same GPU: each rank uses the GPU of its
//! node-local rank (as the launcher says, `OMPI_COMM_WORLD_LOCAL_RANK`, `SLURM_LOCALID`, ...), the
//! same GPU its model computes on by default (`backend::run_devices`).
//!
//! Status: compiled in CI; the rounds (everything but MPI's all-to-all and NCCL's calls) are
//! tested on the CPU (`transport::rounds`); never run on GPUs (no machine with several has been
//! lent to this project).

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::result as nccl;
use cudarc::nccl::safe::{Comm, Id};
use cudarc::nccl::sys::{ncclComm_t, ncclDataType_t, ncclUniqueId};
use mpi::collective::CommunicatorCollectives;
use mpi::datatype::{Partition, PartitionMut};
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::Root;

use super::collectives::{block_rounds, max_chunk_elements, BlockHalf, LibraryCollectives};
use super::msg::{DeviceAlloc, DeviceBytes, DeviceTensor, Envelope, RemoteShape};
use super::transport::rounds::{self, Outgoing, RoundWire};
use super::transport::{receive_within, Beacon, Delivery, Endpoint};
use crate::error::{Result, TrainError};

fn nccl_error(rank: usize, what: String) -> TrainError {
    TrainError::Worker { worker: rank, cause: format!("nccl: {what}") }
}

/// How long a round waits for its rank's first message before it goes with none.
const ROUND_IDLE: Duration = Duration::from_micros(100);

/// The communicator of the rounds' all-to-alls, moved into their thread. SAFETY of `Send`: MPI is
/// initialised with `MPI_THREAD_MULTIPLE` (`mpi::Process::start` refuses less), and after the move
/// only the rounds thread uses this duplicate.
struct RoundsComm(SimpleCommunicator);
// SAFETY: see the type's documentation.
unsafe impl Send for RoundsComm {}

/// A payload's device memory in a transfer, and the tensor it becomes on arrival.
pub struct Transferred {
    memory: DeviceBytes,
    tensor: Option<DeviceTensor>,
}

/// The job's wire for the rounds: MPI for the all-to-all, one NCCL communicator for the payloads.
struct NcclWire {
    rank: usize,
    size: usize,
    mpi: RoundsComm,
    comm: ncclComm_t,
    stream: Arc<CudaStream>,
    alloc: Option<Arc<dyn DeviceAlloc>>,
}

impl NcclWire {
    fn error(&self, what: String) -> TrainError {
        nccl_error(self.rank, what)
    }
}

impl RoundWire for NcclWire {
    type Buf = Transferred;

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_to_all(&mut self, out: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
        // MPI counts and displacements are `int`: a round's envelopes past 2 GiB in all end the
        // job (the transport aborts it) rather than skip the collective its peers are in.
        let total: usize = out.iter().map(Vec::len).sum();
        if total > i32::MAX as usize {
            return Err(self.error(format!("a round's envelopes take {total} bytes, over MPI's 2 GiB")));
        }
        let counts: Vec<i32> = out.iter().map(|b| b.len() as i32).collect();
        let mut in_counts = vec![0i32; self.size];
        self.mpi.0.all_to_all_into(&counts[..], &mut in_counts[..]);
        let in_total: usize = in_counts.iter().map(|&c| c.max(0) as usize).sum();
        if in_total > i32::MAX as usize || in_counts.iter().any(|&c| c < 0) {
            return Err(self.error(format!("the peers' envelopes for this round claim {in_total} bytes")));
        }
        let displs = |c: &[i32]| c.iter().scan(0i32, |at, &n| Some(std::mem::replace(at, *at + n))).collect::<Vec<_>>();
        let send: Vec<u8> = out.concat();
        let total = in_counts.iter().map(|&c| c as usize).sum();
        let mut recv = vec![0u8; total];
        {
            let (out_displs, in_displs) = (displs(&counts), displs(&in_counts));
            let sendbuf = Partition::new(&send[..], &counts[..], &out_displs[..]);
            let mut recvbuf = PartitionMut::new(&mut recv[..], &in_counts[..], &in_displs[..]);
            self.mpi.0.all_to_all_varcount_into(&sendbuf, &mut recvbuf);
        }
        let mut at = 0;
        Ok(in_counts
            .iter()
            .map(|&c| {
                let part = recv[at..at + c as usize].to_vec();
                at += c as usize;
                part
            })
            .collect())
    }

    fn transfer(
        &mut self,
        sends: Vec<(usize, Transferred)>,
        recvs: &[(usize, RemoteShape)],
    ) -> Result<Vec<Transferred>> {
        // A receive that cannot be posted breaks the lockstep: the error ends the job.
        let alloc = |s: &RemoteShape| match &self.alloc {
            Some(a) => a.alloc(s).map(|(t, memory)| Transferred { memory, tensor: Some(t) }),
            None => Err("this rank's backend cannot receive device payloads".into()),
        };
        let received: Vec<Transferred> = recvs
            .iter()
            .map(|(_, s)| alloc(s))
            .collect::<std::result::Result<_, String>>()
            .map_err(|e| self.error(e))?;
        if sends.is_empty() && received.is_empty() {
            return Ok(received);
        }
        let stream = self.stream.cu_stream() as _;
        let (comm, u8t) = (self.comm, ncclDataType_t::ncclUint8);
        nccl::group_start().map_err(|e| self.error(format!("group start: {e:?}")))?;
        let mut posted: std::result::Result<(), String> = Ok(());
        for (peer, t) in sends.iter().filter(|(_, t)| t.memory.bytes > 0) {
            // SAFETY: the memory is a live device buffer of `bytes` bytes, kept by `sends` until
            // the stream is synchronised below.
            let r = unsafe { nccl::send(t.memory.ptr as _, t.memory.bytes, u8t, *peer as i32, comm, stream) };
            posted = posted.and(r.map(drop).map_err(|e| format!("send to {peer}: {e:?}")));
        }
        for ((peer, _), t) in recvs.iter().zip(&received).filter(|(_, t)| t.memory.bytes > 0) {
            // SAFETY: as above, for the freshly allocated receive buffer.
            let r = unsafe { nccl::recv(t.memory.ptr as _, t.memory.bytes, u8t, *peer as i32, comm, stream) };
            posted = posted.and(r.map(drop).map_err(|e| format!("receive from {peer}: {e:?}")));
        }
        // The group is closed whatever happened, so that NCCL's state stays consistent, and the
        // buffers outlive whatever was launched: freed only once the stream is done with them.
        let ended = nccl::group_end().map_err(|e| format!("group end: {e:?}"));
        if let Err(e) = self.stream.synchronize() {
            std::mem::forget(sends);
            std::mem::forget(received);
            return Err(self.error(format!("transfer: {e:?}")));
        }
        posted.and(ended.map(drop)).map_err(|e| self.error(e))?;
        drop(sends);
        Ok(received)
    }

    fn export(t: &DeviceTensor) -> std::result::Result<Transferred, String> {
        match t.rows.device_bytes() {
            Some(memory) => Ok(Transferred { memory: memory?, tensor: None }),
            None => Err(format!("a device payload of {:?} that is not in CUDA memory", t.shape)),
        }
    }

    fn import(&mut self, buf: Transferred, _shape: &RemoteShape) -> Result<DeviceTensor> {
        buf.tensor.ok_or_else(|| self.error("a received payload without its tensor".into()))
    }
}

/// A worker's side of the rounds: its messages go to the rounds thread, arrivals come back.
pub struct NcclEndpoint {
    rank: usize,
    size: usize,
    outbox: Option<Sender<Outgoing<Transferred>>>,
    inbox: Receiver<Delivery>,
    /// Keeps the inbox open after the rounds thread ends.
    _inbox_open: Sender<Delivery>,
    rounds: Option<JoinHandle<()>>,
    /// Told when the rounds thread ends.
    ended: Receiver<()>,
    /// How long dropping the endpoint waits for every rank to close.
    linger: Duration,
}

impl NcclEndpoint {
    /// Makes the job's communicator (rank 0's unique id broadcast over MPI; every rank calls this
    /// at the same point) and starts the rounds thread; returns when its communicator is up.
    /// `alloc` gives received payloads their device memory (the worker's CUDA device, on which the
    /// communicator is made too); dropping the endpoint waits at most `linger` for the other ranks
    /// to close.
    pub fn start(world: &SimpleCommunicator, alloc: Option<Arc<dyn DeviceAlloc>>, linger: Duration) -> Result<Self> {
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        let gpus = CudaContext::device_count().map_err(|e| nccl_error(rank, format!("no CUDA device: {e:?}")))?;
        if gpus < 1 {
            return Err(nccl_error(rank, "no CUDA device".into()));
        }
        // The GPU of the worker's tensors (a payload's memory is sent and received in place), else
        // that of the node-local rank.
        let local = crate::config::parallel::node_local_rank().unwrap_or(rank) % gpus as usize;
        let gpu = alloc.as_ref().and_then(|a| a.cuda_ordinal()).unwrap_or(local);
        if gpu >= gpus as usize {
            return Err(nccl_error(rank, format!("the worker computes on cuda:{gpu}, and this node has {gpus} GPUs")));
        }
        let ctx = CudaContext::new(gpu).map_err(|e| nccl_error(rank, format!("{e:?}")))?;
        let mut id = [0u8; 128];
        if rank == 0 {
            let made = Id::new().map_err(|e| nccl_error(rank, format!("unique id: {e:?}")))?;
            for (d, s) in id.iter_mut().zip(made.internal()) {
                *d = *s as u8;
            }
        }
        world.process_at_rank(0).broadcast_into(&mut id[..]);
        let mpi = RoundsComm(world.duplicate());
        let (ready_tx, ready_rx) = channel::<std::result::Result<(), String>>();
        let (inbox_tx, inbox) = channel::<Delivery>();
        let (outbox, queued) = channel::<Outgoing<Transferred>>();
        let deliver = inbox_tx.clone();
        let (ended_tx, ended) = channel::<()>();
        let rounds = std::thread::Builder::new()
            .name("nccl-rounds".into())
            .spawn(move || {
                let mut internal = [0 as std::ffi::c_char; 128];
                for (d, s) in internal.iter_mut().zip(&id) {
                    *d = *s as std::ffi::c_char;
                }
                let made = ctx.bind_to_thread().map_err(|e| format!("{e:?}")).and_then(|()| {
                    let stream = ctx.new_stream().map_err(|e| format!("{e:?}"))?;
                    let mut comm: ncclComm_t = std::ptr::null_mut();
                    // SAFETY: `comm` is written by NCCL; every rank joins with the same id.
                    unsafe { nccl::comm_init_rank(&mut comm, size as i32, ncclUniqueId { internal }, rank as i32) }
                        .map_err(|e| format!("the job's communicator: {e:?}"))?;
                    Ok((stream, comm))
                });
                let (stream, comm) = match made {
                    Ok(made) => {
                        let _ = ready_tx.send(Ok(()));
                        made
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let mut wire = NcclWire { rank, size, mpi, comm, stream, alloc };
                if let Err(e) = rounds::serve(&mut wire, &queued, &deliver, ROUND_IDLE) {
                    // The ranks are out of step: every peer would wait forever in the next
                    // collective, so the job ends here, saying why.
                    eprintln!("error: worker {rank}: {e}; ending the MPI job");
                    wire.mpi.0.abort(70);
                }
                // SAFETY: the communicator was made above and nothing uses it after this.
                unsafe {
                    let _ = nccl::comm_destroy(comm);
                }
                let _ = ended_tx.send(());
            })
            .map_err(|e| nccl_error(rank, format!("cannot start the rounds thread: {e}")))?;
        match ready_rx.recv_timeout(Duration::from_secs(120)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(nccl_error(rank, e)),
            Err(_) => return Err(nccl_error(rank, "the job's communicator did not come up within 120 s".into())),
        }
        Ok(Self { rank, size, outbox: Some(outbox), inbox, _inbox_open: inbox_tx, rounds: Some(rounds), ended, linger })
    }
}

impl Drop for NcclEndpoint {
    /// Closes this rank's side of the rounds; they end once every rank has closed, which this
    /// waits for at most `linger` (a peer that never closes has failed, and the job is being
    /// ended: this rank is not held behind it).
    fn drop(&mut self) {
        self.outbox.take();
        match self.ended.recv_timeout(self.linger) {
            Ok(()) | Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                if let Some(h) = self.rounds.take() {
                    let _ = h.join();
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                tracing::warn!(rank = self.rank, "nccl: the other ranks did not close within {:?}", self.linger);
            }
        }
    }
}

impl Endpoint for NcclEndpoint {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    /// Takes the envelope's device payloads out on the worker's thread (their buffers finished on
    /// its stream) and queues it for the next round.
    fn transmit(&mut self, dst: usize, env: Envelope) -> Result<()> {
        let rank = self.rank;
        let outbox = self.outbox.as_ref().ok_or_else(|| nccl_error(rank, "the endpoint is closing".into()))?;
        let message = rounds::outgoing::<NcclWire>(dst, env).map_err(|e| nccl_error(rank, e))?;
        outbox.send(message).map_err(|_| nccl_error(rank, "the rounds thread has stopped".into()))
    }
    fn arrive(&mut self, timeout: Duration) -> Result<Option<Envelope>> {
        receive_within(&self.inbox, self.rank, timeout, "the NCCL rounds and this worker's sends")
    }
    fn beacon(&self) -> Option<Beacon> {
        let outbox = self.outbox.clone()?;
        Some(Box::new(move |dst, env| match rounds::outgoing::<NcclWire>(dst, env) {
            Ok(message) => outbox.send(message).is_ok(),
            Err(_) => true,
        }))
    }
}

/// The NCCL communicators of a worker's all-reduces: every worker (global sums), for an attention
/// worker with data-parallel copies its copies (the gradient all-reduce), and the groups of
/// holders of a replicated expert it belongs to. Made in the
/// worker's own thread, after [`super::mpi::MpiGroups`] (whose communicators carry the unique ids).
///
/// Values are host slices (the gradients of a worker are read to the host for the optimizer
/// anyway): each chunk of at most [`max_chunk_elements`] goes host -> device,
/// `ncclAllReduce(sum)` in place on the device, device -> host. Untested: no machine with several
/// GPUs has been lent to this project (see the module's status).
pub struct NcclGroups {
    rank: usize,
    /// The MPI communicators the NCCL unique ids travel through.
    mpi: super::mpi::MpiGroups,
    ctx: std::sync::Arc<CudaContext>,
    everyone: (Vec<usize>, Comm),
    replicas: Option<(Vec<usize>, Comm)>,
    experts: Vec<(Vec<usize>, Comm)>,
}

impl NcclGroups {
    /// Collective over the job: every worker calls it at the same point.
    pub fn new(mpi: super::mpi::MpiGroups, rank: usize) -> Result<Self> {
        let gpus = CudaContext::device_count().map_err(|e| nccl_error(rank, format!("no CUDA device: {e:?}")))?;
        if gpus < 1 {
            return Err(nccl_error(rank, "no CUDA device".into()));
        }
        let ctx = CudaContext::new(crate::config::parallel::node_local_rank().unwrap_or(rank) % gpus as usize)
            .map_err(|e| nccl_error(rank, format!("{e:?}")))?;
        let all = mpi.everyone();
        let everyone = (all.clone(), Self::communicator(&ctx, &mpi, rank, &all)?);
        let replicas = match mpi.replicas() {
            Some(group) => Some((group.to_vec(), Self::communicator(&ctx, &mpi, rank, group)?)),
            None => None,
        };
        let experts = mpi
            .expert_groups()
            .map(|g| Ok((g.to_vec(), Self::communicator(&ctx, &mpi, rank, g)?)))
            .collect::<Result<_>>()?;
        Ok(Self { rank, mpi, ctx, everyone, replicas, experts })
    }

    /// A communicator of `group` (this rank a member): its first member's unique id broadcast
    /// over the group's MPI communicator.
    fn communicator(
        ctx: &std::sync::Arc<CudaContext>,
        mpi: &super::mpi::MpiGroups,
        rank: usize,
        group: &[usize],
    ) -> Result<Comm> {
        let pos = group.iter().position(|&r| r == rank).expect("a member of its group");
        let mut bytes = [0u8; 128];
        if pos == 0 {
            let id = Id::new().map_err(|e| nccl_error(rank, format!("unique id: {e:?}")))?;
            for (d, s) in bytes.iter_mut().zip(id.internal()) {
                *d = *s as u8;
            }
        }
        mpi.broadcast_from_first(group, &mut bytes)?;
        let mut internal = [0 as std::ffi::c_char; 128];
        for (d, s) in internal.iter_mut().zip(&bytes) {
            *d = *s as std::ffi::c_char;
        }
        let stream = ctx.new_stream().map_err(|e| nccl_error(rank, format!("{e:?}")))?;
        Comm::from_rank(stream, pos, group.len(), Id::uninit(internal))
            .map_err(|e| nccl_error(rank, format!("communicator of {group:?}: {e:?}")))
    }

    /// The communicator of `group`.
    fn comm(&self, group: &[usize]) -> Result<&Comm> {
        match &self.replicas {
            Some((ranks, comm)) if ranks == group => Ok(comm),
            _ if self.everyone.0 == group => Ok(&self.everyone.1),
            _ if self.experts.iter().any(|(g, _)| g == group) => {
                Ok(&self.experts.iter().find(|(g, _)| g == group).expect("found").1)
            }
            _ => Err(nccl_error(self.rank, format!("no communicator for the group {group:?}"))),
        }
    }

    /// `ncclReduceScatter` / `ncclAllGather` of host values through the device ([`block_rounds`]).
    fn block_rounds_on_device(&self, group: &[usize], data: &mut [f32], half: BlockHalf) -> Result<()> {
        let comm = self.comm(group)?;
        let err = |e: String| nccl_error(self.rank, e);
        let stream = comm.stream();
        block_rounds(group.len(), comm.rank(), data, half, |send, recv| {
            let sbuf = stream.clone_htod(send).map_err(|e| err(format!("{e:?}")))?;
            let mut rbuf = stream.alloc_zeros::<f32>(recv.len()).map_err(|e| err(format!("{e:?}")))?;
            match half {
                BlockHalf::ReduceScatter => comm
                    .reduce_scatter(&sbuf, &mut rbuf, &cudarc::nccl::safe::ReduceOp::Sum)
                    .map_err(|e| err(format!("reduce-scatter: {e:?}")))?,
                BlockHalf::AllGather => {
                    comm.all_gather(&sbuf, &mut rbuf).map_err(|e| err(format!("all-gather: {e:?}")))?
                }
            };
            stream.memcpy_dtoh(&rbuf, recv).map_err(|e| err(format!("{e:?}")))?;
            stream.synchronize().map_err(|e| err(format!("{e:?}")))
        })
    }

    /// Sums `data` over `group` in place.
    pub fn all_reduce<T>(&self, group: &[usize], data: &mut [T]) -> Result<()>
    where
        T: cudarc::nccl::safe::NcclType + cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Copy,
    {
        let comm = self.comm(group)?;
        let err = |e: String| nccl_error(self.rank, e);
        let stream = comm.stream();
        for part in data.chunks_mut(max_chunk_elements(std::mem::size_of::<T>())) {
            let mut buf = stream.clone_htod(&*part).map_err(|e| err(format!("{e:?}")))?;
            comm.all_reduce_in_place(&mut buf, &cudarc::nccl::safe::ReduceOp::Sum)
                .map_err(|e| err(format!("all-reduce: {e:?}")))?;
            stream.memcpy_dtoh(&buf, part).map_err(|e| err(format!("{e:?}")))?;
            stream.synchronize().map_err(|e| err(format!("{e:?}")))?;
        }
        Ok(())
    }
}

/// Blocked on the peers inside a collective, the worker is not busy, and its watchdog bounds the
/// wait (see the port's pulse): the blanket `AllReduce` of [`LibraryCollectives`] says so.
impl LibraryCollectives for NcclGroups {
    fn all_reduce_f32(&mut self, group: &[usize], data: &mut [f32]) -> Result<()> {
        self.all_reduce(group, data)
    }
    fn all_reduce_f64(&mut self, group: &[usize], data: &mut [f64]) -> Result<()> {
        self.all_reduce(group, data)
    }
    fn block_half(&mut self, group: &[usize], data: &mut [f32], half: BlockHalf) -> Result<()> {
        self.block_rounds_on_device(group, data, half)
    }
    fn regroup_expert_groups(&mut self, groups: &[Vec<usize>]) -> Result<()> {
        self.mpi.set_expert_groups(groups);
        let (ctx, mpi, rank) = (&self.ctx, &self.mpi, self.rank);
        self.experts = mpi
            .expert_groups()
            .map(|g| Ok((g.to_vec(), Self::communicator(ctx, mpi, rank, g)?)))
            .collect::<Result<_>>()?;
        Ok(())
    }
}
