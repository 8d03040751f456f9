"""Resuming: which checkpoint a launch (or a rollback) continues from, and the one-history rules.

A run folder (out_dir) holds one line of history: one run, named by the `run_id` that a fresh
start draws and that its checkpoints, its resumes and `run.json` carry. Each checkpoint also
has its own `checkpoint_id`, and `ancestry` lists the ids of the checkpoints its run resumed
from, oldest first: that is what lets `--resume PATH` tell checkpoints that continued from PATH
from another run's, or from an abandoned later step.

Every decision about what a launch continues is taken here, by rank 0, before anything is
written (the other ranks get its answer, or its error):

- `choose_resume_checkpoint`: resolve `resume` (`find_resume_checkpoint`: auto, never, a path
  and its descendants), then refuse what would mix two runs in one folder: a fresh start over
  a used out_dir (`refuse_used_out_dir`), a folder or a chosen checkpoint of another run
  (`check_one_history`), a fresh start over a run whose checkpoints went missing
  (`refuse_lost_history`);
- `load_compatible_checkpoint`: the chosen checkpoint's state, once it fits this run's model;
- `choose_rollback_checkpoint`: where a rollback goes.

The locks on out_dir and checkpoint_dir, and the owner file of a checkpoint_dir outside
out_dir (one checkpoint folder, one run folder), are training/checkpoint/run_folder.py's: they claim the
folders for a launch, before anything here is asked.
"""

from __future__ import annotations

import json
from pathlib import Path

from common.errors import CheckpointError, ConfigError, print_warning
from training.core import storage
from training.checkpoint.folder import (RESUME_ENTRIES, CheckpointTooNewError, check_compatible,
                                 list_checkpoints, load_checkpoint, newest_readable_checkpoint, require_entries,
                                 set_aside)
from training.core.process_group import DistEnv, broadcast_object, run_on_all_ranks
from training.core.logger import LOG_NAME, read_log
from training.core.storage import Location, name_of, parent_of
from training.core.context import Context

RUN_RECORD = "run.json"  # written by the trainer at every launch (training/observe/provenance.py)


def choose_resume_checkpoint(ctx: Context, out_dir: str, folder: Location, resume: str) -> Location | None:
    """The checkpoint this launch continues (None: a fresh start). Rank 0 resolves `resume` (the checkpoint
    section's) in the run's checkpoint folder and checks the history of out_dir; every rank gets its
    answer, or its error."""
    env, logger = ctx.env, ctx.logger

    def resolve() -> Location | None:
        if not env.master_process:
            return None
        if resume == "never":
            refuse_used_out_dir(Path(out_dir), folder)
        found = find_resume_checkpoint(folder, resume, warn=logger.warn)
        check_one_history(out_dir, folder, None if found is None else found[:2])
        if found is None:
            if resume == "auto":
                refuse_lost_history(out_dir, folder, logger.warn)
            return None
        path, _, how = found
        logger.console(f"resuming from {path} ({how})")
        return path

    return broadcast_object(run_on_all_ranks(env, resolve), env)


def find_resume_checkpoint(folder: Location, resume: str, warn=print_warning) -> tuple[Location, dict, str] | None:
    """Resolve the `resume` key: (path, state, how it was chosen), or None for a fresh start.

    folder is the run's checkpoint folder. The checkpoints of one run always form one line of
    history, so `resume: auto` can never pick up another run's state:
    - auto: the newest readable checkpoint in the folder (unreadable newer ones are set aside).
    - never: a fresh start (choose_resume_checkpoint refuses one into an out_dir that holds a run).
    - a path: that checkpoint, or the newest checkpoint in out_dir that continued from it
      (a relaunch that repeats the same arguments, under torchrun --max-restarts or a SLURM
      requeue, must not go back to the path each time). Checkpoints in the folder of another run,
      or newer ones that did not continue from the path (a rollback), are refused.
    """
    if resume == "never":
        return None
    if resume == "auto":
        found = newest_readable_checkpoint(folder, warn)
        return None if found is None else (*found, "the newest checkpoint in out_dir")
    path = storage.as_location(resume)
    if not storage.exists(path):
        raise ConfigError(f"resume: no checkpoint file or folder at {resume!r} (use auto, never, or the path of a "
                          f"step_XXXXXXXX.pt file or step_XXXXXXXX folder)")
    state = load_checkpoint(path)
    descendants = descendants_of(folder, path, state, warn)
    if descendants:
        return descendants[-1], load_checkpoint(descendants[-1]), f"the newest checkpoint that continued from {path}"
    return path, state, "resume"


