//! A corpus as one token stream: text tokenized in memory, or token shards left on disk (a
//! `disagmoe tokenize` directory or a Megatron `.bin`/`.idx` pair), read window by window.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::indexed::{is_pair, IndexedDataset};
use crate::error::{Result, TrainError};

/// The manifest of a `disagmoe tokenize` directory (`dataset.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Always [`MANIFEST_FORMAT`].
    pub format: String,
    /// Format version, [`MANIFEST_VERSION`].
    pub version: u32,
    /// Token dtype of every shard (`uint16` or `int32`).
    pub dtype: String,
    /// Tokens over all shards (end-of-document tokens included).
    pub tokens: u64,
    /// Documents over all shards.
    pub documents: u64,
    /// The largest token id (a model's vocabulary must be above it).
    pub max_id: u32,
    /// The end-of-document id appended to every document.
    pub eos_id: u32,
    /// The tokenizer, in words.
    pub tokenizer: String,
    /// SHA-256 of the `tokenizer.json` (absent: byte-level).
    pub tokenizer_sha256: Option<String>,
    /// Ids the tokenizer can produce.
    pub vocab_size: usize,
    /// The shards, in stream order.
    pub shards: Vec<ShardEntry>,
}

/// One shard of a [`Manifest`]: a Megatron pair `prefix.bin`/`prefix.idx` in the directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardEntry {
    /// File prefix within the directory.
    pub prefix: String,
    /// Tokens in the shard.
    pub tokens: u64,
    /// Documents in the shard.
    pub documents: u64,
}

/// [`Manifest::format`].
pub const MANIFEST_FORMAT: &str = "disagmoe-tokens";
/// [`Manifest::version`].
pub const MANIFEST_VERSION: u32 = 1;
/// The manifest's file name in a token directory.
pub const MANIFEST_FILE: &str = "dataset.json";

/// What `--data` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataKind {
    /// A UTF-8 text file, tokenized at start-up.
    Text,
    /// A directory written by `disagmoe tokenize`.
    Tokenized,
    /// A Megatron `.bin`/`.idx` pair.
    Megatron,
}

/// Tells what kind of data `path` is.
pub fn data_kind(path: &Path) -> DataKind {
    if path.is_dir() {
        DataKind::Tokenized
    } else if is_pair(path) {
        DataKind::Megatron
    } else {
        DataKind::Text
    }
}

/// The token stream.
pub enum Tokens {
    /// Tokenized text, in memory.
    Memory(Vec<u32>),
    /// Pairs on disk, concatenated.
    Mapped {
        /// The pairs, in stream order.
        parts: Vec<IndexedDataset>,
        /// Stream offset of each part's first token, then the total.
        starts: Vec<u64>,
        /// The largest id, when the manifest says (Megatron pairs: checked as windows are read).
        max_id: Option<u32>,
    },
}

impl Tokens {
    /// Opens a `disagmoe tokenize` directory: its manifest and every shard it lists, checked
    /// against each other.
    pub fn open_tokenized(dir: &Path) -> Result<(Self, Manifest)> {
        let path = dir.join(MANIFEST_FILE);
        let bad = |message: String| TrainError::Corpus { path: path.clone(), message };
        let text = std::fs::read_to_string(&path).map_err(|source| TrainError::Io {
            action: "cannot read the token directory's manifest (a directory given to --data must be written by `disagmoe tokenize`)",
            path: path.clone(),
            source,
        })?;
        let m: Manifest = serde_json::from_str(&text).map_err(|e| bad(format!("is not a token manifest: {e}")))?;
        if m.format != MANIFEST_FORMAT || m.version != MANIFEST_VERSION {
            return Err(bad(format!(
                "has format {:?} version {}; this build reads {MANIFEST_FORMAT:?} version {MANIFEST_VERSION}",
                m.format, m.version
            )));
        }
        let mut parts = Vec::with_capacity(m.shards.len());
        for s in &m.shards {
            let ds = IndexedDataset::open(&dir.join(&s.prefix))?;
            if (ds.tokens() as u64, ds.documents() as u64) != (s.tokens, s.documents) || ds.dtype().name() != m.dtype {
                return Err(bad(format!(
                    "lists shard {} with {} tokens, {} documents ({}); the files hold {}, {} ({})",
                    s.prefix,
                    s.tokens,
                    s.documents,
                    m.dtype,
                    ds.tokens(),
                    ds.documents(),
                    ds.dtype().name()
                )));
            }
            parts.push(ds);
        }
        let tokens = Self::mapped(parts, Some(m.max_id));
        if tokens.len() != m.tokens {
            return Err(bad(format!("says {} tokens; its shards hold {}", m.tokens, tokens.len())));
        }
        Ok((tokens, m))
    }

