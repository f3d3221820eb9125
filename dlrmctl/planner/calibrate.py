"""``dlrmctl plan --calibrate``: measure this machine and write a CPU/gloo topology file.

What ``dlrmctl train --nproc N`` runs on CPU (N gloo ranks, one thread each) is
measured with the same code it runs, in bounded time (each measurement stops after
its time slice; the whole run stays under :data:`TIME_BUDGET_S`):

* ``ddr_bw_gbps``: memory bandwidth, (read + write bytes) / time of a 256 MiB
  ``numpy.copyto`` (best of 3).
* ``fused_efficiency`` / ``dense_efficiency``: one 500,000 x 64 fp32 table (128 MB,
  well beyond the caches) in an :class:`~dlrmctl.modules.embedding_modules.EmbeddingBagCollection`
  with the ``fused`` (FBGEMM TBE, when installed) and ``dense`` kernels, batch 2048,
  20 random ids per bag, one thread: forward bytes as the perf model counts them
  (ids + lengths, ``ids * max(d*4, 64)`` rows, pooled output) / forward time /
  memory bandwidth.
* ``bwd_compute_multiplier`` / ``dense_bwd_compute_multiplier``: (forward + backward
  with the optimizer) / forward - 1 of the fused kernel (the dense one when FBGEMM is
  absent) / of the dense kernel (its sparse gradient and the torch optimizer step).
* ``fused_bwd_id_ns``: the fused backward is timed a second time on a 2,000,000 x 16
  table (the same 128 MB, the same number of ids; medians of 200 calls): the two backward times split it into
  ``bwd_compute_multiplier`` x the model's forward (bytes) plus a cost per id
  (:func:`split_fused_backward`; ``perf`` module docstring: FBGEMM's CPU backward sorts
  the ids by row and runs the optimizer's per-row prologue whatever the width).
* ``kernel_launch_us``: median time of a one-element ``torch.add`` (per-op dispatch).
* on 2 spawned gloo ranks (localhost TCP): ``collective_us`` = median time of a
  one-element-per-rank ``all_to_all_single``; ``intra_host_bw_gbps`` = bytes leaving a
  rank / time of an 8 MiB ``all_to_all_single``; ``lookup_fixed_us`` = the step time
  (forward + backward) of a table_wise sharded EBC on two 16-row tables, minus its 4
  collectives and 2 kernel launches: what one sharding group costs per step whatever
  its ids.  The step of a table_wise + row_wise EBC (two groups) is measured in
  alternation with it and recorded under ``measured`` as a check.  One machine has no inter-host link: the
  inter-host figures are set to the loopback ones (ranks pretending to be hosts with
  ``sharding.local_world_size`` talk over the same loopback).

The raw figures go into the file under ``measured``.  Import of this module does not
import torch; :func:`calibrate` does.
"""

from __future__ import annotations

import datetime
import os
import socket
import statistics
import time
from typing import Callable

from dlrmctl.planner.types import GB, DevicePreset

TIME_BUDGET_S = 60.0  #: the whole calibration must finish within this (seconds)
_TABLE_ROWS, _DIM, _BATCH, _POOL = 500_000, 64, 2048, 20
_NARROW_DIM = 16  #: second width of the fused backward split (``split_fused_backward``)
#: calls per median of the fused pair (dev VM, 3 back-to-back runs: 30 calls gave 8.5-13.2 ns per id, 200 gave
#: 11.6-13.0; two full calibrations minutes apart still gave 12.3 and 8.6)
_SPLIT_ITERS = 200


