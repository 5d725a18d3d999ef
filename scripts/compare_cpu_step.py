#!/usr/bin/env python3
"""Our CPU training step against transformers' on the same MoE model (issue #8's comparison).

Runs, alternately and `--rounds` times: `disagmoe train --model-config benches/qwen3-moe-cpu.json
--batch 4 --seq 256 --steps N` and the same step in PyTorch eager (transformers' Qwen3MoeForCausalLM,
float32, AdamW with our hyper-parameters, the load-balancing loss on, gradient clipping at 1.0), both
with the same thread count. Each run is its own process, so its peak resident memory is its own.
Both train on the bundled corpus (bytes), a new batch each step, so that their routing (and with
it the experts' share of the work) evolves alike; the script reports each one's routing spread.

Throughput, the same definition for both: tokens per second over every step after the first (the
first pays one-time costs), which is what `disagmoe train` reports as `tokens_per_s`; ours is read
from that summary. Also the median step time over the second half of the steps (`late`). Prints
per round and the medians over rounds: both throughputs, the ratio ours/transformers, each one's
fraction of the fp32 matmul rate measured here with torch, and peak RSS.

    python3 scripts/compare_cpu_step.py --bin target/release/disagmoe [--rounds 5] [--steps 8] [--threads 2]

Needs torch and transformers (`pip install torch transformers`); CI does not run it.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "benches", "qwen3-moe-cpu.json")
CORPUS = os.path.join(ROOT, "disagmoe-train", "data", "kjv-genesis-leviticus.txt")
BATCH, SEQ = 4, 256


def run_measured(cmd, env):
    """Runs a command and returns (stdout, its own peak RSS in MB) via wait4."""
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = p.stdout.read()
    err = p.stderr.read()
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd[:3])} failed ({p.returncode}):\n{err[-3000:]}")
    return out, usage.ru_maxrss / 1024.0


def train_flops_per_token(cfg):
    """Forward + backward (3x forward) matmul and attention FLOPs per token, as transformers runs it."""
    m, h, kv, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    e, k, fi, v = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"], cfg["vocab_size"]
    per_layer = m * h * d + 2 * m * kv * d + h * d * m + m * e + k * 3 * m * fi
    matmul_params = cfg["num_hidden_layers"] * per_layer + m * v
    attention = cfg["num_hidden_layers"] * 4 * SEQ * h * d  # QK^T and AV over the whole sequence
    return 3 * (2 * matmul_params + attention)


def ours(binary, steps, threads):
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
        cmd = [binary, "train", "--model-config", CONFIG, "--batch", str(BATCH), "--seq", str(SEQ),
               "--steps", str(steps), "--quiet", "--out", out]
        stdout, rss = run_measured(cmd, env)
        summary = json.loads(stdout.strip().splitlines()[-1])
        with open(os.path.join(out, "metrics.jsonl")) as f:
            lines = [json.loads(line) for line in f]
    step_s = [l["step_s"] for l in lines]
    loads = [[layer["tokens_per_expert"] for layer in l["expert_load"]] for l in lines]
    late = statistics.median(step_s[len(step_s) // 2:])
    return summary["tokens_per_s"], BATCH * SEQ / late, rss, expert_spread(loads[len(loads) // 2:])


def after_first(step_s):
    """Tokens per second over the steps after the first (all of them if there is one)."""
    s = step_s[1:] if len(step_s) >= 2 else step_s
    return BATCH * SEQ * len(s) / sum(s)


def expert_spread(loads):
    """Mean over steps and layers of: experts that got a token, and the busiest expert's share."""
    hit = [sum(1 for c in layer if c > 0) for step in loads for layer in step]
    top = [max(layer) / max(1, sum(layer)) for step in loads for layer in step]
    return {"experts_hit": statistics.mean(hit), "busiest_share": statistics.mean(top)}


