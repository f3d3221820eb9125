"""Train pipelines: overlap data loading, host-to-device copy and the sparse
input_dist of later batches with the forward/backward of the current one.

Names and structure follow TorchRec's ``torchrec.distributed.train_pipeline``:

* :class:`TrainPipelinePlain` (``train.pipeline: none``): load, copy, step —
  nothing overlapped (the reference the others must match bit for bit).
* :class:`TrainPipelineBase` (``base``): batch ``i+1`` is copied to the device on
  the memcpy stream (from pinned memory, ``non_blocking``) while batch ``i``
  computes.
* :class:`TrainPipelineSparseDist` (``sparse_dist``), TorchRec's three-stage
  ordering.  In step ``i``:

  1. batch ``i+2`` is fetched from the loader (whose own thread assembled it) and
     copied host->device on the **memcpy** stream;
  2. batch ``i``'s input_dist (started in step ``i-1``) is finished on the
     **data-dist** stream and the **default** stream waits for it (an event recorded
     before anything of batch ``i+1`` is queued there) and for batch ``i``'s copy;
  3. batch ``i``'s forward is queued on the default stream; then (``after_forward``,
     called by ``run_step`` between its forward and backward) batch ``i+1``'s
     input_dist starts on the data-dist stream, after its copy; its size exchange is a
     blocking host read, which now waits behind forward ``i``'s collectives only (NCCL
     runs one communicator's operations in order), while the GPU computes forward ``i``;
  4. batch ``i``'s backward and optimizer step are queued.

  Tensors that cross streams are ``record_stream``-ed on the stream that uses
  them.  No fx tracing is needed: the sharded model exposes ``sparse_input_dist``
  and ``compute_and_output_dist`` explicitly.

All stream and event work goes through :class:`PipelineStreams`, whose
:class:`StreamProvider` can be injected (a recording fake in the tests; CUDA
streams on a GPU; no-ops on the CPU).

Every pipeline computes exactly the same thing in the same order as the plain
loop (the input_dist of a batch does not read any weights), so per-step losses
are identical.  Ends: :meth:`progress` returns ``None`` once the iterator is
exhausted and every loaded batch has been trained on (no batch lost or
repeated); a pipeline is reused across epochs by calling :meth:`reset` with the
next epoch's iterator.  Equal step counts across ranks are the trainer's job
(it pads a rank that runs out with empty batches, so collectives always match).

Timing: ``stats`` accumulates seconds spent waiting for the loader
(``data_wait_s``), in the input_dist (``comm_wait_s``: the blocking size-exchange read
when a batch's input_dist starts, plus the wait for its id all-to-all) and in whole
steps (``step_s``), as seen by the host.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Optional

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


# ------------------------------------------------------------------ streams
class StreamProvider:
    """The stream / event operations the pipeline needs (no-ops: the CPU provider).

    Streams and events are opaque handles.  Subclass to run on real streams
    (:class:`CudaStreamProvider`) or to record the choreography (tests).
    """

    def new_stream(self, name: str) -> Any:
        """A side stream (``name``: ``"memcpy"`` or ``"data_dist"``)."""
        return name

    def current_stream(self) -> Any:
        """The stream compute runs on (the default stream)."""
        return "default"

    def use(self, stream: Any) -> ContextManager:
        """Context in which work is issued on ``stream``."""
        return contextlib.nullcontext()

    def record_event(self, stream: Any) -> Any:
        """An event marking the work issued so far on ``stream``."""
        return None

    def wait_event(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait (on the device, not the host) until ``event`` has happened."""

    def record_stream(self, obj: Any, stream: Any) -> None:
        """Tell the allocator that ``obj``'s tensors (``obj.record_stream``) are used on ``stream``."""


