//! `disagmoe tokenize`: documents from text, JSONL and Parquet files tokenized once, in parallel,
//! into token shards that training streams windows from.
//!
//! # Inputs
//! Each input is a file or a directory (its files, recursively, in path order; hidden ones
//! skipped). By extension: `.jsonl`/`.ndjson`/`.json` are JSON lines (one document per line, the
//! string field `--text-field`), `.parquet` is Parquet (the string column `--text-field`, one
//! document per row), anything else is UTF-8 text (the whole file one document). Empty documents
//! are skipped.
//!
//! # Output
//! A directory with `dataset.json` ([`Manifest`]) and shards `shard-NNNNN.bin`/`.idx`, each a
//! Megatron `MMapIndexedDataset` pair ([`super::indexed`]) of whole documents, one sequence per
//! document, each document's tokens followed by the end-of-document id. Tokens are `uint16` when
//! the tokenizer's ids fit, else `int32`. The same inputs and options give byte-identical output:
//! documents keep their input order whatever the threads do. The directory is written under a
//! temporary name and renamed when complete.
//!
//! # End of document
//! `--eos` names the token (`<|endoftext|>`) or its id; by default the `eos_token` of a
//! `tokenizer_config.json` beside the `tokenizer.json`, else the first of [`EOS_CANDIDATES`] the
//! vocabulary has. Byte-level text uses id 0 (the NUL byte, which text does not contain).

use std::io::{BufRead, BufReader, IsTerminal};
use std::path::{Path, PathBuf};
use std::time::Instant;

use rayon::prelude::*;
use serde::Serialize;

use super::corpus::{Manifest, ShardEntry, MANIFEST_FILE, MANIFEST_FORMAT, MANIFEST_VERSION};
use super::indexed::{IndexedWriter, TokenDtype};
use super::{read_text, ByteTokenizer, HfTokenizer, Tokenizer};
use crate::checkpoint::sha256_file;
use crate::error::{Result, TrainError};

/// End-of-document tokens looked for when none is named, in order.
pub const EOS_CANDIDATES: &[&str] = &["<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "<|im_end|>"];

/// The end-of-document id of byte-level text.
pub const BYTE_EOS: u32 = 0;

/// Default [`TokenizeOptions::shard_tokens`]: 2^28 tokens (512 MiB of `uint16`).
pub const DEFAULT_SHARD_TOKENS: u64 = 1 << 28;

/// What `disagmoe tokenize` does.
#[derive(Debug, Clone)]
pub struct TokenizeOptions {
    /// Files and directories, in order.
    pub inputs: Vec<PathBuf>,
    /// The directory to create.
    pub out: PathBuf,
    /// A `tokenizer.json` (default: bytes).
    pub tokenizer: Option<PathBuf>,
    /// The JSON field / Parquet column holding a document's text.
    pub text_field: String,
    /// The end-of-document token or id.
    pub eos: Option<String>,
    /// A shard is closed after the document that takes it to this many tokens.
    pub shard_tokens: u64,
    /// Show a progress bar on a terminal.
    pub progress: bool,
}

/// What `disagmoe tokenize` reports.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TokenizeReport {
    /// The directory written.
    pub out: PathBuf,
    /// Input files read.
    pub files: usize,
    /// Bytes of input files.
    pub input_bytes: u64,
    /// Documents written.
    pub documents: u64,
    /// Tokens written (end-of-document ids included).
    pub tokens: u64,
    /// Shards written.
    pub shards: usize,
    /// Token dtype.
    pub dtype: String,
    /// The end-of-document id.
    pub eos_id: u32,
    /// Wall time, seconds.
    pub seconds: f64,
    /// Tokens per second.
    pub tokens_per_s: f64,
    /// Input megabytes per second.
    pub mb_per_s: f64,
}

/// A document's text.
struct Doc {
    text: String,
}

/// Documents tokenized together (in parallel) before they are written in order.
const BATCH_BYTES: usize = 8 << 20;

/// The tokenizer of `path` (bytes when `None`) with its SHA-256.
fn load_tokenizer(path: Option<&Path>) -> Result<(Box<dyn Tokenizer>, Option<String>)> {
    match path {
        None => Ok((Box::new(ByteTokenizer), None)),
        Some(p) => Ok((Box::new(HfTokenizer::from_file(p)?), Some(sha256_file(p)?))),
    }
}

