"""``dlrmctl plan --calibrate``: measure this machine and write a CPU/gloo topology file.

What ``dlrmctl train --nproc N`` runs on CPU (N gloo ranks, one thread each) is
measured with the same code it runs, in bounded time (each measurement stops after
its time slice; the whole run stays under :data:`TIME_BUDGET_S`):

Every microbenchmark is repeated :data:`REPEATS` (5) times after a warm-up and the
median of the repeats is kept (one noisy sample no longer sets the model); the min-max of
the repeats goes into the file under ``measured.spread`` and into its header comment, so
a user sees how noisy the machine was.  A repeat of a per-call figure (lookup, op
dispatch, collective) is itself the median of a slice of calls.

* ``ddr_bw_gbps``: memory bandwidth, (read + write bytes) / time of a 256 MiB
  ``numpy.copyto``.
* ``llc_mb``: this machine's last-level cache (:func:`dlrmctl.planner.devices.detect_llc_bytes`).
* ``fused_cache_speedup`` / ``dense_cache_speedup``: (forward + backward with the optimizer)
  of the 128 MB table below / of a table of ``llc_mb / 4`` (the same dim, ids per step and
  bags; it fits the cache).  The 128 MB table itself hits the cache for a fraction
  ``h0 = C / S`` of its lookups (uniform ids; ``cache.che_hit_fractions`` of one table), so
  the measured ratio ``r`` is corrected to the all-DRAM one, ``s = (r - h0) / (1 - h0)``,
  and the DRAM times below are scaled by ``(1 - h0 / r) / (1 - h0)`` before the kernel
  efficiency, the multiplier and the per-id cost are derived from them: the perf model,
  given ``h0``, then reproduces the measured times.
* ``fused_efficiency`` / ``dense_efficiency``: one 500,000 x 64 fp32 table (128 MB,
  well beyond the caches) in an :class:`~dlrmctl.modules.embedding_modules.EmbeddingBagCollection`
  with the ``fused`` (FBGEMM TBE, when installed) and ``dense`` kernels, batch 2048,
  20 random ids per bag, one thread: forward bytes as the perf model counts them
  (ids + lengths, ``ids * max(d*4, 64)`` rows, pooled output) / forward time /
  memory bandwidth.
* ``bwd_compute_multiplier`` / ``dense_bwd_compute_multiplier``: (forward + backward
  with the optimizer) / forward - 1 of the fused kernel (the dense one when FBGEMM is
  absent) / of the dense kernel (its sparse gradient and the torch optimizer step:
  the dense kernel's optimizer pass is inside this multiplier, and ``perf.estimate_shard``
  adds no separate one when it is set; :func:`kernel_figures`).
* ``fused_fwd_id_ns``, ``fused_fwd_bag_ns``, ``fused_bwd_bag_ns``: the fused lookup is
  timed on three tables in turn within each repeat — 64 columns in bags of 20, 16 columns
  (same bytes, same bags), 64 columns in bags of one (same ids) — and
  :func:`fit_fused_lookup` splits forward and backward into bytes, a cost per id and a cost
  per bag; ``fused_efficiency`` is then the bytes' share (a fitted figure: it can exceed 1,
  the prefetcher hides row bytes).
* ``fused_bwd_id_ns``: the same three lookups' backward (+ optimizer) times split it into
  ``bwd_compute_multiplier`` x the model's forward bytes, a cost per id and a cost per bag
  (:func:`fit_fused_lookup`; ``perf`` module docstring: FBGEMM's CPU backward sorts the ids
  by row and runs the optimizer's per-row prologue whatever the width).
* ``kernel_launch_us``: median time of a one-element ``torch.add`` (per-op dispatch).
* on 2 spawned gloo ranks (localhost TCP): ``collective_us`` = median time of a
  one-element-per-rank ``all_to_all_single``; ``intra_host_bw_gbps`` = bytes leaving a
  rank / mean time of an 8 MiB ``all_to_all_single`` (10 calls per repeat); ``lookup_fixed_us`` = the step time
  (forward + backward) of a table_wise sharded EBC on two 16-row tables, minus its 4
  collectives and 2 kernel launches: what one sharding group costs per step whatever
  its ids.  ``input_dist_bw_gbps`` = the id all-to-all bytes a rank receives / (time of
  that EBC's ``input_dist(kjt).wait()`` with ``BATCH`` samples of ``IDIST_POOL`` ids per
  feature - the same with two samples), the two alternating 20 times per repeat and the
  difference taken within each repeat (a load change hits both alike): what routing,
  packing, the all-to-all and unpacking cost per byte (``perf.input_dist_seconds``).
  ``output_dist_bw_gbps`` = the bytes leaving a rank, forward and backward, of
  ``comm.pooled_all_to_all`` (``POOLED_GROUPS`` groups, 4 MiB per rank, gradients by
  ``torch.autograd.grad``) / (its time - 2 ``collective_us``), the mean of 10 calls per
  repeat: what the output dist's bytes cost with its packing (``Topology.output_bw``).  The step of a table_wise + row_wise EBC (two groups) is measured in
  alternation with it and recorded under ``measured`` as a check.  One machine has no inter-host link: the
  inter-host figures are set to the loopback ones (ranks pretending to be hosts with
  ``sharding.local_world_size`` talk over the same loopback).

The raw figures go into the file under ``measured``.  Import of this module does not
import torch; :func:`calibrate` does.
"""

