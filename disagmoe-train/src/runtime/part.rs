//! What one worker holds, built alone: its part of the model and nothing else.
//!
//! A worker builds the embedding and head (if it holds them), the attention stages of its layers
//! and the expert stages of its layers with only its experts ([`build_part`]): freshly initialised
//! from the run seed and each tensor's checkpoint name (bit-identical to the same tensors and rows
//! of the whole model), or read from a checkpoint directory tensor by tensor, and only the rows of
//! its experts where the checkpoint stacks them. No worker ever allocates a tensor of a component it
//! does not hold.

use std::collections::HashMap;
use std::path::PathBuf;

use burn::module::{Module, ModuleDisplay, ParamId};
use burn::tensor::backend::{AutodiffBackend, Backend};

use disagmoe_models::stages::{AttentionStage, Ends, ExpertStage};
use disagmoe_models::{CheckpointReader, FamilyConfig, Init, TensorSink};

use super::layout::Layout;
use crate::error::Result;

/// What one worker holds.
#[derive(Module, Debug)]
pub struct WorkerPart<B: Backend, A: Module<B>, R: Module<B>, X: Module<B>> {
    /// Embedding, final norm and head (attention group 0; every `ep` worker).
    pub ends: Option<Ends<B, A, R, X>>,
    /// Attention stages of [`Layout::attn_layers`], in order.
    pub attention: Vec<AttentionStage<B, A, R>>,
    /// Expert stages of [`Layout::ffn_layers`], in order, with only this worker's experts.
    pub experts: Vec<ExpertStage<B, X>>,
}

/// Where the weights of a run come from.
#[derive(Debug, Clone)]
pub enum WeightSource {
    /// Freshly initialised from this seed.
    Seed(u64),
    /// A Hugging Face checkpoint directory.
    Checkpoint(PathBuf),
}

/// The part of the model `rank` holds under `layout`, built (or read) alone.
pub fn build_part<B: AutodiffBackend, C: FamilyConfig>(
    config: &C,
    layout: &Layout,
    rank: usize,
    source: &WeightSource,
    device: &B::Device,
) -> Result<WorkerPart<B, C::Attention<B>, C::Router<B>, C::Experts<B>>> {
    let init = match source {
        WeightSource::Seed(seed) => Init::new(*seed, config.dims().initializer_range, device),
        WeightSource::Checkpoint(_) => Init::placeholders(device),
    };
    let ends = layout.holds_ends(rank).then(|| Ends::init(config, &init));
    let attention: Vec<_> =
        layout.attn_layers(rank).into_iter().map(|l| AttentionStage::init(config, l, &init)).collect();
    let experts: Vec<_> = layout
        .ffn_layers(rank)
        .into_iter()
        .map(|(l, i)| ExpertStage::init(config, l, &layout.expert_runs(l, i), i == 0, &init))
        .collect();
    let mut part = WorkerPart { ends, attention, experts };
    if let WeightSource::Checkpoint(dir) = source {
        load_part::<B, C>(&mut part, &mut CheckpointReader::open(dir)?, layout, rank, device)?;
    }
    Ok(part)
}

/// Replaces every tensor of `rank`'s part with the checkpoint's (its own tensors only, and only its
/// rows of a tensor stacked over experts).
pub fn load_part<B: AutodiffBackend, C: FamilyConfig>(
    part: &mut WorkerPart<B, C::Attention<B>, C::Router<B>, C::Experts<B>>,
    ckpt: &mut CheckpointReader,
    layout: &Layout,
    rank: usize,
    device: &B::Device,
) -> Result<()> {
    if let Some(ends) = &mut part.ends {
        ends.load(ckpt, device)?;
    }
    for (stage, l) in part.attention.iter_mut().zip(layout.attn_layers(rank)) {
        stage.load(ckpt, l, C::FFN_NAME, device)?;
    }
    for (stage, (l, _)) in part.experts.iter_mut().zip(layout.ffn_layers(rank)) {
        stage.load(ckpt, l, C::FFN_NAME, device)?;
    }
    Ok(())
}

/// The parameters of a part saved under their checkpoint names: everything the worker holds
/// (`counted_once: false`), or what it alone counts for the run (`true`: the attention side only on
/// the first copy of a data-parallel group), with the stacked expert tensors (a fused `[E, ...]`
/// layout) apart, each with the first row it holds.
pub struct NamedParts {
    /// Whole tensors.
    pub whole: TensorSink,
    /// `(layer, first row, sink)` of each expert shard of a stacked tensor.
    pub stacked: Vec<StackedRows>,
}

