"""micro_batch_size auto: the largest micro-batch that fits this GPU, found by probing the training step.

On CUDA, before training, `choose_micro_batch_size` runs real forward+backward passes of the
training step (the model as training runs it: compiled if compile is on, with the run's
autocast, loss chunking and activation checkpointing) at candidate micro-batches B, and keeps
the largest whose peak fits the GPU's free memory less a headroom, and less what the run will
allocate later that a probe does not (the optimizer's state, created at the first update;
DDP's gradient buckets). The candidates are the B that keep grad_accum_steps whole
(total_batch_size divisible by B * seq_len * dp_size); the search probes the largest first,
then bisects (memory grows with B). Every rank then uses the smallest fit over the ranks,
agreed with one all-reduce (MIN), which also carries a failure: a rank whose probe raised
anything but an out-of-memory error, or that fits no candidate, makes every rank stop with
one error.

total_batch_size and the data order do not change (data/loader.py: the rows a step reads do
not depend on B), so B changes only the rounding, and with dropout which mask falls on which
row (its field's on_resume: dropout_on). The probes leave nothing behind: they run on a model of the
run's shape built for them (before the run's own, which they never touch), with the random
generators restored after, the compiler's caches reset, and the memory freed. So the first step
is bitwise the step of a run launched with the chosen B set by hand (tests/test_micro_batch.py).

Under fsdp every forward is a collective (its all-gathers), so every rank probes the same sizes, and
one all-reduce per probe agrees on whether it fit. A limit: a rank that runs out of memory part-way
through a probe's forward while the others go on leaves them waiting in that forward's all-gather
until the startup timeout (30 minutes), then every rank stops. Ranks on GPUs of one kind with the
same free memory run out at the same size; on a mixed node, set micro_batch_size by hand.

On CPU and MPS there is no memory to probe: auto is one warning line and
micro_batch_size_fallback is used, or the largest candidate below it where it would not keep
grad_accum_steps whole (configs/demo.yaml's 1,024-token batch is 8 rows of 128: 8, not 16). The
search itself (`search_micro_batch_size`) is a pure function of a probe and a memory query,
tested on the CPU (tests/test_micro_batch.py).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from common.errors import ConfigError, ReproError
from data.settings import DataSettings, candidate_sizes, nearest_multiples
from model import GPTConfig
from runtime.process_group import DistEnv, as_repro_error, raise_first_error
from runtime.context import Context
from training.distributed.strategies import Strategy, local_nbytes

HEADROOM = 0.10  # of the GPU's total memory, left free beyond the probe's peak (allocator fragmentation, evals)
FAILED = -1  # a rank's vote when its search raised: every rank stops


@dataclass
class SearchResult:
    chosen: int | None  # the largest candidate that fits on this rank (None: none does)
    budget_bytes: int  # what a probe's peak may add: free memory less the headroom and the reserve
    free_bytes: int
    total_bytes: int
    probes: list[dict] = field(default_factory=list)  # {"B", "fits", "peak_bytes"} in the order probed

    def record(self) -> dict:
        """What run.json keeps of this rank's search."""
        return {"budget_gib": round(self.budget_bytes / 2**30, 3), "free_gib": round(self.free_bytes / 2**30, 3),
                "total_gib": round(self.total_bytes / 2**30, 3),
                "probes": [{**p, "peak_gib": None if p["peak_bytes"] is None else round(p["peak_bytes"] / 2**30, 3)}
                           for p in self.probes]}


