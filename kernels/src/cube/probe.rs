//! The grouped expert products, ours or CubeCL's matrix multiplication: chosen by measurement.
//!
//! Two implementations compute a layer's experts on a CubeCL backend: our grouped kernels
//! ([`super::swiglu_experts`], [`super::gpt_oss_experts`]: tiled products over the experts' row
//! segments, one launch per product for all experts, f32 accumulation) and the reference
//! composition (`crate::reference`), expert by expert through Burn's matrix multiplication:
//! CubeCL's matmul, which Burn autotunes and which uses tensor cores (`cmma`) on CUDA for
//! f16/bf16. Which is faster depends on the device, the dtype and the shapes (many small experts
//! favour one launch for all, large ones the tensor cores), so it is measured, once per class of
//! shapes (the operation, backend, device, dtype, width, intermediate size, experts, and the rows
//! rounded up to a power of two), the first time a layer of that class runs: both forward passes on
//! that layer's own inputs (detached: no graph), one warm-up each, then three alternating runs
//! each, the medians compared. `DISAGMOE_EXPERT_PRODUCTS=grouped|matmul` forces one (tests,
//! benchmarks); unset or `probe` measures.
//!
//! A choice made by timing could differ from one process to the next, and with it the bits of a
//! run (a resumed run would not repeat the straight one). So each measurement is kept, like Burn's
//! autotune results, in a cache file (`expert-products.tsv` under `DISAGMOE_CACHE_DIR`, else
//! `$XDG_CACHE_HOME/disagmoe`, else `~/.cache/disagmoe`), and a class found there is not measured
//! again: on a machine, the first run's choice is every later run's. Delete the file to measure
//! again (after a driver or hardware change).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use crate::documents::Documents;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};

/// The implementation of the grouped expert products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertProducts {
    /// Our grouped tiled kernels.
    Grouped,
    /// CubeCL's (autotuned) matrix multiplication, expert by expert.
    Matmul,
}

/// One measurement: the class of shapes, the median forward time of each implementation, and the
/// choice.
#[derive(Debug, Clone, PartialEq)]
pub struct Measured {
    /// The class of shapes (operation, backend, device, dtype, sizes, rows bucket).
    pub class: String,
    /// Median seconds of our grouped kernels (infinite when they do not apply).
    pub grouped_s: f64,
    /// Median seconds of CubeCL's matmul expert by expert.
    pub matmul_s: f64,
    /// The faster one (ours on a tie).
    pub chosen: ExpertProducts,
    /// Read from the cache file rather than measured by this process.
    pub cached: bool,
}

impl Measured {
    /// Its line in the cache file: `chosen <TAB> grouped_s <TAB> matmul_s <TAB> class`.
    fn line(&self) -> String {
        let chosen = match self.chosen {
            ExpertProducts::Grouped => "grouped",
            ExpertProducts::Matmul => "matmul",
        };
        format!("{chosen}\t{:e}\t{:e}\t{}\n", self.grouped_s, self.matmul_s, self.class)
    }

    /// A line of the cache file, `None` when it is not one (a torn or foreign line is skipped).
    fn parse_line(line: &str) -> Option<Self> {
        let mut parts = line.splitn(4, '\t');
        let chosen = match parts.next()? {
            "grouped" => ExpertProducts::Grouped,
            "matmul" => ExpertProducts::Matmul,
            _ => return None,
        };
        let grouped_s = parts.next()?.parse().ok()?;
        let matmul_s = parts.next()?.parse().ok()?;
        let class = parts.next()?.trim_end().to_owned();
        (!class.is_empty()).then_some(Self { class, grouped_s, matmul_s, chosen, cached: true })
    }
}

/// The cache file (see the module docs), `None` when no directory is known.
pub fn cache_file() -> Option<std::path::PathBuf> {
    let dir = std::env::var_os("DISAGMOE_CACHE_DIR")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|d| std::path::PathBuf::from(d).join("disagmoe")))
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache").join("disagmoe")))?;
    Some(dir.join("expert-products.tsv"))
}

fn load_cache() -> HashMap<String, Measured> {
    let text = cache_file().and_then(|p| std::fs::read_to_string(p).ok()).unwrap_or_default();
    text.lines().filter_map(Measured::parse_line).map(|m| (m.class.clone(), m)).collect()
}

/// Appends one measurement to the cache file (one write of one line; best effort: without the
/// file a later process measures again).
fn save(m: &Measured) {
    use std::io::Write;
    let Some(path) = cache_file() else { return };
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(&path) {
        let _ = f.write_all(m.line().as_bytes());
    }
}

/// The environment variable that forces an implementation.
pub const ENV: &str = "DISAGMOE_EXPERT_PRODUCTS";

