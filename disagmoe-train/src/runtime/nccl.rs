//! The `nccl` transport (feature `nccl` = `cuda` + `mpi`): one process per worker under `mpirun`,
//! bootstrapped over MPI, envelopes moved between GPUs by NCCL, and the all-reduces (attention
//! copies' gradients, the step's global sums) by `ncclAllReduce` ([`NcclGroups`]).
//!
//! NCCL has no receive-from-any-source and wants one thread per communicator, so every ordered
//! pair of workers gets its own two-rank communicator (`i -> j`), driven by one send thread on `i`
//! and one receive thread on `j`, each on its own CUDA stream. A message is its length (8 bytes),
//! then its bytes. The unique ids are made by the sender of each pair and sent over MPI;
//! [`NcclEndpoint::start`] returns only when every communicator is up (or fails). NCCL refuses two
//! ranks of one communicator on the same GPU: each rank uses the GPU of its node-local rank (as the
//! launcher says, `OMPI_COMM_WORLD_LOCAL_RANK`, `SLURM_LOCALID`, ...) for NCCL's buffers, the same
//! GPU its model computes on by default (`backend::run_devices`).
//!
//! Status and known limits: compiled in CI, never run (no machine with several GPUs has been
//! available). Messages are host tensors, so each goes device -> host -> device -> NCCL -> host.
//! Many communicators used concurrently from independent threads is a pattern NCCL warns can
//! deadlock; a single communicator with MPI-exchanged headers and grouped send/receive is the
//! sturdier design, to do when a multi-GPU machine can test it.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;
use std::time::Duration;

use cudarc::driver::CudaContext;
use cudarc::nccl::safe::{Comm, Id};
use mpi::point_to_point::{Destination, Source};
use mpi::topology::{Communicator, SimpleCommunicator};

use super::collectives::{max_chunk_elements, AllReduce, Transit};
use super::msg::{Envelope, Msg};
use super::transport::{receive_within, Beacon, Delivery, Endpoint};
use crate::error::{Result, TrainError};

fn nccl_error(rank: usize, what: String) -> TrainError {
    TrainError::Worker { worker: rank, cause: format!("nccl: {what}") }
}

/// A worker's NCCL connections.
pub struct NcclEndpoint {
    rank: usize,
    size: usize,
    outboxes: Vec<Option<Sender<Vec<u8>>>>,
    inbox: Receiver<Delivery>,
    /// Keeps the inbox open while no receive thread is running (a worker alone, or closing).
    _inbox_open: Sender<Delivery>,
    senders: Vec<JoinHandle<()>>,
}

/// Sends `bytes` (length first) on `comm` to its rank 1.
fn send_bytes(comm: &Comm, bytes: &[u8]) -> std::result::Result<(), String> {
    let stream = comm.stream();
    let len = stream.clone_htod(&(bytes.len() as u64).to_le_bytes()).map_err(|e| format!("{e:?}"))?;
    comm.send(&len, 1).map_err(|e| format!("{e:?}"))?;
    if !bytes.is_empty() {
        let payload = stream.clone_htod(bytes).map_err(|e| format!("{e:?}"))?;
        comm.send(&payload, 1).map_err(|e| format!("{e:?}"))?;
    }
    stream.synchronize().map_err(|e| format!("{e:?}"))
}

/// Receives one message (length first) on `comm` from its rank 0.
fn recv_bytes(comm: &Comm) -> std::result::Result<Vec<u8>, String> {
    let stream = comm.stream();
    let mut len = stream.alloc_zeros::<u8>(8).map_err(|e| format!("{e:?}"))?;
    comm.recv(&mut len, 0).map_err(|e| format!("{e:?}"))?;
    let len = stream.clone_dtoh(&len).map_err(|e| format!("{e:?}"))?;
    let n = u64::from_le_bytes(len.try_into().expect("8 bytes")) as usize;
    if n == 0 {
        return Ok(Vec::new());
    }
    let mut payload = stream.alloc_zeros::<u8>(n).map_err(|e| format!("{e:?}"))?;
    comm.recv(&mut payload, 0).map_err(|e| format!("{e:?}"))?;
    stream.clone_dtoh(&payload).map_err(|e| format!("{e:?}"))
}