def search_micro_batch_size(candidates: Sequence[int], probe: Callable[[int], int],
                            memory: Callable[[], tuple[int, int]], release: Callable[[], None] = lambda: None,
                            headroom: float = HEADROOM, reserve_bytes: int = 0,
                            agree: Callable[[bool], bool] = lambda fits: fits) -> SearchResult:
    """The largest of the (ascending) candidates whose probe fits: the largest first, then a bisection.

    probe(B) runs one forward+backward at micro-batch B and returns the bytes it added at its peak, or
    raises torch.OutOfMemoryError; it fits when it returned at most the budget: memory()'s free bytes
    less headroom * its total bytes, less reserve_bytes (what the run allocates later). release() runs
    after every probe, outside the except clause, so the memory an out-of-memory error's traceback held
    is freed by then. agree(fits) -> fits: where every rank must probe the same sizes (forwards that are
    collectives), each probe's outcome agreed over the ranks; the identity elsewhere.
    """
    free, total = memory()
    budget = int(free - headroom * total - reserve_bytes)
    result = SearchResult(chosen=None, budget_bytes=budget, free_bytes=free, total_bytes=total)

    def fits(size: int) -> bool:
        try:
            peak = probe(size)
        except torch.OutOfMemoryError:
            peak = None
        release()
        ok = agree(peak is not None and peak <= budget)
        result.probes.append({"B": size, "fits": ok, "peak_bytes": peak})
        return ok

    lo, hi = 0, len(candidates) - 1
    mid = hi  # the largest first: the whole per-rank batch often fits a small model
    while lo <= hi:
        if fits(candidates[mid]):
            result.chosen = candidates[mid]
            lo = mid + 1
        else:
            hi = mid - 1
        mid = (lo + hi + 1) // 2
    return result


def agree_on_smallest(vote: int, env: DistEnv) -> int:
    """The smallest vote over the ranks (a chosen B, 0 for none fits, FAILED). Collective: one all-reduce."""
    if not env.distributed:
        return vote
    value = torch.tensor(vote, dtype=torch.int64, device=env.device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN)
    return int(value.item())


# --- the probes of the training step -------------------------------------------------------------------

def probing_supported(device_type: str) -> bool:
    """Whether auto probes (CUDA: a free-memory query and peak statistics), or uses the fallback."""
    return device_type == "cuda"


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of the device (tests fake it on the CPU)."""
    return torch.cuda.mem_get_info(device)


def later_state_bytes(model: torch.nn.Module, ddp_buckets: bool) -> int:
    """What the run allocates after the probes that they do not: the optimizer state (AdamW: two moments
    per parameter of this rank; Muon keeps less), and DDP's gradient buckets (one more gradient's worth)."""
    params = sum(local_nbytes(p) for p in model.parameters() if p.requires_grad)
    return params * (2 + int(ddp_buckets))


def choose_micro_batch_size(ctx: Context, strategy: Strategy, data: DataSettings,
                            model_config: GPTConfig) -> tuple[int, dict]:
    """micro_batch_size auto: the B this run uses, and what run.json records of how it was chosen.

    Every rank calls this, before the run is built. On CUDA: one all-reduce, and under FSDP the probes'
    own collectives and one all-reduce per probe. data: the data section, whose micro_batch_size must be
    None (auto); model_config: the model section's shape, which the probes build.
    """
    env, runtime, logger = ctx.env, ctx.runtime, ctx.logger
    candidates = candidate_sizes(data.total_batch_size, data.seq_len, strategy.dp_size)
    if not candidates:
        fitting = nearest_multiples(data.total_batch_size, data.seq_len * strategy.dp_size)
        raise ConfigError(f"micro_batch_size: auto finds no micro-batch: total_batch_size {data.total_batch_size} "
                          f"does not split into rows of seq_len {data.seq_len} over {strategy.dp_size} ranks; "
                          f"total_batch_size {' or '.join(map(str, fitting))} does")
    if not probing_supported(runtime.device_type):
        fallback = data.micro_batch_size_fallback
        chosen = max(b for b in candidates if b <= fallback)  # 1 always is one
        fitted = "" if chosen == fallback else (
            f", the largest micro-batch up to micro_batch_size_fallback {fallback} that keeps grad_accum_steps "
            f"whole ({candidates[-1]} rows a rank per step: total_batch_size {data.total_batch_size} / seq_len "
            f"{data.seq_len} / {strategy.dp_size} rank(s))")
        logger.warn(f"micro_batch_size auto probes CUDA memory; on {runtime.device_type} it uses "
                    + (f"micro_batch_size_fallback {fallback}" if not fitted else f"{chosen}{fitted}"))
        return chosen, {"requested": "auto", "chosen": chosen, "how": f"fallback ({runtime.device_type})"}
    error, result = None, None
    try:
        result = probe_search(ctx, strategy, candidates, model_config, data.seq_len)
        vote = result.chosen or 0
    except Exception as e:  # noqa: BLE001 - the failure rides on the agreement below, every rank reaches it
        error, vote = as_repro_error(e, env), FAILED
    chosen = agree_on_smallest(vote, env)
    if chosen == FAILED:
        raise_first_error(error, env)  # every rank got FAILED: every rank reaches this gather
    if chosen == 0:
        raise ReproError(f"micro_batch_size: auto: not even micro-batch {candidates[0]} fits the free memory of "
                         f"some rank's GPU with {HEADROOM:.0%} headroom; set micro_batch_size by hand, or use "
                         f"activation_checkpointing or fsdp")
    how = "probed" + (f", the smallest fit of {env.world_size} ranks" if env.distributed else "")
    return chosen, {"requested": "auto", "chosen": chosen, "how": how, "this_rank": result.chosen,
                    "candidates": candidates, "headroom": HEADROOM, **result.record()}


def probe_search(ctx: Context, strategy: Strategy, candidates: list[int], model_config: GPTConfig,
                 seq_len: int) -> SearchResult:
    """This rank's search, by probes of the training step on a model of the run's shape, built for them and
    dropped after: the run's model, optimizer and random generators are never touched."""
    device = ctx.runtime.device
    try:
        return search_with_probe_model(ctx, strategy, candidates, model_config, seq_len)
    finally:  # the probe model is gone with the call's frame
        reset_compiler(ctx.runtime.compile)  # training compiles as a launch with B set by hand does
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)  # the train records' peak_mem_gb is the run's, not a probe's


