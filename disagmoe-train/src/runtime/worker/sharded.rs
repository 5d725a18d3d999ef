//! The distributed optimizer (`--distributed-optimizer`, Megatron-Core's): the parameters a group
//! of workers holds in copies (an attention group's data-parallel copies; `ep`'s attention and
//! ends) are updated in shards.
//!
//! Their gradients are flattened into one vector (the ends, then the attention stages, in visiting
//! order; zeros where a copy has none) and reduce-scattered over the copies: each copy ends with
//! its shard of the sum (the reducer's [`crate::runtime::collectives::AllReduce::shard`]: the
//! ring's piece, MPI's and NCCL's block) and holds AdamW's moments for that shard only. It updates
//! the weights of its shard with the optimizer's own update (elementwise: a part of a tensor gets
//! the bits the whole would), and the updated weights are all-gathered, so that every copy holds
//! the same weights again. Which parameters had a gradient travels in a small all-reduce with the
//! routers' expert counts. The global gradient norm adds each copy's shard once.
//!
//! Under `--precision bf16` the parameters' f32 master weights are sharded the same way: each copy
//! updates its shard of the masters and the all-gather casts them to the bf16 working copy; a
//! checkpoint gathers the masters whole too.
//!
//! A checkpoint gathers the moments whole (the files are laid out as without sharding, so they
//! resume under any placement or number of copies); a resume slices each copy's shard out of the
//! whole moments it read.

use std::collections::HashMap;
use std::ops::Range;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};

use disagmoe_models::TrainModule;

use super::WorkerPart;
use crate::optim::{AdamW, Moment};

/// Visits the parameters the copies share: the ends, then the attention stages.
fn visit_shared<AB, A, R, X, V>(part: &WorkerPart<AB, A, R, X>, v: &mut V)
where
    AB: AutodiffBackend,
    A: TrainModule<AB>,
    R: TrainModule<AB>,
    X: TrainModule<AB>,
    V: ModuleVisitor<AB>,
{
    part.ends.visit(v);
    part.attention.visit(v);
}

/// Flattens the gradients of the parameters the copies share (taking them out of `grads`) into
/// `(values, presence flags)`: the values in visiting order, zeros where this copy has none, and a
/// flag per parameter. The vector the copies reduce, with the distributed optimizer or without
/// (then reduce-scattered and all-gathered: the same sums in the same order, see
/// `Worker::reduce_copies`). `capacity`: the values' length, when known.
pub(super) fn flatten_shared<AB, A, R, X>(
    grads: &mut GradientsParams,
    part: &WorkerPart<AB, A, R, X>,
    capacity: usize,
) -> (Vec<f32>, Vec<f32>)
where
    AB: AutodiffBackend,
    A: TrainModule<AB>,
    R: TrainModule<AB>,
    X: TrainModule<AB>,
{
    struct Take<'a> {
        grads: &'a mut GradientsParams,
        data: Vec<f32>,
        present: Vec<f32>,
    }
    impl<AB: AutodiffBackend> ModuleVisitor<AB> for Take<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            match self.grads.remove::<AB::InnerBackend, D>(param.id) {
                Some(g) => {
                    self.present.push(1.0);
                    self.data.extend(g.into_data().convert::<f32>().to_vec::<f32>().expect("f32"));
                }
                None => {
                    self.present.push(0.0);
                    let n: usize = param.val().dims().iter().product();
                    self.data.extend(std::iter::repeat_n(0.0, n));
                }
            }
        }
    }
    let mut take = Take { grads, data: Vec::with_capacity(capacity), present: Vec::new() };
    visit_shared(part, &mut take);
    (take.data, take.present)
}

/// Puts reduced values ([`flatten_shared`]'s layout, every value summed) back into `grads` as the
/// gradients of the shared parameters flagged present in `present` (summed flags: present on any
/// copy).
pub(super) fn restore_shared<AB, A, R, X>(
    grads: &mut GradientsParams,
    part: &WorkerPart<AB, A, R, X>,
    data: &[f32],
    present: &[f32],
) where
    AB: AutodiffBackend,
    A: TrainModule<AB>,
    R: TrainModule<AB>,
    X: TrainModule<AB>,
{
    struct Put<'a> {
        grads: &'a mut GradientsParams,
        data: &'a [f32],
        present: &'a [f32],
        pos: usize,
        next: usize,
    }
    impl<AB: AutodiffBackend> ModuleVisitor<AB> for Put<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
            let shape = param.val().dims();
            let n: usize = shape.iter().product();
            let values = &self.data[self.pos..self.pos + n];
            self.pos += n;
            self.next += 1;
            if self.present[self.next - 1] > 0.0 {
                let device = param.val().device();
                let t = Tensor::<AB::InnerBackend, D>::from_data(TensorData::new(values.to_vec(), shape), &device);
                self.grads.register::<AB::InnerBackend, D>(param.id, t);
            }
        }
    }
    visit_shared(part, &mut Put { grads, data, present, pos: 0, next: 0 });
}

