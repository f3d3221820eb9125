"""``dlrmctl serve MODEL_DIR``: an exported model behind the Open Inference Protocol (KServe v2, HTTP/REST).

Built on FastAPI + uvicorn (the HTTP stack the ``kserve`` SDK's ``ModelServer`` runs on, without
that SDK's 30-odd extra packages) and ``prometheus-client``.  Endpoints:

* ``GET /v2/health/live``, ``GET /v2/health/ready``, ``GET /v2``;
* ``GET /v2/models/{name}`` (metadata: inputs, outputs, dtypes, shapes), ``GET /v2/models/{name}/ready``;
* ``POST /v2/models/{name}/infer``: JSON tensors, or Triton's binary tensor extension
  (``Inference-Header-Content-Length``; what ``tritonclient.http`` sends by default);
* ``GET /metrics``: Prometheus text (requests, rows, batch rows, latency, queue, errors).

Inputs of a request (``B`` rows; one of the two forms):

* tensors: ``dense`` FP32 ``[B, D]`` (transformed, as the model takes it); for every sparse
  feature ``f`` (``manifest["sparse_features"]``) ``f`` INT64 ``[N_f]`` ids and ``f.lengths``
  INT64 ``[B]`` bag lengths (optional: without it every row has exactly one id, ``N_f = B``);
  ``f.weights`` FP32 ``[N_f]`` for each weighted feature;
* ``raw`` BYTES ``[B]``: raw log lines (Criteo: 39 tab-separated fields, or 40 with the label
  first, which is ignored), through ``dlrmctl predict``'s transform (:func:`~dlrmctl.inference.predict.raw_transformer`).

Outputs: ``score`` FP32 ``[B]`` (``sigmoid(logit)``, as ``dlrmctl predict``) and ``logit`` FP32 ``[B]``.

Dynamic batching (:class:`Batcher`): requests are queued and merged into one forward of up to
``max_batch_rows`` rows or until ``max_delay_ms`` after the oldest queued request, whichever comes
first; a request is never split (one larger than ``max_batch_rows`` is a forward of its own);
each response gets exactly its own rows, in order.  The queue holds at most ``max_queue_rows``
rows: a request that does not fit gets 503 with ``Retry-After``.  A bad request (malformed JSON,
wrong dtype or shape, unknown or missing input, an id outside its table under the model's
``on_invalid_id: error``) gets 400 with one line naming the input; it never reaches a merged
forward.  SIGTERM (or Ctrl-C) stops accepting connections and answers every request already
received before the process exits.

The model comes from :func:`~dlrmctl.inference.export.load_exported` (either artifact kind,
``model.pt2`` or TorchScript ``model.pt``; the manifest's SHA-256 checked).
"""


import asyncio
import collections
import concurrent.futures
import json
import logging
import math
import signal
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from dlrmctl.errors import UserError

log = logging.getLogger("dlrmctl.serve")

__all__ = ["BadRequest", "Batcher", "ModelSpec", "QueueFull", "ServeError", "build_app", "decode_request", "serve"]

#: Open Inference Protocol datatype -> numpy dtype (the ones this server reads)
_NP = {"FP32": np.float32, "FP64": np.float64, "INT64": np.int64, "INT32": np.int32, "BOOL": np.bool_}
RAW_INPUT = "raw"
DENSE_INPUT = "dense"


class ServeError(RuntimeError, UserError):
    """A server that cannot start (bad option, port in use, model not loadable as served)."""


class BadRequest(ValueError):
    """A request the model cannot score: answered 400 with this one-line message (naming the input)."""


class QueueFull(RuntimeError):
    """The queue has no room for the request's rows: answered 503 with ``Retry-After``."""


