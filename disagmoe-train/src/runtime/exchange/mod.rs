//! The one home of AF-Pipe's token exchange: which tokens of a micro-batch go to which expert
//! holder (M2N, [`DispatchPlan`]), how the holders' shares come back together at the next layer's
//! attention worker (N2M, fused with the hand-off of the residual, [`Inbox`]), and the mirrored
//! exchange of gradients ([`input_grad_messages`], [`gather_dispatch_grads`]). Every message of the
//! exchange (`Msg::Dispatch`, `Combine`, `Residual` and their gradients) is built here and nowhere
//! else; the worker computes, and hands this module host rows. A message leaving for another worker
//! is packed in the run's exchange precision there (`Msg::pack`, f32, bf16 or fp8 dispatch, see
//! `disagmoe_core::exchange`) and unpacked to f32 here when kept ([`Inbox::keep`]).
//!
//! # Notation
//! - `T`: tokens of the micro-batch; `M`: model width; `k`: experts per token
//! - holder `r` of a layer serves the contiguous expert range `E_r` (`Layout::expert_range`); the
//!   first holder also holds the shared experts and the dense MLP
//!
//! # M2N
//! A token goes **once** to each holder that has at least one of its `k` experts ([`m2n_shares`]),
//! with the gate weights and ids of all `k` choices: the holder sums the weighted outputs of its
//! own experts (skipping the others' choices). A layer with shared experts sends every token to its
//! first holder; a dense layer sends every token to its first holder and none to the others.
//!
//! # N2M
//! Each holder sends its share `[n_r, M]` (rows in the order of its tokens) to the attention
//! worker of the next layer, which adds a token's shares up and then onto the residual
//! ([`LayerInput::assemble`]).
//!
//! # Gradients
//! The mirror image: the gradient of the next layer's input goes whole to the previous attention
//! worker (the residual) and, row-selected, to each holder ([`rows_of`]); each holder returns the
//! gradients of its inputs and gate weights, which the attention worker adds up.
//!
//! # One order of addition
//! A holder adds its experts' terms, and the attention worker the holders' shares (forward and
//! backward, [`add_token_sums`]), along the tree of `disagmoe_kernels::order`, the order in which
//! one device's combine and permute backward add a token's terms: with holders on aligned
//! power-of-two expert ranges the sums have one device's bits.

use std::collections::HashMap;
use std::ops::Range;

use disagmoe_kernels::order::{range_key, tree_sum, Term};

use super::layout::Layout;
use super::msg::{AuxSums, HostTensor, LayerCoefficients, Msg, Packed};

mod plan;
pub use plan::*;

/// The tokens a holder serves at a layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Share {
    /// The holder's rank.
    pub holder: usize,
    /// Token indices within the micro-batch, ascending.
    pub tokens: Vec<u32>,
}

impl Share {
    /// The `k` chosen expert ids of each of the share's tokens, token-major.
    pub fn ids(&self, route_ids: &[usize], k: usize) -> Vec<u32> {
        self.tokens
            .iter()
            .flat_map(|&t| route_ids[t as usize * k..(t as usize + 1) * k].iter().map(|&e| e as u32))
            .collect()
    }
}

/// M2N of a routed layer: for each holder (with its expert range), the tokens with at least one
/// chosen expert in its range, each once; the first holder gets every token when it holds shared
/// experts.
pub fn m2n_shares(
    route_ids: &[usize],
    k: usize,
    tokens: usize,
    holders: &[(usize, Range<usize>)],
    first_takes_all: bool,
) -> Vec<Share> {
    holders
        .iter()
        .enumerate()
        .map(|(i, (holder, range))| {
            let all = i == 0 && first_takes_all;
            let tokens = (0..tokens)
                .filter(|&t| all || route_ids[t * k..(t + 1) * k].iter().any(|e| range.contains(e)))
                .map(|t| t as u32)
                .collect();
            Share { holder: *holder, tokens }
        })
        .collect()
}

