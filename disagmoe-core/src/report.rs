//! Pictures and traces of a simulated step: an SVG timeline (one row per worker stream) and a
//! Chrome trace JSON that opens in Perfetto (`ui.perfetto.dev`) or `chrome://tracing`.

use crate::error::{CoreError, Result};
use crate::schedule::{OpKind, Schedule};
use crate::simulator::Trace;
use serde_json::{json, Value};
use std::fmt::Write as _;
use std::path::Path;

fn colour(kind: &OpKind) -> &'static str {
    match kind {
        OpKind::AttentionForward => "#4c72b0",
        OpKind::AttentionBackward => "#1f3d73",
        OpKind::ExpertForward => "#dd8452",
        OpKind::ExpertBackward => "#8c4a1c",
        OpKind::WeightGradient | OpKind::Optimizer => "#5a5a5a",
        OpKind::HeadForward | OpKind::HeadBackward => "#8172b3",
        OpKind::Send { .. } | OpKind::Recv { .. } => "#55a868",
        OpKind::Dispatch { .. } | OpKind::Combine { .. } => "#c44e52",
        OpKind::AllReduce => "#937860",
    }
}

fn write(path: &Path, text: &str) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| CoreError::Io { path: dir.display().to_string(), source })?;
    }
    std::fs::write(path, text).map_err(|source| CoreError::Io { path: path.display().to_string(), source })
}

/// The Chrome trace of a simulated schedule: one process per worker, one thread per stream,
/// one complete event (`"ph": "X"`) per op with its micro-batch, layer and volume.
pub fn chrome_trace(schedule: &Schedule, trace: &Trace) -> Value {
    let mut events = Vec::new();
    for (w, worker) in schedule.workers.iter().enumerate() {
        events.push(json!({"name": "process_name", "ph": "M", "pid": w, "args": {"name": format!("{} ({} GPUs)", worker.name, worker.gpus)}}));
        for (s, stream) in worker.streams.iter().enumerate() {
            events.push(json!({"name": "thread_name", "ph": "M", "pid": w, "tid": s, "args": {"name": format!("{:?}", stream.kind)}}));
        }
    }
    for (i, op) in schedule.ops.iter().enumerate() {
        if matches!(op.kind, OpKind::Recv { .. }) {
            continue;
        }
        events.push(json!({
            "name": op.kind.label(),
            "ph": "X",
            "pid": op.worker,
            "tid": op.stream,
            "ts": trace.start[i] * 1e6,
            "dur": (trace.end[i] - trace.start[i]) * 1e6,
            "args": {"micro_batch": op.micro_batch, "layer": op.layer, "chunk": op.chunk, "bytes": op.bytes, "flops": op.flops},
        }));
    }
    json!({"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"schedule": schedule.name, "step_s": trace.step_s}})
}

/// Writes [`chrome_trace`] to `path`.
pub fn write_chrome_trace(path: &Path, schedule: &Schedule, trace: &Trace) -> Result<()> {
    write(path, &chrome_trace(schedule, trace).to_string())
}

/// Draws the timeline of the first `window_s` seconds (all of it when `None`) as an SVG: one row
/// per worker stream, one rectangle per op, coloured by kind.
pub fn write_timeline_svg(path: &Path, schedule: &Schedule, trace: &Trace, window_s: Option<f64>) -> Result<()> {
    let span = window_s.unwrap_or(trace.step_s).min(trace.step_s).max(1e-9);
    let (left, width, row_h, top) = (150.0, 1100.0, 14.0, 40.0);
    let mut rows = Vec::new();
    for (w, worker) in schedule.workers.iter().enumerate() {
        for (s, stream) in worker.streams.iter().enumerate() {
            if !matches!(stream.kind, crate::schedule::StreamKind::Recv) {
                rows.push((w, s, format!("{} {:?}", worker.name, stream.kind)));
            }
        }
    }
    let height = top + rows.len() as f64 * row_h + 60.0;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{height}" font-family="sans-serif" font-size="10">"#,
        left + width + 20.0
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r#"<text x="10" y="20" font-size="14">{}: step {:.3} s (showing {:.3} s)</text>"#,
        schedule.name, trace.step_s, span
    );
    for (r, (_, _, label)) in rows.iter().enumerate() {
        let y = top + r as f64 * row_h;
        let _ = writeln!(svg, r#"<text x="5" y="{}">{label}</text>"#, y + row_h - 3.0);
        let _ = writeln!(svg, r##"<line x1="{left}" x2="{}" y1="{y}" y2="{y}" stroke="#eee"/>"##, left + width);
    }
    for (i, op) in schedule.ops.iter().enumerate() {
        if trace.start[i] >= span || trace.end[i] <= trace.start[i] {
            continue;
        }
        let Some(r) = rows.iter().position(|(w, s, _)| *w == op.worker && *s == op.stream) else { continue };
        let x = left + trace.start[i] / span * width;
        let w = ((trace.end[i].min(span) - trace.start[i]) / span * width).max(0.3);
        let y = top + r as f64 * row_h + 1.0;
        let _ = writeln!(
            svg,
            r#"<rect x="{x:.2}" y="{y:.1}" width="{w:.2}" height="{}" fill="{}"><title>{} mb{} L{}</title></rect>"#,
            row_h - 2.0,
            colour(&op.kind),
            op.kind.label(),
            op.micro_batch,
            op.layer
        );
    }
    let legend_y = top + rows.len() as f64 * row_h + 25.0;
    for (k, (label, kind)) in [
        ("attention fwd", OpKind::AttentionForward),
        ("attention bwd", OpKind::AttentionBackward),
        ("expert fwd", OpKind::ExpertForward),
        ("expert bwd", OpKind::ExpertBackward),
        ("weight grad", OpKind::WeightGradient),
        ("M2N / N2M / P2P", OpKind::Recv { from: 0 }),
        ("all-to-all", OpKind::Dispatch { backward: false }),
        ("all-reduce", OpKind::AllReduce),
    ]
    .iter()
    .enumerate()
    {
        let x = left + k as f64 * 130.0;
        let _ = writeln!(svg, r#"<rect x="{x}" y="{legend_y}" width="12" height="12" fill="{}"/>"#, colour(kind));
        let _ = writeln!(svg, r#"<text x="{}" y="{}">{label}</text>"#, x + 16.0, legend_y + 10.0);
    }
    svg.push_str("</svg>\n");
    write(path, &svg)
}
