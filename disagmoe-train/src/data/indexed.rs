//! Megatron-LM's indexed dataset (`MMapIndexedDataset`): a `.bin` of raw tokens and
//! an `.idx` describing its sequences and documents. We read it (users bring corpora they already
//! preprocessed with Megatron's `preprocess_data.py`) and write it (`disagmoe tokenize` shards are
//! such pairs, so Megatron reads ours too).
//!
//! # Format (version 1, all integers little-endian)
//! `PREFIX.bin`: the tokens of every sequence, back to back, as `dtype`.
//!
//! `PREFIX.idx`:
//!
//! | field              | type                       | meaning                                          |
//! |--------------------|----------------------------|--------------------------------------------------|
//! | magic              | 9 bytes `MMIDIDX\0\0`       |                                                  |
//! | version            | `u64` = 1                  |                                                  |
//! | dtype              | `u8`                       | 1 u8, 2 i8, 3 i16, 4 i32, 5 i64, 6 f64, 7 f32, 8 u16 |
//! | sequence count `S` | `u64`                      |                                                  |
//! | document count `D` | `u64`                      | entries of `document_indices` (documents + 1)    |
//! | sequence lengths   | `i32 x S`                  | tokens per sequence                              |
//! | sequence pointers  | `i64 x S`                  | byte offset of each sequence in `.bin`           |
//! | document indices   | `i64 x D`                  | first sequence of each document, then `S`        |
//!
//! Token ids are read from dtypes 1, 3, 4, 5 and 8 (integers that can be ids); the others are
//! refused by name. We write `u16` (code 8) when the vocabulary fits, else `i32` (code 4), one
//! sequence per document.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{Result, TrainError};

/// The `.idx` magic.
pub const MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";

/// How tokens are stored in a `.bin`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenDtype {
    /// Code 1.
    U8,
    /// Code 3.
    I16,
    /// Code 4.
    I32,
    /// Code 5.
    I64,
    /// Code 8.
    U16,
}

impl TokenDtype {
    /// The dtype of a Megatron code, if it can hold token ids.
    pub fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => Self::U8,
            3 => Self::I16,
            4 => Self::I32,
            5 => Self::I64,
            8 => Self::U16,
            _ => return None,
        })
    }

    /// Megatron's code.
    pub fn code(self) -> u8 {
        match self {
            Self::U8 => 1,
            Self::I16 => 3,
            Self::I32 => 4,
            Self::I64 => 5,
            Self::U16 => 8,
        }
    }

    /// Bytes per token.
    pub fn size(self) -> usize {
        match self {
            Self::U8 => 1,
            Self::I16 | Self::U16 => 2,
            Self::I32 => 4,
            Self::I64 => 8,
        }
    }

    /// What we write for a vocabulary of `vocab` ids: `u16` when it fits, else `i32`.
    pub fn for_vocab(vocab: usize) -> Self {
        if vocab <= 1 << 16 {
            Self::U16
        } else {
            Self::I32
        }
    }

    /// Name in manifests (`uint16`, `int32`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Self::U8 => "uint8",
            Self::I16 => "int16",
            Self::I32 => "int32",
            Self::I64 => "int64",
            Self::U16 => "uint16",
        }
    }

    /// The token at `i` of little-endian `bytes` (a negative id reads as `i64`, refused later).
    fn read(self, bytes: &[u8], i: usize) -> i64 {
        let s = self.size();
        let b = &bytes[i * s..(i + 1) * s];
        match self {
            Self::U8 => b[0] as i64,
            Self::I16 => i16::from_le_bytes([b[0], b[1]]) as i64,
            Self::U16 => u16::from_le_bytes([b[0], b[1]]) as i64,
            Self::I32 => i32::from_le_bytes(b.try_into().expect("4 bytes")) as i64,
            Self::I64 => i64::from_le_bytes(b.try_into().expect("8 bytes")),
        }
    }
}

