//! `disagmoe plot`: the curves of one or more runs as SVG files, from their `metrics.jsonl`.
//!
//! - `loss.svg`: training loss against step (and `eval_loss` where a run recorded it), one colour
//!   per run;
//! - `tokens_per_s.svg`, `lr.svg`: throughput and learning rate against step;
//! - `expert_load-<run>.svg`: per run, a heat map of each MoE layer's experts over the steps, each
//!   cell coloured by the expert's routed copies over the layer's mean (`LoadClass`): dead experts
//!   (no token) and overloaded ones (twice the mean or more) stand out at a glance.
//!
//! Several run directories overlay in the line plots (compare an ablation with its baseline). The
//! command prints a JSON report (the files written, and per run its steps, first and last loss and
//! the last step's expert load) so scripts need not read the pictures.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Args;
use plotters::prelude::*;
use serde::Serialize;

use disagmoe_train::metrics::ExpertLoad;

/// `disagmoe plot` options.
#[derive(Debug, Args)]
pub struct PlotArgs {
    /// Run directories (each holds the `metrics.jsonl` that `train --out DIR` writes).
    #[arg(required = true)]
    pub runs: Vec<PathBuf>,
    /// Where the SVG files go [default: `plots/` inside the first run directory].
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// One step of a run, as the plots need it.
#[derive(Debug, Clone, PartialEq)]
pub struct StepPoint {
    /// Step number.
    pub step: usize,
    /// Training loss (NaN for a step whose loss was not finite).
    pub loss: f64,
    /// Held-out loss, where the run evaluated at this step.
    pub eval_loss: Option<f64>,
    /// Tokens per second.
    pub tokens_per_s: f64,
    /// Learning rate.
    pub lr: f64,
    /// Per MoE layer: (layer, routed copies per expert).
    pub expert_load: Vec<(usize, Vec<usize>)>,
}

/// A run's metrics.
#[derive(Debug, Clone)]
pub struct RunMetrics {
    /// Name shown in legends (the directory's name).
    pub name: String,
    /// Its steps in order (a resumed run's repeated steps keep the last record).
    pub steps: Vec<StepPoint>,
}

impl RunMetrics {
    /// Reads `dir/metrics.jsonl`; an error names the file and line of anything malformed.
    pub fn read(dir: &Path) -> anyhow::Result<Self> {
        let path = dir.join("metrics.jsonl");
        let text = std::fs::read_to_string(&path).with_context(|| {
            format!(
                "{} has no readable metrics.jsonl (write one with `disagmoe train --out {}`)",
                dir.display(),
                dir.display()
            )
        })?;
        // By step: a resumed run whose file was not cut back repeats steps; the newest record wins.
        let mut steps = std::collections::BTreeMap::<usize, StepPoint>::new();
        for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let at = || format!("{}:{}", path.display(), i + 1);
            let v: serde_json::Value = serde_json::from_str(line).with_context(|| format!("{}: not JSON", at()))?;
            let num = |key: &str| v.get(key).and_then(|x| x.as_f64());
            let step = v.get("step").and_then(|x| x.as_u64()).with_context(|| format!("{}: no `step`", at()))?;
            let mut expert_load = Vec::new();
            for l in v.get("expert_load").and_then(|x| x.as_array()).into_iter().flatten() {
                let layer = l.get("layer").and_then(|x| x.as_u64());
                let counts = l
                    .get("tokens_per_expert")
                    .and_then(|x| x.as_array())
                    .map(|a| a.iter().map(|c| c.as_u64().map(|c| c as usize)).collect::<Option<Vec<usize>>>());
                match (layer, counts) {
                    (Some(layer), Some(Some(counts))) => expert_load.push((layer as usize, counts)),
                    _ => bail!("{}: an `expert_load` entry without `layer` and `tokens_per_expert`", at()),
                }
            }
            let point = StepPoint {
                step: step as usize,
                loss: num("loss").unwrap_or(f64::NAN),
                eval_loss: num("eval_loss"),
                tokens_per_s: num("tokens_per_s").unwrap_or(f64::NAN),
                lr: num("lr").unwrap_or(f64::NAN),
                expert_load,
            };
            steps.insert(point.step, point);
        }
        if steps.is_empty() {
            bail!("{} has no steps", path.display());
        }
        let steps: Vec<StepPoint> = steps.into_values().collect();
        let name = dir
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| dir.display().to_string());
        Ok(Self { name, steps })
    }
}

