//! Training data: a text corpus, a tokenizer, and fixed-length packed sequences in a seeded order.
//!
//! The corpus is tokenized once, concatenated into one token stream, and cut into non-overlapping
//! windows of `seq` tokens (the tail shorter than a window is dropped). Each epoch visits every window
//! once in an order shuffled by `(seed, epoch)`, so a run is reproducible and a loader can resume from
//! `(epoch, cursor)`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub mod blend;
pub mod corpus;
pub mod indexed;
pub mod order;
pub mod tokenize;

pub use corpus::{data_kind, DataKind, Tokens};
use order::{Split, WindowOrder};

use crate::error::{Result, TrainError};
use disagmoe_kernels::documents::Documents;

/// The corpus shipped with the crate (public-domain KJV text, see `disagmoe-train/data/README.md`).
pub const BUNDLED_CORPUS: &str = include_str!("../../data/kjv-genesis-leviticus.txt");
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
    /// The id of a token named by its text (`<|endoftext|>`), if the vocabulary has it.
    fn token_id(&self, token: &str) -> Option<u32>;
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
    fn token_id(&self, _token: &str) -> Option<u32> {
        None
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
    fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
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

/// The corpus as fixed-length windows, handed out in seeded shuffled batches. Part of the corpus
/// may be held out for evaluation ([`PackedDataset::hold_out`]): training never reads it.
///
/// The tokens stay where they are (in memory for text, on disk for token shards); a window
/// is read when it is handed out, and the order of an epoch is a list only for corpora of up to
/// [`order::MATERIALISED_WINDOWS`] windows, a seeded permutation computed per position beyond.
pub struct PackedDataset {
    windows: Arc<Windows>,
    seed: u64,
    order: WindowOrder,
    position: DataPosition,
    source: String,
    /// Training windows a run needs at least (one batch).
    min_windows: usize,
}

/// The windows of a corpus: its token stream cut into the training and held-out splits, each read
/// on demand (by whoever owns a window's rows: see [`Batch`]).
pub struct Windows {
    tokens: Tokens,
    seq: usize,
    /// The stream's windows training visits (an epoch's order indexes them).
    train: Split,
    /// The held-out part, whose windows evaluation reads.
    held_out: Split,
    /// Every window of the stream, training and held-out ones alike.
    all: Split,
    /// Ids must be below this.
    model_vocab: usize,
    /// Whether windows are masked by document ([`PackedDataset::with_document_mask`]).
    documents: bool,
    /// Whether their rotary positions restart at each document.
    restart: bool,
}

impl Windows {
    /// The windows `part` indexes.
    fn split(&self, part: Part) -> &Split {
        match part {
            Part::Train => &self.train,
            Part::HeldOut => &self.held_out,
            Part::All => &self.all,
        }
    }

    /// Where documents begin inside window `w` of `split` (positions in `1..seq`, increasing): at
    /// each document start of the stream the window covers, and where it jumps over a held-out
    /// document (its stream ranges meet there; a corpus held out by windows, one document, has no
    /// window across runs).
    fn cuts(&self, split: &Split, w: usize) -> Vec<usize> {
        let mut cuts = Vec::new();
        let mut off = 0usize;
        for r in split.window_ranges(w, self.seq) {
            if off > 0 {
                cuts.push(off);
            }
            let starts = self.tokens.doc_starts_in(r.clone()).unwrap_or_default();
            cuts.extend(starts.iter().map(|&s| off + (s - r.start) as usize));
            off += (r.end - r.start) as usize;
        }
        cuts.sort_unstable();
        cuts.dedup();
        cuts
    }

    /// Window `w` of `split`, its ids checked against the model's vocabulary.
    fn read(&self, split: &Split, w: usize) -> Result<Vec<i64>> {
        let mut row = Vec::with_capacity(self.seq);
        for r in split.window_ranges(w, self.seq) {
            let start = r.start;
            let before = row.len();
            self.tokens.read_into(r, &mut row)?;
            if let Some(i) = row[before..].iter().position(|&t| t < 0 || t as usize >= self.model_vocab) {
                let (file, at) = self.tokens.locate(start + i as u64);
                return Err(TrainError::Corpus {
                    path: file,
                    message: format!(
                        "token {at} is id {}, outside the model's vocabulary 0..{}; use a model whose vocab_size \
                         covers the tokenizer the data was made with",
                        row[before + i],
                        self.model_vocab
                    ),
                });
            }
        }
        Ok(row)
    }
}

/// A step's batch: which training windows make it, read only where their rows are needed (each
/// worker of a distributed step reads its own micro-batches' windows), or rows given outright.
#[derive(Clone)]
pub struct Batch(BatchRows);

#[derive(Clone)]
enum BatchRows {
    Rows(Arc<Vec<Vec<i64>>>),
    /// Windows of one corpus (or of several: a blend), by their index in one of its splits.
    Windows {
        windows: Arc<Vec<(Arc<Windows>, usize)>>,
        part: Part,
    },
}

/// Which windows of a corpus a [`Batch`] indexes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Part {
    /// The training split.
    Train,
    /// The held-out split.
    HeldOut,
    /// Every window of the corpus, numbered from its start.
    All,
}