/// A parameter's place in the flattened vector.
#[derive(Debug, Clone)]
struct FlatParam {
    id: ParamId,
    offset: usize,
    len: usize,
    /// Decayed (a matrix).
    matrix: bool,
}

/// Lists the float parameters of a module in visiting order.
struct List<'a> {
    out: &'a mut Vec<FlatParam>,
    len: &'a mut usize,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for List<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let n: usize = param.val().dims().iter().product();
        self.out.push(FlatParam { id: param.id, offset: *self.len, len: n, matrix: D >= 2 });
        *self.len += n;
    }
}

/// The copies' shared parameters as one sharded vector, and this copy's moments of its shard.
pub(super) struct Sharded<B: Backend> {
    /// The workers holding copies (this one among them).
    pub(super) group: Vec<usize>,
    params: Vec<FlatParam>,
    len: usize,
    shard: Range<usize>,
    /// AdamW's moments of the part of each parameter in the shard.
    moments: HashMap<ParamId, (Tensor<B, 1>, Tensor<B, 1>)>,
    /// The f32 master weights of the part in the shard of each parameter held in bf16.
    masters: HashMap<ParamId, Tensor<B, 1>>,
}

/// A step's reduced gradients: this copy's shard of the sum (the rest of `data` undefined), and
/// which parameters had a gradient on any copy.
pub(super) struct ShardGrads {
    pub(super) data: Vec<f32>,
    pub(super) present: Vec<bool>,
}

impl<B: Backend> Sharded<B> {
    /// The sharding of the parameters `visit` visits (in the order every copy visits them) over
    /// `group`, this worker's shard being `shard(len)`.
    pub(super) fn new<AB, A, R, X>(
        group: Vec<usize>,
        part: &WorkerPart<AB, A, R, X>,
        shard: impl FnOnce(usize) -> Range<usize>,
    ) -> Self
    where
        AB: AutodiffBackend<InnerBackend = B>,
        A: TrainModule<AB>,
        R: TrainModule<AB>,
        X: TrainModule<AB>,
    {
        let (mut params, mut len) = (Vec::new(), 0);
        visit_shared(part, &mut List { out: &mut params, len: &mut len });
        let shard = shard(len);
        Self { group, params, len, shard, moments: HashMap::new(), masters: HashMap::new() }
    }

    /// The part of parameter `p` in this copy's shard, as a range of the parameter's values.
    fn segment(&self, p: &FlatParam) -> Option<Range<usize>> {
        let a = p.offset.max(self.shard.start);
        let b = (p.offset + p.len).min(self.shard.end);
        (a < b).then(|| a - p.offset..b - p.offset)
    }

    /// Takes this copy's shard of the moments `opt` holds for the shared parameters (read from a
    /// checkpoint whole) and drops the rest.
    pub(super) fn take_moments_from<AB: AutodiffBackend<InnerBackend = B>>(&mut self, opt: &mut AdamW<AB>) {
        for p in &self.params {
            let Some((m, v)) = opt.take_moments(p.id) else { continue };
            if let Some(r) = self.segment(p) {
                // A copy, not a view: the whole moments' memory goes.
                let own = |t: Tensor<B, 1>| {
                    let device = t.device();
                    Tensor::from_data(t.slice([r.clone()]).into_data(), &device)
                };
                self.moments.insert(p.id, (own(m), own(v)));
            }
        }
    }

    /// Takes this copy's shard of the master weights `opt` holds for the shared parameters held in
    /// bf16 ([`AdamW::adopt_masters`]) and drops the rest.
    pub(super) fn take_masters_from<AB: AutodiffBackend<InnerBackend = B>>(&mut self, opt: &mut AdamW<AB>) {
        for p in &self.params {
            let Some(master) = opt.take_master(p.id) else { continue };
            if let Some(r) = self.segment(p) {
                let device = master.device();
                self.masters.insert(p.id, Tensor::from_data(master.slice([r]).into_data(), &device));
            }
        }
    }

