#!/usr/bin/env python3
"""Our CPU training step against transformers' on the same MoE model (issue #8's comparison).

Runs, alternately and `--rounds` times: `disagmoe train --model-config benches/qwen3-moe-cpu.json
--batch 4 --seq 256 --steps N` and the same step in PyTorch eager (transformers' Qwen3MoeForCausalLM,
float32, AdamW with our hyper-parameters, the load-balancing loss on, gradient clipping at 1.0), both
with the same thread count. Each run is its own process, so its peak resident memory is its own.
Prints per run and the medians: tokens/s (median step time over the second half of the steps, so
warm-up is not counted), the ratio ours/transformers, each one's fraction of the fp32 matmul rate measured here with
torch, and peak RSS.

    python3 scripts/compare_cpu_step.py --bin target/release/disagmoe [--rounds 3] [--steps 8] [--threads 2]

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
CORPUS = os.path.join(ROOT, "data", "kjv-genesis-leviticus.txt")
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
        _, rss = run_measured(cmd, env)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            lines = [json.loads(line) for line in f]
    step_s = [l["step_s"] for l in lines]
    loads = [[layer["tokens_per_expert"] for layer in l["expert_load"]] for l in lines]
    return statistics.median(step_s[len(step_s) // 2:]), rss, expert_spread(loads[len(loads) // 2:])


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
    return statistics.median(times[len(times) // 2:]), rss, expert_spread(loads[len(loads) // 2:])


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
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
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
        o_s, o_rss, o_load = ours(a.bin, a.steps, a.threads)
        t_s, t_rss, t_load = theirs(a.steps, a.threads, a.experts_implementation)
        rows.append((o_s, o_rss, t_s, t_rss, o_load, t_load))
        print(f"round {r + 1}: ours {tokens / o_s:7.0f} tok/s ({o_s:.3f} s/step, {o_rss:.0f} MB, "
              f"{o_load['experts_hit']:.1f} experts hit/layer)   "
              f"transformers {tokens / t_s:7.0f} tok/s ({t_s:.3f} s/step, {t_rss:.0f} MB, "
              f"{t_load['experts_hit']:.1f} experts hit/layer)", flush=True)
    o_s = statistics.median(r[0] for r in rows)
    t_s = statistics.median(r[2] for r in rows)
    o_rss = max(r[1] for r in rows)
    t_rss = max(r[3] for r in rows)
    result = {
        "threads": a.threads, "experts_implementation": a.experts_implementation, "matmul_gflops": peak / 1e9, "train_gflop_per_step": flops_step / 1e9,
        "ours_tokens_per_s": tokens / o_s, "transformers_tokens_per_s": tokens / t_s,
        "ratio": t_s / o_s,
        "ours_fraction_of_matmul_peak": flops_step / o_s / peak,
        "transformers_fraction_of_matmul_peak": flops_step / t_s / peak,
        "ours_peak_rss_mb": o_rss, "transformers_peak_rss_mb": t_rss,
        "ours_expert_spread": rows[-1][4], "transformers_expert_spread": rows[-1][5],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