/// The `.idx` and `.bin` paths of a dataset prefix; `PREFIX`, `PREFIX.bin` and `PREFIX.idx` all
/// name the same pair.
pub fn pair_paths(path: &Path) -> (PathBuf, PathBuf) {
    let s = path.to_string_lossy();
    let prefix = s.strip_suffix(".idx").or_else(|| s.strip_suffix(".bin")).unwrap_or(&s);
    (PathBuf::from(format!("{prefix}.idx")), PathBuf::from(format!("{prefix}.bin")))
}

/// Whether `path` names a Megatron pair (its `.idx` exists).
pub fn is_pair(path: &Path) -> bool {
    pair_paths(path).0.is_file()
}

/// An open `.bin`/`.idx` pair: the index in memory, the tokens on disk, read where they are when
/// asked for ([`IndexedDataset::read_into`], positional reads through the page cache).
///
/// Not memory-mapped: a mapping's resident set counts every page the kernel maps on a fault, and
/// with large page-cache folios (a shard just written, or read ahead) one window of a few hundred
/// bytes mapped up to a megabyte: +380 MB of resident set within 500 random windows of a 2 GB
/// shard, growing towards the whole file. Positional reads keep the resident set to what the
/// process holds; the page cache still keeps hot pages.
pub struct IndexedDataset {
    bin: std::fs::File,
    dtype: TokenDtype,
    /// Tokens in `.bin` (the sum of the sequence lengths).
    tokens: usize,
    /// Documents (`document_indices` entries - 1).
    documents: usize,
    /// Token offset where each document starts, then `tokens` (`documents + 1` entries).
    doc_starts: Vec<u64>,
    path: PathBuf,
}

