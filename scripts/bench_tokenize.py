#!/usr/bin/env python3
"""`disagmoe tokenize` beside Hugging Face `tokenizers` in Python, same files, same tokenizer.

    python3 scripts/bench_tokenize.py --disagmoe target/release/disagmoe [--docs 200000] [--rounds 3]

Makes (in --work, default /tmp/bench-tokenize) a byte-level BPE tokenizer.json of 16,384 ids
trained on the bundled corpus (GPT-2 style: ByteLevel pre-tokenizer, `<|endoftext|>` as end of
document) and a JSONL corpus of --docs documents (1 to 8 random lines of the bundled corpus each,
seeded). Then, in alternating rounds:
  - `disagmoe tokenize --input corpus.jsonl --tokenizer tokenizer.json` (read, parse, tokenize in
    parallel, write shards);
  - Python end to end: read and parse the JSONL, `Tokenizer.encode_batch` per 10,000 documents
    (Rust threads, all cores), append the end of document, write the ids as uint16;
  - Python `encode_batch` alone on the texts already in memory.
Prints the medians (and the range) in tokens/s and input MB/s as a Markdown table, and checks
that both sides produced the same ids. Needs `tokenizers` and `numpy` (pip install tokenizers
numpy).
"""

import argparse
import json
import os
import pathlib
import random
import statistics
import subprocess
import time

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = pathlib.Path(__file__).resolve().parent.parent
CORPUS = ROOT / "disagmoe-train" / "data" / "kjv-genesis-leviticus.txt"
EOS = "<|endoftext|>"


def make_inputs(work, docs):
    tok_path, jsonl = work / "tokenizer.json", work / "corpus.jsonl"
    if not tok_path.exists():
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=16384, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
        tok.train([str(CORPUS)], trainer)
        tok.save(str(tok_path))
    if not jsonl.exists():
        lines = [l for l in CORPUS.read_text(encoding="utf-8").splitlines() if l.strip()]
        rng = random.Random(0)
        with open(jsonl, "w", encoding="utf-8") as f:
            for i in range(docs):
                text = "\n".join(rng.choice(lines) for _ in range(rng.randint(1, 8)))
                f.write(json.dumps({"id": i, "text": text}) + "\n")
    return tok_path, jsonl


def python_end_to_end(tok, eos, jsonl, out):
    start = time.perf_counter()
    with open(jsonl, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    ids = []
    for i in range(0, len(texts), 10_000):
        for enc in tok.encode_batch(texts[i : i + 10_000], add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(eos)
    np.asarray(ids, dtype=np.uint16).tofile(out)
    return time.perf_counter() - start, len(ids)


def python_encode_only(tok, texts):
    start = time.perf_counter()
    n = 0
    for i in range(0, len(texts), 10_000):
        n += sum(len(e.ids) + 1 for e in tok.encode_batch(texts[i : i + 10_000], add_special_tokens=False))
    return time.perf_counter() - start, n


def ours(binary, tok_path, jsonl, out):
    subprocess.run(["rm", "-rf", str(out)], check=True)
    start = time.perf_counter()
    r = subprocess.run(
        [binary, "tokenize", "--quiet", "--input", str(jsonl), "--tokenizer", str(tok_path), "--out", str(out)],
        check=True,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    return wall, json.loads(r.stdout.strip().splitlines()[-1])["tokens"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--disagmoe", required=True, help="the disagmoe binary (a release build)")
    ap.add_argument("--docs", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=pathlib.Path, default=pathlib.Path("/tmp/bench-tokenize"))
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    tok_path, jsonl = make_inputs(args.work, args.docs)
    tok = Tokenizer.from_file(str(tok_path))
    eos = tok.token_to_id(EOS)
    mb = jsonl.stat().st_size / 1e6
    with open(jsonl, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    times = {"disagmoe tokenize (end to end)": [], "Python tokenizers, end to end": [], "Python tokenizers, encode_batch only": []}
    tokens = {}
    for _ in range(args.rounds):
        t, n = ours(args.disagmoe, tok_path, jsonl, args.work / "ours")
        times["disagmoe tokenize (end to end)"].append(t)
        tokens["ours"] = n
        t, n = python_end_to_end(tok, eos, jsonl, args.work / "python.bin")
        times["Python tokenizers, end to end"].append(t)
        tokens["python"] = n
        t, _ = python_encode_only(tok, texts)
        times["Python tokenizers, encode_batch only"].append(t)
    ours_ids = np.fromfile(args.work / "ours" / "shard-00000.bin", dtype=np.uint16)
    same = np.array_equal(ours_ids, np.fromfile(args.work / "python.bin", dtype=np.uint16))
    print(f"{args.docs} documents, {mb:.1f} MB of JSONL, {tokens['ours']} tokens; {os.cpu_count()} cores; "
          f"same ids on both sides: {same}")
    print("| tokenizer run | tokens/s (median) | MB/s | time, s: median [min, max] |")
    print("|---|---|---|---|")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"| {name} | {tokens['ours'] / m / 1e6:.2f} M | {mb / m:.1f} | {m:.2f} [{min(ts):.2f}, {max(ts):.2f}] |")
    if not same:
        raise SystemExit("the two sides produced different ids")


if __name__ == "__main__":
    main()
