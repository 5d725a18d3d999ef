//! Hugging Face safetensors checkpoints: reading (single file or sharded with
//! `model.safetensors.index.json`; F32, BF16 or F16) and writing (F32, or BF16/F16 on request,
//! [`SaveDtype`]; sharded past a size limit, written to a temporary name and renamed so that a crash
//! never leaves a half-written file).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use burn::module::{Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata};
use safetensors::SafeTensors;

use crate::error::{ModelError, Result};

/// File name of a single-file checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// File name of the index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The dtype tensors are written in. Values are held in f32; `bf16` and `f16` round each to
/// nearest even when writing (half the bytes; the usual dtype of published checkpoints).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SaveDtype {
    /// 4 bytes per value, exact.
    #[default]
    F32,
    /// bfloat16: f32's range, 8 bits of mantissa.
    Bf16,
    /// float16: 11 bits of mantissa, values beyond +-65504 become infinite (refused).
    F16,
}

impl SaveDtype {
    /// The names the command line accepts.
    pub const NAMES: [&'static str; 3] = ["f32", "bf16", "f16"];

    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            SaveDtype::F32 => "f32",
            SaveDtype::Bf16 => "bf16",
            SaveDtype::F16 => "f16",
        }
    }

    /// Its name in a transformers `config.json` (`torch_dtype`).
    pub fn torch_name(self) -> &'static str {
        match self {
            SaveDtype::F32 => "float32",
            SaveDtype::Bf16 => "bfloat16",
            SaveDtype::F16 => "float16",
        }
    }

    /// The safetensors dtype.
    pub fn safetensors(self) -> Dtype {
        match self {
            SaveDtype::F32 => Dtype::F32,
            SaveDtype::Bf16 => Dtype::BF16,
            SaveDtype::F16 => Dtype::F16,
        }
    }

    /// Its name in a safetensors header (`F32`, `BF16`, `F16`).
    pub fn header_name(self) -> &'static str {
        match self {
            SaveDtype::F32 => "F32",
            SaveDtype::Bf16 => "BF16",
            SaveDtype::F16 => "F16",
        }
    }

    /// Bytes per value.
    pub fn size(self) -> usize {
        match self {
            SaveDtype::F32 => 4,
            SaveDtype::Bf16 | SaveDtype::F16 => 2,
        }
    }

    /// `values` as little-endian bytes of this dtype; an error names the tensor when a finite
    /// value does not fit (f16 past 65504).
    pub fn encode(self, name: &str, values: &[f32]) -> Result<Vec<u8>> {
        Ok(match self {
            SaveDtype::F32 => values.iter().flat_map(|x| x.to_le_bytes()).collect(),
            SaveDtype::Bf16 => values.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect(),
            SaveDtype::F16 => {
                if let Some(x) = values.iter().find(|x| x.is_finite() && x.abs() > f32::from(half::f16::MAX)) {
                    return Err(ModelError::InvalidInput(format!(
                        "`{name}` holds {x}, beyond f16's range (+-65504): save it as f32 or bf16"
                    )));
                }
                values.iter().flat_map(|&x| half::f16::from_f32(x).to_le_bytes()).collect()
            }
        })
    }

    /// Sets `torch_dtype` (and `dtype`, current transformers' spelling, when present) of a
    /// `config.json` to this dtype.
    pub fn mark_config(self, config: &mut serde_json::Value) {
        if let Some(obj) = config.as_object_mut() {
            obj.insert("torch_dtype".into(), self.torch_name().into());
            if obj.contains_key("dtype") {
                obj.insert("dtype".into(), self.torch_name().into());
            }
        }
    }
}

impl std::fmt::Display for SaveDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for SaveDtype {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "f32" => Ok(SaveDtype::F32),
            "bf16" => Ok(SaveDtype::Bf16),
            "f16" => Ok(SaveDtype::F16),
            _ => Err(format!("unknown save dtype {s:?} (allowed: {})", SaveDtype::NAMES.join(", "))),
        }
    }
}

/// Whether `name` is a plain file name (one normal path component: not empty, not absolute, no
/// separator, not `.` or `..`), so that joining it to a directory stays inside that directory.
fn is_plain_file_name(name: &str) -> bool {
    let mut parts = Path::new(name).components();
    matches!((parts.next(), parts.next()), (Some(std::path::Component::Normal(p)), None) if p == name)
        && !name.contains(['/', '\\', '\0'])
}

