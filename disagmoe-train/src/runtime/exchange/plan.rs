//! M2N planned and packed ([`DispatchPlan`]), the other exchange messages built, and the mirrored
//! gradient exchange ([`input_grad_messages`], [`gather_dispatch_grads`]).

use super::{
    add_shares, assign_copies, dense_shares, empty, key_of, m2n_shares, rows_of, share_spans, DispatchGrad, Keys,
    Share, Shares,
};
use crate::runtime::layout::Layout;
use crate::runtime::msg::{AuxSums, LayerCoefficients, Msg, Packed};

/// One holder's dispatch of a layer, as planned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedShare {
    /// The holder's rank.
    pub holder: usize,
    /// Its rows' places in the canonical order of a token's expert terms.
    pub key: Keys,
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
    /// Routed copies each holder computes, in holder order (empty for a dense layer).
    pub copies: Vec<usize>,
}

/// What an attention worker keeps of a dispatch it sent, for the mirrored gradient.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SentDispatch {
    /// The holder.
    pub holder: usize,
    /// The holder's rows' places in the canonical order of a token's expert terms.
    pub key: Keys,
    /// The tokens sent to it, ascending.
    pub tokens: Vec<u32>,
}

impl DispatchPlan {
    /// A routed layer: `kept_ids` are the `k` experts of each of the `tokens` tokens (a copy dropped
    /// for capacity is no expert); each copy to the holder [`assign_copies`] picks, each token once
    /// to each holder of one of its copies, every token to the first holder when the layer has
    /// shared experts.
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
        let owner = assign_copies(layout, layer, &kept_ids[..tokens * k]);
        let mut copies = vec![0usize; holders.len()];
        owner.iter().flatten().for_each(|&h| copies[h] += 1);
        let first_takes_all = layout.shared_experts.get(layer).copied().unwrap_or(false);
        let shares = m2n_shares(&owner, k, tokens, &holders, first_takes_all)
            .into_iter()
            .enumerate()
            .map(|(i, share)| {
                let ids = share.ids(kept_ids, &owner, i, k);
                let spans = share_spans(layout, layer, &ids, k, i == 0 && first_takes_all);
                let key = Keys::from_spans(&spans, key_of(layout, layer, i));
                PlannedShare { holder: share.holder, key, ids, tokens: share.tokens }
            })
            .collect();
        Self { mb, layer, width, k: Some(k), shares, copies }
    }

    /// A dense layer: every token to the first holder, none to the others.
    pub fn dense(mb: usize, layer: usize, layout: &Layout, tokens: usize, width: usize) -> Self {
        let shares = dense_shares(tokens, &layout.ffn_holders(layer))
            .into_iter()
            .enumerate()
            .map(|(i, Share { holder, tokens })| PlannedShare {
                holder,
                key: Keys::Holder(key_of(layout, layer, i)),
                tokens,
                ids: Vec::new(),
            })
            .collect();
        Self { mb, layer, width, k: None, shares, copies: Vec::new() }
    }

    /// The dispatches, in holder order, and what the attention worker keeps of them for the
    /// backward: `rows(tokens)` gives a non-empty share's expert inputs `[n, M]` and (routed) gate
    /// weights `[n, k]` (on the host or on the device); an empty share travels as empty host
    /// tensors.
    pub fn into_messages(
        self,
        mut rows: impl FnMut(&[u32]) -> (Packed, Option<Packed>),
    ) -> (Vec<(usize, Msg)>, Vec<SentDispatch>) {
        let (mb, layer) = (self.mb, self.layer);
        self.shares
            .into_iter()
            .map(|PlannedShare { holder, key, tokens, ids }| {
                let (y, weights) = match tokens.is_empty() {
                    true => (empty(self.width).into(), self.k.map(|k| empty(k).into())),
                    false => rows(&tokens),
                };
                let msg = Msg::Dispatch { mb, layer, tokens: tokens.clone(), y, weights, ids };
                ((holder, msg), SentDispatch { holder, key, tokens })
            })
            .unzip()
    }
}

/// The residual stream of micro-batch `mb` out of `layer`, with the balance-loss sums so far.
pub fn residual(mb: usize, layer: usize, x: Packed, aux: AuxSums) -> Msg {
    Msg::Residual { mb, layer, x, aux }
}

/// A holder's share `[n, M]` of `layer`'s output for its `tokens` (N2M), with the key spans of
/// its rows under an explicit placement ([`share_spans`]; empty otherwise).
pub fn combine(mb: usize, layer: usize, tokens: Vec<u32>, spans: Vec<u32>, out: Packed) -> Msg {
    Msg::Combine { mb, layer, tokens, spans, out }
}

/// A holder's gradients of its dispatch of `layer`: of the expert inputs `[n, M]` and (routed) of
/// the gate weights `[n, k]`.
pub fn grad_dispatch(mb: usize, layer: usize, gy: Packed, gw: Option<Packed>) -> Msg {
    Msg::GradDispatch { mb, layer, gy, gw }
}

