// Training through the CubeCL kernels needs a Vulkan driver: see build-support/probe.rs.
include!("../build-support/probe.rs");

fn main() {
    probe(&["vulkan"]);
}
