#!/usr/bin/env bash
# The simulator against a real network (issue 33): MPI over TCP between network namespaces
# (scripts/netns-cluster.sh), links shaped by tc tbf at several rates. For each rate:
#   1. `disagmoe net-bench` on 2 ranks (as the training runs) times ping-pongs, bursts and
#      exchanges and fits the link model (rate, latency, per-message cost, full or half duplex)
#      that the prediction then uses: the fitted values, not the tbf setting; on 4 ranks, the same
#      with incasts into one port, reported beside it;
#   2. ep, ep-overlap and disagg train under `--transport mpi` on 2 ranks of that network (REPEATS
#      rounds, the placements alternating within each), measured;
#   3. `disagmoe predict` predicts each from a calibration run that is none of the measured ones:
#      the same configuration traced over the same transport with the links unshaped, once per
#      model and placement before any measured run.
# Prints a Markdown table of the medians (with the measured spread) and keeps every JSON.
#
#   scripts/validate-network.sh                 # build (release, --features mpi) and sweep; needs root
#   BIN=path/to/disagmoe scripts/validate-network.sh
#   options by environment: RATES="100 200 400" (Mbit/s), STEPS=4, REPEATS=3,
#   MODELS="benches/afpipe-compare.json benches/afpipe-compare-gptoss.json",
#   SIZES=16384,65536,131072,262144,1048576 (net-bench's message sizes: around the exchange's,
#   128-136 KB for these models), OUT=target/validate-network, TABLE=docs/simulator-validation.md
#   (the file whose `validate-network.sh` section gets the table, beside the emulated one)
set -euo pipefail
cd "$(dirname "$0")/.."
RATES=${RATES:-"100 200 400"}
STEPS=${STEPS:-4}
REPEATS=${REPEATS:-3}
MODELS=${MODELS:-"benches/afpipe-compare.json benches/afpipe-compare-gptoss.json"}
SIZES=${SIZES:-16384,65536,131072,262144,1048576}
OUT=${OUT:-target/validate-network}
TABLE=${TABLE:-docs/simulator-validation.md}
HARNESS=scripts/netns-cluster.sh
command -v jq >/dev/null || { echo "validate-network: needs jq (apt-get install jq)" >&2; exit 2; }
command -v mpirun >/dev/null || { echo "validate-network: needs mpirun (apt-get install openmpi-bin)" >&2; exit 2; }
[ "$(id -u)" -eq 0 ] || { echo "validate-network: needs root (network namespaces)" >&2; exit 2; }
if [[ -z ${BIN:-} ]]; then
  cargo build --release --features mpi --bin disagmoe
  BIN=target/release/disagmoe
fi
BIN=$(realpath "$BIN")
CODE="$(git rev-parse --short HEAD 2>/dev/null || echo "?")$(git diff --quiet HEAD 2>/dev/null || echo " with uncommitted changes")"
mkdir -p "$OUT"
trap '"$HARNESS" down >/dev/null 2>&1 || true' EXIT INT TERM
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
MBS=16
COMMON=(--batch $((2 * MBS)) --seq 128 --micro-batches "$MBS" --steps "$STEPS" --threads-per-worker 1 --quiet --json)
placement_args() {
  case "$1" in
    ep) echo "--placement ep --workers 2 --in-flight 1" ;;
    ep-overlap) echo "--placement ep --workers 2 --in-flight 2" ;;
    disagg) echo "--placement disagg --attn-workers 1 --ffn-workers 1 --groups 1 --in-flight $MBS" ;;
  esac
}
PLACEMENTS="ep ep-overlap disagg"

# 1. Calibrations: the same transport (MPI over TCP between the namespaces), the links unshaped
#    (tbf at 100 Gbit/s), no link emulation. (Under plain mpirun, over shared memory, the
#    calibration's overhead was 0.46-0.87 s of a 1-1.3 s step, more than the TCP runs spend.)
"$HARNESS" up 2 --rate 100000 >&2
for model in $MODELS; do
  name=$(basename "$model" .json)
  for p in $PLACEMENTS; do
    echo "validate-network: calibrating $name $p (unshaped links)" >&2
    # shellcheck disable=SC2046
    "$HARNESS" run -np 2 -- "$BIN" train "${COMMON[@]}" --model-config "$(realpath "$model")" $(placement_args "$p") \
      --transport mpi --trace "$(realpath "$OUT")/cal-$name-$p.json" >/dev/null
  done
done
"$HARNESS" down >&2

