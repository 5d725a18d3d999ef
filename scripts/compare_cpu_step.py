#!/usr/bin/env python3
"""Our CPU training step against transformers' on the same Qwen3-MoE model, with the same routing.

For each `--model-config` (default `benches/qwen3-moe-cpu.json`; repeat the option to measure
several sizes, e.g. also `benches/qwen3-moe-cpu-100m.json`), `--rounds` rounds of, in this order,

  A  `disagmoe train --model-config CFG --batch 4 --seq 256 --steps N --force-balanced-routing`
  B  the same training step in PyTorch eager: transformers' `Qwen3MoeForCausalLM`, float32, AdamW
     with our hyper-parameters (lr 3e-3, betas 0.9/0.95, eps 1e-8, weight decay 0.1), the
     load-balancing loss on, gradient clipping at 1.0, and our forced routing patched in,

so A B A B A B; each run is its own process (its peak RSS is its own), both with `--threads`
threads (ours: `RAYON_NUM_THREADS` and `--threads-per-worker`, which puts the single device in a
pool of that size; torch: `torch.set_num_threads` and `OMP_NUM_THREADS`/`MKL_NUM_THREADS`).

Routing (the same on both sides). `--force-balanced-routing` is `RoutingOptions::apply` in
`disagmoe-models/src/moe/routing.rs`: the micro-batch's tokens are flattened `t = b S + s`, and
routed copy `t k + j` (token t, choice j) goes to expert `(t k + j) mod E`, keeping the router's
gate weights: weight j of token t is the router's j-th largest softmax probability (renormalised
over the k chosen when `norm_topk_prob`), not the probability of the forced expert. The router
still runs (logits, softmax, top-k) and gets its gradient through those weights, and the Switch
load-balancing loss counts the forced assignment (`RouterStats::new` reads the forced ids). The
patch here wraps `Qwen3MoeTopKRouter.forward`: the original computes logits and gate weights, and
its indices are replaced by `arange(T k).view(T, k) % E`; `load_balancing_loss_func` is replaced by
the same formula with the forced assignment's counts (transformers' own would re-derive top-k from
the logits). Check, printed per config: a pre-hook on every `Qwen3MoeExperts` records the indices
and weights the experts are called with on the first step (whatever the experts implementation):
indices equal to the rule, weights equal to the router's renormalised top-k of that step's logits,
and its per-expert counts per layer equal to ours from `metrics.jsonl` (step 1, every layer).

Experts implementation (`--experts-impl`): transformers' `eager` (a Python loop over the experts
that got tokens), `batched_mm` (gathers one weight matrix per routed copy, then `bmm`) or
`grouped_mm` (sorted copies, `torch.nn.functional.grouped_mm`, transformers' default); `best`
first runs each for `--probe-steps` steps in its own process, keeps the fastest, and reports all
three (`batched_mm` is skipped, and said so, when the weight copies it would keep for backward
exceed 60% of the available memory).

Throughput, one definition for both: tokens per second over every step after the first (the
first pays one-time costs), what `disagmoe train` reports as `tokens_per_s`; also `late`, the
median step time over the second half of the steps.

Model FLOP utilisation: training FLOPs per step (forward + backward = 3 x forward) of the products
our kernels actually do, over the step time, over the fp32 matmul rate measured here with torch
(the best of 1024^3 and 2048^3 products at `--threads`, measured before each round; the median is
used). Counted: q/k/v/o projections, router, the `T k` routed expert rows (balanced routing: no
padding, no drop), the head; attention as computed by `kernels/src/cpu/ops/attention.rs`: query
tiles of BLOCK (64) rows each compute scores and the probability-times-value product against all
keys up to the tile's last row, so per (sequence, head) `sum_tiles rows x i1` score entries
(S = 256: 40,960 of the full 65,536 square; the exact causal triangle is 32,896), each
`2 d + 2 d_v` FLOPs forward and twice that backward. Not counted: norms, RoPE, softmax, SwiGLU,
cross-entropy, optimizer. The same FLOP count is used for both sides (so the MFU ratio is the
throughput ratio); the full-square and exact-causal counts are printed too.

Memory, what each side can honestly measure:
  - both: peak RSS of the process (wait4's ru_maxrss); ours also as its summary reports it.
  - transformers: tensor bytes from torch itself: parameters, gradients and AdamW state (sums of
    the tensors' bytes after the last step), and activations saved for backward (a
    `saved_tensors_hooks` pack hook over one extra, untimed step: unique storages, parameters
    excluded; their total at the end of the forward is the activation peak held for backward,
    which leaves out transients that are freed during the forward). Also the RSS right after
    importing torch and transformers (the interpreter and libraries, before the model).
  - ours: `disagmoe train` reports no tensor-byte accounting; the state figure printed for us is
    analytic, params x 16 B (f32 weights, gradients, Adam m and v), and labelled so.

    /work/venv/bin/python scripts/compare_cpu_step.py --bin target/release/disagmoe \\
        --model-config benches/qwen3-moe-cpu.json --model-config benches/qwen3-moe-cpu-100m.json

Needs torch and transformers (`pip install torch transformers`); CI does not run it.
`--torch-only` runs only the transformers side (no binary needed; a smoke test of the patch).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "benches", "qwen3-moe-cpu.json")
CORPUS = os.path.join(ROOT, "disagmoe-train", "data", "kjv-genesis-leviticus.txt")
ATTENTION_RS = os.path.join(ROOT, "kernels", "src", "cpu", "ops", "attention.rs")
IMPLS = ("eager", "batched_mm", "grouped_mm")


# ---------------------------------------------------------------------------------------------
# Helpers


def run_measured(cmd, env, check=True):
    """Runs a command; returns (stdout, its own peak RSS in MB via wait4, exit code, stderr)."""
    with tempfile.TemporaryFile("w+") as err_f:
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err_f, text=True)
        out = p.stdout.read()
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        err_f.seek(0)
        err = err_f.read()
    if check and p.returncode != 0:
        sys.exit(f"{' '.join(cmd[:3])} failed ({p.returncode}):\n{err[-3000:]}")
    return out, usage.ru_maxrss / 1024.0, p.returncode, err


def spread(xs):
    """Median, min and max of a list (None entries dropped)."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def fmt(s, unit="", scale=1.0, digits=0):
    if s is None:
        return "n/a"
    f = lambda x: f"{x * scale:,.{digits}f}"
    return f"{f(s['median'])}{unit} [{f(s['min'])}, {f(s['max'])}]"


