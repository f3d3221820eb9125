"""Dynamic batching: a queue of decoded requests merged into model forwards by forward threads
(:class:`Batcher`), the merge of several requests' tensors into one forward's inputs (:func:`merge`),
and the server's Prometheus metrics (:class:`Metrics`)."""

import collections
import concurrent.futures
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from dlrmctl.inference.serve.protocol import BadRequest, Rows


class QueueFull(RuntimeError):
    """The queue has no room for the request's rows: answered 503 with ``Retry-After``."""


def merge(rows: list[Rows], features: int, weighted: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Requests -> one forward's inputs: ``dense [sum B, D]`` float32, ``values [N]`` int64,
    ``lengths [F * sum B]`` int64 (key-major: feature, then request, then row) and ``weights [N]``
    float32 (``weighted``: unweighted features' entries 1.0) or None.

    One concatenation per input: requests whose every feature has one id per row are joined as
    ``[F, B]`` blocks along the rows; otherwise the ids are put in feature-major order with one
    stable sort by feature.
    """
    if len(rows) == 1:
        r = rows[0]
        dense, values, lengths, weights = r.dense, r.values, r.lengths.reshape(-1), r.weights
    else:
        dense = np.concatenate([r.dense for r in rows])
        lengths = np.concatenate([r.lengths for r in rows], axis=1).reshape(-1)
        if all(r.counts is None for r in rows):
            values = np.concatenate([r.values.reshape(features, -1) for r in rows], axis=1).reshape(-1)
            weights = (np.concatenate([r.weights.reshape(features, -1) for r in rows], axis=1).reshape(-1)
                       if weighted else None)
        else:
            key = np.concatenate([np.repeat(np.arange(features), r.counts if r.counts is not None else r.n)
                                  for r in rows])
            order = np.argsort(key, kind="stable")
            values = np.concatenate([r.values for r in rows])[order]
            weights = np.concatenate([r.weights for r in rows])[order] if weighted else None
    # a binary request's arrays are read-only views of its body: torch wants writable memory
    def own(a: np.ndarray, dt: Any) -> torch.Tensor:
        return torch.from_numpy(np.require(a, dt, ["C", "W"]))

    return (own(dense, np.float32), own(values, np.int64), own(lengths, np.int64),
            own(weights, np.float32) if weighted else None)


# ----------------------------------------------------------------------------- metrics
class Metrics:
    """The server's Prometheus metrics, in their own registry (``/metrics``)."""

    def __init__(self, max_batch_rows: int) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("dlrmctl_serve_requests", "infer requests answered, by HTTP status", ["code"], registry=r)
        self.rows = Counter("dlrmctl_serve_rows", "rows scored", registry=r)
        self.errors = Counter("dlrmctl_serve_errors", "infer requests not scored, by reason", ["reason"], registry=r)
        buckets = sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, max_batch_rows})
        self.batch_rows = Histogram("dlrmctl_serve_batch_rows", "rows per model forward", buckets=buckets, registry=r)
        self.latency = Histogram("dlrmctl_serve_request_latency_seconds", "infer request latency (received to answered)",
                                 buckets=(.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5), registry=r)
        self.forward = Histogram("dlrmctl_serve_forward_seconds", "model forward time per batch",
                                 buckets=(.0001, .0005, .001, .002, .005, .01, .02, .05, .1, .5, 1), registry=r)
        self.queue_rows = Gauge("dlrmctl_serve_queue_rows", "rows waiting for a forward", registry=r)
        self.process = Gauge("dlrmctl_serve_process_info", "this server process (pid; index of --processes)",
                             ["pid", "process"], registry=r)


# ----------------------------------------------------------------------------- dynamic batching
@dataclass
class _Item:
    rows: Rows
    future: concurrent.futures.Future
    t: float
    seq: int


