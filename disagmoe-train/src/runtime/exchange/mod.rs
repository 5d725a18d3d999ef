//! The one home of AF-Pipe's token exchange: which tokens of a micro-batch go to which expert
//! holder (M2N, [`DispatchPlan`]), how the holders' shares come back together at the next layer's
//! attention worker (N2M, fused with the hand-off of the residual, [`Inbox`]), and the mirrored
//! exchange of gradients ([`input_grad_messages`], [`gather_dispatch_grads`]). Every message of the
//! exchange (`Msg::Dispatch`, `Combine`, `Residual` and their gradients) is built here and nowhere
//! else; the worker computes, and hands this module its payloads ([`Packed`]): host rows, or
//! tensors left on the device that computed them ([`DeviceTensor`], between workers of one process
//! on one device), on which the rows of a share are taken and the holders' shares added up on that
//! device, in the same order of addition as on the host. A message leaving for another worker is
//! packed in the run's exchange precision there (`Msg::pack`, f32, bf16 or fp8 dispatch, see
//! `disagmoe_core::exchange`) and unpacked to f32 here when kept ([`Inbox::keep`]).
//!
//! # Notation
//! - `T`: tokens of the micro-batch; `M`: model width; `k`: experts per token
//! - holder `r` of a layer holds the experts `E_r`: the contiguous range `Layout::expert_range`, or
//!   its slots of an explicit placement (`Layout::set_expert_map`: a balanced placement in which
//!   hot experts have replicas on several holders); the first holder also holds the shared experts
//!   and the dense MLP
//!
//! # M2N
//! Each routed copy (token, choice) is computed by one holder of its expert: the only one, or for
//! a replicated expert the replica [`assign_copies`] picks so that the holders' copies of the
//! micro-batch are as even as they can be. A token goes **once** to each holder that computes at
//! least one of its `k` copies ([`m2n_shares`]), with the gate weights of all `k` choices and the
//! ids of its own (the others' are [`NOT_HERE`]): the holder sums the weighted outputs of its
//! copies. A layer with shared experts sends every token to its
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
//! power-of-two expert ranges the sums have one device's bits. Under an explicit placement a
//! share's rows each carry the span of the keys they add ([`Keys::PerToken`], from
//! [`share_spans`]), so each token's shares sit where one device's tree has their terms. On a
//! device the tokens held by the same holders, added along the same shape of tree, are added as a
//! group ([`add_shares`]): the same tree, on rows, so the same bits as the host's token-by-token
//! sums.

use disagmoe_kernels::order::{range_key, tree_fold, tree_sum, Term};
use std::collections::{BTreeMap, HashMap};

use super::layout::Layout;
use super::msg::{AuxSums, DeviceTensor, HostTensor, LayerCoefficients, Msg, Packed};

mod assign;
mod plan;
pub use assign::*;
pub use plan::*;

/// The expert id of a dispatched copy that its holder does not compute (dropped, or another
/// holder's): no expert's id.
pub const NOT_HERE: u32 = u32::MAX;

/// The tokens a holder serves at a layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Share {
    /// The holder's rank.
    pub holder: usize,
    /// Token indices within the micro-batch, ascending.
    pub tokens: Vec<u32>,
}

impl Share {
    /// The `k` chosen expert ids of each of the share's tokens, token-major, as the holder of index
    /// `index` reads them: the copies another holder computes (another holder's expert, another
    /// replica of a replicated one) or that were dropped are [`NOT_HERE`].
    pub fn ids(&self, route_ids: &[usize], owner: &[Option<usize>], index: usize, k: usize) -> Vec<u32> {
        self.tokens
            .iter()
            .flat_map(|&t| {
                (t as usize * k..(t as usize + 1) * k).map(|s| {
                    if owner[s] == Some(index) {
                        route_ids[s] as u32
                    } else {
                        NOT_HERE
                    }
                })
            })
            .collect()
    }
}

