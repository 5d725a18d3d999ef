//! Clusters of several node kinds: a [`MixedCluster`] is a list of [`Pool`]s, each a set of
//! identical nodes (a GPU, GPUs and NICs per node, NIC bandwidth, a node count), plus the
//! bandwidth between pools.
//!
//! Spelled on the command line as pools joined by `+`, each pool a cluster preset with an
//! optional NIC count: `h100x8+h20x8`, `h800x8+a100x8`, `h100x8+h100x8-4nic` (the second pool's
//! nodes have 4 NICs instead of 8). [`MIX_PRESETS`] names three mixes; a file of one's own is a
//! TOML or JSON file holding a serialised [`MixedCluster`] (`pools = [...]`). The GPU and node
//! figures are the presets' ([`GpuSpec::preset`], [`NodeSpec::preset`], sources there).
//!
//! The planner ([`crate::heterogeneous`]) gives each side of the disaggregated placement a pool
//! (attention on one kind, experts on another, or both on one pool), and places the baselines,
//! whose GPUs all play the same role, on [`MixedCluster::slowest`]: every GPU as fast as the
//! slowest kind, because the slowest rank sets the pace of a synchronous step.

use crate::error::{check_nonzero, check_positive, invalid, CoreError, Result};
use crate::hardware::{read_toml_or_json, Cluster, GpuSpec, NodeSpec};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Mixes with a name: the first pool compute-rich, the second memory- or network-rich.
/// - `h100+h20`: 8 nodes of 8 H100 and 8 nodes of 8 H20 (989 vs 148 dense bf16 TFLOPS, 3.35 vs
///   4.0 TB/s, 80 vs 96 GB), the pairing MegaScale-Infer serves with.
/// - `h800+a100`: 8 nodes of 8 H800 and 8 of 8 A100 (an older generation kept in service).
/// - `h100-8nic+h100-4nic`: 8 H100 nodes with 8 x 400 Gb/s NICs and 8 with 4.
pub const MIX_PRESETS: &[(&str, &str)] =
    &[("h100+h20", "h100x8+h20x8"), ("h800+a100", "h800x8+a100x8"), ("h100-8nic+h100-4nic", "h100x8+h100x8-4nic")];

/// One kind of node, `nodes` of them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Pool {
    /// Name, e.g. `h100x8`.
    pub name: String,
    /// The accelerator.
    pub gpu: GpuSpec,
    /// The node.
    pub node: NodeSpec,
    /// Number of nodes.
    pub nodes: usize,
}

/// A cluster of several node kinds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MixedCluster {
    /// Name, e.g. `h100x8+h20x8`.
    pub name: String,
    /// The pools, at least two.
    pub pools: Vec<Pool>,
    /// Bandwidth between two pools, bytes/s per direction, shared by all the traffic between them
    /// (absent: one fabric, where each node's NICs are the limit).
    #[serde(default)]
    pub pool_link_bandwidth: Option<f64>,
}

impl Pool {
    /// The pool as a cluster of its own.
    pub fn cluster(&self) -> Cluster {
        Cluster { name: self.name.clone(), gpu: self.gpu.clone(), node: self.node.clone(), nodes: self.nodes }
    }

    /// GPUs in the pool.
    pub fn gpus(&self) -> usize {
        self.nodes * self.node.gpus_per_node
    }

    /// `<gpu>x<nodes>` with an optional `-<k>nic`: a cluster preset whose nodes have `k` NICs.
    fn parse(spec: &str) -> Result<Self> {
        let lower = spec.to_ascii_lowercase();
        let (base, nics) = match lower.rsplit_once('-') {
            Some((base, tail)) if tail.ends_with("nic") => {
                let k: usize = tail.trim_end_matches("nic").parse().map_err(|_| {
                    invalid("cluster pool", spec, "<gpu>x<nodes> or <gpu>x<nodes>-<k>nic, e.g. h100x8-4nic")
                })?;
                check_nonzero("cluster pool NICs per node", k)?;
                (base.to_string(), Some(k))
            }
            _ => (lower.clone(), None),
        };
        let c = Cluster::preset(&base)?;
        let mut node = c.node;
        if let Some(k) = nics {
            node.nics_per_node = k;
        }
        Ok(Self { name: lower, gpu: c.gpu, node, nodes: c.nodes })
    }
}