class Batcher:
    """Queue + ``workers`` forward threads merging queued requests into batches (adaptive delay).

    A forward thread takes the queued requests (oldest first, a request never split, at most
    ``max_batch_rows`` rows unless one request alone has more) as soon as one of these holds:

    * the queued rows reach ``max_batch_rows``;
    * the oldest request was *released* (:meth:`release`: the producer saw no other request
      arriving) and has waited ``min_delay_ms`` (default 0: at once);
    * the oldest request has waited ``max_delay_ms`` (the cap, released or not).

    So a lone request runs without waiting for company that is not coming, requests that arrive
    together are merged, and requests that arrive while every forward thread is busy queue up and
    run as one batch when one is free.  Without :meth:`release` calls every batch waits out
    ``max_delay_ms`` (a fixed delay, as Triton's ``max_queue_delay_microseconds``).

    Args:
        forward: ``(dense [B, D] float32, values [N] int64, lengths [F*B] int64, weights [N] float32 | None)``
            -> logits ``[B]`` float32; raises on a rejected input.
        features: ``F``; weighted: the model takes weights.
        max_queue_rows: rows queued at most (:meth:`submit` raises :class:`QueueFull` beyond).
        min_delay_ms: how long a released request still waits for others (0 to ``max_delay_ms``).
        clock: seconds, monotonic (``time.monotonic``; a test's fake clock).
    """

    #: the longest forward :meth:`release` runs on its calling thread (the event loop), in seconds,
    #: as expected from the forwards timed so far (:meth:`inline_rows`)
    INLINE_SECONDS = 0.010
    #: the most rows :meth:`release` scores on its calling thread before any forward has been timed
    #: (a forward of about 10 ms on one CPU core for the models of benchmarks/serve.md)
    INLINE_ROWS = 1024
    #: the weight of the earlier forwards in the running time per row (each new one weighs 1)
    TIME_DECAY = 0.9

    def __init__(self, forward: Callable[..., torch.Tensor], features: int, weighted: bool, max_batch_rows: int,
                 max_delay_ms: float, max_queue_rows: int, workers: int, metrics: Metrics,
                 min_delay_ms: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.forward, self.features, self.weighted = forward, features, weighted
        self.max_batch_rows, self.delay = max_batch_rows, max_delay_ms / 1000.0
        self.min_delay = min(min_delay_ms, max_delay_ms) / 1000.0
        self.max_queue_rows, self.metrics, self.clock = max_queue_rows, metrics, clock
        self._q: collections.deque[_Item] = collections.deque()
        self._queued = 0
        self._seq = 0  # requests submitted so far
        self._released = 0  # requests 1.._released may go without waiting for more (release())
        self._busy = 0  # batches being scored now (forward threads, and release(inline=True))
        self._timed_s = self._timed_rows = 0.0  # decayed sums of forward seconds and rows (inline_rows)
        self._cond = threading.Condition()
        self._stop = False
        self._threads = [threading.Thread(target=self._run, name=f"dlrmctl-serve-{i}", daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, rows: Rows) -> concurrent.futures.Future:
        """Queue one request; the future's result is its ``(scores, logits)``, each ``[B]`` float32 numpy
        (``scores = sigmoid(logits)``, computed once per batch).

        Raises:
            QueueFull: its rows do not fit in the queue now.
            BadRequest: it has more rows than the queue holds at all.
        """
        if rows.n > self.max_queue_rows:
            raise BadRequest(f"the request has {rows.n} rows, more than the queue holds (--max-queue-rows "
                             f"{self.max_queue_rows}); split it")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stop:
                raise QueueFull("the server is shutting down")
            if self._queued + rows.n > self.max_queue_rows:
                raise QueueFull(f"the queue is full ({self._queued} of {self.max_queue_rows} rows waiting, "
                                f"--max-queue-rows)")
            self._seq += 1
            self._q.append(_Item(rows, fut, self.clock(), self._seq))
            self._queued += rows.n
            self.metrics.queue_rows.set(self._queued)
            # wake a forward thread only when it has something to do: the first request (it starts the
            # delay) or a full batch; not once per request while it waits
            if len(self._q) == 1 or self._queued >= self.max_batch_rows:
                self._cond.notify()
        return fut

    def release(self, inline: bool = False) -> None:
        """Every request submitted so far may run without waiting for others (after ``min_delay_ms``):
        the producer (the app's event loop) has no other request arriving.

        ``inline``: the producer holds no other request either; then, when no batch is being scored,
        ``min_delay_ms`` is 0 and at most :meth:`inline_rows` rows are queued, they are scored here,
        on the calling thread, before this returns (their futures done): a lone request skips the two
        thread hand-offs (wake a forward thread, wake the event loop with its answer), each a wait for
        a CPU on a busy machine.  More rows go to a forward thread, so that the event loop is not held
        for a long forward (health checks are answered meanwhile): with a wide model, where one row
        takes longer than :attr:`INLINE_SECONDS`, every request does.
        """
        with self._cond:
            self._released = self._seq
            if not self._q:
                return
            if not inline or self._busy or self.min_delay > 0 or self._stop or self._queued > self._inline_rows():
                self._cond.notify()
                return
            batch = self._pop()
            self._busy += 1
        try:
            self._score(batch)
        finally:
            with self._cond:
                self._busy -= 1
                if self._q:
                    self._cond.notify()

    def inline_rows(self) -> int:
        """The most rows :meth:`release` scores on its calling thread: those whose forward is expected
        to take at most :attr:`INLINE_SECONDS` at the running time per row (forward seconds over
        rows of the batches scored so far, each earlier batch weighed :attr:`TIME_DECAY` times less,
        timed on ``clock``); :attr:`INLINE_ROWS` until a batch has been timed.  The mean counts each
        batch's fixed cost over its rows, so small batches raise it: a lone small request is
        expected to cost no less than it did."""
        with self._cond:
            return self._inline_rows()

    def _inline_rows(self) -> int:
        if self._timed_rows == 0:
            return self.INLINE_ROWS
        if self._timed_s <= 0:  # a clock that did not move: no forward took measurable time
            return self.max_queue_rows
        return int(self.INLINE_SECONDS * self._timed_rows / self._timed_s)

    def stop(self) -> None:
        """Score everything queued, then end the forward threads."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()

    def _take(self) -> list[_Item] | None:
        with self._cond:
            while not self._q and not self._stop:
                self._cond.wait()
            if not self._q:
                return None
            while not self._stop and self._queued < self.max_batch_rows:
                first = self._q[0]
                wait = self.min_delay if first.seq <= self._released else self.delay
                left = first.t + wait - self.clock()
                if left <= 0:
                    break
                self._cond.wait(left)
                if not self._q:  # another worker took them
                    return []
            batch = self._pop()
            self._busy += 1
            if self._q:
                self._cond.notify()
            return batch

    def _pop(self) -> list[_Item]:
        """The oldest queued requests, at most ``max_batch_rows`` rows (one request at least); under the lock."""
        batch, n = [], 0
        while self._q and (not batch or n + self._q[0].rows.n <= self.max_batch_rows):
            it = self._q.popleft()
            batch.append(it)
            n += it.rows.n
        self._queued -= n
        self.metrics.queue_rows.set(self._queued)
        return batch

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            batch = self._take()
            if batch is None:
                return
            if batch:
                try:
                    self._score(batch)
                finally:
                    with self._cond:
                        self._busy -= 1

    def _score(self, batch: list[_Item]) -> None:
        t0, c0 = time.perf_counter(), self.clock()
        try:
            z = self.forward(*merge([b.rows for b in batch], self.features, self.weighted)).cpu().numpy().astype(np.float32, copy=False)
        except Exception as e:  # noqa: BLE001 - isolate the culprit: each request on its own
            if len(batch) == 1:
                batch[0].future.set_exception(e)
                return
            for b in batch:
                self._score([b])
            return
        p = torch.sigmoid(torch.from_numpy(z)).numpy()  # once per batch; as dlrmctl predict
        with self._cond:  # the running time per row of inline_rows (a failed forward is not timed)
            self._timed_s = self.TIME_DECAY * self._timed_s + max(self.clock() - c0, 0.0)
            self._timed_rows = self.TIME_DECAY * self._timed_rows + len(z)
        self.metrics.forward.observe(time.perf_counter() - t0)
        self.metrics.batch_rows.observe(len(z))
        s = 0
        for b in batch:
            b.future.set_result((p[s:s + b.rows.n], z[s:s + b.rows.n]))
            s += b.rows.n

