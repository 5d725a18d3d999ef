//! What a worker writes and reports beyond its steps: its parameter counts, the final model, the
//! training checkpoints (without gathering anything), and its trace.

use std::path::{Path, PathBuf};

use burn::tensor::backend::AutodiffBackend;

use disagmoe_models::decoder::AttentionLayer;
use disagmoe_models::moe::{Experts, Router};
use disagmoe_models::SaveDtype::F32;
use disagmoe_models::{SaveDtype, TrainModule};

use super::Worker;
use crate::checkpoint::{self, TrainState};
use crate::config::{CheckpointKill, CheckpointMoment};
use crate::error::{Result, TrainError};
use crate::optim::{sum_of_squares, Moment};
use crate::runtime::msg::{Msg, ShardReport};
use crate::runtime::shards::{write_index, write_shards};
use crate::runtime::trace::TraceEvent;
use crate::trainer::StateBytes;

/// A 32-bit digest (FNV-1a) of a layout's explicit expert placements (0 without any).
pub(super) fn placement_digest(layout: &crate::runtime::layout::Layout) -> u32 {
    let mut h = 0x811C_9DC5u32;
    let mut eat = |x: usize| {
        for b in (x as u64).to_le_bytes() {
            h = (h ^ u32::from(b)).wrapping_mul(0x0100_0193);
        }
    };
    for (l, map) in layout.expert_maps.iter().enumerate() {
        let Some(map) = map else { continue };
        eat(l);
        for slots in &map.slots {
            eat(usize::MAX);
            slots.iter().for_each(|&x| eat(x));
        }
    }
    if layout.expert_maps.iter().all(Option::is_none) {
        0
    } else {
        h
    }
}

/// The `i`-th report of every worker's [`Msg::Shards`] (the model's files, then each moment's).
fn nth_reports(gathered: &[Msg], i: usize) -> Vec<ShardReport> {
    gathered.iter().filter_map(|m| if let Msg::Shards(r) = m { r.get(i).cloned() } else { None }).collect()
}

