//! AdamW with decoupled weight decay, a warm-up + cosine learning-rate schedule, and clipping by the
//! global gradient norm (the norm over all parameters together, as Megatron and PyTorch's
//! `clip_grad_norm_` compute it; Burn's own clipping works per tensor).
//!
//! State is kept per parameter id, flattened, on the parameter's device. Weight decay applies to
//! matrices only (embeddings, projections, experts, router), not to norms and biases.

use std::collections::HashMap;

use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Tensor};

/// Peak learning rate at the end of warm-up, then cosine decay to `min_lr` at `total` steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    /// Learning rate after warm-up.
    pub peak: f64,
    /// Learning rate at the last step.
    pub min: f64,
    /// Steps of linear warm-up from `peak / warmup`.
    pub warmup: usize,
    /// Steps the schedule spans.
    pub total: usize,
}

impl LrSchedule {
    /// The learning rate of step `step` (1-based).
    pub fn at(&self, step: usize) -> f64 {
        if self.warmup > 0 && step <= self.warmup {
            return self.peak * step as f64 / self.warmup as f64;
        }
        let span = self.total.saturating_sub(self.warmup).max(1) as f64;
        let progress = ((step.saturating_sub(self.warmup)) as f64 / span).clamp(0.0, 1.0);
        self.min + 0.5 * (self.peak - self.min) * (1.0 + (std::f64::consts::PI * progress).cos())
    }
}

/// AdamW hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWSettings {
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Decoupled weight decay (matrices only).
    pub weight_decay: f64,
    /// The moments are kept in bf16 (read into f32 for each update, rounded back after it).
    pub bf16_moments: bool,
}

struct Moments<B: Backend> {
    m: Tensor<B, 1>,
    v: Tensor<B, 1>,
}

/// One of AdamW's two moments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Moment {
    /// The running mean of the gradients (`exp_avg`).
    First,
    /// The running mean of their squares (`exp_avg_sq`).
    Second,
}

impl Moment {
    /// Both, in order.
    pub const BOTH: [Moment; 2] = [Moment::First, Moment::Second];

    /// PyTorch's name of the moment (the directory of a checkpoint that holds it).
    pub fn name(self) -> &'static str {
        match self {
            Moment::First => "exp_avg",
            Moment::Second => "exp_avg_sq",
        }
    }
}

/// Replaces every parameter's value with its moment (zeros where there is none yet).
struct MomentsOf<'a, B: AutodiffBackend> {
    state: &'a HashMap<ParamId, Moments<B::InnerBackend>>,
    moment: Moment,
    /// Moments given whole, before `state`'s.
    full: &'a HashMap<ParamId, Tensor<B::InnerBackend, 1>>,
}

impl<B: AutodiffBackend> ModuleMapper<B> for MomentsOf<'_, B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let shape = tensor.dims();
        let value = match (self.full.get(&id), self.state.get(&id)) {
            (Some(t), _) => to_f32(t.clone()).reshape(shape),
            (None, Some(Moments { m, v })) => {
                let t = if self.moment == Moment::First { m } else { v };
                to_f32(t.clone()).reshape(shape)
            }
            (None, None) => Tensor::zeros(shape, &tensor.device()),
        };
        Param::from_mapped_value(id, Tensor::from_inner(value), mapper)
    }
}

/// `t` in f32 (itself when it is).
fn to_f32<B: Backend, const D: usize>(t: Tensor<B, D>) -> Tensor<B, D> {
    if t.dtype() == burn::tensor::DType::F32 {
        t
    } else {
        t.cast(burn::tensor::DType::F32)
    }
}

/// Every float parameter of a module, flattened, in visiting order.
struct Flat<B: AutodiffBackend> {
    out: Vec<(ParamId, Tensor<B::InnerBackend, 1>)>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Flat<B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let t = param.val().inner();
        let n = t.dims().iter().product::<usize>();
        self.out.push((param.id, t.reshape([n])));
    }
}

