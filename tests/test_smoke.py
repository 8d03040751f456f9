"""`make smoke`: the README's GPT-2 124M launch, shrunk, as a user runs it before paying for GPUs.

The target runs torchrun on 2 ranks with configs/gpt2_124m.yaml as it is, shrunk on the command line (the
Makefile says which keys and why), on a data folder it prepares from the repository's own text. Here it runs
for real through make (pytest marker `smoke`: `make test-smoke`, which CI runs after `make test`), into a
temporary SMOKE_DIR, with the environment this test runs in (make's install step is taken as done: it would
reach the network).
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_and_reap, trainer_env
from runtime.logger import read_log


def recipe_launch() -> list[str]:
    """The torchrun words of the smoke target's recipe, up to its shrinking arguments."""
    makefile = (REPO / "Makefile").read_text().replace("\\\n", " ")
    recipe = re.search(r"^smoke:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    words = shlex.split(next(line for line in recipe.splitlines() if "torchrun" in line))
    start = next(i for i, w in enumerate(words) if w.endswith("torchrun"))
    return words[start:words.index("--data_dir")]


def test_the_smoke_target_runs_the_documented_124m_launch():
    """The README's launch with its GPU count as the only change (2 ranks on a CPU)."""
    readme = " ".join((REPO / "README.md").read_text().split())
    launch = [w.replace("--nproc_per_node=2", "--nproc_per_node=8") for w in recipe_launch()]
    launch[0] = "torchrun"
    assert " ".join(launch) in readme, launch


def make_smoke(smoke_dir: Path, timeout: float):
    """`make smoke SMOKE_DIR=smoke_dir`, finished."""
    venv = Path(sys.executable).parent.parent  # this test's environment stands in for make's .venv
    cmd = ["make", "--no-print-directory", "-o", f"{venv}/.installed", "smoke", f"VENV={venv}",
           f"SMOKE_DIR={smoke_dir}"]
    return run_and_reap(cmd, trainer_env(), timeout=timeout)


@pytest.mark.parametrize("given", ["", ".", "folder", "file"])
def test_make_smoke_deletes_no_folder_it_did_not_make(tmp_path, given):
    """SMOKE_DIR is emptied first, so it must be the smoke's own: an empty value, the repository (`.`), a folder
    holding a user's file, or a file are refused in one line, before anything is deleted."""
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("mine")
    smoke_dir = {"": "", ".": ".", "folder": tmp_path / "folder", "file": tmp_path / "file"}[given]
    proc = make_smoke(smoke_dir, timeout=30)
    assert proc.returncode == 2 and proc.stderr.startswith(f'error: SMOKE_DIR="{smoke_dir}" is not a folder'), \
        proc.stderr
    assert (tmp_path / "folder" / "notes.txt").read_text() == (tmp_path / "file").read_text() == "mine"
    assert (REPO / "Makefile").exists()


@pytest.mark.smoke
@pytest.mark.slow  # make, prep and torchrun on 2 ranks
def test_make_smoke_trains_the_shrunk_124m_config_on_two_ranks(tmp_path):
    """Into a folder whose path holds a space, beside a folder named as its first word (which an unquoted
    `rm -rf` would delete), twice: the second run empties the first's folder, which make smoke made."""
    (tmp_path / "my").mkdir()
    (tmp_path / "my" / "notes.txt").write_text("mine")
    for _ in range(2):
        proc = make_smoke(tmp_path / "my smoke", timeout=150)
        assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert (tmp_path / "my" / "notes.txt").read_text() == "mine"
    run = tmp_path / "my smoke" / "run"
    records = read_log(run / "log.jsonl")
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(6))
    assert [r["step"] for r in records if r["kind"] == "val"] == [0, 3, 6]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000003.pt", "step_00000006.pt"]
    assert "world size 2" in proc.stdout and "grad_accum_steps 2" in proc.stdout  # 2 ranks, 2 micro-steps each
    assert proc.stdout.rstrip().splitlines()[-1].startswith("smoke: passed: the 124M launch trained on 2 ranks")