struct ShardFile {
    path: PathBuf,
    map: Mmap,
    header_len: usize,
    meta: Metadata,
}

/// Reads tensors by their Hugging Face names from a checkpoint directory, converting to f32.
///
/// It remembers which tensors were taken, so a loader can report the ones it did not use.
pub struct CheckpointReader {
    dir: PathBuf,
    files: Vec<ShardFile>,
    /// tensor name -> index into `files`
    index: HashMap<String, usize>,
    taken: HashSet<String>,
    /// Values converted by the largest single read so far.
    largest_read: usize,
    /// Tensors held in memory ([`CheckpointReader::in_memory`]), by name.
    memory: HashMap<String, MemoryTensor>,
}

/// A tensor of an in-memory reader: its whole shape, and blocks of its rows (along dimension 0),
/// each `(first row, values)`; a tensor stacked over experts may hold only some experts' rows.
struct MemoryTensor {
    shape: Vec<usize>,
    blocks: Vec<(usize, Vec<f32>)>,
}

impl MemoryTensor {
    /// Values of one row.
    fn row_len(&self) -> usize {
        self.shape.iter().skip(1).product()
    }

    /// Rows `first..first + n`, from the blocks that hold them (`None` when one is missing).
    fn rows(&self, first: usize, n: usize) -> Option<Vec<f32>> {
        let len = self.row_len();
        let rows = self.shape.first().copied().unwrap_or(1);
        if first.checked_add(n)? > rows {
            return None;
        }
        let mut out = Vec::with_capacity(n.checked_mul(len)?);
        let mut row = first;
        while row < first + n {
            let (start, values) = self.blocks.iter().find(|(s, v)| *s <= row && row < s + v.len() / len.max(1))?;
            let end = (start + values.len() / len.max(1)).min(first + n);
            out.extend_from_slice(&values[(row - start) * len..(end - start) * len]);
            row = end;
        }
        Some(out)
    }
}

fn io_err<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> ModelError + 'a {
    move |source| ModelError::Io { action, path: path.to_path_buf(), source }
}

