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
use std::ops::Range;

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
    /// The part of `len` values that member `pos` of a group of `n` holds summed after
    /// [`AllReduce::reduce_scatter_f32`] (and gives in [`AllReduce::all_gather_f32`]): the
    /// members' parts are disjoint, contiguous and cover `0..len`.
    fn shard(&self, n: usize, pos: usize, len: usize) -> Range<usize>;
    /// The first half of an all-reduce: afterwards this member's [`AllReduce::shard`] of `data`
    /// holds the sum over `group` (the rest of `data` is left undefined).
    fn reduce_scatter_f32(&mut self, via: &mut dyn Transit, group: &[usize], data: &mut [f32]) -> Result<()>;
    /// The second half: every member's shard of `data` reaches every other member.
    fn all_gather_f32(&mut self, via: &mut dyn Transit, group: &[usize], data: &mut [f32]) -> Result<()>;
    /// The run's groups of holders of a replicated expert are now `groups` (the experts were
    /// placed anew): a library's reducer makes their communicators anew. Collective: every worker
    /// calls it at the same point with the same list. The ring needs nothing.
    fn regroup_experts(&mut self, via: &mut dyn Transit, groups: &[Vec<usize>]) -> Result<()> {
        let _ = (via, groups);
        Ok(())
    }
}

/// A reducer built on a library's collectives over host values (MPI's, NCCL's): each call blocks on
/// the group's other members, so the worker is marked as waiting inside it (its watchdog bounds the
/// wait, see [`Pulse`]); its reduce-scatter and all-gather use the [`block_shard`] layout.
pub trait LibraryCollectives {
    /// Sums f32 values over `group` in place.
    fn all_reduce_f32(&mut self, group: &[usize], data: &mut [f32]) -> Result<()>;
    /// Sums f64 values over `group` in place.
    fn all_reduce_f64(&mut self, group: &[usize], data: &mut [f64]) -> Result<()>;
    /// A reduce-scatter or all-gather over `group` ([`block_rounds`]).
    fn block_half(&mut self, group: &[usize], data: &mut [f32], half: BlockHalf) -> Result<()>;
    /// See [`AllReduce::regroup_experts`].
    fn regroup_expert_groups(&mut self, groups: &[Vec<usize>]) -> Result<()>;
}

impl<L: LibraryCollectives> AllReduce for L {
    fn sum_f32(&mut self, via: &mut dyn Transit, group: &[usize], data: &mut [f32]) -> Result<()> {
        via.pulse().in_collective(format!("an all-reduce over workers {group:?}"), || self.all_reduce_f32(group, data))
    }
    fn sum_f64(&mut self, via: &mut dyn Transit, group: &[usize], data: &mut [f64]) -> Result<()> {
        via.pulse().in_collective(format!("an all-reduce over workers {group:?}"), || self.all_reduce_f64(group, data))
    }
    fn shard(&self, n: usize, pos: usize, len: usize) -> Range<usize> {
        block_shard(n, pos, len)
    }
    fn reduce_scatter_f32(&mut self, via: &mut dyn Transit, group: &[usize], data: &mut [f32]) -> Result<()> {
        via.pulse().in_collective(format!("a reduce-scatter over workers {group:?}"), || {
            self.block_half(group, data, BlockHalf::ReduceScatter)
        })
    }
    fn all_gather_f32(&mut self, via: &mut dyn Transit, group: &[usize], data: &mut [f32]) -> Result<()> {
        via.pulse().in_collective(format!("an all-gather over workers {group:?}"), || {
            self.block_half(group, data, BlockHalf::AllGather)
        })
    }
    fn regroup_experts(&mut self, via: &mut dyn Transit, groups: &[Vec<usize>]) -> Result<()> {
        let what = "making the communicators of the replica holders anew".to_string();
        via.pulse().in_collective(what, || self.regroup_expert_groups(groups))
    }
}

/// The block layout of MPI's and NCCL's reduce-scatter: blocks of `ceil(len / n)` values in member
/// order (the last ones shorter, or empty).
pub fn block_shard(n: usize, pos: usize, len: usize) -> Range<usize> {
    let b = len.div_ceil(n.max(1));
    (pos * b).min(len)..((pos + 1) * b).min(len)
}

