//! `disagmoe net-bench`: times a real network the way the MPI transport uses it, for the link model
//! of the prediction ([`super::predict::network`], issue 33).
//!
//! Under `mpirun -np N` (N >= 2), every rank takes part; per message size, after a round of 1 KiB
//! messages left out (connections open lazily), in each of `repeats` rounds, in turn:
//! - **ping-pong**: rank 0 sends one message to rank 1;
//! - **burst** of k = 1..3 messages: rank 0 sends them in turn, with blocking sends as the
//!   transport's send thread does, to ranks 1, 2, ... (back to back to the same peers where there
//!   are fewer than k);
//! - **incast** from k = 2..N-1 peers: ranks 1..=k each send one message to rank 0 at once;
//! - **exchange** of k = 1..3 messages each way: ranks 0 and 1 send each other k messages at
//!   once, each from a send thread while it receives, as the transport does (both directions of a
//!   link busy: each one's acknowledgements and MPI's handshakes travel behind the other's data).
//!
//! Each time runs from the first send's start to the last receive's end, both read from the
//! machine's monotonic clock by the ranks that did them (so the ranks must share one machine, as
//! the network namespaces of `scripts/netns-cluster.sh` do; checked: every rank must report the
//! same host). Rank 0 gets the medians and the spread of the rounds.

use mpi::collective::CommunicatorCollectives;
use mpi::point_to_point::{Destination, Source};
use mpi::topology::{Communicator, SimpleCommunicator};

use super::predict::network::{Pattern, Sample};
use super::transport::now_us;
use crate::error::{Result, TrainError};

const DATA: i32 = 11;
/// The most messages of a burst or of each side of an exchange.
const BURST_MAX: usize = 3;
const STAMP: i32 = 12;

/// What to time.
#[derive(Debug, Clone)]
pub struct BenchSettings {
    /// Message sizes, bytes (each from 1 to [`MAX_BYTES`]).
    pub sizes: Vec<usize>,
    /// Timed rounds per size (1 to 100).
    pub repeats: usize,
}

/// The largest message timed (the traffic stays bounded).
pub const MAX_BYTES: usize = 64 << 20;

impl BenchSettings {
    /// Refuses sizes or repeats out of range, naming the allowed values.
    pub fn validate(&self) -> Result<()> {
        if self.sizes.is_empty() {
            return Err(TrainError::option("sizes", "at least one message size"));
        }
        if let Some(&b) = self.sizes.iter().find(|&&b| b == 0 || b > MAX_BYTES) {
            return Err(TrainError::option("sizes", format!("{b} bytes (allowed: 1 to {MAX_BYTES})")));
        }
        if !(1..=100).contains(&self.repeats) {
            return Err(TrainError::option("repeats", format!("{} (allowed: 1 to 100)", self.repeats)));
        }
        Ok(())
    }
}

