"""Train GPT-2 on token shards, on one device or many (torchrun), resuming exactly.

    python train_gpt2.py --config configs/demo.yaml
    torchrun --standalone --nproc_per_node=8 train_gpt2.py          # GPT-2 124M on FineWeb-Edu

Step s is the s-th optimizer update. Each step sees total_batch_size tokens: every rank runs
grad_accum_steps micro-batches of (micro_batch_size, seq_len) and DDP averages the gradients
once, on the last micro-step. Rank 0 alone writes logs, samples and checkpoints; every
collective (loss all-reduce, val loss, HellaSwag, checkpoint barrier) is reached by all ranks,
and an error that only one rank can see is shared with the others before they go on, so every
rank stops with the same one-line message instead of hanging.

Exit codes: 0 done (or preempted and checkpointed), 2 bad configuration or input, 3 the loss
went NaN/inf (the update was not applied), 1 anything else (e.g. a checkpoint write failed).
"""

from __future__ import annotations

import time

from training.metrics import process_start_time

LAUNCH_TIME = process_start_time()  # startup (launch to first finished step) is measured from here

import contextlib  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from data.loader import Prefetcher, TrainLoader, ValLoader, validate_shards  # noqa: E402
from data.tokenizer import get_tokenizer  # noqa: E402
from errors import ConfigError, NonFiniteLossError, run_cli  # noqa: E402
from model import GPT  # noqa: E402
from training.checkpoint import (check_compatible, checkpoint_path, find_resume_checkpoint,  # noqa: E402
                                 list_checkpoints, load_checkpoint, prune_checkpoints, remove_stale_temp_files,
                                 save_checkpoint)
from training.config import TrainConfig, config_yaml, parse_args, usage  # noqa: E402
from training.distributed import (DistEnv, all_reduce_sum, as_repro_error, barrier, broadcast_object,  # noqa: E402
                                  raise_first_error, resolve_dtype, run_on_all_ranks, setup_distributed,
                                  teardown_distributed)
from training.evaluation import evaluate_val_loss, generate_samples  # noqa: E402
from training.hellaswag import HellaSwagEval  # noqa: E402
from training.metrics import detect_peak_flops, model_flops_utilization  # noqa: E402
from training.preemption import PreemptionFlag  # noqa: E402
from training.run_logger import LOG_NAME, RunLogger, write_text_file  # noqa: E402
from training.schedule import learning_rate  # noqa: E402
from training.weights import load_initial_weights  # noqa: E402


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    cfg = parse_args(argv)
    check_optional_packages(cfg)
    env = setup_distributed(cfg.device)
    preemption = PreemptionFlag().install()
    logger = None
    try:
        logger = train(cfg, env, preemption)
        barrier(env)  # leave together: a gloo rank torn down while its peer still talks can abort
        return cfg.preempt_exit_code if preemption.requested else 0
    finally:
        preemption.restore()
        if logger is not None:
            logger.close()
        teardown_distributed()


