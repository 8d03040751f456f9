"""A training run: built at launch (fresh, or from the checkpoint it resumes), its state in one place.

`build_run` opens the data, builds the model and optimizer, and restores the checkpoint that
training/checkpoint/resume.py picks (`Run.load_state_dict`); training/checkpoint/checkpointer.py writes the run back
as a checkpoint. A checkpoint `step_s` holds the state after s updates.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from data.loader import TrainLoader, ValLoader, validate_shards
from data.mixture import (MixtureLoader, changed_shards, derived_state, make_train_loader, parse_val_sets,
                          sources_fingerprint)
from common.errors import CheckpointError, ConfigError, DivergedError
from model import GPT
from training.checkpoint.folder import checkpoints_folder, format_of
from training.core.storage import Location
from training.train.config import TrainConfig
from training.core.process_group import run_on_all_ranks
from training.optim.optimizers import build_optimizer, check_same_optimizer
from training.distributed.strategies import Strategy, full_tensors
from training.checkpoint.resume import choose_resume_checkpoint, choose_rollback_checkpoint, load_compatible_checkpoint
from training.core.context import Context
from training.train.micro_batch import choose_micro_batch_size
from training.optim.ema import EMASettings, WeightAverage, checkpointed_start
from training.optim.spikes import RollbackRequested, SpikeWindow
from training.train.weights import load_initial_weights


@dataclass
class Run:
    """What one process holds between steps. `model` is the unwrapped, uncompiled module:
    checkpoints, evaluation and sampling use it; the training forward goes through its
    compiled / DDP wrapper.

    Its state, what a checkpoint holds, is `state_dict()` and goes back with `load_state_dict()`:
    the model, the optimizer, float16's loss scale, the step, the tokens seen, the lineage, the
    latest evaluation figures, the W&B run id, and what steers a long run (the spike window,
    skips in a row, rollbacks and the batches they passed over).
    Nothing else is needed to resume exactly: the data position is a function of the step and
    data_offset (data/loader.py), and of where each source of a mixture stood (its `mixture`
    entry, data/mixture.py), and dropout masks are reseeded from (seed, step, rank) every step.
    """

    model: GPT
    optimizer: torch.optim.Optimizer
    strategy: Strategy  # how model and optimizer are spread over the ranks
    scaler: torch.amp.GradScaler  # float16's loss scale (a no-op in every other dtype)
    # one folder, or several mixed by weight (data/mixture.py); None: a run without data, whose checkpoints
    # scripts/bench_checkpoint.py times
    train_loader: TrainLoader | MixtureLoader | None
    val_loaders: dict[str, ValLoader]  # the val sets by name (one, `val`, by default)
    grad_accum_steps: int
    data_fingerprint: str  # of the shards in data_dir (each source's, for a mixture): data/mixture.py
    # --- the state (state_dict / load_state_dict)
    step: int = 0  # optimizer updates applied so far
    tokens_seen: int = 0
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # drawn by a fresh start, kept by resumes
    ancestry: list[str] = field(default_factory=list)  # checkpoint_ids this run resumed from, oldest first
    metrics: dict = field(default_factory=dict)  # the latest val / HellaSwag figures
    wandb_run_id: str | None = None  # set on rank 0 when W&B starts (a resume continues that W&B run)
    spikes: SpikeWindow | None = None  # with spike_skip: the recent steps a spike is judged against
    ema: WeightAverage | None = None  # with ema_decay: the average of the weights (training/optim/ema.py)
    skips_in_a_row: int = 0  # spikes skipped since the last applied update
    rollbacks: int = 0  # rollbacks so far in this run (max_rollbacks bounds them)
    data_offset: int = 0  # batches passed over by rollbacks: step s trains on the data of step s + data_offset
    # --- this launch
    start_step: int = 0  # where this launch began: 0, or the step of the checkpoint it resumed
    resumed_from: Location | None = None  # the checkpoint it resumed (a rollback candidate, wherever it lies)
    resumed_step: int = 0  # and its step
    micro_batch: dict | None = None  # micro_batch_size auto: how this launch chose it (run.json)

    @property
    def val_loader(self) -> ValLoader:
        """The first val set: the one the val loss of the console and the checkpoints' metrics is."""
        return next(iter(self.val_loaders.values()))

    def state_dict(self) -> dict:
        """Tensors and plain Python values only (loads with torch.load(weights_only=True)).

        A collective: under FSDP the model and optimizer are gathered onto rank 0's CPU (the
        other ranks get empty dicts for them); the optimizer's state is keyed by parameter name.
        The file format writes it; the sharded format saves the same entries: the model and
        optimizer through DCP, each rank its part, and `progress_state()` beside them.
        """
        model_state, optimizer_state = self.strategy.full_state(self.model, self.optimizer)
        extra = {entry: full_tensors(tensors, self.strategy.env.master_process)
                 for entry, tensors in self.extra_tensors().items()}  # gathered like the model
        return {"model": model_state, "optimizer": optimizer_state, **extra, **self.progress_state()}

    def extra_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """The tensor entries beside the model and optimizer, each keyed by parameter name and laid out like
        the parameters (this rank's shards under FSDP): the EMA of the weights, once it has started."""
        return {"ema": self.ema.average} if self.ema is not None and self.ema.ready else {}

    def progress_state(self) -> dict:
        """The state beside the model and optimizer: plain Python values, the same on every rank."""
        return {
            "scaler": self.scaler.state_dict(),  # {} unless float16
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "run_id": self.run_id,
            "ancestry": list(self.ancestry),
            "metrics": dict(self.metrics),
            "wandb_run_id": self.wandb_run_id,
            "ema_state": self.ema.progress_state() if self.ema is not None else None,  # its start, before it too
            # a mixture: each source's rows read and tokens given (None: one folder)
            "mixture": (self.train_loader.state_dict(self.step, self.step + self.data_offset)
                        if self.train_loader is not None else None),
            "long_run": {"spike_window": self.spikes.state_dict() if self.spikes else None,
                         "skips_in_a_row": self.skips_in_a_row, "rollbacks": self.rollbacks,
                         "data_offset": self.data_offset},
        }

    def load_state_dict(self, state: dict, path: Location) -> str | None:
        """Continue from the checkpoint at path (its state: load_checkpoint's, on every rank), with this
        run's optimizer settings. A collective: every rank loads its part, in the checkpoint's format.
        Returns what changed in a mixture's composition since (its rows per step), in words, or None.

        The saved optimizer state keeps its moments and step counts; its settings (lr, betas, eps,
        weight decay, kernel choice) become this run's, so a resume with changed settings trains
        with what config.yaml says. The lineage goes on: the same run_id, and the checkpoint's own
        id appended to the ancestry.
        """
        fmt = format_of(path)
        if self.ema is not None:  # the checkpoint's average is loaded into tensors laid out like the weights
            self.ema.reset()
            if fmt.holds(state, "ema"):
                self.ema.allocate(self.model)
        fmt.load_into(self, path, state, lambda saved: with_current_settings(saved, self.optimizer))
        if self.ema is not None:  # the start the checkpoint's run set goes on (none: this run's own, set at build)
            start = checkpointed_start(state)
            self.ema.load_progress_state(self.ema.start_step if start is None else start, state.get("ema_state"))
        if self.scaler.is_enabled() and state.get("scaler"):  # the loss scale goes on where it was
            self.scaler.load_state_dict(state["scaler"])
        self.step = self.start_step = state["step"]
        self.tokens_seen = state["tokens_seen"]
        self.run_id = state.get("run_id") or self.run_id
        self.ancestry = [*state.get("ancestry", []), state.get("checkpoint_id")]
        self.metrics = dict(state.get("metrics", {}))
        self.wandb_run_id = state.get("wandb_run_id")
        long_run = state.get("long_run") or {}  # older checkpoints: no skips, no rollbacks
        if self.spikes is not None and long_run.get("spike_window"):
            self.spikes.load_state_dict(long_run["spike_window"])
        self.skips_in_a_row = long_run.get("skips_in_a_row", 0)
        self.rollbacks = long_run.get("rollbacks", 0)
        self.data_offset = long_run.get("data_offset", 0)
        if isinstance(self.train_loader, MixtureLoader):  # each source from where it stood (older checkpoints:
            # where the checkpoint's own config put it)
            position = self.step + self.data_offset
            saved = state.get("mixture") or derived_state(state.get("config") or {}, self.step, position)
            if saved is not None:
                return self.train_loader.load_state_dict(saved)
        return None


