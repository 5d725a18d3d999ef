//! The compute backend, chosen at build time by cargo feature, in one place.
//!
//! | feature  | backend                                   |
//! |----------|-------------------------------------------|
//! | `flex`   | Burn's `Flex` CPU backend (the default)    |
//! | `ndarray`| Burn's `NdArray` CPU backend               |
//! | `wgpu`   | CubeCL on WebGPU/Vulkan (WGSL)             |
//! | `cuda`   | CubeCL on CUDA                             |
//!
//! When several are enabled the most specific wins: `cuda`, then `wgpu`, then `ndarray`, then
//! `flex` (so `--features cuda` works on top of the default features).

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;

use crate::error::{Result, TrainError};

#[cfg(feature = "cuda")]
mod chosen {
    /// The inference backend.
    pub type Backend = burn::backend::Cuda;
    /// Its name in reports.
    pub const NAME: &str = "cuda";
}

#[cfg(all(feature = "wgpu", not(feature = "cuda")))]
mod chosen {
    /// The inference backend.
    pub type Backend = burn::backend::Wgpu;
    /// Its name in reports.
    pub const NAME: &str = "wgpu";
}

#[cfg(all(feature = "ndarray", not(any(feature = "cuda", feature = "wgpu"))))]
mod chosen {
    /// The inference backend.
    pub type Backend = burn::backend::NdArray;
    /// Its name in reports.
    pub const NAME: &str = "ndarray";
}

#[cfg(all(feature = "flex", not(any(feature = "cuda", feature = "wgpu", feature = "ndarray"))))]
mod chosen {
    /// The inference backend.
    pub type Backend = burn::backend::Flex;
    /// Its name in reports.
    pub const NAME: &str = "flex";
}

#[cfg(not(any(feature = "flex", feature = "ndarray", feature = "wgpu", feature = "cuda")))]
compile_error!("disagmoe-train needs one backend feature: `flex` (default), `ndarray`, `wgpu` or `cuda`");

/// The backend for inference (no autodiff).
pub type DefaultBackend = chosen::Backend;
/// The backend for training (autodiff over [`DefaultBackend`]).
pub type TrainBackend = Autodiff<DefaultBackend>;
/// Name of the compiled-in backend (`flex`, `ndarray`, `wgpu` or `cuda`).
pub const BACKEND_NAME: &str = chosen::NAME;

/// A device of the compiled-in backend.
pub type Device = burn::tensor::Device<DefaultBackend>;

/// The device `spec` names on the compiled-in backend: `cpu` (flex, ndarray: their one device),
/// `cuda:N` (`cuda` alone: `cuda:0`), `wgpu:N` (`wgpu:0` or `wgpu` alone: WebGPU's default
/// adapter -- the first discrete GPU where there is one, else e.g. Mesa's lavapipe; `wgpu:N` for
/// N > 0: the N-th discrete GPU; `wgpu:cpu`: a CPU adapter).
pub fn parse_device(spec: &str) -> Result<Device> {
    let bad = |allowed: &str| {
        TrainError::option(
            "devices",
            format!("{spec:?} is not a device of the {BACKEND_NAME} backend (allowed: {allowed})"),
        )
    };
    let (kind, index) = match spec.split_once(':') {
        Some((k, i)) => (k, Some(i)),
        None => (spec, None),
    };
    let number = |i: Option<&str>| -> std::result::Result<usize, ()> { i.map_or(Ok(0), |i| i.parse().map_err(|_| ())) };
    #[cfg(feature = "cuda")]
    {
        let allowed = "cuda:N, cuda";
        return match (kind, number(index)) {
            ("cuda", Ok(n)) => Ok(burn::backend::cuda::CudaDevice::new(n)),
            _ => Err(bad(allowed)),
        };
    }
    #[cfg(all(feature = "wgpu", not(feature = "cuda")))]
    {
        use burn::backend::wgpu::WgpuDevice;
        let allowed = "wgpu:N, wgpu, wgpu:cpu";
        return match (kind, index, number(index)) {
            ("wgpu", Some("cpu"), _) => Ok(WgpuDevice::Cpu),
            ("wgpu", _, Ok(0)) => Ok(WgpuDevice::DefaultDevice),
            ("wgpu", _, Ok(n)) => Ok(WgpuDevice::DiscreteGpu(n)),
            _ => Err(bad(allowed)),
        };
    }
    #[cfg(not(any(feature = "cuda", feature = "wgpu")))]
    {
        let _ = number;
        match (kind, index) {
            ("cpu", None | Some("0")) => Ok(Default::default()),
            _ => Err(bad("cpu")),
        }
    }
}

/// The devices of a run: those `specs` name, or by default the backend's default device -- with
/// CUDA under an MPI launcher, the GPU of this process's node-local rank (modulo the node's GPUs).
pub fn run_devices(specs: &[String]) -> Result<Vec<Device>> {
    if !specs.is_empty() {
        return specs.iter().map(|s| parse_device(s)).collect();
    }
    #[cfg(feature = "cuda")]
    if let Some(rank) = crate::config::parallel::node_local_rank() {
        // Counting GPUs starts the driver: without one, the probe reports it in one line later.
        let gpus = std::panic::catch_unwind(|| DefaultBackend::device_count(0)).unwrap_or(1).max(1);
        return Ok(vec![burn::backend::cuda::CudaDevice::new(rank % gpus)]);
    }
    Ok(vec![Default::default()])
}

