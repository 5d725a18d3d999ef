//! A weighted mixture of datasets (Megatron's blend): `0.7 tokens/web 0.2 tokens/code 0.1
//! tokens/math`.
//!
//! The windows of a run are dealt in blocks of [`BLEND_BLOCK`]: each block holds exactly `q_d`
//! windows of source `d`, the largest-remainder rounding of `w_d x BLEND_BLOCK`; inside a block the
//! source furthest behind its quota's share goes next (Megatron's blending index, made exact per
//! block), so a block's prefixes stay within about a window of its quotas. Over any run of whole
//! blocks each source's share is its rounded weight, less than `1 / BLEND_BLOCK` from the weight. A
//! source whose weight is too small for a window per block is refused, not silently dropped.
//!
//! Each source is a [`PackedDataset`] of its own (its own held-out split and its own seeded epochs,
//! seed mixed with the source's index); it hands out its windows in its own order, cycling epochs
//! as it runs out. The blend's position is one number, the windows handed out so far
//! (`DataPosition::cursor`; `epoch` stays 0): how far each source got follows from it (whole blocks
//! times its quota plus its windows in the partial block), so a resume at any step reads exactly
//! the windows an uninterrupted run reads.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{Batch, DataPosition, PackedDataset};
use crate::error::{Result, TrainError};

/// Windows per block of the blend (see the module doc).
pub const BLEND_BLOCK: usize = 1000;

/// One source of a blend: a `disagmoe tokenize` directory, a Megatron prefix or a text file, and
/// its weight (relative: the weights are normalised to sum to 1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlendSource {
    /// Relative weight (at least 0; not all 0).
    pub weight: f64,
    /// The data.
    pub path: PathBuf,
}

/// Parses Megatron's blend syntax, `W1 PATH1 W2 PATH2 ...`: one string of words separated by
/// white space, or several command-line values, one word each (a path may then hold spaces).
pub fn parse_blend<S: AsRef<str>>(values: &[S]) -> Result<Vec<BlendSource>> {
    let words: Vec<&str> = match values {
        [one] => one.as_ref().split_whitespace().collect(),
        many => many.iter().map(AsRef::as_ref).collect(),
    };
    let bad = |what: String| {
        TrainError::option(
            "data",
            format!("{what}: a blend is `WEIGHT PATH [WEIGHT PATH ...]`, e.g. `0.7 tokens/web 0.3 tokens/code`"),
        )
    };
    if words.is_empty() || !words.len().is_multiple_of(2) {
        return Err(bad(format!("{} words given, not pairs of a weight and a path", words.len())));
    }
    let sources = words
        .chunks(2)
        .map(|pair| {
            let weight = pair[0].parse::<f64>().map_err(|_| bad(format!("`{}` is not a weight", pair[0])))?;
            Ok(BlendSource { weight, path: PathBuf::from(pair[1]) })
        })
        .collect::<Result<Vec<_>>>()?;
    check_blend(&sources)?;
    Ok(sources)
}

/// Whether command-line values of `--data` are a blend (several values, or one value whose first
/// word is a number followed by more words) rather than one path.
pub fn is_blend<S: AsRef<str>>(values: &[S]) -> bool {
    match values {
        [] => false,
        [one] => {
            let mut words = one.as_ref().split_whitespace();
            words.next().is_some_and(|w| w.parse::<f64>().is_ok()) && words.next().is_some()
        }
        _ => true,
    }
}