    /// Flattens the gradients of the shared parameters (taking them out of `grads`) into
    /// `(values, presence flags)` ([`flatten_shared`]).
    pub(super) fn flatten<AB, A, R, X>(
        &self,
        grads: &mut GradientsParams,
        part: &WorkerPart<AB, A, R, X>,
    ) -> (Vec<f32>, Vec<f32>)
    where
        AB: AutodiffBackend<InnerBackend = B>,
        A: TrainModule<AB>,
        R: TrainModule<AB>,
        X: TrainModule<AB>,
    {
        flatten_shared(grads, part, self.len)
    }

    /// The squares of this copy's shard of the reduced gradients, summed in f64; with the first
    /// parameter whose part is not finite.
    pub(super) fn squares(&self, g: &ShardGrads) -> (f64, Option<ParamId>) {
        let (mut total, mut bad) = (0.0, None);
        for (p, _) in self.params.iter().zip(&g.present).filter(|(_, &on)| on) {
            if let Some(r) = self.segment(p) {
                let sq: f64 = g.data[p.offset + r.start..p.offset + r.end].iter().map(|&x| f64::from(x).powi(2)).sum();
                if !sq.is_finite() && bad.is_none() {
                    bad = Some(p.id);
                }
                total += sq;
            }
        }
        (total, bad)
    }

