//! The one order in which a token's expert outputs are added up, so that a device that holds all
//! experts and a group whose members each hold a contiguous range of them get the same bits.
//!
//! Floating-point addition is not associative: `(a + b) + (c + d)` and `((a + b) + c) + d` differ
//! in the last bits, and AdamW turns such differences, in gradient elements that are nearly zero,
//! into visibly different weights after a few steps. So every place that adds a token's expert
//! terms -- the combine of one device's MoE block, a holder's share of it, the attention worker
//! that adds the holders' shares, and the mirrored sums of gradients -- adds them along the same
//! binary tree over expert ids: a node splits its terms at the highest bit in which its smallest
//! and largest key differ, the lower half added before the upper.
//!
//! Keys: routed expert `e` is `2 e + 1`, the shared experts (always on, held with the first
//! expert range) are `0`, and a holder's partial sum over the experts `a..b` spans `2 a ..= 2 b - 1`.
//! When every holder's range is a power-of-two block aligned to its size (8 experts over 2 or 4
//! holders, 64 over 8...), the tree restricted to one holder's keys is exactly the subtree the
//! holder computes, and adding the holders' partials along the tree gives the bits of the sum over
//! all terms. Other layouts fall back to adding the terms whose ranges straddle a split one after
//! another in key order: the same sum, not the same bits.

use std::ops::Range;

/// The key of routed expert `e`.
pub fn expert_key(e: usize) -> (u64, u64) {
    let k = 2 * e as u64 + 1;
    (k, k)
}

/// The key of the shared experts' output (added first, beside expert 0).
pub const SHARED_KEY: (u64, u64) = (0, 0);

/// The key of a partial sum over the routed experts `range` (and the shared experts, which sit
/// below expert 0, when the range starts at 0).
pub fn range_key(range: &Range<usize>) -> (u64, u64) {
    let (a, b) = (2 * range.start as u64, 2 * range.end as u64);
    (a, b.max(a + 1) - 1)
}

/// One term of a sum: `row`, times `scale` when given (rounded to f32 before it is added, as
/// `scale * row` would be), covering the keys `key.0 ..= key.1`.
#[derive(Debug, Clone, Copy)]
pub struct Term<'a> {
    /// Lowest and highest key the term covers.
    pub key: (u64, u64),
    /// The values, one row.
    pub row: &'a [f32],
    /// A factor applied to `row` first (a gate weight).
    pub scale: Option<f32>,
}

impl Term<'_> {
    fn write(&self, out: &mut [f32]) {
        match self.scale {
            Some(w) => out.iter_mut().zip(self.row).for_each(|(o, &v)| *o = w * v),
            None => out.copy_from_slice(self.row),
        }
    }

    fn add_to(&self, out: &mut [f32]) {
        match self.scale {
            Some(w) => out.iter_mut().zip(self.row).for_each(|(o, &v)| *o += w * v),
            None => out.iter_mut().zip(self.row).for_each(|(o, &v)| *o += v),
        }
    }
}

