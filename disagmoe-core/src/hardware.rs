//! Hardware descriptions: a GPU, a node (GPUs, NVLink, NICs) and a cluster of identical nodes.
//!
//! Cluster presets are named `<gpu>x<nodes>` with 8 GPUs and 8 NICs per node, e.g. `h800x16` (the
//! paper's 16 x 8 H800 cluster) or `h200x4`. A cluster of one's own is a TOML or JSON file holding a
//! serialised [`Cluster`]; see [`Cluster::from_file`].
//!
//! All rates are per direction, in bytes or FLOPs per second. The `*_efficiency` fields are the
//! fraction of the peak a well-tuned kernel or transfer reaches; the cost model multiplies peaks by
//! them, so they are where a user calibrates the model against measurements.

use crate::error::{check_nonzero, check_positive, invalid, CoreError, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// One accelerator.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuSpec {
    /// Marketing name, e.g. `H800`.
    pub name: String,
    /// Peak dense bf16 tensor-core throughput, FLOP/s (no sparsity).
    pub peak_bf16_flops: f64,
    /// Peak HBM bandwidth, bytes/s.
    pub hbm_bandwidth: f64,
    /// HBM capacity, bytes.
    pub hbm_bytes: f64,
    /// Fraction of `peak_bf16_flops` reached by large GEMMs and flash attention (0, 1].
    #[serde(default = "default_compute_eff")]
    pub compute_efficiency: f64,
    /// Fraction of `hbm_bandwidth` reached by streaming kernels (0, 1].
    #[serde(default = "default_hbm_eff")]
    pub hbm_efficiency: f64,
    /// Fraction of `hbm_bytes` usable by the framework (the rest: CUDA context, NCCL buffers,
    /// fragmentation) (0, 1].
    #[serde(default = "default_usable_memory")]
    pub usable_memory_fraction: f64,
}

/// One node: GPUs joined by NVLink, plus NICs into the inter-node network.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeSpec {
    /// GPUs per node.
    pub gpus_per_node: usize,
    /// NVLink bandwidth per GPU per direction, bytes/s.
    pub nvlink_bandwidth: f64,
    /// Network interface cards per node (any GPU of the node may use any of them, PXN-style).
    pub nics_per_node: usize,
    /// Bandwidth of one NIC per direction, bytes/s.
    pub nic_bandwidth: f64,
    /// Fraction of NIC and NVLink bandwidth reached by bulk transfers (0, 1].
    #[serde(default = "default_network_eff")]
    pub network_efficiency: f64,
    /// Fixed latency of one message or collective step, seconds.
    #[serde(default = "default_latency")]
    pub latency_s: f64,
}

/// A cluster of identical nodes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cluster {
    /// Name, e.g. `h800x16`.
    pub name: String,
    /// The accelerator.
    pub gpu: GpuSpec,
    /// The node.
    pub node: NodeSpec,
    /// Number of nodes.
    pub nodes: usize,
}

/// A serialised description from a file: TOML if the name ends in `.toml`, JSON otherwise; the
/// error names the file.
pub(crate) fn read_toml_or_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| CoreError::Io { path: shown.clone(), source })?;
    if path.extension().is_some_and(|e| e == "toml") {
        toml::from_str(&text).map_err(|e| CoreError::Toml { path: shown, message: e.to_string() })
    } else {
        serde_json::from_str(&text).map_err(|source| CoreError::Json { path: shown, source })
    }
}

fn default_compute_eff() -> f64 {
    0.6
}
fn default_hbm_eff() -> f64 {
    0.8
}
fn default_usable_memory() -> f64 {
    0.9
}
fn default_network_eff() -> f64 {
    0.8
}
fn default_latency() -> f64 {
    10e-6
}

const GB: f64 = 1e9;
const TFLOPS: f64 = 1e12;

/// GPU names with a built-in [`GpuSpec`].
pub const GPU_PRESETS: &[&str] = &["h800", "h100", "h200", "a100", "h20"];

