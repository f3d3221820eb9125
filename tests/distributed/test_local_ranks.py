"""dlrmctl.distributed.local_ranks.run_local_ranks: the product's launcher of local gloo ranks
(reshard, plan --calibrate): results by rank, a collective between them, errors named."""

import os

import pytest
import torch

from dlrmctl.distributed.local_ranks import LocalRanksError, run_local_ranks


def _sum_ranks(env, base):
    from dlrmctl.distributed import comm

    t = torch.tensor([float(env.rank + base)])
    comm.all_reduce(t, env.pg)
    return env.rank, env.world_size, float(t.item()), torch.get_num_threads()


def _fail_on_one(env):
    if env.rank == 1:
        raise ValueError("table 't3' has 0 rows")
    return env.rank


def _die_on_one(env):
    if env.rank == 1:
        os._exit(7)
    import time

    time.sleep(30)


@pytest.mark.multiprocess
def test_results_come_back_by_rank_after_a_collective():
    out = run_local_ranks(_sum_ranks, 3, (10,), timeout_s=120)
    assert out == [(r, 3, 33.0, 1) for r in range(3)]


@pytest.mark.multiprocess
def test_a_failing_rank_is_named_with_its_error_and_traceback():
    with pytest.raises(LocalRanksError, match=r"reshard: rank 1: ValueError: table 't3' has 0 rows") as e:
        run_local_ranks(_fail_on_one, 2, what="reshard", timeout_s=120)
    assert e.value.rank == 1 and "_fail_on_one" in e.value.remote_traceback


@pytest.mark.multiprocess
def test_a_dead_rank_is_reported_and_the_others_are_ended():
    with pytest.raises(LocalRanksError, match=r"rank\(s\) \[1\] died \(exit codes \[7\]\)"):
        run_local_ranks(_die_on_one, 2, timeout_s=120)


def _unpicklable_result(env):
    import threading

    return threading.Lock()


def _exit_quietly_on_one(env):
    if env.rank == 1:
        os._exit(0)
    return env.rank


@pytest.mark.multiprocess
def test_an_unpicklable_result_is_an_error_of_its_rank_not_a_hang():
    with pytest.raises(LocalRanksError, match=r"rank \d: TypeError: the result of _unpicklable_result cannot be sent"):
        run_local_ranks(_unpicklable_result, 2, timeout_s=None)


@pytest.mark.multiprocess
def test_a_rank_that_exits_0_without_a_result_is_reported():
    with pytest.raises(LocalRanksError, match=r"rank\(s\) \[1\] exited \(code 0\) without sending a result"):
        run_local_ranks(_exit_quietly_on_one, 2, timeout_s=None)


@pytest.mark.multiprocess
def test_world_size_1_runs_in_one_spawned_rank():
    assert run_local_ranks(_sum_ranks, 1, (5,), timeout_s=120) == [(0, 1, 5.0, 1)]


def test_world_size_is_checked():
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        run_local_ranks(_sum_ranks, 0)


def test_the_rendezvous_port_is_held_from_the_moment_it_is_chosen():
    """The port was looked up free, let go, and bound seconds later by rank 0 (an `Address already in
    use` when another process took it meanwhile, on a busy machine): the starting process's store now
    holds it from the moment the kernel picks it."""
    import errno
    import socket

    from dlrmctl.distributed.env import host_rendezvous

    store = host_rendezvous(30)
    with socket.socket() as s, pytest.raises(OSError) as e:
        s.bind(("127.0.0.1", store.port))
    assert e.value.errno == errno.EADDRINUSE