/// AdamW over any Burn module.
pub struct AdamW<B: AutodiffBackend> {
    settings: AdamWSettings,
    step: u64,
    state: HashMap<ParamId, Moments<B::InnerBackend>>,
    /// The f32 master weights (flattened) of the parameters held in bf16 ([`AdamW::adopt_masters`]).
    masters: HashMap<ParamId, Tensor<B::InnerBackend, 1>>,
}

/// Norm of the gradients of one step.
#[derive(Debug, Clone)]
pub struct GradNorms {
    /// Global L2 norm over all parameters.
    pub total: f64,
    /// L2 norm per parameter (only filled in on the fault path: when `total` is not finite).
    pub per_param: Vec<(ParamId, f64)>,
}

struct SquaresVisitor<'a, B: AutodiffBackend> {
    grads: &'a GradientsParams,
    squares: Vec<(ParamId, Tensor<B::InnerBackend, 1>)>,
    /// Sums of squares already on the host (fused path).
    host: Vec<(ParamId, f64)>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for SquaresVisitor<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) {
            match disagmoe_kernels::fused::sum_squares(&g) {
                Some(sq) => self.host.push((param.id, sq)),
                None => self.squares.push((param.id, g.square().sum())),
            }
        }
    }
}

/// Test-only fault (`inject_nonfinite`): multiplies the gradient of parameter `target` by NaN where
/// `model` holds it and it has one; whether it did.
pub fn poison_gradient<B: AutodiffBackend, M: Module<B>>(
    model: &M,
    target: ParamId,
    grads: &mut GradientsParams,
) -> bool {
    struct Poison<'a> {
        target: ParamId,
        grads: &'a mut GradientsParams,
        done: bool,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Poison<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if param.id == self.target {
                if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
                    self.grads.register::<B::InnerBackend, D>(param.id, g.mul_scalar(f64::NAN));
                    self.done = true;
                }
            }
        }
    }
    let mut v = Poison { target, grads, done: false };
    model.visit(&mut v);
    v.done
}

/// The global L2 norm of `grads` over the parameters of `model` (one host read).
pub fn grad_norm<B: AutodiffBackend, M: AutodiffModule<B>>(model: &M, grads: &GradientsParams) -> GradNorms {
    let mut v = SquaresVisitor::<B> { grads, squares: Vec::new(), host: Vec::new() };
    model.visit(&mut v);
    let (mut ids, mut host): (Vec<ParamId>, Vec<f64>) = v.host.into_iter().unzip();
    if !v.squares.is_empty() {
        ids.extend(v.squares.iter().map(|(id, _)| *id));
        let all = Tensor::cat(v.squares.into_iter().map(|(_, t)| t).collect(), 0);
        let read: Vec<f32> = all.into_data().convert::<f32>().to_vec().expect("f32 norms");
        host.extend(read.into_iter().map(f64::from));
    }
    if host.is_empty() {
        return GradNorms { total: 0.0, per_param: Vec::new() };
    }
    let total = host.iter().sum::<f64>().sqrt();
    let per_param =
        if total.is_finite() { Vec::new() } else { ids.into_iter().zip(host.iter().map(|&x| x.sqrt())).collect() };
    GradNorms { total, per_param }
}

/// Bytes of the weights of `model` and of the gradients in `grads` of its parameters (elements
/// times their dtype's size).
pub fn weight_and_grad_bytes<B: AutodiffBackend, M: Module<B>>(model: &M, grads: &GradientsParams) -> (u64, u64) {
    struct Count<'a> {
        grads: &'a GradientsParams,
        params: u64,
        grads_bytes: u64,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Count<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let v = param.val();
            self.params += (v.dims().iter().product::<usize>() * v.dtype().size()) as u64;
            if let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) {
                self.grads_bytes += (g.dims().iter().product::<usize>() * g.dtype().size()) as u64;
            }
        }
    }
    let mut count = Count { grads, params: 0, grads_bytes: 0 };
    model.visit(&mut count);
    (count.params, count.grads_bytes)
}

/// Whether a run in precision `p` holds its matrices in bf16 (with f32 masters in the optimizer):
/// under `bf16`. `f16` keeps f32 weights (its loss scaling needs the f32 update's range).
pub fn bf16_weights(p: disagmoe_kernels::precision::Precision) -> bool {
    p == disagmoe_kernels::precision::Precision::Bf16
}

