//! End-to-end checks of `plan` and `simulate` on the paper's cluster and on small clusters.

use disagmoe_core::cost::{CostModel, Workload};
use disagmoe_core::hardware::Cluster;
use disagmoe_core::model_shape::ModelShape;
use disagmoe_core::plan::{plan, simulate_schedules, SCHEDULE_NAMES};
use disagmoe_core::reproduce::{paper_micro_batch, PAPER_MODELS, PAPER_SEQS};
use disagmoe_core::schedule::afpipe::build_afpipe;
use disagmoe_core::schedule::baselines::{build_baseline, Baseline};
use disagmoe_core::simulator::{run, simulate};

fn cost(model: &str, cluster: Cluster, seq: usize) -> CostModel {
    let mb = paper_micro_batch(seq);
    let workload = Workload { seq, micro_batch: mb, global_batch: 2 * cluster.total_gpus() * mb };
    let mut cost = CostModel::new(ModelShape::preset(model).unwrap(), cluster, workload).unwrap();
    // The paper's setting (Megatron-Core's mixed precision), as `reproduce-paper` plans it.
    cost.precision = disagmoe_core::cost::Precision::megatron();
    cost
}

fn share(model: &str, cluster: &Cluster, seq: usize) -> f64 {
    let p = plan(&cost(model, cluster.clone(), seq), false, 6).unwrap();
    p.attention_gpus as f64 / (p.attention_gpus + p.ffn_gpus) as f64
}

#[test]
fn attention_share_grows_with_sequence_length_when_the_network_is_not_the_bottleneck() {
    // Four NICs per GPU: the jobs become compute-bound and attention's quadratic term shows.
    let mut cluster = Cluster::preset("h800x16").unwrap();
    cluster.node.nics_per_node = 32;
    for model in ["gpt-oss-120b", "deepseek-moe-16b"] {
        let shares: Vec<f64> = [4096, 8192, 16384, 32768].iter().map(|&s| share(model, &cluster, s)).collect();
        for w in shares.windows(2) {
            assert!(w[1] >= w[0] - 1e-9, "{model}: attention share falls: {shares:?}");
        }
        assert!(shares[3] > shares[0], "{model}: attention share does not grow: {shares:?}");
    }
}

#[test]
fn baseline_step_times_come_from_simulating_their_schedules() {
    let c = cost("gpt-oss-120b", Cluster::preset("h800x16").unwrap(), 8192);
    let mut faster = c.clone();
    faster.cluster.node.nic_bandwidth *= 4.0;
    let mut ratios = Vec::new();
    for b in [Baseline::Megatron, Baseline::Tutel, Baseline::Comet, Baseline::DualPipe] {
        let s = build_baseline(&c, b).unwrap();
        let (trace, report) = run(&s).unwrap();
        assert_eq!(report.step_s, trace.step_s);
        assert!(report.exposed_comm_s > 0.0, "{}: the all-to-alls must show", b.name());
        let quick = simulate(&build_baseline(&faster, b).unwrap()).unwrap().step_s;
        assert!(quick < report.step_s, "{}: a faster network must help", b.name());
        ratios.push(report.step_s / quick);
    }
    // Each baseline reacts to the network differently: no fixed factor links them.
    ratios.sort_by(f64::total_cmp);
    assert!(ratios[3] - ratios[0] > 0.05, "{ratios:?}");
}

/// Context parallelism in the baselines, as Megatron's, only where nothing fits without it:
/// Qwen3-235B at 32K on the paper's cluster fits no pipeline depth with whole sequences per rank
/// (even recomputed), and fits with each sequence split over `cp > 1` ranks and simulates; at 8K
/// the layout is the one without it.
#[test]
fn baselines_split_sequences_only_where_nothing_fits_without_it() {
    use disagmoe_core::schedule::baselines::ep_layout;
    let cluster = Cluster::preset("h800x16").unwrap();
    let long = cost("qwen3-235b-a22b", cluster.clone(), 32768);
    for b in [Baseline::Megatron, Baseline::Tutel, Baseline::Comet] {
        let layout = ep_layout(&long, b).unwrap();
        assert!(layout.cp > 1, "{}: {layout:?}", b.name());
        // Each micro-batch is one sequence over `cp` ranks: `cp` times the micro-batches.
        assert_eq!(layout.micro_batches, long.workload.global_batch.div_ceil(layout.dp / layout.cp), "{layout:?}");
        let report = simulate(&build_baseline(&long, b).unwrap()).unwrap();
        assert!(report.step_s.is_finite() && report.step_s > 0.0, "{}", b.name());
    }
    let short = cost("qwen3-235b-a22b", cluster, 8192);
    assert_eq!(ep_layout(&short, Baseline::Megatron).unwrap().cp, 1);
}