def build_run(cfg: TrainConfig, ctx: Context, strategy: Strategy) -> Run | None:
    """The run this launch continues or starts; None when its checkpoint already reached max_steps.

    Every rank calls this. Rank 0 picks the checkpoint, every rank loads that same file; a
    problem any rank sees (a data folder one node lacks, an unreadable file) stops every rank
    with the same error. It reads keys of many sections (data, model, optimizer, schedule, ema,
    long_run, checkpoint's resume, evaluation's val sets, runtime's seed): building the run is
    where they meet, so it is handed the whole configuration.
    """
    env, runtime, logger = ctx.env, ctx.runtime, ctx.logger
    data, seed = cfg.data, cfg.runtime.seed
    micro_batch = None
    if data.micro_batch_size is None:  # auto: probed now, and the concrete B is what every part of the run reads
        data.micro_batch_size, micro_batch = choose_micro_batch_size(ctx, strategy, data, cfg.model.model_config())
    grad_accum_steps = data.grad_accum_steps(strategy.dp_size)  # a ConfigError when the batch does not divide
    folder = checkpoints_folder(cfg.run.out_dir, cfg.checkpoint.checkpoint_dir)
    resume_path = choose_resume_checkpoint(ctx, cfg.run.out_dir, folder, cfg.checkpoint.resume)

    def open_data() -> tuple[TrainLoader | MixtureLoader, dict[str, ValLoader], str]:
        # each data-parallel replica reads its share of every batch (the strategy's dp view)
        train_loader = make_train_loader(data.data_dir, data.seq_len, data.micro_batch_size, data.total_batch_size,
                                         strategy.dp_rank, strategy.dp_size, seed, shuffle=data.shuffle,
                                         doc_aligned=data.doc_aligned)
        val_sets, val_tokens = cfg.evaluation.val_sets, cfg.evaluation.val_tokens
        val_loaders = {name: ValLoader(path, data.seq_len, val_tokens, data.micro_batch_size, strategy.dp_rank,
                                       strategy.dp_size, key="val_sets" if val_sets else "data_dir")
                       for name, path in parse_val_sets(val_sets, data.data_dir).items()}
        # every rank checks the headers, and the token ranges of its share of the shards: a split of
        # the work over the processes (env), not of the data over the replicas
        val_paths = [p for loader in val_loaders.values() for p in loader.paths]
        validate_shards(train_loader.paths + val_paths, cfg.model.vocab_size, env.rank, env.world_size)
        return train_loader, val_loaders, sources_fingerprint(data.data_dir)

    train_loader, val_loaders, fingerprint = run_on_all_ranks(env, open_data)

    torch.manual_seed(seed)  # the same initial weights on every rank (the same as one process's)
    model = GPT(cfg.model.model_config())
    load_initial_weights(model, cfg.model.init_from)
    strategy.shard(model)  # under FSDP: before the optimizer, which must hold the sharded parameters
    model.to(runtime.device, dtype=runtime.weights_dtype)
    # AdamW (configure_optimizers), or Muon + AdamW: the optimizer section, and the schedule's peak lr
    optimizer = build_optimizer(model, cfg.optimizer, cfg.schedule.max_lr, runtime.device_type)
    scaler = torch.amp.GradScaler(runtime.device_type, enabled=runtime.loss_scaling)
    long_run = cfg.long_run
    spikes = SpikeWindow(long_run.spike_window, long_run.spike_threshold, runtime.device, runtime.weights_dtype) \
        if long_run.spike_skip else None
    averaging, max_steps = cfg.ema, cfg.schedule.max_steps
    ema = WeightAverage(averaging.ema_decay, averaging.start_step(max_steps)) if averaging.ema_decay else None
    run = Run(model=model, optimizer=optimizer, strategy=strategy, scaler=scaler, train_loader=train_loader,
              val_loaders=val_loaders, grad_accum_steps=grad_accum_steps, data_fingerprint=fingerprint, spikes=spikes,
              micro_batch=micro_batch, ema=ema)
    if resume_path is None:
        return run

    state = run_on_all_ranks(env, lambda: load_compatible_checkpoint(resume_path, model.config))
    if state["step"] >= max_steps:  # decided on every rank: all of them stop here
        if state["step"] > max_steps:
            raise ConfigError(f"max_steps: {max_steps} is below step {state['step']} of {resume_path}; "
                              f"raise max_steps to train on, or start another run in another out_dir")
        logger.console(f"nothing to do: {resume_path} is at max_steps {max_steps}; raise max_steps to train on")
        return None
    check_same_optimizer(cfg.optimizer.optimizer, state["config"], resume_path)  # another's state does not fit
    composition = run.load_state_dict(state, resume_path)
    run.resumed_from, run.resumed_step = resume_path, run.step
    if composition:
        logger.warn(f"the mixture's composition changed since {resume_path} was written: {composition}")
    if run.ema is not None:
        describe_ema_start(run, checkpointed_start(state), averaging, max_steps, resume_path, logger.warn)
    warn_on_changed_settings(cfg, state["config"], logger.warn)
    trained_on = state.get("provenance", {}).get("data_fingerprint")
    changed = changed_shards(trained_on, fingerprint) if trained_on is not None else None
    if changed:  # the shards themselves (a mixture's weights are in its fingerprint too, but are not its shards)
        where = data.data_dir if changed == ["data_dir"] else f"source(s) {', '.join(changed)}"
        logger.warn(f"the shards in {where} changed since {resume_path} was written (data fingerprint "
                    f"{trained_on} -> {fingerprint}): the steps after the resume read other data")
    return run