# ----------------------------------------------------------------------------- the model's contract
@dataclass
class ModelSpec:
    """What a request must carry, read from the manifest.

    Attributes:
        name: the served model name (``/v2/models/{name}``).
        num_dense: ``D``, dense width.
        features: sparse features, the model's input order.
        weighted: features whose ``f.weights`` input is required.
        rows: feature -> the smallest table row count it feeds (ids must be below it under ``error``).
        on_invalid_id: ``error`` (an id outside its table is a 400) or ``zero`` (dropped by the model).
        raw: whether raw lines can be scored (the manifest records the preprocessing, no weighted features).
    """

    name: str
    num_dense: int
    features: list[str]
    weighted: list[str]
    rows: dict[str, int]
    on_invalid_id: str
    raw: bool

    @classmethod
    def of(cls, model: Any, name: str) -> "ModelSpec":
        """From an :class:`~dlrmctl.inference.export.ExportedModel`."""
        m = model.manifest
        rows: dict[str, int] = {}
        for t in m.get("tables") or []:
            for f in t.get("features") or []:
                rows[f] = min(rows.get(f, 1 << 62), int(t["num_embeddings"]))
        return cls(name=name, num_dense=model.num_dense, features=list(model.feature_names),
                   weighted=list(model.weighted_features), rows=rows,
                   on_invalid_id=str(m.get("on_invalid_id", "error")),
                   raw=bool(m.get("preprocessing")) and not model.weighted_features)

    def metadata(self, platform: str) -> dict:
        """The ``GET /v2/models/{name}`` body (Open Inference Protocol model metadata)."""
        inputs = [{"name": DENSE_INPUT, "datatype": "FP32", "shape": [-1, self.num_dense]}]
        for f in self.features:
            inputs.append({"name": f, "datatype": "INT64", "shape": [-1]})
            inputs.append({"name": f"{f}.lengths", "datatype": "INT64", "shape": [-1], "optional": True})
            if f in self.weighted:
                inputs.append({"name": f"{f}.weights", "datatype": "FP32", "shape": [-1]})
        if self.raw:
            inputs.append({"name": RAW_INPUT, "datatype": "BYTES", "shape": [-1],
                           "note": "raw log lines instead of every other input"})
        return {"name": self.name, "versions": ["1"], "platform": platform, "inputs": inputs,
                "outputs": [{"name": "score", "datatype": "FP32", "shape": [-1]},
                            {"name": "logit", "datatype": "FP32", "shape": [-1]}],
                "parameters": {"on_invalid_id": self.on_invalid_id}}


@dataclass
class Rows:
    """One decoded request: ``dense [B, D]`` float32; per feature ``ids [N_f]`` int64,
    ``lengths [B]`` int64 and ``weights [N_f]`` float32 (weighted features only, else None)."""

    dense: np.ndarray
    ids: list[np.ndarray]
    lengths: list[np.ndarray]
    weights: list[np.ndarray | None]

    @property
    def n(self) -> int:
        """Rows ``B``."""
        return int(self.dense.shape[0])


# ----------------------------------------------------------------------------- decoding
def _tensor(inp: dict, binary: memoryview | None, pos: list[int]) -> tuple[str, str, list[int], np.ndarray | list]:
    """``(name, datatype, shape, data)`` of one request input (JSON ``data`` or a binary chunk)."""
    if not isinstance(inp, dict):
        raise BadRequest("each element of 'inputs' must be an object with name, datatype, shape, data")
    name = inp.get("name")
    if not isinstance(name, str):
        raise BadRequest("an input has no 'name'")
    dt, shape = inp.get("datatype"), inp.get("shape")
    if not isinstance(dt, str):
        raise BadRequest(f"input '{name}': no 'datatype'")
    if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise BadRequest(f"input '{name}': 'shape' must be a list of non-negative integers, got {shape!r}")
    count = math.prod(shape)
    size = (inp.get("parameters") or {}).get("binary_data_size")
    if size is not None:
        if binary is None or not isinstance(size, int) or size < 0 or pos[0] + size > len(binary):
            raise BadRequest(f"input '{name}': binary_data_size {size!r} does not fit the binary part of the request")
        chunk = binary[pos[0]:pos[0] + size]
        pos[0] += size
        if dt == "BYTES":
            out, off = [], 0
            while off < len(chunk):
                if off + 4 > len(chunk):
                    raise BadRequest(f"input '{name}': truncated BYTES element")
                (ln,) = struct.unpack_from("<I", chunk, off)
                out.append(bytes(chunk[off + 4:off + 4 + ln]))
                off += 4 + ln
            data: Any = out
        else:
            if dt not in _NP:
                raise BadRequest(f"input '{name}': datatype {dt} is not read by this server")
            item = np.dtype(_NP[dt]).itemsize
            if size != count * item:
                raise BadRequest(f"input '{name}': {size} bytes of binary data for shape {shape} {dt} "
                                 f"(expected {count * item})")
            data = np.frombuffer(chunk, dtype=np.dtype(_NP[dt]).newbyteorder("<")).reshape(shape)
    else:
        raw = inp.get("data")
        if raw is None:
            raise BadRequest(f"input '{name}': no 'data' (and no binary_data_size)")
        if dt == "BYTES":
            flat = _flatten(raw)
            if not all(isinstance(x, str) for x in flat):
                raise BadRequest(f"input '{name}': BYTES data must be strings")
            data = [x.encode() for x in flat]
        else:
            if dt not in _NP:
                raise BadRequest(f"input '{name}': datatype {dt} is not read by this server")
            try:
                arr = np.asarray(_flatten(raw), dtype=np.float64 if dt.startswith("FP") else object)
                if dt.startswith("FP"):
                    data = arr.astype(_NP[dt])
                else:
                    if not all(isinstance(x, int) and not isinstance(x, bool) for x in arr.tolist()) and dt != "BOOL":
                        raise ValueError("not integers")
                    data = np.asarray(arr.tolist(), dtype=_NP[dt])
            except (ValueError, TypeError, OverflowError):
                raise BadRequest(f"input '{name}': data is not a list of {dt} numbers") from None
    got = data.size if isinstance(data, np.ndarray) else len(data)
    if got != count:
        raise BadRequest(f"input '{name}': {got} values for shape {shape} ({count} expected)")
    if isinstance(data, np.ndarray):
        data = data.reshape(shape)
    return name, dt, shape, data


