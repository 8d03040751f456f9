"""Every CUDA path, checked on GPT-2 124M in bf16 on real tokens (pytest marker `gpu`).

scripts/gpu_check.sh runs them first on a GPU machine (about 3 minutes on one H100, most of it
compilation); each test stays well under a minute once the first compile is cached. Without CUDA
(CI), or with GPU_CHECK_DRY_RUN=1, they run on the CPU instead, with conftest's tiny model and the
same assertions: a rehearsal, in every `make test`, that proves the tests themselves before GPU
time is spent on them.

Real tokens: the repository's own text (README, docs, code), tokenized with data/tokenizer.py
into shards by write_corpus_shards, which scripts/gpu_check.sh also uses for its benchmarks.

The last tests (marked slow, not gpu) run scripts/gpu_check.sh's own dry run on the CPU, a part each.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import GPT2_VOCAB, REPO, base_args, build_tiny_run, load_weights, run_trainer, train_losses
from slowness import guard
from data.shards import shard_name, write_shard
from data.tokenizer import GPT2_VOCAB_SIZE, get_tokenizer, tokenize_document

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


def repo_text_documents() -> list[str]:
    """The repository's own prose and code, one document per file, in a fixed order."""
    patterns = ("*.md", "docs/*.md", "*.py", "*/*.py", "configs/*.yaml")
    paths = sorted({p for pattern in patterns for p in REPO.glob(pattern)
                    if not any(part.startswith(".") for part in p.relative_to(REPO).parts)})
    return [p.read_text(encoding="utf-8", errors="replace") for p in paths]


def write_corpus_shards(folder: str | Path, train_tokens: int, val_tokens: int = 65_537) -> Path:
    """A val and a train shard of the repository's text (~180K tokens), repeated to the sizes asked.

    Real text, so losses fall and compare across variants; the repetition does not matter for
    speed or for comparing two runs on the same tokens. The val window repeats train text: it
    only has to exist (65,537 tokens: one B=64 micro-batch at T=1024, what scripts/bench.py reads).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokens = np.concatenate([tokenize_document(text) for text in repo_text_documents()])
    write_shard(folder / shard_name("repo", "val", 0), np.resize(tokens, val_tokens))
    write_shard(folder / shard_name("repo", "train", 1), np.resize(tokens, train_tokens))
    return folder


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
    from training.core.process_group import DistEnv
    from training.core.logger import read_log
    from training.core.runtime import resolve_runtime

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
    import memory_check
    import repro_check
    from launch.config import parse_args
    from training.run.micro_batch import candidate_sizes

    launches, world_sizes = {}, {}
    # the default groups, then group multigpu's variants as a node of 8 GPUs and one of 3 would run them
    for gpus, groups in (("", []), ("8", ["multigpu"]), ("3", ["multigpu"])):
        listing = subprocess.run(["bash", str(REPO / "scripts" / "bench_gpu.sh"), "-", *groups],
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


# A stand-in for build-nanogpt's train_gpt2.py, whose code may not live in this repository: the
# definitions scripts/gpu_reference.py loads, on our model, around statements that must not run.
REFERENCE_STAND_IN = """
import os
import numpy as np
import torch
from hellaswag import render_example
import model as ours

class GPTConfig(ours.GPTConfig):
    pass

class GPT(ours.GPT):
    def configure_optimizers(self, weight_decay, learning_rate, device_type):
        return super().configure_optimizers(weight_decay, learning_rate, (0.9, 0.95), 1e-8, device_type)

def get_lr(it):
    return max_lr * min(1.0, (it + 1) / warmup_steps)

class DataLoaderLite:
    def __init__(self, B, T, process_rank, num_processes, split):
        self.B, self.T, self.position = B, T, 0
        shard = sorted(name for name in os.listdir("edu_fineweb10B") if split in name)[0]
        self.tokens = torch.tensor(np.load(os.path.join("edu_fineweb10B", shard)).astype(np.int32), dtype=torch.long)

    def next_batch(self):
        buf = self.tokens[self.position : self.position + self.B * self.T + 1]
        self.position += self.B * self.T
        return buf[:-1].view(self.B, self.T), buf[1:].view(self.B, self.T)