from __future__ import annotations

import datetime
import socket
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from dlrmctl.planner.devices import GB, MiB, DevicePreset, detect_llc_bytes
from dlrmctl.planner.measure import (  # noqa: F401  (the measurements, importable from here)
    BATCH,
    DIM,
    IDIST_POOL,
    NARROW_DIM,
    POOL,
    POOLED_GROUPS,
    REPEATS,
    SPLIT_ITERS,
    TABLE_ROWS,
    Sample,
    fwd_bytes,
    measure_comm,
    measure_lookup,
    measure_lookups,
    measure_memory_bandwidth,
    measure_op_overhead,
    median_of,
)

TIME_BUDGET_S = 60.0  #: the whole calibration must finish within this (seconds)


def lookup_efficiency(t_fwd_s: float, mem_bw: float, dim: int = DIM) -> float:
    """Fraction of ``mem_bw`` (bytes/s) the calibration lookup's forward reached: model bytes / time / bandwidth."""
    return fwd_bytes(dim) / t_fwd_s / mem_bw


def cache_correction(step_dram_s: float, step_cache_s: float, dram_hit: float) -> tuple[float, float]:
    """Split the DRAM table's step into its cache hits and misses (module docstring).

    Args:
        step_dram_s: step time on the calibration table that does not fit the cache.
        step_cache_s: step time on the table that fits (same ids, dim, bags).
        dram_hit: ``h0``, the fraction of the big table's lookups that hit anyway (0..1).

    Returns:
        ``(s, k)``: the all-DRAM / in-cache speedup ``s = (r - h0) / (1 - h0)`` (``r`` the
        measured ratio; kept >= 1: noise can push it below) and ``k = t_dram / step_dram_s``,
        the factor that turns the measured DRAM times into all-miss times
        (``(1 - h0 / r) / (1 - h0)``, 1 when ``s`` is clamped).
    """
    r = step_dram_s / step_cache_s
    h0 = min(max(dram_hit, 0.0), 0.99)
    s = (r - h0) / (1 - h0)
    if s < 1.0:
        return 1.0, 1.0
    return s, (1 - h0 / r) / (1 - h0)


@dataclass(frozen=True)
class KernelFigures:
    """What one kernel's calibration lookups give the perf model (``calibrate`` writes them to the file).

    Attributes:
        cache_speedup: all-DRAM / in-cache step-time ratio ``s`` (:func:`cache_correction`).
        dram_factor: ``k``, measured DRAM-table times -> all-miss times.
        efficiency: fraction of the memory bandwidth the all-miss forward reaches
            (``Topology.kernel_efficiency[kernel]``).
        bwd_multiplier: all-miss (backward + optimizer step) / forward, >= 0.1
            (``Topology.dense_bwd_compute_multiplier`` for the dense kernel: it contains the
            dense kernel's unfused optimizer step, so ``perf.estimate_shard`` adds none; the
            fused kernel's is refitted by :func:`fit_fused_lookup`).
    """

    cache_speedup: float
    dram_factor: float
    efficiency: float
    bwd_multiplier: float


