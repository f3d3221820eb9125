"""Run a function on N local gloo ranks spawned by this process and collect what each returns.

The product's own helpers that need several ranks on one host without ``torchrun`` —
``dlrmctl checkpoint reshard`` (N writer ranks) and ``dlrmctl plan --calibrate`` (collective
microbenchmarks on 2 ranks) — share this one launcher (tests have their own, with the
environment objects they compare: ``tests/dist_utils.py``).

Each rank is a ``spawn``-ed process (no fork of a parent that may hold threads or a process
group), joins a gloo group rendezvousing at a store this process serves on localhost, runs
``fn(env, *args)`` with its :class:`~dlrmctl.distributed.env.ShardingEnv`, reports the result
(or the error and its traceback) through a queue and leaves the group.  ``fn`` and ``args``
must be picklable (a module-level function).
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from typing import Any, Callable, Sequence


class LocalRanksError(RuntimeError):
    """A spawned rank raised, died, or the ranks did not all finish in time.

    Attributes:
        rank: the first failing rank, or None for a timeout.
        remote_traceback: the failing rank's traceback text ("" when it died or timed out).
    """

    def __init__(self, msg: str, rank: int | None = None, remote_traceback: str = "") -> None:
        super().__init__(msg)
        self.rank = rank
        self.remote_traceback = remote_traceback


def _rank_main(rank: int, world_size: int, port: int, threads: int, pg_timeout_s: float,
               fn: Callable[..., Any], args: Sequence[Any], q: Any, parent: int | None = None) -> None:
    from dlrmctl.procs import die_with_parent

    die_with_parent(parent=parent)  # a SIGKILLed parent leaves no rank behind
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch
    from multiprocessing.reduction import ForkingPickler

    torch.set_num_threads(threads)
    try:
        from dlrmctl.distributed.env import destroy_distributed, init_process_group_tcp

        env = init_process_group_tcp(rank, world_size, port, "gloo", timeout_s=pg_timeout_s)
        try:
            result = fn(env, *args)
        finally:
            destroy_distributed()
        try:  # here, not in the queue's feeder thread (which only prints the error and drops the item)
            ForkingPickler.dumps(result)
        except Exception as e:
            raise TypeError(f"the result of {getattr(fn, '__name__', fn)!s} cannot be sent back (pickled): {e}") from e
        q.put((rank, True, result))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        q.put((rank, False, (f"{type(e).__name__}: {e}", traceback.format_exc())))


def run_local_ranks(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), *,
                    timeout_s: float | None = None, threads: int = 1, pg_timeout_s: float = 600.0,
                    what: str = "rank") -> list[Any]:
    """``fn(env, *args)`` on ``world_size`` spawned gloo ranks of this host; their results by rank.

    Args:
        fn: a module-level function ``(ShardingEnv, *args) -> picklable``; it runs inside an
            initialised gloo group (collectives through :mod:`dlrmctl.distributed.comm`).
        world_size: ranks to spawn (>= 1).
        timeout_s: wall-clock limit for all ranks (seconds); None: no limit (a dead rank is
            still noticed within a second).
        threads: intra-op threads per rank (``OMP_NUM_THREADS`` and ``torch.set_num_threads``).
        pg_timeout_s: the process group's collective timeout (seconds).
        what: how errors name the job (e.g. ``"reshard"``).

    Returns:
        ``[result of rank 0, ..., result of rank world_size - 1]``.

    Raises:
        ValueError: ``world_size`` < 1.
        LocalRanksError: a rank raised (its error in the message, its traceback in
            ``remote_traceback``), a rank
            died (its exit code), or ``timeout_s`` passed; the other ranks are killed.
    """
    import torch.multiprocessing as mp

    from dlrmctl.distributed.env import host_rendezvous

    if world_size < 1:
        raise ValueError(f"{what}: world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    store = host_rendezvous(pg_timeout_s)  # served here until the ranks are done
    port = store.port
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, threads, pg_timeout_s, fn, tuple(args), q,
                                                           os.getpid()),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    exited_empty: set[int] = set()  # exited 0 with nothing received by the previous poll
    try:
        while len(results) < world_size:
            try:
                r, ok, val = q.get(timeout=1.0)
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
                if dead:
                    raise LocalRanksError(f"{what}: rank(s) {dead} died (exit codes "
                                          f"{[procs[i].exitcode for i in dead]})", dead[0]) from None
                # a rank that exited 0 has flushed its queue item: still none a poll later, it sent nothing
                silent = sorted(exited_empty - set(results))
                if silent:
                    raise LocalRanksError(f"{what}: rank(s) {silent} exited (code 0) without sending a result",
                                          silent[0]) from None
                exited_empty = {i for i, p in enumerate(procs) if p.exitcode == 0 and i not in results}
                if deadline is not None and time.monotonic() > deadline:
                    raise LocalRanksError(f"{what}: the {world_size} ranks did not finish within "
                                          f"{timeout_s:.0f} s (finished: {sorted(results)})") from None
                continue
            if not ok:
                raise LocalRanksError(f"{what}: rank {r}: {val[0]}", r, val[1])
            results[r] = val
    finally:
        done = len(results) == world_size
        for p in procs:
            if not done and p.is_alive():
                p.kill()
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]
