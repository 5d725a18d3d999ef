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
