//! The architecture is enforced, not only written (ARCHITECTURE.md): the dependency graph that
//! `cargo metadata` resolves must keep the planner free of tensor libraries and the models free of
//! transports, transitively.

use std::collections::{BTreeSet, HashMap};
use std::process::Command;

use serde_json::Value;

/// Names of every package the named workspace crate depends on, transitively, through normal (and
/// build) dependencies.
fn dependencies(metadata: &Value, krate: &str) -> BTreeSet<String> {
    reachable_outside(metadata, krate, &[])
}

/// Names of the packages reachable from the named workspace crate through normal (and build)
/// dependencies without passing through a package whose name starts with one of `walls` (those
/// are left out, with all they bring): the crate's own graph outside them.
fn reachable_outside(metadata: &Value, krate: &str, walls: &[&str]) -> BTreeSet<String> {
    let packages: HashMap<&str, &str> = metadata["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["id"].as_str().unwrap(), p["name"].as_str().unwrap()))
        .collect();
    let nodes: HashMap<&str, &Value> =
        metadata["resolve"]["nodes"].as_array().unwrap().iter().map(|n| (n["id"].as_str().unwrap(), n)).collect();
    let root = packages.iter().find(|(_, name)| **name == krate).map(|(id, _)| *id).expect("crate in the workspace");
    let mut seen = BTreeSet::new();
    let mut stack = vec![root];
    while let Some(id) = stack.pop() {
        for dep in nodes[id]["deps"].as_array().unwrap() {
            let normal =
                dep["dep_kinds"].as_array().unwrap().iter().any(|k| k["kind"].is_null() || k["kind"] == "build");
            let pkg = dep["pkg"].as_str().unwrap();
            let name = packages[pkg];
            if normal && !walls.iter().any(|w| name.starts_with(w)) && seen.insert(name.to_string()) {
                stack.push(pkg);
            }
        }
    }
    seen
}

/// Names of the dependencies a workspace crate declares (any kind, any feature).
fn declared(metadata: &Value, krate: &str) -> BTreeSet<String> {
    let pkg = metadata["packages"].as_array().unwrap().iter().find(|p| p["name"] == krate).expect("crate");
    pkg["dependencies"].as_array().unwrap().iter().map(|d| d["name"].as_str().unwrap().to_string()).collect()
}

/// The platform this test runs on (`rustc -vV`'s host), for `--filter-platform`.
fn host() -> String {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let out = Command::new(rustc).arg("-vV").output().expect("rustc -vV runs");
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines().find_map(|l| l.strip_prefix("host: ")).expect("rustc -vV names its host").trim().to_string()
}

/// The workspace's resolved graph on this platform with every feature on (what a
/// `--features nccl,wgpu` build sees), exactly as the lock file pins it.
///
/// Not `--offline`: the packages of features this build did not use (the CUDA and NCCL crates)
/// were never fetched, and `cargo metadata` needs their manifests, so it fetches them, as `cargo
/// build` would (a fresh clone runs the README's test command and nothing else first).
fn metadata() -> Value {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let platform = host();
    let args = ["metadata", "--format-version", "1", "--locked", "--all-features", "--filter-platform", &platform];
    let out =
        Command::new(cargo).args(args).current_dir(env!("CARGO_MANIFEST_DIR")).output().expect("cargo metadata runs");
    assert!(out.status.success(), "cargo metadata: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn the_planner_depends_on_no_tensor_library_and_the_models_on_no_transport() {
    // With every feature on, the planner still pulls in no tensor or device crate.
    let all = metadata();
    let core = dependencies(&all, "disagmoe-core");
    // (`ndarray` comes in with the LP solver's sparse matrices, a numerical array, not a tensor
    // library with devices or autodiff.)
    let tensor = ["burn", "cubecl", "cubek", "tch", "candle", "torch", "wgpu", "cudarc", "mpi", "nccl"];
    let bad: Vec<&String> = core.iter().filter(|d| tensor.iter().any(|t| d.starts_with(t))).collect();
    assert!(bad.is_empty(), "disagmoe-core must not depend on tensor or device crates, found {bad:?}");
    assert!(!core.iter().any(|d| d.starts_with("disagmoe")), "disagmoe-core depends on no other workspace crate");

    // The models and the kernels under them never communicate. Transitively, in the whole graph
    // with every feature of the workspace on (Burn's backends unified as a `--features nccl,wgpu`
    // build has them): no transport of ours anywhere; and no crate that can carry bytes between
    // processes or hosts in their own graph outside Burn and CubeCL. (Inside those there are:
    // `bincode`, Burn's record format; `cudarc` with the NCCL bindings CubeCL's CUDA runtime
    // switches on; `reqwest`/`tokio`, CubeCL's CPU runtime fetching LLVM at build time. The
    // models call none of them.)
    let transport = ["mpi", "mpi-sys", "mpi-derive", "disagmoe-train", "zmq", "nccl", "nccl-sys"];
    let networked = ["bincode", "cudarc", "tokio", "reqwest", "hyper", "h2", "quinn", "tonic", "mio", "socket2"];
    let walls = ["burn", "cubecl", "cubek"];
    for krate in ["disagmoe-models", "disagmoe-kernels"] {
        let graph = dependencies(&all, krate);
        let bad: Vec<&String> = graph.iter().filter(|d| transport.contains(&d.as_str())).collect();
        assert!(bad.is_empty(), "{krate} must have no transport crate in its graph, found {bad:?}");
        let own = reachable_outside(&all, krate, &walls);
        let bad: Vec<&String> =
            own.iter().filter(|d| networked.contains(&d.as_str()) || transport.contains(&d.as_str())).collect();
        assert!(bad.is_empty(), "{krate} reaches {bad:?} outside Burn and CubeCL");
        assert!(own.len() < graph.len(), "{krate}: the walls leave out what Burn brings");
    }
    // The check sees the whole graph: Burn's CUDA runtime is in it, and the crates it brings.
    let models = dependencies(&all, "disagmoe-models");
    assert!(models.contains("cubecl-cuda") && models.contains("cudarc"), "the check sees the whole graph");
    assert!(declared(&all, "disagmoe-models").contains("burn"), "the check sees the models' real dependencies");
    assert!(
        !declared(&all, "disagmoe-kernels").iter().any(|d| d.starts_with("disagmoe-")),
        "the kernels know no workspace crate"
    );
}
