//! The compute/communication roofline of each component (attention side, expert side).
//!
//! A component given `x` GPUs and `n` NICs turns FLOPs into progress at most at
//! `x * sustained FLOP/s` and moves tokens at most at its port bandwidth (`n` NICs). Its
//! *intensity* `I` is FLOPs per byte it must exchange (M2N/N2M), its attainable throughput is
//! `min(compute ceiling, I * port bandwidth)`, and its *inflection point*
//! `Î = compute ceiling / port bandwidth` is the intensity at which it turns from network-bound
//! to compute-bound. Attention's intensity grows linearly with the sequence length (its quadratic
//! score term), the experts' does not, so attention reaches its ceiling first as sequences grow:
//! that is why the allocator gives attention more GPUs and experts more NICs as `S` grows.

use crate::cost::CostModel;
use crate::error::{CoreError, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Which side of the disaggregated model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Component {
    /// Attention (and the dense parts) on A-workers.
    Attention,
    /// Experts on F-workers.
    Ffn,
}

/// Whether a component is limited by its network port or by its GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Bound {
    /// Intensity below the inflection point.
    Network,
    /// Intensity at or above the inflection point.
    Compute,
}

/// One component's roofline at one workload and resource grant.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ComponentRoofline {
    /// The component.
    pub component: Component,
    /// GPUs granted (one group).
    pub gpus: usize,
    /// NICs granted (one group).
    pub nics: usize,
    /// FLOPs per exchanged byte of one layer's forward on one micro-batch.
    pub intensity: f64,
    /// Inflection point Î, FLOP/byte.
    pub inflection: f64,
    /// Compute ceiling of the group, FLOP/s.
    pub compute_ceiling: f64,
    /// Port bandwidth of the group, bytes/s.
    pub port_bandwidth: f64,
    /// Compute time of one layer on one micro-batch (forward), seconds.
    pub compute_s: f64,
    /// Network time of the same, seconds.
    pub network_s: f64,
    /// `max(compute_s, network_s)`.
    pub time_s: f64,
    /// Which term binds.
    pub bound: Bound,
}

/// Roofline of `component` for a group of `gpus` GPUs and `nics` NICs, averaged over layers.
/// `peer_gpus` is the size of the other side's group (it sets how many ranks a token visits).
pub fn component_roofline(
    cost: &CostModel,
    component: Component,
    gpus: usize,
    nics: usize,
    peer_gpus: usize,
) -> ComponentRoofline {
    let layers = cost.model.layers;
    let ffn_gpus = if component == Component::Ffn { gpus } else { peer_gpus };
    let (mut flops, mut compute_s, mut bytes) = (0.0, 0.0, 0.0);
    // The attention group's context-parallel size for this workload (1 when its choice has none).
    let cp = cost.context_parallel.size_for(gpus, &cost.workload).unwrap_or(1);
    for l in 0..layers {
        let w = match component {
            Component::Attention => cost.attention_forward(l, gpus, cp),
            Component::Ffn => cost.ffn_forward(l, gpus),
        };
        flops += w.flops * gpus as f64;
        compute_s += cost.gpu_time(w);
        // Each port carries M2N one way and N2M the other: the larger binds.
        bytes += cost.m2n_bytes(l, ffn_gpus).max(cost.n2m_bytes(l, ffn_gpus));
    }
    let n = layers as f64;
    let (flops, compute_s, bytes) = (flops / n, compute_s / n, bytes / n);
    let port_bandwidth = cost.group_bandwidth(gpus, nics);
    let compute_ceiling = gpus as f64 * cost.cluster.gpu.sustained_flops();
    let network_s = bytes / port_bandwidth;
    let intensity = flops / bytes;
    let inflection = compute_ceiling / port_bandwidth;
    ComponentRoofline {
        component,
        gpus,
        nics,
        intensity,
        inflection,
        compute_ceiling,
        port_bandwidth,
        compute_s,
        network_s,
        time_s: compute_s.max(network_s),
        bound: if intensity >= inflection { Bound::Compute } else { Bound::Network },
    }
}

/// Smallest sequence length (a power of two in 256..=1M) at which `component` with this grant is
/// compute-bound, or `None` if it stays network-bound.
pub fn inflection_sequence(
    cost: &CostModel,
    component: Component,
    gpus: usize,
    nics: usize,
    peer_gpus: usize,
) -> Option<usize> {
    (8..=20).map(|e| 1usize << e).find(|&seq| {
        let mut c = cost.clone();
        c.workload.seq = seq;
        component_roofline(&c, component, gpus, nics, peer_gpus).bound == Bound::Compute
    })
}