impl IndexedDataset {
    /// Opens a pair (see [`pair_paths`]); checks the header, that sequences are back to back in
    /// `.bin` and that `.bin` holds them all.
    pub fn open(path: &Path) -> Result<Self> {
        let (idx_path, bin_path) = pair_paths(path);
        let bad = |message: String| TrainError::Corpus { path: idx_path.clone(), message };
        let idx = std::fs::read(&idx_path).map_err(|source| TrainError::Io {
            action: "cannot read Megatron index",
            path: idx_path.clone(),
            source,
        })?;
        if idx.len() < 34 || &idx[..9] != MAGIC {
            return Err(bad("is not a Megatron MMapIndexedDataset index (no MMIDIDX header)".into()));
        }
        let u64_at = |o: usize| u64::from_le_bytes(idx[o..o + 8].try_into().expect("8 bytes"));
        let version = u64_at(9);
        if version != 1 {
            return Err(bad(format!("index version {version}; version 1 is supported")));
        }
        let code = idx[17];
        let dtype = TokenDtype::from_code(code).ok_or_else(|| {
            bad(format!("dtype code {code} cannot hold token ids; allowed: 1 (uint8), 3 (int16), 4 (int32), 5 (int64), 8 (uint16)"))
        })?;
        let (seqs, docs) = (u64_at(18) as usize, u64_at(26) as usize);
        let need = 34usize.checked_add(seqs.saturating_mul(12)).and_then(|n| n.checked_add(docs.saturating_mul(8)));
        if need.is_none_or(|n| idx.len() < n) || docs == 0 {
            return Err(bad(format!(
                "is truncated: {} bytes for {seqs} sequences and {docs} document indices",
                idx.len()
            )));
        }
        let lengths = |i: usize| i32::from_le_bytes(idx[34 + 4 * i..38 + 4 * i].try_into().expect("4 bytes"));
        let pointers = 34 + 4 * seqs;
        let pointer = |i: usize| i64::from_le_bytes(idx[pointers + 8 * i..pointers + 8 * i + 8].try_into().expect("8"));
        // Token offset of each sequence start; sequences must be back to back.
        let mut seq_starts = Vec::with_capacity(seqs + 1);
        let mut at = 0u64;
        for i in 0..seqs {
            let (len, ptr) = (lengths(i), pointer(i));
            if len < 0 || ptr != (at * dtype.size() as u64) as i64 {
                return Err(bad(format!(
                    "sequence {i} has length {len} at byte {ptr}; expected a length >= 0 at byte {} (sequences back to back)",
                    at * dtype.size() as u64
                )));
            }
            seq_starts.push(at);
            at += len as u64;
        }
        seq_starts.push(at);
        let doc_base = pointers + 8 * seqs;
        let mut doc_starts = Vec::with_capacity(docs);
        for d in 0..docs {
            let s = i64::from_le_bytes(idx[doc_base + 8 * d..doc_base + 8 * d + 8].try_into().expect("8"));
            if s < 0 || s as usize > seqs || doc_starts.last().is_some_and(|&p| seq_starts[s as usize] < p) {
                return Err(bad(format!("document index {d} is {s}, outside 0..={seqs} or decreasing")));
            }
            doc_starts.push(seq_starts[s as usize]);
        }
        let file = std::fs::File::open(&bin_path).map_err(|source| TrainError::Io {
            action: "cannot open Megatron tokens",
            path: bin_path.clone(),
            source,
        })?;
        let len = file
            .metadata()
            .map_err(|source| TrainError::Io { action: "cannot stat", path: bin_path.clone(), source })?
            .len();
        let tokens = at as usize;
        if len < (tokens * dtype.size()) as u64 {
            return Err(TrainError::Corpus {
                path: bin_path,
                message: format!(
                    "holds {len} bytes, fewer than the {tokens} {} tokens its index describes",
                    dtype.name()
                ),
            });
        }
        // Windows are read in a random order, a few hundred bytes each: no read-ahead.
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;
            // SAFETY: an advisory call on an open descriptor; it reads or writes no memory of ours.
            unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM) };
        }
        Ok(Self { bin: file, dtype, tokens, documents: docs - 1, doc_starts, path: bin_path })
    }

    /// Tokens.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Documents.
    pub fn documents(&self) -> usize {
        self.documents
    }

    /// Token offset where each document starts, then the token count.
    pub fn doc_starts(&self) -> &[u64] {
        &self.doc_starts
    }

    /// The dtype of `.bin`.
    pub fn dtype(&self) -> TokenDtype {
        self.dtype
    }

    /// The `.bin` file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Tokens `range` (of `0..tokens`) appended to `out`, read from the file where they are.
    pub fn read_into(&self, range: std::ops::Range<usize>, out: &mut Vec<i64>) -> Result<()> {
        use std::os::unix::fs::FileExt;
        debug_assert!(range.end <= self.tokens);
        let s = self.dtype.size();
        let mut bytes = vec![0u8; range.len() * s];
        self.bin.read_exact_at(&mut bytes, (range.start * s) as u64).map_err(|source| TrainError::Io {
            action: "cannot read tokens from",
            path: self.path.clone(),
            source,
        })?;
        out.extend((0..range.len()).map(|i| self.dtype.read(&bytes, i)));
        Ok(())
    }
}

/// Writes a `.bin`/`.idx` pair, one document (one sequence) at a time.
pub struct IndexedWriter {
    bin: std::io::BufWriter<std::fs::File>,
    idx_path: PathBuf,
    bin_path: PathBuf,
    dtype: TokenDtype,
    lengths: Vec<i32>,
    tokens: u64,
}

impl IndexedWriter {
    /// Creates `PREFIX.bin` (and, at [`IndexedWriter::finish`], `PREFIX.idx`).
    pub fn create(prefix: &Path, dtype: TokenDtype) -> Result<Self> {
        let (idx_path, bin_path) = pair_paths(prefix);
        let file = std::fs::File::create(&bin_path).map_err(|source| TrainError::Io {
            action: "cannot create",
            path: bin_path.clone(),
            source,
        })?;
        Ok(Self {
            bin: std::io::BufWriter::with_capacity(1 << 20, file),
            idx_path,
            bin_path,
            dtype,
            lengths: Vec::new(),
            tokens: 0,
        })
    }