def descendants_of(folder: Location, path: Location, state: dict, warn) -> list[Location]:
    """The checkpoints in folder newer than the one at path (its state) that continued from it, oldest
    first; a ConfigError when the folder holds another run's, or a newer one that did not continue from it."""
    descendants = []
    for step, other in list_checkpoints(folder):
        if same_location(other, path):
            continue
        try:
            lineage = load_checkpoint(other)  # metadata only: the tensors stay on storage
        except CheckpointTooNewError:
            raise
        except CheckpointError as e:
            set_aside(other, e, warn)
            continue
        if lineage.get("run_id") != state.get("run_id"):
            raise ConfigError(
                f"resume: {other} belongs to another run than {path}; give this run another out_dir")
        if step > state["step"]:
            if state.get("checkpoint_id") is None or state["checkpoint_id"] not in lineage.get("ancestry", []):
                raise ConfigError(
                    f"resume: {other} is newer than {path} and did not continue from it; to go back to "
                    f"{storage.name_of(path)}, move the newer checkpoints out of {folder} or use another out_dir")
            descendants.append(other)
    return descendants


def same_location(a: Location, b: Location) -> bool:
    if isinstance(a, Path) and isinstance(b, Path):
        return a.resolve() == b.resolve()
    return str(a).rstrip("/") == str(b).rstrip("/")


def refuse_used_out_dir(out_dir: Path, folder: Location) -> None:
    """A fresh start must not mix with the run already in out_dir (its checkpoints and log)."""
    used = [name_of(p) for _, p in list_checkpoints(folder)][-2:]
    if (out_dir / LOG_NAME).exists():
        used.insert(0, LOG_NAME)
    if used:
        raise ConfigError(f"resume: {out_dir} already holds a run ({', '.join(used)}); "
                          f"continue it with --resume auto, or give this run another out_dir")


