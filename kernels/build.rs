// The CubeCL tests need a Vulkan driver (Mesa's lavapipe on a CPU machine), the f16 ones a driver
// with f16 (vulkaninfo tells): see build-support/probe.rs.
include!("../build-support/probe.rs");

fn main() {
    probe(&["vulkan", "f16"]);
}
