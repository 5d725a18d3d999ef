#!/usr/bin/env python3
"""Generate the Mixtral parity fixtures from Hugging Face transformers (float32).

For each configuration below this writes `fixtures/mixtral/<name>/`:
  - config.json, model.safetensors : a tiny random checkpoint saved by `save_pretrained` (transformers
                                     writes Mixtral's Hub layout: `block_sparse_moe.gate`, and per expert
                                     `block_sparse_moe.experts.{j}.w1` (gate), `w3` (up), `w2` (down))
  - reference.safetensors          : input_ids [B, S] (int64), logits [B, S, V], loss, lm_loss and
                                     aux_loss (each [1]; loss = lm_loss + router_aux_loss_coef * aux_loss)
                                     and `grad.<hub name>` for every parameter, named as in model.safetensors

A `*_bf16` configuration is saved with its weights in bfloat16; its reference is computed in float32 from
the checkpoint loaded back as float32 (so from the bf16-rounded weights).

Routing is discontinuous, so a seed is kept only when, in every layer and for every token, the k-th and
(k+1)-th router probabilities differ by more than MARGIN.

Usage:  python3 -m venv .venv && .venv/bin/pip install torch transformers safetensors
        .venv/bin/python scripts/make_mixtral_fixtures.py [--out fixtures/mixtral] [--seed N]
CI does not run this; the fixtures it made are committed.
"""
import copy
import os
import re

import torch
from safetensors import safe_open
from transformers import MixtralConfig, MixtralForCausalLM

from fixture_common import hub_grads, main, save_fixture

MARGIN = 2e-4

CONFIGS = {
    # GQA ratio 2, top-2 of 6, sliding window (5) shorter than the sequence (11), untied head,
    # rope_theta 1e6 (the Mixtral-8x7B value).
    "gqa2_top2_window": dict(
        vocab_size=97, hidden_size=40, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2,
        sliding_window=5, rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        rms_norm_eps=1e-5, tie_word_embeddings=False, router_aux_loss_coef=0.02,
        max_position_embeddings=64, batch=2, seq=11,
    ),
    # GQA ratio 1 (plain MHA), top-1 of 4 (the renormalised weight is exactly 1, so the router learns
    # only through the aux loss), no sliding window, tied embeddings, head_dim (12) != hidden / heads (8).
    "mha_top1_tied": dict(
        vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=12, num_local_experts=4,
        num_experts_per_tok=1, sliding_window=None,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        rms_norm_eps=1e-6, tie_word_embeddings=True, router_aux_loss_coef=0.01,
        max_position_embeddings=64, batch=3, seq=9,
    ),
    # bfloat16 checkpoint: GQA ratio 4, top-2 of 8, sliding window 4 < sequence 8, untied head.
    "gqa4_top2_bf16": dict(
        vocab_size=80, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=4, rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        rms_norm_eps=1e-5, tie_word_embeddings=False, router_aux_loss_coef=0.001,
        max_position_embeddings=64, batch=2, seq=8, bf16=True,
    ),
}

# In-memory name -> Hub name (what save_pretrained writes for Mixtral).
HUB_RENAMES = [
    (re.compile(r"\.mlp\.experts\.(\d+)\.gate_proj\."), r".block_sparse_moe.experts.\1.w1."),
    (re.compile(r"\.mlp\.experts\.(\d+)\.up_proj\."), r".block_sparse_moe.experts.\1.w3."),
    (re.compile(r"\.mlp\.experts\.(\d+)\.down_proj\."), r".block_sparse_moe.experts.\1.w2."),
    (re.compile(r"\.mlp\.gate\."), r".block_sparse_moe.gate."),
]


def mixtral_hub_grads(model, config):
    out = {}
    for k, g in hub_grads(model, config.intermediate_size).items():
        for pat, rep in HUB_RENAMES:
            k = pat.sub(rep, k)
        out[k] = g
    return out


def min_routing_margin(router_logits, k):
    """Smallest gap between the k-th and (k+1)-th router probability over all layers and tokens."""
    m = float("inf")
    for logits in router_logits:
        probs = torch.softmax(logits.detach().float(), dim=-1)
        top = torch.topk(probs, k + 1, dim=-1).values
        m = min(m, float((top[:, k - 1] - top[:, k]).min()))
    return m


def build(config, seed, batch, seq, bf16):
    for attempt in range(100):
        torch.manual_seed(seed + attempt)
        model = MixtralForCausalLM(config).float()
        model.config._experts_implementation = "eager"  # loop over experts (no grouped_mm on odd sizes)
        model.config._attn_implementation = "eager"
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:  # norms: move them off their trivial init
                    p.add_(0.1 * torch.randn_like(p))
                if bf16:  # the margin must hold for the weights the checkpoint will hold
                    p.copy_(p.bfloat16().float())
        ids = torch.randint(0, config.vocab_size, (batch, seq))
        model.train()  # dropout is 0; train mode only so that nothing is cached
        with torch.no_grad():
            out = model(input_ids=ids, labels=ids, output_router_logits=True)
        margin = min_routing_margin(out.router_logits, config.num_experts_per_tok)
        if margin > MARGIN:
            return model, ids, seed + attempt, margin
    raise SystemExit(f"no seed gave a routing margin above {MARGIN}")


def make(name, spec, out_dir, seed):
    spec = dict(spec)
    batch, seq, bf16 = spec.pop("batch"), spec.pop("seq"), spec.pop("bf16", False)
    config = MixtralConfig(**spec, initializer_range=0.1, output_router_logits=True,
                           bos_token_id=0, eos_token_id=1, pad_token_id=None)
    config._attn_implementation = "eager"
    model, ids, used_seed, margin = build(config, seed, batch, seq, bf16)
    d = os.path.join(out_dir, name)
    saved = model
    if bf16:
        saved = copy.deepcopy(model).to(torch.bfloat16)
        saved.save_pretrained(d, safe_serialization=True)
        model = MixtralForCausalLM.from_pretrained(d, dtype=torch.float32)
        model.config._experts_implementation = "eager"
        model.config._attn_implementation = "eager"
    model.train()
    out = model(input_ids=ids, labels=ids, output_router_logits=True)
    margin = min_routing_margin(out.router_logits, config.num_experts_per_tok)
    assert margin > MARGIN, margin
    out.loss.backward()
    lm_loss = out.loss.detach() - config.router_aux_loss_coef * out.aux_loss.detach()
    reference = {"input_ids": ids, "logits": out.logits, "loss": out.loss, "lm_loss": lm_loss,
                 "aux_loss": out.aux_loss, **mixtral_hub_grads(model, config)}
    save_fixture(saved, d, reference, seed=used_seed, margin=margin)
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    grads = {k[len("grad."):] for k in reference if k.startswith("grad.")}
    assert grads == keys, (sorted(grads ^ keys))
    print(f"{name}: loss {out.loss.item():.6f} aux {out.aux_loss.item():.6f} margin {margin:.2e} "
          f"seed {used_seed} params {sum(p.numel() for p in model.parameters())}")


if __name__ == "__main__":
    main("mixtral", CONFIGS, make, default_seed=2468)
