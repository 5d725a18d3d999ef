#!/usr/bin/env python3
"""Skews a DeepSeek-V3 checkpoint's routing for balance experiments (issue 35).

Copies the model directory SRC to DST and sets each MoE layer's selection bias
(`model.layers.L.mlp.gate.e_score_correction_bias`, which only chooses experts and never weights
them) to LAMBDA * ln(p), p a Zipf(S) distribution over the layer's experts in a fixed random order
per layer (Python's `random.Random(L).shuffle`). Standard library only.

    python3 scripts/skew-router-bias.py SRC DST LAMBDA S

Used in docs/runtime.md ("Redundant experts"): SRC is the `final/` of a one-step tiny-deepseek-v3
run with a negligible learning rate.
"""
import json
import math
import random
import shutil
import struct
import sys


def main():
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    src, dst, lam, s = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    path = dst + "/model.safetensors"
    data = bytearray(open(path, "rb").read())
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    changed = 0
    for name, meta in header.items():
        if not name.endswith("e_score_correction_bias"):
            continue
        if meta["dtype"] != "F32":
            sys.exit(f"{name}: {meta['dtype']}, expected F32")
        start, end = meta["data_offsets"]
        experts = (end - start) // 4
        layer = int(name.split(".")[2])
        order = list(range(experts))
        random.Random(layer).shuffle(order)  # order[r]: the expert of popularity rank r
        weights = [(r + 1) ** -s for r in range(experts)]
        total = sum(weights)
        bias = [0.0] * experts
        for r, e in enumerate(order):
            bias[e] = lam * math.log(weights[r] / total)
        data[8 + n + start : 8 + n + end] = struct.pack(f"<{experts}f", *bias)
        changed += 1
    if changed == 0:
        sys.exit(f"{src}: no e_score_correction_bias (a DeepSeek-V3 checkpoint is needed)")
    open(path, "wb").write(bytes(data))
    print(f"{dst}: {changed} layers' selection bias set to {lam} ln(Zipf({s}))")


if __name__ == "__main__":
    main()