class CudaStreamProvider(StreamProvider):
    """Real CUDA streams and events on ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self, name: str) -> Any:
        return torch.cuda.Stream(device=self.device)

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def use(self, stream: Any) -> ContextManager:
        return torch.cuda.stream(stream)

    def record_event(self, stream: Any) -> Any:
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def wait_event(self, stream: Any, event: Any) -> None:
        if event is not None:
            stream.wait_event(event)

    def record_stream(self, obj: Any, stream: Any) -> None:
        if obj is not None and hasattr(obj, "record_stream"):
            obj.record_stream(stream)


def default_stream_provider(device: torch.device) -> StreamProvider:
    """CUDA streams for a CUDA device, no-ops otherwise."""
    return CudaStreamProvider(device) if device.type == "cuda" else StreamProvider()


class PipelineStreams:
    """The pipeline's stream and event choreography, in one place.

    Three streams: ``memcpy`` (host->device copies), ``data_dist`` (input_dist
    all-to-alls and their routing), ``default`` (forward/backward).

    Args:
        device: where batches go.
        provider: stream/event implementation (default: :func:`default_stream_provider`).
    """

    def __init__(self, device: torch.device, provider: StreamProvider | None = None) -> None:
        self.device = device
        self.p = provider or default_stream_provider(device)
        self.memcpy = self.p.new_stream("memcpy")
        self.data_dist = self.p.new_stream("data_dist")
        self.default = self.p.current_stream()

    def copy(self, batch: Any) -> tuple[Any, Any]:
        """Issue ``batch``'s host->device copy on the memcpy stream (non-blocking: the
        loader pins host memory on CUDA).  Returns ``(device batch, copy event)``."""
        with self.p.use(self.memcpy):
            b = batch.to(self.device, non_blocking=True)
            ev = self.p.record_event(self.memcpy)
        return b, ev

    def start_input_dist(self, batch: Any, copy_event: Any, start: Callable[[Any], Any]) -> Any:
        """Start ``batch``'s input_dist on the data-dist stream after its copy; returns the awaitable."""
        with self.p.use(self.data_dist):
            self.p.wait_event(self.data_dist, copy_event)
            self.p.record_stream(batch.sparse_features, self.data_dist)
            return start(batch.sparse_features)

    def wait_input_dist(self, awaitable: Any) -> Any:
        """Finish an input_dist (on the data-dist stream) and hand its result to the
        default stream, which waits for it from here on.  Returns the context."""
        with self.p.use(self.data_dist):
            ctx = awaitable.wait()
            ev = self.p.record_event(self.data_dist)
        self.p.wait_event(self.default, ev)
        self.p.record_stream(ctx, self.default)
        return ctx

    def ready_for_compute(self, batch: Any, copy_event: Any) -> Any:
        """The default stream waits for ``batch``'s copy; ``batch`` is recorded on it."""
        self.p.wait_event(self.default, copy_event)
        self.p.record_stream(batch, self.default)
        return batch


# ---------------------------------------------------------------- pipelines
class TrainPipelinePlain:
    """No overlap: fetch, copy, run.

    Args:
        device: where batches go.
        run_step: ``run_step(batch, sparse_ctx, after_forward=None) -> loss`` (any value; the
            trainer's is a device tensor); ``sparse_ctx`` is ``None`` here (the model runs its own
            input_dist).  ``after_forward`` (``sparse_dist`` only, a no-argument callable) is to be
            called once the forward is queued and before the backward; a ``run_step`` that does
            not call it gets it called after it returns.
        start_sparse_dist: ``start_sparse_dist(kjt) -> Awaitable`` (sparse_dist only).
        streams: stream provider (tests inject a recording one); default per device.
    """

    def __init__(
        self,
        device: torch.device,
        run_step: Callable[[Any, Any], Any],
        start_sparse_dist: Optional[Callable[[Any], Any]] = None,
        streams: StreamProvider | None = None,
    ) -> None:
        self.device = device
        self.run_step = run_step
        self.start_sparse_dist = start_sparse_dist
        self.stats = PipelineStats()
        self._it: Iterator[Any] | None = None
        self.streams = PipelineStreams(device, streams)

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

    def _timed_step(self, batch: Any, ctx: Any, after_forward: Optional[Callable[[], None]] = None) -> Any:
        loss = self.run_step(batch, ctx) if after_forward is None else self.run_step(batch, ctx, after_forward=after_forward)
        self.stats.steps += 1
        self.stats.samples += batch.labels.numel()
        return loss

    def progress(self) -> Any:
        """Train one batch; returns its loss, or ``None`` when the epoch is done."""
        t0 = time.perf_counter()
        b = self._fetch()
        if b is None:
            return None
        loss = self._timed_step(b.to(self.device), None)
        self.stats.step_s += time.perf_counter() - t0
        return loss