impl GpuSpec {
    /// Built-in spec for `h800`, `h100`, `h200`, `a100` or `h20` (SXM, dense bf16,
    /// 80/80/141/80/96 GB).
    pub fn preset(name: &str) -> Result<Self> {
        // Sources (dense bf16, i.e. half the datasheets' "with sparsity" figures):
        // - H100 SXM: NVIDIA H100 Tensor Core GPU datasheet (1,979 TFLOPS sparse, 3.35 TB/s, 80 GB).
        // - H800 SXM: H100 SXM's compute and memory, NVLink cut to 400 GB/s (NVIDIA's H800
        //   product brief; the DisagMoE paper's cluster).
        // - H200 SXM: NVIDIA H200 datasheet (1,979 TFLOPS sparse, 4.8 TB/s, 141 GB).
        // - A100 SXM 80 GB: NVIDIA A100 datasheet (312 TFLOPS, 2,039 GB/s, 80 GB).
        // - H20: NVIDIA's HGX H20 figures as published by server vendors and cloud providers
        //   (148 TFLOPS FP16/BF16 dense, 4.0 TB/s, 96 GB HBM3; no public NVIDIA datasheet).
        let (label, flops, hbm_bw, hbm) = match name.to_ascii_lowercase().as_str() {
            "h800" => ("H800", 989.0 * TFLOPS, 3350.0 * GB, 80.0 * GB),
            "h100" => ("H100", 989.0 * TFLOPS, 3350.0 * GB, 80.0 * GB),
            "h200" => ("H200", 989.0 * TFLOPS, 4800.0 * GB, 141.0 * GB),
            "a100" => ("A100", 312.0 * TFLOPS, 2039.0 * GB, 80.0 * GB),
            "h20" => ("H20", 148.0 * TFLOPS, 4000.0 * GB, 96.0 * GB),
            _ => {
                return Err(CoreError::UnknownPreset {
                    kind: "gpu",
                    name: name.to_string(),
                    known: GPU_PRESETS.join(", "),
                })
            }
        };
        Ok(Self {
            name: label.to_string(),
            peak_bf16_flops: flops,
            hbm_bandwidth: hbm_bw,
            hbm_bytes: hbm,
            compute_efficiency: default_compute_eff(),
            hbm_efficiency: default_hbm_eff(),
            usable_memory_fraction: default_usable_memory(),
        })
    }

    /// Sustained GEMM throughput, FLOP/s.
    pub fn sustained_flops(&self) -> f64 {
        self.peak_bf16_flops * self.compute_efficiency
    }

    /// Sustained HBM bandwidth, bytes/s.
    pub fn sustained_hbm(&self) -> f64 {
        self.hbm_bandwidth * self.hbm_efficiency
    }

    /// Bytes of HBM the framework may use.
    pub fn usable_memory(&self) -> f64 {
        self.hbm_bytes * self.usable_memory_fraction
    }
}

impl NodeSpec {
    /// The node of a GPU preset: 8 GPUs, 8 NICs. H800: NVLink 400 GB/s bidirectional, 8 x 400 Gb/s
    /// (the paper's cluster); H100/H200/H20: NVLink 900 GB/s bidirectional, 8 x 400 Gb/s; A100:
    /// NVLink 600 GB/s bidirectional, 8 x 200 Gb/s.
    pub fn preset(gpu: &str) -> Result<Self> {
        // Sources: NVLink from the datasheets above (H20: the HGX H20 figures, 900 GB/s); NICs as
        // in NVIDIA's DGX reference designs, one per GPU (DGX H100: 8 x ConnectX-7 400 Gb/s;
        // DGX A100: 8 x ConnectX-6 200 Gb/s; H20 nodes assumed to carry the H100 HGX design's).
        let (nvlink_bidir, nic_gbit) = match gpu.to_ascii_lowercase().as_str() {
            "h800" => (400.0, 400.0),
            "h100" | "h200" | "h20" => (900.0, 400.0),
            "a100" => (600.0, 200.0),
            _ => {
                return Err(CoreError::UnknownPreset {
                    kind: "gpu",
                    name: gpu.to_string(),
                    known: GPU_PRESETS.join(", "),
                })
            }
        };
        Ok(Self {
            gpus_per_node: 8,
            nvlink_bandwidth: nvlink_bidir * GB / 2.0,
            nics_per_node: 8,
            nic_bandwidth: nic_gbit * GB / 8.0,
            network_efficiency: default_network_eff(),
            latency_s: default_latency(),
        })
    }

    /// Sustained bandwidth of one NIC, bytes/s.
    pub fn sustained_nic(&self) -> f64 {
        self.nic_bandwidth * self.network_efficiency
    }

    /// Sustained NVLink bandwidth of one GPU, bytes/s.
    pub fn sustained_nvlink(&self) -> f64 {
        self.nvlink_bandwidth * self.network_efficiency
    }
}

impl Cluster {
    /// Built-in cluster `<gpu>x<nodes>`, e.g. `h800x16`.
    pub fn preset(name: &str) -> Result<Self> {
        let lower = name.to_ascii_lowercase();
        let unknown = || CoreError::UnknownPreset {
            kind: "cluster",
            name: name.to_string(),
            known: "<gpu>x<nodes> with gpu in {h800, h100, h200, a100, h20}, e.g. h800x16, h200x4".to_string(),
        };
        let (gpu, nodes) = lower.split_once('x').ok_or_else(unknown)?;
        let nodes: usize = nodes.parse().map_err(|_| unknown())?;
        check_nonzero("cluster.nodes", nodes)?;
        Ok(Self { name: lower.clone(), gpu: GpuSpec::preset(gpu)?, node: NodeSpec::preset(gpu)?, nodes })
    }

