"""Every CUDA path, checked on GPT-2 124M in bf16 on real tokens (pytest marker `gpu`).

scripts/gpu_check.sh runs them first on a GPU machine (about 3 minutes on one H100, most of it
compilation); each test stays well under a minute once the first compile is cached. Without CUDA
(CI), or with GPU_CHECK_DRY_RUN=1, they run on the CPU instead, with conftest's tiny model and the
same assertions: a rehearsal, in every `make test`, that proves the tests themselves before GPU
time is spent on them.

Real tokens: the repository's own text (README, docs, code), tokenized with data/tokenizer.py
into shards by benchmarks/corpus.py, which scripts/gpu_check.sh also uses for its benchmarks.

scripts/gpu_check.sh's own dry run, a part each, is rehearsed in tests/test_gpu_check.py, which `make test`
leaves to `make test-gpu-check` (CI runs both).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import GPT2_VOCAB, REPO, base_args, build_tiny_run, load_weights, run_trainer, train_losses
from slowness import guard
from benchmarks.corpus import write_corpus_shards
from data.tokenizer import GPT2_VOCAB_SIZE, get_tokenizer

DRY_RUN = os.environ.get("GPU_CHECK_DRY_RUN") == "1" or not torch.cuda.is_available()  # the CPU rehearsal


def gpu(test):
    """Marker `gpu` (gpu_check.sh's tests part selects them)."""
    return pytest.mark.gpu(test)


# (device, B, T, model keys, fused-loss chunk) of each setting, 2 micro-steps of B x T tokens:
# the rehearsal on the CPU starts from conftest's tiny model (base_args); 128 tokens per micro-batch
# give chunks of 48, 48 and 32. On CUDA, GPT-2 124M ("null" clears base_args' tiny n_layer/n_head/
# n_embd); 8192 tokens per micro-batch give chunks of 3000, 3000 and 2192, a ragged last one.
REHEARSAL = ("cpu", 4, 32, dict(micro_batch_size=4, total_batch_size=2 * 4 * 32, max_lr=3e-3), 48)
CUDA = ("cuda", 8, 1024, dict(model="gpt2", n_layer="null", n_head="null", n_embd="null", block_size=1024,
                              seq_len=1024, micro_batch_size=8, total_batch_size=2 * 8 * 1024, max_lr=6e-4), 3000)


def trainer_settings(device: str, B: int, T: int, model: dict) -> dict:
    """bf16 autocast, eager unless a test compiles. Warmup 5 keeps steps 0-4 independent of max_steps,
    so a 5-step run is the first half of a 10-step one (resume test). Val runs after the last step
    only, on one micro-batch."""
    return dict(model, device=device, dtype="bfloat16", compile="false", warmup_steps=5, min_lr=6e-5,
                eval_interval=0, val_tokens=B * T, checkpoint_interval=0, seed=1337, vocab_size=GPT2_VOCAB)


DEVICE, B, T, MODEL, CHUNK = REHEARSAL if DRY_RUN else CUDA
SETTINGS = trainer_settings(DEVICE, B, T, MODEL)
# The tests' own torch.compile calls: in the rehearsal, Dynamo traces the model as on the GPU, but
# the graphs run eagerly. Inductor's CPU kernels are not what a GPU runs, and generating them
# cost about 22 s of the rehearsal's 41 on a cold cache (CI's). The trainer's own compile (the
# HellaSwag run) still goes through Inductor.
COMPILE_BACKEND = "eager" if DRY_RUN else "inductor"

# Two runs on different kernels (compiled vs eager), or on kernels that round differently in each process (CUDA's
# atomics), part by rounding at their first backward. bf16 training at these settings amplifies that gap chaotically:
# on an H200 the compiled and eager losses were 6e-4 apart at step 2, 2.2e-2 at step 9 and 2.4e-3 at step 19. So the
# tests compare on the same state (same weights, same micro-batch), where the two agree to rounding, and hold the
# trajectories only to TRAJECTORY_TOL, which a lost optimizer state or a wrong lr or batch exceeds by far.
SAME_STATE_LOSS_TOL = 1e-3  # relative: one forward, bf16 operands (the fused-loss test's bound)
SAME_STATE_GRAD_TOL = 1e-2  # relative norm of the gradients of one backward, bf16 operands
RESUME_TOL = 1e-3  # absolute: the loss of the first step after one update from the same state
TRAJECTORY_TOL = 0.1  # absolute, per step: two trajectories that parted by rounding only
HELLASWAG_TIE = 5e-3  # relative gap between two endings' losses that bf16 rounding could close (~0.05 nats)
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def gpu_args(data: Path, out: Path, **overrides) -> list[str]:
    return base_args(data, out, **{**SETTINGS, **overrides})


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.linalg.norm(a.float() - b.float()) / torch.linalg.norm(b.float())).item()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus_shards(tmp_path_factory.mktemp("corpus"), train_tokens=40 * 2 * B * T + 1)


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches emptied after the test: its compiled frames of GPT.forward would otherwise stay in
    the process (an xdist worker runs other files next) and count toward the recompile limit there."""
    yield
    torch._dynamo.reset()


@pytest.fixture
def exact_fp32():
    """fp32 matmuls without TF32 (a fresh process's default), restored afterwards."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture(scope="module")
def compiled_run(corpus, tmp_path_factory) -> tuple[Path, Path]:
    """(run folder, HellaSwag fixture) of a compiled run with HellaSwag and samples every 2 steps."""
    from test_observability import hellaswag_fixture

    root = tmp_path_factory.mktemp("compiled")
    hellaswag = hellaswag_fixture(root / "hellaswag_val.jsonl")
    run_trainer(gpu_args(corpus, root / "run", compile="true", max_steps=4, eval_interval=2, hellaswag_interval=2,
                         hellaswag_path=hellaswag, sample_interval=2, sample_count=2, sample_tokens=8), timeout=240)
    return root / "run", hellaswag


def loss_and_grads(run, model, runtime, x: torch.Tensor, y: torch.Tensor, chunk: int = 0):
    """(loss, all gradients flattened, lm_head's gradient) of one forward and backward of run.model through
    `model` (itself or a compiled wrapper); the gradients are cleared after."""
    run.model.zero_grad(set_to_none=True)
    with runtime.autocast():
        _, loss = model(x, y, loss_chunk_size=chunk)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in run.model.parameters()])
    head = run.model.lm_head.weight.grad.clone()
    run.model.zero_grad(set_to_none=True)
    return loss.item(), grads, head


