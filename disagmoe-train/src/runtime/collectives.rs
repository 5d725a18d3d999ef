//! Collective sums of a distributed run: the gradients of an attention group's copies, and the
//! step's global sums (squared gradient norm, losses, expert load, timings).
//!
//! A worker sums through an [`AllReduce`]; each transport reduces with the engine built for it
//! (the engine picks it, `engine.rs`), and this module knows none of them but its own ring:
//! - `local` (threads): [`Ring`], a **ring all-reduce** (reduce-scatter, then all-gather) over the
//!   worker's port, in chunks ([`ring_all_reduce`] over any [`RingLink`]);
//! - `mpi`: MPI's `MPI_Allreduce` on a sub-communicator per group (`mpi.rs`), in chunks of at most
//!   [`max_chunk_elements`] so that no single call exceeds MPI's 2 GiB (`i32` count) limit;
//! - `nccl`: `ncclAllReduce` on device buffers, one communicator per group (`nccl.rs`), in the same
//!   chunks (which bound the staging buffer on the device).
//!
//! Every member of a group ends with the same bits: in the ring each chunk's sum is formed once,
//! along the ring, and then copied to the others.

use std::collections::HashMap;

use super::msg::ReduceData;
use super::transport::Pulse;
use crate::error::{Result, TrainError};

/// Elements of one message or one collective call: `DISAGMOE_MAX_CHUNK_BYTES` (tests force it
/// small to exercise the chunking) divided by the element size, else 256 MiB worth.
pub fn max_chunk_elements(element_bytes: usize) -> usize {
    let bytes = std::env::var("DISAGMOE_MAX_CHUNK_BYTES")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&b| b > 0)
        .unwrap_or(256 << 20);
    (bytes / element_bytes).max(1)
}

/// A number the ring adds.
pub trait Summable: Copy + Default + std::ops::AddAssign + Send + 'static {}
impl Summable for f32 {}
impl Summable for f64 {}

/// A number type an all-reduce carries: how it travels, and which of a reducer's sums adds it.
pub trait ReduceValues: Summable + Sized {
    /// Wraps values for a message.
    fn wrap(values: Vec<Self>) -> ReduceData;
    /// The values of a message of this type.
    fn unwrap(data: ReduceData) -> Option<Vec<Self>>;
    /// Sums `data` over `group` with `reducer`.
    fn sum_with(reducer: &mut dyn AllReduce, via: &mut dyn Transit, group: &[usize], data: &mut [Self]) -> Result<()>;
}

impl ReduceValues for f32 {
    fn wrap(values: Vec<Self>) -> ReduceData {
        ReduceData::F32(values)
    }
    fn unwrap(data: ReduceData) -> Option<Vec<Self>> {
        match data {
            ReduceData::F32(v) => Some(v),
            ReduceData::F64(_) => None,
        }
    }
    fn sum_with(reducer: &mut dyn AllReduce, via: &mut dyn Transit, group: &[usize], data: &mut [Self]) -> Result<()> {
        reducer.sum_f32(via, group, data)
    }
}

impl ReduceValues for f64 {
    fn wrap(values: Vec<Self>) -> ReduceData {
        ReduceData::F64(values)
    }
    fn unwrap(data: ReduceData) -> Option<Vec<Self>> {
        match data {
            ReduceData::F64(v) => Some(v),
            ReduceData::F32(_) => None,
        }
    }
    fn sum_with(reducer: &mut dyn AllReduce, via: &mut dyn Transit, group: &[usize], data: &mut [Self]) -> Result<()> {
        reducer.sum_f64(via, group, data)
    }
}

/// The worker's side of an all-reduce: its messages (chunks of a ring, through the worker's
/// port, told apart by the all-reduce's number `op` and the chunk's `seq`), and its pulse (a
/// collective that blocks on the peers marks the worker waiting, see [`Pulse`]).
pub trait Transit {
    /// Hands chunk `seq` of all-reduce `op` to `dst`.
    fn send_chunk(&mut self, dst: usize, op: u64, seq: u64, data: ReduceData) -> Result<()>;
    /// Chunk `seq` of all-reduce `op` from `src` (other messages that come meanwhile are kept).
    fn recv_chunk(&mut self, src: usize, op: u64, seq: u64) -> Result<ReduceData>;
    /// The worker's pulse.
    fn pulse(&self) -> &Pulse;
}

