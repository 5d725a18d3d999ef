#!/usr/bin/env bash
# The simulator against the runtime: `disagmoe compare --predict` (ep, ep-overlap, disagg; each
# predicted from a calibration run without link emulation) over several emulated link rates and
# model configs, with as many workers as cores, REPEATS times in alternation (each time with its
# own calibration); prints a Markdown table of the medians of predicted and measured step time
# (with the measured spread) and exposed communication (the runtime's `in_flight_wait_s`: waits
# while the awaited data was queued for or on the wire), and keeps every run's JSON.
#
#   scripts/validate-simulator.sh                  # build (release, --features mpi) and sweep
#   BIN=path/to/disagmoe scripts/validate-simulator.sh
#   options by environment: LINKS="0.1 0.2 0.4" (Gbit/s), LATENCY_US=20, STEPS=4, REPEATS=3,
#   MODELS="benches/afpipe-compare.json benches/afpipe-compare-gptoss.json",
#   WORKERS=$(nproc), OUT=target/validate-simulator.jsonl, TABLE=docs/simulator-validation.md
#   (the file whose `validate-simulator.sh` section gets the table; `disagmoe reproduce-paper` puts
#   the file into docs/paper-reproduction.md)
set -euo pipefail
cd "$(dirname "$0")/.."
LINKS=${LINKS:-"0.1 0.2 0.4"}
LATENCY_US=${LATENCY_US:-20}
STEPS=${STEPS:-4}
REPEATS=${REPEATS:-3}
MODELS=${MODELS:-"benches/afpipe-compare.json benches/afpipe-compare-gptoss.json"}
WORKERS=${WORKERS:-$(nproc)}
OUT=${OUT:-target/validate-simulator.jsonl}
TABLE=${TABLE:-docs/simulator-validation.md}
command -v jq >/dev/null || { echo "validate-simulator: needs jq (apt-get install jq)" >&2; exit 2; }
if [[ $WORKERS -lt 2 ]]; then
  echo "validate-simulator: needs at least 2 workers (WORKERS=$WORKERS)" >&2
  exit 2
fi
if [[ -z ${BIN:-} ]]; then
  cargo build --release --features mpi --bin disagmoe
  BIN=target/release/disagmoe
fi
# The code measured (before the table below is written, which changes the tree).
CODE="$(git rev-parse --short HEAD 2>/dev/null || echo "?")$(git diff --quiet HEAD 2>/dev/null || echo " with uncommitted changes")"
ATTN=$((WORKERS / 2))
FFN=$((WORKERS - ATTN))
MBS=$((8 * WORKERS))
mkdir -p "$(dirname "$OUT")"
: >"$OUT"
for rep in $(seq "$REPEATS"); do
  for model in $MODELS; do
    for link in $LINKS; do
      echo "validate-simulator: round $rep/$REPEATS, $model at $link Gbit/s ($ATTN+$FFN disagg, ep on $WORKERS)" >&2
      "$BIN" compare --model-config "$model" --attn-workers "$ATTN" --ffn-workers "$FFN" --groups 1 \
        --batch $((2 * MBS)) --seq 128 --micro-batches "$MBS" --steps "$STEPS" \
        --link-latency-us "$LATENCY_US" --link-gbps "$link" --predict --json --quiet 2>/dev/null |
        tail -n 1 |
        jq -c --arg model "$(basename "$model" .json)" --arg link "$link" --argjson rep "$rep" \
          '{model: $model, link_gbps: ($link | tonumber), round: $rep, calibrations: .calibrations, runs: [.runs[] | del(.summary)]}' \
          >>"$OUT"
    done
  done
done
# Medians per (model, link, run) over the rounds.
{
  echo "Measured $(date -u +%Y-%m-%d) on $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')),"
  echo "binary \`$BIN\` at $CODE, \`scripts/validate-simulator.sh\` (REPEATS=$REPEATS STEPS=$STEPS"
  echo "LATENCY_US=$LATENCY_US; $ATTN+$FFN workers for disagg, $WORKERS for ep, 1 thread each; batch $((2 * MBS)) x 128 in $MBS micro-batches):"
  echo
jq -s '
  def median: sort | if length % 2 == 1 then .[length / 2 | floor] else (.[length / 2 - 1] + .[length / 2]) / 2 end;
  def r3: . * 1000 | round / 1000;
  [.[] | . as $r | .runs[] | . + {model: $r.model, link_gbps: $r.link_gbps}]
  | group_by([.model, .link_gbps, .placement])
  | map({model: .[0].model, link_gbps: .[0].link_gbps, placement: .[0].placement, in_flight: .[0].in_flight, rounds: length,
         step: ([.[].step_s] | median), step_min: ([.[].step_s] | min), step_max: ([.[].step_s] | max),
         predicted: ([.[].predicted_step_s] | median),
         exposed: ([.[].in_flight_wait_s] | median), predicted_exposed: ([.[].predicted_exposed_comm_s] | median)})
  | sort_by(.model, .link_gbps, (.placement | if . == "ep" then 0 elif . == "ep-overlap" then 1 else 2 end))
  | (["| model | link | run | in flight | step measured (min-max) | step predicted | error | exposed comm (on the wire) measured | predicted |",
      "|---|---|---|---|---|---|---|---|---|"]
     + map("| \(.model) | \(.link_gbps) Gbit/s | \(.placement) | \(.in_flight) | \(.step | r3) s (\(.step_min | r3)-\(.step_max | r3)) | \(.predicted | r3) s | \((.predicted - .step) / .step * 1000 | round / 10 | if . == 0 then 0 else . end)% | \(.exposed | r3) s | \(.predicted_exposed | r3) s |")
     + ["", "worst |error| \([.[] | ((.predicted - .step) / .step | fabs)] | max * 1000 | round / 10)%, mean \([.[] | ((.predicted - .step) / .step | fabs)] | add / length * 1000 | round / 10)% over \(length) configurations, \(.[0].rounds) rounds each"])
  | .[]' -r "$OUT"
} >"$OUT.table.md"
cat "$OUT.table.md"
# This script's section of the table file (the other validation's stays as it is).
scripts/splice-section.sh "$TABLE" validate-simulator.sh <"$OUT.table.md"