impl CheckpointReader {
    /// Opens `dir/model.safetensors.index.json` if present, else `dir/model.safetensors`.
    ///
    /// An index is followed exactly: every shard it names must be a plain file name inside `dir`
    /// (no path, no `..`: a hostile index never reads a file elsewhere), each tensor is read from
    /// the shard the index names, and a shard holding a tensor the index places elsewhere (or
    /// nowhere), or missing one the index places in it, is refused.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let index_path = dir.join(INDEX_FILE);
        if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(io_err("cannot read", &index_path))?;
            let v: serde_json::Value = serde_json::from_str(&text).map_err(|source| ModelError::ConfigParse {
                path: index_path.clone(),
                field: String::new(),
                source,
            })?;
            let bad = |message: String| ModelError::Safetensors { path: index_path.clone(), message };
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| bad("index has no `weight_map` object".into()))?;
            let mut placed = HashMap::with_capacity(map.len());
            for (tensor, file) in map {
                let file = file
                    .as_str()
                    .ok_or_else(|| bad(format!("`weight_map` places `{tensor}` in {file}, not a file name")))?;
                if !is_plain_file_name(file) {
                    return Err(bad(format!(
                        "`weight_map` places `{tensor}` in {file:?}: a shard must be a plain file name inside the \
                         checkpoint directory (no `/`, no `..`, not absolute)"
                    )));
                }
                placed.insert(tensor.clone(), file.to_owned());
            }
            let mut names: Vec<String> = placed.values().cloned().collect();
            names.sort();
            names.dedup();
            let reader = Self::from_files(dir, names)?;
            reader.check_placement(&index_path, &placed)?;
            Ok(reader)
        } else {
            let single = dir.join(SINGLE_FILE);
            if !single.exists() {
                return Err(ModelError::Io {
                    action: "no checkpoint found (expected model.safetensors or model.safetensors.index.json) in",
                    path: dir,
                    source: std::io::Error::from(std::io::ErrorKind::NotFound),
                });
            }
            Self::from_files(dir, vec![SINGLE_FILE.to_owned()])
        }
    }

    /// Opens one safetensors file (any name).
    pub fn open_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
        let name = path.file_name().unwrap_or_default().to_string_lossy().to_string();
        Self::from_files(dir, vec![name])
    }

    /// Opens the named files of `dir`; a tensor held by two of them is refused.
    fn from_files(dir: PathBuf, file_names: Vec<String>) -> Result<Self> {
        let mut files: Vec<ShardFile> = Vec::new();
        let mut index = HashMap::new();
        for name in file_names {
            let path = dir.join(&name);
            let file = std::fs::File::open(&path).map_err(io_err("cannot open", &path))?;
            // SAFETY: the map is read-only; a checkpoint modified while we read it is a user error
            // that at worst yields wrong values, which the shape and length checks bound.
            let map = unsafe { Mmap::map(&file) }.map_err(io_err("cannot map", &path))?;
            let (header_len, meta) = SafeTensors::read_metadata(&map)
                .map_err(|e| ModelError::Safetensors { path: path.clone(), message: e.to_string() })?;
            for tensor_name in meta.tensors().keys() {
                if let Some(other) = index.insert(tensor_name.clone(), files.len()) {
                    let other: &ShardFile = &files[other];
                    return Err(ModelError::Safetensors {
                        path: path.clone(),
                        message: format!(
                            "`{tensor_name}` is also in {}: a tensor must be in one shard",
                            other.path.display()
                        ),
                    });
                }
            }
            files.push(ShardFile { path, map, header_len, meta });
        }
        Ok(Self { dir, files, index, taken: HashSet::new(), largest_read: 0, memory: HashMap::new() })
    }

    /// A reader of tensors held in memory (see [`CheckpointReader::put_rows`]): loaders read them
    /// by name as they read a checkpoint's, e.g. to rebuild a module from values received from
    /// another process.
    pub fn in_memory() -> Self {
        Self {
            dir: PathBuf::from("<memory>"),
            files: Vec::new(),
            index: HashMap::new(),
            taken: HashSet::new(),
            largest_read: 0,
            memory: HashMap::new(),
        }
    }

    /// Adds rows `first..` (along dimension 0) of the tensor `name` of shape `shape` to an
    /// in-memory reader: the whole tensor (`first` 0, every row), or some rows of a tensor stacked
    /// over experts (reads of other rows are refused). Refused when the values are not whole rows
    /// of `shape`, lie past its end, or `name` was given with another shape.
    pub fn put_rows(&mut self, name: &str, shape: &[usize], first: usize, values: Vec<f32>) -> Result<()> {
        let len: usize = shape.iter().skip(1).product();
        let rows = shape.first().copied().unwrap_or(1);
        let bad = |message: String| ModelError::Safetensors { path: PathBuf::from("<memory>"), message };
        if shape.is_empty() && (first != 0 || values.len() != 1) {
            return Err(bad(format!("`{name}`: a scalar takes one value at row 0")));
        }
        let past_end = |len: usize| first.checked_add(values.len() / len).is_none_or(|end| end > rows);
        if !shape.is_empty() && (len == 0 || values.len() % len != 0 || past_end(len)) {
            return Err(bad(format!("`{name}`: {} values from row {first} are not rows of {shape:?}", values.len())));
        }
        let t = self
            .memory
            .entry(name.to_owned())
            .or_insert_with(|| MemoryTensor { shape: shape.to_vec(), blocks: Vec::new() });
        if t.shape != shape {
            return Err(bad(format!("`{name}` given as {shape:?} and as {:?}", t.shape)));
        }
        t.blocks.push((first, values));
        Ok(())
    }

    /// Every tensor is in the shard `placed` (the index's `weight_map`) names, and every tensor the
    /// index names is there.
    fn check_placement(&self, index_path: &Path, placed: &HashMap<String, String>) -> Result<()> {
        let bad = |message: String| ModelError::Safetensors { path: index_path.to_path_buf(), message };
        let file_name = |fi: usize| self.files[fi].path.file_name().map(|n| n.to_string_lossy().to_string());
        for (tensor, &fi) in &self.index {
            let found = file_name(fi).unwrap_or_default();
            match placed.get(tensor) {
                Some(want) if *want == found => {}
                Some(want) => {
                    return Err(bad(format!("`{tensor}` is in {found}, but the index places it in {want}")));
                }
                None => return Err(bad(format!("`{tensor}` is in {found}, but the index does not name it"))),
            }
        }
        for (tensor, want) in placed {
            if !self.index.contains_key(tensor) {
                return Err(bad(format!("the index places `{tensor}` in {want}, which does not hold it")));
            }
        }
        Ok(())
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Names of all tensors in the checkpoint, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.index.keys().chain(self.memory.keys()).cloned().collect();
        v.sort();
        v
    }

    /// Whether the checkpoint has a tensor of this name.
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name) || self.memory.contains_key(name)
    }

    /// Rows `first..first + n` of an in-memory tensor with its whole shape (`None`: not in memory).
    fn memory_rows(&mut self, name: &str, first: usize, n: Option<usize>) -> Option<Result<(Vec<usize>, Vec<f32>)>> {
        let t = self.memory.get(name)?;
        let rows = t.shape.first().copied().unwrap_or(1);
        let n = n.unwrap_or(rows - first.min(rows));
        let out = match t.rows(first, n) {
            Some(values) => Ok((t.shape.clone(), values)),
            _ => Err(ModelError::MissingTensor {
                name: format!("{name} (rows {first}..{} of the values held)", first + n),
                dir: self.dir.clone(),
            }),
        };
        if let Ok((_, values)) = &out {
            self.taken.insert(name.to_owned());
            self.largest_read = self.largest_read.max(values.len());
        }
        Some(out)
    }

    /// The raw bytes, dtype and shape of a tensor, checked against each other.
    fn raw(&mut self, name: &str) -> Result<(&[u8], Dtype, Vec<usize>)> {
        let &fi = self
            .index
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor { name: name.into(), dir: self.dir.clone() })?;
        let file = &self.files[fi];
        let info = file.meta.info(name).expect("indexed tensor has metadata");
        let start = 8 + file.header_len + info.data_offsets.0;
        let end = 8 + file.header_len + info.data_offsets.1;
        let bytes = file.map.get(start..end).ok_or_else(|| ModelError::Safetensors {
            path: file.path.clone(),
            message: format!("data of `{name}` lies past the end of the file (truncated?)"),
        })?;
        let width = match info.dtype {
            Dtype::F32 => 4,
            Dtype::BF16 | Dtype::F16 => 2,
            Dtype::U8 => 1,
            other => return Err(ModelError::UnsupportedDtype { name: name.into(), dtype: format!("{other:?}") }),
        };
        let n: usize = info.shape.iter().product();
        if bytes.len() != n * width {
            return Err(ModelError::Safetensors {
                path: file.path.clone(),
                message: format!("`{name}` has {} bytes, its shape {:?} needs {}", bytes.len(), info.shape, n * width),
            });
        }
        Ok((bytes, info.dtype, info.shape.clone()))
    }

    /// Reads a tensor (F32, BF16 or F16) as f32 with its shape, marking it used.
    pub fn read_f32(&mut self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        if let Some(read) = self.memory_rows(name, 0, None) {
            return read;
        }
        let (bytes, dtype, shape) = self.raw(name)?;
        let values = to_f32(name, bytes, dtype)?;
        self.taken.insert(name.to_owned());
        self.largest_read = self.largest_read.max(values.len());
        Ok((shape, values))
    }

    /// Values converted (allocated) by the largest single read so far: a reader of a shard can
    /// check it never materialised more than its own rows.
    pub fn largest_read(&self) -> usize {
        self.largest_read
    }

    /// Reads rows `first..first + n` (along dimension 0) of a tensor as f32, converting only those
    /// rows from the memory map: an expert shard of a fused `[E, ...]` tensor reads its experts only.
    /// Returns the full tensor's shape and the rows' values.
    pub fn read_rows_f32(&mut self, name: &str, first: usize, n: usize) -> Result<(Vec<usize>, Vec<f32>)> {
        if let Some(read) = self.memory_rows(name, first, Some(n)) {
            return read;
        }
        let (bytes, dtype, shape) = self.raw(name)?;
        let rows = shape.first().copied().unwrap_or(1);
        if first + n > rows {
            return Err(ModelError::ShapeMismatch {
                name: name.into(),
                found: shape.clone(),
                expected: std::iter::once(first + n).chain(shape.iter().skip(1).copied()).collect(),
            });
        }
        let row_bytes = bytes.len() / rows.max(1);
        let values = to_f32(name, &bytes[first * row_bytes..(first + n) * row_bytes], dtype)?;
        self.taken.insert(name.to_owned());
        self.largest_read = self.largest_read.max(values.len());
        Ok((shape, values))
    }

    /// Rows `first..first + shape[0]` of a tensor stacked along dimension 0, checked against
    /// `shape` in every other dimension, on `device`.
    pub fn tensor_rows<B: Backend, const D: usize>(
        &mut self,
        name: &str,
        shape: [usize; D],
        first: usize,
        device: &B::Device,
    ) -> Result<Tensor<B, D>> {
        let (found, values) = self.read_rows_f32(name, first, shape[0])?;
        if found.len() != D || found[1..] != shape[1..] {
            let mut expected = shape.to_vec();
            expected[0] = found.first().copied().unwrap_or(0);
            return Err(ModelError::ShapeMismatch { name: name.into(), found, expected });
        }
        Ok(Tensor::from_data(TensorData::new(values, shape), device))
    }

    /// Reads a `U8` tensor (e.g. MXFP4 blocks and scales) as raw bytes with its shape.
    pub fn read_u8(&mut self, name: &str) -> Result<(Vec<usize>, Vec<u8>)> {
        let (bytes, dtype, shape) = self.raw(name)?;
        if dtype != Dtype::U8 {
            return Err(ModelError::UnsupportedDtype { name: name.into(), dtype: format!("{dtype:?} (expected U8)") });
        }
        let out = bytes.to_vec();
        self.taken.insert(name.to_owned());
        Ok((shape, out))
    }

    /// Reads rows `first..first + n` (along dimension 0) of a `U8` tensor; returns the full shape.
    pub fn read_rows_u8(&mut self, name: &str, first: usize, n: usize) -> Result<(Vec<usize>, Vec<u8>)> {
        let (bytes, dtype, shape) = self.raw(name)?;
        if dtype != Dtype::U8 {
            return Err(ModelError::UnsupportedDtype { name: name.into(), dtype: format!("{dtype:?} (expected U8)") });
        }
        let rows = shape.first().copied().unwrap_or(1);
        if first + n > rows {
            return Err(ModelError::ShapeMismatch {
                name: name.into(),
                found: shape.clone(),
                expected: std::iter::once(first + n).chain(shape.iter().skip(1).copied()).collect(),
            });
        }
        let row_bytes = bytes.len() / rows.max(1);
        let out = bytes[first * row_bytes..(first + n) * row_bytes].to_vec();
        self.taken.insert(name.to_owned());
        self.largest_read = self.largest_read.max(out.len());
        Ok((shape, out))
    }

    /// Reads a tensor, checks its shape, and puts it on `device`.
    pub fn tensor<B: Backend, const D: usize>(
        &mut self,
        name: &str,
        shape: [usize; D],
        device: &B::Device,
    ) -> Result<Tensor<B, D>> {
        let (found, values) = self.read_f32(name)?;
        if found.as_slice() != shape.as_slice() {
            return Err(ModelError::ShapeMismatch { name: name.into(), found, expected: shape.to_vec() });
        }
        Ok(Tensor::from_data(TensorData::new(values, shape), device))
    }

    /// Names present in the checkpoint that no loader has read, sorted.
    pub fn unused(&self) -> Vec<String> {
        let mut v: Vec<String> =
            self.index.keys().chain(self.memory.keys()).filter(|n| !self.taken.contains(*n)).cloned().collect();
        v.sort();
        v
    }
}

