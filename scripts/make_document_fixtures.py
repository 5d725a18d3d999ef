#!/usr/bin/env python3
"""Generate the document-mask parity fixtures from Hugging Face transformers (float32, eager).

For each committed parity fixture listed below (a tiny random checkpoint and its
`reference.safetensors`), this writes `documents.safetensors` next to them: the same rows packed
with several documents each, run with a block-diagonal causal mask (each token attends to the
earlier tokens of its own document only; a sliding-window layer also to its window only), and
the next-token loss with the targets that begin another document ignored (label -100):
  - input_ids  [B, S] int64: the reference's rows
  - doc_starts [B, S] int64: where each token's document starts
  - logits     [B, S, V]
  - lm_loss    [1]: the mean next-token cross-entropy over the counted targets
  - logits_restart, lm_loss_restart: the same with positions restarting at each document
    (position_ids counted from each document's start); the others count them from the row's.
    Under rotary embeddings the two differ by rounding only (a score depends on i - j alone).

Usage:  python3 -m venv .venv && .venv/bin/pip install torch transformers safetensors
        .venv/bin/python scripts/make_document_fixtures.py [--fixtures fixtures]
CI does not run this; the fixtures it made are committed.
"""
import argparse
import os

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from make_deepseek_fixtures import min_routing_margin  # DeepSeek-V3's group-limited routing

# One fixture per attention kind: GQA (Qwen3-MoE, OLMoE, Mixtral), sliding windows and sinks
# (GPT-OSS), MLA (DeepSeek-V3).
# (Mixtral: a window on every layer; GPT-OSS: windowed and full layers.)
FIXTURES = [
    "qwen3_moe/gqa2_norm_topk",
    "olmoe/clip_norm_topk_gqa2",
    "mixtral/gqa2_top2_window",
    "gpt_oss/gqa2_window_yarn_clamp",
    "deepseek_v3/plain_q_groups_tied",
]


def starts_of(seq, cuts):
    """Each token's document start for a row whose documents begin at `cuts` (besides 0)."""
    out, at = [], 0
    for i in range(seq):
        if i in cuts:
            at = i
        out.append(at)
    return out


def masks(doc_starts, window):
    """Additive [B, 1, S, S] masks: causal within each document, and also within `window`."""
    b, s = doc_starts.shape
    i = torch.arange(s).view(1, s, 1)
    j = torch.arange(s).view(1, 1, s)
    allowed = (j <= i) & (j >= doc_starts.view(b, s, 1))
    neg = torch.finfo(torch.float32).min
    full = torch.zeros(b, 1, s, s).masked_fill(~allowed.unsqueeze(1), neg)
    if window is None:
        return full, None
    slide = torch.zeros(b, 1, s, s).masked_fill(~(allowed & (j > i - window)).unsqueeze(1), neg)
    return full, slide


def router_margin(router_logits, k):
    """Smallest gap between the k-th and (k+1)-th router probability over all layers and tokens."""
    m = float("inf")
    for logits in router_logits or []:
        probs = torch.softmax(logits.float(), dim=-1)
        if probs.shape[-1] <= k:
            continue
        top = torch.topk(probs, k + 1, dim=-1).values
        m = min(m, float((top[:, k - 1] - top[:, k]).min().detach()))
    return m


