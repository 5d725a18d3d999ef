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
use serde::{Deserialize, Serialize};

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
    /// What each `--input` gave, in the order given (the sources of a blend are often tokenized
    /// apart; this says what one tokenize made of each input).
    pub per_input: Vec<InputReport>,
    /// Input megabytes per second.
    pub mb_per_s: f64,
}

/// What one `--input` (a file or a directory) gave.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputReport {
    /// The input as given.
    pub input: PathBuf,
    /// Its files read.
    pub files: usize,
    /// Its non-empty documents written.
    pub documents: u64,
    /// Its tokens written (end-of-document ids included).
    pub tokens: u64,
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
    Ok(input_files_by_input(inputs)?.into_iter().map(|(f, _)| f).collect())
}

/// [`input_files`], each with the index of the input it came from.
fn input_files_by_input(inputs: &[PathBuf]) -> Result<Vec<(PathBuf, usize)>> {
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
    for (i, input) in inputs.iter().enumerate() {
        if input.is_dir() {
            let mut found = Vec::new();
            walk(input, &mut found)?;
            files.extend(found.into_iter().map(|f| (f, i)));
        } else if input.is_file() {
            files.push((input.clone(), i));
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
            let file = StrictFile::open(path).map_err(io)?;
            let unreadable = |e: String| corpus(format!("is not a readable Parquet file: {e}"));
            let reader = parquet_call(|| SerializedFileReader::new(file))
                .map_err(unreadable)?
                .map_err(|e| unreadable(e.to_string()))?;
            // The parquet crate panics on a column chunk whose offset or size is negative
            // (`ColumnChunkMetaData::byte_range`): refuse such metadata first.
            for (g, group) in reader.metadata().row_groups().iter().enumerate() {
                for c in group.columns() {
                    let start = c.dictionary_page_offset().unwrap_or(c.data_page_offset());
                    if start < 0 || c.compressed_size() < 0 {
                        return Err(corpus(format!(
                            "is damaged: row group {g} places column `{}` at byte {start}, {} bytes long",
                            c.column_path().string(),
                            c.compressed_size()
                        )));
                    }
                }
            }
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
            let cannot_read = |e: String| corpus(format!("cannot read column `{field}`: {e}"));
            let mut rows = parquet_call(|| reader.get_row_iter(Some(projection)))
                .map_err(cannot_read)?
                .map_err(|e| cannot_read(e.to_string()))?;
            for number in 0.. {
                let row =
                    parquet_call(|| rows.next()).map_err(|e| corpus(format!("row {number} is unreadable: {e}")))?;
                let Some(row) = row else { break };
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

/// A Parquet file as the parquet crate reads it, stricter at its end than `std::fs::File`: a read
/// past the end fails (`UnexpectedEof`) instead of returning no bytes, and a byte range past the end
/// is refused before anything is allocated for it. parquet 60.1 skips a page header's unknown
/// fields through `Read` and takes "no bytes" for a skip done: a 448-byte file whose page header
/// claimed a list of 2^31 doubles kept it reading nothing for minutes (found by the
/// `tokenize_parquet` fuzz target).
struct StrictFile {
    file: std::fs::File,
    len: u64,
}

impl StrictFile {
    fn open(path: &Path) -> std::io::Result<Self> {
        let file = std::fs::File::open(path)?;
        let len = file.metadata()?.len();
        Ok(Self { file, len })
    }
}

impl parquet::file::reader::Length for StrictFile {
    fn len(&self) -> u64 {
        self.len
    }
}

impl parquet::file::reader::ChunkReader for StrictFile {
    type T = StrictRead;

    fn get_read(&self, start: u64) -> parquet::errors::Result<StrictRead> {
        self.file.get_read(start).map(StrictRead)
    }

    fn get_bytes(&self, start: u64, length: usize) -> parquet::errors::Result<bytes::Bytes> {
        if start.checked_add(length as u64).is_none_or(|end| end > self.len) {
            return Err(parquet::errors::ParquetError::EOF(format!(
                "{length} bytes at byte {start} of a file of {}",
                self.len
            )));
        }
        self.file.get_bytes(start, length)
    }
}

/// A reader of a [`StrictFile`]: reading at its end is an error.
struct StrictRead(std::io::BufReader<std::fs::File>);

impl std::io::Read for StrictRead {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self.0.read(buf)? {
            0 if !buf.is_empty() => {
                Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "read past the end of the file"))
            }
            n => Ok(n),
        }
    }
}

/// Runs `call` into the parquet crate, whose readers panic on some damaged files instead of
/// failing (60.1: a column chunk at a negative offset, a page whose values run past its end): a
/// panic becomes an error with its message, nothing printed.
fn parquet_call<T>(call: impl FnOnce() -> T) -> std::result::Result<T, String> {
    crate::backend::catch_quietly(std::panic::AssertUnwindSafe(call))
        .map_err(|message| format!("the Parquet reader failed: {message}"))
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
    let files = input_files_by_input(&opts.inputs)?;
    let input_bytes: u64 = files.iter().map(|(f, _)| std::fs::metadata(f).map_or(0, |m| m.len())).sum();
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
    let (manifest, per_input) = written?;
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
        per_input,
    })
}