def search_with_probe_model(ctx: Context, strategy: Strategy, candidates: list[int], model_config: GPTConfig,
                            seq_len: int) -> SearchResult:
    env, runtime = ctx.env, ctx.runtime
    device = runtime.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model = probe_copy(model_config, strategy, device, runtime.weights_dtype)
        train_model = strategy.probe_model(model)

    def probe(size: int) -> int:
        reset_compiler(runtime.compile)  # each size compiled afresh: no dynamic shapes, no recompile limit
        x = torch.zeros((size, seq_len), dtype=torch.long, device=device)
        before = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0  # what the allocator holds
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # dropout draws
            with runtime.autocast():
                _, loss = train_model(x, x, loss_chunk_size=runtime.loss_chunk_size, loss_head=runtime.loss_head)
            loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            return torch.cuda.max_memory_reserved(device) - before
        return 0

    def release() -> None:
        for p in model.parameters():
            p.grad = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def agree(fits: bool) -> bool:
        if not (strategy.forwards_are_collective and env.distributed):
            return fits
        return agree_on_smallest(int(fits), env) == 1

    release()
    ddp_buckets = env.distributed and not strategy.forwards_are_collective
    return search_micro_batch_size(candidates, probe, lambda: device_memory(device), release,
                                   reserve_bytes=later_state_bytes(model, ddp_buckets), agree=agree)


def probe_copy(config, strategy, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A model of the run's shape for the probes, spread over the ranks as the run's is; its weights are
    zeros (memory does not depend on them), so nothing is drawn and nothing initialised on the host."""
    from model import GPT

    with torch.device("meta"):
        model = GPT(config)
    strategy.shard(model)
    model.to_empty(device=device)
    model.to(dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def reset_compiler(compiled: bool) -> None:
    """Forget what torch.compile traced, so the next forward compiles as the first one of a process does."""
    if compiled:
        torch._dynamo.reset()