/// The implementation `DISAGMOE_EXPERT_PRODUCTS` forces, if any (`grouped`, `matmul`; `probe` or
/// unset: none). Any other value is refused when the process reads it first, naming the allowed
/// ones ([`check_env`]).
pub fn forced() -> Option<ExpertProducts> {
    static FORCED: OnceLock<Option<ExpertProducts>> = OnceLock::new();
    THREAD_FORCED
        .with(std::cell::Cell::get)
        .or_else(|| *FORCED.get_or_init(|| parse(std::env::var(ENV).ok().as_deref()).unwrap_or(None)))
}

thread_local! {
    static THREAD_FORCED: std::cell::Cell<Option<ExpertProducts>> = const { std::cell::Cell::new(None) };
}

/// Forces an implementation on the calling thread (`None` removes the override): tests run both.
pub fn force_for_thread(choice: Option<ExpertProducts>) {
    THREAD_FORCED.with(|c| c.set(choice));
}

fn parse(value: Option<&str>) -> Result<Option<ExpertProducts>, String> {
    match value {
        None | Some("probe") | Some("") => Ok(None),
        Some("grouped") => Ok(Some(ExpertProducts::Grouped)),
        Some("matmul") => Ok(Some(ExpertProducts::Matmul)),
        Some(other) => Err(format!("{ENV}={other:?} is not a choice (allowed: probe, grouped, matmul)")),
    }
}

/// Checks `DISAGMOE_EXPERT_PRODUCTS` (programs call it before a run, so that a typo is an error
/// rather than a silent probe).
pub fn check_env() -> Result<(), String> {
    parse(std::env::var(ENV).ok().as_deref()).map(|_| ())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

static CHOICES: Mutex<Option<HashMap<String, Measured>>> = Mutex::new(None);

thread_local! {
    /// The last choice [`choose`] made on this thread (for the run's summary of which
    /// implementation ran: `crate::usage`).
    static LAST_CHOICE: std::cell::Cell<Option<ExpertProducts>> = const { std::cell::Cell::new(None) };
}

/// The last choice made on this thread, cleared.
pub(crate) fn take_last_choice() -> Option<ExpertProducts> {
    LAST_CHOICE.with(|c| c.take())
}

/// Every measurement so far, in no particular order.
pub fn measured() -> Vec<Measured> {
    lock(&CHOICES).as_ref().map(|m| m.values().cloned().collect()).unwrap_or_default()
}

/// The rows of a class: `rows` rounded up to a power of two.
pub(crate) fn rows_bucket(rows: usize) -> usize {
    rows.max(1).next_power_of_two()
}

/// The implementation for `class`: the forced one, the one measured before, or measured now by
/// running `grouped` (`None`: our kernels do not apply) and `matmul` on `device`.
pub(crate) fn choose<B: Backend, T>(
    class: String,
    device: &B::Device,
    grouped: impl FnMut() -> Option<T>,
    matmul: impl FnMut() -> T,
) -> ExpertProducts {
    let chosen = choose_now::<B, T>(class, device, grouped, matmul);
    LAST_CHOICE.with(|c| c.set(Some(chosen)));
    chosen
}

fn choose_now<B: Backend, T>(
    class: String,
    device: &B::Device,
    mut grouped: impl FnMut() -> Option<T>,
    mut matmul: impl FnMut() -> T,
) -> ExpertProducts {
    if let Some(f) = forced() {
        return f;
    }
    // Held while measuring: workers sharing the device wait for one probe instead of running two
    // at once (which would also spoil both figures).
    let mut choices = lock(&CHOICES);
    let map = choices.get_or_insert_with(load_cache);
    if let Some(m) = map.get(&class) {
        return m.chosen;
    }
    let timed = |f: &mut dyn FnMut() -> bool| -> Option<f64> {
        let _ = B::sync(device);
        let t0 = Instant::now();
        let ok = f();
        let _ = B::sync(device);
        ok.then(|| t0.elapsed().as_secs_f64())
    };
    let mut run_grouped = || grouped().is_some();
    let mut run_matmul = || {
        matmul();
        true
    };
    let applies = timed(&mut run_grouped).is_some();
    timed(&mut run_matmul);
    let (mut g, mut m) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        if applies {
            g.extend(timed(&mut run_grouped));
        }
        m.extend(timed(&mut run_matmul));
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::INFINITY)
    };
    let (grouped_s, matmul_s) = (median(g), median(m));
    let chosen = if grouped_s <= matmul_s { ExpertProducts::Grouped } else { ExpertProducts::Matmul };
    let m = Measured { class: class.clone(), grouped_s, matmul_s, chosen, cached: false };
    save(&m);
    map.insert(class, m);
    chosen
}

