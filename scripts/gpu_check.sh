#!/usr/bin/env bash
# The GPU check of docs/PERFORMANCE.md as one prepared script: CUDA correctness first, then speed.
#
#   bash scripts/gpu_check.sh [RESULTS_DIR] [PART...]         # RESULTS_DIR: $OUT if set, else bench_results
#   GPU_CHECK_DRY_RUN=1 bash scripts/gpu_check.sh /tmp/dry    # every part's plumbing on the CPU, tiny models
#   GPU_CHECK_DRY_RUN=1 GPU_CHECK_GPUS=2 bash scripts/gpu_check.sh /tmp/dry2   # as on a node of 2 GPUs
#   bash scripts/gpu_check.sh --report DIR RESULTS...         # one summary of several invocations' results
#
# Parts, most valuable first. The default on one GPU is the twelve from tests on, in this order; with more
# than one GPU visible it is all thirteen: multigpu on every GPU first, then the others side by side, one
# GPU each (below, "Several GPUs"):
#   multigpu   every GPU at once (skipped on one): GPT-2 124M's step (B=64, 524,288 tokens) under torchrun on
#              all GPUs and on one, tokens/s per GPU and scaling efficiency (bench_gpu.sh group multigpu);
#              the all-reduce of DDP's 25 MiB gradient bucket and of the whole 124M gradient, fp32 and
#              bf16, algorithm and bus bandwidth (benchmarks/bench_allreduce.py); a 30-step 124M run on all
#              GPUs stopped by SIGTERM to torchrun after step 10 and launched again, which must resume
#              from that checkpoint, end at step 30 and log every step once (benchmarks/preemption_check.py)
#   tests      pytest -m gpu tests/test_gpu.py: compiled vs eager, fused loss, resume, HellaSwag under
#              compile, sample.py's KV cache, export to transformers (124M, bf16, real tokens)
#   speed      GPT-2 124M, T=1024, 524,288 tokens/step: compiled/eager x plain/fused loss, B=64 and 32
#   reference  build-nanogpt's loop at B=64, compiled, when .ref/build-nanogpt/train_gpt2.py was
#              carried along (benchmarks/gpu_reference.py says how to fetch it)
#   presets    350M, 774M, 1558M at the largest micro-batch that fits
#   fsdp       --strategy fsdp / fsdp_zero2 under torchrun on the one GPU (124M B=64, 1558M): FSDP's
#              overhead against the DDP rows
#   levers     the speed levers (docs/PERFORMANCE.md, "Speed levers"), 124M compiled at B=64, 10 steps each: the
#              plain variant, the one-pass Triton loss, the fused residual add + layer norm, the best
#              combination of those two, the FP8 lm_head against the modern recipe's plain row, and
#              max-autotune-no-cudagraphs, beside build-nanogpt's loop timed as the reference part times it;
#              each profiled one step more; in one call of about 8 minutes (GPU_CHECK_BUDGET_S=480)
#   longrun    what spike_skip and rank_stats_interval cost per step (124M B=64, against the speed rows)
#   recipe     Muon's optimizer step for 124M and 1558M (benchmarks/bench_muon.py: Newton-Schulz of every
#              matrix, the work that N GPUs share), then the faithful and the modern recipe, GPT-2
#              124M, 300 steps of 65,536 tokens on the same Shakespeare tokens
#              (scripts/compare_recipes.py --gpu; needs data/shakespeare: python prep/shakespeare.py)
#   checkpoint benchmarks/bench_checkpoint.py on the GPU, 124M and 1558M: the file, a sharded save, an
#              async sharded save (how long the loop is blocked, how long until complete), and the
#              loads of the first two
#   memory     micro_batch_size auto (benchmarks/memory_check.py) for gpt2, gpt2-medium, gpt2-large and gpt2-xl
#              with activation_checkpointing none, selective and full: the B chosen, the peak memory of
#              2 real steps (eager, 524,288 tokens), against scripts/memory_table.py's estimate
#   repro      benchmarks/repro_check.py: two identical compiled 124M runs of 50 steps and a resume, with
#              and without --deterministic true, compared bit for bit; the kernels and gradients that
#              differ; then what deterministic costs at B=64 (bench_gpu.sh group repro)
#   recompute  what activation checkpointing costs per step: 124M selective and full, compiled and
#              eager, and 1558M full (bench_gpu.sh group recompute, against the speed rows)
# Numerics (final losses after the same steps on the same tokens, across variants) come with
# every summary. The variants themselves are listed in benchmarks/bench_gpu.sh.
#
# On a GPU machine, from a clone of this repository with `make install` done:
#   git clone https://github.com/karpathy/build-nanogpt .ref/build-nanogpt   # the reference loop (git-ignored)
#   python prep/shakespeare.py                                               # the recipe part's tokens
#   GPU_CHECK_BUDGET_S=0 bash scripts/gpu_check.sh bench_results/gpu         # every part (see "Several GPUs")
# then read bench_results/gpu/summary.md (printed last). Without .ref/ or data/shakespeare the parts
# that need them are skipped and listed. The parts can also run in several invocations, each into its
# own RESULTS_DIR (say, on machines rented by the hour), merged afterwards by --report:
#   bash scripts/gpu_check.sh bench_results/a tests speed
#   bash scripts/gpu_check.sh bench_results/b reference presets fsdp
#   GPU_CHECK_BUDGET_S=480 bash scripts/gpu_check.sh bench_results/e levers   (8 minutes: what does not fit is listed)
#   bash scripts/gpu_check.sh bench_results/c repro longrun recipe checkpoint
#   bash scripts/gpu_check.sh bench_results/d memory recompute   (memory: 12 short runs; GPU_CHECK_MEMORY_MODELS=
#                "gpt2-large gpt2-xl" reruns only those presets)
#   bash scripts/gpu_check.sh --report bench_results/gpu bench_results/a bench_results/b bench_results/c bench_results/d \
#       bench_results/e
#
# Several GPUs (a rented node): the same command, `bash scripts/gpu_check.sh bench_results/node`, runs
# multigpu, then spreads the other parts over the GPUs: each GPU gets an invocation of this script of its
# own (CUDA_VISIBLE_DEVICES one GPU, its results merged into RESULTS_DIR as --report does), all at once,
# under this invocation's budget. The parts go out in the order given, each to the GPU with the least
# estimated work so far (the times below), so that under a budget every GPU starts with its most valuable
# part. Named parts are spread the same way (multigpu, if named, still first; a single part runs here, on the
# first GPU). While they run, each GPU's console is the file the script names. GPU_CHECK_GPUS=N uses the
# first N visible GPUs (1: one part after the other on one GPU, as on a machine of one). The parts running
# side by side share the host's CPUs, so their compile and startup seconds may read higher than alone; a
# step's time is the GPU's.
#
# Time. Measured on one H200 (2026-11-28): tests 140 s (three cold compiles of 124M at B=8, trainer runs
# of 4-10 steps); each 124M speed variant about 76 s (startup with cold compile 34 s, 31 steps of ~1 s);
# reference 45 s. Estimated for one H100, not yet measured (summary.md gives each part's seconds):
# presets ~1.5, 2 and 3 min (compilation grows with depth; each runs 3-6 steps); fsdp ~1.5 min per 124M
# variant and ~3 min for 1558M; levers ~45 s per variant (a cold compile of 34 s, 11 steps), several
# minutes for max-autotune, which runs last with what the budget leaves; checkpoint ~0.5 min for 124M and
# ~5 min for 1558M (three saves and two loads of 19 GB). So the first two invocations above take ~7 and
# ~13 min, the levers call 8, and all twelve about an hour.
# Estimated for a node of 8 H100s, not yet measured: multigpu ~4.5 min (one GPU's 30 steps ~76 s as a speed
# variant, 8 GPUs' ~50 s, the all-reduces ~20 s, the preemption check's two launches with cold compiles ~2
# min); the default budget then leaves ~4.5 min to the other parts, every GPU starting its most valuable
# ones: ~10 min in all, every GPU busy. Without a budget the longest GPU's share takes ~12 min: ~17 min for
# every part, against about an hour one part after the other on one GPU.
# GPU_CHECK_BUDGET_S (default 560, 0 for none) caps one invocation at about that many seconds: a part or
# variant that would start with less than 90 s left is skipped and listed as skipped, and the next
# invocation can run it, BENCH_ONLY naming the labels (glob patterns) to run:
#   BENCH_ONLY="124m-compile-plain-b32 1558m-*" bash ... speed presets
# and GPU_CHECK_TESTS (a pytest -k expression) the tests part's tests:  GPU_CHECK_TESTS=resume bash ... tests
#
# Results, flat, rewritten after every part (an invocation stopped midway keeps what it did; parts spread
# over GPUs join them once every GPU is done): summary.md,
# results.json (every row, test, failure and part), numerics.json, gpu_check.log (the console) and
# details.tar.gz (each variant's scripts/bench.py JSON and log, pytest's junit XML and log; with parts
# spread over GPUs, each GPU's console and details.tar.gz): five files, so a results folder is quick to
# copy off the machine.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
ALL_PARTS="multigpu tests speed reference presets fsdp levers longrun recipe checkpoint memory repro recompute"
ONE_GPU_PARTS=${ALL_PARTS#multigpu }  # the default on one GPU: every part but the one that needs several
SKIPPED=99  # a part's exit status for "nothing to run here" (not one pytest or timeout uses)

summarize() {  # environment DRY_RUN PARTS BUDGET | collect WORK RESULTS | report OUT RESULTS...
    "$PY" scripts/gpu_check_report.py "$@"
}

if [ "${1:-}" = --report ]; then  # no GPU needed: merge the results of earlier calls into one summary
    shift
    [ $# -ge 2 ] || { echo "usage: bash scripts/gpu_check.sh --report DIR RESULTS..." >&2; exit 2; }
    summarize report "$@" && cat "$1/summary.md"
    exit
fi

RESULTS=${1:-${OUT:-bench_results}}
shift $(( $# > 0 ? 1 : 0 ))
for part in "$@"; do
    [[ " $ALL_PARTS " == *" $part "* ]] || { echo "error: unknown part $part (parts: $ALL_PARTS)" >&2; exit 2; }
done
# Every part runs the trainer: one line now if this Python cannot import it (a GPU image with its own torch
# but without requirements.txt, say), rather than the same traceback in every part's log
if ! probe=$("$PY" -c "import train_gpt2, torch; print(torch.cuda.device_count())" 2>&1); then
    echo "error: $PY cannot import the trainer ($(tail -1 <<< "$probe")): run make install, or set PYTHON" \
         "to a Python with requirements.txt installed" >&2
    exit 2
fi
DRY_RUN=${GPU_CHECK_DRY_RUN:-0}
VISIBLE=$(tail -1 <<< "$probe")  # the GPUs torch sees (CUDA_VISIBLE_DEVICES narrows them)
[[ $VISIBLE =~ ^[0-9]+$ ]] || VISIBLE=0
GPUS=${GPU_CHECK_GPUS:-$(( VISIBLE > 0 ? VISIBLE : 1 ))}
if ! [[ $GPUS =~ ^[1-9][0-9]*$ ]] || { [ "$DRY_RUN" != 1 ] && (( GPUS > (VISIBLE > 0 ? VISIBLE : 1) )); }; then
    echo "error: GPU_CHECK_GPUS=$GPUS: a number of GPUs from 1 to the $VISIBLE torch sees here" >&2
    exit 2
fi
# The multigpu part's ranks: every GPU used (the dry run's stand-ins for them: at least 2 ranks on gloo)
RANKS=$(( DRY_RUN == 1 && GPUS < 2 ? 2 : GPUS ))
# Named parts run as named; by default, with more than one GPU, multigpu and then the rest spread over the GPUs
PARTS=${*:-$( (( GPUS > 1 )) && echo "$ALL_PARTS" || echo "$ONE_GPU_PARTS")}
BUDGET=${GPU_CHECK_BUDGET_S:-$([ "$DRY_RUN" = 1 ] && echo 1800 || echo 560)}
REFERENCE=${GPU_REFERENCE:-.ref/build-nanogpt/train_gpt2.py}
# 20 s of the budget stay for the last summary; 0 means no budget
DEADLINE=$(( BUDGET > 0 ? $(date +%s) + BUDGET - 20 : $(date +%s) + 10**9 ))
if [ "$DRY_RUN" = 1 ]; then
    MIN_START_S=5 TEST_TIMEOUT_S=600 CORPUS_TOKENS=100000 REFERENCE_ARGS=(--dry_run --warmup 1 --steps 2)
    export GPU_CHECK_DRY_RUN=1 BENCH_DRY_RUN=1  # test_gpu.py and bench_gpu.sh shrink themselves to the CPU
else
    # 31 steps of 524,288 tokens: the longest variant (30 steps) never wraps around the data
    MIN_START_S=90 TEST_TIMEOUT_S=240 CORPUS_TOKENS=$(( 31 * 524288 + 1 )) REFERENCE_ARGS=()
fi
export BENCH_DEADLINE=$DEADLINE BENCH_MIN_S=$MIN_START_S
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
BENCH=$WORK/bench

corpus() {  # the repository-text corpus in $WORK/corpus (real tokens, so losses compare), written once
    [ -d "$WORK/corpus" ] || "$PY" benchmarks/corpus.py "$WORK/corpus" "$CORPUS_TOKENS"
}

bench_group() {  # bench_gpu.sh's group $1 on the corpus
    corpus || return
    DATA_DIR=$WORK/corpus PYTHON=$PY bash benchmarks/bench_gpu.sh "$BENCH" "$1"
}

part_tests() {  # $1: seconds left. pytest-timeout stops one test, timeout the whole part
    timeout --kill-after=20 "$1" "$PY" -m pytest -m gpu tests/test_gpu.py ${GPU_CHECK_TESTS:+-k "$GPU_CHECK_TESTS"} \
        -v -rfE --timeout "$TEST_TIMEOUT_S" \
        -o junit_family=xunit1 --junitxml "$WORK/tests.xml" 2>&1 | tee "$WORK/tests.log"
}

part_speed() { bench_group speed; }
part_presets() { bench_group presets; }
part_fsdp() { bench_group fsdp; }
part_levers() {  # $1: seconds left. build-nanogpt's loop for as many steps as the levers' rows, then the levers
    part_reference "$1" reference-build-nanogpt-b64-levers --warmup 2 --steps 8
    bench_group levers
}
part_longrun() { bench_group longrun; }
part_recompute() { bench_group recompute; }

part_reference() {  # $1: seconds left; [$2: the row's label, then gpu_reference.py arguments (the levers part's)]
    local label=${2:-reference-build-nanogpt-b64} status
    if [ ! -f "$REFERENCE" ]; then
        printf '%s\tno %s (benchmarks/gpu_reference.py says how to fetch it)\n' "$label" "$REFERENCE" >> "$BENCH/skipped.txt"
        return $SKIPPED
    fi
    echo "$label" >> "$BENCH/order.txt"
    timeout --kill-after=20 "$1" "$PY" benchmarks/gpu_reference.py --ref "$REFERENCE" --json "$BENCH/$label.json" \
        --label "$label" "${@:3}" "${REFERENCE_ARGS[@]}" > "$BENCH/$label.log" 2>&1
    status=$?
    tail -3 "$BENCH/$label.log"
    [ $status = 0 ] || printf '%s\texit %s\n' "$label" "$status" >> "$BENCH/failed.txt"
    return $status
}

part_recipe() {  # $1: seconds left. Muon's step, then both recipes on the Shakespeare shards (data/shakespeare)
    local model muon=(--device cuda --variants replicated,whole) models=(gpt2 gpt2-xl)
    [ "$DRY_RUN" = 1 ] && muon=(--device cpu --dry_run) models=(gpt2)
    for model in "${models[@]}"; do
        timeout --kill-after=20 "$1" "$PY" benchmarks/bench_muon.py --model "$model" "${muon[@]}" \
            > "$BENCH/muon-$model.log" 2>&1 || printf 'muon-%s\texit %s\n' "$model" "$?" >> "$BENCH/failed.txt"
        grep '^{' "$BENCH/muon-$model.log" >> "$BENCH/muon.jsonl"
    done
    if ! ls data/shakespeare/*_val_*.npy > /dev/null 2>&1; then
        printf 'recipe\tno data/shakespeare (python prep/shakespeare.py first)\n' >> "$BENCH/skipped.txt"
        return $SKIPPED
    fi
    local args=(--gpu) status
    [ "$DRY_RUN" = 1 ] && args=(--dry_run)
    timeout --kill-after=20 "$1" "$PY" scripts/compare_recipes.py "${args[@]}" --seeds 1337 --out "$WORK/recipe" \
        > "$BENCH/recipe.log" 2>&1
    status=$?
    tail -6 "$BENCH/recipe.log"
    cp "$WORK/recipe/recipes.json" "$WORK/recipe/recipes.png" "$BENCH/" 2>/dev/null
    [ $status = 0 ] || printf 'recipe\texit %s\n' "$status" >> "$BENCH/failed.txt"
    return $status
}

part_checkpoint() {  # $1: seconds left. Each model's checkpoints are deleted before the next (19 GB each for 1558M)
    local models=(gpt2 gpt2-xl) device=(--device cuda) model variant label left status
    [ "$DRY_RUN" = 1 ] && models=(tiny) device=(--device cpu --dry_run)
    for model in "${models[@]}"; do
        for variant in file sharded sharded-async load-file load-sharded; do
            label=checkpoint-$model-$variant
            left=$(( DEADLINE - $(date +%s) ))
            if (( left < MIN_START_S )); then
                printf '%s\t%ss of the time budget left\n' "$label" "$left" >> "$BENCH/skipped.txt"
                continue
            fi
            local args=(--model "${model/tiny/gpt2}" "${device[@]}" --label "$label")
            case $variant in
                file) args+=(--format file --dir "$WORK/ckpt/file") ;;
                sharded) args+=(--format sharded --dir "$WORK/ckpt/sharded") ;;
                sharded-async) args+=(--format sharded --async) ;;  # a temp folder, deleted at once
                load-file) args+=(--load "$WORK/ckpt/file/step_00000001.pt") ;;
                load-sharded) args+=(--load "$WORK/ckpt/sharded/step_00000001") ;;
            esac
            echo "=== $label"
            timeout --kill-after=20 "$left" "$PY" benchmarks/bench_checkpoint.py "${args[@]}" > "$BENCH/$label.log" 2>&1
            status=$?
            tail -1 "$BENCH/$label.log"
            if [ $status = 0 ]; then
                grep '^{' "$BENCH/$label.log" | tail -1 >> "$BENCH/checkpoint.jsonl"
            else
                printf '%s\texit %s\n' "$label" "$status" >> "$BENCH/failed.txt"
            fi
        done
        rm -rf "$WORK/ckpt"
    done
}

part_repro() {  # $1: seconds left. repro_check.py, then (with the time left) the bench rows of deterministic mode
    local args=() status
    [ "$DRY_RUN" = 1 ] && args=(--dry_run --steps 4)
    corpus || return
    # BENCH_MIN_S is kept back for the bench variant, which the deadline skips if repro_check used it
    timeout --kill-after=20 $(( $1 - MIN_START_S )) "$PY" benchmarks/repro_check.py --data_dir "$WORK/corpus" \
        --out "$WORK/repro" "${args[@]}" > "$BENCH/repro.log" 2>&1
    status=$?
    tail -20 "$BENCH/repro.log"
    cp "$WORK/repro/repro.json" "$WORK/repro/repro.md" "$BENCH/" 2>/dev/null
    [ $status = 0 ] || printf 'repro\texit %s\n' "$status" >> "$BENCH/failed.txt"
    bench_group repro
    return $status
}

part_memory() {  # $1: seconds left. One benchmarks/memory_check.py per preset (its settings each check the budget)
    local models=(${GPU_CHECK_MEMORY_MODELS:-gpt2 gpt2-medium gpt2-large gpt2-xl}) args=() model left status=0
    [ "$DRY_RUN" = 1 ] && models=(gpt2) args=(--dry_run)
    corpus || return
    for model in "${models[@]}"; do
        left=$(( DEADLINE - $(date +%s) ))
        if (( left < MIN_START_S )); then
            printf 'memory-%s\t%ss of the time budget left\n' "$model" "$left" >> "$BENCH/skipped.txt"
            continue
        fi
        echo "=== memory $model"
        timeout --kill-after=20 "$left" "$PY" benchmarks/memory_check.py --model "$model" --data_dir "$WORK/corpus" \
            --work "$WORK/memory" "${args[@]}" > "$BENCH/memory-$model.log" 2>&1 \
            || { status=$?; printf 'memory-%s\texit %s\n' "$model" "$status" >> "$BENCH/failed.txt"; }
        grep '^{' "$BENCH/memory-$model.log" | tee -a "$BENCH/memory.jsonl"
        rm -rf "$WORK/memory"
    done
    return $status
}

timed_step() {  # label, command...: run with the budget's time left, its console in $BENCH/label.log; or skipped
    local label=$1 left code
    shift
    left=$(( DEADLINE - $(date +%s) ))
    if (( left < MIN_START_S )); then
        printf '%s\t%ss of the time budget left\n' "$label" "$left" >> "$BENCH/skipped.txt"
        return 0
    fi
    echo "=== $label"
    timeout --kill-after=20 "$left" "$@" > "$BENCH/$label.log" 2>&1
    code=$?
    tail -3 "$BENCH/$label.log"
    case $code in
        0) return 0 ;;
        124 | 137) printf '%s\ttimed out after %ss\n' "$label" "$left" >> "$BENCH/failed.txt" ;;
        *) printf '%s\texit %s: %s\n' "$label" "$code" \
               "$(grep -m1 '^error:' "$BENCH/$label.log" || tail -1 "$BENCH/$label.log")" >> "$BENCH/failed.txt" ;;
    esac
    return $code
}

part_multigpu() {  # $1: seconds left. Every GPU at once (the dry run: $RANKS ranks on gloo): 124M's step on all
    # of them against one, the all-reduce of DDP's gradient buckets, and a short run stopped by SIGTERM and resumed
    local status=0 launch torchrun=("$PY" -m torch.distributed.run --standalone --nproc_per_node="$RANKS")
    local allreduce=() preemption=(--max_steps 30 --signal_after 10 --total_batch_size $(( 65536 * RANKS ))
                                   --val_tokens 65536)  # one B=64 micro-batch per GPU a step
    if (( RANKS < 2 )); then
        printf 'multigpu\tone GPU: nothing to compare it with\n' >> "$BENCH/skipped.txt"
        return $SKIPPED
    fi
    if [ "$DRY_RUN" = 1 ]; then
        allreduce=(--device cpu --dry_run)
        preemption=(--max_steps 12 --signal_after 3 --model custom --n_layer 2 --n_head 2 --n_embd 64 --block_size 32
                    --seq_len 32 --micro_batch_size 2 --total_batch_size $(( 64 * RANKS )) --device cpu
                    --dtype float32 --compile false --val_tokens 64)
    fi
    corpus || return
    DATA_DIR=$WORK/corpus PYTHON=$PY BENCH_GPUS=$RANKS bash benchmarks/bench_gpu.sh "$BENCH" multigpu || status=$?
    timed_step "allreduce-${RANKS}gpu" "${torchrun[@]}" benchmarks/bench_allreduce.py --json "$BENCH/allreduce.jsonl" \
        "${allreduce[@]}" || status=$?
    # each of its two launches gets at most half the time left, so that a hung one still leaves its findings
    timed_step "preemption-${RANKS}gpu" "$PY" benchmarks/preemption_check.py --nproc "$RANKS" --out "$WORK/preemption" \
        --json "$BENCH/preemption.json" --launch_timeout $(( (DEADLINE - $(date +%s)) / 2 )) \
        --data_dir "$WORK/corpus" "${preemption[@]}" || status=$?
    for launch in 1 2; do  # the two launches' consoles, for details.tar.gz
        cp "$WORK/preemption/launch$launch.log" "$BENCH/preemption-${RANKS}gpu-launch$launch.log" 2>/dev/null
    done
    return $status
}

run_part() {  # one part under the budget; its status goes to parts.tsv, then the results are rewritten
    local name=$1 start left code status
    start=$(date +%s)
    left=$(( DEADLINE - start ))
    if (( left < MIN_START_S )); then
        status="skipped: ${left}s of the budget left"
    else
        echo "=== part $name (${left}s of the budget left)"
        "part_$name" "$left"
        code=$?
        case $code in
            0) status=ok ;;
            "$SKIPPED") status="skipped: nothing to run" ;;
            124 | 137) status="timed out" ;;
            *) status="failed (exit $code)" ;;
        esac
    fi
    printf '%s\t%s\t%s\n' "$name" "$status" "$(( $(date +%s) - start ))" >> "$WORK/parts.tsv"
    summarize collect "$WORK" "$RESULTS" && summarize report "$RESULTS" "$RESULTS/results.json"
}

# Each single-GPU part's seconds on one H100, estimated (the header's figures): what spreading them evens out
declare -A PART_S=([tests]=140 [speed]=300 [reference]=45 [presets]=390 [fsdp]=360 [levers]=540 [longrun]=150
                   [recipe]=150 [checkpoint]=330 [memory]=600 [repro]=580 [recompute]=410)

spread() {  # the single-GPU parts "$@" side by side: one invocation of this script per GPU, under this one's budget
    local -a load=() groups=() devices=() pids=() sources=("$RESULTS/results.json")
    local part i best left code
    IFS=, read -r -a devices <<< "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $(( GPUS - 1 )))}"
    # In the order given (most valuable first by default), each part to the GPU with the least estimated work
    # so far: under a budget, every GPU starts with the most valuable part it holds
    for part in "$@"; do
        best=0
        for (( i = 1; i < GPUS; i++ )); do (( ${load[i]:-0} < ${load[best]:-0} )) && best=$i; done
        load[best]=$(( ${load[best]:-0} + PART_S[$part] ))
        groups[best]+="${groups[best]:+ }$part"
    done
    left=$(( DEADLINE - $(date +%s) ))
    if (( left < MIN_START_S )); then
        for part in "$@"; do printf '%s\tskipped: %ss of the budget left\t0\n' "$part" "$left" >> "$WORK/parts.tsv"; done
    else
        for i in "${!groups[@]}"; do
            echo "=== GPU ${devices[i]}: ${groups[i]} (console: $WORK/gpu_check-gpu$i.log, kept in details.tar.gz)"
            printf '%s\t%s\n' "${devices[i]}" "${groups[i]}" >> "$WORK/spread.tsv"
            # its budget ends with this one's (each keeps 20 s for its summary); 0 stays no budget
            CUDA_VISIBLE_DEVICES=${devices[i]} GPU_CHECK_GPUS=1 GPU_CHECK_BUDGET_S=$(( BUDGET > 0 ? left + 20 : 0 )) \
                PYTHON=$PY bash scripts/gpu_check.sh "$WORK/gpu$i" ${groups[i]} > "$WORK/gpu_check-gpu$i.log" 2>&1 &
            pids[i]=$!
        done
        for i in "${!pids[@]}"; do
            wait "${pids[i]}"
            code=$?
            echo "=== GPU ${devices[i]}, exit $code: $(grep -m1 '^Parts:' "$WORK/gpu$i/summary.md" 2>/dev/null)"
            if [ -f "$WORK/gpu$i/results.json" ]; then
                sources+=("$WORK/gpu$i/results.json")
                cp "$WORK/gpu$i/details.tar.gz" "$WORK/details-gpu$i.tar.gz"
            else  # it stopped before its first part: its console says why
                for part in ${groups[i]}; do
                    printf '%s\tfailed: its invocation exited %s (gpu_check-gpu%s.log)\t0\n' "$part" "$code" "$i" \
                        >> "$WORK/parts.tsv"
                done
            fi
        done
    fi
    summarize collect "$WORK" "$RESULTS" && summarize report "$RESULTS" "${sources[@]}"
}

main() {
    echo "gpu_check: parts [$PARTS] into $RESULTS, budget ${BUDGET}s, $GPUS GPU(s)$([ "$DRY_RUN" = 1 ] &&
        echo ', DRY RUN on the CPU')"
    mkdir -p "$BENCH"
    summarize environment "$DRY_RUN" "$PARTS" "$BUDGET" > "$WORK/environment.json"
    local part others=()
    if (( GPUS > 1 )); then  # multigpu takes every GPU: first, then the other parts side by side
        for part in $PARTS; do
            if [ "$part" = multigpu ]; then run_part multigpu; else others+=("$part"); fi
        done
        case ${#others[@]} in
            0) ;;
            1) run_part "${others[0]}" ;;  # nothing to run beside it: here, its console live
            *) spread "${others[@]}" ;;
        esac
    else
        for part in $PARTS; do
            run_part "$part"
        done
    fi
    echo
    cat "$RESULTS/summary.md"
}

mkdir -p "$RESULTS"
main 2>&1 | tee "$RESULTS/gpu_check.log"
