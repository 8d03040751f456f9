"""training/observe/diagnostics.py: the profiler window, CUDA memory snapshots, the ranks' timings and stragglers.

In-process on one CPU rank, then two forked gloo ranks (tests/forked_ranks.py) without the trainer.
"""

from __future__ import annotations

import datetime
import json
import socket
import time
from pathlib import Path

import pytest
import torch

from forked_ranks import launch
from launch.config import TrainConfig
from runtime.context import Context
from training.observe.diagnostics import Diagnostics, MemorySnapshot, ProfileWindow, RankStats
from runtime.process_group import DistEnv
from runtime.logger import RunLogger, read_log
from runtime.runtime import Runtime

CPU_ENV = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), distributed=False)


def runtime_on(device: str) -> Runtime:
    return Runtime(device=torch.device(device), dtype="float32", compile=False, loss_chunk_size=0,
                   peak_flops=None, device_name=device)


CPU = runtime_on("cpu")


def config(**keys) -> TrainConfig:
    return TrainConfig(device="cpu", **keys)


def made(component, logger: RunLogger, out_dir: Path | None = None, env: DistEnv = CPU_ENV, runtime: Runtime = CPU,
         **keys):
    """A diagnostic as the trainer makes it: from the diagnostics section of the config keys, this process (a
    CPU rank unless env says otherwise), its runtime and the logger, and what it reads of other sections (the
    run folder its files go into, max_steps)."""
    if out_dir is not None:
        keys["out_dir"] = str(out_dir)
    cfg = config(**keys)
    ctx = Context(env, runtime, logger)
    of_other_sections = {ProfileWindow: (cfg.run.out_dir, cfg.schedule.max_steps), MemorySnapshot: (cfg.run.out_dir,),
                         RankStats: (), Diagnostics: (cfg.run.out_dir, cfg.schedule.max_steps)}[component]
    return component(cfg.diagnostics, ctx, *of_other_sections)


@pytest.fixture
def logger(tmp_path):
    log = RunLogger(enabled=True)
    log.open_run_folder(tmp_path / "run", 0, {})
    yield log
    log.close()


def records(tmp_path, kind: str) -> list[dict]:
    return [r for r in read_log(tmp_path / "run" / "log.jsonl") if r["kind"] == kind]


def warnings(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("warning:")]


def some_work() -> None:
    a = torch.randn(64, 64)
    (a @ a).sum()


# --- 1. ProfileWindow -------------------------------------------------------------------------------


def test_profile_window_writes_one_chrome_trace_of_its_steps(tmp_path, logger, capsys):
    window = made(ProfileWindow, logger, tmp_path / "run", profile_from=2, profile_steps=2)
    for step in range(6):
        window.step_started(step)
        assert window.active == (step in (2, 3))
        some_work()
        window.step_finished(step)
    window.close()  # nothing left open: a no-op
    (trace,) = (tmp_path / "run" / "profile").iterdir()
    assert trace.name == "rank0_steps2-3.json" and window.path == trace
    names = {event.get("name") for event in json.loads(trace.read_text())["traceEvents"]}
    assert {"step 2", "step 3"} <= names and "step 1" not in names and "step 4" not in names
    out = capsys.readouterr()
    assert out.out.count("profile: steps 2-3 traced") == 1 and str(tmp_path / "run" / "profile") in out.out
    assert not warnings(out.err)


def test_profile_window_off_or_resumed_past_profiles_nothing(tmp_path, logger):
    off = made(ProfileWindow, logger, tmp_path / "run")
    past = made(ProfileWindow, logger, tmp_path / "run", profile_from=2, profile_steps=2)
    inside = made(ProfileWindow, logger, tmp_path / "run", profile_from=2, profile_steps=3)
    for window, start in ((off, 0), (past, 4), (inside, 3)):
        for step in range(start, start + 4):
            window.step_started(step)
            assert not window.active
            window.step_finished(step)
        window.close()
    assert not (tmp_path / "run" / "profile").exists()


