//! `disagmoe plan`, `disagmoe simulate` and `disagmoe reproduce-paper`: the planning commands.
//! They only parse arguments and print; the work is in `disagmoe-core`.

use anyhow::{Context, Result};
use clap::Args;
use disagmoe_core::cost::{CostModel, Workload};
use disagmoe_core::exchange::{ExchangeDtype, ExchangePrecision};
use disagmoe_core::experts::{ExpertBalance, ExpertLoad, ExpertPlacement};
use disagmoe_core::hardware::Cluster;
use disagmoe_core::heterogeneous::{plan_mixed, MixedScope};
use disagmoe_core::model_shape::ModelShape;
use disagmoe_core::phases::{plan_phases_on, Phase};
use disagmoe_core::plan::{mean_imbalance, plan, simulate_schedules, DEFAULT_SEARCH_EVALS, SCHEDULE_NAMES};
use disagmoe_core::pools::MixedCluster;
use disagmoe_core::reproduce::{reproduce_paper, ReproduceOptions};
use std::path::PathBuf;

/// The memory model of the run being planned (`--precision`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PlanPrecision {
    /// The runtime in f32.
    F32,
    /// The runtime under `--precision bf16`: bf16 weights (f32 masters) and products.
    Bf16,
    /// Megatron-Core's mixed precision with its distributed optimizer.
    Megatron,
}

/// Model, cluster and step shape shared by `plan` and `simulate`.
#[derive(Debug, Clone, Args)]
pub struct JobArgs {
    /// Model preset (see `disagmoe_core::model_shape::MODEL_PRESETS`: qwen3-235b-a22b, gpt-oss-120b,
    /// deepseek-moe-16b, mixtral-8x7b, olmoe-1b-7b, ...), a path to a Hugging Face config.json of any
    /// supported family, or a JSON file of a `ModelShape`.
    #[arg(long)]
    pub model: String,
    /// Cluster preset `<gpu>x<nodes>` (gpu: h800, h100, h200, a100, h20), or a .toml/.json cluster
    /// file. `plan` also takes a cluster of several node kinds: pools joined by `+`
    /// (`h100x8+h20x8`, `h100x8+h100x8-4nic` for nodes with 4 NICs), a mix preset (h100+h20,
    /// h800+a100, h100-8nic+h100-4nic), or a file with `pools`.
    #[arg(long)]
    pub cluster: String,
    /// Sequence length in tokens.
    #[arg(long)]
    pub seq: usize,
    /// Sequences per pipeline micro-batch.
    #[arg(long = "micro-batch", default_value_t = 1)]
    pub micro_batch: usize,
    /// Sequences per optimizer step (default: 2 x GPUs x micro-batch).
    #[arg(long = "global-batch")]
    pub global_batch: Option<usize>,
    /// What the token exchange's payloads travel in: bf16, fp8 (dispatch in e4m3 with a scale per
    /// 128 values, combine and gradients in bf16) or f32; the transfers of AF-Pipe and the
    /// baselines' all-to-alls alike [default: bf16].
    #[arg(long, value_name = "f32|bf16|fp8")]
    pub exchange_dtype: Option<ExchangeDtype>,
    /// The products' dtype of the run being planned, as `disagmoe train --precision`: the memory
    /// of each GPU is what the runtime holds under it (f32: f32 weights, gradients and AdamW
    /// moments, the moments sharded over copies; bf16: bf16 weights, f32 gradients, f32 master
    /// weights and moments sharded over copies; activations in the products' dtype); or `megatron`:
    /// Megatron-Core's mixed precision with its distributed optimizer (bf16 weights, f32
    /// gradients, f32 master copy and moments sharded), what `reproduce-paper` plans with
    /// [default: bf16].
    #[arg(long, value_enum, value_name = "f32|bf16|megatron")]
    pub precision: Option<PlanPrecision>,
    /// What AdamW's moments are kept in, as `disagmoe train --optimizer-state-dtype` [default:
    /// f32].
    #[arg(long, value_name = "f32|bf16")]
    pub optimizer_state_dtype: Option<disagmoe_train::config::StateDtype>,
    /// How routed tokens spread over each layer's experts: uniform, zipf:S (the expert of rank r
    /// gets a share proportional to r^-S, ranks shuffled per layer), or the path of a run's
    /// metrics.jsonl (the measured mean share of each expert per layer) [default: uniform].
    #[arg(long, value_name = "uniform|zipf:S|METRICS.jsonl")]
    pub expert_load: Option<String>,
    /// Extra replicas of the hottest experts per MoE layer (DeepSeek's EPLB), placed to even the
    /// expert GPUs' loads [default: 0].
    #[arg(long, default_value_t = 0)]
    pub redundant_experts: usize,
    /// How an attention group shares a micro-batch: `auto` (each group size gets the smallest
    /// context-parallel size C whose a / C replicas divide the micro-batch's sequences: C > 1 only
    /// where sequences are fewer than GPUs), a size C (each sequence split over C GPUs in
    /// load-balanced chunks, ring attention; 1: none), or `dealt` (whole micro-batches per GPU, as
    /// `disagmoe train` runs today) [default: auto].
    #[arg(long, value_name = "auto|C|dealt")]
    pub context_parallel: Option<disagmoe_core::cost::ContextParallel>,
    /// How experts are placed on expert GPUs: contiguous ranges (the runtime's split) or balanced
    /// by load (EPLB) [default: balanced with --redundant-experts, else contiguous].
    #[arg(long, value_name = "contiguous|balanced")]
    pub expert_placement: Option<disagmoe_core::experts::ExpertPlacement>,
}

