"""The adaptive batcher of `dlrmctl serve`: a lone request runs at once, without waiting out
--max-delay-ms for company that is not coming; requests that arrive together are still merged into
one forward; --min-delay-ms holds a released request.  A fake clock that never moves shows that no
wait happened (a wait on it would never end); the app is driven straight through ASGI with a fake
model, so these need neither fbgemm nor a socket."""

import asyncio
import json
import threading
import time

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from dlrmctl.inference.serve.app import build_app  # noqa: E402
from dlrmctl.inference.serve.batcher import Batcher, Metrics  # noqa: E402
from dlrmctl.inference.serve.protocol import Rows  # noqa: E402
from tests.helpers.asgi import asgi_request  # noqa: E402


class FrozenClock:
    """A monotonic clock that stays where it is set."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Forwards:
    """A model forward (logit = the first dense column) that records each batch's rows and the
    clock's time when it ran."""

    def __init__(self, clock=time.monotonic) -> None:
        self.batches: list[int] = []
        self.at: list[float] = []
        self.clock = clock

    def __call__(self, dense, values, lengths, weights):
        self.batches.append(int(dense.shape[0]))
        self.at.append(self.clock())
        return dense[:, 0].clone()


def one_row(x: float) -> Rows:
    return Rows(np.full((1, 1), x, np.float32), np.zeros(1, np.int64), np.ones((1, 1), np.int64), None)


def batcher(fwd, clock, max_delay_ms=60_000.0, min_delay_ms=0.0) -> Batcher:
    return Batcher(fwd, 1, False, max_batch_rows=64, max_delay_ms=max_delay_ms, max_queue_rows=1024, workers=1,
                   metrics=Metrics(64), min_delay_ms=min_delay_ms, clock=clock)


def test_a_lone_released_request_runs_at_once_without_waiting_for_the_delay():
    clock = FrozenClock()
    fwd = Forwards(clock)
    b = batcher(fwd, clock)  # a 60 s cap that the frozen clock never reaches
    try:
        fut = b.submit(one_row(3.0))
        b.release()  # the producer has nothing else arriving
        scores, logits = fut.result(30)
        assert float(logits[0]) == 3.0 and float(scores[0]) == pytest.approx(float(torch.sigmoid(torch.tensor(3.0))))
        assert fwd.batches == [1] and fwd.at == [clock.t]  # ran at the instant it was queued
    finally:
        b.stop()


def test_requests_queued_before_the_release_are_merged_into_one_forward():
    clock = FrozenClock()
    fwd = Forwards(clock)
    b = batcher(fwd, clock)
    try:
        futs = [b.submit(one_row(float(i))) for i in range(5)]
        time.sleep(0.2)
        assert fwd.batches == []  # not released, the cap not reached: they wait for more
        b.release()
        got = [float(f.result(30)[1][0]) for f in futs]
        assert got == [0.0, 1.0, 2.0, 3.0, 4.0] and fwd.batches == [5]
    finally:
        b.stop()


def test_min_delay_holds_a_released_request_and_the_cap_bounds_an_unreleased_one():
    clock = FrozenClock()
    fwd = Forwards(clock)
    b = batcher(fwd, clock, max_delay_ms=300.0, min_delay_ms=100.0)
    try:
        fut = b.submit(one_row(1.0))
        b.release()
        time.sleep(0.3)
        assert not fut.done()  # released, but --min-delay-ms has not passed on the (frozen) clock
        clock.t += 0.1
        assert fut.result(30) and fwd.batches == [1]
        fut = b.submit(one_row(2.0))  # never released: it runs when the cap has passed
        time.sleep(0.3)
        assert not fut.done()
        clock.t += 0.3
        assert fut.result(30) and fwd.batches == [1, 1]
    finally:
        b.stop()