/// How loaded an expert is in one step, relative to its layer's mean: the colour classes of the
/// heat map.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadClass {
    /// No routed token.
    Dead,
    /// Under half the mean.
    Starved,
    /// Half the mean to 0.9 of it.
    Light,
    /// Within 10% of the mean.
    Balanced,
    /// 1.1 to 2 times the mean.
    Heavy,
    /// Twice the mean or more.
    Overloaded,
}

impl LoadClass {
    /// Every class, from dead to overloaded.
    pub const ALL: [LoadClass; 6] =
        [Self::Dead, Self::Starved, Self::Light, Self::Balanced, Self::Heavy, Self::Overloaded];

    /// The class of `count` copies in a layer with `mean` copies per expert.
    pub fn of(count: usize, mean: f64) -> Self {
        let r = if mean > 0.0 { count as f64 / mean } else { 0.0 };
        match () {
            _ if count == 0 => Self::Dead,
            _ if r < 0.5 => Self::Starved,
            _ if r < 0.9 => Self::Light,
            _ if r <= 1.1 => Self::Balanced,
            _ if r < 2.0 => Self::Heavy,
            _ => Self::Overloaded,
        }
    }

    /// Its colour in the heat map (each class its own, so a reader or a test can tell them apart).
    pub fn rgb(self) -> (u8, u8, u8) {
        match self {
            Self::Dead => (0, 0, 0),
            Self::Starved => (49, 54, 149),
            Self::Light => (116, 173, 209),
            Self::Balanced => (240, 240, 240),
            Self::Heavy => (244, 109, 67),
            Self::Overloaded => (165, 0, 38),
        }
    }

    fn label(self) -> &'static str {
        match self {
            Self::Dead => "dead (0)",
            Self::Starved => "< 0.5x mean",
            Self::Light => "0.5-0.9x",
            Self::Balanced => "0.9-1.1x",
            Self::Heavy => "1.1-2x",
            Self::Overloaded => ">= 2x mean",
        }
    }
}

/// The last step's load of one layer, in the report.
#[derive(Debug, Clone, Serialize)]
pub struct LayerLoad {
    /// Layer.
    pub layer: usize,
    /// Busiest expert over the mean.
    pub max_mean_ratio: f64,
    /// Experts with no token.
    pub dead_experts: usize,
    /// Experts at twice the mean or more.
    pub overloaded_experts: usize,
}

/// What `plot` says about one run.
#[derive(Debug, Clone, Serialize)]
pub struct RunReport {
    /// The run's name (its directory).
    pub name: String,
    /// Steps plotted.
    pub steps: usize,
    /// Loss of the first and last step.
    pub first_loss: f64,
    /// See `first_loss`.
    pub last_loss: f64,
    /// The last step's expert load per MoE layer.
    pub last_expert_load: Vec<LayerLoad>,
    /// Heat-map cells per load class, all steps and layers together.
    pub cells: Vec<(LoadClass, usize)>,
}

/// What `plot` prints.
#[derive(Debug, Clone, Serialize)]
pub struct PlotReport {
    /// SVG files written.
    pub files: Vec<PathBuf>,
    /// Per run.
    pub runs: Vec<RunReport>,
}

/// The palette of the line plots (one colour per run).
const RUN_COLOURS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
];

fn plot_error(path: &Path) -> impl Fn(&dyn std::fmt::Display) -> anyhow::Error + '_ {
    move |e| anyhow::anyhow!("cannot draw {}: {e}", path.display())
}

