"""Rank 0's record of a run: a console line, `log.jsonl`, and optionally W&B and TensorBoard.

Every other rank holds a disabled logger, so call sites need no `if master_process`. Nothing
here is a collective. A record that cannot be written (disk full) does not raise in the
middle of a step: the logger keeps the WriteError in `failure` and writes nothing more, and
the trainer shares it with every rank at the step's all-reduce, so all stop with one line.

log.jsonl has one JSON object per event (`kind` = train, val, hellaswag, sample, ...), each with the
wall-clock time it was written (`time`, unix seconds), added here for every record. When a
run resumes from the checkpoint of step s, the records of step >= s are dropped first: they
describe work after that checkpoint which will now be redone, so the log ends up with
exactly one record of each kind per step. A rollback to that checkpoint drops them the same
way, but keeps the records of earlier rollbacks (`rewind`). A figure that is NaN or infinite is
written as null, so that every line stays JSON that any reader takes (jq, pandas, a browser:
Python's NaN and Infinity are no JSON); the readers of a figure take its null as non-finite
(compare_runs.py refuses it, plot_log.py leaves the point out).

TensorBoard gets the same records' numbers as `kind/field` scalars against the step (and the
samples' text), and hides the values of the dropped records, so each step shows the value kept
in the log. W&B gets every record as one row, at W&B's own step (which only goes forward) with
the training step as `trainer/step`, the x-axis of the charts; W&B cannot drop the rows of the
redone steps, so a `rewind/to_step` row marks where they stop counting (see _wandb_log).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from common.atomic_file import atomic_write
from common.errors import ConfigError, DataError, WriteError, print_warning
from common.log_fields import RECORD_FIELDS, TRAIN_METRICS
from common.settings import OrNone, Settings, Words, option, require, section

LOG_NAME = "log.jsonl"
# Records of something that happened (not of a step's state): a rollback's rewind keeps them, so a second
# rollback to the same checkpoint leaves the first one's record, and the launch keeps its one startup record and
# its record of each evaluation it cannot run (see RunLogger.rewind)
EVENT_KINDS = ("rollback", "startup", "skip_eval")
# Records for log.jsonl alone: which checkpoints were saved, and where (what a relaunch checks, see
# training/checkpoint/run_folder.py), is bookkeeping, not a curve; an evaluation skipped has its reason, no figure
LOG_ONLY_KINDS = ("checkpoint", "skip_eval")
TENSORBOARD_MISSING = "tensorboard: needs the tensorboard package (pip install tensorboard), or set --tensorboard false"
WANDB_STEP = "trainer/step"  # the x-axis of every W&B chart of the trainer's records (W&B's own step counts rows)


def read_log(path: str | Path) -> list[dict]:
    """All records of a log.jsonl: its JSON objects (a torn last line, from a crash mid-write, is skipped, and so
    is a line that holds some other JSON value: every reader, and the rewind, takes a record for a dict)."""
    records = []
    with open(path) as f:
        for line in f:
            with contextlib.suppress(json.JSONDecodeError):
                record = json.loads(line)
                if isinstance(record, dict):
                    records.append(record)
    return records


def read_run_log(path: str | Path, missing: str = "no such file") -> list[dict]:
    """read_log for a tool reading a run someone names: a log that is missing (`missing` says so) or cannot be
    read is a DataError naming it."""
    try:
        return read_log(path)
    except FileNotFoundError:
        raise DataError(f"{path}: {missing}") from None
    except OSError as e:
        raise DataError(f"{path}: {e.strerror or e}") from None


def truncate_log(path: str | Path, step: int, keep_kinds: tuple[str, ...] = ()) -> int:
    """Keep only the records before `step`, those of keep_kinds, and the checkpoint record of `step`
    itself (the run goes on from that checkpoint: it still exists), rewriting the file atomically.

    Returns how many records were dropped.
    """
    path = Path(path)
    if not path.exists():
        return 0
    records = read_log(path)
    kept = [r for r in records if r.get("step", -1) < step or r.get("kind") in keep_kinds
            or (r.get("kind") == "checkpoint" and r.get("step") == step)]
    write_text_file(path, "".join(json.dumps(r) + "\n" for r in kept))
    return len(records) - len(kept)


def write_text_file(path: Path, text: str) -> None:
    """Replace path's content atomically (common/atomic_file.py); a failure is a WriteError naming it."""
    try:
        with atomic_write(path, "w") as f:
            f.write(text)
    except OSError as e:
        raise WriteError(f"{path}: could not write ({e.strerror or e})") from None


