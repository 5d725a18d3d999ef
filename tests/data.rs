//! Data at scale through the `disagmoe` command: `tokenize` (text, JSONL, Parquet) into token
//! shards, training from them and from Megatron `.bin`/`.idx` pairs, and clear errors on bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;

use disagmoe::train::data::indexed::{IndexedWriter, TokenDtype};
use disagmoe::train::data::{ByteTokenizer, HfTokenizer, PackedDataset, Packing, Tokenizer, Tokens};
use disagmoe::train::DocumentMask;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_disagmoe"))
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn json(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "exit {:?}: {}", out.status, String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.lines().last().expect("a JSON line")).unwrap()
}

/// The error line of a failed command (exit 2, no panic).
fn error(out: &Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(2), "a clear error, not a crash: {err}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

fn tokenize(inputs: &[&Path], out: &Path, extra: &[&str]) -> Output {
    let mut c = bin();
    c.args(["tokenize", "--quiet", "--input"]).args(inputs).arg("--out").arg(out).args(extra);
    c.output().unwrap()
}

/// A Parquet file with a `text` column (`None`: null) and an `id` column, pages compressed with
/// `codec`.
fn write_parquet(path: &Path, rows: &[Option<&str>], codec: parquet::basic::Compression) {
    use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    let schema = Arc::new(
        parquet::schema::parser::parse_message_type(
            "message doc { REQUIRED INT64 id; OPTIONAL BYTE_ARRAY text (UTF8); }",
        )
        .unwrap(),
    );
    let props = Arc::new(WriterProperties::builder().set_compression(codec).build());
    let mut w = SerializedFileWriter::new(std::fs::File::create(path).unwrap(), schema, props).unwrap();
    let mut group = w.next_row_group().unwrap();
    let ids: Vec<i64> = (0..rows.len() as i64).collect();
    let mut col = group.next_column().unwrap().unwrap();
    col.typed::<Int64Type>().write_batch(&ids, None, None).unwrap();
    col.close().unwrap();
    let values: Vec<ByteArray> = rows.iter().flatten().map(|s| ByteArray::from(*s)).collect();
    let defs: Vec<i16> = rows.iter().map(|r| i16::from(r.is_some())).collect();
    let mut col = group.next_column().unwrap().unwrap();
    col.typed::<ByteArrayType>().write_batch(&values, Some(&defs), None).unwrap();
    col.close().unwrap();
    group.close().unwrap();
    w.close().unwrap();
}

/// Every document of a token directory, in order.
fn documents(dir: &Path) -> Vec<Vec<i64>> {
    let (tokens, _) = Tokens::open_tokenized(dir).unwrap();
    let starts = tokens.doc_starts().unwrap();
    starts
        .windows(2)
        .map(|w| {
            let mut out = Vec::new();
            tokens.read_into(w[0]..w[1], &mut out).unwrap();
            out
        })
        .collect()
}

fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| (p.file_name().unwrap().to_string_lossy().to_string(), std::fs::read(&p).unwrap()))
        .collect();
    v.sort();
    v
}

