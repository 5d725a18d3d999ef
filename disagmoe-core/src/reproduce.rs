//! The paper's setting reproduced by simulation: writes `docs/paper-reproduction.md` and its
//! figures. Run with `disagmoe reproduce-paper` (see `ReproduceArgs` in the root binary).
//!
//! Nothing in the tables is typed in: every allocation comes from [`crate::plan::plan`] and every
//! step time from simulating the schedule; only the paper's own reported numbers are constants,
//! quoted for comparison.

use crate::cost::{CostModel, Workload};
use crate::error::{CoreError, Result};
use crate::exchange::{ExchangeDtype, ExchangePrecision};
use crate::experts::{ExpertBalance, ExpertLoad, ExpertPlacement};
use crate::hardware::Cluster;
use crate::model_shape::ModelShape;
use crate::plan::{mean_imbalance, plan, simulate_schedules, ScheduleResult, DEFAULT_SEARCH_EVALS, SCHEDULE_NAMES};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Where to write and which cluster to use.
#[derive(Debug, Clone)]
pub struct ReproduceOptions {
    /// Markdown output.
    pub out: PathBuf,
    /// Directory of the SVG figures.
    pub img_dir: PathBuf,
    /// Cluster preset (the paper: `h800x16`).
    pub cluster: String,
    /// Mixed clusters of the section "Heterogeneous clusters" (none: no section; the paper's
    /// page: [`crate::pools::MIX_PRESETS`]).
    pub mixes: Vec<String>,
}

/// Models of the reproduction. DeepSeek is DeepSeekMoE-16B: DeepSeek-V3's 671B parameters with
/// Adam state do not fit in 128 x 80 GB (the document quotes the allocator's error).
pub const PAPER_MODELS: &[&str] = &["qwen3-235b-a22b", "gpt-oss-120b", "deepseek-moe-16b"];
/// Sequence lengths of the reproduction.
pub const PAPER_SEQS: &[usize] = &[4096, 8192, 16384, 32768];

/// Sequences per micro-batch at sequence length `seq`: 64K tokens per micro-batch.
pub fn paper_micro_batch(seq: usize) -> usize {
    (65_536 / seq).max(1)
}

fn relative(from: &Path, to: &Path) -> String {
    let base = from.parent().unwrap_or(Path::new(""));
    to.strip_prefix(base).map(|p| p.display().to_string()).unwrap_or_else(|_| to.display().to_string())
}

fn cost_for(model: &str, cluster: &Cluster, seq: usize) -> Result<CostModel> {
    let mb = paper_micro_batch(seq);
    let workload = Workload { seq, micro_batch: mb, global_batch: 2 * cluster.total_gpus() * mb };
    let mut cost = CostModel::new(ModelShape::preset(model)?, cluster.clone(), workload)?;
    // The paper's setting: Megatron-Core's mixed precision.
    cost.precision = crate::cost::Precision::megatron();
    Ok(cost)
}