impl MixedCluster {
    /// A mix preset ([`MIX_PRESETS`]) or pools joined by `+` (`h100x8+h20x8`).
    pub fn preset(name: &str) -> Result<Self> {
        let lower = name.to_ascii_lowercase();
        let spelled = MIX_PRESETS.iter().find(|(n, _)| *n == lower).map_or(lower.as_str(), |(_, s)| *s);
        let parts: Vec<&str> = spelled.split('+').collect();
        if parts.len() >= 2 && parts.iter().any(|p| p.trim().is_empty()) {
            return Err(invalid(
                "cluster",
                name,
                "pools joined by '+', none empty, each <gpu>x<nodes>[-<k>nic], e.g. h100x8+h20x8",
            ));
        }
        if parts.len() < 2 {
            return Err(CoreError::UnknownPreset {
                kind: "mixed cluster",
                name: name.to_string(),
                known: format!(
                    "{}, or pools joined by '+', each <gpu>x<nodes>[-<k>nic], e.g. h100x8+h20x8",
                    MIX_PRESETS.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
                ),
            });
        }
        let pools = parts.iter().map(|p| Pool::parse(p)).collect::<Result<Vec<_>>>()?;
        let mixed = Self { name: spelled.to_string(), pools, pool_link_bandwidth: None };
        mixed.validate()?;
        Ok(mixed)
    }

    /// Whether `spec` names a mixed cluster (a mix preset, pools joined by `+`, or a file with
    /// `pools`) rather than a cluster of identical nodes.
    pub fn is_mixed(spec: &str) -> bool {
        let path = Path::new(spec);
        if path.is_file() {
            // A file is mixed when it has a top-level `pools` (one that does not parse is left to
            // the plain cluster's reader, whose error names the file).
            return read_toml_or_json::<serde_json::Value>(path).is_ok_and(|v| v.get("pools").is_some());
        }
        spec.contains('+') || MIX_PRESETS.iter().any(|(n, _)| n.eq_ignore_ascii_case(spec))
    }

    /// A preset or a path to a `.toml` / `.json` file holding a [`MixedCluster`].
    pub fn from_preset_or_file(spec: &str) -> Result<Self> {
        if Path::new(spec).is_file() || (!spec.contains('+') && (spec.ends_with(".toml") || spec.ends_with(".json"))) {
            Self::from_file(Path::new(spec))
        } else {
            Self::preset(spec)
        }
    }

    /// Reads and validates a mixed-cluster file (TOML if the name ends in `.toml`, JSON otherwise).
    pub fn from_file(path: &Path) -> Result<Self> {
        let mixed: MixedCluster = read_toml_or_json(path)?;
        mixed.validate()?;
        Ok(mixed)
    }

    /// Checks every pool as a cluster and the link; the error names the pool and the field.
    pub fn validate(&self) -> Result<()> {
        if self.pools.len() < 2 {
            return Err(invalid(
                "cluster.pools",
                self.pools.len(),
                "at least 2 pools (one kind of node is a plain cluster: --cluster <gpu>x<nodes>)",
            ));
        }
        for (i, pool) in self.pools.iter().enumerate() {
            pool.cluster().validate().map_err(|e| match e {
                CoreError::InvalidField { field, value, allowed } => CoreError::InvalidField {
                    field: field.replacen("cluster.", &format!("cluster.pools[{i}]."), 1),
                    value,
                    allowed,
                },
                other => other,
            })?;
        }
        if let Some(bw) = self.pool_link_bandwidth {
            check_positive("cluster.pool_link_bandwidth", bw)?;
        }
        Ok(())
    }

    /// GPUs in the cluster.
    pub fn total_gpus(&self) -> usize {
        self.pools.iter().map(Pool::gpus).sum()
    }