    /// Updates this copy's shard: the new weights of every present parameter's part are written
    /// over the gradients in `g.data`, ready for the all-gather. Call after `opt.step` (the same
    /// step counter).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn update_shard<AB, A, R, X>(
        &mut self,
        g: &mut ShardGrads,
        opt: &AdamW<AB>,
        lr: f64,
        grad_scale: f64,
        part: &WorkerPart<AB, A, R, X>,
    ) where
        AB: AutodiffBackend<InnerBackend = B>,
        A: TrainModule<AB>,
        R: TrainModule<AB>,
        X: TrainModule<AB>,
    {
        struct Step<'a, AB: AutodiffBackend> {
            sharded: &'a mut Sharded<AB::InnerBackend>,
            g: &'a mut ShardGrads,
            opt: &'a AdamW<AB>,
            lr: f64,
            grad_scale: f64,
            next: usize,
        }
        impl<AB: AutodiffBackend> ModuleVisitor<AB> for Step<'_, AB> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
                let i = self.next;
                self.next += 1;
                let p = self.sharded.params[i].clone();
                debug_assert_eq!(p.id, param.id, "the same visiting order as the listing");
                let Some(r) = self.sharded.segment(&p).filter(|_| self.g.present[i]) else { return };
                let at = p.offset + r.start..p.offset + r.end;
                // A parameter held in bf16 is updated through its master (see `AdamW::step`).
                let master = self.sharded.masters.remove(&p.id);
                let low = master.is_some();
                let part = match master {
                    Some(m) => m,
                    None => param.val().inner().reshape([p.len]).slice([r]),
                };
                let device = part.device();
                let grad = Tensor::<AB::InnerBackend, 1>::from_data(
                    TensorData::new(self.g.data[at.clone()].to_vec(), [at.len()]),
                    &device,
                );
                let moments = self.sharded.moments.remove(&p.id);
                let (new, m, v) = self.opt.update(part, grad, moments, p.matrix, self.lr, self.grad_scale);
                self.sharded.moments.insert(p.id, (m, v));
                let values = new.clone().into_data().convert::<f32>().to_vec::<f32>().expect("f32");
                if low {
                    self.sharded.masters.insert(p.id, new);
                }
                self.g.data[at].copy_from_slice(&values);
            }
        }
        let mut step = Step { sharded: self, g, opt, lr, grad_scale, next: 0 };
        visit_shared(part, &mut step);
    }

    /// Puts the gathered weights of every present parameter back into `part`.
    pub(super) fn load<AB, A, R, X>(&self, g: &ShardGrads, part: WorkerPart<AB, A, R, X>) -> WorkerPart<AB, A, R, X>
    where
        AB: AutodiffBackend<InnerBackend = B>,
        A: TrainModule<AB>,
        R: TrainModule<AB>,
        X: TrainModule<AB>,
    {
        let mut load = Load { sharded: self, g, next: 0 };
        let WorkerPart { ends, attention, experts } = part;
        let ends = Module::map(ends, &mut load);
        let attention = Module::map(attention, &mut load);
        WorkerPart { ends, attention, experts }
    }

    /// One moment of this copy's shard laid into a vector of the flattened length (zeros
    /// elsewhere), for an all-gather.
    pub(super) fn moment_shard(&self, moment: Moment) -> Vec<f32> {
        let mut data = vec![0f32; self.len];
        for p in &self.params {
            if let (Some(r), Some((m, v))) = (self.segment(p), self.moments.get(&p.id)) {
                let t = if moment == Moment::First { m } else { v };
                let values = t.clone().into_data().convert::<f32>().to_vec::<f32>().expect("f32");
                data[p.offset + r.start..p.offset + r.end].copy_from_slice(&values);
            }
        }
        data
    }

    /// The master weights of this copy's shard laid into a vector of the flattened length (zeros
    /// elsewhere), for an all-gather.
    pub(super) fn master_shard(&self) -> Vec<f32> {
        let mut data = vec![0f32; self.len];
        for p in &self.params {
            if let (Some(r), Some(m)) = (self.segment(p), self.masters.get(&p.id)) {
                let values = m.clone().into_data().convert::<f32>().to_vec::<f32>().expect("f32");
                data[p.offset + r.start..p.offset + r.end].copy_from_slice(&values);
            }
        }
        data
    }

    /// The gathered master weights `data` as whole flattened tensors, for the parameters held in
    /// bf16 (those of `part` whose value is not f32), on `device`.
    pub(super) fn split_masters<AB, A, R, X>(
        &self,
        data: &[f32],
        part: &WorkerPart<AB, A, R, X>,
        device: &B::Device,
    ) -> HashMap<ParamId, Tensor<B, 1>>
    where
        AB: AutodiffBackend<InnerBackend = B>,
        A: TrainModule<AB>,
        R: TrainModule<AB>,
        X: TrainModule<AB>,
    {
        struct Low(Vec<ParamId>);
        impl<AB: AutodiffBackend> ModuleVisitor<AB> for Low {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
                if param.val().dtype() != burn::tensor::DType::F32 {
                    self.0.push(param.id);
                }
            }
        }
        let mut low = Low(Vec::new());
        visit_shared(part, &mut low);
        let low: std::collections::HashSet<ParamId> = low.0.into_iter().collect();
        let mut all = self.split(data, device);
        all.retain(|id, _| low.contains(id));
        all
    }

    /// The gathered moment `data` as whole flattened tensors per parameter.
    pub(super) fn split(&self, data: &[f32], device: &B::Device) -> HashMap<ParamId, Tensor<B, 1>> {
        (self.params.iter())
            .map(|p| {
                let values = data[p.offset..p.offset + p.len].to_vec();
                (p.id, Tensor::from_data(TensorData::new(values, [p.len]), device))
            })
            .collect()
    }

    /// Bytes of the moments and master weights this copy holds.
    pub(super) fn state_bytes(&self) -> u64 {
        let bytes = |t: &Tensor<B, 1>| (t.dims()[0] * t.dtype().size()) as u64;
        self.moments.values().map(|(m, v)| bytes(m) + bytes(v)).sum::<u64>()
            + self.masters.values().map(bytes).sum::<u64>()
    }
}

/// See [`Sharded::load`].
struct Load<'a, B: Backend> {
    sharded: &'a Sharded<B>,
    g: &'a ShardGrads,
    next: usize,
}

impl<AB: AutodiffBackend> ModuleMapper<AB> for Load<'_, AB::InnerBackend> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
        let i = self.next;
        self.next += 1;
        if !self.g.present[i] {
            return param;
        }
        let p = &self.sharded.params[i];
        let (id, tensor, mapper) = param.consume();
        debug_assert_eq!(p.id, id, "the same visiting order as the listing");
        let require_grad = tensor.is_require_grad();
        let (shape, device, dtype) = (tensor.dims(), tensor.device(), tensor.dtype());
        drop(tensor);
        let values = self.g.data[p.offset..p.offset + p.len].to_vec();
        // Cast on the device (`from_data` would make any data the backend's f32): a bf16 weight
        // gets the rounding of `AdamW::step`'s cast.
        let t = Tensor::<AB::InnerBackend, D>::from_data(TensorData::new(values, shape), &device);
        let mut t = Tensor::<AB, D>::from_inner(if dtype == burn::tensor::DType::F32 { t } else { t.cast(dtype) });
        if require_grad {
            t = t.require_grad();
        }
        Param::from_mapped_value(id, t, mapper)
    }
}
