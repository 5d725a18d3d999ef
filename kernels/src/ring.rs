//! Ring attention: the causal attention of one sequence computed by `C` workers of an attention
//! group (context parallelism). The sequence is cut into `2C` chunks and worker `r` holds chunks
//! `r` and `2C - 1 - r`, one from the front and its mirror from the back, so that under the causal
//! mask every worker has the same work (Megatron's and torchtitan's load balancing). Each worker
//! attends with its own queries to every worker's keys and values as they come round the ring,
//! one worker's block per step, skipping the chunk pairs the mask empties, and merges the partial
//! results with the online softmax: each partial result carries its log-sum-exp, merged in f32.
//!
//! [`partial`] and [`merge`] are the steps a worker takes, [`worker_attention`] one worker's whole
//! computation over the [`Block`]s in ring order ([`worker_partial`] the same in pieces: its own
//! block first, while the others travel, then the rest onto that; [`chunk_partials`] the same per
//! chunk of the worker's queries, [`split_queries`], so that merging block by block copies no
//! whole result); [`ring_attention`] runs the
//! `C` workers one after the other over a whole sequence (the schedule, not the transport), equal
//! to [`crate::reference::attention`] up to rounding, forward and backward.

use std::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::{Bool, Int, Tensor, TensorData};

use crate::documents::Documents;
use crate::precision::matmul;
use crate::reference::heads;

/// The log-sum-exp of a query that sees no key in a block: finite, so that merging it with an
/// empty partner gives no NaN, and `exp(EMPTY - lse)` is 0 against any real one.
const EMPTY: f32 = -1.0e30;

/// The two chunks of a sequence of `seq` tokens that each of `c` workers holds: `2c` contiguous
/// chunks as equal as they can be (the first `seq % 2c` one token longer), worker `r` holding
/// chunks `r` and `2c - 1 - r`.
///
/// # Errors
/// `c` of 0, or a sequence shorter than `2c` tokens (a chunk would be empty).
pub fn chunks(seq: usize, c: usize) -> Result<Vec<[Range<usize>; 2]>, String> {
    if c == 0 || seq < 2 * c {
        return Err(format!(
            "context parallelism over {c} workers needs sequences of at least {} tokens (2 chunks per worker), got {seq}",
            2 * c
        ));
    }
    let n = 2 * c;
    let bounds: Vec<usize> = (0..=n).map(|i| i * (seq / n) + i.min(seq % n)).collect();
    let chunk = |i: usize| bounds[i]..bounds[i + 1];
    Ok((0..c).map(|r| [chunk(r), chunk(n - 1 - r)]).collect())
}

/// Which tokens of a sequence attend where: the causal mask, a sliding window (query `i` sees keys
/// `i - window < j <= i`) and documents (keys of the query's own document only).
#[derive(Clone, Copy, Debug)]
pub struct Mask<'a> {
    /// The window, if any.
    pub window: Option<usize>,
    /// Documents over `[B, S]` (positions of the whole sequence), if any.
    pub docs: Option<&'a Documents>,
}

impl Mask<'_> {
    fn sees(&self, b: usize, qp: usize, kp: usize) -> bool {
        kp <= qp && qp - kp < self.window.unwrap_or(usize::MAX) && self.docs.is_none_or(|d| kp >= d.start(b, qp))
    }

    /// Whether no query of `q` sees any key of `k` in any row (a block the ring skips).
    fn empty(&self, q: &Range<usize>, k: &Range<usize>) -> bool {
        let causal = k.start > q.end - 1;
        let window = self.window.is_some_and(|w| q.start - (k.end - 1).min(q.start) >= w);
        causal || window
    }
}

/// Whether queries `q` `[B, Sq, H, D]`, keys `k` `[B, Tk, G, D]` and values `v` `[B, Tk, G, E]`
/// at `[seq, q_start, k_start]` (positions `q_start..q_start + Sq` and `k_start..k_start + Tk` of
/// sequences of `seq` tokens), with `window` and `docs` over `[B, seq]`, make a block the fused
/// block operations take (`crate::fused::attention_block`): grouped-query heads, no empty side,
/// both inside the sequence, a window of at least one token.
#[cfg_attr(not(any(feature = "flex", feature = "wgpu", feature = "cuda")), allow(dead_code))]
pub(crate) fn block_fits(
    [q, k, v]: [[usize; 4]; 3],
    window: Option<usize>,
    docs: Option<&Documents>,
    [seq, q_start, k_start]: [usize; 3],
) -> bool {
    let ([b, sq, h, d], [kb, tk, g, kd], [vb, vt, vg, _]) = (q, k, v);
    g != 0
        && h % g == 0
        && (kb, kd) == (b, d)
        && (vb, vt, vg) == (b, tk, g)
        && window != Some(0)
        && sq != 0
        && tk != 0
        && q_start + sq <= seq
        && k_start + tk <= seq
        && docs.is_none_or(|x| (x.batch(), x.seq()) == (b, seq))
}