/// One timed round of every pattern at `bytes`; rank 0 gets `(pattern, peers, seconds)`.
fn round(world: &SimpleCommunicator, bytes: usize) -> Vec<(Pattern, usize, f64)> {
    let (rank, n) = (world.rank() as usize, world.size() as usize);
    let data = vec![0x5au8; bytes];
    let mut inbox = vec![0u8; bytes];
    let mut times = Vec::new();
    let stamp = |t: u64| t.to_le_bytes();
    let read = |b: [u8; 8]| u64::from_le_bytes(b);
    // Ping-pong: one message to rank 1. Burst k (1 to 3): k messages sent in turn, message i to
    // rank 1 + i mod (N - 1) (distinct peers where there are enough, else back to back to the
    // same one).
    let dst_of = |i: usize| 1 + i % (n - 1);
    let mut bursts: Vec<(Pattern, usize)> = (1..=BURST_MAX).map(|k| (Pattern::Burst, k)).collect();
    bursts.insert(0, (Pattern::PingPong, 1));
    for (pattern, k) in bursts {
        world.barrier();
        let mine = (0..k).filter(|&i| dst_of(i) == rank).count();
        let receivers = k.min(n - 1);
        if rank == 0 {
            let t0 = now_us();
            for i in 0..k {
                world.process_at_rank(dst_of(i) as i32).send_with_tag(&data[..], DATA);
            }
            let mut last = t0;
            for _ in 0..receivers {
                let mut t = [0u8; 8];
                world.any_process().receive_into_with_tag(&mut t[..], STAMP);
                last = last.max(read(t));
            }
            times.push((pattern, k, (last - t0) as f64 / 1e6));
        } else if mine > 0 {
            for _ in 0..mine {
                world.process_at_rank(0).receive_into_with_tag(&mut inbox[..], DATA);
            }
            let t = now_us();
            world.process_at_rank(0).send_with_tag(&stamp(t)[..], STAMP);
        }
    }
    for k in 2..n {
        world.barrier();
        if rank == 0 {
            for _ in 1..=k {
                world.any_process().receive_into_with_tag(&mut inbox[..], DATA);
            }
            let end = now_us();
            let mut first = u64::MAX;
            for _ in 1..=k {
                let mut t = [0u8; 8];
                world.any_process().receive_into_with_tag(&mut t[..], STAMP);
                first = first.min(read(t));
            }
            times.push((Pattern::Incast, k, end.saturating_sub(first) as f64 / 1e6));
        } else if rank <= k {
            let t = now_us();
            world.process_at_rank(0).send_with_tag(&data[..], DATA);
            world.process_at_rank(0).send_with_tag(&stamp(t)[..], STAMP);
        }
    }
    for k in 1..=BURST_MAX {
        world.barrier();
        if rank <= 1 {
            let other = (1 - rank) as i32;
            let t0 = now_us();
            std::thread::scope(|s| {
                s.spawn(|| {
                    let world = SimpleCommunicator::world();
                    for _ in 0..k {
                        world.process_at_rank(other).send_with_tag(&data[..], DATA);
                    }
                });
                for _ in 0..k {
                    world.process_at_rank(other).receive_into_with_tag(&mut inbox[..], DATA);
                }
            });
            let end = now_us();
            if rank == 1 {
                world.process_at_rank(0).send_with_tag(&[t0, end][..], STAMP);
            } else {
                let mut theirs = [0u64; 2];
                world.process_at_rank(1).receive_into_with_tag(&mut theirs[..], STAMP);
                let s = (end.max(theirs[1]) - t0.min(theirs[0])) as f64 / 1e6;
                times.push((Pattern::Exchange, k, s));
            }
        }
    }
    times
}

/// Runs the benchmark on the MPI world (every rank calls it); rank 0 gets the number of ranks and
/// the samples, the others `None`.
pub fn run(settings: &BenchSettings) -> Result<Option<(usize, Vec<Sample>)>> {
    settings.validate()?;
    let universe = super::mpi::start_mpi()?;
    let world = universe.world();
    let (rank, n) = (world.rank() as usize, world.size() as usize);
    if n < 2 {
        return Err(TrainError::option("ranks", "net-bench needs 2 ranks or more (mpirun -np N, N >= 2)"));
    }
    // One machine: the times mix two ranks' clocks.
    let host = mpi::environment::processor_name().unwrap_or_default();
    let hash = host.bytes().fold(0xcbf29ce484222325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100000001b3));
    let mut hashes = vec![0u64; n];
    world.all_gather_into(&hash, &mut hashes[..]);
    if hashes.iter().any(|&h| h != hash) {
        return Err(TrainError::option(
            "ranks",
            "net-bench times transfers with the machine's monotonic clock, read by sender and receiver: \
             every rank must run on one machine (e.g. the network namespaces of scripts/netns-cluster.sh)",
        ));
    }
    let mut out = Vec::new();
    for &bytes in &settings.sizes {
        round(&world, bytes.min(1 << 10));
        let mut all: Vec<(Pattern, usize, Vec<f64>)> = Vec::new();
        for _ in 0..settings.repeats {
            for (pattern, k, s) in round(&world, bytes) {
                match all.iter_mut().find(|(p, q, _)| (*p, *q) == (pattern, k)) {
                    Some((_, _, v)) => v.push(s),
                    None => all.push((pattern, k, vec![s])),
                }
            }
        }
        for (pattern, peers, mut v) in all {
            v.sort_by(f64::total_cmp);
            let median = if v.len() % 2 == 1 { v[v.len() / 2] } else { 0.5 * (v[v.len() / 2 - 1] + v[v.len() / 2]) };
            out.push(Sample { pattern, peers, bytes, seconds: median, min_s: v[0], max_s: v[v.len() - 1] });
        }
    }
    world.barrier();
    Ok((rank == 0).then_some((n, out)))
}
