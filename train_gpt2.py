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
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from data.loader import Prefetcher, TrainLoader, ValLoader, validate_shards  # noqa: E402
from data.shards import DataError  # noqa: E402
from data.tokenizer import get_tokenizer  # noqa: E402
from model import GPT  # noqa: E402
from training.checkpoint import (CheckpointError, CheckpointWriteError, check_compatible,  # noqa: E402
                                 checkpoint_path, find_resume_checkpoint, load_checkpoint,
                                 prune_checkpoints, remove_stale_temp_files, save_checkpoint)
from training.config import ConfigError, TrainConfig, parse_args, save_yaml, usage  # noqa: E402
from training.distributed import (DistEnv, all_reduce_sum, barrier, broadcast_object, first_error,  # noqa: E402
                                  resolve_dtype, run_on_all_ranks, setup_distributed, teardown_distributed)
from training.evaluation import evaluate_val_loss, generate_samples  # noqa: E402
from training.hellaswag import HellaSwagDataError, HellaSwagEval  # noqa: E402
from training.metrics import detect_peak_flops, model_flops_utilization  # noqa: E402
from training.preemption import PreemptionFlag  # noqa: E402
from training.run_logger import RunLogger  # noqa: E402
from training.schedule import learning_rate  # noqa: E402
from training.weights import load_initial_weights  # noqa: E402


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm went NaN/inf; the update was not applied."""


def main(argv: list[str]) -> int:
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


def train(cfg: TrainConfig, env: DistEnv, preemption: PreemptionFlag) -> RunLogger:
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

    # --- data: every rank checks the headers, and a share of the token ranges -------------------
    train_loader = TrainLoader(cfg.data_dir, cfg.seq_len, cfg.micro_batch_size, cfg.total_batch_size,
                               env.rank, env.world_size, cfg.seed)
    val_loader = ValLoader(cfg.data_dir, cfg.seq_len, cfg.val_tokens, cfg.micro_batch_size,
                           env.rank, env.world_size)
    problem = first_error(validate_shards(train_loader.paths + val_loader.paths, cfg.vocab_size,
                                          env.rank, env.world_size), env)
    if problem:
        raise DataError(problem)

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
    resume_path = choose_resume_checkpoint(cfg, env)
    if resume_path is not None:
        state = run_on_all_ranks(env, lambda: load_compatible_checkpoint(resume_path, raw_model),
                                 CheckpointError, CheckpointError)
        raw_model.load_state_dict(state["model"])
        load_optimizer_state(optimizer, state["optimizer"])
        start_step, tokens_seen = state["step"], state["tokens_seen"]
        wandb_run_id = state.get("wandb_run_id")
        warn_on_changed_batch(cfg, state["config"], master_process)
        del state

    # --- rank 0's outputs ------------------------------------------------------------------------
    if master_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_yaml(cfg, out_dir / "config.yaml")
        remove_stale_temp_files(out_dir)  # left by a process killed mid-write
    logger = RunLogger(out_dir, enabled=master_process, resume_step=start_step)
    if cfg.wandb:  # network or credentials trouble is seen by rank 0 alone
        run_on_all_ranks(env, lambda: logger.start_wandb(cfg.wandb_project, cfg.wandb_run_name, cfg.wandb_mode,
                                                         cfg.to_dict(), cfg.wandb_tags, wandb_run_id, out_dir),
                         Exception, ConfigError, describe=lambda e: f"wandb: could not start the run "
                         f"({type(e).__name__}: {e}); use --wandb_mode offline or --wandb false")
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
                "format_version": 1,
            }
            save_checkpoint(state, checkpoint_path(out_dir, step))
            prune_checkpoints(out_dir, cfg.keep_last, protect=resume_path)
            logger.console(f"saved checkpoint {checkpoint_path(out_dir, step)}")

        run_on_all_ranks(env, write, CheckpointWriteError, CheckpointWriteError)

    # --- the loop: at the top of each iteration the model has had `step` updates -----------------
    step = start_step
    stop_agreed = False  # set only from the all-reduced vote, so every rank stops at the same step
    try:
        while True:
            last_step = step == cfg.max_steps
            if stop_agreed:
                save(step)
                logger.console(f"{preemption.signal_name} received: saved step {step}; "
                               f"run the same command again to resume")
                break
            if last_step or (cfg.eval_interval and step % cfg.eval_interval == 0):
                val_loss = evaluate_val_loss(raw_model, val_loader, env, autocast)
                last_metrics["val_loss"] = val_loss
                logger.log({"kind": "val", "step": step, "loss": val_loss, "tokens": tokens_seen})
                logger.console(f"step {step:6d} | val loss {val_loss:.4f}")
            if hellaswag is not None and (last_step or step % cfg.hellaswag_interval == 0):
                result = hellaswag.evaluate(raw_model, autocast)  # a collective; None if unavailable
                if result is not None:
                    last_metrics["hellaswag_acc_norm"] = result["acc_norm"]
                    logger.log({"kind": "hellaswag", "step": step, "tokens": tokens_seen, **result})
                    logger.console(f"step {step:6d} | hellaswag acc_norm {result['acc_norm']:.4f} "
                                   f"({result['n']} examples)")
            if (master_process and cfg.sample_interval and step > 0
                    and (last_step or step % cfg.sample_interval == 0)):
                samples = generate_samples(raw_model, tokenizer, cfg.sample_prompt, cfg.sample_count,
                                           cfg.sample_tokens, device, seed=cfg.seed + step, autocast=autocast)
                for text in samples:
                    logger.log({"kind": "sample", "step": step, "text": text})
                    logger.console(f"step {step:6d} | sample: {text!r}")
            if step > start_step and ((last_step and cfg.final_checkpoint)
                                      or (cfg.checkpoint_interval and step % cfg.checkpoint_interval == 0)):
                save(step)
            if last_step:
                break

            # --- one optimizer step over total_batch_size tokens ------------------------------
            t0 = time.perf_counter()
            if cfg.dropout > 0:
                # dropout masks depend on (seed, rank, step) only, so a resumed run draws the same ones
                torch.manual_seed((cfg.seed * 1_000_003 + step) * 4099 + env.rank)
            lr = learning_rate(step, cfg.warmup_steps, cfg.max_steps, cfg.max_lr, cfg.min_lr)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=device)
            for micro_step in range(grad_accum_steps):
                x, y = batches.get(step, micro_step)  # (B, T) each, already on the device
                # DDP all-reduces gradients only on the last micro-step: no_sync covers forward and backward
                sync = micro_step == grad_accum_steps - 1
                with model.no_sync() if env.ddp and not sync else contextlib.nullcontext():
                    with autocast:
                        _, loss = model(x, y, loss_chunk_size=loss_chunk_size)
                    loss = loss / grad_accum_steps  # gradients add up to the mean over the whole batch
                    loss_sum += loss.detach()
                    loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip or math.inf)
            # one collective per step: the global mean loss, and whether any rank was told to stop
            stop_vote = torch.zeros_like(loss_sum).fill_(float(preemption.requested))
            stats = all_reduce_sum(torch.stack([loss_sum, stop_vote]), env)
            # the one host synchronisation of the step: decide before the update is applied
            loss_value, stop_votes, norm_value = torch.stack([stats[0] / env.world_size, stats[1], grad_norm]).tolist()
            if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
                raise NonFiniteLossError(
                    f"step {step}: loss {loss_value} / grad norm {norm_value} is not finite; the update was "
                    f"not applied and the newest checkpoint in {out_dir} is the last good state"
                )
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if stop_votes:
                stop_agreed = True
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


def choose_resume_checkpoint(cfg: TrainConfig, env: DistEnv) -> Path | None:
    """Rank 0 resolves `resume` (scanning out_dir for auto); every rank gets its answer or its error."""
    path, problem = None, None
    if env.master_process:
        try:
            found = find_resume_checkpoint(cfg.out_dir, cfg.resume)
            path = None if found is None else found[0]
        except CheckpointError as e:
            problem = str(e)
    path, problem = broadcast_object((path, problem), env)
    if problem:
        raise CheckpointError(problem)
    return path


def load_compatible_checkpoint(path: Path, model: GPT) -> dict:
    state = load_checkpoint(path)
    check_compatible(state, model.config.to_dict(), path)
    return state


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Load AdamW moments and step counts; keep this run's kernel choice (fused on CUDA or not)."""
    for group, current in zip(saved["param_groups"], optimizer.param_groups):
        for key in ("fused", "foreach", "capturable"):
            if key in current:
                group[key] = current[key]
    optimizer.load_state_dict(saved)


