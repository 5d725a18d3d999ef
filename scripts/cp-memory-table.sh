#!/usr/bin/env bash
# The memory table of docs/performance.md ("Context parallelism: memory per attention worker"):
# benches/qwen3-moe-cpu.json at 8192 tokens per sequence under `mpirun -np 3`, disagg with 2
# attention workers and 1 expert worker in one group, batch 2 in 2 micro-batches, one step; each
# run once without context parallelism (each attention worker holds its micro-batch's whole
# sequence) and once with `--context-parallel 2` (each holds half of every sequence), each with
# and without `--recompute attention`; per attention rank the peak RSS of its process, and the
# ratio of context parallelism's to the run without it.
#
# In flight: without context parallelism each attention worker owns one micro-batch (window 1);
# with it each owns a unit (half a sequence) of both micro-batches. The table has both windows of
# the run with context parallelism: 2 (the same micro-batches in flight over the group as without:
# both) and 1.
#
#   cargo build --release --features mpi --bin disagmoe
#   scripts/cp-memory-table.sh [BINARY] [SEQ]
#
# Needs mpirun (Open MPI) and python3. Runs as root with Open MPI's consent variables set.
set -euo pipefail
bin=${1:-target/release/disagmoe}
seq=${2:-8192}
[[ -x "$bin" ]] || { echo "no binary at $bin (cargo build --release --features mpi --bin disagmoe)" >&2; exit 2; }
command -v mpirun >/dev/null || { echo "mpirun not found (apt-get install openmpi-bin)" >&2; exit 2; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
runs=()
for recompute in none attention; do
  for cp_window in "1 1" "2 2" "2 1"; do
    read -r cp window <<<"$cp_window"
    name="$recompute-cp$cp-w$window"
    runs+=("$name")
    start=$(date +%s%N)
    mpirun --oversubscribe -np 3 "$bin" train --model-config benches/qwen3-moe-cpu.json --steps 1 --batch 2 \
      --seq "$seq" --micro-batches 2 --placement disagg --attn-workers 2 --ffn-workers 1 --groups 1 \
      --context-parallel "$cp" --in-flight "$window" --recompute "$recompute" --transport mpi --json \
      >"$out/$name.out" 2>"$out/$name.err" || {
      cat "$out/$name.err" >&2
      exit 1
    }
    end=$(date +%s%N)
    tail -n 1 "$out/$name.out" >"$out/$name.json"
    echo "$(( (end - start) / 1000000 ))" >"$out/$name.ms"
  done
done
python3 - "$out" "$seq" "${runs[@]}" <<'EOF'
import json, sys
out, seq, names = sys.argv[1], sys.argv[2], sys.argv[3:]
runs = {n: json.load(open(f"{out}/{n}.json")) for n in names}
secs = {n: int(open(f"{out}/{n}.ms").read()) / 1000 for n in names}
print(f"seq {seq}, batch 2 in 2 micro-batches, disagg 2+1 in one group, one step")
print()
print("| recompute | context parallel | in flight | attention rank 0 peak RSS MB | attention rank 1 | expert rank | C / without, rank 0 | rank 1 | loss | wall s |")
print("|---|---|---|---|---|---|---|---|---|---|")
for n in names:
    recompute, cp, window = n.split("-")
    rss = runs[n]["peak_rss_mb_per_rank"]
    base = runs[f"{recompute}-cp1-w1"]["peak_rss_mb_per_rank"]
    ratio = [f"{r / b:.3f}" for r, b in zip(rss[:2], base[:2])]
    print(f"| {recompute} | {cp[2:]} | {window[1:]} | {rss[0]:,.0f} | {rss[1]:,.0f} | {rss[2]:,.0f} | {ratio[0]} | {ratio[1]} | "
          f"{runs[n]['losses'][0]:.6f} | {secs[n]:.1f} |")
EOF
