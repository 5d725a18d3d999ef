#!/usr/bin/env python3
"""Generate the DeepSeek-V3 multi-token prediction (MTP) parity fixtures (float32).

transformers' deepseek_v3 drops the MTP layer (`_keys_to_ignore_on_load_unexpected = model.layers.61`),
so the reference is DeepSeek-V3's MTP module (technical report, section 2.2) built from transformers'
own DeepSeek-V3 pieces: the main model's final normed hidden state h, then for the one module at
layer L (= num_hidden_layers)

    x      = eh_proj(cat[enorm(embed(t_{i+1})), hnorm(h_i)])   # embedding first, as the Hub's eh_proj,
                                                              # vLLM's deepseek_mtp.py and Megatron-Core
    y      = DeepseekV3DecoderLayer(config, L)(x)            # MLA + routed MoE with shared experts,
                                                              # causal, positions 0..S-2
    logits = lm_head(shared_head.norm(y))                    # the main model's head
    mtp    = CE(logits[:, :-1], t[:, 2:])                    # position i predicts t_{i+2}

    loss   = lm_loss + MTP_COEF * mtp

For each configuration this writes `fixtures/deepseek_v3_mtp/<name>/`:
  - config.json, model.safetensors : the main model (`save_pretrained`) plus the MTP layer in the Hub's
                                     layout: `model.layers.{L}.{enorm, hnorm, eh_proj}`, the decoder
                                     layer's own names (per-expert), `shared_head.norm`, and the copies
                                     `model.layers.{L}.embed_tokens.weight` / `shared_head.head.weight`
                                     of the shared embedding and head
  - reference.safetensors          : input_ids, logits, loss, lm_loss, mtp_loss, mtp_loss_coef (each [1])
                                     and `grad.<hub name>` of every parameter, the MTP layer's included

Routing is discontinuous, so a seed is kept only when every router's choice (the main MoE layers' and
the MTP layer's) is clear of ties by MARGIN.

Usage:  python3 -m venv .venv && .venv/bin/pip install torch transformers safetensors
        .venv/bin/python scripts/make_deepseek_mtp_fixtures.py [--out fixtures/deepseek_v3_mtp]
CI does not run this; the fixtures it made are committed.
"""
import os
import tempfile

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

from fixture_common import hub_grads, main, save_fixture
from make_deepseek_fixtures import CONFIGS as MAIN_CONFIGS, MARGIN, margin_of

MTP_COEF = 0.3  # the report's weight for the first 10T tokens (not our default, so the test sees it used)

CONFIGS = {
    # Untied head, low-rank queries, YaRN, interleaved rope, biases (the main fixture's shape).
    "untied_qlora_yarn": dict(MAIN_CONFIGS["qlora_yarn_interleave"], num_nextn_predict_layers=1),
    # Tied embeddings: the shared head is the embedding matrix.
    "tied_plain_q": dict(MAIN_CONFIGS["plain_q_groups_tied"], num_nextn_predict_layers=1),
}