/// Which half of an all-reduce [`block_rounds`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockHalf {
    /// Each call sends `n` blocks (member-major) and receives this member's block, summed.
    ReduceScatter,
    /// Each call sends this member's block and receives every member's, in member order.
    AllGather,
}

/// A reduce-scatter or all-gather of `data` in the [`block_shard`] layout over `n` members (this
/// one at `pos`) through a collective of equal blocks (`MPI_Reduce_scatter_block` and
/// `MPI_Allgather`, NCCL's), in calls of at most [`max_chunk_elements`] values in all: `call(send,
/// recv)` is one such call; every member makes the same calls (the layout is the same everywhere).
/// Values past the end travel as zeros.
pub fn block_rounds(
    n: usize,
    pos: usize,
    data: &mut [f32],
    half: BlockHalf,
    mut call: impl FnMut(&[f32], &mut [f32]) -> Result<()>,
) -> Result<()> {
    let len = data.len();
    let b = len.div_ceil(n.max(1));
    let chunk = (max_chunk_elements(std::mem::size_of::<f32>()) / n.max(1)).max(1);
    let mut k0 = 0;
    while k0 < b {
        let c = chunk.min(b - k0);
        let at = |member: usize, j: usize| Some(member * b + k0 + j).filter(|&i| i < len);
        match half {
            BlockHalf::ReduceScatter => {
                let mut send = vec![0f32; n * c];
                for (k, x) in send.iter_mut().enumerate() {
                    if let Some(i) = at(k / c, k % c) {
                        *x = data[i];
                    }
                }
                let mut recv = vec![0f32; c];
                call(&send, &mut recv)?;
                for (j, x) in recv.into_iter().enumerate() {
                    if let Some(i) = at(pos, j) {
                        data[i] = x;
                    }
                }
            }
            BlockHalf::AllGather => {
                let send: Vec<f32> = (0..c).map(|j| at(pos, j).map_or(0.0, |i| data[i])).collect();
                let mut recv = vec![0f32; n * c];
                call(&send, &mut recv)?;
                for (k, x) in recv.into_iter().enumerate() {
                    if let Some(i) = at(k / c, k % c) {
                        data[i] = x;
                    }
                }
            }
        }
        k0 += c;
    }
    Ok(())
}

/// The ring all-reduce over the worker's port ([`ring_all_reduce`]): each of a group's
/// all-reduces gets the next number of that group (its members count alike), which tags its
/// chunks apart from any other's.
#[derive(Debug)]
pub struct Ring {
    me: usize,
    /// All-reduces run so far per group.
    counts: HashMap<Vec<usize>, u64>,
}

impl Ring {
    /// The ring reducer of worker `me`.
    pub fn new(me: usize) -> Self {
        Self { me, counts: HashMap::new() }
    }

    /// The number of the next all-reduce over `group`: a 32-bit digest of its members and the
    /// group's count of all-reduces, packed in 64 bits. Groups that share members (a worker's
    /// attention copies, the holders of each of several replicated experts) get different numbers,
    /// so a chunk that arrives early for one of them is never taken for another's.
    fn next_op(&mut self, group: &[usize]) -> u64 {
        let count = self.counts.entry(group.to_vec()).or_insert(0);
        *count += 1;
        (group_digest(group) << 32) | (*count & 0xFFFF_FFFF)
    }

    fn sum<T: ReduceValues>(&mut self, via: &mut dyn Transit, group: &[usize], data: &mut [T]) -> Result<()> {
        self.rounds(via, group, data, Half::Both)
    }

    fn rounds<T: ReduceValues>(
        &mut self,
        via: &mut dyn Transit,
        group: &[usize],
        data: &mut [T],
        half: Half,
    ) -> Result<()> {
        if group.len() <= 1 {
            return Ok(());
        }
        let op = self.next_op(group);
        let chunk = max_chunk_elements(std::mem::size_of::<T>());
        ring_rounds(&mut Tagged { via, op }, group, self.me, data, chunk, half)
    }
}

