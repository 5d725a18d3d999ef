#!/usr/bin/env python3
"""Generate the Qwen3-MoE parity fixtures from Hugging Face transformers (float32).

For each configuration below this writes `fixtures/qwen3_moe/<name>/`:
  - config.json, model.safetensors : a tiny random checkpoint saved by `save_pretrained`
  - reference.safetensors          : input_ids [B, S] (int64), logits [B, S, V], loss, lm_loss,
                                     aux_loss (each [1]) and `grad.<hub name>` for every parameter
                                     (per-expert Hub names, whatever layout transformers keeps in memory)

Usage:  python3 -m venv .venv && .venv/bin/pip install torch transformers safetensors
        .venv/bin/python scripts/make_qwen3_fixtures.py [--out fixtures/qwen3_moe]
CI does not run this; the fixtures it made are committed.
"""
import argparse
import json
import os

import torch
import transformers
from safetensors.torch import save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from fixture_common import hub_grads

CONFIGS = {
    # GQA ratio 2, head_dim (16) != hidden/heads (12), norm_topk_prob true, a dense layer, untied head.
    "gqa2_norm_topk": dict(
        vocab_size=97, hidden_size=48, intermediate_size=40, moe_intermediate_size=24,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        router_aux_loss_coef=0.01, output_router_logits=True, max_position_embeddings=64,
        batch=2, seq=11,
    ),
    # GQA ratio 4, head_dim == hidden/heads, norm_topk_prob false, tied embeddings, attention biases,
    # decoder_sparse_step 2 (layer 0 dense), sliding window shorter than the sequence.
    "gqa4_no_norm_tied_window": dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=20,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        num_experts=6, num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=2,
        attention_bias=True, use_sliding_window=True, sliding_window=5,
        rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        router_aux_loss_coef=0.001, output_router_logits=True, max_position_embeddings=64,
        batch=3, seq=9,
    ),
    # Every layer sparse, top-1, GQA ratio 1 (plain MHA), a longer sequence.
    "mha_top1": dict(
        vocab_size=80, hidden_size=40, intermediate_size=56, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=5, num_key_value_heads=5, head_dim=10,
        num_experts=4, num_experts_per_tok=1, norm_topk_prob=False,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        router_aux_loss_coef=0.02, output_router_logits=True, max_position_embeddings=64,
        batch=2, seq=16,
    ),
}


def min_routing_margin(router_logits, k):
    """Smallest gap between the k-th and (k+1)-th router probability over all layers and tokens."""
    m = float("inf")
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        if probs.shape[-1] <= k:
            continue
        top = torch.topk(probs, k + 1, dim=-1).values
        m = min(m, float((top[:, k - 1] - top[:, k]).min()))
    return m


def make(name, spec, out_dir, seed):
    spec = dict(spec)
    batch, seq = spec.pop("batch"), spec.pop("seq")
    config = Qwen3MoeConfig(**spec, initializer_range=0.1)
    for attempt in range(50):
        torch.manual_seed(seed + attempt)
        model = Qwen3MoeForCausalLM(config).float()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if p.dim() == 1:  # norms and biases: move them off their trivial init
                    p.add_(0.1 * torch.randn_like(p))
        ids = torch.randint(0, config.vocab_size, (batch, seq))
        model.train()  # dropout is 0; train mode only so that nothing is cached
        out = model(input_ids=ids, labels=ids, output_router_logits=True)
        margin = min_routing_margin(out.router_logits, config.num_experts_per_tok)
        if margin > 2e-4:
            break
    else:
        raise SystemExit(f"{name}: no seed gave a routing margin above 2e-4")
    out.loss.backward()
    lm_loss = out.loss.detach() - config.router_aux_loss_coef * out.aux_loss.detach()
    d = os.path.join(out_dir, name)
    os.makedirs(d, exist_ok=True)
    model.save_pretrained(d, safe_serialization=True)
    tensors = {
        "input_ids": ids.to(torch.int64).contiguous(),
        "logits": out.logits.detach().float().contiguous(),
        "loss": out.loss.detach().reshape(1).float(),
        "lm_loss": lm_loss.reshape(1).float(),
        "aux_loss": out.aux_loss.detach().reshape(1).float(),
    }
    tensors.update(hub_grads(model, config.moe_intermediate_size))
    save_file(tensors, os.path.join(d, "reference.safetensors"),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__,
                        "seed": str(seed + attempt), "routing_margin": f"{margin:.3e}"})
    print(f"{name}: loss {out.loss.item():.6f} aux {out.aux_loss.item():.6f} margin {margin:.2e} "
          f"params {sum(p.numel() for p in model.parameters())}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "fixtures", "qwen3_moe"))
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    torch.set_default_dtype(torch.float32)
    for i, (name, spec) in enumerate(CONFIGS.items()):
        make(name, spec, args.out, args.seed + 100 * i)


if __name__ == "__main__":
    main()
