"""A training run's state, built at launch (fresh, or from the checkpoint it resumes) and saved.

`build_run` opens the data, builds the model and optimizer, and restores the checkpoint that
`resume` picks; `save_run` writes that state back as a checkpoint. A checkpoint `step_s` holds
the state after s updates; the data position needs nothing but the step (data/loader.py), and
dropout masks are reseeded from (seed, step, rank) every step, so no RNG state is saved.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from data.loader import TrainLoader, ValLoader, validate_shards
from data.manifest import data_fingerprint
from errors import CheckpointError, ConfigError
from model import GPT
from training.checkpoint import (FORMAT_VERSION, RESUME_ENTRIES, check_compatible, checkpoint_path,
                                 find_resume_checkpoint, list_checkpoints, load_checkpoint, prune_checkpoints,
                                 require_entries, save_checkpoint)
from training.config import TrainConfig
from training.distributed import DistEnv, broadcast_object, run_on_all_ranks
from training.parallel import Strategy
from training.run_folder import check_one_history
from training.run_logger import LOG_NAME, RunLogger
from training.runtime import Runtime
from training.weights import load_initial_weights


@dataclass
class Run:
    """What one process holds between steps. `model` is the unwrapped, uncompiled module:
    checkpoints, evaluation and sampling use it; the training forward goes through its
    compiled / DDP wrapper."""

    model: GPT
    optimizer: torch.optim.Optimizer
    strategy: Strategy  # how model and optimizer are spread over the ranks
    scaler: torch.amp.GradScaler  # float16's loss scale (a no-op in every other dtype)
    train_loader: TrainLoader
    val_loader: ValLoader
    grad_accum_steps: int
    start_step: int  # where this launch began: 0, or the step of the checkpoint it resumed
    step: int  # optimizer updates applied so far
    tokens_seen: int
    lineage: dict  # run_id and ancestry, see training/checkpoint.py
    data_fingerprint: str  # of the shards in data_dir, see data/manifest.py
    resumed_from: Path | None = None
    wandb_run_id: str | None = None
    metrics: dict = field(default_factory=dict)  # the latest val / HellaSwag figures, saved with checkpoints


def build_run(cfg: TrainConfig, env: DistEnv, runtime: Runtime, strategy: Strategy, logger: RunLogger) -> Run | None:
    """The run this launch continues or starts; None when its checkpoint already reached max_steps.

    Every rank calls this. Rank 0 picks the checkpoint, every rank loads that same file; a
    problem any rank sees (a data folder one node lacks, an unreadable file) stops every rank
    with the same error.
    """
    grad_accum_steps = cfg.grad_accum_steps(env.world_size)  # a ConfigError when the batch does not divide
    resume_path = choose_resume_checkpoint(cfg, env, logger)

    def open_data() -> tuple[TrainLoader, ValLoader, str]:
        train_loader = TrainLoader(cfg.data_dir, cfg.seq_len, cfg.micro_batch_size, cfg.total_batch_size,
                                   env.rank, env.world_size, cfg.seed)
        val_loader = ValLoader(cfg.data_dir, cfg.seq_len, cfg.val_tokens, cfg.micro_batch_size,
                               env.rank, env.world_size)
        # every rank checks the headers, and the token ranges of its share of the shards
        validate_shards(train_loader.paths + val_loader.paths, cfg.vocab_size, env.rank, env.world_size)
        return train_loader, val_loader, data_fingerprint(cfg.data_dir)

    train_loader, val_loader, fingerprint = run_on_all_ranks(env, open_data)

    torch.manual_seed(cfg.seed)  # the same initial weights on every rank (the same as one process's)
    model = GPT(cfg.model_config())
    load_initial_weights(model, cfg.init_from)
    strategy.shard(model)  # under FSDP: before the optimizer, which must hold the sharded parameters
    model.to(runtime.device, dtype=runtime.weights_dtype)
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.max_lr, (cfg.beta1, cfg.beta2), cfg.adam_eps,
                                           runtime.device_type)
    scaler = torch.amp.GradScaler(runtime.device_type, enabled=runtime.loss_scaling)
    run = Run(model=model, optimizer=optimizer, strategy=strategy, scaler=scaler, train_loader=train_loader,
              val_loader=val_loader,
              grad_accum_steps=grad_accum_steps, start_step=0, step=0, tokens_seen=0,
              lineage={"run_id": uuid.uuid4().hex, "ancestry": []}, data_fingerprint=fingerprint)
    if resume_path is None:
        return run

    state = run_on_all_ranks(env, lambda: load_compatible_checkpoint(resume_path, cfg.model_config()))
    if state["step"] >= cfg.max_steps:  # decided on every rank: all of them stop here
        if state["step"] > cfg.max_steps:
            raise ConfigError(f"max_steps: {cfg.max_steps} is below step {state['step']} of {resume_path}; "
                              f"raise max_steps to train on, or start another run in another out_dir")
        logger.console(f"nothing to do: {resume_path} is at max_steps {cfg.max_steps}; raise max_steps to train on")
        return None
    strategy.load_state(model, optimizer, state["model"], with_current_settings(state["optimizer"], optimizer))
    if scaler.is_enabled() and state.get("scaler"):  # the loss scale goes on where it was: exact resume
        scaler.load_state_dict(state["scaler"])
    run.start_step = run.step = state["step"]
    run.tokens_seen = state["tokens_seen"]
    run.resumed_from = resume_path
    run.wandb_run_id = state.get("wandb_run_id")
    run.metrics = dict(state.get("metrics", {}))
    run.lineage = {"run_id": state.get("run_id") or run.lineage["run_id"],
                   "ancestry": [*state.get("ancestry", []), state.get("checkpoint_id")]}
    warn_on_changed_settings(cfg, state["config"], logger)
    trained_on = state.get("provenance", {}).get("data_fingerprint")
    if trained_on is not None and trained_on != fingerprint:
        logger.warn(f"the shards in {cfg.data_dir} changed since {resume_path} was written (data fingerprint "
                    f"{trained_on} -> {fingerprint}): the steps after the resume read other data")
    return run


def choose_resume_checkpoint(cfg: TrainConfig, env: DistEnv, logger: RunLogger) -> Path | None:
    """Rank 0 resolves `resume` (scanning out_dir); every rank gets its answer, or its error."""
    def resolve() -> Path | None:
        if not env.master_process:
            return None
        if cfg.resume == "never":
            refuse_used_out_dir(Path(cfg.out_dir))
        found = find_resume_checkpoint(cfg.out_dir, cfg.resume, warn=logger.warn)
        check_one_history(cfg.out_dir, None if found is None else found[:2])
        if found is None:
            return None
        path, _, how = found
        logger.console(f"resuming from {path} ({how})")
        return path

    return broadcast_object(run_on_all_ranks(env, resolve), env)


def refuse_used_out_dir(out_dir: Path) -> None:
    """A fresh start must not mix with the run already in out_dir (its checkpoints and log)."""
    used = [p for p in (out_dir / LOG_NAME, *(p for _, p in list_checkpoints(out_dir))) if p.exists()]
    if used:
        raise ConfigError(f"resume: {out_dir} already holds a run ({', '.join(p.name for p in used[-2:])}); "
                          f"continue it with --resume auto, or give this run another out_dir")


def load_compatible_checkpoint(path: Path, model_config) -> dict:
    """The checkpoint's state, its tensors memory-mapped: every rank pages in only what it copies."""
    state = require_entries(load_checkpoint(path), RESUME_ENTRIES, path, "resuming")
    check_compatible(state, model_config.to_dict(), path)
    return state


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