def kernel_figures(fwd_dram_s: float, bwd_dram_s: float, fwd_cache_s: float, bwd_cache_s: float,
                   dram_hit: float, mem_bw: float) -> KernelFigures:
    """Derive one kernel's model figures from its two calibration lookups (module docstring).

    Args:
        fwd_dram_s, bwd_dram_s: forward and (backward + optimizer step) seconds on the
            ``TABLE_ROWS x DIM`` table (:func:`measure_lookup` medians).
        fwd_cache_s, bwd_cache_s: the same on the table that fits the cache.
        dram_hit: ``h0``, the big table's own cache hit fraction.
        mem_bw: memory bandwidth, bytes/s.

    With these figures, ``perf.estimate_shard`` of a table_wise shard of the big table at hit
    ``h0`` gives back ``fwd_dram_s`` and ``bwd_dram_s`` (``tests/planner/test_planner_cache.py``).

    Raises:
        ZeroDivisionError: a zero forward or step time.
    """
    s, k = cache_correction(fwd_dram_s + bwd_dram_s, fwd_cache_s + bwd_cache_s, dram_hit)
    t_f, t_b = fwd_dram_s * k, bwd_dram_s * k
    return KernelFigures(s, k, lookup_efficiency(t_f, mem_bw), max(0.1, t_b / t_f))


@dataclass(frozen=True)
class FusedFit:
    """The fused kernel's lookup model fitted to three calibration lookups (:func:`fit_fused_lookup`).

    Attributes:
        efficiency: fraction of the memory bandwidth the bytes go at (fitted: may exceed 1,
            the prefetcher hides row bytes).
        bwd_multiplier: backward seconds per forward-byte second.
        fwd_id_s, bwd_id_s: seconds per looked-up id, forward / backward (+ optimizer).
        fwd_bag_s, bwd_bag_s: seconds per bag (pooled output row), forward / backward.
    """

    efficiency: float
    bwd_multiplier: float
    fwd_id_s: float
    bwd_id_s: float
    fwd_bag_s: float
    bwd_bag_s: float


