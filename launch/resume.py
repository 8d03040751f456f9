"""Resuming: what a launch or a rollback continues from, what it loads into what, and what a changed setting means.

Every choice is taken by rank 0 before anything is written, and the other ranks get its answer or
its error; the loading is a collective. The pieces, in that order below:

- what a launch continues from (`choose_resume_checkpoint`): with `resume: auto` the newest readable
  checkpoint of its folder (a damaged newer one is set aside), with `--resume PATH` that one or the
  newest checkpoint that continued from it, with `never` (or auto and nothing to resume) a fresh start;
  then what would mix two runs in one folder is refused. A run folder holds one line of history: one
  run, named by the `run_id` a fresh start draws and its checkpoints, resumes and run.json carry; each
  checkpoint has its own `checkpoint_id`, and `ancestry` lists the ids its run resumed from;
- what it loads (`resume_run`): the run's own values and every part it registers (training/run/run.py's
  Run.parts), through the checkpoint's format (every rank its part, under any strategy and world
  size), a checkpoint of older code converted to this layout first (`current_layout`), each part checked
  against the run before anything is loaded: one that does not fit is set aside when resume chose it, as
  an unreadable one is, and refused when --resume names it (`continue_run`);
- what a changed setting means: another model shape or optimizer is refused, and a checkpoint past
  max_steps; one at it is nothing to do once its final evaluations ran (`finished`); any other changed
  key is one warning naming it and whether it changes the training math (its field's on_resume);
- a rollback (`roll_back`, launch/recovery.py calls it): from the newest checkpoint of the folder, or
  the one this launch resumed if newer.

The locks on out_dir and checkpoint_dir are training/checkpoint/run_folder.py's: they claim the
folders for a launch before anything here is asked. Reading and writing a checkpoint's files is
training/checkpoint/'s (folder.py, the formats).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path

from common.errors import CheckpointError, ConfigError, DivergedError, print_warning
from common.settings import changes_training_math, require
from data.loader import TrainLoader
from data.mixture import changed_shards, derived_state
from training.checkpoint.folder import (RESUME_ENTRIES, CheckpointTooNewError, DamagedCheckpointError,
                                        check_compatible, format_of, list_checkpoints, load_checkpoint,
                                        newest_readable_checkpoint, require_entries, set_aside)
from training.checkpoint.settings import no_checkpoint_at
from runtime import storage
from runtime.context import Context
from runtime.logger import LOG_NAME, read_log
from runtime.process_group import DistEnv, broadcast_object, run_on_all_ranks
from runtime.storage import Location, name_of, parent_of
from training.optim.settings import EMASettings
from training.optim.spikes import RollbackRequested
from launch.config import ON_RESUME_OF, TrainConfig
from training.run.run import Run

RUN_RECORD = "run.json"  # written by the trainer at every launch (training/observe/provenance.py)


# --- what a launch continues from ------------------------------------------------------------------------

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
    require(storage.exists(path), "resume", no_checkpoint_at(resume))
    state = load_checkpoint(path)
    if descendants := descendants_of(folder, path, state, warn):
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
    require(not used, "resume", f"{out_dir} already holds a run ({', '.join(used)}); continue it with --resume auto, "
                                f"or give this run another out_dir")


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
    require(len(owners) <= 1, "resume", f"{out_dir} holds more than one run ({describe(owners)}); one folder holds "
                                        f"one line of history: move the other run's files out, or give this run "
                                        f"another out_dir")
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
    if recorded := recorded_run_id(out_dir):
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
    if steps := [r["step"] for r in records if r.get("kind") == "train"]:
        warn(f"{out_dir} holds the log of a launch that saved no checkpoint (steps {min(steps)}-{max(steps)}): "
             f"starting that run over, and its log with it")


# --- what it loads into what ------------------------------------------------------------------------

def continue_run(cfg: TrainConfig, ctx: Context, run: Run, path: Location | None) -> bool:
    """The run just built (build_run) continues from the checkpoint at path (resume_run), None being a fresh start;
    False when there is nothing to do. Every rank calls it (a collective).

    A checkpoint that reads but does not fit the run (a DamagedCheckpointError: found before anything of it was
    loaded, so the run is as built) is treated as one that does not read is when choosing: one that resume chose
    itself (auto's newest, or the newest that continued from --resume PATH) is set aside, and the run continues
    from the one chosen next; the one --resume PATH names is refused (the next is chosen in run.checkpoints).
    """
    env, logger, resume = ctx.env, ctx.logger, cfg.checkpoint.resume
    while path is not None:
        try:
            return resume_run(cfg, ctx, run, path)
        except DamagedCheckpointError as e:
            if resume not in ("auto", "never") and same_location(path, storage.as_location(resume)):
                raise
            damaged, error = path, e
            run_on_all_ranks(env, lambda: set_aside(damaged, error, logger.warn) if env.master_process else None)
            path = choose_resume_checkpoint(ctx, cfg.run.out_dir, run.checkpoints, resume)
    return True


def resume_run(cfg: TrainConfig, ctx: Context, run: Run, path: Location) -> bool:
    """The run just built (build_run) continues from the checkpoint at path; False when there is nothing to do
    (the checkpoint is at max_steps, its final evaluations run). Every rank calls it (a collective); a problem
    any rank sees stops every rank alike. It compares the whole configuration with the checkpoint's: what a
    changed setting means."""
    env, logger, max_steps = ctx.env, ctx.logger, cfg.schedule.max_steps
    log = Path(cfg.run.out_dir) / LOG_NAME  # rank 0's: every rank gets its answer
    logged = broadcast_object(run_on_all_ranks(env, lambda: env.master_process and final_evaluations_logged(path, log)),
                              env)
    state = run_on_all_ranks(env, lambda: load_compatible_checkpoint(path, run.model.config, logged))
    if state["step"] >= max_steps:  # decided on every rank: all of them stop here, or run the final evaluations
        if state["step"] > max_steps:
            raise ConfigError(f"max_steps: {max_steps} is below step {state['step']} of {path}; "
                              f"raise max_steps to train on, or start another run in another out_dir")
        if finished(state):
            # `--seed 7` into a finished folder meant another run: say so (a moved out_dir or another log_interval
            # would not train otherwise, and is not worth the line)
            changed = changed_settings(run.config, state["config"], math_only=True)
            differ = (f"; this launch's settings differ from that run's ({changed}) but train nothing here: give a "
                      f"new run a new out_dir" if changed else "")
            logger.console(f"nothing to do: {path} is at max_steps {max_steps}; raise max_steps to train on{differ}")
            return False
        logger.console(f"{path} is at max_steps {max_steps}, but its final evaluations were not run (a stop came "
                       f"first): running them, and only them")
    check_same_optimizer(cfg.optimizer.optimizer, state["config"], path)  # another's state does not fit
    for change in load_state(run, state, path):
        logger.warn(f"since {path} was written, {change}")
    run.resumed_from, run.resumed_step = path, run.step
    if moved := moved_position(run.train_loader, state["config"], run.step + run.data_offset):
        logger.warn(f"{moved} since {path} was written")
    if run.ema is not None:
        describe_ema_start(run, state["ema_state"], cfg.ema, max_steps, path, logger.warn)
    warn_on_changed_settings(run.config, state["config"], logger.warn)
    trained_on, fingerprint = state.get("provenance", {}).get("data_fingerprint"), run.data_fingerprint
    changed = changed_shards(trained_on, fingerprint) if trained_on is not None else None
    if changed:  # the shards themselves (a mixture's weights are in its fingerprint too, but are not its shards)
        where = cfg.data.data_dir if changed == ["data_dir"] else f"source(s) {', '.join(changed)}"
        logger.warn(f"the shards in {where} changed since {path} was written (data fingerprint "
                    f"{trained_on} -> {fingerprint}): the steps after the resume read other data")
    return True


def finished(state: dict) -> bool:
    """Whether the checkpoint (its state, in this code's layout: current_layout) is of a finished run: one whose
    final evaluations, after its last step, are logged and in its figures."""
    return state["finished_at"] == state["step"]


def final_evaluations_logged(path: Location, log: Path) -> bool:
    """rank 0: whether the checkpoint at path is one of older code (it saved no finished_at) at its run's max_steps,
    whose final evaluations log (out_dir's) records: a record of each evaluation its config ran after the last step
    (val always, hellaswag and samples when their interval was set), at its step. Such code saved its last
    checkpoint after those evaluations, but a stop in the last step saved it before them, and only the log tells
    which. Reads the log only for such a checkpoint."""
    state = load_checkpoint(path)
    config, step = state.get("config") or {}, state["step"]
    if "finished_at" in state or step != config.get("max_steps") or not log.is_file():
        return False
    records = read_log(log)
    due = {"val"} | ({"hellaswag"} if config.get("hellaswag_interval") else set())
    due |= {"sample"} if config.get("sample_interval") and step > 0 else set()
    skipped = {r.get("eval") for r in records if r.get("kind") == "skip_eval"}  # could not run (no HellaSwag data)
    return due - skipped <= {r.get("kind") for r in records if r.get("step") == step}


def moved_position(loader, saved: dict, position: int) -> str | None:
    """Where one folder's train rows go on from, said in words when another total_batch_size moved it; None where
    it did not (a mixture keeps each source's position as state instead: data/mixture.py).

    One folder's position is a function of the data position: step s reads rows s*R .. (s+1)*R - 1 of its epoch,
    R = total_batch_size / seq_len rows. Resumed with another R, the run goes on from another row than the one
    the checkpoint's run had reached: the rows between are passed over, or read again, in that epoch."""
    if not isinstance(loader, TrainLoader) or saved.get("seq_len") != loader.T:
        return None  # a mixture; or other rows altogether (seq_len: the changed-settings warning says so)
    old_rows = saved.get("total_batch_size", 0) // loader.T
    if not old_rows or old_rows == loader.rows_per_step:
        return None
    if loader.stream.num_rows < old_rows:
        return None  # the checkpoint's run could not have read this folder: the shards changed (another warning)
    old_epoch, old_first = loader.step_start(position, old_rows)
    new_epoch, new_first = loader.step_start(position)
    if (old_epoch, old_first) == (new_epoch, new_first):
        return None
    if old_epoch == new_epoch:
        low, high = sorted((old_first, new_first))
        what = (f"rows {low:,}-{high - 1:,} of epoch {new_epoch} are " +
                ("never read" if new_first > old_first else "read a second time"))
    else:
        what = f"the checkpoint's run was at row {old_first:,} of epoch {old_epoch}"
    return (f"total_batch_size {old_rows * loader.T:,} -> {loader.rows_per_step * loader.T:,} moved the train "
            f"data's position: step {position} reads from row {new_first:,} of epoch {new_epoch} ({what})")


def load_compatible_checkpoint(path: Location, model_config, final_evaluations_logged: bool = False) -> dict:
    """The checkpoint's state in this code's layout (current_layout), once it has what a resume needs and fits this
    run's model shape (its tensors left on storage: every rank then reads only what it keeps).
    final_evaluations_logged: whether the run's log records its final evaluations (what says whether a checkpoint
    of older code is of a finished run: final_evaluations_logged above)."""
    state = require_entries(load_checkpoint(path), RESUME_ENTRIES, path, "resuming")
    # --resume never is no way out: it refuses a folder that holds a run
    check_compatible(state, model_config.to_dict(), path, "resume it with the model settings it was trained with "
                                                          "(in its config), or train this model from scratch in a "
                                                          "new out_dir")
    return current_layout(state, final_evaluations_logged)


def current_layout(state: dict, final_evaluations_logged: bool = False) -> dict:
    """A checkpoint's entries (load_checkpoint's) as this code's run loads them (Run.load_state_dict): the one
    conversion of what the checkpoints of older code, and a run's settings, left out or kept elsewhere.
    - long_run (format_version 3 and before): its spike window, skips in a row, rollbacks and data offset, each
      an entry (none in older checkpoints: none of them);
    - finished_at, which older code did not save: finished at its config's max_steps once its run's log records
      the final evaluations (final_evaluations_logged); that code saved the last checkpoint of a run stopped in
      its last step before them, and the relaunch must run them;
    - mixture, which one folder's run, and older code, keep none of: where its config puts each source
      (data/mixture.py's derived_state), so that a mixture goes on from the rows they had read;
    - ema_state: older code kept none before the average started: its config's start. A run without an EMA
      keeps none: decay 0, at this step (an EMA turned on now starts no earlier: WeightAverage.load_state_dict);
    - format_version 1: no lineage (a run id of its own, no ancestry), and what else it lacks: none."""
    state, config = dict(state), state.get("config") or {}
    long_run = state.pop("long_run", None) or {}
    state.setdefault("spike_window", long_run.get("spike_window"))
    for key in ("skips_in_a_row", "rollbacks", "data_offset"):
        state.setdefault(key, long_run.get(key, 0))
    finished = final_evaluations_logged and state["step"] == config.get("max_steps")
    state.setdefault("finished_at", state["step"] if finished else None)
    if state.get("mixture") is None:
        state["mixture"] = derived_state(config, state["step"], state["step"] + state["data_offset"])
    if state.get("ema_state") is None:
        decay = config.get("ema_decay") or 0.0
        averaging = EMASettings(ema_decay=decay, ema_start=config.get("ema_start", 0.0))
        state["ema_state"] = {"decay": decay, "start_step": averaging.start_step(config["max_steps"]) if decay
                              else state["step"], "updates": 0}
    none = {"run_id": uuid.uuid4().hex, "ancestry": [], "checkpoint_id": None, "metrics": {}, "wandb_run_id": None}
    return {**none, **state}


def load_state(run: Run, state: dict, path: Location) -> list[str]:
    """Continue from the checkpoint at path (its state: load_compatible_checkpoint's, on every rank) through the run's
    parts (Run.parts). A collective: every rank first checks that the checkpoint fits its parts (the format's
    check_fits: a DamagedCheckpointError, while nothing is loaded), then loads its part, in the checkpoint's format;
    a failure any rank sees in either (a tensor only it cannot read) stops every rank alike, with its message.
    What a part says changed since (a mixture's rows per step), in words. The lineage goes on: the checkpoint's id
    joins the ancestry."""
    env, fmt = run.strategy.env, format_of(path)
    run_on_all_ranks(env, lambda: fmt.check_fits(run, path, state))
    changes = run_on_all_ranks(env, lambda: fmt.load_into(run, path, state))
    run.start_step = run.step
    run.ancestry.append(state["checkpoint_id"])
    return changes


# --- what a changed setting means -------------------------------------------------------------------

def check_same_optimizer(optimizer: str, saved_config: dict, path) -> None:
    """A checkpoint resumes only with the optimizer it was written with (optimizer: this run's): its state
    (AdamW moments, or Muon momentum buffers) does not fit another. Checkpoints from before the key were adamw's."""
    saved = saved_config.get("optimizer", "adamw")
    if saved != optimizer:
        raise CheckpointError(f"optimizer: {path} was written with optimizer {saved}, this run uses "
                              f"{optimizer}: its optimizer state does not fit; resume with --optimizer {saved}, "
                              f"or start from its weights with --init_from {path} in another out_dir")


def changed_keys(now: dict, saved: dict) -> list[str]:
    """The keys whose value differs from the checkpoint's config (saved; now: this launch's, flat, run.config), but
    `resume`, which names the launch."""
    return [key for key in now if key != "resume" and key in saved and saved[key] != now[key]]


def changed_settings(now: dict, saved: dict, math_only: bool = False) -> str:
    """The changed keys (changed_keys; math_only: those that change the training math) in words, each with both
    values: `seed 1337 -> 7, ...`; '' where none."""
    keys = [key for key in changed_keys(now, saved) if not math_only or changes_training_math(ON_RESUME_OF[key], now)]
    return ", ".join(f"{key} {saved[key]!r} -> {now[key]!r}" for key in keys)


def warn_on_changed_settings(now: dict, saved: dict, warn: Callable[[str], None]) -> None:
    """One line naming every key that differs from the checkpoint's config (not `resume`), and those of them
    that change the training math (each field's on_resume, judged with this run's settings): a changed
    log_interval, out_dir or strategy is worth a line, but not the claim that the run now trains differently,
    nor is a spike setting while spike_skip is off."""
    keys = changed_keys(now, saved)
    if not keys:
        return
    changed = changed_settings(now, saved)
    if math := [key for key in keys if changes_training_math(ON_RESUME_OF[key], now)]:
        effect = (f"{', '.join(math)} {'changes' if len(math) == 1 else 'change'} the training math: the steps "
                  f"after the resume differ from an uninterrupted run")
    else:
        effect = "none of them changes the training math"
    warn(f"resuming with settings that differ from the checkpoint's: {changed} "
         f"(this run uses the new values; {effect})")


def describe_ema_start(run: Run, saved: dict, averaging: EMASettings, max_steps: int, path: Location,
                       warn: Callable[[str], None]) -> None:
    """Say where a resumed run's EMA starts when it is not where this config would start a fresh one.

    saved: the checkpoint's ema_state (current_layout's: decay 0 where its run kept no EMA); averaging: this run's
    ema section, whose start would be floor(ema_start * max_steps) (max_steps: the schedule section's). A kept
    start is state and goes on (a raised max_steps must not freeze the average until a later start, and then
    fold on from the stale one)."""
    planned, kept = averaging.start_step(max_steps), saved["start_step"]
    if not saved["decay"]:
        if run.ema.start_step != planned:  # the checkpoint's step: the first update this run makes
            warn(f"{path} holds no EMA of the weights (it was trained with ema_decay 0): the EMA starts from the "
                 f"weights of step {run.ema.start_step}, not of step {planned}")
        return
    if kept == planned:
        return
    now = f"ema_start {averaging.ema_start} of max_steps {max_steps} would start a fresh run's at step {planned}"
    if run.ema.ready:
        warn(f"the EMA of the weights started at step {kept} and averages on from there ({now})")
    elif kept < max_steps:
        warn(f"the EMA of the weights starts at step {kept}, as the run of {path} set it ({now})")
    else:
        warn(f"the EMA of the weights starts at step {kept}, as the run of {path} set it, at or after max_steps "
             f"{max_steps}: this run ends without one ({now})")


# --- a rollback ------------------------------------------------------------------------------------------

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


def roll_back(ctx: Context, run: Run, request: RollbackRequested, folder: Location, max_rollbacks: int) -> None:
    """Continue from the newest checkpoint, past the batches since it. Every rank calls it (collective).

    The run's state becomes the checkpoint's (weights, optimizer, step, spike window) except
    the rollback count, and data_offset moves so that the checkpoint's step trains on the data
    after the batch that failed: the batches from the checkpoint to the failure are passed
    over, and the rollback record says which. So the data position stays a function of the
    state, and a run resumed later goes where this one goes. The log drops the records of the
    steps that will be redone, as a resume does. A save in flight must have been waited for.
    folder: the run's checkpoint folder; max_rollbacks: the long_run section's.
    """
    env, logger = ctx.env, ctx.logger
    stop = f"step {request.step}: {request.reason}"
    if run.rollbacks >= max_rollbacks:
        raise DivergedError(f"{stop}; rolled back {run.rollbacks} time(s) already (max_rollbacks {max_rollbacks}): "
                            f"stopping; the newest checkpoint in {folder} is the last good state")

    path = choose_rollback_checkpoint(folder, run.resumed_from, run.resumed_step, env, logger.warn)
    if path is None:
        raise DivergedError(f"{stop}; there is no checkpoint in {folder} to roll back to: stopping")
    state = run_on_all_ranks(env, lambda: load_compatible_checkpoint(path, run.model.config))
    failed_batch, rollbacks = request.step + run.data_offset, run.rollbacks + 1
    run.optimizer.zero_grad(set_to_none=True)  # a non-finite step left its gradients
    load_state(run, state, path)
    passed_over = [run.step + run.data_offset, failed_batch]  # data positions, first and last
    run.data_offset = failed_batch + 1 - run.step
    run.rollbacks = rollbacks
    run.skips_in_a_row = 0  # the batches of those skips are passed over
    logger.rewind(run.step)
    logger.log({"kind": "rollback", "step": run.step, "tokens": run.tokens_seen, "from_step": request.step,
                "reason": request.reason, "skipped_batches": passed_over})
    logger.warn(f"{stop}; rolled back to {path} (step {run.step}) and passing over the batches of data positions "
                f"{passed_over[0]}-{passed_over[1]} (rollback {rollbacks} of at most {max_rollbacks})")
