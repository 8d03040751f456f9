#!/usr/bin/env bash
# From FineWeb-Edu to a report card beside GPT-2's, on one GPU node, in one command:
#
#     bash scripts/speedrun.sh                          # configs/gpt2_124m.yaml on every GPU of this node
#     SPEEDRUN_PRICE=2.5 bash scripts/speedrun.sh       # the estimate in dollars too, at $2.50 per GPU-hour
#
# It prints the trainer's estimate for this node's GPU model and count first, then runs each stage; a stage whose
# output is complete is skipped, so the same command after an interruption (a crash, a preemption, Ctrl-C)
# continues where it stopped, and after the end does nothing but print the estimate:
#
#   1 estimate   train_gpt2.py --estimate: hours, dollars, evaluations, disk, memory (nothing runs)
#   2 data       prep/fineweb.py: FineWeb-Edu sample-10BT into token shards; an interrupted prep continues where
#                it stopped (done: the prep's manifest, written last)
#   3 hellaswag  prep/hellaswag.py: the HellaSwag val split into the cache, for the trainer's in-loop HellaSwag
#                (done: the file is there)
#   4 train      torchrun on every GPU, from the newest checkpoint of the run folder (done: the log records the
#                checkpoint of the last step: scripts/run_finished.py)
#   5 card       eval_lm.py --card of the final checkpoint: RUN/report.md, report.json (done: newer than the log)
#   6 gpt2 card  eval_lm.py gpt2 --card, OpenAI's GPT-2 124M on the 124M config's val window of the same data:
#                RUN/gpt2_card/ (done: its report.json)
#   7 beside     both cards in one table: RUN/report_vs_gpt2.md (scripts/card_table.py)
#   8 curves     plot_log.py: RUN/curves.png, loss and HellaSwag against tokens (done: newer than the log)
#
# Stages 2, 3, 5 and 6 need the network the first time (the Hugging Face Hub, GitHub); stage 4 does not.
#
# Environment (an empty value is refused: an unset variable must not become the current folder):
#   SPEEDRUN_CONFIG      the trainer's config (configs/gpt2_124m.yaml)
#   SPEEDRUN_DATA        the token shards' folder (data/edu_fineweb10B)
#   SPEEDRUN_OUT         the run folder (out/NAME, NAME the config's file name: out/gpt2_124m)
#   SPEEDRUN_GPUS        torchrun's processes (every GPU nvidia-smi lists, or those CUDA_VISIBLE_DEVICES names)
#   SPEEDRUN_GPU         the GPU model the estimate is for (the first GPU's name, from nvidia-smi)
#   SPEEDRUN_PRICE       dollars per GPU-hour, for the estimate's dollars (unset: none)
#   SPEEDRUN_TRAIN_ARGS  more trainer arguments, `--key value ...`, split at spaces (the same for the estimate)
#   SPEEDRUN_SHRINK=1    the rehearsal on a CPU, as `make smoke` shrinks the 124M launch: the data from the
#                        repository's own text, 2 ranks on gloo, a 2-layer model for 6 steps, no HellaSwag, the
#                        card's val figures alone and no GPT-2 card (the network is not used); about a minute
#   PYTHON               the Python to run everything with (python3; the activated .venv's first)
set -euo pipefail

