//! Any bytes as a Megatron `.idx`, beside a `.bin` of 256 bytes: `IndexedDataset::open` returns a
//! dataset or an error, never panics. A dataset that opens describes only tokens its `.bin` holds
//! (documents in order, the last ending at most at the token count), and every document reads back
//! (`read_into`) as exactly the `.bin`'s bytes at its offset in the index's dtype: no read fails or
//! lands outside the `.bin`. Then the pair as `--data` (`PackedDataset::open`, the held-out split
//! by its documents): every window, training and held out, reads without error and the training
//! windows of the whole corpus are the stream's tokens. Opening and reading everything may allocate
//! at most `8 x (idx + bin bytes) + 1 MiB` (a counting global allocator checks every input),
//! whatever the counts in the header claim.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use disagmoe_fuzz::{peak_during, work_dir, Counting};
use disagmoe_train::data::indexed::IndexedDataset;
use disagmoe_train::data::{ByteTokenizer, PackedDataset, Packing};
use libfuzzer_sys::fuzz_target;

#[global_allocator]
static ALLOC: Counting = Counting;

/// The `.bin`: every byte below 0x80, so that tokens of every dtype are ids (not negative).
const BIN_LEN: usize = 256;
fn bin() -> [u8; BIN_LEN] {
    std::array::from_fn(|i| ((i * 37 + 11) % 128) as u8)
}

/// Token `i` of the `.bin` read as `size`-byte little-endian integers.
fn token(bin: &[u8], size: usize, i: usize) -> i64 {
    let mut w = [0u8; 8];
    w[..size].copy_from_slice(&bin[i * size..(i + 1) * size]);
    i64::from_le_bytes(w)
}

/// The pair's prefix, in a directory of this process.
fn prefix() -> &'static PathBuf {
    static PREFIX: OnceLock<PathBuf> = OnceLock::new();
    PREFIX.get_or_init(|| {
        let dir = work_dir("idx");
        std::fs::write(dir.join("d.bin"), bin()).unwrap();
        dir.join("d")
    })
}

fn check(data: &[u8]) {
    let prefix = prefix();
    let idx = prefix.with_extension("idx");
    std::fs::write(&idx, data).unwrap();
    let bin = bin();
    let Ok(ds) = IndexedDataset::open(prefix) else { return };
    let size = ds.dtype().size();
    let tokens = ds.tokens();
    assert!(tokens * size <= BIN_LEN, "{tokens} tokens of {size} bytes in a .bin of {BIN_LEN}");
    let starts = ds.doc_starts();
    assert_eq!(starts.len(), ds.documents() + 1);
    assert!(starts.windows(2).all(|w| w[0] <= w[1]), "documents in order: {starts:?}");
    assert!(starts.last().is_some_and(|&s| s as usize <= tokens));
    for d in starts.windows(2) {
        let (a, b) = (d[0] as usize, d[1] as usize);
        let mut out = Vec::new();
        ds.read_into(a..b, &mut out).expect("a document the index describes reads");
        assert!(out.iter().copied().eq((a..b).map(|i| token(&bin, size, i))), "document {a}..{b}");
    }
    let mut all = Vec::new();
    ds.read_into(0..tokens, &mut all).expect("every token reads");
    assert!(all.iter().copied().eq((0..tokens).map(|i| token(&bin, size, i))));

    // The pair as a run's data: windows of 2..=9 tokens, a quarter of its documents held out.
    let seq = 2 + data.len() % 8;
    let packing = Packing { seq, seed: data.len() as u64, model_vocab: usize::MAX, min_windows: 1 };
    let Ok(packed) = PackedDataset::open(Some(&idx), None, &ByteTokenizer, packing) else { return };
    let windows = packed.all_windows();
    assert_eq!(windows, tokens / seq);
    let rows = packed.window_rows(0..windows).expect("every window reads");
    assert!(rows.concat().iter().eq(all[..windows * seq].iter()), "windows are the stream");
    let Ok(mut packed) = packed.hold_out(0.25) else { return };
    let eval = packed.eval_rows(usize::MAX).expect("every held-out window reads");
    assert_eq!(eval.len(), packed.eval_windows());
    let train = packed.next_batch(packed.windows()).expect("every training window reads");
    assert!(eval.iter().chain(&train).all(|r| r.len() == seq));
}

fuzz_target!(|data: &[u8]| {
    let ((), took) = peak_during(|| check(data));
    let bound = 8 * (data.len() + BIN_LEN) + (1 << 20);
    assert!(took <= bound, "an index of {} bytes took {took} bytes (bound {bound})", data.len());
});