    /// A preset name or a path to a `.toml` / `.json` file holding a [`Cluster`].
    pub fn from_preset_or_file(spec: &str) -> Result<Self> {
        if spec.ends_with(".toml") || spec.ends_with(".json") || Path::new(spec).is_file() {
            Self::from_file(Path::new(spec))
        } else {
            Self::preset(spec)
        }
    }

    /// Reads and validates a cluster file (TOML if the name ends in `.toml`, JSON otherwise).
    pub fn from_file(path: &Path) -> Result<Self> {
        let cluster: Cluster = read_toml_or_json(path)?;
        cluster.validate()?;
        Ok(cluster)
    }

    /// Checks every field; the error names the field and its allowed range.
    pub fn validate(&self) -> Result<()> {
        check_nonzero("cluster.nodes", self.nodes)?;
        check_nonzero("cluster.node.gpus_per_node", self.node.gpus_per_node)?;
        check_nonzero("cluster.node.nics_per_node", self.node.nics_per_node)?;
        check_positive("cluster.gpu.peak_bf16_flops", self.gpu.peak_bf16_flops)?;
        check_positive("cluster.gpu.hbm_bandwidth", self.gpu.hbm_bandwidth)?;
        check_positive("cluster.gpu.hbm_bytes", self.gpu.hbm_bytes)?;
        check_positive("cluster.node.nvlink_bandwidth", self.node.nvlink_bandwidth)?;
        check_positive("cluster.node.nic_bandwidth", self.node.nic_bandwidth)?;
        if !(self.node.latency_s >= 0.0 && self.node.latency_s.is_finite()) {
            return Err(invalid("cluster.node.latency_s", self.node.latency_s, "a finite number >= 0"));
        }
        for (field, v) in [
            ("cluster.gpu.compute_efficiency", self.gpu.compute_efficiency),
            ("cluster.gpu.hbm_efficiency", self.gpu.hbm_efficiency),
            ("cluster.gpu.usable_memory_fraction", self.gpu.usable_memory_fraction),
            ("cluster.node.network_efficiency", self.node.network_efficiency),
        ] {
            if !(v > 0.0 && v <= 1.0) {
                return Err(invalid(field, v, "a fraction in (0, 1]"));
            }
        }
        Ok(())
    }

    /// GPUs in the cluster.
    pub fn total_gpus(&self) -> usize {
        self.nodes * self.node.gpus_per_node
    }

    /// NICs in the cluster.
    pub fn total_nics(&self) -> usize {
        self.nodes * self.node.nics_per_node
    }

    /// NICs per GPU (1.0 on the presets).
    pub fn nics_per_gpu(&self) -> f64 {
        self.node.nics_per_node as f64 / self.node.gpus_per_node as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paper_cluster_has_128_gpus_and_50_gbyte_nics() {
        let c = Cluster::preset("h800x16").unwrap();
        assert_eq!(c.total_gpus(), 128);
        assert_eq!(c.total_nics(), 128);
        assert!((c.node.nic_bandwidth - 50e9).abs() < 1.0);
        assert!((c.node.nvlink_bandwidth - 200e9).abs() < 1.0);
    }

    #[test]
    fn unknown_gpu_and_malformed_names_are_rejected_with_the_known_list() {
        let e = Cluster::preset("v100x4").unwrap_err().to_string();
        assert!(e.contains("h800"), "{e}");
        assert!(Cluster::preset("h800").is_err());
        assert!(Cluster::preset("h800x0").unwrap_err().to_string().contains("cluster.nodes"));
    }

    #[test]
    fn cluster_file_round_trips_through_toml_and_json_and_is_validated() {
        let dir = std::env::temp_dir().join(format!("disagmoe-hw-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let c = Cluster::preset("h200x4").unwrap();
        let t = dir.join("c.toml");
        std::fs::write(&t, toml::to_string(&c).unwrap()).unwrap();
        assert_eq!(Cluster::from_file(&t).unwrap(), c);
        let mut bad = c.clone();
        bad.node.network_efficiency = 1.5;
        let j = dir.join("c.json");
        std::fs::write(&j, serde_json::to_string(&bad).unwrap()).unwrap();
        let e = Cluster::from_preset_or_file(j.to_str().unwrap()).unwrap_err().to_string();
        assert!(e.contains("network_efficiency") && e.contains("(0, 1]"), "{e}");
    }
}
