//! Document masks of packed windows: which tokens of a window belong to the same document, so
//! that attention stays within each document (the mask of pretraining recipes since Llama 3).
//!
//! Under a causal mask, "keys of my own document" is a contiguous range ending at the query, so
//! a document mask is one number per token: where its document starts. Every attention
//! implementation ([`crate::reference`], the fused CPU operation, the CubeCL kernel) intersects
//! the range `[start(i), i]` with the sliding window; the kernels skip the key tiles that lie
//! wholly before their query tile's first start.

use std::fmt;
use std::sync::Arc;

/// The documents of each row of a `[B, S]` batch: for token `i` of row `b`, the position where its
/// document starts and the one past where it ends. Cheap to clone (shared).
#[derive(Clone, PartialEq, Eq)]
pub struct Documents {
    batch: usize,
    seq: usize,
    /// Starts of every token (`[B * S]`), then ends (`[B * S]`), row-major.
    bounds: Arc<[u32]>,
    /// Whether rotary positions restart at each document ([`Documents::restarting_positions`]).
    restart: bool,
}

impl fmt::Debug for Documents {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let cuts: Vec<Vec<usize>> = (0..self.batch).map(|b| self.cuts(b)).collect();
        f.debug_struct("Documents")
            .field("seq", &self.seq)
            .field("cuts", &cuts)
            .field("restart", &self.restart)
            .finish()
    }
}

impl Documents {
    /// Rows of `seq` tokens where row `b`'s documents begin at positions `cuts[b]` (besides 0),
    /// strictly increasing and inside `1..seq`.
    ///
    /// # Errors
    /// A cut outside `1..seq` or out of order, named with its row; a window longer than `u32`.
    pub fn new(seq: usize, cuts: &[Vec<usize>]) -> Result<Self, String> {
        if seq == 0 || seq > u32::MAX as usize {
            return Err(format!("document mask over windows of {seq} tokens; allowed: 1..={}", u32::MAX));
        }
        let batch = cuts.len();
        let mut bounds = vec![0u32; 2 * batch * seq];
        let (starts, ends) = bounds.split_at_mut(batch * seq);
        for (b, row) in cuts.iter().enumerate() {
            let mut prev = 0usize;
            for &c in row {
                if c <= prev || c >= seq {
                    return Err(format!(
                        "row {b}: document cut {c} is not inside {}..{seq} after the previous cut {prev}",
                        prev + 1
                    ));
                }
                prev = c;
            }
            let edges: Vec<usize> = std::iter::once(0).chain(row.iter().copied()).chain(std::iter::once(seq)).collect();
            for w in edges.windows(2) {
                for i in w[0]..w[1] {
                    starts[b * seq + i] = w[0] as u32;
                    ends[b * seq + i] = w[1] as u32;
                }
            }
        }
        Ok(Self { batch, seq, bounds: bounds.into(), restart: false })
    }

    /// Rows that are each one document (the mask changes nothing).
    pub fn whole(batch: usize, seq: usize) -> Self {
        Self::new(seq, &vec![Vec::new(); batch]).expect("no cuts")
    }

    /// The same documents, with each token's rotary position counted from its document's start
    /// ([`Documents::positions`]) instead of the row's (Megatron's `--reset-position-ids`).
    pub fn restarting_positions(mut self) -> Self {
        self.restart = true;
        self
    }

    /// Whether rotary positions restart at each document.
    pub fn restarts_positions(&self) -> bool {
        self.restart
    }

    /// Rows in the batch.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Tokens per row.
    pub fn seq(&self) -> usize {
        self.seq
    }

    /// Where token `i` of row `b`'s document starts.
    pub fn start(&self, b: usize, i: usize) -> usize {
        self.bounds[b * self.seq + i] as usize
    }

    /// One past where token `i` of row `b`'s document ends.
    pub fn end(&self, b: usize, i: usize) -> usize {
        self.bounds[(self.batch + b) * self.seq + i] as usize
    }

    /// Every token's start `[B * S]`, then every token's end `[B * S]`: what the kernels read.
    pub fn bounds(&self) -> &[u32] {
        &self.bounds
    }

    /// The positions where row `b`'s documents begin, besides 0.
    pub fn cuts(&self, b: usize) -> Vec<usize> {
        (1..self.seq).filter(|&i| self.start(b, i) == i).collect()
    }

