//! Training data: a text corpus, a tokenizer, and fixed-length packed sequences in a seeded order.
//!
//! The corpus is tokenized once, concatenated into one token stream, and cut into non-overlapping
//! windows of `seq` tokens (the tail shorter than a window is dropped). Each epoch visits every window
//! once in an order shuffled by `(seed, epoch)`, so a run is reproducible and a loader can resume from
//! `(epoch, cursor)`.

use std::path::{Path, PathBuf};

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

use crate::error::{Result, TrainError};

/// The corpus shipped with the crate (public-domain KJV text, see `disagmoe-train/data/README.md`).
pub const BUNDLED_CORPUS: &str = include_str!("../data/kjv-genesis-leviticus.txt");
/// Name of the bundled corpus in reports.
pub const BUNDLED_CORPUS_NAME: &str = "bundled:kjv-genesis-leviticus.txt";

/// Turns text into token ids.
pub trait Tokenizer: Send + Sync {
    /// Token ids of `text`.
    fn encode(&self, text: &str) -> Result<Vec<u32>>;
    /// The text of token ids (invalid UTF-8 shown as U+FFFD).
    fn decode(&self, ids: &[u32]) -> Result<String>;
    /// Number of distinct ids the tokenizer can produce.
    fn vocab_size(&self) -> usize;
    /// A short description for logs.
    fn describe(&self) -> String;
}

/// One token per UTF-8 byte: ids `0..256`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ByteTokenizer;

impl Tokenizer for ByteTokenizer {
    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(text.bytes().map(u32::from).collect())
    }
    fn decode(&self, ids: &[u32]) -> Result<String> {
        let bytes = ids
            .iter()
            .map(|&id| {
                u8::try_from(id).map_err(|_| TrainError::Tokenizer {
                    path: "byte-level".into(),
                    message: format!("id {id} is not a byte: byte-level text has ids 0..256"),
                })
            })
            .collect::<Result<Vec<u8>>>()?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
    fn vocab_size(&self) -> usize {
        256
    }
    fn describe(&self) -> String {
        "byte-level (256 ids)".into()
    }
}

/// A Hugging Face `tokenizer.json`, through the `tokenizers` crate.
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
}

impl HfTokenizer {
    /// Loads a `tokenizer.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| TrainError::Tokenizer { path: path.clone(), message: e.to_string() })?;
        Ok(Self { inner, path })
    }
}

impl Tokenizer for HfTokenizer {
    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| TrainError::Tokenizer { path: self.path.clone(), message: e.to_string() })?;
        Ok(enc.get_ids().to_vec())
    }
    fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| TrainError::Tokenizer { path: self.path.clone(), message: e.to_string() })
    }
    fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
    fn describe(&self) -> String {
        format!("{} ({} ids)", self.path.display(), self.vocab_size())
    }
}

/// The `tokenizer.json` of a run or a checkpoint: `explicit`, else the one in `model_dir` when it
/// has one; `None`: byte-level.
pub fn tokenizer_file(explicit: Option<&Path>, model_dir: Option<&Path>) -> Option<PathBuf> {
    explicit.map(Path::to_path_buf).or_else(|| model_dir.map(|d| d.join("tokenizer.json")).filter(|p| p.exists()))
}

/// The tokenizer of a run or a checkpoint: [`tokenizer_file`]'s, else bytes.
pub fn tokenizer_for(explicit: Option<&Path>, model_dir: Option<&Path>) -> Result<Box<dyn Tokenizer>> {
    Ok(match tokenizer_file(explicit, model_dir) {
        Some(path) => Box::new(HfTokenizer::from_file(path)?),
        None => Box::new(ByteTokenizer),
    })
}

/// Where a position in the data stream is: which epoch, and how many windows of it were consumed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, Default)]
pub struct DataPosition {
    /// Epoch number, from 0.
    pub epoch: u64,
    /// Windows of this epoch already handed out.
    pub cursor: usize,
}

