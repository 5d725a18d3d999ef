//! The AF-Pipe schedule: attention and expert groups as separate pipeline stages with
//! communication as a stage of its own.
//!
//! Layer `l` runs its attention on A-worker `A[l mod p]` and its experts on F-worker `F[l mod p]`.
//! A micro-batch visits `A0 -> M2N -> F0 -> N2M -> A1 -> ... -> F[p-1] -> N2M -> A0 -> ...` for
//! all layers, then the head (on the A-worker after the last layer), then the same ring backwards
//! carrying gradients. Every worker has three concurrent streams, forward compute, backward
//! compute and communication, all dynamic: whatever is ready runs (backward first), so an
//! F-worker sends gradients while it computes the forward of the next micro-batch. At most
//! [`afpipe_window`] micro-batches are in flight (their activations must fit in memory).

use super::{OpId, OpKind, Schedule, ScheduleBuilder, StreamKind as K, Transfer, WorkerRole, NO_LAYER};
use crate::allocator::Allocation;
use crate::cost::CostModel;
use crate::error::{CoreError, Result};

/// Micro-batches in flight and whether activations are recomputed: as many as memory allows,
/// up to `16 p` (the ring has `4 p` stages per direction and a micro-batch's round trip is long
/// under load) and the micro-batches of the step. Full recomputation is switched on when it lets
/// at least 25% more micro-batches fly (its extra forward is cheap when the ring is
/// network-bound).
pub fn afpipe_window(cost: &CostModel, alloc: &Allocation) -> (usize, bool) {
    let usable = cost.cluster.gpu.usable_memory();
    let p = alloc.groups;
    let cap = cost.workload.micro_batches().min(16 * p).max(1);
    let fits = |w: usize, rc: bool| {
        cost.attention_memory(p, alloc.attention_gpus_per_group, w, rc) <= usable
            && cost.ffn_memory(p, alloc.ffn_gpus_per_group, w, rc) <= usable
    };
    let largest = |rc: bool| (1..=cap).rev().find(|&w| fits(w, rc)).unwrap_or(1);
    let plain = largest(false);
    if plain >= cap.min(4 * p) {
        (plain, false)
    } else {
        let with = largest(true);
        if with as f64 >= 1.25 * plain as f64 {
            (with, true)
        } else {
            (plain, false)
        }
    }
}

