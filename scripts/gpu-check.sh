#!/usr/bin/env bash
# GPU check on an NVIDIA GPU, in two parts:
#  kernels: the kernel tests on CUDA (every kernel against its plain-Burn reference, outputs and
#    gradients, f32 and f16), then achieved TFLOP/s and GB/s of the kernels against ceilings
#    measured in the same run (a large copy, a large dense matmul) at the large shapes of issue #6
#    (16K tokens, hidden 4096, expert size 1536, 64 experts, top-8; attention seq 8K, head dim 128).
#  train: `disagmoe train` on the GPU: the tiny presets of the three families (qwen3-moe, gpt-oss,
#    deepseek-v3) 100 steps in f32 and in bf16 (final losses side by side), then a ~1.2B-parameter
#    Qwen3-MoE (benches/qwen3-moe-1b.json) in bf16, single (with and without --recompute full) and disagg with 4 workers sharing the
#    GPU (--devices cuda:0 x 4): tokens/s, model TFLOP/s and utilisation against the GPU's bf16
#    dense peak (H100/H200/H800 989, A100 312 TFLOP/s), peak device memory (nvidia-smi, sampled).
#  exchange: the same disagg 2+2 on one GPU with the token exchange in f32, bf16 and fp8, its
#    payloads left on the device (the default with one device) and, for f32 and bf16, through the
#    host (--exchange-payloads host): step time, exchange bytes per worker and step, and the
#    payload bytes read back to the host per step (payload_host_bytes; 0 on the device path but
#    for fp8's dispatch, which is packed on the host).
#  cp: context parallelism on the GPU: the same 1B model in f32 (the flash kernel per ring block
#    is f32), disagg 2+2 in one group on 1 GPU at seq 4096, without and with --context-parallel 2:
#    step time, final loss, peak device memory and which attention ran (flash expected).
#
#   scripts/gpu-check.sh                      # with cargo: build (--features cuda), both parts
#   scripts/gpu-check.sh --build-only DIR     # build the binaries into DIR (no GPU needed)
#   scripts/gpu-check.sh --prebuilt DIR       # run binaries from DIR (a GPU machine without cargo)
#   options: --part kernels|train|exchange|cp|all (default all; if all does not fit one 10-minute
#   device call, run --part kernels, --part train, --part exchange and --part cp as separate calls), --dtype f32|f16|bf16 (kernel report dtype,
#   default f32), --json FILE (kernel report as JSON), --steps N (1B runs, default 6)
#
# CUDA libraries load at run time: building needs no GPU and no CUDA toolkit.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=all dir="" dtype=f32 json="" part=all steps=6
while [ $# -gt 0 ]; do
  case "$1" in
    --build-only) mode=build; dir="${2:?--build-only needs a directory}"; shift 2 ;;
    --prebuilt) mode=prebuilt; dir="${2:?--prebuilt needs a directory}"; shift 2 ;;
    --dtype) dtype="${2:?--dtype needs f32, f16 or bf16}"; shift 2 ;;
    --json) json="${2:?--json needs a file}"; shift 2 ;;
    --part) part="${2:?--part needs kernels, train or all}"; shift 2 ;;
    --steps) steps="${2:?--steps needs a number}"; shift 2 ;;
    *) echo "unknown argument $1 (allowed: --build-only DIR, --prebuilt DIR, --part kernels|train|exchange|cp|all, --dtype f32|f16|bf16, --json FILE, --steps N)" >&2; exit 2 ;;
  esac
done
case "$dtype" in f32|f16|bf16) ;; *) echo "--dtype $dtype: allowed values are f32, f16, bf16" >&2; exit 2 ;; esac
case "$part" in kernels|train|exchange|cp|all) ;; *) echo "--part $part: allowed values are kernels, train, exchange, cp, all" >&2; exit 2 ;; esac
case "$steps" in ''|*[!0-9]*) echo "--steps $steps: a positive whole number" >&2; exit 2 ;; esac

