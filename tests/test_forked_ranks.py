"""tests/forked_ranks.py, the suite's fast launcher: the trainer runs as it does under torchrun, bitwise."""

from __future__ import annotations

import datetime
import os
import time

import pytest

from conftest import base_args, load_weights, make_shards, run_trainer, train_losses
from forked_ranks import launch
from slowness import guard


def rank_one_dies(argv: list[str]) -> int:
    """A rank body for the test below: rank 1 exits 7 at once, rank 0 waits for it in a barrier."""
    import torch.distributed as dist

    if os.environ["RANK"] == "1":
        os._exit(7)
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    dist.barrier()  # never passes: rank 1 is gone
    return 0


@pytest.mark.slow
def test_forked_ranks_train_bitwise_like_torchrun_workers(tmp_path):
    data = make_shards(tmp_path / "shards")
    forked, real = tmp_path / "forked", tmp_path / "torchrun"
    proc = run_trainer(base_args(data, forked, dropout=0.1), nproc=2)
    assert proc.exitcodes == [0, 0] and "saved checkpoint" in proc.stdout
    run_trainer(base_args(data, real, dropout=0.1), nproc=2, torchrun=True)
    assert train_losses(forked) == train_losses(real) and len(train_losses(real)) == 6
    a, b = load_weights(forked, 6), load_weights(real, 6)
    assert all((a[k] == b[k]).all() for k in a)


def test_a_rank_that_dies_is_reported_and_the_waiting_one_is_killed():
    started = time.monotonic()
    proc = launch([], 2, target="test_forked_ranks:rank_one_dies", timeout=60, grace=1)
    assert proc.exitcodes == [-9, 7] and proc.returncode == -9  # rank 0 hung in the barrier: killed
    assert time.monotonic() - started < guard(30)  # the grace of 1 s, not the 60 s timeout


def what_the_rank_inherited(argv: list[str]) -> int:
    """A rank body for the test below: which preloads it found imported, and how many objects are frozen."""
    import gc
    import sys

    print(" ".join(name for name in ("rank_preload", "train_gpt2", "torch._dynamo") if name in sys.modules),
          gc.get_freeze_count() > 100_000)
    return 0


def test_a_rank_inherits_the_preloaded_modules_and_their_frozen_objects():
    """The forkserver imported tests/rank_preload.py (it needs tests/ on its path, which Python 3.11's forkserver
    does not take from this process) and froze what it made: a rank neither imports nor collects them again."""
    proc = launch([], target="test_forked_ranks:what_the_rank_inherited", timeout=60)
    assert proc.returncode == 0 and proc.stdout == "rank_preload train_gpt2 torch._dynamo True\n", proc.stdout + proc.stderr