raise SystemExit("the reference's top-level training code ran")
"""


# scripts/gpu_check.sh on the CPU (GPU_CHECK_DRY_RUN=1): the parts in five invocations, grouped as its header
# splits them (multigpu alone: 2 ranks on gloo), each into its own results folder, and one test per part; then
# parts spread over 2 stand-in GPUs side by side, a budget that skips every part, and --report merging them all. The `gpu` tests above run in this suite itself
# (their CPU form, without CUDA): the tests part runs one of them (GPU_CHECK_TESTS), which proves the part's
# own plumbing (its pytest command, the junit XML read into results.json) without running them twice.
DRY_RUN_SPEED = ["124m-compile-plain-b64", "124m-eager-fused-b64"]  # two of the group keep the part short
DRY_RUN_RECOMPUTE = ["124m-eager-fused-b64-full"]  # one of bench_gpu.sh's group recompute
DRY_RUN_TEST = "test_fused_chunked_loss_matches_the_plain_loss_and_its_gradients"  # in-process: seconds
DRY_RUN_CALLS = {"call1": ("tests", "speed"), "call2": ("reference",), "call3": ("recipe", "checkpoint"),
                 "call4": ("memory", "recompute"), "call5": ("multigpu",)}  # results folder: its call's parts
DRY_RUN_MULTIGPU = ["124m-ddp-1gpu", "124m-ddp-2gpu"]  # bench_gpu.sh's group multigpu on 2 ranks
# recipe's comparison of two recipes needs data/shakespeare (`make demo` makes it), and is skipped without it
RECIPE_WITHOUT_DATA = ("recipe", "no data/shakespeare (python prep/shakespeare.py first)")


@pytest.fixture(scope="module")
def gpu_check(tmp_path_factory):
    """gpu_check(name, *args, report=False, **env): `scripts/gpu_check.sh RESULTS *args` (or `--report RESULTS
    *args`, each a name) in the dry run, RESULTS this module's folder `name`, run once per name (the --report
    test reuses the parts' results) -> (RESULTS, the finished process)."""
    root = tmp_path_factory.mktemp("gpu_check")
    reference = root / "ref" / "train_gpt2.py"
    reference.parent.mkdir()
    reference.write_text(REFERENCE_STAND_IN)
    env = dict(os.environ, GPU_CHECK_DRY_RUN="1", GPU_REFERENCE=str(reference), PYTHON=sys.executable,
               MALLOC_MMAP_THRESHOLD_="17179869184", MALLOC_TRIM_THRESHOLD_="17179869184",
               BENCH_ONLY=" ".join(DRY_RUN_SPEED + DRY_RUN_RECOMPUTE + DRY_RUN_MULTIGPU + ["reference-*"]),
               GPU_CHECK_TESTS=DRY_RUN_TEST)
    env.pop("OUT", None)
    done = {}

    def run(name: str, *args: str, report: bool = False, **extra_env: str) -> tuple[Path, subprocess.CompletedProcess]:
        if name not in done:
            # gpu_check.sh works from the repository root: every folder it is given is absolute
            args = ["--report", str(root / name), *(str(root / a) for a in args)] if report else [str(root / name), *args]
            proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), *args], cwd=root,
                                  env={**env, **extra_env}, capture_output=True, text=True, timeout=guard(300))
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            done[name] = root / name, proc
        return done[name]

    return run


def dry_run_part(gpu_check, part: str) -> tuple[Path, dict, set[str]]:
    """The call of DRY_RUN_CALLS that runs `part`, its results folder checked as every call's is
    -> (the folder, its results.json, the names in its details.tar.gz)."""
    (name, parts), = [(name, parts) for name, parts in DRY_RUN_CALLS.items() if part in parts]
    out, proc = gpu_check(name, *parts)
    assert sorted(p.name for p in out.iterdir()) == [
        "details.tar.gz", "gpu_check.log", "numerics.json", "results.json", "summary.md"]
    assert proc.stdout.endswith((out / "summary.md").read_text())  # the summary is printed last
    results = json.loads((out / "results.json").read_text())
    skipped = [(s["label"], s["why"]) for s in results["skipped"]]
    assert skipped in ([], [RECIPE_WITHOUT_DATA]), skipped
    assert [(p["part"], p["status"]) for p in results["parts"]] == [
        (p, "skipped: nothing to run" if p == "recipe" and skipped else "ok") for p in parts]
    assert results["environment"][0]["dry_run"] and not results["failed"]
    with tarfile.open(out / "details.tar.gz") as tar:
        details = set(tar.getnames())
    assert {"parts.tsv", "environment.json"} <= details
    return out, results, details


