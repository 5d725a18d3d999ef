//! A CUDA tensor's device memory for a library that reads or writes it in place (NCCL's grouped
//! sends and receives): its address, with the tensor that keeps the memory alive. Only Burn's
//! CubeCL backend on CUDA has one (`CudaCube`, not under autodiff); every other backend gets
//! `None`.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Shape, Tensor, TensorPrimitive};
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cubecl::Runtime;

use super::{kind_of, CudaCube};
use crate::{cast, Kind};

/// The CUDA device ordinal of `device` when `B` is the CUDA backend (plain or under autodiff).
pub fn cuda_ordinal<B: Backend>(device: &B::Device) -> Option<usize> {
    kind_of::<B, CudaCube>()?;
    let device: <CudaRuntime as Runtime>::Device = cast(device.clone());
    Some(device.index)
}

/// Device memory holding a tensor's values, contiguous, and the tensor that owns it.
pub struct RawBuffer {
    /// The device address of the first value.
    pub ptr: u64,
    /// Bytes of the values.
    pub bytes: usize,
    _owner: CubeTensor<CudaRuntime>,
}

fn resource(t: &CubeTensor<CudaRuntime>) -> Result<u64, String> {
    t.client.get_resource(t.handle.clone()).map(|r| r.resource().ptr).map_err(|e| format!("{e:?}"))
}

/// The values of `t` in device memory, contiguous, finished on the calling thread's stream (so
/// another stream may read them); `None` unless `B` is the plain CUDA backend.
pub fn cuda_buffer<B: Backend>(t: &Tensor<B, 2>) -> Option<Result<RawBuffer, String>> {
    if kind_of::<B, CudaCube>() != Some(Kind::Plain) {
        return None;
    }
    let t: Tensor<CudaCube, 2> = cast(t.clone());
    let prim = burn_cubecl::kernel::into_contiguous(t.into_primitive().tensor());
    Some((|| {
        cubecl::future::block_on(prim.client.sync()).map_err(|e| format!("{e:?}"))?;
        let bytes = prim.meta.shape().num_elements() * prim.dtype.size();
        Ok(RawBuffer { ptr: resource(&prim)?, bytes, _owner: prim })
    })())
}

/// A new `[rows, cols]` tensor of `dtype` on `device` whose memory is allocated (its values not
/// set) and ready for another stream to write, with that memory; `None` unless `B` is the plain
/// CUDA backend.
pub fn cuda_empty<B: Backend>(
    shape: [usize; 2],
    dtype: DType,
    device: &B::Device,
) -> Option<Result<(Tensor<B, 2>, RawBuffer), String>> {
    if kind_of::<B, CudaCube>() != Some(Kind::Plain) {
        return None;
    }
    let device: <CudaRuntime as Runtime>::Device = cast(device.clone());
    Some((|| {
        let client = CudaRuntime::client(&device);
        let bytes = shape[0] * shape[1] * dtype.size();
        let handle = client.empty(bytes.max(1));
        cubecl::future::block_on(client.sync()).map_err(|e| format!("{e:?}"))?;
        let prim = CubeTensor::new_contiguous(client, device, Shape::new(shape), handle, dtype);
        let ptr = resource(&prim)?;
        let tensor: Tensor<CudaCube, 2> = Tensor::from_primitive(TensorPrimitive::Float(prim.clone()));
        Ok((cast(tensor), RawBuffer { ptr, bytes, _owner: prim }))
    })())
}