    /// The whole cluster with every GPU, node and NIC as slow and as small as the slowest kind's
    /// (each figure the pools' minimum, the latency their maximum, the smallest node size; GPUs
    /// beyond a whole number of such nodes are left out): what a schedule whose GPUs all play the
    /// same role runs at, since a synchronous step waits for its slowest rank. A
    /// `pool_link_bandwidth` is not applied to it (its traffic is modelled on NICs only).
    pub fn slowest(&self) -> Cluster {
        let min = |f: &dyn Fn(&Pool) -> f64| self.pools.iter().map(f).fold(f64::INFINITY, f64::min);
        let node_size = self.pools.iter().map(|p| p.node.gpus_per_node).min().unwrap_or(1);
        let nics_per_gpu = min(&|p| p.node.nics_per_node as f64 / p.node.gpus_per_node as f64);
        let gpu = GpuSpec {
            name: format!("slowest of {}", self.name),
            peak_bf16_flops: min(&|p| p.gpu.peak_bf16_flops),
            hbm_bandwidth: min(&|p| p.gpu.hbm_bandwidth),
            hbm_bytes: min(&|p| p.gpu.hbm_bytes),
            compute_efficiency: min(&|p| p.gpu.compute_efficiency),
            hbm_efficiency: min(&|p| p.gpu.hbm_efficiency),
            usable_memory_fraction: min(&|p| p.gpu.usable_memory_fraction),
        };
        let node = NodeSpec {
            gpus_per_node: node_size,
            nvlink_bandwidth: min(&|p| p.node.nvlink_bandwidth),
            nics_per_node: ((nics_per_gpu * node_size as f64).round() as usize).max(1),
            nic_bandwidth: min(&|p| p.node.nic_bandwidth),
            network_efficiency: min(&|p| p.node.network_efficiency),
            latency_s: self.pools.iter().map(|p| p.node.latency_s).fold(0.0, f64::max),
        };
        Cluster { name: format!("{} (as its slowest)", self.name), gpu, node, nodes: self.total_gpus() / node_size }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mixes_parse_from_presets_and_pools() {
        let m = MixedCluster::preset("h100+h20").unwrap();
        assert_eq!(m.pools.len(), 2);
        assert_eq!((m.pools[0].gpu.name.as_str(), m.pools[1].gpu.name.as_str()), ("H100", "H20"));
        assert_eq!(m.total_gpus(), 128);
        let n = MixedCluster::preset("h100x8+h100x4-4nic").unwrap();
        assert_eq!((n.pools[1].nodes, n.pools[1].node.nics_per_node), (4, 4));
        assert!(MixedCluster::is_mixed("h100x8+h20x8") && MixedCluster::is_mixed("h800+a100"));
        assert!(!MixedCluster::is_mixed("h800x16"));
        let e = MixedCluster::preset("h100x8").unwrap_err().to_string();
        assert!(e.contains("h100+h20") && e.contains("'+'"), "{e}");
        for empty in ["+", "h100x8+", "h100x8++h20x8"] {
            let e = MixedCluster::preset(empty).unwrap_err().to_string();
            assert!(e.contains("none empty"), "{empty}: {e}");
        }
        let e = MixedCluster::preset("h100x8+h100x8-0nic").unwrap_err().to_string();
        assert!(e.contains("NICs"), "{e}");
        assert!(MixedCluster::preset("h100x8+v100x8").unwrap_err().to_string().contains("h800"));
    }

    #[test]
    fn the_slowest_cluster_takes_every_figure_from_the_slowest_pool() {
        let m = MixedCluster::preset("h100x8+h20x8").unwrap();
        let s = m.slowest();
        assert_eq!(s.total_gpus(), 128);
        assert_eq!(s.gpu.peak_bf16_flops, m.pools[1].gpu.peak_bf16_flops);
        assert_eq!(s.gpu.hbm_bandwidth, m.pools[0].gpu.hbm_bandwidth);
        assert_eq!(s.gpu.hbm_bytes, m.pools[0].gpu.hbm_bytes);
        let n = MixedCluster::preset("h100-8nic+h100-4nic").unwrap().slowest();
        assert_eq!(n.node.nics_per_node, 4);
    }

    #[test]
    fn mixed_cluster_files_round_trip_and_name_the_bad_pool() {
        let dir = std::env::temp_dir().join(format!("disagmoe-pools-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut m = MixedCluster::preset("h800+a100").unwrap();
        m.pool_link_bandwidth = Some(400e9);
        let t = dir.join("m.toml");
        std::fs::write(&t, toml::to_string(&m).unwrap()).unwrap();
        assert!(MixedCluster::is_mixed(t.to_str().unwrap()));
        // A plain cluster file is not mixed, whatever its path or its text holds.
        let plain = dir.join("a+b.json");
        std::fs::write(&plain, serde_json::to_string(&m.pools[0].cluster()).unwrap().replace("h800x8", "pools"))
            .unwrap();
        assert!(!MixedCluster::is_mixed(plain.to_str().unwrap()));
        assert_eq!(MixedCluster::from_preset_or_file(t.to_str().unwrap()).unwrap(), m);
        let mut bad = m.clone();
        bad.pools[1].gpu.compute_efficiency = 0.0;
        let j = dir.join("m.json");
        std::fs::write(&j, serde_json::to_string(&bad).unwrap()).unwrap();
        let e = MixedCluster::from_file(&j).unwrap_err().to_string();
        assert!(e.contains("pools[1]") && e.contains("compute_efficiency"), "{e}");
        bad.pools.truncate(1);
        assert!(bad.validate().unwrap_err().to_string().contains("at least 2 pools"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
