//! The one home of AF-Pipe's token exchange: which tokens of a micro-batch go to which expert
//! holder (M2N, [`DispatchPlan`]), how the holders' shares come back together at the next layer's
//! attention worker (N2M, fused with the hand-off of the residual, [`Inbox`]), and the mirrored
//! exchange of gradients ([`input_grad_messages`], [`gather_dispatch_grads`]). Every message of the
//! exchange (`Msg::Dispatch`, `Combine`, `Residual` and their gradients) is built here and nowhere
//! else; the worker computes, and hands this module host rows.
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
use super::msg::{AuxSums, HostTensor, LayerCoefficients, Msg};

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

/// One holder's dispatch of a layer, as planned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedShare {
    /// The holder's rank.
    pub holder: usize,
    /// Its place in the canonical order of a token's expert terms.
    pub key: (u64, u64),
    /// The tokens it serves, ascending.
    pub tokens: Vec<u32>,
    /// The `k` chosen expert ids of each of its tokens, token-major (empty for a dense layer).
    pub ids: Vec<u32>,
}

/// M2N of one micro-batch at one layer: a share per holder of the layer, in holder order (see the
/// module doc).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DispatchPlan {
    /// Micro-batch.
    pub mb: usize,
    /// Layer.
    pub layer: usize,
    /// Model width `M`.
    pub width: usize,
    /// Experts per token of a routed layer (`None`: dense, no gate weights travel).
    pub k: Option<usize>,
    /// The shares.
    pub shares: Vec<PlannedShare>,
}

/// What an attention worker keeps of a dispatch it sent, for the mirrored gradient.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SentDispatch {
    /// The holder.
    pub holder: usize,
    /// The holder's place in the canonical order of a token's expert terms.
    pub key: (u64, u64),
    /// The tokens sent to it, ascending.
    pub tokens: Vec<u32>,
}

impl DispatchPlan {
    /// A routed layer: `kept_ids` are the `k` experts of each of the `tokens` tokens (a copy dropped
    /// for capacity is no expert); each token once to each holder of one of its experts, every
    /// token to the first holder when the layer has shared experts.
    pub fn routed(
        mb: usize,
        layer: usize,
        layout: &Layout,
        kept_ids: &[usize],
        k: usize,
        tokens: usize,
        width: usize,
    ) -> Self {
        let holders = layout.ffn_holders(layer);
        let ranges: Vec<_> = holders.iter().enumerate().map(|(i, &h)| (h, layout.expert_range(i))).collect();
        let first_takes_all = layout.shared_experts.get(layer).copied().unwrap_or(false);
        let shares = m2n_shares(kept_ids, k, tokens, &ranges, first_takes_all)
            .into_iter()
            .enumerate()
            .map(|(i, share)| PlannedShare {
                holder: share.holder,
                key: key_of(layout, i),
                ids: share.ids(kept_ids, k),
                tokens: share.tokens,
            })
            .collect();
        Self { mb, layer, width, k: Some(k), shares }
    }

    /// A dense layer: every token to the first holder, none to the others.
    pub fn dense(mb: usize, layer: usize, layout: &Layout, tokens: usize, width: usize) -> Self {
        let shares = dense_shares(tokens, &layout.ffn_holders(layer))
            .into_iter()
            .enumerate()
            .map(|(i, Share { holder, tokens })| PlannedShare {
                holder,
                key: key_of(layout, i),
                tokens,
                ids: Vec::new(),
            })
            .collect();
        Self { mb, layer, width, k: None, shares }
    }

    /// The dispatches, in holder order: `rows(tokens)` gives a non-empty share's expert inputs
    /// `[n, M]` and (routed) gate weights `[n, k]`; an empty share travels as empty tensors.
    pub fn messages(&self, mut rows: impl FnMut(&[u32]) -> (HostTensor, Option<HostTensor>)) -> Vec<(usize, Msg)> {
        let (mb, layer) = (self.mb, self.layer);
        self.shares
            .iter()
            .map(|s| {
                let (y, weights) = match s.tokens.is_empty() {
                    true => (empty(self.width), self.k.map(empty)),
                    false => rows(&s.tokens),
                };
                let (tokens, ids) = (s.tokens.clone(), s.ids.clone());
                (s.holder, Msg::Dispatch { mb, layer, tokens, y, weights, ids })
            })
            .collect()
    }

