#!/usr/bin/env python3
"""Greedy generation fixtures: what transformers' `generate` writes after a prompt, for every parity
fixture checkpoint of every family (but the MXFP4 one, which transformers cannot run on the CPU).

For each `fixtures/<family>/<config>/` (made by the `make_*_fixtures.py` scripts) this writes
`generate.safetensors` next to the checkpoint:
  - prompt [P] (int64): the first P ids of a row of the parity fixture's input_ids
  - tokens [N] (int64): the N tokens greedy decoding adds (no end-of-sequence stop)
with the margin in the metadata: over the N decisions, the smallest gap between the largest and the
second largest logit (computed by one full forward pass over prompt + tokens). A prompt is kept only
when that margin exceeds MARGIN, so that float noise far below it cannot change the tokens; the first
row and prompt length that do are used.

transformers families run `model.generate(do_sample=False)` (its own KV cache, sliding windows and
sinks included). DeepSeekMoE (`fixtures/deepseek`) has no transformers model: its composed model
(scripts/make_deepseek_moe_fixtures.py) is run greedily by a full forward pass per token.

Usage:  python3 -m venv .venv && .venv/bin/pip install torch transformers safetensors
        .venv/bin/python scripts/make_generate_fixtures.py [--new-tokens 16]
CI does not run this; the fixtures it made are committed.
"""
import argparse
import json
import os
import sys

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(__file__))

FAMILIES = ["qwen3_moe", "gpt_oss", "deepseek_v3", "mixtral", "olmoe", "deepseek"]
MARGIN = 1e-3


def load(family, d):
    """The model of a fixture directory, float32, in eval mode, and a `logits(ids)` function."""
    if family == "deepseek":
        import make_deepseek_moe_fixtures as ds

        with open(os.path.join(d, "config.json")) as f:
            cfg = json.load(f)
        model = ds.DeepseekForCausalLM(ds.Cfg(cfg))
        model.load_state_dict({k: v.float() for k, v in load_file(os.path.join(d, "model.safetensors")).items()},
                              strict=True)
        model.train()  # the composed model has only DeepseekMoE's training branch (no dropout anywhere)
        return model, lambda ids: model(ids, ids)[1]
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    # The eager paths, as the parity fixtures were made (grouped_mm refuses the tiny odd sizes).
    model.config._experts_implementation = "eager"
    model.config._attn_implementation = "eager"
    model.eval()
    return model, lambda ids: model(input_ids=ids, use_cache=False).logits


def greedy(family, model, logits_of, prompt, n):
    if family == "deepseek":
        ids = prompt.clone()
        for _ in range(n):
            nxt = logits_of(ids)[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
        return ids[0, prompt.shape[1]:]
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, prompt.shape[1]:]


def margin(logits_of, prompt, tokens):
    ids = torch.cat([prompt[0], tokens]).unsqueeze(0)
    logits = logits_of(ids)[0, prompt.shape[1] - 1: -1]  # the N positions that chose the tokens
    top = logits.topk(2, dim=-1).values
    assert torch.equal(logits.argmax(-1), tokens), "greedy tokens are the full pass's argmax"
    return float((top[:, 0] - top[:, 1]).min())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default=os.path.join(os.path.dirname(__file__), "..", "fixtures"))
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args()
    torch.set_default_dtype(torch.float32)
    for family in FAMILIES:
        root = os.path.join(args.root, family)
        for name in sorted(os.listdir(root)):
            d = os.path.join(root, name)
            if not os.path.exists(os.path.join(d, "reference.safetensors")):
                continue
            with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
                if any(k.endswith("_blocks") for k in f.keys()):
                    # transformers cannot run MXFP4 experts on the CPU (it leaves them uninitialised).
                    continue
            model, logits_of = load(family, d)
            rows = load_file(os.path.join(d, "reference.safetensors"))["input_ids"]
            found = None
            with torch.no_grad():
                for row in range(rows.shape[0]):
                    for p in (5, 3, 7, 2):
                        prompt = rows[row: row + 1, :p].to(torch.int64)
                        tokens = greedy(family, model, logits_of, prompt, args.new_tokens)
                        m = margin(logits_of, prompt, tokens)
                        if m > MARGIN:
                            found = (prompt, tokens, m)
                            break
                    if found:
                        break
            if not found:
                raise SystemExit(f"{family}/{name}: no prompt with a greedy margin above {MARGIN}")
            prompt, tokens, m = found
            save_file({"prompt": prompt[0].contiguous(), "tokens": tokens.to(torch.int64).contiguous()},
                      os.path.join(d, "generate.safetensors"),
                      metadata={"transformers": transformers.__version__, "torch": torch.__version__,
                                "margin": f"{m:.3e}",
                                "method": "full forward per token" if family == "deepseek" else "generate"})
            print(f"{family}/{name}: prompt {prompt[0].tolist()} -> {tokens.tolist()} margin {m:.2e}")


if __name__ == "__main__":
    main()