/// Rows `first..` of the stacked expert tensors of one layer.
pub struct StackedRows {
    /// The layer.
    pub layer: usize,
    /// First row (expert) held.
    pub first: usize,
    /// The rows, under the whole tensors' names.
    pub sink: TensorSink,
}

impl<B: Backend, A, R, X> WorkerPart<B, A, R, X>
where
    A: Module<B> + ModuleDisplay + disagmoe_models::decoder::AttentionLayer<B>,
    R: Module<B> + ModuleDisplay + disagmoe_models::Router<B>,
    X: Module<B> + ModuleDisplay + disagmoe_models::Experts<B>,
{
    fn save(&self, layout: &Layout, rank: usize, ffn_name: &str, counted_once: bool, names_only: bool) -> NamedParts {
        let new_sink = || if names_only { TensorSink::names_only() } else { TensorSink::new() };
        let mut whole = new_sink();
        let mut stacked = Vec::new();
        if !counted_once || layout.replicas(rank).first() == Some(&rank) {
            if let Some(ends) = &self.ends {
                ends.save(&mut whole);
            }
            for (stage, l) in self.attention.iter().zip(layout.attn_layers(rank)) {
                stage.save(&mut whole, l, ffn_name);
            }
        }
        for (stage, (l, _)) in self.experts.iter().zip(layout.ffn_layers(rank)) {
            let prefix = format!("model.layers.{l}.{ffn_name}.experts");
            for (x, run) in stage.experts.iter().zip(&stage.runs) {
                // A replicated expert is counted by its first holder.
                if counted_once && !counts_run(layout, l, run, rank) {
                    continue;
                }
                if x.fused() {
                    let mut sink = new_sink();
                    x.save(&mut sink, &prefix);
                    stacked.push(StackedRows { layer: l, first: run.start, sink });
                } else {
                    x.save(&mut whole, &prefix);
                }
            }
            stage.save_shared(&mut whole, l, ffn_name);
        }
        NamedParts { whole, stacked }
    }

    /// The checkpoint name of every parameter this worker holds.
    pub fn names(&self, layout: &Layout, rank: usize, ffn_name: &str) -> HashMap<ParamId, String> {
        let NamedParts { whole, stacked } = self.save(layout, rank, ffn_name, false, true);
        let mut names = whole.names_by_id();
        for s in stacked {
            names.extend(s.sink.names_by_id());
        }
        names
    }

    /// The values of what this worker counts for the run (see [`NamedParts`]).
    pub fn counted_once(&self, layout: &Layout, rank: usize, ffn_name: &str) -> NamedParts {
        self.save(layout, rank, ffn_name, true, false)
    }

    /// Parameters (values) this worker holds, and those it alone counts for the run (the
    /// attention side on the first copy of a data-parallel group, a replicated expert on its first
    /// holder).
    pub fn param_counts(&self, layout: &Layout, rank: usize) -> (usize, usize) {
        let all = self.num_params();
        let first_copy = layout.replicas(rank).first().is_none_or(|&r| r == rank);
        let attention = self.ends.as_ref().map_or(0, |e| e.num_params())
            + self.attention.iter().map(|s| s.num_params()).sum::<usize>();
        let mut counted = if first_copy { attention } else { 0 };
        for (stage, (l, _)) in self.experts.iter().zip(layout.ffn_layers(rank)) {
            counted += stage.shared_experts.as_ref().map_or(0, |m| m.num_params());
            counted += stage.dense.as_ref().map_or(0, |m| m.num_params());
            for (x, run) in stage.experts.iter().zip(&stage.runs) {
                if counts_run(layout, l, run, rank) {
                    counted += Module::num_params(x);
                }
            }
        }
        (all, counted)
    }

    /// The expert modules this worker counts for the run (a replicated expert on its first
    /// holder only), for sums over every parameter once.
    pub fn counted_experts(&self, layout: &Layout, rank: usize) -> Vec<&X> {
        let mut out = Vec::new();
        for (stage, (l, _)) in self.experts.iter().zip(layout.ffn_layers(rank)) {
            out.extend(
                stage.experts.iter().zip(&stage.runs).filter(|(_, r)| counts_run(layout, l, r, rank)).map(|(x, _)| x),
            );
        }
        out
    }
}

/// Whether `rank` counts the experts `run` of `layer` for the run: always, unless the run is a
/// replicated expert (a run of its own) and `rank` is not its first holder.
pub fn counts_run(layout: &Layout, layer: usize, run: &std::ops::Range<usize>, rank: usize) -> bool {
    run.len() != 1
        || layout.expert_replicas(layer, run.start) <= 1
        || layout.expert_holders(layer, run.start).first() == Some(&rank)
}