def _import_wandb(folder: Path):
    """wandb, imported (the first time) with the temp dir pointed at `folder`, the run's wandb folder.

    Importing wandb makes two folders in the temp dir (tmp*wandb-media, tmp*wandb-artifacts) that
    only an atexit hook removes: a rank that ends without running it (killed after a hang, or forked
    by a launcher whose children end with os._exit) would leave them in the system temp dir for
    good. Made in the run's own folder, what such a rank leaves stays with the run. No other thread
    of the trainer runs yet when rank 0 starts W&B, so none sees the swap.
    """
    if "wandb" not in sys.modules:
        folder.mkdir(parents=True, exist_ok=True)
        saved, tempfile.tempdir = tempfile.tempdir, str(folder)
        try:
            import wandb  # noqa: F401 - imported lazily: training never needs wandb when wandb=false
        finally:
            tempfile.tempdir = saved
    return sys.modules["wandb"]


def _is_number(value) -> bool:
    """A value W&B and TensorBoard can plot: a finite int or float (not a bool, text or list)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _finite_or_none(value):
    """value, but a NaN or infinite float as None: null in log.jsonl (see the module's docstring)."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


class RunLogger:
    """Rank 0's console, warnings, run folder files, log.jsonl and W&B run; a no-op on other ranks.

    Made at launch (console and warnings work at once); `open_run_folder` then creates out_dir
    and its files once the run's starting step is known. One owner (the trainer's main) closes it.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.wandb_run = None
        self.tensorboard = None  # a SummaryWriter, with `tensorboard: true`
        self.failure: WriteError | None = None  # the first record that could not be written
        self.path: Path | None = None  # log.jsonl, once the run folder is open
        self._jsonl = None
        self._opened_at = (0, 0)  # the step the run starts from, and how many records of later steps the log lost
        self._wandb_kinds: set[str] = set()  # the kinds whose W&B charts are set to WANDB_STEP

    def open_run_folder(self, out_dir: str | Path, resume_step: int, files: dict[str, str]) -> None:
        """Create out_dir, write `files` (name -> text, e.g. config.yaml), open log.jsonl.

        The log loses its records of step >= resume_step (they will be redone). Rank 0 only; a
        failure is a ConfigError (out_dir cannot exist) or a WriteError naming the file.
        """
        if not self.enabled:
            return
        out_dir = Path(out_dir)
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"out_dir: cannot create {out_dir} ({e.strerror or e})") from None
        for name, text in files.items():
            write_text_file(out_dir / name, text)
        self.path = out_dir / LOG_NAME
        self._opened_at = (resume_step, truncate_log(self.path, resume_step))
        try:
            self._jsonl = open(self.path, "a", buffering=1)  # line-buffered: one record per line
        except OSError as e:
            raise WriteError(f"{self.path}: could not open ({e.strerror or e})") from None
        self._rewind_wandb()

    # --- W&B ----------------------------------------------------------------------------------
    def start_wandb(self, project: str, run_name: str, mode: str, config: dict, tags: list[str],
                    run_id: str | None, out_dir: str | Path) -> None:
        """Start (or resume, given run_id) the W&B run. The API key comes from the environment only.

        The trainer starts it before it writes the run folder's files (open_run_folder), so that a start that fails
        (no API key, no network) leaves the folder as it was: the wandb/ folder it made is removed. A resumed run
        whose log lost records starts with a rewind row (see _wandb_log), once both are open.
        """
        if not self.enabled:
            return
        folder = Path(out_dir) / "wandb"
        made = not folder.exists()
        try:
            wandb = _import_wandb(folder)
            self.wandb_run = wandb.init(
                project=project, name=run_name or None, config=config, tags=tags or None,
                id=run_id, resume="allow", mode=mode, dir=str(out_dir),
            )
        except BaseException:
            if made:
                shutil.rmtree(folder, ignore_errors=True)
            raise
        self.wandb_run.define_metric(WANDB_STEP)
        self._wandb_kinds = set()
        self._rewind_wandb()

    def _rewind_wandb(self) -> None:
        """Once W&B and the log are both open (in either order): a rewind row where the log lost records."""
        start_step, dropped = self._opened_at
        if self.wandb_run is not None and self.path is not None and dropped:
            self._wandb_rewind(start_step, dropped)

    def start_tensorboard(self, log_dir: str | Path, start_step: int) -> None:
        """Write every record's numbers as TensorBoard scalars into log_dir (rank 0).

        start_step is the step the run starts from, as given to open_run_folder: the events of
        step >= start_step that earlier launches wrote are purged (hidden by TensorBoard when it
        reads the folder), as the log dropped their records, so each step shows the redone value once.
        """
        if not self.enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
        except ImportError:
            raise ConfigError(TENSORBOARD_MISSING) from None
        try:
            self.tensorboard = SummaryWriter(log_dir=str(log_dir), purge_step=start_step)
        except OSError as e:
            raise WriteError(f"{log_dir}: could not create the TensorBoard folder ({e.strerror or e})") from None

    @property
    def wandb_run_id(self) -> str | None:
        return self.wandb_run.id if self.wandb_run is not None else None

    # --- records --------------------------------------------------------------------------------
    def log(self, record: dict) -> None:
        """Append one event to log.jsonl, with the time now, and send its numbers to W&B under `kind/name`
        (W&B and TensorBoard keep their own time)."""
        if not self.enabled:
            return
        if self.failure is not None:
            return
        record = {**{k: _finite_or_none(v) for k, v in record.items()}, "time": time.time()}
        try:
            self._jsonl.write(json.dumps(record) + "\n")
        except OSError as e:
            self.failure = WriteError(f"{self.path}: could not append a record ({e.strerror or e}); "
                                      f"the checkpoints written before are intact")
            return
        kind, step = record["kind"], record["step"]
        if kind in LOG_ONLY_KINDS:
            return
        numbers = {f"{kind}/{k}": v for k, v in record.items() if k not in RECORD_FIELDS and _is_number(v)}
        if self.tensorboard is not None:
            try:
                for name, value in numbers.items():
                    self.tensorboard.add_scalar(name, value, global_step=step)
                if kind == "sample":
                    self.tensorboard.add_text("sample/text", record["text"], global_step=step)
            except OSError as e:
                self.failure = WriteError(f"{self.tensorboard.log_dir}: could not write TensorBoard events "
                                          f"({e.strerror or e}); the checkpoints written before are intact")
        if self.wandb_run is not None:
            metrics = numbers
            if kind == "sample":
                import wandb

                metrics = {"sample/text": wandb.Html("<pre>" + record["text"] + "</pre>")}
            self._wandb_log(kind, step, metrics)

    def _wandb_log(self, kind: str, step: int, metrics: dict) -> None:
        """One W&B row: the metrics (`kind/...`) and WANDB_STEP = step, at W&B's own next step.

        W&B's step only goes forward: a row logged at a step below its newest is dropped (with a
        "Tried to log to step ..." line), so the steps that a resume or a rollback redoes, and the
        rollback record itself, never arrived while the training step was W&B's step. W&B can
        forget rows only by rewinding a run on its server (wandb.init resume_from: a preview
        feature, and not something an offline run can do). So every record becomes a row at W&B's
        own step, each kind's charts are drawn against WANDB_STEP, and a rewind is a row of its own
        (`rewind/to_step` = s): the rows logged before it at WANDB_STEP >= s, other than rollback
        rows, are of abandoned steps, and the rows after it redo them. A chart shows both values
        of a redone step; W&B's own step (chronological) tells them apart.
        """
        if kind not in self._wandb_kinds:
            self.wandb_run.define_metric(f"{kind}/*", step_metric=WANDB_STEP)  # not "*": eval_lm.py has its own
            self._wandb_kinds.add(kind)
        self.wandb_run.log({WANDB_STEP: step, **metrics})

    def _wandb_rewind(self, step: int, dropped: int) -> None:
        """The row that marks the W&B rows of step >= `step` logged so far (bar rollbacks) as abandoned."""
        self._wandb_log("rewind", step, {"rewind/to_step": step, "rewind/dropped_records": dropped})

    def check(self) -> None:
        """Raise the failure of an earlier record, if any."""
        if self.failure is not None:
            raise self.failure

    def rewind(self, step: int) -> None:
        """A rollback to the checkpoint of `step`: drop the log's records of step >= `step`, which will be redone.

        Unlike a resume's truncation, the records of EVENT_KINDS stay: an earlier rollback to the same
        checkpoint happened in this run's course and will not be redone (the data it passed over stays
        passed over), so log.jsonl keeps one rollback record per rollback, as the checkpoints count them.
        """
        if not self.enabled or self._jsonl is None:
            return
        self._jsonl.close()
        dropped = truncate_log(self.path, step, keep_kinds=EVENT_KINDS)
        try:
            self._jsonl = open(self.path, "a", buffering=1)
        except OSError as e:
            raise WriteError(f"{self.path}: could not open ({e.strerror or e})") from None
        if self.tensorboard is not None:
            self._purge_tensorboard(step)
        if self.wandb_run is not None and dropped:
            self._wandb_rewind(step, dropped)

    def _purge_tensorboard(self, step: int) -> None:
        """Hide the TensorBoard events of step >= `step` written so far, as a restart's purge_step does.

        The event that SummaryWriter(purge_step=step) writes at the top of a new file, a SessionLog
        START at `step`, written into the open file: TensorBoard's EventAccumulator drops at it
        every event of step >= `step` read before it. (A new file would do the same only if read
        after this one, but the files are read in the order of their names, and two opened within
        the same second can sort the wrong way: ...10 before ...9.) TensorBoard's fast loader
        ignores the event, but drops a chart's values at and past a step logged again, as the
        redone steps are. Either way a chart holds one value per step: of the rollback records
        the log keeps at one step, the newest.
        """
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        try:
            self.tensorboard.file_writer.add_event(Event(step=step, session_log=SessionLog(status=SessionLog.START)))
        except OSError as e:
            self.failure = WriteError(f"{self.tensorboard.log_dir}: could not write TensorBoard events "
                                      f"({e.strerror or e}); the checkpoints written before are intact")

    def console(self, text: str) -> None:
        if self.enabled:
            print(text, flush=True)

    def warn(self, text: str) -> None:
        """One `warning: ...` line on stderr (rank 0 only, like every other line)."""
        if self.enabled:
            print_warning(text)

    def close(self) -> None:
        if self._jsonl is not None:
            with contextlib.suppress(OSError):  # its failure was reported when the record was written
                self._jsonl.close()
            self._jsonl = None
        if self.tensorboard is not None:
            with contextlib.suppress(OSError):  # flushes the events; a failure was reported when a record was written
                self.tensorboard.close()
            self.tensorboard = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def format_train_line(r: dict, max_steps: int, elapsed_s: float, eta_s: float | None) -> str:
    """The console line of a train record: where the run is (`step 1200/19073 (6.3%)`: 1,200 of max_steps updates
    done, the count an evaluation of the model they made prints, `step 1200 | val loss ...`; the train record of
    the 1,200th update has step 1199), the step's figures, the peak memory on a GPU, this launch's time so far,
    and the time to max_steps (eta_s; None until a launch has a rate: its first step compiles). After the peak memory,
    the text of each metric the step recorded whose declaration shows it (common/log_fields.py's train_metric)."""
    width = len(str(max_steps))
    done = r["step"] + 1
    mfu = f" | mfu {100 * r['mfu']:5.1f}%" if "mfu" in r else ""
    memory = f" | mem {r['peak_mem_gb']:5.1f} GiB" if "peak_mem_gb" in r else ""
    texts = (m.show(r[m.name]) for m in TRAIN_METRICS.values() if m.show and m.name in r)
    shown = "".join(f" | {text}" for text in texts if text)
    eta = f" | eta {format_duration(eta_s)}" if eta_s is not None else ""
    return (f"step {done:{width}d}/{max_steps} ({100 * done / max_steps:5.1f}%) | "
            f"loss {r['loss']:.4f} | lr {r['lr']:.3e} | norm {r['grad_norm']:6.3f} | {r['step_ms']:8.1f} ms | "
            f"{r['tokens_per_sec']:10,.0f} tok/s{mfu}{memory}{shown} | elapsed {format_duration(elapsed_s)}{eta}")


def format_duration(seconds: float) -> str:
    """45s, 12m05s, 3h07m, 2d04h: two units at most, the larger first."""
    seconds = max(0, round(seconds))
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


WANDB_MODES = ("online", "offline", "disabled")


@section
class LoggingSettings(Settings):
    """The logging section: what rank 0 writes besides log.jsonl (which gets every record)."""

    SECTION = "logging"
    SUMMARY = "the console, TensorBoard and Weights & Biases"

    log_interval: int = option(1, "console line every N steps (log.jsonl gets every step)", on_resume="none")
    tensorboard: bool = option(False, "also write the log's numbers as TensorBoard scalars to out_dir/tensorboard/ "
                                      "(needs the tensorboard package)", on_resume="none")
    wandb: bool = option(False, "log to Weights & Biases", on_resume="none")
    wandb_project: str = option("gpt2-repro", "W&B project", on_resume="none")
    wandb_run_name: str = option("", "W&B run name ('': W&B picks one)", on_resume="none")
    wandb_mode: OrNone[str] = option(None, "online, offline (sync later) or disabled; auto: the WANDB_MODE "
                                           "environment variable's, online where it is unset", on_resume="none",
                                     none="auto")
    wandb_tags: Words = option([], "W&B tags, comma-separated on the command line", on_resume="none")

    def validate(self) -> None:
        require(self.log_interval > 0, "log_interval", f"must be positive, got {self.log_interval}")
        require(self.wandb_mode in (None, *WANDB_MODES), "wandb_mode",
                f"unknown mode {self.wandb_mode!r}; choose online, offline, disabled or auto")
        if self.wandb:
            wandb_mode_of(self.wandb_mode)  # WANDB_MODE checked now, not when W&B starts

    def resolved_wandb_mode(self) -> str:
        return wandb_mode_of(self.wandb_mode)


def wandb_mode_of(setting: str | None) -> str:
    """The W&B mode a run uses: its setting, or (auto: None) the WANDB_MODE environment variable's, as W&B's own
    tools take it (`WANDB_MODE=offline python train_gpt2.py ...`), else online. W&B's old word for offline, dryrun,
    is offline; another word is a ConfigError naming the variable."""
    if setting is not None:
        return setting
    mode = os.environ.get("WANDB_MODE", "").strip().lower() or "online"
    mode = "offline" if mode == "dryrun" else mode
    require(mode in WANDB_MODES, "WANDB_MODE", f"unknown mode {mode!r} in the environment; choose online, offline or "
                                               f"disabled, or set --wandb_mode")
    return mode
