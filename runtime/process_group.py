"""Process-group setup from torchrun's environment, and the collective helpers.

A plain `python train_gpt2.py` runs as one process with no process group; under torchrun
(RANK / LOCAL_RANK / WORLD_SIZE set) we join the group: NCCL on CUDA, gloo on CPU, so the
same code runs in CI's multi-process tests. Every helper below `teardown_distributed` is a
collective that *every* rank must call; none of them may sit behind an `if master_process`.
"""

from __future__ import annotations

import datetime
import gc
import os
import socket
import time
import traceback
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.errors import ConfigError, ReproError, first_line
from runtime.launcher import stop_when_launcher_dies


@dataclass
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    distributed: bool  # launched by torchrun: a process group joins the ranks (also for one rank)

    @property
    def master_process(self) -> bool:
        return self.rank == 0

    @property
    def device_type(self) -> str:
        return self.device.type


AGREEMENT = "gpt2-repro/attempt"  # the store keys with which the ranks name their launch attempt
ARRIVED = "gpt2-repro/arrived"  # outside torchrun's agent store: how many ranks have reached the meeting
MAX_POLL_S = 0.05  # a rank waiting for others polls the store at most this far apart


def meeting_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """The store to make the process group with, returned once every rank of this launch attempt is there.

    Under torchrun's shared agent store (TORCHELASTIC_USE_AGENT_STORE): a client of it, with keys
    of this attempt only. torchrun's agents keep one TCP store for the whole job, across restarts
    (--max-restarts), and the process group's keys carry no attempt number: a restarted worker
    could read the address its dead predecessor published and fail to connect. Nor can the
    restart count name the attempt: an agent counts a restart only when its own worker failed
    ("membership changes do not count"), so after one node's worker dies, its new worker has
    TORCHELASTIC_RESTART_COUNT 1 and the other nodes' new workers 0. So the ranks agree on a
    number in the store itself (`agree_on_attempt`) and prefix every key with it. Outside
    torchrun's shared store, as torch's env:// does it: rank 0 hosts a store of this attempt's
    own, and every rank waits until all arrived.

    Every wait polls the store and sleeps between polls, and a signal's handler runs in the sleep:
    the store's own blocking calls (a connection retried, store.wait, a host waiting for its
    clients) run none until they return, up to `timeout` (30 minutes at start-up), so ranks
    waiting for a late one ignored Ctrl-C until torchrun killed them (30 s after the SIGINT it
    forwarded, minutes under scripts/slurm.sbatch). Once all are there, init_process_group's own
    waits through the store take milliseconds. A store that fails (its host died) is one line.
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        if agent_store:
            store = connect_to_store(host, port, world_size, timeout, hosted_by_launcher=True)
            attempt = agree_on_attempt(store, rank, world_size, timeout)
            return dist.PrefixStore(f"{AGREEMENT}_{attempt}", store)
        if rank == 0:
            store = dist.TCPStore(host, port, world_size, is_master=True, wait_for_workers=False, timeout=timeout,
                                  multi_tenant=True)
        else:
            store = connect_to_store(host, port, world_size, timeout, hosted_by_launcher=False)
        store.add(ARRIVED, 1)
        wait_until(lambda: store.add(ARRIVED, 0) >= world_size, timeout,
                   lambda: f"start-up: {world_size - store.add(ARRIVED, 0)} of {world_size} ranks did not arrive "
                           f"within {timeout}")
        return store
    except dist.DistError as e:
        raise ReproError(f"the store at {host}:{port} (MASTER_ADDR, MASTER_PORT) failed: {first_line(e)}") from None


def connect_to_store(host: str, port: int, world_size: int, timeout: datetime.timedelta,
                     hosted_by_launcher: bool) -> dist.TCPStore:
    """A client of the TCPStore at host:port, made once the store listens (probed from here, where a signal's
    handler runs: TCPStore's own connection retries for `timeout` without running any).

    hosted_by_launcher: torchrun's agent store, which exists before any worker starts: a refused
    connection means that whatever hosted it (the agent of the rendezvous' host, or a rendezvous
    store) is gone, and no rank can ever meet through it. Otherwise rank 0 hosts the store, and
    a refused connection means only that rank 0 is not listening yet.
    """
    def listening() -> bool:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return True
        except ConnectionRefusedError:
            if hosted_by_launcher:
                raise ReproError(f"torchrun's store at {host}:{port} refuses connections: what hosted it (the "
                                 f"launcher) is gone") from None
            return False
        except OSError:  # no route yet, the name does not resolve yet, a connection timed out: try again
            return False

    wait_until(listening, timeout, lambda: f"the store at {host}:{port} (MASTER_ADDR, MASTER_PORT) did not answer "
               f"within {timeout}", poll_s=MAX_POLL_S)
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)


def wait_until(ready, timeout: datetime.timedelta, failure, poll_s: float = 0.001) -> None:
    """Return once ready() is true; after `timeout`, raise ReproError(failure()). Polls from poll_s apart,
    doubling to MAX_POLL_S, and sleeps between polls: a signal's handler runs in the sleep (a Ctrl-C raises
    KeyboardInterrupt there)."""
    deadline = time.monotonic() + timeout.total_seconds()
    while not ready():
        if time.monotonic() > deadline:
            raise ReproError(failure())
        time.sleep(poll_s)
        poll_s = min(2 * poll_s, MAX_POLL_S)


def agree_on_attempt(store, rank: int, world_size: int, timeout: datetime.timedelta,
                     poll_s: float = 0.01) -> int:
    """A number that every rank of this launch attempt gets, and no earlier attempt had. Uses the store only.

    Rank 0 draws the number from a counter (store.add is atomic, so it is new). Every other rank
    asks under a token it made up and waits for the answer keyed by that token, so it can never
    read an answer meant for a dead predecessor; rank 0 answers every ask it finds (a stale one
    from a dead worker too, harmlessly) until all the others have acknowledged its number. Both
    wait in polls a signal can interrupt (meeting_store).
    """
    if rank != 0:
        token = uuid.uuid4().hex
        answer = f"{AGREEMENT}/answer/{token}"
        store.set(f"{AGREEMENT}/ask/{rank}", token)
        wait_until(lambda: store.check([answer]), timeout,
                   lambda: f"torchrun's launch attempt: rank 0 did not answer rank {rank} within {timeout}", poll_s)
        attempt = int(store.get(answer))
        store.add(f"{AGREEMENT}/joined/{attempt}", 1)
        return attempt
    attempt = store.add(f"{AGREEMENT}/count", 1)
    answered: dict[int, bytes] = {}  # rank -> the last token answered
    deadline = time.monotonic() + timeout.total_seconds()
    while store.add(f"{AGREEMENT}/joined/{attempt}", 0) < world_size - 1:
        for other in range(1, world_size):
            ask = f"{AGREEMENT}/ask/{other}"
            if store.check([ask]) and (token := store.get(ask)) != answered.get(other):
                store.set(f"{AGREEMENT}/answer/{token.decode()}", str(attempt))
                answered[other] = token
        if time.monotonic() > deadline:
            missing = world_size - 1 - store.add(f"{AGREEMENT}/joined/{attempt}", 0)
            raise ReproError(f"torchrun's launch attempt: {missing} of {world_size - 1} other ranks did not "
                             f"arrive within {timeout}")
        time.sleep(poll_s)
    return attempt


def local_rank() -> int:
    """This process's index on its node: torchrun's LOCAL_RANK, 0 for a plain process."""
    return int(os.environ.get("LOCAL_RANK", 0))


def setup_distributed(device: torch.device, timeout: datetime.timedelta) -> DistEnv:
    """Join torchrun's process group if launched by it (NCCL on CUDA, gloo otherwise).

    `timeout` bounds every collective until `set_collective_timeout` changes it: long enough
    for start-up (compilation, the first evaluation), where ranks legitimately wait for each other.
    """
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    stop_when_launcher_dies()  # the trainer asked before its imports; an entry point that did not asks here
    if distributed:
        if device.type == "mps":
            raise ConfigError("device: mps does not support multi-process training; run one process")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend=backend, timeout=timeout, store=meeting_store(rank, world_size, timeout),
            rank=rank, world_size=world_size, device_id=device if device.type == "cuda" else None,
        )
    elif device.type == "cuda":
        torch.cuda.set_device(device)
    return DistEnv(rank=rank, local_rank=local_rank(), world_size=world_size, device=device, distributed=distributed)


def set_collective_timeout(env: DistEnv, timeout: datetime.timedelta) -> None:
    """From now on a collective that waits longer than `timeout` fails (a rank hung or died)."""
    if env.distributed:
        dist.distributed_c10d._set_pg_timeout(timeout)


def teardown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        # Free the DDP reducer (it sits in reference cycles) while the group still exists: a
        # gloo reducer destroyed later, at interpreter exit, can abort the process.
        gc.collect()
        dist.destroy_process_group()


def all_reduce_sum(tensor: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum a tensor over ranks in place (no-op on one process). Collective."""
    if env.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