/// How a worker's groups sum: f32 (gradients, counts) and f64 (losses, norms, timings) values over
/// a group of ranks it belongs to, in place, every member ending with the same bits. [`Ring`] over
/// the worker's own transport (`local`), MPI sub-communicators (`mpi`), NCCL (`nccl`); the engine
/// makes the one of its transport (`engine.rs`).
pub trait AllReduce {
    /// Sums f32 values over `group`.
    fn sum_f32(&mut self, via: &mut dyn Transit, group: &[usize], data: &mut [f32]) -> Result<()>;
    /// Sums f64 values over `group`.
    fn sum_f64(&mut self, via: &mut dyn Transit, group: &[usize], data: &mut [f64]) -> Result<()>;
}

/// The ring all-reduce over the worker's port ([`ring_all_reduce`]): each of a group's
/// all-reduces gets the next number of that group (its members count alike), which tags its
/// chunks apart from any other's.
#[derive(Debug)]
pub struct Ring {
    me: usize,
    /// All-reduces run so far per group (first rank, size).
    counts: HashMap<(usize, usize), u64>,
}

impl Ring {
    /// The ring reducer of worker `me`.
    pub fn new(me: usize) -> Self {
        Self { me, counts: HashMap::new() }
    }

    /// The number of the next all-reduce over `group`: first rank, size and count packed in 64
    /// bits (16, 16 and 32).
    fn next_op(&mut self, group: &[usize]) -> u64 {
        let count = self.counts.entry((group[0], group.len())).or_insert(0);
        *count += 1;
        ((group[0] as u64) << 48) | ((group.len() as u64) << 32) | *count
    }

    fn sum<T: ReduceValues>(&mut self, via: &mut dyn Transit, group: &[usize], data: &mut [T]) -> Result<()> {
        if group.len() <= 1 {
            return Ok(());
        }
        let op = self.next_op(group);
        let chunk = max_chunk_elements(std::mem::size_of::<T>());
        ring_all_reduce(&mut Tagged { via, op }, group, self.me, data, chunk)
    }
}

impl AllReduce for Ring {
    fn sum_f32(&mut self, via: &mut dyn Transit, group: &[usize], data: &mut [f32]) -> Result<()> {
        self.sum(via, group, data)
    }
    fn sum_f64(&mut self, via: &mut dyn Transit, group: &[usize], data: &mut [f64]) -> Result<()> {
        self.sum(via, group, data)
    }
}

/// One all-reduce's chunks over a [`Transit`].
struct Tagged<'a> {
    via: &'a mut dyn Transit,
    op: u64,
}

impl<T: ReduceValues> RingLink<T> for Tagged<'_> {
    fn send_chunk(&mut self, dst: usize, seq: u64, data: Vec<T>) -> Result<()> {
        self.via.send_chunk(dst, self.op, seq, T::wrap(data))
    }
    fn recv_chunk(&mut self, src: usize, seq: u64) -> Result<Vec<T>> {
        let op = self.op;
        T::unwrap(self.via.recv_chunk(src, op, seq)?).ok_or_else(|| TrainError::Worker {
            worker: src,
            cause: format!("sent all-reduce {op} values of another type"),
        })
    }
}

/// How the ring talks: send a chunk to a member, receive the next chunk from one.
pub trait RingLink<T: Summable> {
    /// Hands `data` (chunk `seq` of this all-reduce) to `dst`.
    fn send_chunk(&mut self, dst: usize, seq: u64, data: Vec<T>) -> Result<()>;
    /// The chunk `seq` from `src`.
    fn recv_chunk(&mut self, src: usize, seq: u64) -> Result<Vec<T>>;
}

/// The `part`-th of `parts` contiguous pieces of `0..len` (sizes differ by at most one).
fn piece(len: usize, parts: usize, part: usize) -> std::ops::Range<usize> {
    (part * len / parts)..((part + 1) * len / parts)
}