impl AllReduce for Ring {
    fn sum_f32(&mut self, via: &mut dyn Transit, group: &[usize], data: &mut [f32]) -> Result<()> {
        self.sum(via, group, data)
    }
    fn sum_f64(&mut self, via: &mut dyn Transit, group: &[usize], data: &mut [f64]) -> Result<()> {
        self.sum(via, group, data)
    }
    /// The piece the ring's reduce-scatter completes at a member: the one after its own.
    fn shard(&self, n: usize, pos: usize, len: usize) -> Range<usize> {
        piece(len, n, (pos + 1) % n)
    }
    fn reduce_scatter_f32(&mut self, via: &mut dyn Transit, group: &[usize], data: &mut [f32]) -> Result<()> {
        self.rounds(via, group, data, Half::ReduceScatter)
    }
    fn all_gather_f32(&mut self, via: &mut dyn Transit, group: &[usize], data: &mut [f32]) -> Result<()> {
        self.rounds(via, group, data, Half::AllGather)
    }
}

/// A 32-bit digest of a group's members (SplitMix64 over them, in order).
fn group_digest(group: &[usize]) -> u64 {
    let mut h = 0x243F_6A88_85A3_08D3u64 ^ group.len() as u64;
    for &r in group {
        h = h.wrapping_add(0x9E37_79B9_7F4A_7C15).wrapping_add(r as u64);
        let mut z = h;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        h = z ^ (z >> 31);
    }
    h >> 32
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

/// The rounds of a ring all-reduce to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Half {
    /// Reduce-scatter then all-gather: the sum everywhere.
    Both,
    /// The first `n - 1` rounds: member `pos` ends with piece `pos + 1` summed.
    ReduceScatter,
    /// The last `n - 1` rounds: member `pos`'s piece `pos + 1` reaches everyone.
    AllGather,
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
    ring_rounds(link, group, me, data, chunk, Half::Both)
}

