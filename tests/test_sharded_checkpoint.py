"""The sharded checkpoint format end to end: exact resumes, snapshots, resharding, readers, crashes, storage.

A sharded checkpoint is a `step_XXXXXXXX/` folder that every rank writes its part of, in the
background by default, and that counts once its commit file is there (training/checkpoint/sharded_format.py,
training/checkpoint/checkpointer.py). Real runs of the tiny model show here that it resumes bitwise under the
same strategy and world size, reshards onto others, serves every reader, survives a kill, a damaged
part and a failed write, and goes wherever fsspec reaches. Each uninterrupted reference run is
trained once per file, on first use (the `straight` fixture).
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import shutil
import signal
import threading
import uuid
from pathlib import Path

import pytest
import torch
from launch import components
from conftest import GPT2_VOCAB, base_args, build_tiny_run, crashed_copy, run_trainer, train_losses, train_here
from common.errors import run_cli
from forked_ranks import launch
from training.checkpoint import folder as ckpt
from training.checkpoint import sharded_format as sharded
from training.checkpoint.checkpointer import Checkpointer
from launch.resume import find_resume_checkpoint, load_state
from runtime import storage
from runtime.logger import read_log

STEPS = 6
ARGS = dict(max_steps=STEPS, checkpoint_interval=3, checkpoint_format="sharded")  # checkpoints 3 and 6
F64 = dict(dtype="float64")  # strategies and world sizes add in other orders: float64 makes that ~1e-16
# 12 rows a step: 2 ranks x 3 micro-steps of 2 rows, or 3 ranks x 2 (the 512-token default does not divide by 3)
THREE_RANK_GEOMETRY = dict(total_batch_size=384, micro_batch_size=2)

# The uninterrupted runs the others are compared with: name -> (nproc, settings beside ARGS)
STRAIGHT = {
    "ddp1": (None, {}),
    "ddp2": (2, {}),
    "fsdp2": (2, {"strategy": "fsdp"}),
    "file2": (2, {"checkpoint_format": "file"}),
    "fsdp2_f64": (2, {"strategy": "fsdp", **F64}),
    "ddp2_f64_384": (2, {**F64, **THREE_RANK_GEOMETRY}),
}


@pytest.fixture(scope="module")
def straight(data, tmp_path_factory):
    """straight(name) -> the out_dir of that uninterrupted run, trained on its first use in this file."""
    root = tmp_path_factory.mktemp("straight")
    trained: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in trained:
            run_trainer(args(data, name, root / name), nproc=STRAIGHT[name][0])
            trained[name] = root / name
        return trained[name]

    return get


def args(data: Path, name: str, out: Path, **overrides) -> list[str]:
    """The arguments of straight run `name` into out, with overrides."""
    return base_args(data, out, **{**ARGS, **STRAIGHT[name][1], **overrides})


# --- helpers ----------------------------------------------------------------------------------------


def checkpoint_at(out: Path, step: int, folder: ckpt.Location | None = None) -> ckpt.Location:
    return dict(ckpt.list_checkpoints(folder or out / "checkpoints"))[step]


def assert_same_state(a: dict, b: dict, rtol: float = 0.0) -> None:
    """read_full_state's model and optimizer: bitwise equal (rtol 0), else each tensor within rtol in relative norm."""
    def same(x: torch.Tensor, y: torch.Tensor, what) -> None:
        if rtol == 0:
            assert x.dtype == y.dtype and torch.equal(x, y), what
        else:
            assert torch.linalg.norm((x - y).double()) <= rtol * torch.linalg.norm(y.double()), what

    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        same(a["model"][key], b["model"][key], key)
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    for index, entries in a["optimizer"]["state"].items():
        assert entries.keys() == b["optimizer"]["state"][index].keys(), index
        for name, value in entries.items():
            same(value, b["optimizer"]["state"][index][name], (index, name))
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]


