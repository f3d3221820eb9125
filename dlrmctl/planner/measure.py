"""The timed measurements of ``dlrmctl plan --calibrate`` (:mod:`dlrmctl.planner.calibrate` turns them
into a topology file): memory bandwidth, embedding lookups per kernel, one op's dispatch, and
the collectives on 2 gloo ranks, each the median of :data:`REPEATS` repeats after a warm-up,
each bounded in time.  Importing this module does not import torch.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

TABLE_ROWS, DIM, BATCH, POOL = 500_000, 64, 2048, 20
NARROW_DIM = 16  #: second width of the fused lookup fit (``fit_fused_lookup``)
IDIST_POOL = 80  #: ids per bag of the input-dist calibration batch (``input_dist_bw_gbps``)
POOLED_GROUPS = 2  #: groups (sharding types) of the output-dist calibration (``output_dist_bw_gbps``)
#: calls per median of the fused pair (dev VM, 3 back-to-back runs: 30 calls gave 8.5-13.2 ns per id, 200 gave
#: 11.6-13.0; two full calibrations minutes apart still gave 12.3 and 8.6)
SPLIT_ITERS = 200
#: repeats of every microbenchmark (median kept, min-max reported); the dev VM's spread between whole
#: calibrations (gloo 0.59-0.89 GB/s, fused per id 7.7-16.7 ns) came from single samples
REPEATS = 5


@dataclass(frozen=True)
class Sample:
    """One calibrated figure: the median of its repeats and their range (the unit of the values)."""

    median: float
    lo: float
    hi: float

    @staticmethod
    def of(values: Sequence[float]) -> "Sample":
        """Median and min-max of ``values`` (non-empty)."""
        if not values:
            raise ValueError("a calibration sample needs at least one value")
        return Sample(statistics.median(values), min(values), max(values))

    def inverse(self, k: float) -> "Sample":
        """``k / value`` (seconds -> a rate): the median maps to the median, lo and hi swap."""
        return Sample(k / self.median, k / self.hi, k / self.lo)

    def scaled(self, k: float) -> "Sample":
        """The same figure in another unit (``k > 0``: every field times ``k``; ``k < 0`` swaps lo / hi)."""
        a, b = self.lo * k, self.hi * k
        return Sample(self.median * k, min(a, b), max(a, b))


def median_of(measure: Callable[[], float], repeats: int = REPEATS, warmup: int = 1) -> Sample:
    """Run ``measure`` ``warmup`` times (discarded: first-touch page faults, lazy init, cold caches),
    then ``repeats`` times; the :class:`Sample` of the repeats.

    Args:
        measure: one measurement (any unit, e.g. seconds); called ``warmup + repeats`` times.

    Raises:
        ValueError: ``repeats < 1``.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        measure()
    return Sample.of([measure() for _ in range(repeats)])


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