#[test]
fn tokenize_reads_text_jsonl_and_parquet_into_shards_that_decode_to_the_documents() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("in");
    std::fs::create_dir_all(input.join("a")).unwrap();
    std::fs::write(input.join("a/one.txt"), "First document.\nIt has two lines.").unwrap();
    std::fs::write(input.join(".hidden.txt"), "never read").unwrap();
    let jsonl = [
        r#"{"text": "héllo — ✓ unicode", "id": 1}"#,
        "",
        r#"{"text": "", "id": 2}"#,
        r#"{"text": "third \"quoted\" line\nwith a newline", "id": 3}"#,
    ];
    std::fs::write(input.join("b.jsonl"), jsonl.join("\n")).unwrap();
    // Snappy, as Hugging Face datasets are published.
    let rows = [Some("a Parquet row"), None, Some("the last row, longer than the others")];
    write_parquet(&input.join("c.parquet"), &rows, parquet::basic::Compression::SNAPPY);
    let want: Vec<&str> = vec![
        "First document.\nIt has two lines.",
        "héllo — ✓ unicode",
        "third \"quoted\" line\nwith a newline",
        "a Parquet row",
        "the last row, longer than the others",
    ];
    // Bytes, small shards (several documents per shard, several shards).
    let (one, two) = (tmp.path().join("one"), tmp.path().join("two"));
    let report = json(&tokenize(&[&input], &one, &["--shard-tokens", "40"]));
    assert_eq!((report["files"].as_u64(), report["documents"].as_u64()), (Some(3), Some(5)), "{report}");
    assert!(report["shards"].as_u64().unwrap() >= 3, "{report}");
    // Per input: the one directory gave everything.
    let per = &report["per_input"];
    assert_eq!((per[0]["files"].as_u64(), per[0]["documents"].as_u64()), (Some(3), Some(5)), "{report}");
    assert_eq!(per[0]["tokens"], report["tokens"]);
    // Inputs given one by one are reported one by one (the JSONL file has two non-empty documents).
    let four = tmp.path().join("four");
    let inputs = [input.join("a"), input.join("b.jsonl"), input.join("c.parquet")];
    let report = json(&tokenize(&inputs.iter().map(PathBuf::as_path).collect::<Vec<_>>(), &four, &[]));
    let docs: Vec<u64> = (0..3).map(|i| report["per_input"][i]["documents"].as_u64().unwrap()).collect();
    assert_eq!(docs, [1, 2, 2], "{report}");
    let tokens: u64 = (0..3).map(|i| report["per_input"][i]["tokens"].as_u64().unwrap()).sum();
    assert_eq!(Some(tokens), report["tokens"].as_u64());
    let docs = documents(&one);
    assert_eq!(docs.len(), want.len());
    for (got, text) in docs.iter().zip(&want) {
        let ids: Vec<u32> = got.iter().map(|&t| t as u32).collect();
        assert_eq!(ids.last(), Some(&0), "each document ends with the byte-level end-of-document id 0");
        assert_eq!(ByteTokenizer.decode(&ids[..ids.len() - 1]).unwrap(), *text);
    }
    // Deterministic: the same inputs give byte-identical output.
    json(&tokenize(&[&input], &two, &["--shard-tokens", "40"]));
    assert_eq!(files(&one), files(&two));
    // A tokenizer.json: the ids are its encoding of each document, then the named end of document.
    let hf_path = root().join("fixtures/tokenizer/tokenizer.json");
    let hf = HfTokenizer::from_file(&hf_path).unwrap();
    let three = tmp.path().join("three");
    let report = json(&tokenize(&[&input], &three, &["--tokenizer", hf_path.to_str().unwrap(), "--eos", "3"]));
    assert_eq!((report["eos_id"].as_u64(), report["dtype"].as_str()), (Some(3), Some("uint16")));
    for (got, text) in documents(&three).iter().zip(&want) {
        let mut ids: Vec<i64> = hf.encode(text).unwrap().iter().map(|&t| t as i64).collect();
        ids.push(3);
        assert_eq!(got, &ids);
    }
    // A model whose vocabulary is smaller than the ids in the data is refused at start-up.
    let out = bin().args(["train", "--steps", "1", "--quiet", "--data"]).arg(&three).output().unwrap();
    assert!(error(&out).contains("outside the model's vocabulary 0..256"), "{}", error(&out));
    // ... and training with another tokenizer than the data's is refused.
    let out = bin()
        .args(["train", "--steps", "1", "--quiet", "--tokenizer", hf_path.to_str().unwrap(), "--data"])
        .arg(&one)
        .output()
        .unwrap();
    assert!(error(&out).contains("not the run's tokenizer"), "{}", error(&out));
}

