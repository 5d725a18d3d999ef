//! The exchange's payloads as the worker makes and takes them: on the host ([`HostTensor`], what
//! a process transport carries), or left on the device that computed them ([`OnDevice`], a
//! [`DeviceRows`] of the worker's backend) when the run's workers share one device in one process
//! (`--exchange-payloads`, see `crate::config::parallel::ExchangePayloads`).
//!
//! Every payload value copied out of a backend's tensor into host memory is counted, on the thread
//! of the worker that copies it ([`host_bytes`]): the summary's `payload_host_bytes`, 0 when the
//! payloads stay on the device.

use std::any::Any;
use std::cell::Cell;
use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, IndexingUpdateOp, Int, Tensor, TensorData};

use disagmoe_core::exchange::ExchangeDtype;

#[cfg(any(feature = "mpi", feature = "cuda"))]
use crate::runtime::msg::DeviceBytes;
#[cfg(feature = "mpi")]
use crate::runtime::msg::{DeviceAlloc, RemoteShape};
use crate::runtime::msg::{DeviceRows, DeviceTensor, HostTensor, Packed};

thread_local! {
    static HOST_BYTES: Cell<u64> = const { Cell::new(0) };
}

/// Payload bytes this thread has copied from a backend's tensors to the host so far.
pub(super) fn host_bytes() -> u64 {
    HOST_BYTES.with(Cell::get)
}

fn count_host(bytes: usize) {
    HOST_BYTES.with(|c| c.set(c.get() + bytes as u64));
}

/// A tensor's values on the host, as f32, counted as payload bytes read back.
pub(super) fn read_back<I: Backend, const D: usize>(t: Tensor<I, D>) -> HostTensor {
    let data = t.into_data();
    count_host(data.bytes.len());
    let data = data.convert::<f32>();
    HostTensor { shape: data.shape.clone().into(), data: data.to_vec::<f32>().expect("f32 tensor") }
}

/// A tensor of the worker's backend `I` (the backend under autodiff) left on its device.
pub(super) struct OnDevice<I: Backend> {
    t: Tensor<I, 2>,
    /// Whether a bf16 payload is cast on the device (else it is packed on the host): on a GPU
    /// backend that holds bf16, whose conversion rounds to nearest even. Burn's CPU backend
    /// converts through f64 with `half`'s `bf16::from_f64`, which drops the f64's low 32 bits
    /// before rounding (ties decided without them): not the host packing's bits, so not used.
    bf16: bool,
}

impl<I: Backend> OnDevice<I> {
    /// `t` as a payload.
    pub(super) fn wrap(t: Tensor<I, 2>) -> DeviceTensor {
        let bf16 = disagmoe_kernels::device_backend::<I>() && I::supports_dtype(&t.device(), DType::BF16);
        Self::with(t, bf16)
    }

    fn with(t: Tensor<I, 2>, bf16: bool) -> DeviceTensor {
        DeviceTensor { shape: t.dims(), rows: Arc::new(OnDevice { t, bf16 }) }
    }

    fn like(&self, t: Tensor<I, 2>) -> DeviceTensor {
        Self::with(t, self.bf16)
    }

    /// The tensor of a payload made by a worker of this backend.
    pub(super) fn tensor(p: &DeviceTensor) -> Tensor<I, 2> {
        p.rows
            .as_any()
            .downcast_ref::<OnDevice<I>>()
            .expect("the payloads of a run are tensors of its one backend")
            .t
            .clone()
    }

    fn index(&self, rows: &[u32]) -> Tensor<I, 1, Int> {
        super::autodiff::index::<I>(rows, &self.t.device())
    }
}

impl<I: Backend> DeviceRows for OnDevice<I> {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn elem_bytes(&self) -> usize {
        self.t.dtype().size()
    }

    fn select(&self, rows: &[u32]) -> DeviceTensor {
        self.like(self.t.clone().select(0, self.index(rows)))
    }

    fn add(&self, other: &DeviceTensor) -> DeviceTensor {
        self.like(self.t.clone() + Self::tensor(other))
    }

