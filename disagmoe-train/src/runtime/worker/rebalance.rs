//! Placing the experts anew during a run (`rebalance_every`): DeepSeek's EPLB on the loads the run
//! measures, applied by moving the experts that change holder, with their AdamW moments, between
//! expert workers.
//!
//! Every worker keeps the same moving average of each MoE layer's expert shares (from the step's
//! global expert counts, which every worker has after the step's global sum) and, every
//! `rebalance_every` steps after the update, computes the same placement from it
//! (`ExpertMap::balanced`, with the run's redundant replicas, its workers relabelled so that as
//! many experts as can stay where they are: `ExpertMap::keeping`). Layer by layer, each new holder of
//! an expert asks the expert's first old holder for it (point to point, one expert in transit per
//! receiver: it asks for the next once the last has arrived) and serves the requests of the
//! others; then it rebuilds that layer's expert stage from what it kept and what it received,
//! exactly as a resume reads a checkpoint (an in-memory reader: the parameters, then each moment
//! into a module of the same structure that `AdamW::import_moment_modules` takes), and drops the
//! moments of the modules it replaced. The shared experts stay where they are. Afterwards the
//! names, the layout and the reducer's groups of replica holders follow the new placement. The
//! math is unchanged: parameters and moments are the same values wherever they live.

use std::collections::HashMap;
use std::ops::Range;
use std::time::Instant;

use burn::tensor::backend::AutodiffBackend;

use disagmoe_core::experts::ExpertMap;
use disagmoe_models::decoder::AttentionLayer;
use disagmoe_models::moe::{Experts, Router};
use disagmoe_models::stages::ExpertStage;
use disagmoe_models::{CheckpointReader, TensorSink, TrainModule};

use super::Worker;
use crate::config::parallel::LOAD_EMA_DECAY;
use crate::error::{Result, TrainError};
use crate::metrics::Rebalance;
use crate::optim::Moment;
use crate::runtime::msg::{ExpertTensor, Msg};
use crate::trainer::StepReport;

/// Builds a layer's expert stage holding the routed experts of the given runs and nothing else
/// (placeholders, to be loaded): the family's constructor, known where the worker is started.
pub type ExpertBuilder<B, X> = Box<dyn Fn(usize, &[Range<usize>]) -> ExpertStage<B, X>>;

/// The tensors of each expert of `run` held by `x` (its parameters, or the moment `which` names
/// when `x` holds moments), named as the checkpoint names them: an expert's own tensors
/// (`{prefix}.{e}.…`), or its row of a tensor stacked over the run's experts (any other name, its
/// first dimension the run's length). Refused for a tensor that is neither.
fn expert_tensors<B: AutodiffBackend, X: TrainModule<B> + Experts<B>>(
    x: &X,
    run: &Range<usize>,
    prefix: &str,
    experts: usize,
    which: u8,
) -> std::result::Result<HashMap<usize, Vec<ExpertTensor>>, String> {
    let mut sink = TensorSink::new();
    x.save(&mut sink, prefix);
    let names: Vec<String> = sink.names().map(str::to_owned).collect();
    let mut out: HashMap<usize, Vec<ExpertTensor>> = run.clone().map(|e| (e, Vec::new())).collect();
    for name in names {
        let (shape, values) = sink.take(&name).expect("a name of the sink");
        let own = run.clone().find(|e| name.starts_with(&format!("{prefix}.{e}.")));
        if let Some(e) = own {
            let t = ExpertTensor { which, name, shape, first: 0, values };
            out.get_mut(&e).expect("an expert of the run").push(t);
            continue;
        }
        // Rows of the run's experts under the whole tensor's name.
        if shape.first() != Some(&run.len()) {
            return Err(format!(
                "`{name}` ({shape:?}) is neither one expert's tensor (`{prefix}.<expert>.…`) nor stacked over \
                 experts {run:?}: this expert type cannot be moved between workers"
            ));
        }
        let row = values.len() / run.len().max(1);
        let mut whole = shape.clone();
        whole[0] = experts;
        for (j, e) in run.clone().enumerate() {
            let values = values[j * row..(j + 1) * row].to_vec();
            let t = ExpertTensor { which, name: name.clone(), shape: whole.clone(), first: e, values };
            out.get_mut(&e).expect("an expert of the run").push(t);
        }
    }
    Ok(out)
}

/// The tensors of the runs of a layer's stage, per expert, made once per run as they are asked for.
#[derive(Default)]
struct RunCache {
    /// Run index -> expert -> its tensors (taken out as they are sent or kept).
    runs: HashMap<usize, HashMap<usize, Vec<ExpertTensor>>>,
}

