#!/usr/bin/env python3
"""Generate the DeepSeekMoE (model_type `deepseek`, deepseek-ai/deepseek-moe-16b-*) parity fixtures (float32).

transformers has no `deepseek` model: the Hub ships it as remote code (modeling_deepseek.py and
configuration_deepseek.py, written for transformers 4.36), which does not import under transformers 5
(`transformers.modeling_attn_mask_utils` is gone). So this script composes the same model in plain torch,
op for op from that file's eager path (DeepseekRMSNorm, DeepseekRotaryEmbedding (rotate_half), the eager
DeepseekAttention, DeepseekMLP, MoEGate, AddAuxiliaryLoss, DeepseekMoE's training branch,
DeepseekDecoderLayer, DeepseekForCausalLM), and saves the checkpoint in the Hub's format (config.json keyed
like deepseek-moe-16b's, tensor names of DeepseekForCausalLM).

`--modeling-dir DIR` (a folder holding the Hub's modeling_deepseek.py and configuration_deepseek.py; under
a transformers that can import them, e.g. 4.44) also builds DeepSeek's own DeepseekForCausalLM, loads the
composed model's weights into it (strictly, so the tensor names are checked too) and fails unless its
logits, loss, per-layer aux losses and every gradient agree with the composed model's.

For each configuration below this writes `fixtures/deepseek/<name>/`:
  - config.json, model.safetensors : the tiny random checkpoint in the Hub's format
  - reference.safetensors          : input_ids [B, S] (int64), logits [B, S, V], lm_loss (what the model
                                     returns as `loss`), aux_loss (sum over MoE layers of the gates' aux
                                     losses divided by aux_loss_alpha), loss = lm_loss + aux_loss_alpha *
                                     aux_loss (each [1]), and `grad.<hub name>` for every parameter from
                                     `loss.backward()` in train mode: DeepSeek adds the aux loss through
                                     AddAuxiliaryLoss, whose backward feeds it a gradient of 1, so these
                                     are the gradients of `loss`, not of lm_loss.

A `*_bf16` configuration is saved with its weights in bfloat16; its reference is computed in float32 from
the checkpoint loaded back as float32 (so from the bf16-rounded weights).

Routing is discontinuous, so a seed is kept only when, in every MoE layer and for every token, the k-th
and (k+1)-th gate scores differ by more than MARGIN.

Usage:  python3 -m venv .venv && .venv/bin/pip install torch transformers safetensors
        .venv/bin/python scripts/make_deepseek_moe_fixtures.py [--out fixtures/deepseek] [--seed N]
                                                                [--modeling-dir DIR]
CI does not run this; the fixtures it made are committed.
"""
import argparse
import copy
import importlib.util
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

MARGIN = 2e-4

CONFIGS = {
    # Layer 0 dense (first_k_dense_replace 1), layers 1-2 MoE (moe_layer_freq 1), two shared experts
    # (one SwiGLU of width 2 * moe_intermediate_size), top-3 of 8 renormalised, sequence-level aux loss,
    # GQA ratio 2.
    "shared2_freq1_seqaux_norm": dict(
        vocab_size=97, hidden_size=32, intermediate_size=40, moe_intermediate_size=12,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2,
        first_k_dense_replace=1, moe_layer_freq=1, norm_topk_prob=True, seq_aux=True,
        aux_loss_alpha=0.01, rope_theta=10000.0, rms_norm_eps=1e-6,
        batch=2, seq=11,
    ),
    # moe_layer_freq 2 with first_k_dense_replace 1: layers 0, 1, 3 dense, layers 2 and 4 MoE; no shared
    # experts (n_shared_experts null), top-2 of 6 not renormalised, token-level (non-seq) aux loss, MHA.
    "noshared_freq2_tokaux": dict(
        vocab_size=64, hidden_size=32, intermediate_size=24, moe_intermediate_size=10,
        num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=None,
        first_k_dense_replace=1, moe_layer_freq=2, norm_topk_prob=False, seq_aux=False,
        aux_loss_alpha=0.02, rope_theta=100000.0, rms_norm_eps=1e-5,
        batch=3, seq=9,
    ),
    # bfloat16 checkpoint: layer 0 dense, layer 1 MoE, one shared expert, top-2 of 4 renormalised,
    # sequence-level aux loss, MHA.
    "shared1_seqaux_bf16": dict(
        vocab_size=80, hidden_size=32, intermediate_size=24, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, moe_layer_freq=1, norm_topk_prob=True, seq_aux=True,
        aux_loss_alpha=0.01, rope_theta=10000.0, rms_norm_eps=1e-6,
        batch=2, seq=8, bf16=True,
    ),
}