def describe_ema_start(run: Run, kept: int | None, averaging: EMASettings, max_steps: int, path: Location,
                       warn: Callable[[str], None]) -> None:
    """Say where a resumed run's EMA starts when it is not where this config would start a fresh one.

    kept: the start of the EMA the checkpoint's run kept (None: it had none); averaging: this run's ema
    section, whose start would be floor(ema_start * max_steps) (max_steps: the schedule section's). A kept
    start is state and goes on (a raised max_steps must not freeze the average until a later start, and then
    fold on from the stale one)."""
    planned = averaging.start_step(max_steps)
    if kept is None:
        if run.step > planned:
            warn(f"{path} holds no EMA of the weights (it was trained with ema_decay 0): the EMA starts from the "
                 f"weights of step {run.step}, not of step {planned}")
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
    run.load_state_dict(state, path)
    passed_over = [run.step + run.data_offset, failed_batch]  # data positions, first and last
    run.data_offset = failed_batch + 1 - run.step
    run.rollbacks = rollbacks
    run.skips_in_a_row = 0  # the batches of those skips are passed over
    logger.rewind(run.step)
    logger.log({"kind": "rollback", "step": run.step, "tokens": run.tokens_seen, "from_step": request.step,
                "reason": request.reason, "skipped_batches": passed_over})
    logger.warn(f"{stop}; rolled back to {path} (step {run.step}) and passing over the batches of data positions "
                f"{passed_over[0]}-{passed_over[1]} (rollback {rollbacks} of at most {max_rollbacks})")