def train_in_process(data: Path, out: Path, steps: int, compile: bool, probe=None) -> list[float]:
    """Per-step losses of `steps` trainer steps through the eager model or torch.compile of it (one GPU).
    probe(run, runtime, step), if given, is called before each step."""
    from data.loader import Prefetcher
    from launch.components import make_lockstep

    cfg, ctx, run = build_tiny_run(data, out, **{**SETTINGS, "max_steps": steps, "loss_chunk_size": 0})
    model = torch.compile(run.model, backend=COMPILE_BACKEND) if compile else run.model
    batches = Prefetcher(run.train_loader, 0, steps, ctx.runtime.device)
    lockstep = make_lockstep(cfg, ctx)  # the trainer's step: the math, the votes, the one host sync
    losses = []
    try:
        for step in range(steps):
            if probe is not None:
                probe(run, ctx.runtime, step)
            losses.append(lockstep.step(run, model, batches, stop_requested=False).loss)
        return losses
    finally:
        batches.close()


@pytest.mark.slow  # not a process, but 40 steps and Dynamo's tracing: the longest of the fast set
@gpu
def test_compiled_and_eager_agree_step_by_step_over_20_steps(corpus, tmp_path, fresh_dynamo):
    """At each of 20 steps of an eager run, torch.compile of the model on the same weights and micro-batch
    gives the same loss and gradients to rounding; and 20 steps of the trainer's step through the compiled
    model follow the eager run to TRAJECTORY_TOL (the two part by rounding, which training amplifies)."""
    compiled_model = {}
    worst = {"loss": 0.0, "grads": 0.0, "lm_head": 0.0}

    def same_state(run, runtime, step):
        if "model" not in compiled_model:
            compiled_model["model"] = torch.compile(run.model, backend=COMPILE_BACKEND)
        x, y = (t.to(runtime.device) for t in run.train_loader.micro_batch(step, 0))
        eager_loss, eager_grads, eager_head = loss_and_grads(run, run.model, runtime, x, y)
        loss, grads, head = loss_and_grads(run, compiled_model["model"], runtime, x, y)
        for key, error in (("loss", abs(loss - eager_loss) / eager_loss), ("grads", relative_error(grads, eager_grads)),
                           ("lm_head", relative_error(head, eager_head))):
            worst[key] = max(worst[key], error)

    eager = train_in_process(corpus, tmp_path / "eager", 20, compile=False, probe=same_state)
    assert worst["loss"] <= SAME_STATE_LOSS_TOL, worst
    assert max(worst["grads"], worst["lm_head"]) <= SAME_STATE_GRAD_TOL, worst
    compiled = train_in_process(corpus, tmp_path / "compiled", 20, compile=True)
    gap = max(abs(a - b) for a, b in zip(compiled, eager))
    assert gap <= TRAJECTORY_TOL, f"compiled vs eager: {gap:.4g} > {TRAJECTORY_TOL}\n{compiled}\n{eager}"
    assert eager[-1] < eager[0] - 0.1, eager  # it learns, so the comparison means something


