"""Checkpoints that read but do not fit the run that loads them: a tensor missing, of another shape, an optimizer
moment one row longer, a plain entry without the fields its part reads. Each is found before anything is loaded,
truncated or changed, and said in one line naming the file and the entry: refused when the user named it (--resume
PATH, --init_from), set aside when resume chose it itself, as an unreadable one is; in either format.

Each test is a regression test of a defect an audit reproduced: it fails on the code before the fix (a traceback
after the log was truncated, or a silent resume with a layer freshly initialised).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import base_args, make_shards, train_here
from training.checkpoint import folder as ckpt
from training.checkpoint import sharded_format as sharded

# two steps with every part that reads plain entries or tensors of its own: an EMA of the weights, a mixture
SETTINGS = dict(max_steps=2, checkpoint_interval=1, eval_interval=0, val_tokens=64, ema_decay=0.9,
                checkpoint_async="false")
FC = "transformer.h.0.mlp.c_fc.weight"  # (256, 64) in the tiny model


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("damaged_sources")
    edu = make_shards(root / "edu", seed=1)
    code = make_shards(root / "code", seed=2, train_sizes=(2100,), prefix="code")
    return f"{edu}:0.75,{code}:0.25"


@pytest.fixture(scope="module")
def runs(mixture, tmp_path_factory) -> dict[str, Path]:
    """A finished run of each format: checkpoints at steps 1 and 2, and its log."""
    folders = {}
    for fmt in ("file", "sharded"):
        folders[fmt] = tmp_path_factory.mktemp(f"damaged_{fmt}") / "run"
        assert train_here(base_args(mixture, folders[fmt], **SETTINGS, checkpoint_format=fmt)) == 0
    return folders


def rows_longer(tensor: torch.Tensor) -> torch.Tensor:
    return torch.cat([tensor, tensor[:1]])


# what each damage does to a checkpoint's entries (the plain ones: the sharded commit file's too), and the entry
# and words the error names
DAMAGES = {
    "model_tensor_missing": (lambda s: s["model"].pop(FC), "'model' has no 'transformer.h.0.mlp.c_fc.weight'"),
    "model_tensor_shape": (lambda s: s["model"].update({FC: torch.zeros(3, 3)}),
                           f"'model'['{FC}'] is of shape (3, 3), this run's is (256, 64)"),
    "ema_tensor_shape": (lambda s: s["ema"].update({FC: torch.zeros(3, 3)}),
                         f"'ema'['{FC}'] is of shape (3, 3), this run's is (256, 64)"),
    "optimizer_moment_longer": (lambda s: s["optimizer"]["state"][FC].update(
        exp_avg=rows_longer(s["optimizer"]["state"][FC]["exp_avg"])),
        f"'optimizer'['state']['{FC}']['exp_avg'] is of shape (257, 64), its parameter's is (256, 64)"),
    "mixture_fields": (lambda s: s.update(mixture={"foo": 1}), "'mixture' has no 'step'"),
    "ema_state_fields": (lambda s: s["ema_state"].pop("start_step"), "'ema_state' has no 'start_step'"),
    "metrics_none": (lambda s: s.update(metrics=None), "'metrics' is None, expected a dict"),
}
PLAIN = ("mixture_fields", "ema_state_fields", "metrics_none")


def damaged_copy(run: Path, out: Path, damage: str) -> Path:
    """run's folder copied to out, its checkpoint of step 2 damaged; that checkpoint's path."""
    shutil.copytree(run, out)
    (path,) = [p for s, p in ckpt.list_checkpoints(out / "checkpoints") if s == 2]
    change, _ = DAMAGES[damage]
    if ckpt.format_of(path) is ckpt.FILE:
        state = torch.load(path, weights_only=True)
        change(state)
        ckpt.save_checkpoint(state, path)
    elif damage in PLAIN:
        commit = json.loads((path / sharded.COMMIT_NAME).read_text())
        change(commit)
        (path / sharded.COMMIT_NAME).write_text(json.dumps(commit))
    else:  # the tensors written again by DCP, damaged, with the commit file of the original
        state = ckpt.read_full_state(path)
        change(state)
        metadata = json.loads((path / sharded.COMMIT_NAME).read_text())
        shutil.rmtree(path)
        sharded.start_save({name: state[name] for name in ("model", "optimizer", "ema")}, path, asynchronous=False)
        sharded.commit(path, metadata)
    return path


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file's bytes, but the lock's (each launch writes who holds it)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def error_line(capfd) -> str:
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


CASES = [(fmt, damage) for fmt in ("file", "sharded") for damage in DAMAGES
         if fmt == "file" or damage in (*PLAIN, "optimizer_moment_longer")]


@pytest.mark.parametrize("fmt,damage", CASES, ids=[f"{fmt}-{damage}" for fmt, damage in CASES])
def test_a_checkpoint_that_does_not_fit_the_run_is_refused_by_name_before_anything_changes(mixture, runs, tmp_path,
                                                                                           capfd, fmt, damage):
    """--resume PATH of the damaged checkpoint: one line naming it and the entry, exit 2, and the run folder as it
    was (its log not truncated, nothing set aside: the user named that checkpoint)."""
    out = tmp_path / "run"
    path = damaged_copy(runs[fmt], out, damage)
    before = snapshot(out)
    capfd.readouterr()
    assert train_here(base_args(mixture, out, **{**SETTINGS, "max_steps": 3}, checkpoint_format=fmt,
                                resume=path)) == 2
    assert error_line(capfd) == f"error: {path}: checkpoint entry {DAMAGES[damage][1]} (damaged, or edited)"
    assert snapshot(out) == before


def test_auto_resume_sets_a_checkpoint_that_does_not_fit_aside_and_goes_on_from_the_one_before(mixture, runs,
                                                                                               tmp_path, capfd):
    """As with a checkpoint that does not read: the newest is renamed .unreadable (kept), the one before resumed."""
    out = tmp_path / "run"
    path = damaged_copy(runs["file"], out, "model_tensor_missing")
    capfd.readouterr()
    assert train_here(base_args(mixture, out, **{**SETTINGS, "max_steps": 3})) == 0
    captured = capfd.readouterr()
    assert (f"warning: skipping {path}: checkpoint entry {DAMAGES['model_tensor_missing'][1]} (damaged, or edited); "
            f"renamed it to step_00000002.pt.unreadable") in captured.err
    assert f"resumed from {ckpt.checkpoint_path(out / 'checkpoints', 1)} at step 1" in captured.out
    assert (out / "checkpoints" / "step_00000002.pt.unreadable").is_file()
    assert [s for s, _ in ckpt.list_checkpoints(out / "checkpoints")] == [1, 2, 3]  # step 2 trained again


@pytest.mark.parametrize("damage", ["model_tensor_missing", "model_tensor_shape"])
def test_init_from_a_checkpoint_whose_model_does_not_fit_is_one_line(mixture, runs, tmp_path, capfd, damage):
    path = damaged_copy(runs["file"], tmp_path / "source", damage)
    capfd.readouterr()
    assert train_here(base_args(mixture, tmp_path / "out", **SETTINGS, init_from=path)) == 2
    assert error_line(capfd) == f"error: {path}: checkpoint entry {DAMAGES[damage][1]} (damaged, or edited)"
    assert not (tmp_path / "out" / "log.jsonl").exists()