/// M2N of a routed layer: for each holder (ranks `holders`), the tokens with at least one routed
/// copy it computes (`owner[t k + j]`: the index in `holders` of the holder of copy `j` of token
/// `t`, `None` when dropped), each once; the first holder gets every token when it holds shared
/// experts.
pub fn m2n_shares(
    owner: &[Option<usize>],
    k: usize,
    tokens: usize,
    holders: &[usize],
    first_takes_all: bool,
) -> Vec<Share> {
    let mut lists: Vec<Vec<u32>> = vec![Vec::new(); holders.len()];
    for t in 0..tokens as u32 {
        if first_takes_all {
            lists[0].push(t);
        }
        for &h in owner[t as usize * k..(t as usize + 1) * k].iter().flatten() {
            if lists[h].last() != Some(&t) {
                lists[h].push(t);
            }
        }
    }
    holders.iter().zip(lists).map(|(&holder, tokens)| Share { holder, tokens }).collect()
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
    pub x: Packed,
    /// The balance-loss sums so far.
    pub aux: AuxSums,
}

/// Where a share's rows sit in the canonical order of a token's expert terms: one key for every
/// row (`disagmoe_kernels::order::range_key` of the holder's expert range), or one per row (the
/// span of the terms the row adds up, under an explicit placement).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Keys {
    /// Every row's.
    Holder((u64, u64)),
    /// Row by row.
    PerToken(Vec<(u64, u64)>),
}

impl Keys {
    /// The key of row `i`.
    pub fn at(&self, i: usize) -> (u64, u64) {
        match self {
            Keys::Holder(k) => *k,
            Keys::PerToken(k) => k[i],
        }
    }

    /// The keys of a share from its message's spans (`2 n` values, lowest and highest key of each
    /// row), or the holder's key when there are none.
    pub fn from_spans(spans: &[u32], holder: (u64, u64)) -> Self {
        if spans.is_empty() {
            return Keys::Holder(holder);
        }
        Keys::PerToken(spans.chunks_exact(2).map(|c| (u64::from(c[0]), u64::from(c[1]))).collect())
    }
}

/// One holder's share of the previous layer's expert output (N2M).
#[derive(Debug)]
pub struct Partial {
    /// The holder.
    pub holder: usize,
    /// Its rows' places in the canonical order of a token's expert terms.
    pub key: Keys,
    /// Its tokens.
    pub tokens: Vec<u32>,
    /// `[n, M]` in the order of `tokens`.
    pub out: Packed,
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
    pub h: Packed,
    /// The balance-loss sums so far.
    pub aux: AuxSums,
    /// Who sent which tokens (where the gradient rows go back).
    pub from: Vec<Share>,
}

impl LayerInput {
    /// N2M: the residual plus the sum of the holders' shares, added token by token in the
    /// canonical order of `disagmoe_kernels::order` (whatever order they arrived in), so the layer
    /// input has the bits of one device's `h + moe(h)`; on the device when the payloads are there
    /// ([`add_shares`]).
    pub fn assemble(self) -> Assembled {
        let ResidualIn { x, aux } = self.residual.expect("an input is assembled once complete");
        let [t, m] = [x.rows(), *x.shape().last().expect("[T, M]")];
        let mut partials = self.partials;
        partials.sort_by_key(|p| p.holder);
        let shares: Vec<Shares> =
            partials.iter().map(|p| Shares { key: &p.key, tokens: &p.tokens, rows: &p.out }).collect();
        let h = add_shares(Some(x), [t, m], &shares);
        let from = partials.into_iter().map(|Partial { holder, tokens, .. }| Share { holder, tokens }).collect();
        Assembled { h, aux, from }
    }
}

/// One holder's rows of a `[T, M]` sum: `rows` `[n, M]` for the ascending `tokens`.
#[derive(Debug, Clone, Copy)]
pub struct HolderRows<'a> {
    /// The rows' places in the canonical order (`disagmoe_kernels::order::range_key`).
    pub key: &'a Keys,
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
                terms.push(Term { key: h.key.at(*c), row: &h.rows[*c * m..(*c + 1) * m], scale: None });
                *c += 1;
            }
        }
        tree_sum(&mut terms, &mut sum, &mut scratch);
        dst.iter_mut().zip(&sum).for_each(|(d, s)| *d += s);
    }
}