/// The gradient of `layer`'s input `gh` (`[T, M]`) sent back (the mirror of N2M): each holder of
/// `layer - 1` its rows (`from`, who sent which tokens), then all of it to the previous attention
/// worker `prev` (the residual), with the balance-loss coefficients.
pub fn input_grad_messages(
    mb: usize,
    layer: usize,
    gh: Packed,
    from: &[Share],
    prev: usize,
    aux_coef: Vec<LayerCoefficients>,
) -> Vec<(usize, Msg)> {
    let mut msgs: Vec<(usize, Msg)> = from
        .iter()
        .map(|share| (share.holder, Msg::GradCombine { mb, layer: layer - 1, g: rows_of(&gh, &share.tokens) }))
        .collect();
    msgs.push((prev, Msg::GradResidual { mb, layer: layer - 1, g: gh, aux_coef }));
    msgs
}

/// A holder's gate-weight gradients `[n, k]` for its (non-empty) tokens.
#[derive(Debug)]
pub struct GateGrad<'a> {
    /// The tokens, ascending.
    pub tokens: &'a [u32],
    /// `[n, k]`
    pub gw: Packed,
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
) -> (Packed, Vec<GateGrad<'a>>) {
    grads.sort_by_key(|d| d.holder);
    let sent_to = |holder: usize| sent.iter().find(|s| s.holder == holder).expect("a dispatch per holder");
    let shares: Vec<Shares> = grads
        .iter()
        .map(|d| {
            let s = sent_to(d.holder);
            Shares { key: &s.key, tokens: &s.tokens, rows: &d.gy }
        })
        .collect();
    let g_normed = add_shares(None, [t, m], &shares);
    let gates = grads
        .into_iter()
        .filter_map(|DispatchGrad { holder, gw, .. }| {
            let tokens = &sent_to(holder).tokens;
            gw.filter(|_| !tokens.is_empty()).map(|gw| GateGrad { tokens, gw })
        })
        .collect();
    (g_normed, gates)
}

#[cfg(test)]
mod tests {
    use super::super::tests::two_holders;
    use super::*;
    use crate::runtime::msg::HostTensor;
    use disagmoe_kernels::order::range_key;

    #[test]
    fn a_routed_plan_sends_each_token_once_per_holder_with_all_its_choices() {
        let layout = two_holders(false);
        // 3 tokens, k = 2: token 0 -> {0, 1}, token 1 -> {1, 3}, token 2 -> {2, 3}.
        let plan = DispatchPlan::routed(1, 0, &layout, &[0, 1, 1, 3, 2, 3], 2, 3, 5);
        assert_eq!(
            plan.shares.iter().map(|s| (s.holder, s.tokens.clone())).collect::<Vec<_>>(),
            [(2, vec![0, 1]), (3, vec![1, 2])]
        );
        assert_eq!(plan.shares[1].ids, vec![super::super::NOT_HERE, 3, 2, 3]);
        assert_eq!(
            (&plan.shares[0].key, &plan.shares[1].key),
            (&Keys::Holder(range_key(&(0..2))), &Keys::Holder(range_key(&(2..4))))
        );
        let mut asked = Vec::new();
        let (msgs, _) = plan.into_messages(|tokens| {
            asked.push(tokens.to_vec());
            let n = tokens.len();
            (
                HostTensor { shape: vec![n, 5], data: vec![1.0; n * 5] }.into(),
                Some(HostTensor { shape: vec![n, 2], data: vec![0.5; n * 2] }.into()),
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
        let (msgs, sent) = plan.into_messages(|tokens| {
            assert_eq!(tokens, [0, 1]);
            (
                HostTensor { shape: vec![2, 5], data: vec![0.0; 10] }.into(),
                Some(HostTensor { shape: vec![2, 2], data: vec![0.0; 4] }.into()),
            )
        });
        let Msg::Dispatch { y, weights: Some(w), .. } = &msgs[1].1 else { panic!() };
        assert_eq!((y.shape(), w.shape()), (&[0, 5][..], &[0, 2][..]));
        assert_eq!((sent[0].holder, sent[1].tokens.len()), (2, 0));
    }

    #[test]
    fn a_dense_plan_sends_every_token_to_the_first_holder_without_gate_weights() {
        let plan = DispatchPlan::dense(0, 0, &two_holders(false), 3, 4);
        let (msgs, _) = plan
            .into_messages(|tokens| (HostTensor { shape: vec![tokens.len(), 4], data: vec![0.0; 12] }.into(), None));
        let kinds: Vec<_> = msgs
            .iter()
            .map(|(dst, m)| match m {
                Msg::Dispatch { tokens, weights: None, ids, .. } if ids.is_empty() => (*dst, tokens.len()),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(kinds, [(2, 3), (3, 0)]);
    }
}