def warn_on_changed_settings(cfg: TrainConfig, saved: dict, logger: RunLogger) -> None:
    """One line naming every key that differs from the checkpoint's config (not `resume`)."""
    now = cfg.to_dict()
    changed = [f"{key} {saved[key]!r} -> {now[key]!r}" for key in now
               if key != "resume" and key in saved and saved[key] != now[key]]
    if changed:
        logger.warn(f"resuming with settings that differ from the checkpoint's: {', '.join(changed)} "
                    f"(this run uses the new values; the steps after the resume differ from an uninterrupted run)")


def save_run(run: Run, cfg: TrainConfig, env: DistEnv, logger: RunLogger, provenance: dict) -> None:
    """Checkpoint `step_{run.step}`: rank 0 writes, every rank learns whether that worked. Collective."""
    model_state, optimizer_state = run.strategy.full_state(run.model, run.optimizer)  # gathered under FSDP

    def write() -> None:
        if not env.master_process:
            return
        logger.check()  # a log that could not be written stops the run before anything else
        path = checkpoint_path(cfg.out_dir, run.step)
        state = checkpoint_state(run, cfg, model_state, optimizer_state, logger.wandb_run_id, provenance)
        save_checkpoint(state, path)
        prune_checkpoints(cfg.out_dir, cfg.keep_last, written_step=run.step, warn=logger.warn)
        logger.console(f"saved checkpoint {path}")

    run_on_all_ranks(env, write)


def checkpoint_state(run: Run, cfg: TrainConfig, model_state: dict, optimizer_state: dict,
                     wandb_run_id: str | None, provenance: dict) -> dict:
    """Tensors and plain Python values only, so the file loads with torch.load(weights_only=True)."""
    return {
        "model": model_state,
        "optimizer": optimizer_state,
        "scaler": run.scaler.state_dict(),  # {} unless float16
        "step": run.step,
        "tokens_seen": run.tokens_seen,
        "config": cfg.to_dict(),
        "model_args": run.model.config.to_dict(),
        "wandb_run_id": wandb_run_id,
        "metrics": dict(run.metrics),
        "provenance": provenance,
        **run.lineage,
        "checkpoint_id": uuid.uuid4().hex,
        "format_version": FORMAT_VERSION,
    }
