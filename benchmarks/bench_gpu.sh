#!/usr/bin/env bash
# The GPU benchmarks of docs/PERFORMANCE.md: one scripts/bench.py run (the trainer's real step) per variant.
#
#   bash benchmarks/bench_gpu.sh [RESULTS_DIR] [GROUP...]   # default: bench_results/; groups speed levers presets fsdp longrun repro recompute
#   DATA_DIR=data/shakespeare bash benchmarks/bench_gpu.sh  # real tokens: final_loss values compare (numerics)
#   BENCH_DRY_RUN=1 bash benchmarks/bench_gpu.sh /tmp/b     # every variant as a 3-step tiny CPU run (plumbing)
#   BENCH_ONLY="124m-compile-plain-b32 1558m-*" bash benchmarks/bench_gpu.sh DIR speed presets   # some labels only
#   BENCH_LIST=1 bash benchmarks/bench_gpu.sh - [GROUP...]  # runs nothing; a line a variant: label, launcher
#                                                        # (python, or torchrun:N for N ranks), NAME=value words,
#                                                        # arguments (tabs)
#   bash benchmarks/bench_gpu.sh DIR multigpu               # DDP on every GPU against one GPU (not among the default
#                                                        # groups; BENCH_GPUS: how many GPUs, else all torch sees)
#
# scripts/gpu_check.sh calls this for its speed, levers, presets and multigpu parts, among others. Each variant writes
# RESULTS_DIR/<label>.json (scripts/bench.py's row) and <label>.log. A variant that fails (out of memory,
# its time limit) adds "label<TAB>why" to failed.txt and the rest go on (the script then exits 1, but for
# variants that only ran out of memory); with BENCH_DEADLINE
# (Unix seconds) set, one that would start with less than BENCH_MIN_S left adds a line to
# skipped.txt instead, and none runs past the deadline. order.txt lists the labels in run order.
#
# Every variant compiles into its own empty inductor cache, so compile_s and startup_s are what
# a first launch on a fresh machine costs, whatever ran before.
#
# To add a variant, add one `run LABEL [NAME=value...] ARGS...` line to a group (leading NAME=value
# words are environment variables, e.g. inductor switches; TORCHRUN=N launches the variant under
# `torchrun --nproc_per_node=N`: N=1 is what a sharded --strategy needs on one GPU); `fit` tries micro-batch
# sizes in turn.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${1:-bench_results}
shift $(( $# > 0 ? 1 : 0 ))
GROUPS_TO_RUN=${*:-speed levers presets fsdp longrun repro recompute}
LIST=${BENCH_LIST:-0}  # 1: list the variants (every micro-batch size a `fit` would try), write and run nothing
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}  # make install's venv first
DATA=()
[ -n "${DATA_DIR:-}" ] && DATA=(--data_dir "$DATA_DIR")
# dry run: the same list, each variant shrunk to a tiny model on the CPU (the last value of a key wins)
TINY=()
[ "${BENCH_DRY_RUN:-0}" = 1 ] && TINY=(--model custom --n_layer 2 --n_head 2 --n_embd 64 --block_size 32
    --seq_len 32 --micro_batch_size 2 --total_batch_size 128 --device cpu --dtype float32 --compile false
    --warmup 1 --steps 2)
BENCH_MIN_S=${BENCH_MIN_S:-60}          # a variant with less than this left would only time out
BENCH_TIMEOUT_S=${BENCH_TIMEOUT_S:-900}  # one variant's limit when there is no deadline

chosen() {  # label: status 0 when BENCH_ONLY's patterns (default: all) match it
    local patterns=() pattern
    read -r -a patterns <<< "${BENCH_ONLY:-*}"  # label patterns, read without expanding them as file names
    for pattern in "${patterns[@]}"; do
        [[ $1 == $pattern ]] && return 0  # unquoted: a glob match
    done
    return 1
}

run() {  # label, [NAME=value...], bench/trainer arguments; status 0 when the JSON was written
    local label=$1 limit=$BENCH_TIMEOUT_S status why
    shift
    local envs=() launch=("$PY")
    while [ $# -gt 0 ] && [[ $1 =~ ^[A-Z_][A-Z0-9_]*= ]]; do
        if [[ $1 =~ ^TORCHRUN=([1-9][0-9]*)$ ]]; then
            launch=("$PY" -m torch.distributed.run --standalone --nproc_per_node="${BASH_REMATCH[1]}")
        else envs+=("$1"); fi
        shift
    done
    chosen "$label" || return 1
    if [ "$LIST" = 1 ]; then
        printf '%s\t%s\t%s\t%s\n' "$label" "$( [ ${#launch[@]} -gt 1 ] && echo "torchrun:${launch[-1]#*=}" || echo python)" \
            "${envs[*]}" "$*"
        return 1
    fi
    if [ -n "${BENCH_DEADLINE:-}" ]; then
        local left=$(( BENCH_DEADLINE - $(date +%s) ))
        if (( left < BENCH_MIN_S )); then
            printf '%s\t%ss of the time budget left\n' "$label" "$left" >> "$RESULTS/skipped.txt"
            echo "=== $label: skipped, ${left}s left"
            return 1
        fi
        (( left < limit )) && limit=$left
    fi
    echo "$label" >> "$RESULTS/order.txt"
    echo "=== $label: ${envs[*]:+${envs[*]} }$* (limit ${limit}s)"
    local cache
    cache=$(mktemp -d)
    env "${envs[@]}" TORCHINDUCTOR_CACHE_DIR="$cache" timeout --kill-after=20 "$limit" \
        "${launch[@]}" scripts/bench.py --label "$label" --json "$RESULTS/$label.json" "${DATA[@]}" "$@" "${TINY[@]}" \
        > "$RESULTS/$label.log" 2>&1
    status=$?
    rm -rf "$cache"
    tail -4 "$RESULTS/$label.log"
    [ $status = 0 ] && return 0
    if [ $status = 124 ] || [ $status = 137 ]; then why="timed out after ${limit}s"
    elif grep -qi "out of memory" "$RESULTS/$label.log"; then why="out of memory"
    else why="exit $status: $(grep -m1 '^error:' "$RESULTS/$label.log" || tail -1 "$RESULTS/$label.log")"
    fi
    printf '%s\t%s\n' "$label" "$why" >> "$RESULTS/failed.txt"
    return 1
}

fit() {  # label prefix, micro-batch sizes largest first, then arguments: the largest that does not run out of memory
    local prefix=$1 sizes=$2 b
    shift 2
    for b in $sizes; do
        run "$prefix-b$b" "$@" --micro_batch_size "$b" && return
        [ "$LIST" = 1 ] && continue
        # only running out of memory is worth a smaller batch (not a timeout, an error or a skip)
        [ "$(tail -1 "$RESULTS/failed.txt" 2>/dev/null)" = "$prefix-b$b	out of memory" ] || return
    done
}

# GPT-2 124M, T=1024, 524,288 tokens per step. 30 steps: 25 timed after 5 of warm-up (the first
# compiles), ~1 s each on an H100, and final_loss after 30 steps on the same tokens for numerics.
SPEED=(--model gpt2 --warmup 5 --steps 25)

group_speed() {  # the reference's setting first, then one lever at a time
    # the two that matter most also profile one more step: where its GPU time goes, kernel by kernel
    run 124m-compile-plain-b64 "${SPEED[@]}" --micro_batch_size 64 --compile true --loss_chunk_size 0 \
        --profile_top 12
    run 124m-compile-fused-b64 "${SPEED[@]}" --micro_batch_size 64 --compile true --loss_chunk_size 8192 \
        --profile_top 12
    run 124m-eager-fused-b64   "${SPEED[@]}" --micro_batch_size 64 --compile false --loss_chunk_size 8192
    run 124m-compile-plain-b32 "${SPEED[@]}" --micro_batch_size 32 --compile true  --loss_chunk_size 0
}

# The speed levers (docs/PERFORMANCE.md, "Speed levers"), GPT-2 124M compiled at B=64 as the speed group's best,
# each alone against the plain variant, then the best combination; short (2 warm-up, 8 timed steps, one profiled)
# so that gpu_check.sh's levers part, with build-nanogpt's loop, fits in 8 minutes on one GPU.
LEVERS=(--model gpt2 --warmup 2 --steps 8 --micro_batch_size 64 --compile true --loss_chunk_size 0 --profile_top 10)
# the levers of the faithful recipe that the best combination may take: label suffix, then its trainer arguments
COMBINABLE=("loss-triton --loss_kernel triton" "fused-norm --fused_residual_norm true")

faster() {  # label, baseline label: status 0 when both ran and label's tokens/s beat the baseline's
    "$PY" scripts/gpu_check_report.py faster "$RESULTS/$1.json" "$RESULTS/$2.json"
}

group_levers() {  # each lever alone, the best combination, FP8 (modern recipe), then max-autotune (minutes to compile)
    local lever name args combined=() names=()
    run 124m-levers-plain "${LEVERS[@]}"
    for lever in "${COMBINABLE[@]}"; do
        name=${lever%% *}
        read -r -a args <<< "${lever#* }"
        run "124m-levers-$name" "${LEVERS[@]}" "${args[@]}"
    done
    # the best combination: every lever above that beat the plain variant on its own (listing: all of them)
    for lever in "${COMBINABLE[@]}"; do
        name=${lever%% *}
        if [ "$LIST" = 1 ] || faster "124m-levers-$name" 124m-levers-plain; then
            names+=("$name")
            read -r -a args <<< "${lever#* }"
            combined+=("${args[@]}")
        fi
    done
    if [ ${#names[@]} -ge 2 ]; then
        run 124m-levers-best "${LEVERS[@]}" "${combined[@]}"
    elif chosen 124m-levers-best; then
        printf '124m-levers-best\t%s of %s levers beat 124m-levers-plain alone%s: no combination to run\n' \
            "${#names[@]}" "${#COMBINABLE[@]}" "${names[*]:+ (${names[*]})}" >> "$RESULTS/skipped.txt"
    fi
    # FP8 lm_head: the modern recipe only, so against the modern recipe's own plain row (gpu_check.sh compares the
    # losses of rows with the same optimizer: Muon's with Muon's). Its wsd schedule refuses a warm-up (715 steps)
    # that runs into its cooldown, as it would in these 11 steps: 2 warm-up steps, for both rows alike
    local modern=(--config configs/gpt2_124m_modern.yaml "${LEVERS[@]}" --warmup_steps 2)
    run 124m-levers-modern "${modern[@]}"
    if [ "${BENCH_DRY_RUN:-0}" = 1 ] && [ "$LIST" != 1 ]; then  # the CPU has no FP8 matrix units: one error line
        chosen 124m-levers-modern-fp8 && printf '124m-levers-modern-fp8\tthe dry run is on the CPU, which %s\n' \
            "fp8_lm_head refuses" >> "$RESULTS/skipped.txt"
    else
        run 124m-levers-modern-fp8 "${modern[@]}" --fp8_lm_head true
    fi
    # last: Inductor times Triton templates for every matrix product shape, so it compiles for minutes
    run 124m-levers-autotune "${LEVERS[@]}" --compile_mode max-autotune-no-cudagraphs
}

group_longrun() {  # what the long-run features cost per step against 124m-compile-plain-b64 (speed group)
    # a window of 8 is full after 8 steps: 22 of the 30 steps are judged (6 sigma: nothing is skipped)
    run 124m-compile-plain-b64-spikeskip "${SPEED[@]}" --micro_batch_size 64 --compile true --loss_chunk_size 0 \
        --spike_skip true --spike_window 8
    run 124m-compile-plain-b64-rankstats "${SPEED[@]}" --micro_batch_size 64 --compile true --loss_chunk_size 0 \
        --rank_stats_interval 5
}

group_repro() {  # what deterministic mode costs per step against 124m-compile-plain-b64 (speed group)
    run 124m-compile-plain-b64-deterministic "${SPEED[@]}" --micro_batch_size 64 --compile true --loss_chunk_size 0 \
        --deterministic true
}

group_recompute() {  # what activation checkpointing costs per step against 124m-compile-fused-b64 (speed group)
    run 124m-compile-fused-b64-selective "${SPEED[@]}" --micro_batch_size 64 --compile true --loss_chunk_size 8192 \
        --activation_checkpointing selective
    run 124m-compile-fused-b64-full "${SPEED[@]}" --micro_batch_size 64 --compile true --loss_chunk_size 8192 \
        --activation_checkpointing full
    run 124m-eager-fused-b64-full "${SPEED[@]}" --micro_batch_size 64 --compile false --loss_chunk_size 8192 \
        --activation_checkpointing full
    # against 1558m-b8 (presets group): the micro-batch that recomputation lets fit (memory table: 124 on 80 GiB)
    fit 1558m-full "64 32" --model gpt2-xl --compile true --loss_chunk_size 8192 --activation_checkpointing full \
        --warmup 1 --steps 2
}

group_presets() {  # B from the activations measured on the CPU (docs/PERFORMANCE.md, "Memory"), halved on out of memory
    fit 350m "32 16" --model gpt2-medium --compile true --warmup 2 --steps 4
    fit 774m "16 8"  --model gpt2-large  --compile true --warmup 2 --steps 3
    fit 1558m "8 4"  --model gpt2-xl     --compile true --warmup 1 --steps 2
}

group_fsdp() {  # FSDP2 on one GPU (torchrun, world size 1): its overhead against the DDP rows above
    run 124m-fsdp-compile-plain-b64 TORCHRUN=1 "${SPEED[@]}" --micro_batch_size 64 --compile true \
        --loss_chunk_size 0 --strategy fsdp
    run 124m-fsdp-zero2-compile-plain-b64 TORCHRUN=1 "${SPEED[@]}" --micro_batch_size 64 --compile true \
        --loss_chunk_size 0 --strategy fsdp_zero2
    fit 1558m-fsdp "8 4" TORCHRUN=1 --model gpt2-xl --compile true --warmup 1 --steps 2 --strategy fsdp
}

group_multigpu() {  # 124M's step under DDP on MULTI_GPUS GPUs against one, the same tokens a step: how it scales
    # B=64 on every GPU: each GPU takes 8/N of the 8 micro-batches of 524,288 tokens. A count that does not
    # divide 8 takes 65,536 x N x floor(8/N) tokens a step (N x 65,536 above 8 GPUs), on one GPU as on N.
    local per_gpu=$(( MULTI_GPUS < 8 ? 8 / MULTI_GPUS : 1 ))
    local same=("${SPEED[@]}" --micro_batch_size 64 --compile true --loss_chunk_size 0
                --total_batch_size $(( 65536 * MULTI_GPUS * per_gpu )))
    run 124m-ddp-1gpu TORCHRUN=1 "${same[@]}"
    run "124m-ddp-${MULTI_GPUS}gpu" TORCHRUN="$MULTI_GPUS" "${same[@]}"
}

for group in $GROUPS_TO_RUN; do
    if ! declare -F "group_$group" > /dev/null; then
        echo "error: unknown group $group (groups: $(declare -F | sed -n 's/^declare -f group_//p' | tr '\n' ' '))" >&2
        exit 2
    fi
done
if [[ " $GROUPS_TO_RUN " == *" multigpu "* ]]; then  # how many GPUs: BENCH_GPUS, else every GPU torch sees
    if [ -n "${BENCH_GPUS:-}" ]; then MULTI_GPUS=$BENCH_GPUS
    elif [ "$LIST" = 1 ]; then MULTI_GPUS=8  # the listing shows a node of 8
    elif [ "${BENCH_DRY_RUN:-0}" = 1 ]; then MULTI_GPUS=2  # 2 ranks on gloo
    else MULTI_GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2> /dev/null)
    fi
    if ! [[ $MULTI_GPUS =~ ^[0-9]+$ ]] || (( MULTI_GPUS < 2 )); then
        echo "error: group multigpu compares 2 or more GPUs with one, and there are ${MULTI_GPUS:-no} (BENCH_GPUS sets how many)" >&2
        exit 2
    fi
fi
if [ "$LIST" = 1 ]; then
    for group in $GROUPS_TO_RUN; do "group_$group"; done
    exit 0
fi
# what every variant needs, checked once: one line and exit 2, rather than a traceback per variant
if ! "$PY" -c "import torch" > /dev/null 2>&1; then
    echo "error: $PY cannot import torch: run make install (it makes .venv), or set PYTHON to a Python with torch" >&2
    exit 2
fi
if [ "${BENCH_DRY_RUN:-0}" != 1 ] && ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    echo "error: no CUDA GPU for $PY's torch: the variants are GPU benchmarks (BENCH_DRY_RUN=1 runs each as a tiny CPU run)" >&2
    exit 2
fi
mkdir -p "$RESULTS"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$RESULTS/gpu.txt" 2>&1 \
    || echo "no nvidia-smi" > "$RESULTS/gpu.txt"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" >> "$RESULTS/gpu.txt"
for group in $GROUPS_TO_RUN; do
    "group_$group"
done
echo "results in $RESULTS/"
# a variant that ran out of memory is an answer (fit tries a smaller batch next); any other failure is not
failed=$(grep -cv $'\tout of memory$' "$RESULTS/failed.txt" 2> /dev/null)
if [ "${failed:-0}" -gt 0 ]; then
    echo "error: $failed variant(s) failed, not for lack of memory: $RESULTS/failed.txt says why" >&2
    exit 1
fi
