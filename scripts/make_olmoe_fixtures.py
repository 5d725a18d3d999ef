#!/usr/bin/env python3
"""Generate the OLMoE parity fixtures from Hugging Face transformers (float32).

For each configuration below this writes `fixtures/olmoe/<name>/`:
  - config.json, model.safetensors : a tiny random checkpoint saved by `save_pretrained` (per-expert Hub
                                     names `mlp.experts.{j}.{gate,up,down}_proj.weight`, q/k norms
                                     `self_attn.{q,k}_norm.weight`)
  - reference.safetensors          : input_ids [B, S] (int64), logits [B, S, V], loss, lm_loss and
                                     aux_loss (each [1]; loss = lm_loss + router_aux_loss_coef * aux_loss)
                                     and `grad.<hub name>` for every parameter, named as in model.safetensors

`clip_qkv` is chosen so that it does clip: the fraction of q/k/v entries beyond it (after the q/k norms,
where transformers clamps) is printed and stored in the reference metadata as `clip_fraction`.
A config with `pad_token_id` 1 (OLMoE-1B-7B's value) puts token 1 in the input: nn.Embedding's
padding_idx gives that row of the embedding no gradient from the lookup.

A `*_bf16` configuration is saved with its weights in bfloat16; its reference is computed in float32 from
the checkpoint loaded back as float32 (so from the bf16-rounded weights).

Routing is discontinuous, so a seed is kept only when, in every layer and for every token, the k-th and
(k+1)-th router probabilities differ by more than MARGIN.

Usage:  python3 -m venv .venv && .venv/bin/pip install torch transformers safetensors
        .venv/bin/python scripts/make_olmoe_fixtures.py [--out fixtures/olmoe] [--seed N]
CI does not run this; the fixtures it made are committed.
"""
import copy
import os

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import OlmoeConfig, OlmoeForCausalLM

from fixture_common import hub_grads, main, save_fixture

MARGIN = 2e-4

CONFIGS = {
    # clip_qkv 1.2 (clips some q/k/v entries), norm_topk_prob true, GQA ratio 2 (k_norm over
    # kv_heads * head_dim), top-2 of 8, untied head, pad_token_id 1 with token 1 in the input.
    "clip_norm_topk_gqa2": dict(
        vocab_size=97, hidden_size=40, intermediate_size=12, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
        clip_qkv=1.2, norm_topk_prob=True, tie_word_embeddings=False, pad_token_id=1,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0), rms_norm_eps=1e-5,
        router_aux_loss_coef=0.01, max_position_embeddings=64, batch=2, seq=11,
    ),
    # No clipping, norm_topk_prob false, plain MHA, top-3 of 6, tied embeddings, no pad token.
    "noclip_no_norm_tied": dict(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, num_experts=6, num_experts_per_tok=3,
        clip_qkv=None, norm_topk_prob=False, tie_word_embeddings=True, pad_token_id=None,
        rope_parameters=dict(rope_type="default", rope_theta=500000.0), rms_norm_eps=1e-6,
        router_aux_loss_coef=0.02, max_position_embeddings=64, batch=3, seq=9,
    ),
    # bfloat16 checkpoint: clip_qkv 1.0, norm_topk_prob true, GQA ratio 4, top-2 of 4, untied head.
    "clip_gqa4_bf16": dict(
        vocab_size=80, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
        clip_qkv=1.0, norm_topk_prob=True, tie_word_embeddings=False, pad_token_id=None,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0), rms_norm_eps=1e-5,
        router_aux_loss_coef=0.01, max_position_embeddings=64, batch=2, seq=8, bf16=True,
    ),
}


def min_routing_margin(router_logits, k):
    """Smallest gap between the k-th and (k+1)-th router probability over all layers and tokens."""
    m = float("inf")
    for logits in router_logits:
        probs = torch.softmax(logits.detach().float(), dim=-1)
        top = torch.topk(probs, k + 1, dim=-1).values
        m = min(m, float((top[:, k - 1] - top[:, k]).min()))
    return m


def clip_fraction(model, ids, clip):
    """Fraction of the q, k and v entries (after the q/k norms) that clip_qkv clamps."""
    if clip is None:
        return 0.0
    seen = []
    hooks = []
    for layer in model.model.layers:
        at = layer.self_attn
        for mod in (at.q_norm, at.k_norm, at.v_proj):  # the hooks see the values before the clamp_
            hooks.append(mod.register_forward_hook(lambda m, i, o: seen.append(o.detach().clone())))
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    total = sum(t.numel() for t in seen)
    return sum(int((t.abs() > clip).sum()) for t in seen) / total


def build(config, seed, batch, seq, bf16):
    for attempt in range(100):
        torch.manual_seed(seed + attempt)
        model = OlmoeForCausalLM(config).float()
        model.config._experts_implementation = "eager"  # loop over experts (no grouped_mm on odd sizes)
        model.config._attn_implementation = "eager"
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:  # norms: move them off their trivial init
                    p.add_(0.1 * torch.randn_like(p))
                if bf16:  # the margin must hold for the weights the checkpoint will hold
                    p.copy_(p.bfloat16().float())
        ids = torch.randint(0, config.vocab_size, (batch, seq))
        if config.pad_token_id is not None:
            ids[0, 2] = config.pad_token_id  # exercise padding_idx (no embedding gradient from lookups)
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
    config = OlmoeConfig(**spec, initializer_range=0.1, output_router_logits=True,
                         bos_token_id=None, eos_token_id=2)
    config._attn_implementation = "eager"
    model, ids, used_seed, margin = build(config, seed, batch, seq, bf16)
    d = os.path.join(out_dir, name)
    saved = model
    if bf16:
        saved = copy.deepcopy(model).to(torch.bfloat16)
        saved.save_pretrained(d, safe_serialization=True)
        model = OlmoeForCausalLM.from_pretrained(d, dtype=torch.float32)
        model.config._experts_implementation = "eager"
        model.config._attn_implementation = "eager"
    model.train()
    clipped = clip_fraction(model, ids, config.clip_qkv)
    assert config.clip_qkv is None or clipped > 0, "clip_qkv clips nothing"
    out = model(input_ids=ids, labels=ids, output_router_logits=True)
    margin = min_routing_margin(out.router_logits, config.num_experts_per_tok)
    assert margin > MARGIN, margin
    out.loss.backward()
    lm_loss = out.loss.detach() - config.router_aux_loss_coef * out.aux_loss.detach()
    reference = {"input_ids": ids, "logits": out.logits, "loss": out.loss, "lm_loss": lm_loss,
                 "aux_loss": out.aux_loss, **hub_grads(model, config.intermediate_size)}
    save_fixture(saved, d, reference, seed=used_seed, margin=margin)
    # Record the clip fraction next to the other metadata.
    ref_path = os.path.join(d, "reference.safetensors")
    with safe_open(ref_path, "pt") as f:
        meta = dict(f.metadata())
    meta["clip_fraction"] = f"{clipped:.4f}"
    save_file(load_file(ref_path), ref_path, metadata=meta)
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    grads = {k[len("grad."):] for k in reference if k.startswith("grad.")}
    assert grads == keys, (sorted(grads ^ keys))
    print(f"{name}: loss {out.loss.item():.6f} aux {out.aux_loss.item():.6f} margin {margin:.2e} "
          f"seed {used_seed} clip_fraction {clipped:.4f} "
          f"params {sum(p.numel() for p in model.parameters())}")


if __name__ == "__main__":
    main("olmoe", CONFIGS, make, default_seed=1357)