def _timed(fn: Callable[[], object], max_iters: int, max_s: float, warmup: int = 1) -> list[float]:
    """Seconds of each call of ``fn`` (after ``warmup`` calls), at most ``max_iters`` calls or ``max_s`` seconds."""
    for _ in range(warmup):
        fn()
    out: list[float] = []
    t_end = time.perf_counter() + max_s
    while len(out) < max_iters and (not out or time.perf_counter() < t_end):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def measure_memory_bandwidth(nbytes: int = 256 << 20) -> float:
    """Bytes/s of a ``numpy.copyto`` of ``nbytes`` (read + write bytes / best time of 3)."""
    import numpy as np

    src = np.ones(nbytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    best = min(_timed(lambda: np.copyto(dst, src), 3, 5.0))
    return 2 * nbytes / best


def _fwd_bytes(dim: int) -> int:
    """Forward bytes of the calibration lookup as ``perf.estimate_shard`` counts them (fp32 rows, int32 ids)."""
    ids = _BATCH * _POOL
    return (_BATCH + ids) * 4 + ids * max(dim * 4, 64) + _BATCH * dim * 4


def measure_lookup(kernel: str, mem_bw: float, max_s: float = 6.0, dim: int = _DIM,
                   rows: int = _TABLE_ROWS, iters: int = 30) -> tuple[float, float, float, float]:
    """``(efficiency, backward multiplier, forward s, backward s)`` of one EBC lookup kernel
    (see the module docstring) on a ``rows x dim`` fp32 table, ``_BATCH`` bags of ``_POOL`` ids.

    The backward seconds are (forward + backward with the optimizer) - forward, medians of at
    most ``iters`` calls each (and at most ``max_s / 2`` seconds each).

    Raises:
        RuntimeError: ``kernel == "fused"`` without FBGEMM (the caller skips it).
    """
    import torch

    from dlrmctl import _fbgemm
    from dlrmctl.modules.embedding_configs import EmbeddingBagConfig
    from dlrmctl.modules.embedding_modules import EmbeddingBagCollection, EmbeddingOptimizerSpec
    from dlrmctl.sparse import KeyedJaggedTensor
    from dlrmctl.train.optim import embedding_optimizer_for_dense

    if kernel == "fused" and not _fbgemm.ensure_checked():
        raise RuntimeError("the fused kernel needs fbgemm_gpu")
    table = EmbeddingBagConfig(name="cal", num_embeddings=rows, embedding_dim=dim, feature_names=["f"])
    spec = EmbeddingOptimizerSpec("exact_rowwise_adagrad", lr=0.01)
    ebc = EmbeddingBagCollection([table], compute_kernel=kernel, optimizer=spec)
    params = [p for p in ebc.parameters() if p.requires_grad]
    opt = embedding_optimizer_for_dense(params, spec.type, spec.lr, spec.eps, 0.0) if kernel == "dense" else None
    gen = torch.Generator().manual_seed(0)
    kjt = KeyedJaggedTensor(["f"], torch.randint(0, rows, (_BATCH * _POOL,), generator=gen),
                            lengths=torch.full((_BATCH,), _POOL))

    def fwd() -> None:
        with torch.no_grad():
            ebc(kjt)

    def step() -> None:
        ebc(kjt).values().sum().backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()

    t_f = statistics.median(_timed(fwd, iters, max_s / 2))
    t_s = statistics.median(_timed(step, iters, max_s / 2))
    return _fwd_bytes(dim) / t_f / mem_bw, max(0.1, (t_s - t_f) / t_f), t_f, t_s - t_f


def split_fused_backward(eff: float, mem_bw: float, bwd_wide_s: float, bwd_narrow_s: float,
                         narrow_dim: int) -> tuple[float, float]:
    """Split the fused backward into a per-byte and a per-id part from two widths over the same ids.

    The perf model's fused backward is ``mult * fwd + ids * per_id`` with ``fwd = bytes(dim) /
    (eff * mem_bw)`` (``perf.estimate_shard``); two measurements (``_DIM`` and ``narrow_dim``
    columns, ``_BATCH * _POOL`` ids, tables of the same bytes) give both unknowns::

        mult = (bwd_wide - bwd_narrow) / (fwd(_DIM) - fwd(narrow_dim))
        per_id = (bwd_wide - mult * fwd(_DIM)) / ids

    ``mult`` is kept >= 0.1 and ``per_id`` >= 0 (noise can push either below).

    Returns:
        ``(bwd_compute_multiplier, fused_bwd_id seconds)``.
    """
    ids = _BATCH * _POOL
    bw = eff * mem_bw
    f_wide, f_narrow = _fwd_bytes(_DIM) / bw, _fwd_bytes(narrow_dim) / bw
    mult = max(0.1, (bwd_wide_s - bwd_narrow_s) / (f_wide - f_narrow))
    return mult, max(0.0, (bwd_wide_s - mult * f_wide) / ids)


def measure_op_overhead() -> float:
    """Seconds of one tiny torch op (a one-element ``add``): the per-op dispatch cost."""
    import torch

    a, b = torch.ones(1), torch.ones(1)
    return statistics.median(_timed(lambda: torch.add(a, b), 2000, 1.0, warmup=100))


def _comm_worker(rank: int, world: int, port: int, max_s: float, q) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    try:
        from dlrmctl.distributed.comm import all_to_all_ints, barrier
        from dlrmctl.distributed.env import destroy_distributed, init_process_group_tcp
        from dlrmctl.distributed.model_parallel import plan_from_types
        from dlrmctl.distributed.sharded_ebc import ShardedEmbeddingBagCollection
        from dlrmctl.modules.embedding_configs import EmbeddingBagConfig
        from dlrmctl.sparse import KeyedJaggedTensor

        env = init_process_group_tcp(rank, world, port, "gloo", timeout_s=max_s + 30)
        pg = env.pg
        # every rank runs the same number of iterations (a fixed count, not a time slice)
        small = torch.zeros(world, dtype=torch.int64)
        lat = _timed(lambda: all_to_all_ints(small, [1] * world, [1] * world, pg), 300, 1e9, warmup=20)
        n = (8 << 20) // 4
        big = torch.zeros(n, dtype=torch.float32)
        splits = [n // world] * world
        bw = _timed(lambda: all_to_all_ints(big, splits, splits, pg), 10, 1e9, warmup=2)

        tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=16, embedding_dim=4, feature_names=[f"f{i}"])
                  for i in range(2)]
        kjt = KeyedJaggedTensor(["f0", "f1"], torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 1, 1, 1]))
        sebcs = {name: ShardedEmbeddingBagCollection(tables, plan_from_types(tables, types, world, world), env,
                                                     check_ids=False)
                 for name, types in (("one", {"t0": "table_wise", "t1": "table_wise"}),
                                     ("two", {"t0": "table_wise", "t1": "row_wise"}))}
        steps: dict[str, list[float]] = {"one": [], "two": []}
        barrier(pg)
        for i in range(160):  # alternate, so that a load change on the machine hits both alike
            for name, sebc in sebcs.items():
                t = time.perf_counter()
                sebc(kjt).values().sum().backward()
                if i >= 10:
                    steps[name].append(time.perf_counter() - t)
        q.put((rank, {"a2a_small_s": statistics.median(lat), "a2a_8mib_s": statistics.median(bw),
                      "step_one_type_s": statistics.median(steps["one"]),
                      "step_two_types_s": statistics.median(steps["two"])}))
        destroy_distributed()
    except BaseException as e:  # reported to the parent, which raises it
        q.put((rank, e))


