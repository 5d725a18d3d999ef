//! A worker of a distributed run builds and reads only what it holds: its part of a fresh model is
//! bit-identical to the same tensors (and expert rows) of the whole model, the parts together hold
//! every parameter of the model, and reading a part from a checkpoint never materialises more than
//! the part's own tensors and rows.

use std::collections::BTreeMap;
use std::path::Path;

use burn::backend::{Autodiff, Flex};
use disagmoe_models::{FamilyConfig, FamilyModel, FamilyVisitor, HfCheckpoint, ModelConfig, TrainModule};
use disagmoe_train::runtime::layout::Layout;
use disagmoe_train::runtime::part::{build_part, load_part, WeightSource};

type B = Autodiff<Flex>;

/// Every tensor of a named collection as (shape, values).
type Tensors = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

fn tensors(sink: &disagmoe_models::TensorSink) -> Tensors {
    sink.names().map(|n| (n.to_owned(), sink.get(n).map(|(s, v)| (s.to_vec(), v.to_vec())).unwrap())).collect()
}

/// What the parts of every rank of `layout` hold, against the whole model.
struct Check<'a> {
    layout: &'a Layout,
    seed: u64,
}

impl FamilyVisitor<B> for Check<'_> {
    type Output = ();

    fn visit<C: FamilyConfig>(self, config: &C)
    where
        C::Attention<B>: TrainModule<B>,
        C::Router<B>: TrainModule<B>,
        C::Experts<B>: TrainModule<B>,
    {
        let device = Default::default();
        let whole = FamilyModel::<B, C>::init(config.clone(), self.seed, &device);
        let whole_tensors = tensors(&whole.state_dict());
        let total = whole_tensors.values().map(|(s, _)| s.iter().product::<usize>()).sum::<usize>();
        let mut counted = 0;
        let mut seen = BTreeMap::<String, usize>::new();
        for rank in 0..self.layout.workers {
            let part = build_part::<B, C>(config, self.layout, rank, &WeightSource::Seed(self.seed), &device).unwrap();
            let parts = part.counted_once(self.layout, rank, C::FFN_NAME);
            for (name, (shape, values)) in tensors(&parts.whole) {
                let (want_shape, want) = &whole_tensors[&name];
                assert_eq!(&shape, want_shape, "{name}");
                assert_eq!(&values, want, "{name}: built alone, rank {rank} differs from the whole model");
                *seen.entry(name).or_default() += values.len();
            }
            for rows in parts.stacked {
                for (name, (shape, values)) in tensors(&rows.sink) {
                    let (want_shape, want) = &whole_tensors[&name];
                    let row: usize = want_shape[1..].iter().product();
                    let expect = &want[rows.first * row..(rows.first + shape[0]) * row];
                    assert_eq!(&values[..], expect, "{name}: rows from {} built alone differ", rows.first);
                    *seen.entry(name).or_default() += values.len();
                }
            }
            let (_, mine) = part.param_counts(self.layout, rank);
            counted += mine;
            let all = part.param_counts(self.layout, rank).0;
            assert!(all < total, "rank {rank} holds {all} of the model's {total} parameters");
        }
        assert_eq!(counted, total, "the parts count every parameter once");
        for (name, (shape, _)) in &whole_tensors {
            assert_eq!(seen.get(name).copied(), Some(shape.iter().product()), "{name} is held exactly once");
        }
    }
}

#[test]
fn parts_built_alone_are_the_whole_model_s_tensors() {
    for preset in
        ["tiny-qwen3-moe", "tiny-gpt-oss", "tiny-deepseek-v3", "tiny-deepseek-moe", "tiny-mixtral", "tiny-olmoe"]
    {
        let config = ModelConfig::preset(preset).unwrap();
        let (layers, experts) = (config.dims().num_hidden_layers, config.model_shape(preset).moe.experts);
        for layout in [
            Layout::disagg(layers, experts, 4, 2, 2, 2).unwrap(),
            Layout::disagg(layers, experts, 4, 2, 4, 1).unwrap(),
            Layout::ep(layers, experts, 4, 4).unwrap(),
        ] {
            let mut layout = layout;
            layout.sparse = (0..layers).map(|l| config.is_sparse_layer(l)).collect();
            config.visit(Check { layout: &layout, seed: 7 });
        }
    }
}

/// Reads each rank's part of a checkpoint and checks the largest single read.
struct Load<'a> {
    dir: &'a Path,
    layout: &'a Layout,
}

impl FamilyVisitor<B> for Load<'_> {
    type Output = ();

    fn visit<C: FamilyConfig>(self, config: &C)
    where
        C::Attention<B>: TrainModule<B>,
        C::Router<B>: TrainModule<B>,
        C::Experts<B>: TrainModule<B>,
    {
        let device = Default::default();
        let whole = FamilyModel::<B, C>::from_pretrained(self.dir, &device).unwrap();
        let whole_tensors = tensors(&whole.state_dict());
        let largest_whole = whole_tensors.values().map(|(_, v)| v.len()).max().unwrap();
        for rank in 0..self.layout.workers {
            let mut part = build_part::<B, C>(config, self.layout, rank, &WeightSource::Seed(1), &device).unwrap();
            let mut reader = disagmoe_models::CheckpointReader::open(self.dir).unwrap();
            load_part::<B, C>(&mut part, &mut reader, self.layout, rank, &device).unwrap();
            let parts = part.counted_once(self.layout, rank, C::FFN_NAME);
            let mut own = tensors(&parts.whole);
            for rows in &parts.stacked {
                own.extend(tensors(&rows.sink));
            }
            let own_largest = own.values().map(|(_, v)| v.len()).max().unwrap_or(0);
            assert!(
                reader.largest_read() <= own_largest,
                "rank {rank} read {} values at once, its largest tensor has {own_largest}",
                reader.largest_read()
            );
            if !self.layout.holds_ends(rank) {
                assert!(own_largest < largest_whole, "an expert rank holds shards, not the stacked tensors");
            }
            for rows in &parts.stacked {
                for (name, (shape, values)) in tensors(&rows.sink) {
                    let (want_shape, want) = &whole_tensors[&name];
                    let row: usize = want_shape[1..].iter().product();
                    assert_eq!(&values[..], &want[rows.first * row..(rows.first + shape[0]) * row], "{name}");
                }
            }
        }
    }
}

#[test]
fn a_part_read_from_a_checkpoint_reads_only_its_own_rows() {
    // GPT-OSS stacks each layer's experts in one tensor: each holder reads its rows only.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/gpt_oss/gqa2_window_yarn_clamp");
    let config = ModelConfig::from_file(dir.join("config.json")).unwrap();
    let (layers, experts) = (config.dims().num_hidden_layers, config.model_shape("fixture").moe.experts);
    let layout = Layout::disagg(layers, experts, 2, 1, 2, 1).unwrap();
    config.visit(Load { dir: &dir, layout: &layout });
}