impl Batch {
    /// A batch of the given rows (one document each: no document mask).
    pub fn from_rows(rows: Vec<Vec<i64>>) -> Self {
        Self(BatchRows::Rows(Arc::new(rows)))
    }

    /// A batch of training windows, each of its corpus.
    pub fn of_windows(windows: Vec<(Arc<Windows>, usize)>) -> Self {
        Self(BatchRows::Windows { windows: Arc::new(windows), part: Part::Train })
    }

    /// No rows (a process whose workers read none).
    pub fn empty() -> Self {
        Self::from_rows(Vec::new())
    }

    /// Sequences in the batch.
    pub fn len(&self) -> usize {
        match &self.0 {
            BatchRows::Rows(r) => r.len(),
            BatchRows::Windows { windows, .. } => windows.len(),
        }
    }

    /// Whether the batch has no sequence.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Rows `range` of the batch, read now.
    pub fn rows(&self, range: std::ops::Range<usize>) -> Result<Vec<Vec<i64>>> {
        match &self.0 {
            BatchRows::Rows(r) => Ok(r[range].to_vec()),
            BatchRows::Windows { windows, part } => {
                windows[range].iter().map(|(c, w)| c.read(c.split(*part), *w)).collect()
            }
        }
    }

    /// The documents of rows `range` when any of them is masked by document
    /// ([`PackedDataset::with_document_mask`]; a row of a corpus without the mask is one
    /// document), else `None`. Needs the corpus's document index only, not its tokens.
    pub fn documents(&self, range: std::ops::Range<usize>) -> Result<Option<Documents>> {
        let BatchRows::Windows { windows, part } = &self.0 else { return Ok(None) };
        let rows = &windows[range];
        let Some((first, _)) = rows.iter().find(|(c, _)| c.documents) else { return Ok(None) };
        let cuts: Vec<Vec<usize>> =
            (rows.iter()).map(|(c, w)| if c.documents { c.cuts(c.split(*part), *w) } else { Vec::new() }).collect();
        Documents::new(first.seq, &cuts)
            .map(|d| Some(if first.restart { d.restarting_positions() } else { d }))
            .map_err(|message| TrainError::Corpus { path: "(document index)".into(), message })
    }
}

/// A UTF-8 text file, whole; invalid UTF-8 is an error naming the offset of the first bad byte.
pub fn read_text(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).map_err(|source| TrainError::Io {
        action: "cannot read corpus",
        path: path.into(),
        source,
    })?;
    String::from_utf8(bytes).map_err(|e| TrainError::Corpus {
        path: path.into(),
        message: format!("is not valid UTF-8 text (first bad byte at offset {})", e.utf8_error().valid_up_to()),
    })
}