/// Tokenizes every document of `files` into shards in `dir`, then writes the manifest there.
fn write_shards(
    opts: &TokenizeOptions,
    tokenizer: &dyn Tokenizer,
    sha: Option<String>,
    eos: u32,
    files: &[(PathBuf, usize)],
    input_bytes: u64,
    dir: &Path,
) -> Result<(Manifest, Vec<InputReport>)> {
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
    let mut per_input: Vec<InputReport> =
        opts.inputs.iter().map(|i| InputReport { input: i.clone(), ..InputReport::default() }).collect();
    for &(_, i) in files {
        per_input[i].files += 1;
    }
    // Documents to tokenize, each with the input it came from.
    let mut batch: Vec<(Doc, usize)> = Vec::new();
    let mut batch_bytes = 0usize;
    let flush = |batch: &mut Vec<(Doc, usize)>, writer: &mut ShardWriter, per_input: &mut Vec<InputReport>| {
        let ids: Vec<Result<Vec<u32>>> = batch.par_iter().map(|(d, _)| tokenizer.encode(&d.text)).collect();
        for (ids, (_, i)) in ids.into_iter().zip(batch.iter()) {
            let ids = ids?;
            (per_input[*i].documents, per_input[*i].tokens) =
                (per_input[*i].documents + 1, per_input[*i].tokens + ids.len() as u64 + 1);
            writer.push(ids)?;
        }
        batch.clear();
        Ok::<(), TrainError>(())
    };
    for (file, input) in files {
        read_documents(file, &opts.text_field, &mut |doc| {
            batch_bytes += doc.text.len();
            batch.push((doc, *input));
            if batch_bytes >= BATCH_BYTES {
                flush(&mut batch, &mut writer, &mut per_input)?;
                bar.set_message(format!("{} documents", writer.shards.iter().map(|s| s.documents).sum::<u64>()));
                batch_bytes = 0;
            }
            Ok(())
        })?;
        bar.inc(std::fs::metadata(file).map_or(0, |m| m.len()));
    }
    flush(&mut batch, &mut writer, &mut per_input)?;
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
    Ok((manifest, per_input))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by the `tokenize_parquet` fuzz target: a column chunk at a negative offset made the
    /// parquet crate panic (`column start and length should not be negative`).
    #[test]
    fn a_column_chunk_at_a_negative_offset_is_refused() {
        const CRASH: &[u8] = b"PA\x00\x00\x15\x02\x19,H\x03doc\x15\x02\x00\x15\x0c%\x00\x18\x04text%\x00\x00\x16\
            \x08\x19\x1c\x19\x1c&\x00\x1c\x15\x0c\x19%\x00\x06\x19\x18\x04text\x15\x00\x16\x08\
            \x16^\x16\x0f&\x08I\x1c\x15\x00\x15\x00\x15\x02\x00\x00\x16f\x15\x14\x00\x16^\x16\
            \x08&\x08\x16^\x14\x00\x00(\x19p0\x19\x1c\x1c\x00\x00\x00t\x00\x00\x00PAR1on 20.1.0\
            \x19\x1c\x1c\x00\x00\x00t\x00\x00\x00PAR1";
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("damaged.parquet");
        std::fs::write(&path, CRASH).unwrap();
        let e = read_documents(&path, "text", &mut |_| Ok(())).err().unwrap().to_string();
        assert!(e.contains("damaged.parquet") && e.contains("is damaged") && e.contains("column `text`"), "{e}");
    }

    /// Found by the `tokenize_parquet` fuzz target: a dictionary page claiming more values than it
    /// holds made the parquet crate panic (`range end index 4 out of range for slice of length 0`).
    #[test]
    fn a_page_whose_values_run_past_its_end_is_refused() {
        const CRASH: &[u8] = b"PAR1\x15\x04\x15\x1a\x15\xff\xff\xff\xff\xff\x1aL\x15\x02\x15\x00\x12\x00\x00\x09\
            \x02>\x15\x02\x19,H\x03doc\x15\x02\x00\x15\x0c%\x00\x18\x04text\x00\x16\x02\x19\x1c\
            \x19\x1c&\x00\x1c\x15\x0c\x195\x00\x06\x10\x19\x18\x04text\x15\x00\x16\x02\x16\\\x16\
            \\&>&\x08\x1c6\x00(\x09raw bytes\x18\x09raw bytes\x11\x11\x00\x19,\x15\x04\x15\x00\
            \x15\x02\x00\x15\x00\x15\x10\x15\x02\x00<\x16\x12\x00\x00\x16\xa6\x01\x15\x1a\x16d\
            \x15B\x00\x16\\\x16\x02&\x08\x16\\\x14\x00\x00(\x19parquet-rs version 60.1.0\x19\x1c\
            \x1c\x00\x00\x00\xa1\x00\x00\x00PAR1";
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("short.parquet");
        std::fs::write(&path, CRASH).unwrap();
        let e = read_documents(&path, "text", &mut |_| Ok(())).err().unwrap().to_string();
        assert!(e.contains("short.parquet") && e.contains("row 0 is unreadable: the Parquet reader failed"), "{e}");
    }

    /// Found by the `tokenize_parquet` fuzz target: a page header claiming a list of 2^31 doubles,
    /// which parquet 60.1 skipped by reading nothing 2^31 times at the end of a 448-byte file
    /// (about 50 s; longer lists, longer). The file read past its end is now an error.
    #[test]
    fn a_page_header_that_runs_past_the_end_of_the_file_is_refused() {
        const CRASH: &[u8] =
            b"PAR1\x15\x04\x150\x15,L\x15\x06\x15\x00\x12\x00\x00\x18\x00\x00\x0d\x01<\x01\x00\x00\x00\x00\
            \x00\x00\x00\x02\x00\x00\x00\x00\x00\x00\x00\x15\x00\x15\x08\x15\x0c,\x15\x06\x15\x10\x15\
            \x06\x15\x06\x00\x00\x04\x0c\x02\x03$\x00\xeb\xfb\xea\x8e\x15r\x01\x00L\x15\x04\x15\x00\x12\
            \x00\x009l\x0d\x00\x00\x00\x00\x11\x00\x00a\x20Parquet\x20row$\x00\x00\x00\x00\x00\x19\x1c\
            \x16\x8c\x02\x158\x16\x00\x00\x19\x16b\x00\x15\x02\x19<H\x03doc\x15\x04\x00\x15\x04%\x00\x18\
            \x02id\x00\x15\x0c%\x02\x18\x04text%\x00\x00\x16\x06\x19\x1c\x19,&\x00\x1c\x15\x04\x195\x00\
            \x06\x10\x19\x18\x02id\x15\x02\x16\x06\x16v\x16v&P&\x08\x1c\x18\x08\x02\x00\x00\x00\x00\x00\
            \x00\x00\x18\x08\x00\x00\x00\x00\x00\x00\x00\x00\x16\x00(\x08\x02\x00\x00\x00\x00;\x00\x00\
            \x18\x08\x00\x00\x00\x00\x00\x00\x00\x00\x11\x11\x00\x19,\x15\x04\x15\x00\x15\x02\x00\x15\
            \x00\x15\x10\x15\x02\x00\x00\x16\x8a\x04\x15\x14\x16\xc4\x02\x15>\x00&\x00\x1c\x15\x0c\x195\
            \x00\x06\x10\x19\x18\x04text\x15\x02\x16\x06\x16\xc2\x01\x16\xc6\x01&\x8c\x02&~\x1c6\x02($th\
            e\x20last\x20row,\x20longer\x20than\x20the\x20others\x18\x0da\x20Parquet\x20row\x11\x11\x00\
            \x19,\x15\x04\x15\x00\x15\x02\x00\x15\x00\x15\x10\x15\x02\x00<\x16b)&\x02\x04\x00\x00\x16\
            \x9e\x04\x15\x1c\x16\x82\x03\x15\x88\x01\x00\x16\xb8\x02\x16\x06&\x08\x16\xbc\x02\x14\x00\
            \x00(\x19parquerow\x19\x18$thsion\x2060.1.0\x19,\x1c\x00\x00\x1c\x00\x00\x00>\x01\x00\x00PAR\
            1";
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("long.parquet");
        std::fs::write(&path, CRASH).unwrap();
        let e = read_documents(&path, "text", &mut |_| Ok(())).err().unwrap().to_string();
        assert!(e.contains("long.parquet") && e.contains("past the end of the file"), "{e}");
    }
}