def recorded_run_id(out_dir: str | Path) -> str | None:
    """The run_id in out_dir/run.json; None without one (no run yet, or a folder of older code)."""
    try:
        record = json.loads((Path(out_dir) / RUN_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record.get("run_id") if isinstance(record, dict) else None


def check_one_history(out_dir: str | Path, checkpoints: Location, chosen: tuple[Location, dict] | None) -> None:
    """Refuse to go on when out_dir (with its checkpoint folder), or out_dir and the checkpoint chosen
    to resume, hold more than one run.

    What names a run: run.json's run_id (every launch writes it), and each readable checkpoint's
    run_id. They must all agree, with each other and with the chosen checkpoint. A chosen
    checkpoint from another folder into an out_dir whose log cannot be attributed to any run
    (written by older code) is refused too: its records would mix with the new ones.
    """
    out_dir = Path(out_dir)
    owners = runs_in(out_dir, checkpoints)
    if len(owners) > 1:
        raise ConfigError(f"resume: {out_dir} holds more than one run ({describe(owners)}); one folder holds one "
                          f"line of history: move the other run's files out, or give this run another out_dir")
    if chosen is None:
        return
    path, state = chosen
    theirs = state.get("run_id")
    ours = next(iter(owners), None)
    if ours is not None and theirs != ours:
        raise ConfigError(f"resume: {path} belongs to run {short(theirs)}, but {out_dir} holds run {short(ours)} "
                          f"({owners[ours]}); continue that run with --resume auto, or give this run another out_dir")
    if ours is None and (out_dir / LOG_NAME).exists() and str(parent_of(path)) != str(checkpoints):
        raise ConfigError(f"resume: {out_dir} holds a {LOG_NAME} of another run; resuming {path} there would mix "
                          f"their records: give this run another out_dir")


def runs_in(out_dir: Path, checkpoints: Location) -> dict[str, str]:
    """run_id -> what carries it (for a message): run.json's, then each readable checkpoint's."""
    owners: dict[str, str] = {}
    recorded = recorded_run_id(out_dir)
    if recorded:
        owners[recorded] = f"{RUN_RECORD} and {LOG_NAME}"
    for _, path in list_checkpoints(checkpoints):
        try:
            run_id = load_checkpoint(path).get("run_id")  # metadata only: the tensors stay on storage
        except CheckpointTooNewError:
            raise
        except CheckpointError:
            continue  # damaged: never chosen, and set aside when it would be
        if run_id:
            owners.setdefault(run_id, f"{name_of(checkpoints)}/{name_of(path)}")
    return owners


def describe(owners: dict[str, str]) -> str:
    return ", ".join(f"run {short(run_id)} in {where}" for run_id, where in owners.items())


def short(run_id: str | None) -> str:
    return run_id[:8] if run_id else "(unnamed)"


def refuse_lost_history(out_dir: str | Path, checkpoints: Location, warn) -> None:
    """Before a fresh start into out_dir (resume auto found no checkpoint to continue): refuse one
    that would replace the log of a run that saved checkpoints this launch cannot see.

    That happens when checkpoint_dir was changed or mistyped on a relaunch, or when the run's
    only checkpoint is damaged (set aside as `.unreadable`): starting over would truncate
    log.jsonl and rewrite run.json under a new run id. The log's `checkpoint` records say what
    was saved, and where. A launch that saved none (it crashed before its first checkpoint) has
    nothing to continue: it starts over, with a warning.
    """
    log = Path(out_dir) / LOG_NAME
    if not log.exists():
        return
    records = read_log(log)
    saved = [r for r in records if r.get("kind") == "checkpoint"]
    aside = sorted(name for name in storage.list_names(checkpoints) if name.endswith(".unreadable"))
    if saved or aside:
        found = [f"its log records checkpoint {saved[-1].get('path')}"] if saved else []
        found += [f"{checkpoints} holds {', '.join(aside)} (set aside as unreadable)"] if aside else []
        raise ConfigError(f"resume: {out_dir} holds a run that saved checkpoints ({'; '.join(found)}), but there is "
                          f"none to resume in {checkpoints}; starting over would replace its log: point "
                          f"--checkpoint_dir or --resume at its checkpoints, or give this run another out_dir")
    steps = [r["step"] for r in records if r.get("kind") == "train"]
    if steps:
        warn(f"{out_dir} holds the log of a launch that saved no checkpoint (steps {min(steps)}-{max(steps)}): "
             f"starting that run over, and its log with it")


def load_compatible_checkpoint(path: Location, model_config) -> dict:
    """The checkpoint's state, once it has what a resume needs and fits this run's model shape (its
    tensors left on storage: every rank then reads only what it keeps)."""
    state = require_entries(load_checkpoint(path), RESUME_ENTRIES, path, "resuming")
    check_compatible(state, model_config.to_dict(), path)
    return state


def choose_rollback_checkpoint(folder: Location, resumed_from: Location | None, resumed_step: int, env: DistEnv,
                               warn) -> Location | None:
    """Where a rollback goes: the newest checkpoint in the folder, or the one this launch resumed from
    if newer (it may lie elsewhere: a run continued with --resume PATH into a new out_dir); None when
    there is neither. Rank 0 chooses; every rank gets its answer. Collective."""
    def newest() -> Location | None:
        if not env.master_process:
            return None
        found = find_resume_checkpoint(folder, "auto", warn=warn)
        if resumed_from is not None and (found is None or found[1]["step"] < resumed_step):
            return resumed_from
        return None if found is None else found[0]

    return broadcast_object(run_on_all_ranks(env, newest), env)