/// How a corpus is cut and checked: windows of `seq` tokens in an order seeded by `seed`, ids
/// below `model_vocab`, at least `min_windows` training windows (one batch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Packing {
    /// Tokens per window.
    pub seq: usize,
    /// Seed of the epochs' orders.
    pub seed: u64,
    /// Ids must be below this.
    pub model_vocab: usize,
    /// Training windows needed at least.
    pub min_windows: usize,
}

impl PackedDataset {
    /// Tokenizes `text` and packs it into windows of `seq` tokens.
    ///
    /// Fails when the text is empty, gives fewer than `min_windows` windows, or yields an id outside
    /// `0..model_vocab`.
    pub fn new(text: &str, source: &str, tokenizer: &dyn Tokenizer, packing: Packing) -> Result<Self> {
        if text.trim().is_empty() {
            return Err(TrainError::Corpus { path: source.into(), message: "is empty".into() });
        }
        let tokens = tokenizer.encode(text)?;
        Self::from_tokens(Tokens::Memory(tokens), source, &tokenizer.describe(), packing)
    }

    /// Packs a token stream into windows of `seq` tokens (see [`PackedDataset::new`]);
    /// `tokenizer` names where the ids came from in errors.
    pub fn from_tokens(tokens: Tokens, source: &str, tokenizer: &str, packing: Packing) -> Result<Self> {
        let Packing { seq, seed, model_vocab, min_windows } = packing;
        let corpus_err = |message: String| TrainError::Corpus { path: source.into(), message };
        if seq < 2 {
            return Err(TrainError::option("seq", format!("must be at least 2 tokens, got {seq}")));
        }
        if tokens.is_empty() {
            return Err(corpus_err("is empty".into()));
        }
        if let Some(bad) = tokens.max_id().filter(|&m| m as usize >= model_vocab) {
            return Err(corpus_err(format!(
                "tokenizer {tokenizer} produced id {bad}, outside the model's vocabulary 0..{model_vocab}; \
                 use a model whose vocab_size covers the tokenizer"
            )));
        }
        let windows = tokens.len() / seq as u64;
        if windows < min_windows.max(1) as u64 {
            return Err(corpus_err(format!(
                "has {} tokens, fewer than one batch of {} windows of {seq} tokens needs ({})",
                tokens.len(),
                min_windows.max(1),
                min_windows.max(1) as u128 * seq as u128
            )));
        }
        let train = Split::new([(0, windows * seq as u64)]);
        Ok(Self {
            order: WindowOrder::new(train.windows(seq), seed, 0),
            windows: Arc::new(Windows {
                tokens,
                seq,
                all: train.clone(),
                train,
                held_out: Split::default(),
                model_vocab,
                documents: false,
                restart: false,
            }),
            seed,
            position: DataPosition::default(),
            source: source.into(),
            min_windows: min_windows.max(1),
        })
    }

    /// Holds out `floor(fraction x units)` units of the corpus for evaluation, evenly spaced (unit
    /// `floor((i + 1/2) x units / held)` for each `i`: the same for every seed, and drawn from the
    /// whole corpus, so they follow the training distribution). The units are its documents when it
    /// has several (token shards), else its windows (a text file). No training window shares a token
    /// with them. Training visits only the rest. Fails when too few training windows would remain.
    pub fn hold_out(mut self, fraction: f64) -> Result<Self> {
        if !(0.0..=0.5).contains(&fraction) {
            return Err(TrainError::option("eval_fraction", format!("must be in 0..=0.5, got {fraction}")));
        }
        let w = Arc::get_mut(&mut self.windows).expect("the corpus is split before any batch is handed out");
        let all = w.train.windows(w.seq);
        let (train, held_out) = order::split(w.tokens.len(), w.tokens.doc_starts().as_deref(), w.seq, fraction);
        if train.windows(w.seq) < self.min_windows {
            return Err(TrainError::Corpus {
                path: self.source.clone().into(),
                message: format!(
                    "has {all} windows of {} tokens; holding out {} of them for evaluation (eval_fraction {fraction}) \
                     leaves fewer than one batch ({}) to train on: lower --eval-fraction or use more text",
                    w.seq,
                    held_out.windows(w.seq),
                    self.min_windows
                ),
            });
        }
        (w.train, w.held_out) = (train, held_out);
        self.position = DataPosition::default();
        self.shuffle();
        Ok(self)
    }