def _flatten(x: Any) -> list:
    if isinstance(x, list):
        if x and isinstance(x[0], list):
            out: list = []
            for e in x:
                out.extend(_flatten(e))
            return out
        return x
    raise BadRequest("tensor 'data' must be a (nested) list")


def _want(name: str, dt: str, shape: list[int], data: Any, datatype: str, ndim: int) -> np.ndarray:
    if dt != datatype:
        raise BadRequest(f"input '{name}': datatype must be {datatype}, got {dt}")
    if len(shape) != ndim:
        raise BadRequest(f"input '{name}': shape must have {ndim} dimension(s), got {shape}")
    return data


def decode_request(body: bytes, header_length: int | None, spec: ModelSpec,
                   transform: Callable[[list[bytes]], tuple[np.ndarray, np.ndarray]] | None) -> tuple[Rows, dict]:
    """Decode and check one ``/infer`` body against the model's contract.

    Args:
        body: the HTTP body: JSON, or (``header_length`` given) a JSON header of that many bytes
            followed by the binary tensor data.
        spec: the model's contract.
        transform: raw lines -> ``(dense [n, D] float32, ids [n, F] int64 in spec.features order)``
            (None: the model cannot score raw lines).

    Returns:
        ``(rows, request JSON)``.

    Raises:
        BadRequest: naming the input and what was expected.
    """
    if header_length is not None and not 0 <= header_length <= len(body):
        raise BadRequest(f"Inference-Header-Content-Length {header_length} is outside the body's {len(body)} bytes")
    head = body if header_length is None else body[:header_length]
    binary = None if header_length is None else memoryview(body)[header_length:]
    try:
        req = json.loads(head)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not JSON: {e}") from None
    if not isinstance(req, dict) or not isinstance(req.get("inputs"), list) or not req["inputs"]:
        raise BadRequest("the request must be a JSON object with a non-empty 'inputs' list")
    pos = [0]
    got: dict[str, tuple[str, list[int], Any]] = {}
    for inp in req["inputs"]:
        name, dt, shape, data = _tensor(inp, binary, pos)
        if name in got:
            raise BadRequest(f"input '{name}' is given twice")
        got[name] = (dt, shape, data)
    known = {DENSE_INPUT, *spec.features, *(f"{f}.lengths" for f in spec.features),
             *(f"{f}.weights" for f in spec.weighted)} | ({RAW_INPUT} if spec.raw else set())
    unknown = sorted(set(got) - known)
    if unknown:
        hint = f", {RAW_INPUT}" if spec.raw else ""
        raise BadRequest(f"input '{unknown[0]}' is not an input of model {spec.name} (inputs: {DENSE_INPUT}, "
                         f"{spec.features[0]}..{spec.features[-1]} with .lengths{hint}; GET /v2/models/{spec.name})")
    if RAW_INPUT in got:
        if len(got) > 1:
            raise BadRequest(f"input '{RAW_INPUT}' (raw lines) replaces every other input; also got "
                             f"{sorted(set(got) - {RAW_INPUT})}")
        dt, shape, lines = got[RAW_INPUT]
        _want(RAW_INPUT, dt, shape, lines, "BYTES", 1)
        if not lines:
            raise BadRequest(f"input '{RAW_INPUT}': no lines")
        assert transform is not None
        dense, ids = transform(lines)
        n = dense.shape[0]
        return Rows(dense, [np.ascontiguousarray(ids[:, j]) for j in range(ids.shape[1])],
                    [np.ones(n, np.int64)] * len(spec.features), [None] * len(spec.features)), req
    if DENSE_INPUT not in got:
        raise BadRequest(f"input '{DENSE_INPUT}' (FP32 [B, {spec.num_dense}]) is missing"
                         + (f" (or send raw lines as '{RAW_INPUT}')" if spec.raw else ""))
    dt, shape, dense = got[DENSE_INPUT]
    _want(DENSE_INPUT, dt, shape, dense, "FP32", 2)
    if shape[1] != spec.num_dense or shape[0] < 1:
        raise BadRequest(f"input '{DENSE_INPUT}': shape must be [B >= 1, {spec.num_dense}], got {shape}")
    if not np.isfinite(dense).all():
        raise BadRequest(f"input '{DENSE_INPUT}': holds NaN or infinity")
    B = shape[0]
    ids_l, len_l, w_l = [], [], []
    for f in spec.features:
        if f not in got:
            raise BadRequest(f"input '{f}' (INT64 ids, [N]) is missing")
        dt, shape, ids = got[f]
        ids = _want(f, dt, shape, ids, "INT64", 1)
        if f"{f}.lengths" in got:
            dt, shape, ln = got[f"{f}.lengths"]
            ln = _want(f"{f}.lengths", dt, shape, ln, "INT64", 1)
            if shape[0] != B:
                raise BadRequest(f"input '{f}.lengths': shape must be [{B}] (one bag length per row of '{DENSE_INPUT}'), got {shape}")
            if (ln < 0).any():
                raise BadRequest(f"input '{f}.lengths': a negative bag length")
            if int(ln.sum()) != ids.size:
                raise BadRequest(f"input '{f}': {ids.size} ids but '{f}.lengths' sums to {int(ln.sum())}")
        else:
            if ids.size != B:
                raise BadRequest(f"input '{f}': {ids.size} ids for {B} rows; give one id per row or '{f}.lengths'")
            ln = np.ones(B, np.int64)
        lim = spec.rows.get(f)
        if spec.on_invalid_id == "error" and lim is not None and ids.size:
            bad = np.flatnonzero((ids < 0) | (ids >= lim))
            if bad.size:
                raise BadRequest(f"input '{f}': id {int(ids[bad[0]])} at position {int(bad[0])} is outside the table's "
                                 f"{lim} rows (ids 0..{lim - 1}; the model's on_invalid_id is 'error')")
        w = None
        if f in spec.weighted:
            if f"{f}.weights" not in got:
                raise BadRequest(f"input '{f}.weights' (FP32 [N], one per id of '{f}') is missing: {f} is a weighted feature")
            dt, shape, w = got[f"{f}.weights"]
            w = _want(f"{f}.weights", dt, shape, w, "FP32", 1)
            if w.size != ids.size:
                raise BadRequest(f"input '{f}.weights': shape must be [{ids.size}] (one per id), got {shape}")
        ids_l.append(np.asarray(ids, np.int64))
        len_l.append(np.asarray(ln, np.int64))
        w_l.append(None if w is None else np.asarray(w, np.float32))
    return Rows(np.ascontiguousarray(dense, np.float32), ids_l, len_l, w_l), req


