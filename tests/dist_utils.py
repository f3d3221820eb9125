"""Run a function on N gloo ranks (CPU processes), with a hard time bound.

``run_multiprocess(fn, world_size, *args)`` starts ``world_size`` processes
(``forkserver``: torch / fbgemm are imported once in the fork server, so each
rank starts in well under a second), initialises a gloo process group at a
rendezvous store this process serves on localhost, calls ``fn(env, *args)`` on every rank with a
:class:`~dlrmctl.distributed.env.ShardingEnv` and returns the per-rank results.
A rank's exception is re-raised in the caller with its traceback; a job that
exceeds ``timeout_s`` is killed and raises ``TimeoutError`` (never hangs CI).

``fn`` and ``args`` must be picklable (module-level functions).
"""

from __future__ import annotations

import os
import pickle
import queue
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "dlrmctl", "dlrmctl.distributed.sharded_ebc"])
        _CTX = ctx
    return _CTX


def _worker(rank: int, world_size: int, local_world_size: int, port: int, timeout_s: float, backend: str,
            fn: Callable, args: tuple, q) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    from dlrmctl.distributed.env import init_process_group_tcp

    torch.set_num_threads(1)
    try:
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        env = init_process_group_tcp(rank, world_size, port, backend, device=device, timeout_s=timeout_s,
                                     local_world_size=local_world_size)
        result = fn(env, *args)
        # plain pickle bytes: tensors travel by value, not as shared-memory handles that
        # die with this process
        q.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put((rank, False, traceback.format_exc()))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def run_multiprocess(fn: Callable, world_size: int, *args: Any, local_world_size: int | None = None,
                     timeout_s: float = 120.0, backend: str = "gloo") -> list[Any]:
    """``[fn(env_rank0, *args), ..., fn(env_rank{N-1}, *args)]`` computed on N ranks
    (gloo on CPU; ``backend="nccl"`` puts rank r on ``cuda:r``).

    Raises:
        RuntimeError: a rank raised (message carries its traceback).
        TimeoutError: the ranks did not all finish within ``timeout_s``.
    """
    from dlrmctl.distributed.env import host_rendezvous

    ctx = _context()
    q = ctx.Queue()
    store = host_rendezvous(timeout_s)  # served here until the ranks are done (no free port looked up first)
    port = store.port
    lws = local_world_size or world_size
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, lws, port, timeout_s, backend, fn, args, q), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    results: dict[int, Any] = {}
    error: str | None = None
    try:
        while len(results) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"{world_size} ranks did not finish within {timeout_s:.0f}s; done: {sorted(results)}"
                )
            try:
                rank, ok, val = q.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
                if dead:
                    raise RuntimeError(f"rank(s) {dead} died (exit codes {[procs[i].exitcode for i in dead]})")
                continue
            if not ok:
                error = f"rank {rank} failed:\n{val}"
                break
            results[rank] = pickle.loads(val)
    finally:
        if error is not None or len(results) < world_size:
            for p in procs:
                if p.is_alive():
                    p.kill()
        for p in procs:
            p.join(timeout=10)
    if error is not None:
        raise RuntimeError(error)
    return [results[r] for r in range(world_size)]