def test_a_window_that_can_never_start_is_one_warning_at_start_up(tmp_path, logger, capsys):
    def run_steps(window, steps) -> list[str]:
        for step in steps:
            window.step_started(step)
            window.step_finished(step)
        window.close()
        return warnings(capsys.readouterr().err)

    late = made(ProfileWindow, logger, tmp_path / "run", profile_from=50, max_steps=4)
    assert warnings(capsys.readouterr().err) == [  # at construction, before the first step
        "warning: profile: profile_from 50 is not before max_steps 4: the window never starts, no trace is written"]
    assert run_steps(late, range(4)) == [] and late.path is None
    passed = made(ProfileWindow, logger, tmp_path / "run", profile_from=2, profile_steps=3, max_steps=10)
    assert run_steps(passed, range(3, 10)) == [  # resumed inside the window: it only starts at profile_from
        "warning: profile: profile_from 2 is before step 3, where this run starts (resumed): the window never "
        "starts, no trace is written"]
    assert passed.path is None and not (tmp_path / "run" / "profile").exists()

    quiet = RunLogger(enabled=False)  # the other ranks: the same checks, no line
    made(ProfileWindow, quiet, tmp_path / "run", profile_from=50, max_steps=4)
    assert run_steps(made(ProfileWindow, quiet, tmp_path / "run", profile_from=2, max_steps=10),
                     range(5, 6)) == []
    for keys, first in ((dict(profile_from=0, max_steps=4), 5), (dict(profile_from=2, max_steps=10), 2),
                        (dict(profile_from=3, profile_steps=5, max_steps=4), 0)):  # off, resumed at it, cut short
        assert run_steps(made(ProfileWindow, logger, tmp_path / "run", **keys), range(first, 4)) == []


def test_a_window_left_open_is_written_by_close_and_a_failed_write_is_a_warning(tmp_path, logger, capsys):
    window = made(ProfileWindow, logger, tmp_path / "run", profile_from=1, profile_steps=5)
    for step in range(3):
        window.step_started(step)
        some_work()
        window.step_finished(step)
    window.step_started(3)  # fails inside: step_finished never comes
    window.close()
    window.close()
    assert [p.name for p in (tmp_path / "run" / "profile").iterdir()] == ["rank0_steps1-3.json"]
    names = {e.get("name") for e in json.loads(window.path.read_text())["traceEvents"]}
    assert {"step 1", "step 2", "step 3"} <= names

    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "profile").write_text("a file where the folder should be")
    window = made(ProfileWindow, logger, blocked, profile_from=1, profile_steps=1)
    for step in range(3):
        window.step_started(step)
        window.step_finished(step)
    assert window.path is None
    (line,) = warnings(capsys.readouterr().err)
    assert "profile: could not write" in line and "rank0_steps1-1.json" in line


# --- 2. MemorySnapshot --------------------------------------------------------------------------------


def test_memory_snapshot_on_the_cpu_is_one_warning_and_nothing_else(tmp_path, logger, capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: calls.append(("record", a, k)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda *a, **k: calls.append(("dump", a, k)))
    snapshot = made(MemorySnapshot, logger, tmp_path / "run", memory_snapshot=2)
    for step in range(4):
        snapshot.step_finished(step)
    snapshot.out_of_memory(4)
    snapshot.close()
    out = capsys.readouterr()
    assert warnings(out.err) == ["warning: memory_snapshot: CUDA only; ignored on cpu"] and out.out == ""
    assert calls == [] and not (tmp_path / "run" / "memory").exists()
    made(MemorySnapshot, logger, tmp_path / "run")  # off: not even the warning
    assert capsys.readouterr().err == ""


@pytest.fixture
def fake_cuda_memory(monkeypatch):
    """torch.cuda.memory's recorder replaced by one that notes its calls and writes a stand-in file."""
    calls = []

    def record(*args, **kwargs):
        calls.append(("record", kwargs))

    def dump(path):
        calls.append(("dump", Path(path).name))
        Path(path).write_bytes(b"snapshot")

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump)
    return calls


