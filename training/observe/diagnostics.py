"""Diagnostics of a long run: a profiler window, CUDA memory snapshots, the ranks' timings.

Three independent pieces, each off unless its key of the diagnostics section (DiagnosticsSettings)
turns it on: ProfileWindow (a torch.profiler trace per rank), MemorySnapshot (every CUDA allocation
of the first steps) and RankStats (each rank's compute and data-wait times, shared at an interval,
a straggler named); `Diagnostics` drives the three from the training loop. Their files go into the
run folder (out_dir). None of them synchronises with the host inside a step: CUDA timings are
events read at the interval, the profiler and the snapshots write only at their window's end.
Nothing here is checkpointed: diagnostics are not part of a run's course.
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from common.errors import first_line
from runtime.context import Context
from runtime.process_group import all_gather
from training.observe.settings import DiagnosticsSettings

STRAGGLER_INTERVALS = 3  # intervals in a row, for the same rank, before it is named


# --- 1. the profiler window ---------------------------------------------------------------------


class ProfileWindow:
    """torch.profiler over steps profile_from .. profile_from + profile_steps - 1, one trace per rank.

    The trace is `out_dir/profile/rank{R}_steps{A}-{B}.json`, a Chrome trace (export_chrome_trace)
    that Perfetto (https://ui.perfetto.dev) and chrome://tracing open; every step in it is a
    `step N` region. Every rank writes its own file; rank 0 prints one line naming the folder.
    CPU activity always, CUDA activity (and memory) on CUDA; shapes and stacks are not recorded
    (they make traces large and slow the steps). Off when profile_from is 0. Not a collective.

    A window only starts at step == profile_from: a run resumed past it (or inside it) profiles
    nothing, nor does one whose max_steps comes first; rank 0 says so in one warning at start-up
    (at construction, or at the run's first step_started for a resume), since the missing trace
    would otherwise go unnoticed. A failure to start the profiler or to write the trace is a
    warning, never a crash.
    """

    def __init__(self, settings: DiagnosticsSettings, ctx: Context, out_dir: str, max_steps: int):
        """out_dir: the run folder (run section); max_steps (schedule section): whether the window is reached."""
        self.env, self.runtime, self.logger = ctx.env, ctx.runtime, ctx.logger
        self.settings = settings
        self.first = self.settings.profile_from
        self.last = self.settings.profile_from + self.settings.profile_steps - 1
        self.enabled = self.settings.profile_from > 0
        self.folder = Path(out_dir) / "profile"
        self.path: Path | None = None  # the trace written, once it is
        self._profiler = None
        self._region = None  # the open `step N` record_function
        self._last_started: int | None = None
        self._done = False  # one window per process, also after a rollback to before it
        self._first_step_seen = not self.enabled  # the resume check is made once, at the run's first step
        if self.enabled and self.first >= max_steps:
            self._first_step_seen = True
            self.logger.warn(f"profile: profile_from {self.first} is not before max_steps {max_steps}: "
                             f"the window never starts, no trace is written")

    @property
    def active(self) -> bool:
        """Whether the profiler is recording now."""
        return self._profiler is not None

    def step_started(self, step: int) -> None:
        """Call right before update `step` (0-based) is taken, on every rank.

        Starts the profiler at step == profile_from, and opens the step's `step N` region while
        the window is open. A step that never finished (an exception inside it) is closed here.
        """
        if not self.enabled:
            return
        if not self._first_step_seen:
            self._first_step_seen = True
            if step > self.first:
                self.logger.warn(f"profile: profile_from {self.first} is before step {step}, where this run starts "
                                 f"(resumed): the window never starts, no trace is written")
        self._close_region()
        if self._profiler is None and not self._done and step == self.first:
            self._start()
        if self._profiler is not None:
            self._region = torch.profiler.record_function(f"step {step}")
            self._region.__enter__()
            self._last_started = step

    def step_finished(self, step: int) -> None:
        """Call right after update `step` is taken (the step's host sync has happened), on every rank.

        After the window's last step, stops the profiler and writes this rank's trace (seconds
        for a big model: this step's own timing, taken before, does not include it).
        """
        if self._profiler is None:
            return
        self._close_region()
        if step >= self.last:
            self._finish(step)

    def close(self) -> None:
        """Call once when training ends, also after a failure (a `finally`): a window still open
        (the run ended or failed inside it) is stopped and its trace written, up to the last
        step started. Safe to call twice, and when nothing was profiled."""
        if self._profiler is not None:
            self._close_region()
            self._finish(self._last_started if self._last_started is not None else self.first)

    # --- internals
    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        cuda = self.runtime.device_type == "cuda"
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        try:
            profiler = torch.profiler.profile(activities=activities, record_shapes=False, with_stack=False,
                                              profile_memory=cuda)
            profiler.start()
        except Exception as e:  # noqa: BLE001 - a diagnostic never stops the run
            self._done = True
            self.logger.warn(f"profile: could not start torch.profiler at step {self.first} ({first_line(e)}); "
                             f"nothing is profiled")
            return
        self._profiler = profiler

    def _close_region(self) -> None:
        if self._region is not None:
            region, self._region = self._region, None
            with contextlib.suppress(Exception):  # a region the profiler already closed
                region.__exit__(None, None, None)

    def _finish(self, last_step: int) -> None:
        profiler, self._profiler = self._profiler, None
        self._done = True
        path = self.folder / f"rank{self.env.rank}_steps{self.first}-{last_step}.json"
        try:
            profiler.stop()
            self.folder.mkdir(parents=True, exist_ok=True)
            profiler.export_chrome_trace(str(path))
        except Exception as e:  # noqa: BLE001 - a diagnostic never stops the run
            self.logger.warn(f"profile: could not write {path} ({first_line(e)})")
            return
        self.path = path
        self.logger.console(f"profile: steps {self.first}-{last_step} traced, one Chrome trace per rank in "
                            f"{self.folder} (open in https://ui.perfetto.dev or chrome://tracing)")


# --- 2. the CUDA memory snapshot ----------------------------------------------------------------


class MemorySnapshot:
    """Every CUDA allocation of the first memory_snapshot steps, one snapshot per rank.

    On CUDA with memory_snapshot = N > 0, allocations are recorded (with their stacks, up to
    100,000 events) from construction on; after step N - 1 each rank writes
    `out_dir/memory/rank{R}_step{N-1}.pickle` (the name holds the last step recorded) and
    recording stops. If the run runs out of memory while recording, `out_of_memory(step)` writes
    `rank{R}_oom_step{step}.pickle` instead: what filled the memory, allocation by allocation.

    To view one: open https://pytorch.org/memory_viz and drag the .pickle onto the page (it
    runs in the browser; nothing is uploaded). "Active Memory Timeline" shows every tensor alive
    over time, with the stack that allocated it on hover; "Allocator State History" shows the
    caching allocator's segments. Allocations made before construction appear without stacks.

    Elsewhere (CPU, MPS), memory_snapshot > 0 is one warning and nothing more. Not a collective.
    Recording slows the host a little (a stack per allocation), never syncs with the GPU.
    """

    def __init__(self, settings: DiagnosticsSettings, ctx: Context, out_dir: str):
        """out_dir: the run folder (run section), whose memory/ the snapshots go into."""
        runtime, logger = ctx.runtime, ctx.logger
        self.env, self.logger = ctx.env, logger
        self.settings = settings
        self.steps = self.settings.memory_snapshot
        self.folder = Path(out_dir) / "memory"
        self.recording = False
        self.paths: list[Path] = []  # the snapshots written
        self._last_finished: int | None = None
        if not self.steps:
            return
        if runtime.device_type != "cuda":
            logger.warn(f"memory_snapshot: CUDA only; ignored on {runtime.device}")
            return
        try:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        except Exception as e:  # noqa: BLE001 - a diagnostic never stops the run
            logger.warn(f"memory_snapshot: could not start recording ({first_line(e)}); no snapshot")
            return
        self.recording = True

    def step_finished(self, step: int) -> None:
        """Call right after update `step` is taken, on every rank. After step memory_snapshot - 1
        (or, in a run resumed past it, after its first step) writes the snapshot, stops recording."""
        self._last_finished = step
        if self.recording and step >= self.steps - 1:
            self._dump(f"rank{self.env.rank}_step{step}.pickle", f"steps up to {step}")

    def out_of_memory(self, step: int | None = None) -> None:
        """Call from the loop's `except torch.OutOfMemoryError`, before re-raising; `step`: the
        update that ran out (run.step; None: the one after the last finished). Writes
        rank{R}_oom_step{step}.pickle if still recording, else does nothing. Never raises."""
        if not self.recording:
            return
        if step is None and self._last_finished is not None:
            step = self._last_finished + 1
        name = f"rank{self.env.rank}_oom_step{step}.pickle" if step is not None else f"rank{self.env.rank}_oom.pickle"
        self._dump(name, "out of memory" + (f" at step {step}" if step is not None else ""))

    def close(self) -> None:
        """Call once when training ends (a `finally`): a recording still on (the run ended or failed
        before step memory_snapshot - 1) is written as rank{R}_step{last finished}.pickle and stopped."""
        if self.recording:
            last = self._last_finished
            self._dump(f"rank{self.env.rank}_step{last if last is not None else 'none'}.pickle",
                       f"steps up to {last}, the run ended" if last is not None else "before the first step")

    def _dump(self, name: str, what: str) -> None:
        self.recording = False
        path = self.folder / name
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(path))
        except Exception as e:  # noqa: BLE001 - a diagnostic never stops the run
            self.logger.warn(f"memory_snapshot: could not write {path} ({first_line(e)})")
        else:
            self.paths.append(path)
            self.logger.console(f"memory snapshot ({what}): one per rank in {self.folder} "
                                f"(view at https://pytorch.org/memory_viz)")
        try:
            torch.cuda.memory._record_memory_history(enabled=None)
        except Exception as e:  # noqa: BLE001
            self.logger.warn(f"memory_snapshot: could not stop recording ({first_line(e)})")


# --- 3. rank timings and stragglers ---------------------------------------------------------------


class RankStats:
    """Each rank's own compute and data-wait times, shared every rank_stats_interval steps.

    Per step, on every rank, with no host synchronisation:
      - data wait: the host seconds given to `add_data_wait` (waiting for batches);
      - compute: from `step_started` to the step's LAST `forward_done`, less the step's data
        wait. Under DDP, forwards and all but the last backward run without a collective, so
        this is the rank's own speed; the window ends before the last backward, whose gradient
        all-reduce makes every rank wait for the slowest. On CUDA the window is measured by
        CUDA events (GPU time: start event to last forward's event), read at the interval; on
        other devices by time.perf_counter. A step with no forward_done counts its whole step.
        (Under FSDP every forward all-gathers parameters, so compute includes waits for the
        other ranks there: the slowest rank is then blurred into all of them.)
      - step: the whole step's host wall time, step_started to step_finished.

    `maybe_share(step)` after every step: at every interval, one all-gather of each rank's
    means [compute ms, data-wait ms, step ms] since the last interval; rank 0 logs a `ranks`
    record. The slowest rank is the one with the largest compute + data wait (a data stall is a
    straggler too). When straggler_factor > 0 and the same rank's compute + data wait is above
    straggler_factor x the median for 3 intervals in a row, rank 0 warns once for that streak.
    The decision uses only the gathered values, so every rank reaches the same one.

    The median is the lower middle value for an even number of ranks (statistics.median_low),
    so that with 2 ranks a rank is compared with the other one, not with the mean of both.
    """

    def __init__(self, settings: DiagnosticsSettings, ctx: Context):
        """Collective when rank_stats_interval > 0 and distributed: every rank makes one, at start-up
        (the host names are gathered here, once)."""
        env = ctx.env
        self.env, self.logger = env, ctx.logger
        self.settings = settings
        self.interval = self.settings.rank_stats_interval
        self.factor = self.settings.straggler_factor
        self.cuda = ctx.runtime.device_type == "cuda"
        self.hosts: list[str] = []
        self.streak_rank: int | None = None  # the rank slower than factor x median in the last intervals
        self.streak = 0  # how many intervals in a row
        self._reset()
        self._step_start: float | None = None  # perf_counter at step_started; None outside a step
        if not self.interval:
            return
        host = socket.gethostname()
        if env.distributed:
            self.hosts = [""] * env.world_size
            dist.all_gather_object(self.hosts, host)
        else:
            self.hosts = [host]

    # --- per step (every rank; no host sync)
    def step_started(self) -> None:
        """Call at the start of each training step, before its first batch is fetched."""
        if not self.interval:
            return
        self._step_wait = 0.0
        self._last_forward: float | None = None
        if self.cuda:
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record()
            self._forward_event = None
        self._step_start = time.perf_counter()

    def forward_done(self) -> None:
        """Call at the end of each micro-step's forward (a forward hook: see `watch`). Outside a
        step (evaluation forwards) it does nothing."""
        if not self.interval or self._step_start is None:
            return
        if self.cuda:
            if self._forward_event is None:
                self._forward_event = torch.cuda.Event(enable_timing=True)
            self._forward_event.record()  # re-recorded by each micro-step: the last one counts
        else:
            self._last_forward = time.perf_counter()

    def add_data_wait(self, seconds: float) -> None:
        """Call where batches are fetched, with the host seconds this rank waited for one."""
        if not self.interval:
            return
        self._wait_s += seconds
        if self._step_start is not None:
            self._step_wait += seconds

    def step_finished(self) -> None:
        """Call at the end of each training step (after its host sync). A step_started not followed
        by step_finished (an exception inside the step) is simply not counted."""
        if not self.interval or self._step_start is None:
            return
        start, self._step_start = self._step_start, None
        step_s = time.perf_counter() - start
        self._steps += 1
        self._step_s += step_s
        if self.cuda and self._forward_event is not None:
            self._events.append((self._start_event, self._forward_event, self._step_wait))
        elif not self.cuda and self._last_forward is not None:
            self._compute_s += max(self._last_forward - start - self._step_wait, 0.0)
        else:  # no forward seen: the whole step
            self._compute_s += max(step_s - self._step_wait, 0.0)

    def watch(self, model: torch.nn.Module):
        """Register forward_done as a forward hook of `model` (the module the training step calls:
        the DDP / compiled wrapper, whose hooks run outside the compiled graph); its handle."""
        return model.register_forward_hook(lambda module, args, output: self.forward_done())

    # --- at the interval (every rank)
    def maybe_share(self, step: int) -> dict | None:
        """Call on EVERY rank after each step (step: the 0-based update just taken). At every
        rank_stats_interval-th step: one all-gather, rank 0 logs the `ranks` record and maybe a
        straggler warning, the timings restart. Returns the record (on every rank), else None."""
        if not self.interval or (step + 1) % self.interval:
            return None
        return self.share(step)

    def share(self, step: int) -> dict:
        """The interval's work (see maybe_share), now. Collective. Syncs with the device once (here,
        not in a step): the step's own sync has completed the events already."""
        steps = self._steps
        rows = self._gather(self._local_means())
        self._reset()
        record = self._judge(step, rows, steps)
        self.logger.log(record)
        return record

    def _local_means(self) -> list[float]:
        compute_s = self._compute_s
        if self._events:
            self._events[-1][1].synchronize()  # complete already (the step synced); cheap
            for start, end, wait in self._events:
                compute_s += max(start.elapsed_time(end) / 1000 - wait, 0.0)
        n = max(self._steps, 1)
        return [1000 * compute_s / n, 1000 * self._wait_s / n, 1000 * self._step_s / n]

    def _gather(self, local: list[float]) -> list[list[float]]:
        """Every rank's [compute ms, data-wait ms, step ms], in rank order. Collective."""
        if not self.env.distributed:
            return [local]
        mine = torch.tensor(local, dtype=torch.float64, device=self.env.device)
        return all_gather(mine, self.env).tolist()  # the interval's one host sync

    def _judge(self, step: int, rows: list[list[float]], steps: int) -> dict:
        """The record of one interval from the gathered rows, and the straggler streak (every rank alike)."""
        compute = [r[0] for r in rows]
        wait = [r[1] for r in rows]
        load = [c + w for c, w in zip(compute, wait)]
        slowest = max(range(len(rows)), key=lambda r: (load[r], -r))
        waiting = max(range(len(rows)), key=lambda r: (wait[r], -r))
        hosts = self.hosts if len(self.hosts) == len(rows) else [""] * len(rows)
        record = {"kind": "ranks", "step": step, "steps": steps,
                  "compute_ms_median": statistics.median_low(compute),
                  "slowest_rank": slowest, "slowest_host": hosts[slowest],
                  "slowest_compute_ms": compute[slowest], "slowest_data_wait_ms": wait[slowest],
                  "data_wait_ms_median": statistics.median_low(wait), "data_wait_ms_max": wait[waiting],
                  "data_wait_rank": waiting, "step_ms": statistics.median_low([r[2] for r in rows])}
        median = statistics.median_low(load)
        straggling = self.factor > 0 and len(rows) > 1 and median > 0 and load[slowest] > self.factor * median
        if not straggling:
            self.streak_rank, self.streak = None, 0
            return record
        if slowest == self.streak_rank:
            self.streak += 1
        else:
            self.streak_rank, self.streak = slowest, 1
        if self.streak == STRAGGLER_INTERVALS:  # once per streak
            self.logger.warn(
                f"rank {slowest} on {hosts[slowest]} is {load[slowest] / median:.1f}x slower than the median "
                f"({load[slowest]:.0f} ms against {median:.0f} ms per step, of which {wait[slowest]:.0f} ms "
                f"waiting for data) for {self.streak} intervals")
        return record

    def _reset(self) -> None:
        self._steps = 0
        self._compute_s = self._wait_s = self._step_s = 0.0
        self._step_wait = 0.0
        self._events: list = []


# --- the bundle the training loop drives ---------------------------------------------------------------


class Diagnostics:
    """The three diagnostics, driven from the training loop (train_gpt2.py's train()); each is off unless configured.
    Made on every rank once the training model is (a collective: the host names), which watch() then times; each
    step runs in `with diagnostics.step(step)`, then step_finished(step, data_wait); close() in the loop's finally."""

    def __init__(self, settings: DiagnosticsSettings, ctx: Context, out_dir: str, max_steps: int):
        """settings: the diagnostics section; out_dir: the run folder the files go into (run section);
        max_steps: the schedule section's (whether the profile window is ever reached)."""
        self.settings = settings  # each piece reads its keys of it
        self.profile = ProfileWindow(settings, ctx, out_dir, max_steps)
        self.memory = MemorySnapshot(settings, ctx, out_dir)
        self.ranks = RankStats(settings, ctx)  # collective (host names) when on
        self._hook = None

    def watch(self, model: torch.nn.Module) -> None:
        """forward_done on every forward of `model` (the training model), when rank stats are on."""
        if self.ranks.interval and self._hook is None:
            self._hook = self.ranks.watch(model)

    @contextlib.contextmanager
    def step(self, step: int):
        """Around the work of update `step`: its profiler region, and a memory snapshot if it runs out
        of memory (memory_snapshot: what filled the memory)."""
        self.step_started(step)
        try:
            yield
        except torch.OutOfMemoryError:
            self.memory.out_of_memory(step)
            raise

    def step_started(self, step: int) -> None:
        self.profile.step_started(step)
        self.ranks.step_started()  # last: the profiler's start is not timed

    def step_finished(self, step: int, data_wait: float = 0.0) -> None:
        """After update `step`, on every rank, with the seconds it waited for batches: timings,
        snapshot, profile window, then (at the interval) the ranks' one all-gather. A collective
        at every rank_stats_interval-th step."""
        self.ranks.add_data_wait(data_wait)
        self.ranks.step_finished()  # first: the writes below are not part of the step's time
        self.memory.step_finished(step)
        self.profile.step_finished(step)
        self.ranks.maybe_share(step)

    def close(self) -> None:
        """Once, in a finally: the profile window and a memory recording still open are written."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.profile.close()
        self.memory.close()