: >"$OUT/runs.jsonl"
for rate in $RATES; do
  "$HARNESS" up 4 --rate "$rate" >&2
  echo "validate-network: net-bench at $rate Mbit/s (2 ranks: the fit; 4 ranks: with incasts)" >&2
  "$HARNESS" run -np 2 -- "$BIN" net-bench --sizes "$SIZES" --out "$OUT/link-$rate.json" >/dev/null
  "$HARNESS" run -np 4 -- "$BIN" net-bench --sizes "$SIZES" --out "$OUT/link4-$rate.json" >/dev/null
  for rep in $(seq "$REPEATS"); do
    for model in $MODELS; do
      name=$(basename "$model" .json)
      for p in $PLACEMENTS; do
        echo "validate-network: round $rep/$REPEATS, $name $p at $rate Mbit/s" >&2
        # shellcheck disable=SC2046
        "$HARNESS" run -np 2 -- "$BIN" train "${COMMON[@]}" --model-config "$(realpath "$model")" $(placement_args "$p") \
          --transport mpi | tail -n 1 >"$OUT/run.json"
        # shellcheck disable=SC2046
        "$BIN" predict "${COMMON[@]}" --model-config "$model" $(placement_args "$p") \
          --calibration-trace "$OUT/cal-$name-$p.json" --link-fit "$OUT/link-$rate.json" >"$OUT/predicted.json"
        jq -c --arg model "$name" --arg p "$p" --argjson rate "$rate" --argjson rep "$rep" --slurpfile pr "$OUT/predicted.json" \
          '{model: $model, placement: $p, rate_mbit: $rate, round: $rep, in_flight: .in_flight,
            step_s: (if .steps >= 2 then (.step_s * .steps - .first_step_s) / (.steps - 1) else .step_s end),
            in_flight_wait_s: .in_flight_wait_s, predicted_step_s: $pr[0].predicted_step_s,
            predicted_exposed_comm_s: $pr[0].predicted_exposed_comm_s, link: $pr[0].link}' \
          "$OUT/run.json" >>"$OUT/runs.jsonl"
      done
    done
  done
  "$HARNESS" down >&2
done

{
  echo "Measured $(date -u +%Y-%m-%d) on $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')),"
  echo "binary \`$BIN\` at $CODE, \`scripts/validate-network.sh\` (REPEATS=$REPEATS STEPS=$STEPS;"
  echo "MPI over TCP between network namespaces, tbf at the rate; 1+1 workers for disagg, 2 for ep, 1 thread each;"
  echo "batch $((2 * MBS)) x 128 in $MBS micro-batches; predictions from a calibration over the unshaped links and the link net-bench fitted):"
  echo
  echo "| tbf rate | fitted link (net-bench, 2 ranks): used by the predictions | the same on 4 ranks, with incasts |"
  echo "|---|---|---|"
  for rate in $RATES; do
    fit() {
      jq -r '"\(.link.gbps * 1000 | . * 10 | round / 10) Mbit/s, latency \(.link.latency_us | round) us, \(.link.per_message_us | round) us per message, \(if .link.half_duplex then "half" else "full" end) duplex; worst error \(.fit_error * 1000 | round / 10)% fitted (bursts, ping-pongs), \(.exchange_error // 0 | . * 1000 | round / 10)% on exchanges\(if .incast_error then ", \(.incast_error * 1000 | round / 10)% on incasts" else "" end) (held out)"' "$1"
    }
    echo "| $rate Mbit/s | $(fit "$OUT/link-$rate.json") | $(fit "$OUT/link4-$rate.json") |"
  done
  echo
  jq -s -r '
    def median: sort | if length % 2 == 1 then .[length / 2 | floor] else (.[length / 2 - 1] + .[length / 2]) / 2 end;
    def r3: . * 1000 | round / 1000;
    group_by([.model, .rate_mbit, .placement])
    | map({model: .[0].model, rate: .[0].rate_mbit, placement: .[0].placement, in_flight: .[0].in_flight, rounds: length,
           step: ([.[].step_s] | median), step_min: ([.[].step_s] | min), step_max: ([.[].step_s] | max),
           predicted: ([.[].predicted_step_s] | median),
           exposed: ([.[].in_flight_wait_s] | median), predicted_exposed: ([.[].predicted_exposed_comm_s] | median)})
    | sort_by(.model, .rate, (.placement | if . == "ep" then 0 elif . == "ep-overlap" then 1 else 2 end))
    | (["| model | tbf rate | run | in flight | step measured (min-max) | step predicted | error | exposed comm (on the wire) measured | predicted |",
        "|---|---|---|---|---|---|---|---|---|"]
       + map("| \(.model) | \(.rate) Mbit/s | \(.placement) | \(.in_flight) | \(.step | r3) s (\(.step_min | r3)-\(.step_max | r3)) | \(.predicted | r3) s | \((.predicted - .step) / .step * 1000 | round / 10 | if . == 0 then 0 else . end)% | \(.exposed | r3) s | \(.predicted_exposed | r3) s |")
       + ["", "worst |error| \([.[] | ((.predicted - .step) / .step | fabs)] | max * 1000 | round / 10)%, mean \([.[] | ((.predicted - .step) / .step | fabs)] | add / length * 1000 | round / 10)% over \(length) configurations, \(.[0].rounds) rounds each"])
    | .[]' "$OUT/runs.jsonl"
} >"$OUT.table.md"
cat "$OUT.table.md"
# This script's section of the table file (the other validation's stays as it is).
scripts/splice-section.sh "$TABLE" validate-network.sh <"$OUT.table.md"
