"""The ASGI app of ``dlrmctl serve`` (:class:`App`): ``POST .../infer`` answered as raw ASGI (no
per-request routing, validation or response classes), every other endpoint (health, metadata,
metrics) and the lifespan (which runs the :class:`~dlrmctl.inference.serve.batcher.Batcher`) on FastAPI."""

import asyncio
import concurrent.futures
import logging
import os
import time
from contextlib import asynccontextmanager
from typing import Any, Callable

from dlrmctl.errors import quoted
from dlrmctl.inference.serve.batcher import Batcher, Metrics, QueueFull
from dlrmctl.inference.serve.protocol import (RAW_INPUT, VERSIONS, BadRequest, ModelSpec, Rows, decode_request,
                                              infer_response, json_error, no_version)

log = logging.getLogger("dlrmctl.serve")


class RawTransform:
    """Raw log lines (the ``raw`` input) -> the model's tensors, through ``dlrmctl predict``'s transform
    (:func:`~dlrmctl.inference.predict.raw_transformer`) of the model's training preprocessing.

    Args:
        model: an :class:`~dlrmctl.inference.export.ExportedModel` whose spec has ``raw`` set.
        spec: its :class:`ModelSpec` (the feature order and weighted features of the rows returned).
    """

    def __init__(self, model: Any, spec: ModelSpec) -> None:
        from dlrmctl.inference.predict import raw_transformer

        self._tr, self._data_features = raw_transformer(model)
        self._spec = spec

    def __call__(self, lines: list[bytes]) -> Rows:
        """``lines`` (``n`` raw lines) -> their :class:`Rows` in the model's feature order (bags of a
        multi-valued column, per-id weights of a weighted one).

        Raises:
            BadRequest: a line the transform refuses (naming its element), or raw lines that lack
                some of the model's features.
        """
        from dlrmctl.data.columnar import DataError
        from dlrmctl.data.raw_rows import RawInputError, model_inputs

        try:
            dense, ids, _ = self._tr.lines(lines, RAW_INPUT)
        except DataError as e:
            msg = str(e)
            for pre in (f"{e.path}:{e.line}: ", f"{e.path}: "):
                msg = msg.removeprefix(pre)
            where = f" element {e.line - 1}" if e.line is not None else ""
            raise BadRequest(f"input '{RAW_INPUT}'{where}: {msg}") from None
        spec = self._spec
        try:
            values, lengths, weights = model_inputs(ids, self._data_features, spec.features, spec.weighted)
        except RawInputError as e:
            raise BadRequest(f"input '{RAW_INPUT}': {e}") from None
        counts = lengths.sum(axis=1)
        n = dense.shape[0]
        return Rows(dense, values, lengths, weights, None if (counts == n).all() else counts)


async def _send(send: Callable, code: int, body: bytes, headers: list | None = None) -> None:
    """One whole HTTP answer (JSON unless ``headers`` give a content-type)."""
    h = [(b"content-length", str(len(body)).encode())]
    if not any(k == b"content-type" for k, _ in headers or ()):
        h.append((b"content-type", b"application/json"))
    await send({"type": "http.response.start", "status": code, "headers": h + list(headers or ())})
    await send({"type": "http.response.body", "body": body})