#[test]
fn bad_inputs_are_refused_naming_the_file_and_line() {
    let tmp = tempfile::tempdir().unwrap();
    let case = |name: &str, bytes: &[u8], extra: &[&str], want: &[&str]| {
        let path = tmp.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        let out = tokenize(&[&path], &tmp.path().join(format!("{name}.out")), extra);
        let err = error(&out);
        for w in want {
            assert!(err.contains(w), "{name}: wanted {w:?} in {err}");
        }
        assert!(!tmp.path().join(format!("{name}.out")).exists(), "nothing written on error");
        assert!(!tmp.path().join(format!("{name}.out.partial")).exists(), "nothing left behind");
    };
    case("utf8.jsonl", b"{\"text\": \"ok\"}\n{\"text\": \"bad \xff byte\"}\n", &[], &["utf8.jsonl", "line 2", "UTF-8"]);
    case(
        "field.jsonl",
        b"{\"body\": \"x\"}\n",
        &[],
        &["field.jsonl", "line 1", "no string field `text`", "body", "--text-field"],
    );
    case("notjson.jsonl", b"{\"text\": \"x\"}\nnot json\n", &[], &["notjson.jsonl", "line 2 is not JSON"]);
    case("broken.parquet", b"PAR1 this is not really parquet", &[], &["broken.parquet", "not a readable Parquet file"]);
    case("bad.txt", b"abc \xc3\x28 def", &[], &["bad.txt", "not valid UTF-8", "offset 4"]);
    case("eos.txt", b"fine", &["--eos", "300"], &["eos", "outside the tokenizer's ids 0..256"]);
    // A Parquet file without the column.
    let path = tmp.path().join("cols.parquet");
    write_parquet(&path, &[Some("x")], parquet::basic::Compression::ZSTD(Default::default()));
    let err = error(&tokenize(&[&path], &tmp.path().join("cols.out"), &["--text-field", "body"]));
    assert!(err.contains("has no column `body` (its columns: id, text)"), "{err}");
    // An existing output directory is never overwritten.
    let taken = tmp.path().join("taken");
    std::fs::create_dir(&taken).unwrap();
    std::fs::write(taken.join("keep.txt"), "mine").unwrap();
    let err = error(&tokenize(&[&path], &taken, &[]));
    assert!(err.contains("exists"), "{err}");
    assert_eq!(std::fs::read_to_string(taken.join("keep.txt")).unwrap(), "mine");
    // Missing inputs.
    let err = error(&tokenize(&[&tmp.path().join("nope.txt")], &tmp.path().join("nope.out"), &[]));
    assert!(err.contains("nope.txt") && err.contains("does not exist"), "{err}");
    // Training on a directory that is not token data, or on a Megatron index without its tokens.
    let train = |data: &Path| bin().args(["train", "--steps", "1", "--quiet", "--data"]).arg(data).output().unwrap();
    let err = error(&train(&taken));
    assert!(err.contains("dataset.json") && err.contains("disagmoe tokenize"), "{err}");
    let lone = tmp.path().join("lone");
    std::fs::copy(root().join("fixtures/megatron/docs_text_document.idx"), lone.with_extension("idx")).unwrap();
    let err = error(&train(&lone));
    assert!(err.contains("lone.bin"), "{err}");
}

/// The committed Megatron pair (written by `scripts/make_megatron_fixture.py` from Megatron's
/// documented format) and its documents.
fn megatron_fixture() -> (PathBuf, PathBuf) {
    (root().join("fixtures/megatron/docs_text_document"), root().join("fixtures/megatron/docs.jsonl"))
}

#[test]
fn a_megatron_pair_gives_the_windows_of_our_own_shards_of_the_same_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    let (pair, docs) = megatron_fixture();
    let ours = tmp.path().join("ours");
    json(&tokenize(&[&docs], &ours, &["--shard-tokens", "5000"]));
    let open = |p: &Path| {
        PackedDataset::open(
            Some(p),
            None,
            &ByteTokenizer,
            Packing { seq: 32, seed: 11, model_vocab: 256, min_windows: 4 },
        )
        .unwrap()
        .hold_out(0.1)
        .unwrap()
        .with_document_mask(DocumentMask::On)
        .unwrap()
    };
    for megatron in [pair.clone(), pair.with_extension("idx"), pair.with_extension("bin")] {
        let (mut a, mut b) = (open(&megatron), open(&ours));
        assert_eq!((a.windows(), a.eval_windows()), (b.windows(), b.eval_windows()));
        assert!(a.eval_windows() > 0 && a.windows() > 100);
        assert_eq!(a.eval_rows(usize::MAX).unwrap(), b.eval_rows(usize::MAX).unwrap());
        assert_eq!(a.window_rows(0..a.all_windows()).unwrap(), b.window_rows(0..b.all_windows()).unwrap());
        // The same documents too (our shards end where documents do).
        let mut cuts = 0;
        for _ in 0..100 {
            let (x, y) = (a.next_windows(4), b.next_windows(4));
            assert_eq!(x.rows(0..4).unwrap(), y.rows(0..4).unwrap());
            let (dx, dy) = (x.documents(0..4).unwrap().unwrap(), y.documents(0..4).unwrap().unwrap());
            assert_eq!(dx, dy);
            cuts += (0..4).map(|r| dx.cuts(r).len()).sum::<usize>();
        }
        assert!(cuts > 0, "some windows hold two documents");
    }
    // Training on either gives the same run.
    let run = |data: &Path| {
        json(
            &bin()
                .args(["train", "--steps", "3", "--batch", "4", "--seq", "32", "--quiet", "--data"])
                .arg(data)
                .output()
                .unwrap(),
        )
    };
    let (a, b) = (run(&pair), run(&ours));
    assert_eq!(a["losses"], b["losses"]);
    // Held-out data is taken by documents: no held-out window shares a document with training.
    let ds = open(&ours);
    let (tokens, _) = Tokens::open_tokenized(&ours).unwrap();
    let doc_count = tokens.doc_starts().unwrap().len() - 1;
    assert_eq!(doc_count, 48);
    assert!(ds.eval_windows() * 32 <= tokens.len() as usize / 5, "about a tenth of the documents held out");
}