    /// What the attention worker keeps for the backward.
    pub fn into_sent(self) -> Vec<SentDispatch> {
        self.shares.into_iter().map(|s| SentDispatch { holder: s.holder, key: s.key, tokens: s.tokens }).collect()
    }
}

/// The residual stream of micro-batch `mb` out of `layer`, with the balance-loss sums so far.
pub fn residual(mb: usize, layer: usize, x: HostTensor, aux: AuxSums) -> Msg {
    Msg::Residual { mb, layer, x, aux }
}

/// A holder's share `[n, M]` of `layer`'s output for its `tokens` (N2M).
pub fn combine(mb: usize, layer: usize, tokens: Vec<u32>, out: HostTensor) -> Msg {
    Msg::Combine { mb, layer, tokens, out }
}

/// A holder's gradients of its dispatch of `layer`: of the expert inputs `[n, M]` and (routed) of
/// the gate weights `[n, k]`.
pub fn grad_dispatch(mb: usize, layer: usize, gy: HostTensor, gw: Option<HostTensor>) -> Msg {
    Msg::GradDispatch { mb, layer, gy, gw }
}

/// The gradient of `layer`'s input `gh` sent back (the mirror of N2M): each holder of
/// `layer - 1` its rows (`from`, who sent which tokens), then all of it to the previous attention
/// worker `prev` (the residual), with the balance-loss coefficients.
pub fn input_grad_messages(
    mb: usize,
    layer: usize,
    gh: HostTensor,
    from: &[Share],
    prev: usize,
    aux_coef: Vec<LayerCoefficients>,
) -> Vec<(usize, Msg)> {
    let mut msgs: Vec<(usize, Msg)> = from
        .iter()
        .map(|share| (share.holder, Msg::GradCombine { mb, layer: layer - 1, g: rows_of(&gh, &share.tokens) }))
        .collect();
    let m = *gh.shape.last().expect("[B, S, M]");
    let g = HostTensor { shape: vec![gh.data.len() / m, m], data: gh.data };
    msgs.push((prev, Msg::GradResidual { mb, layer: layer - 1, g, aux_coef }));
    msgs
}

/// A holder's gate-weight gradients `[n, k]` for its (non-empty) tokens.
#[derive(Debug)]
pub struct GateGrad<'a> {
    /// The tokens, ascending.
    pub tokens: &'a [u32],
    /// `[n, k]`
    pub gw: HostTensor,
}

