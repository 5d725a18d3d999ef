//! Any bytes as `model.safetensors.index.json` of a checkpoint directory that holds two valid
//! shards (`model-00001-of-00002.safetensors`, `model-00002-of-00002.safetensors`), a third
//! repeating a tensor of the first (`dup.safetensors`), a file that is no shard (`notes.txt`) and
//! a shard in a subdirectory (`sub/inner.safetensors`), with more shards beside the directory
//! (`../outside.safetensors`) and at a fixed absolute path (`$TMPDIR/disagmoe-fuzz-outside.safetensors`):
//! `CheckpointReader::open` returns a reader or an error, never panics. A reader that opens holds
//! exactly the tensors the index's `weight_map` names, each in the shard it names, which is a plain
//! file of the directory (never the subdirectory's, the parent's or the absolute one's), never two
//! shards holding the same tensor; every tensor reads back the values written.
#![no_main]

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::OnceLock;

use disagmoe_models::CheckpointReader;
use libfuzzer_sys::fuzz_target;

/// A tensor of a shard: name, dtype, shape, bytes.
type T = (&'static str, &'static str, &'static [usize], Vec<u8>);

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A safetensors file of `tensors`, in that order.
fn shard(tensors: &[T]) -> Vec<u8> {
    let mut header = String::from("{");
    let mut at = 0;
    for (i, (name, dtype, shape, bytes)) in tensors.iter().enumerate() {
        let sep = if i == 0 { "" } else { "," };
        let end = at + bytes.len();
        header +=
            &format!("{sep}\"{name}\":{{\"dtype\":\"{dtype}\",\"shape\":{shape:?},\"data_offsets\":[{at},{end}]}}");
        at = end;
    }
    header.push('}');
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    for t in tensors {
        out.extend_from_slice(&t.3);
    }
    out
}

/// The shards of the directory, by file name (the tensors each holds).
fn inside() -> Vec<(&'static str, Vec<T>)> {
    vec![
        (
            "model-00001-of-00002.safetensors",
            vec![
                ("a.weight", "F32", &[2, 2], f32s(&[1.0, -2.0, 0.5, 3.0])),
                ("b.bias", "BF16", &[3], vec![0x80, 0x3f, 0x00, 0xc0, 0x00, 0x00]), // 1, -2, 0
            ],
        ),
        (
            "model-00002-of-00002.safetensors",
            vec![
                ("c.blocks", "U8", &[2, 3], vec![1, 2, 3, 4, 5, 6]),
                ("d.scale", "F16", &[2], vec![0x00, 0x3c, 0x00, 0x38]), // 1, 0.5
            ],
        ),
        ("dup.safetensors", vec![("a.weight", "F32", &[1], f32s(&[9.0]))]),
    ]
}

/// Tensors no index may reach.
const OUTSIDE: [&str; 3] = ["inner.weight", "outside.weight", "absolute.weight"];

/// The checkpoint directory of this process, made once.
fn dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let tmp = std::env::temp_dir();
        let base = tmp.join(format!("disagmoe-fuzz-index-{}", std::process::id()));
        let dir = base.join("ckpt");
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        for (name, tensors) in inside() {
            std::fs::write(dir.join(name), shard(&tensors)).unwrap();
        }
        std::fs::write(dir.join("notes.txt"), b"not a shard").unwrap();
        let one = |name: &'static str| shard(&[(name, "F32", &[1], f32s(&[7.0]))]);
        std::fs::write(dir.join("sub").join("inner.safetensors"), one("inner.weight")).unwrap();
        std::fs::write(base.join("outside.safetensors"), one("outside.weight")).unwrap();
        // Shared by every process (seeds name it): written under another name, then renamed.
        let part = tmp.join(format!("disagmoe-fuzz-outside.{}", std::process::id()));
        std::fs::write(&part, one("absolute.weight")).unwrap();
        std::fs::rename(&part, tmp.join("disagmoe-fuzz-outside.safetensors")).unwrap();
        dir
    })
}

fuzz_target!(|data: &[u8]| {
    let dir = dir();
    std::fs::write(dir.join("model.safetensors.index.json"), data).unwrap();
    let Ok(mut reader) = CheckpointReader::open(dir) else { return };
    // What the index says (serde_json, as the reader parses it: a repeated key, the last).
    let index: serde_json::Value = serde_json::from_slice(data).expect("an index that opens is JSON");
    let placed: BTreeMap<&str, &str> = index["weight_map"]
        .as_object()
        .expect("an index that opens has a weight map")
        .iter()
        .map(|(t, f)| (t.as_str(), f.as_str().expect("shards are file names")))
        .collect();
    let files: BTreeSet<&str> = placed.values().copied().collect();
    assert!(
        !(files.contains("dup.safetensors") && files.contains("model-00001-of-00002.safetensors")),
        "two shards holding `a.weight` are refused"
    );
    let shards = inside();
    for f in &files {
        assert!(shards.iter().any(|(name, _)| name == f), "{f:?} is a shard of the directory");
    }
    let names = reader.names();
    assert!(names.iter().map(String::as_str).eq(placed.keys().copied()), "tensors {names:?}, index {placed:?}");
    for name in OUTSIDE {
        assert!(!reader.contains(name), "`{name}` is read from outside the directory");
    }
    for name in &names {
        let (_, tensors) = shards.iter().find(|(f, _)| *f == placed[name.as_str()]).expect("a shard");
        let (_, dtype, shape, bytes) = tensors.iter().find(|t| t.0 == name).expect("the shard holds it");
        if *dtype == "U8" {
            let (s, v) = reader.read_u8(name).expect("a U8 tensor reads");
            assert_eq!((s.as_slice(), v.as_slice()), (*shape, bytes.as_slice()));
        } else {
            let (s, v) = reader.read_f32(name).expect("a float tensor reads");
            assert_eq!(s.as_slice(), *shape);
            let want: Vec<f32> = match (name.as_str(), *dtype) {
                (_, "F32") => bytes.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(),
                ("b.bias", _) => vec![1.0, -2.0, 0.0],
                _ => vec![1.0, 0.5],
            };
            assert_eq!(v, want, "`{name}`");
        }
    }
});