def gpu_tests() -> list[str]:
    """The `gpu` tests above, sorted."""
    return sorted(name for name, test in globals().items() if name.startswith("test_") and "gpu" in
                  {mark.name for mark in getattr(test, "pytestmark", [])})


@pytest.mark.slow
def test_gpu_check_dry_run_tests_part_runs_the_chosen_gpu_tests_and_reads_their_outcome(gpu_check):
    """gpu_check.sh's pytest on the one `gpu` test GPU_CHECK_TESTS names, its outcome read from the junit XML."""
    _, results, details = dry_run_part(gpu_check, "tests")
    assert DRY_RUN_TEST in gpu_tests() and len(gpu_tests()) == 6
    assert [(t["test"], t["outcome"]) for t in results["tests"]] == [(DRY_RUN_TEST, "passed")]
    assert {"tests.xml", "tests.log"} <= details


@pytest.mark.slow
def test_gpu_check_dry_run_speed_part_benches_the_variants_and_compares_their_losses(gpu_check):
    out, results, details = dry_run_part(gpu_check, "speed")
    assert [r["label"] for r in results["rows"]] == DRY_RUN_SPEED
    (numerics,) = json.loads((out / "numerics.json").read_text())
    assert [r["label"] for r in numerics["rows"]] == DRY_RUN_SPEED and all(r["within_tolerance"] for r in numerics["rows"])
    assert {"124m-compile-plain-b64.json", "124m-compile-plain-b64.log"} <= details


@pytest.mark.slow
def test_gpu_check_dry_run_reference_part_runs_the_reference_loop(gpu_check):
    out, results, details = dry_run_part(gpu_check, "reference")
    assert [r["label"] for r in results["rows"]] == ["reference-build-nanogpt-b64"]
    assert "reference-build-nanogpt-b64.log" in details
    assert "1.000x" in (out / "summary.md").read_text()  # the reference's own row


@pytest.mark.slow
def test_gpu_check_dry_run_checkpoint_part_saves_and_loads_in_every_format(gpu_check):
    out, results, _ = dry_run_part(gpu_check, "checkpoint")
    saves, loads = results["checkpoint"][:3], results["checkpoint"][3:]
    assert [c["label"] for c in results["checkpoint"]] == [
        f"checkpoint-tiny-{v}" for v in ("file", "sharded", "sharded-async", "load-file", "load-sharded")]
    assert all(c["total_s"] >= c["blocking_s"] > 0 and c["bytes_on_disk"] > 0 for c in saves)
    assert all(c["load_s"] > 0 for c in loads) and "| checkpoint-tiny-load-file |" in (out / "summary.md").read_text()


@pytest.mark.slow
def test_gpu_check_dry_run_memory_part_sets_auto_beside_the_tables_estimate(gpu_check):
    """On the CPU micro_batch_size auto falls back (4): the rehearsal checks the plumbing, each setting's run,
    run.json's record, the estimate, and the summary's table."""
    out, results, details = dry_run_part(gpu_check, "memory")
    settings = ("none", "selective", "full")
    assert [m["label"] for m in results["memory"]] == [f"memory-tiny-{s}" for s in settings]
    assert all(m["exit"] == 0 and m["chosen_B"] == 4 and m["how"] == "fallback (cpu)" and m["peak_gib"] is None
               for m in results["memory"])
    per_sequence = [m["activations_per_sequence_gib"] for m in results["memory"]]
    assert per_sequence[2] < per_sequence[0]  # full recomputation keeps less per sequence than none
    assert all(m["estimate_peak_gib"] > 0 for m in results["memory"]) and "memory-gpt2.log" in details
    summary = (out / "summary.md").read_text()
    assert "## Memory: micro_batch_size auto" in summary and "| tiny | full | 4 | fallback (cpu) | 0 | - |" in summary


@pytest.mark.slow
def test_gpu_check_dry_run_recipe_part_times_muons_step_before_the_recipes(gpu_check):
    """Muon's optimizer step needs no data; the recipes need data/shakespeare, and are skipped without it."""
    out, results, _ = dry_run_part(gpu_check, "recipe")
    assert [m["label"] for m in results["muon"]] == ["muon-replicated", "muon-whole", "muon-rows"]
    assert all(m["step_ms"] > 0 and m["newton_schulz_runs"] == 8 for m in results["muon"])  # one process: all 8
    assert "| muon-whole | dry_run | 1 | cpu |" in (out / "summary.md").read_text()