def torch_child(steps, threads, experts):
    """The transformers step (run in a child process)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.set_num_threads(threads)
    torch.manual_seed(42)
    with open(CONFIG) as f:
        cfg = Qwen3MoeConfig(**{k: v for k, v in json.load(f).items() if k != "model_type"})
    cfg._experts_implementation = experts
    model = Qwen3MoeForCausalLM(cfg).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    # The same kind of data as ours: the bundled corpus as bytes, a new batch of windows each step
    # (the routing, and so the experts' share of the work, depends on it).
    with open(CORPUS, "rb") as f:
        corpus = torch.tensor(list(f.read()), dtype=torch.long)
    gen = torch.Generator().manual_seed(0)
    times, loads = [], []
    k, e = cfg.num_experts_per_tok, cfg.num_experts
    for _ in range(steps):
        starts = torch.randint(0, len(corpus) - SEQ, (BATCH,), generator=gen)
        ids = torch.stack([corpus[int(s):int(s) + SEQ] for s in starts])
        t0 = time.perf_counter()
        out = model(input_ids=ids, labels=ids, output_router_logits=True)
        loss = out.loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        with torch.no_grad():  # routing of this step (outside the timed region)
            loads.append([torch.bincount(r.topk(k, dim=-1).indices.flatten(), minlength=e).tolist()
                          for r in out.router_logits])
    print(json.dumps({"step_s": times, "loads": loads}))


def theirs(steps, threads, experts):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    out, rss = run_measured([sys.executable, __file__, "--torch-child", "--steps", str(steps),
                             "--threads", str(threads), "--experts-implementation", experts], env)
    res = json.loads(out.strip().splitlines()[-1])
    times, loads = res["step_s"], res["loads"]
    late = statistics.median(times[len(times) // 2:])
    return after_first(times), BATCH * SEQ / late, rss, expert_spread(loads[len(loads) // 2:])


def matmul_rate(threads):
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    reps = 20
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * 1024**3 * reps / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "disagmoe"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--experts-implementation", default="eager",
                    help="transformers' MoE experts code: eager (a loop over experts hit by tokens; the fastest "
                         "on CPU here), batched_mm or grouped_mm (transformers' default)")
    ap.add_argument("--torch-child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.torch_child:
        return torch_child(a.steps, a.threads, a.experts_implementation)
    with open(CONFIG) as f:
        flops_step = train_flops_per_token(json.load(f)) * BATCH * SEQ
    peak = matmul_rate(a.threads)
    tokens = BATCH * SEQ
    rows = []
    for r in range(a.rounds):
        o_rate, o_late, o_rss, o_load = ours(a.bin, a.steps, a.threads)
        t_rate, t_late, t_rss, t_load = theirs(a.steps, a.threads, a.experts_implementation)
        rows.append((o_rate, o_late, o_rss, o_load, t_rate, t_late, t_rss, t_load))
        print(f"round {r + 1}: ours {o_rate:7.0f} tok/s (late {o_late:.0f}, {o_rss:.0f} MB, "
              f"{o_load['experts_hit']:.1f} experts hit/layer)   "
              f"transformers {t_rate:7.0f} tok/s (late {t_late:.0f}, {t_rss:.0f} MB, "
              f"{t_load['experts_hit']:.1f} experts hit/layer)   ratio {o_rate / t_rate:.2f}", flush=True)
    med = lambda i: statistics.median(r[i] for r in rows)
    o_rate, o_late, t_rate, t_late = med(0), med(1), med(4), med(5)
    result = {
        "threads": a.threads, "steps": a.steps, "rounds": a.rounds,
        "experts_implementation": a.experts_implementation, "matmul_gflops": peak / 1e9,
        "train_gflop_per_step": flops_step / 1e9,
        "ours_tokens_per_s": o_rate, "transformers_tokens_per_s": t_rate, "ratio": o_rate / t_rate,
        "ours_late_tokens_per_s": o_late, "transformers_late_tokens_per_s": t_late, "late_ratio": o_late / t_late,
        "ours_fraction_of_matmul_peak": flops_step * o_rate / tokens / peak,
        "transformers_fraction_of_matmul_peak": flops_step * t_rate / tokens / peak,
        "ours_peak_rss_mb": max(r[2] for r in rows), "transformers_peak_rss_mb": max(r[6] for r in rows),
        "ours_expert_spread": rows[-1][3], "transformers_expert_spread": rows[-1][7],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