def fit_fused_lookup(mem_bw: float, fwd: Sequence[float], bwd: Sequence[float], narrow_dim: int,
                     fallback_eff: float) -> FusedFit:
    """Fit the fused lookup model to three lookups of the same ``I = BATCH * POOL`` ids.

    The perf model (``perf.estimate_shard``) charges a fused shard::

        fwd = bytes / (eff * mem_bw) + I * fwd_id + G * fwd_bag
        bwd = mult * bytes / (eff * mem_bw) + I * bwd_id + G * bwd_bag

    with ``G`` its bags (pooled rows).  ``fwd`` / ``bwd`` are the seconds of: ``DIM`` columns in
    ``BATCH`` bags of ``POOL`` (the wide lookup), ``narrow_dim`` columns in the same bags (a table
    of the same bytes), and ``DIM`` columns in bags of one id (``I`` bags).  The wide and narrow
    ones differ only in bytes (the slope per byte), the wide and one-id ones in bags and output
    bytes (the cost per bag); what is left of the wide one is per id.  On the dev VM (1 thread)
    the forward barely depends on the width (0.39 / 0.35 ms at 64 / 16 columns), and 20x the bags
    over the same ids cost 0.40 -> 0.72 ms forward and 0.9 -> 2.9 ms backward: a bytes-only model
    (TorchRec's) charges a column shard half a table's lookup and a one-id-per-bag table (every
    Criteo table) a fraction of what it costs.

    Negative fits from noise are clamped to 0; with no per-byte slope (the narrow lookup as slow
    as the wide one) the forward is charged as bytes at ``fallback_eff`` plus the per-bag fit.

    Returns:
        :class:`FusedFit`.

    Raises:
        ValueError: ``mem_bw`` or ``fallback_eff`` not > 0.
    """
    ids = BATCH * POOL
    g, g1 = BATCH, ids
    bw_, bn, bp = fwd_bytes(DIM), fwd_bytes(narrow_dim), fwd_bytes(DIM, pool=1)
    f_w, f_n, f_p = fwd
    b_w, b_n, b_p = bwd
    if mem_bw <= 0 or fallback_eff <= 0:
        raise ValueError(f"fit_fused_lookup: mem_bw and fallback_eff must be > 0, got {mem_bw}, {fallback_eff}")
    x = (f_w - f_n) / (bw_ - bn)  # seconds per byte
    if x <= 0:
        x = 1.0 / (fallback_eff * mem_bw)
    eff = 1.0 / (x * mem_bw)
    fwd_bag = max(0.0, (f_p - f_w - (bp - bw_) * x) / (g1 - g))
    fwd_id = max(0.0, (f_w - bw_ * x - g * fwd_bag) / ids)
    mult = max(0.1, (b_w - b_n) / ((bw_ - bn) * x))
    bwd_bag = max(0.0, (b_p - b_w - mult * (bp - bw_) * x) / (g1 - g))
    bwd_id = max(0.0, (b_w - mult * bw_ * x - g * bwd_bag) / ids)
    return FusedFit(eff, mult, fwd_id, bwd_id, fwd_bag, bwd_bag)


def _range(x: Sample, k: float = 1.0, nd: int = 3) -> list[float]:
    a = x.scaled(k)
    return [round(a.lo, nd), round(a.hi, nd)]


def spread_summary(measured: dict) -> str:
    """One line per figure of ``measured["spread"]`` (``name: median (min-max over N repeats)``), for the
    topology file's header; empty when there is none."""
    spread = measured.get("spread") or {}
    if not spread:
        return ""
    lines = [f"median of {measured.get('repeats', REPEATS)} repeats each; min-max over the repeats:"]
    for k, (lo, hi) in spread.items():
        lines.append(f"  {k}: {measured.get(k, '?')} ({lo}-{hi})")
    return "\n".join(lines)


def fused_backward_line(raw_wide_s: float, raw_narrow_s: float, dram_factor: float, per_id_s: float,
                        multiplier: float, per_bag_s: float = 0.0) -> str:
    """The calibration's console line for the fused backward split, both figures of each width labelled.

    Args:
        raw_wide_s, raw_narrow_s: the measured medians (seconds) at ``DIM`` and ``NARROW_DIM``
            columns on the DRAM table: what the file stores as ``measured.fused_bwd_ms`` and
            ``measured.fused_bwd_dim16_ms`` (ms).
        dram_factor: ``kernel_figures(...).dram_factor``: the raw times x this = all-DRAM times
            (the DRAM table's own cache hits taken out), which :func:`fit_fused_lookup` fits.
        per_id_s, multiplier, per_bag_s: the fit (``fused_bwd_id_ns`` x 1e-9,
            ``bwd_compute_multiplier``, ``fused_bwd_bag_ns`` x 1e-9; the wide lookup has ``BATCH`` bags).
    """
    return (f"fused backward at {DIM} / {NARROW_DIM} columns: measured {raw_wide_s * 1e3:.3f} / "
            f"{raw_narrow_s * 1e3:.3f} ms (the file's fused_bwd_ms / fused_bwd_dim{NARROW_DIM}_ms), all-DRAM "
            f"{raw_wide_s * dram_factor * 1e3:.3f} / {raw_narrow_s * dram_factor * 1e3:.3f} ms (x {dram_factor:.3f}: "
            f"the table's own cache hits taken out; fitted) = {per_id_s * 1e9:.2f} ns per id + "
            f"{per_bag_s * 1e9:.2f} ns per bag ({BATCH} bags) + {multiplier:.2f} x the bytes' forward")