    /// Appends one document.
    pub fn push(&mut self, ids: &[u32]) -> Result<()> {
        let len = i32::try_from(ids.len()).map_err(|_| TrainError::Corpus {
            path: self.bin_path.clone(),
            message: format!("a document of {} tokens is longer than the format's i32 lengths allow", ids.len()),
        })?;
        let mut buf = Vec::with_capacity(ids.len() * self.dtype.size());
        for &id in ids {
            match self.dtype {
                TokenDtype::U16 => buf.extend_from_slice(&(id as u16).to_le_bytes()),
                TokenDtype::I32 => buf.extend_from_slice(&(id as i32).to_le_bytes()),
                other => unreachable!("the writer uses u16 or i32, not {other:?}"),
            }
        }
        self.bin.write_all(&buf).map_err(|source| TrainError::Io {
            action: "cannot write",
            path: self.bin_path.clone(),
            source,
        })?;
        self.lengths.push(len);
        self.tokens += ids.len() as u64;
        Ok(())
    }

    /// Tokens written so far.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Documents written so far.
    pub fn documents(&self) -> usize {
        self.lengths.len()
    }

    /// Flushes `.bin` and writes `.idx`.
    pub fn finish(mut self) -> Result<()> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| TrainError::Io { action: "cannot write", path, source }
        };
        self.bin.flush().map_err(io(&self.bin_path))?;
        let n = self.lengths.len();
        let mut idx = Vec::with_capacity(34 + 12 * n + 8 * (n + 1));
        idx.extend_from_slice(MAGIC);
        idx.extend_from_slice(&1u64.to_le_bytes());
        idx.push(self.dtype.code());
        idx.extend_from_slice(&(n as u64).to_le_bytes());
        idx.extend_from_slice(&(n as u64 + 1).to_le_bytes());
        for &l in &self.lengths {
            idx.extend_from_slice(&l.to_le_bytes());
        }
        let mut at = 0i64;
        for &l in &self.lengths {
            idx.extend_from_slice(&(at * self.dtype.size() as i64).to_le_bytes());
            at += l as i64;
        }
        for d in 0..=n as i64 {
            idx.extend_from_slice(&d.to_le_bytes());
        }
        std::fs::write(&self.idx_path, idx).map_err(io(&self.idx_path))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_pair_reads_back_with_its_documents() {
        let dir = tempfile::tempdir().unwrap();
        for (dtype, big) in [(TokenDtype::U16, 65_535u32), (TokenDtype::I32, 1_000_000)] {
            let prefix = dir.path().join(dtype.name());
            let mut w = IndexedWriter::create(&prefix, dtype).unwrap();
            let docs: [&[u32]; 3] = [&[1, 2, 3], &[], &[big, 0]];
            for d in docs {
                w.push(d).unwrap();
            }
            w.finish().unwrap();
            let ds = IndexedDataset::open(&prefix.with_extension("idx")).unwrap();
            assert_eq!((ds.tokens(), ds.documents(), ds.dtype()), (5, 3, dtype));
            assert_eq!(ds.doc_starts(), &[0, 3, 3, 5]);
            let mut out = Vec::new();
            ds.read_into(0..5, &mut out).unwrap();
            assert_eq!(out, [1, 2, 3, big as i64, 0]);
        }
    }

    #[test]
    fn broken_pairs_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("x");
        let mut w = IndexedWriter::create(&prefix, TokenDtype::U16).unwrap();
        w.push(&[1, 2, 3, 4]).unwrap();
        w.finish().unwrap();
        // A short .bin.
        std::fs::write(prefix.with_extension("bin"), [0u8; 6]).unwrap();
        let e = IndexedDataset::open(&prefix).err().unwrap().to_string();
        assert!(e.contains("x.bin") && e.contains("fewer than the 4 uint16 tokens"), "{e}");
        // A float dtype.
        let mut idx = std::fs::read(prefix.with_extension("idx")).unwrap();
        idx[17] = 7;
        std::fs::write(prefix.with_extension("idx"), &idx).unwrap();
        let e = IndexedDataset::open(&prefix).err().unwrap().to_string();
        assert!(e.contains("dtype code 7") && e.contains("8 (uint16)"), "{e}");
        // Not an index.
        std::fs::write(prefix.with_extension("idx"), b"hello").unwrap();
        let e = IndexedDataset::open(&prefix).err().unwrap().to_string();
        assert!(e.contains("x.idx") && e.contains("MMIDIDX"), "{e}");
    }
}
