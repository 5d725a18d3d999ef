#!/usr/bin/env python3
"""Writes fixtures/megatron/: documents (docs.jsonl) and the same documents as a Megatron-LM
indexed dataset (docs_text_document.bin/.idx), written here from Megatron's documented format, not
by disagmoe, so that tests can check our reader against an independent writer and our own
`disagmoe tokenize` shards of the same documents against it.

Tokens: byte-level (each UTF-8 byte one id) with end-of-document id 0 after every document, as
`disagmoe tokenize` does without a tokenizer.json (Megatron's `preprocess_data.py --append-eod`
with a byte tokenizer would write the same).

Format (megatron/core/datasets/indexed_dataset.py, `_IndexWriter`; all little-endian):
  .idx: b"MMIDIDX\\x00\\x00", version u64 = 1, dtype code u8 (8 = uint16), sequence count u64,
        document count u64 (= documents + 1), sequence lengths int32[S], sequence pointers
        int64[S] (byte offsets into .bin), document indices int64[D] (0, then the running count
        of sequences at each document's end)
  .bin: the tokens, back to back.

Needs only the Python standard library:  python3 scripts/make_megatron_fixture.py
"""

import json
import pathlib
import struct

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "fixtures" / "megatron"
CORPUS = ROOT / "disagmoe-train" / "data" / "kjv-genesis-leviticus.txt"
EOD = 0
UINT16 = 8


def documents():
    """Documents of 1 to 4 consecutive lines of the bundled corpus (48 of them)."""
    lines = [l for l in CORPUS.read_text(encoding="utf-8").splitlines() if l.strip()]
    docs, at = [], 0
    for i in range(48):
        n = 1 + (i * 7) % 4
        docs.append("\n".join(lines[at : at + n]))
        at += n
    return docs


def write_pair(prefix, sequences):
    lengths = [len(s) for s in sequences]
    with open(f"{prefix}.bin", "wb") as f:
        for s in sequences:
            f.write(struct.pack(f"<{len(s)}H", *s))
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", UINT16))
        f.write(struct.pack("<Q", len(sequences)))
        f.write(struct.pack("<Q", len(sequences) + 1))
        f.write(struct.pack(f"<{len(lengths)}i", *lengths))
        pointers, at = [], 0
        for n in lengths:
            pointers.append(at)
            at += n * 2
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(sequences) + 1}q", *range(len(sequences) + 1)))


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    docs = documents()
    with open(OUT / "docs.jsonl", "w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, "text": d}) + "\n")
    write_pair(OUT / "docs_text_document", [list(d.encode("utf-8")) + [EOD] for d in docs])
    print(f"wrote {len(docs)} documents to {OUT}")


if __name__ == "__main__":
    main()