/// Runs every setting, writes the markdown and figures, returns the number of settings.
pub fn reproduce_paper(opts: &ReproduceOptions) -> Result<usize> {
    let cluster = Cluster::preset(&opts.cluster).or_else(|_| Cluster::from_preset_or_file(&opts.cluster))?;
    std::fs::create_dir_all(&opts.img_dir)
        .map_err(|source| CoreError::Io { path: opts.img_dir.display().to_string(), source })?;
    let names: Vec<String> = SCHEDULE_NAMES.iter().map(|s| s.to_string()).collect();
    let mut md = String::new();
    let mut settings = 0;
    let mut best_vs: Vec<Versus> = Vec::new();
    let mut shares: Vec<(String, Vec<(usize, f64)>)> = Vec::new();
    let mut body = String::new();

    for &model in PAPER_MODELS {
        let _ = writeln!(body, "\n## {model}\n");
        let _ = writeln!(
            body,
            "| seq | micro-batch | groups | attention GPUs/NICs | CP | FFN GPUs/NICs | schedule | step (s) | exposed comm, mean (s) | exposed comm, bottleneck (s) | bubble (s) | AF-Pipe speedup | exposed removed (mean / bottleneck) |"
        );
        let _ = writeln!(body, "|---|---|---|---|---|---|---|---|---|---|---|---|---|");
        let mut model_shares = Vec::new();
        for &seq in PAPER_SEQS {
            let cost = cost_for(model, &cluster, seq)?;
            let p = plan(&cost, false, DEFAULT_SEARCH_EVALS)?;
            model_shares.push((seq, p.attention_gpus as f64 / (p.attention_gpus + p.ffn_gpus) as f64));
            let (report, sims) = simulate_schedules(&cost, &names, Some(p.allocation))?;
            settings += 1;
            if seq == 4096 {
                let a = &p.allocation;
                let svg = opts.img_dir.join(format!("roofline-{model}.svg"));
                crate::roofline::plot_rooflines_svg(
                    &svg,
                    &cost,
                    (a.attention_gpus_per_group, a.attention_nics_per_group),
                    (a.ffn_gpus_per_group, a.ffn_nics_per_group),
                    PAPER_SEQS,
                )?;
            }
            if model == "gpt-oss-120b" && seq == 8192 {
                for s in &sims {
                    let svg = opts.img_dir.join(format!("timeline-{model}-8k-{}.svg", s.schedule.name));
                    crate::report::write_timeline_svg(&svg, &s.schedule, &s.trace, Some(s.trace.step_s * 0.05))?;
                }
            }
            let cell = |r: &ScheduleResult| {
                format!(
                    "| {} | {:.3} | {:.3} | {:.3} | {:.3} | {} | {} |",
                    r.schedule,
                    r.step_s,
                    r.exposed_comm_s,
                    r.bottleneck_exposed_comm_s,
                    r.bubble_s,
                    r.afpipe_speedup.map_or("—".into(), |x| format!("{x:.2}x")),
                    match (r.afpipe_exposed_comm_reduction, r.afpipe_bottleneck_exposed_comm_reduction) {
                        (Some(x), Some(y)) => format!("{:.0}% / {:.0}%", 100.0 * x, 100.0 * y),
                        _ => "—".into(),
                    }
                )
            };
            let a = &p.allocation;
            for (i, r) in report.schedules.iter().enumerate() {
                let head = if i == 0 {
                    format!(
                        "| {}K | {} | {} | {}/{} | {} | {}/{} ",
                        seq / 1024,
                        cost.workload.micro_batch,
                        a.groups,
                        p.attention_gpus,
                        p.attention_nics,
                        a.context_parallel,
                        p.ffn_gpus,
                        p.ffn_nics
                    )
                } else {
                    "| | | | | | ".to_string()
                };
                let _ = writeln!(body, "{head}{}", cell(r));
                if let (Some(s), Some(x), Some(y)) =
                    (r.afpipe_speedup, r.afpipe_exposed_comm_reduction, r.afpipe_bottleneck_exposed_comm_reduction)
                {
                    let i = match best_vs.iter().position(|b| b.baseline == r.schedule) {
                        Some(i) => i,
                        None => {
                            best_vs.push(Versus::new(&r.schedule));
                            best_vs.len() - 1
                        }
                    };
                    best_vs[i].add(s, x, y);
                }
            }
            for f in &report.failures {
                let _ = writeln!(body, "| | | | | | | {} | did not fit | | | | | |", f.schedule);
                let _ = writeln!(body, "|  |  |  |  |  |  | ↳ `{}` | | | | | | |", plain(&f.error));
            }
        }
        shares.push((model.to_string(), model_shares));
    }

    // DeepSeek-V3 on the paper's cluster: quote the allocator.
    let v3 = cost_for("deepseek-v3", &cluster, 4096)
        .and_then(|c| crate::allocator::AllocationProblem::new(&c, None).map(|_| ()));
    let v3_note = match v3 {
        Ok(()) => "DeepSeek-V3 fits on this cluster; it was left out only to keep the run short.".to_string(),
        Err(e) => {
            format!("DeepSeek-V3 is not used: on this cluster the allocator answers \"{}\".", plain(&e.to_string()))
        }
    };

    let _ = writeln!(md, "# The paper's setting, reproduced by simulation\n");
    let _ = writeln!(
        md,
        "Generated by `disagmoe reproduce-paper` (from the workspace root: `cargo run --release -- reproduce-paper`, or\n\
         without building Burn: `cargo run -p disagmoe-core --release --example reproduce_paper`); do not edit by hand. Cluster: `{}` ({} x {} {} GPUs, {} NICs of {:.0} Gb/s per node). Models: Qwen3-235B-A22B,\n\
         GPT-OSS-120B and **DeepSeekMoE-16B** (the DeepSeek model of this reproduction). {v3_note}\n",
        cluster.name,
        cluster.nodes,
        cluster.node.gpus_per_node,
        cluster.gpu.name,
        cluster.node.nics_per_node,
        cluster.node.nic_bandwidth * 8.0 / 1e9
    );
    let _ = writeln!(
        md,
        "Workload: 64K tokens per micro-batch (`micro-batch = 65536 / seq` sequences), global batch `2 x GPUs x micro-batch`\n\
         sequences. AF-Pipe runs on the allocation `disagmoe plan` chooses (MILP + local search with the simulator);\n\
         each baseline runs on its own layout (smallest pipeline depth that fits, EP over the data-parallel ranks, full\n\
         recomputation only when activations would not fit, and Megatron's context parallelism, each sequence split over\n\
         the smallest power of two of ranks that fits, only when nothing fits without it: `cp` in the layout).\n\
         Every step time below is the makespan of a simulated\n\
         schedule; no baseline is derived from another by a factor.\n"
    );
    let _ = writeln!(md, "## Summary beside the paper\n");
    let _ = writeln!(
        md,
        "| AF-Pipe vs | settings | AF-Pipe faster | best speedup | paper | less exposed comm (mean / bottleneck) | largest reduction (mean / bottleneck) | paper |"
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|");
    let paper = |b: &str| match b {
        "1f1b-interleaved" => ("up to 1.81x", "—"),
        "tutel" => ("up to 1.34x", "up to 88%"),
        "comet" => ("up to 1.34x", "up to 75%"),
        "dualpipe" => ("up to 1.34x", "up to 45%"),
        _ => ("—", "—"),
    };
    for v in &best_vs {
        let (ps, px) = paper(&v.baseline);
        let _ = writeln!(
            md,
            "| {} | {} | {} | {:.2}x | {ps} | {} / {} | {:.0}% / {:.0}% | {px} |",
            v.baseline,
            v.settings,
            v.faster,
            v.best_speedup,
            v.less_exposed,
            v.less_exposed_bottleneck,
            100.0 * v.best_reduction,
            100.0 * v.best_reduction_bottleneck
        );
    }
    let _ = writeln!(
        md,
        "\n*Exposed communication*, the same for every schedule: time a worker's GPUs idle while communication\n\
         that its own compute waits on is pending (from the moment the data is ready to go until it arrives).\n\
         *mean*: averaged over all GPUs; *bottleneck*: on the worker that computes longest, i.e. how much\n\
         communication stretches the step beyond the busiest GPUs' compute.\n"
    );
    let _ =
        writeln!(md, "Attention share of the GPUs chosen by `plan` (the paper: it grows with the sequence length):\n");
    let _ = writeln!(
        md,
        "| model | {} |",
        PAPER_SEQS.iter().map(|s| format!("{}K", s / 1024)).collect::<Vec<_>>().join(" | ")
    );
    let _ = writeln!(md, "|---|{}", "---|".repeat(PAPER_SEQS.len()));
    for (m, v) in &shares {
        let _ = writeln!(
            md,
            "| {m} | {} |",
            v.iter().map(|(_, x)| format!("{:.0}%", 100.0 * x)).collect::<Vec<_>>().join(" | ")
        );
    }
    // The same planner on a cluster whose network is four times richer (4 NICs per GPU).
    let mut rich = cluster.clone();
    rich.node.nics_per_node *= 4;
    rich.name = format!("{} with {} NICs per node", cluster.name, rich.node.nics_per_node);
    let _ = writeln!(
        md,
        "\nThe same planner on `{}` (four NICs per GPU, otherwise identical), where the jobs are no longer\n\
         network-bound and attention's quadratic term decides:\n",
        rich.name
    );
    let _ = writeln!(
        md,
        "| model | {} |",
        PAPER_SEQS.iter().map(|s| format!("{}K", s / 1024)).collect::<Vec<_>>().join(" | ")
    );
    let _ = writeln!(md, "|---|{}", "---|".repeat(PAPER_SEQS.len()));
    for &model in PAPER_MODELS {
        let mut cells = Vec::new();
        for &seq in PAPER_SEQS {
            let p = plan(&cost_for(model, &rich, seq)?, false, DEFAULT_SEARCH_EVALS)?;
            cells.push(format!(
                "{:.0}% ({} x {}+{})",
                100.0 * p.attention_gpus as f64 / (p.attention_gpus + p.ffn_gpus) as f64,
                p.groups,
                p.allocation.attention_gpus_per_group,
                p.allocation.ffn_gpus_per_group
            ));
        }
        let _ = writeln!(md, "| {model} | {} |", cells.join(" | "));
    }
    let _ = writeln!(md, "\n(`p x a+f`: group pairs x attention GPUs + expert GPUs per pair.)");
    context_parallel_section(&mut md, &cluster)?;
    exchange_section(&mut md, &cluster, &names)?;
    balance_section(&mut md, &cluster, &names)?;
    if !opts.mixes.is_empty() {
        heterogeneous_section(&mut md, &opts.mixes)?;
    }
    let _ = writeln!(md, "\n## Figures\n");
    for &model in PAPER_MODELS {
        let svg = opts.img_dir.join(format!("roofline-{model}.svg"));
        let _ = writeln!(md, "![rooflines of {model}]({})\n", relative(&opts.out, &svg));
    }
    for name in SCHEDULE_NAMES {
        let svg = opts.img_dir.join(format!("timeline-gpt-oss-120b-8k-{name}.svg"));
        if svg.exists() {
            let _ = writeln!(
                md,
                "![{name} timeline, GPT-OSS-120B at 8K, first 5% of the step]({})\n",
                relative(&opts.out, &svg)
            );
        }
    }
    md.push_str(&body);
    md.push_str(HONEST_ACCOUNT);
    md.push_str(&trust_section(&opts.out));
    if let Some(dir) = opts.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| CoreError::Io { path: dir.display().to_string(), source })?;
    }
    std::fs::write(&opts.out, md).map_err(|source| CoreError::Io { path: opts.out.display().to_string(), source })?;
    Ok(settings)
}