/// M2N of a dense layer: every token to the first holder, none to the others.
pub fn dense_shares(tokens: usize, holders: &[usize]) -> Vec<Share> {
    holders
        .iter()
        .enumerate()
        .map(|(i, &holder)| Share { holder, tokens: if i == 0 { (0..tokens as u32).collect() } else { Vec::new() } })
        .collect()
}

/// The residual stream arriving at a layer (or the head) from the previous layer's attention worker.
#[derive(Debug)]
pub struct ResidualIn {
    /// `[T, M]`
    pub x: HostTensor,
    /// The balance-loss sums so far.
    pub aux: AuxSums,
}

/// One holder's share of the previous layer's expert output (N2M).
#[derive(Debug)]
pub struct Partial {
    /// The holder.
    pub holder: usize,
    /// Its place in the canonical order of a token's expert terms
    /// (`disagmoe_kernels::order::range_key` of its expert range).
    pub key: (u64, u64),
    /// Its tokens.
    pub tokens: Vec<u32>,
    /// `[n, M]` in the order of `tokens`.
    pub out: HostTensor,
}

/// What a layer's attention worker collects before it can run (or the head before the loss).
#[derive(Debug, Default)]
pub struct LayerInput {
    /// The residual stream.
    pub residual: Option<ResidualIn>,
    /// The holders' shares received so far.
    pub partials: Vec<Partial>,
}

/// An assembled layer input.
#[derive(Debug)]
pub struct Assembled {
    /// `[T, M]`: the residual plus every holder's share.
    pub h: HostTensor,
    /// The balance-loss sums so far.
    pub aux: AuxSums,
    /// Who sent which tokens (where the gradient rows go back).
    pub from: Vec<Share>,
}

impl LayerInput {
    /// N2M: the residual plus the sum of the holders' shares, added on the host token by token in
    /// the canonical order of `disagmoe_kernels::order` (whatever order they arrived in), so the
    /// layer input has the bits of one device's `h + moe(h)`.
    pub fn assemble(self) -> Assembled {
        let ResidualIn { x: mut h, aux } = self.residual.expect("an input is assembled once complete");
        let m = *h.shape.last().expect("[T, M]");
        let mut partials = self.partials;
        partials.sort_by_key(|p| p.holder);
        let rows: Vec<HolderRows> =
            partials.iter().map(|p| HolderRows { key: p.key, tokens: &p.tokens, rows: &p.out.data }).collect();
        add_token_sums(&mut h.data, m, &rows);
        let from = partials.into_iter().map(|Partial { holder, tokens, .. }| Share { holder, tokens }).collect();
        Assembled { h, aux, from }
    }
}

/// One holder's rows of a `[T, M]` sum: `rows` `[n, M]` for the ascending `tokens`.
#[derive(Debug, Clone, Copy)]
pub struct HolderRows<'a> {
    /// The holder's place in the canonical order (`disagmoe_kernels::order::range_key`).
    pub key: (u64, u64),
    /// Its tokens, ascending.
    pub tokens: &'a [u32],
    /// `[n, M]`
    pub rows: &'a [f32],
}