def after_first(step_s, tokens):
    """Tokens per second over the steps after the first (all of them if there is one)."""
    s = step_s[1:] if len(step_s) >= 2 else step_s
    return tokens * len(s) / sum(s)


def late_rate(step_s, tokens):
    return tokens / statistics.median(step_s[len(step_s) // 2:])


def mem_available_bytes():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def vm_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def load_cfg(path):
    with open(path) as f:
        return json.load(f)


def attention_block():
    """Query rows per tile of our CPU attention (`const BLOCK` in attention.rs; 64 if unreadable)."""
    try:
        with open(ATTENTION_RS) as f:
            m = re.search(r"const BLOCK: usize = (\d+);", f.read())
        return int(m.group(1)) if m else 64
    except OSError:
        return 64


def score_entries(seq, how, block):
    """Attention score entries per (sequence, head): `full` square, exact `causal` triangle, or as
    our tiled kernel `computed`s them (each tile of `block` rows against keys [0, tile end))."""
    if how == "full":
        return seq * seq
    if how == "causal":
        return seq * (seq + 1) // 2
    return sum((min(i0 + block, seq) - i0) * min(i0 + block, seq) for i0 in range(0, seq, block))


def train_flops_per_step(cfg, batch, seq, how="computed", block=64):
    """Forward + backward (3 x forward) FLOPs of the products (see the module docstring)."""
    m, h, kv, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    e, k, fi, v = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"], cfg["vocab_size"]
    layers = cfg["num_hidden_layers"]
    dense = set(cfg.get("mlp_only_layers") or [])
    step = cfg.get("decoder_sparse_step", 1) or 1
    per_token = m * v  # head
    for l in range(layers):
        per_token += m * h * d + 2 * m * kv * d + h * d * m
        if l not in dense and (l + 1) % step == 0:
            per_token += m * e + k * 3 * m * fi
        else:
            per_token += 3 * m * cfg["intermediate_size"]
    tokens = batch * seq
    linear = 2 * tokens * per_token
    attention = layers * batch * h * score_entries(seq, how, block) * (2 * d + 2 * d)
    return 3 * (linear + attention)


def count_params(cfg):
    """Parameters of the transformers model (meta device: nothing allocated)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(hf_config(cfg, "eager"))
    return sum(p.numel() for p in model.parameters())


def hf_config(cfg, experts):
    from transformers import Qwen3MoeConfig

    c = Qwen3MoeConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    c._experts_implementation = experts
    return c


def batched_mm_bytes(cfg, batch, seq):
    """Bytes of the per-copy weight matrices batched_mm gathers and keeps for backward (all layers)."""
    m, fi = cfg["hidden_size"], cfg["moe_intermediate_size"]
    copies = batch * seq * cfg["num_experts_per_tok"]
    return cfg["num_hidden_layers"] * copies * (2 * fi * m + m * fi) * 4


def matmul_rate(threads):
    """Best fp32 matmul rate (FLOP/s) of 1024^3 and 2048^3 products at `threads` threads."""
    import torch

    torch.set_num_threads(threads)
    best = 0.0
    for n, reps in ((1024, 10), (2048, 3)):
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        for _ in range(2):
            t0 = time.perf_counter()
            for _ in range(reps):
                a @ b
            best = max(best, 2 * n**3 * reps / (time.perf_counter() - t0))
    return best


# ---------------------------------------------------------------------------------------------
# The transformers side (a child process)


def forced_ids(tokens, k, e, device=None):
    """Our `--force-balanced-routing`: copy `t k + j` -> expert `(t k + j) mod E`, as `[T, k]`."""
    import torch

    return (torch.arange(tokens * k, device=device) % e).view(tokens, k)


def patch_balanced_routing():
    """Patches transformers' Qwen3-MoE router and balance loss to our forced round robin."""
    import torch
    from transformers.models.qwen3_moe import modeling_qwen3_moe as mq

    router = mq.Qwen3MoeTopKRouter
    original = router.forward
    cache = {}

    def forward(self, hidden_states):
        logits, weights, ids = original(self, hidden_states)  # the router's own gate weights
        key = (ids.shape[0], self.top_k, self.num_experts, ids.device)
        if key not in cache:
            cache[key] = forced_ids(ids.shape[0], self.top_k, self.num_experts, ids.device).to(ids.dtype)
        return logits, weights, cache[key]

    calls = {"loss": 0}

    def load_balancing_loss_func(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        # transformers' formula (E sum_e C_e/R P_e/R over all layers' rows), the counts C_e those
        # of the forced assignment, as our RouterStats count them.
        if gate_logits is None or not isinstance(gate_logits, tuple):
            return 0
        assert attention_mask is None, "the forced balance loss takes no padding mask"
        calls["loss"] += 1
        dev = gate_logits[0].device
        counts = torch.zeros(num_experts, dtype=torch.float32, device=dev)
        prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=dev)
        rows = 0
        for g in gate_logits:
            probs = torch.nn.functional.softmax(g.float(), dim=-1)
            ids = forced_ids(g.shape[0], top_k, num_experts, dev)
            counts = counts + torch.bincount(ids.reshape(-1), minlength=num_experts).float()
            prob_sum = prob_sum + probs.sum(dim=0)
            rows += g.shape[0]
        return torch.sum((counts / rows) * (prob_sum / rows)) * num_experts

    router.forward = forward
    mq.load_balancing_loss_func = load_balancing_loss_func
    return calls


def grouped_mm_path(model):
    """Whether grouped_mm runs torch's kernel (`native`) or transformers' per-expert fallback."""
    try:
        import torch
        from transformers.integrations import moe

        ex = next(m for m in model.modules() if type(m).__name__ == "Qwen3MoeExperts")
        x = torch.zeros(4, ex.gate_up_proj.shape[-1])
        offs = torch.tensor([4], dtype=torch.int32)
        return "native" if moe._can_use_grouped_mm(x, ex.gate_up_proj, offs) else "fallback"
    except Exception as err:  # noqa: BLE001 - a label only
        return f"unknown ({type(err).__name__})"


def torch_child(a):
    rss_start_kb = vm_kb("VmRSS")
    import torch
    import transformers
    from transformers import Qwen3MoeForCausalLM

    rss_import_kb = vm_kb("VmRSS")
    torch.set_num_threads(a.threads)
    torch.manual_seed(42)
    loss_calls = patch_balanced_routing()
    cfg = load_cfg(a.model_config[0])
    model = Qwen3MoeForCausalLM(hf_config(cfg, a.experts_impl)).float().train()
    assert model.config._experts_implementation == a.experts_impl, model.config._experts_implementation
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    batch, seq = a.batch, a.seq
    # The bundled corpus as bytes, a new batch of windows each step (as before; with the forced
    # routing the experts' work no longer depends on the data).
    with open(CORPUS, "rb") as f:
        corpus = torch.tensor(list(f.read()), dtype=torch.long)
    gen = torch.Generator().manual_seed(0)
    k, e = cfg["num_experts_per_tok"], cfg["num_experts"]

    # First step: record what the experts are called with (pre-hooks, removed after the step).
    seen = []
    hooks = [mod.register_forward_pre_hook(lambda mod, args: seen.append((args[1].detach().clone(), args[2].detach().clone())))
             for mod in model.modules() if type(mod).__name__ == "Qwen3MoeExperts"]

    def batch_ids():
        starts = torch.randint(0, len(corpus) - seq, (batch,), generator=gen)
        return torch.stack([corpus[int(s):int(s) + seq] for s in starts])

    times, losses, check = [], [], None
    for step in range(a.steps):
        ids = batch_ids()
        t0 = time.perf_counter()
        out = model(input_ids=ids, labels=ids, output_router_logits=True)
        loss = out.loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        if step == 0:
            for hk in hooks:
                hk.remove()
            check = routing_check(seen, out.router_logits, batch * seq, k, e, cfg.get("norm_topk_prob", True))
            seen.clear()

    # One more, untimed step with tensor-byte accounting (not in the brief probes of `best`).
    mem = {} if a.probe else memory_step(model, opt, batch_ids())
    mem["rss_at_start_mb"] = rss_start_kb / 1024
    mem["rss_after_import_mb"] = rss_import_kb / 1024
    mem["rss_peak_self_mb"] = vm_kb("VmHWM") / 1024
    print(json.dumps({
        "step_s": times, "losses": losses, "route_check": check, "memory": mem,
        "balance_loss_calls": loss_calls["loss"],
        "params": sum(p.numel() for p in model.parameters()),
        "experts_impl": model.config._experts_implementation,
        "attn_impl": model.config._attn_implementation,
        "grouped_mm_path": grouped_mm_path(model) if a.experts_impl == "grouped_mm" else None,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
    }))


def routing_check(seen, router_logits, tokens, k, e, norm):
    """The first step's routing as the experts saw it, against the forced rule and the router."""
    import torch

    rule = forced_ids(tokens, k, e)
    ids_ok, weights_ok, counts = True, True, []
    for (ids, w), logits in zip(seen, router_logits):
        ids_ok &= ids.shape == rule.shape and bool(torch.equal(ids.to(rule.dtype), rule))
        top = torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1).values
        if norm:
            top = top / top.sum(dim=-1, keepdim=True)
        weights_ok &= bool(torch.allclose(w.float(), top, rtol=1e-5, atol=1e-7))
        counts.append(torch.bincount(ids.reshape(-1), minlength=e).tolist())
    return {"layers_seen": len(seen), "layers": len(router_logits), "ids_equal_rule": ids_ok,
            "weights_equal_router_topk": weights_ok, "counts_per_layer": counts,
            "first_token_ids": rule[:3].tolist()}


def memory_step(model, opt, ids):
    """Tensor bytes of one training step, from torch: saved activations, params, grads, AdamW state."""
    import torch

    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr not in param_ptrs and ptr not in saved:
            saved[ptr] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, labels=ids, output_router_logits=True)
    saved_bytes = sum(saved.values())
    logits_bytes = out.logits.untyped_storage().nbytes()
    out.loss.backward()
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    opt_bytes = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                    if torch.is_tensor(v))
    mb = 1024 * 1024
    return {"params_mb": param_bytes / mb, "grads_mb": grad_bytes / mb, "adamw_state_mb": opt_bytes / mb,
            "saved_activations_mb": saved_bytes / mb, "logits_mb": logits_bytes / mb,
            "state_mb": (param_bytes + grad_bytes + opt_bytes) / mb}


