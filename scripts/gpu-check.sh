#!/usr/bin/env bash
# GPU check of the CubeCL kernels on an NVIDIA GPU: runs the kernel tests on CUDA (every kernel
# against its plain-Burn reference, outputs and gradients, f32 and f16), then prints achieved
# TFLOP/s and GB/s of the kernels against ceilings measured in the same run (a large copy, a large
# dense matmul) at the large shapes of issue #6 (16K tokens, hidden 4096, expert size 1536, 64
# experts, top-8; attention seq 8K, head dim 128, causal).
#
#   scripts/gpu-check.sh                      # with cargo: build (--features cuda), test, report
#   scripts/gpu-check.sh --build-only DIR     # build the two binaries into DIR (no GPU needed)
#   scripts/gpu-check.sh --prebuilt DIR       # run binaries from DIR (a GPU machine without cargo)
#   options: --dtype f32|f16|bf16 (report dtype, default f32), --json FILE (report as JSON)
#
# CUDA libraries load at run time: building needs no GPU and no CUDA toolkit.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=all dir="" dtype=f32 json=""
while [ $# -gt 0 ]; do
  case "$1" in
    --build-only) mode=build; dir="${2:?--build-only needs a directory}"; shift 2 ;;
    --prebuilt) mode=prebuilt; dir="${2:?--prebuilt needs a directory}"; shift 2 ;;
    --dtype) dtype="${2:?--dtype needs f32, f16 or bf16}"; shift 2 ;;
    --json) json="${2:?--json needs a file}"; shift 2 ;;
    *) echo "unknown argument $1 (allowed: --build-only DIR, --prebuilt DIR, --dtype f32|f16|bf16, --json FILE)" >&2; exit 2 ;;
  esac
done
case "$dtype" in f32|f16|bf16) ;; *) echo "--dtype $dtype: allowed values are f32, f16, bf16" >&2; exit 2 ;; esac

build() {
  local out="$1"
  mkdir -p "$out"
  local flags=(-p disagmoe-kernels --no-default-features --features cuda --release)
  cargo build "${flags[@]}" --example kernel_report
  local test_bin
  test_bin=$(cargo test "${flags[@]}" --test cube_vs_reference --no-run --message-format=json 2>/dev/null \
    | grep -o '"executable":"[^"]*cube_vs_reference[^"]*"' | tail -1 | cut -d'"' -f4)
  [ -n "$test_bin" ] || { echo "could not find the cube_vs_reference test binary" >&2; exit 1; }
  cp "$test_bin" "$out/cube_vs_reference"
  cp target/release/examples/kernel_report "$out/kernel_report"
  strip "$out/cube_vs_reference" "$out/kernel_report" 2>/dev/null || true
  echo "built into $out: cube_vs_reference, kernel_report"
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
[ -x "$dir/cube_vs_reference" ] && [ -x "$dir/kernel_report" ] || { echo "$dir must hold cube_vs_reference and kernel_report" >&2; exit 2; }
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "nvidia-smi not found"

echo "== kernel tests on CUDA"
CI=true "$dir/cube_vs_reference" --test-threads 1

echo "== achieved rates against measured ceilings ($dtype)"
report=("$dir/kernel_report" --dtype "$dtype")
[ -n "$json" ] && report+=(--json "$json")
"${report[@]}"
