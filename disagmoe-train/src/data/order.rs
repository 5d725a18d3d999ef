//! Where the windows of a split are in the token stream, and the seeded order an epoch visits
//! them in, neither materialised beyond what the corpus's size allows.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

/// Part of the token stream (the training or the held-out split): token ranges of the stream,
/// concatenated; its windows are cut from the concatenation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Split {
    /// `(start, len)` in stream tokens, increasing, not overlapping.
    runs: Vec<(u64, u64)>,
    /// Split offset of each run's first token.
    offsets: Vec<u64>,
    tokens: u64,
}

impl Split {
    /// The split made of `runs` (`(start, len)`, increasing); empty runs are dropped.
    pub fn new(runs: impl IntoIterator<Item = (u64, u64)>) -> Self {
        let mut s = Self::default();
        for (start, len) in runs.into_iter().filter(|r| r.1 > 0) {
            s.offsets.push(s.tokens);
            s.runs.push((start, len));
            s.tokens += len;
        }
        s
    }

    /// Tokens in the split.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Whole windows of `seq` tokens (the tail is dropped).
    pub fn windows(&self, seq: usize) -> usize {
        (self.tokens / seq as u64) as usize
    }

    /// The stream ranges holding window `w` of `seq` tokens, in order.
    pub fn window_ranges(&self, w: usize, seq: usize) -> Vec<std::ops::Range<u64>> {
        let (mut at, end) = (w as u64 * seq as u64, (w as u64 + 1) * seq as u64);
        let mut out = Vec::new();
        let mut r = self.offsets.partition_point(|&o| o <= at) - 1;
        while at < end {
            let (start, len) = self.runs[r];
            let within = at - self.offsets[r];
            let take = (len - within).min(end - at);
            out.push(start + within..start + within + take);
            at += take;
            r += 1;
        }
        out
    }
}

/// Splits a stream of `tokens` into (training, held-out) parts holding out `floor(fraction x
/// units)` of its units, evenly spaced (unit `floor((i + 1/2) x units / held)` for each `i`), where
/// the units are the documents (`doc_starts`: each document's first token, then `tokens`) when
/// there are at least two, else the windows of `seq` tokens.
pub fn split(tokens: u64, doc_starts: Option<&[u64]>, seq: usize, fraction: f64) -> (Split, Split) {
    let docs = doc_starts.filter(|d| d.len() > 2);
    let units = match docs {
        Some(d) => d.len() - 1,
        None => (tokens / seq as u64) as usize,
    };
    let unit = |u: usize| match docs {
        Some(d) => (d[u], d[u + 1] - d[u]),
        None => (u as u64 * seq as u64, seq as u64),
    };
    let held = (units as f64 * fraction).floor() as usize;
    let held_units: Vec<usize> = (0..held).map(|i| ((2 * i + 1) * units) / (2 * held)).collect();
    let eval = Split::new(held_units.iter().map(|&u| unit(u)));
    let mut train_runs = Vec::with_capacity(held + 1);
    let mut at = 0u64;
    for &(start, len) in &eval.runs {
        train_runs.push((at, start - at));
        at = start + len;
    }
    // Window units end at the last whole window (the tail is no unit); documents at the end.
    let end = if docs.is_some() { tokens } else { units as u64 * seq as u64 };
    train_runs.push((at, end.saturating_sub(at)));
    (Split::new(train_runs), eval)
}

/// Windows of an epoch, in the seeded order it visits them.
#[derive(Debug, Clone)]
pub enum WindowOrder {
    /// A shuffled list (corpora of up to [`MATERIALISED_WINDOWS`] windows).
    Listed(Vec<u32>),
    /// A seeded pseudo-random permutation computed per position (larger corpora): no list.
    Permuted(Permutation),
}

/// Corpora up to this many windows get a listed order (4 bytes per window).
pub const MATERIALISED_WINDOWS: usize = 1 << 22;