/// The end-of-document id (see the module docs).
fn eos_id(tokenizer: &dyn Tokenizer, path: Option<&Path>, eos: Option<&str>) -> Result<u32> {
    let vocab = tokenizer.vocab_size();
    let err = |message: String| TrainError::option("eos", message);
    if let Some(e) = eos {
        if let Ok(id) = e.parse::<u32>() {
            return if (id as usize) < vocab {
                Ok(id)
            } else {
                Err(err(format!("id {id} is outside the tokenizer's ids 0..{vocab}")))
            };
        }
        return tokenizer.token_id(e).ok_or_else(|| {
            err(format!("{} has no token {e:?}; name a token it has or an id in 0..{vocab}", tokenizer.describe()))
        });
    }
    let Some(path) = path else { return Ok(BYTE_EOS) };
    let config = path.with_file_name("tokenizer_config.json");
    if let Ok(text) = std::fs::read_to_string(&config) {
        let value: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
        let named = value["eos_token"].as_str().or_else(|| value["eos_token"]["content"].as_str());
        if let Some(id) = named.and_then(|t| tokenizer.token_id(t)) {
            return Ok(id);
        }
    }
    EOS_CANDIDATES.iter().find_map(|t| tokenizer.token_id(t)).ok_or_else(|| {
        err(format!(
            "{} has no end-of-document token we know (looked for the eos_token of a tokenizer_config.json beside it, \
             then {}); name one with --eos TOKEN or --eos ID",
            tokenizer.describe(),
            EOS_CANDIDATES.join(", ")
        ))
    })
}

/// The input files, in order: files as given, directories' files recursively in path order.
pub fn input_files(inputs: &[PathBuf]) -> Result<Vec<PathBuf>> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
        let io = |source| TrainError::Io { action: "cannot list", path: dir.into(), source };
        let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(io)?
            .map(|e| e.map(|e| e.path()))
            .collect::<std::io::Result<_>>()
            .map_err(io)?;
        entries.sort();
        for p in entries {
            if p.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.')) {
                continue;
            }
            if p.is_dir() {
                walk(&p, out)?;
            } else {
                out.push(p);
            }
        }
        Ok(())
    }
    let mut files = Vec::new();
    for input in inputs {
        if input.is_dir() {
            walk(input, &mut files)?;
        } else if input.is_file() {
            files.push(input.clone());
        } else {
            return Err(TrainError::Corpus { path: input.clone(), message: "does not exist".into() });
        }
    }
    if files.is_empty() {
        return Err(TrainError::option(
            "input",
            "no input files: give text, JSONL or Parquet files or directories of them",
        ));
    }
    Ok(files)
}

/// How a file is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Text,
    JsonLines,
    Parquet,
}

fn format_of(path: &Path) -> Format {
    match path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase).as_deref() {
        Some("jsonl" | "ndjson" | "json") => Format::JsonLines,
        Some("parquet") => Format::Parquet,
        _ => Format::Text,
    }
}

/// Calls `each` with every non-empty document of `path`, in order.
fn read_documents(path: &Path, field: &str, each: &mut dyn FnMut(Doc) -> Result<()>) -> Result<()> {
    let corpus = |message: String| TrainError::Corpus { path: path.into(), message };
    let io = |source| TrainError::Io { action: "cannot read", path: path.into(), source };
    match format_of(path) {
        Format::Text => {
            let text = read_text(path)?;
            if !text.is_empty() {
                each(Doc { text })?;
            }
        }
        Format::JsonLines => {
            let mut reader = BufReader::with_capacity(1 << 20, std::fs::File::open(path).map_err(io)?);
            let mut line = Vec::new();
            for number in 1.. {
                line.clear();
                if reader.read_until(b'\n', &mut line).map_err(io)? == 0 {
                    break;
                }
                let text = std::str::from_utf8(&line).map_err(|e| {
                    corpus(format!("line {number} is not valid UTF-8 (bad byte at column {})", e.valid_up_to() + 1))
                })?;
                if text.trim().is_empty() {
                    continue;
                }
                let value: serde_json::Value =
                    serde_json::from_str(text).map_err(|e| corpus(format!("line {number} is not JSON: {e}")))?;
                let doc = match &value[field] {
                    serde_json::Value::String(s) => s.clone(),
                    serde_json::Value::Null if value.get(field).is_some() => String::new(),
                    _ => {
                        let fields: Vec<&str> =
                            value.as_object().map(|o| o.keys().map(String::as_str).collect()).unwrap_or_default();
                        return Err(corpus(format!(
                            "line {number} has no string field `{field}` (its fields: {}); choose one with --text-field",
                            if fields.is_empty() { "none, not an object".to_string() } else { fields.join(", ") }
                        )));
                    }
                };
                if !doc.is_empty() {
                    each(Doc { text: doc })?;
                }
            }
        }
        Format::Parquet => {
            use parquet::file::reader::{FileReader, SerializedFileReader};
            use parquet::record::Field;
            let file = std::fs::File::open(path).map_err(io)?;
            let reader =
                SerializedFileReader::new(file).map_err(|e| corpus(format!("is not a readable Parquet file: {e}")))?;
            let schema = reader.metadata().file_metadata().schema();
            let columns: Vec<String> = schema.get_fields().iter().map(|f| f.name().to_string()).collect();
            let Some(column) = schema.get_fields().iter().find(|f| f.name() == field) else {
                return Err(corpus(format!(
                    "has no column `{field}` (its columns: {}); choose one with --text-field",
                    columns.join(", ")
                )));
            };
            let projection = parquet::schema::types::Type::group_type_builder(schema.name())
                .with_fields(vec![column.clone()])
                .build()
                .map_err(|e| corpus(format!("cannot select column `{field}`: {e}")))?;
            let rows = reader
                .get_row_iter(Some(projection))
                .map_err(|e| corpus(format!("cannot read column `{field}`: {e}")))?;
            for (number, row) in rows.enumerate() {
                let row = row.map_err(|e| corpus(format!("row {number} is unreadable: {e}")))?;
                match row.into_columns().into_iter().next().map(|(_, f)| f) {
                    Some(Field::Str(s)) if !s.is_empty() => each(Doc { text: s })?,
                    Some(Field::Str(_) | Field::Null) | None => {}
                    Some(other) => {
                        return Err(corpus(format!(
                            "row {number}: column `{field}` holds {other:?}, not text; choose a text column with --text-field"
                        )))
                    }
                }
            }
        }
    }
    Ok(())
}