/// One block of attention: queries at positions `q` of the sequence over keys and values at
/// positions `k`, without sinks. Returns the normalised output `[B, Sq, H, E]` and its
/// log-sum-exp `[B, H, Sq, 1]` (f32; a query that sees no key gets output 0 and a log-sum-exp far
/// below any real one).
///
/// # Shapes
/// - q: `[B, Sq, H, D]` (positions `q`), k: `[B, Tk, G, D]`, v: `[B, Tk, G, E]` (positions `k`)
pub fn partial<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    scale: f64,
    mask: Mask<'_>,
    qpos: &[usize],
    kpos: &[usize],
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    // Contiguous positions (a chunk each, as the ring has them): the fused operation where there
    // is one, which keeps only the block's probabilities for the backward.
    let contiguous = |p: &[usize]| p.windows(2).all(|w| w[1] == w[0] + 1);
    if let (Some(&q0), Some(&k0), true) = (qpos.first(), kpos.first(), contiguous(qpos) && contiguous(kpos)) {
        let seq = mask.docs.map_or((q0 + qpos.len()).max(k0 + kpos.len()), |d| d.seq());
        let at = [seq, q0, k0];
        if let Some(block) =
            crate::fused::attention_block(q.clone(), k.clone(), v.clone(), scale, mask.window, mask.docs, at, EMPTY)
        {
            return block;
        }
    }
    let [b, s, h, _] = q.dims();
    let t = kpos.len();
    let device = q.device();
    let (q, k, v) = (q.swap_dims(1, 2), heads(k, h), heads(v, h));
    let scores = matmul(q, k.swap_dims(2, 3)).mul_scalar(scale); // [B, H, Sq, Tk], f32
    let rows = if mask.docs.is_some() { b } else { 1 };
    let hidden: Vec<bool> =
        (0..rows * s * t).map(|i| !mask.sees(i / (s * t), qpos[(i / t) % s], kpos[i % t])).collect();
    let hidden =
        Tensor::<B, 4, Bool>::from_data(TensorData::new(hidden, [rows, 1, s, t]), &device).expand([b, h, s, t]);
    let scores = scores.mask_fill(hidden.clone(), EMPTY);
    // The row maximum only steadies the exponentials: the result does not depend on it.
    let max = scores.clone().max_dim(3).detach(); // [B, H, Sq, 1]
    let p = (scores - max.clone()).exp().mask_fill(hidden, 0.0);
    let sum = p.clone().sum_dim(3); // [B, H, Sq, 1]
    let seen = sum.clone().greater_elem(0.0);
    let safe = sum.clone().mask_fill(seen.clone().bool_not(), 1.0);
    let out = matmul(p, v).div(safe.clone()); // [B, H, Sq, E]
    let lse = (max + safe.log()).mask_fill(seen.bool_not(), EMPTY);
    (out.swap_dims(1, 2), lse)
}

/// The attention over the keys of two blocks from each one's: outputs `[B, S, H, E]` weighted by
/// their share of the softmax, and the log-sum-exp of the union (f32).
pub fn merge<B: Backend>(
    a: (Tensor<B, 4>, Tensor<B, 4>),
    b: (Tensor<B, 4>, Tensor<B, 4>),
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let ((oa, la), (ob, lb)) = (a, b);
    let top = la.clone().max_pair(lb.clone()).detach();
    let lse = top.clone() + ((la.clone() - top.clone()).exp() + (lb.clone() - top).exp()).log();
    let weight = |l: Tensor<B, 4>| (l - lse.clone()).exp().swap_dims(1, 2); // [B, S, H, 1]
    (oa * weight(la) + ob * weight(lb), lse)
}

/// The output once the sinks' logits join the softmax (one per head, its probability dropped).
///
/// # Shapes
/// - out: `[B, S, H, E]`, lse: `[B, H, S, 1]`, sinks: `[H]`
pub fn with_sinks<B: Backend>(out: Tensor<B, 4>, lse: Tensor<B, 4>, sinks: Tensor<B, 1>) -> Tensor<B, 4> {
    let [b, h, s, _] = lse.dims();
    let sink = sinks.reshape([1, h, 1, 1]).expand([b, h, s, 1]);
    let top = lse.clone().max_pair(sink.clone()).detach();
    let total = top.clone() + ((lse.clone() - top.clone()).exp() + (sink - top).exp()).log();
    out * (lse - total).exp().swap_dims(1, 2)
}