/// Keeps freed memory in the process instead of handing it back to the kernel after each tensor.
///
/// A training step on the CPU allocates and frees the same large activation buffers every step;
/// with glibc's defaults each buffer over its adaptive mmap threshold is a fresh mapping whose
/// pages the kernel zeroes on first touch (seen: a tenth of a step in page faults). Raising the
/// thresholds makes those buffers come from the heap again. Called once by the trainers; a no-op
/// off glibc.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            const MIB: libc::c_int = 1 << 20;
            // SAFETY: mallopt only changes allocator parameters; it is safe to call at any time.
            unsafe {
                libc::mallopt(libc::M_MMAP_THRESHOLD, 256 * MIB);
                libc::mallopt(libc::M_TRIM_THRESHOLD, 1024 * MIB);
                libc::mallopt(libc::M_TOP_PAD, 64 * MIB);
            }
        });
    }
}

/// Checks that backend `B` can compute on `device` here, by running one tiny operation; a GPU
/// backend without its driver or a device (cudarc cannot load `libcuda.so`, WebGPU finds no
/// adapter) fails with one line saying what is missing and how to train on the CPU instead, not a
/// worker thread's panic. Called before a run builds anything.
pub fn probe<B: Backend>(device: &B::Device) -> Result<()> {
    // Nothing the closure touches outlives a failed probe: the run stops with the error.
    probe_with(
        BACKEND_NAME,
        std::panic::AssertUnwindSafe(|| {
            let t = burn::tensor::Tensor::<B, 1>::from_floats([1.0, 2.0], device);
            (t * 2.0).into_data()
        }),
    )
}

/// Runs `op` and turns a panic in it into [`TrainError::NoDevice`] for `backend`, printing
/// nothing (see [`catch_quietly`]). A probe runs once, before any worker starts.
pub fn probe_with<R>(backend: &'static str, op: impl FnOnce() -> R + std::panic::UnwindSafe) -> Result<()> {
    catch_quietly(op).map(|_| ()).map_err(|reason| TrainError::NoDevice { backend, reason })
}

/// Runs `op`, a call into a library that panics where it should fail (a device runtime without its
/// driver, a Parquet reader on a damaged file), and turns a panic into its message, printing
/// nothing: the caller reports it as one line in its own words. The message is the first panic of
/// any thread while `op` runs (a device runtime fails in its own server thread; the caller then sees
/// only a closed channel), its first line, cut to its first sentence when long. The process's panic
/// hook is swapped for a silent one meanwhile (one call at a time), so use this only around such
/// calls, never around a run's workers.
pub fn catch_quietly<R>(op: impl FnOnce() -> R + std::panic::UnwindSafe) -> std::result::Result<R, String> {
    use std::sync::{Arc, Mutex};
    fn text(payload: &(dyn std::any::Any + Send)) -> String {
        let message = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("it failed without a message");
        let line = message.lines().find(|l| !l.trim().is_empty()).unwrap_or(message).trim();
        // A runtime's message may go on with every library it tried or a debug dump of its state:
        // keep the first sentence of a long one.
        let cut = [". ", " - ", ": "].iter().filter_map(|sep| line.get(20..)?.find(sep).map(|i| i + 20)).min();
        let short = match cut {
            Some(cut) if line.len() > 160 => &line[..cut],
            _ => line,
        };
        short.trim_end_matches('.').to_string()
    }
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _guard = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let first: Arc<Mutex<Option<String>>> = Arc::default();
    let previous = std::panic::take_hook();
    let seen = Arc::clone(&first);
    std::panic::set_hook(Box::new(move |info| {
        seen.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(|| text(info.payload()));
    }));
    let outcome = std::panic::catch_unwind(op);
    std::panic::set_hook(previous);
    outcome.map_err(|payload| {
        first.lock().unwrap_or_else(|e| e.into_inner()).take().unwrap_or_else(|| text(payload.as_ref()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_are_parsed_for_the_compiled_in_backend_and_others_refused() {
        let here = match BACKEND_NAME {
            "cuda" => "cuda:0",
            "wgpu" => "wgpu:0",
            _ => "cpu",
        };
        assert_eq!(run_devices(&[here.to_string(), here.to_string()]).unwrap().len(), 2);
        assert_eq!(run_devices(&[]).unwrap().len(), 1, "default: one device");
        for other in ["tpu:0", "cuda:x", "wgpu:-1"] {
            let err = parse_device(other).unwrap_err().to_string();
            assert!(err.contains("allowed") && err.contains(other), "{other}: {err}");
        }
    }

    #[test]
    fn a_backend_that_cannot_start_is_one_line_naming_it_and_the_cpu_way() {
        probe::<DefaultBackend>(&Default::default()).expect("the CPU backend computes here");
        // The device runtime fails in a thread of its own; the caller sees a closed channel.
        let e = probe_with("cuda", || {
            let server = std::thread::spawn(|| {
                panic!(
                    "Unable to dynamically load the \"cuda\" shared library - searched for library names: {:?}.\nmore",
                    ["libcuda.so"; 20]
                )
            });
            let channel: std::result::Result<(), &str> = server.join().map_err(|_| "RecvError");
            channel.unwrap()
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("no usable cuda device: Unable to dynamically load the \"cuda\" shared library. "), "{e}");
        assert!(!e.contains("searched"), "{e}");
        assert!(
            e.contains("without --features cuda")
                && !e.contains('\n')
                && !e.contains("more")
                && !e.contains("RecvError"),
            "{e}"
        );
    }
}