#[test]
fn ids_beyond_the_vocabulary_in_megatron_data_are_named_when_read() {
    let tmp = tempfile::tempdir().unwrap();
    let prefix = tmp.path().join("big");
    let mut w = IndexedWriter::create(&prefix, TokenDtype::U16).unwrap();
    for d in 0..40u32 {
        let doc: Vec<u32> = (0..50).map(|i| if d == 30 && i == 7 { 60_000 } else { (d + i) % 200 }).collect();
        w.push(&doc).unwrap();
    }
    w.finish().unwrap();
    let out = bin()
        .args(["train", "--steps", "200", "--batch", "4", "--seq", "32", "--quiet", "--eval-fraction", "0", "--data"])
        .arg(&prefix)
        .output()
        .unwrap();
    let err = error(&out);
    assert!(err.contains("big.bin") && err.contains("token 1507 is id 60000") && err.contains("0..256"), "{err}");
}

/// The steps of `dir/metrics.jsonl`.
fn metric_records(dir: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// Three sources of different text, each tokenized apart; trained on as a blend `0.6 / 0.3 /
/// 0.1`: each step's tokens come from the sources the blend's order says, each source is
/// evaluated on its own held-out windows (the reported loss is their weighted mean), a resume
/// from a checkpoint in the middle reads the windows the straight run read (same losses, bit for
/// bit), and bad blends are refused in one line.
#[test]
fn a_blend_trains_on_its_sources_by_weight_evaluates_each_and_resumes_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = std::fs::read_to_string(root().join("disagmoe-train/data/kjv-genesis-leviticus.txt")).unwrap();
    let chunks: Vec<&str> = corpus.lines().filter(|p| !p.trim().is_empty()).collect();
    let mut dirs = Vec::new();
    for (d, name) in ["web", "code", "math"].iter().enumerate() {
        // Each source: its own documents (every third line of the corpus, from a different one).
        let input = tmp.path().join(format!("{name}.jsonl"));
        let lines: Vec<String> = (chunks.iter().skip(d).step_by(3).take(150))
            .map(|p| serde_json::json!({ "text": format!("{name}: {p}") }).to_string())
            .collect();
        std::fs::write(&input, lines.join("\n")).unwrap();
        let out = tmp.path().join(name);
        let report = json(&tokenize(&[&input], &out, &[]));
        let per = &report["per_input"][0];
        assert_eq!((per["documents"].as_u64(), per["tokens"].as_u64()), (Some(150), report["tokens"].as_u64()));
        dirs.push(out);
    }
    let blend: Vec<String> =
        ["0.6", "0.3", "0.1"].iter().zip(&dirs).flat_map(|(w, d)| [w.to_string(), d.display().to_string()]).collect();
    let common =
        ["--steps", "8", "--batch", "4", "--seq", "32", "--quiet", "--eval-every", "4", "--eval-batches", "1000"];
    let train = |out: &Path, extra: &[&str]| {
        let mut c = bin();
        c.arg("train").args(common).arg("--out").arg(out).args(extra).arg("--data").args(&blend);
        json(&c.output().unwrap())
    };
    let straight = tmp.path().join("straight");
    let summary = train(&straight, &[]);
    let records = metric_records(&straight);
    assert_eq!(records.len(), 8);
    let labels: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
    let mut total = [0u64; 3];
    for r in &records {
        let per = r["tokens_per_source"].as_object().unwrap();
        let counts: Vec<u64> = labels.iter().map(|l| per.get(l).map_or(0, |v| v.as_u64().unwrap())).collect();
        assert_eq!(counts.iter().sum::<u64>(), 4 * 32, "{r}");
        for (t, c) in total.iter_mut().zip(&counts) {
            *t += c;
        }
        let evaluated = r.get("eval_loss").is_some();
        assert_eq!(evaluated, r["step"] == 4 || r["step"] == 8, "{r}");
        if evaluated {
            let per = r["eval_loss_per_source"].as_object().unwrap();
            let losses: Vec<f64> = labels.iter().map(|l| per[l].as_f64().unwrap()).collect();
            let mean = 0.6 * losses[0] + 0.3 * losses[1] + 0.1 * losses[2];
            assert!((r["eval_loss"].as_f64().unwrap() - mean).abs() < 1e-9, "{r}");
        }
    }
    // `disagmoe eval` of the final model on the blend: each source's held-out windows, the same
    // losses as the last step's evaluation.
    let mut c = bin();
    c.args(["eval", "--seq", "32", "--batch", "4", "--model-dir"])
        .arg(straight.join("final"))
        .arg("--data")
        .args(&blend);
    let eval = json(&c.output().unwrap());
    let last = &records[7];
    assert!((eval["loss"].as_f64().unwrap() - last["eval_loss"].as_f64().unwrap()).abs() < 1e-9, "{eval} vs {last}");
    for l in &labels {
        let (a, b) = (eval["per_source"][l].as_f64().unwrap(), last["eval_loss_per_source"][l].as_f64().unwrap());
        assert!((a - b).abs() < 1e-9, "{l}: {a} vs {b}");
    }
    // 32 windows dealt by the blend's order: 19 / 10 / 3 (the first 32 of a block of 600/300/100).
    assert_eq!(total.map(|t| t / 32), [19, 10, 3]);
    // Stop after 6 with checkpoints every 3; lose the checkpoint of step 6; resume from step 3.
    let ck = tmp.path().join("ck");
    let out = tmp.path().join("out");
    let ck_args = ["--checkpoint-every", "3", "--checkpoint-dir", ck.to_str().unwrap()];
    let first = train(&out, &[&["--stop-after", "6"][..], &ck_args].concat());
    assert_eq!(first["steps"], 6);
    std::fs::remove_dir_all(ck.join("step-00000006")).unwrap();
    let resumed = train(&out, &["--resume", ck.to_str().unwrap()]);
    assert_eq!(resumed["resumed_from_step"], 3);
    assert_eq!(resumed["losses"], summary["losses"], "the windows of an uninterrupted run");
    assert_eq!(resumed["eval_loss"], summary["eval_loss"]);
    let again = metric_records(&out);
    assert_eq!(
        again.iter().map(|r| r["tokens_per_source"].clone()).collect::<Vec<_>>(),
        records.iter().map(|r| r["tokens_per_source"].clone()).collect::<Vec<_>>()
    );
    // Bad blends: one line each, naming the problem.
    let web = dirs[0].to_str().unwrap();
    let hf = tmp.path().join("web-hf");
    let tokenizer = root().join("fixtures/tokenizer/tokenizer.json");
    json(&tokenize(&[&tmp.path().join("web.jsonl")], &hf, &["--tokenizer", tokenizer.to_str().unwrap(), "--eos", "3"]));
    for (data, want) in [
        (vec!["0.5", web, "-0.5", web], "must be finite and at least 0"),
        (vec!["0", web, "0", web], "sum to 0"),
        (vec!["0.5", web, "0.5", "/no/such/source"], "/no/such/source does not exist"),
        (vec!["0.5", web, "0.5"], "not pairs"),
        (vec!["0.5", web, "0.5", web], "given twice"),
        (vec!["0.5", web, "0.5", hf.to_str().unwrap()], "a blend's sources must share one"),
    ] {
        let out = bin().args(["train", "--steps", "1", "--quiet", "--data"]).args(&data).output().unwrap();
        let err = error(&out);
        assert!(err.contains(want) && err.trim().lines().count() == 1, "{data:?}: {err}");
    }
}