def measure_memory_bandwidth(nbytes: int = 256 << 20, repeats: int = REPEATS) -> Sample:
    """Bytes/s of a ``numpy.copyto`` of ``nbytes`` (read + write bytes / time), median of ``repeats`` copies."""
    import numpy as np

    src = np.ones(nbytes // 8, dtype=np.float64)
    dst = np.empty_like(src)

    def once() -> float:
        t = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - t

    return median_of(once, repeats).inverse(2 * nbytes)


def fwd_bytes(dim: int, pool: int = POOL) -> int:
    """Forward bytes of the calibration lookup as ``perf.estimate_shard`` counts them (fp32 rows, int32
    ids): ``BATCH * POOL`` ids in bags of ``pool`` (``BATCH * POOL / pool`` bags)."""
    ids = BATCH * POOL
    bags = ids // pool
    return (bags + ids) * 4 + ids * max(dim * 4, 64) + bags * dim * 4


def _lookup_bench(kernel: str, dim: int, rows: int,
                  pool: int = POOL) -> tuple[Callable[[], None], Callable[[], None]]:
    """``(forward, step)`` closures of one EBC lookup (module docstring): a ``rows x dim`` fp32
    table, ``BATCH * POOL`` uniform ids in bags of ``pool``, exact row-wise Adagrad; ``step`` is forward +
    backward (+ the dense kernel's optimizer step).  Three warm-up calls of each are made (a fresh
    table's pages are first touched by the first steps: on the dev VM the first 30 fused backward
    calls of the 128 MB table took 4x the later ones).

    Raises:
        RuntimeError: ``kernel == "fused"`` without FBGEMM (the caller skips it).
    """
    import torch

    from dlrmctl import _fbgemm
    from dlrmctl.modules.embedding_configs import EmbeddingBagConfig
    from dlrmctl.modules.embedding_modules import EmbeddingBagCollection, EmbeddingOptimizerSpec
    from dlrmctl.sparse import KeyedJaggedTensor
    from dlrmctl.optim.dense import embedding_optimizer_for_dense

    if kernel == "fused" and not _fbgemm.ensure_checked():
        raise RuntimeError("the fused kernel needs fbgemm_gpu")
    table = EmbeddingBagConfig(name="cal", num_embeddings=rows, embedding_dim=dim, feature_names=["f"])
    spec = EmbeddingOptimizerSpec("exact_rowwise_adagrad", lr=0.01)
    ebc = EmbeddingBagCollection([table], compute_kernel=kernel, optimizer=spec)
    params = [p for p in ebc.parameters() if p.requires_grad]
    opt = embedding_optimizer_for_dense(params, spec.type, spec.lr, spec.eps, 0.0) if kernel == "dense" else None
    gen = torch.Generator().manual_seed(0)
    kjt = KeyedJaggedTensor(["f"], torch.randint(0, rows, (BATCH * POOL,), generator=gen),
                            lengths=torch.full((BATCH * POOL // pool,), pool))

    def fwd() -> None:
        with torch.no_grad():
            ebc(kjt)

    def step() -> None:
        ebc(kjt).values().sum().backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()

    for _ in range(3):
        fwd()
        step()
    return fwd, step


def measure_lookups(kernel: str, tables: Sequence[tuple[int, ...]], max_s: float = 6.0, iters: int = 30,
                    repeats: int = REPEATS) -> list[tuple[Sample, Sample]]:
    """``[(forward s, backward s)]`` of one EBC lookup kernel per ``(dim, rows[, pool])`` table
    (:func:`_lookup_bench`), the tables measured in turn within each repeat, so that a change
    of load on the machine hits all of them alike (their differences are what the splits use).

    Each of ``repeats`` repeats times, per table, ``iters / repeats`` forward calls and as many
    forward + backward (+ optimizer) calls, at most ``max_s / (2 * repeats * len(tables))``
    seconds each, and keeps their medians; the backward of a repeat is its (forward + backward)
    - forward.  Returned per table: the :class:`Sample` over the repeats of each.

    Raises:
        RuntimeError: ``kernel == "fused"`` without FBGEMM (the caller skips it).
    """
    benches = [_lookup_bench(kernel, *t) for t in tables]
    n = max(3, iters // repeats)
    slice_s = max_s / (2 * repeats * len(benches))
    fs: list[list[float]] = [[] for _ in benches]
    bs: list[list[float]] = [[] for _ in benches]
    for _ in range(repeats):
        for i, (fwd, step) in enumerate(benches):
            t_f = statistics.median(_timed(fwd, n, slice_s, warmup=0))
            t_s = statistics.median(_timed(step, n, slice_s, warmup=0))
            fs[i].append(t_f)
            bs[i].append(max(0.0, t_s - t_f))
    return [(Sample.of(f), Sample.of(b)) for f, b in zip(fs, bs)]


def measure_lookup(kernel: str, max_s: float = 6.0, dim: int = DIM, rows: int = TABLE_ROWS,
                   iters: int = 30, repeats: int = REPEATS) -> tuple[Sample, Sample]:
    """``(forward s, backward s)`` of one EBC lookup kernel on a ``rows x dim`` fp32 table
    (:func:`measure_lookups` of that one table).

    Raises:
        RuntimeError: ``kernel == "fused"`` without FBGEMM (the caller skips it).
    """
    return measure_lookups(kernel, [(dim, rows)], max_s=max_s, iters=iters, repeats=repeats)[0]


def measure_op_overhead(repeats: int = REPEATS) -> Sample:
    """Seconds of one tiny torch op (a one-element ``add``): the per-op dispatch cost; each repeat the
    median of 400 calls."""
    import torch

    a, b = torch.ones(1), torch.ones(1)
    return median_of(lambda: statistics.median(_timed(lambda: torch.add(a, b), 400, 0.3, warmup=20)), repeats)


def _comm_rank(env) -> dict[str, list[float]]:
    """One rank of :func:`measure_comm` (in a gloo group of :func:`run_local_ranks`, 1 thread):
    per figure, :data:`REPEATS` medians in seconds."""
    import torch

    from dlrmctl.distributed.comm import all_to_all_ints, barrier, pooled_all_to_all
    from dlrmctl.distributed.model_parallel import plan_from_types
    from dlrmctl.distributed.sharded_ebc import ShardedEmbeddingBagCollection
    from dlrmctl.modules.embedding_configs import EmbeddingBagConfig
    from dlrmctl.sparse import KeyedJaggedTensor

    world = env.world_size
    pg = env.pg
    # every rank runs the same number of iterations (a fixed count, not a time slice)
    small = torch.zeros(world, dtype=torch.int64)
    n = (8 << 20) // 4
    big = torch.zeros(n, dtype=torch.float32)
    splits = [n // world] * world
    tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=16, embedding_dim=4, feature_names=[f"f{i}"])
              for i in range(2)]
    kjt = KeyedJaggedTensor(["f0", "f1"], torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 1, 1, 1]))
    sebcs = {name: ShardedEmbeddingBagCollection(tables, plan_from_types(tables, types, world, world), env,
                                                 check_ids=False)
             for name, types in (("one", {"t0": "table_wise", "t1": "table_wise"}),
                                 ("two", {"t0": "table_wise", "t1": "row_wise"}))}
    # warm-up, then REPEATS rounds, each one median per figure; every rank runs the same number of
    # iterations (fixed counts, not time slices), so the collectives pair up
    _timed(lambda: all_to_all_ints(small, [1] * world, [1] * world, pg), 20, 1e9, warmup=0)
    _timed(lambda: all_to_all_ints(big, splits, splits, pg), 2, 1e9, warmup=0)
    for sebc in sebcs.values():
        for _ in range(10):
            sebc(kjt).values().sum().backward()
    # the input dist of the one-type EBC: BATCH samples x IDIST_POOL ids per feature vs the two
    # samples above (its fixed part); the difference is what its bytes cost (input_dist_bw)
    gen = torch.Generator().manual_seed(env.rank)
    kjt_big = KeyedJaggedTensor(["f0", "f1"], torch.randint(0, 16, (2 * BATCH * IDIST_POOL,), generator=gen),
                                lengths=torch.full((2 * BATCH,), IDIST_POOL))
    one = sebcs["one"]
    for _ in range(5):
        one.input_dist(kjt_big).wait()
    idist_bytes = float(one.input_dist_bytes[1])  # data bytes sent = received per rank (symmetric batch)
    # the output dist's path: pooled_all_to_all forward + backward of POOLED_GROUPS groups, 4 MiB per rank
    bs = [2 * BATCH // world] * world
    width = (4 << 20) // 4 // sum(bs) // POOLED_GROUPS
    base = [torch.randn(sum(bs), width) for _ in range(POOLED_GROUPS)]
    widths = [[width] * POOLED_GROUPS for _ in range(world)]

    def pooled() -> None:
        ins = [b.clone().requires_grad_() for b in base]
        out = [t for row in pooled_all_to_all(ins, bs, widths, pg) for t in row]
        torch.autograd.grad(out, ins, [torch.ones_like(t) for t in out])  # the gradient all-to-all, no .grad

    pooled_leaving = float(sum(bs) * width * POOLED_GROUPS * 4 * (world - 1) / world)  # bytes, per direction
    _timed(pooled, 3, 1e9, warmup=0)
    res: dict[str, list[float]] = {"a2a_small_s": [], "a2a_8mib_s": [], "step_one_type_s": [],
                                   "step_two_types_s": [], "idist_small_s": [], "idist_big_s": [],
                                   "idist_extra_s": [], "idist_bytes": [], "pooled_a2a_s": [],
                                   "pooled_bytes": []}
    for _ in range(REPEATS):
        barrier(pg)
        res["a2a_small_s"].append(statistics.median(
            _timed(lambda: all_to_all_ints(small, [1] * world, [1] * world, pg), 60, 1e9, warmup=0)))
        # the mean of 10, not the median: loopback TCP throughput swings call to call (0.7-1.9 GB/s
        # on the dev VM) and a training step pays its slow calls too
        res["a2a_8mib_s"].append(statistics.fmean(
            _timed(lambda: all_to_all_ints(big, splits, splits, pg), 10, 1e9, warmup=0)))
        steps: dict[str, list[float]] = {"one": [], "two": []}
        barrier(pg)
        for _ in range(30):  # alternate, so that a load change on the machine hits both alike
            for name, sebc in sebcs.items():
                t = time.perf_counter()
                sebc(kjt).values().sum().backward()
                steps[name].append(time.perf_counter() - t)
        res["step_one_type_s"].append(statistics.median(steps["one"]))
        res["step_two_types_s"].append(statistics.median(steps["two"]))
        idist: dict[str, list[float]] = {"small": [], "big": []}
        barrier(pg)
        for _ in range(20):  # alternate (as above): the difference is what the bytes cost
            for name, x in (("small", kjt), ("big", kjt_big)):
                t = time.perf_counter()
                one.input_dist(x).wait()
                idist[name].append(time.perf_counter() - t)
        small_s, big_s = statistics.median(idist["small"]), statistics.median(idist["big"])
        res["idist_small_s"].append(small_s)
        res["idist_big_s"].append(big_s)
        res["idist_extra_s"].append(max(big_s - small_s, 1e-5))  # >= 10 us: a noisy round cannot give an infinite rate
        res["idist_bytes"].append(idist_bytes)
        barrier(pg)
        res["pooled_a2a_s"].append(statistics.fmean(_timed(pooled, 10, 1e9, warmup=0)))  # mean: as a2a_8mib_s
        res["pooled_bytes"].append(pooled_leaving)
    return res


def measure_comm(world: int = 2, max_s: float = 30.0) -> dict[str, Sample]:
    """Collective latency / bandwidth and the per-group fixed cost on ``world`` spawned gloo ranks.

    Returns:
        per figure (seconds: ``a2a_small_s``, ``a2a_8mib_s``, ``step_one_type_s``,
        ``step_two_types_s``, ``idist_small_s``, ``idist_big_s``, ``idist_extra_s`` = big - small
        of the same round, ``pooled_a2a_s``: ``pooled_all_to_all`` forward + backward, 4 MiB per
        rank; bytes: ``idist_bytes``, the id all-to-all bytes each rank receives in the big input
        dist, ``pooled_bytes``, the bytes leaving a rank in each direction of the pooled one), the :class:`Sample` over :data:`REPEATS` rounds of the slowest
        rank's figure in each round.

    Raises:
        RuntimeError: a rank failed or did not finish within ``max_s`` (its processes are ended).
    """
    from dlrmctl.distributed.local_ranks import LocalRanksError, run_local_ranks

    try:
        per_rank = run_local_ranks(_comm_rank, world, timeout_s=max_s, pg_timeout_s=max_s + 30,
                                   what="calibration")
    except LocalRanksError as e:
        raise RuntimeError(f"the {world} gloo calibration ranks: {e}") from None
    got = dict(enumerate(per_rank))
    return {k: Sample.of([max(got[r][k][i] for r in got) for i in range(REPEATS)])  # type: ignore[index]
            for k in got[0]}  # type: ignore[index]
