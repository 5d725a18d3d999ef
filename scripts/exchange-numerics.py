#!/usr/bin/env python3
"""The exchange's precision against the noise of the training trajectory itself.

For each tiny preset, 200 steps under disagg 2+2 (batch 8 x 32, 4 micro-batches): the f32 exchange,
bf16 and fp8, and six f32 runs whose learning rate is moved by k x 1e-6 (k = -3..3, not 0), a
perturbation that changes no precision. Prints, for the last step's training loss and the mean of
the last 10, each low-precision run's relative difference from f32 beside the median and largest
difference the perturbed runs show. Every run is deterministic (same bits on a rerun).

    cargo build --release -p disagmoe
    python3 scripts/exchange-numerics.py [--bin target/release/disagmoe]
"""
import argparse
import json
import statistics
import subprocess

PRESETS = ["tiny-qwen3-moe", "tiny-gpt-oss", "tiny-deepseek-v3"]
RUN = ["train", "--steps", "200", "--batch", "8", "--seq", "32", "--micro-batches", "4", "--quiet",
       "--placement", "disagg", "--attn-workers", "2", "--ffn-workers", "2", "--groups", "2"]
LR = 3e-3  # the default learning rate


def losses(binary, preset, extra):
    out = subprocess.run([binary, *RUN, "--model-preset", preset, *extra], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["losses"]


def rel(run, base, n):
    a, b = statistics.mean(run[-n:]), statistics.mean(base[-n:])
    return 100 * (a - b) / b


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="target/release/disagmoe")
    args = ap.parse_args()
    print("| preset | statistic | lr x (1 + k 1e-6): median / largest abs. difference | bf16 | fp8 |")
    print("|---|---|---|---|---|")
    for preset in PRESETS:
        base = losses(args.bin, preset, ["--exchange-dtype", "f32"])
        low = {d: losses(args.bin, preset, ["--exchange-dtype", d]) for d in ("bf16", "fp8")}
        moved = [losses(args.bin, preset, ["--exchange-dtype", "f32", "--lr", repr(LR * (1 + k * 1e-6))])
                 for k in (-3, -2, -1, 1, 2, 3)]
        for n, name in ((1, "last step"), (10, "mean of the last 10")):
            spread = sorted(abs(rel(m, base, n)) for m in moved)
            print(f"| {preset} | {name} | {statistics.median(spread):.2f}% / {spread[-1]:.2f}% "
                  f"| {rel(low['bf16'], base, n):+.2f}% | {rel(low['fp8'], base, n):+.2f}% |", flush=True)


if __name__ == "__main__":
    main()