# ---------------------------------------------------------------------------------------------
# The two sides, from the parent


def ours(a, config):
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, RAYON_NUM_THREADS=str(a.threads))
        cmd = [a.bin, "train", "--model-config", config, "--batch", str(a.batch), "--seq", str(a.seq),
               "--steps", str(a.steps), "--force-balanced-routing", "--threads-per-worker", str(a.threads),
               "--quiet", "--out", out]
        stdout, rss, _, _ = run_measured(cmd, env)
        summary = json.loads(stdout.strip().splitlines()[-1])
        with open(os.path.join(out, "metrics.jsonl")) as f:
            lines = [json.loads(line) for line in f]
    tokens = a.batch * a.seq
    step_s = [l["step_s"] for l in lines]
    counts = [[layer["tokens_per_expert"] for layer in l["expert_load"]] for l in lines]
    all_counts = [c for step in counts for layer in step for c in layer]
    return {
        "tokens_per_s": summary["tokens_per_s"], "late_tokens_per_s": late_rate(step_s, tokens),
        "script_tokens_per_s": after_first(step_s, tokens), "rss_mb": rss,
        "summary_rss_mb": max(summary.get("peak_rss_mb_per_rank") or [0]),
        "params": summary.get("params"), "threads": summary.get("threads_per_worker"),
        "flops_per_token_summary": summary.get("flops_per_token"), "kernels": summary.get("kernels"),
        "first_counts": counts[0] if counts else None,
        "balanced_every_step": bool(all_counts) and max(all_counts) - min(all_counts) <= 1,
        "losses": summary.get("losses"),
    }