type Swiglu<B> = (Tensor<B, 2>, Tensor<B, 2>, Tensor<B, 2>);

/// `t` in the product dtype of this thread (`low`), or as it is.
fn to<B: Backend, const D: usize>(t: Tensor<B, D>, low: Option<DType>) -> Tensor<B, D> {
    match low {
        Some(d) => t.cast(d),
        None => t,
    }
}

/// The class of a layer's expert products (see the module docs).
fn class<B: Backend>(what: &str, device: &B::Device, low: Option<DType>, dims: [usize; 4]) -> String {
    let [rows, m, i, e] = dims;
    let sizes = format!("width {m}, intermediate {i}, {e} experts, up to {} rows", rows_bucket(rows));
    class_of::<B>(what, device, low, &sizes)
}

/// `{what} on {runtime} {device}, {dtype}, {sizes}`.
fn class_of<B: Backend>(what: &str, device: &B::Device, low: Option<DType>, sizes: &str) -> String {
    let dtype = low.map_or_else(|| "f32".to_owned(), |d| format!("{d:?}").to_lowercase());
    let name = std::any::type_name::<B>();
    let runtime = if name.contains("Cuda") {
        "cuda"
    } else if name.contains("Wgpu") {
        "wgpu"
    } else {
        "cubecl"
    };
    let graph = if name.contains("Autodiff") { " autodiff" } else { "" };
    format!("{what} on {runtime}{graph} {device:?}, {dtype}, {sizes}")
}

/// [`super::swiglu_experts`] where it is faster than CubeCL's matmul expert by expert (measured,
/// see the module docs), in this thread's product precision (a low one: operands cast to it, our
/// kernels accumulating in f32, the result cast back to f32); `None` where the matmul is faster
/// (or our kernels do not apply): the caller's reference composition then runs it.
///
/// # Shapes
/// - as [`super::swiglu_experts`]
pub fn swiglu_experts_where_faster<B: Backend>(
    xs: Tensor<B, 2>,
    counts: &[usize],
    experts: &[Swiglu<B>],
) -> Option<Tensor<B, 2>> {
    let low = crate::precision::precision().dtype();
    let run = |xs: Tensor<B, 2>, experts: &[Swiglu<B>]| {
        let cast: Vec<Swiglu<B>> =
            experts.iter().map(|(g, u, d)| (to(g.clone(), low), to(u.clone(), low), to(d.clone(), low))).collect();
        super::swiglu_experts(to(xs, low), counts, &cast).map(|y| y.cast(DType::F32))
    };
    let [i, m] = experts.first()?.0.dims();
    let device = xs.device();
    let detached: Vec<Swiglu<B>> =
        experts.iter().map(|(g, u, d)| (g.clone().detach(), u.clone().detach(), d.clone().detach())).collect();
    let class = class::<B>("SwiGLU experts", &device, low, [xs.dims()[0], m, i, experts.len()]);
    let choice = choose::<B, _>(
        class,
        &device,
        || run(xs.clone().detach(), &detached),
        || crate::reference::swiglu_experts(xs.clone().detach(), counts, &detached),
    );
    match choice {
        ExpertProducts::Grouped => run(xs, experts),
        ExpertProducts::Matmul => None,
    }
}

/// [`super::gpt_oss_experts`] where it is faster than CubeCL's matmul expert by expert, as
/// [`swiglu_experts_where_faster`].
///
/// # Shapes
/// - as [`super::gpt_oss_experts`]
#[allow(clippy::too_many_arguments)]
pub fn gpt_oss_experts_where_faster<B: Backend>(
    xs: Tensor<B, 2>,
    counts: &[usize],
    gate_up: Tensor<B, 3>,
    gate_up_bias: Tensor<B, 2>,
    down: Tensor<B, 3>,
    down_bias: Tensor<B, 2>,
    alpha: f64,
    limit: f64,
) -> Option<Tensor<B, 2>> {
    let low = crate::precision::precision().dtype();
    let run = |xs: Tensor<B, 2>, gu: Tensor<B, 3>, gub: Tensor<B, 2>, dn: Tensor<B, 3>, dnb: Tensor<B, 2>| {
        let (xs, gu, gub, dn, dnb) = (to(xs, low), to(gu, low), to(gub, low), to(dn, low), to(dnb, low));
        super::gpt_oss_experts(xs, counts, gu, gub, dn, dnb, alpha, limit).map(|y| y.cast(DType::F32))
    };
    let [e, m, two_i] = gate_up.dims();
    let device = xs.device();
    let (gu, gub, dn, dnb) =
        (gate_up.clone().detach(), gate_up_bias.clone().detach(), down.clone().detach(), down_bias.clone().detach());
    let class = class::<B>("GPT-OSS experts", &device, low, [xs.dims()[0], m, two_i / 2, e]);
    let choice = choose::<B, _>(
        class,
        &device,
        || run(xs.clone().detach(), gu.clone(), gub.clone(), dn.clone(), dnb.clone()),
        || {
            let (gu, gub, dn, dnb) = (gu.clone(), gub.clone(), dn.clone(), dnb.clone());
            crate::reference::gpt_oss_experts(xs.clone().detach(), counts, gu, gub, dn, dnb, alpha, limit)
        },
    );
    match choice {
        ExpertProducts::Grouped => run(xs, gate_up, gate_up_bias, down, down_bias),
        ExpertProducts::Matmul => None,
    }
}