@gpu
def test_fused_chunked_loss_matches_the_plain_loss_and_its_gradients(corpus, tmp_path, fresh_dynamo):
    """The fused chunked lm_head + cross-entropy against the plain path, eager and compiled, in bf16.

    bf16 operands put both paths between 1e-3 and 1e-2 apart in relative norm; a wrong scale,
    chunk boundary or weight gradient is off by O(1).
    """
    _, ctx, run = build_tiny_run(corpus, tmp_path / "run", **SETTINGS)
    runtime = ctx.runtime
    x, y = (t.to(runtime.device) for t in run.train_loader.micro_batch(0, 0))
    compiled = torch.compile(run.model, backend=COMPILE_BACKEND)

    plain_loss, plain_grads, plain_head = loss_and_grads(run, run.model, runtime, x, y)
    for name, model in (("eager", run.model), ("compiled", compiled)):
        loss, grads, head = loss_and_grads(run, model, runtime, x, y, CHUNK)
        assert abs(loss - plain_loss) <= SAME_STATE_LOSS_TOL * plain_loss, (name, loss, plain_loss)
        assert relative_error(grads, plain_grads) <= SAME_STATE_GRAD_TOL, (name, relative_error(grads, plain_grads))
        assert relative_error(head, plain_head) <= SAME_STATE_GRAD_TOL, (name, relative_error(head, plain_head))


@pytest.mark.slow  # three trainer runs
@gpu
def test_resume_on_cuda_matches_a_straight_run(corpus, tmp_path, record_property):
    """10 straight steps that checkpoint at step 5, and a run resumed from that checkpoint for steps 5-9.

    Eager, as the CUDA default then (the fused loss): a checkpoint holds the uncompiled module, so
    compilation plays no part in what a resume restores.

    Both take step 5 from the same state: weights, optimizer moments, data position and lr. When two
    straight runs are bitwise equal (deterministic kernels), the resumed steps and final weights must
    be too. Otherwise (some CUDA backward kernels, attention's among them, add with atomics) each
    backward rounds differently in each process, and training amplifies that (TRAJECTORY_TOL's note).
    Then step 5, a forward on the same state, must give the same loss to rounding; step 6, after one
    update, within RESUME_TOL (a resume that lost the moments or the lr misses it by far); the rest
    within TRAJECTORY_TOL. The junit property `resume_comparison` says which applied.
    """
    from training.checkpoint.folder import list_checkpoints

    straight, again, resumed = (tmp_path / name for name in ("straight", "again", "resumed"))
    for out in (straight, again):
        run_trainer(gpu_args(corpus, out, max_steps=10, checkpoint_interval=5), timeout=240)
    (checkpoint,) = [path for step, path in list_checkpoints(straight / "checkpoints") if step == 5]
    proc = run_trainer(gpu_args(corpus, resumed, max_steps=10, resume=checkpoint), timeout=240)
    assert "resumed from" in proc.stdout and "at step 5" in proc.stdout, proc.stdout[-2000:]

    reference, repeat, losses = train_losses(straight), train_losses(again), train_losses(resumed)
    assert sorted(losses) == list(range(5, 10))
    weights, repeat_weights, resumed_weights = (load_weights(d, 10) for d in (straight, again, resumed))
    deterministic = reference == repeat and all(torch.equal(weights[k], repeat_weights[k]) for k in weights)
    if deterministic:
        record_property("resume_comparison", "bitwise")
        assert losses == {s: reference[s] for s in losses}
        for key in weights:
            assert torch.equal(resumed_weights[key], weights[key]), key
        return
    gaps = {s: abs(losses[s] - reference[s]) for s in losses}
    record_property("resume_comparison", "to rounding: " + ", ".join(f"step {s} {g:.3g}" for s, g in gaps.items()))
    assert gaps[5] <= SAME_STATE_LOSS_TOL * reference[5], gaps
    assert gaps[6] <= RESUME_TOL, gaps
    assert max(gaps.values()) <= TRAJECTORY_TOL, gaps


