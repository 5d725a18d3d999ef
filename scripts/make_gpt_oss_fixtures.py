#!/usr/bin/env python3
"""Generate the GPT-OSS parity fixtures from Hugging Face transformers (float32).

Writes `fixtures/gpt_oss/<name>/` with config.json, model.safetensors (saved by `save_pretrained`)
and reference.safetensors (input_ids, logits, loss, lm_loss, aux_loss, `grad.<name>` per parameter),
like scripts/make_qwen3_fixtures.py. The `mxfp4` fixture stores its expert weights as MXFP4
(`*_blocks`, `*_scales`, quantised here) and its reference logits come from the weights that
transformers' own dequantiser (`_convert_moe_packed_tensors`) produces.

Usage: .venv/bin/python scripts/make_gpt_oss_fixtures.py
"""
import os

import torch
import transformers
from safetensors.torch import save_file
from transformers import GptOssConfig, GptOssForCausalLM
from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

OUT = os.path.join(os.path.dirname(__file__), "..", "fixtures", "gpt_oss")

CONFIGS = {
    # GQA 2, head_dim 12 != 40/4, sliding window 4 shorter than the sequence on even layers, YaRN
    # (the GPT-OSS default), a low clamp limit so that the clamps are active.
    "gqa2_window_yarn_clamp": dict(
        vocab_size=90, hidden_size=40, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, num_local_experts=6, num_experts_per_tok=2, sliding_window=4,
        swiglu_limit=0.6, router_aux_loss_coef=0.02, output_router_logits=True, max_position_embeddings=256,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
        batch=2, seq=10,
    ),
    # GQA 4, tied embeddings, no attention biases, plain RoPE, explicit layer types, top-3 of 4.
    "gqa4_tied_default_rope": dict(
        vocab_size=70, hidden_size=32, intermediate_size=20, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=3, sliding_window=3,
        layer_types=["full_attention", "sliding_attention"], attention_bias=False, tie_word_embeddings=True,
        router_aux_loss_coef=0.001, output_router_logits=True, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        batch=3, seq=8,
    ),
}


def margin(router_logits, k):
    m = float("inf")
    for logits in router_logits:
        top = torch.topk(logits.detach().float(), k + 1, dim=-1).values
        m = min(m, float((top[:, k - 1] - top[:, k]).min()))
    return m


def build(spec, seed):
    spec = dict(spec)
    batch, seq = spec.pop("batch"), spec.pop("seq")
    config = GptOssConfig(**spec, initializer_range=0.1)
    config._attn_implementation = "eager"
    for attempt in range(50):
        torch.manual_seed(seed + attempt)
        model = GptOssForCausalLM(config).float()
        model.config._attn_implementation = "eager"
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 1 or name.endswith("_bias"):
                    p.add_(0.1 * torch.randn_like(p))
        ids = torch.randint(0, config.vocab_size, (batch, seq))
        out = model(input_ids=ids, labels=ids, output_router_logits=True)
        mg = margin(out.router_logits, config.num_experts_per_tok)
        if mg > 1e-3:
            return config, model, ids, out, seed + attempt, mg
    raise SystemExit("no seed gave a routing margin above 1e-3")


def write(name, config, model, ids, out, seed, mg, weights=None):
    d = os.path.join(OUT, name)
    os.makedirs(d, exist_ok=True)
    model.save_pretrained(d, safe_serialization=True)
    if weights is not None:  # replace the expert weights by their MXFP4 form
        save_file(weights, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    out.loss.backward()
    lm = out.loss.detach() - config.router_aux_loss_coef * out.aux_loss.detach()
    t = {"input_ids": ids.to(torch.int64), "logits": out.logits.detach().float().contiguous(),
         "loss": out.loss.detach().reshape(1), "lm_loss": lm.reshape(1), "aux_loss": out.aux_loss.detach().reshape(1)}
    for pname, p in model.named_parameters():
        t[f"grad.{pname}"] = p.grad.detach().float().contiguous()
    save_file(t, os.path.join(d, "reference.safetensors"),
              metadata={"transformers": transformers.__version__, "seed": str(seed), "routing_margin": f"{mg:.3e}"})
    print(f"{name}: loss {out.loss.item():.6f} aux {out.aux_loss.item():.6f} margin {mg:.2e}")


def quantize_experts(model, gen):
    """Random MXFP4 expert weights; sets the model to transformers' dequantisation of them."""
    packed = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            ex = layer.mlp.experts
            for pname in ("gate_up_proj", "down_proj"):
                p = getattr(ex, pname)  # [E, in, out]; blocks are [E, out, in/32, 16]
                e, cin, cout = p.shape
                assert cin % 32 == 0, "MXFP4 groups 32 input values"
                blocks = torch.randint(0, 256, (e, cout, cin // 32, 16), dtype=torch.uint8, generator=gen)
                scales = torch.randint(121, 125, (e, cout, cin // 32), dtype=torch.uint8, generator=gen)
                deq = _convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
                assert deq.shape == p.shape, (deq.shape, p.shape)
                p.copy_(deq)
                packed[f"model.layers.{i}.mlp.experts.{pname}_blocks"] = blocks
                packed[f"model.layers.{i}.mlp.experts.{pname}_scales"] = scales
    return packed


def main():
    torch.set_default_dtype(torch.float32)
    for i, (name, spec) in enumerate(CONFIGS.items()):
        write(name, *build(spec, 500 + 100 * i))
    # MXFP4: input sizes must be multiples of 32 (hidden 64, intermediate 32).
    spec = dict(vocab_size=50, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                router_aux_loss_coef=0.01, output_router_logits=True, max_position_embeddings=64,
                batch=2, seq=8)
    config, model, ids, _, seed, _ = build(spec, 900)
    packed = quantize_experts(model, torch.Generator().manual_seed(3))
    out = model(input_ids=ids, labels=ids, output_router_logits=True)
    mg = margin(out.router_logits, config.num_experts_per_tok)
    weights = {k: v.detach().contiguous() for k, v in model.state_dict().items()
               if not (k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj"))}
    weights.update(packed)
    write("mxfp4", config, model, ids, out, seed, mg, weights=weights)


if __name__ == "__main__":
    main()