impl WindowOrder {
    /// The order of `n` windows in `epoch` of a run seeded `seed`.
    pub fn new(n: usize, seed: u64, epoch: u64) -> Self {
        let key = seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        if n <= MATERIALISED_WINDOWS {
            let mut order: Vec<u32> = (0..n as u32).collect();
            order.shuffle(&mut StdRng::seed_from_u64(key));
            Self::Listed(order)
        } else {
            Self::Permuted(Permutation::new(n as u64, key))
        }
    }

    /// Windows in the epoch.
    pub fn len(&self) -> usize {
        match self {
            Self::Listed(v) => v.len(),
            Self::Permuted(p) => p.n as usize,
        }
    }

    /// Whether the epoch has no window.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The window visited `i`-th.
    pub fn at(&self, i: usize) -> usize {
        match self {
            Self::Listed(v) => v[i] as usize,
            Self::Permuted(p) => p.at(i as u64) as usize,
        }
    }
}

/// A seeded bijection of `0..n`: a four-round Feistel network on the smallest even number of bits
/// covering `n`, walked until it lands inside `0..n` (cycle walking; under four steps on average).
#[derive(Debug, Clone)]
pub struct Permutation {
    n: u64,
    half_bits: u32,
    keys: [u64; 4],
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

impl Permutation {
    /// A permutation of `0..n` drawn by `key`.
    pub fn new(n: u64, key: u64) -> Self {
        let bits = 64 - n.saturating_sub(1).leading_zeros();
        let half_bits = bits.div_ceil(2).max(1);
        let keys = std::array::from_fn(|r| splitmix64(key ^ splitmix64(r as u64 + 1)));
        Self { n, half_bits, keys }
    }

    fn round(&self, x: u64) -> u64 {
        let mask = (1u64 << self.half_bits) - 1;
        let (mut l, mut r) = (x >> self.half_bits, x & mask);
        for k in self.keys {
            (l, r) = (r, l ^ (splitmix64(r ^ k) & mask));
        }
        (l << self.half_bits) | r
    }

    /// The image of `i` (`i < n`).
    pub fn at(&self, i: u64) -> u64 {
        let mut x = self.round(i);
        while x >= self.n {
            x = self.round(x);
        }
        x
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_permutation_is_a_bijection_and_depends_on_its_key() {
        for n in [1u64, 2, 3, 1000, 4097] {
            let p = Permutation::new(n, 7);
            let mut seen: Vec<u64> = (0..n).map(|i| p.at(i)).collect();
            let first = seen.clone();
            seen.sort_unstable();
            assert_eq!(seen, (0..n).collect::<Vec<_>>(), "n = {n}");
            if n > 3 {
                let q = Permutation::new(n, 8);
                assert_ne!(first, (0..n).map(|i| q.at(i)).collect::<Vec<_>>());
                assert_ne!(first, (0..n).collect::<Vec<_>>(), "shuffled");
            }
        }
    }

    #[test]
    fn splits_by_windows_and_by_documents() {
        // 10 windows of 4 tokens (+ a tail of 2), 20% held out: windows 2 and 7.
        let (train, eval) = split(42, None, 4, 0.2);
        assert_eq!(eval.window_ranges(0, 4), vec![8..12]);
        assert_eq!(eval.window_ranges(1, 4), vec![28..32]);
        assert_eq!((train.windows(4), eval.windows(4)), (8, 2));
        assert_eq!(train.window_ranges(2, 4), vec![12..16], "window 2 of training is window 3");
        // Documents of 5, 3, 7, 5 tokens; one held out (document 2): windows never take from it.
        let docs = [0u64, 5, 8, 15, 20];
        let (train, eval) = split(20, Some(&docs), 4, 0.25);
        assert_eq!((train.tokens(), eval.tokens()), (13, 7));
        assert_eq!(train.window_ranges(1, 4), vec![4..8]);
        assert_eq!(train.window_ranges(2, 4), vec![15..19], "across the held-out document");
        assert_eq!(eval.window_ranges(0, 4), vec![8..12]);
        // A window straddling two runs.
        assert_eq!(train.window_ranges(1, 5), vec![5..8, 15..17]);
    }
}