/// Little-endian F32, BF16 or F16 values as f32.
fn to_f32(name: &str, bytes: &[u8], dtype: Dtype) -> Result<Vec<f32>> {
    Ok(match dtype {
        Dtype::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        Dtype::BF16 => bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        Dtype::F16 => bytes.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        other => return Err(ModelError::UnsupportedDtype { name: name.into(), dtype: format!("{other:?}") }),
    })
}

/// Collects named f32 tensors and writes them as a Hugging Face safetensors checkpoint.
///
/// It also records the [`ParamId`] behind each name, so gradients and optimizer state (keyed by
/// parameter id in Burn) can be reported under Hugging Face names. A sink made with
/// [`TensorSink::names_only`] records only the names, reading no values.
#[derive(Default)]
pub struct TensorSink {
    tensors: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    ids: BTreeMap<String, ParamId>,
    names_only: bool,
}

struct View<'a> {
    dtype: Dtype,
    shape: &'a [usize],
    bytes: Vec<u8>,
}

impl safetensors::View for &View<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

impl TensorSink {
    /// An empty sink.
    pub fn new() -> Self {
        Self::default()
    }

    /// A sink that records names and parameter ids, and no values.
    pub fn names_only() -> Self {
        Self { names_only: true, ..Self::default() }
    }