/// The corpus as fixed-length windows, handed out in seeded shuffled batches. Some windows, evenly
/// spread over the corpus, may be held out for evaluation ([`PackedDataset::hold_out`]): training
/// never reads them.
pub struct PackedDataset {
    tokens: Vec<u32>,
    seq: usize,
    seed: u64,
    order: Vec<usize>,
    position: DataPosition,
    source: String,
    /// Windows kept for evaluation, in corpus order.
    held_out: Vec<usize>,
    /// Windows training visits, in corpus order (`order` indexes it).
    train: Vec<usize>,
    /// Training windows a run needs at least (one batch).
    min_windows: usize,
}

impl PackedDataset {
    /// Tokenizes `text` and packs it into windows of `seq` tokens.
    ///
    /// Fails when the text is empty, gives fewer than `min_windows` windows, or yields an id outside
    /// `0..model_vocab`.
    pub fn new(
        text: &str,
        source: &str,
        tokenizer: &dyn Tokenizer,
        seq: usize,
        seed: u64,
        model_vocab: usize,
        min_windows: usize,
    ) -> Result<Self> {
        let corpus_err = |message: String| TrainError::Corpus { path: source.into(), message };
        if seq < 2 {
            return Err(TrainError::option("seq", format!("must be at least 2 tokens, got {seq}")));
        }
        if text.trim().is_empty() {
            return Err(corpus_err("is empty".into()));
        }
        let tokens = tokenizer.encode(text)?;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= model_vocab) {
            return Err(corpus_err(format!(
                "tokenizer {} produced id {bad}, outside the model's vocabulary 0..{model_vocab}; \
                 use a model whose vocab_size covers the tokenizer",
                tokenizer.describe()
            )));
        }
        let windows = tokens.len() / seq;
        if windows < min_windows.max(1) {
            return Err(corpus_err(format!(
                "has {} tokens, fewer than one batch of {} windows of {seq} tokens needs ({})",
                tokens.len(),
                min_windows.max(1),
                min_windows.max(1) * seq
            )));
        }
        let mut ds = Self {
            tokens,
            seq,
            seed,
            order: Vec::new(),
            position: DataPosition::default(),
            source: source.into(),
            held_out: Vec::new(),
            train: (0..windows).collect(),
            min_windows: min_windows.max(1),
        };
        ds.shuffle();
        Ok(ds)
    }

    /// Holds out `floor(fraction x windows)` windows for evaluation, evenly spaced over the corpus
    /// (window `floor((i + 1/2) x windows / held)` for each `i`: the same for every seed, and drawn
    /// from the whole text, so they follow the training distribution); windows do not overlap, so
    /// no training window shares a token with them. Training visits only the others. Fails when
    /// too few training windows would remain.
    pub fn hold_out(mut self, fraction: f64) -> Result<Self> {
        if !(0.0..=0.5).contains(&fraction) {
            return Err(TrainError::option("eval_fraction", format!("must be in 0..=0.5, got {fraction}")));
        }
        let all = self.tokens.len() / self.seq;
        let held = (all as f64 * fraction).floor() as usize;
        if all - held < self.min_windows {
            return Err(TrainError::Corpus {
                path: self.source.clone().into(),
                message: format!(
                    "has {all} windows of {} tokens; holding out {held} for evaluation (eval_fraction {fraction}) \
                     leaves fewer than one batch ({}) to train on: lower --eval-fraction or use more text",
                    self.seq, self.min_windows
                ),
            });
        }
        self.held_out = (0..held).map(|i| ((2 * i + 1) * all) / (2 * held)).collect();
        let held_out: std::collections::HashSet<usize> = self.held_out.iter().copied().collect();
        self.train = (0..all).filter(|w| !held_out.contains(w)).collect();
        self.position = DataPosition::default();
        self.shuffle();
        Ok(self)
    }

    /// Number of held-out windows.
    pub fn eval_windows(&self) -> usize {
        self.held_out.len()
    }

    /// The first `n` held-out windows (all of them when fewer), in corpus order.
    pub fn eval_rows(&self, n: usize) -> Vec<Vec<i64>> {
        self.held_out.iter().take(n).map(|&w| self.window(w)).collect()
    }

    /// Windows `range` of the corpus (training and held-out ones alike, numbered from its start).
    pub fn window_rows(&self, range: std::ops::Range<usize>) -> Vec<Vec<i64>> {
        range.map(|w| self.window(w)).collect()
    }

    fn window(&self, w: usize) -> Vec<i64> {
        self.tokens[w * self.seq..(w + 1) * self.seq].iter().map(|&t| t as i64).collect()
    }

    /// Windows of the whole corpus, held-out ones included.
    pub fn all_windows(&self) -> usize {
        self.tokens.len() / self.seq
    }

    /// The data of a run: its corpus (the bundled one by default) with its tokenizer (the given
    /// `tokenizer.json`, else the checkpoint's own when it has one, else bytes), checked against
    /// the model's vocabulary.
    pub fn for_run(cfg: &crate::config::RunConfig, model_vocab: usize) -> Result<Self> {
        let tokenizer = tokenizer_for(cfg.data.tokenizer.as_deref(), cfg.model.dir.as_deref())?;
        let (seq, seed, batch) = (cfg.data.seq, cfg.seed, cfg.data.batch);
        let all = match &cfg.data.path {
            Some(path) => Self::from_file(path, tokenizer.as_ref(), seq, seed, model_vocab, batch),
            None => Self::new(BUNDLED_CORPUS, BUNDLED_CORPUS_NAME, tokenizer.as_ref(), seq, seed, model_vocab, batch),
        }?;
        all.hold_out(cfg.data.eval_fraction)
    }

    /// Reads a UTF-8 text file and packs it (see [`PackedDataset::new`]).
    pub fn from_file(
        path: &Path,
        tokenizer: &dyn Tokenizer,
        seq: usize,
        seed: u64,
        model_vocab: usize,
        min_windows: usize,
    ) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|source| TrainError::Io {
            action: "cannot read corpus",
            path: path.into(),
            source,
        })?;
        let text = String::from_utf8(bytes).map_err(|e| TrainError::Corpus {
            path: path.into(),
            message: format!("is not valid UTF-8 text (first bad byte at offset {})", e.utf8_error().valid_up_to()),
        })?;
        Self::new(&text, &path.display().to_string(), tokenizer, seq, seed, model_vocab, min_windows)
    }

    fn shuffle(&mut self) {
        let mut rng = StdRng::seed_from_u64(self.seed ^ self.position.epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        self.order = (0..self.windows()).collect();
        self.order.shuffle(&mut rng);
    }

    /// Number of training windows (one epoch), the held-out ones excluded.
    pub fn windows(&self) -> usize {
        self.train.len()
    }

    /// Tokens in the corpus.
    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Where the corpus came from.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The position the next batch starts at.
    pub fn position(&self) -> DataPosition {
        self.position
    }

    /// Continues from a saved position.
    pub fn seek(&mut self, position: DataPosition) {
        self.position = DataPosition { epoch: position.epoch, cursor: 0 };
        self.shuffle();
        self.position.cursor = position.cursor.min(self.windows());
    }

    /// The next `batch` windows as rows of token ids, moving to the next epoch when one runs out.
    pub fn next_batch(&mut self, batch: usize) -> Vec<Vec<i64>> {
        (0..batch)
            .map(|_| {
                if self.position.cursor >= self.order.len() {
                    self.position = DataPosition { epoch: self.position.epoch + 1, cursor: 0 };
                    self.shuffle();
                }
                let w = self.train[self.order[self.position.cursor]];
                self.position.cursor += 1;
                self.window(w)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_are_reproducible_and_resumable() {
        let text = "abcdefghij".repeat(50);
        let mut a = PackedDataset::new(&text, "t", &ByteTokenizer, 8, 7, 256, 2).unwrap();
        let first: Vec<_> = (0..5).map(|_| a.next_batch(4)).collect();
        let pos = a.position();
        let next = a.next_batch(4);
        let mut b = PackedDataset::new(&text, "t", &ByteTokenizer, 8, 7, 256, 2).unwrap();
        assert_eq!(first, (0..5).map(|_| b.next_batch(4)).collect::<Vec<_>>());
        let mut c = PackedDataset::new(&text, "t", &ByteTokenizer, 8, 7, 256, 2).unwrap();
        c.seek(pos);
        assert_eq!(next, c.next_batch(4));
    }

    #[test]
    fn an_epoch_visits_every_window_once() {
        let text: String = (0..400).map(|i| char::from(b'a' + (i % 26) as u8)).collect();
        let mut ds = PackedDataset::new(&text, "t", &ByteTokenizer, 10, 1, 256, 1).unwrap();
        let rows = ds.next_batch(ds.windows());
        let mut firsts: Vec<i64> = rows.iter().map(|r| r[0]).collect();
        firsts.sort();
        assert_eq!(rows.len(), 40);
        assert_eq!(ds.position(), DataPosition { epoch: 0, cursor: 40 });
        ds.next_batch(1);
        assert_eq!(ds.position().epoch, 1);
    }

    #[test]
    fn held_out_windows_are_never_trained_on() {
        // 100 windows of 4 tokens, each different (`00yz`, `01yz`, ...).
        let text: String = (0..100).map(|w| format!("{w:02}yz")).collect();
        let bytes = text.as_bytes();
        let index = |r: &Vec<i64>| {
            (0..100).find(|w| bytes[w * 4..w * 4 + 4].iter().map(|&b| b as i64).eq(r.iter().copied())).unwrap()
        };
        let ds = PackedDataset::new(&text, "t", &ByteTokenizer, 4, 3, 256, 2).unwrap().hold_out(0.1).unwrap();
        assert_eq!((ds.windows(), ds.eval_windows()), (90, 10));
        let eval = ds.eval_rows(100);
        assert_eq!(eval.len(), 10, "all held-out windows, no more");
        let held: Vec<usize> = eval.iter().map(index).collect();
        assert_eq!(held, [5, 15, 25, 35, 45, 55, 65, 75, 85, 95], "evenly spread over the corpus");
        // Three epochs of training batches: every training window, never a held-out one.
        let mut ds = ds;
        let rows: Vec<Vec<i64>> = (0..3 * 90 / 6).flat_map(|_| ds.next_batch(6)).collect();
        let starts: std::collections::BTreeSet<usize> = rows.iter().map(index).collect();
        assert_eq!(starts, (0..100).filter(|w| !held.contains(w)).collect(), "training visits the others");
        // The same split for every seed.
        let other = PackedDataset::new(&text, "t", &ByteTokenizer, 4, 9, 256, 2).unwrap().hold_out(0.1).unwrap();
        assert_eq!(other.eval_rows(100), eval);
        // Too little left to train on is refused by name.
        let e = PackedDataset::new(&text, "t.txt", &ByteTokenizer, 4, 3, 256, 60).unwrap().hold_out(0.5).err().unwrap();
        assert!(e.to_string().contains("--eval-fraction"), "{e}");
    }

    #[test]
    fn bad_corpora_are_clear_errors() {
        let e = PackedDataset::new("   ", "empty.txt", &ByteTokenizer, 8, 0, 256, 1).err().unwrap();
        assert!(e.to_string().contains("empty.txt: is empty"), "{e}");
        let e = PackedDataset::new("short", "s.txt", &ByteTokenizer, 8, 0, 256, 1).err().unwrap();
        assert!(e.to_string().contains("fewer than one batch"), "{e}");
        let e = PackedDataset::new("hello world, hello", "v.txt", &ByteTokenizer, 4, 0, 100, 1).err().unwrap();
        assert!(e.to_string().contains("outside the model's vocabulary 0..100"), "{e}");
    }
}