def assert_same_run(run: Path, reference: Path, folder: ckpt.Location | None = None) -> None:
    """One train record per step, bitwise-equal losses, and a bitwise-equal final model and optimizer."""
    steps = [r["step"] for r in read_log(run / "log.jsonl") if r["kind"] == "train"]
    assert steps == list(range(STEPS)), steps
    assert train_losses(run) == train_losses(reference)
    assert_same_state(ckpt.read_full_state(checkpoint_at(run, STEPS, folder)),
                      ckpt.read_full_state(checkpoint_at(reference, STEPS)))


def assert_close_run(run: Path, reference: Path, rtol: float) -> None:
    """Losses, final weights and optimizer state within rtol (another strategy or world size)."""
    steps = [r["step"] for r in read_log(run / "log.jsonl") if r["kind"] == "train"]
    assert steps == list(range(STEPS)), steps
    la, lb = train_losses(run), train_losses(reference)
    for step in la:
        assert abs(la[step] - lb[step]) <= rtol * abs(lb[step]), (step, la[step], lb[step])
    assert_same_state(ckpt.read_full_state(checkpoint_at(run, STEPS)),
                      ckpt.read_full_state(checkpoint_at(reference, STEPS)), rtol)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def take_steps(run, n: int) -> None:
    """n optimizer updates of an in-process run (build_tiny_run) on fixed random tokens."""
    generator = torch.Generator().manual_seed(run.step)
    for _ in range(n):
        tokens = torch.randint(0, 512, (4, 33), generator=generator)
        _, loss = run.model(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        loss.backward()
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        run.step += 1


def by_name(run) -> dict:
    """The run's optimizer state as checkpoints hold it: keyed by parameter name (DCP's own view of it)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    assert run.optimizer.state  # DCP would fill an empty one with a step of its own
    return get_optimizer_state_dict(run.model, run.optimizer)


def cloned(state: dict) -> dict:
    """A deep copy of a (nested) state dict's tensors."""
    if isinstance(state, dict):
        return {k: cloned(v) for k, v in state.items()}
    if isinstance(state, list):
        return [cloned(v) for v in state]
    return state.detach().clone() if torch.is_tensor(state) else state


def save_in_process(cfg, ctx, run) -> None:
    checkpointer = components.make_checkpointer(cfg, ctx, run, record={})
    checkpointer.save(run)
    checkpointer.wait()


# --- rank entry points for launch(): the trainer, with a fault (see the tests that use them) ----------


def killed_in_background_save(argv: list[str]) -> int:
    """The trainer, SIGKILLed by its own background writer of checkpoint KILL_AT_STEP: once the rank's
    part is written, and training has gone on past the save step, but before DCP's index and the
    commit file. Every rank does the same, so the whole job dies with that save in flight."""
    kill_step = int(os.environ["KILL_AT_STEP"])
    trained_on = threading.Event()
    real_writer = sharded._writer

    def writer(location):
        storage_writer = real_writer(location)
        if ckpt.step_of(location) == kill_step:
            real_write = storage_writer.write_data

            def write_then_die(plan, planner):
                real_write(plan, planner).wait()
                trained_on.wait(30)
                os.kill(os.getpid(), signal.SIGKILL)

            storage_writer.write_data = write_then_die
        return storage_writer

    def wrap_step(step):
        def counted(run, model, batches, stop_requested):
            # at the start of the step after kill_step: that step's record is in the log by now (it is
            # written after the step returns, so setting this at its end let the kill come first)
            if run.step > kill_step:
                trained_on.set()
            return step(run, model, batches, stop_requested)

        return counted

    sharded._writer = writer
    return train_here(argv, wrap_step=wrap_step)


def trainer_with_small_files(argv: list[str]) -> int:
    """The trainer, where a file cannot grow past FILE_SIZE_LIMIT bytes (EFBIG, as on a full disk; it
    also stops root, which a read-only folder would not)."""
    limit = int(os.environ["FILE_SIZE_LIMIT"])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return train_here(argv)


def launch_with_fault(target: str, argv: list[str], nproc: int, **env: str):
    return launch(list(map(str, argv)), nproc, target=f"test_sharded_checkpoint:{target}", extra_env=env, timeout=120)


# --- 1. exact resume ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp1", "ddp2", "fsdp2"], ids=["1-process", "ddp-2-ranks", "fsdp-2-ranks"])
def test_a_run_stopped_after_a_background_save_resumes_bitwise(data, straight, tmp_path, name):
    out = tmp_path / "resumed"
    nproc = STRAIGHT[name][0]
    # The first launch stops after step 5 without a final checkpoint: its step-3 checkpoint was written
    # in the background while steps 3 and 4 trained, and its log holds their records, which the resume
    # drops. Steps 0-2 have the same lr for any max_steps (warmup, then the cosine's start).
    first = run_trainer(args(data, name, out, max_steps=5, final_checkpoint="false"), nproc=nproc)
    assert f"saving checkpoint {out / 'checkpoints' / 'step_00000003'} in the background" in first.stdout
    assert [s for s, _ in ckpt.list_checkpoints(out / "checkpoints")] == [3]
    again = run_trainer(args(data, name, out), nproc=nproc)
    assert f"resumed from {out / 'checkpoints' / 'step_00000003'} at step 3" in again.stdout
    # the last step's save is the process's last act: written at once, with no copy to host memory first
    final = out / "checkpoints" / "step_00000006"
    assert f"saved checkpoint {final} (" in again.stdout and f"saving checkpoint {final}" not in again.stdout
    assert_same_run(out, straight(name))


# --- 2. the snapshot of an asynchronous save -----------------------------------------------------------


def test_an_async_save_holds_the_state_of_its_step_while_training_changes_it(data, tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    cfg, ctx, run = build_tiny_run(data, tmp_path / "out", checkpoint_format="sharded")
    assert cfg.checkpoint.checkpoint_async
    take_steps(run, 2)
    model_before, optimizer_before = cloned(run.model.state_dict()), cloned(by_name(run))
    # the files are written only once the test lets them, after it changed the model and the optimizer
    go_on, writers = threading.Event(), []
    real_write = FileSystemWriter.write_data

    def gated_write(self, plan, planner):
        writers.append(threading.current_thread())
        assert go_on.wait(60)
        return real_write(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", gated_write)
    checkpointer = components.make_checkpointer(cfg, ctx, run, record={})
    checkpointer.save(run)
    assert not checkpointer.pending.future.done()  # the write goes on in the background
    with torch.no_grad():  # training goes on: every parameter and every AdamW tensor changes in place
        for p in run.model.parameters():
            p.add_(1.0)
        for entries in run.optimizer.state.values():
            for value in entries.values():
                value.add_(1.0)
    take_steps(run, 1)
    go_on.set()
    checkpointer.wait()
    assert writers and threading.main_thread() not in writers
    path = tmp_path / "out" / "checkpoints" / "step_00000002"
    saved = ckpt.read_full_state(path)
    assert saved["step"] == 2
    assert_same_state(saved, {"model": model_before, "optimizer": optimizer_before})
    assert not torch.equal(run.model.lm_head.weight, model_before["lm_head.weight"])  # it did change meanwhile


# --- 3. another world size, strategy or format ---------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("source,then,nproc", [("fsdp2_f64", {"strategy": "ddp"}, None),
                                               ("ddp2_f64_384", {"strategy": "fsdp"}, 3)],
                         ids=["fsdp-2-ranks-to-1-process", "ddp-2-ranks-to-fsdp-3-ranks"])
def test_a_sharded_checkpoint_resumes_on_another_world_size_and_strategy(data, straight, tmp_path, source, then, nproc):
    """3 ranks shard every LayerNorm (64 values) and attention bias (192) unevenly; the resumed run
    writes its own parts (one per rank), and trains like the straight run to float64 rounding."""
    out = tmp_path / "resumed"
    crashed_copy(straight(source), out, last_checkpoint=3)
    proc = run_trainer(args(data, source, out, **then), nproc=nproc)
    assert "at step 3" in proc.stdout
    parts = sorted(p.name for p in (out / "checkpoints" / f"step_{STEPS:08d}").glob("*.distcp"))
    assert parts == [f"__{rank}_0.distcp" for rank in range(nproc or 1)]
    assert_close_run(out, straight(source), rtol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("source,then", [("file2", "sharded"), ("ddp2", "file")], ids=["file-to-sharded", "sharded-to-file"])
def test_file_and_sharded_checkpoints_resume_into_each_other_bitwise(data, straight, tmp_path, source, then):
    out = tmp_path / "resumed"
    crashed_copy(straight(source), out, last_checkpoint=3)
    run_trainer(args(data, source, out, checkpoint_format=then), nproc=2)
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == (["step_00000003.pt", "step_00000006"] if then == "sharded" else ["step_00000003", "step_00000006.pt"])
    assert_same_run(out, straight("ddp2"))  # the same training, whichever format wrote and read it


# --- 4. readers -----------------------------------------------------------------------------------------


@pytest.fixture
def gpt2_vocab_checkpoint(data, tmp_path) -> tuple[Path, dict]:
    """A sharded checkpoint (step 1, written in the background) of the tiny model with GPT-2's
    vocabulary (what export_hf needs), and the model's state when it was saved."""
    cfg, ctx, run = build_tiny_run(data, tmp_path / "source", vocab_size=GPT2_VOCAB, checkpoint_format="sharded")
    take_steps(run, 1)
    save_in_process(cfg, ctx, run)
    return tmp_path / "source" / "checkpoints" / "step_00000001", cloned(run.model.state_dict())


def test_sample_and_export_read_a_sharded_folder_as_they_read_its_consolidated_file(gpt2_vocab_checkpoint, tmp_path,
                                                                                    capfd):
    import export_hf
    import sample
    from safetensors.torch import load_file

    folder, model_state = gpt2_vocab_checkpoint
    consolidated = tmp_path / "step_00000001.pt"
    ckpt.consolidate(folder, consolidated)
    samples, exports = [], []
    for i, path in enumerate((folder, consolidated)):
        capfd.readouterr()
        assert run_cli(sample.main, ["--ckpt", str(path), "--prompt", "Hello", "--num_samples", "2",
                                     "--max_new_tokens", "6", "--device", "cpu"]) == 0
        header, *text = capfd.readouterr().out.splitlines()
        assert header == f"# step 1 of {path}" and text[0] == "--- sample 0"
        samples.append(text)
        assert run_cli(export_hf.main, [str(path), str(tmp_path / f"hf{i}")]) == 0
        exports.append(load_file(tmp_path / f"hf{i}" / "model.safetensors"))
    assert samples[0] == samples[1]  # the same weights: the same seeded samples
    assert exports[0].keys() == exports[1].keys()
    assert all(torch.equal(exports[0][k], exports[1][k]) for k in exports[0])
    assert torch.equal(exports[0]["transformer.wte.weight"], model_state["transformer.wte.weight"][:50257])


def test_init_from_a_sharded_folder_starts_a_new_run_from_its_weights(data, gpt2_vocab_checkpoint, tmp_path):
    folder, model_state = gpt2_vocab_checkpoint
    *_, run = build_tiny_run(data, tmp_path / "new", vocab_size=GPT2_VOCAB, init_from=folder)
    state = run.model.state_dict()
    assert state.keys() == model_state.keys()
    assert all(torch.equal(state[k], model_state[k]) for k in state)
    assert run.step == 0 and not run.optimizer.state  # a new run: step 0, a fresh optimizer


def test_init_from_a_url_of_a_sharded_folder_starts_from_its_weights(data, gpt2_vocab_checkpoint, tmp_path):
    """init_from reads checkpoints where load_checkpoint does: a URL too (it holds sharded ones only)."""
    folder, model_state = gpt2_vocab_checkpoint
    *_, run = build_tiny_run(data, tmp_path / "new", vocab_size=GPT2_VOCAB, init_from=f"file://{folder}")
    state = run.model.state_dict()
    assert state.keys() == model_state.keys()
    assert all(torch.equal(state[k], model_state[k]) for k in state)


@pytest.mark.slow
def test_consolidate_writes_the_folders_state_and_the_trainer_resumes_from_the_file(data, straight, tmp_path, capfd):
    import consolidate_checkpoint

    out = tmp_path / "consolidated"
    crashed_copy(straight("ddp2"), out, last_checkpoint=3)
    folder, target = out / "checkpoints" / "step_00000003", tmp_path / "step_00000003.pt"
    proc = run_trainer([folder, target], script="consolidate_checkpoint.py")  # as a user runs it: a process of its own
    assert proc.stdout.startswith(f"wrote {target}: step 3, ") and proc.stderr == "", proc.stderr
    whole, file = ckpt.read_full_state(folder), ckpt.read_full_state(target)
    assert_same_state(file, whole)
    assert file.keys() == whole.keys()
    for key in whole.keys() - {"model", "optimizer"}:
        assert file[key] == whole[key], key  # step, tokens_seen, lineage, config, provenance...
    assert torch.load(target, weights_only=True)["step"] == 3
    assert run_cli(consolidate_checkpoint.main, [str(folder), str(target)]) == 2  # never overwrites
    assert error_lines(capfd.readouterr().err) == [f"error: out: {target} exists; give another name (nothing is overwritten)"]
    # the file in place of the folder: the trainer resumes from it exactly
    ckpt.delete_checkpoint(folder)
    shutil.move(target, out / "checkpoints" / target.name)
    proc = run_trainer(args(data, "ddp2", out), nproc=2)
    assert f"resumed from {out / 'checkpoints' / target.name} at step 3" in proc.stdout
    assert_same_run(out, straight("ddp2"))


# --- 5. crash safety -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_folder_without_its_commit_file_is_never_resumed_and_goes_at_the_next_launch(data, straight, tmp_path):
    out = tmp_path / "interrupted"
    crashed_copy(straight("ddp2"), out, last_checkpoint=STEPS)
    interrupted = out / "checkpoints" / "step_00000006"
    (interrupted / "checkpoint.json").unlink()  # every part and DCP's index written, not the commit: killed just before it
    assert [s for s, _ in ckpt.list_checkpoints(out / "checkpoints")] == [3]
    assert find_resume_checkpoint(out / "checkpoints", "auto")[0] == out / "checkpoints" / "step_00000003"
    assert interrupted.is_dir()  # choosing does not touch it: only a launch, holding the folder's lock, removes it
    proc = run_trainer(args(data, "ddp2", out), nproc=2)
    assert "removed what 1 interrupted checkpoint save(s) left: step_00000006" in proc.stdout
    assert f"resumed from {out / 'checkpoints' / 'step_00000003'} at step 3" in proc.stdout
    assert_same_run(out, straight("ddp2"))


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_complete_folder_with_a_damaged_part_is_set_aside_and_the_run_resumes_before_it(data, straight, tmp_path,
                                                                                          damage):
    out = tmp_path / "damaged"
    crashed_copy(straight("ddp2"), out, last_checkpoint=STEPS)
    part = out / "checkpoints" / "step_00000006" / "__1_0.distcp"
    if damage == "truncated":
        part.write_bytes(part.read_bytes()[:1000])  # a copy that failed half-way
    else:
        part.unlink()
    proc = run_trainer(args(data, "ddp2", out), nproc=2)
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: skipping")]
    assert len(warnings) == 1, proc.stderr[-3000:]
    assert f"{out / 'checkpoints' / 'step_00000006'}: checkpoint part __1_0.distcp is {damage}" in warnings[0]
    assert warnings[0].endswith("renamed it to step_00000006.unreadable")
    assert (out / "checkpoints" / "step_00000006.unreadable" / "checkpoint.json").is_file()  # kept, for inspection
    assert "at step 3" in proc.stdout
    assert_same_run(out, straight("ddp2"))


@pytest.mark.slow
def test_a_part_damaged_within_its_length_stops_the_resume_and_the_readers_with_one_line(data, straight, tmp_path,
                                                                                       capfd):
    """Its size passes the check before loading; the load itself fails (DCP's own exception derives
    from BaseException, which slipped past every `except Exception` as a traceback)."""
    import sample

    out = tmp_path / "garbled"
    crashed_copy(straight("ddp2"), out, last_checkpoint=STEPS)
    folder = out / "checkpoints" / "step_00000006"
    for part in folder.glob("*.distcp"):
        part.write_bytes(bytes(part.stat().st_size))  # zeros: bit rot, or a copy that wrote holes
    proc = run_trainer(args(data, "ddp2", out, max_steps=9), nproc=2, check=False)
    errors = error_lines(proc.stderr)
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith(f"error: {folder}: could not read the training state (")
    assert proc.exitcodes == [2, 2] and "Traceback" not in proc.stderr
    capfd.readouterr()
    assert run_cli(sample.main, ["--ckpt", str(folder), "--device", "cpu"]) == 2
    (line,) = capfd.readouterr().err.splitlines()
    assert line.startswith(f"error: {folder}: could not read the model (")


@pytest.mark.slow
def test_a_commit_file_of_a_newer_format_is_refused_and_left_in_place(data, straight, tmp_path, capfd):
    import sample

    out = tmp_path / "newer"
    crashed_copy(straight("ddp2"), out, last_checkpoint=STEPS)
    commit = out / "checkpoints" / "step_00000006" / "checkpoint.json"
    commit.write_text(json.dumps({**json.loads(commit.read_text()), "format_version": 99}))
    before, log_before = commit.read_bytes(), (out / "log.jsonl").read_bytes()
    proc = run_trainer(args(data, "ddp2", out, max_steps=9), nproc=2, check=False)
    errors = error_lines(proc.stderr)
    assert len(errors) == 1, proc.stderr[-3000:]  # rank 0's, for both ranks
    assert errors[0].startswith(f"error: {commit.parent}: checkpoint format_version 99 is newer than this code reads")
    assert proc.exitcodes == [2, 2]
    assert commit.read_bytes() == before and (out / "log.jsonl").read_bytes() == log_before
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000003", "step_00000006"]
    capfd.readouterr()
    assert run_cli(sample.main, ["--ckpt", str(out), "--device", "cpu"]) == 2  # every reader refuses it
    assert error_lines(capfd.readouterr().err) == [errors[0]]


@pytest.mark.slow
def test_a_job_killed_during_a_background_save_resumes_from_the_previous_checkpoint(data, straight, tmp_path):
    out = tmp_path / "killed"
    every_2 = args(data, "ddp2", out, checkpoint_interval=2)  # checkpoints 2, 4, 6: the kill comes in the save of 4
    proc = launch_with_fault("killed_in_background_save", every_2, 2, KILL_AT_STEP="4")
    assert proc.exitcodes == [-signal.SIGKILL] * 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert max(r["step"] for r in read_log(out / "log.jsonl") if r["kind"] == "train") >= 4  # trained on meanwhile
    killed = out / "checkpoints" / "step_00000004"
    assert (killed / "__0_0.distcp").is_file() and not (killed / "checkpoint.json").exists()
    assert [s for s, _ in ckpt.list_checkpoints(out / "checkpoints")] == [2]
    again = run_trainer(every_2, nproc=2)  # the same command, without the fault
    assert "removed what 1 interrupted checkpoint save(s) left: step_00000004" in again.stdout
    assert "at step 2" in again.stdout
    assert_same_run(out, straight("ddp2"))


# --- 6. retention ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_keep_last_2_leaves_the_two_newest_complete_folders(data, tmp_path):
    out = tmp_path / "kept"
    run_trainer(base_args(data, out, **{**ARGS, "max_steps": 4, "checkpoint_interval": 1, "keep_last": 2,
                                        "eval_interval": 0}), nproc=2)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000003", "step_00000004"]
    assert all(sharded.is_complete(p) for p in (out / "checkpoints").iterdir())


def test_pruning_removes_the_commit_file_first_so_a_deletion_cut_short_leaves_no_checkpoint(tmp_path, monkeypatch,
                                                                                           capsys):
    folder = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        path = ckpt.checkpoint_path(folder, step, ckpt.SHARDED)
        path.mkdir(parents=True)
        (path / "__0_0.distcp").write_bytes(b"part")
        sharded.commit(path, {"step": step})
    removed, real_remove = [], storage.remove

    def remove(location):
        removed.append(location.relative_to(folder).as_posix())
        if location.name == "step_00000001":  # the deletion of step 1 is cut short after its commit file
            raise OSError(5, "Input/output error")
        real_remove(location)

    monkeypatch.setattr(storage, "remove", remove)
    deleted = ckpt.prune_checkpoints(folder, keep_last=1, written_step=3)
    assert removed == ["step_00000001/checkpoint.json", "step_00000001",
                       "step_00000002/checkpoint.json", "step_00000002"]
    assert deleted == [folder / "step_00000002"]
    assert "could not delete old checkpoint" in capsys.readouterr().err
    assert [s for s, _ in ckpt.list_checkpoints(folder)] == [3]  # what is left of step 1 is no checkpoint
    monkeypatch.setattr(storage, "remove", real_remove)
    assert ckpt.remove_stale_temp_files(folder) == [folder / "step_00000001"]  # and the next launch removes it
    assert sorted(p.name for p in folder.iterdir()) == ["step_00000003"]


# --- 7. storage -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides,message", [
    (dict(out_dir="file:///tmp/run"), "error: out_dir: 'file:///tmp/run' is a URL, but the run folder"),
    (dict(checkpoint_dir="memory://run", checkpoint_format="file"),
     "error: checkpoint_format: file checkpoints are written locally; checkpoint_dir 'memory://run' is a URL"),
    pytest.param(dict(checkpoint_dir="s3://bucket/x"), "error: checkpoint_dir: cannot open s3://bucket/x: Install s3fs",
                 marks=pytest.mark.skipif(importlib.util.find_spec("s3fs") is not None,
                                          reason="s3fs is installed: an s3:// URL is usable here")),
], ids=["url-out_dir", "file-format-to-a-url", "s3-without-s3fs"])
def test_unusable_storage_settings_are_one_line_naming_the_key_and_create_nothing(data, tmp_path, monkeypatch, capfd,
                                                                                  overrides, message):
    monkeypatch.chdir(tmp_path)  # where a URL mistaken for a path would create `file:/...`
    settings = {"out_dir": tmp_path / "out", **overrides}
    assert train_here(base_args(data, **settings)) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith(message), err
    assert list(tmp_path.iterdir()) == []  # no out_dir, no `file:` folder