/// The paper's models at every sequence length on each mixed cluster: AF-Pipe placed by the
/// planner (the fastest role assignment), each other assignment, and the baselines on the cluster
/// as its slowest (`plan --cluster MIX --compare`).
fn heterogeneous_section(md: &mut String, mixes: &[String]) -> Result<()> {
    use crate::heterogeneous::{plan_mixed, MixedScope, Roles};
    use crate::pools::MixedCluster;
    let _ = writeln!(
        md,
        "\n## Heterogeneous clusters\n\n\
         Clusters of two node kinds (`crate::pools`: presets joined by `+`, a node's NIC count after `-`).\n\
         The planner tries every way of giving the two sides pools and keeps the fastest simulated step:\n\
         attention on one pool and experts on the other (each side costed, sized and fitted on its own\n\
         pool's GPUs, the exchange crossing both pools' NICs), both on one pool (the other idle), or both\n\
         over the whole cluster as if every GPU were the slowest kind. The baselines give every GPU the same\n\
         role, so they run on the cluster as its slowest (each figure the pools' minimum): a synchronous step\n\
         waits for its slowest rank. Same workload as above (64K tokens per micro-batch, two micro-batches\n\
         per GPU per step). Each row is one command:\n\n\
         `disagmoe plan --model MODEL --cluster MIX --seq S --micro-batch 65536/S --global-batch 2x128x(65536/S) --precision megatron --compare`\n\n\
         Columns: (a) the planner's choice and its step; the two apart assignments (A: attention's pool, F:\n\
         the experts'), one of them (b), the roles the other way round; each pool alone; (c) AF-Pipe on the\n\
         cluster as its slowest, the best placement that ignores the kinds; (d) the best baseline on it. All\n\
         simulated; \"-\" where nothing fits in memory. Not modelled: a side spread over two pools (each side\n\
         lives in one pool), and a link between the pools slower than their NICs (a cluster file may give\n\
         `pool_link_bandwidth`; each group pair then gets an equal share of it)."
    );
    for spec in mixes {
        let mixed = MixedCluster::from_preset_or_file(spec)?;
        let names: Vec<&str> = mixed.pools.iter().map(|p| p.name.as_str()).collect();
        let (p0, p1) = (names[0], names.get(1).copied().unwrap_or(names[0]));
        let _ = writeln!(
            md,
            "\n### {} ({})\n\n\
             | model | seq | (a) chosen | (a) step (s) | A {p0}, F {p1} (s) | A {p1}, F {p0} (s) | {p0} alone (s) | {p1} alone (s) | (c) as slowest (s) | (d) best baseline (s) | (a) vs (c) | (a) vs (d) |\n\
             |---|---|---|---|---|---|---|---|---|---|---|---|",
            mixed.name,
            mixed.pools.iter().map(|p| format!("{} x {}", p.gpus(), p.gpu.name)).collect::<Vec<_>>().join(" + ")
        );
        for &model in PAPER_MODELS {
            for &seq in PAPER_SEQS {
                let template = cost_for(model, &mixed.slowest(), seq)?;
                let report = match plan_mixed(&template, &mixed, MixedScope::Compare, false, DEFAULT_SEARCH_EVALS) {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = writeln!(md, "| {model} | {seq} | `{}` | | | | | | | | | |", plain(&e.to_string()));
                        continue;
                    }
                };
                let (chosen, best) = report.best();
                let a = best.allocation;
                let step = |r: Roles| report.step_of(r).map_or("-".to_string(), |s| format!("{s:.3}"));
                let slowest = report.step_of(Roles::Slowest);
                let baseline = report.baselines.iter().min_by(|x, y| x.step_s.total_cmp(&y.step_s));
                let ratio = |other: Option<f64>| {
                    other.map_or("-".to_string(), |o| format!("{:.2}x", o / best.predicted_step_s))
                };
                let _ = writeln!(
                    md,
                    "| {model} | {seq} | {}: {} x {}+{}{} | {:.3} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    chosen.description,
                    a.groups,
                    a.attention_gpus_per_group,
                    a.ffn_gpus_per_group,
                    if a.context_parallel > 1 { format!(", CP {}", a.context_parallel) } else { String::new() },
                    best.predicted_step_s,
                    step(Roles::Apart { attention: 0, ffn: 1 }),
                    step(Roles::Apart { attention: 1, ffn: 0 }),
                    step(Roles::OnePool { pool: 0 }),
                    step(Roles::OnePool { pool: 1 }),
                    step(Roles::Slowest),
                    baseline.map_or("-".to_string(), |b| format!("{} {:.3}", b.schedule, b.step_s)),
                    ratio(slowest),
                    ratio(baseline.map(|b| b.step_s)),
                );
            }
        }
    }
    Ok(())
}

