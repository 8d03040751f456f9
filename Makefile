# Set-up and entry points. `make demo` and `make test` work on a fresh clone: they create the
# virtual environment in .venv and install what they need first.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# Without an NVIDIA GPU, take PyTorch's CPU wheel (about 200 MB) rather than PyPI's CUDA build
# (several GB). Its index is asked first (scripts/torch_index.py, at most 5 s): where it cannot be
# reached, one line says so and torch comes from pip's configured index alone, without pip's
# screen of retry warnings. With an NVIDIA GPU, PyPI's CUDA build. TORCH_INDEX=... overrides both.
HAS_NVIDIA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo yes)
ifeq ($(HAS_NVIDIA)$(shell uname -s),Linux)
TORCH_INDEX ?= $$($(PYTHON) scripts/torch_index.py https://download.pytorch.org/whl/cpu)
endif
# glibc's malloc settings that make CPU training (the demo) about 1.7x faster: common/cpu_malloc.env says why
CPU_MALLOC := $(shell grep -E '^[A-Z_]+=' common/cpu_malloc.env)

# $(call fresh_folder,NAME): empty the folder that the variable NAME names, for a target that writes all of it.
# Quoted (a path may hold spaces), and refused in one line where the folder holds anything the target did not
# write (no .made_by_make in it: `make smoke SMOKE_DIR=.` must not delete the repository) or is not a folder.
define fresh_folder
	@if [ -z "$($(1))" ] || { [ -e "$($(1))" ] && [ ! -d "$($(1))" ]; } || { [ -d "$($(1))" ] && \
	    [ ! -e "$($(1))/.made_by_make" ] && [ -n "$$(ls -A "$($(1))")" ]; }; then \
	    echo "error: $(1)=\"$($(1))\" is not a folder this target made; name a new or empty folder" >&2; exit 2; fi
	rm -rf "$($(1))"
	mkdir -p "$($(1))" && touch "$($(1))/.made_by_make"
endef

.PHONY: install demo smoke pictures test test-fast test-smoke test-slurm test-capability test-triton test-gpu-check lint lock \
	clean-demo

# requirements.txt holds lower bounds; requirements.lock the exact versions CI passed with
$(VENV)/.installed: requirements.txt requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION) $(TORCH_INDEX)
	$(PY) -m pip install --quiet -r requirements.txt -c requirements.lock
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) prep/shakespeare.py
	$(CPU_MALLOC) $(PY) train_gpt2.py --config configs/demo.yaml
	$(PY) sample.py --ckpt out/demo --prompt "ROMEO:" --max_new_tokens 120 --num_samples 1
	$(PY) plot_log.py out/demo -o out/demo/curves.png

# The documented GPT-2 124M launch (README, "Train GPT-2 124M"): torchrun, 2 ranks, configs/gpt2_124m.yaml as
# it is, shrunk on the command line to check a machine's setup in about a minute on 2 CPU cores, on a small
# data folder made here from the repository's own text (no network; prep in one process for its ~200 KB). What
# it shrinks: the model (custom, 2 layers, 64 wide: one micro-batch of the 124M config is about 6 x 124M x
# 65,536 = 4.9e13 FLOPs, minutes on a CPU); micro_batch_size 64 -> 1 and total_batch_size 524,288 -> 4,096, so
# each rank still accumulates 2 micro-batches of the real seq_len 1,024 under no_sync, as on fewer than 8
# GPUs; max_steps 19,073 -> 6 with warmup_steps 715 -> 2, so the lr warms up and its cosine runs; the val
# loss and the checkpoints every 3 steps instead of 250 and 5,000 (val_tokens 4,096 of a val split of at
# most 16,384 tokens, which holds whole documents: README.md, the first, must fit), the samples at the end;
# HellaSwag off (its data comes from the network). Everything it writes is in SMOKE_DIR, emptied first.
SMOKE_DIR ?= out/smoke
SMOKE_SHRINK := --model custom --n_layer 2 --n_head 2 --n_embd 64 --micro_batch_size 1 --total_batch_size 4096 \
	--max_steps 6 --warmup_steps 2 --eval_interval 3 --val_tokens 4096 --sample_interval 6 --checkpoint_interval 3 \
	--hellaswag_interval 0