def test_an_inline_release_scores_on_the_calling_thread_unless_a_batch_is_being_scored():
    """``release(inline=True)`` (the producer holds no other request) scores the queued requests on
    the calling thread before it returns; while a forward thread scores a batch, they are queued for
    it as with a plain release, and run once it is free; before any forward was timed, more than
    INLINE_ROWS rows go to it."""
    clock = FrozenClock()
    gate, entered = threading.Event(), threading.Event()
    threads: list[str] = []

    def fwd(dense, values, lengths, weights):
        threads.append(threading.current_thread().name)
        if float(dense[0, 0]) == 9.0:  # the batch that holds the forward thread
            entered.set()
            assert gate.wait(30)
        return dense[:, 0].clone()

    b = Batcher(fwd, 1, False, max_batch_rows=64, max_delay_ms=60_000.0, max_queue_rows=4096, workers=1,
                metrics=Metrics(64), clock=clock)
    try:
        # more rows than INLINE_ROWS, nothing timed yet: a forward thread scores them, the caller (the
        # event loop) is not held
        n = b.INLINE_ROWS + 1
        assert b.inline_rows() == b.INLINE_ROWS
        fut = b.submit(Rows(np.full((n, 1), 3.0, np.float32), np.zeros(n, np.int64), np.ones((1, n), np.int64), None))
        b.release(inline=True)
        assert float(fut.result(30)[1][-1]) == 3.0 and threads == ["dlrmctl-serve-0"]
        threads.clear()
        fut = b.submit(one_row(1.0))
        b.release(inline=True)
        assert fut.done() and float(fut.result()[1][0]) == 1.0  # done before release returned
        assert threads == [threading.current_thread().name]
        held = b.submit(one_row(9.0))
        b.release()
        assert entered.wait(30)  # a forward thread is scoring it now
        fut = b.submit(one_row(2.0))
        b.release(inline=True)
        assert not fut.done()  # queued for the busy forward thread, not scored here
        gate.set()
        assert float(held.result(30)[1][0]) == 9.0 and float(fut.result(30)[1][0]) == 2.0
        assert threads[1:] == ["dlrmctl-serve-0", "dlrmctl-serve-0"]
    finally:
        gate.set()
        b.stop()


def rows_of(n: int, value: float) -> Rows:
    return Rows(np.full((n, 1), value, np.float32), np.zeros(n, np.int64), np.ones((1, n), np.int64), None)


def test_the_inline_cap_follows_the_measured_forward_time_per_row():
    """The rows ``release(inline=True)`` scores on the event loop are those expected to take at most
    INLINE_SECONDS at the running forward time per row (on the batcher's clock, which the fake
    forward moves): 20 us per row gives 500 rows (400 inline, 600 to a forward thread); a wide
    model whose one row takes 30 ms never holds the event loop, even for a lone one-row request."""
    clock = FrozenClock()
    threads: list[str] = []
    per_row = [20e-6]

    def fwd(dense, values, lengths, weights):
        threads.append(threading.current_thread().name)
        clock.t += per_row[0] * dense.shape[0]  # the forward's time, as the batcher's clock sees it
        return dense[:, 0].clone()

    b = Batcher(fwd, 1, False, max_batch_rows=4096, max_delay_ms=60_000.0, max_queue_rows=8192, workers=1,
                metrics=Metrics(4096), clock=clock)
    me = threading.current_thread().name
    try:
        fut = b.submit(rows_of(1000, 1.0))  # untimed: 1000 <= INLINE_ROWS rows run inline
        b.release(inline=True)
        assert fut.done() and threads == [me]
        assert b.inline_rows() == pytest.approx(500, abs=1)  # 10 ms / 20 us
        fut = b.submit(rows_of(400, 2.0))
        b.release(inline=True)
        assert fut.done() and threads == [me, me]
        fut = b.submit(rows_of(600, 3.0))
        b.release(inline=True)
        assert float(fut.result(30)[1][-1]) == 3.0 and threads[2:] == ["dlrmctl-serve-0"]
    finally:
        b.stop()
    per_row[0] = 0.030  # a wide model: 30 ms for one row
    b = Batcher(fwd, 1, False, max_batch_rows=4096, max_delay_ms=60_000.0, max_queue_rows=8192, workers=1,
                metrics=Metrics(4096), clock=clock)
    try:
        threads.clear()
        fut = b.submit(rows_of(1, 4.0))  # untimed: inline (the first forward is what measures it)
        b.release(inline=True)
        assert fut.done() and threads == [me] and b.inline_rows() == 0
        for v in (5.0, 6.0):  # then every lone row goes to a forward thread
            fut = b.submit(rows_of(1, v))
            b.release(inline=True)
            assert float(fut.result(30)[1][0]) == v
        assert threads[1:] == ["dlrmctl-serve-0", "dlrmctl-serve-0"] and b.inline_rows() == 0
    finally:
        b.stop()