def test_memory_snapshot_on_cuda_records_then_dumps_once_after_its_steps(tmp_path, logger, capsys, fake_cuda_memory):
    """The CUDA path without a GPU: the recorder is faked, so this checks the calls made to it and the
    files' names and places, not what a real snapshot holds (that needs a GPU; none is used here)."""
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cuda", 0), distributed=False)
    snapshot = made(MemorySnapshot, logger, tmp_path / "run", env, runtime_on("cuda:0"), memory_snapshot=3)
    assert fake_cuda_memory == [("record", {"max_entries": 100_000})] and snapshot.recording
    for step in range(6):
        snapshot.step_finished(step)
    snapshot.out_of_memory(6)  # recording stopped: nothing
    snapshot.close()
    assert fake_cuda_memory == [("record", {"max_entries": 100_000}), ("dump", "rank0_step2.pickle"),
                                ("record", {"enabled": None})]
    assert [p.name for p in (tmp_path / "run" / "memory").iterdir()] == ["rank0_step2.pickle"]
    out = capsys.readouterr()
    assert "https://pytorch.org/memory_viz" in out.out and not warnings(out.err)


def test_memory_snapshot_on_cuda_dumps_on_out_of_memory_while_recording(tmp_path, logger, fake_cuda_memory):
    """Faked recorder, as above: the calls and file names of the out-of-memory path."""
    env = DistEnv(rank=3, local_rank=3, world_size=4, device=torch.device("cuda", 3), distributed=False)
    snapshot = made(MemorySnapshot, logger, tmp_path / "run", env, runtime_on("cuda:3"), memory_snapshot=10)
    snapshot.step_finished(0)
    snapshot.out_of_memory(1)
    snapshot.out_of_memory(1)  # once
    snapshot.close()
    assert fake_cuda_memory[1:] == [("dump", "rank3_oom_step1.pickle"), ("record", {"enabled": None})]
    assert snapshot.paths == [tmp_path / "run" / "memory" / "rank3_oom_step1.pickle"]


# --- 3. RankStats, one rank ---------------------------------------------------------------------------


def fake_step(stats, step: int, forward_s: float, wait_s: float = 0.0, micro_steps: int = 2) -> None:
    """A step as the trainer times it: a batch fetched, then its forward, per micro-step."""
    stats.step_started()
    for _ in range(micro_steps):
        time.sleep(wait_s)
        stats.add_data_wait(wait_s)
        time.sleep(forward_s)
        stats.forward_done()
    time.sleep(0.002)  # the last backward and the step's all-reduce: not compute
    stats.step_finished()
    stats.maybe_share(step)


def test_rank_stats_on_one_rank_log_a_record_every_interval_and_never_warn(tmp_path, logger, capsys):
    stats = made(RankStats, logger, rank_stats_interval=2)
    assert stats.hosts == [socket.gethostname()]
    for step in range(5):
        fake_step(stats, step, forward_s=0.01, wait_s=0.005)
    ranks = records(tmp_path, "ranks")
    assert [r["step"] for r in ranks] == [1, 3] and all(r["steps"] == 2 for r in ranks)
    for r in ranks:
        assert r["slowest_rank"] == 0 and r["data_wait_rank"] == 0 and r["slowest_host"] == socket.gethostname()
        assert r["data_wait_ms_median"] == pytest.approx(10.0) == r["data_wait_ms_max"]  # 2 x 5 ms given
        assert 18 <= r["compute_ms_median"] == r["slowest_compute_ms"] < 60  # 2 x 10 ms forwards, not the waits
        assert r["step_ms"] >= r["compute_ms_median"] + 10
    assert not warnings(capsys.readouterr().err)


def test_rank_stats_off_does_nothing(tmp_path, logger):
    stats = made(RankStats, logger, rank_stats_interval=0)
    for step in range(4):
        fake_step(stats, step, forward_s=0.0)
    assert stats.maybe_share(99) is None and records(tmp_path, "ranks") == [] and stats.hosts == []


