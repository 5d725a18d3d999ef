//! Any bytes as a Parquet input of `disagmoe tokenize` (`data::tokenize::tokenize`, byte-level
//! tokenizer, column `text`, shards of 1 to 64 tokens so that inputs span several): a report or an
//! error, never a panic, and a failed run leaves nothing behind. A run that succeeds writes a token
//! directory that opens (`Tokens::open_tokenized`) with the documents and tokens it reports, each
//! document a non-empty UTF-8 text followed by the end-of-document id (no input can make a
//! document of anything but text).
//!
//! The parquet crate panics on some damaged files; `tokenize` catches such a panic around its calls
//! into the crate (swapping the panic hook, libfuzzer-sys's aborting one here, for a silent one
//! meanwhile) and fails with its message. Any other panic aborts as usual.
#![no_main]

use disagmoe_fuzz::tokenize_bytes;
use disagmoe_train::data::tokenize::BYTE_EOS;
use disagmoe_train::data::Tokens;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (report, out) = tokenize_bytes(data, "parquet");
    let Ok(report) = report else { return };
    let (tokens, manifest) = Tokens::open_tokenized(&out).expect("the written directory opens");
    assert!(report.documents >= 1);
    assert_eq!((manifest.documents, manifest.tokens, tokens.len()), (report.documents, report.tokens, report.tokens));
    let mut read = Vec::new();
    tokens.read_into(0..tokens.len(), &mut read).expect("the shards read");
    let starts = tokens.doc_starts().expect("shards have documents");
    assert_eq!(starts.len() as u64, report.documents + 1);
    assert_eq!(starts.last().copied(), Some(read.len() as u64));
    for d in starts.windows(2) {
        let doc = &read[d[0] as usize..d[1] as usize];
        let (eos, text) = doc.split_last().expect("a document has its end");
        assert_eq!(*eos, i64::from(BYTE_EOS));
        assert!(!text.is_empty(), "empty documents are skipped");
        let bytes: Vec<u8> = text.iter().map(|&t| u8::try_from(t).expect("a byte")).collect();
        assert!(std::str::from_utf8(&bytes).is_ok(), "a document is text");
    }
    std::fs::remove_dir_all(&out).unwrap();
});