class Mtp(nn.Module):
    """One DeepSeek-V3 MTP module (the shared embedding and head are the main model's)."""

    def __init__(self, config, layer):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = DeepseekV3RMSNorm(h, eps=eps)
        self.hnorm = DeepseekV3RMSNorm(h, eps=eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = DeepseekV3DecoderLayer(config, layer)
        self.head_norm = DeepseekV3RMSNorm(h, eps=eps)


def forward(model, mtp, ids, config):
    """The main model's logits and lm loss, the MTP loss, and every router's (gate, logits)."""
    seen = []
    hooks = [mod.register_forward_hook(lambda mod, inp, out: seen.append((mod, out[0].detach())))
             for name, mod in list(model.named_modules()) + list(mtp.named_modules())
             if name.endswith("mlp.gate")]
    h = model.model(input_ids=ids).last_hidden_state  # [B, S, M], after the final norm
    logits = model.lm_head(h)
    ce = nn.functional.cross_entropy
    v = config.vocab_size
    lm_loss = ce(logits[:, :-1].reshape(-1, v), ids[:, 1:].reshape(-1))
    n = ids.shape[1] - 1
    x = mtp.eh_proj(torch.cat([mtp.enorm(model.model.embed_tokens(ids[:, 1:])), mtp.hnorm(h[:, :n])], dim=-1))
    pos = torch.arange(n).unsqueeze(0)
    cos_sin = model.model.rotary_emb(x, pos)
    causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
    y = mtp.block(x, attention_mask=causal, position_ids=pos, position_embeddings=cos_sin)
    mtp_logits = model.lm_head(mtp.head_norm(y))
    mtp_loss = ce(mtp_logits[:, :-1].reshape(-1, v), ids[:, 2:].reshape(-1))
    for hk in hooks:
        hk.remove()
    return logits, lm_loss, mtp_loss, seen


def hub_tensors_of_layer(model, mtp, config, layer):
    """The MTP block's tensors under the Hub's names: saved by transformers as layer `layer` of a
    model one layer deeper (its per-expert names, as the Hub checkpoints have them)."""
    deeper = DeepseekV3Config(**{**config.to_dict(), "num_hidden_layers": layer + 1})
    big = DeepseekV3ForCausalLM(deeper).float()
    state = model.state_dict()
    state.update({f"model.layers.{layer}.{k}": t for k, t in mtp.block.state_dict().items()})
    missing, unexpected = big.load_state_dict(state, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    with tempfile.TemporaryDirectory() as tmp:
        big.save_pretrained(tmp, safe_serialization=True)
        saved = load_file(os.path.join(tmp, "model.safetensors"))
    return {k: t for k, t in saved.items() if k.startswith(f"model.layers.{layer}.")}


def make(name, spec, out_dir, seed):
    spec = dict(spec)
    batch, seq = spec.pop("batch"), spec.pop("seq")
    config = DeepseekV3Config(**spec, initializer_range=0.1)
    config._attn_implementation = "eager"
    layer = config.num_hidden_layers
    for attempt in range(200):
        torch.manual_seed(seed + attempt)
        model = DeepseekV3ForCausalLM(config).float()
        model.config._experts_implementation = "eager"
        model.config._attn_implementation = "eager"
        mtp = Mtp(config, layer).float()
        with torch.no_grad():
            # A module built alone is not initialised by transformers (experts start as
            # torch.empty): matrices from normal(0, initializer_range), norms at one, biases zero.
            for pname, p in mtp.named_parameters():
                if p.dim() >= 2:
                    nn.init.normal_(p, std=config.initializer_range)
                elif "norm" in pname:
                    nn.init.ones_(p)
                else:
                    nn.init.zeros_(p)
            for p in list(model.parameters()) + list(mtp.parameters()):
                if p.dim() == 1:  # norms and biases: move them off their trivial init
                    p.add_(0.1 * torch.randn_like(p))
            for module in (model, mtp):
                for bname, b in module.named_buffers():
                    if bname.endswith("e_score_correction_bias"):
                        b.copy_(0.1 * torch.randn_like(b))
        ids = torch.randint(0, config.vocab_size, (batch, seq))
        model.train()
        mtp.train()
        logits, lm_loss, mtp_loss, routers = forward(model, mtp, ids, config)
        with torch.no_grad():
            margin = min(margin_of(g, lg, config) for g, lg in routers)
        if margin > MARGIN:
            break
    else:
        raise SystemExit(f"{name}: no seed gave a routing margin above {MARGIN}")
    assert len(routers) == sum(layer_idx >= config.first_k_dense_replace for layer_idx in range(layer + 1))
    loss = lm_loss + MTP_COEF * mtp_loss
    loss.backward()

    grads = hub_grads(model, config.moe_intermediate_size)
    prefix = f"model.layers.{layer}"
    for pname, p in mtp.named_parameters():
        g = p.grad.detach().clone().float()
        if pname.startswith("block."):
            continue
        hub = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
               "head_norm.weight": "shared_head.norm.weight"}[pname]
        grads[f"grad.{prefix}.{hub}"] = g.contiguous()

    class BlockHolder(nn.Module):  # block gradients under `model.layers.{L}.` with hub_grads' naming
        def __init__(self, block):
            super().__init__()
            self.model = nn.Module()
            self.model.layers = nn.ModuleDict({str(layer): block})

    grads.update(hub_grads(BlockHolder(mtp.block), config.moe_intermediate_size))

    reference = {
        "input_ids": ids,
        "logits": logits,
        "loss": loss,
        "lm_loss": lm_loss,
        "mtp_loss": mtp_loss,
        "mtp_loss_coef": torch.tensor(MTP_COEF),
        **grads,
    }
    dir_ = os.path.join(out_dir, name)
    save_fixture(model, dir_, reference, seed=seed + attempt, margin=margin)
    # The checkpoint gains the MTP layer in the Hub's layout.
    weights = load_file(os.path.join(dir_, "model.safetensors"))
    weights.update(hub_tensors_of_layer(model, mtp, config, layer))
    weights[f"{prefix}.enorm.weight"] = mtp.enorm.weight.detach().clone()
    weights[f"{prefix}.hnorm.weight"] = mtp.hnorm.weight.detach().clone()
    weights[f"{prefix}.eh_proj.weight"] = mtp.eh_proj.weight.detach().clone()
    weights[f"{prefix}.shared_head.norm.weight"] = mtp.head_norm.weight.detach().clone()
    weights[f"{prefix}.embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    weights[f"{prefix}.shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(dir_, "model.safetensors"),
              metadata={"format": "pt"})
    print(f"{name}: loss {loss.item():.6f} (lm {lm_loss.item():.6f}, mtp {mtp_loss.item():.6f}) "
          f"margin {margin:.2e} seed {seed + attempt}")


if __name__ == "__main__":
    main("deepseek_v3_mtp", CONFIGS, make, default_seed=8642)