/// The full reproduction grid (docs/paper-reproduction.md): every schedule simulates, and what
/// the report derives from the simulations is consistent with them. Which schedule is faster in
/// which setting is a reported figure (`disagmoe reproduce`), not something a test asserts.
#[test]
fn the_reproduction_grid_reports_what_it_simulated() {
    let cluster = Cluster::preset("h800x16").unwrap();
    let mut compared = std::collections::HashMap::new();
    for model in PAPER_MODELS {
        for &seq in PAPER_SEQS {
            let (report, sims) =
                simulate_schedules(&cost(model, cluster.clone(), seq), &names(SCHEDULE_NAMES), None).unwrap();
            assert_eq!(report.schedules.len() + report.failures.len(), SCHEDULE_NAMES.len(), "{model} at {seq}");
            assert_eq!(sims.len(), report.schedules.len());
            let af = report.schedules.iter().find(|r| r.schedule == "afpipe").unwrap();
            for (r, sim) in report.schedules.iter().zip(&sims) {
                let what = format!("{model} at {seq}: {}", r.schedule);
                assert_eq!(r.schedule, sim.schedule.name, "{what}");
                assert_eq!(r.step_s, sim.trace.step_s, "{what}");
                assert!(r.step_s.is_finite() && r.step_s > 0.0, "{what}: {}", r.step_s);
                for (name, v) in [("exposed", r.exposed_comm_s), ("bubble", r.bubble_s)] {
                    assert!((0.0..=r.step_s).contains(&v), "{what}: {name} {v} of {}", r.step_s);
                }
                assert!(r.exposed_comm_s + r.bubble_s <= r.step_s * (1.0 + 1e-9), "{what}");
                assert!((0.0..=1.0 + 1e-9).contains(&r.compute_utilisation), "{what}");
                if r.schedule == "afpipe" {
                    continue;
                }
                let speedup = r.afpipe_speedup.unwrap();
                assert!((speedup - r.step_s / af.step_s).abs() <= 1e-12 * speedup, "{what}: {speedup}");
                *compared.entry(r.schedule.clone()).or_insert(0) += 1;
            }
            for f in &report.failures {
                assert!(!f.error.is_empty() && f.schedule != "afpipe", "{model} at {seq}: {f:?}");
            }
        }
    }
    // Every baseline fits in memory in most settings (DualPipe: GPT-OSS-120B and DeepSeekMoE-16B).
    for b in &SCHEDULE_NAMES[1..] {
        assert!(compared.get(*b).copied().unwrap_or(0) >= 8, "{b} ran in too few settings: {compared:?}");
    }
}

fn names(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

#[test]
fn frozen_afpipe_schedule_is_valid_and_replays_the_same_timeline() {
    let c = cost("qwen3-30b-a3b", Cluster::preset("h100x2").unwrap(), 4096);
    let alloc = plan(&c, false, 4).unwrap().allocation;
    let mut s = build_afpipe(&c, &alloc).unwrap();
    let dynamic = simulate(&s).unwrap().step_s;
    s.freeze().unwrap();
    s.validate().unwrap();
    assert!(s
        .workers
        .iter()
        .flat_map(|w| &w.streams)
        .filter(|st| st.kind != disagmoe_core::schedule::StreamKind::Recv)
        .all(|st| st.ordered));
    let frozen = simulate(&s).unwrap().step_s;
    assert!((frozen - dynamic).abs() <= 1e-9 * dynamic, "{frozen} vs {dynamic}");
    // The schedule is plain data: it survives JSON.
    let back: disagmoe_core::schedule::Schedule = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
    assert_eq!(back.workers.len(), s.workers.len());
    assert!(back
        .ops
        .iter()
        .zip(&s.ops)
        .all(|(x, y)| x.kind == y.kind && x.deps == y.deps && x.micro_batch == y.micro_batch));
    let replay = simulate(&back).unwrap().step_s;
    assert!((replay - frozen).abs() <= 1e-9 * frozen, "{replay} vs {frozen}");
}

#[test]
fn plan_and_simulate_json_carry_the_documented_fields() {
    let c = cost("deepseek-moe-16b", Cluster::preset("h800x2").unwrap(), 4096);
    let p = plan(&c, true, 6).unwrap();
    let v = serde_json::to_value(&p).unwrap();
    for key in [
        "attention_gpus",
        "ffn_gpus",
        "attention_nics",
        "ffn_nics",
        "groups",
        "predicted_step_s",
        "solve_s",
        "params_total",
        "params_active",
        "flops_per_token",
        "candidates",
    ] {
        assert!(v.get(key).is_some(), "plan JSON lacks `{key}`: {v}");
    }
    assert!(!p.candidates.unwrap().is_empty());
    assert!(p.attention_gpus + p.ffn_gpus <= 16);
    let names: Vec<String> =
        ["afpipe", "1f1b-interleaved", "tutel", "comet", "dualpipe"].iter().map(|s| s.to_string()).collect();
    let (report, sims) = simulate_schedules(&c, &names, Some(p.allocation)).unwrap();
    let v = serde_json::to_value(&report).unwrap();
    for r in v["schedules"].as_array().unwrap() {
        for key in ["step_s", "exposed_comm_s", "bubble_s"] {
            assert!(r.get(key).is_some(), "{r}");
        }
        if r["schedule"] != "afpipe" {
            assert!(r["afpipe_speedup"].as_f64().unwrap() > 0.0);
        }
    }
    let dir = std::env::temp_dir().join(format!("disagmoe-sim-{}", std::process::id()));
    let s = &sims[0];
    disagmoe_core::report::write_chrome_trace(&dir.join("t.json"), &s.schedule, &s.trace).unwrap();
    disagmoe_core::report::write_timeline_svg(&dir.join("t.svg"), &s.schedule, &s.trace, None).unwrap();
    let trace: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("t.json")).unwrap()).unwrap();
    assert!(trace["traceEvents"].as_array().unwrap().len() > s.schedule.workers.len());
    assert!(std::fs::read_to_string(dir.join("t.svg")).unwrap().starts_with("<svg"));
}