/// AF-Pipe in the paper's setting with context parallelism chosen by the planner (`plan
/// --context-parallel auto`, the rest of this page) beside none (`--context-parallel 1`: a GPU
/// holds whole sequences), each planned anew, at every sequence length.
fn context_parallel_section(md: &mut String, cluster: &Cluster) -> Result<()> {
    let _ = writeln!(
        md,
        "\n## Context parallelism\n\n\
         An attention group splits each micro-batch over its GPUs. With 64K tokens per micro-batch, a\n\
         micro-batch holds 16 sequences at 4K and 2 at 32K, fewer than a large group has GPUs: without\n\
         context parallelism (`plan --context-parallel 1`) a GPU holds whole sequences and the rest of\n\
         the group waits; with it (`auto`, every other table here) the `C` GPUs of a replica split each\n\
         sequence into load-balanced causal chunks and pass K/V blocks around a ring (over NVLink when\n\
         the ring fits in a node, else over the NICs; twice the bytes in the backward), overlapped with\n\
         the blocks' compute. Each row is planned anew; `p x a+f` as above; AF-Pipe's simulated step in\n\
         seconds.\n"
    );
    let _ =
        writeln!(md, "| model | seq | micro-batch | with CP: plan | CP | step | without: plan | step | CP's gain |");
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|");
    let afpipe = ["afpipe".to_string()];
    for &model in PAPER_MODELS {
        for &seq in PAPER_SEQS {
            let mut cells = Vec::new();
            let mut steps = Vec::new();
            for cp in [crate::cost::ContextParallel::Auto, crate::cost::ContextParallel::Fixed(1)] {
                let mut cost = cost_for(model, cluster, seq)?;
                cost.context_parallel = cp;
                match plan(&cost, false, DEFAULT_SEARCH_EVALS) {
                    Ok(p) => {
                        let a = &p.allocation;
                        let (report, _) = simulate_schedules(&cost, &afpipe, Some(*a))?;
                        let step = report.schedules.first().map(|r| r.step_s).unwrap_or(f64::NAN);
                        let shape = format!("{} x {}+{}", a.groups, a.attention_gpus_per_group, a.ffn_gpus_per_group);
                        if cp == crate::cost::ContextParallel::Auto {
                            cells.push(format!("{shape} | {}", a.context_parallel));
                        } else {
                            cells.push(shape);
                        }
                        cells.push(format!("{step:.3}"));
                        steps.push(step);
                    }
                    Err(e) => {
                        let gap = if cp == crate::cost::ContextParallel::Auto { " | —" } else { "" };
                        cells.push(format!("does not fit: `{}`{gap}", plain(&e.to_string())));
                        cells.push("—".into());
                        steps.push(f64::NAN);
                    }
                }
            }
            let gain = match steps[..] {
                [with, without] if with.is_finite() && without.is_finite() => format!("{:.2}x", without / with),
                _ => "—".into(),
            };
            let _ = writeln!(
                md,
                "| {model} | {}K | {} | {} | {gain} |",
                seq / 1024,
                paper_micro_batch(seq),
                cells.join(" | ")
            );
        }
    }
    Ok(())
}