/// Builds the AF-Pipe schedule of one training step for `alloc`.
pub fn build_afpipe(cost: &CostModel, alloc: &Allocation) -> Result<Schedule> {
    let p = alloc.groups;
    let m = &cost.model;
    if p == 0 || p > m.layers {
        return Err(CoreError::InvalidField {
            field: "allocation.groups".into(),
            value: p.to_string(),
            allowed: format!("1..={} (the layer count)", m.layers),
        });
    }
    let (a, f) = (alloc.attention_gpus_per_group, alloc.ffn_gpus_per_group);
    let mut b = ScheduleBuilder::new("afpipe");
    let streams = [
        (K::BackwardCompute, false),
        (K::ForwardCompute, false),
        (K::Comm, false),
        (K::GradComm, false),
        (K::Recv, false),
    ];
    for g in 0..p {
        let bw = cost.group_bandwidth(a, alloc.attention_nics_per_group);
        b.worker(format!("A{g}"), WorkerRole::Attention { group: g }, a, alloc.attention_nics_per_group, bw, &streams);
        let bw = cost.group_bandwidth(f, alloc.ffn_nics_per_group);
        b.worker(format!("F{g}"), WorkerRole::Ffn { group: g }, f, alloc.ffn_nics_per_group, bw, &streams);
    }
    let aw = |l: usize| 2 * (l % p);
    let fw = |l: usize| 2 * (l % p) + 1;
    let attn: Vec<_> = (0..m.layers).map(|l| cost.attention_forward(l, a)).collect();
    let ffn: Vec<_> = (0..m.layers).map(|l| cost.ffn_forward(l, f)).collect();
    let bytes: Vec<f64> = (0..m.layers).map(|l| cost.m2n_bytes(l, f)).collect();
    let head = cost.head_forward(a);
    let (window, recompute) = afpipe_window(cost, alloc);
    // Backward work: gradients (twice the forward) plus the recomputed forward.
    let bwd = |w: crate::cost::Work| {
        let g = w.backward();
        if recompute {
            crate::cost::Work { flops: g.flops + w.flops, hbm_bytes: g.hbm_bytes + w.hbm_bytes }
        } else {
            g
        }
    };
    let mbs = cost.workload.micro_batches();
    let mut first_backward: Vec<OpId> = Vec::with_capacity(mbs);
    let mut attn_backward: Vec<Vec<OpId>> = vec![Vec::new(); p];

    for mb in 0..mbs {
        let mut prev: Vec<OpId> = if mb >= window { vec![first_backward[mb - window]] } else { vec![] };
        let mut ffn_fwd = Vec::with_capacity(m.layers);
        for l in 0..m.layers {
            let lu = l as u32;
            let af = b.op(
                aw(l),
                K::ForwardCompute,
                OpKind::AttentionForward,
                mb,
                lu,
                0,
                prev,
                cost.gpu_time(attn[l]),
                attn[l].flops,
                0.0,
            );
            let r = b.transfer(cost, aw(l), fw(l), Transfer::M2n, false, mb, lu, vec![af], bytes[l]);
            let ff = b.op(
                fw(l),
                K::ForwardCompute,
                OpKind::ExpertForward,
                mb,
                lu,
                0,
                vec![r],
                cost.gpu_time(ffn[l]),
                ffn[l].flops,
                0.0,
            );
            ffn_fwd.push(ff);
            prev = vec![b.transfer(cost, fw(l), aw(l + 1), Transfer::N2m, false, mb, lu, vec![ff], bytes[l])];
        }
        let hw = aw(m.layers);
        let hf = b.op(
            hw,
            K::ForwardCompute,
            OpKind::HeadForward,
            mb,
            NO_LAYER,
            0,
            prev,
            cost.gpu_time(head),
            head.flops,
            0.0,
        );
        let hb_work = head.backward();
        let mut grad = b.op(
            hw,
            K::BackwardCompute,
            OpKind::HeadBackward,
            mb,
            NO_LAYER,
            0,
            vec![hf],
            cost.gpu_time(hb_work),
            hb_work.flops,
            0.0,
        );
        for l in (0..m.layers).rev() {
            let lu = l as u32;
            let r = b.transfer(cost, aw(l + 1), fw(l), Transfer::N2m, true, mb, lu, vec![grad], bytes[l]);
            let w = bwd(ffn[l]);
            let fb = b.op(
                fw(l),
                K::BackwardCompute,
                OpKind::ExpertBackward,
                mb,
                lu,
                0,
                vec![r, ffn_fwd[l]],
                cost.gpu_time(w),
                w.flops,
                0.0,
            );
            let r = b.transfer(cost, fw(l), aw(l), Transfer::M2n, true, mb, lu, vec![fb], bytes[l]);
            let w = bwd(attn[l]);
            grad = b.op(
                aw(l),
                K::BackwardCompute,
                OpKind::AttentionBackward,
                mb,
                lu,
                0,
                vec![r],
                cost.gpu_time(w),
                w.flops,
                0.0,
            );
            attn_backward[l % p].push(grad);
        }
        first_backward.push(grad);
    }
    // Gradient all-reduce of each attention group (its ranks replicate the dense parameters);
    // expert groups all-reduce only their replicated shared experts / dense MLPs.
    for (g, deps) in attn_backward.into_iter().enumerate() {
        let bytes = cost.attention_grad_bytes(p);
        let secs = cost.all_reduce_time(bytes, a, alloc.attention_nics_per_group);
        b.op(2 * g, K::Comm, OpKind::AllReduce, 0, NO_LAYER, 0, deps, secs, 0.0, bytes);
        let replicated = cost.ffn_group_params(g, p, f).1 * cost.precision.grad_comm_bytes;
        if replicated > 0.0 && f > 1 {
            let deps: Vec<OpId> = b.schedule.workers[2 * g + 1].streams[0].ops.clone();
            let secs = cost.all_reduce_time(replicated, f, alloc.ffn_nics_per_group);
            b.op(2 * g + 1, K::Comm, OpKind::AllReduce, 0, NO_LAYER, 0, deps, secs, 0.0, replicated);
        }
    }
    b.finish()
}