def test_forwards_outside_a_step_are_not_counted_and_watch_hooks_the_model(tmp_path, logger):
    stats = made(RankStats, logger, rank_stats_interval=1)
    model = torch.nn.Linear(4, 4)
    handle = stats.watch(model)
    model(torch.zeros(1, 4))  # an evaluation forward: no step open
    stats.step_started()
    time.sleep(0.02)
    model(torch.zeros(1, 4))
    time.sleep(0.05)  # after the last forward: not compute
    stats.step_finished()
    record = stats.maybe_share(0)
    handle.remove()
    assert 15 <= record["compute_ms_median"] < 45 and record["step_ms"] >= 65


def test_a_straggler_is_named_once_per_streak_of_three_intervals(tmp_path, logger, capsys):
    """The decision from gathered rows (as every rank holds them): rank 2 is slow 5 intervals in a
    row (one warning), rank 1 for 2 (none), then rank 2 again for 3 (a second warning)."""
    stats = made(RankStats, logger, rank_stats_interval=10, straggler_factor=1.5)
    stats.hosts = ["node0", "node0", "node1", "node1"]
    fine = [[100.0, 1.0, 120.0]] * 4
    rank2 = [[100.0, 1.0, 160.0], [100.0, 1.0, 160.0], [120.0, 40.0, 160.0], [101.0, 1.0, 160.0]]
    rank1 = [[100.0, 1.0, 160.0], [300.0, 1.0, 310.0], [100.0, 1.0, 160.0], [101.0, 1.0, 160.0]]
    pattern = [rank2] * 5 + [rank1] * 2 + [fine] + [rank2] * 3
    for interval, rows in enumerate(pattern):
        record = stats._judge(10 * interval + 9, rows, 10)
        assert record["compute_ms_median"] == 100.0 and record["step_ms"] == 160.0 or rows is fine
    lines = warnings(capsys.readouterr().err)
    assert lines == ["warning: rank 2 on node1 is 1.6x slower than the median (160 ms against 101 ms per step, "
                     "of which 40 ms waiting for data) for 3 intervals"] * 2
    assert record["slowest_rank"] == 2 and record["slowest_host"] == "node1" and record["data_wait_rank"] == 2
    assert record["slowest_compute_ms"] == 120.0 and record["data_wait_ms_max"] == 40.0

    never = made(RankStats, logger, rank_stats_interval=10, straggler_factor=0)
    never.hosts = stats.hosts
    for interval in range(4):
        never._judge(interval, rank1, 10)
    assert not warnings(capsys.readouterr().err)


def test_the_bundle_drives_all_three(tmp_path, logger, capsys):
    diagnostics = made(Diagnostics, logger, tmp_path / "run", rank_stats_interval=2, profile_from=1, profile_steps=1,
                       memory_snapshot=1)
    model = torch.nn.Linear(8, 8)
    diagnostics.watch(model)
    for step in range(4):
        diagnostics.step_started(step)
        model(torch.zeros(2, 8))
        diagnostics.step_finished(step, data_wait=0.001)
    diagnostics.close()
    assert [r["step"] for r in records(tmp_path, "ranks")] == [1, 3]
    assert [p.name for p in (tmp_path / "run" / "profile").iterdir()] == ["rank0_steps1-1.json"]
    assert warnings(capsys.readouterr().err) == ["warning: memory_snapshot: CUDA only; ignored on cpu"]


# --- two ranks on gloo, without the trainer ------------------------------------------------------------------


def two_ranks(argv: list[str]) -> int:
    """A rank body for launch(): RankStats over 6 fake steps (rank 1's forwards 50 ms slower), then a
    profile window of steps 1-2; rank 0 logs into argv[0]."""
    import torch.distributed as dist

    out_dir = Path(argv[0])
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=1))
    rank = dist.get_rank()
    env = DistEnv(rank=rank, local_rank=rank, world_size=dist.get_world_size(), device=torch.device("cpu"),
                  distributed=True)
    logger = RunLogger(enabled=rank == 0)
    logger.open_run_folder(out_dir, 0, {})
    try:
        keys = dict(rank_stats_interval=2, straggler_factor=1.5, profile_from=1, profile_steps=2)
        stats = made(RankStats, logger, out_dir, env, **keys)
        for step in range(6):
            fake_step(stats, step, forward_s=0.005 + 0.05 * rank, wait_s=0.001)
        window = made(ProfileWindow, logger, out_dir, env, **keys)
        for step in range(4):
            window.step_started(step)
            some_work()
            window.step_finished(step)
        window.close()
        dist.barrier()
    finally:
        logger.close()
        dist.destroy_process_group()
    return 0