/// Whether the parameter named `name`, of `dims` dimensions, is held in bf16 under bf16 weights:
/// the matrices the products read (projections, experts, embeddings and heads), not the routers'
/// weights (their logits decide the routing: kept f32, as Megatron-Core's `--moe-router-dtype
/// fp32`), nor vectors and biases (norms, sinks, gpt-oss's expert biases), which are few bytes
/// and added to f32 activations.
pub fn held_in_bf16(name: &str, dims: usize) -> bool {
    let router = name.ends_with(".gate.weight") || name.ends_with(".router.weight");
    dims >= 2 && !router && !name.ends_with("bias")
}

/// The gradients in `grads` of `module`'s parameters in f32: those of parameters held in bf16
/// ([`AdamW::adopt_masters`]) come out of a backward in bf16 and are cast once, there, so that
/// micro-batches and copies add them in f32 (the planner's 4 gradient bytes per parameter).
pub fn grads_in_f32<B: AutodiffBackend, M: Module<B>>(module: &M, mut grads: GradientsParams) -> GradientsParams {
    struct Cast<'a> {
        grads: &'a mut GradientsParams,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Cast<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if param.val().dtype() == DType::F32 {
                return;
            }
            if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
                let g = if g.dtype() == DType::F32 { g } else { g.cast(DType::F32) };
                self.grads.register::<B::InnerBackend, D>(param.id, g);
            }
        }
    }
    module.visit(&mut Cast { grads: &mut grads });
    grads
}

struct SquareSum<'a, B: Backend> {
    parts: &'a mut Vec<Tensor<B, 1>>,
}

impl<B: Backend> ModuleVisitor<B> for SquareSum<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        // In f32 whatever the parameter's dtype (the parts are concatenated).
        self.parts.push(param.val().cast(DType::F32).square().sum());
    }
}

/// Sum of squares of all parameters of a module (one host read, accumulated in f64).
pub fn sum_of_squares<B: Backend, M: burn::module::Module<B>>(module: &M) -> f64 {
    let mut parts = Vec::new();
    module.visit(&mut SquareSum { parts: &mut parts });
    if parts.is_empty() {
        return 0.0;
    }
    let host: Vec<f64> = Tensor::cat(parts, 0).into_data().convert::<f64>().to_vec().expect("f64");
    host.iter().sum()
}

struct StepMapper<'a, B: AutodiffBackend> {
    opt: &'a mut AdamW<B>,
    grads: &'a mut GradientsParams,
    lr: f64,
    grad_scale: f64,
}

impl<B: AutodiffBackend> ModuleMapper<B> for StepMapper<'_, B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let Some(grad) = self.grads.remove::<B::InnerBackend, D>(id) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let require_grad = tensor.is_require_grad();
        let moments = self.opt.state.remove(&id).map(|Moments { m, v }| (m, v));
        let shape = tensor.dims();
        // A bf16 parameter is updated through its f32 master, and takes the master's rounding.
        let (value, low) = match self.opt.masters.remove(&id) {
            Some(master) => (master.reshape(shape), Some(tensor.dtype())),
            None => (tensor.inner(), None),
        };
        let grad = if grad.dtype() == DType::F32 { grad } else { grad.cast(DType::F32) };
        let (p, m, v) = self.opt.update(value, grad, moments, D >= 2, self.lr, self.grad_scale);
        self.opt.state.insert(id, Moments { m, v });
        let p = match low {
            Some(dtype) => {
                let n = shape.iter().product::<usize>();
                self.opt.masters.insert(id, p.clone().reshape([n]));
                p.cast(dtype)
            }
            None => p,
        };
        let mut out = Tensor::from_inner(p);
        if require_grad {
            out = out.require_grad();
        }
        Param::from_mapped_value(id, out, mapper)
    }
}

impl<B: AutodiffBackend> AdamW<B> {
    /// A fresh optimizer.
    pub fn new(settings: AdamWSettings) -> Self {
        Self { settings, step: 0, state: HashMap::new(), masters: HashMap::new() }
    }