/// Attention under a low product precision: [`super::attention`] (flash attention) on operands
/// cast to it, where that is faster than the reference composition (`crate::reference::attention`,
/// whose `q k^T` and `p v` run in the low dtype through `crate::precision::matmul`, on CubeCL's
/// autotuned, on CUDA tensor-core, matmul), measured and kept as the expert products are (see
/// the module docs; "grouped" there is our kernel, "matmul" the composition). The kernel keeps
/// the softmax, its running maximum and sums in f32 (the sinks, one logit per head, are rounded
/// to the low dtype with the operands); its output is cast back to f32. `None` where the
/// composition is faster, the precision is f32, or the kernel does not apply.
///
/// # Shapes
/// - as [`super::attention`]
pub fn attention_where_faster<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    sinks: Option<Tensor<B, 1>>,
    scale: f64,
    window: Option<usize>,
    docs: Option<&Documents>,
) -> Option<Tensor<B, 4>> {
    let low = crate::precision::precision().dtype()?;
    let run = |q: Tensor<B, 4>, k: Tensor<B, 4>, v: Tensor<B, 4>, sinks: Option<Tensor<B, 1>>| {
        let sinks = sinks.map(|x| x.cast(low));
        super::attention(q.cast(low), k.cast(low), v.cast(low), sinks, scale, window, docs).map(|y| y.cast(DType::F32))
    };
    let ([b, s, h, d], [_, _, g, _], e) = (q.dims(), k.dims(), v.dims()[3]);
    let device = q.device();
    let sizes = format!(
        "{h} heads of {d}, {g} key/value heads of {e}, window {}, sinks {}, documents {}, batch {b}, up to {} positions",
        window.map_or_else(|| "none".to_owned(), |w| w.to_string()),
        if sinks.is_some() { "yes" } else { "no" },
        if docs.is_some_and(|x| !x.is_whole()) { "yes" } else { "no" },
        rows_bucket(s)
    );
    let class = class_of::<B>("attention", &device, Some(low), &sizes);
    let (qd, kd, vd, sd) =
        (q.clone().detach(), k.clone().detach(), v.clone().detach(), sinks.clone().map(|x| x.detach()));
    let choice = choose::<B, Tensor<B, 4>>(
        class,
        &device,
        || run(qd.clone(), kd.clone(), vd.clone(), sd.clone()),
        || crate::reference::attention(qd.clone(), kd.clone(), vd.clone(), sd.clone(), scale, window, docs),
    );
    match choice {
        ExpertProducts::Grouped => run(q, k, v, sinks),
        ExpertProducts::Matmul => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environment_names_one_implementation_or_none() {
        assert_eq!(parse(None), Ok(None));
        assert_eq!(parse(Some("probe")), Ok(None));
        assert_eq!(parse(Some("grouped")), Ok(Some(ExpertProducts::Grouped)));
        assert_eq!(parse(Some("matmul")), Ok(Some(ExpertProducts::Matmul)));
        assert!(parse(Some("tensor-cores")).unwrap_err().contains("probe, grouped, matmul"));
        assert_eq!(rows_bucket(0), 1);
        assert_eq!(rows_bucket(600), 1024);
    }

    #[test]
    fn a_measurement_survives_its_cache_line_and_torn_lines_are_skipped() {
        let m = Measured {
            class: "SwiGLU experts on cuda Cuda(0), bf16, width 4096, intermediate 1536, 64 experts, up to 131072 rows"
                .into(),
            grouped_s: 0.0123,
            matmul_s: 4.5e-3,
            chosen: ExpertProducts::Matmul,
            cached: false,
        };
        let back = Measured::parse_line(&m.line()).unwrap();
        assert_eq!(back, Measured { cached: true, ..m.clone() });
        assert_eq!(Measured::parse_line(&m.line()[..10]), None);
        assert_eq!(Measured::parse_line("fastest\t1\t2\tclass"), None);
        assert_eq!(Measured::parse_line("grouped\t1\t2\t"), None);
    }
}