def test_two_ranks_share_their_timings_and_name_the_straggler(tmp_path):
    out_dir = tmp_path / "run"
    proc = launch([str(out_dir)], 2, target="test_diagnostics:two_ranks", timeout=120)
    assert proc.exitcodes == [0, 0], proc.stdout + proc.stderr
    ranks = [r for r in read_log(out_dir / "log.jsonl") if r["kind"] == "ranks"]
    assert [r["step"] for r in ranks] == [1, 3, 5]
    assert all(r["slowest_rank"] == 1 and r["slowest_host"] == socket.gethostname() for r in ranks)
    assert all(r["slowest_compute_ms"] > 90 and r["compute_ms_median"] < 40 for r in ranks)  # median_low: rank 0
    (line,) = [w for w in warnings(proc.stderr) if "slower than the median" in w]
    assert line.startswith("warning: rank 1 on ") and line.endswith("for 3 intervals")
    traces = sorted((out_dir / "profile").iterdir())
    assert [p.name for p in traces] == ["rank0_steps1-2.json", "rank1_steps1-2.json"]
    for trace in traces:
        assert json.loads(trace.read_text())["traceEvents"]
    assert proc.stdout.count("profile: steps 1-2 traced") == 1  # rank 0's line only


def gather_rows(argv: list[str]) -> int:
    """A rank body for launch(): RankStats' all-gather of each rank's own row, printed as JSON."""
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=1))
    rank = dist.get_rank()
    env = DistEnv(rank=rank, local_rank=rank, world_size=dist.get_world_size(), device=torch.device("cpu"),
                  distributed=True)
    try:
        stats = made(RankStats, RunLogger(enabled=False), None, env, rank_stats_interval=1)
        print(json.dumps(stats._gather([10.0 * rank + 1, 10.0 * rank + 2, 10.0 * rank + 3])), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


def test_the_ranks_all_gather_is_in_rank_order_and_warns_nothing(tmp_path):
    """torch 2.13 deprecates all_gather_into_tensor with a FutureWarning on every rank, at every run."""
    proc = launch([], 2, target="test_diagnostics:gather_rows", timeout=120)
    assert proc.exitcodes == [0, 0], proc.stdout + proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("[[")]
    assert rows == [[[1.0, 2.0, 3.0], [11.0, 12.0, 13.0]]] * 2
    assert "FutureWarning" not in proc.stderr, proc.stderr


# --- in the trainer, 2 ranks ----------------------------------------------------------------------------


@pytest.mark.slow
def test_in_a_two_rank_run_a_slow_rank_is_named_and_both_ranks_write_their_profile(tmp_path):
    """tests/inject_fault.py FAULT=slow: rank 1 sleeps 0.2 s before every step's work."""
    from conftest import base_args, make_shards, run_trainer

    out = tmp_path / "out"
    args = base_args(make_shards(tmp_path / "shards"), out, max_steps=8, eval_interval=0, checkpoint_interval=0,
                     rank_stats_interval=2, profile_from=2, profile_steps=2)
    proc = run_trainer(args, nproc=2, script="tests/inject_fault.py",
                       extra_env={"FAULT": "slow", "FAULT_RANK": "1", "FAULT_SLEEP": "0.2"})
    ranks = [r for r in read_log(out / "log.jsonl") if r["kind"] == "ranks"]
    assert [r["step"] for r in ranks] == [1, 3, 5, 7] and all(r["slowest_rank"] == 1 for r in ranks)
    assert all(r["slowest_compute_ms"] > 150 for r in ranks)
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: rank 1 on ")]
    assert len(warnings) == 1 and "slower than the median" in warnings[0], proc.stderr[-2000:]
    for rank in (0, 1):
        trace = json.loads((out / "profile" / f"rank{rank}_steps2-3.json").read_text())
        assert trace["traceEvents"]