    /// Number of held-out windows.
    pub fn eval_windows(&self) -> usize {
        self.windows.held_out.windows(self.windows.seq)
    }

    /// The first `n` held-out windows (all of them when fewer), in corpus order.
    pub fn eval_rows(&self, n: usize) -> Result<Vec<Vec<i64>>> {
        let b = self.eval_batch(0..n);
        b.rows(0..b.len())
    }

    /// Held-out windows `range` (clipped to those there are), in corpus order, as a batch: read
    /// where needed, masked by document as training is.
    pub fn eval_batch(&self, range: std::ops::Range<usize>) -> Batch {
        self.batch_of(Part::HeldOut, range.start..range.end.min(self.eval_windows()))
    }

    /// Windows `range` of the whole corpus (training and held-out ones alike, numbered from its
    /// start; clipped to those there are) as a batch.
    pub fn window_batch(&self, range: std::ops::Range<usize>) -> Batch {
        self.batch_of(Part::All, range.start..range.end.min(self.all_windows()))
    }

    fn batch_of(&self, part: Part, range: std::ops::Range<usize>) -> Batch {
        let windows = (range.start.min(range.end)..range.end).map(|w| (self.windows.clone(), w)).collect();
        Batch(BatchRows::Windows { windows: Arc::new(windows), part })
    }

    /// Masks windows by document (`on`: attention within each document, no loss on the token
    /// after an end-of-document), from the corpus's document index; `auto` is on for data that
    /// has one (token shards) and off for text, `on` refuses text.
    pub fn with_document_mask(mut self, mode: crate::config::DocumentMask) -> Result<Self> {
        use crate::config::DocumentMask;
        let w = Arc::get_mut(&mut self.windows).expect("the corpus is masked before any batch is handed out");
        w.documents = match mode {
            DocumentMask::Off => false,
            DocumentMask::Auto => w.tokens.has_documents(),
            DocumentMask::On if w.tokens.has_documents() => true,
            DocumentMask::On => {
                return Err(TrainError::option(
                    "document_mask",
                    format!(
                        "is on, but {} is text, which has no document index: give a `disagmoe tokenize` directory \
                         or a Megatron .bin/.idx pair, or set it to auto or off",
                        self.source
                    ),
                ))
            }
        };
        Ok(self)
    }

    /// Counts rotary positions from each document's start (`restart`) or from each window's;
    /// restarting needs the document mask ([`PackedDataset::with_document_mask`]).
    pub fn with_document_positions(mut self, positions: crate::config::DocumentPositions) -> Result<Self> {
        let restart = positions == crate::config::DocumentPositions::Restart;
        let w = Arc::get_mut(&mut self.windows).expect("positions are set before any batch is handed out");
        if restart && !w.documents {
            return Err(TrainError::option(
                "document_positions",
                format!(
                    "restart needs document masks, and {} is not masked (text, or document_mask off): use token \
                     shards with document_mask auto or on, or positions continue",
                    self.source
                ),
            ));
        }
        w.restart = restart;
        Ok(self)
    }

    /// Whether windows are masked by document.
    pub fn document_mask(&self) -> bool {
        self.windows.documents
    }

    /// Windows `range` of the corpus (training and held-out ones alike, numbered from its start).
    pub fn window_rows(&self, range: std::ops::Range<usize>) -> Result<Vec<Vec<i64>>> {
        let b = self.window_batch(range);
        b.rows(0..b.len())
    }

    /// Windows of the whole corpus, held-out ones included.
    pub fn all_windows(&self) -> usize {
        (self.windows.tokens.len() / self.windows.seq as u64) as usize
    }