/// One line plot: `value` of every run against step (finite points only).
fn line_plot(
    path: &Path,
    title: &str,
    y_desc: &str,
    runs: &[RunMetrics],
    value: impl Fn(&StepPoint) -> Option<f64>,
    dashed: Option<(&str, &dyn Fn(&StepPoint) -> Option<f64>)>,
) -> anyhow::Result<()> {
    let err = plot_error(path);
    let series = |f: &dyn Fn(&StepPoint) -> Option<f64>, r: &RunMetrics| -> Vec<(f64, f64)> {
        r.steps.iter().filter_map(|s| f(s).filter(|v| v.is_finite()).map(|v| (s.step as f64, v))).collect()
    };
    let mut all: Vec<(f64, f64)> = runs.iter().flat_map(|r| series(&value, r)).collect();
    if let Some((_, d)) = &dashed {
        all.extend(runs.iter().flat_map(|r| series(*d, r)));
    }
    let (x0, x1) = all.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let (y0, y1) = all.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| (a.min(p.1), b.max(p.1)));
    let (x0, x1) = if all.is_empty() { (0.0, 1.0) } else { (x0, x1.max(x0 + 1.0)) };
    let (y0, y1) = if all.is_empty() { (0.0, 1.0) } else { (y0, y1) };
    let pad = ((y1 - y0) * 0.05).max(y1.abs() * 1e-3).max(1e-12);
    let root = SVGBackend::new(path, (900, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(x0..x1, (y0 - pad)..(y1 + pad))
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc(y_desc)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .draw()
        .map_err(|e| err(&e))?;
    for (i, r) in runs.iter().enumerate() {
        let colour = RUN_COLOURS[i % RUN_COLOURS.len()];
        chart
            .draw_series(LineSeries::new(series(&value, r), colour.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(r.name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2)));
        if let Some((what, d)) = &dashed {
            let pts = series(*d, r);
            if !pts.is_empty() {
                chart
                    .draw_series(DashedLineSeries::new(pts.clone(), 6, 4, colour.stroke_width(2)))
                    .map_err(|e| err(&e))?
                    .label(format!("{} ({what})", r.name))
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour.mix(0.6).stroke_width(2)));
                chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, colour.filled()))).map_err(|e| err(&e))?;
            }
        }
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// At most this many columns in a heat map: longer runs show every k-th step.
const MAX_COLUMNS: usize = 400;

/// The steps a heat map shows (all of them up to `MAX_COLUMNS`, else evenly spaced ones, the
/// last included).
pub fn heat_map_steps(run: &RunMetrics) -> Vec<&StepPoint> {
    let n = run.steps.len();
    let stride = n.div_ceil(MAX_COLUMNS).max(1);
    let mut shown: Vec<&StepPoint> = run.steps.iter().step_by(stride).collect();
    if (n - 1) % stride != 0 {
        shown.push(&run.steps[n - 1]);
    }
    shown
}