def measure_comm(world: int = 2, max_s: float = 30.0) -> dict[str, float]:
    """Collective latency / bandwidth and the per-group fixed cost on ``world`` spawned gloo ranks.

    Returns:
        the slowest rank's medians (seconds): ``a2a_small_s``, ``a2a_8mib_s``,
        ``step_one_type_s``, ``step_two_types_s``.

    Raises:
        RuntimeError: a rank failed or did not finish within ``max_s`` (its processes are ended).
    """
    import queue

    import torch.multiprocessing as mp

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_comm_worker, args=(r, world, port, max_s, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, object] = {}
    deadline = time.monotonic() + max_s
    try:
        while len(got) < world:
            try:
                r, v = q.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"the {world} gloo calibration ranks did not finish within {max_s:.0f} s") from None
            if isinstance(v, BaseException):
                raise RuntimeError(f"calibration rank {r} failed: {v!r}")
            got[r] = v
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
    return {k: max(got[r][k] for r in got) for k in got[0]}  # type: ignore[index]


def calibrate(log: Callable[[str], None] = lambda s: None) -> tuple[DevicePreset, dict]:
    """Measure this machine (module docstring) in under :data:`TIME_BUDGET_S` seconds.

    Returns:
        ``(preset, measured)``: a ``cpu`` :class:`DevicePreset` for :func:`save_topology_file`
        and the raw figures (GB/s, microseconds, ratios).

    Raises:
        RuntimeError: the gloo ranks failed or timed out.
    """
    import torch

    from dlrmctl import _fbgemm

    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        mem_bw = measure_memory_bandwidth()
        log(f"memory bandwidth (numpy copy): {mem_bw / GB:.2f} GB/s")
        launch = measure_op_overhead()
        log(f"per-op dispatch: {launch * 1e6:.2f} us")
        eff: dict[str, float] = {}
        mults: dict[str, float] = {}
        per_id = 0.0
        fused_bwd: tuple[float, float] | None = None
        for kernel in ("fused", "dense"):
            if kernel == "fused" and not _fbgemm.ensure_checked():
                log("fused kernel: fbgemm_gpu not installed, keeping the default efficiency")
                continue
            # the fused pair below is split by a difference: more calls per median narrow its spread (_SPLIT_ITERS)
            iters = _SPLIT_ITERS if kernel == "fused" else 30
            e, m, _, bwd_wide = measure_lookup(kernel, mem_bw, iters=iters)
            eff[kernel], mults[kernel] = e, m
            log(f"{kernel} lookup: {e * mem_bw / GB:.2f} GB/s = {e:.3f} of memory bandwidth; backward / forward {m:.2f}")
            if kernel == "fused":
                # same ids and table bytes, a quarter of the width: what the backward pays per id
                _, _, _, bwd_narrow = measure_lookup(kernel, mem_bw, dim=_NARROW_DIM,
                                                     rows=_TABLE_ROWS * _DIM // _NARROW_DIM, iters=iters)
                mults[kernel], per_id = split_fused_backward(e, mem_bw, bwd_wide, bwd_narrow, _NARROW_DIM)
                fused_bwd = (bwd_wide, bwd_narrow)
                log(f"fused backward: {bwd_wide * 1e3:.2f} ms at {_DIM} columns, {bwd_narrow * 1e3:.2f} ms at "
                    f"{_NARROW_DIM} over the same ids = {per_id * 1e9:.2f} ns per id + {mults[kernel]:.2f} x forward")
    finally:
        torch.set_num_threads(threads)
    left = TIME_BUDGET_S - (time.perf_counter() - t0) - 5
    comm = measure_comm(2, max_s=max(10.0, left))
    coll = comm["a2a_small_s"]
    a2a_bw = (8 << 20) * 0.5 / comm["a2a_8mib_s"]  # half of each rank's 8 MiB leaves it on 2 ranks
    # a one-type step on tiny tables: its 4 collectives, one fused TBE forward + backward, and the
    # group's fixed cost (routing, lookup call, combine: Python and dispatch)
    group = max(0.0, comm["step_one_type_s"] - 4 * coll - 2 * launch)
    log(f"gloo all-to-all: {coll * 1e6:.0f} us per call, {a2a_bw / GB:.2f} GB/s; one sharding group: "
        f"{group * 1e6:.0f} us per step")
    measured = {
        "ddr_copy_gbps": round(mem_bw / GB, 3),
        "op_dispatch_us": round(launch * 1e6, 3),
        **{f"{k}_lookup_gbps": round(v * mem_bw / GB, 3) for k, v in eff.items()},
        **({"fused_bwd_ms": round(fused_bwd[0] * 1e3, 3), f"fused_bwd_dim{_NARROW_DIM}_ms": round(fused_bwd[1] * 1e3, 3)}
           if fused_bwd is not None else {}),
        "gloo_a2a_small_us": round(coll * 1e6, 1),
        "gloo_a2a_8mib_ms": round(comm["a2a_8mib_s"] * 1e3, 3),
        "sebc_step_one_type_ms": round(comm["step_one_type_s"] * 1e3, 3),
        "sebc_step_two_types_ms": round(comm["step_two_types_s"] * 1e3, 3),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    preset = DevicePreset(
        compute_device="cpu", hbm_gb=0.0, ddr_gb=None, hbm_bw_gbps=0.0, ddr_bw_gbps=round(mem_bw / GB, 3),
        intra_host_bw_gbps=round(a2a_bw / GB, 4), inter_host_bw_gbps=round(a2a_bw / GB, 4),
        default_gpus_per_host=None,
        source=f"dlrmctl plan --calibrate on {socket.gethostname()} at "
               f"{datetime.datetime.now().isoformat(timespec='seconds')} (CPU, gloo, 1 thread per rank)",
        kernel_launch_us=round(launch * 1e6, 3), collective_us=round(coll * 1e6, 1),
        inter_host_collective_us=round(coll * 1e6, 1), lookup_fixed_us=round(group * 1e6, 1),
        fused_efficiency=round(eff["fused"], 4) if "fused" in eff else None,
        dense_efficiency=round(eff["dense"], 4) if "dense" in eff else None,
        bwd_compute_multiplier=round(mults.get("fused", mults["dense"]), 3),
        dense_bwd_compute_multiplier=round(mults["dense"], 3),
        fused_bwd_id_ns=round(per_id * 1e9, 3) if "fused" in eff else None,
    )
    return preset, measured
