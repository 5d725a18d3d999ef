// The MPI transport's tests need `mpirun`, and the one over a real network root and iproute2: see
// build-support/probe.rs.
include!("build-support/probe.rs");

fn main() {
    probe(&["mpi", "netns"]);
}
