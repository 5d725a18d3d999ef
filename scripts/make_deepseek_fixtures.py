#!/usr/bin/env python3
"""Generate the DeepSeek-V3 parity fixtures from Hugging Face transformers (float32).

For each configuration below this writes `fixtures/deepseek_v3/<name>/`:
  - config.json, model.safetensors : a tiny random checkpoint saved by `save_pretrained`
                                     (random router correction biases included)
  - reference.safetensors          : input_ids [B, S] (int64), logits [B, S, V], loss and lm_loss
                                     (each [1]; transformers' deepseek_v3 has no aux loss) and
                                     `grad.<hub name>` for every parameter (per-expert Hub names,
                                     whatever layout transformers keeps in memory)

Routing is discontinuous, so a seed is kept only when every token's choice is clear of ties: the gap
between the last kept and the first dropped group score, and between the k-th and (k+1)-th biased
expert score among the kept groups, must exceed MARGIN in every MoE layer.

Usage:  python3 -m venv .venv && .venv/bin/pip install torch transformers safetensors
        .venv/bin/python scripts/make_deepseek_fixtures.py [--out fixtures/deepseek_v3]
CI does not run this; the fixtures it made are committed.
"""
import os

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from fixture_common import hub_grads, main, save_fixture

MARGIN = 2e-4

CONFIGS = {
    # Low-rank queries, YaRN (mscale != mscale_all_dim: both the rope attention factor and the softmax
    # scale change), interleaved rope dims, attention biases, 4 groups of 2 experts with 2 kept, one
    # shared expert, one dense layer, normalised and scaled weights, untied head. Head dims are
    # unrelated to hidden / heads (32 / 3).
    "qlora_yarn_interleave": dict(
        vocab_size=97, hidden_size=32, intermediate_size=44, moe_intermediate_size=12,
        num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3,
        q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
        n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3, n_shared_experts=1,
        first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        rope_interleave=True, attention_bias=True, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                             original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0,
                             mscale=1.0, mscale_all_dim=0.7),
        max_position_embeddings=64, rms_norm_eps=1e-6,
        batch=2, seq=11,
    ),
    # Plain q_proj, default rope (half-split), 3 groups of 4 experts with 2 kept, top-4, two shared
    # experts, one dense layer, no normalisation, tied embeddings, rms_norm_eps != the latent norms'.
    "plain_q_groups_tied": dict(
        vocab_size=64, hidden_size=40, intermediate_size=36, moe_intermediate_size=10,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=7,
        n_routed_experts=12, n_group=3, topk_group=2, num_experts_per_tok=4, n_shared_experts=2,
        first_k_dense_replace=1, norm_topk_prob=False, routed_scaling_factor=1.5,
        rope_interleave=False, attention_bias=False, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        max_position_embeddings=64, rms_norm_eps=1e-5,
        batch=3, seq=9,
    ),
}


def margin_of(gate, logits, config):
    """Smallest gap over tokens at the group cut and at the expert cut of one router."""
    e, g, keep, k = config.n_routed_experts, config.n_group, config.topk_group, config.num_experts_per_tok
    m = float("inf")
    choice = logits.float().sigmoid() + gate.e_score_correction_bias  # [T, E]
    group = choice.view(-1, g, e // g).topk(2, dim=-1).values.sum(-1)  # [T, G]
    if keep < g:
        top = group.topk(keep + 1, dim=-1).values
        m = min(m, float((top[:, keep - 1] - top[:, keep]).min()))
    kept = group.topk(keep, dim=-1).indices
    mask = torch.zeros_like(group).scatter_(1, kept, 1).bool()
    mask = mask.unsqueeze(-1).expand(-1, g, e // g).reshape(-1, e)
    top = choice.masked_fill(~mask, float("-inf")).topk(k + 1, dim=-1).values
    return min(m, float((top[:, k - 1] - top[:, k]).min()))


def min_routing_margin(model, router_logits, config):
    """Smallest gap, over MoE layers and tokens, at the group cut and at the expert cut."""
    routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    assert len(routers) == len(router_logits)
    return min(margin_of(gate, logits, config) for gate, logits in zip(routers, router_logits))


def make(name, spec, out_dir, seed):
    spec = dict(spec)
    batch, seq = spec.pop("batch"), spec.pop("seq")
    config = DeepseekV3Config(**spec, initializer_range=0.1)
    config._attn_implementation = "eager"
    for attempt in range(100):
        torch.manual_seed(seed + attempt)
        model = DeepseekV3ForCausalLM(config).float()
        # The reference loops over experts (grouped_mm needs 16-byte strides, which odd sizes lack).
        model.config._experts_implementation = "eager"
        model.config._attn_implementation = "eager"
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if p.dim() == 1:  # norms and biases: move them off their trivial init
                    p.add_(0.1 * torch.randn_like(p))
            for bname, b in model.named_buffers():
                if bname.endswith("e_score_correction_bias"):
                    b.copy_(0.1 * torch.randn_like(b))
        ids = torch.randint(0, config.vocab_size, (batch, seq))
        model.train()  # dropout is 0; train mode only so that nothing is cached
        out = model(input_ids=ids, labels=ids, output_router_logits=True)
        with torch.no_grad():
            margin = min_routing_margin(model, out.router_logits, config)
        if margin > MARGIN:
            break
    else:
        raise SystemExit(f"{name}: no seed gave a routing margin above {MARGIN}")
    assert getattr(out, "aux_loss", None) is None, "deepseek_v3 was expected to have no aux loss"
    out.loss.backward()
    reference = {
        "input_ids": ids,
        "logits": out.logits,
        "loss": out.loss,
        "lm_loss": out.loss,
        **hub_grads(model, config.moe_intermediate_size),
    }
    save_fixture(model, os.path.join(out_dir, name), reference, seed=seed + attempt, margin=margin)
    print(f"{name}: loss {out.loss.item():.6f} margin {margin:.2e} seed {seed + attempt} "
          f"params {sum(p.numel() for p in model.parameters())}")


if __name__ == "__main__":
    main("deepseek_v3", CONFIGS, make, default_seed=4321)