@pytest.mark.slow  # compiled_run starts the trainer
@gpu
def test_hellaswag_in_a_compiled_run_matches_an_eager_eval_of_its_checkpoint(compiled_run):
    """HellaSwag and samples interleaved with compiled training steps, then the same eval of the saved weights.

    The same weights and kernels give the same figures. Only an example whose two best endings
    lie within bf16 noise of each other (HELLASWAG_TIE) may flip, should this process's kernels
    round differently from the trainer's; the allowance is the count of such examples.
    """
    from evals.hellaswag import HellaSwag
    from hellaswag_scores import per_example_scores
    from model import GPT, GPTConfig
    from runtime.process_group import DistEnv
    from runtime.logger import read_log
    from runtime.runtime import resolve_runtime

    out, fixture = compiled_run
    records = read_log(out / "log.jsonl")
    logged = [r for r in records if r["kind"] == "hellaswag"]
    assert [r["step"] for r in logged] == [0, 2, 4] and all(r["n"] == 11 for r in logged)
    assert [r["step"] for r in records if r["kind"] == "sample"] == [2, 2, 4, 4]
    assert [r["step"] for r in records if r["kind"] == "train"] == [0, 1, 2, 3]

    state = torch.load(out / "checkpoints" / "step_00000004.pt", map_location="cpu", weights_only=True)
    runtime = resolve_runtime(DEVICE, "bfloat16", False, 0)
    model = GPT(GPTConfig(**state["model_args"]))
    model.load_state_dict(state["model"])
    model.to(runtime.device)
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=runtime.device, distributed=False)
    evaluator = HellaSwag(str(fixture), 0, env, get_tokenizer())
    result = evaluator.accuracy(model, runtime.autocast())
    assert result["n"] == 11

    scores = per_example_scores(evaluator, model, runtime.autocast())

    def near_ties(losses_of) -> int:
        """Examples whose two best endings' losses are within HELLASWAG_TIE (relative) of each other."""
        best_two = [sorted(losses_of(score))[:2] for score in scores]
        return sum(second - best <= HELLASWAG_TIE * best for best, second in best_two)

    assert abs(result["acc_norm"] - logged[-1]["acc_norm"]) * 11 <= near_ties(lambda s: s.mean_losses)
    assert abs(result["acc"] - logged[-1]["acc"]) * 11 <= near_ties(lambda s: s.sum_losses)


@pytest.mark.slow  # sample.py, and compiled_run the trainer
@gpu
def test_sample_py_with_kv_cache_equals_greedy_decoding_without_it(compiled_run, exact_fp32):
    from sample import load_model

    out, _ = compiled_run
    prompt, new_tokens = "The trainer resumes", 24
    proc = subprocess.run([sys.executable, str(REPO / "sample.py"), "--ckpt", str(out), "--prompt", prompt,
                           "--max_new_tokens", str(new_tokens), "--num_samples", "2", "--temperature", "0",
                           "--device", DEVICE], cwd=REPO, capture_output=True, text=True, timeout=guard(180))
    assert proc.returncode == 0, proc.stderr[-3000:]

    model, _ = load_model(str(out), torch.device(DEVICE))
    enc = get_tokenizer()
    ids = torch.tensor([enc.encode(prompt)], device=DEVICE)
    with torch.no_grad():
        for _ in range(new_tokens):  # the whole context through the model each time: no cache
            logits, _ = model(ids)
            ids = torch.cat([ids, logits[:, -1, :GPT2_VOCAB_SIZE].argmax(-1, keepdim=True)], dim=1)
    assert proc.stdout.count(f"\n{enc.decode(ids[0].tolist())}\n") == 2, proc.stdout


@pytest.mark.slow  # export_hf.py, and compiled_run the trainer
@gpu
def test_a_cuda_checkpoint_exports_and_loads_in_transformers_with_the_same_logits(compiled_run, tmp_path, exact_fp32):
    pytest.importorskip("transformers")
    from transformers import GPT2LMHeadModel

    from sample import load_model

    out, _ = compiled_run
    hf_dir = tmp_path / "hf"
    proc = subprocess.run([sys.executable, str(REPO / "export_hf.py"), str(out), str(hf_dir)], cwd=REPO,
                          env=dict(os.environ, **OFFLINE_ENV), capture_output=True, text=True, timeout=guard(180))
    assert proc.returncode == 0, proc.stderr[-3000:]
    hf = GPT2LMHeadModel.from_pretrained(hf_dir).to(DEVICE).eval()
    ours, _ = load_model(str(out), torch.device(DEVICE))
    tokens = get_tokenizer().encode_ordinary((REPO / "README.md").read_text())[: 2 * T]
    idx = torch.tensor(tokens, device=DEVICE).view(2, T)  # (2, T) of real text
    with torch.no_grad():
        ours_logits, _ = ours(idx)
        hf_logits = hf(idx).logits
    torch.testing.assert_close(ours_logits[..., :GPT2_VOCAB_SIZE], hf_logits, atol=1e-3, rtol=1e-3)