/// The paper's setting at 8K with the token exchange in f32, bf16 (the rest of this page) and
/// fp8 dispatch with bf16 combine and gradients (DeepEP's choice): each planned anew, every
/// schedule's transfers in the same dtype (the baselines' all-to-alls too).
fn exchange_section(md: &mut String, cluster: &Cluster, names: &[String]) -> Result<()> {
    let _ = writeln!(
        md,
        "\n## The exchange's precision\n\n\
         At 8K, with the token exchange's payloads in f32, in bf16 (every other table here) and with\n\
         the dispatch in fp8 (e4m3, a scale per 128 values) and the combine and gradients in bf16\n\
         (`plan --exchange-dtype`; the baselines' all-to-alls carry the same payloads), each planned\n\
         anew. Step in seconds; the speed-up is AF-Pipe's over the fastest baseline that fits.\n"
    );
    let _ = writeln!(
        md,
        "| model | exchange | plan (p x a+f) | AF-Pipe step | fastest baseline | its step | AF-Pipe speedup |"
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|---|");
    for &model in PAPER_MODELS {
        for dtype in [ExchangeDtype::F32, ExchangeDtype::Bf16, ExchangeDtype::Fp8] {
            let mut cost = cost_for(model, cluster, 8192)?;
            cost.precision.exchange = ExchangePrecision::of(dtype);
            let p = plan(&cost, false, DEFAULT_SEARCH_EVALS)?;
            let (report, _) = simulate_schedules(&cost, names, Some(p.allocation))?;
            let a = &p.allocation;
            let _ = writeln!(
                md,
                "| {model} | {} | {} x {}+{} | {} |",
                cost.precision.exchange.describe(),
                a.groups,
                a.attention_gpus_per_group,
                a.ffn_gpus_per_group,
                versus_cells(&report.schedules)
            );
        }
    }
    Ok(())
}

/// The paper's setting at 8K under skewed expert loads (Zipf 1.0 and 1.2), with the contiguous
/// split and with EPLB's balanced placement and `E / 8` redundant experts per layer (DeepSeek-V3's
/// proportion: 32 for 256), each planned anew; the baselines see the same load and placement.
fn balance_section(md: &mut String, cluster: &Cluster, names: &[String]) -> Result<()> {
    let _ = writeln!(
        md,
        "\n## Skewed expert load\n\n\
         At 8K with routing skewed over each layer's experts: the expert of rank r gets a share\n\
         proportional to r^-s (`plan --expert-load zipf:s`; ranks shuffled per layer), placed in\n\
         contiguous ranges (the runtime's split) or by EPLB with E/8 redundant experts per layer\n\
         (`--redundant-experts`; DeepSeek-V3's proportion), each planned anew. Every schedule, the\n\
         baselines' expert-parallel ranks too, is timed by its busiest expert GPU under the same load\n\
         and placement; the exchange's volumes stay those of uniform routing. \"busiest / mean\":\n\
         the busiest expert GPU's share of a layer's routed copies over the mean share, averaged over\n\
         layers, on the plan's expert group.\n"
    );
    let _ = writeln!(
        md,
        "| model | load | placement | plan (p x a+f) | busiest / mean | AF-Pipe step | fastest baseline | its step | AF-Pipe speedup |"
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|");
    for &model in PAPER_MODELS {
        let base = cost_for(model, cluster, 8192)?;
        let experts = base.model.moe.experts;
        let mut settings = vec![ExpertBalance::default()];
        for s in [1.0, 1.2] {
            settings.push(ExpertBalance { load: ExpertLoad::Zipf(s), ..Default::default() });
            settings.push(ExpertBalance {
                load: ExpertLoad::Zipf(s),
                placement: ExpertPlacement::Balanced,
                redundant: experts / 8,
            });
        }
        for balance in settings {
            let cost = base.clone().with_expert_balance(balance.clone())?;
            let placement = match balance.placement {
                ExpertPlacement::Contiguous => "contiguous".to_string(),
                ExpertPlacement::Balanced => format!("balanced, {} redundant", balance.redundant),
            };
            let row = plan(&cost, false, DEFAULT_SEARCH_EVALS).and_then(|p| {
                let (report, _) = simulate_schedules(&cost, names, Some(p.allocation))?;
                Ok((p, report))
            });
            let (p, report) = match row {
                Ok(r) => r,
                Err(e) => {
                    let _ = writeln!(
                        md,
                        "| {model} | {} | {placement} | did not fit: {} | | | | | |",
                        balance.load.name(),
                        plain(&e.to_string())
                    );
                    continue;
                }
            };
            let a = &p.allocation;
            let _ = writeln!(
                md,
                "| {model} | {} | {placement} | {} x {}+{} | {:.2} | {} |",
                balance.load.name(),
                a.groups,
                a.attention_gpus_per_group,
                a.ffn_gpus_per_group,
                mean_imbalance(&cost, &balance, a.ffn_gpus_per_group)?,
                versus_cells(&report.schedules)
            );
        }
    }
    Ok(())
}

/// The cells `AF-Pipe step | fastest baseline | its step | AF-Pipe speedup` of simulated
/// `schedules` ("—" where a side did not fit).
fn versus_cells(schedules: &[ScheduleResult]) -> String {
    let afpipe = schedules.iter().find(|r| r.schedule == "afpipe");
    let best = schedules.iter().filter(|r| r.schedule != "afpipe").min_by(|a, b| a.step_s.total_cmp(&b.step_s));
    [
        afpipe.map_or("—".into(), |r| format!("{:.3}", r.step_s)),
        best.map_or("—".into(), |r| r.schedule.clone()),
        best.map_or("—".into(), |r| format!("{:.3}", r.step_s)),
        match (afpipe, best) {
            (Some(a), Some(b)) => format!("{:.2}x", b.step_s / a.step_s),
            _ => "—".into(),
        },
    ]
    .join(" | ")
}

/// An error message made safe inside a markdown table cell or code span.
fn plain(message: &str) -> String {
    message.replace('`', "'").replace('|', "/")
}

/// AF-Pipe against one baseline over all settings.
struct Versus {
    baseline: String,
    settings: usize,
    faster: usize,
    less_exposed: usize,
    less_exposed_bottleneck: usize,
    best_speedup: f64,
    best_reduction: f64,
    best_reduction_bottleneck: f64,
}

impl Versus {
    fn new(baseline: &str) -> Self {
        Self {
            baseline: baseline.to_string(),
            settings: 0,
            faster: 0,
            less_exposed: 0,
            less_exposed_bottleneck: 0,
            best_speedup: 0.0,
            best_reduction: f64::NEG_INFINITY,
            best_reduction_bottleneck: f64::NEG_INFINITY,
        }
    }

    fn add(&mut self, speedup: f64, reduction: f64, reduction_bottleneck: f64) {
        self.settings += 1;
        self.faster += usize::from(speedup > 1.0);
        self.less_exposed += usize::from(reduction > 0.0);
        self.less_exposed_bottleneck += usize::from(reduction_bottleneck > 0.0);
        self.best_speedup = self.best_speedup.max(speedup);
        self.best_reduction = self.best_reduction.max(reduction);
        self.best_reduction_bottleneck = self.best_reduction_bottleneck.max(reduction_bottleneck);
    }
}

const HONEST_ACCOUNT: &str = r#"
## Where and why the numbers differ from the paper

- **The simulated speedups are larger than the paper's** (the summary table puts them side by side). The
  simulator has none of a real system's costs on AF-Pipe's side (kernel launches, the copies that pack and
  unpack M2N/N2M buffers, uneven expert load across ranks), while the baselines that must recompute pay their
  dispatch all-to-all again in backward on a cluster that is network-bound (next point), and DualPipe, with
  the few micro-batches per rank that the global batch leaves it at 16K and 32K, runs many chunks unpaired.
  Read the ratios as what the schedules allow on this model of the cluster, not as a prediction of measured
  speedups.
- **The modelled cluster is network-bound for all three models.** With one 400 Gb/s NIC per GPU at 80%
  efficiency and top-k routing, a token's exchange per MoE layer (dispatch + combine, or M2N + N2M, forward and
  backward) takes longer than its attention and expert compute from 4K to 32K. Every schedule then converges
  towards the same network time, and schedules differ in how much of it they hide. AF-Pipe's gains here come from
  overlap (three independent streams per worker, no blocking between micro-batches), from memory (each GPU
  holds only attention or only experts, so more micro-batches fit in flight without recomputation) and, with
  small expert groups, from sending a token once per destination rank rather than once per expert.
- **The attention share stays at about 50% on the paper's cluster.** When the network binds, the best
  allocation splits the NICs evenly between the two sides (both carry the same bytes), and NICs follow GPUs.
  The paper's finding, more attention GPUs for longer sequences, appears as soon as the network is not the
  bottleneck: see the table on the four-NIC variant of the cluster. The paper's measured speedups imply a less
  network-bound regime than this model's (NIC efficiency, DeepEP-style node-level deduplication and per-kernel
  efficiencies that differ between schedules are not modelled).