class FakeModel:
    """What the app reads of an exported model: 1 dense column, 2 features of 10 rows each."""

    artifact = "pt2"
    num_dense = 1
    feature_names = ["a", "b"]
    weighted_features: list = []
    manifest = {"tables": [{"name": "t", "num_embeddings": 10, "features": ["a", "b"]}], "on_invalid_id": "error"}

    def __init__(self) -> None:
        self.batches: list[int] = []
        self.threads: list[str] = []

    def logits(self, dense, values, lengths, weights):
        self.batches.append(int(dense.shape[0]))
        self.threads.append(threading.current_thread().name)
        return dense[:, 0].clone()


def infer_body(x: float) -> bytes:
    return json.dumps({"inputs": [{"name": "dense", "datatype": "FP32", "shape": [1, 1], "data": [x]},
                                  {"name": "a", "datatype": "INT64", "shape": [1], "data": [1]},
                                  {"name": "b", "datatype": "INT64", "shape": [1], "data": [2]}]}).encode()


async def post(app, body: bytes, path: str = "/v2/models/m/infer", headers=(), method: str = "POST") -> tuple[int, dict]:
    """(status, JSON answer) of one request driven straight through the ASGI ``app``."""
    status, _, out = await asgi_request(app, method, path, body, headers)
    return status, json.loads(out)


def run_app(app, check) -> None:
    """Run ``await check()`` on a fresh event loop inside ``app``'s lifespan (its batcher running)."""
    async def run():
        async with app.api.router.lifespan_context(app.api):
            await asyncio.wait_for(check(), 60)

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(run())
    finally:
        loop.close()


def test_the_app_runs_a_lone_request_at_once_and_merges_requests_that_arrive_together():
    """Through the app: a lone request is answered long before a 60 s --max-delay-ms; 8 requests
    read in one pass of the event loop are one forward of 8 rows, each answered with its own row."""
    model = FakeModel()
    app = build_app(model, "m", max_delay_ms=60_000.0)

    async def check():
        t = time.monotonic()
        code, out = await asyncio.wait_for(post(app, infer_body(0.5)), 30)
        assert code == 200 and out["outputs"][1]["data"] == [0.5]
        assert time.monotonic() - t < 30
        assert model.batches == [1]
        res = await asyncio.wait_for(asyncio.gather(*(post(app, infer_body(float(i))) for i in range(8))), 30)
        assert [r[1]["outputs"][1]["data"] for r in res] == [[float(i)] for i in range(8)]
        assert model.batches == [1, 8]
        # the lone request was scored on the event loop's thread (no hand-off), the 8 on a forward thread
        assert model.threads == [threading.current_thread().name, "dlrmctl-serve-0"]
        # a refused request (an id outside its table) does not leave the others waiting
        bad = infer_body(1.0).replace(b'"data": [2]', b'"data": [99]')
        res = await asyncio.wait_for(asyncio.gather(post(app, bad), post(app, infer_body(2.0))), 30)
        assert res[0][0] == 400 and "id 99" in res[0][1]["error"] and res[1][0] == 200
        assert model.batches == [1, 8, 1]

    run_app(app, check)


def test_wakes_stay_once_per_batch_with_releases(monkeypatch):
    """Requests submitted while their forward thread waits do not each wake it; a release wakes it once."""
    wakes = []

    class Counting(threading.Condition):  # the Batcher's own (made without a lock; a thread's Event passes one)
        def __init__(self, lock=None):
            super().__init__(lock)
            self.batchers = lock is None

        def notify(self, n=1):
            if self.batchers:
                wakes.append(n)
            super().notify(n)

    monkeypatch.setattr(threading, "Condition", Counting)
    clock = FrozenClock()
    b = batcher(Forwards(clock), clock)
    monkeypatch.undo()
    try:
        futs = [b.submit(one_row(float(i))) for i in range(20)]
        b.release()
        assert [float(f.result(30)[1][0]) for f in futs] == [float(i) for i in range(20)]
    finally:
        b.stop()
    assert len(wakes) <= 3, wakes  # the first request, the release, the stop