build() {
  local out="$1"
  mkdir -p "$out"
  local flags=(-p disagmoe-kernels --no-default-features --features cuda,report --release)
  cargo build "${flags[@]}" --example kernel_report
  local test_bin
  test_bin=$(cargo test "${flags[@]}" --test cube_vs_reference --no-run --message-format=json 2>/dev/null \
    | grep -o '"executable":"[^"]*cube_vs_reference[^"]*"' | tail -1 | cut -d'"' -f4)
  [ -n "$test_bin" ] || { echo "could not find the cube_vs_reference test binary" >&2; exit 1; }
  cp "$test_bin" "$out/cube_vs_reference"
  cp target/release/examples/kernel_report "$out/kernel_report"
  # The trainer on CUDA (its own target dir: another feature set than the default build's).
  cargo build --release -p disagmoe --features cuda --bin disagmoe --target-dir target/gpu-check-build
  cp target/gpu-check-build/release/disagmoe "$out/disagmoe"
  cp benches/qwen3-moe-1b.json "$out/"
  strip "$out/cube_vs_reference" "$out/kernel_report" "$out/disagmoe" 2>/dev/null || true
  echo "built into $out: cube_vs_reference, kernel_report, disagmoe, qwen3-moe-1b.json"
}

if [ "$mode" = build ]; then
  build "$dir"
  exit 0
fi
if [ "$mode" = all ]; then
  command -v cargo >/dev/null || { echo "no cargo here: build elsewhere with --build-only DIR, then run --prebuilt DIR" >&2; exit 2; }
  dir=target/gpu-check
  build "$dir"
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "nvidia-smi not found"

if [ "$part" = kernels ] || [ "$part" = all ]; then
  [ -x "$dir/cube_vs_reference" ] && [ -x "$dir/kernel_report" ] || { echo "$dir must hold cube_vs_reference and kernel_report" >&2; exit 2; }
  echo "== kernel tests on CUDA"
  CI=true "$dir/cube_vs_reference" --test-threads 1

  echo "== achieved rates against measured ceilings ($dtype)"
  report=("$dir/kernel_report" --dtype "$dtype")
  [ -n "$json" ] && report+=(--json "$json")
  "${report[@]}"
fi
[ "$part" = kernels ] && exit 0

[ -x "$dir/disagmoe" ] && [ -f "$dir/qwen3-moe-1b.json" ] || { echo "$dir must hold disagmoe and qwen3-moe-1b.json" >&2; exit 2; }
# One field of the summary (the last line of stdout, one JSON object).
field() { { grep -o "\"$1\":[^,}]*" <<<"$2" || true; } | head -1 | cut -d: -f2; }
# The device the runs use (GPU_CHECK_DEVICE=cpu tries the script with a CPU build).
dev=${GPU_CHECK_DEVICE:-cuda:0}
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)
case "$gpu_name" in
  *H100*|*H200*|*H800*) peak=989 ;;
  *A100*) peak=312 ;;
  *) peak="" ;;
esac
kernel_fallbacks=0
# Runs `disagmoe train ARGS...` while sampling the device memory; prints one line of figures.
train() {
  local label="$1"; shift
  local mem_log summary max_mem="" sampler=""
  mem_log=$(mktemp)
  if command -v nvidia-smi >/dev/null; then
    (while true; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1; sleep 0.5; done) >"$mem_log" 2>/dev/null &
    sampler=$!
  fi
  summary=$("$dir/disagmoe" train --quiet "$@" | tail -1) || summary=""
  [ -n "$sampler" ] && kill "$sampler" 2>/dev/null
  if [ -z "$summary" ]; then echo "$label: FAILED"; rm -f "$mem_log"; return 0; fi
  max_mem=$(sort -n "$mem_log" | tail -1); rm -f "$mem_log"
  local tps tflops loss attn experts
  tps=$(field tokens_per_s "$summary"); tflops=$(field model_tflops_per_s "$summary"); loss=$(field last_loss "$summary")
  # Which implementation attention and the experts ran (the summary's "kernels"): on CUDA the
  # kernels must apply; a run that fell back to the reference composition fails the check.
  attn=$(field attention "$summary" | tr -d '"'); experts=$(field experts "$summary" | tr -d '"')
  if [[ "$dev" == cuda* ]] && { [[ "$attn" == *reference* ]] || [[ "$experts" == *reference* ]] || [ -z "$attn" ]; }; then
    echo "$label: FAILED: the kernels fell back (attention: ${attn:-none}, experts: ${experts:-none})"
    kernel_fallbacks=$((kernel_fallbacks + 1))
  fi
  local mfu="n/a (unknown GPU peak)"
  [ -n "$peak" ] && mfu=$(awk -v t="$tflops" -v p="$peak" 'BEGIN { printf "%.1f%% of %d TFLOP/s bf16 dense", 100 * t / p, p }')
  printf '%-34s final loss %-8.4f  %10.0f tokens/s  %7.2f model TFLOP/s  MFU %s  peak device memory %s MiB  (attention %s, experts %s)\n' \
    "$label" "$loss" "$tps" "$tflops" "$mfu" "${max_mem:-n/a}" "${attn:-?}" "${experts:-?}"
}

