#!/usr/bin/env bash
# The memory table of docs/runtime.md ("The distributed optimizer: memory per rank"):
# benches/disagg-300m.json under `mpirun -np 6`, disagg with 4 attention workers in 2 groups (2
# copies per group) and 2 expert workers, under --precision f32 and bf16, with and without the
# distributed optimizer: per rank the parameters held, the bytes of weights, gradients and
# optimizer moments (`state_per_rank`, counted from the live tensors) and the peak RSS of its
# process; then, per attention rank, its state with the optimizer on over its state with it off,
# beside the planner's factor: under f32 (4 + 4 + 8/2) / (4 + 4 + 8) = 0.75, under bf16 (bf16
# weights, f32 gradients, f32 master and moments) (2 + 4 + 12/2) / (2 + 4 + 12) = 0.6667 (with
# `-- --optimizer-state-dtype bf16` the moments take 4 bytes instead of 8: 0.8333 and 0.7143).
#
#   cargo build --release --features mpi --bin disagmoe
#   scripts/memory-table.sh [BINARY] [-- extra train options]
#
# Needs mpirun (Open MPI) and python3 (for the table). Runs as root with Open MPI's consent
# variables set. Each run is 2 steps of 4 x 128 tokens in 4 micro-batches.
set -euo pipefail
bin=${1:-target/release/disagmoe}
shift || true
[[ "${1:-}" == "--" ]] && shift
extra=("$@")
[[ -x "$bin" ]] || { echo "no binary at $bin (cargo build --release --features mpi --bin disagmoe)" >&2; exit 2; }
command -v mpirun >/dev/null || { echo "mpirun not found (apt-get install openmpi-bin)" >&2; exit 2; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
for precision in f32 bf16; do
  for opt in off on; do
    mpirun --oversubscribe -np 6 "$bin" train --model-config benches/disagg-300m.json --steps 2 --batch 4 \
      --seq 128 --micro-batches 4 --placement disagg --attn-workers 4 --ffn-workers 2 --groups 2 \
      --transport mpi --precision "$precision" --distributed-optimizer "$opt" --json "${extra[@]}" \
      >"$out/$precision-$opt.out" 2>"$out/$precision-$opt.err" || {
      cat "$out/$precision-$opt.err" >&2
      exit 1
    }
    tail -n 1 "$out/$precision-$opt.out" >"$out/$precision-$opt.json"
  done
done
moments=8
[[ " ${extra[*]} " == *" --optimizer-state-dtype bf16 "* ]] && moments=4
python3 - "$out" "$moments" <<'EOF'
import json, sys
out = sys.argv[1]
moments = float(sys.argv[2])
# Weights + gradients, then the optimizer's bytes (master weights under bf16, then the moments).
held = {"f32": (4 + 4, moments), "bf16": (2 + 4, 4 + moments)}
factor = {p: (w + o / 2) / (w + o) for p, (w, o) in held.items()}
runs = {(p, o): json.load(open(f"{out}/{p}-{o}.json")) for p in ("f32", "bf16") for o in ("off", "on")}
print("| precision | distributed optimizer | rank | role | parameters | weights MB | gradients MB | optimizer MB | state MB | peak RSS MB |")
print("|---|---|---|---|---|---|---|---|---|---|")
roles = ["attention g0.w0", "attention g0.w1", "attention g1.w0", "attention g1.w1", "experts g0", "experts g1"]
for (p, o), s in runs.items():
    for r, (params, st, rss) in enumerate(zip(s["params_per_rank"], s["state_per_rank"], s["peak_rss_mb_per_rank"])):
        mb = lambda b: f"{b / 1e6:,.1f}"
        total = st["params"] + st["grads"] + st["optimizer"]
        print(f"| {p} | {o} | {r} | {roles[r]} | {params / 1e6:.1f}M | {mb(st['params'])} | {mb(st['grads'])} | "
              f"{mb(st['optimizer'])} | {mb(total)} | {rss:,.0f} |")
print()
print("| precision | rank | state on / off | planner's factor | peak RSS on / off | losses off | losses on |")
print("|---|---|---|---|---|---|---|")
for p in ("f32", "bf16"):
    off, on = runs[(p, "off")], runs[(p, "on")]
    for r in range(4):
        a, b = on["state_bytes_per_rank"][r], off["state_bytes_per_rank"][r]
        ra, rb = on["peak_rss_mb_per_rank"][r], off["peak_rss_mb_per_rank"][r]
        fmt = lambda l: ", ".join(f"{x:.4f}" for x in l)
        print(f"| {p} | {r} | {a / b:.4f} | {factor[p]:.4f} | {ra / rb:.3f} | {fmt(off['losses'])} | {fmt(on['losses'])} |")
EOF