/// The attention worker's side of the holders' gradients of `T x M` dispatched rows: the gradient
/// of the normed output (the holders' input gradients added token by token in the canonical
/// order, as one device's permute backward adds a token's copies), and each holder's gate-weight
/// gradients, in holder order.
pub fn gather_dispatch_grads<'a>(
    sent: &'a [SentDispatch],
    mut grads: Vec<DispatchGrad>,
    t: usize,
    m: usize,
) -> (HostTensor, Vec<GateGrad<'a>>) {
    grads.sort_by_key(|d| d.holder);
    let sent_to = |holder: usize| sent.iter().find(|s| s.holder == holder).expect("a dispatch per holder");
    let mut g_normed = HostTensor { shape: vec![t, m], data: vec![0.0; t * m] };
    let rows: Vec<HolderRows> = grads
        .iter()
        .map(|d| {
            let s = sent_to(d.holder);
            HolderRows { key: s.key, tokens: &s.tokens, rows: &d.gy.data }
        })
        .collect();
    add_token_sums(&mut g_normed.data, m, &rows);
    let gates = grads
        .into_iter()
        .filter_map(|DispatchGrad { holder, gw, .. }| {
            let tokens = &sent_to(holder).tokens;
            gw.filter(|_| !tokens.is_empty()).map(|gw| GateGrad { tokens, gw })
        })
        .collect();
    (g_normed, gates)
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
                self.dispatched.insert((mb, layer), Dispatched { tokens, y, weights, ids });
            }
            Msg::GradCombine { mb, layer, g } => {
                self.grad_combines.insert((mb, layer), g);
            }
            Msg::Combine { mb, layer, tokens, out } => {
                let key = holder_key(layout, layer, src);
                let partial = Partial { holder: src, key, tokens, out };
                self.inputs.entry((mb, layer + 1)).or_default().partials.push(partial);
            }
            Msg::Residual { mb, layer, x, aux } => {
                self.inputs.entry((mb, layer + 1)).or_default().residual = Some(ResidualIn { x, aux });
            }
            Msg::GradResidual { mb, layer, g, aux_coef } => {
                self.grads.entry((mb, layer)).or_default().residual = Some(GradResidualIn { g, aux_coef });
            }
            Msg::GradDispatch { mb, layer, gy, gw } => {
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
    fn two_holders(shared: bool) -> Layout {
        let mut layout = Layout::disagg(1, 4, 2, 2, 2, 1).unwrap();
        layout.shared_experts = vec![shared];
        layout
    }

    #[test]
    fn a_routed_plan_sends_each_token_once_per_holder_with_all_its_choices() {
        let layout = two_holders(false);
        // 3 tokens, k = 2: token 0 -> {0, 1}, token 1 -> {1, 3}, token 2 -> {2, 3}.
        let plan = DispatchPlan::routed(1, 0, &layout, &[0, 1, 1, 3, 2, 3], 2, 3, 5);
        assert_eq!(
            plan.shares.iter().map(|s| (s.holder, s.tokens.clone())).collect::<Vec<_>>(),
            [(2, vec![0, 1]), (3, vec![1, 2])]
        );
        assert_eq!(plan.shares[1].ids, vec![1, 3, 2, 3]);
        assert_eq!((plan.shares[0].key, plan.shares[1].key), (range_key(&(0..2)), range_key(&(2..4))));
        let mut asked = Vec::new();
        let msgs = plan.messages(|tokens| {
            asked.push(tokens.to_vec());
            let n = tokens.len();
            (
                HostTensor { shape: vec![n, 5], data: vec![1.0; n * 5] },
                Some(HostTensor { shape: vec![n, 2], data: vec![0.5; n * 2] }),
            )
        });
        assert_eq!(asked, [vec![0, 1], vec![1, 2]]);
        for (dst, msg) in &msgs {
            msg.check().unwrap();
            let Msg::Dispatch { mb: 1, layer: 0, tokens, ids, .. } = msg else { panic!("{msg:?}") };
            assert_eq!((tokens.len() * 2, *dst == 2 || *dst == 3), (ids.len(), true));
        }
        // With shared experts the first holder takes every token; a holder with no token gets
        // empty tensors (and is not asked for rows).
        let plan = DispatchPlan::routed(0, 0, &two_holders(true), &[0, 1, 1, 0], 2, 2, 5);
        assert_eq!(plan.shares[0].tokens, vec![0, 1]);
        assert!(plan.shares[1].tokens.is_empty());
        let msgs = plan.messages(|tokens| {
            assert_eq!(tokens, [0, 1]);
            (
                HostTensor { shape: vec![2, 5], data: vec![0.0; 10] },
                Some(HostTensor { shape: vec![2, 2], data: vec![0.0; 4] }),
            )
        });
        let Msg::Dispatch { y, weights: Some(w), .. } = &msgs[1].1 else { panic!() };
        assert_eq!((y.shape.clone(), w.shape.clone()), (vec![0, 5], vec![0, 2]));
        let sent = plan.into_sent();
        assert_eq!((sent[0].holder, sent[1].tokens.len()), (2, 0));
    }

    #[test]
    fn a_dense_plan_sends_every_token_to_the_first_holder_without_gate_weights() {
        let plan = DispatchPlan::dense(0, 0, &two_holders(false), 3, 4);
        let msgs = plan.messages(|tokens| (HostTensor { shape: vec![tokens.len(), 4], data: vec![0.0; 12] }, None));
        let kinds: Vec<_> = msgs
            .iter()
            .map(|(dst, m)| match m {
                Msg::Dispatch { tokens, weights: None, ids, .. } if ids.is_empty() => (*dst, tokens.len()),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(kinds, [(2, 3), (3, 0)]);
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
                Msg::GradCombine { layer: 0, g, .. } | Msg::GradResidual { layer: 0, g, .. } => (*dst, g.data.clone()),
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
