// The MPI transport's tests need `mpirun`: see build-support/probe.rs.
include!("build-support/probe.rs");

fn main() {
    probe(&["mpi"]);
}