@pytest.mark.slow
def test_a_file_url_checkpoint_dir_trains_and_resumes_bitwise_on_two_ranks(data, straight, tmp_path):
    out, cwd = tmp_path / "run", tmp_path / "cwd"
    cwd.mkdir()
    url = f"file://{tmp_path / 'store'}/checkpoints"
    first = run_trainer(args(data, "ddp2", out, checkpoint_dir=url, max_steps=5, final_checkpoint="false"), nproc=2,
                        cwd=cwd)
    assert f"saving checkpoint {url}/step_00000003 in the background" in first.stdout
    assert (tmp_path / "store" / "checkpoints" / "step_00000003" / "checkpoint.json").is_file()
    again = run_trainer(args(data, "ddp2", out, checkpoint_dir=url), nproc=2, cwd=cwd)
    assert f"resumed from {url}/step_00000003 at step 3" in again.stdout
    assert not (out / "checkpoints").exists() and list(cwd.iterdir()) == []  # nothing went to a local `file:` path
    assert_same_run(out, straight("ddp2"), folder=url)


def test_a_memory_url_checkpoint_dir_saves_and_loads_in_one_process(data, tmp_path, monkeypatch):
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # where a URL mistaken for a path would create `memory:/...`
    url = f"memory://sharded-test-{uuid.uuid4().hex}/checkpoints"
    cfg, ctx, run = build_tiny_run(data, tmp_path / "out", checkpoint_dir=url)
    assert cfg.resolved_checkpoint_format() == "sharded" and cfg.checkpoint.checkpoint_async
    take_steps(run, 2)
    try:
        save_in_process(cfg, ctx, run)
        assert ckpt.list_checkpoints(url) == [(2, f"{url}/step_00000002")]
        state = ckpt.load_checkpoint(f"{url}/step_00000002")
        assert state["step"] == 2 and state["run_id"] == run.run_id
        assert_same_state(ckpt.read_full_state(f"{url}/step_00000002", state),
                          {"model": run.model.state_dict(), "optimizer": by_name(run)})
        *_, resumed = build_tiny_run(data, tmp_path / "other", checkpoint_dir=url)
        load_state(resumed, state, f"{url}/step_00000002")  # what a resume does: every tensor read back through fsspec
        assert resumed.step == 2
        assert_same_state({"model": resumed.model.state_dict(), "optimizer": resumed.optimizer.state_dict()},
                          {"model": run.model.state_dict(), "optimizer": run.optimizer.state_dict()})
        assert not (tmp_path / "out" / "checkpoints").exists() and list((tmp_path / "cwd").iterdir()) == []
    finally:
        storage.remove(url.rsplit("/", 1)[0])