/// The positions worker `r` of a ring of `c` holds of a sequence of `seq` tokens, in the order it
/// holds them: its front chunk, then its back chunk ([`chunks`]).
///
/// # Errors
/// As [`chunks`], or `r` not below `c`.
pub fn held_positions(seq: usize, c: usize, r: usize) -> Result<Vec<usize>, String> {
    let held = chunks(seq, c)?;
    let own = held.get(r).ok_or_else(|| format!("worker {r} is not in a ring of {c} workers"))?;
    Ok(positions_of(own))
}

/// The positions of two chunks, front then back.
fn positions_of([front, back]: &[Range<usize>; 2]) -> Vec<usize> {
    front.clone().chain(back.clone()).collect()
}

/// The keys and values one worker holds, as they come round the ring: `[B, T, G, D]` and
/// `[B, T, G, E]` over the positions of its two chunks, front then back (`T` = their lengths).
#[derive(Clone, Debug)]
pub struct Block<B: Backend> {
    /// Keys.
    pub k: Tensor<B, 4>,
    /// Values.
    pub v: Tensor<B, 4>,
    /// The two chunks of the sequence it holds ([`chunks`]).
    pub held: [Range<usize>; 2],
}

/// A worker's attention so far over some of the ring's blocks, before the sinks: the output of
/// its queries normalised over the keys seen, `[B, T, H, E]`, and its log-sum-exp `[B, H, T, 1]`
/// (f32), over both of the worker's chunks in the order of its queries ([`worker_partial`]).
#[derive(Clone, Debug)]
pub struct Partial<B: Backend> {
    /// `[B, T, H, E]`.
    pub out: Tensor<B, 4>,
    /// `[B, H, T, 1]`.
    pub lse: Tensor<B, 4>,
}

/// What one worker of the ring computes: the attention of its queries (`q`, `[B, T, H, D]` over
/// its chunks `held`, front then back) over the blocks of keys and values in ring order (its own
/// first, then those of workers `r - 1`, `r - 2`, ... as they arrive), the chunk pairs the mask
/// empties skipped, the partial results merged in f32, the sinks added last. Returns
/// `[B, T, H, E]` in the order of `q`: [`finish`] of [`worker_partial`] without a start.
///
/// Each block may be a leaf of the worker's own graph (what it received): the gradient of the
/// objective with respect to it is what goes back to its owner, and an owner's keys and values
/// get the sum of those over the ring (`kernels/tests/ring.rs` checks this against the whole
/// attention).
///
/// # Errors
/// As [`worker_partial`].
pub fn worker_attention<B: Backend>(
    q: Tensor<B, 4>,
    held: &[Range<usize>; 2],
    blocks: &[Block<B>],
    sinks: Option<Tensor<B, 1>>,
    scale: f64,
    mask: Mask<'_>,
) -> Result<Tensor<B, 4>, String> {
    Ok(finish(worker_partial(q, held, blocks, None, scale, mask)?, sinks))
}

/// A worker's attention over `blocks` (in ring order), merged in f32 onto `start` when given
/// (the attention over the blocks before them: a worker computes its own block's while the
/// others are on their way, then the rest as they arrive). The result is the same, bit for bit,
/// as one call over all the blocks: [`chunk_partials`] on the queries' two chunks, joined.
///
/// # Errors
/// As [`chunk_partials`], or queries whose length is not that of the chunks.
pub fn worker_partial<B: Backend>(
    q: Tensor<B, 4>,
    held: &[Range<usize>; 2],
    blocks: &[Block<B>],
    start: Option<Partial<B>>,
    scale: f64,
    mask: Mask<'_>,
) -> Result<Partial<B>, String> {
    let t = q.dims()[1];
    if held.iter().any(|r| r.is_empty()) {
        return Err(format!("a worker of the ring holds two non-empty chunks, got {held:?}"));
    }
    if t != held[0].len() + held[1].len() {
        return Err(format!(
            "queries over {t} positions for the chunks {held:?} ({} positions)",
            held[0].len() + held[1].len()
        ));
    }
    if let Some(Partial { out, lse }) = &start {
        let [b, _, h, _] = q.dims();
        let [ob, ot, oh, _] = out.dims();
        if [ob, ot, oh] != [b, t, h] || lse.dims() != [b, h, t, 1] {
            return Err(format!(
                "a start of outputs {:?} and log-sum-exp {:?} for queries {:?}",
                out.dims(),
                lse.dims(),
                q.dims()
            ));
        }
    }
    let start = start.map(|p| p.chunks(held));
    Ok(Partial::join(chunk_partials(&split_queries(q, held), held, blocks, start, scale, mask)?))
}