impl NcclEndpoint {
    /// Exchanges the pairs' ids over MPI and starts one send thread per peer and one receive thread
    /// per peer; each creates its communicator (which waits for the peer's matching thread).
    pub fn start(world: &SimpleCommunicator) -> Result<Self> {
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        let gpus = CudaContext::device_count().map_err(|e| nccl_error(rank, format!("no CUDA device: {e:?}")))?;
        if gpus < 1 {
            return Err(nccl_error(rank, "no CUDA device".into()));
        }
        let ctx = CudaContext::new(crate::config::parallel::node_local_rank().unwrap_or(rank) % gpus as usize)
            .map_err(|e| nccl_error(rank, format!("{e:?}")))?;
        // 1. Ids: the sender of each pair makes it and tells the receiver.
        let mut out_ids = Vec::new();
        for peer in (0..size).filter(|&p| p != rank) {
            let id = Id::new().map_err(|e| nccl_error(rank, format!("unique id: {e:?}")))?;
            let bytes: Vec<u8> = id.internal().iter().map(|&c| c as u8).collect();
            world.process_at_rank(peer as i32).send(&bytes[..]);
            out_ids.push((peer, id));
        }
        let mut in_ids = Vec::new();
        for peer in (0..size).filter(|&p| p != rank) {
            let (bytes, _) = world.process_at_rank(peer as i32).receive_vec::<u8>();
            let mut internal = [0 as std::ffi::c_char; 128];
            for (d, s) in internal.iter_mut().zip(&bytes) {
                *d = *s as std::ffi::c_char;
            }
            in_ids.push((peer, Id::uninit(internal)));
        }
        // 2. Threads, each with its own stream and communicator; each reports whether its
        // communicator came up.
        let (ready_tx, ready_rx) = channel::<std::result::Result<(), String>>();
        let (inbox_tx, inbox) = channel::<Delivery>();
        let mut outboxes: Vec<Option<Sender<Vec<u8>>>> = (0..size).map(|_| None).collect();
        let mut senders = Vec::new();
        for (peer, id) in out_ids {
            let (tx, rx) = channel::<Vec<u8>>();
            outboxes[peer] = Some(tx);
            let ctx = ctx.clone();
            let ready = ready_tx.clone();
            senders.push(
                std::thread::Builder::new()
                    .name(format!("nccl-send-{peer}"))
                    .spawn(move || {
                        let comm = match ctx.new_stream().map_err(|e| format!("{e:?}")).and_then(|stream| {
                            Comm::from_rank(stream, 0, 2, id).map_err(|e| format!("communicator to {peer}: {e:?}"))
                        }) {
                            Ok(c) => {
                                let _ = ready.send(Ok(()));
                                c
                            }
                            Err(e) => {
                                let _ = ready.send(Err(e));
                                return;
                            }
                        };
                        for bytes in rx {
                            if let Err(e) = send_bytes(&comm, &bytes) {
                                tracing::error!(peer, "nccl: send failed: {e}");
                                return;
                            }
                        }
                    })
                    .expect("spawn an NCCL send thread"),
            );
        }
        for (peer, id) in in_ids {
            let ctx = ctx.clone();
            let ready = ready_tx.clone();
            let deliver = inbox_tx.clone();
            // Receive threads end with their peer's `Shutdown`; they are not joined, so a dead peer
            // cannot hold this process.
            std::thread::Builder::new()
                .name(format!("nccl-recv-{peer}"))
                .spawn(move || {
                    let comm = match ctx.new_stream().map_err(|e| format!("{e:?}")).and_then(|stream| {
                        Comm::from_rank(stream, 1, 2, id).map_err(|e| format!("communicator from {peer}: {e:?}"))
                    }) {
                        Ok(c) => {
                            let _ = ready.send(Ok(()));
                            c
                        }
                        Err(e) => {
                            let _ = ready.send(Err(e));
                            return;
                        }
                    };
                    // A message this rank cannot take ends the run at once, naming its sender.
                    let fail = |cause: String| {
                        let _ = deliver.send(Err(nccl_error(rank, format!("from worker {peer}: {cause}"))));
                    };
                    loop {
                        match recv_bytes(&comm).map(|b| Envelope::from_bytes(&b)) {
                            Ok(Ok(env)) if matches!(env.msg, Msg::Shutdown) => break,
                            Ok(Ok(env)) => {
                                if deliver.send(Ok(env)).is_err() {
                                    break;
                                }
                            }
                            Ok(Err(e)) => break fail(format!("an undecodable message: {e}")),
                            Err(e) => break fail(format!("receive failed: {e}")),
                        }
                    }
                })
                .expect("spawn an NCCL receive thread");
        }
        // 3. Every communicator up, or an error (the caller then ends the job).
        for _ in 0..2 * (size - 1) {
            match ready_rx.recv_timeout(Duration::from_secs(120)) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(nccl_error(rank, e)),
                Err(_) => return Err(nccl_error(rank, "a communicator did not come up within 120 s".into())),
            }
        }
        Ok(Self { rank, size, outboxes, inbox, _inbox_open: inbox_tx, senders })
    }
}