# Every rank's tensor gathered into one output tensor: torch 2.13 names it all_gather_single and deprecates
# all_gather_into_tensor (a FutureWarning on every rank); older torch has only the old name, same semantics.
ALL_GATHER_INTO_TENSOR = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather(tensor: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Every rank's tensor in rank order, on every rank (one process: its own): (world_size, *shape). Collective."""
    if not env.distributed:
        return tensor.unsqueeze(0)
    # flat: gloo takes only a 1-D output (world_size x the input), NCCL either shape
    everyone = tensor.new_empty(env.world_size * tensor.numel())
    ALL_GATHER_INTO_TENSOR(everyone, tensor.flatten())
    return everyone.view(env.world_size, *tensor.shape)


def any_rank(flag: bool, env: DistEnv) -> bool:
    """Whether flag is true on any rank, the same answer on every rank. Collective (a host sync)."""
    if not env.distributed:
        return flag
    vote = torch.full((), float(flag), device=env.device)
    return all_reduce_sum(vote, env).item() > 0


def barrier(env: DistEnv) -> None:
    """Wait for every rank. Collective."""
    if env.distributed:
        if env.device_type == "cuda":
            dist.barrier(device_ids=[env.device.index])
        else:
            dist.barrier()


def broadcast_object(obj, env: DistEnv, src: int = 0):
    """Rank src's picklable object, on every rank. Collective."""
    if not env.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=env.device if env.device_type == "cuda" else None)
    return box[0]