    fn add_rows(&self, rows: &[u32], values: &DeviceTensor) -> DeviceTensor {
        let t = self.t.clone().select_assign(0, self.index(rows), Self::tensor(values), IndexingUpdateOp::Add);
        self.like(t)
    }

    fn zeros(&self, shape: [usize; 2]) -> DeviceTensor {
        self.like(Tensor::zeros(shape, &self.t.device()))
    }

    fn upload(&self, h: &HostTensor) -> DeviceTensor {
        self.like(Tensor::from_data(TensorData::new(h.data.clone(), h.shape.clone()), &self.t.device()))
    }

    fn pack(&self, dtype: ExchangeDtype) -> Packed {
        match dtype {
            ExchangeDtype::F32 => Packed::Device(self.like(self.t.clone())),
            ExchangeDtype::Bf16 if self.bf16 => Packed::Device(self.like(self.t.clone().cast(DType::BF16))),
            // fp8 (and bf16 on a device without it) is packed on the host, as for a wire.
            _ => Packed::F32(self.to_host()).pack(dtype),
        }
    }

    fn own(&self) -> DeviceTensor {
        // A new buffer either way (`x * 1` is `x` exactly, signed zeros and all): the shared one
        // is never touched again once this returns.
        let copy = match self.t.dtype() {
            DType::F32 => self.t.clone().mul_scalar(1.0),
            _ => self.t.clone().cast(DType::F32),
        };
        if let Err(e) = I::sync(&copy.device()) {
            // The run's next read of the device reports it where it can be handled.
            tracing::warn!("a device sync after taking a payload failed: {e:?}");
        }
        self.like(copy)
    }

    fn to_host(&self) -> HostTensor {
        read_back(self.t.clone())
    }

    #[cfg(feature = "cuda")]
    fn device_bytes(&self) -> Option<std::result::Result<DeviceBytes, String>> {
        disagmoe_kernels::cube::raw::cuda_buffer(&self.t)
            .map(|r| r.map(|b| DeviceBytes { ptr: b.ptr, bytes: b.bytes, keep: Box::new(b) }))
    }
}

/// New payloads on a worker's device, for a transport to write into (CUDA only).
#[cfg(feature = "mpi")]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Alloc<I: Backend> {
    device: I::Device,
}

#[cfg(feature = "mpi")]
impl<I: Backend> DeviceAlloc for Alloc<I> {
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    fn alloc(&self, shape: &RemoteShape) -> std::result::Result<(DeviceTensor, DeviceBytes), String> {
        let dtype = if shape.elem_bytes == 2 { DType::BF16 } else { DType::F32 };
        #[cfg(feature = "cuda")]
        if let Some(made) = disagmoe_kernels::cube::raw::cuda_empty::<I>(shape.shape, dtype, &self.device) {
            let (t, b) = made?;
            return Ok((OnDevice::wrap(t), DeviceBytes { ptr: b.ptr, bytes: b.bytes, keep: Box::new(b) }));
        }
        Err(format!(
            "no device memory to receive a {dtype:?} payload of {:?} into (the run's backend is not CUDA)",
            shape.shape
        ))
    }

    fn cuda_ordinal(&self) -> Option<usize> {
        #[cfg(feature = "cuda")]
        return disagmoe_kernels::cube::raw::cuda_ordinal::<I>(&self.device);
        #[cfg(not(feature = "cuda"))]
        None
    }
}

/// What a transport that moves device payloads itself allocates them with on `device` of the
/// worker's backend `B` (`None` unless it is the CUDA backend).
#[cfg(feature = "mpi")]
pub(crate) fn device_alloc<B: burn::tensor::backend::AutodiffBackend>(
    device: &B::Device,
) -> Option<Arc<dyn DeviceAlloc>> {
    disagmoe_kernels::device_backend::<B>()
        .then(|| Arc::new(Alloc::<B::InnerBackend> { device: device.clone() }) as Arc<dyn DeviceAlloc>)
}
