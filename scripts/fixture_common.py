"""Helpers shared by the `make_*_fixtures.py` scripts."""
import argparse
import os

import torch
import transformers
from safetensors.torch import save_file


def hub_grads(model, moe_intermediate_size):
    """Every parameter's gradient as `grad.<hub name>`, fused experts split into the Hub's per-expert
    names: `experts.gate_up_proj` [E, 2I, M] (gate rows first) and `experts.down_proj` [E, M, I]."""
    out = {}
    inter = moe_intermediate_size
    for name, p in model.named_parameters():
        g = p.grad.detach().clone().float()
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for j in range(g.shape[0]):
                out[f"grad.{base}{j}.gate_proj.weight"] = g[j, :inter].contiguous()
                out[f"grad.{base}{j}.up_proj.weight"] = g[j, inter:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for j in range(g.shape[0]):
                out[f"grad.{base}{j}.down_proj.weight"] = g[j].contiguous()
        else:
            out[f"grad.{name}"] = g.contiguous()
    return out


def save_fixture(model, out_dir, reference, seed, margin):
    """Writes `out_dir/` with the checkpoint (`save_pretrained`) and `reference.safetensors`: every
    tensor of `reference` (int64 stays int64, the rest becomes float32; 0-d becomes [1]), with the
    versions, the seed and the routing margin in the metadata."""
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tensors = {}
    for k, t in reference.items():
        t = t.detach()
        t = t.to(torch.int64) if k == "input_ids" else t.float()
        tensors[k] = (t.reshape(1) if t.dim() == 0 else t).clone().contiguous()
    save_file(tensors, os.path.join(out_dir, "reference.safetensors"),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__,
                        "seed": str(seed), "routing_margin": f"{margin:.3e}"})


def main(family, configs, make, default_seed):
    """Command line of a fixture script: `--out` (default `fixtures/<family>`) and `--seed`; calls
    `make(name, spec, out_dir, seed)` for each configuration, seeds 100 apart."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "fixtures", family))
    ap.add_argument("--seed", type=int, default=default_seed)
    args = ap.parse_args()
    torch.set_default_dtype(torch.float32)
    for i, (name, spec) in enumerate(configs.items()):
        make(name, spec, args.out, args.seed + 100 * i)