def with_current_settings(saved: dict, optimizer: torch.optim.Optimizer) -> dict:
    """The saved optimizer state (AdamW moments, step counts) with every setting of this run.

    The saved groups carry the old run's lr, betas, eps, weight decay and kernel choice (fused
    on CUDA or not); this run's values replace them, so a resume with changed settings trains
    with what config.yaml says (weight decay stays on the decay group only).
    """
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved['param_groups'])} parameter groups, "
                              f"this run's {len(optimizer.param_groups)}")
    groups = [{**group, **{k: v for k, v in current.items() if k != "params"}}
              for group, current in zip(saved["param_groups"], optimizer.param_groups)]
    return {**saved, "param_groups": groups}


def warn_on_changed_settings(cfg: TrainConfig, saved: dict, warn: Callable[[str], None]) -> None:
    """One line naming every key that differs from the checkpoint's config (not `resume`), and those of them
    that change the training math (TrainConfig.changes_training_math): a changed log_interval, out_dir or
    strategy is worth a line, but not the claim that the run now trains differently."""
    now = cfg.to_dict()
    keys = [key for key in now if key != "resume" and key in saved and saved[key] != now[key]]
    if not keys:
        return
    changed = ", ".join(f"{key} {saved[key]!r} -> {now[key]!r}" for key in keys)
    math = [key for key in keys if cfg.changes_training_math(key)]
    if math:
        effect = (f"{', '.join(math)} {'changes' if len(math) == 1 else 'change'} the training math: the steps "
                  f"after the resume differ from an uninterrupted run")
    else:
        effect = "none of them changes the training math"
    warn(f"resuming with settings that differ from the checkpoint's: {changed} "
         f"(this run uses the new values; {effect})")
