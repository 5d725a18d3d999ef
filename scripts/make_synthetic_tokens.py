#!/usr/bin/env python3
"""Writes a synthetic token directory in the format `disagmoe tokenize` writes (dataset.json and one
Megatron .bin/.idx shard, see disagmoe-train/src/data/indexed.rs), for measuring training on a
corpus far larger than memory:

    python3 scripts/make_synthetic_tokens.py --tokens 1000000000 --out /tmp/tokens-1e9
    disagmoe train --data /tmp/tokens-1e9 ...

Documents of 1 to 2,000 tokens (uniform), ids uniform in 1..=255 (the byte-level ids of the tiny
presets), each document followed by the end-of-document id 0. Needs numpy.
"""

import argparse
import json
import pathlib

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1_000_000_000, help="tokens to write (at least)")
    ap.add_argument("--out", type=pathlib.Path, required=True, help="directory to create")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    args.out.mkdir(parents=True)
    lengths = []
    total = 0
    chunk = 1 << 24
    with open(args.out / "shard-00000.bin", "wb") as f:
        while total < args.tokens:
            # Documents of this chunk (their lengths include the end-of-document id).
            n = rng.integers(2, 2002, size=chunk // 1000)
            n = n[: np.searchsorted(np.cumsum(n), args.tokens - total, side="right") + 1]
            ids = rng.integers(1, 256, size=int(n.sum()), dtype=np.uint16)
            ids[np.cumsum(n) - 1] = 0
            f.write(ids.tobytes())
            lengths.extend(n.tolist())
            total += int(n.sum())
    lengths = np.asarray(lengths, dtype=np.int32)
    docs = len(lengths)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64) * 2]).astype(np.int64)
    with open(args.out / "shard-00000.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(np.uint64(1).tobytes())
        f.write(np.uint8(8).tobytes())
        f.write(np.uint64(docs).tobytes())
        f.write(np.uint64(docs + 1).tobytes())
        f.write(lengths.tobytes())
        f.write(pointers.tobytes())
        f.write(np.arange(docs + 1, dtype=np.int64).tobytes())
    manifest = {
        "format": "disagmoe-tokens",
        "version": 1,
        "dtype": "uint16",
        "tokens": total,
        "documents": docs,
        "max_id": 255,
        "eos_id": 0,
        "tokenizer": "byte-level (256 ids)",
        "tokenizer_sha256": None,
        "vocab_size": 256,
        "shards": [{"prefix": "shard-00000", "tokens": total, "documents": docs}],
    }
    (args.out / "dataset.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"wrote {total} tokens in {docs} documents to {args.out}")


if __name__ == "__main__":
    main()
