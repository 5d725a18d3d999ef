//! The worker's glue to Burn's autodiff: gradients out of the graph, forks of a stage's
//! parameters, and gradients flattened for an all-reduce.
//!
//! Every boundary between workers is a leaf of the graph: a received tensor becomes a leaf that
//! requires a gradient (`Worker::take`), and a stage's backward is `sum(output * received
//! gradient)`.

use burn::module::{ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor, TensorData};

/// The gradient of the step's loss with respect to a loss term with coefficient `coef` in a
/// micro-batch's loss, rounded as one device's autodiff rounds it (`total = lm + coef * term`,
/// then `total / micro_batches` when there are several: `f32(1 / K) * f32(coef)` in f32), so the
/// balance and z-loss gradients have the single engine's bits.
pub(super) fn term_scale(micro_batches: usize, coef: f64) -> f32 {
    if micro_batches > 1 {
        (1.0f32 / micro_batches as f32) * coef as f32
    } else {
        coef as f32
    }
}

/// Token indices as an index tensor.
pub(super) fn index<B: Backend>(v: &[u32], device: &B::Device) -> Tensor<B, 1, Int> {
    Tensor::from_data(TensorData::new(v.iter().map(|&i| i as i64).collect::<Vec<_>>(), [v.len()]), device)
}

/// The gradient of leaf `t` out of `grads` (zeros of `shape` when it got none).
pub(super) fn grad_of<B: AutodiffBackend, const D: usize>(
    t: &Option<Tensor<B, D>>,
    grads: &mut B::Gradients,
    shape: [usize; D],
    device: &B::Device,
) -> Tensor<B::InnerBackend, D> {
    t.as_ref().and_then(|t| t.grad_remove(grads)).unwrap_or_else(|| Tensor::zeros(shape, device))
}

/// Gives every parameter of a module its own autodiff leaf (and moves it to `device`). Workers fork
/// their stage for each task, so the graphs of micro-batches in flight at once share no node: Burn
/// would otherwise join them through the parameters, and a backward of one would disturb another.
/// With `track: false` the parameters are constants: the forward builds no graph (the first
/// forward of a recomputed stage).
pub(super) struct Fork<'a, B: AutodiffBackend> {
    pub(super) device: &'a B::Device,
    pub(super) track: bool,
}

impl<B: AutodiffBackend> ModuleMapper<B> for Fork<'_, B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let require_grad = self.track && tensor.is_require_grad();
        let mut t = Tensor::<B, D>::from_inner(tensor.inner().to_device(self.device));
        if require_grad {
            t = t.require_grad();
        }
        Param::from_mapped_value(id, t, mapper)
    }
}

/// Flattens (and later restores) the gradients of a module's parameters, with presence flags.
pub(super) struct Flatten<'a> {
    pub(super) grads: &'a mut GradientsParams,
    pub(super) out: Vec<f32>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Flatten<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let n: usize = param.val().dims().iter().product();
        match self.grads.get::<B::InnerBackend, D>(param.id) {
            Some(g) => {
                self.out.push(1.0);
                self.out.extend(g.into_data().convert::<f32>().to_vec::<f32>().expect("f32"));
            }
            None => {
                self.out.push(0.0);
                self.out.extend(std::iter::repeat_n(0.0, n));
            }
        }
    }
}

/// Gives parameters without a gradient a zero one (fused expert shards that saw no token).
pub(super) struct ZeroFill<'a> {
    pub(super) grads: &'a mut GradientsParams,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for ZeroFill<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if self.grads.get::<B::InnerBackend, D>(param.id).is_none() {
            let v = param.val();
            self.grads.register::<B::InnerBackend, D>(param.id, Tensor::zeros(v.dims(), &v.device()));
        }
    }
}

/// Puts flattened gradients ([`Flatten`]) back, in the same visiting order.
pub(super) struct Restore<'a> {
    pub(super) grads: &'a mut GradientsParams,
    pub(super) data: &'a [f32],
    pub(super) pos: usize,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Restore<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let shape = param.val().dims();
        let n: usize = shape.iter().product();
        let present = self.data[self.pos] > 0.0;
        let values: Vec<f32> = self.data[self.pos + 1..self.pos + 1 + n].to_vec();
        self.pos += 1 + n;
        self.grads.remove::<B::InnerBackend, D>(param.id);
        if present {
            let device = param.val().device();
            let t = Tensor::<B::InnerBackend, D>::from_data(TensorData::new(values, shape), &device);
            self.grads.register::<B::InnerBackend, D>(param.id, t);
        }
    }
}

/// Moves the gradients of a module's parameters from one set to another (those it has).
pub(super) struct MoveGrads<'a> {
    pub(super) from: &'a mut GradientsParams,
    pub(super) to: &'a mut GradientsParams,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for MoveGrads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.from.remove::<B::InnerBackend, D>(param.id) {
            self.to.register::<B::InnerBackend, D>(param.id, g);
        }
    }
}