def hub_config(spec, dtype):
    """config.json with deepseek-moe-16b-base's keys (its `auto_map` left out: the remote code is not
    shipped here)."""
    return {
        "architectures": ["DeepseekForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "aux_loss_alpha": spec["aux_loss_alpha"],
        "bos_token_id": 0,
        "eos_token_id": 1,
        "first_k_dense_replace": spec["first_k_dense_replace"],
        "hidden_act": "silu",
        "hidden_size": spec["hidden_size"],
        "initializer_range": 0.1,
        "intermediate_size": spec["intermediate_size"],
        "max_position_embeddings": 64,
        "model_type": "deepseek",
        "moe_intermediate_size": spec["moe_intermediate_size"],
        "moe_layer_freq": spec["moe_layer_freq"],
        "n_routed_experts": spec["n_routed_experts"],
        "n_shared_experts": spec["n_shared_experts"],
        "norm_topk_prob": spec["norm_topk_prob"],
        "num_attention_heads": spec["num_attention_heads"],
        "num_experts_per_tok": spec["num_experts_per_tok"],
        "num_hidden_layers": spec["num_hidden_layers"],
        "num_key_value_heads": spec["num_key_value_heads"],
        "pretraining_tp": 1,
        "rms_norm_eps": spec["rms_norm_eps"],
        "rope_scaling": None,
        "rope_theta": spec["rope_theta"],
        "scoring_func": "softmax",
        "seq_aux": spec["seq_aux"],
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "use_cache": True,
        "vocab_size": spec["vocab_size"],
    }


# ---- The model, composed from modeling_deepseek.py's eager path ------------------------------------------

class Cfg:
    def __init__(self, d):
        self.__dict__.update(d)


class RMSNorm(nn.Module):
    def __init__(self, size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = c.hidden_size // self.heads
        assert self.head_dim * self.heads == c.hidden_size
        self.q_proj = nn.Linear(c.hidden_size, self.heads * self.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=c.attention_bias)
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        t = torch.arange(s, dtype=self.inv_freq.dtype)
        emb = torch.cat([torch.outer(t, self.inv_freq)] * 2, dim=-1)  # positions 0..S-1
        cos, sin = emb.cos().to(x.dtype)[None, None], emb.sin().to(x.dtype)[None, None]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        if rep > 1:  # repeat_kv (which returns its input untouched when rep == 1)
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        w = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        mask = torch.full((s, s), torch.finfo(x.dtype).min).triu(1)  # _prepare_4d_causal_attention_mask
        w = F.softmax(w + mask, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(w, v).transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, c, inter):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEGate(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.top_k, self.n_experts = c.num_experts_per_tok, c.n_routed_experts
        self.alpha, self.seq_aux, self.norm_topk_prob = c.aux_loss_alpha, c.seq_aux, c.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(self.n_experts, c.hidden_size))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # not re-initialised by _init_weights

    def forward(self, x):
        b, s, h = x.shape
        x = x.view(-1, h)
        scores = F.linear(x, self.weight, None).softmax(dim=-1)  # in the activations' dtype
        topk_weight, topk_idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        if self.top_k > 1 and self.norm_topk_prob:
            topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
        aux_loss = None
        if self.training and self.alpha > 0.0:
            idx = topk_idx.view(b, -1)
            if self.seq_aux:
                ce = torch.zeros(b, self.n_experts)
                ce.scatter_add_(1, idx, torch.ones(b, s * self.top_k)).div_(s * self.top_k / self.n_experts)
                aux_loss = (ce * scores.view(b, s, -1).mean(dim=1)).sum(dim=1).mean() * self.alpha
            else:
                ce = F.one_hot(idx.view(-1), num_classes=self.n_experts).float().mean(0)
                aux_loss = (scores.mean(0) * ce * self.n_experts).sum() * self.alpha
        return topk_idx, topk_weight, aux_loss


class AddAuxiliaryLoss(torch.autograd.Function):
    """Returns x; in backward gives `loss` a gradient of 1 (whatever reaches x)."""

    @staticmethod
    def forward(ctx, x, loss):
        assert loss.numel() == 1
        ctx.dtype = loss.dtype
        ctx.required_aux_loss = loss.requires_grad
        return x

    @staticmethod
    def backward(ctx, grad_output):
        grad_loss = None
        if ctx.required_aux_loss:
            grad_loss = torch.ones(1, dtype=ctx.dtype, device=grad_output.device)
        return grad_output, grad_loss


class MoE(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.k = c.num_experts_per_tok
        self.experts = nn.ModuleList([MLP(c, c.moe_intermediate_size) for _ in range(c.n_routed_experts)])
        self.gate = MoEGate(c)
        self.shared_experts = None
        if c.n_shared_experts is not None:
            self.shared_experts = MLP(c, c.moe_intermediate_size * c.n_shared_experts)

    def forward(self, x):
        identity, shape = x, x.shape
        topk_idx, topk_weight, aux_loss = self.gate(x)
        assert self.training, "the reference is the training branch"
        x = x.view(-1, x.shape[-1]).repeat_interleave(self.k, dim=0)
        flat = topk_idx.view(-1)
        y = torch.empty_like(x)
        for i, expert in enumerate(self.experts):
            y[flat == i] = expert(x[flat == i])
        y = (y.view(*topk_weight.shape, -1) * topk_weight.unsqueeze(-1)).sum(dim=1).view(*shape)
        y = AddAuxiliaryLoss.apply(y, aux_loss)
        if self.shared_experts is not None:
            y = y + self.shared_experts(identity)
        return y


class Layer(nn.Module):
    def __init__(self, c, i):
        super().__init__()
        self.self_attn = Attention(c)
        moe = c.n_routed_experts is not None and i >= c.first_k_dense_replace and i % c.moe_layer_freq == 0
        self.mlp = MoE(c) if moe else MLP(c, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList([Layer(c, i) for i in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class DeepseekForCausalLM(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.config = c
        self.model = Body(c)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        for m in self.modules():  # DeepseekPreTrainedModel._init_weights
            if isinstance(m, (nn.Linear, nn.Embedding)):
                m.weight.data.normal_(mean=0.0, std=c.initializer_range)

    def forward(self, input_ids, labels):
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x)
        logits = self.lm_head(self.model.norm(x)).float()
        v = logits.shape[-1]
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, v), labels[:, 1:].reshape(-1))
        return loss, logits


# ---- Fixtures ----------------------------------------------------------------------------------------------

def gates(model):
    return [m for m in model.modules() if type(m).__name__ == "MoEGate"]


def run(model, ids, official=False):
    """Train-mode forward and backward. Returns logits, lm_loss, the gates' aux losses (with alpha, from
    forward hooks), and the gradients by name."""
    aux, hooks = [], []
    for g in gates(model):
        hooks.append(g.register_forward_hook(lambda m, i, o: aux.append(o[2])))
    model.zero_grad(set_to_none=True)
    model.train()
    if official:
        out = model(input_ids=ids, labels=ids, use_cache=False)
        loss, logits = out.loss, out.logits
    else:
        loss, logits = model(ids, ids)
    for h in hooks:
        h.remove()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return logits.detach(), loss.detach(), [a.detach() for a in aux], grads


def min_routing_margin(model, ids):
    scores = []
    hooks = [g.register_forward_hook(lambda m, i, o: scores.append(
        F.linear(i[0].reshape(-1, i[0].shape[-1]), m.weight).softmax(-1).detach())) for g in gates(model)]
    with torch.no_grad():
        model.train()
        model(ids, ids)
    for h in hooks:
        h.remove()
    k = model.config.num_experts_per_tok
    m = float("inf")
    for s in scores:
        top = torch.topk(s, k + 1, dim=-1).values
        m = min(m, float((top[:, k - 1] - top[:, k]).min()))
    return m


def load_official(modeling_dir):
    """DeepSeek's own modeling_deepseek.py / configuration_deepseek.py as the package `deepseek_hub`."""
    spec = importlib.util.spec_from_file_location(
        "deepseek_hub", os.path.join(modeling_dir, "modeling_deepseek.py"),
        submodule_search_locations=[modeling_dir])
    pkg = importlib.util.module_from_spec(spec)
    pkg.__path__ = [modeling_dir]
    sys.modules["deepseek_hub"] = pkg
    import importlib as il
    try:
        conf = il.import_module("deepseek_hub.configuration_deepseek")
        mod = il.import_module("deepseek_hub.modeling_deepseek")
    except Exception as e:  # noqa: BLE001
        raise SystemExit(f"DeepSeek's modeling file does not import under transformers "
                         f"{transformers.__version__}: {e!r}")
    return conf, mod


def cross_check(official, cfg_json, model, ids, ours):
    conf, mod = official
    c = conf.DeepseekConfig(**{k: v for k, v in cfg_json.items() if k not in ("architectures", "torch_dtype")},
                            attn_implementation="eager")
    c._attn_implementation = "eager"
    ref = mod.DeepseekForCausalLM(c).float()
    ref.load_state_dict(model.state_dict(), strict=True)
    logits, lm, aux, grads = run(ref, ids, official=True)
    o_logits, o_lm, o_aux, o_grads = ours
    worst = max(float((logits - o_logits).abs().max()), float((lm - o_lm).abs()),
                max(float((a - b).abs()) for a, b in zip(aux, o_aux)))
    assert len(aux) == len(o_aux) and set(grads) == set(o_grads)
    gworst = max(float((grads[n] - o_grads[n]).abs().max() / (o_grads[n].abs().max() + 1e-12)) for n in grads)
    print(f"  official modeling_deepseek.py: max |diff| logits/losses {worst:.2e}, "
          f"max relative grad diff {gworst:.2e}")
    assert worst < 1e-5 and gworst < 1e-5, "the composed model disagrees with DeepSeek's code"


def save_checkpoint(model, cfg_json, d, dtype):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg_json, f, indent=2, sort_keys=True)
        f.write("\n")
    sd = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    save_file(sd, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})


def make(name, spec, out_dir, seed, official):
    spec = dict(spec)
    batch, seq, bf16 = spec.pop("batch"), spec.pop("seq"), spec.pop("bf16", False)
    cfg_json = hub_config(spec, "bfloat16" if bf16 else "float32")
    c = Cfg(cfg_json)
    for attempt in range(100):
        torch.manual_seed(seed + attempt)
        model = DeepseekForCausalLM(c).float()
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:  # norms: move them off their trivial init
                    p.add_(0.1 * torch.randn_like(p))
                if bf16:  # the margin must hold for the weights the checkpoint will hold
                    p.copy_(p.bfloat16().float())
        ids = torch.randint(0, c.vocab_size, (batch, seq))
        margin = min_routing_margin(model, ids)
        if margin > MARGIN:
            break
    else:
        raise SystemExit(f"{name}: no seed gave a routing margin above {MARGIN}")
    d = os.path.join(out_dir, name)
    save_checkpoint(model, cfg_json, d, torch.bfloat16 if bf16 else torch.float32)
    # The reference comes from the checkpoint as saved, read back as float32.
    model = DeepseekForCausalLM(c)
    model.load_state_dict({k: v.float() for k, v in load_file(os.path.join(d, "model.safetensors")).items()},
                          strict=True)
    assert min_routing_margin(model, ids) == margin
    ours = run(model, ids)
    logits, lm_loss, aux, grads = ours
    if official is not None:
        cross_check(official, cfg_json, model, ids, ours)
    alpha = c.aux_loss_alpha
    aux_loss = torch.stack(aux).sum() / alpha
    tensors = {
        "input_ids": ids.to(torch.int64).contiguous(),
        "logits": logits.float().contiguous(),
        "loss": (lm_loss + alpha * aux_loss).reshape(1).float(),
        "lm_loss": lm_loss.reshape(1).float(),
        "aux_loss": aux_loss.reshape(1).float(),
    }
    tensors.update({f"grad.{n}": g.float().contiguous() for n, g in grads.items()})
    save_file(tensors, os.path.join(d, "reference.safetensors"),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__,
                        "seed": str(seed + attempt), "routing_margin": f"{margin:.3e}",
                        "model": "composed from modeling_deepseek.py (deepseek-moe-16b)"})
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        assert {f"grad.{k}" for k in f.keys()} == {k for k in tensors if k.startswith("grad.")}
    moe = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, MoE)]
    print(f"{name}: loss {float(tensors['loss']):.6f} lm {float(lm_loss):.6f} aux {float(aux_loss):.6f} "
          f"margin {margin:.2e} seed {seed + attempt} moe layers {moe} "
          f"params {sum(p.numel() for p in model.parameters())}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "fixtures", "deepseek"))
    ap.add_argument("--seed", type=int, default=8642)
    ap.add_argument("--modeling-dir", help="folder with the Hub's modeling_deepseek.py and "
                    "configuration_deepseek.py, to cross-check the composed model against")
    args = ap.parse_args()
    torch.set_default_dtype(torch.float32)
    official = load_official(os.path.abspath(args.modeling_dir)) if args.modeling_dir else None
    for i, (name, spec) in enumerate(CONFIGS.items()):
        make(name, spec, args.out, args.seed + 100 * i, official)


if __name__ == "__main__":
    main()