    /// The data of a run: its corpus (the bundled one by default) with its tokenizer (the given
    /// `tokenizer.json`, else the checkpoint's own when it has one, else bytes), checked against
    /// the model's vocabulary, its held-out part split off.
    pub fn for_run(cfg: &crate::config::RunConfig, model_vocab: usize) -> Result<Self> {
        let path = tokenizer_file(cfg.data.tokenizer.as_deref(), cfg.model.dir.as_deref());
        let tokenizer = tokenizer_for(cfg.data.tokenizer.as_deref(), cfg.model.dir.as_deref())?;
        let packing = Packing { seq: cfg.data.seq, seed: cfg.seed, model_vocab, min_windows: cfg.data.batch };
        let all = Self::open(cfg.data.path.as_deref(), path.as_deref(), tokenizer.as_ref(), packing)?;
        all.hold_out(cfg.data.eval_fraction)?
            .with_document_mask(cfg.data.document_mask)?
            .with_document_positions(cfg.data.document_positions)
    }

    /// Packs `data` (the bundled corpus when `None`): a text file is tokenized with `tokenizer`, a
    /// `disagmoe tokenize` directory is opened in place (and refused when `tokenizer_path` names
    /// another tokenizer than the one it was made with), as is a Megatron `.bin`/`.idx` pair.
    pub fn open(
        data: Option<&Path>,
        tokenizer_path: Option<&Path>,
        tokenizer: &dyn Tokenizer,
        packing: Packing,
    ) -> Result<Self> {
        let Some(path) = data else {
            return Self::new(BUNDLED_CORPUS, BUNDLED_CORPUS_NAME, tokenizer, packing);
        };
        let name = path.display().to_string();
        match data_kind(path) {
            DataKind::Text => Self::from_file(path, tokenizer, packing),
            DataKind::Tokenized => {
                let (tokens, manifest) = Tokens::open_tokenized(path)?;
                tokenize::check_tokenizer(&manifest, path, tokenizer_path)?;
                Self::from_tokens(tokens, &name, &manifest.tokenizer, packing)
            }
            DataKind::Megatron => {
                let tokens = Tokens::open_megatron(path)?;
                Self::from_tokens(tokens, &name, "(Megatron data)", packing)
            }
        }
    }

    /// Reads a UTF-8 text file and packs it (see [`PackedDataset::new`]).
    pub fn from_file(path: &Path, tokenizer: &dyn Tokenizer, packing: Packing) -> Result<Self> {
        Self::new(&read_text(path)?, &path.display().to_string(), tokenizer, packing)
    }

    fn shuffle(&mut self) {
        self.order = WindowOrder::new(self.windows(), self.seed, self.position.epoch);
    }

    /// Number of training windows (one epoch), the held-out ones excluded.
    pub fn windows(&self) -> usize {
        self.windows.train.windows(self.windows.seq)
    }