impl JobArgs {
    /// Loads and validates the model, cluster and workload.
    pub fn cost_model(&self) -> Result<CostModel> {
        let model = model_shape(&self.model).with_context(|| format!("loading model `{}`", self.model))?;
        // A mixed cluster's template runs on the cluster as its slowest (the workload's default
        // global batch counts all its GPUs); `plan` costs each pool on its own.
        let cluster = match self.mixed_cluster()? {
            Some(mixed) => mixed.slowest(),
            None => Cluster::from_preset_or_file(&self.cluster)
                .with_context(|| format!("loading cluster `{}`", self.cluster))?,
        };
        // The default is computed only when it is defined: a micro-batch so large that twice the
        // GPUs' worth overflows is refused with the workload's own rule (at most the global batch).
        let global_batch = match self.global_batch {
            Some(g) => g,
            None => (2 * cluster.total_gpus()).checked_mul(self.micro_batch).ok_or_else(|| {
                anyhow::anyhow!(
                    "invalid `workload.micro_batch` = {}: 2 x {} GPUs x micro_batch (the default global batch) \
                     overflows; give a smaller --micro-batch or a --global-batch",
                    self.micro_batch,
                    cluster.total_gpus()
                )
            })?,
        };
        let workload = Workload { seq: self.seq, micro_batch: self.micro_batch, global_batch };
        let mut cost = CostModel::new(model, cluster, workload)?;
        match self.precision {
            None | Some(PlanPrecision::Bf16) => {}
            Some(PlanPrecision::F32) => cost.precision = disagmoe_core::cost::Precision::runtime(false),
            Some(PlanPrecision::Megatron) => {
                if self.optimizer_state_dtype.is_some() {
                    anyhow::bail!(
                        "--optimizer-state-dtype sets the runtime's moments (with --precision f32 or bf16); \
                         --precision megatron keeps Megatron-Core's f32 master copy and moments"
                    );
                }
                cost.precision = disagmoe_core::cost::Precision::megatron();
            }
        }
        if self.optimizer_state_dtype == Some(disagmoe_train::config::StateDtype::Bf16) {
            cost.precision = cost.precision.with_bf16_moments();
        }
        if let Some(d) = self.exchange_dtype {
            cost.precision.exchange = ExchangePrecision::of(d);
        }
        if let Some(cp) = self.context_parallel {
            cost.context_parallel = cp;
        }
        let load = match &self.expert_load {
            Some(spec) => ExpertLoad::from_arg(spec).with_context(|| format!("--expert-load {spec}"))?,
            None => ExpertLoad::Uniform,
        };
        let placement = self.expert_placement.unwrap_or(if self.redundant_experts > 0 {
            ExpertPlacement::Balanced
        } else {
            ExpertPlacement::Contiguous
        });
        let balance = ExpertBalance { load, placement, redundant: self.redundant_experts };
        Ok(cost.with_expert_balance(balance)?)
    }
}

