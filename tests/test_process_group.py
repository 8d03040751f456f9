"""The process group's store: the ranks of a launch attempt agree on its name, whatever came before."""

from __future__ import annotations

import datetime
import threading

import torch.distributed as dist

from training.core.process_group import AGREEMENT, agree_on_attempt

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