impl<B, A, R, X> Worker<B, A, R, X>
where
    B: AutodiffBackend,
    A: TrainModule<B> + AttentionLayer<B>,
    R: TrainModule<B> + Router<B>,
    X: TrainModule<B> + Experts<B>,
{
    /// After a training step: the moving average of the expert loads takes the step's counts, and
    /// every `rebalance_every` steps the experts are placed anew (see the module doc). Every
    /// worker calls it after the same steps.
    #[allow(clippy::type_complexity)]
    pub(super) fn after_update(
        &mut self,
        report: &StepReport,
    ) -> Result<Option<(Rebalance, std::collections::BTreeMap<usize, Vec<Vec<usize>>>)>> {
        let every = self.settings.rebalance_every;
        if every == 0 {
            return Ok(None);
        }
        let t0 = Instant::now();
        let sparse: Vec<usize> = (0..self.layout.layers).filter(|&l| self.layout.sparse[l]).collect();
        for (counts, &l) in report.expert_counts.iter().zip(&sparse) {
            let total: usize = counts.iter().sum();
            if total == 0 {
                continue;
            }
            let shares = counts.iter().map(|&c| c as f64 / total as f64);
            match self.loads.get_mut(&l) {
                Some(avg) => {
                    for (a, s) in avg.iter_mut().zip(shares) {
                        *a = LOAD_EMA_DECAY * *a + (1.0 - LOAD_EMA_DECAY) * s;
                    }
                }
                None => {
                    self.loads.insert(l, shares.collect());
                }
            }
        }
        if self.comm.step % every != 0 {
            return Ok(None);
        }
        // The new placement, the same on every worker (checked below).
        let mut next = self.layout.clone();
        let mut changed = Vec::new();
        for &l in &sparse {
            let Some(avg) = self.loads.get(&l) else { continue };
            let holders = self.layout.ffn_holders(l).len();
            let mut map = ExpertMap::balanced(avg, holders, self.settings.redundant_experts)
                .map_err(crate::runtime::layout::option_error)?;
            // The same balance with as many experts as can be left where they are.
            if let Some(previous) = &self.layout.expert_maps[l] {
                map = map.keeping(previous).map_err(crate::runtime::layout::option_error)?;
            }
            next.set_expert_map(l, map).map_err(crate::runtime::layout::option_error)?;
            if next.expert_maps[l] != self.layout.expert_maps[l] {
                changed.push(l);
            }
        }
        let placement_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let (mut moved, mut bytes) = (0usize, 0usize);
        for &l in &changed {
            let (m, b) = self.move_layer(l, &next)?;
            moved += m;
            bytes += b;
        }
        if !changed.is_empty() {
            self.layout = next;
            let rank = self.rank();
            self.names = self.part().names(&self.layout, rank, self.ffn_name);
            if self.settings.bf16_weights {
                // The experts received arrive as f32 masters: held in bf16 like the others.
                let names = &self.names;
                let low = |id, dims| names.get(&id).is_some_and(|n| crate::optim::held_in_bf16(n, dims));
                let part = self.part.take().expect("part");
                self.part = Some(self.opt.adopt_masters(part, &low));
            }
            let groups = self.layout.expert_replica_groups();
            self.reducer.regroup_experts(&mut self.comm, &groups)?;
        }
        // What it cost (the bytes every worker sent, the slowest worker's seconds), every
        // worker's placement, which must be worker 0's, and the parameters each now holds.
        let workers = self.layout.workers;
        let rank = self.rank();
        let mut sums = vec![0.0f64; 1 + 4 * workers];
        sums[1 + 3 * workers + rank] = self.part().param_counts(&self.layout, rank).0 as f64;
        sums[0] = bytes as f64;
        sums[1 + rank] = placement_s;
        sums[1 + workers + rank] = t1.elapsed().as_secs_f64();
        sums[1 + 2 * workers + rank] = f64::from(super::persist::placement_digest(&self.layout));
        self.all_reduce(&self.everyone(), &mut sums)?;
        let digests = &sums[1 + 2 * workers..1 + 3 * workers];
        let differ: Vec<usize> = (0..workers).filter(|&w| digests[w] != digests[0]).collect();
        if !differ.is_empty() {
            return Err(TrainError::Worker {
                worker: rank,
                cause: format!(
                    "workers {differ:?} placed the experts otherwise than worker 0 after step {}",
                    self.comm.step
                ),
            });
        }
        let slowest = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
        let rebalance = Rebalance {
            experts_moved: moved,
            bytes_moved: sums[0],
            placement_s: slowest(&sums[1..1 + workers]),
            move_s: slowest(&sums[1 + workers..1 + 2 * workers]),
            params_per_rank: sums[1 + 3 * workers..].iter().map(|&x| x as usize).collect(),
        };
        Ok(Some((rebalance, crate::runtime::explicit_placement(&self.layout))))
    }

    /// Moves the experts of `layer` whose holders change under `next`: asks for the ones this
    /// worker gains, serves the ones others gain from it, then rebuilds its stage of the layer.
    /// Returns the expert copies moved in the layer (by every worker) and the bytes this worker
    /// sent.
    fn move_layer(&mut self, layer: usize, next: &crate::runtime::layout::Layout) -> Result<(usize, usize)> {
        let rank = self.rank();
        let holders = self.layout.ffn_holders(layer);
        // Every (holder, expert, source) a move makes: the source is the expert's first old holder.
        let mut moves = Vec::new();
        for (j, &h) in holders.iter().enumerate() {
            let had = self.layout.held_experts(layer, j);
            for e in next.held_experts(layer, j) {
                if !had.contains(&e) && !moves.iter().any(|&(h2, e2, _)| (h2, e2) == (h, e)) {
                    let src = self.layout.expert_holders(layer, e)[0];
                    moves.push((h, e, src));
                }
            }
        }
        let mut wanted: Vec<(usize, usize)> =
            moves.iter().filter(|m| m.0 == rank).map(|&(_, e, src)| (e, src)).rev().collect();
        let mut to_serve = moves.iter().filter(|m| m.2 == rank).count();
        self.comm.working_on(format!("moving the experts of layer {layer} (rebalancing)"));
        let mut cache = RunCache::default();
        let mut received: Vec<ExpertTensor> = Vec::new();
        let mut asked: Option<(usize, usize)> = None;
        let mut sent = 0usize;
        loop {
            if asked.is_none() {
                if let Some((e, src)) = wanted.pop() {
                    self.comm.send(src, Msg::ExpertWanted { layer, expert: e })?;
                    asked = Some((e, src));
                }
            }
            if asked.is_none() && to_serve == 0 {
                break;
            }
            let env = self.next_move_message(layer)?;
            match env.msg {
                Msg::ExpertWanted { expert, .. } => {
                    to_serve = to_serve.checked_sub(1).ok_or_else(|| TrainError::Worker {
                        worker: rank,
                        cause: format!(
                            "worker {} asked for expert {expert} of layer {layer}, which it does not gain",
                            env.src
                        ),
                    })?;
                    // A copy: this worker may keep the expert too (a new replica elsewhere).
                    let tensors = self.expert_from(&mut cache, layer, expert, false)?;
                    let n = tensors.len();
                    for (i, t) in tensors.into_iter().enumerate() {
                        sent += t.values.len() * 4;
                        let msg = Msg::ExpertMoved { layer, expert, tensors: vec![t], last: i + 1 == n };
                        self.comm.send(env.src, msg)?;
                    }
                    if n == 0 {
                        self.comm.send(env.src, Msg::ExpertMoved { layer, expert, tensors: Vec::new(), last: true })?;
                    }
                }
                Msg::ExpertMoved { expert, tensors, last, .. } => {
                    if asked != Some((expert, env.src)) {
                        return Err(TrainError::Worker {
                            worker: rank,
                            cause: format!(
                                "worker {} sent expert {expert} of layer {layer}, which was not asked of it",
                                env.src
                            ),
                        });
                    }
                    received.extend(tensors);
                    if last {
                        asked = None;
                    }
                }
                _ => unreachable!("next_move_message returns moves only"),
            }
        }
        if let Some(&(_, j)) = self.layout.ffn_layers(rank).iter().find(|(l, _)| *l == layer) {
            self.rebuild_layer(&mut cache, layer, j, next, received)?;
        }
        Ok((moves.len(), sent))
    }

    /// The next message of the experts' move of `layer`, from those kept for later or the port;
    /// any other message is kept for later.
    fn next_move_message(&mut self, layer: usize) -> Result<crate::runtime::msg::Envelope> {
        let of_layer = |m: &Msg| matches!(m, Msg::ExpertWanted { layer: l, .. } | Msg::ExpertMoved { layer: l, .. } if *l == layer);
        loop {
            if let Some(pos) = self.comm.later.iter().position(|e| of_layer(&e.msg)) {
                return Ok(self.comm.later.remove(pos));
            }
            let step = self.comm.step;
            let env =
                self.comm.wait_for_message(|| format!("moving the experts of layer {layer} after step {step}"))?;
            match env.msg {
                Msg::Abort { worker, cause } => return Err(TrainError::Worker { worker, cause }),
                ref m if of_layer(m) => return Ok(env),
                _ => self.comm.later.push(env),
            }
        }
    }

    /// The parameters and both moments of expert `expert` of `layer`, which this worker holds, from
    /// `cache` (its run's tensors made once, when first asked for): a copy, or taken out of it
    /// when `take`.
    fn expert_from(&self, cache: &mut RunCache, layer: usize, expert: usize, take: bool) -> Result<Vec<ExpertTensor>> {
        let stage = self.ffn_index.get(&layer).map(|&s| &self.part().experts[s]);
        let found = stage.and_then(|st| st.runs.iter().position(|r| r.contains(&expert)).map(|r| (st, r)));
        let Some((stage, r)) = found else {
            return Err(TrainError::Worker {
                worker: self.rank(),
                cause: format!("asked for expert {expert} of layer {layer}, which it does not hold"),
            });
        };
        if !cache.runs.contains_key(&r) {
            let tensors = self.run_tensors(layer, &stage.experts[r], &stage.runs[r])?;
            cache.runs.insert(r, tensors);
        }
        let run = cache.runs.get_mut(&r).expect("made above");
        Ok(if take { run.remove(&expert) } else { run.get(&expert).cloned() }.unwrap_or_default())
    }

    /// The parameters and both moments of every expert of one run of `layer`.
    fn run_tensors(&self, layer: usize, x: &X, run: &Range<usize>) -> Result<HashMap<usize, Vec<ExpertTensor>>> {
        let prefix = format!("model.layers.{layer}.{}.experts", self.ffn_name);
        let e = self.layout.experts;
        let refused = |cause: String| TrainError::option("rebalance_every", cause);
        // The f32 master weights where the experts are held in bf16.
        let mut all = expert_tensors::<B, X>(&self.opt.masters_as(x.clone()), run, &prefix, e, 0).map_err(refused)?;
        for (which, moment) in [(1, Moment::First), (2, Moment::Second)] {
            let m = self.opt.moments_as(x.clone(), moment);
            for (expert, t) in expert_tensors::<B, X>(&m, run, &prefix, e, which).map_err(refused)? {
                all.get_mut(&expert).expect("the same experts").extend(t);
            }
        }
        Ok(all)
    }

    /// Rebuilds this worker's stage of `layer` (holder `j`) for the experts `next` gives it: the
    /// ones it keeps from its own modules, the others from `received`; the moments of the modules
    /// it replaces are dropped.
    fn rebuild_layer(
        &mut self,
        cache: &mut RunCache,
        layer: usize,
        j: usize,
        next: &crate::runtime::layout::Layout,
        received: Vec<ExpertTensor>,
    ) -> Result<()> {
        let s = self.ffn_index[&layer];
        let keep = next.held_experts(layer, j);
        let mut tensors = received;
        for e in &keep {
            if self.part().experts[s].runs.iter().any(|r| r.contains(e)) {
                tensors.extend(self.expert_from(cache, layer, *e, true)?);
            }
        }
        let mut readers = [CheckpointReader::in_memory(), CheckpointReader::in_memory(), CheckpointReader::in_memory()];
        for t in tensors {
            readers[t.which as usize].put_rows(&t.name, &t.shape, t.first, t.values)?;
        }
        let runs = next.expert_runs(layer, j);
        let device = self.device.clone();
        let build = |reader: &mut CheckpointReader| -> Result<Vec<X>> {
            let mut stage = (self.build_experts)(layer, &runs);
            stage.load(reader, layer, self.ffn_name, &device)?;
            Ok(stage.experts)
        };
        let [p, m, v] = &mut readers;
        let (xs, ms, vs) = (build(p)?, build(m)?, build(v)?);
        let mut part = self.part.take().expect("part");
        let stage = &mut part.experts[s];
        for x in &stage.experts {
            self.opt.forget(x);
        }
        for ((x, m), v) in xs.iter().zip(&ms).zip(&vs) {
            self.opt.import_moment_modules(x, m, v)?;
        }
        stage.experts = xs;
        stage.runs = runs;
        self.part = Some(part);
        Ok(())
    }
}