/// `out[t] += sum over the holders that have token t of their row`, the holders' rows of a token
/// added in the canonical order of `disagmoe_kernels::order` first (a token no holder has gets
/// `+ 0`). N2M adds the expert shares onto the residual this way; the attention worker's backward
/// adds the holders' input gradients the same way, mirroring one device's permute backward.
pub fn add_token_sums(out: &mut [f32], m: usize, holders: &[HolderRows<'_>]) {
    debug_assert!(holders.iter().all(|h| h.tokens.windows(2).all(|w| w[0] < w[1])), "tokens ascending");
    let mut cursor = vec![0usize; holders.len()];
    let (mut terms, mut scratch, mut sum) = (Vec::with_capacity(holders.len()), Vec::new(), vec![0f32; m]);
    for (t, dst) in out.chunks_mut(m.max(1)).enumerate() {
        terms.clear();
        for (h, c) in holders.iter().zip(&mut cursor) {
            if h.tokens.get(*c) == Some(&(t as u32)) {
                terms.push(Term { key: h.key, row: &h.rows[*c * m..(*c + 1) * m], scale: None });
                *c += 1;
            }
        }
        tree_sum(&mut terms, &mut sum, &mut scratch);
        dst.iter_mut().zip(&sum).for_each(|(d, s)| *d += s);
    }
}

/// The gradient of a layer's residual, from the next layer's attention worker.
#[derive(Debug)]
pub struct GradResidualIn {
    /// `[T, M]`
    pub g: HostTensor,
    /// Per routed layer, the gradient of the loss with respect to its score sums.
    pub aux_coef: Vec<LayerCoefficients>,
}

/// One holder's gradients of what it was dispatched.
#[derive(Debug)]
pub struct DispatchGrad {
    /// The holder.
    pub holder: usize,
    /// `[n, M]` gradient of the expert inputs.
    pub gy: HostTensor,
    /// `[n, k]` gradient of the gate weights (routed layers).
    pub gw: Option<HostTensor>,
}

/// What a layer's attention worker collects before its backward.
#[derive(Debug, Default)]
pub struct GradInput {
    /// The residual's gradient.
    pub residual: Option<GradResidualIn>,
    /// The holders' gradients received so far.
    pub dispatch: Vec<DispatchGrad>,
}

/// The rows `tokens` of a `[T, M]` host tensor (a holder's part of a gradient), `[n, M]`.
pub fn rows_of(g: &HostTensor, tokens: &[u32]) -> HostTensor {
    let m = *g.shape.last().expect("[.., M]");
    let mut data = Vec::with_capacity(tokens.len() * m);
    for &t in tokens {
        data.extend_from_slice(&g.data[t as usize * m..(t as usize + 1) * m]);
    }
    HostTensor { shape: vec![tokens.len(), m], data }
}

/// An empty `[0, cols]` host tensor (a holder that got no token).
pub fn empty(cols: usize) -> HostTensor {
    HostTensor { shape: vec![0, cols], data: Vec::new() }
}

/// Where holder `index` of a layer (of [`Layout::ffn_holders`]) sits in the canonical order of a
/// token's expert terms: the key of its expert range.
fn key_of(layout: &Layout, index: usize) -> (u64, u64) {
    range_key(&layout.expert_range(index))
}

/// Where `holder`'s share of `layer` sits in the canonical order of a token's expert terms.
pub fn holder_key(layout: &Layout, layer: usize, holder: usize) -> (u64, u64) {
    let index = layout.ffn_holders(layer).iter().position(|&h| h == holder).expect("a holder of the layer");
    key_of(layout, index)
}

/// The expert rows a holder was dispatched, kept until its task runs.
#[derive(Debug)]
pub struct Dispatched {
    /// Token indices within the micro-batch, ascending.
    pub tokens: Vec<u32>,
    /// `[n, M]`
    pub y: HostTensor,
    /// `[n, k]` gate weights (routed layers).
    pub weights: Option<HostTensor>,
    /// `n * k` global expert ids.
    pub ids: Vec<u32>,
}

/// What a worker has received of the token exchange and not used yet, by (micro-batch, layer).
#[derive(Debug, Default)]
pub struct Inbox {
    inputs: HashMap<(usize, usize), LayerInput>,
    grads: HashMap<(usize, usize), GradInput>,
    dispatched: HashMap<(usize, usize), Dispatched>,
    grad_combines: HashMap<(usize, usize), HostTensor>,
}

impl Inbox {
    /// Keeps an exchange message from `src` (the holders' shares with their place in the order of
    /// addition); any other message is handed back.
    pub fn keep(&mut self, layout: &Layout, src: usize, msg: Msg) -> Option<Msg> {
        match msg {
            Msg::Dispatch { mb, layer, tokens, y, weights, ids } => {
                let (y, weights) = (y.unpack(), weights.map(Packed::unpack));
                self.dispatched.insert((mb, layer), Dispatched { tokens, y, weights, ids });
            }
            Msg::GradCombine { mb, layer, g } => {
                self.grad_combines.insert((mb, layer), g.unpack());
            }
            Msg::Combine { mb, layer, tokens, out } => {
                let key = holder_key(layout, layer, src);
                let partial = Partial { holder: src, key, tokens, out: out.unpack() };
                self.inputs.entry((mb, layer + 1)).or_default().partials.push(partial);
            }
            Msg::Residual { mb, layer, x, aux } => {
                self.inputs.entry((mb, layer + 1)).or_default().residual = Some(ResidualIn { x: x.unpack(), aux });
            }
            Msg::GradResidual { mb, layer, g, aux_coef } => {
                let g = g.unpack();
                self.grads.entry((mb, layer)).or_default().residual = Some(GradResidualIn { g, aux_coef });
            }
            Msg::GradDispatch { mb, layer, gy, gw } => {
                let (gy, gw) = (gy.unpack(), gw.map(Packed::unpack));
                self.grads.entry((mb, layer)).or_default().dispatch.push(DispatchGrad { holder: src, gy, gw });
            }
            other => return Some(other),
        }
        None
    }

    /// The input of `layer` (or the head when `layer == layers`) of micro-batch `mb`, assembled
    /// (N2M); its task is ready, so every part of it is here.
    pub fn assemble(&mut self, mb: usize, layer: usize) -> Assembled {
        self.inputs.remove(&(mb, layer)).expect("a ready task's input").assemble()
    }

    /// The gradients of `layer`'s output of micro-batch `mb` at its attention worker.
    pub fn grads(&mut self, mb: usize, layer: usize) -> GradInput {
        self.grads.remove(&(mb, layer)).expect("a ready task's gradients")
    }

    /// The rows dispatched to this holder for (`mb`, `layer`).
    pub fn dispatched(&mut self, mb: usize, layer: usize) -> Dispatched {
        self.dispatched.remove(&(mb, layer)).expect("a ready task's dispatch")
    }

    /// The gradient of this holder's share of (`mb`, `layer`).
    pub fn grad_combine(&mut self, mb: usize, layer: usize) -> HostTensor {
        self.grad_combines.remove(&(mb, layer)).expect("a ready task's gradient")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_token_goes_once_to_each_holder_of_one_of_its_experts() {
        // 3 tokens, k = 2, experts 0..4 over two holders (0..2 on rank 5, 2..4 on rank 6).
        let ids = [0, 1, 1, 3, 2, 3];
        let shares = m2n_shares(&ids, 2, 3, &[(5, 0..2), (6, 2..4)], false);
        assert_eq!(shares[0], Share { holder: 5, tokens: vec![0, 1] });
        assert_eq!(shares[1], Share { holder: 6, tokens: vec![1, 2] });
        assert_eq!(shares[1].ids(&ids, 2), vec![1, 3, 2, 3]);
        let with_shared = m2n_shares(&ids, 2, 3, &[(5, 0..2), (6, 2..4)], true);
        assert_eq!(with_shared[0].tokens, vec![0, 1, 2]);
        assert_eq!(
            dense_shares(2, &[5, 6]),
            vec![Share { holder: 5, tokens: vec![0, 1] }, Share { holder: 6, tokens: vec![] }]
        );
    }

    #[test]
    fn shares_add_onto_the_residual_and_gradients_split_back_by_rows() {
        let x = HostTensor { shape: vec![3, 2], data: vec![1.0; 6] };
        let mut input = LayerInput { residual: Some(ResidualIn { x, aux: AuxSums::default() }), partials: Vec::new() };
        input.partials.push(Partial {
            holder: 5,
            key: range_key(&(0..2)),
            tokens: vec![0, 2],
            out: HostTensor { shape: vec![2, 2], data: vec![1.0, 2.0, 3.0, 4.0] },
        });
        input.partials.push(Partial {
            holder: 6,
            key: range_key(&(2..4)),
            tokens: vec![2],
            out: HostTensor { shape: vec![1, 2], data: vec![10.0, 20.0] },
        });
        let a = input.assemble();
        assert_eq!(a.h.data, vec![2.0, 3.0, 1.0, 1.0, 14.0, 25.0]);
        assert_eq!(rows_of(&a.h, &a.from[1].tokens).data, vec![14.0, 25.0]);
    }

    /// Two holders of 4 experts (0..2 on rank 2, 2..4 on rank 3) behind attention workers 0 and 1.
    pub(super) fn two_holders(shared: bool) -> Layout {
        let mut layout = Layout::disagg(1, 4, 2, 2, 2, 1).unwrap();
        layout.shared_experts = vec![shared];
        layout
    }

    #[test]
    fn the_inbox_keeps_shares_in_the_order_of_addition_and_gradients_gather_back() {
        let layout = two_holders(false);
        let mut inbox = Inbox::default();
        // Holder 3's share arrives first; the sum is the same as in holder order.
        let share = |tokens: Vec<u32>, v: f32| {
            let n = tokens.len();
            combine(0, 0, tokens, HostTensor { shape: vec![n, 2], data: vec![v; n * 2] })
        };
        assert!(inbox.keep(&layout, 3, share(vec![1], 10.0)).is_none());
        assert!(inbox.keep(&layout, 2, share(vec![0, 1], 1.0)).is_none());
        let x = HostTensor { shape: vec![2, 2], data: vec![0.5; 4] };
        assert!(inbox.keep(&layout, 0, residual(0, 0, x, AuxSums::default())).is_none());
        assert!(inbox.keep(&layout, 0, Msg::Shutdown).is_some(), "not the exchange's");
        let a = inbox.assemble(0, 1);
        assert_eq!(a.h.data, vec![1.5, 1.5, 11.5, 11.5]);
        assert_eq!(a.from.iter().map(|s| s.holder).collect::<Vec<_>>(), [2, 3]);
        // The mirror: each holder its rows of the gradient, the whole to the previous worker.
        let gh = HostTensor { shape: vec![1, 2, 2], data: vec![1.0, 2.0, 3.0, 4.0] };
        let msgs = input_grad_messages(0, 1, gh, &a.from, 0, Vec::new());
        let got: Vec<_> = msgs
            .iter()
            .map(|(dst, m)| match m {
                Msg::GradCombine { layer: 0, g, .. } | Msg::GradResidual { layer: 0, g, .. } => {
                    (*dst, g.clone().unpack().data)
                }
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(got, [(2, vec![1.0, 2.0, 3.0, 4.0]), (3, vec![3.0, 4.0]), (0, vec![1.0, 2.0, 3.0, 4.0])]);
        // The holders' input gradients come back in any order and add up token by token.
        let sent = vec![
            SentDispatch { holder: 2, key: range_key(&(0..2)), tokens: vec![0, 1] },
            SentDispatch { holder: 3, key: range_key(&(2..4)), tokens: vec![] },
        ];
        let grads = vec![
            DispatchGrad { holder: 3, gy: empty(2), gw: Some(empty(2)) },
            DispatchGrad {
                holder: 2,
                gy: HostTensor { shape: vec![2, 2], data: vec![1.0, 2.0, 3.0, 4.0] },
                gw: Some(HostTensor { shape: vec![2, 2], data: vec![9.0; 4] }),
            },
        ];
        let (g, gates) = gather_dispatch_grads(&sent, grads, 2, 2);
        assert_eq!(g.data, vec![1.0, 2.0, 3.0, 4.0]);
        assert_eq!(gates.len(), 1, "no gate gradient of a holder without tokens");
        assert_eq!((gates[0].tokens, gates[0].gw.data.len()), (&[0u32, 1][..], 4));
    }
}