/// The rounds `half` of [`ring_all_reduce`]: both halves run apart give the same bits as the whole.
pub fn ring_rounds<T: Summable, L: RingLink<T>>(
    link: &mut L,
    group: &[usize],
    me: usize,
    data: &mut [T],
    chunk: usize,
    half: Half,
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
    let rounds = match half {
        Half::Both => 0..2 * (n - 1),
        Half::ReduceScatter => 0..n - 1,
        Half::AllGather => n - 1..2 * (n - 1),
    };
    for round in rounds {
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
        run_scaled(n, len, chunk, 0.5)
    }

    fn run_scaled(n: usize, len: usize, chunk: usize, scale: f32) -> Vec<Vec<f32>> {
        on_members(n, len, scale, move |link, group, me, data| ring_all_reduce(link, group, me, data, chunk).unwrap())
    }

    /// Member `me`'s values are `(me * 1000 + i) * scale`; each member's thread runs `work` on its
    /// link, the group, its rank and its values; returns every member's values after.
    fn on_members(
        n: usize,
        len: usize,
        scale: f32,
        work: impl Fn(&mut Channels, &[usize], usize, &mut Vec<f32>) + Send + Sync + 'static,
    ) -> Vec<Vec<f32>> {
        let work = std::sync::Arc::new(work);
        let (tx, rx): (Vec<_>, Vec<_>) = (0..n).map(|_| channel()).unzip();
        let handles: Vec<_> = rx
            .into_iter()
            .enumerate()
            .map(|(me, inbox)| {
                let (to, work) = (tx.clone(), work.clone());
                std::thread::spawn(move || {
                    let mut link = Channels { me, to, inbox, held: HashMap::new() };
                    let mut data: Vec<f32> = (0..len).map(|i| (me * 1000 + i) as f32 * scale).collect();
                    let group: Vec<usize> = (0..n).collect();
                    work(&mut link, &group, me, &mut data);
                    data
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    fn run_halves(n: usize, len: usize, chunk: usize) -> Vec<Vec<f32>> {
        on_members(n, len, 0.37, move |link, group, me, data| {
            ring_rounds(link, group, me, data, chunk, Half::ReduceScatter).unwrap();
            // Only the shard is kept: the all-gather must not read the rest.
            let shard = Ring::new(me).shard(n, me, len);
            let mut kept = vec![f32::NAN; len];
            kept[shard.clone()].copy_from_slice(&data[shard]);
            ring_rounds(link, group, me, &mut kept, chunk, Half::AllGather).unwrap();
            *data = kept;
        })
    }

    #[test]
    fn the_halves_apart_give_the_whole_ring_bits_and_shards_cover_the_values() {
        for (n, len, chunk) in [(2, 10, 3), (3, 7, 1), (4, 1, 4), (4, 1000, 64), (5, 13, 1000), (3, 2, 1)] {
            // Values whose sums round: the order of the additions shows in the bits.
            let whole = run_scaled(n, len, chunk, 0.37);
            let halves = run_halves(n, len, chunk);
            assert_eq!(halves, whole, "n={n} len={len} chunk={chunk}: the halves give the whole's bits everywhere");
            for ring in [true, false] {
                let mut covered = vec![0; len];
                for pos in 0..n {
                    let s = if ring { Ring::new(0).shard(n, pos, len) } else { block_shard(n, pos, len) };
                    s.for_each(|i| covered[i] += 1);
                }
                assert!(covered.iter().all(|&c| c == 1), "n={n} len={len}: {covered:?}");
            }
        }
    }

    /// What each member of `data` sends in each call of [`block_rounds`].
    fn sends_of(data: &[Vec<f32>], half: BlockHalf) -> Vec<Vec<Vec<f32>>> {
        (0..data.len())
            .map(|pos| {
                let mut calls = Vec::new();
                block_rounds(data.len(), pos, &mut data[pos].clone(), half, |send, _| {
                    calls.push(send.to_vec());
                    Ok(())
                })
                .unwrap();
                calls
            })
            .collect()
    }

    /// Every member's calls of [`block_rounds`], run in lockstep by one thread that plays the
    /// collective: each member's sends recorded, then answered as the collective would.
    fn block_sum(n: usize, len: usize) -> Vec<Vec<f32>> {
        let inputs: Vec<Vec<f32>> = (0..n).map(|m| (0..len).map(|i| (m * 100 + i) as f32).collect()).collect();
        let sends = sends_of(&inputs, BlockHalf::ReduceScatter);
        let mut out: Vec<Vec<f32>> = inputs.clone();
        for (pos, data) in out.iter_mut().enumerate() {
            let mut k = 0;
            block_rounds(n, pos, data, BlockHalf::ReduceScatter, |_, recv| {
                let c = recv.len();
                for (j, r) in recv.iter_mut().enumerate() {
                    *r = (0..n).map(|m| sends[m][k][pos * c + j]).sum();
                }
                k += 1;
                Ok(())
            })
            .unwrap();
        }
        // Keep the shards only, then gather them.
        let kept: Vec<Vec<f32>> = (0..n)
            .map(|pos| {
                let s = block_shard(n, pos, len);
                let mut v = vec![f32::NAN; len];
                v[s.clone()].copy_from_slice(&out[pos][s]);
                v
            })
            .collect();
        let gsends = sends_of(&kept, BlockHalf::AllGather);
        (0..n)
            .map(|pos| {
                let mut data = kept[pos].clone();
                let mut k = 0;
                block_rounds(n, pos, &mut data, BlockHalf::AllGather, |_, recv| {
                    let c = recv.len() / n;
                    for (i, r) in recv.iter_mut().enumerate() {
                        *r = gsends[i / c][k][i % c];
                    }
                    k += 1;
                    Ok(())
                })
                .unwrap();
                data
            })
            .collect()
    }

    #[test]
    fn block_rounds_sum_and_gather_any_length() {
        for (n, len) in [(2, 10), (3, 7), (4, 1), (4, 3), (5, 13), (2, 0)] {
            let want: Vec<f32> = (0..len).map(|i| (0..n).map(|m| (m * 100 + i) as f32).sum()).collect();
            for (pos, got) in block_sum(n, len).iter().enumerate() {
                assert_eq!(got, &want, "n={n} len={len} member {pos}");
            }
        }
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