    /// Adds a parameter under its Hugging Face name.
    pub fn put_param<B: Backend, const D: usize>(&mut self, name: String, p: &Param<Tensor<B, D>>) {
        self.ids.insert(name.clone(), p.id);
        if !self.names_only {
            self.put(name, p.val());
        } else {
            self.tensors.insert(name, (p.val().dims().to_vec(), Vec::new()));
        }
    }

    /// Hugging Face name of each parameter id.
    pub fn names_by_id(&self) -> HashMap<ParamId, String> {
        self.ids.iter().map(|(n, id)| (*id, n.clone())).collect()
    }

    /// Adds a tensor (read back from its device as f32).
    pub fn put<B: Backend, const D: usize>(&mut self, name: String, t: Tensor<B, D>) {
        let shape = t.dims().to_vec();
        let values = t.into_data().convert::<f32>().to_vec::<f32>().expect("f32 data");
        self.tensors.insert(name, (shape, values));
    }

    /// Adds raw f32 values.
    pub fn put_raw(&mut self, name: String, shape: Vec<usize>, values: Vec<f32>) {
        self.tensors.insert(name, (shape, values));
    }

    /// Adds `name` as a copy of the collected tensor `of` (nothing when `of` was not collected):
    /// a tensor a checkpoint layout repeats under a second name, which is not a parameter.
    pub fn put_copy(&mut self, name: String, of: &str) {
        if let Some(t) = self.tensors.get(of).cloned() {
            self.tensors.insert(name, t);
        }
    }