/// Writes the sum of `terms` into `out` (zeros when there is none) in the canonical order (see
/// the module docs). `terms` is sorted by key here; `scratch` is grown as needed and may be reused
/// from call to call.
pub fn tree_sum(terms: &mut [Term<'_>], out: &mut [f32], scratch: &mut Vec<f32>) {
    terms.sort_by_key(|t| t.key);
    let need = terms.len().saturating_sub(1) * out.len();
    if scratch.len() < need {
        scratch.resize(need, 0.0);
    }
    sum_sorted(terms, out, &mut scratch[..need]);
}

fn sum_sorted(terms: &[Term<'_>], out: &mut [f32], scratch: &mut [f32]) {
    let [first, .., last] = terms else {
        match terms.first() {
            Some(t) => t.write(out),
            None => out.fill(0.0),
        }
        return;
    };
    let (lo, hi) = (first.key.0, terms.iter().map(|t| t.key.1).max().unwrap_or(last.key.1));
    let split = (lo != hi)
        .then(|| {
            let bit = 63 - (lo ^ hi).leading_zeros();
            let at = terms.partition_point(|t| (t.key.0 >> bit) & 1 == 0);
            let clean = at > 0 && at < terms.len() && terms[..at].iter().all(|t| (t.key.1 >> bit) & 1 == 0);
            clean.then_some(at)
        })
        .flatten();
    match split {
        Some(at) => {
            let (tmp, rest) = scratch.split_at_mut(out.len());
            sum_sorted(&terms[..at], out, rest);
            sum_sorted(&terms[at..], tmp, rest);
            out.iter_mut().zip(tmp.iter()).for_each(|(o, &v)| *o += v);
        }
        None => {
            // Ranges that straddle the split (a layout whose holders are not aligned blocks): one
            // after another in key order.
            first.write(out);
            terms[1..].iter().for_each(|t| t.add_to(out));
        }
    }
}

/// The sum of `terms` (`(key, value)`, in any order) along the same tree as [`tree_sum`], for values
/// added by `add` (a device's tensors, where [`tree_sum`] adds host rows): `add(lower, upper)` at
/// each split, one after another in key order where ranges straddle a split. `None` for no term.
pub fn tree_fold<T>(mut terms: Vec<((u64, u64), T)>, add: &mut impl FnMut(T, T) -> T) -> Option<T> {
    terms.sort_by_key(|t| t.0);
    fold_sorted(terms, add)
}

fn fold_sorted<T>(mut terms: Vec<((u64, u64), T)>, add: &mut impl FnMut(T, T) -> T) -> Option<T> {
    if terms.len() <= 1 {
        return terms.pop().map(|t| t.1);
    }
    let lo = terms[0].0 .0;
    let hi = terms.iter().map(|t| t.0 .1).max().unwrap_or(lo);
    let split = (lo != hi)
        .then(|| {
            let bit = 63 - (lo ^ hi).leading_zeros();
            let at = terms.partition_point(|t| (t.0 .0 >> bit) & 1 == 0);
            let clean = at > 0 && at < terms.len() && terms[..at].iter().all(|t| (t.0 .1 >> bit) & 1 == 0);
            clean.then_some(at)
        })
        .flatten();
    match split {
        Some(at) => {
            let upper = terms.split_off(at);
            let (a, b) = (fold_sorted(terms, add), fold_sorted(upper, add));
            a.zip(b).map(|(a, b)| add(a, b))
        }
        None => {
            let mut rest = terms.into_iter().map(|t| t.1);
            let first = rest.next();
            first.map(|f| rest.fold(f, |acc, v| add(acc, v)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(terms: &mut [Term<'_>]) -> Vec<f32> {
        let mut out = vec![0.0; terms[0].row.len()];
        tree_sum(terms, &mut out, &mut Vec::new());
        out
    }

    #[test]
    fn partial_sums_over_aligned_ranges_give_the_bits_of_the_whole_sum() {
        let mut order_mattered = false;
        // Values whose sum depends on the order (large and small magnitudes mixed).
        let rows: Vec<Vec<f32>> =
            (0..8).map(|e| vec![1.0e7 * (e as f32 + 1.0).sin(), 0.3 * e as f32 + 1e-3, -3.7e-4 * e as f32]).collect();
        let shared = vec![0.1f32, -2.5e6, 7.0];
        for chosen in [vec![1usize, 3, 5, 6], vec![0, 7], vec![2, 3, 4, 5, 6, 7], vec![6, 0, 3]] {
            let term = |e: usize| Term { key: expert_key(e), row: &rows[e], scale: Some(0.25 + e as f32 / 7.0) };
            let mut all: Vec<Term> = chosen.iter().map(|&e| term(e)).collect();
            all.push(Term { key: SHARED_KEY, row: &shared, scale: None });
            let whole = sum(&mut all);
            // These values do depend on the order: adding in key order gives other bits somewhere.
            all.sort_by_key(|t| t.key);
            let mut in_key_order = vec![0.0f32; 3];
            all.iter().for_each(|t| t.add_to(&mut in_key_order));
            order_mattered |= in_key_order != whole;
            for holders in [2usize, 4, 8] {
                let size = 8 / holders;
                let partials: Vec<(Range<usize>, Vec<f32>)> = (0..holders)
                    .map(|h| h * size..(h + 1) * size)
                    .filter_map(|r| {
                        let mut mine: Vec<Term> = chosen.iter().filter(|e| r.contains(e)).map(|&e| term(e)).collect();
                        if r.start == 0 {
                            mine.push(Term { key: SHARED_KEY, row: &shared, scale: None });
                        }
                        (!mine.is_empty()).then(|| (r.clone(), sum(&mut mine)))
                    })
                    .collect();
                let mut terms: Vec<Term> =
                    partials.iter().rev().map(|(r, p)| Term { key: range_key(r), row: p, scale: None }).collect();
                assert_eq!(sum(&mut terms), whole, "{chosen:?} over {holders} holders");
            }
        }
        assert!(order_mattered, "the test values must be sensitive to the order of addition");
    }

    /// The fold over whole rows adds in the order of `tree_sum`: the same bits, aligned or not.
    #[test]
    fn the_fold_adds_in_the_order_of_the_host_sum() {
        let rows: Vec<Vec<f32>> = (0..6).map(|i| vec![1.0e7 * (i as f32 + 0.5).sin(), 1e-3 * i as f32 - 0.2]).collect();
        for ranges in [vec![0..2, 2..4, 4..6, 6..8], vec![0..3, 3..6, 6..7], vec![0..1, 4..8]] {
            for skip in 0..ranges.len() {
                let keep: Vec<usize> = (0..ranges.len()).filter(|&i| i != skip || ranges.len() < 3).collect();
                let mut terms: Vec<Term> = keep
                    .iter()
                    .rev()
                    .map(|&i| Term { key: range_key(&ranges[i]), row: &rows[i], scale: None })
                    .collect();
                let host = sum(&mut terms);
                let folded =
                    tree_fold(keep.iter().map(|&i| (range_key(&ranges[i]), rows[i].clone())).collect(), &mut |a, b| {
                        a.iter().zip(&b).map(|(x, y)| x + y).collect()
                    });
                assert_eq!(folded, Some(host), "{ranges:?} without {skip}");
            }
        }
        assert_eq!(tree_fold::<f32>(Vec::new(), &mut |a, b| a + b), None);
    }

    #[test]
    fn unaligned_ranges_and_empty_sums_still_add_up() {
        let (a, b, c) = ([1.0f32, 2.0], [10.0f32, 20.0], [100.0f32, 200.0]);
        let mut terms = [
            Term { key: range_key(&(0..3)), row: &a, scale: None },
            Term { key: range_key(&(3..6)), row: &b, scale: None },
            Term { key: expert_key(6), row: &c, scale: Some(2.0) },
        ];
        assert_eq!(sum(&mut terms), vec![211.0, 422.0]);
        let mut out = vec![5.0f32; 2];
        tree_sum(&mut [], &mut out, &mut Vec::new());
        assert_eq!(out, vec![0.0, 0.0]);
    }
}