- **Exposed communication against DualPipe: below it in all 8 settings where DualPipe fits, on the all-GPU
  mean and on the bottleneck worker.** The closest are DeepSeekMoE-16B at 4K and 8K, where DualPipe fits
  without recomputation: AF-Pipe exposes 5% and 6% less on the mean and its step is 2% shorter. DualPipe runs
  as its fixed program, transcribed from `DualPipe.step` (deepseek-ai/DualPipe): warm-up forwards, then steps
  that each pair one forward chunk with one backward chunk of the other direction, then cool-down backwards
  with zero-bubble weight steps; a step starts when the rank's previous step has finished and its inputs have
  arrived. Inside a step it gets what DeepSeek-V3 describes: the two chunks share the GPUs and one
  communication stream with no fixed order, and backward chunks compute weight gradients apart from input
  gradients (the ZeroBubble split), so an input gradient releases the next all-to-all at once. Point-to-point
  sends are asynchronous (the reference code waits for them before each step). Giving forward chunks priority
  on the GPUs moves DualPipe's figures by under 2%; a second communication stream for its backward
  all-to-alls makes them worse. Modelled earlier with dynamic streams (any ready op of any micro-batch runs),
  DualPipe exposed 1% less than AF-Pipe at DeepSeekMoE-16B 8K; its fixed program leaves its port idle 1-5% of
  the steady phase (when one chunk of a pair has finished, the other's tail of all-to-alls and compute runs
  alone) and 16-31% of the first and last twentieth of the step (unpaired warm-up forwards and cool-down
  backwards): its port is busy 94% (4K) and 93% (8K) of the step, AF-Pipe's 99%. AF-Pipe still moves more
  bytes per port there (about 8.2 s of port time against DualPipe's 7.9 s and 7.8 s; DualPipe's all-to-all
  keeps 1/8 of its traffic on NVLink). Where DualPipe must recompute (all of GPT-OSS-120B, DeepSeekMoE-16B
  from 16K) the backward chunk of a pair re-runs the dispatch and outlasts the forward chunk, and with 8 or 16
  micro-batches per rank (16K, 32K) a large share of the chunks run unpaired; there AF-Pipe exposes 13-53%
  less. Two earlier modelling errors were fixed, no number was tuned: (1) the baselines' full recomputation
  re-runs the dispatch all-to-all in backward (only the layer input is kept, and the expert inputs live on
  other ranks; the combine is not charged again), while AF-Pipe's expert workers keep the tokens they
  received and recompute locally; (2) exposed communication has one definition for all schedules (above);
  before, a send also counted on its sender, which does not wait on it. What remains on AF-Pipe's side:
  its attention workers compute for about half the step (GPT-OSS-120B at 8K: 47%) while the data they wait
  on is almost always pending on their port (98% busy), so their idle half is exposed by definition.