smoke: install
	$(call fresh_folder,SMOKE_DIR)
	$(PY) prep/fineweb.py --input README.md docs/*.md *.py --out "$(SMOKE_DIR)/data" --val_size 16384 --num_proc 1
	@$(CPU_MALLOC) $(VENV)/bin/torchrun --standalone --nproc_per_node=2 train_gpt2.py --config configs/gpt2_124m.yaml \
		--data_dir "$(SMOKE_DIR)/data" --out_dir "$(SMOKE_DIR)/run" $(SMOKE_SHRINK) \
	&& echo "smoke: passed: the 124M launch trained on 2 ranks under torchrun; its run folder is $(SMOKE_DIR)/run" \
	|| { echo "smoke: FAILED: the launch's error: line above says why" >&2; exit 1; }

# Every shipped picture (docs/*.png) redrawn by plot_log.py or ladder.py from the runs it shows, kept small
# in docs/pictures/ (the records it draws, config.yaml and the train data's unigram entropy; a ladder's
# ladder.json), with what each draws in docs/pictures/NAME/figure.txt (tests/test_plot_log.py compares it to
# today's plot_log.py and ladder.py): seconds. FROM_SCRATCH=1 first reruns those runs into out/pictures/ and
# stores them: make demo's training, the README's mixture and scripts/compare_recipes.py's seed 1337 (26
# minutes, measured on 2 CPU cores under a load average of 8-12), then the README's scaling ladder with its
# check, one thread a run as docs/SCALING.md's was trained (29 minutes there, under a load average of 6-14).
PICTURE_RUNS := out/pictures
pictures: install
ifdef FROM_SCRATCH
	$(call fresh_folder,PICTURE_RUNS)
	$(PY) prep/shakespeare.py
	$(CPU_MALLOC) $(PY) train_gpt2.py --config configs/demo.yaml --out_dir "$(PICTURE_RUNS)/demo"
	$(PY) prep/fineweb.py --input README.md docs/*.md --out data/prose --val_size 16384 --overwrite
	$(PY) prep/fineweb.py --input $$(git ls-files '*.py') --out data/code --val_size 16384 --overwrite
	$(CPU_MALLOC) $(PY) train_gpt2.py --config configs/demo.yaml --data_dir data/prose:0.5,data/code:0.5 \
	    --val_tokens 2048 --max_steps 300 --eval_interval 25 --sample_interval 0 --out_dir "$(PICTURE_RUNS)/mix"
	$(PY) scripts/compare_recipes.py --seeds 1337 --out "$(PICTURE_RUNS)/recipes"
	OMP_NUM_THREADS=1 $(PY) ladder.py --tokens_per_param 0.01 --seeds 1337 1 --check --set eval_interval=0 \
	    --set sample_interval=0 --out "$(PICTURE_RUNS)/ladder"
	$(PY) scripts/pictures.py --store "$(PICTURE_RUNS)"
endif
	$(PY) scripts/pictures.py

# Tests run on both cores (pytest-xdist), a whole file per worker: a file's run fixtures are built once.
XDIST := -n 2 --dist loadfile

# everything but `make smoke` run for real, the Slurm scenarios and the GPU check's rehearsal (CI runs those
# next); about 7 minutes on 2 idle CPU cores. The 10 slowest tests are listed, so growth shows.
test: install lint
	$(CPU_MALLOC) $(PY) -m pytest -q $(XDIST) --durations=10 -m "not slurm and not smoke and not gpu_check"

# The checkpoint and resume tests once more with PyTorch's CPU kernels chosen as on a machine without AVX
# (ATEN_CPU_CAPABILITY=default), which differ from this machine's own (avx2, avx512) in the last bits of float
# results: their bitwise comparisons are between two results computed in the same run, so they must hold on any
# CPU a user has. About 3 minutes on 2 idle CPU cores.
CAPABILITY_TESTS := tests/test_run_state.py tests/test_resume.py tests/test_checkpoint.py tests/test_sharded_checkpoint.py \
	tests/test_damaged_checkpoints.py
test-capability: install
	ATEN_CPU_CAPABILITY=default $(PY) -c "import torch; print('CPU kernels:', torch.backends.cpu.get_cpu_capability())"
	ATEN_CPU_CAPABILITY=default $(CPU_MALLOC) $(PY) -m pytest -q $(XDIST) -m "not slurm and not smoke" $(CAPABILITY_TESTS)

# `make smoke` run for real through make, into a temporary SMOKE_DIR, and its run folder checked
# (tests/test_smoke.py); then scripts/speedrun.sh rehearsed the same way (SPEEDRUN_SHRINK=1), twice: the second
# run skips every stage the first completed (tests/test_speedrun.py). About a minute on 2 idle CPU cores.
test-smoke: install
	$(CPU_MALLOC) $(PY) -m pytest -q -p no:xdist -m smoke tests/test_smoke.py tests/test_speedrun.py

# scripts/slurm.sbatch submitted to a real Slurm on this machine (tests/test_slurm.py: munge, slurmctld and
# two slurmd, started and stopped by the tests); installs Debian's Slurm and munge first where they are
# missing (root or sudo, about 10 s). About 2.5 minutes on 2 idle CPU cores.
test-slurm: install
	bash scripts/install_slurm.sh
	REQUIRE_SLURM=1 $(CPU_MALLOC) $(PY) -m pytest -q -p no:xdist -m slurm tests/test_slurm.py --durations=0

# scripts/gpu_check.sh rehearsed on the CPU (GPU_CHECK_DRY_RUN=1, tiny models), a part per test: its parts, results
# files, budget and several GPUs (2 ranks on gloo, 2 stand-in GPUs), proven before GPU time is spent on them
# (tests/test_gpu_check.py). About 4 minutes on 2 idle CPU cores, most of it on one (its tests share one fixture).
test-gpu-check: install
	$(CPU_MALLOC) $(PY) -m pytest -q -p no:xdist -m gpu_check tests/test_gpu_check.py

# The Triton kernels (runtime/kernels/) run by Triton's interpreter on the CPU (TRITON_INTERPRET=1), checked
# against torch's ops (tests/test_kernels.py, marker `triton`): seconds, in an environment of their own,
# TRITON_VENV, made once with the same torch and requirements as .venv, plus Triton, which .venv never gets
# (make test skips these tests, saying why). The Triton that the GPU checks ran with.
TRITON_VERSION ?= 3.6.0
TRITON_VENV ?= .venv-triton
$(TRITON_VENV)/.installed: requirements.txt requirements.lock
	$(PYTHON) -m venv $(TRITON_VENV)
	$(TRITON_VENV)/bin/python -m pip install --quiet torch==$(TORCH_VERSION) $(TORCH_INDEX)
	$(TRITON_VENV)/bin/python -m pip install --quiet triton==$(TRITON_VERSION) -r requirements.txt -c requirements.lock
	touch $@

test-triton: $(TRITON_VENV)/.installed
	TRITON_INTERPRET=1 $(CPU_MALLOC) $(TRITON_VENV)/bin/python -m pytest -q -p no:xdist -m triton tests/test_kernels.py

# the inner loop: no test that starts a process (trainer, torchrun, prep) or compiles; about 40 seconds
test-fast: install
	$(CPU_MALLOC) $(PY) -m pytest -q $(XDIST) -m "not slow"

lint: install
	$(VENV)/bin/ruff check .

# remake requirements.lock from the newest versions requirements.txt allows (then run make test)
lock:
	rm -rf .lock-venv
	$(PYTHON) -m venv .lock-venv
	.lock-venv/bin/python -m pip install --quiet torch==$(TORCH_VERSION) $(TORCH_INDEX)
	.lock-venv/bin/python -m pip install --quiet -r requirements.txt
	{ sed -n '1,3p' requirements.lock; .lock-venv/bin/python -m pip freeze --exclude torch; } > requirements.lock.new
	mv requirements.lock.new requirements.lock
	rm -rf .lock-venv

clean-demo:
	rm -rf out/demo data/shakespeare
