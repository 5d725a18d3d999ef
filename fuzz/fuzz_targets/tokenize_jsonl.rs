//! Any bytes as a JSON-lines input of `disagmoe tokenize` (`data::tokenize::tokenize`, byte-level
//! tokenizer, text field `text`, shards of 1 to 64 tokens so that inputs span several): a report
//! or an error, never a panic, and a failed run leaves nothing behind. It succeeds exactly when
//! every line is blank or a JSON object whose `text` is a string or null and some document is not
//! empty; the token directory it writes then opens (`Tokens::open_tokenized`) and holds each
//! non-empty document's UTF-8 bytes followed by the end-of-document id, in input order, one
//! document per sequence.
#![no_main]

use disagmoe_fuzz::tokenize_bytes;
use disagmoe_train::data::tokenize::BYTE_EOS;
use disagmoe_train::data::Tokens;
use libfuzzer_sys::fuzz_target;

/// The documents of a JSON-lines text, as the module docs define them (`None`: refused).
fn documents(data: &[u8]) -> Option<Vec<String>> {
    let mut docs = Vec::new();
    for line in data.split_inclusive(|&b| b == b'\n') {
        let text = std::str::from_utf8(line).ok()?;
        if text.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value = serde_json::from_str(text).ok()?;
        match value.as_object()?.get("text")? {
            serde_json::Value::String(s) if !s.is_empty() => docs.push(s.clone()),
            serde_json::Value::String(_) | serde_json::Value::Null => {}
            _ => return None,
        }
    }
    Some(docs)
}

fuzz_target!(|data: &[u8]| {
    let (report, out) = tokenize_bytes(data, "jsonl");
    let want = documents(data).filter(|d| !d.is_empty());
    let Ok(report) = report else {
        assert!(want.is_none(), "{want:?} refused: {}", report.err().unwrap());
        return;
    };
    let want = want.expect("tokenize succeeds only on documents");
    let (tokens, manifest) = Tokens::open_tokenized(&out).expect("the written directory opens");
    let stream: Vec<i64> = want.iter().flat_map(|d| d.bytes().map(i64::from).chain([i64::from(BYTE_EOS)])).collect();
    assert_eq!((report.documents, report.tokens), (want.len() as u64, stream.len() as u64));
    assert_eq!((manifest.documents, manifest.tokens, tokens.len()), (report.documents, report.tokens, report.tokens));
    let mut read = Vec::new();
    tokens.read_into(0..tokens.len(), &mut read).expect("the shards read");
    assert!(read == stream, "the shards hold the documents");
    let mut ends: Vec<u64> = want
        .iter()
        .scan(0, |at, d| {
            *at += d.len() as u64 + 1;
            Some(*at)
        })
        .collect();
    ends.insert(0, 0);
    assert_eq!(tokens.doc_starts().expect("shards have documents"), ends);
    std::fs::remove_dir_all(&out).unwrap();
});