/// Draws both rooflines (attention group, expert group: attainable FLOP/s per GPU against
/// intensity) and each component's operating points at the given sequence lengths into an SVG.
pub fn plot_rooflines_svg(
    path: &Path,
    cost: &CostModel,
    (a, na): (usize, usize),
    (f, nf): (usize, usize),
    seqs: &[usize],
) -> Result<()> {
    use plotters::prelude::*;
    let err = |e: &dyn std::fmt::Display| CoreError::Plot { path: path.display().to_string(), message: e.to_string() };
    let per_gpu_peak = cost.cluster.gpu.sustained_flops();
    let mut points: Vec<(Component, usize, f64, f64)> = Vec::new();
    for &seq in seqs {
        let mut c = cost.clone();
        c.workload.seq = seq;
        for (comp, g, n, peer) in [(Component::Attention, a, na, f), (Component::Ffn, f, nf, a)] {
            let r = component_roofline(&c, comp, g, n, peer);
            let attained = (r.intensity * r.port_bandwidth).min(r.compute_ceiling) / g as f64;
            points.push((comp, seq, r.intensity, attained));
        }
    }
    let ridge_a = a as f64 * per_gpu_peak / cost.group_bandwidth(a, na);
    let ridge_f = f as f64 * per_gpu_peak / cost.group_bandwidth(f, nf);
    let xs = points.iter().map(|p| p.2).chain([ridge_a, ridge_f]);
    let x_min = xs.clone().fold(f64::INFINITY, f64::min) / 4.0;
    let x_max = xs.fold(0.0, f64::max) * 4.0;
    let y_max = per_gpu_peak * 2.0;
    let y_min = per_gpu_peak / 1000.0;
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let title = format!(
        "Rooflines: {} on {} (attention {a} GPU/{na} NIC, FFN {f} GPU/{nf} NIC per group)",
        cost.model.name, cost.cluster.name
    );
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d((x_min..x_max).log_scale(), (y_min..y_max).log_scale())
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("intensity: FLOPs per exchanged byte")
        .y_desc("attainable FLOP/s per GPU")
        .y_label_formatter(&|v| format!("{:.0} T", v / 1e12))
        .x_label_formatter(&|v| format!("{v:.0}"))
        .draw()
        .map_err(|e| err(&e))?;
    for (label, g, bw, color) in
        [("attention roof", a, cost.group_bandwidth(a, na), BLUE), ("FFN roof", f, cost.group_bandwidth(f, nf), RED)]
    {
        let per_gpu_bw = bw / g as f64;
        let curve: Vec<(f64, f64)> = (0..=200)
            .map(|i| x_min * (x_max / x_min).powf(i as f64 / 200.0))
            .map(|x| (x, (x * per_gpu_bw).min(per_gpu_peak).max(y_min)))
            .collect();
        chart
            .draw_series(LineSeries::new(curve, color.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    for (comp, color) in [(Component::Attention, BLUE), (Component::Ffn, RED)] {
        let pts: Vec<(f64, f64, usize)> = points.iter().filter(|p| p.0 == comp).map(|p| (p.2, p.3, p.1)).collect();
        chart.draw_series(pts.iter().map(|&(x, y, _)| Circle::new((x, y), 5, color.filled()))).map_err(|e| err(&e))?;
        chart
            .draw_series(
                pts.iter().map(|&(x, y, s)| Text::new(format!("{}K", s / 1024), (x, y * 1.25), ("sans-serif", 12))),
            )
            .map_err(|e| err(&e))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::Workload;
    use crate::hardware::Cluster;
    use crate::model_shape::ModelShape;

    fn cost(seq: usize) -> CostModel {
        let w = Workload { seq, micro_batch: 1, global_batch: 64 };
        CostModel::new(ModelShape::preset("qwen3-235b-a22b").unwrap(), Cluster::preset("h800x16").unwrap(), w).unwrap()
    }

    #[test]
    fn attention_intensity_grows_with_sequence_and_ffn_intensity_does_not() {
        let (a4, a32) = (
            component_roofline(&cost(4096), Component::Attention, 8, 8, 24),
            component_roofline(&cost(32768), Component::Attention, 8, 8, 24),
        );
        let (f4, f32) = (
            component_roofline(&cost(4096), Component::Ffn, 24, 24, 8),
            component_roofline(&cost(32768), Component::Ffn, 24, 24, 8),
        );
        assert!(a32.intensity > 3.0 * a4.intensity, "{} vs {}", a32.intensity, a4.intensity);
        assert!((f32.intensity / f4.intensity - 1.0).abs() < 0.01);
        assert_eq!(a32.time_s, a32.compute_s.max(a32.network_s));
    }

    #[test]
    fn more_nics_lower_the_inflection_point_and_move_it_to_shorter_sequences() {
        let c = cost(4096);
        let few = component_roofline(&c, Component::Attention, 8, 1, 24);
        let many = component_roofline(&c, Component::Attention, 8, 8, 24);
        assert!(many.inflection < few.inflection);
        let s_few = inflection_sequence(&c, Component::Attention, 8, 1, 24);
        let s_many = inflection_sequence(&c, Component::Attention, 8, 8, 24);
        assert!(s_many.unwrap() <= s_few.unwrap_or(usize::MAX), "{s_many:?} {s_few:?}");
    }

    #[test]
    fn roofline_svg_is_written() {
        let path = std::env::temp_dir().join(format!("roofline-{}.svg", std::process::id()));
        plot_rooflines_svg(&path, &cost(4096), (8, 4), (24, 12), &[4096, 8192, 16384, 32768]).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.starts_with("<svg") && text.contains("attention roof"), "{}", &text[..100.min(text.len())]);
    }
}