@pytest.mark.slow
def test_gpu_check_dry_run_recompute_part_benches_activation_checkpointing(gpu_check):
    """The part runs bench_gpu.sh's group recompute (one of its variants here, to keep it short)."""
    out, results, _ = dry_run_part(gpu_check, "recompute")
    assert [r["label"] for r in results["rows"]] == DRY_RUN_RECOMPUTE
    assert f"| {DRY_RUN_RECOMPUTE[0]} |" in (out / "summary.md").read_text()


# The levers part as docs/PERFORMANCE.md gives its call, `GPU_CHECK_BUDGET_S=480 bash scripts/gpu_check.sh DIR levers`:
# the reference loop, then (to keep the rehearsal short) the plain row and the modern recipe's, with what the part
# decides without a GPU: the best combination (here no lever beat the plain row: none was measured) and the FP8 row,
# which the CPU cannot run. Every other variant's arguments are checked by the test of every GPU launch above.
LEVERS_REHEARSED = ["124m-levers-plain", "124m-levers-best", "124m-levers-modern", "124m-levers-modern-fp8"]


@pytest.mark.slow
def test_gpu_check_dry_run_levers_part_benches_the_levers_beside_the_reference(gpu_check):
    out, _ = gpu_check("levers", "levers", GPU_CHECK_BUDGET_S="480", BENCH_ONLY=" ".join(LEVERS_REHEARSED))
    results = json.loads((out / "results.json").read_text())
    assert [(p["part"], p["status"]) for p in results["parts"]] == [("levers", "ok")] and not results["failed"]
    rows = {r["label"]: r for r in results["rows"]}
    assert list(rows) == ["reference-build-nanogpt-b64-levers", "124m-levers-plain", "124m-levers-modern"]
    assert [(s["label"], s["why"]) for s in results["skipped"]] == [
        ("124m-levers-best", "0 of 2 levers beat 124m-levers-plain alone: no combination to run"),
        ("124m-levers-modern-fp8", "the dry run is on the CPU, which fp8_lm_head refuses")]
    plain, modern = rows["124m-levers-plain"], rows["124m-levers-modern"]
    assert (plain["optimizer"], modern["optimizer"]) == ("adamw", "muon") and plain["levers"] == modern["levers"] == []
    assert plain["top_kernels"] and modern["top_kernels"]  # one profiled step each
    # the same steps on the same tokens as the reference's (2 + 8 there, shrunk alike to 1 + 2 here)
    assert rows["reference-build-nanogpt-b64-levers"]["steps_timed"] == plain["steps_timed"] == 2
    assert json.loads((out / "numerics.json").read_text()) == []  # AdamW and Muon rows are never compared
    summary = (out / "summary.md").read_text()
    assert "| reference-build-nanogpt-b64-levers | 2 |" in summary and "1.000x" in summary
    assert all(f"| {label} |" in summary for label in rows) and "124m-levers-modern-fp8: skipped" in summary