impl Drop for NcclEndpoint {
    /// Tells every peer's receive thread to stop and flushes the sends.
    fn drop(&mut self) {
        for outbox in self.outboxes.iter_mut() {
            if let Some(tx) = outbox.take() {
                let stop = Envelope { src: self.rank, step: 0, sent_us: 0, deliver_us: 0, msg: Msg::Shutdown };
                let _ = tx.send(stop.to_bytes());
            }
        }
        for h in self.senders.drain(..) {
            let _ = h.join();
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
    fn transmit(&mut self, dst: usize, env: Envelope) -> Result<()> {
        let outbox = self.outboxes[dst]
            .as_ref()
            .ok_or_else(|| nccl_error(self.rank, format!("no connection to worker {dst}")))?;
        outbox
            .send(env.to_bytes())
            .map_err(|_| nccl_error(self.rank, format!("the send thread to worker {dst} has stopped")))
    }
    fn arrive(&mut self, timeout: Duration) -> Result<Option<Envelope>> {
        receive_within(&self.inbox, self.rank, timeout, "the NCCL receive threads and this worker's sends")
    }
    fn beacon(&self) -> Option<Beacon> {
        let outboxes = self.outboxes.clone();
        Some(Box::new(move |dst, env| match &outboxes[dst] {
            Some(outbox) => outbox.send(env.to_bytes()).is_ok(),
            None => true,
        }))
    }
}

/// The NCCL communicators of a worker's all-reduces: every worker (global sums) and, for an
/// attention worker with data-parallel copies, its copies (the gradient all-reduce). Made in the
/// worker's own thread, after [`super::mpi::MpiGroups`] (whose communicators carry the unique ids).
///
/// Values are host slices (the gradients of a worker are read to the host for the optimizer
/// anyway): each chunk of at most [`max_chunk_elements`] goes host -> device,
/// `ncclAllReduce(sum)` in place on the device, device -> host. Untested: no machine with several
/// GPUs has been lent to this project (see the module's status).
pub struct NcclGroups {
    rank: usize,
    everyone: (Vec<usize>, Comm),
    replicas: Option<(Vec<usize>, Comm)>,
}

impl NcclGroups {
    /// Collective over the job: every worker calls it at the same point.
    pub fn new(mpi: &super::mpi::MpiGroups, rank: usize) -> Result<Self> {
        let gpus = CudaContext::device_count().map_err(|e| nccl_error(rank, format!("no CUDA device: {e:?}")))?;
        if gpus < 1 {
            return Err(nccl_error(rank, "no CUDA device".into()));
        }
        let ctx = CudaContext::new(crate::config::parallel::node_local_rank().unwrap_or(rank) % gpus as usize)
            .map_err(|e| nccl_error(rank, format!("{e:?}")))?;
        let comm = |group: &[usize]| -> Result<Comm> {
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
        };
        let all = mpi.everyone();
        let everyone = (all.clone(), comm(&all)?);
        let replicas = match mpi.replicas() {
            Some(group) => Some((group.to_vec(), comm(group)?)),
            None => None,
        };
        Ok(Self { rank, everyone, replicas })
    }

    /// Sums `data` over `group` in place.
    pub fn all_reduce<T>(&self, group: &[usize], data: &mut [T]) -> Result<()>
    where
        T: cudarc::nccl::safe::NcclType + cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Copy,
    {
        let comm = match &self.replicas {
            Some((ranks, comm)) if ranks == group => comm,
            _ if self.everyone.0 == group => &self.everyone.1,
            _ => return Err(nccl_error(self.rank, format!("no communicator for the group {group:?}"))),
        };
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

/// Blocked on the peers inside the collective: the worker is not busy, and its watchdog bounds the
/// wait (see the port's pulse).
impl AllReduce for NcclGroups {
    fn sum_f32(&mut self, via: &mut dyn Transit, group: &[usize], data: &mut [f32]) -> Result<()> {
        via.pulse().in_collective(format!("an all-reduce over workers {group:?}"), || self.all_reduce(group, data))
    }
    fn sum_f64(&mut self, via: &mut dyn Transit, group: &[usize], data: &mut [f64]) -> Result<()> {
        via.pulse().in_collective(format!("an all-reduce over workers {group:?}"), || self.all_reduce(group, data))
    }
}