@dataclass
class _InFlight:
    """A batch inside the pipeline: device copy, its copy event, its input_dist (if started)."""

    batch: Any
    copy_event: Any
    dist: Any = None


class TrainPipelineBase(TrainPipelinePlain):
    """Batch ``i+1`` is copied to the device (memcpy stream) while batch ``i`` computes."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self._queue: list[_InFlight] = []
        self._primed = False

    def reset(self, it: Iterator[Any]) -> None:
        super().reset(it)
        self._queue = []
        self._primed = False

    def _enqueue(self) -> bool:
        """Fetch the next batch and start its copy; False when the iterator is exhausted."""
        b = self._fetch()
        if b is None:
            return False
        dev_b, ev = self.streams.copy(b)
        self._queue.append(_InFlight(dev_b, ev))
        return True

    def progress(self) -> Any:
        t0 = time.perf_counter()
        if not self._primed:
            self._enqueue()
            self._primed = True
        if not self._queue:
            return None
        self._enqueue()  # batch i+1: its copy overlaps batch i's compute
        cur = self._queue.pop(0)
        loss = self._timed_step(self.streams.ready_for_compute(cur.batch, cur.copy_event), None)
        self.stats.step_s += time.perf_counter() - t0
        return loss


class TrainPipelineSparseDist(TrainPipelineBase):
    """Copy of batch ``i+2``, input_dist of batch ``i+1`` and compute of batch ``i``
    overlap (see the module docstring for the stream ordering)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        if self.start_sparse_dist is None:
            raise ValueError("TrainPipelineSparseDist needs start_sparse_dist (a sharded model)")

    def _start_dist(self, f: _InFlight) -> None:
        if f.dist is None:
            f.dist = self.streams.start_input_dist(f.batch, f.copy_event, self.start_sparse_dist)  # type: ignore[arg-type]

    def progress(self) -> Any:
        t0 = time.perf_counter()
        if not self._primed:
            # fill: batch 0 copied and its input_dist started, batch 1 copying
            if self._enqueue():
                self._timed_dist(self._queue[0])
                self._enqueue()
            self._primed = True
        if not self._queue:
            return None
        self._enqueue()  # 1. batch i+2: host->device on the memcpy stream
        cur = self._queue.pop(0)
        self._timed_dist(cur)  # (already started, except for a one-batch epoch start)
        tw = time.perf_counter()
        ctx = self.streams.wait_input_dist(cur.dist)  # 2. batch i: default waits for its input_dist
        self.stats.comm_wait_s += time.perf_counter() - tw
        batch = self.streams.ready_for_compute(cur.batch, cur.copy_event)
        nxt = self._queue[0] if self._queue else None

        def after_forward() -> None:  # 3. forward i queued: batch i+1's input_dist starts
            if nxt is not None:
                self._timed_dist(nxt)

        loss = self._timed_step(batch, ctx, after_forward)  # 3./4. forward, backward, update of batch i
        after_forward()  # (a no-op when run_step called it)
        self.stats.step_s += time.perf_counter() - t0
        return loss

    def _timed_dist(self, f: _InFlight) -> None:
        """Start ``f``'s input_dist (once); its blocking size exchange counts as ``comm_wait_s``."""
        if f.dist is None:
            tw = time.perf_counter()
            self._start_dist(f)
            self.stats.comm_wait_s += time.perf_counter() - tw


PIPELINES = {"none": TrainPipelinePlain, "base": TrainPipelineBase, "sparse_dist": TrainPipelineSparseDist}


def make_pipeline(
    kind: str,
    device: torch.device,
    run_step: Callable[[Any, Any], Any],
    start_sparse_dist: Optional[Callable[[Any], Any]] = None,
    streams: StreamProvider | None = None,
) -> TrainPipelinePlain:
    """Pipeline for ``train.pipeline``; ``sparse_dist`` without a sharded model falls back to ``base``.

    Raises:
        ValueError: unknown ``kind``.
    """
    if kind not in PIPELINES:
        raise ValueError(f"train.pipeline must be one of {list(PIPELINES)}, got {kind!r}")
    if kind == "sparse_dist" and start_sparse_dist is None:
        kind = "base"
    return PIPELINES[kind](device, run_step, start_sparse_dist, streams)