@pytest.mark.slow  # it starts bash (bench_gpu.sh's listing), though for well under a second
def test_every_gpu_launch_prepared_here_is_a_valid_configuration(tmp_path):
    """The trainer arguments of every GPU launch: bench_gpu.sh's variants (every micro-batch size a
    `fit` may try), compare_recipes.py --gpu, repro_check.py's runs, memory_check.py's and this file's CUDA
    setting.

    CI has no GPU and the dry runs replace the model and device, so a renamed key or a new rule
    between keys would otherwise first fail on a GPU. Each at its world size: 1, as gpu_check runs them, but
    for the group multigpu's (listed for a node of 8 GPUs, and of 3, whose step is not 524,288 tokens).
    """
    sys.path.insert(0, str(REPO / "scripts"))
    import bench
    import compare_recipes
    from benchmarks import memory_check, repro_check
    from launch.config import parse_args
    from launch.micro_batch import candidate_sizes

    launches, world_sizes = {}, {}
    # the default groups, then group multigpu's variants as a node of 8 GPUs and one of 3 would run them
    for gpus, groups in (("", []), ("8", ["multigpu"]), ("3", ["multigpu"])):
        listing = subprocess.run(["bash", str(REPO / "benchmarks" / "bench_gpu.sh"), "-", *groups],
                                 env=dict(os.environ, BENCH_LIST="1", BENCH_GPUS=gpus), capture_output=True, text=True,
                                 timeout=guard(60))
        assert listing.returncode == 0, listing.stderr
        for line in listing.stdout.splitlines():
            label, launcher, variables, arguments = line.split("\t")
            assert re.fullmatch(r"python|torchrun:\d+", launcher) and all("=" in v for v in variables.split()), line
            label += f" (node of {gpus})" if gpus else ""
            launches[label] = bench.split_args(arguments.split())[1]
            world_sizes[label] = int(launcher.partition(":")[2] or 1)
    assert [world_sizes[f"124m-ddp-{n}gpu (node of {n})"] for n in (8, 3)] == [8, 3]
    groups = {"speed": "124m-compile-plain-b64", "levers": "124m-levers-modern-fp8",
              "presets": "1558m-b4", "fsdp": "1558m-fsdp-b4", "longrun": "124m-compile-plain-b64-spikeskip",
              "repro": "124m-compile-plain-b64-deterministic"}
    assert set(groups.values()) <= set(launches), sorted(launches)
    max_steps, recipe_settings = compare_recipes.SETTINGS["gpu"]
    for recipe, extra in compare_recipes.RECIPES.items():
        launches[f"recipe-{recipe}"] = [*recipe_settings, *compare_recipes.COMMON, *extra]
    for mode, extra in repro_check.MODES.items():
        launches[f"repro-{mode}"] = [*repro_check.SHAPES["gpu"]["args"], *extra, "--max_steps", "50"]
    launches["test_gpu"] = base_args(tmp_path, tmp_path, **trainer_settings(*CUDA[:4]))
    for model in ("gpt2", "gpt2-xl"):
        for setting in memory_check.SETTINGS:
            launches[f"memory-{model}-{setting}"] = memory_check.trainer_args(model, setting, "data", tmp_path, False)
    for label, arguments in launches.items():
        cfg = parse_args(arguments)  # a ConfigError names the key
        assert cfg.runtime.device == "cuda" or "--device" not in arguments, label
        if cfg.data.micro_batch_size is None:  # auto: some micro-batch keeps grad_accum_steps whole
            assert candidate_sizes(cfg.data.total_batch_size, cfg.data.seq_len, world_sizes.get(label, 1)), label
        else:
            cfg.data.grad_accum_steps(world_sizes.get(label, 1))


def test_packages_on_the_callers_pythonpath_reach_the_trainers_the_tests_start(monkeypatch, tmp_path):
    """A GPU machine set up by hand may hold some packages beside its Python's own, on PYTHONPATH: the
    trainers these tests start keep them, behind the repository."""
    from conftest import trainer_env

    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert trainer_env()["PYTHONPATH"].split(os.pathsep) == [str(REPO), str(tmp_path)]
    monkeypatch.delenv("PYTHONPATH")
    assert trainer_env()["PYTHONPATH"] == str(REPO)