    /// Whether every row is one document.
    pub fn is_whole(&self) -> bool {
        (0..self.batch).all(|b| self.end(b, 0) == self.seq)
    }

    /// Rows `range` (a micro-batch).
    ///
    /// # Panics
    /// If `range` is not inside the batch.
    pub fn rows(&self, range: std::ops::Range<usize>) -> Self {
        assert!(range.end <= self.batch, "rows {range:?} of a batch of {}", self.batch);
        let cuts: Vec<Vec<usize>> = range.map(|b| self.cuts(b)).collect();
        Self { restart: self.restart, ..Self::new(self.seq, &cuts).expect("cuts of a valid mask") }
    }

    /// Each token's position within its document (`[B * S]`, row-major): the rotary positions
    /// of a run whose positions restart per document.
    pub fn positions(&self) -> Vec<usize> {
        (0..self.batch * self.seq).map(|bi| bi % self.seq - self.bounds[bi] as usize).collect()
    }

    /// Whether token `i + 1` of row `b` begins another document, so that predicting it from
    /// token `i` is no training signal (`[B * (S - 1)]`, row-major: the next-token loss's mask).
    pub fn crosses(&self) -> Vec<bool> {
        self.crosses_ahead(0)
    }

    /// Whether token `i + k + 1` of row `b` lies in another document than token `i`
    /// (`[B * (S - k - 1)]`, row-major): the mask of a loss where position `i` predicts the token
    /// `k + 1` places ahead (multi-token prediction's depth `k`).
    pub fn crosses_ahead(&self, k: usize) -> Vec<bool> {
        let n = self.seq.saturating_sub(k + 1);
        (0..self.batch).flat_map(|b| (0..n).map(move |i| self.start(b, i + k + 1) > i)).collect()
    }

    /// The documents of each row's first `n` tokens (a document cut short ends at `n`).
    ///
    /// # Panics
    /// If `n` is 0 or longer than the rows.
    pub fn prefix(&self, n: usize) -> Self {
        assert!(n >= 1 && n <= self.seq, "a prefix of {n} tokens of rows of {}", self.seq);
        let cuts: Vec<Vec<usize>> =
            (0..self.batch).map(|b| self.cuts(b).into_iter().filter(|&c| c < n).collect()).collect();
        Self { restart: self.restart, ..Self::new(n, &cuts).expect("cuts of a valid mask") }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_follow_the_cuts_and_refusals_name_the_row() {
        let d = Documents::new(6, &[vec![2, 5], vec![]]).unwrap();
        let starts: Vec<usize> = (0..6).map(|i| d.start(0, i)).collect();
        let ends: Vec<usize> = (0..6).map(|i| d.end(0, i)).collect();
        assert_eq!(starts, [0, 0, 2, 2, 2, 5]);
        assert_eq!(ends, [2, 2, 5, 5, 5, 6]);
        assert_eq!((0..6).map(|i| d.start(1, i)).collect::<Vec<_>>(), [0; 6]);
        assert_eq!(d.cuts(0), [2, 5]);
        assert_eq!(d.positions()[..6], [0, 1, 0, 1, 2, 0]);
        assert_eq!(d.crosses()[..5], [false, true, false, false, true]);
        // Two ahead: 0 -> 2 and 1 -> 3 cross the cut at 2, 2 -> 4 does not, 3 -> 5 crosses 5.
        assert_eq!(d.crosses_ahead(1)[..4], [true, true, false, true]);
        assert_eq!(d.crosses_ahead(1).len(), 2 * 4);
        assert_eq!(d.prefix(5).cuts(0), [2]);
        assert_eq!((d.prefix(5).seq(), d.prefix(5).end(0, 4)), (5, 5));
        assert!(!d.is_whole());
        assert!(d.rows(1..2).is_whole());
        assert_eq!(d.rows(0..1).cuts(0), [2, 5]);
        for bad in [vec![0], vec![6], vec![3, 3], vec![4, 2]] {
            let e = Documents::new(6, &[vec![], bad.clone()]).unwrap_err();
            assert!(e.starts_with("row 1: document cut"), "{bad:?}: {e}");
        }
    }
}