    /// One AdamW update of the values `param` (any shape: a parameter, or the part of a flattened
    /// parameter a distributed optimizer's shard holds) with gradient `grad` (multiplied by
    /// `grad_scale` first) and moments `moments` (flattened; zeros when `None`), at the step
    /// counter's current value; `matrix`: decayed. Returns the new values and moments. Elementwise,
    /// so a part of a tensor gets the bits the whole would (fused on the CPU, Burn's operations
    /// elsewhere).
    #[allow(clippy::type_complexity)]
    pub fn update<const D: usize>(
        &self,
        param: Tensor<B::InnerBackend, D>,
        grad: Tensor<B::InnerBackend, D>,
        moments: Option<(Tensor<B::InnerBackend, 1>, Tensor<B::InnerBackend, 1>)>,
        matrix: bool,
        lr: f64,
        grad_scale: f64,
    ) -> (Tensor<B::InnerBackend, D>, Tensor<B::InnerBackend, 1>, Tensor<B::InnerBackend, 1>) {
        let AdamWSettings { beta1, beta2, eps, weight_decay, bf16_moments } = self.settings;
        let t = self.step as i32;
        let decay = matrix && weight_decay > 0.0;
        // bf16 moments are computed with in f32 and kept in bf16.
        let moments = moments.map(|(m, v)| (to_f32(m), to_f32(v)));
        let keep = |t: Tensor<B::InnerBackend, 1>| if bf16_moments { t.cast(burn::tensor::DType::BF16) } else { t };
        #[cfg(feature = "flex")]
        let (param, grad, moments) = {
            let n: usize = param.dims().iter().product();
            let f32s = param.dtype() == DType::F32 && grad.dtype() == DType::F32;
            let moments_ok = moments.as_ref().is_none_or(|(m, v)| {
                m.dims() == [n] && v.dims() == [n] && m.dtype() == DType::F32 && v.dtype() == DType::F32
            });
            if disagmoe_kernels::fused::cpu_available::<B::InnerBackend>() && f32s && moments_ok {
                let s = disagmoe_kernels::cpu::AdamWScalars {
                    grad_scale: grad_scale as f32,
                    beta1: beta1 as f32,
                    one_minus_beta1: (1.0 - beta1) as f32,
                    beta2: beta2 as f32,
                    one_minus_beta2: (1.0 - beta2) as f32,
                    bc1: (1.0 - beta1.powi(t)) as f32,
                    bc2: (1.0 - beta2.powi(t)) as f32,
                    eps: eps as f32,
                    lr: lr as f32,
                    decay: if decay { (1.0 - lr * weight_decay) as f32 } else { 1.0 },
                };
                // Moved, not cloned: the update then runs in place in the parameter's and moments'
                // buffers.
                let (p, m, v) = disagmoe_kernels::fused::adamw(param, grad, moments, s)
                    .expect("fused AdamW applies: backend, dtypes and shapes checked above");
                return (p, keep(m), keep(v));
            }
            (param, grad, moments)
        };
        let shape = param.dims();
        let n: usize = shape.iter().product();
        let mut p = param.reshape([n]);
        let g = if grad_scale != 1.0 { grad.reshape([n]).mul_scalar(grad_scale) } else { grad.reshape([n]) };
        if decay {
            p = p.mul_scalar(1.0 - lr * weight_decay);
        }
        let (m, v) = moments.unwrap_or_else(|| (Tensor::zeros([n], &g.device()), Tensor::zeros([n], &g.device())));
        let m = m.mul_scalar(beta1) + g.clone().mul_scalar(1.0 - beta1);
        let v = v.mul_scalar(beta2) + g.square().mul_scalar(1.0 - beta2);
        let bc1 = 1.0 - beta1.powi(t);
        let bc2 = 1.0 - beta2.powi(t);
        let update = m.clone().div_scalar(bc1) / v.clone().div_scalar(bc2).sqrt().add_scalar(eps);
        let p = p - update.mul_scalar(lr);
        (p.reshape(shape), keep(m), keep(v))
    }