/// Refuses a blend that cannot be dealt: no source, a weight that is negative or not finite, or
/// weights summing to 0.
pub fn check_blend(sources: &[BlendSource]) -> Result<()> {
    if sources.is_empty() {
        return Err(TrainError::option("data", "a blend needs at least one `WEIGHT PATH` pair"));
    }
    if let Some(s) = sources.iter().find(|s| !s.weight.is_finite() || s.weight < 0.0) {
        return Err(TrainError::option(
            "data",
            format!(
                "the weight of {} is {}: weights must be finite and at least 0 (relative; normalised to sum to 1)",
                s.path.display(),
                s.weight
            ),
        ));
    }
    let sum: f64 = sources.iter().map(|s| s.weight).sum();
    if !sum.is_finite() {
        return Err(TrainError::option(
            "data",
            format!("the blend's weights sum to {sum}: give them in a smaller scale (they are relative)"),
        ));
    }
    if sum <= 0.0 {
        return Err(TrainError::option(
            "data",
            format!("the blend's weights sum to {sum}: at least one source needs a weight above 0"),
        ));
    }
    for (i, s) in sources.iter().enumerate() {
        if sources[..i].iter().any(|t| t.path == s.path) {
            return Err(TrainError::option(
                "data",
                format!("{} is given twice in the blend: give it once with the sum of its weights", s.path.display()),
            ));
        }
    }
    let index = BlendIndex::new(&sources.iter().map(|s| s.weight).collect::<Vec<_>>());
    if let Some((s, _)) = sources.iter().zip(&index.quotas).find(|(s, &q)| s.weight > 0.0 && q == 0) {
        return Err(TrainError::option(
            "data",
            format!(
                "{} has weight {} of {sum} in all, too small for a window in each block of {BLEND_BLOCK}: \
                 raise it to at least {} of the total, or give it weight 0 (evaluated, never trained on)",
                s.path.display(),
                s.weight,
                1.0 / BLEND_BLOCK as f64
            ),
        ));
    }
    Ok(())
}

/// The blend in Megatron's syntax, weights normalised to sum to 1 (the run settings' `data`, so
/// that `7 a 3 b` and `0.7 a 0.3 b` are the same blend).
pub fn describe_blend(sources: &[BlendSource]) -> String {
    let sum: f64 = sources.iter().map(|s| s.weight).sum();
    sources.iter().map(|s| format!("{} {}", s.weight / sum, s.path.display())).collect::<Vec<_>>().join(" ")
}

/// The order windows are dealt in: per block, each source's quota and the sequence of sources.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlendIndex {
    /// Windows of each source per block (summing to [`BLEND_BLOCK`]).
    pub quotas: Vec<usize>,
    /// The source of each window of a block.
    pub order: Vec<u32>,
}

impl BlendIndex {
    /// The index of `weights` (checked by [`check_blend`]).
    pub fn new(weights: &[f64]) -> Self {
        let sum: f64 = weights.iter().sum();
        let exact: Vec<f64> = weights.iter().map(|w| w / sum * BLEND_BLOCK as f64).collect();
        let mut quotas: Vec<usize> = exact.iter().map(|x| x.floor() as usize).collect();
        // Largest remainders first (ties to the earlier source) until the block is full.
        let mut by_remainder: Vec<usize> = (0..weights.len()).collect();
        by_remainder.sort_by(|&a, &b| (exact[b] - exact[b].floor()).total_cmp(&(exact[a] - exact[a].floor())));
        let missing = BLEND_BLOCK - quotas.iter().sum::<usize>();
        for &d in by_remainder.iter().cycle().take(missing) {
            quotas[d] += 1;
        }
        // The source furthest behind its share of the windows so far goes next (integers:
        // q_d (j + 1) - c_d BLOCK), among those with windows left in the block.
        let mut taken = vec![0usize; weights.len()];
        let order = (0..BLEND_BLOCK)
            .map(|j| {
                let behind = |d: usize| (quotas[d] * (j + 1)) as i64 - (taken[d] * BLEND_BLOCK) as i64;
                let d = (0..weights.len())
                    .filter(|&d| taken[d] < quotas[d])
                    .max_by_key(|&d| (behind(d), std::cmp::Reverse(d)))
                    .expect("a block's quotas sum to its size");
                taken[d] += 1;
                d as u32
            })
            .collect();
        Self { quotas, order }
    }

    /// Windows each source dealt among the first `handed` windows of the run.
    pub fn taken(&self, handed: u64) -> Vec<u64> {
        let (blocks, within) = (handed / BLEND_BLOCK as u64, (handed % BLEND_BLOCK as u64) as usize);
        let mut taken: Vec<u64> = self.quotas.iter().map(|&q| blocks * q as u64).collect();
        for &d in &self.order[..within] {
            taken[d as usize] += 1;
        }
        taken
    }