    /// Tokens in the corpus.
    pub fn num_tokens(&self) -> u64 {
        self.windows.tokens.len()
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

    /// The next `batch` windows, moving to the next epoch when one runs out; their rows are read
    /// where they are needed ([`Batch::rows`]).
    pub fn next_windows(&mut self, batch: usize) -> Batch {
        Batch::of_windows((0..batch).map(|_| self.next_window()).collect())
    }

    /// The next window (its corpus and its index there), moving to the next epoch when one runs
    /// out.
    pub fn next_window(&mut self) -> (Arc<Windows>, usize) {
        if self.position.cursor >= self.order.len() {
            self.position = DataPosition { epoch: self.position.epoch + 1, cursor: 0 };
            self.shuffle();
        }
        let w = self.order.at(self.position.cursor);
        self.position.cursor += 1;
        (self.windows.clone(), w)
    }

    /// The next `batch` windows as rows of token ids (see [`PackedDataset::next_windows`]).
    pub fn next_batch(&mut self, batch: usize) -> Result<Vec<Vec<i64>>> {
        let b = self.next_windows(batch);
        b.rows(0..b.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pk(seq: usize, seed: u64, model_vocab: usize, min_windows: usize) -> Packing {
        Packing { seq, seed, model_vocab, min_windows }
    }

    #[test]
    fn batches_are_reproducible_and_resumable() {
        let text = "abcdefghij".repeat(50);
        let mut a = PackedDataset::new(&text, "t", &ByteTokenizer, pk(8, 7, 256, 2)).unwrap();
        let first: Vec<_> = (0..5).map(|_| a.next_batch(4).unwrap()).collect();
        let pos = a.position();
        let next = a.next_batch(4).unwrap();
        let mut b = PackedDataset::new(&text, "t", &ByteTokenizer, pk(8, 7, 256, 2)).unwrap();
        assert_eq!(first, (0..5).map(|_| b.next_batch(4).unwrap()).collect::<Vec<_>>());
        let mut c = PackedDataset::new(&text, "t", &ByteTokenizer, pk(8, 7, 256, 2)).unwrap();
        c.seek(pos);
        assert_eq!(next, c.next_batch(4).unwrap());
    }

    #[test]
    fn an_epoch_visits_every_window_once() {
        let text: String = (0..400).map(|i| char::from(b'a' + (i % 26) as u8)).collect();
        let mut ds = PackedDataset::new(&text, "t", &ByteTokenizer, pk(10, 1, 256, 1)).unwrap();
        let rows = ds.next_batch(ds.windows()).unwrap();
        let mut firsts: Vec<i64> = rows.iter().map(|r| r[0]).collect();
        firsts.sort();
        assert_eq!(rows.len(), 40);
        assert_eq!(ds.position(), DataPosition { epoch: 0, cursor: 40 });
        ds.next_batch(1).unwrap();
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
        let ds = PackedDataset::new(&text, "t", &ByteTokenizer, pk(4, 3, 256, 2)).unwrap().hold_out(0.1).unwrap();
        assert_eq!((ds.windows(), ds.eval_windows()), (90, 10));
        let eval = ds.eval_rows(100).unwrap();
        assert_eq!(eval.len(), 10, "all held-out windows, no more");
        let held: Vec<usize> = eval.iter().map(index).collect();
        assert_eq!(held, [5, 15, 25, 35, 45, 55, 65, 75, 85, 95], "evenly spread over the corpus");
        // Three epochs of training batches: every training window, never a held-out one.
        let mut ds = ds;
        let rows: Vec<Vec<i64>> = (0..3 * 90 / 6).flat_map(|_| ds.next_batch(6).unwrap()).collect();
        let starts: std::collections::BTreeSet<usize> = rows.iter().map(index).collect();
        assert_eq!(starts, (0..100).filter(|w| !held.contains(w)).collect(), "training visits the others");
        // The same split for every seed.
        let other = PackedDataset::new(&text, "t", &ByteTokenizer, pk(4, 9, 256, 2)).unwrap().hold_out(0.1).unwrap();
        assert_eq!(other.eval_rows(100).unwrap(), eval);
        // Too little left to train on is refused by name.
        let e =
            PackedDataset::new(&text, "t.txt", &ByteTokenizer, pk(4, 3, 256, 60)).unwrap().hold_out(0.5).err().unwrap();
        assert!(e.to_string().contains("--eval-fraction"), "{e}");
    }

    /// Two shards of 24 documents of 0 to 9 tokens, token `10 d + i` being token `i` of document
    /// `d` (so a row says which document each of its tokens is from).
    fn shards(dir: &Path) -> Tokens {
        use indexed::{IndexedDataset, IndexedWriter, TokenDtype};
        let mut parts = Vec::new();
        for (name, docs) in [("a", 0..10u32), ("b", 10..24)] {
            let mut w = IndexedWriter::create(&dir.join(name), TokenDtype::U16).unwrap();
            for d in docs {
                w.push(&(0..(d * 7) % 10).map(|i| 10 * d + i).collect::<Vec<u32>>()).unwrap();
            }
            w.finish().unwrap();
            parts.push(IndexedDataset::open(&dir.join(name)).unwrap());
        }
        Tokens::mapped(parts, None)
    }

    /// Where a row's documents begin, from its tokens.
    fn cuts_of(row: &[i64]) -> Vec<usize> {
        (1..row.len()).filter(|&j| row[j] / 10 != row[j - 1] / 10).collect()
    }

    #[test]
    fn document_cuts_follow_the_index_across_shards_and_held_out_documents() {
        use crate::config::{DocumentMask, DocumentPositions};
        let dir = tempfile::tempdir().unwrap();
        let tokens = shards(dir.path());
        assert_eq!(tokens.doc_starts_in(0..tokens.len()).unwrap(), {
            let mut d = tokens.doc_starts().unwrap();
            d.dedup();
            d[1..d.len() - 1].to_vec()
        });
        let ds = PackedDataset::from_tokens(tokens, "shards", "test", pk(4, 5, 256, 2)).unwrap().hold_out(0.2).unwrap();
        let ds = ds.with_document_mask(DocumentMask::Auto).unwrap();
        assert!(ds.document_mask(), "auto is on for token shards");
        let mut seen = (0, 0);
        for batch in [ds.eval_batch(0..ds.eval_windows()), ds.window_batch(0..ds.all_windows())] {
            let (rows, docs) = (batch.rows(0..batch.len()).unwrap(), batch.documents(0..batch.len()).unwrap().unwrap());
            for (b, row) in rows.iter().enumerate() {
                assert_eq!(docs.cuts(b), cuts_of(row), "row {row:?}");
                seen.0 += usize::from(!docs.cuts(b).is_empty());
                seen.1 += usize::from(docs.cuts(b).is_empty());
            }
        }
        assert!(seen.0 > 5 && seen.1 > 5, "rows with and without cuts: {seen:?}");
        let mut ds = ds.with_document_positions(DocumentPositions::Restart).unwrap();
        let batch = ds.next_windows(ds.windows());
        let (rows, docs) = (batch.rows(0..batch.len()).unwrap(), batch.documents(2..batch.len()).unwrap().unwrap());
        for (b, row) in rows[2..].iter().enumerate() {
            assert_eq!(docs.cuts(b), cuts_of(row), "training row {row:?}");
        }
        assert!(docs.restarts_positions());
        // Off, or rows given outright: no mask.
        let off = PackedDataset::from_tokens(shards(dir.path()), "s", "t", pk(4, 5, 256, 2)).unwrap();
        let mut off = off.with_document_mask(DocumentMask::Off).unwrap();
        assert!(off.next_windows(3).documents(0..3).unwrap().is_none());
        assert!(Batch::from_rows(vec![vec![1, 2]]).documents(0..1).unwrap().is_none());
        // Text has no document index: auto is off, on is refused naming the allowed data.
        let text = || PackedDataset::new(&"ab".repeat(40), "c.txt", &ByteTokenizer, pk(4, 0, 256, 1)).unwrap();
        assert!(!text().with_document_mask(DocumentMask::Auto).unwrap().document_mask());
        let e = text().with_document_mask(DocumentMask::On).err().unwrap().to_string();
        assert!(e.contains("document_mask") && e.contains("c.txt") && e.contains("tokenize"), "{e}");
        let e = text().with_document_positions(DocumentPositions::Restart).err().unwrap().to_string();
        assert!(e.contains("document_positions") && e.contains("continue"), "{e}");
    }

    #[test]
    fn bad_corpora_are_clear_errors() {
        let e = PackedDataset::new("   ", "empty.txt", &ByteTokenizer, pk(8, 0, 256, 1)).err().unwrap();
        assert!(e.to_string().contains("empty.txt: is empty"), "{e}");
        let e = PackedDataset::new("short", "s.txt", &ByteTokenizer, pk(8, 0, 256, 1)).err().unwrap();
        assert!(e.to_string().contains("fewer than one batch"), "{e}");
        let e = PackedDataset::new("hello world, hello", "v.txt", &ByteTokenizer, pk(4, 0, 100, 1)).err().unwrap();
        assert!(e.to_string().contains("outside the model's vocabulary 0..100"), "{e}");
    }
}