@torch.no_grad()
def make(dir, seed):
    model = AutoModelForCausalLM.from_pretrained(dir, dtype=torch.float32, attn_implementation="eager")
    model.config._attn_implementation = "eager"
    # Experts looped over (grouped_mm needs 16-byte strides, which the fixtures' odd sizes lack).
    model.config._experts_implementation = "eager"
    model.train()  # dropout is 0; train mode only so that nothing is cached
    cfg = model.config
    ids = load_file(os.path.join(dir, "reference.safetensors"))["input_ids"].to(torch.int64)
    b, s = ids.shape
    k = getattr(cfg, "num_experts_per_tok", 1)
    types = getattr(cfg, "layer_types", None)
    window = getattr(cfg, "sliding_window", None)
    if not getattr(cfg, "use_sliding_window", True):
        window = None
    # Layer types: a mask per kind; else the window (if any) is every layer's.
    per_kind = window is not None and types is not None and "sliding_attention" in types
    gen = torch.Generator().manual_seed(seed)
    for attempt in range(50):
        # Two to four documents per row, none shorter than 2 tokens; the last row stays whole
        # on the first attempt (a row of one document is the unmasked case).
        rows = []
        for r in range(b):
            n = int(torch.randint(2, 5, (1,), generator=gen))
            cuts = sorted(set(int(c) for c in torch.randint(2, s - 1, (n - 1,), generator=gen)))
            cuts = [c for i, c in enumerate(cuts) if i == 0 or c - cuts[i - 1] >= 2]
            rows.append(starts_of(s, cuts if (r < b - 1 or attempt > 0) else []))
        doc_starts = torch.tensor(rows, dtype=torch.int64)
        full, slide = masks(doc_starts, window)
        mask = {"full_attention": full, "sliding_attention": slide} if per_kind else (full if window is None else slide)
        labels = ids.clone()
        labels[doc_starts == torch.arange(s).view(1, s)] = -100  # a target that begins a document
        # The logits; the router logits from the base model (transformers' balance loss reads
        # the attention mask as [B, S] and cannot take a 4D one).
        # Positions continuing over the row, and restarting at each document.
        restart = torch.arange(s).view(1, s) - doc_starts
        logits, margin = {}, float("inf")
        for kind, positions in [("continue", None), ("restart", restart)]:
            args = dict(input_ids=ids, attention_mask=mask, position_ids=positions)
            logits[kind] = model(**args, output_router_logits=False).logits.detach()
            router_logits = getattr(model.model(**args, output_router_logits=True), "router_logits", None)
            assert router_logits, f"{dir}: no router logits"
            if cfg.model_type == "deepseek_v3":
                margin = min(margin, min_routing_margin(model, router_logits, cfg))
            else:
                margin = min(margin, router_margin(router_logits, k))
        if margin > 2e-4:
            break
    else:
        raise SystemExit(f"{dir}: no document cuts gave a routing margin above 2e-4")
    def loss(lg):
        return torch.nn.functional.cross_entropy(
            lg[:, :-1].reshape(-1, lg.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100).reshape(1)
    # The mask matters. Restarting positions changes only rounding: rotary embeddings make a
    # score depend on i - j alone, which a shift of a whole document keeps.
    plain = model(input_ids=ids).logits.detach()
    assert (plain - logits["continue"]).abs().max() > 1e-3, f"{dir}: the document mask changed nothing"
    shift = float((logits["restart"] - logits["continue"]).abs().max())
    save_file(
        {
            "input_ids": ids.contiguous(),
            "doc_starts": doc_starts.contiguous(),
            "logits": logits["continue"].float().contiguous(),
            "lm_loss": loss(logits["continue"]).float(),
            "logits_restart": logits["restart"].float().contiguous(),
            "lm_loss_restart": loss(logits["restart"]).float(),
        },
        os.path.join(dir, "documents.safetensors"),
        metadata={"transformers": transformers.__version__, "torch": torch.__version__,
                  "seed": str(seed), "attempt": str(attempt), "routing_margin": f"{margin:.3e}"},
    )
    cuts = [[i for i in range(1, s) if row[i] == i] for row in rows]
    print(f"{dir}: cuts {cuts} lm_loss {loss(logits['continue']).item():.6f} "
          f"(restarting positions {loss(logits['restart']).item():.6f}, logits moved {shift:.1e}) "
          f"margin {margin:.2e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default=os.path.join(os.path.dirname(__file__), "..", "fixtures"))
    ap.add_argument("--seed", type=int, default=4321)
    args = ap.parse_args()
    torch.set_default_dtype(torch.float32)
    for i, name in enumerate(FIXTURES):
        root = os.path.join(args.fixtures, name)
        make(os.path.normpath(root), args.seed + 100 * i)


if __name__ == "__main__":
    main()