- **Where AF-Pipe's step loses time against its roofline** (GPT-OSS-120B at 8K: 12.24 s against a
  network bound of 10.93 s including per-transfer latency): about 0.2 s is the attention group's gradient
  all-reduce after the last backward (no schedule overlaps it), about 0.2 s is pipeline fill and drain,
  and about 1 s is the network idling in steady state (about 9% of each tenth of the step). The output
  head and loss run on the attention worker after the last layer (6 ms per micro-batch, a quarter of its
  compute); micro-batches reach it in bunches, and while the heads run the attention worker produces
  nothing to send. With the head's cost set near zero (a diagnostic, not a result) the step falls to
  11.90 s; letting 32 or 64 micro-batches fly gives 12.13 s and 12.01 s, and giving the head a lower
  priority than attention makes it worse (12.54 s).
- **Memory decides feasibility.** DualPipe keeps two copies of the parameters and does not fit Qwen3-235B-A22B on
  128 x 80 GB at any length here; the EP baselines do not fit it at 32K even with full recomputation ("did not
  fit" rows quote the constraint and shortfall). DeepSeek-V3 (671B) fits nowhere on this cluster with Adam state,
  hence DeepSeekMoE-16B.
- **Context parallelism.** An attention group splits each micro-batch over its GPUs; where a micro-batch
  has fewer sequences than the planned group has GPUs (most settings here), the planner splits sequences
  (the CP column; the section "Context parallelism" plans the same jobs without it). The ring's K/V
  transfers are charged per layer as `max(compute, transfers)` on each attention GPU, over NVLink when the
  ring fits in a node and over the GPU's NIC share otherwise (GPT-OSS-120B at 32K: a 64-GPU group would need
  rings of 32 across nodes, so the planner takes four pairs of 16 with rings of 8 and a longer pipeline:
  17.2 s against 11.9 s when splitting sequences was free). Not modelled: the ring's traffic competing
  with the exchange on the NICs (rings here stay within a node except Qwen3-235B-A22B's rings of 16),
  MLA passing its compressed latent instead of keys and values, and context parallelism for the baselines,
  which keep whole sequences on each rank (at 32K they pay for it in memory: the EP baselines do not fit
  Qwen3-235B-A22B).
- **Not modelled:** load imbalance between experts beyond the `ceil(E / f)` rounding in every table but
  "Skewed expert load" (routing is assumed uniform there), the exchange's extra bytes to a hot expert
  GPU (its volumes stay uniform in that section too), kernel launch overheads, congestion beyond max-min
  fair sharing of each group's port, overlap of the gradient all-reduce with backward (no schedule
  overlaps it), the optimizer step.