def theirs(a, config, impl, steps, probe=False):
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
    cmd = [sys.executable, os.path.abspath(__file__), "--torch-child", "--model-config", config,
           "--steps", str(steps), "--threads", str(a.threads), "--batch", str(a.batch), "--seq", str(a.seq),
           "--experts-impl", impl] + (["--probe"] if probe else [])
    out, rss, rc, err = run_measured(cmd, env, check=False)
    if rc != 0:
        return {"error": f"exit {rc}: " + (err.strip().splitlines() or ["?"])[-1][:300]}
    res = json.loads(out.strip().splitlines()[-1])
    tokens = a.batch * a.seq
    res.update(tokens_per_s=after_first(res["step_s"], tokens), late_tokens_per_s=late_rate(res["step_s"], tokens),
               rss_mb=rss)
    return res


def choose_impl(a, config, cfg):
    """`best`: each implementation for `--probe-steps` steps, the fastest kept; all reported."""
    if a.experts_impl != "best":
        return a.experts_impl, {}
    probes = {}
    avail = mem_available_bytes()
    for impl in IMPLS:
        if impl == "batched_mm" and avail is not None and batched_mm_bytes(cfg, a.batch, a.seq) > 0.6 * avail:
            probes[impl] = {"skipped": f"would keep {batched_mm_bytes(cfg, a.batch, a.seq) / 2**30:.1f} GiB of "
                                       f"gathered expert weights for backward; {avail / 2**30:.1f} GiB available"}
        else:
            r = theirs(a, config, impl, a.probe_steps, probe=True)
            probes[impl] = {"error": r["error"]} if "error" in r else {
                "tokens_per_s": r["tokens_per_s"], "step_s": r["step_s"], "rss_mb": r["rss_mb"],
                "grouped_mm_path": r.get("grouped_mm_path")}
        print(f"  probe {impl:10s}: {json.dumps(probes[impl])}", flush=True)
    ok = {k: v for k, v in probes.items() if "tokens_per_s" in v}
    if not ok:
        sys.exit("no transformers experts implementation ran")
    return max(ok, key=lambda k: ok[k]["tokens_per_s"]), probes


