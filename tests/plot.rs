//! `disagmoe plot` end to end: two short runs (one without the balance loss) plotted together; the
//! SVG files parse, the line plots hold one curve per run, and the expert heat map shows exactly
//! the load the metrics report (its cells counted by colour against `metrics.jsonl`).

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;

use disagmoe::plot::LoadClass;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_disagmoe"))
}

fn train(out: &Path, aux: &str) {
    let run = bin()
        .args(["train", "--steps", "12", "--batch", "4", "--seq", "32", "--quiet", "--model-preset", "tiny-qwen3-moe"])
        .args(["--aux-loss", aux, "--out", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
}

/// The SVG's elements as (name, attributes); panics if the file is not well-formed XML.
fn elements(path: &Path) -> Vec<(String, HashMap<String, String>)> {
    let file = std::fs::File::open(path).unwrap();
    let mut out = Vec::new();
    for event in xml::reader::EventReader::new(std::io::BufReader::new(file)) {
        match event.unwrap_or_else(|e| panic!("{}: not well-formed: {e}", path.display())) {
            xml::reader::XmlEvent::StartElement { name, attributes, .. } => {
                out.push((name.local_name, attributes.into_iter().map(|a| (a.name.local_name, a.value)).collect()))
            }
            _ => {}
        }
    }
    assert_eq!(out.first().map(|e| e.0.as_str()), Some("svg"), "{}", path.display());
    out
}

/// Heat-map cells per class, computed from the metrics file itself.
fn classes_from_metrics(dir: &Path) -> HashMap<LoadClass, usize> {
    let mut counts = HashMap::new();
    for line in std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap().lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        for layer in v["expert_load"].as_array().unwrap() {
            let c: Vec<usize> =
                layer["tokens_per_expert"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect();
            let mean = c.iter().sum::<usize>() as f64 / c.len() as f64;
            for &n in &c {
                *counts.entry(LoadClass::of(n, mean)).or_default() += 1;
            }
        }
    }
    counts
}

#[test]
fn plots_parse_and_the_heat_map_shows_the_load_the_metrics_report() {
    let tmp = tempfile::tempdir().unwrap();
    let (off, on, plots) = (tmp.path().join("aux-off"), tmp.path().join("aux-on"), tmp.path().join("plots"));
    train(&off, "off");
    train(&on, "on");
    let out = bin()
        .args(["plot", off.to_str().unwrap(), on.to_str().unwrap(), "--out", plots.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let files: Vec<String> =
        report["files"].as_array().unwrap().iter().map(|f| f.as_str().unwrap().to_string()).collect();
    assert_eq!(files.len(), 5, "loss, throughput, lr and a heat map per run: {files:?}");
    for f in &files {
        let els = elements(Path::new(f));
        assert!(els.len() > 10, "{f}: {} elements", els.len());
    }
    // One curve per run in each line plot.
    for name in ["loss.svg", "tokens_per_s.svg", "lr.svg"] {
        let lines = elements(&plots.join(name)).into_iter().filter(|(n, _)| n == "polyline").count();
        assert!(lines >= 2, "{name}: {lines} curves");
    }
    // The heat map of the run without the balance loss: every (step, layer, expert) cell has the
    // colour of its load class, as counted from the metrics (each class also has one legend swatch).
    let heat = files.iter().find(|f| f.contains("expert_load-1")).expect("the first run's heat map");
    let mut by_fill: HashMap<String, usize> = HashMap::new();
    for (name, attrs) in elements(Path::new(heat)) {
        if name == "rect" {
            if let Some(fill) = attrs.get("fill") {
                *by_fill.entry(fill.to_uppercase()).or_default() += 1;
            }
        }
    }
    let want = classes_from_metrics(&off);
    let run = &report["runs"][0];
    for class in LoadClass::ALL {
        let (r, g, b) = class.rgb();
        let fill = format!("#{r:02X}{g:02X}{b:02X}");
        let cells = want.get(&class).copied().unwrap_or(0);
        assert_eq!(by_fill.get(&fill).copied().unwrap_or(0), cells + 1, "{class:?} ({fill}) cells");
        let reported = run["cells"].as_array().unwrap().iter().find(|c| c[0] == serde_json::json!(class)).unwrap();
        assert_eq!(reported[1].as_u64().unwrap() as usize, cells, "{class:?} in the report");
    }
    assert_eq!(run["steps"], 12);
    let total: usize = want.values().sum();
    assert_eq!(total, 12 * 4 * 8, "12 steps x 4 MoE layers x 8 experts of tiny-qwen3-moe");
    eprintln!("aux off, cells per class: {want:?}; last step: {}", run["last_expert_load"]);
}

#[test]
fn a_directory_without_metrics_is_refused_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let out = bin().args(["plot", tmp.path().to_str().unwrap()]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("metrics.jsonl") && err.contains("--out"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    std::fs::write(tmp.path().join("metrics.jsonl"), "{\"step\": 1}\nnot json\n").unwrap();
    let out = bin().args(["plot", tmp.path().to_str().unwrap()]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("metrics.jsonl:2"), "names the line: {err}");
}