impl JobArgs {
    /// The cluster when it has several node kinds (pools joined by `+`, a mix preset, a file with
    /// `pools`).
    pub fn mixed_cluster(&self) -> Result<Option<MixedCluster>> {
        if !MixedCluster::is_mixed(&self.cluster) {
            return Ok(None);
        }
        let mixed = MixedCluster::from_preset_or_file(&self.cluster)
            .with_context(|| format!("loading mixed cluster `{}`", self.cluster))?;
        Ok(Some(mixed))
    }
}

/// A planner preset by name; or a file: a Hugging Face `config.json` (any family `disagmoe-models`
/// reads, which describes itself to the planner), else a saved `ModelShape`.
pub fn model_shape(spec: &str) -> Result<ModelShape> {
    let path = std::path::Path::new(spec);
    if !(spec.ends_with(".json") || path.is_file()) {
        return Ok(ModelShape::preset(spec)?);
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let doc: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    if doc.get("model_type").is_some() {
        let name = path
            .parent()
            .and_then(|p| p.file_name())
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_else(|| "custom".into());
        let shape = disagmoe_models::ModelConfig::from_json_str(&text)
            .with_context(|| path.display().to_string())?
            .model_shape(&name);
        shape.validate()?;
        return Ok(shape);
    }
    Ok(ModelShape::from_json_file(path)?)
}

/// `disagmoe plan`: choose GPUs and NICs per attention/expert group.
#[derive(Debug, Clone, Args)]
pub struct PlanArgs {
    /// Model, cluster and step shape.
    #[command(flatten)]
    pub job: JobArgs,
    /// Also list every allocation considered with its predicted step time.
    #[arg(long)]
    pub explain: bool,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Simulator evaluations the local search may spend.
    #[arg(long = "search-evals", default_value_t = DEFAULT_SEARCH_EVALS)]
    pub search_evals: usize,
    /// Write an SVG of both rooflines for the chosen allocation here.
    #[arg(long = "roofline-svg")]
    pub roofline_svg: Option<PathBuf>,
    /// On a mixed cluster: plan every way of giving the two sides pools (not only until the best
    /// is proven) and simulate the baselines on the cluster as its slowest.
    #[arg(long)]
    pub compare: bool,
    /// A run in phases, `SEQxSTEPS` each (`4096x1000,16384x200,32768x100`): plan every phase,
    /// each keeping the tokens per micro-batch and per step of --seq x --micro-batch /
    /// --global-batch, and compare re-planning at each boundary with the best split kept
    /// throughout (all simulated; on a mixed cluster the roles of the pools too).
    #[arg(long, value_delimiter = ',', value_parser = parse_phase, value_name = "SEQxSTEPS,...")]
    pub phases: Vec<(usize, usize)>,
}

/// One `SEQxSTEPS` phase of `--phases` (the batch follows from the tokens every phase keeps).
fn parse_phase(s: &str) -> std::result::Result<(usize, usize), String> {
    match disagmoe_train::config::RunPhase::parse(s).map_err(|e| e.to_string())? {
        disagmoe_train::config::RunPhase { seq, steps, batch: None } => Ok((seq, steps)),
        _ => Err(format!(
            "`{s}`: plan's phases keep the tokens per step of --seq x --global-batch, so a phase has no batch \
             of its own; give SEQxSTEPS"
        )),
    }
}

/// `disagmoe simulate`: simulate AF-Pipe and the baselines.
#[derive(Debug, Clone, Args)]
pub struct SimulateArgs {
    /// Model, cluster and step shape.
    #[command(flatten)]
    pub job: JobArgs,
    /// Comma-separated schedules: afpipe, 1f1b-interleaved, tutel, comet, dualpipe.
    #[arg(long, value_delimiter = ',', default_value = "afpipe,1f1b-interleaved,tutel,comet,dualpipe")]
    pub schedules: Vec<String>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Write `<schedule>.svg` (timeline) and `<schedule>.trace.json` (Chrome/Perfetto) here.
    #[arg(long = "timeline-dir")]
    pub timeline_dir: Option<PathBuf>,
}

/// `disagmoe reproduce-paper`: regenerate docs/paper-reproduction.md by simulation.
#[derive(Debug, Clone, Args)]
pub struct ReproduceArgs {
    /// Markdown file to write.
    #[arg(long, default_value = "docs/paper-reproduction.md")]
    pub out: PathBuf,
    /// Directory for the SVG figures (linked relative to the markdown file).
    #[arg(long = "img-dir", default_value = "docs/img")]
    pub img_dir: PathBuf,
    /// Cluster preset of the paper's setting.
    #[arg(long, default_value = "h800x16")]
    pub cluster: String,
}

/// Runs `disagmoe plan`.
pub fn run_plan(args: &PlanArgs) -> Result<()> {
    let cost = args.job.cost_model()?;
    if !args.phases.is_empty() {
        return run_plan_phases(args, &cost);
    }
    if let Some(mixed) = args.job.mixed_cluster()? {
        return run_plan_mixed(args, &cost, &mixed);
    }
    if args.compare {
        anyhow::bail!(
            "--compare plans the role assignments of a cluster of several node kinds (e.g. --cluster h100x8+h20x8); \
             on `{}` (one kind) `disagmoe simulate` compares AF-Pipe with the baselines",
            args.job.cluster
        );
    }
    let report = plan(&cost, args.explain, args.search_evals)?;
    if let Some(path) = &args.roofline_svg {
        let a = &report.allocation;
        disagmoe_core::roofline::plot_rooflines_svg(
            path,
            &cost,
            (a.attention_gpus_per_group, a.attention_nics_per_group),
            (a.ffn_gpus_per_group, a.ffn_nics_per_group),
            &[4096, 8192, 16384, 32768],
        )?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "{} on {} at {} tokens x {} sequences per micro-batch",
        report.model, report.cluster, report.seq, report.micro_batch
    );
    println!(
        "  params {:.1}B total, {:.1}B active; {:.2} TFLOP per token (training)",
        report.params_total / 1e9,
        report.params_active / 1e9,
        report.flops_per_token / 1e12
    );
    println!(
        "  {} group pairs: attention {} GPUs / {} NICs, experts {} GPUs / {} NICs",
        report.groups, report.attention_gpus, report.attention_nics, report.ffn_gpus, report.ffn_nics
    );
    let a = report.allocation.attention_gpus_per_group;
    let cp = report.context_parallel;
    println!(
        "  context parallelism {cp} (--context-parallel {}): {} replica(s) of {cp} GPU(s) per attention group of {a}{}",
        report.context_parallel_choice,
        a / cp.max(1),
        if cp > 1 { ", each sequence split over a ring" } else { ", whole sequences per GPU" }
    );
    println!(
        "  predicted step {:.3} s (roofline bottleneck {:.3} s), {} micro-batches in flight{}",
        report.predicted_step_s,
        report.milp_bottleneck_s,
        report.in_flight,
        if report.recompute { ", recomputing activations" } else { "" }
    );
    if let Some(b) = &report.expert_balance {
        println!(
            "  expert load {}: busiest expert GPU at {:.2}x the mean with {} placement and {} redundant \
             expert(s) per layer, step {:.3} s; contiguous without redundant experts {:.2}x, step {:.3} s",
            b.load,
            b.imbalance,
            b.placement.name(),
            b.redundant_experts,
            report.predicted_step_s,
            b.imbalance_contiguous,
            b.step_contiguous_s
        );
    }
    println!("  solved in {:.3} s (MILP {:.3} s)", report.solve_s, report.milp_s);
    for c in report.candidates.iter().flatten() {
        let a = &c.allocation;
        println!(
            "    candidate p={} A {}x{}GPU/{}NIC CP {} F {}x{}GPU/{}NIC: step {:.3} s (roofline {:.3} s)",
            a.groups,
            a.groups,
            a.attention_gpus_per_group,
            a.attention_nics_per_group,
            a.context_parallel,
            a.groups,
            a.ffn_gpus_per_group,
            a.ffn_nics_per_group,
            c.predicted_step_s,
            c.roofline_s
        );
    }
    Ok(())
}

/// `disagmoe plan --phases`: each phase's plan and the gain of re-planning at the boundaries.
fn run_plan_phases(args: &PlanArgs, cost: &CostModel) -> Result<()> {
    let mixed = args.job.mixed_cluster()?;
    for (given, flag) in
        [(args.compare, "--compare"), (args.roofline_svg.is_some(), "--roofline-svg"), (args.explain, "--explain")]
    {
        if given {
            anyhow::bail!("{flag} plans one step shape; it does not go with --phases");
        }
    }
    let phases = Phase::keeping_tokens(cost.workload, &args.phases)?;
    let r = plan_phases_on(cost, mixed.as_ref(), &phases, args.search_evals.max(1))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    let split = |a: &disagmoe_core::allocator::Allocation| {
        format!(
            "{} x (A {} GPU/{} NIC, F {} GPU/{} NIC){}",
            a.groups,
            a.attention_gpus_per_group,
            a.attention_nics_per_group,
            a.ffn_gpus_per_group,
            a.ffn_nics_per_group,
            if a.context_parallel > 1 { format!(", CP {}", a.context_parallel) } else { String::new() }
        )
    };
    println!("{} on {}, {} phases:", r.model, r.cluster, r.phases.len());
    for p in &r.phases {
        let w = p.phase.workload;
        let single = p.single_step_s.map_or(String::new(), |s| format!("; the single split {s:.3} s"));
        let roles = p.roles_description.as_ref().map_or(String::new(), |r| format!("{r}, "));
        println!(
            "  {} tokens x {} sequences per micro-batch, {} steps: {roles}{}, step {:.3} s{single}",
            w.seq,
            w.micro_batch,
            p.phase.steps,
            split(&p.allocation),
            p.step_s
        );
    }
    println!("  re-planned at each boundary: {:.1} s ({} switch(es) of split)", r.replanned_s, r.switches);
    match (&r.single, r.single_s, r.gain) {
        (Some(a), Some(s), Some(g)) => println!(
            "  best single split ({} compared): {}{}, {s:.1} s; re-planning gains {g:.3}x",
            r.single_candidates,
            r.single_roles_description.as_ref().map_or(String::new(), |r| format!("{r}, ")),
            split(a)
        ),
        _ => println!("  no split the phases' searches found fits in memory in every phase: the run must re-plan"),
    }
    println!("  (switching costs, a checkpoint written and read back, are not counted); solved in {:.3} s", r.solve_s);
    Ok(())
}

/// `disagmoe plan` on a cluster of several node kinds.
fn run_plan_mixed(args: &PlanArgs, cost: &CostModel, mixed: &MixedCluster) -> Result<()> {
    if args.roofline_svg.is_some() {
        anyhow::bail!("--roofline-svg draws one kind of GPU; on a mixed cluster use --explain (each pool's rooflines)");
    }
    let scope = if args.compare { MixedScope::Compare } else { MixedScope::Choose };
    let report = plan_mixed(cost, mixed, scope, args.explain, args.search_evals.max(1))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "{} on {} ({}) at {} tokens x {} sequences per micro-batch",
        report.model,
        report.cluster,
        mixed.pools.iter().map(|p| format!("{} x {}", p.gpus(), p.gpu.name)).collect::<Vec<_>>().join(" + "),
        report.seq,
        report.micro_batch
    );
    let (chosen, best) = report.best();
    let a = &best.allocation;
    println!("  chosen: {}", chosen.description);
    println!(
        "  {} group pairs: attention {} x {} GPUs / {} NICs{}, experts {} x {} GPUs / {} NICs",
        a.groups,
        a.groups,
        a.attention_gpus_per_group,
        a.attention_nics_per_group,
        if a.context_parallel > 1 { format!(" (CP {})", a.context_parallel) } else { String::new() },
        a.groups,
        a.ffn_gpus_per_group,
        a.ffn_nics_per_group
    );
    println!(
        "  predicted step {:.3} s (roofline bottleneck {:.3} s), {} micro-batches in flight{}",
        best.predicted_step_s,
        best.milp_bottleneck_s,
        best.in_flight,
        if best.recompute { ", recomputing activations" } else { "" }
    );
    println!("  role assignments:");
    for (i, r) in report.roles.iter().enumerate() {
        let mark = if i == report.chosen { "*" } else { " " };
        match (&r.plan, &r.error) {
            (Some(p), _) => println!(
                "   {mark} {:<52} step {:>9.3} s  ({} x {}+{} GPUs)",
                r.description,
                p.predicted_step_s,
                p.allocation.groups,
                p.allocation.attention_gpus_per_group,
                p.allocation.ffn_gpus_per_group
            ),
            (None, Some(e)) => println!("   {mark} {:<52} {e}", r.description),
            (None, None) => {}
        }
    }
    if !report.baselines.is_empty() || !report.baseline_failures.is_empty() {
        println!("  baselines on the cluster as its slowest (every GPU plays the same role):");
        for b in &report.baselines {
            println!(
                "    {:<17} step {:>9.3} s  (AF-Pipe as chosen {:.2}x faster)  {}",
                b.schedule,
                b.step_s,
                b.step_s / best.predicted_step_s,
                b.layout
            );
        }
        for f in &report.baseline_failures {
            println!("    {:<17} not run: {}", f.schedule, f.error);
        }
    }
    for r in report.rooflines.iter().flatten() {
        let seq = |s: Option<usize>| s.map_or("never (up to 1M)".to_string(), |s| format!("from {s} tokens"));
        println!(
            "  {} ({}), one node: attention {:.1} FLOP/B vs inflection {:.1} ({:?}-bound, compute-bound {}), \
             {:.2} ms per layer; experts {:.1} FLOP/B vs {:.1} ({:?}-bound, compute-bound {}), {:.2} ms per layer",
            r.pool,
            r.gpu,
            r.attention.intensity,
            r.attention.inflection,
            r.attention.bound,
            seq(r.attention_inflection_seq),
            1e3 * r.attention.time_s,
            r.ffn.intensity,
            r.ffn.inflection,
            r.ffn.bound,
            seq(r.ffn_inflection_seq),
            1e3 * r.ffn.time_s
        );
    }
    println!("  solved in {:.3} s", report.solve_s);
    Ok(())
}