    /// Opens a Megatron pair.
    pub fn open_megatron(path: &Path) -> Result<Self> {
        Ok(Self::mapped(vec![IndexedDataset::open(path)?], None))
    }

    pub(crate) fn mapped(parts: Vec<IndexedDataset>, max_id: Option<u32>) -> Self {
        let mut starts = vec![0u64];
        for p in &parts {
            starts.push(starts.last().expect("one") + p.tokens() as u64);
        }
        Self::Mapped { parts, starts, max_id }
    }

    /// Tokens in the stream.
    pub fn len(&self) -> u64 {
        match self {
            Self::Memory(v) => v.len() as u64,
            Self::Mapped { starts, .. } => *starts.last().expect("one"),
        }
    }

    /// Whether the stream has no token.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The largest id when known without reading the tokens.
    pub fn max_id(&self) -> Option<u32> {
        match self {
            Self::Memory(v) => v.iter().copied().max(),
            Self::Mapped { max_id, .. } => *max_id,
        }
    }

    /// Each document's first token, then the token count (`None`: one document).
    pub fn doc_starts(&self) -> Option<Vec<u64>> {
        let Self::Mapped { parts, starts, .. } = self else { return None };
        let mut out = vec![0u64];
        for (p, &base) in parts.iter().zip(starts) {
            out.extend(p.doc_starts()[1..].iter().map(|&s| base + s));
        }
        Some(out)
    }

    /// Whether the stream has a document index (token shards; text is one stream of tokens).
    pub fn has_documents(&self) -> bool {
        matches!(self, Self::Mapped { .. })
    }

    /// Where documents start strictly inside stream `range`, in order, each once (`None`: the
    /// stream has no document index). A part's first token starts a document.
    pub fn doc_starts_in(&self, range: std::ops::Range<u64>) -> Option<Vec<u64>> {
        let Self::Mapped { parts, starts, .. } = self else { return None };
        let mut out = Vec::new();
        if range.start >= range.end {
            return Some(out);
        }
        let mut p = starts.partition_point(|&s| s <= range.start).saturating_sub(1);
        while p < parts.len() && starts[p] < range.end {
            let (base, local) = (starts[p], parts[p].doc_starts());
            // Local starts `s` with `range.start < base + s < range.end`.
            let lo = local.partition_point(|&s| base + s <= range.start);
            let hi = local.partition_point(|&s| base + s < range.end);
            for &s in &local[lo..hi.max(lo)] {
                if out.last() != Some(&(base + s)) {
                    out.push(base + s);
                }
            }
            p += 1;
        }
        Some(out)
    }

    /// Stream tokens `range` appended to `out`.
    pub fn read_into(&self, range: std::ops::Range<u64>, out: &mut Vec<i64>) -> Result<()> {
        match self {
            Self::Memory(v) => out.extend(v[range.start as usize..range.end as usize].iter().map(|&t| t as i64)),
            Self::Mapped { parts, starts, .. } => {
                let mut at = range.start;
                let mut p = starts.partition_point(|&s| s <= at) - 1;
                while at < range.end {
                    let end = range.end.min(starts[p + 1]);
                    parts[p].read_into((at - starts[p]) as usize..(end - starts[p]) as usize, out)?;
                    at = end;
                    p += 1;
                }
            }
        }
        Ok(())
    }

    /// Where stream token `at` lives (a shard file and offset), for errors.
    pub fn locate(&self, at: u64) -> (PathBuf, u64) {
        match self {
            Self::Memory(_) => (PathBuf::from("(memory)"), at),
            Self::Mapped { parts, starts, .. } => {
                let p = starts.partition_point(|&s| s <= at).saturating_sub(1).min(parts.len() - 1);
                (parts[p].path().to_path_buf(), at - starts[p])
            }
        }
    }
}