def calibrate(log: Callable[[str], None] = lambda s: None) -> tuple[DevicePreset, dict]:
    """Measure this machine (module docstring) in under :data:`TIME_BUDGET_S` seconds.

    Returns:
        ``(preset, measured)``: a ``cpu`` :class:`DevicePreset` for :func:`save_topology_file`
        and the raw figures (GB/s, microseconds, milliseconds, ratios; medians of
        :data:`REPEATS` repeats) with ``spread`` (per figure ``[min, max]`` over the repeats)
        and ``repeats``.

    Raises:
        RuntimeError: the gloo ranks failed or timed out.
    """
    import torch

    from dlrmctl import _fbgemm
    from dlrmctl.planner.cache import che_hit_fractions

    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    spread: dict[str, list[float]] = {}
    measured: dict = {}
    llc = detect_llc_bytes()
    llc_bytes = llc if llc else 32 * (1 << 20)
    log(f"last-level cache: {llc_bytes / MiB:.0f} MiB" + ("" if llc else " (not detected: the 32 MiB default)"))
    # rows of the in-cache table: a quarter of the cache at DIM fp32 columns (+ 4 B row-wise state per row)
    cache_rows = max(1024, llc_bytes // 4 // (DIM * 4 + 4))
    # h0: the part of the big table's lookups that hit anyway (one table, uniform ids: C / S)
    dram_hit = che_hit_fractions([TABLE_ROWS], [DIM * 4 + 4], [BATCH * POOL], llc_bytes)[0]
    try:
        bw_s = measure_memory_bandwidth()
        mem_bw = bw_s.median
        measured["ddr_copy_gbps"], spread["ddr_copy_gbps"] = round(mem_bw / GB, 3), _range(bw_s, 1 / GB)
        log(f"memory bandwidth (numpy copy): {mem_bw / GB:.2f} GB/s (repeats {bw_s.lo / GB:.2f}-{bw_s.hi / GB:.2f})")
        launch_s = measure_op_overhead()
        launch = launch_s.median
        measured["op_dispatch_us"], spread["op_dispatch_us"] = round(launch * 1e6, 3), _range(launch_s, 1e6)
        log(f"per-op dispatch: {launch * 1e6:.2f} us")
        eff: dict[str, float] = {}
        mults: dict[str, float] = {}
        speedup: dict[str, float] = {}
        per_id = 0.0
        fwd_per_id = bag_fwd = bag_bwd = 0.0
        for kernel in ("fused", "dense"):
            if kernel == "fused" and not _fbgemm.ensure_checked():
                log("fused kernel: fbgemm_gpu not installed, keeping the default efficiency and cache speedup")
                continue
            # the fused pair below is split by a difference: more calls per median narrow its spread (SPLIT_ITERS)
            iters = SPLIT_ITERS if kernel == "fused" else 30
            # fused: the 64-wide DRAM table and the 16-wide one of the same bytes and ids in turn
            # (their differences split the forward and the backward), then the in-cache table
            tables = [(DIM, TABLE_ROWS)] + ([(NARROW_DIM, TABLE_ROWS * DIM // NARROW_DIM), (DIM, TABLE_ROWS, 1)]
                                              if kernel == "fused" else [])
            pairs = measure_lookups(kernel, tables, max_s=6.0 * len(tables), iters=iters)
            f_d, b_d = pairs[0]
            f_c, b_c = measure_lookup(kernel, rows=cache_rows, iters=iters)
            step_d, step_c = f_d.median + b_d.median, f_c.median + b_c.median
            fig = kernel_figures(f_d.median, b_d.median, f_c.median, b_c.median, dram_hit, mem_bw)
            speedup[kernel], k = fig.cache_speedup, fig.dram_factor
            # all-DRAM times: what the perf model charges a lookup that misses the cache
            bwd_wide = b_d.median * k
            eff[kernel], mults[kernel] = fig.efficiency, fig.bwd_multiplier
            for name, smp in ((f"{kernel}_fwd_ms", f_d), (f"{kernel}_bwd_ms", b_d),
                              (f"{kernel}_cache_fwd_ms", f_c), (f"{kernel}_cache_bwd_ms", b_c)):
                measured[name], spread[name] = round(smp.median * 1e3, 3), _range(smp, 1e3)
            log(f"{kernel} lookup: {eff[kernel] * mem_bw / GB:.2f} GB/s = {eff[kernel]:.3f} of memory bandwidth; "
                f"backward / forward {mults[kernel]:.2f}{' (bytes only: refitted below)' if kernel == 'fused' else ''}; step {step_d * 1e3:.2f} ms on {TABLE_ROWS} rows, "
                f"{step_c * 1e3:.2f} ms on {cache_rows} rows (in cache): speedup {speedup[kernel]:.2f} "
                f"(DRAM table's own hits {dram_hit:.2f} taken out)")
            if kernel == "fused":
                # same ids and table bytes, a quarter of the width: what the backward pays per id
                (f_n, b_n), (f_p, b_p) = pairs[1], pairs[2]
                bwd_narrow = b_n.median * k
                fit = fit_fused_lookup(mem_bw, [f_d.median * k, f_n.median * k, f_p.median * k],
                                       [bwd_wide, bwd_narrow, b_p.median * k], NARROW_DIM, eff[kernel])
                eff[kernel], mults[kernel], per_id, fwd_per_id = fit.efficiency, fit.bwd_multiplier, fit.bwd_id_s, fit.fwd_id_s
                bag_fwd, bag_bwd = fit.fwd_bag_s, fit.bwd_bag_s
                measured["fused_fwd_pool1_ms"], spread["fused_fwd_pool1_ms"] = round(f_p.median * 1e3, 3), _range(f_p, 1e3)
                measured["fused_bwd_pool1_ms"], spread["fused_bwd_pool1_ms"] = round(b_p.median * 1e3, 3), _range(b_p, 1e3)
                measured[f"fused_fwd_dim{NARROW_DIM}_ms"] = round(f_n.median * 1e3, 3)
                spread[f"fused_fwd_dim{NARROW_DIM}_ms"] = _range(f_n, 1e3)
                log(f"fused lookup fit: forward {fwd_per_id * 1e9:.2f} ns per id + {bag_fwd * 1e9:.2f} ns per bag + "
                    f"bytes at {eff[kernel] * mem_bw / GB:.1f} GB/s (measured forward "
                    f"{f_d.median * 1e3:.3f} / {f_n.median * 1e3:.3f} / {f_p.median * 1e3:.3f} ms at {DIM} / "
                    f"{NARROW_DIM} columns / one id per bag, same ids); backward on the next line")
                measured[f"fused_bwd_dim{NARROW_DIM}_ms"] = round(b_n.median * 1e3, 3)
                spread[f"fused_bwd_dim{NARROW_DIM}_ms"] = _range(b_n, 1e3)
                log(fused_backward_line(b_d.median, b_n.median, k, per_id, mults[kernel], bag_bwd))
    finally:
        torch.set_num_threads(threads)
    left = TIME_BUDGET_S - (time.perf_counter() - t0) - 5
    comm = measure_comm(2, max_s=max(10.0, left))
    coll = comm["a2a_small_s"].median
    half = (8 << 20) * 0.5  # half of each rank's 8 MiB leaves it on 2 ranks
    a2a_bw = half / comm["a2a_8mib_s"].median
    # a one-type step on tiny tables: its 4 collectives, one fused TBE forward + backward, and the
    # group's fixed cost (routing, lookup call, combine: Python and dispatch)
    group = max(0.0, comm["step_one_type_s"].median - 4 * coll - 2 * launch)
    log(f"gloo all-to-all: {coll * 1e6:.0f} us per call, {a2a_bw / GB:.2f} GB/s "
        f"(repeats {comm['a2a_8mib_s'].inverse(half).lo / GB:.2f}-{comm['a2a_8mib_s'].inverse(half).hi / GB:.2f}); "
        f"one sharding group: {group * 1e6:.0f} us per step")
    for name, key, k in (("gloo_a2a_small_us", "a2a_small_s", 1e6), ("gloo_a2a_8mib_ms", "a2a_8mib_s", 1e3),
                         ("sebc_step_one_type_ms", "step_one_type_s", 1e3),
                         ("sebc_step_two_types_ms", "step_two_types_s", 1e3)):
        measured[name], spread[name] = round(comm[key].median * k, 3), _range(comm[key], k)
    measured["gloo_a2a_gbps"] = round(a2a_bw / GB, 4)
    spread["gloo_a2a_gbps"] = _range(comm["a2a_8mib_s"].inverse(half), 1 / GB, 4)
    idist_bytes = comm["idist_bytes"].median
    idist = comm["idist_extra_s"].inverse(idist_bytes)  # bytes/s (median of the rounds' differences)
    for name, key in (("input_dist_small_ms", "idist_small_s"), ("input_dist_big_ms", "idist_big_s")):
        measured[name], spread[name] = round(comm[key].median * 1e3, 3), _range(comm[key], 1e3)
    measured["input_dist_bytes"] = int(idist_bytes)
    measured["input_dist_gbps"], spread["input_dist_gbps"] = round(idist.median / GB, 4), _range(idist, 1 / GB, 4)
    # output dist: bytes leaving a rank, forward and backward, per second of the whole path, its two
    # collectives' fixed latency (step_latency) taken out
    pooled_bytes = 2 * comm["pooled_bytes"].median
    pooled_s = comm["pooled_a2a_s"]
    pooled_net = Sample(max(pooled_s.median - 2 * coll, 1e-6), max(pooled_s.lo - 2 * coll, 1e-6),
                        max(pooled_s.hi - 2 * coll, 1e-6)).inverse(pooled_bytes)
    measured["pooled_a2a_ms"], spread["pooled_a2a_ms"] = round(pooled_s.median * 1e3, 3), _range(pooled_s, 1e3)
    measured["output_dist_gbps"] = round(pooled_net.median / GB, 4)
    spread["output_dist_gbps"] = _range(pooled_net, 1 / GB, 4)
    log(f"output dist (pooled_all_to_all forward + backward, {POOLED_GROUPS} groups, 4 MiB per rank): "
        f"{pooled_s.median * 1e3:.3f} ms = {pooled_net.median / GB:.3f} GB/s leaving a rank after its 2 collectives' "
        f"latency (repeats {pooled_net.lo / GB:.3f}-{pooled_net.hi / GB:.3f}; the bare all-to-all {a2a_bw / GB:.2f})")
    log(f"input dist: {comm['idist_big_s'].median * 1e3:.3f} ms for {idist_bytes / 1e6:.3f} MB received per rank, "
        f"{comm['idist_small_s'].median * 1e3:.3f} ms for two samples: {idist.median / GB:.3f} GB/s "
        f"(repeats {idist.lo / GB:.3f}-{idist.hi / GB:.3f}; the wire model charges the same bytes at "
        f"{a2a_bw / GB * 2:.2f} GB/s)")
    measured.update({
        "llc_detected": llc is not None,
        "cache_table_rows": cache_rows,
        "dram_table_cache_hit": round(dram_hit, 4),
        "repeats": REPEATS,
        "seconds": round(time.perf_counter() - t0, 1),
        "spread": spread,
    })
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
        fused_fwd_id_ns=round(fwd_per_id * 1e9, 3) if "fused" in eff else None,
        fused_fwd_bag_ns=round(bag_fwd * 1e9, 3) if "fused" in eff else None,
        fused_bwd_bag_ns=round(bag_bwd * 1e9, 3) if "fused" in eff else None,
        llc_mb=round(llc_bytes / MiB, 3),
        fused_cache_speedup=round(speedup["fused"], 3) if "fused" in speedup else None,
        dense_cache_speedup=round(speedup["dense"], 3),
        input_dist_bw_gbps=round(idist.median / GB, 4),
        output_dist_bw_gbps=round(pooled_net.median / GB, 4),
    )
    return preset, measured