def run_on_all_ranks(env: DistEnv, fn, describe=None):
    """fn() on this rank; if it failed on any rank, every rank raises that failure. Collective.

    For work whose failure only some ranks can see (rank 0 writing a checkpoint or a log, one
    node missing a file): the error travels to every rank, so they all stop with the same
    one-line message instead of the others waiting forever in their next collective. A
    ReproError travels as it is; anything else (a bug) prints its traceback on the rank that
    hit it and travels as a ReproError naming that rank. `describe(e)` may turn an exception
    into the ReproError to share (return None to treat it as unexpected).
    """
    result, error = None, None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - every failure must reach the agreement below
        error = as_repro_error(e, env, describe)
    raise_first_error(error, env)
    return result


def as_repro_error(e: Exception, env: DistEnv, describe=None) -> ReproError:
    """The ReproError to share for e: itself, describe(e), or a one-line stand-in for a bug."""
    if isinstance(e, ReproError):
        return e
    described = describe(e) if describe is not None else None
    if described is not None:
        return described
    traceback.print_exc()
    return ReproError(f"rank {env.rank}: {type(e).__name__}: {e} (traceback above)")


def raise_first_error(error: ReproError | None, env: DistEnv) -> None:
    """Raise the lowest rank's error on every rank, or return if no rank has one. Collective."""
    error = first_error(error, env)
    if error is not None:
        raise error


def first_error(error, env: DistEnv):
    """Gather each rank's error (a message or exception, or None); the first one, on every rank.

    Collective. Lets all ranks fail with the same one-line message when only one of them saw
    the problem, instead of the others hanging in their next collective.
    """
    if not env.distributed:
        return error
    gathered: list = [None] * env.world_size
    dist.all_gather_object(gathered, error)
    return next((e for e in gathered if e is not None), None)