@pytest.mark.slow
def test_gpu_check_dry_run_multigpu_part_scales_all_reduces_and_preempts_on_2_ranks(gpu_check):
    """The part on every GPU, rehearsed on 2 gloo ranks: the same step on 2 ranks and on 1 (its figures paired,
    its losses equal: DDP on 2 ranks trains on the same batches as accumulation on one), the all-reduce of a
    bucket and of the whole gradient, and a run that SIGTERM stopped mid-run and a relaunch resumed."""
    out, results, details = dry_run_part(gpu_check, "multigpu")
    assert [(r["label"], r["world_size"], r["grad_accum"]) for r in results["rows"]] == [
        ("124m-ddp-1gpu", 1, 2), ("124m-ddp-2gpu", 2, 1)]
    (numerics,) = json.loads((out / "numerics.json").read_text())
    assert [r["label"] for r in numerics["rows"]] == DRY_RUN_MULTIGPU and all(r["within_tolerance"] for r in numerics["rows"])
    assert [(a["label"], a["world_size"], a["backend"]) for a in results["allreduce"]] == [
        (f"allreduce-{buffer}-{dtype}", 2, "gloo") for buffer in ("bucket", "grad") for dtype in ("fp32", "bf16")]
    assert all(a["ms"] > 0 and a["algbw_gbps"] > 0 for a in results["allreduce"])
    assert all(a["busbw_gbps"] == pytest.approx(a["algbw_gbps"]) for a in results["allreduce"])  # 2 ranks: 2(N-1)/N = 1
    (preempted,) = results["preemption"]
    assert preempted["ok"] and preempted["problems"] == [] and preempted["world_size"] == 2
    assert 3 < preempted["saved_step"] == preempted["resumed_at"] < preempted["final_checkpoint"] == 12
    assert preempted["logged_steps"] == 12
    summary = (out / "summary.md").read_text()
    assert "## Several GPUs: the same step under DDP on N GPUs and on one" in summary
    assert "| 124m-ddp-2gpu | 2 |" in summary and "| allreduce-grad-fp32 | dry_run |" in summary
    assert "| preemption-2gpu | 2 | 12 | 3 |" in summary and "ok: resumed where it stopped" in summary
    assert {"124m-ddp-2gpu.json", "allreduce-2gpu.log", "preemption-2gpu.log", "preemption-2gpu-launch1.log",
            "preemption-2gpu-launch2.log"} <= details


@pytest.mark.slow
def test_gpu_check_on_several_gpus_runs_the_single_gpu_parts_side_by_side_one_gpu_each(gpu_check):
    """With 2 GPUs (GPU_CHECK_GPUS=2: stand-ins on the CPU) two parts run at once, each in an invocation of its own
    on one of the GPUs CUDA_VISIBLE_DEVICES names, and their results merge into the one results folder."""
    out, proc = gpu_check("spread", "tests", "reference", GPU_CHECK_GPUS="2", CUDA_VISIBLE_DEVICES="4,6")
    assert sorted(p.name for p in out.iterdir()) == [
        "details.tar.gz", "gpu_check.log", "numerics.json", "results.json", "summary.md"]
    assert proc.stdout.endswith((out / "summary.md").read_text())
    results = json.loads((out / "results.json").read_text())
    assert results["spread"] == [{"gpu": "4", "parts": ["tests"]}, {"gpu": "6", "parts": ["reference"]}]
    assert [(p["part"], p["status"]) for p in results["parts"]] == [("tests", "ok"), ("reference", "ok")]
    assert [e["cuda_visible_devices"] for e in results["environment"]] == ["4,6", "4", "6"]
    assert [t["test"] for t in results["tests"]] == [DRY_RUN_TEST]
    assert [r["label"] for r in results["rows"]] == ["reference-build-nanogpt-b64"] and not results["failed"]
    assert "Spread over 2 GPUs, one invocation each, side by side: GPU 4: tests; GPU 6: reference" in (
        out / "summary.md").read_text()
    with tarfile.open(out / "details.tar.gz") as tar:
        assert {"gpu_check-gpu0.log", "gpu_check-gpu1.log", "details-gpu0.tar.gz", "details-gpu1.tar.gz",
                "spread.tsv"} <= set(tar.getnames())


@pytest.mark.slow
def test_gpu_check_skips_every_part_a_spent_budget_leaves_no_time_for(gpu_check):
    skipped, _ = gpu_check("skipped", "tests", "presets", GPU_CHECK_BUDGET_S="1")
    parts = json.loads((skipped / "results.json").read_text())["parts"]
    assert [p["part"] for p in parts] == ["tests", "presets"] and all(p["status"].startswith("skipped") for p in parts)
    # on several GPUs: multigpu first, then the others, none started
    spread, _ = gpu_check("skipped-spread", "tests", "presets", "multigpu", GPU_CHECK_BUDGET_S="1", GPU_CHECK_GPUS="2")
    results = json.loads((spread / "results.json").read_text())
    assert [p["part"] for p in results["parts"]] == ["multigpu", "tests", "presets"] and not results["spread"]
    assert all(p["status"].startswith("skipped") for p in results["parts"]), results["parts"]


WITHOUT_PYDANTIC = """
import sys


class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "pydantic":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


sys.meta_path.insert(0, Absent())
"""