impl<B, A, R, X> Worker<B, A, R, X>
where
    B: AutodiffBackend,
    A: TrainModule<B> + AttentionLayer<B>,
    R: TrainModule<B> + Router<B>,
    X: TrainModule<B> + Experts<B>,
{
    /// This worker's part with the f32 master weights in place of the bf16 working copies (itself
    /// without bf16 weights): what checkpoints and the final model save. Under the distributed
    /// optimizer the copies gather their shards of the masters (every copy takes part).
    fn master_part(&mut self) -> Result<super::WorkerPart<B, A, R, X>> {
        let mut whole = std::collections::HashMap::new();
        if self.settings.bf16_weights {
            if let Some(sharded) = &self.sharded {
                let (group, mut data) = (sharded.group.clone(), sharded.master_shard());
                self.all_gather(&group, &mut data)?;
                whole = self.sharded.as_ref().expect("sharded").split_masters(&data, self.part(), &self.device);
            }
        }
        Ok(self.opt.masters_with(self.part().clone(), &whole))
    }

    /// Parameters each worker holds (by rank) and parameters of the whole model (each counted once),
    /// the same on every worker; an error on every worker when no worker holds the tensor of the
    /// test-only fault `inject_nonfinite`.
    pub fn param_counts(&mut self) -> Result<(Vec<usize>, usize)> {
        let rank = self.rank();
        let (own, counted) = self.part().param_counts(&self.layout, rank);
        let workers = self.layout.workers;
        // Then how many workers hold the tensor of the test-only fault `inject_nonfinite`.
        let poisoned = self.settings.poison_at.as_ref().map(|(_, tensor)| tensor.clone());
        let mut v = vec![0f64; 2 * workers + 2];
        v[rank] = own as f64;
        v[workers] = counted as f64;
        v[workers + 1] = poisoned.as_ref().is_some_and(|t| self.names.values().any(|n| n == t)) as u8 as f64;
        // And the expert placement each worker computed (every process computes its own).
        v[workers + 2 + rank] = placement_digest(&self.layout) as f64;
        self.all_reduce(&self.everyone(), &mut v)?;
        let digests = &v[workers + 2..];
        if digests.iter().any(|&d| d != digests[0]) {
            let differ: Vec<usize> = (0..workers).filter(|&w| digests[w] != digests[0]).collect();
            return Err(TrainError::option(
                "expert_load",
                format!(
                    "workers {differ:?} placed the experts otherwise than worker 0: every process must read the same load (a metrics.jsonl that differs between nodes, or one still being written?)"
                ),
            ));
        }
        if let Some(tensor) = poisoned.filter(|_| v[workers + 1] == 0.0) {
            return Err(TrainError::option(
                "inject_nonfinite.tensor",
                format!("`{tensor}` is not a parameter of the model"),
            ));
        }
        Ok((v[..workers].iter().map(|&x| x as usize).collect(), v[workers] as usize))
    }

    /// The end of the run: the sum of squares of every parameter (each once), each worker's peak
    /// resident memory and the most training state it held, the same on every worker; with `out`,
    /// the model written there by every worker ([`crate::runtime::shards`]) in `dtype`, rank 0
    /// writing `config.json` and the index last.
    pub fn finish(
        &mut self,
        out: Option<&Path>,
        config: &serde_json::Value,
        dtype: SaveDtype,
    ) -> Result<(f64, Vec<f64>, Vec<StateBytes>)> {
        let rank = self.rank();
        self.comm.working_on("writing the final model".into());
        let part = &self.master_part()?;
        let mut own = if self.layout.has_replicas() {
            // A replicated expert once, on its first holder.
            let counted: Vec<X> = part.counted_experts(&self.layout, rank).into_iter().cloned().collect();
            let shared: Vec<_> = part.experts.iter().map(|s| (s.shared_experts.clone(), s.dense.clone())).collect();
            let (s, d): (Vec<_>, Vec<_>) = shared.into_iter().unzip();
            sum_of_squares(&counted) + sum_of_squares(&s) + sum_of_squares(&d)
        } else {
            sum_of_squares(&part.experts)
        };
        if self.layout.replicas(rank).first() == Some(&rank) {
            own += sum_of_squares(&part.ends) + sum_of_squares(&part.attention);
        }
        if let Some(dir) = out {
            let parts = part.counted_once(&self.layout, rank, self.ffn_name);
            let report = write_shards(dir, rank, &parts, self.layout.experts, dtype)?;
            let reports = self.comm.collect_on_zero(Msg::Shards(vec![report]), "the written files")?;
            if rank == 0 {
                let mut config = config.clone();
                dtype.mark_config(&mut config);
                write_index(dir, &nth_reports(&reports, 0), &config)?;
            }
        }
        let workers = self.layout.workers;
        // The checksum, then per rank its peak RSS and its state bytes by kind (exact in f64 up
        // to 2^53 bytes).
        let mut v = vec![0f64; 1 + 4 * workers];
        v[0] = own;
        let s = self.peak_state;
        v[1 + 4 * rank..5 + 4 * rank].copy_from_slice(&[
            crate::metrics::peak_rss_mb(),
            s.params as f64,
            s.grads as f64,
            s.optimizer as f64,
        ]);
        self.all_reduce(&self.everyone(), &mut v)?;
        let per_rank = v[1..].chunks(4);
        let rss = per_rank.clone().map(|c| c[0]).collect();
        let state =
            per_rank.map(|c| StateBytes { params: c[1] as u64, grads: c[2] as u64, optimizer: c[3] as u64 }).collect();
        Ok((v[0], rss, state))
    }

    /// Writes a training checkpoint of the state after `state.step` into `dir` without gathering
    /// anything: rank 0 makes the partial directory; every worker writes its tensors and its AdamW
    /// moments ([`crate::runtime::shards`], the moments laid out as the model under `exp_avg/` and
    /// `exp_avg_sq/`), synced, and reports them; rank 0 then writes the indexes and commits
    /// ([`crate::checkpoint::commit`]), and every worker waits for that before it goes on.
    pub fn checkpoint(
        &mut self,
        dir: &Path,
        state: &TrainState,
        keep: usize,
        config: &serde_json::Value,
        kill: Option<&CheckpointKill>,
    ) -> Result<PathBuf> {
        let (step, rank) = (state.step, self.rank());
        self.comm.working_on(format!("writing the checkpoint of step {step}"));
        let hook = |at| {
            if let Some(k) = kill {
                k.maybe(rank, step, at);
            }
        };
        let all = self.everyone();
        // Phase 0: the partial directory exists before anyone writes.
        if rank == 0 {
            checkpoint::begin(dir, step)?;
        }
        self.all_reduce(&all, &mut [0f64])?;
        // Phase 1: every worker's files, each synced.
        let partial = checkpoint::partial_dir(dir, step);
        let experts = self.layout.experts;
        // The distributed optimizer's moments, gathered whole (every copy takes part; the first
        // writes them).
        let mut whole = Vec::new();
        for moment in Moment::BOTH {
            let Some(sharded) = &self.sharded else { break };
            let (group, mut data) = (sharded.group.clone(), sharded.moment_shard(moment));
            self.all_gather(&group, &mut data)?;
            whole.push(self.sharded.as_ref().expect("sharded").split(&data, &self.device));
        }
        let part = &self.master_part()?;
        let mut reports =
            vec![write_shards(&partial, rank, &part.counted_once(&self.layout, rank, self.ffn_name), experts, F32)?];
        hook(CheckpointMoment::Writing);
        for (i, moment) in Moment::BOTH.into_iter().enumerate() {
            let none = std::collections::HashMap::new();
            let moments = self.opt.moments_with(part.clone(), moment, whole.get(i).unwrap_or(&none));
            let parts = moments.counted_once(&self.layout, rank, self.ffn_name);
            reports.push(write_shards(&checkpoint::moment_dir(&partial, moment), rank, &parts, experts, F32)?);
        }
        hook(CheckpointMoment::Written);
        let gathered = self.comm.collect_on_zero(Msg::Shards(reports), "the checkpoint's files")?;
        // Phase 2: rank 0 alone makes it a checkpoint.
        if rank == 0 {
            write_index(&partial, &nth_reports(&gathered, 0), config)?;
            // The expert placement, so that a resume continues under the same one.
            let layers = crate::runtime::explicit_placement(&self.layout);
            if !layers.is_empty() {
                let saved = crate::runtime::SavedPlacement {
                    options: self.settings.placement_options.clone(),
                    layers,
                    loads: self.loads.clone(),
                };
                let path = partial.join(crate::runtime::PLACEMENT_FILE);
                let text = serde_json::to_vec_pretty(&saved).expect("a placement serialises");
                disagmoe_models::weights::write_atomically(&path, |t| std::fs::write(t, &text))?;
            }
            for (i, moment) in Moment::BOTH.into_iter().enumerate() {
                write_index(&checkpoint::moment_dir(&partial, moment), &nth_reports(&gathered, i + 1), config)?;
            }
            hook(CheckpointMoment::Indexed);
            checkpoint::commit(dir, &partial, state, keep)?;
            hook(CheckpointMoment::Committed);
        }
        self.all_reduce(&all, &mut [0f64])?;
        Ok(dir.join(checkpoint::step_dir_name(step)))
    }

    /// Gathers every worker's trace events on worker 0 (others return an empty list).
    pub fn gather_traces(&mut self) -> Result<Vec<TraceEvent>> {
        let mine = std::mem::take(&mut self.comm.tracer.events);
        let all = self.comm.collect_on_zero(Msg::Trace(mine), "trace events")?;
        Ok(all.into_iter().flat_map(|m| if let Msg::Trace(e) = m { e } else { Vec::new() }).collect())
    }
}