# --- 8. a failed write ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_failed_background_write_stops_every_rank_with_one_line_and_earlier_checkpoints_stay(data, straight,
                                                                                               tmp_path):
    out = tmp_path / "full"
    crashed_copy(straight("ddp2"), out, last_checkpoint=3)
    earlier = ckpt.read_full_state(out / "checkpoints" / "step_00000003")
    every_step = args(data, "ddp2", out, checkpoint_interval=1)  # step 4's save fails while step 4 trains
    proc = launch_with_fault("trainer_with_small_files", every_step, 2, FILE_SIZE_LIMIT=str(64 * 1024))
    # reported when seen; the state of step 5 is then saved synchronously in its place, which fails too
    assert f"warning: {out / 'checkpoints' / 'step_00000004'}: could not write checkpoint (File too large)" in proc.stderr
    errors = error_lines(proc.stderr)
    assert len(errors) == 1, proc.stderr[-3000:]  # rank 0's, for both ranks
    assert errors[0] == (f"error: {out / 'checkpoints' / 'step_00000005'}: could not write checkpoint (File too large); "
                         f"earlier checkpoints are intact")
    assert proc.exitcodes == [1, 1]
    assert [s for s, _ in ckpt.list_checkpoints(out / "checkpoints")] == [3]
    assert_same_state(ckpt.read_full_state(out / "checkpoints" / "step_00000003"), earlier)
    again = run_trainer(every_step, nproc=2)  # room again: the same command goes on from step 3
    assert "removed what 2 interrupted checkpoint save(s) left: step_00000004, step_00000005" in again.stdout
    assert_same_run(out, straight("ddp2"))


def test_a_short_write_that_torch_reports_opaquely_is_named_as_what_it_likely_is(tmp_path):
    """torch.save's zip writer turns a write cut short by a full disk or a file size limit into
    'unexpected pos A vs B'; without an OSError from any rank, the line says what that means."""
    from common.errors import CheckpointWriteError

    opaque = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    error = Checkpointer._write_error(tmp_path / "step_00000004", opaque)
    assert isinstance(error, CheckpointWriteError)
    assert str(error) == (f"{tmp_path / 'step_00000004'}: could not write checkpoint (a write came back short: is "
                          f"the disk full, or a file size limit reached? ([enforce fail at inline_container.cc:672] "
                          f". unexpected pos 704 vs 598)); earlier checkpoints are intact")
