//! Any bytes as a Parquet input of `disagmoe tokenize` (`data::tokenize::tokenize`, byte-level
//! tokenizer, column `text`, shards of 1 to 64 tokens so that inputs span several): a report or an
//! error, never a panic, and a failed run leaves nothing behind. A run that succeeds writes a token
//! directory that opens (`Tokens::open_tokenized`) with the documents and tokens it reports, each
//! document a non-empty UTF-8 text followed by the end-of-document id (no input can make a
//! document of anything but text).
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use disagmoe_train::data::tokenize::{tokenize, TokenizeOptions, BYTE_EOS};
use disagmoe_train::data::Tokens;
use libfuzzer_sys::fuzz_target;

/// The working directory of this process (tokenize's threads: one).
fn dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        std::env::set_var("RAYON_NUM_THREADS", "1");
        let dir = std::env::temp_dir().join(format!("disagmoe-fuzz-parquet-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    })
}

fuzz_target!(|data: &[u8]| {
    let dir = dir();
    let (input, out) = (dir.join("in.parquet"), dir.join("out"));
    let partial = dir.join("out.partial");
    std::fs::write(&input, data).unwrap();
    let opts = TokenizeOptions {
        inputs: vec![input],
        out: out.clone(),
        tokenizer: None,
        text_field: "text".into(),
        eos: None,
        shard_tokens: 1 + (data.len() % 64) as u64,
        progress: false,
    };
    let report = tokenize(&opts);
    assert!(!partial.exists(), "no partial directory is left");
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