/// A worker's queries `[B, T, H, D]` as its two chunks `held`, front then back.
pub fn split_queries<B: Backend>(q: Tensor<B, 4>, held: &[Range<usize>; 2]) -> [Tensor<B, 4>; 2] {
    [q.clone().narrow(1, 0, held[0].len()), q.narrow(1, held[0].len(), held[1].len())]
}

impl<B: Backend> Partial<B> {
    /// The attention of each of the worker's two chunks `held` (front, back).
    pub fn chunks(self, held: &[Range<usize>; 2]) -> [Partial<B>; 2] {
        let (a, b) = (held[0].len(), held[1].len());
        let Partial { out, lse } = self;
        [
            Partial { out: out.clone().narrow(1, 0, a), lse: lse.clone().narrow(2, 0, a) },
            Partial { out: out.narrow(1, a, b), lse: lse.narrow(2, a, b) },
        ]
    }

    /// The attention of both chunks, front then back, from each one's ([`Partial::chunks`]).
    pub fn join([front, back]: [Partial<B>; 2]) -> Partial<B> {
        Partial { out: Tensor::cat(vec![front.out, back.out], 1), lse: Tensor::cat(vec![front.lse, back.lse], 2) }
    }
}

/// [`worker_partial`] on the queries of the worker's two chunks, `q` (front, back:
/// [`split_queries`]), onto a start of each one's ([`Partial::chunks`]): a worker that merges
/// block by block keeps its attention so far per chunk, so that a block costs its attention and
/// its merge, and no copy of the whole.
///
/// # Errors
/// An empty chunk, queries of a chunk or a block whose length is not that of its chunks, a
/// start of another shape than the queries', or (without a start) no block of this worker's own
/// chunks, or (with one) a block of them again.
pub fn chunk_partials<B: Backend>(
    q: &[Tensor<B, 4>; 2],
    held: &[Range<usize>; 2],
    blocks: &[Block<B>],
    start: Option<[Partial<B>; 2]>,
    scale: f64,
    mask: Mask<'_>,
) -> Result<[Partial<B>; 2], String> {
    let len = |h: &[Range<usize>; 2]| h[0].len() + h[1].len();
    if held.iter().any(|r| r.is_empty()) {
        return Err(format!("a worker of the ring holds two non-empty chunks, got {held:?}"));
    }
    for (qc, r) in q.iter().zip(held) {
        if qc.dims()[1] != r.len() {
            return Err(format!("queries over {} positions for the chunk {r:?}", qc.dims()[1]));
        }
    }
    for block in blocks {
        let (k, v) = (block.k.dims()[1], block.v.dims()[1]);
        if block.held.iter().any(|r| r.is_empty()) || k != len(&block.held) || v != len(&block.held) {
            return Err(format!(
                "a block of keys over {k} and values over {v} positions for the chunks {:?}",
                block.held
            ));
        }
    }
    match &start {
        Some(_) if blocks.iter().any(|b| &b.held == held) => {
            return Err(format!(
                "a block of this worker's own chunks {held:?} onto a start: the start already holds it"
            ));
        }
        Some(parts) => {
            for (p, qc) in parts.iter().zip(q) {
                let [b, t, h, _] = qc.dims();
                let [ob, ot, oh, _] = p.out.dims();
                if [ob, ot, oh] != [b, t, h] || p.lse.dims() != [b, h, t, 1] {
                    return Err(format!(
                        "a start of outputs {:?} and log-sum-exp {:?} for queries {:?}",
                        p.out.dims(),
                        p.lse.dims(),
                        qc.dims()
                    ));
                }
            }
        }
        None if !blocks.iter().any(|b| &b.held == held) => {
            return Err(format!("no block holds this worker's own chunks {held:?}: its queries would see no key"));
        }
        None => {}
    }
    let mut start = start.map(|[a, b]| [Some(a), Some(b)]).unwrap_or([None, None]);
    let mut parts = Vec::with_capacity(2);
    for ((qr, qc), begin) in held.iter().zip(q).zip(&mut start) {
        let qpos: Vec<usize> = qr.clone().collect();
        let mut acc: Option<(Tensor<B, 4>, Tensor<B, 4>)> = begin.take().map(|p| (p.out, p.lse));
        for block in blocks {
            let mut k_at = 0;
            for kr in &block.held {
                let at = k_at;
                k_at += kr.len();
                if mask.empty(qr, kr) {
                    continue;
                }
                let kpos: Vec<usize> = kr.clone().collect();
                let (k, v) = (block.k.clone().narrow(1, at, kr.len()), block.v.clone().narrow(1, at, kr.len()));
                let part = partial(qc.clone(), k, v, scale, mask, &qpos, &kpos);
                acc = Some(match acc {
                    None => part,
                    Some(prev) => merge(prev, part),
                });
            }
        }
        // Every query sees at least itself: its own chunk (in its own block, checked above, or
        // in the start) is never skipped.
        let (out, lse) = acc.expect("a chunk attends to itself");
        parts.push(Partial { out, lse });
    }
    let [front, back]: [Partial<B>; 2] = parts.try_into().unwrap_or_else(|_| unreachable!("two chunks"));
    Ok([front, back])
}