fail() { echo "error: $*" >&2; exit 2; }
here="$(pwd)"
absolute() { case "$1" in /*) printf '%s' "$1" ;; *) printf '%s/%s' "$here" "$1" ;; esac; }
for name in SPEEDRUN_CONFIG SPEEDRUN_DATA SPEEDRUN_OUT SPEEDRUN_GPUS SPEEDRUN_GPU SPEEDRUN_PRICE SPEEDRUN_SHRINK \
        PYTHON; do
    if [ -n "${!name+set}" ] && [ -z "${!name//[[:space:]]/}" ]; then
        fail "$name is set but empty: give it a value, or unset it for its default"
    fi
done

cd "$(dirname "$0")/.."  # the repository: the scripts below, and the shrunk prep's inputs, are named from here
config="$(absolute "${SPEEDRUN_CONFIG:-configs/gpt2_124m.yaml}")"
[ -f "$config" ] || fail "SPEEDRUN_CONFIG: no such file $config"
data="$(absolute "${SPEEDRUN_DATA:-data/edu_fineweb10B}")"
name="$(basename "$config" .yaml)"
run="$(absolute "${SPEEDRUN_OUT:-out/$name}")"
py="${PYTHON:-$(command -v python || command -v python3 || true)}"
[ -n "$py" ] || fail "no python or python3 here: activate the environment (make install), or set PYTHON"
read -r -a extra <<< "${SPEEDRUN_TRAIN_ARGS:-}"

shrink="${SPEEDRUN_SHRINK:-0}"
if [ "$shrink" = 1 ]; then
    # make smoke's shrinking (the Makefile says why each): a 2-layer model 64 wide, 2 ranks of 2 micro-batches of
    # the real 1,024 tokens, 6 steps with the lr's warmup and cosine, val and checkpoints every 3, no HellaSwag
    extra=(--model custom --n_layer 2 --n_head 2 --n_embd 64 --micro_batch_size 1 --total_batch_size 4096
           --max_steps 6 --warmup_steps 2 --eval_interval 3 --val_tokens 4096 --sample_interval 6
           --checkpoint_interval 3 --hellaswag_interval 0 "${extra[@]}")
    gpus="${SPEEDRUN_GPUS:-2}"
    gpu="${SPEEDRUN_GPU:-H100}"  # no GPU here: the estimate is the shrunk run's, as if on these GPUs
    set -a && . common/cpu_malloc.env && set +a  # the CPU's malloc settings, exported (the Makefile's CPU_MALLOC)
elif [ "$shrink" = 0 ]; then
    if [ -z "${SPEEDRUN_GPUS:-}" ] || [ -z "${SPEEDRUN_GPU:-}" ]; then
        command -v nvidia-smi > /dev/null || fail "no nvidia-smi: no GPU to train on here; set SPEEDRUN_GPUS and " \
            "SPEEDRUN_GPU, or SPEEDRUN_SHRINK=1 for the rehearsal on a CPU"
    fi
    if [ -n "${SPEEDRUN_GPUS:-}" ]; then
        gpus="$SPEEDRUN_GPUS"
    elif [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
        IFS=, read -r -a visible <<< "$CUDA_VISIBLE_DEVICES"
        gpus="${#visible[@]}"
    else
        gpus="$(nvidia-smi --list-gpus | grep -c '^GPU ')" || fail "nvidia-smi lists no GPU"
    fi
    gpu="${SPEEDRUN_GPU:-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)}"
else
    fail "SPEEDRUN_SHRINK: 1 (the rehearsal on a CPU) or 0, got '$shrink'"
fi
[[ "$gpus" =~ ^[1-9][0-9]*$ ]] || fail "SPEEDRUN_GPUS: a number of GPUs, got '$gpus'"

trainer=(--config "$config" --data_dir "$data" --out_dir "$run" "${extra[@]}")
stage() { echo; echo "speedrun [$1/8] $2"; }
skip() { echo "speedrun: done already ($1): skipped"; }
newer() { [ -e "$1" ] && [ -e "$2" ] && [ "$1" -nt "$2" ]; }  # $1 exists and was written after $2

stage 1 "estimate: $gpus x $gpu"
# an estimate it cannot make (a GPU model outside the table) is said, and the run goes on: it only informs
if ! "$py" train_gpt2.py "${trainer[@]}" --estimate --gpu "$gpu" --gpus "$gpus" \
        ${SPEEDRUN_PRICE:+--price "$SPEEDRUN_PRICE"}; then
    echo "speedrun: no estimate (the line above says why); going on"
fi

stage 2 "data: token shards in $data"
manifests=("$data"/*_manifest.json)
if [ -e "${manifests[0]}" ]; then
    skip "${manifests[0]}"
elif [ "$shrink" = 1 ]; then
    "$py" prep/fineweb.py --input README.md docs/*.md ./*.py --out "$data" --val_size 16384 --num_proc 1
else
    "$py" prep/fineweb.py --out "$data"
fi

stage 3 "hellaswag: the val split in the cache"
if [ "$shrink" = 1 ]; then
    echo "speedrun: the rehearsal trains without HellaSwag (its data comes from the network): skipped"
else
    "$py" prep/hellaswag.py  # a valid file already there is kept, and said so
fi

stage 4 "train: $gpus processes into $run"
if "$py" scripts/run_finished.py "${trainer[@]}"; then
    skip "$run/log.jsonl records the checkpoint of the last step"
else
    "$py" -m torch.distributed.run --standalone --nproc_per_node="$gpus" train_gpt2.py "${trainer[@]}"
fi

stage 5 "card: $run/report.md"
if newer "$run/report.json" "$run/log.jsonl"; then
    skip "$run/report.json"
elif [ "$shrink" = 1 ]; then
    "$py" eval_lm.py "$run" --card --tasks none  # the tasks' data comes from the network
else
    "$py" eval_lm.py "$run" --card --batch_size 32
fi

stage 6 "gpt2 card: $run/gpt2_card/report.md"
if [ "$shrink" = 1 ]; then
    echo "speedrun: the rehearsal has no GPT-2 card (its weights come from the network): skipped"
elif [ -e "$run/gpt2_card/report.json" ]; then
    skip "$run/gpt2_card/report.json"
else
    "$py" eval_lm.py gpt2 --card --data_dir "$data" --out_dir "$run/gpt2_card" --batch_size 32
fi

stage 7 "beside: $run/report_vs_gpt2.md"
if [ -e "$run/gpt2_card/report.json" ]; then
    "$py" scripts/card_table.py "$run/report.json" "$run/gpt2_card/report.json" --names "$name,GPT-2 124M" \
        -o "$run/report_vs_gpt2.md"
else
    echo "speedrun: no GPT-2 card to set beside the run's: skipped"
fi

stage 8 "curves: $run/curves.png"
if newer "$run/curves.png" "$run/log.jsonl"; then
    skip "$run/curves.png"
else
    "$py" plot_log.py "$run" -o "$run/curves.png"
fi

echo
echo "speedrun: done: $run (report.md, curves.png$([ -e "$run/report_vs_gpt2.md" ] && echo ', report_vs_gpt2.md'))"