#[test]
fn unknown_schedule_names_are_rejected_with_the_allowed_list() {
    let c = cost("qwen3-30b-a3b", Cluster::preset("h100x2").unwrap(), 4096);
    let e = simulate_schedules(&c, &["gpipe".to_string()], None).err().unwrap().to_string();
    assert!(e.contains("gpipe") && e.contains("dualpipe"), "{e}");
}

/// A skewed expert load slows the expert side by its busiest GPU's share; EPLB's redundant
/// replicas give most of it back and cost expert memory; the plan reports both placements.
#[test]
fn skewed_expert_load_is_timed_on_the_busiest_gpu_and_redundant_experts_even_it() {
    use disagmoe_core::experts::{ExpertBalance, ExpertLoad, ExpertPlacement};
    let base = cost("gpt-oss-120b", Cluster::preset("h800x16").unwrap(), 8192);
    let uniform = base.clone();
    let skewed =
        base.clone().with_expert_balance(ExpertBalance { load: ExpertLoad::Zipf(1.2), ..Default::default() }).unwrap();
    let balanced = base
        .clone()
        .with_expert_balance(ExpertBalance {
            load: ExpertLoad::Zipf(1.2),
            placement: ExpertPlacement::Balanced,
            redundant: 16,
        })
        .unwrap();
    let layers = 0..base.model.layers;
    let flops = |c: &CostModel, f: usize| layers.clone().map(|l| c.ffn_forward(l, f).flops).sum::<f64>();
    let (u, s, b) = (flops(&uniform, 8), flops(&skewed, 8), flops(&balanced, 8));
    assert!(s > 1.5 * u, "zipf 1.2 on 8 GPUs: busiest GPU's flops {s:e} vs uniform {u:e}");
    assert!(b < s && b < 1.2 * u, "16 redundant experts: {b:e} (contiguous {s:e}, uniform {u:e})");
    // The busiest GPU's share under uniform routing: ceil(E / f) / E, in closed form.
    let uniform_share = base.model.moe.experts.div_ceil(8) as f64 / base.model.moe.experts as f64;
    assert!((uniform.busiest_expert_gpu(0, 8).share - uniform_share).abs() < 1e-12);
    // Redundant replicas are held: more expert memory.
    let mem = |c: &CostModel| c.ffn_memory_parts(4, 8, 2, false).params;
    assert!(mem(&balanced) > mem(&skewed), "{} vs {}", mem(&balanced), mem(&skewed));
    assert!((mem(&skewed) - mem(&uniform)).abs() < 1e-6, "no replicas, same weights");

    let p = plan(&balanced, false, 6).unwrap();
    let b = p.expert_balance.expect("a skewed load is reported");
    assert!(b.imbalance < b.imbalance_contiguous, "{b:?}");
    assert!(b.step_contiguous_s > p.predicted_step_s, "{b:?} vs {}", p.predicted_step_s);
    assert!(plan(&uniform, false, 6).unwrap().expert_balance.is_none());

    // What does not fit the model is refused by name.
    let e =
        base.clone().with_expert_balance(ExpertBalance { redundant: 2, ..Default::default() }).unwrap_err().to_string();
    assert!(e.contains("redundant_experts") && e.contains("balanced"), "{e}");
    let e = base
        .clone()
        .with_expert_balance(ExpertBalance {
            load: ExpertLoad::Zipf(1.0),
            placement: ExpertPlacement::Balanced,
            redundant: usize::MAX,
        })
        .unwrap_err()
        .to_string();
    assert!(e.contains("at most"), "{e}");
    let measured =
        ExpertLoad::from_metrics_jsonl(r#"{"expert_load":[{"layer":0,"tokens_per_expert":[1,2,3]}]}"#).unwrap();
    let e = base.with_expert_balance(ExpertBalance { load: measured, ..Default::default() }).unwrap_err().to_string();
    assert!(e.contains("experts"), "{e}");
}

#[test]
fn at_32k_the_planner_splits_sequences_where_it_pays_and_a_fixed_size_is_kept() {
    use disagmoe_core::cost::ContextParallel;
    let cluster = Cluster::preset("h800x16").unwrap();
    // Two sequences per micro-batch: without context parallelism a GPU holds a whole sequence.
    let auto = cost("gpt-oss-120b", cluster.clone(), 32768);
    let with = plan(&auto, false, 6).unwrap();
    let a = with.allocation;
    assert!(with.context_parallel > 1 && with.context_parallel == a.context_parallel, "{a:?}");
    assert_eq!(a.attention_gpus_per_group / a.context_parallel, 2, "{a:?}: a replica per sequence");
    assert_eq!(with.context_parallel_choice, "auto");
    let mut none = auto.clone();
    none.context_parallel = ContextParallel::Fixed(1);
    let without = plan(&none, false, 6).unwrap();
    assert_eq!(without.allocation.context_parallel, 1);
    assert!(with.predicted_step_s < without.predicted_step_s, "{with:?} vs {without:?}");
    // The simulated step of each plan is its AF-Pipe schedule's.
    for (c, p) in [(&auto, &with), (&none, &without)] {
        let s = simulate(&build_afpipe(c, &p.allocation).unwrap()).unwrap();
        assert!((s.step_s - p.predicted_step_s).abs() < 1e-9 * p.predicted_step_s);
    }
    // Rings of 3 fit groups of 24 (three nodes); rings of 17 fit no group of 128 GPUs (divisors or
    // multiples of 8, at most 127 beside an expert group): refused, naming the option.
    let mut three = auto.clone();
    three.context_parallel = ContextParallel::Fixed(3);
    let a = plan(&three, false, 6).unwrap().allocation;
    assert!(a.context_parallel == 3 && a.attention_gpus_per_group % 3 == 0, "{a:?}");
    let mut seventeen = auto.clone();
    seventeen.context_parallel = ContextParallel::Fixed(17);
    let e = plan(&seventeen, false, 6).unwrap_err().to_string();
    assert!(e.contains("context_parallel") && e.contains("multiple of 17") && e.contains("auto"), "{e}");
}

/// A cluster of one node kind plans exactly as it did before clusters of several kinds existed:
/// `docs/paper-reproduction.md`, regenerated here without its section on mixed clusters, equals
/// the committed page without that section, byte for byte (so the page is also what the code
/// writes today).
#[test]
fn the_paper_page_is_what_the_planner_writes_byte_for_byte() {
    use disagmoe_core::reproduce::{reproduce_paper, ReproduceOptions};
    let dir = std::env::temp_dir().join(format!("disagmoe-paper-{}", std::process::id()));
    let out = dir.join("docs").join("paper-reproduction.md");
    let options = ReproduceOptions {
        out: out.clone(),
        img_dir: dir.join("docs").join("img"),
        cluster: "h800x16".into(),
        mixes: Vec::new(),
    };
    // The page quotes the simulator's validation from the file beside it.
    let docs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs");
    std::fs::create_dir_all(dir.join("docs")).unwrap();
    std::fs::copy(docs.join("simulator-validation.md"), dir.join("docs").join("simulator-validation.md")).unwrap();
    reproduce_paper(&options).unwrap();
    let written = std::fs::read_to_string(&out).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let committed = std::fs::read_to_string(docs.join("paper-reproduction.md")).unwrap();
    let (from, to) = ("\n## Heterogeneous clusters\n", "\n## Figures\n");
    let start = committed.find(from).expect("the committed page has the mixed clusters' section");
    let end = start + committed[start..].find(to).expect("and the figures after it");
    let without = format!("{}{}", &committed[..start], &committed[end..]);
    if written != without {
        let line = written.lines().zip(without.lines()).position(|(a, b)| a != b);
        let show = |text: &str| line.and_then(|l| text.lines().nth(l)).unwrap_or("").to_string();
        panic!(
            "the page differs from what the planner writes at line {:?}:\n  written:   {}\n  committed: {}\n\
             regenerate it with `cargo run -p disagmoe-core --release --example reproduce_paper`",
            line.map(|l| l + 1),
            show(&written),
            show(&without)
        );
    }
}
