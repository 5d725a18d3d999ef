//! The model of a distributed run written as one Hugging Face directory without gathering it:
//! every worker writes what it holds, rank 0 writes `config.json` and the index last.
//!
//! - Whole tensors: each worker writes the tensors it counts for the run (the attention side only
//!   from the first copy of a data-parallel group) into `model-rank-<r>.safetensors`.
//! - Tensors stacked over experts (GPT-OSS's fused `[E, ...]` expert tensors, split over a layer's
//!   holders): one file per layer, `model-experts-layer-<l>.safetensors`, whose header every holder
//!   computes the same way (names in order, full shapes); each holder writes its rows at their
//!   offsets (`pwrite`), so no worker holds more than its own rows.
//! - Rank 0 writes `model.safetensors.index.json` (which file holds each tensor) and `config.json`
//!   after every worker has reported its files written and synced.
//!
//! transformers loads the directory like any sharded checkpoint.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;

use disagmoe_models::weights::write_atomically;
use disagmoe_models::SaveDtype;

use super::msg::ShardReport;
use super::part::{NamedParts, StackedRows};
use crate::error::{Result, TrainError};

fn io<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> TrainError + 'a {
    move |source| TrainError::Io { action, path: path.into(), source }
}

/// The file of layer `layer`'s stacked expert tensors.
pub fn stacked_file(layer: usize) -> String {
    format!("model-experts-layer-{layer:04}.safetensors")
}

/// The safetensors header of a file of tensors with the given names and full shapes (in `dtype`,
/// in name order), and the offset of each tensor's data from the start of the file.
fn header(tensors: &BTreeMap<String, Vec<usize>>, dtype: SaveDtype) -> (Vec<u8>, BTreeMap<String, usize>) {
    let mut meta = serde_json::Map::new();
    meta.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut at = 0usize;
    let mut starts = BTreeMap::new();
    for (name, shape) in tensors {
        let bytes = shape.iter().product::<usize>() * dtype.size();
        meta.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype.header_name(), "shape": shape, "data_offsets": [at, at + bytes]}),
        );
        starts.insert(name.clone(), at);
        at += bytes;
    }
    let mut json = serde_json::to_vec(&serde_json::Value::Object(meta)).expect("header serialises");
    while (json.len() + 8) % 8 != 0 {
        json.push(b' ');
    }
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend(json);
    let base = out.len();
    (out, starts.into_iter().map(|(n, s)| (n, base + s)).collect())
}

/// Writes this worker's share of the model into `dir` in `dtype` (see the module docs); `experts` is
/// the number of routed experts per layer (the rows of a stacked tensor).
pub fn write_shards(
    dir: &Path,
    rank: usize,
    parts: &NamedParts,
    experts: usize,
    dtype: SaveDtype,
) -> Result<ShardReport> {
    std::fs::create_dir_all(dir).map_err(io("cannot create directory", dir))?;
    let mut report = ShardReport::default();
    if !parts.whole.is_empty() {
        let file = format!("model-rank-{rank:05}.safetensors");
        report.bytes += parts.whole.write_file_as(&dir.join(&file), dtype)?;
        report.files.extend(parts.whole.names().map(|n| (n.to_owned(), file.clone())));
    }
    for rows in &parts.stacked {
        report.bytes += write_rows(dir, rows, experts, dtype)?;
        report.files.extend(rows.sink.names().map(|n| (n.to_owned(), stacked_file(rows.layer))));
    }
    Ok(report)
}

/// Writes rows `first..` of a layer's stacked tensors into their shared file, header included.
fn write_rows(dir: &Path, rows: &StackedRows, experts: usize, dtype: SaveDtype) -> Result<usize> {
    let full: BTreeMap<String, Vec<usize>> = rows
        .sink
        .names()
        .map(|n| {
            let (shape, _) = rows.sink.get(n).expect("listed");
            let mut shape = shape.to_vec();
            shape[0] = experts;
            (n.to_owned(), shape)
        })
        .collect();
    let (head, starts) = header(&full, dtype);
    let path = dir.join(stacked_file(rows.layer));
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(io("cannot open", &path))?;
    let total = head.len() + full.values().map(|s| s.iter().product::<usize>() * dtype.size()).sum::<usize>();
    file.set_len(total as u64).map_err(io("cannot size", &path))?;
    file.write_all_at(&head, 0).map_err(io("cannot write", &path))?;
    let mut written = 0;
    for (name, start) in &starts {
        let (shape, values) = rows.sink.get(name).expect("listed");
        let row_bytes = shape[1..].iter().product::<usize>() * dtype.size();
        let bytes = dtype.encode(name, values)?;
        file.write_all_at(&bytes, (start + rows.first * row_bytes) as u64).map_err(io("cannot write", &path))?;
        written += bytes.len();
    }
    file.sync_all().map_err(io("cannot sync", &path))?;
    Ok(written)
}

/// Rank 0's last step: the index of every worker's files and `config.json`.
pub fn write_index(dir: &Path, reports: &[ShardReport], config: &serde_json::Value) -> Result<()> {
    let mut weight_map = serde_json::Map::new();
    let mut total = 0usize;
    for r in reports {
        total += r.bytes;
        for (tensor, file) in &r.files {
            weight_map.insert(tensor.clone(), serde_json::Value::String(file.clone()));
        }
    }
    let index = serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    let index_path = dir.join(disagmoe_models::weights::INDEX_FILE);
    write_atomically(&index_path, |tmp| {
        let mut f = std::fs::File::create(tmp)?;
        f.write_all(&serde_json::to_vec_pretty(&index).expect("index serialises"))
    })?;
    // A single-file checkpoint left from an earlier run would shadow nothing (the index wins), but
    // would mislead a reader of the directory.
    let _ = std::fs::remove_file(dir.join(disagmoe_models::weights::SINGLE_FILE));
    let text = serde_json::to_vec_pretty(config).expect("config serialises");
    write_atomically(&dir.join("config.json"), |tmp| std::fs::write(tmp, &text))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use disagmoe_models::TensorSink;

    use super::*;

    #[test]
    fn holders_writing_their_rows_make_one_readable_file() {
        let dir = tempfile::tempdir().unwrap();
        let (experts, m) = (5, 3);
        // Two holders of one layer: experts 0..2 and 2..5, written in either order.
        for (first, n) in [(2usize, 3usize), (0, 2)] {
            let mut sink = TensorSink::new();
            let rows: Vec<f32> = (first * m..(first + n) * m).map(|x| x as f32).collect();
            sink.put_raw("model.layers.0.mlp.experts.down_proj_bias".into(), vec![n, m], rows.clone());
            sink.put_raw(
                "model.layers.0.mlp.experts.gate_up_proj_bias".into(),
                vec![n, 2 * m],
                [rows.clone(), rows].concat(),
            );
            let parts = NamedParts { whole: TensorSink::new(), stacked: vec![StackedRows { layer: 0, first, sink }] };
            write_shards(dir.path(), first, &parts, experts, SaveDtype::F32).unwrap();
        }
        let mut reader = disagmoe_models::CheckpointReader::open_file(dir.path().join(stacked_file(0))).unwrap();
        let (shape, values) = reader.read_f32("model.layers.0.mlp.experts.down_proj_bias").unwrap();
        assert_eq!(shape, vec![experts, m]);
        assert_eq!(values, (0..experts * m).map(|x| x as f32).collect::<Vec<_>>());
        let (shape, _) = reader.read_f32("model.layers.0.mlp.experts.gate_up_proj_bias").unwrap();
        assert_eq!(shape, vec![experts, 2 * m]);
    }
}