/// Writes documents into shards, opening the next shard when one is full.
struct ShardWriter {
    dir: PathBuf,
    dtype: TokenDtype,
    shard_tokens: u64,
    eos: u32,
    current: Option<IndexedWriter>,
    shards: Vec<ShardEntry>,
    max_id: u32,
}

impl ShardWriter {
    fn push(&mut self, mut ids: Vec<u32>) -> Result<()> {
        ids.push(self.eos);
        self.max_id = self.max_id.max(ids.iter().copied().max().unwrap_or(0));
        if self.current.is_none() {
            let prefix = format!("shard-{:05}", self.shards.len());
            self.current = Some(IndexedWriter::create(&self.dir.join(&prefix), self.dtype)?);
            self.shards.push(ShardEntry { prefix, tokens: 0, documents: 0 });
        }
        let w = self.current.as_mut().expect("opened");
        w.push(&ids)?;
        if w.tokens() >= self.shard_tokens {
            self.close()?;
        }
        Ok(())
    }

    fn close(&mut self) -> Result<()> {
        if let Some(w) = self.current.take() {
            let entry = self.shards.last_mut().expect("an open shard is listed");
            (entry.tokens, entry.documents) = (w.tokens(), w.documents() as u64);
            w.finish()?;
        }
        Ok(())
    }
}

/// Runs `disagmoe tokenize`.
pub fn tokenize(opts: &TokenizeOptions) -> Result<TokenizeReport> {
    let start = Instant::now();
    if opts.shard_tokens == 0 {
        return Err(TrainError::option("shard_tokens", "must be at least 1"));
    }
    if opts.out.exists() {
        return Err(TrainError::option(
            "out",
            format!("{} exists; name a new directory (nothing is overwritten)", opts.out.display()),
        ));
    }
    let (tokenizer, sha) = load_tokenizer(opts.tokenizer.as_deref())?;
    let eos = eos_id(tokenizer.as_ref(), opts.tokenizer.as_deref(), opts.eos.as_deref())?;
    let files = input_files(&opts.inputs)?;
    let input_bytes: u64 = files.iter().map(|f| std::fs::metadata(f).map_or(0, |m| m.len())).sum();
    let partial = PathBuf::from(format!("{}.partial", opts.out.display()));
    if partial.exists() {
        return Err(TrainError::option(
            "out",
            format!(
                "{} exists (an interrupted tokenize writes there); remove it or name another --out",
                partial.display()
            ),
        ));
    }
    std::fs::create_dir_all(&partial).map_err(|source| TrainError::Io {
        action: "cannot create",
        path: partial.clone(),
        source,
    })?;
    // Whatever fails from here leaves nothing behind: the directory is ours.
    let written = write_shards(opts, tokenizer.as_ref(), sha, eos, &files, input_bytes, &partial);
    if written.is_err() {
        let _ = std::fs::remove_dir_all(&partial);
    }
    let manifest = written?;
    std::fs::rename(&partial, &opts.out).map_err(|source| TrainError::Io {
        action: "cannot rename the finished shards to",
        path: opts.out.clone(),
        source,
    })?;
    let seconds = start.elapsed().as_secs_f64();
    Ok(TokenizeReport {
        out: opts.out.clone(),
        files: files.len(),
        input_bytes,
        documents: manifest.documents,
        tokens: manifest.tokens,
        shards: manifest.shards.len(),
        dtype: manifest.dtype,
        eos_id: eos,
        seconds,
        tokens_per_s: manifest.tokens as f64 / seconds.max(1e-9),
        mb_per_s: input_bytes as f64 / 1e6 / seconds.max(1e-9),
    })
}