def warn_on_changed_batch(cfg: TrainConfig, saved: dict, master_process: bool) -> None:
    """Resuming with another total batch or seq_len changes which rows each step reads."""
    for key in ("total_batch_size", "seq_len"):
        if master_process and saved.get(key) != getattr(cfg, key):
            print(f"warning: {key} was {saved.get(key)} in the checkpoint and is {getattr(cfg, key)} now; "
                  f"the data order after the resume differs from an uninterrupted run", file=sys.stderr)


def check_optional_packages(cfg: TrainConfig) -> None:
    """Fail up front, on every rank, when the config asks for a package that is not installed."""
    import importlib.util

    if cfg.wandb and cfg.wandb_mode != "disabled" and importlib.util.find_spec("wandb") is None:
        raise ConfigError("wandb: the wandb package is not installed (pip install wandb), or set --wandb false")


EXIT_CODES = [(ConfigError, 2), (DataError, 2), (HellaSwagDataError, 2), (CheckpointWriteError, 1), (CheckpointError, 2), (NonFiniteLossError, 3)]


def cli(argv: list[str]) -> int:
    """Run main(); known failures become one `error:` line and their exit code, no traceback."""
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    try:
        return main(argv)
    except tuple(kind for kind, _ in EXIT_CODES) as e:
        sys.stderr.flush()
        # one write call, so the lines of ranks sharing a terminal never interleave
        os.write(sys.stderr.fileno(), f"error: {e}\n".encode())
        return next(code for kind, code in EXIT_CODES if isinstance(e, kind))


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