def merge(rows: list[Rows], features: int, weighted: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Requests -> one forward's inputs: ``dense [sum B, D]`` float32, ``values [N]`` int64,
    ``lengths [F * sum B]`` int64 (key-major: feature, then request, then row) and ``weights [N]``
    float32 (``weighted``: unweighted features' entries 1.0) or None."""
    dense = np.concatenate([r.dense for r in rows]) if len(rows) > 1 else rows[0].dense
    dense = np.require(dense, np.float32, ["C", "W"])  # a binary request's arrays are read-only views
    vals, lens, ws = [], [], []
    for j in range(features):
        for r in rows:
            vals.append(r.ids[j])
            lens.append(r.lengths[j])
            if weighted:
                ws.append(r.weights[j] if r.weights[j] is not None else np.ones(r.ids[j].size, np.float32))
    return (torch.from_numpy(np.ascontiguousarray(dense)), torch.from_numpy(np.concatenate(vals)),
            torch.from_numpy(np.concatenate(lens)), torch.from_numpy(np.concatenate(ws)) if weighted else None)


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


# ----------------------------------------------------------------------------- dynamic batching
@dataclass
class _Item:
    rows: Rows
    future: concurrent.futures.Future
    t: float = field(default_factory=time.monotonic)


class Batcher:
    """Queue + ``workers`` forward threads merging queued requests into batches.

    A batch closes when adding the next queued request would pass ``max_batch_rows`` or
    ``max_delay_ms`` after its oldest request arrived; a request is never split.

    Args:
        forward: ``(dense [B, D] float32, values [N] int64, lengths [F*B] int64, weights [N] float32 | None)``
            -> logits ``[B]`` float32; raises on a rejected input.
        features: ``F``; weighted: the model takes weights.
        max_queue_rows: rows queued at most (:meth:`submit` raises :class:`QueueFull` beyond).
    """

    def __init__(self, forward: Callable[..., torch.Tensor], features: int, weighted: bool, max_batch_rows: int,
                 max_delay_ms: float, max_queue_rows: int, workers: int, metrics: Metrics) -> None:
        self.forward, self.features, self.weighted = forward, features, weighted
        self.max_batch_rows, self.delay = max_batch_rows, max_delay_ms / 1000.0
        self.max_queue_rows, self.metrics = max_queue_rows, metrics
        self._q: collections.deque[_Item] = collections.deque()
        self._queued = 0
        self._cond = threading.Condition()
        self._stop = False
        self._threads = [threading.Thread(target=self._run, name=f"dlrmctl-serve-{i}", daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, rows: Rows) -> concurrent.futures.Future:
        """Queue one request; the future's result is its logits ``[B]`` float32 numpy.

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
            self._q.append(_Item(rows, fut))
            self._queued += rows.n
            self.metrics.queue_rows.set(self._queued)
            self._cond.notify()
        return fut

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
            deadline = self._q[0].t + self.delay
            while not self._stop and self._queued < self.max_batch_rows:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
                if not self._q:  # another worker took them
                    return []
            batch, n = [], 0
            while self._q and (not batch or n + self._q[0].rows.n <= self.max_batch_rows):
                it = self._q.popleft()
                batch.append(it)
                n += it.rows.n
            self._queued -= n
            self.metrics.queue_rows.set(self._queued)
            if self._q:
                self._cond.notify()
            return batch

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            batch = self._take()
            if batch is None:
                return
            if batch:
                self._score(batch)

    def _score(self, batch: list[_Item]) -> None:
        t0 = time.perf_counter()
        try:
            z = self.forward(*merge([b.rows for b in batch], self.features, self.weighted)).cpu().numpy()
        except Exception as e:  # noqa: BLE001 - isolate the culprit: each request on its own
            if len(batch) == 1:
                batch[0].future.set_exception(e)
                return
            for b in batch:
                self._score([b])
            return
        self.metrics.forward.observe(time.perf_counter() - t0)
        self.metrics.batch_rows.observe(len(z))
        s = 0
        for b in batch:
            b.future.set_result(z[s:s + b.rows.n])
            s += b.rows.n


# ----------------------------------------------------------------------------- the app
def _infer_response(req: dict, name: str, logits: np.ndarray) -> tuple[bytes, dict]:
    """``(body, headers)`` of an infer answer: JSON, or binary outputs when the request asks
    (``parameters.binary_data_output`` or an output's ``parameters.binary_data``)."""
    scores = torch.sigmoid(torch.from_numpy(np.ascontiguousarray(logits))).numpy()  # as dlrmctl predict
    outs = {"score": scores.astype(np.float32), "logit": logits.astype(np.float32)}
    wanted = [o.get("name") for o in req.get("outputs") or [] if isinstance(o, dict)] or list(outs)
    for w in wanted:
        if w not in outs:
            raise BadRequest(f"output '{w}' is not an output of model {name} (outputs: score, logit)")
    all_bin = bool((req.get("parameters") or {}).get("binary_data_output"))
    per = {o.get("name"): bool((o.get("parameters") or {}).get("binary_data", all_bin))
           for o in req.get("outputs") or [] if isinstance(o, dict)}
    res: dict = {"model_name": name, "model_version": "1", "outputs": []}
    if req.get("id") is not None:
        res["id"] = req["id"]
    blobs = []
    for w in wanted:
        a = outs[w]
        o: dict = {"name": w, "datatype": "FP32", "shape": [int(a.shape[0])]}
        if per.get(w, all_bin):
            b = a.astype("<f4").tobytes()
            o["parameters"] = {"binary_data_size": len(b)}
            blobs.append(b)
        else:
            o["data"] = a.tolist()
        res["outputs"].append(o)
    head = json.dumps(res, separators=(",", ":")).encode()
    if not blobs:
        return head, {"content-type": "application/json"}
    return head + b"".join(blobs), {"content-type": "application/octet-stream",
                                    "inference-header-content-length": str(len(head))}


def build_app(model: Any, name: str, max_batch_rows: int = 4096, max_delay_ms: float = 2.0,
              max_queue_rows: int = 65536, workers: int = 1):
    """The FastAPI app serving ``model`` (an :class:`~dlrmctl.inference.export.ExportedModel`) as ``name``.

    The batcher starts with the app's lifespan and drains on its shutdown.  ``app.state.metrics``
    holds the :class:`Metrics`.
    """
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request, Response
    from fastapi.responses import JSONResponse, PlainTextResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    spec = ModelSpec.of(model, name)
    metrics = Metrics(max_batch_rows)
    transform = None
    if spec.raw:
        from dlrmctl.inference.predict import raw_transformer

        tr, data_features = raw_transformer(model)
        cols = [data_features.index(f) for f in spec.features] if all(f in data_features for f in spec.features) else None

        def transform(lines: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
            from dlrmctl.data.columnar import DataError

            try:
                dense, ids, _ = tr.lines(lines, RAW_INPUT)
            except DataError as e:
                msg = str(e)
                for pre in (f"{e.path}:{e.line}: ", f"{e.path}: "):
                    msg = msg.removeprefix(pre)
                where = f" element {e.line - 1}" if e.line is not None else ""
                raise BadRequest(f"input '{RAW_INPUT}'{where}: {msg}") from None
            if cols is None:
                raise BadRequest(f"input '{RAW_INPUT}': the raw lines' features {data_features} lack some of the model's")
            return dense, ids[:, cols]

    def fwd(dense, values, lengths, weights):
        return model.logits(dense, values, lengths, weights)

    state: dict = {}

    @asynccontextmanager
    async def lifespan(app):
        state["batcher"] = Batcher(fwd, len(spec.features), bool(spec.weighted), max_batch_rows, max_delay_ms,
                                   max_queue_rows, workers, metrics)
        state["ready"] = True
        yield
        state["ready"] = False
        await asyncio.get_running_loop().run_in_executor(None, state["batcher"].stop)

    app = FastAPI(title="dlrmctl serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.metrics = metrics
    app.state.spec = spec

    def err(code: int, msg: str, headers: dict | None = None) -> JSONResponse:
        return JSONResponse({"error": msg}, status_code=code, headers=headers)

    def no_model(n: str) -> JSONResponse:
        return err(404, f"model '{n}' is not served here (this server serves '{name}')")

    @app.get("/v2/health/live")
    async def live():
        return {"live": True}

    @app.get("/v2/health/ready")
    async def ready():
        ok = bool(state.get("ready"))
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/v2")
    async def server_meta():
        from dlrmctl import __version__

        return {"name": "dlrmctl", "version": __version__, "extensions": ["binary_tensor_data"]}

    @app.get("/v2/models/{model_name}")
    @app.get("/v2/models/{model_name}/versions/{version}")
    async def model_meta(model_name: str, version: str | None = None):
        if model_name != name:
            return no_model(model_name)
        return spec.metadata(f"pytorch_{model.artifact}")

    @app.get("/v2/models/{model_name}/ready")
    @app.get("/v2/models/{model_name}/versions/{version}/ready")
    async def model_ready(model_name: str, version: str | None = None):
        if model_name != name:
            return no_model(model_name)
        ok = bool(state.get("ready"))
        return JSONResponse({"name": name, "ready": ok}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prom():
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v2/models/{model_name}/infer")
    @app.post("/v2/models/{model_name}/versions/{version}/infer")
    async def infer(model_name: str, request: Request, version: str | None = None):
        t0 = time.perf_counter()
        code, reason = 200, None
        try:
            if model_name != name:
                code, reason = 404, "unknown_model"
                return no_model(model_name)
            body = await request.body()
            hl = request.headers.get("inference-header-content-length")
            try:
                hlen = None if hl is None else int(hl)
            except ValueError:
                hlen = -1
            try:
                rows, req = decode_request(body, hlen, spec, transform)
                fut = state["batcher"].submit(rows)
            except BadRequest as e:
                code, reason = 400, "bad_request"
                return err(400, str(e))
            except QueueFull as e:
                code, reason = 503, "queue_full"
                return err(503, f"{e}; retry after 1 s", headers={"Retry-After": "1"})
            try:
                logits = await asyncio.wrap_future(fut)
            except Exception as e:  # noqa: BLE001 - the model refused this request's rows
                from dlrmctl.inference.export import ExportError

                if isinstance(e, ExportError):
                    code, reason = 400, "bad_request"
                    return err(400, str(e).split(": bad model input: ", 1)[-1])
                log.exception("forward failed")
                code, reason = 500, "model_error"
                return err(500, f"the model failed on this request: {type(e).__name__}: {e}")
            try:
                out, headers = _infer_response(req, name, logits)
            except BadRequest as e:
                code, reason = 400, "bad_request"
                return err(400, str(e))
            metrics.rows.inc(rows.n)
            return Response(out, headers=headers, media_type=headers["content-type"])
        finally:
            metrics.requests.labels(str(code)).inc()
            if reason:
                metrics.errors.labels(reason).inc()
            metrics.latency.observe(time.perf_counter() - t0)

    return app


# ----------------------------------------------------------------------------- running
def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one the OS picks) whose accepted
    connections have ``TCP_NODELAY`` set.

    The protocol is given as ``IPPROTO_TCP`` (not 0): asyncio sets ``TCP_NODELAY`` on an accepted
    connection only when its socket says so, and without it an answer written in two segments
    (uvicorn writes the headers, then the body) waits for the client's delayed ACK (about 40 ms
    on Linux) on every request of a kept-alive connection after its first.  ``TCP_NODELAY`` is
    also set on the listening socket (Linux passes it on to accepted connections).

    Raises:
        ServeError: the address cannot be bound (in use, not local), naming it.
    """
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(fam, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {e.strerror or e}; choose another --port "
                         "(0: any free port) or --host") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(model: Any, name: str, sock: socket.socket, max_batch_rows: int, max_delay_ms: float, max_queue_rows: int,
          workers: int) -> str | None:
    """Run the server on ``sock`` (from :func:`bind`; connections made before this starts wait in its
    backlog) until SIGTERM / SIGINT; every request received is answered first.

    Returns:
        the name of the signal that stopped it (``SIGTERM``), or None.
    """
    import uvicorn

    app = build_app(model, name, max_batch_rows, max_delay_ms, max_queue_rows, workers)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=60, backlog=2048)
    server = uvicorn.Server(config)
    caught: list[int] = []

    def after(sig, frame):  # uvicorn re-raises the signal it drained on: note it, do not die by it
        caught.append(sig)

    old = {s: signal.signal(s, after) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        sock.close()
    return signal.Signals(caught[0]).name if caught else None