/// Runs `disagmoe simulate`.
pub fn run_simulate(args: &SimulateArgs) -> Result<()> {
    if MixedCluster::is_mixed(&args.job.cluster) {
        anyhow::bail!(
            "`simulate` takes a cluster of one node kind; for `{}` (several kinds) `disagmoe plan --compare` \
             simulates every role assignment and the baselines",
            args.job.cluster
        );
    }
    let cost = args.job.cost_model()?;
    let names: Vec<String> = args.schedules.iter().map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect();
    if names.is_empty() {
        anyhow::bail!("--schedules is empty; choose from {}", SCHEDULE_NAMES.join(", "));
    }
    let (report, sims) = simulate_schedules(&cost, &names, None)?;
    if let Some(dir) = &args.timeline_dir {
        for s in &sims {
            disagmoe_core::report::write_timeline_svg(
                &dir.join(format!("{}.svg", s.schedule.name)),
                &s.schedule,
                &s.trace,
                None,
            )?;
            disagmoe_core::report::write_chrome_trace(
                &dir.join(format!("{}.trace.json", s.schedule.name)),
                &s.schedule,
                &s.trace,
            )?;
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!("{} on {} at {} tokens", report.model, report.cluster, report.seq);
    let balance = cost.expert_balance();
    if let (Some(a), false) = (report.allocation, *balance == ExpertBalance::default()) {
        // The balance of AF-Pipe's expert groups (no extra simulation: `plan` reports the step).
        let f = a.ffn_gpus_per_group;
        let contiguous = ExpertBalance { load: balance.load.clone(), ..Default::default() };
        println!(
            "  expert load {}: busiest expert GPU at {:.2}x the mean on AF-Pipe's expert groups with {} \
             placement and {} redundant expert(s) per layer ({:.2}x contiguous without); every schedule is \
             timed with it",
            balance.load.name(),
            mean_imbalance(&cost, balance, f)?,
            balance.placement.name(),
            balance.redundant,
            mean_imbalance(&cost, &contiguous, f)?
        );
    }
    for r in &report.schedules {
        let vs = match r.afpipe_speedup {
            Some(x) => format!("  AF-Pipe {x:.2}x faster"),
            None => String::new(),
        };
        println!(
            "  {:<17} step {:>9.3} s  exposed comm {:>8.3} s  bubble {:>8.3} s  util {:>5.1}%{vs}\n  {:<17} {}",
            r.schedule,
            r.step_s,
            r.exposed_comm_s,
            r.bubble_s,
            100.0 * r.compute_utilisation,
            "",
            r.layout
        );
    }
    for f in &report.failures {
        println!("  {:<17} not run: {}", f.schedule, f.error);
    }
    Ok(())
}

/// Runs `disagmoe reproduce-paper`.
pub fn run_reproduce(args: &ReproduceArgs) -> Result<()> {
    let options = ReproduceOptions {
        out: args.out.clone(),
        img_dir: args.img_dir.clone(),
        cluster: args.cluster.clone(),
        mixes: disagmoe_core::pools::MIX_PRESETS.iter().map(|(name, _)| name.to_string()).collect(),
    };
    let summary = reproduce_paper(&options)?;
    println!("wrote {} ({} settings simulated)", args.out.display(), summary);
    Ok(())
}
