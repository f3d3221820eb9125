"""Train pipelines: overlap data loading, host-to-device copy and the sparse
input_dist of the next batch with the forward/backward of the current one.

Names and structure follow TorchRec's ``torchrec.distributed.train_pipeline``:

* :class:`TrainPipelinePlain` (``train.pipeline: none``): load, copy, step —
  nothing overlapped (the reference the others must match bit for bit).
* :class:`TrainPipelineBase` (``base``): batch ``i+1`` is fetched from the
  loader (whose own background thread assembles it from the memory-mapped
  shards) and copied to the device on a side CUDA stream from pinned memory
  while batch ``i`` computes.
* :class:`TrainPipelineSparseDist` (``sparse_dist``): additionally starts batch
  ``i+1``'s input_dist (the id all-to-all, ``async_op=True``) before batch ``i``'s
  forward/backward, and waits on it only when batch ``i+1`` is computed.  No fx
  tracing is needed: the sharded model exposes ``sparse_input_dist`` and
  ``compute_and_output_dist`` explicitly.

Every pipeline computes exactly the same thing in the same order as the plain
loop (the input_dist of a batch does not read any weights), so per-step losses
are identical.  Ends: :meth:`progress` returns ``None`` once the iterator is
exhausted and every loaded batch has been trained on (no batch lost or
repeated); a pipeline is reused across epochs by calling :meth:`reset` with the
next epoch's iterator.  Equal step counts across ranks are the trainer's job
(it pads a rank that runs out with empty batches, so collectives always match).

Timing: ``stats`` accumulates seconds spent waiting for the loader
(``data_wait_s``), waiting for the input_dist all-to-all (``comm_wait_s``) and
in whole steps (``step_s``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch


@dataclass
class PipelineStats:
    """Seconds accumulated since the last :meth:`reset_stats`."""

    data_wait_s: float = 0.0
    comm_wait_s: float = 0.0
    step_s: float = 0.0
    steps: int = 0
    samples: int = 0

    def shares(self) -> dict[str, float]:
        """Fractions of step time waiting on data / communication, and samples/s."""
        t = max(self.step_s, 1e-12)
        return {
            "data_wait_share": self.data_wait_s / t,
            "comm_wait_share": self.comm_wait_s / t,
            "samples_per_s": self.samples / t,
        }


class TrainPipelinePlain:
    """No overlap: fetch, copy, run.

    Args:
        device: where batches go.
        run_step: ``run_step(batch, sparse_ctx) -> float`` (loss); ``sparse_ctx`` is
            ``None`` here (the model runs its own input_dist).
        start_sparse_dist: ``start_sparse_dist(kjt) -> Awaitable`` (sparse_dist only).
    """

    def __init__(
        self,
        device: torch.device,
        run_step: Callable[[Any, Any], float],
        start_sparse_dist: Optional[Callable[[Any], Any]] = None,
    ) -> None:
        self.device = device
        self.run_step = run_step
        self.start_sparse_dist = start_sparse_dist
        self.stats = PipelineStats()
        self._it: Iterator[Any] | None = None

    def reset(self, it: Iterator[Any]) -> None:
        """Start a new epoch from iterator ``it`` (anything left of the previous one is dropped)."""
        self._it = it

    def reset_stats(self) -> None:
        self.stats = PipelineStats()

    def _fetch(self) -> Any:
        t0 = time.perf_counter()
        b = next(self._it, None)  # type: ignore[arg-type]
        self.stats.data_wait_s += time.perf_counter() - t0
        return b

    def _timed_step(self, batch: Any, ctx: Any) -> float:
        loss = self.run_step(batch, ctx)
        self.stats.steps += 1
        self.stats.samples += batch.labels.numel()
        return loss

    def progress(self) -> float | None:
        """Train one batch; ``None`` when the epoch is done."""
        t0 = time.perf_counter()
        b = self._fetch()
        if b is None:
            return None
        loss = self._timed_step(b.to(self.device), None)
        self.stats.step_s += time.perf_counter() - t0
        return loss


class TrainPipelineBase(TrainPipelinePlain):
    """Batch ``i+1`` is loaded and copied to the device while batch ``i`` computes."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self._cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream() if self._cuda else None
        self._cur: Any = None
        self._primed = False

    def reset(self, it: Iterator[Any]) -> None:
        super().reset(it)
        self._cur = None
        self._primed = False

    def _load(self) -> Any:
        """Fetch the next batch and start its host-to-device copy (side stream on CUDA)."""
        b = self._fetch()
        if b is None:
            return None
        if self._cuda:
            with torch.cuda.stream(self._copy_stream):
                b = b.to(self.device, non_blocking=True)
        else:
            b = b.to(self.device)
        return b

    def _ready(self, b: Any) -> Any:
        """Make the compute stream wait for ``b``'s copy and keep its memory alive there."""
        if self._cuda:
            cur = torch.cuda.current_stream()
            cur.wait_stream(self._copy_stream)
            b.record_stream(cur)
        return b

    def progress(self) -> float | None:
        t0 = time.perf_counter()
        if not self._primed:
            self._cur = self._load()
            self._primed = True
        if self._cur is None:
            return None
        cur = self._ready(self._cur)
        self._cur = self._load()  # overlaps with cur's compute (async copy on CUDA)
        loss = self._timed_step(cur, None)
        self.stats.step_s += time.perf_counter() - t0
        return loss


class TrainPipelineSparseDist(TrainPipelineBase):
    """Base pipeline + batch ``i+1``'s input_dist runs during batch ``i``'s forward/backward."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        if self.start_sparse_dist is None:
            raise ValueError("TrainPipelineSparseDist needs start_sparse_dist (a sharded model)")
        self._cur_dist: Any = None

    def reset(self, it: Iterator[Any]) -> None:
        super().reset(it)
        self._cur_dist = None

    def progress(self) -> float | None:
        t0 = time.perf_counter()
        if not self._primed:
            self._cur = self._load()
            if self._cur is not None:
                self._cur = self._ready(self._cur)
                self._cur_dist = self.start_sparse_dist(self._cur.sparse_features)  # type: ignore[misc]
            self._primed = True
        if self._cur is None:
            return None
        cur, cur_dist = self._cur, self._cur_dist
        tw = time.perf_counter()
        ctx = cur_dist.wait()
        self.stats.comm_wait_s += time.perf_counter() - tw
        # next batch: fetch, copy, and start its id all-to-all before cur's forward/backward
        nxt = self._load()
        if nxt is not None:
            nxt = self._ready(nxt)
            self._cur_dist = self.start_sparse_dist(nxt.sparse_features)  # type: ignore[misc]
        else:
            self._cur_dist = None
        self._cur = nxt
        loss = self._timed_step(cur, ctx)
        self.stats.step_s += time.perf_counter() - t0
        return loss


PIPELINES = {"none": TrainPipelinePlain, "base": TrainPipelineBase, "sparse_dist": TrainPipelineSparseDist}


def make_pipeline(
    kind: str,
    device: torch.device,
    run_step: Callable[[Any, Any], float],
    start_sparse_dist: Optional[Callable[[Any], Any]] = None,
) -> TrainPipelinePlain:
    """Pipeline for ``train.pipeline``; ``sparse_dist`` without a sharded model falls back to ``base``.

    Raises:
        ValueError: unknown ``kind``.
    """
    if kind not in PIPELINES:
        raise ValueError(f"train.pipeline must be one of {list(PIPELINES)}, got {kind!r}")
    if kind == "sparse_dist" and start_sparse_dist is None:
        kind = "base"
    return PIPELINES[kind](device, run_step, start_sparse_dist)