def compare(a, config, rates):
    cfg = load_cfg(config)
    name = os.path.relpath(config, ROOT)
    block = attention_block()
    tokens = a.batch * a.seq
    flops = {how: train_flops_per_step(cfg, a.batch, a.seq, how, block) for how in ("computed", "causal", "full")}
    params = count_params(cfg)
    print(f"\n== {name}: {params / 1e6:.1f}M parameters, batch {a.batch} x {a.seq}, {a.threads} threads, "
          f"{a.steps} steps x {a.rounds} rounds; {flops['computed'] / 1e9:.1f} GFLOP/step as computed "
          f"(attention tiles of {block}; full square {flops['full'] / 1e9:.1f}, causal {flops['causal'] / 1e9:.1f})",
          flush=True)
    impl, probes = choose_impl(a, config, cfg)
    print(f"  transformers experts implementation: {impl}", flush=True)
    rows = []
    for r in range(a.rounds):
        rates.append(matmul_rate(a.threads))
        o = None if a.torch_only else ours(a, config)
        t = theirs(a, config, impl, a.steps)
        if "error" in t:
            sys.exit(f"transformers ({impl}) failed: {t['error']}")
        rows.append((o, t, rates[-1]))
        line = f"  round {r + 1}: matmul {rates[-1] / 1e9:.0f} GFLOP/s"
        if o:
            line += f"  ours {o['tokens_per_s']:7.0f} tok/s (late {o['late_tokens_per_s']:.0f}, {o['rss_mb']:.0f} MB)"
        line += f"  transformers {t['tokens_per_s']:7.0f} tok/s (late {t['late_tokens_per_s']:.0f}, {t['rss_mb']:.0f} MB)"
        if o:
            line += f"  ratio {o['tokens_per_s'] / t['tokens_per_s']:.2f}"
        print(line, flush=True)

    peak = statistics.median(x[2] for x in rows)
    mfu = lambda rate: flops["computed"] * rate / tokens / peak
    t0 = rows[0][1]
    res = {
        "config": name, "params_transformers": params, "batch": a.batch, "seq": a.seq, "threads": a.threads,
        "steps": a.steps, "rounds": a.rounds, "experts_impl": impl, "experts_impl_probes": probes,
        "attn_impl": t0["attn_impl"], "grouped_mm_path": t0.get("grouped_mm_path"),
        "torch": t0["torch"], "transformers": t0["transformers"],
        "matmul_gflops": spread([x[2] / 1e9 for x in rows]),
        "gflop_per_step": {k: v / 1e9 for k, v in flops.items()}, "attention_block": block,
        "transformers_tokens_per_s": spread([x[1]["tokens_per_s"] for x in rows]),
        "transformers_late_tokens_per_s": spread([x[1]["late_tokens_per_s"] for x in rows]),
        "transformers_mfu": spread([mfu(x[1]["tokens_per_s"]) for x in rows]),
        "transformers_peak_rss_mb": spread([x[1]["rss_mb"] for x in rows]),
        "transformers_tensor_mb": t0["memory"],
        "transformers_route_check": {k: v for k, v in t0["route_check"].items() if k != "counts_per_layer"},
        "transformers_balance_loss_patched": t0["balance_loss_calls"] == a.steps + 1,
    }
    if not a.torch_only:
        o0 = rows[0][0]
        res.update({
            "params_ours": o0["params"], "ours_threads": o0["threads"], "ours_kernels": o0["kernels"],
            "ours_flops_per_token_summary": o0["flops_per_token_summary"],
            "ours_tokens_per_s": spread([x[0]["tokens_per_s"] for x in rows]),
            "ours_late_tokens_per_s": spread([x[0]["late_tokens_per_s"] for x in rows]),
            "ours_mfu": spread([mfu(x[0]["tokens_per_s"]) for x in rows]),
            "ratio": spread([x[0]["tokens_per_s"] / x[1]["tokens_per_s"] for x in rows]),
            "late_ratio": spread([x[0]["late_tokens_per_s"] / x[1]["late_tokens_per_s"] for x in rows]),
            "ours_peak_rss_mb": spread([x[0]["rss_mb"] for x in rows]),
            "ours_summary_peak_rss_mb": spread([x[0]["summary_rss_mb"] for x in rows]),
            "ours_state_mb_analytic": (o0["params"] or 0) * 16 / 2**20,
            "ours_balanced_every_step": all(x[0]["balanced_every_step"] for x in rows),
            "first_step_counts_equal": o0["first_counts"] == t0["route_check"]["counts_per_layer"],
        })
    report(res, t0, rows[0][0])
    print(json.dumps(res), flush=True)
    return res