    /// A moment as this optimizer keeps it (bf16 when asked, else as given).
    fn kept(&self, t: Tensor<B::InnerBackend, 1>) -> Tensor<B::InnerBackend, 1> {
        if self.settings.bf16_moments {
            t.cast(burn::tensor::DType::BF16)
        } else {
            t
        }
    }

    /// Takes out the moments of parameter `id` (flattened), when it has any.
    #[allow(clippy::type_complexity)]
    pub fn take_moments(&mut self, id: ParamId) -> Option<(Tensor<B::InnerBackend, 1>, Tensor<B::InnerBackend, 1>)> {
        self.state.remove(&id).map(|Moments { m, v }| (m, v))
    }

    /// Drops the moments of `module`'s parameters (a module this worker no longer holds).
    pub fn forget<M: AutodiffModule<B>>(&mut self, module: &M) {
        struct Ids(Vec<ParamId>);
        impl<B: burn::tensor::backend::Backend> ModuleVisitor<B> for Ids {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                self.0.push(param.id);
            }
        }
        let mut ids = Ids(Vec::new());
        module.visit(&mut ids);
        for id in ids.0 {
            self.state.remove(&id);
            self.masters.remove(&id);
        }
    }

    /// Bytes of the moments and master weights this optimizer holds.
    pub fn state_bytes(&self) -> u64 {
        let bytes = |t: &Tensor<B::InnerBackend, 1>| (t.dims()[0] * t.dtype().size()) as u64;
        self.state.values().map(|Moments { m, v }| bytes(m) + bytes(v)).sum::<u64>()
            + self.masters.values().map(bytes).sum::<u64>()
    }

    /// Holds the parameters of `module` that `low` picks in bf16 (the working copy the products
    /// read), keeping their f32 values here as master weights: the update runs on the master and
    /// writes its bf16 rounding into the parameter (Megatron-Core's bf16 parameters with f32 main
    /// weights). Parameters already held in bf16 keep their master.
    pub fn adopt_masters<M: AutodiffModule<B>>(&mut self, module: M, low: &dyn Fn(ParamId, usize) -> bool) -> M {
        struct Adopt<'a, B: AutodiffBackend> {
            masters: &'a mut HashMap<ParamId, Tensor<B::InnerBackend, 1>>,
            low: &'a dyn Fn(ParamId, usize) -> bool,
        }
        impl<B: AutodiffBackend> ModuleMapper<B> for Adopt<'_, B> {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
                let (id, tensor, mapper) = param.consume();
                if tensor.dtype() != DType::F32 || !(self.low)(id, D) {
                    return Param::from_mapped_value(id, tensor, mapper);
                }
                let require_grad = tensor.is_require_grad();
                let inner = tensor.inner();
                let n = inner.dims().iter().product::<usize>();
                self.masters.insert(id, inner.clone().reshape([n]));
                // A leaf of its own (a cast of the f32 tensor would send its gradient there).
                let mut t = Tensor::from_inner(inner.cast(DType::BF16));
                if require_grad {
                    t = t.require_grad();
                }
                Param::from_mapped_value(id, t, mapper)
            }
        }
        module.map(&mut Adopt::<B> { masters: &mut self.masters, low })
    }

    /// Takes out the master weights of parameter `id` (flattened), when it is held in bf16.
    pub fn take_master(&mut self, id: ParamId) -> Option<Tensor<B::InnerBackend, 1>> {
        self.masters.remove(&id)
    }

    /// A copy of `module` with the f32 master weights in place of the bf16 working copies: `full`
    /// gives those of the parameters it names (flattened; a distributed optimizer's, gathered),
    /// this optimizer the others; a parameter held in f32 is its own master. What a checkpoint
    /// saves and a checksum sums.
    pub fn masters_with<M: AutodiffModule<B>>(
        &self,
        module: M,
        full: &HashMap<ParamId, Tensor<B::InnerBackend, 1>>,
    ) -> M {
        struct Masters<'a, B: AutodiffBackend> {
            masters: &'a HashMap<ParamId, Tensor<B::InnerBackend, 1>>,
            full: &'a HashMap<ParamId, Tensor<B::InnerBackend, 1>>,
        }
        impl<B: AutodiffBackend> ModuleMapper<B> for Masters<'_, B> {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
                let Some(master) = self.full.get(&param.id).or_else(|| self.masters.get(&param.id)) else {
                    return param;
                };
                let (id, tensor, mapper) = param.consume();
                let require_grad = tensor.is_require_grad();
                let mut t = Tensor::from_inner(master.clone().reshape(tensor.dims()));
                if require_grad {
                    t = t.require_grad();
                }
                Param::from_mapped_value(id, t, mapper)
            }
        }
        if self.masters.is_empty() && full.is_empty() {
            return module;
        }
        module.map(&mut Masters::<B> { masters: &self.masters, full })
    }

    /// [`AdamW::masters_with`] of this optimizer's masters alone.
    pub fn masters_as<M: AutodiffModule<B>>(&self, module: M) -> M {
        self.masters_with(module, &HashMap::new())
    }

    /// A copy of `module` whose parameters hold one of their moments: `full` gives those of the
    /// parameters it names (flattened; a distributed optimizer's, gathered), this optimizer the
    /// others (zeros for a parameter not updated yet).
    pub fn moments_with<M: AutodiffModule<B>>(
        &self,
        module: M,
        moment: Moment,
        full: &HashMap<ParamId, Tensor<B::InnerBackend, 1>>,
    ) -> M {
        module.map(&mut MomentsOf::<B> { state: &self.state, moment, full })
    }

    /// Steps taken so far.
    pub fn steps_taken(&self) -> u64 {
        self.step
    }

    /// Resumes the step counter (after loading moments with [`AdamW::import_moments`]).
    pub fn set_steps_taken(&mut self, steps: u64) {
        self.step = steps;
    }

    /// A copy of `module` whose parameters hold one of their moments (zeros for a parameter not
    /// updated yet): saved like the module itself, with its names, shapes and sharding.
    pub fn moments_as<M: AutodiffModule<B>>(&self, module: M, moment: Moment) -> M {
        self.moments_with(module, moment, &HashMap::new())
    }

    /// Takes the moments of `module`'s parameters from `m` and `v`, modules of the same structure
    /// whose parameters hold them (as [`AdamW::moments_as`] makes and a checkpoint loads them).
    pub fn import_moment_modules<M: AutodiffModule<B>>(
        &mut self,
        module: &M,
        m: &M,
        v: &M,
    ) -> crate::error::Result<()> {
        let flat = |x: &M| {
            let mut f = Flat::<B> { out: Vec::new() };
            x.visit(&mut f);
            f.out
        };
        let (params, ms, vs) = (flat(module), flat(m), flat(v));
        if params.len() != ms.len() || params.len() != vs.len() {
            return Err(crate::error::TrainError::option(
                "resume",
                format!(
                    "the checkpoint's moments hold {} and {} tensors, the model {}",
                    ms.len(),
                    vs.len(),
                    params.len()
                ),
            ));
        }
        for (((id, p), (_, m)), (_, v)) in params.into_iter().zip(ms).zip(vs) {
            if p.dims() != m.dims() || p.dims() != v.dims() {
                return Err(crate::error::TrainError::option(
                    "resume",
                    format!("a moment of the checkpoint has {:?} values, its parameter {:?}", m.dims(), p.dims()),
                ));
            }
            self.state.insert(id, Moments { m: self.kept(m), v: self.kept(v) });
        }
        Ok(())
    }

    /// Loads the moments of a checkpoint of an earlier version (`exp_avg.<name>` and
    /// `exp_avg_sq.<name>`, flattened, in one file) for the parameters of a (re)loaded model.
    pub fn import_moments(
        &mut self,
        ckpt: &mut disagmoe_models::CheckpointReader,
        names: &HashMap<ParamId, String>,
        device: &burn::tensor::Device<B::InnerBackend>,
    ) -> disagmoe_models::Result<()> {
        use burn::tensor::TensorData;
        for (id, name) in names {
            let (m_name, v_name) = (format!("exp_avg.{name}"), format!("exp_avg_sq.{name}"));
            if !ckpt.contains(&m_name) {
                continue; // a parameter that never had a gradient
            }
            let (_, m) = ckpt.read_f32(&m_name)?;
            let (_, v) = ckpt.read_f32(&v_name)?;
            let (nm, nv) = (m.len(), v.len());
            self.state.insert(
                *id,
                Moments {
                    m: self.kept(Tensor::from_data(TensorData::new(m, [nm]), device)),
                    v: self.kept(Tensor::from_data(TensorData::new(v, [nv]), device)),
                },
            );
        }
        Ok(())
    }

    /// One update of every parameter that has a gradient, with the gradients multiplied by
    /// `grad_scale` first (the clipping factor).
    pub fn step<M: AutodiffModule<B>>(&mut self, model: M, grads: &mut GradientsParams, lr: f64, grad_scale: f64) -> M {
        self.step += 1;
        let mut mapper = StepMapper { opt: self, grads, lr, grad_scale };
        model.map(&mut mapper)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TrainBackend as TB;
    use burn::module::Module;
    use burn::tensor::TensorData;

    #[derive(Module, Debug)]
    struct Two<B: Backend> {
        w: Param<Tensor<B, 2>>,
        b: Param<Tensor<B, 1>>,
    }

    #[test]
    fn adamw_first_step_matches_the_closed_form() {
        // At step 1, m_hat = g and v_hat = g^2, so the update is lr * g / (|g| + eps) ~ lr * sign(g);
        // decay multiplies matrices (not vectors) by (1 - lr * wd) first.
        let device = Default::default();
        let w0 = [[1.0f32, -2.0], [0.5, 3.0]];
        let m = Two::<TB> {
            w: Param::from_tensor(Tensor::from_data(TensorData::from(w0), &device)),
            b: Param::from_tensor(Tensor::from_data(TensorData::from([1.0f32, 1.0]), &device)),
        };
        let coef = Tensor::<TB, 2>::from_data(TensorData::from([[1.0f32, -1.0], [2.0, -0.5]]), &device);
        let loss = (m.w.val() * coef).sum() + m.b.val().sum().mul_scalar(-3.0);
        let mut grads = GradientsParams::from_grads(loss.backward(), &m);
        let norms = grad_norm::<TB, _>(&m, &grads);
        let expected_norm = (1.0f64 + 1.0 + 4.0 + 0.25 + 9.0 + 9.0).sqrt();
        assert!((norms.total - expected_norm).abs() < 1e-5);
        let (lr, wd) = (0.1, 0.5);
        let mut opt = AdamW::<TB>::new(AdamWSettings {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: wd,
            bf16_moments: false,
        });
        let m = opt.step(m, &mut grads, lr, 1.0);
        let w: Vec<f32> = m.w.val().into_data().to_vec().unwrap();
        let signs = [1.0f32, -1.0, 1.0, -1.0];
        for (i, (&got, &w0)) in w.iter().zip(w0.iter().flatten()).enumerate() {
            let want = w0 * (1.0 - (lr * wd) as f32) - lr as f32 * signs[i];
            assert!((got - want).abs() < 1e-5, "w[{i}] = {got}, want {want}");
        }
        let b: Vec<f32> = m.b.val().into_data().to_vec().unwrap();
        assert!(b.iter().all(|&x| (x - 1.1).abs() < 1e-5), "no decay on vectors: {b:?}");
    }

    #[test]
    fn schedule_warms_up_then_decays_to_min() {
        let s = LrSchedule { peak: 1e-3, min: 1e-4, warmup: 10, total: 110 };
        assert!((s.at(1) - 1e-4).abs() < 1e-12);
        assert!((s.at(10) - 1e-3).abs() < 1e-12);
        assert!((s.at(60) - 5.5e-4).abs() < 1e-9);
        assert!((s.at(110) - 1e-4).abs() < 1e-12);
        assert!(s.at(30) > s.at(31));
    }
}