def train(cfg: TrainConfig, env: DistEnv, preemption: PreemptionFlag) -> RunLogger | None:
    master_process = env.master_process
    device, device_type = env.device, env.device_type
    grad_accum_steps = cfg.grad_accum_steps(env.world_size)
    out_dir = Path(cfg.out_dir)
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 for any fp32 matmul left outside autocast
        torch.backends.cudnn.allow_tf32 = True
    dtype = resolve_dtype(cfg.dtype, device)
    autocast = torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=dtype == "bfloat16")
    use_compile = cfg.compile if cfg.compile is not None else device_type == "cuda"
    # the fused chunked loss saves ~30 GB at B=64 where no compiler fuses the cross-entropy
    loss_chunk_size = cfg.loss_chunk_size if cfg.loss_chunk_size is not None else (
        8192 if device_type == "cuda" and not use_compile else 0)

    # --- data: every rank opens the shards and checks the headers and a share of the token ranges;
    # a problem any rank sees (a folder one node lacks) stops every rank with the same line
    def open_data():
        train_loader = TrainLoader(cfg.data_dir, cfg.seq_len, cfg.micro_batch_size, cfg.total_batch_size,
                                   env.rank, env.world_size, cfg.seed)
        val_loader = ValLoader(cfg.data_dir, cfg.seq_len, cfg.val_tokens, cfg.micro_batch_size,
                               env.rank, env.world_size)
        validate_shards(train_loader.paths + val_loader.paths, cfg.vocab_size, env.rank, env.world_size)
        return train_loader, val_loader

    train_loader, val_loader = run_on_all_ranks(env, open_data)

    # --- model and optimizer: the same seed gives every rank the same initial weights ----------
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model_config())
    load_initial_weights(model, cfg.init_from)
    model.to(device, dtype=torch.float64 if dtype == "float64" else torch.float32)
    raw_model = model  # unwrapped and uncompiled: checkpoints, eval and sampling use it
    optimizer = raw_model.configure_optimizers(cfg.weight_decay, cfg.max_lr, (cfg.beta1, cfg.beta2),
                                               cfg.adam_eps, device_type)

    # --- resume: rank 0 picks the checkpoint, every rank loads that same file -------------------
    start_step, tokens_seen, wandb_run_id = 0, 0, None
    lineage = {"run_id": uuid.uuid4().hex, "ancestry": []}  # see training/checkpoint.py
    resume_path, how = choose_resume_checkpoint(cfg, env)
    if resume_path is not None:
        state = run_on_all_ranks(env, lambda: load_compatible_checkpoint(resume_path, raw_model))
        start_step = state["step"]
        if start_step >= cfg.max_steps:  # decided on every rank: all of them stop here
            if start_step > cfg.max_steps:
                raise ConfigError(f"max_steps: {cfg.max_steps} is below step {start_step} of {resume_path}; "
                                  f"raise max_steps to train on, or start another run in another out_dir")
            if master_process:
                print(f"nothing to do: {resume_path} is at max_steps {cfg.max_steps}; raise max_steps to train on")
            return None
        raw_model.load_state_dict(state["model"])
        load_optimizer_state(optimizer, state["optimizer"])
        tokens_seen = state["tokens_seen"]
        wandb_run_id = state.get("wandb_run_id")
        lineage = {"run_id": state.get("run_id") or lineage["run_id"],
                   "ancestry": [*state.get("ancestry", []), state.get("checkpoint_id")]}
        if master_process:
            warn_on_changed_settings(cfg, state["config"])
        del state

    # --- rank 0's outputs: a failure to write them stops every rank with the same line ----------
    def open_outputs() -> RunLogger:
        if master_process:
            try:
                out_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ConfigError(f"out_dir: cannot create {out_dir} ({e.strerror or e})") from None
            write_text_file(out_dir / "config.yaml", config_yaml(cfg))
            remove_stale_temp_files(out_dir)  # left by a process killed mid-write
        return RunLogger(out_dir, enabled=master_process, resume_step=start_step)

    logger = run_on_all_ranks(env, open_outputs)
    if resume_path is not None:
        logger.console(f"resuming from {resume_path} ({how})")
    if cfg.wandb:  # network or credentials trouble is seen by rank 0 alone
        run_on_all_ranks(env, lambda: logger.start_wandb(cfg.wandb_project, cfg.wandb_run_name, cfg.wandb_mode,
                                                         cfg.to_dict(), cfg.wandb_tags, wandb_run_id, out_dir),
                         describe=lambda e: ConfigError(f"wandb: could not start the run ({type(e).__name__}: "
                                                        f"{e}); use --wandb_mode offline or --wandb false"))
    tokenizer = get_tokenizer()
    # every rank: fetched once per node, and every rank agrees whether it is available
    hellaswag = HellaSwagEval(cfg.hellaswag_path, cfg.hellaswag_limit, env, tokenizer) if cfg.hellaswag_interval else None
    flops_per_token = raw_model.estimate_flops_per_token(cfg.seq_len)
    peak_flops = detect_peak_flops(device, cfg.peak_flops)
    logger.console(
        f"model {cfg.model}: {raw_model.num_params():,} parameters | world size {env.world_size} | "
        f"device {device} | {dtype} | compile {use_compile} | grad_accum_steps {grad_accum_steps} | "
        f"{train_loader.stream.num_rows:,} train rows ({train_loader.steps_per_epoch} steps/epoch)"
        + (f" | resumed from {resume_path} at step {start_step}" if resume_path else "")
    )

    if use_compile:
        model = torch.compile(model)
    if env.ddp:
        model = DDP(model, device_ids=[env.local_rank] if device_type == "cuda" else None)
    batches = Prefetcher(train_loader, start_step, cfg.max_steps, device)

    last_metrics: dict = {}

    def save(step: int) -> None:
        """Rank 0 writes; every rank learns whether that worked (a collective, and a barrier)."""
        def write() -> None:
            if not master_process:
                return
            logger.check()  # a log that could not be written stops the run before anything else
            state = {
                "model": raw_model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "step": step,
                "tokens_seen": tokens_seen,
                "config": cfg.to_dict(),
                "model_args": raw_model.config.to_dict(),
                "rng": {"torch": torch.get_rng_state(),
                        "cuda": torch.cuda.get_rng_state(device) if device_type == "cuda" else None},
                "wandb_run_id": logger.wandb_run_id,
                "metrics": dict(last_metrics),
                **lineage,
                "checkpoint_id": uuid.uuid4().hex,
                "format_version": 1,
            }
            save_checkpoint(state, checkpoint_path(out_dir, step))
            prune_checkpoints(out_dir, cfg.keep_last, written_step=step)
            logger.console(f"saved checkpoint {checkpoint_path(out_dir, step)}")

        run_on_all_ranks(env, write)

    def agree_to_stop() -> bool:
        """Whether any rank was asked to stop. Collective: one small all-reduce (eval steps only)."""
        vote = torch.full((), float(preemption.requested), device=device)
        return all_reduce_sum(vote, env).item() > 0

    def evaluate_val(step: int) -> None:
        val_loss = evaluate_val_loss(raw_model, val_loader, env, autocast)
        last_metrics["val_loss"] = val_loss
        logger.log({"kind": "val", "step": step, "loss": val_loss, "tokens": tokens_seen})
        logger.console(f"step {step:6d} | val loss {val_loss:.4f}")

    def evaluate_hellaswag(step: int) -> None:
        result = hellaswag.evaluate(raw_model, autocast)  # a collective; None if unavailable
        if result is not None:
            last_metrics["hellaswag_acc_norm"] = result["acc_norm"]
            logger.log({"kind": "hellaswag", "step": step, "tokens": tokens_seen, **result})
            logger.console(f"step {step:6d} | hellaswag acc_norm {result['acc_norm']:.4f} ({result['n']} examples)")

    def write_samples(step: int) -> None:
        def generate() -> None:  # rank 0 alone; a failure reaches every rank
            if not master_process:
                return
            samples = generate_samples(raw_model, tokenizer, cfg.sample_prompt, cfg.sample_count,
                                       cfg.sample_tokens, device, seed=cfg.seed + step, autocast=autocast)
            for text in samples:
                logger.log({"kind": "sample", "step": step, "text": text})
                logger.console(f"step {step:6d} | sample: {text!r}")

        run_on_all_ranks(env, generate)

    # --- the loop: at the top of each iteration the model has had `step` updates -----------------
    step = start_step
    stopping = False  # set only from an all-reduced vote, so every rank stops at the same step
    try:
        while True:
            last_step = step == cfg.max_steps
            due = []  # periodic work at this step, in this order
            if last_step or (cfg.eval_interval and step % cfg.eval_interval == 0):
                due.append(evaluate_val)
            if hellaswag is not None and (last_step or step % cfg.hellaswag_interval == 0):
                due.append(evaluate_hellaswag)
            if cfg.sample_interval and step > 0 and (last_step or step % cfg.sample_interval == 0):
                due.append(write_samples)
            # a stop signal skips every pending eval: the ranks agree before each one, and once
            # more after the last, so a signal that arrives during an eval saves right after it
            for work in due:
                stopping = stopping or agree_to_stop()
                if stopping:
                    break
                work(step)
            if due and not stopping:
                stopping = agree_to_stop()
            if stopping:
                if step > start_step:
                    save(step)
                logger.console(f"{preemption.signal_name} received: saved step {step}; "
                               f"{resume_hint(cfg)}")
                break
            if step > start_step and ((last_step and cfg.final_checkpoint)
                                      or (cfg.checkpoint_interval and step % cfg.checkpoint_interval == 0)):
                save(step)
            if last_step:
                run_on_all_ranks(env, logger.check)  # the last records were written
                break

            # --- one optimizer step over total_batch_size tokens ------------------------------
            t0 = time.perf_counter()
            if cfg.dropout > 0:
                # dropout masks depend on (seed, rank, step) only, so a resumed run draws the same ones
                torch.manual_seed(((cfg.seed * 1_000_003 + step) * 4099 + env.rank) % 2**64)
            lr = learning_rate(step, cfg.warmup_steps, cfg.max_steps, cfg.max_lr, cfg.min_lr)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=device)
            failure = None  # this rank's problem, shared through the step's all-reduce below
            for micro_step in range(grad_accum_steps):
                try:
                    x, y = batches.get(step, micro_step)  # (B, T) each, already on the device
                except Exception as e:  # noqa: BLE001 - keep stepping in lockstep, fail together below
                    failure = failure or as_repro_error(e, env)
                    x = y = torch.zeros((cfg.micro_batch_size, cfg.seq_len), dtype=torch.long, device=device)
                # DDP all-reduces gradients only on the last micro-step: no_sync covers forward and backward
                sync = micro_step == grad_accum_steps - 1
                with model.no_sync() if env.ddp and not sync else contextlib.nullcontext():
                    with autocast:
                        _, loss = model(x, y, loss_chunk_size=loss_chunk_size)
                    loss = loss / grad_accum_steps  # gradients add up to the mean over the whole batch
                    loss_sum += loss.detach()
                    loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip or math.inf)
            # one collective per step: the global mean loss, whether any rank was told to stop, and
            # whether any rank failed (a batch it could not read, a log it could not write)
            failure = failure or logger.failure
            stats = all_reduce_sum(torch.stack([loss_sum, loss_sum.new_full((), float(preemption.requested)),
                                                loss_sum.new_full((), float(failure is not None))]), env)
            # the one host synchronisation of the step: decide before the update is applied
            loss_value, stop_votes, failures, norm_value = torch.stack(
                [stats[0] / env.world_size, stats[1], stats[2], grad_norm]).tolist()
            if failures:
                raise_first_error(failure, env)  # every rank raises the same error; no update applied
            if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
                raise NonFiniteLossError(
                    f"step {step}: loss {loss_value} / grad norm {norm_value} is not finite; the update was "
                    f"not applied and the newest checkpoint in {out_dir} is the last good state"
                )
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if stop_votes:
                stopping = True
                preemption.signal_name = preemption.signal_name or "a stop signal (on another rank)"
            step += 1
            tokens_seen += cfg.total_batch_size

            dt = time.perf_counter() - t0
            tokens_per_sec = cfg.total_batch_size / dt  # all ranks together
            record = {"kind": "train", "step": step - 1, "loss": loss_value, "lr": lr, "grad_norm": norm_value,
                      "tokens": tokens_seen, "tokens_per_sec": tokens_per_sec, "step_ms": dt * 1000}
            mfu = model_flops_utilization(flops_per_token, tokens_per_sec, env.world_size, peak_flops)
            if mfu is not None:
                record["mfu"] = mfu
            if device_type == "cuda":
                record["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
            logger.log(record)
            if step == start_step + 1:
                logger.log({"kind": "startup", "step": start_step, "compile": use_compile,
                            "seconds_to_first_step": time.time() - LAUNCH_TIME})
            if (step - 1) % cfg.log_interval == 0 or step == cfg.max_steps:
                logger.console(format_train_line(record))
    finally:
        batches.close()
    return logger


def format_train_line(r: dict) -> str:
    mfu = f" | mfu {100 * r['mfu']:5.1f}%" if "mfu" in r else ""
    return (f"step {r['step']:6d} | loss {r['loss']:.4f} | lr {r['lr']:.3e} | norm {r['grad_norm']:6.3f} | "
            f"{r['step_ms']:8.1f} ms | {r['tokens_per_sec']:10,.0f} tok/s{mfu}")


def choose_resume_checkpoint(cfg: TrainConfig, env: DistEnv) -> tuple[Path | None, str]:
    """Rank 0 resolves `resume` (scanning out_dir); every rank gets its answer, or its error.

    Returns the checkpoint path (None: a fresh start) and how it was chosen.
    """
    def resolve():
        if not env.master_process:
            return None
        if cfg.resume == "never":
            refuse_used_out_dir(Path(cfg.out_dir))
        found = find_resume_checkpoint(cfg.out_dir, cfg.resume)
        return (None, "fresh start") if found is None else (found[0], found[2])

    return broadcast_object(run_on_all_ranks(env, resolve), env)


def refuse_used_out_dir(out_dir: Path) -> None:
    """A fresh start must not mix with the run already in out_dir (its checkpoints and log)."""
    used = [p for p in (out_dir / LOG_NAME, *(p for _, p in list_checkpoints(out_dir))) if p.exists()]
    if used:
        raise ConfigError(f"resume: {out_dir} already holds a run ({', '.join(p.name for p in used[-2:])}); "
                          f"continue it with --resume auto, or give this run another out_dir")


def resume_hint(cfg: TrainConfig) -> str:
    """The command that continues this run (a fresh start would refuse a used out_dir)."""
    if cfg.resume == "never":
        return "run the same command with --resume auto to resume"
    return "run the same command again to resume"


def load_compatible_checkpoint(path: Path, model: GPT) -> dict:
    state = load_checkpoint(path)
    check_compatible(state, model.config.to_dict(), path)
    return state


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """AdamW moments and step counts from the checkpoint; every setting from this run's config.

    The saved groups carry the old run's lr, betas, eps, weight decay and kernel choice (fused
    on CUDA or not); this run's values replace them before loading, so a resume with changed
    settings trains with what config.yaml says (weight decay stays on the decay group only).
    """
    groups = [{**group, **{k: v for k, v in current.items() if k != "params"}}
              for group, current in zip(saved["param_groups"], optimizer.param_groups)]
    optimizer.load_state_dict({**saved, "param_groups": groups})


def warn_on_changed_settings(cfg: TrainConfig, saved: dict) -> None:
    """One line naming every key that differs from the checkpoint's config (not `resume`)."""
    now = cfg.to_dict()
    changed = [f"{key} {saved[key]!r} -> {now[key]!r}" for key in now
               if key != "resume" and key in saved and saved[key] != now[key]]
    if changed:
        print(f"warning: resuming with settings that differ from the checkpoint's: {', '.join(changed)} "
              f"(this run uses the new values; the steps after the resume differ from an uninterrupted run)",
              file=sys.stderr, flush=True)


def check_optional_packages(cfg: TrainConfig) -> None:
    """Fail up front, on every rank, when the config asks for a package that is not installed."""
    import importlib.util

    if cfg.wandb and cfg.wandb_mode != "disabled" and importlib.util.find_spec("wandb") is None:
        raise ConfigError("wandb: the wandb package is not installed (pip install wandb), or set --wandb false")


def cli(argv: list[str]) -> int:
    return run_cli(main, argv)


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