/// One holder's payload rows of a `[T, M]` sum: `rows` `[n, M]` for the ascending `tokens`.
#[derive(Debug, Clone, Copy)]
pub struct Shares<'a> {
    /// The rows' places in the canonical order (`disagmoe_kernels::order::range_key`).
    pub key: &'a Keys,
    /// Its tokens, ascending.
    pub tokens: &'a [u32],
    /// `[n, M]`, f32 on the host or on a device.
    pub rows: &'a Packed,
}

/// `out` (zeros when `None`) plus, for each token, the sum of the holders' rows of it in the
/// canonical order ([`add_token_sums`]), `[T, M]` = `shape`. On the host when every payload is
/// there; on the device when one is (host rows joining it are uploaded): the tokens that the same
/// holders have, added along the same shape of tree, form a group, whose rows are taken from each
/// holder and added along that tree ([`tree_fold`]), and the group's sums added onto its rows of
/// `out`, so every value gets the same additions as on the host.
pub fn add_shares(out: Option<Packed>, shape: [usize; 2], holders: &[Shares<'_>]) -> Packed {
    let on_device = |p: &Packed| match p {
        Packed::Device(d) => Some(d.clone()),
        _ => None,
    };
    let device = out
        .as_ref()
        .and_then(on_device)
        .or_else(|| holders.iter().filter(|h| !h.tokens.is_empty()).find_map(|h| on_device(h.rows)));
    let [t, m] = shape;
    let Some(like) = device else {
        let mut out =
            out.map(Packed::unpack).unwrap_or_else(|| HostTensor { shape: vec![t, m], data: vec![0.0; t * m] });
        let rows: Vec<HolderRows> = holders
            .iter()
            .filter(|h| !h.tokens.is_empty())
            .map(|h| HolderRows { key: h.key, tokens: h.tokens, rows: host_values(h.rows) })
            .collect();
        add_token_sums(&mut out.data, m, &rows);
        return Packed::F32(out);
    };
    let mut out = match out {
        Some(p) => device_of(&p, &like),
        None => like.rows.zeros([t, m]),
    };
    // The holders of each token and its row in each, grouped by the holders and the shape of the
    // tree that adds their rows (one shape per holder set when every row of a holder has its key;
    // per-token keys can give a holder set several): a group's members add alike, so the group
    // folds with its first token's keys.
    struct Group {
        keys: Vec<(u64, u64)>,
        tokens: Vec<u32>,
        rows: Vec<Vec<u32>>,
    }
    let mut groups: BTreeMap<(Vec<usize>, Vec<u32>), Group> = BTreeMap::new();
    let mut cursor = vec![0u32; holders.len()];
    let mut present = Vec::with_capacity(holders.len());
    for token in 0..t as u32 {
        present.clear();
        for (i, (h, c)) in holders.iter().zip(&mut cursor).enumerate() {
            if h.tokens.get(*c as usize) == Some(&token) {
                present.push((i, *c));
                *c += 1;
            }
        }
        let keys: Vec<(u64, u64)> = present.iter().map(|&(i, c)| holders[i].key.at(c as usize)).collect();
        let leaves = present.iter().zip(&keys).map(|(&(i, _), &k)| (k, vec![i as u32])).collect();
        let shape = tree_fold(leaves, &mut |mut a: Vec<u32>, b: Vec<u32>| {
            a.extend(b);
            a.push(u32::MAX);
            a
        })
        .unwrap_or_default();
        let members: Vec<usize> = present.iter().map(|p| p.0).collect();
        let group = groups.entry((members, shape)).or_insert_with(|| Group {
            keys,
            tokens: Vec::new(),
            rows: vec![Vec::new(); present.len()],
        });
        group.tokens.push(token);
        group.rows.iter_mut().zip(&present).for_each(|(rows, p)| rows.push(p.1));
    }
    for ((members, _), Group { keys, tokens, rows }) in groups {
        let terms: Vec<((u64, u64), DeviceTensor)> = members
            .iter()
            .zip(&rows)
            .zip(keys)
            .map(|((&i, positions), key)| {
                let all = device_of(holders[i].rows, &like);
                // Ascending positions as many as the rows are all of them.
                let mine = if positions.len() == all.shape[0] { all } else { all.rows.select(positions) };
                (key, mine)
            })
            .collect();
        let sum = tree_fold(terms, &mut |a: DeviceTensor, b: DeviceTensor| a.rows.add(&b))
            .unwrap_or_else(|| like.rows.zeros([tokens.len(), m]));
        out = if tokens.len() == t { out.rows.add(&sum) } else { out.rows.add_rows(&tokens, &sum) };
    }
    Packed::Device(out)
}

/// A payload's f32 values on the host (the inbox has unpacked every one).
fn host_values(p: &Packed) -> &[f32] {
    match p {
        Packed::F32(t) => &t.data,
        other => unreachable!("a payload on the host is unpacked before it is added: {:?}", other.shape()),
    }
}

/// A payload on `like`'s device (host rows uploaded).
fn device_of(p: &Packed, like: &DeviceTensor) -> DeviceTensor {
    match p {
        Packed::Device(d) => d.clone(),
        Packed::F32(h) => like.rows.upload(h),
        other => like.rows.upload(&other.clone().unpack()),
    }
}

/// The gradient of a layer's residual, from the next layer's attention worker.
#[derive(Debug)]
pub struct GradResidualIn {
    /// `[T, M]`
    pub g: Packed,
    /// Per routed layer, the gradient of the loss with respect to its score sums.
    pub aux_coef: Vec<LayerCoefficients>,
}

/// One holder's gradients of what it was dispatched.
#[derive(Debug)]
pub struct DispatchGrad {
    /// The holder.
    pub holder: usize,
    /// `[n, M]` gradient of the expert inputs.
    pub gy: Packed,
    /// `[n, k]` gradient of the gate weights (routed layers).
    pub gw: Option<Packed>,
}

/// What a layer's attention worker collects before its backward.
#[derive(Debug, Default)]
pub struct GradInput {
    /// The residual's gradient.
    pub residual: Option<GradResidualIn>,
    /// The holders' gradients received so far.
    pub dispatch: Vec<DispatchGrad>,
}

/// The rows `tokens` (ascending) of a `[T, M]` payload (a holder's part of a gradient), `[n, M]`,
/// where it is; all of them are the payload itself.
pub fn rows_of(g: &Packed, tokens: &[u32]) -> Packed {
    let m = *g.shape().last().expect("[.., M]");
    match g {
        Packed::Device(d) if tokens.len() == d.shape[0] => Packed::Device(d.clone()),
        Packed::Device(_) if tokens.is_empty() => Packed::F32(empty(m)),
        Packed::Device(d) => Packed::Device(d.rows.select(tokens)),
        g => {
            let g = host_values(g);
            let mut data = Vec::with_capacity(tokens.len() * m);
            for &t in tokens {
                data.extend_from_slice(&g[t as usize * m..(t as usize + 1) * m]);
            }
            Packed::F32(HostTensor { shape: vec![tokens.len(), m], data })
        }
    }
}

/// An empty `[0, cols]` host tensor (a holder that got no token).
pub fn empty(cols: usize) -> HostTensor {
    HostTensor { shape: vec![0, cols], data: Vec::new() }
}

/// Where holder `index` of `layer` (of [`Layout::ffn_holders`]) sits in the canonical order of a
/// token's expert terms: the key of its expert range (of the span of the experts it holds, when
/// they are not contiguous: such spans overlap, and the tree adds them one after another).
fn key_of(layout: &Layout, layer: usize, index: usize) -> (u64, u64) {
    let held = layout.held_experts(layer, index);
    let (Some(&first), Some(&last)) = (held.first(), held.last()) else {
        return range_key(&layout.expert_range(index));
    };
    // The first holder's share also holds the shared experts (key 0, beside expert 0).
    let shared = index == 0 && layout.shared_experts.get(layer).copied().unwrap_or(false);
    range_key(&(if shared { 0 } else { first }..last + 1))
}

/// The lowest and highest key of the terms each token of a share adds up, `2 n` values (see
/// `Msg::Combine`): its copies computed there (`ids`, `k` per token, [`NOT_HERE`] for the others')
/// and the shared experts (key 0) when `shared`. Empty when the layer has no explicit placement
/// (the holder's range key places every row).
pub fn share_spans(layout: &Layout, layer: usize, ids: &[u32], k: usize, shared: bool) -> Vec<u32> {
    if layout.expert_maps.get(layer).is_none_or(Option::is_none) || k == 0 {
        return Vec::new();
    }
    let mut spans = Vec::with_capacity(2 * ids.len() / k);
    for row in ids.chunks(k) {
        let keys = row.iter().filter(|&&e| e != NOT_HERE).map(|&e| 2 * e + 1);
        let (lo, hi) = keys.fold((u32::MAX, 0), |(lo, hi), key| (lo.min(key), hi.max(key)));
        let lo = if shared { 0 } else { lo.min(hi) };
        spans.extend([lo, hi]);
    }
    spans
}

/// Where `holder`'s share of `layer` sits in the canonical order of a token's expert terms.
pub fn holder_key(layout: &Layout, layer: usize, holder: usize) -> (u64, u64) {
    let index = layout.ffn_holders(layer).iter().position(|&h| h == holder).expect("a holder of the layer");
    key_of(layout, layer, index)
}

/// The expert rows a holder was dispatched, kept until its task runs.
#[derive(Debug)]
pub struct Dispatched {
    /// Token indices within the micro-batch, ascending.
    pub tokens: Vec<u32>,
    /// `[n, M]`
    pub y: Packed,
    /// `[n, k]` gate weights (routed layers).
    pub weights: Option<Packed>,
    /// `n * k` global expert ids.
    pub ids: Vec<u32>,
}

/// What a worker has received of the token exchange and not used yet, by (micro-batch, layer).
#[derive(Debug, Default)]
pub struct Inbox {
    inputs: HashMap<(usize, usize), LayerInput>,
    grads: HashMap<(usize, usize), GradInput>,
    dispatched: HashMap<(usize, usize), Dispatched>,
    grad_combines: HashMap<(usize, usize), Packed>,
    /// Context parallelism: per (receiving unit, layer), the ring's blocks of keys and values by
    /// sending unit.
    ring_blocks: HashMap<(usize, usize), Vec<(usize, Packed)>>,
    /// Context parallelism: per (owning unit, layer), the gradients of its block by the unit whose
    /// attention computed them.
    ring_grads: HashMap<(usize, usize), Vec<(usize, Packed)>>,
}

/// The ring's messages `map` holds for (unit, layer) `key`, taken out, by the other unit,
/// ascending (the order the ring adds them in).
fn by_unit(map: &mut HashMap<(usize, usize), Vec<(usize, Packed)>>, key: (usize, usize)) -> Vec<(usize, Packed)> {
    let mut got = map.remove(&key).unwrap_or_default();
    got.sort_by_key(|(u, _)| *u);
    got
}

impl Inbox {
    /// Keeps an exchange message from `src` (the holders' shares with their place in the order of
    /// addition); any other message is handed back.
    pub fn keep(&mut self, layout: &Layout, src: usize, msg: Msg) -> Option<Msg> {
        match msg {
            Msg::Dispatch { mb, layer, tokens, y, weights, ids } => {
                let (y, weights) = (y.unpacked(), weights.map(Packed::unpacked));
                self.dispatched.insert((mb, layer), Dispatched { tokens, y, weights, ids });
            }
            Msg::GradCombine { mb, layer, g } => {
                self.grad_combines.insert((mb, layer), g.unpacked());
            }
            Msg::Combine { mb, layer, tokens, spans, out } => {
                let key = Keys::from_spans(&spans, holder_key(layout, layer, src));
                let partial = Partial { holder: src, key, tokens, out: out.unpacked() };
                self.inputs.entry((mb, layer + 1)).or_default().partials.push(partial);
            }
            Msg::Residual { mb, layer, x, aux } => {
                self.inputs.entry((mb, layer + 1)).or_default().residual = Some(ResidualIn { x: x.unpacked(), aux });
            }
            Msg::GradResidual { mb, layer, g, aux_coef } => {
                let g = g.unpacked();
                self.grads.entry((mb, layer)).or_default().residual = Some(GradResidualIn { g, aux_coef });
            }
            Msg::GradDispatch { mb, layer, gy, gw } => {
                let (gy, gw) = (gy.unpacked(), gw.map(Packed::unpacked));
                self.grads.entry((mb, layer)).or_default().dispatch.push(DispatchGrad { holder: src, gy, gw });
            }
            Msg::Kv { mb, layer, to, kv } => {
                self.ring_blocks.entry((to, layer)).or_default().push((mb, kv.unpacked()));
            }
            Msg::GradKv { mb, layer, from, g } => {
                self.ring_grads.entry((mb, layer)).or_default().push((from, g.unpacked()));
            }
            other => return Some(other),
        }
        None
    }

    /// Unit `from`'s block of keys and values of `layer` for unit `unit`'s attention (context
    /// parallelism); its task is ready, so it is here.
    pub fn ring_block(&mut self, unit: usize, layer: usize, from: usize) -> Packed {
        let blocks = self.ring_blocks.get_mut(&(unit, layer)).expect("a ready task's block");
        let at = blocks.iter().position(|(u, _)| *u == from).expect("a ready task's block");
        let (_, block) = blocks.swap_remove(at);
        if blocks.is_empty() {
            self.ring_blocks.remove(&(unit, layer));
        }
        block
    }

    /// The gradients of unit `unit`'s block of keys and values of `layer` from the other units of
    /// its ring, by unit, ascending (the order they are added in).
    pub fn ring_grads(&mut self, unit: usize, layer: usize) -> Vec<(usize, Packed)> {
        by_unit(&mut self.ring_grads, (unit, layer))
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
    pub fn grad_combine(&mut self, mb: usize, layer: usize) -> Packed {
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
        let owner: Vec<Option<usize>> = ids.iter().map(|&e| Some(e / 2)).collect();
        let shares = m2n_shares(&owner, 2, 3, &[5, 6], false);
        assert_eq!(shares[0], Share { holder: 5, tokens: vec![0, 1] });
        assert_eq!(shares[1], Share { holder: 6, tokens: vec![1, 2] });
        // Holder 6 reads its own copies' experts; token 1's first copy is holder 5's.
        assert_eq!(shares[1].ids(&ids, &owner, 1, 2), vec![NOT_HERE, 3, 2, 3]);
        let with_shared = m2n_shares(&owner, 2, 3, &[5, 6], true);
        assert_eq!(with_shared[0].tokens, vec![0, 1, 2]);
        assert_eq!(
            dense_shares(2, &[5, 6]),
            vec![Share { holder: 5, tokens: vec![0, 1] }, Share { holder: 6, tokens: vec![] }]
        );
    }

    #[test]
    fn shares_add_onto_the_residual_and_gradients_split_back_by_rows() {
        let x = HostTensor { shape: vec![3, 2], data: vec![1.0; 6] };
        let mut input =
            LayerInput { residual: Some(ResidualIn { x: x.into(), aux: AuxSums::default() }), partials: Vec::new() };
        input.partials.push(Partial {
            holder: 5,
            key: Keys::Holder(range_key(&(0..2))),
            tokens: vec![0, 2],
            out: HostTensor { shape: vec![2, 2], data: vec![1.0, 2.0, 3.0, 4.0] }.into(),
        });
        input.partials.push(Partial {
            holder: 6,
            key: Keys::Holder(range_key(&(2..4))),
            tokens: vec![2],
            out: HostTensor { shape: vec![1, 2], data: vec![10.0, 20.0] }.into(),
        });
        let a = input.assemble();
        assert_eq!(a.h.clone().unpack().data, vec![2.0, 3.0, 1.0, 1.0, 14.0, 25.0]);
        assert_eq!(rows_of(&a.h, &a.from[1].tokens).unpack().data, vec![14.0, 25.0]);
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
            combine(0, 0, tokens, Vec::new(), HostTensor { shape: vec![n, 2], data: vec![v; n * 2] }.into())
        };
        assert!(inbox.keep(&layout, 3, share(vec![1], 10.0)).is_none());
        assert!(inbox.keep(&layout, 2, share(vec![0, 1], 1.0)).is_none());
        let x = HostTensor { shape: vec![2, 2], data: vec![0.5; 4] };
        assert!(inbox.keep(&layout, 0, residual(0, 0, x.into(), AuxSums::default())).is_none());
        assert!(inbox.keep(&layout, 0, Msg::Shutdown).is_some(), "not the exchange's");
        let a = inbox.assemble(0, 1);
        assert_eq!(a.h.clone().unpack().data, vec![1.5, 1.5, 11.5, 11.5]);
        assert_eq!(a.from.iter().map(|s| s.holder).collect::<Vec<_>>(), [2, 3]);
        // The mirror: each holder its rows of the gradient, the whole to the previous worker.
        let gh = HostTensor { shape: vec![2, 2], data: vec![1.0, 2.0, 3.0, 4.0] };
        let msgs = input_grad_messages(0, 1, gh.into(), &a.from, 0, Vec::new());
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
            SentDispatch { holder: 2, key: Keys::Holder(range_key(&(0..2))), tokens: vec![0, 1] },
            SentDispatch { holder: 3, key: Keys::Holder(range_key(&(2..4))), tokens: vec![] },
        ];
        let grads = vec![
            DispatchGrad { holder: 3, gy: empty(2).into(), gw: Some(empty(2).into()) },
            DispatchGrad {
                holder: 2,
                gy: HostTensor { shape: vec![2, 2], data: vec![1.0, 2.0, 3.0, 4.0] }.into(),
                gw: Some(HostTensor { shape: vec![2, 2], data: vec![9.0; 4] }.into()),
            },
        ];
        let (g, gates) = gather_dispatch_grads(&sent, grads, 2, 2);
        assert_eq!(g.unpack().data, vec![1.0, 2.0, 3.0, 4.0]);
        assert_eq!(gates.len(), 1, "no gate gradient of a holder without tokens");
        assert_eq!((gates[0].tokens, gates[0].gw.shape()), (&[0u32, 1][..], &[2usize, 2][..]));
    }

    /// On a device, the holders' shares add up group by group to the host's token-by-token bits:
    /// aligned and unaligned expert ranges, the shared experts' holder taking every token, holders
    /// without tokens, and tokens no holder has.
    #[test]
    fn shares_add_up_on_a_device_to_the_hosts_bits() {
        let (t, m) = (12usize, 3usize);
        // Values whose sums depend on the order of addition.
        let value = |h: usize, i: usize| 1.0e7 * ((h * 31 + i) as f32 * 0.71).sin() + 1e-3 * i as f32;
        let residual = HostTensor { shape: vec![t, m], data: (0..t * m).map(|i| (i as f32 * 0.3).cos()).collect() };
        let mut order_mattered = false;
        for ranges in [vec![0..2, 2..4, 4..6, 6..8], vec![0..3, 3..6, 6..8], vec![0..4, 4..8]] {
            for pattern in 0..4u32 {
                // Which holder has which token: a mix, the first holder taking all, one empty.
                let has = |h: usize, tok: usize| match pattern {
                    0 => (tok * 7 + h * 3) % 5 < 2,
                    1 => h == 0 || (tok + h) % 3 == 0,
                    2 => h != 1 && (tok * h) % 4 != 1,
                    _ => tok % 2 == 0 && h < 2,
                };
                let tokens: Vec<Vec<u32>> = (0..ranges.len())
                    .map(|h| (0..t).filter(|&tok| has(h, tok)).map(|tok| tok as u32).collect())
                    .collect();
                let rows: Vec<HostTensor> = tokens
                    .iter()
                    .enumerate()
                    .map(|(h, toks)| HostTensor {
                        shape: vec![toks.len(), m],
                        data: (0..toks.len() * m).map(|i| value(h, i)).collect(),
                    })
                    .collect();
                let host: Vec<Packed> = rows.iter().cloned().map(Packed::F32).collect();
                // On the device, except the empty shares (they travel as host tensors).
                let mem = crate::runtime::msg::mem_device::mem;
                let device: Vec<Packed> = rows
                    .iter()
                    .map(|r| if r.shape[0] == 0 { Packed::F32(r.clone()) } else { Packed::Device(mem(r.clone())) })
                    .collect();
                fn with<'a>(payloads: &'a [Packed], tokens: &'a [Vec<u32>], keys: &'a [Keys]) -> Vec<Shares<'a>> {
                    payloads
                        .iter()
                        .enumerate()
                        .map(|(h, p)| Shares { key: &keys[h], tokens: &tokens[h], rows: p })
                        .collect()
                }
                // Range keys, and per-token keys (the spans of an explicit placement) where
                // tokens of one holder sit at different places.
                let keys: Vec<Keys> = if pattern % 2 == 0 {
                    ranges.iter().map(|r| Keys::Holder(range_key(r))).collect()
                } else {
                    (0..ranges.len())
                        .map(|h| {
                            let r = &ranges[h];
                            let spans = tokens[h].iter().map(|&tok| {
                                let e = r.start + tok as usize % r.len();
                                (2 * e as u64 + 1, 2 * (r.end as u64 - 1) + 1)
                            });
                            Keys::PerToken(spans.collect())
                        })
                        .collect()
                };
                let shares = |payloads| with(payloads, &tokens, &keys);
                let want = add_shares(Some(Packed::F32(residual.clone())), [t, m], &shares(&host)).unpack();
                let got = add_shares(Some(Packed::Device(mem(residual.clone()))), [t, m], &shares(&device));
                assert!(matches!(got, Packed::Device(_)), "the sum stays on the device");
                let got = got.unpack();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got.data), bits(&want.data), "{ranges:?}, pattern {pattern}");
                // Zeros plus the shares (a gradient's sum), the residual on the host.
                let want = add_shares(None, [t, m], &shares(&host)).unpack();
                let got = add_shares(None, [t, m], &shares(&device)).unpack();
                assert_eq!(bits(&got.data), bits(&want.data), "{ranges:?}, pattern {pattern}, from zeros");
                // A share's rows of the sum, on the device as on the host.
                let sum = add_shares(None, [t, m], &shares(&device));
                assert_eq!(
                    rows_of(&sum, &tokens[0]).unpack(),
                    rows_of(&Packed::F32(want.clone()), &tokens[0]).unpack()
                );
                let mut naive = residual.clone();
                for (h, toks) in tokens.iter().enumerate() {
                    for (i, &tok) in toks.iter().enumerate() {
                        for j in 0..m {
                            naive.data[tok as usize * m + j] += rows[h].data[i * m + j];
                        }
                    }
                }
                let want = add_shares(Some(Packed::F32(residual.clone())), [t, m], &shares(&host)).unpack();
                order_mattered |= naive.data != want.data;
            }
        }
        assert!(order_mattered, "the test values must be sensitive to the order of addition");
    }
}