class App:
    """The ASGI app serving ``model`` (an :class:`~dlrmctl.inference.export.ExportedModel`) as ``name``.

    An infer request body over ``max_request_mb`` MiB is refused with 413 before it is read whole
    (a body is held twice while it is decoded: without a bound a few large posts exhaust memory).
    The batcher starts with the app's lifespan and drains on its shutdown.

    Attributes:
        api: the FastAPI app (health, metadata, metrics; its lifespan runs the batcher).
        state: ``api.state``: ``metrics`` (:class:`~dlrmctl.inference.serve.batcher.Metrics`) and
            ``spec`` (:class:`~dlrmctl.inference.serve.protocol.ModelSpec`).
        spec, metrics: the same objects.
        batcher: the running :class:`~dlrmctl.inference.serve.batcher.Batcher` (None outside the lifespan).
        ready: whether the batcher takes requests (``/v2/health/ready``).
        unready: why the server is not ready although its batcher is (another server process of
            ``--processes`` exited and is being restarted), or None.
    """

    _PREFIX = "/v2/models/"
    #: bodies at least this long are decoded on a thread of their own, not on the event loop (which
    #: keeps answering health checks and small requests meanwhile)
    OFF_LOOP_BYTES = 256 * 1024

    def __init__(self, model: Any, name: str, max_batch_rows: int = 4096, max_delay_ms: float = 2.0,
                 max_queue_rows: int = 65536, workers: int = 1, process: str = "1 of 1",
                 max_request_mb: float = 64.0, min_delay_ms: float = 0.0, max_ids_per_row: int = 1024) -> None:
        from fastapi import FastAPI

        self.model, self.name = model, name
        self.max_batch_rows, self.max_delay_ms, self.max_queue_rows = max_batch_rows, max_delay_ms, max_queue_rows
        self.workers, self.max_request_mb, self.min_delay_ms = workers, max_request_mb, min_delay_ms
        self.max_body = int(max_request_mb * 2**20)
        self.spec = ModelSpec.of(model, name, max_ids_per_row)
        self.metrics = Metrics(max_batch_rows)
        self.metrics.process.labels(str(os.getpid()), process).set(1)
        self._ok = self.metrics.requests.labels("200")
        self.transform = RawTransform(model, self.spec) if self.spec.raw else None
        self.batcher: Batcher | None = None
        self.ready = False
        self.unready: str | None = None
        self._arriving = 0  # infer requests begun on the event loop and not yet queued or refused
        self._inflight = 0  # infer requests begun and not yet answered
        self._flush_due = False
        self._decoder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dlrmctl-serve-decode")
        self.api = FastAPI(title="dlrmctl serve", lifespan=self._lifespan, docs_url=None, redoc_url=None)
        self.api.state.metrics = self.metrics
        self.api.state.spec = self.spec
        self.state = self.api.state
        for path, handler in (("/v2/health/live", self.live), ("/v2/health/ready", self.health_ready),
                              ("/v2", self.server_metadata), ("/v2/models", self.models),
                              ("/v2/models/{model_name}", self.model_metadata),
                              ("/v2/models/{model_name}/versions/{version}", self.model_metadata),
                              ("/v2/models/{model_name}/ready", self.model_ready),
                              ("/v2/models/{model_name}/versions/{version}/ready", self.model_ready),
                              ("/metrics", self.prometheus)):
            self.api.get(path)(handler)
        self.api.post("/v2/repository/index")(self.repository_index)

    # ------------------------------------------------------------------------- ASGI
    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        """ASGI 3 entry point."""
        path = scope.get("path", "")
        if scope["type"] == "http" and path.endswith("/infer") and path.startswith(self._PREFIX):
            parts = path[len(self._PREFIX):-len("/infer")].split("/")
            if len(parts) == 1 or (len(parts) == 3 and parts[1] == "versions"):
                if scope["method"] != "POST":
                    await _send(send, 405, json_error(f"{path} takes POST"), [(b"allow", b"POST")])
                    return
                await self.infer(parts[0], scope, receive, send, parts[2] if len(parts) == 3 else None)
                return
        await self.api(scope, receive, send)

    @asynccontextmanager
    async def _lifespan(self, api: Any):
        self.batcher = Batcher(self._forward, len(self.spec.features), bool(self.spec.weighted), self.max_batch_rows,
                               self.max_delay_ms, self.max_queue_rows, self.workers, self.metrics, self.min_delay_ms)
        self.ready = True
        yield
        self.ready = False
        await asyncio.get_running_loop().run_in_executor(None, self.batcher.stop)
        self._decoder.shutdown(wait=False)

    def _forward(self, dense, values, lengths, weights):
        return self.model.logits(dense, values, lengths, weights)

    def _arrived(self) -> None:
        """One infer request stopped arriving (queued, or refused): once the event loop has run every
        callback ready now (the other requests read in the same pass are decoded and queued by then)
        and no request is still arriving, the queued ones may run without waiting (:meth:`Batcher.release`);
        when the server holds no other request (a lone client), on this thread at once."""
        self._arriving -= 1
        if not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        if self._arriving == 0 and self.batcher is not None:
            self.batcher.release(inline=self._inflight == 1)

    # ------------------------------------------------------------------------- FastAPI endpoints
    def _error(self, code: int, msg: str):
        from fastapi.responses import JSONResponse

        return JSONResponse({"error": msg}, status_code=code)

    def _no_model(self, n: str) -> str:
        return f"model {quoted(n)} is not served here (this server serves '{self.name}')"

    def _unknown(self, model_name: str, version: str | None) -> str | None:
        """The 404 message for a model name / version this server does not serve, or None."""
        if model_name != self.name:
            return self._no_model(model_name)
        if version is not None and version not in VERSIONS:
            return no_version(model_name, version)
        return None

    async def live(self):
        """``GET /v2/health/live``."""
        return {"live": True}

    def _readiness(self, **fields):
        from fastapi.responses import JSONResponse

        ok = self.ready and self.unready is None
        body = {**fields, "ready": ok}
        if self.unready is not None:
            body["reason"] = self.unready
        return JSONResponse(body, status_code=200 if ok else 503)

    async def health_ready(self):
        """``GET /v2/health/ready``: 200 while the batcher takes requests and every server process of
        ``--processes`` runs, else 503 (with the ``reason`` where one is known)."""
        return self._readiness()

    async def server_metadata(self):
        """``GET /v2``."""
        from dlrmctl import __version__

        return {"name": "dlrmctl", "version": __version__, "extensions": ["binary_tensor_data"]}

    async def models(self):
        """``GET /v2/models``: the models served, each with its versions, platform and state."""
        return {"models": [{"name": self.name, "versions": list(VERSIONS), "platform": self._platform(),
                            "state": "READY" if self.ready else "UNAVAILABLE"}]}

    async def repository_index(self):
        """``POST /v2/repository/index`` (Triton's model repository extension): one entry per model version."""
        return [{"name": self.name, "version": v, "state": "READY" if self.ready else "UNAVAILABLE"} for v in VERSIONS]

    def _platform(self) -> str:
        return f"pytorch_{self.model.artifact}"

    async def model_metadata(self, model_name: str, version: str | None = None):
        """``GET /v2/models/{name}[/versions/{v}]``: inputs, outputs, dtypes, shapes."""
        msg = self._unknown(model_name, version)
        if msg:
            return self._error(404, msg)
        return self.spec.metadata(self._platform())

    async def model_ready(self, model_name: str, version: str | None = None):
        """``GET /v2/models/{name}[/versions/{v}]/ready``."""
        msg = self._unknown(model_name, version)
        if msg:
            return self._error(404, msg)
        return self._readiness(name=self.name)

    async def prometheus(self):
        """``GET /metrics``: Prometheus text."""
        from fastapi.responses import PlainTextResponse
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return PlainTextResponse(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ------------------------------------------------------------------------- infer
    async def infer(self, model_name: str, scope: dict, receive: Callable, send: Callable,
                    version: str | None = None) -> None:
        """``POST /v2/models/{model_name}[/versions/{version}]/infer``: read the body, decode, queue, answer."""
        t0 = time.perf_counter()
        metrics, max_body = self.metrics, self.max_body
        code, reason, body, answered = 200, None, b"", False
        self._arriving += 1
        self._inflight += 1
        arriving = True
        try:
            more = True
            chunks, size = [], 0
            for k, v in scope["headers"]:
                if k == b"content-length" and v.isdigit() and int(v) > max_body:
                    size = int(v)
            while more and size <= max_body:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    code, reason = 499, "disconnected"
                    return
                chunks.append(msg.get("body", b""))
                size += len(chunks[-1])
                more = msg.get("more_body", False)
            if size > max_body:
                code, reason = 413, "too_large"
                body = json_error(f"the request body is over {self.max_request_mb:g} MiB (--max-request-mb); "
                                  "send its rows in several requests")
                return
            data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            unknown = self._unknown(model_name, version)
            if unknown:
                code, reason, body = 404, "unknown_model", json_error(unknown)
                return
            hlen = None
            for k, v in scope["headers"]:
                if k == b"inference-header-content-length":
                    if not v.strip().isdigit():
                        code, reason = 400, "bad_request"
                        body = json_error("header Inference-Header-Content-Length must be the JSON header's length in "
                                          f"bytes (a non-negative integer), got {quoted(v.decode('latin-1'))}")
                        return
                    hlen = int(v)
            try:
                if len(data) >= self.OFF_LOOP_BYTES:
                    rows, req = await asyncio.get_running_loop().run_in_executor(
                        self._decoder, decode_request, data, hlen, self.spec, self.transform)
                else:
                    rows, req = decode_request(data, hlen, self.spec, self.transform)
                fut = self.batcher.submit(rows)
            except BadRequest as e:
                code, reason, body = 400, "bad_request", json_error(str(e))
                return
            except RecursionError:  # json.loads of (or a walk over) arrays nested thousands deep
                code, reason, body = 400, "bad_request", json_error("the request JSON is nested too deeply")
                return
            except QueueFull as e:
                code, reason, body = 503, "queue_full", json_error(f"{e}; retry after 1 s")
                return
            finally:
                arriving = False
                self._arrived()
            try:
                scores, logits = await asyncio.wrap_future(fut)
            except Exception as e:  # noqa: BLE001 - the model refused this request's rows
                from dlrmctl.inference.export import ExportError

                if isinstance(e, ExportError):
                    code, reason, body = 400, "bad_request", json_error(str(e).split(": bad model input: ", 1)[-1])
                    return
                log.exception("forward failed")
                code, reason = 500, "model_error"
                body = json_error(f"the model failed on this request: {type(e).__name__}: {e}")
                return
            try:
                out, headers = infer_response(req, self.name, scores, logits)
            except BadRequest as e:
                code, reason, body = 400, "bad_request", json_error(str(e))
                return
            metrics.rows.inc(rows.n)
            answered = True
            await _send(send, 200, out, headers)
        except Exception as e:  # noqa: BLE001 - a bug (or the client went away): logged, the server keeps serving
            log.exception("infer failed")
            code, reason, body = 500, "server_error", json_error(f"internal error: {type(e).__name__}: {e}")
        finally:
            try:
                if arriving:
                    self._arrived()
                if code != 200 and code != 499 and not answered:
                    await _send(send, code, body, [(b"retry-after", b"1")] if code == 503 else None)
                (self._ok if code == 200 else metrics.requests.labels(str(code))).inc()
                if reason:
                    metrics.errors.labels(reason).inc()
                metrics.latency.observe(time.perf_counter() - t0)
            finally:
                self._inflight -= 1


def build_app(model: Any, name: str, max_batch_rows: int = 4096, max_delay_ms: float = 2.0,
              max_queue_rows: int = 65536, workers: int = 1, process: str = "1 of 1",
              max_request_mb: float = 64.0, min_delay_ms: float = 0.0, max_ids_per_row: int = 1024) -> App:
    """The ASGI app (:class:`App`) serving ``model`` (an :class:`~dlrmctl.inference.export.ExportedModel`)
    as ``name``; ``process`` labels this server process in ``dlrmctl_serve_process_info``."""
    return App(model, name, max_batch_rows, max_delay_ms, max_queue_rows, workers, process, max_request_mb, min_delay_ms,
               max_ids_per_row)
