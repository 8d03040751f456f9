"""The process group's store: the ranks of a launch attempt agree on its name, whatever came before; a rank
waiting there for the others still answers Ctrl-C, and a store that is gone ends the wait at once."""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from common.errors import ReproError
from forked_ranks import free_port
from slowness import guard
from runtime.process_group import AGREEMENT, agree_on_attempt, setup_distributed

TIMEOUT = datetime.timedelta(seconds=30)


def agree(store, ranks: list[int], world_size: int, late: dict[int, threading.Event] | None = None) -> dict[int, int]:
    """Each rank's answer, from threads that share one store (as torchrun's workers share the agent's)."""
    answers = {}

    def rank_body(rank):
        if late and rank in late:
            late[rank].wait()
        answers[rank] = agree_on_attempt(store, rank, world_size, TIMEOUT, poll_s=0.001)

    threads = [threading.Thread(target=rank_body, args=(rank,)) for rank in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    return answers


def test_every_rank_of_an_attempt_gets_one_new_number():
    store = dist.HashStore()
    first = agree(store, [0, 1, 2], 3)
    assert len(set(first.values())) == 1
    second = agree(store, [0, 1, 2], 3)
    assert len(set(second.values())) == 1 and second[0] != first[0]


def test_a_dead_workers_stale_ask_and_answer_do_not_mislead_its_successor():
    """Rank 2's predecessor asked (and was answered) in an earlier attempt, and another one asked and died
    unanswered; the new rank 2 arrives after rank 0 has started answering: it still gets the new number."""
    store = dist.HashStore()
    earlier = agree(store, [0, 1, 2], 3)[0]
    store.set(f"{AGREEMENT}/ask/2", "dead-and-unanswered")
    rank_two_arrives = threading.Event()
    threading.Timer(0.2, rank_two_arrives.set).start()
    answers = agree(store, [0, 1, 2], 3, late={2: rank_two_arrives})
    assert len(set(answers.values())) == 1 and answers[0] != earlier


def test_a_restart_counted_on_one_node_only_still_agrees():
    """What TORCHELASTIC_RESTART_COUNT could not do: the ranks do not read it at all. Ranks that come in any
    order, the non-zero ones first, meet on rank 0's number."""
    store = dist.HashStore()
    rank_zero_arrives = threading.Event()
    threading.Timer(0.2, rank_zero_arrives.set).start()
    answers = agree(store, [0, 1, 2, 3], 4, late={0: rank_zero_arrives})
    assert len(set(answers.values())) == 1


# --- waiting at start-up: Ctrl-C, and a store that is gone ----------------------------------------------------

STARTUP = datetime.timedelta(seconds=guard(30))  # how long a start-up wait may last here (the trainer's: 30 minutes)
PROMPT_S = guard(5)  # a Ctrl-C or a gone store ends the wait within this, not after STARTUP


@contextlib.contextmanager
def ctrl_c_after(seconds: float):
    """A SIGINT to this process `seconds` from now, handled as in a script (KeyboardInterrupt): a Ctrl-C."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)


def rank_of_two(monkeypatch, rank: int, port: int, agent_store: bool) -> None:
    """This process's environment as rank `rank` of a launch of 2 (torchrun's agent store, or env://)."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)  # no parent-death signal for the test process
    for key, value in {"RANK": rank, "WORLD_SIZE": 2, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                       "TORCHELASTIC_USE_AGENT_STORE": agent_store}.items():
        monkeypatch.setenv(key, str(value))


def test_a_rank_waiting_for_rank_zeros_answer_stops_at_ctrl_c():
    """Rank 0 is late (still importing, say): rank 1 waits for its answer, and a Ctrl-C stops it there."""
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt), ctrl_c_after(0.3):
        agree_on_attempt(dist.HashStore(), 1, 2, STARTUP)
    assert time.monotonic() - started < PROMPT_S


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_waiting_for_a_late_one_under_env_init_stops_at_ctrl_c(monkeypatch, rank):
    """Outside torchrun's agent store rank 0 hosts the store: rank 1 waits for it to listen, and rank 0 for
    rank 1 to arrive; either stops at a Ctrl-C."""
    rank_of_two(monkeypatch, rank, free_port(), agent_store=False)
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt), ctrl_c_after(0.3):
        setup_distributed(torch.device("cpu"), STARTUP)
    assert time.monotonic() - started < PROMPT_S and not dist.is_initialized()


def test_torchruns_store_gone_ends_the_start_up_in_one_line(monkeypatch):
    """A launcher killed before its worker asked for the parent-death signal took its store with it: the worker
    that comes to it finds nothing listening, and ends, instead of retrying the connection for 30 minutes."""
    port = free_port()
    rank_of_two(monkeypatch, 1, port, agent_store=True)
    started = time.monotonic()
    with pytest.raises(ReproError, match=f"torchrun's store at 127.0.0.1:{port} refuses connections"):
        setup_distributed(torch.device("cpu"), STARTUP)
    assert time.monotonic() - started < PROMPT_S and not dist.is_initialized()
