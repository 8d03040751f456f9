"""Building the run a launch trains: the data, the model and the optimizer, fresh or continued from a checkpoint
(launch/resume.py)."""

from __future__ import annotations

import torch

from data.loader import TrainLoader, ValLoader, validate_shards
from data.mixture import MixtureLoader, make_train_loader, sources_fingerprint
from data.settings import grad_accum_steps as accumulation, parse_sources, parse_val_sets
from model import GPT
from runtime.storage import Location
from runtime.context import Context
from runtime.process_group import run_on_all_ranks
from training.distributed.strategies import Strategy
from training.optim.ema import WeightAverage
from training.optim.optimizers import build_optimizer
from training.optim.spikes import SpikeWindow
from launch.config import TrainConfig
from launch.micro_batch import choose_micro_batch_size
from launch.resume import choose_resume_checkpoint, continue_run
from training.run.run import Run
from launch.weights import load_initial_weights


def build_run(cfg: TrainConfig, ctx: Context, strategy: Strategy, checkpoints: Location) -> Run | None:
    """The run this launch continues or starts; None when its checkpoint already reached max_steps and ran its
    final evaluations (one that a stop saved before them is continued: the loop runs them, and only them).

    Every rank calls this. Rank 0 picks the checkpoint, every rank loads that same file; a
    problem any rank sees (a data folder one node lacks, an unreadable file) stops every rank
    with the same error. It reads keys of many sections (data, model, optimizer, schedule, ema,
    long_run, checkpoint's resume, evaluation's val sets, runtime's seed): building the run is
    where they meet, so it is handed the whole configuration. checkpoints: the run's checkpoint folder.
    """
    env, runtime = ctx.env, ctx.runtime
    data, seed = cfg.data, cfg.runtime.seed
    parse_sources(data.data_dir)  # a source's tokens_<name> against every train record field, all declared by now
    micro_batch_size, micro_batch = data.micro_batch_size, None
    if micro_batch_size is None:  # auto: probed now; the run holds the B (cfg, validated, is never written to)
        micro_batch_size, micro_batch = choose_micro_batch_size(ctx, strategy, data, cfg.model.model_config())
    # a ConfigError when the batch does not divide
    grad_accum_steps = accumulation(data.total_batch_size, data.seq_len, micro_batch_size, strategy.dp_size)
    strategy.check_accumulation(grad_accum_steps)
    resume_path = choose_resume_checkpoint(ctx, cfg.run.out_dir, checkpoints, cfg.checkpoint.resume)

    def open_data() -> tuple[TrainLoader | MixtureLoader, dict[str, ValLoader], str]:
        # each data-parallel replica reads its share of every batch (the strategy's dp view)
        train_loader = make_train_loader(data.data_dir, data.seq_len, micro_batch_size, data.total_batch_size,
                                         strategy.dp_rank, strategy.dp_size, seed, shuffle=data.shuffle,
                                         doc_aligned=data.doc_aligned)
        val_sets, val_tokens = cfg.evaluation.val_sets, cfg.evaluation.val_tokens
        val_loaders = {name: ValLoader(path, data.seq_len, val_tokens, micro_batch_size, strategy.dp_rank,
                                       strategy.dp_size, key="val_sets" if val_sets else "data_dir")
                       for name, path in parse_val_sets(val_sets, data.data_dir).items()}
        # every rank checks the headers, and the token ranges of its share of the shards: a split of
        # the work over the processes (env), not of the data over the replicas
        val_paths = [p for loader in val_loaders.values() for p in loader.paths]
        validate_shards(train_loader.paths + val_paths, cfg.model.vocab_size, env.rank, env.world_size)
        return train_loader, val_loaders, sources_fingerprint(data.data_dir)

    train_loader, val_loaders, fingerprint = run_on_all_ranks(env, open_data)

    def initial_model() -> GPT:  # every rank reads init_from itself: a file one of them cannot read stops them all
        torch.manual_seed(seed)  # the same initial weights on every rank (the same as one process's)
        model = GPT(cfg.model.model_config())
        load_initial_weights(model, cfg.model.init_from)
        return model

    model = run_on_all_ranks(env, initial_model)
    strategy.shard(model)  # under FSDP: before the optimizer, which must hold the sharded parameters
    model.to(runtime.device, dtype=runtime.weights_dtype)
    # the optimizer section's (training/optim/optimizers/), its groups' peak lr the schedule's
    optimizer = build_optimizer(model, cfg.optimizer, cfg.schedule.max_lr, runtime.device_type)
    scaler = torch.amp.GradScaler(runtime.device_type, enabled=runtime.loss_scaling)
    long_run = cfg.long_run
    spikes = SpikeWindow(long_run.spike_window, long_run.spike_threshold, runtime.device, runtime.weights_dtype) \
        if long_run.spike_skip else None
    averaging, max_steps = cfg.ema, cfg.schedule.max_steps
    ema = WeightAverage(averaging.ema_decay, averaging.start_step(max_steps)) if averaging.ema_decay else None
    run = Run(model=model, optimizer=optimizer, strategy=strategy, scaler=scaler, train_loader=train_loader,
              val_loaders=val_loaders, grad_accum_steps=grad_accum_steps, data_fingerprint=fingerprint, spikes=spikes,
              ema=ema, config={**cfg.to_dict(), "micro_batch_size": micro_batch_size}, checkpoints=checkpoints,
              micro_batch_size=micro_batch_size, micro_batch=micro_batch)
    return run if continue_run(cfg, ctx, run, resume_path) else None