    /// Takes one collected tensor's shape and values out of the sink.
    pub fn take(&mut self, name: &str) -> Option<(Vec<usize>, Vec<f32>)> {
        self.tensors.remove(name)
    }

    /// Names collected so far.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Values of one collected tensor.
    pub fn get(&self, name: &str) -> Option<(&[usize], &[f32])> {
        self.tensors.get(name).map(|(s, v)| (s.as_slice(), v.as_slice()))
    }

    /// Writes every tensor into the one safetensors file `path` (f32, atomically); returns the bytes
    /// of tensor data written.
    pub fn write_file(&self, path: &Path) -> Result<usize> {
        self.write_file_as(path, SaveDtype::F32)
    }

    /// [`TensorSink::write_file`] in `dtype`.
    pub fn write_file_as(&self, path: &Path, dtype: SaveDtype) -> Result<usize> {
        let names: Vec<&String> = self.tensors.keys().collect();
        write_views(path, &self.views(&names, dtype)?)?;
        Ok(self.tensors.values().map(|(_, v)| v.len() * dtype.size()).sum())
    }

    /// The tensors `names` as views of their bytes in `dtype`.
    fn views(&self, names: &[&String], dtype: SaveDtype) -> Result<Vec<(String, View<'_>)>> {
        names
            .iter()
            .map(|name| {
                let (shape, values) = &self.tensors[*name];
                let bytes = dtype.encode(name, values)?;
                Ok(((*name).clone(), View { dtype: dtype.safetensors(), shape, bytes }))
            })
            .collect()
    }

    /// Whether the sink holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty() && self.ids.is_empty()
    }

    /// Writes `dir/model.safetensors`, or shards of at most `max_shard_bytes` plus
    /// `model.safetensors.index.json` when the tensors do not fit in one. Each file is written to a
    /// temporary name, synced, and renamed into place.
    pub fn write(&self, dir: impl AsRef<Path>, max_shard_bytes: usize) -> Result<Vec<PathBuf>> {
        self.write_as(dir, max_shard_bytes, SaveDtype::F32)
    }

    /// [`TensorSink::write`] in `dtype`.
    pub fn write_as(&self, dir: impl AsRef<Path>, max_shard_bytes: usize, dtype: SaveDtype) -> Result<Vec<PathBuf>> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(io_err("cannot create directory", dir))?;
        // Deal tensors to shards in name order.
        let mut shards: Vec<Vec<&String>> = vec![vec![]];
        let mut current = 0usize;
        for (name, (_, v)) in &self.tensors {
            let size = v.len() * dtype.size();
            if current > 0 && current + size > max_shard_bytes {
                shards.push(vec![]);
                current = 0;
            }
            shards.last_mut().unwrap().push(name);
            current += size;
        }
        let n = shards.len();
        let mut written = Vec::new();
        let mut weight_map = serde_json::Map::new();
        for (i, names) in shards.iter().enumerate() {
            let file_name =
                if n == 1 { SINGLE_FILE.to_owned() } else { format!("model-{:05}-of-{:05}.safetensors", i + 1, n) };
            let path = dir.join(&file_name);
            write_views(&path, &self.views(names, dtype)?)?;
            for name in names {
                weight_map.insert((*name).clone(), serde_json::Value::String(file_name.clone()));
            }
            written.push(path);
        }
        let index_path = dir.join(INDEX_FILE);
        if n > 1 {
            let total: usize = self.tensors.values().map(|(_, v)| v.len() * dtype.size()).sum();
            let index = serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
            write_atomically(&index_path, |tmp| std::fs::write(tmp, serde_json::to_vec_pretty(&index).unwrap()))?;
            written.push(index_path);
            let _ = std::fs::remove_file(dir.join(SINGLE_FILE));
        } else if index_path.exists() {
            // A stale index would shadow the single file we just wrote.
            std::fs::remove_file(&index_path).map_err(io_err("cannot remove stale index", &index_path))?;
        }
        Ok(written)
    }
}

