//! Steps 2 and 4 of the layer: the expert-sorted order of the routed copies ([`Dispatch`]) and
//! the gate-weighted combine back into token order.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

/// Where each group starts when groups of `counts` rows are laid out one after another.
pub fn exclusive_prefix_sum(counts: &[usize]) -> Vec<usize> {
    counts
        .iter()
        .scan(0, |acc, &c| {
            let start = *acc;
            *acc += c;
            Some(start)
        })
        .collect()
}

/// Step 2 and 4: the expert-sorted order of the `N = T * k` routed copies.
#[derive(Debug, Clone)]
pub struct Dispatch {
    /// Rows per expert, `[E]`.
    pub counts: Vec<usize>,
    /// For each sorted position, the token-major slot `t * k + j` it came from, `[N]`.
    pub slots: Vec<usize>,
    /// Experts per token.
    pub top_k: usize,
    /// The expert of each token-major slot `t * k + j`, `[T k]` (the router's choices; a copy not
    /// in `slots` is another holder's or dropped).
    pub experts: Vec<usize>,
}

impl Dispatch {
    /// A stable counting sort of the routed copies by expert id.
    pub fn new(ids: &[usize], num_experts: usize, top_k: usize) -> Self {
        Self::for_experts(ids, 0..num_experts, top_k)
    }

    /// The same sort of only the copies routed to `experts` (a holder's shard): `counts` has one
    /// entry per expert of the range, `slots` lists only those copies. Permute and combine work on
    /// such a subset unchanged; the other holders' shares add up to the layer's output.
    pub fn for_experts(ids: &[usize], experts: std::ops::Range<usize>, top_k: usize) -> Self {
        let mut counts = vec![0usize; experts.len()];
        for &e in ids.iter().filter(|e| experts.contains(e)) {
            counts[e - experts.start] += 1;
        }
        let mut next = exclusive_prefix_sum(&counts);
        let mut slots = vec![0usize; counts.iter().sum()];
        for (slot, &e) in ids.iter().enumerate().filter(|(_, e)| experts.contains(e)) {
            slots[next[e - experts.start]] = slot;
            next[e - experts.start] += 1;
        }
        Self { counts, slots, top_k, experts: ids.to_vec() }
    }

    /// The same sort of only the copies routed to the experts `held` (global ids, ascending; a
    /// holder of any set of experts): `counts` has one entry per held expert, in that order.
    pub fn for_expert_set(ids: &[usize], held: &[usize], top_k: usize) -> Self {
        debug_assert!(held.windows(2).all(|w| w[0] < w[1]), "held experts ascending");
        if let (Some(&first), Some(&last)) = (held.first(), held.last()) {
            if last + 1 - first == held.len() {
                return Self::for_experts(ids, first..last + 1, top_k);
            }
        }
        let local = |e: &usize| held.binary_search(e).ok();
        let mut counts = vec![0usize; held.len()];
        for i in ids.iter().filter_map(local) {
            counts[i] += 1;
        }
        let mut next = exclusive_prefix_sum(&counts);
        let mut slots = vec![0usize; counts.iter().sum()];
        for (slot, i) in ids.iter().enumerate().filter_map(|(s, e)| local(e).map(|i| (s, i))) {
            slots[next[i]] = slot;
            next[i] += 1;
        }
        Self { counts, slots, top_k, experts: ids.to_vec() }
    }

    /// Routed copies sorted here (`N`).
    pub fn rows(&self) -> usize {
        self.slots.len()
    }

    /// Gathers each token once per chosen expert, in expert order (the fused operation or kernel
    /// where `disagmoe_kernels::fused` has one, else its reference); with `shared`, also `x` for
    /// the shared experts, through the same operation so that the fused backward adds a token's
    /// gradients (its copies' and the shared experts') in the canonical order of
    /// `disagmoe_kernels::order`.
    ///
    /// # Shapes
    /// - x: `[T, M]` -> `[N, M]` and, with `shared`, `[T, M]`
    pub fn permute<B: Backend>(&self, x: Tensor<B, 2>, shared: bool) -> (Tensor<B, 2>, Option<Tensor<B, 2>>) {
        let n = self.rows();
        match disagmoe_kernels::fused::permute_rows(x.clone(), &self.slots, self.top_k, &self.experts, shared) {
            Some(out) if shared => {
                let t = out.dims()[0] - n;
                (out.clone().narrow(0, 0, n), Some(out.narrow(0, n, t)))
            }
            Some(out) => (out, None),
            None => {
                (disagmoe_kernels::reference::permute_rows(x.clone(), &self.slots, self.top_k), shared.then_some(x))
            }
        }
    }

    /// Weights each expert output by its gate and adds a token's outputs (and its row of `base`,
    /// the shared experts' output) back in token order. The fused CPU operation adds them in the
    /// canonical order of `disagmoe_kernels::order`, so one holder's share of a layer and the
    /// attention worker's sum of the shares give the bits of one device's combine.
    ///
    /// # Shapes
    /// - ys: `[N, M]` (expert order); weights: `[T, k]`; base: `[T, M]`; output: `[T, M]`
    pub fn combine<B: Backend>(
        &self,
        ys: Tensor<B, 2>,
        weights: Tensor<B, 2>,
        base: Option<Tensor<B, 2>>,
    ) -> Tensor<B, 2> {
        disagmoe_kernels::fused::combine_rows(ys.clone(), weights.clone(), &self.slots, &self.experts, base.clone())
            .unwrap_or_else(|| {
                let out = disagmoe_kernels::reference::combine_rows(ys, weights, &self.slots);
                match base {
                    Some(base) => out + base,
                    None => out,
                }
            })
    }
}
