#!/usr/bin/env python3
"""Interop checks against Hugging Face transformers (run by hand; CI has no Python).

1. transformers -> disagmoe: a fresh random Qwen3-MoE saved by `save_pretrained` (in float32 and in
   bfloat16, sharded) is run by `disagmoe forward`; its logits must match transformers' float32
   logits within 1e-4 relative error.
2. disagmoe -> transformers: the final model written by `disagmoe train --out`, and a training
   checkpoint (`--checkpoint-dir`, step-<n>/), each written by one device and by a disaggregated
   run (every worker its own shards), are loaded by `from_pretrained`; transformers' logits must
   match `disagmoe forward` on the same directory. The final model saved with `--save-dtype bf16`
   loads as bfloat16 (`dtype="auto"` reads its config) and matches the same way.

Usage: .venv/bin/python scripts/check_hf_roundtrip.py --bin target/release/disagmoe
"""
import argparse
import json
import os
import subprocess
import tempfile

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM, GptOssConfig, GptOssForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM


def rel(a, b):
    return float((a - b).norm() / b.norm())


def ours_forward(binary, model_dir, ids, work):
    ids_path = os.path.join(work, "ids.json")
    out_path = os.path.join(work, "logits.safetensors")
    with open(ids_path, "w") as f:
        json.dump(ids.tolist(), f)
    res = subprocess.run([binary, "forward", "--model-dir", model_dir, "--input-ids", ids_path, "--out", out_path],
                         check=True, capture_output=True, text=True)
    loss = json.loads(res.stdout.strip().splitlines()[-1])["loss"]
    return load_file(out_path)["logits"], loss


def hf_logits(model_dir, ids):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    # Next-token cross-entropy alone (transformers' `loss` adds the aux term when the config asks).
    lm = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    return logits, float(lm)


def random_models():
    torch.manual_seed(7)
    yield "qwen3_moe", Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=151, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, head_dim=24, num_experts=16, num_experts_per_tok=4,
        norm_topk_prob=True, mlp_only_layers=[2], rope_theta=1e6, initializer_range=0.08, tie_word_embeddings=False))
    cfg = GptOssConfig(vocab_size=151, hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
                       initializer_range=0.08)
    cfg._attn_implementation = "eager"
    yield "gpt_oss", GptOssForCausalLM(cfg)
    yield "deepseek_v3", DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=151, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, initializer_range=0.08, max_position_embeddings=128))


def check_hf_to_ours(binary, work):
    for family, model in random_models():
        check_one(binary, work, family, model)


def check_one(binary, work, family, model):
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    for dtype in (torch.float32, torch.bfloat16):
        d = os.path.join(work, f"hf_{family}_{str(dtype).split('.')[-1]}")
        model.to(dtype).save_pretrained(d, max_shard_size="100KB")
        ref, ref_loss = hf_logits(d, ids)
        ours, loss = ours_forward(binary, d, ids, work)
        print(f"transformers -> disagmoe ({family}, {dtype}, {len([f for f in os.listdir(d) if f.endswith('.safetensors')])} shards): "
              f"logits rel err {rel(ours, ref):.2e}, loss {loss:.6f} vs {ref_loss:.6f}")
        assert rel(ours, ref) <= 1e-4


# One process writes the whole model (`single`), or every worker writes its own shard and rank 0 the
# index (`disagg`: no worker holds the whole model).
PLACEMENTS = {
    "single": ["--placement", "single"],
    "disagg": ["--placement", "disagg", "--attn-workers", "2", "--ffn-workers", "2", "--groups", "2"],
}


def check_ours_to_hf(binary, work):
    for preset in ("tiny-qwen3-moe", "tiny-gpt-oss", "tiny-deepseek-v3", "tiny-mixtral", "tiny-olmoe"):
        for placement in PLACEMENTS:
            check_ours_one(binary, work, preset, placement)


def check_ours_one(binary, work, preset, placement):
    out = os.path.join(work, f"run_{preset}_{placement}")
    ck = os.path.join(work, f"ck_{preset}_{placement}")
    subprocess.run([binary, "train", "--model-preset", preset, "--steps", "3", "--batch", "4", "--seq", "32",
                    "--out", out, "--checkpoint-dir", ck, "--checkpoint-every", "2", "--quiet"] + PLACEMENTS[placement],
                   check=True, capture_output=True)
    for what, d in (("final model", os.path.join(out, "final")), ("checkpoint", os.path.join(ck, "step-00000002"))):
        ids = torch.randint(0, 256, (2, 20))
        ref, ref_loss = hf_logits(d, ids)
        ours, loss = ours_forward(binary, d, ids, work)
        shards = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
        print(f"disagmoe -> transformers ({preset}, {placement} {what}, {len(shards)} shard files): from_pretrained ok, "
              f"logits rel err {rel(ours, ref):.2e}, loss {loss:.6f} vs {ref_loss:.6f}")
        assert rel(ours, ref) <= 1e-4
    # The final model in bfloat16: transformers takes its dtype from config.json.
    out16 = out + "_bf16"
    subprocess.run([binary, "train", "--model-preset", preset, "--steps", "3", "--batch", "4", "--seq", "32",
                    "--out", out16, "--save-dtype", "bf16", "--quiet"] + PLACEMENTS[placement],
                   check=True, capture_output=True)
    d = os.path.join(out16, "final")
    auto = AutoModelForCausalLM.from_pretrained(d, dtype="auto")
    assert auto.dtype == torch.bfloat16, auto.dtype
    ids = torch.randint(0, 256, (2, 20))
    ref, ref_loss = hf_logits(d, ids)
    ours, loss = ours_forward(binary, d, ids, work)
    print(f"disagmoe -> transformers ({preset}, {placement} final model in bf16): loads as {auto.dtype}, "
          f"logits rel err {rel(ours, ref):.2e}, loss {loss:.6f} vs {ref_loss:.6f}")
    assert rel(ours, ref) <= 1e-4


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/disagmoe")
    args = ap.parse_args()
    binary = os.path.abspath(args.bin)
    with tempfile.TemporaryDirectory() as work:
        check_hf_to_ours(binary, work)
        check_ours_to_hf(binary, work)
    print("all interop checks passed")


if __name__ == "__main__":
    main()