def report(res, t0, o0):
    chk = t0["route_check"]
    print(f"  routing check (transformers, step 1): experts called in {chk['layers_seen']}/{chk['layers']} layers; "
          f"ids == (t k + j) mod E: {chk['ids_equal_rule']}; weights == router's renormalised top-k: "
          f"{chk['weights_equal_router_topk']}; balance loss patched: {res['transformers_balance_loss_patched']}")
    print(f"    layer 0 counts, transformers: {chk['counts_per_layer'][0]}")
    if o0:
        print(f"    layer 0 counts, ours:         {o0['first_counts'][0]}")
        print(f"    every layer equal on both sides: {res['first_step_counts_equal']}; ours balanced on every step: "
              f"{res['ours_balanced_every_step']}; params ours {o0['params']:,} / transformers "
              f"{res['params_transformers']:,}; ours threads {o0['threads']}")
    print(f"  medians [min, max] over {res['rounds']} rounds (matmul rate {fmt(res['matmul_gflops'], ' GFLOP/s')}):")
    if o0:
        print(f"    ours          {fmt(res['ours_tokens_per_s'], ' tok/s')}  late {fmt(res['ours_late_tokens_per_s'])}"
              f"  MFU {fmt(res['ours_mfu'], '%', 100, 1)}  RSS {fmt(res['ours_peak_rss_mb'], ' MB')}")
    print(f"    transformers  {fmt(res['transformers_tokens_per_s'], ' tok/s')}  late "
          f"{fmt(res['transformers_late_tokens_per_s'])}  MFU {fmt(res['transformers_mfu'], '%', 100, 1)}  RSS "
          f"{fmt(res['transformers_peak_rss_mb'], ' MB')}  ({res['experts_impl']}, attention {res['attn_impl']})")
    if o0:
        print(f"    ratio ours/transformers {fmt(res['ratio'], 'x', 1, 2)}  late {fmt(res['late_ratio'], 'x', 1, 2)}")
    m = res["transformers_tensor_mb"]
    print(f"  memory, transformers (torch's tensors): params {m['params_mb']:.0f} + grads {m['grads_mb']:.0f} + "
          f"AdamW {m['adamw_state_mb']:.0f} = {m['state_mb']:.0f} MB; saved for backward {m['saved_activations_mb']:.0f} MB "
          f"(logits {m['logits_mb']:.0f}); RSS after imports {m['rss_after_import_mb']:.0f} MB")
    if o0:
        print(f"  memory, ours: state {res['ours_state_mb_analytic']:.0f} MB (analytic: params x 16 B; no tensor "
              f"accounting in the summary); peak RSS as the summary reports it {fmt(res['ours_summary_peak_rss_mb'], ' MB')}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "disagmoe"))
    ap.add_argument("--model-config", action="append", metavar="PATH",
                    help="a Qwen3-MoE config.json; repeat for several [default: benches/qwen3-moe-cpu.json]")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24, help="steps per run; the first is not timed [24]")
    ap.add_argument("--probe-steps", type=int, default=4, help="steps per implementation for --experts-impl best")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--experts-impl", "--experts-implementation", default="best", choices=IMPLS + ("best",),
                    help="transformers' experts code, or best: probe all three and keep the fastest [best]")
    ap.add_argument("--torch-only", action="store_true", help="only the transformers side (smoke test)")
    ap.add_argument("--torch-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.model_config = [os.path.abspath(p) for p in (a.model_config or [CONFIG])]
    if a.torch_child:
        return torch_child(a)
    if not a.torch_only and not os.path.exists(a.bin):
        sys.exit(f"{a.bin} not found (build it: cargo build --release), or pass --torch-only")
    t_start = time.time()
    results, rates = [], []
    for config in a.model_config:
        results.append(compare(a, config, rates))
    print(f"\ndone in {time.time() - t_start:.0f} s", flush=True)
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()