    /// The source of window `i` of the run.
    pub fn source_of(&self, i: u64) -> usize {
        self.order[(i % BLEND_BLOCK as u64) as usize] as usize
    }
}

/// One source of a run's data, opened.
pub struct Source {
    /// The path as given (metrics and TensorBoard name the source by it).
    pub label: String,
    /// Normalised weight.
    pub weight: f64,
    /// Its windows.
    pub data: PackedDataset,
}

/// What a run trains on: one dataset, or a blend of several.
pub struct RunData {
    sources: Vec<Source>,
    /// `None` for one dataset given as a path (its own position is the run's).
    blend: Option<BlendIndex>,
    /// Windows handed out so far (a blend).
    handed: u64,
}

/// The seed of source `d`'s epochs: the run's own for the first (a one-source blend reads what
/// `--data PATH` reads), mixed with `d` for the others.
fn source_seed(seed: u64, d: usize) -> u64 {
    seed ^ (d as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

impl RunData {
    /// One dataset.
    pub fn single(data: PackedDataset) -> Self {
        let label = data.source().to_owned();
        Self { sources: vec![Source { label, weight: 1.0, data }], blend: None, handed: 0 }
    }

    /// A blend of `sources` (checked by [`check_blend`]), each opened by `open(path, seed)`.
    pub fn blend(
        sources: &[BlendSource],
        seed: u64,
        mut open: impl FnMut(&Path, u64) -> Result<PackedDataset>,
    ) -> Result<Self> {
        check_blend(sources)?;
        let sum: f64 = sources.iter().map(|s| s.weight).sum();
        let mut opened = Vec::with_capacity(sources.len());
        for (d, s) in sources.iter().enumerate() {
            let data = open(&s.path, source_seed(seed, d))?;
            opened.push(Source { label: s.path.display().to_string(), weight: s.weight / sum, data });
        }
        let weights: Vec<f64> = sources.iter().map(|s| s.weight).collect();
        Ok(Self { sources: opened, blend: Some(BlendIndex::new(&weights)), handed: 0 })
    }

    /// The run's data: `[data] blend` when given, else `path` (the bundled corpus by default).
    pub fn for_run(cfg: &crate::config::RunConfig, model_vocab: usize) -> Result<Self> {
        if cfg.data.blend.is_empty() {
            return Ok(Self::single(PackedDataset::for_run(cfg, model_vocab)?));
        }
        check_same_tokenizer(&cfg.data.blend)?;
        let tokenizer_path = super::tokenizer_file(cfg.data.tokenizer.as_deref(), cfg.model.dir.as_deref());
        let tokenizer = super::tokenizer_for(cfg.data.tokenizer.as_deref(), cfg.model.dir.as_deref())?;
        Self::blend(&cfg.data.blend, cfg.seed, |path, seed| {
            if !path.exists() && !megatron_prefix_exists(path) {
                return Err(TrainError::option(
                    "data",
                    format!(
                        "the blend's source {} does not exist (a tokenize directory, a Megatron prefix or a text file)",
                        path.display()
                    ),
                ));
            }
            // A source needs a window, not a batch: the blend cycles its epochs.
            let packing = super::Packing { seq: cfg.data.seq, seed, model_vocab, min_windows: 1 };
            PackedDataset::open(Some(path), tokenizer_path.as_deref(), tokenizer.as_ref(), packing)?
                .hold_out(cfg.data.eval_fraction)?
                .with_document_mask(cfg.data.document_mask)?
                .with_document_positions(cfg.data.document_positions)
        })
    }

    /// The sources, in the order given.
    pub fn sources(&self) -> &[Source] {
        &self.sources
    }

    /// Whether the data is a blend (reported per source).
    pub fn is_blend(&self) -> bool {
        self.blend.is_some()
    }

    /// The blend's index, for a blend.
    pub fn index(&self) -> Option<&BlendIndex> {
        self.blend.as_ref()
    }

    /// Where the data came from, in words.
    pub fn describe(&self) -> String {
        match &self.blend {
            None => self.sources[0].label.clone(),
            Some(_) => {
                self.sources.iter().map(|s| format!("{:.4} {}", s.weight, s.label)).collect::<Vec<_>>().join(" ")
            }
        }
    }

    /// Tokens of every source.
    pub fn num_tokens(&self) -> u64 {
        self.sources.iter().map(|s| s.data.num_tokens()).sum()
    }

    /// Training windows of every source.
    pub fn windows(&self) -> usize {
        self.sources.iter().map(|s| s.data.windows()).sum()
    }

    /// The position the next batch starts at: one dataset's own, or for a blend the windows
    /// handed out so far (in `cursor`).
    pub fn position(&self) -> DataPosition {
        match &self.blend {
            None => self.sources[0].data.position(),
            Some(_) => DataPosition { epoch: 0, cursor: self.handed as usize },
        }
    }

    /// Continues from a saved position (see [`RunData::position`]).
    pub fn seek(&mut self, position: DataPosition) {
        let Some(index) = &self.blend else {
            self.sources[0].data.seek(position);
            return;
        };
        self.handed = position.cursor as u64;
        for (s, taken) in self.sources.iter_mut().zip(index.taken(self.handed)) {
            let n = s.data.windows().max(1) as u64;
            s.data.seek(DataPosition { epoch: taken / n, cursor: (taken % n) as usize });
        }
    }

    /// The next `batch` windows, and how many of them each source gave.
    pub fn next_windows(&mut self, batch: usize) -> (Batch, Vec<usize>) {
        let Some(index) = &self.blend else {
            return (self.sources[0].data.next_windows(batch), vec![batch]);
        };
        let mut counts = vec![0; self.sources.len()];
        let picks = (0..batch)
            .map(|_| {
                let d = index.source_of(self.handed);
                self.handed += 1;
                counts[d] += 1;
                self.sources[d].data.next_window()
            })
            .collect();
        (Batch::of_windows(picks), counts)
    }
}

/// Refuses a blend of `disagmoe tokenize` directories made with different tokenizers (their ids
/// would mean different tokens): every manifest's tokenizer (its SHA-256 when it has one) must be
/// the first's.
fn check_same_tokenizer(sources: &[BlendSource]) -> Result<()> {
    let mut first: Option<(&Path, String)> = None;
    for s in sources.iter().filter(|s| super::data_kind(&s.path) == super::DataKind::Tokenized) {
        let path = s.path.join(super::corpus::MANIFEST_FILE);
        let Ok(text) = std::fs::read_to_string(&path) else { continue };
        // An unreadable manifest is reported when the source is opened.
        let Ok(manifest) = serde_json::from_str::<super::corpus::Manifest>(&text) else { continue };
        let id = manifest.tokenizer_sha256.clone().unwrap_or_else(|| manifest.tokenizer.clone());
        match &first {
            None => first = Some((&s.path, id)),
            Some((other, want)) if *want != id => {
                return Err(TrainError::option(
                    "data",
                    format!(
                        "{} was tokenized with {} and {} with another tokenizer: a blend's sources must share one",
                        s.path.display(),
                        manifest.tokenizer,
                        other.display()
                    ),
                ));
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// Whether `path` is the prefix of a Megatron `.bin`/`.idx` pair.
fn megatron_prefix_exists(path: &Path) -> bool {
    let with = |ext: &str| PathBuf::from(format!("{}.{ext}", path.display()));
    with("bin").exists() && with("idx").exists()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{ByteTokenizer, Packing};

    #[test]
    fn blocks_hit_the_weights_exactly_and_prefixes_stay_close() {
        for weights in [vec![0.7, 0.2, 0.1], vec![1.0, 1.0, 1.0], vec![0.5, 0.0, 0.25, 0.25], vec![0.999, 0.001]] {
            let index = BlendIndex::new(&weights);
            let sum: f64 = weights.iter().sum();
            assert_eq!(index.quotas.iter().sum::<usize>(), BLEND_BLOCK);
            let mut counts = vec![0usize; weights.len()];
            for (j, &d) in index.order.iter().enumerate() {
                counts[d as usize] += 1;
                for (e, &c) in counts.iter().enumerate() {
                    // Every prefix within one window (plus the quota's rounding) of the weights.
                    let want = weights[e] / sum * (j + 1) as f64;
                    assert!((c as f64 - want).abs() <= 1.0 + 1e-9 + (j + 1) as f64 / BLEND_BLOCK as f64);
                }
            }
            assert_eq!(counts, index.quotas, "{weights:?}");
            for (q, w) in index.quotas.iter().zip(&weights) {
                assert!((*q as f64 / BLEND_BLOCK as f64 - w / sum).abs() < 1.0 / BLEND_BLOCK as f64);
            }
            // `taken` agrees with counting.
            let mut c = vec![0u64; weights.len()];
            for i in 0..2500u64 {
                assert_eq!(index.taken(i), c);
                c[index.source_of(i)] += 1;
            }
        }
    }

    #[test]
    fn bad_blends_are_refused_in_one_line() {
        for (spec, want) in [
            ("0.7 a -0.3 b", "at least 0"),
            ("0.5 a 0.5 a", "a is given twice"),
            ("1 a 0.0001 b", "too small for a window"),
            ("1e308 a 1e308 b", "smaller scale"),
            ("0 a 0 b", "sum to 0"),
            ("0.7 a 0.3", "not pairs"),
            ("x a", "`x` is not a weight"),
            ("NaN a", "finite"),
            ("inf a", "finite"),
            ("", "not pairs"),
        ] {
            let e = parse_blend(&[spec]).unwrap_err().to_string();
            assert!(e.contains(want) && !e.contains('\n'), "{spec}: {e}");
        }
        assert!(is_blend(&["0.5 a 0.5 b"]) && is_blend(&["a", "b"]) && !is_blend(&["corpus.txt"]));
        assert!(!is_blend(&["0.5"]), "a file named like a number is a path");
        // Separate values keep their spaces; the same blend in another scale describes alike.
        let b = parse_blend(&["0.5", "my dir", "0.5", "b"]).unwrap();
        assert_eq!(b[0].path, PathBuf::from("my dir"));
        assert_eq!(describe_blend(&parse_blend(&["7 a 3 b"]).unwrap()), "0.7 a 0.3 b");
    }

    /// Three text sources whose windows say which source they are from (first byte `a`, `b`, `c`).
    fn three(seed: u64) -> RunData {
        let sources = parse_blend(&["0.7 a 0.2 b 0.1 c"]).unwrap();
        RunData::blend(&sources, seed, |path, seed| {
            let d = (path.to_str().unwrap().as_bytes()[0] - b'a') as usize;
            let text = path.to_str().unwrap().repeat(8 * (50 + 30 * d));
            PackedDataset::new(&text, "t", &ByteTokenizer, Packing { seq: 8, seed, model_vocab: 256, min_windows: 1 })
        })
        .unwrap()
    }

    #[test]
    fn shares_hold_over_ten_thousand_windows_and_resume_reads_the_same_windows() {
        let mut data = three(5);
        let mut rows = Vec::new();
        let mut counts = [0usize; 3];
        for _ in 0..10_000 / 40 {
            let (batch, c) = data.next_windows(40);
            for (d, n) in c.iter().enumerate() {
                counts[d] += n;
            }
            rows.extend(batch.rows(0..batch.len()).unwrap());
        }
        // The rows say where they came from.
        let seen: Vec<usize> =
            (0..3).map(|d| rows.iter().filter(|r| r[0] == (b'a' + d as u8) as i64).count()).collect();
        assert_eq!(seen, counts);
        for (c, w) in counts.iter().zip([0.7, 0.2, 0.1]) {
            assert!((*c as f64 / 10_000.0 - w).abs() <= 0.005, "{counts:?}");
        }
        // Resume at arbitrary positions (mid-block, mid-epoch of each source): the same windows.
        for at in [0usize, 1, 37, 999, 1000, 1001, 4321, 9960] {
            let mut resumed = three(5);
            resumed.seek(DataPosition { epoch: 0, cursor: at });
            let (batch, _) = resumed.next_windows(40);
            assert_eq!(batch.rows(0..40).unwrap(), rows[at..at + 40], "resumed at window {at}");
        }
        assert_eq!(data.position(), DataPosition { epoch: 0, cursor: 10_000 });
    }
}