/// The heat map of one run: one row per (layer, expert), one column per shown step. Returns the
/// number of cells per load class.
fn heat_map(path: &Path, run: &RunMetrics) -> anyhow::Result<Vec<(LoadClass, usize)>> {
    let err = plot_error(path);
    let shown = heat_map_steps(run);
    // Rows: the layers in order of the last step, each with its experts.
    let layers: Vec<(usize, usize)> =
        run.steps.last().map(|s| s.expert_load.iter().map(|(l, c)| (*l, c.len())).collect()).unwrap_or_default();
    let rows: usize = layers.iter().map(|(_, e)| e).sum::<usize>().max(1);
    let (w, h) = (1000u32, (180 + rows * 6).clamp(400, 2400) as u32);
    let root = SVGBackend::new(path, (w, h)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let (body, legend) = root.split_horizontally(w - 170);
    let title = format!("{}: routed copies per expert over the layer's mean", run.name);
    let mut chart = ChartBuilder::on(&body)
        .caption(title, ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..shown.len() as f64, 0f64..rows as f64)
        .map_err(|e| err(&e))?;
    // Rows from the top: the first layer's experts, then the next layer's, and so on.
    let mut starts = Vec::new();
    let mut acc = 0;
    for &(layer, e) in &layers {
        starts.push((layer, acc, e));
        acc += e;
    }
    let step_label = |x: &f64| match shown.get(*x as usize) {
        Some(s) if x.fract() == 0.0 => s.step.to_string(),
        _ => String::new(),
    };
    chart
        .configure_mesh()
        .disable_mesh()
        .x_desc("step")
        .y_desc("layer, its experts top to bottom")
        .x_label_formatter(&step_label)
        .y_labels(0)
        .draw()
        .map_err(|e| err(&e))?;
    // Layer names beside their blocks, and a line between blocks.
    for &(layer, start, experts) in &starts {
        let (x, y) = chart.backend_coord(&(0.0, rows as f64 - start as f64 - experts as f64 / 2.0));
        body.draw(&Text::new(format!("L{layer}"), (x - 30, y - 6), ("sans-serif", 13))).map_err(|e| err(&e))?;
    }
    let mut cells = std::collections::HashMap::<LoadClass, usize>::new();
    let mut rects = Vec::new();
    for (col, s) in shown.iter().enumerate() {
        for &(layer, start, experts) in &starts {
            let Some((_, counts)) = s.expert_load.iter().find(|(l, _)| *l == layer) else { continue };
            let mean = counts.iter().sum::<usize>() as f64 / counts.len().max(1) as f64;
            for (e, &c) in counts.iter().enumerate().take(experts) {
                let class = LoadClass::of(c, mean);
                *cells.entry(class).or_default() += 1;
                let (r, g, b) = class.rgb();
                // Row 0 at the top: the first layer's first expert.
                let y = (rows - start - e) as f64;
                rects.push(Rectangle::new([(col as f64, y - 1.0), (col as f64 + 1.0, y)], RGBColor(r, g, b).filled()));
            }
        }
    }
    chart.draw_series(rects).map_err(|e| err(&e))?;
    let separators = starts.iter().filter(|(_, start, _)| *start > 0).map(|&(_, start, _)| {
        let y = (rows - start) as f64;
        PathElement::new(vec![(0.0, y), (shown.len() as f64, y)], RGBColor(255, 196, 0).stroke_width(3))
    });
    chart.draw_series(separators).map_err(|e| err(&e))?;
    // The legend: one swatch per class.
    for (i, class) in LoadClass::ALL.iter().enumerate() {
        let (r, g, b) = class.rgb();
        let y = 60 + i as i32 * 28;
        legend
            .draw(&Rectangle::new([(10, y), (30, y + 18)], ShapeStyle::from(&RGBColor(r, g, b)).filled()))
            .map_err(|e| err(&e))?;
        legend.draw(&Rectangle::new([(10, y), (30, y + 18)], BLACK.stroke_width(1))).map_err(|e| err(&e))?;
        legend.draw(&Text::new(class.label(), (38, y + 3), ("sans-serif", 13))).map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(LoadClass::ALL.iter().map(|c| (*c, cells.get(c).copied().unwrap_or(0))).collect())
}

/// A file name made of a run's name (letters, digits, `-`, `_`, `.` kept).
fn file_safe(name: &str) -> String {
    name.chars().map(|c| if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') { c } else { '_' }).collect()
}

/// Reads the runs and writes the plots; returns what was written.
pub fn run_plot(args: &PlotArgs) -> anyhow::Result<PlotReport> {
    let runs = args.runs.iter().map(|d| RunMetrics::read(d)).collect::<anyhow::Result<Vec<_>>>()?;
    let out = args.out.clone().unwrap_or_else(|| args.runs[0].join("plots"));
    std::fs::create_dir_all(&out).with_context(|| format!("cannot create {}", out.display()))?;
    let mut files = Vec::new();
    let loss = out.join("loss.svg");
    let eval: &dyn Fn(&StepPoint) -> Option<f64> = &|s| s.eval_loss;
    let has_eval = runs.iter().any(|r| r.steps.iter().any(|s| s.eval_loss.is_some()));
    line_plot(&loss, "Loss", "loss", &runs, |s| Some(s.loss), has_eval.then_some(("eval", eval)))?;
    files.push(loss);
    let tps = out.join("tokens_per_s.svg");
    line_plot(&tps, "Throughput", "tokens/s", &runs, |s| Some(s.tokens_per_s), None)?;
    files.push(tps);
    let lr = out.join("lr.svg");
    line_plot(&lr, "Learning rate", "learning rate", &runs, |s| Some(s.lr), None)?;
    files.push(lr);
    let mut reports = Vec::new();
    for (i, r) in runs.iter().enumerate() {
        let mut cells = Vec::new();
        if r.steps.iter().any(|s| !s.expert_load.is_empty()) {
            let name = if runs.len() > 1 {
                format!("expert_load-{}-{}.svg", i + 1, file_safe(&r.name))
            } else {
                "expert_load.svg".into()
            };
            let path = out.join(name);
            cells = heat_map(&path, r)?;
            files.push(path);
        }
        let last = r.steps.last().expect("a run has steps");
        let last_expert_load = last
            .expert_load
            .iter()
            .map(|(layer, counts)| {
                // The statistics the metrics file reports, from the training side's one definition.
                let load = ExpertLoad::from_counts(*layer, counts);
                let mean = counts.iter().sum::<usize>() as f64 / counts.len().max(1) as f64;
                LayerLoad {
                    layer: *layer,
                    max_mean_ratio: load.max_mean_ratio,
                    dead_experts: load.dead_experts,
                    overloaded_experts: counts
                        .iter()
                        .filter(|&&c| LoadClass::of(c, mean) == LoadClass::Overloaded)
                        .count(),
                }
            })
            .collect();
        reports.push(RunReport {
            name: r.name.clone(),
            steps: r.steps.len(),
            first_loss: r.steps[0].loss,
            last_loss: last.loss,
            last_expert_load,
            cells,
        });
    }
    Ok(PlotReport { files, runs: reports })
}