"#;

/// The file `scripts/validate-simulator.sh` writes next to the reproduction: the simulator's
/// predictions against measured runs of the runtime.
pub const VALIDATION_FILE: &str = "simulator-validation.md";

/// "How far to trust these numbers": what the simulator has been checked against, with the
/// validation table read from [`VALIDATION_FILE`] beside `out`.
fn trust_section(out: &Path) -> String {
    let file = out.with_file_name(VALIDATION_FILE);
    let table = std::fs::read_to_string(&file).unwrap_or_else(|_| {
        format!("(No validation yet: `scripts/validate-simulator.sh` writes `{VALIDATION_FILE}` beside this file.)\n")
    });
    format!("{TRUST_HEAD}\n{}\n{TRUST_TAIL}", table.trim_end())
}

const TRUST_HEAD: &str = r#"
## How far to trust these numbers

Every figure above is a simulation. The simulator has been held against what can be measured
here: our own runtime on the 2-core development machine, over emulated links, and under `mpirun`
over a real TCP network between network namespaces with shaped links (the second table below,
with the link model fitted to that network by `disagmoe net-bench`). `disagmoe
compare --predict` builds, from a run's layout, the schedule the runtime executes (its tasks in the
runtime's priority, the in-flight window, one transfer per message on its port at the link's rate
plus the latency, the end-of-step reductions and optimizer), times the tasks and sizes the messages
from a calibration run of the same configuration without link emulation, and simulates it with the
simulator used above (`disagmoe-train/src/runtime/predict/`). `scripts/validate-simulator.sh` runs
it for ep (one micro-batch in flight), ep-overlap (two) and disagg, at three link rates, on two
models, in three alternating rounds (medians; the measured spread in brackets). "Exposed comm" is
the simulator's definition (waits while the awaited data is queued for or on the wire), measured by
the runtime as `in_flight_wait_s`:
"#;

const TRUST_TAIL: &str = r#"
What this validates: the simulator's model of schedules — dependencies, priorities between compute
streams, the in-flight window, ports that carry one message at a time, latency, overlap of one
micro-batch's communication with another's compute — predicts measured step times of AF-Pipe and of
EP with and without overlap within the errors above, where communication and compute are of the
same order (the link rates were chosen so: that is where schedules differ). Most of the remaining
error is the machine: the same run's compute varies by about ±10% from one run to the next here,
and the calibration and the measured run are different runs.

What it does not validate, and what the figures above rest on: (1) the cost model's per-operation
GPU times (FLOP and memory rates, kernel efficiencies): here compute is calibrated, not predicted;
(2) the network at scale: many flows sharing a port (max-min fairness), NVLink beside the NICs,
all-to-alls over hundreds of ranks, real NICs with their latency and loss; the validated runs have
two workers and one flow per port direction, and the real network is TCP through a kernel shaper
on one machine (its fit's incasts have three senders); (3) the baselines Tutel, Comet and DualPipe, which the runtime does not implement (its EP
baseline with two micro-batches in flight is the ping-pong overlap that the stronger ones refine).
Read in this light, the summary table says what the schedules allow on the modelled cluster if its
cost model holds; where its speedups exceed the paper's, the difference comes from costs that are not
modelled on AF-Pipe's side (above): treat them as upper bounds, not predictions. On two CPU workers
the measured difference between disaggregation and an overlapped EP is small (`docs/runtime.md`),
and the simulator, given the same runs' calibrations, predicts it as small.
"#;