/// A worker's output once every block is in: the sinks, when given, join the softmax.
pub fn finish<B: Backend>(p: Partial<B>, sinks: Option<Tensor<B, 1>>) -> Tensor<B, 4> {
    match sinks {
        Some(sinks) => with_sinks(p.out, p.lse, sinks),
        None => p.out,
    }
}

/// [`crate::reference::attention`] computed as `c` workers of a ring would: each with the queries
/// of its two chunks ([`chunks`]), the keys and values of every worker coming round one block per
/// step (its own first), through [`worker_attention`]; the workers' outputs put back in sequence
/// order.
///
/// # Errors
/// As [`chunks`].
///
/// # Shapes
/// - q: `[B, S, H, D]`, k: `[B, S, G, D]`, v: `[B, S, G, E]`, sinks: `[H]` -> `[B, S, H, E]`;
///   docs over `[B, S]`
#[allow(clippy::too_many_arguments)]
pub fn ring_attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    sinks: Option<Tensor<B, 1>>,
    scale: f64,
    mask: Mask<'_>,
    c: usize,
) -> Result<Tensor<B, 4>, String> {
    let [_, s, _, _] = q.dims();
    let held = chunks(s, c)?;
    let device = q.device();
    let take = |x: &Tensor<B, 4>, [a, b]: &[Range<usize>; 2]| {
        Tensor::cat(vec![x.clone().narrow(1, a.start, a.len()), x.clone().narrow(1, b.start, b.len())], 1)
    };
    let blocks: Vec<Block<B>> =
        held.iter().map(|h| Block { k: take(&k, h), v: take(&v, h), held: h.clone() }).collect();
    let mut outs = Vec::with_capacity(c);
    let mut order = Vec::with_capacity(s);
    for (r, own) in held.iter().enumerate() {
        // Step i brings worker r - i's block.
        let ring: Vec<Block<B>> = (0..c).map(|i| blocks[(r + c - i) % c].clone()).collect();
        outs.push(worker_attention(take(&q, own), own, &ring, sinks.clone(), scale, mask)?);
        order.extend(positions_of(own));
    }
    // Back into sequence order.
    let mut inverse = vec![0i64; s];
    for (at, &p) in order.iter().enumerate() {
        inverse[p] = at as i64;
    }
    let inverse = Tensor::<B, 1, Int>::from_data(TensorData::new(inverse, [s]), &device);
    Ok(Tensor::cat(outs, 1).select(1, inverse))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_balance_the_causal_work_and_cover_the_sequence() {
        let c = chunks(10, 2).unwrap();
        assert_eq!(c, vec![[0..3, 8..10], [3..6, 6..8]]);
        let c = chunks(13, 3).unwrap();
        let mut all: Vec<usize> = c.iter().flat_map(|[a, b]| a.clone().chain(b.clone())).collect();
        all.sort();
        assert_eq!(all, (0..13).collect::<Vec<_>>());
        // Causal work (keys seen) per worker within a token per row of the mean.
        let work: Vec<usize> = c.iter().map(|[a, b]| a.clone().chain(b.clone()).map(|p| p + 1).sum()).collect();
        let (lo, hi) = (work.iter().min().unwrap(), work.iter().max().unwrap());
        assert!(hi - lo <= 13, "{work:?}");
        let e = chunks(5, 3).unwrap_err();
        assert!(e.contains("at least 6 tokens"), "{e}");
    }
}
