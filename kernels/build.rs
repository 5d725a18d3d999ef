// The CubeCL tests need a Vulkan driver (Mesa's lavapipe on a CPU machine): see build-support/probe.rs.
include!("../build-support/probe.rs");

fn main() {
    probe(&["vulkan"]);
}