@pytest.mark.parametrize("case", ["a python without the requirements", "an unknown part", "a count of no GPUs"])
def test_gpu_check_refuses_in_one_line_before_it_runs_any_part(case, tmp_path):
    """A GPU image's own Python with torch but without requirements.txt (pydantic), a misspelt part, or
    GPU_CHECK_GPUS not a number of GPUs: one error line and exit 2, no results folder, rather than the same
    traceback in every part."""
    env = dict(os.environ, GPU_CHECK_DRY_RUN="1", PYTHON=sys.executable)
    args = ["tests"]
    if case == "an unknown part":
        args = ["tests", "sped"]
    elif case == "a count of no GPUs":
        env["GPU_CHECK_GPUS"] = "0"
    else:
        (tmp_path / "site").mkdir()
        (tmp_path / "site" / "sitecustomize.py").write_text(WITHOUT_PYDANTIC)
        env["PYTHONPATH"] = str(tmp_path / "site")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(tmp_path / "results"), *args],
                          env=env, capture_output=True, text=True, timeout=guard(60))
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout[-2000:] + proc.stderr[-2000:]
    (line,) = proc.stderr.splitlines()
    expected = {"an unknown part": "unknown part sped", "a count of no GPUs": "GPU_CHECK_GPUS=0: a number of GPUs"}.get(
        case, "the package 'pydantic' is not installed")
    assert line.startswith("error: ") and expected in line, line
    assert not (tmp_path / "results").exists()


@pytest.mark.slow
def test_gpu_check_report_merges_the_calls_into_one_summary(gpu_check):
    """--report over the part calls above (run here if this test runs alone) and the skipped one."""
    for call_parts in DRY_RUN_CALLS.values():
        dry_run_part(gpu_check, call_parts[0])
    gpu_check("skipped", "tests", "presets", GPU_CHECK_BUDGET_S="1")
    merged, _ = gpu_check("merged", *DRY_RUN_CALLS, "skipped", report=True)
    results = json.loads((merged / "results.json").read_text())
    parts = [(p["part"], p["status"].split(":")[0]) for p in results["parts"]]
    assert [p for p in parts if p[0] != "recipe"] == [
        *((p, "ok") for call_parts in DRY_RUN_CALLS.values() for p in call_parts if p != "recipe"),
        ("tests", "skipped"), ("presets", "skipped")]
    assert [t["test"] for t in results["tests"]] == [DRY_RUN_TEST]
    assert [r["label"] for r in results["rows"]] == [*DRY_RUN_SPEED, "reference-build-nanogpt-b64", *DRY_RUN_RECOMPUTE,
                                                     *DRY_RUN_MULTIGPU]
    summary = (merged / "summary.md").read_text()
    assert "speed ok" in summary and "reference ok" in summary and "tests skipped" in summary
    assert "1.000x" in summary  # the reference's row, with ratios beside the speed rows


def test_the_preemption_check_names_each_way_a_preempted_run_can_go_wrong():
    """scripts/preemption_check.py's verdict on two launches: none for a stop mid-run resumed where it stopped,
    one sentence for each thing that went wrong otherwise."""
    sys.path.insert(0, str(REPO / "scripts"))
    from preemption_check import check

    def launch(console: str, newest: int | None, exit: int = 0) -> dict:
        return {"console": console, "newest": newest, "exit": exit, "error": "error: the reason"}

    stopped = launch("SIGTERM received: saved step 12; run the same command again to resume", 12, exit=1)
    resumed = launch("model gpt2 | resumed from /r/checkpoints/step_00000012.pt at step 12", 30)
    steps = [(s, 3.0) for s in range(30)]
    assert check(stopped, resumed, steps, max_steps=30, signal_after=10) == []
    problems = check(stopped, launch("resumed from x at step 9", 29, exit=1), [*steps[:20], *steps[19:29],
                     (29, float("nan"))], max_steps=30, signal_after=10)
    assert [p.split(":")[0].split(",")[0] for p in problems] == [
        "the second launch exited 1", "the second launch did not resume at step 12",
        "the newest checkpoint after the second launch is step 29", "the log's training steps are not 0 to 29 once each",
        "losses that are not finite at steps [29]"]
    assert "repeated [19]" in problems[3]
    late = launch("SIGTERM received: saved step 30; ...", 30, exit=1)  # the run ended before the signal landed
    assert "did not land mid-run" in check(late, resumed, steps, 30, 10)[0]
    assert check(launch("error: no shards", None, exit=2), resumed, [], 30, 10) == [
        "the first launch never said it saved after SIGTERM (exit 2): error: the reason"]
