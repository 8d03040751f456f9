#!/usr/bin/env bash
# Every GPU measurement of docs/PERFORMANCE.md in one go (one H100 80GB, ~20 minutes).
#
#   bash scripts/bench_gpu.sh [RESULTS_DIR]        # default: bench_results/
#   DATA_DIR=data/shakespeare bash scripts/bench_gpu.sh
#
# Each variant is one bench.py run (the real trainer step) writing RESULTS_DIR/<label>.json; a
# variant that fails (e.g. out of memory) is recorded in RESULTS_DIR/failed.txt and the rest go
# on. With DATA_DIR set, all variants read the same real tokens and their final_loss values
# after 50 steps can be compared (numerics check); otherwise bench.py generates random tokens.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${1:-bench_results}
mkdir -p "$RESULTS"
PY=${PYTHON:-python3}
DATA=()
[ -n "${DATA_DIR:-}" ] && DATA=(--data_dir "$DATA_DIR")
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$RESULTS/gpu.txt"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$RESULTS/gpu.txt"

run() {  # label, then bench/trainer arguments
    local label=$1; shift
    echo "=== $label: $*"
    if ! timeout 900 $PY bench.py --label "$label" --json "$RESULTS/$label.json" "${DATA[@]}" "$@" 2>&1 \
            | tee "$RESULTS/$label.log" | tail -4; then
        echo "$label" >> "$RESULTS/failed.txt"
    fi
}

STEPS=(--warmup 5 --steps 45)   # 50 steps: timings after warm-up, and a loss to compare
# GPT-2 124M, T=1024, 524,288 tokens per step: the reference loop's setting, then one lever at a time
run 124m-compile-plain-b64   --model gpt2 --micro_batch_size 64 --compile true  --loss_chunk_size 0    "${STEPS[@]}"
run 124m-compile-fused-b64   --model gpt2 --micro_batch_size 64 --compile true  --loss_chunk_size 8192 "${STEPS[@]}"
run 124m-compile-plain-b32   --model gpt2 --micro_batch_size 32 --compile true  --loss_chunk_size 0    "${STEPS[@]}"
run 124m-eager-fused-b64     --model gpt2 --micro_batch_size 64 --compile false --loss_chunk_size 8192 "${STEPS[@]}"
run 124m-eager-plain-b64     --model gpt2 --micro_batch_size 64 --compile false --loss_chunk_size 0    --warmup 2 --steps 3
# larger models at the largest micro-batch expected to fit (see scripts/activation_memory.py)
run 350m-compile-b32   --model gpt2-medium --micro_batch_size 32 --compile true --warmup 3 --steps 7
run 774m-compile-b16   --model gpt2-large  --micro_batch_size 16 --compile true --warmup 3 --steps 7
run 1558m-compile-b8   --model gpt2-xl --micro_batch_size 8 --total_batch_size 1048576 --compile true --warmup 2 --steps 4
echo "results in $RESULTS/"
