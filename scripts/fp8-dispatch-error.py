#!/usr/bin/env python3
"""Quantization error of the M2N dispatch in e4m3 with one scale per 128 values of a token (what
`--exchange-dtype fp8` sends) against one scale per token, on the dispatched activations (the
post-attention RMSNorm output each MoE block routes) of a model trained by `disagmoe train`, run
through transformers on 16 windows of 256 bytes of README.md.

    disagmoe train --model-config benches/qwen3-moe-cpu-100m.json --steps 60 --batch 8 --seq 128 --out /tmp/m
    python3 scripts/fp8-dispatch-error.py /tmp/m/final      # needs torch and transformers
"""
import sys, torch
from transformers import AutoModelForCausalLM
d = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
cfg = model.config
torch.manual_seed(0)
import os
text = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'README.md'), 'rb').read()[:64*256]
ids = torch.tensor(list(text), dtype=torch.long)[: (len(text)//256)*256].view(-1, 256)[:16] % cfg.vocab_size
acts = []
hooks = [l.mlp.register_forward_pre_hook(lambda m, a: acts.append(a[0].detach().reshape(-1, a[0].shape[-1]))) for l in model.model.layers]
with torch.no_grad():
    model(ids)
for h in hooks: h.remove()
E4M3_MAX = 448.0
def quant(x, block):
    n, w = x.shape
    xb = x.view(n, w // block, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    s = amax / E4M3_MAX
    q = (xb / s).to(torch.float8_e4m3fn).to(torch.float32) * s
    return q.view(n, w)
rows = []
for i, x in enumerate(acts):
    w = x.shape[1]
    r = {}
    for name, block in [("per-128", 128), ("per-token", w)]:
        q = quant(x, block)
        r[name] = ((q - x).norm() / x.norm()).item()
    # how heavy the outliers are: largest |x| of a token over its RMS, median over tokens
    ratio = (x.abs().amax(1) / x.pow(2).mean(1).sqrt()).median().item()
    rows.append((i, w, r["per-128"], r["per-token"], ratio))
    print(f"layer {i} width {w}: relative error per-128 {r['per-128']:.4e}, per-token {r['per-token']:.4e}; max/rms of a token (median) {ratio:.1f}")