/// Writes one safetensors file of `views` atomically.
fn write_views(path: &Path, views: &[(String, View<'_>)]) -> Result<()> {
    let meta = HashMap::from([("format".to_owned(), "pt".to_owned())]);
    let refs = views.iter().map(|(n, v)| (n.clone(), v));
    write_atomically(path, |tmp| {
        safetensors::serialize_to_file(refs, Some(meta), tmp).map_err(|e| std::io::Error::other(e.to_string()))
    })
}

/// Writes `path` through `write(tmp)` to `path.tmp`, fsyncs it, then renames it over `path`.
pub fn write_atomically(path: &Path, write: impl FnOnce(&Path) -> std::io::Result<()>) -> Result<()> {
    let mut tmp_name = path.file_name().unwrap_or_default().to_os_string();
    tmp_name.push(".tmp");
    let tmp = path.with_file_name(tmp_name);
    let result =
        write(&tmp).and_then(|_| std::fs::File::open(&tmp)?.sync_all()).and_then(|_| std::fs::rename(&tmp, path));
    result.map_err(|source| {
        let _ = std::fs::remove_file(&tmp);
        ModelError::Io { action: "cannot write", path: path.to_path_buf(), source }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes a shard `name` holding the tensors `names` (one value each) into `dir`.
    fn shard(dir: &Path, name: &str, names: &[&str]) {
        let mut sink = TensorSink::new();
        for (i, n) in names.iter().enumerate() {
            sink.put_raw((*n).into(), vec![1], vec![i as f32]);
        }
        sink.write_file(&dir.join(name)).unwrap();
    }

    /// Writes an index placing each `(tensor, file)`; opens the directory, returning the error.
    fn open_with_index(dir: &Path, placed: &[(&str, &str)]) -> std::result::Result<CheckpointReader, String> {
        let map: serde_json::Map<String, serde_json::Value> =
            placed.iter().map(|(t, f)| ((*t).to_string(), serde_json::Value::from(*f))).collect();
        let index = serde_json::json!({"metadata": {}, "weight_map": map});
        std::fs::write(dir.join(INDEX_FILE), index.to_string()).unwrap();
        CheckpointReader::open(dir).map_err(|e| e.to_string())
    }

    #[test]
    fn an_in_memory_reader_serves_whole_tensors_and_the_rows_it_holds() {
        let mut r = CheckpointReader::in_memory();
        r.put_rows("w", &[2, 3], 0, (0..6).map(|v| v as f32).collect()).unwrap();
        // Rows 1, 2 and 4 of a tensor stacked over 5 experts, in two blocks given out of order.
        r.put_rows("s", &[5, 2], 4, vec![8.0, 9.0]).unwrap();
        r.put_rows("s", &[5, 2], 1, vec![2.0, 3.0, 4.0, 5.0]).unwrap();
        assert!(r.contains("w") && r.contains("s") && !r.contains("x"));
        assert_eq!(r.read_f32("w").unwrap(), (vec![2, 3], vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]));
        assert_eq!(r.read_rows_f32("s", 1, 2).unwrap(), (vec![5, 2], vec![2.0, 3.0, 4.0, 5.0]));
        assert_eq!(r.read_rows_f32("s", 2, 1).unwrap().1, [4.0, 5.0]);
        assert_eq!(r.read_rows_f32("s", 4, 1).unwrap().1, [8.0, 9.0]);
        // Rows it does not hold, or past the end, are refused by name.
        for (first, n) in [(0, 1), (2, 2), (3, 1), (4, 2)] {
            let e = r.read_rows_f32("s", first, n).unwrap_err().to_string();
            assert!(e.contains("`s") || e.contains("s (rows"), "{e}");
        }
        assert!(r.read_f32("s").is_err());
        assert!(r.put_rows("s", &[4, 2], 0, vec![0.0, 0.0]).is_err(), "another shape");
        assert!(r.put_rows("t", &[2, 3], 1, vec![0.0; 6]).is_err(), "past the end");
        assert!(r.put_rows("t", &[2, 3], 0, vec![0.0; 4]).is_err(), "not whole rows");
        let t: Tensor<burn::backend::Flex, 2> = r.tensor_rows("s", [2, 2], 1, &Default::default()).unwrap();
        assert_eq!(t.into_data().to_vec::<f32>().unwrap(), [2.0, 3.0, 4.0, 5.0]);
        assert_eq!(r.unused(), Vec::<String>::new());
    }

    #[test]
    fn an_index_is_followed_exactly_and_never_outside_the_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ck");
        std::fs::create_dir_all(&dir).unwrap();
        shard(tmp.path(), "outside.safetensors", &["a"]);
        shard(&dir, "a.safetensors", &["a", "b"]);
        shard(&dir, "c.safetensors", &["c"]);
        let mut ok =
            open_with_index(&dir, &[("a", "a.safetensors"), ("b", "a.safetensors"), ("c", "c.safetensors")]).unwrap();
        assert_eq!(ok.names(), ["a", "b", "c"]);
        assert_eq!(ok.read_f32("b").unwrap().1, [1.0]);
        let outside = tmp.path().join("outside.safetensors");
        let outside = outside.to_str().unwrap();
        for (file, what) in [
            ("../outside.safetensors", "a parent directory"),
            (outside, "an absolute path"),
            ("sub/a.safetensors", "a subdirectory"),
            ("./a.safetensors", "a dotted path"),
            ("..", "the parent itself"),
            ("", "an empty name"),
        ] {
            let e = open_with_index(&dir, &[("a", file), ("b", "a.safetensors"), ("c", "c.safetensors")])
                .err()
                .unwrap_or_else(|| panic!("{what} ({file:?}) was followed"));
            assert!(e.contains("plain file name"), "{what}: {e}");
        }
        // The index's placement is the truth: a tensor elsewhere, unnamed, missing or in two shards.
        let e = open_with_index(&dir, &[("a", "a.safetensors"), ("b", "c.safetensors"), ("c", "c.safetensors")])
            .err()
            .unwrap();
        assert!(e.contains("`b` is in a.safetensors, but the index places it in c.safetensors"), "{e}");
        let e = open_with_index(&dir, &[("a", "a.safetensors"), ("c", "c.safetensors")]).err().unwrap();
        assert!(e.contains("`b` is in a.safetensors, but the index does not name it"), "{e}");
        let e = open_with_index(
            &dir,
            &[("a", "a.safetensors"), ("b", "a.safetensors"), ("c", "c.safetensors"), ("d", "c.safetensors")],
        )
        .err()
        .unwrap();
        assert!(e.contains("places `d` in c.safetensors, which does not hold it"), "{e}");
        shard(&dir, "c.safetensors", &["c", "a"]);
        let e = open_with_index(&dir, &[("a", "a.safetensors"), ("b", "a.safetensors"), ("c", "c.safetensors")])
            .err()
            .unwrap();
        assert!(e.contains("`a` is also in") && e.contains("one shard"), "{e}");
    }

    #[test]
    fn low_dtypes_round_to_nearest_even_and_f16_refuses_what_it_cannot_hold() {
        // 1 + 2^-8 lies halfway between two bf16 values: to the even one, 1.0.
        let bytes = SaveDtype::Bf16.encode("w", &[1.0, 1.0 + 1.0 / 256.0, -2.5]).unwrap();
        let back: Vec<f32> = bytes.chunks(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect();
        assert_eq!(back, vec![1.0, 1.0, -2.5]);
        assert_eq!(SaveDtype::F32.encode("w", &[0.1]).unwrap(), 0.1f32.to_le_bytes().to_vec());
        let e = SaveDtype::F16.encode("model.norm.weight", &[1.0, 70000.0]).unwrap_err().to_string();
        assert!(e.contains("model.norm.weight") && e.contains("f32 or bf16"), "{e}");
        assert!(SaveDtype::F16.encode("w", &[f32::INFINITY, 65504.0]).is_ok());
        assert_eq!("bf16".parse::<SaveDtype>(), Ok(SaveDtype::Bf16));
        assert!("fp8".parse::<SaveDtype>().unwrap_err().contains("f32, bf16, f16"));
    }
}
