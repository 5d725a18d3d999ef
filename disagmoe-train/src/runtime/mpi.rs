//! The `mpi` transport: one process per worker, started by `mpirun -np <workers>` (any MPI; CI uses
//! Debian's OpenMPI). MPI rank = worker rank. The `nccl` transport starts the same way and only
//! moves the envelopes differently ([`super::nccl`]).
//!
//! Each process builds the model from the seed, keeps its own part and drops the rest. Its endpoint
//! has two communication threads: one sends (so a large send never holds up compute), one receives
//! with `MPI_Recv` from any source and hands envelopes to the worker. Envelopes travel as bincode.
//! When a worker fails it tells the others (an `Abort` message) and the process exits with an error;
//! if a process dies outright, `mpirun` ends the job.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;
use std::time::Duration;

use mpi::collective::CommunicatorCollectives;
use mpi::environment::Universe;
use mpi::point_to_point::{Destination, Source};
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::Threading;

use super::transport::{receive_within, Endpoint, Envelope, Msg};
use crate::config::{RunConfig, TransportKind};
use crate::error::{Result, TrainError};

static WORLD_RANK: AtomicUsize = AtomicUsize::new(0);

/// This process's MPI rank (0 before MPI was started).
pub fn world_rank() -> usize {
    WORLD_RANK.load(Ordering::SeqCst)
}

/// A worker's MPI connection.
pub struct MpiEndpoint {
    rank: usize,
    size: usize,
    outbox: Option<Sender<(usize, Vec<u8>)>>,
    inbox: Receiver<Envelope>,
    /// Keeps the inbox open while no receive thread is running (a worker alone, or closing).
    _inbox_open: Sender<Envelope>,
    sender: Option<JoinHandle<()>>,
    receiver: Option<JoinHandle<()>>,
}

impl MpiEndpoint {
    fn start() -> Self {
        let world = SimpleCommunicator::world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        let (outbox, outgoing) = channel::<(usize, Vec<u8>)>();
        let (inbox_tx, inbox) = channel::<Envelope>();
        let sender = std::thread::Builder::new()
            .name("mpi-send".into())
            .spawn(move || {
                let world = SimpleCommunicator::world();
                for (dst, bytes) in outgoing {
                    world.process_at_rank(dst as i32).send(&bytes[..]);
                }
            })
            .expect("spawn the MPI send thread");
        let deliver = inbox_tx.clone();
        let receiver = std::thread::Builder::new()
            .name("mpi-recv".into())
            .spawn(move || {
                let world = SimpleCommunicator::world();
                loop {
                    let (bytes, _status) = world.any_process().receive_vec::<u8>();
                    match Envelope::from_bytes(&bytes) {
                        Some(env) if matches!(env.msg, Msg::Shutdown) => break,
                        Some(env) => {
                            if deliver.send(env).is_err() {
                                break;
                            }
                        }
                        None => tracing::error!(bytes = bytes.len(), "undecodable MPI message dropped"),
                    }
                }
            })
            .expect("spawn the MPI receive thread");
        Self {
            rank,
            size,
            outbox: Some(outbox),
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
        if bytes.len() > i32::MAX as usize {
            return Err(TrainError::Worker {
                worker: self.rank,
                cause: format!(
                    "a {} message of {} bytes exceeds MPI's 2 GiB per message (the mpi transport does not split messages yet)",
                    env.msg.kind(),
                    bytes.len()
                ),
            });
        }
        outbox
            .send((dst, bytes))
            .map_err(|_| TrainError::Worker { worker: self.rank, cause: "the MPI send thread has stopped".into() })
    }
    fn arrive(&mut self, timeout: Duration) -> Result<Option<Envelope>> {
        receive_within(&self.inbox, self.rank, timeout, "the MPI receive thread and this worker's sends")
    }
}

fn start_mpi() -> Result<Universe> {
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

    /// This rank's endpoint of the transport.
    pub fn endpoint(&self, transport: TransportKind) -> Box<dyn Endpoint> {
        match transport {
            #[cfg(feature = "nccl")]
            TransportKind::Nccl => match super::nccl::NcclEndpoint::start(&self.universe.world()) {
                Ok(e) => Box::new(e),
                Err(e) => {
                    eprintln!("error: {e}");
                    self.universe.world().abort(2);
                }
            },
            _ => Box::new(MpiEndpoint::start()),
        }
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