/// Tokenizes every document of `files` into shards in `dir`, then writes the manifest there.
fn write_shards(
    opts: &TokenizeOptions,
    tokenizer: &dyn Tokenizer,
    sha: Option<String>,
    eos: u32,
    files: &[PathBuf],
    input_bytes: u64,
    dir: &Path,
) -> Result<Manifest> {
    let dtype = TokenDtype::for_vocab(tokenizer.vocab_size());
    let mut writer = ShardWriter {
        dir: dir.to_path_buf(),
        dtype,
        shard_tokens: opts.shard_tokens,
        eos,
        current: None,
        shards: Vec::new(),
        max_id: 0,
    };
    let bar = progress_bar(opts.progress, input_bytes);
    let mut batch: Vec<Doc> = Vec::new();
    let mut batch_bytes = 0usize;
    let flush = |batch: &mut Vec<Doc>, writer: &mut ShardWriter| -> Result<()> {
        let ids: Vec<Result<Vec<u32>>> = batch.par_iter().map(|d| tokenizer.encode(&d.text)).collect();
        for ids in ids {
            writer.push(ids?)?;
        }
        batch.clear();
        Ok(())
    };
    for file in files {
        read_documents(file, &opts.text_field, &mut |doc| {
            batch_bytes += doc.text.len();
            batch.push(doc);
            if batch_bytes >= BATCH_BYTES {
                flush(&mut batch, &mut writer)?;
                bar.set_message(format!("{} documents", writer.shards.iter().map(|s| s.documents).sum::<u64>()));
                batch_bytes = 0;
            }
            Ok(())
        })?;
        bar.inc(std::fs::metadata(file).map_or(0, |m| m.len()));
    }
    flush(&mut batch, &mut writer)?;
    writer.close()?;
    bar.finish_and_clear();
    let (tokens, documents) = writer.shards.iter().fold((0, 0), |(t, d), s| (t + s.tokens, d + s.documents));
    if documents == 0 {
        return Err(TrainError::option("input", "the inputs hold no non-empty document"));
    }
    let manifest = Manifest {
        format: MANIFEST_FORMAT.into(),
        version: MANIFEST_VERSION,
        dtype: dtype.name().into(),
        tokens,
        documents,
        max_id: writer.max_id,
        eos_id: eos,
        tokenizer: tokenizer.describe(),
        tokenizer_sha256: sha,
        vocab_size: tokenizer.vocab_size(),
        shards: writer.shards,
    };
    let path = dir.join(MANIFEST_FILE);
    let text = serde_json::to_string_pretty(&manifest).expect("a manifest serialises") + "\n";
    std::fs::write(&path, text).map_err(|source| TrainError::Io { action: "cannot write", path, source })?;
    Ok(manifest)
}

fn progress_bar(enabled: bool, bytes: u64) -> indicatif::ProgressBar {
    use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
    let target = if enabled && std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    let bar = ProgressBar::with_draw_target(Some(bytes), target);
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}, eta {eta}] {bar:30} {bytes}/{total_bytes} {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar
}

/// Refuses token data made with another tokenizer than the run's own (when the run names one).
pub fn check_tokenizer(manifest: &Manifest, dir: &Path, run_tokenizer: Option<&Path>) -> Result<()> {
    let Some(path) = run_tokenizer else { return Ok(()) };
    let sha = sha256_file(path)?;
    if manifest.tokenizer_sha256.as_deref() != Some(sha.as_str()) {
        return Err(TrainError::Corpus {
            path: dir.into(),
            message: format!(
                "was tokenized with {}, not the run's tokenizer {}; tokenize it again with --tokenizer {} or train \
                 with the tokenizer it was made with",
                manifest.tokenizer,
                path.display(),
                path.display()
            ),
        });
    }
    Ok(())
}
