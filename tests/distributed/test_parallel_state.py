"""TensorParallelGroup: one engine's group, built from its own store; two ranks run here as two
threads of this process (gloo does not mind), each with its own backend object."""
from __future__ import annotations

import socket
import threading

import pytest
import torch

from pagedllm.distributed.parallel_state import TensorParallelGroup, connect_store, create_store, init_group


def _two_ranks(body, timeout: float = 30.0) -> list:
    """Runs ``body(group)`` on ranks 0 and 1 of a fresh group; returns their results."""
    store = create_store(2, 0, timeout)
    results, errors = [None, None], []

    def rank(r: int) -> None:
        try:
            s = store if r == 0 else connect_store(store.port, 2, timeout)
            group = init_group(torch.device("cpu"), r, 2, s, timeout)
            results[r] = body(group)
            group.destroy()
        except Exception as exc:  # surfaced in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not errors and not any(t.is_alive() for t in threads), errors
    return results


def test_collectives_sum_and_gather_in_rank_order():
    def body(group):
        x = torch.full((2, 3), float(group.rank + 1))
        summed = group.all_reduce(x.clone())
        gathered = group.all_gather_last_dim(torch.full((2, 1), float(group.rank)))
        return summed, gathered

    for summed, gathered in _two_ranks(body):
        assert torch.equal(summed, torch.full((2, 3), 3.0))
        assert torch.equal(gathered, torch.tensor([[0.0, 1.0], [0.0, 1.0]]))


def test_a_destroyed_group_refuses_collectives():
    def body(group):
        group.barrier()
        group.destroy()
        group.destroy()  # idempotent
        with pytest.raises(RuntimeError, match="destroyed"):
            group.all_reduce(torch.ones(1))
        return group.is_destroyed

    assert _two_ranks(body) == [True, True]


def test_a_group_of_one_never_communicates():
    group = TensorParallelGroup()
    x = torch.ones(3)
    assert group.all_reduce(x) is x and group.all_gather_last_dim(x) is x
    group.barrier()
    assert not group.is_destroyed


@pytest.mark.parametrize("rank, size", [(2, 2), (-1, 2)])
def test_rank_outside_the_group_is_refused(rank, size):
    with pytest.raises(ValueError, match=f"rank={rank}"):
        TensorParallelGroup(rank, size, backend=object())


def test_a_taken_port_moves_the_store_to_the_next_one():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        store = create_store(2, taken, 5.0)
    assert store.port > taken