big=(--model-config "$dir/qwen3-moe-1b.json" --steps "$steps" --batch 8 --seq 1024 --precision bf16)
disagg=(--placement disagg --attn-workers 2 --ffn-workers 2 --groups 2 --micro-batches 4 --devices "$dev,$dev,$dev,$dev")
if [ "$part" = train ] || [ "$part" = all ]; then
  echo "== tiny presets, 100 steps, f32 vs bf16"
  for preset in tiny-qwen3-moe tiny-gpt-oss tiny-deepseek-v3; do
    for precision in f32 bf16; do
      train "$preset $precision" --model-preset "$preset" --steps 100 --precision "$precision" --devices "$dev"
    done
  done

  echo "== ~1.2B Qwen3-MoE (benches/qwen3-moe-1b.json) in bf16, $steps steps of 8 x 1024 tokens"
  train "1B single" "${big[@]}" --placement single --devices "$dev"
  train "1B single, --recompute full" "${big[@]}" --placement single --devices "$dev" --recompute full
  train "1B disagg 2+2, 4 workers on 1 GPU" "${big[@]}" "${disagg[@]}"
fi

# Runs a disagg run and prints its step time, exchange bytes and payload bytes read back.
exchange() {
  local label="$1"; shift
  local summary
  summary=$("$dir/disagmoe" train --quiet "${big[@]}" "${disagg[@]}" "$@" | tail -1) || summary=""
  if [ -z "$summary" ]; then echo "$label: FAILED"; return 0; fi
  printf '%-34s step %8.4f s  final loss %-8.4f  exchange %9.2f MB/worker/step  payloads read back %9.2f MB/step  (%s)\n' \
    "$label" "$(field step_s "$summary")" "$(field last_loss "$summary")" \
    "$(awk -v b="$(field exchange_bytes_per_worker "$summary")" 'BEGIN { print b / 1e6 }')" \
    "$(awk -v b="$(field payload_host_bytes "$summary")" 'BEGIN { print b / 1e6 }')" \
    "$({ grep -o '"exchange_dtype":"[^"]*"' <<<"$summary" || true; } | cut -d'"' -f4)"
}

if [ "$part" = exchange ] || [ "$part" = all ]; then
  echo "== 1B disagg 2+2 on 1 GPU: the token exchange in f32, bf16, fp8; payloads on the device or through the host"
  for x in f32 bf16 fp8; do
    exchange "exchange $x, payloads on device" --exchange-dtype "$x"
  done
  for x in f32 bf16; do
    exchange "exchange $x, payloads via host" --exchange-dtype "$x" --exchange-payloads host
  done
fi
if [ "$part" = cp ] || [ "$part" = all ]; then
  echo "== 1B in f32, disagg 2+2 in one group on 1 GPU, $steps steps of 4 x 4096 tokens: without and with context parallelism 2"
  cp=(--model-config "$dir/qwen3-moe-1b.json" --steps "$steps" --batch 4 --seq 4096 --precision f32 --placement disagg
    --attn-workers 2 --ffn-workers 2 --groups 1 --micro-batches 2 --devices "$dev,$dev,$dev,$dev")
  train "1B f32 disagg 2+2 one group" "${cp[@]}"
  train "1B f32 disagg 2+2, --context-parallel 2" "${cp[@]}" --context-parallel 2
fi
if [ "$kernel_fallbacks" -gt 0 ]; then
  echo "$kernel_fallbacks CUDA run(s) ran attention or the experts without the kernels" >&2
  exit 1
fi