/// Sums `data` over `group` (ranks in ring order; `me` among them) in place: reduce-scatter then
/// all-gather around the ring, each of the `n` pieces split into chunks of at most `chunk`
/// elements. `2 (n - 1)` messages per chunk leave each member.
pub fn ring_all_reduce<T: Summable, L: RingLink<T>>(
    link: &mut L,
    group: &[usize],
    me: usize,
    data: &mut [T],
    chunk: usize,
) -> Result<()> {
    let n = group.len();
    if n <= 1 || data.is_empty() {
        return Ok(());
    }
    let pos = group.iter().position(|&r| r == me).expect("a member of its group");
    let (next, prev) = (group[(pos + 1) % n], group[(pos + n - 1) % n]);
    let chunk = chunk.max(1);
    let len = data.len();
    // Chunk `c` of round `r` is message `r << 32 | c`: sender and receiver agree on it whatever
    // the pieces' sizes.
    let seq = |round: usize, c: usize| ((round as u64) << 32) | c as u64;
    for round in 0..2 * (n - 1) {
        // Reduce-scatter (rounds 0..n-1): after round s, piece (pos - s - 1) holds the sum of
        // s + 2 members; piece (pos + 1) is complete at the end. All-gather (rounds n-1..): the
        // complete pieces travel once around the ring.
        let gather = round >= n - 1;
        let s = if gather { round - (n - 1) } else { round };
        let offset = if gather { 1 } else { 0 };
        let send_piece = piece(len, n, (pos + offset + n - s) % n);
        let recv_piece = piece(len, n, (pos + offset + n - s - 1) % n);
        for (c, start) in send_piece.clone().step_by(chunk).enumerate() {
            link.send_chunk(next, seq(round, c), data[start..(start + chunk).min(send_piece.end)].to_vec())?;
        }
        for (c, start) in recv_piece.clone().step_by(chunk).enumerate() {
            let got = link.recv_chunk(prev, seq(round, c))?;
            let end = (start + chunk).min(recv_piece.end);
            if got.len() != end - start {
                return Err(TrainError::Worker {
                    worker: me,
                    cause: format!(
                        "all-reduce: a chunk of {} values from worker {prev}, expected {}",
                        got.len(),
                        end - start
                    ),
                });
            }
            if gather {
                data[start..end].copy_from_slice(&got);
            } else {
                for (d, v) in data[start..end].iter_mut().zip(got.iter()) {
                    *d += *v;
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::mpsc::{channel, Receiver, Sender};

    use super::*;

    /// Members as threads, chunks through channels keyed by (source, sequence).
    struct Channels {
        me: usize,
        to: Vec<Sender<(usize, u64, Vec<f32>)>>,
        inbox: Receiver<(usize, u64, Vec<f32>)>,
        held: HashMap<(usize, u64), Vec<f32>>,
    }

    impl RingLink<f32> for Channels {
        fn send_chunk(&mut self, dst: usize, seq: u64, data: Vec<f32>) -> crate::error::Result<()> {
            self.to[dst].send((self.me, seq, data)).unwrap();
            Ok(())
        }
        fn recv_chunk(&mut self, src: usize, seq: u64) -> crate::error::Result<Vec<f32>> {
            loop {
                if let Some(v) = self.held.remove(&(src, seq)) {
                    return Ok(v);
                }
                let (s, q, v) = self.inbox.recv().unwrap();
                self.held.insert((s, q), v);
            }
        }
    }

    fn run(n: usize, len: usize, chunk: usize) -> Vec<Vec<f32>> {
        let (tx, rx): (Vec<_>, Vec<_>) = (0..n).map(|_| channel()).unzip();
        let handles: Vec<_> = rx
            .into_iter()
            .enumerate()
            .map(|(me, inbox)| {
                let to = tx.clone();
                std::thread::spawn(move || {
                    let mut link = Channels { me, to, inbox, held: HashMap::new() };
                    let mut data: Vec<f32> = (0..len).map(|i| (me * 1000 + i) as f32 * 0.5).collect();
                    let group: Vec<usize> = (0..n).collect();
                    ring_all_reduce(&mut link, &group, me, &mut data, chunk).unwrap();
                    data
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn every_member_gets_the_sum_with_any_chunk_size() {
        for (n, len, chunk) in [(2, 10, 3), (3, 7, 1), (4, 1, 4), (4, 1000, 64), (5, 13, 1000), (3, 2, 1)] {
            let out = run(n, len, chunk);
            let want: Vec<f32> = (0..len).map(|i| (0..n).map(|me| (me * 1000 + i) as f32 * 0.5).sum::<f32>()).collect();
            for (me, got) in out.iter().enumerate() {
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-3 * w.abs().max(1.0),
                        "n={n} len={len} chunk={chunk} member {me} [{i}]"
                    );
                }
                assert_eq!(got, &out[0], "every member has the same bits");
            }
        }
    }
}
