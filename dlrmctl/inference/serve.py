"""``dlrmctl serve MODEL_DIR``: an exported model behind the Open Inference Protocol (KServe v2, HTTP/REST).

Built on FastAPI + uvicorn (the HTTP stack the ``kserve`` SDK's ``ModelServer`` runs on, without
that SDK's 30-odd extra packages; ``httptools`` + ``uvloop`` where installed) and ``prometheus-client``.
``POST .../infer`` is a raw ASGI route ahead of FastAPI (:class:`App`): a request's CPU is its HTTP
parsing, one JSON header parse and zero-copy views of its binary tensors, not per-request routing
and validation.  Endpoints:

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
received before the process exits.  :func:`start_processes`: more server processes on the same
port (``SO_REUSEPORT``), each with its own model, queue and metrics.

The model comes from :func:`~dlrmctl.inference.export.load_exported` (either artifact kind,
``model.pt2`` or TorchScript ``model.pt``; the manifest's SHA-256 checked).
"""


import asyncio
import collections
import concurrent.futures
import json
import logging
import math
import os
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

__all__ = ["App", "BadRequest", "Batcher", "ModelSpec", "QueueFull", "Rows", "ServeError", "bind", "build_app", "decode_request",
           "http_stack", "merge", "serve", "start_processes", "stop_processes"]

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
    known: frozenset = field(init=False, repr=False)
    length_names: list[str] = field(init=False, repr=False)
    limits: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        #: every input name a request may carry; ``f.lengths`` per feature; ``[F]`` int64 table rows per
        #: feature (ids must be below; int64's maximum where no table is known)
        self.length_names = [f"{f}.lengths" for f in self.features]
        self.known = frozenset({DENSE_INPUT, *self.features, *self.length_names,
                                *(f"{f}.weights" for f in self.weighted)} | ({RAW_INPUT} if self.raw else set()))
        self.limits = np.array([self.rows.get(f, np.iinfo(np.int64).max) for f in self.features], np.int64)

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
                   raw=_has_raw_transform(m) and not model.weighted_features)

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


def _has_raw_transform(manifest: dict) -> bool:
    """Whether raw lines of the model's dataset can be preprocessed here (the ``raw`` input): a
    manifest with its training preprocessing, of a dataset :data:`~dlrmctl.inference.predict.RAW_TRANSFORMS`
    knows (Criteo); a synthetic or MovieLens model is served from tensors only."""
    from dlrmctl.inference.predict import RAW_TRANSFORMS

    pre = manifest.get("preprocessing")
    return isinstance(pre, dict) and pre.get("dataset") in RAW_TRANSFORMS


@dataclass
class Rows:
    """One decoded request of ``B`` rows and ``F`` features (the model's order).

    Attributes:
        dense: ``[B, D]`` float32 (may be a read-only view of the request body).
        values: ``[N]`` int64 ids, feature-major (feature 0's ids, then feature 1's, ...).
        lengths: ``[F, B]`` int64 bag lengths.
        weights: ``[N]`` float32 per id (1.0 for an unweighted feature's ids) when the model has
            weighted features, else None.
        counts: ``[F]`` int64 ids per feature, or None when every feature has exactly ``B`` ids
            (``values`` is then ``[F, B]`` flattened, whatever the bag lengths).
    """

    dense: np.ndarray
    values: np.ndarray
    lengths: np.ndarray
    weights: np.ndarray | None
    counts: np.ndarray | None = None

    @property
    def n(self) -> int:
        """Rows ``B``."""
        return int(self.dense.shape[0])


# ----------------------------------------------------------------------------- decoding
#: datatype -> little-endian numpy dtype of its binary chunk
_LE = {k: np.dtype(v).newbyteorder("<") for k, v in _NP.items()}
_ITEM = {k: v.itemsize for k, v in _LE.items()}


def _tensor(inp: Any, binary: memoryview | None, pos: int) -> tuple[str, str, list[int], np.ndarray | list, int]:
    """``(name, datatype, shape, data, pos after it)`` of one request input (JSON ``data`` or the
    binary chunk at ``pos``: a zero-copy ``np.frombuffer`` view)."""
    if not isinstance(inp, dict):
        raise BadRequest("each element of 'inputs' must be an object with name, datatype, shape, data")
    name = inp.get("name")
    if not isinstance(name, str):
        raise BadRequest("an input has no 'name'")
    dt, shape = inp.get("datatype"), inp.get("shape")
    if not isinstance(dt, str):
        raise BadRequest(f"input '{name}': no 'datatype'")
    if type(shape) is list and len(shape) == 1 and type(shape[0]) is int and shape[0] >= 0:  # most inputs
        count = shape[0]
    elif isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape):
        count = math.prod(shape)
    else:
        raise BadRequest(f"input '{name}': 'shape' must be a list of non-negative integers, got {shape!r}")
    par = inp.get("parameters")
    size = par.get("binary_data_size") if isinstance(par, dict) else None
    if size is not None:
        if binary is None or type(size) is not int or size < 0 or pos + size > len(binary):
            raise BadRequest(f"input '{name}': binary_data_size {size!r} does not fit the binary part of the request")
        end = pos + size
        if dt == "BYTES":
            chunk, out, off = binary[pos:end], [], 0
            while off < len(chunk):
                if off + 4 > len(chunk):
                    raise BadRequest(f"input '{name}': truncated BYTES element")
                (ln,) = struct.unpack_from("<I", chunk, off)
                out.append(bytes(chunk[off + 4:off + 4 + ln]))
                off += 4 + ln
            data: Any = out
        else:
            item = _ITEM.get(dt)
            if item is None:
                raise BadRequest(f"input '{name}': datatype {dt} is not read by this server")
            if size != count * item:
                raise BadRequest(f"input '{name}': {size} bytes of binary data for shape {shape} {dt} "
                                 f"(expected {count * item})")
            data = np.frombuffer(binary, _LE[dt], count, pos)
            if len(shape) != 1:
                data = data.reshape(shape)
            return name, dt, shape, data, end
        pos = end
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
    return name, dt, shape, data, pos


def _flatten(x: Any) -> list:
    if isinstance(x, list):
        if x and isinstance(x[0], list):
            out: list = []
            for e in x:
                out.extend(_flatten(e))
            return out
        return x
    raise BadRequest("tensor 'data' must be a (nested) list")


def _want(name: str, got: tuple, datatype: str, ndim: int) -> np.ndarray:
    """The data of input ``name`` (``got``: its ``(datatype, shape, data)``) after checking its datatype and rank."""
    dt, shape, data = got
    if dt != datatype:
        raise BadRequest(f"input '{name}': datatype must be {datatype}, got {dt}")
    if len(shape) != ndim:
        raise BadRequest(f"input '{name}': shape must have {ndim} dimension(s), got {shape}")
    return data


def decode_request(body: bytes, header_length: int | None, spec: ModelSpec,
                   transform: Callable[[list[bytes]], tuple[np.ndarray, np.ndarray]] | None) -> tuple[Rows, dict]:
    """Decode and check one ``/infer`` body against the model's contract.

    The JSON header is parsed once; each binary tensor is a zero-copy view of the body; the ids of
    all features are checked against their tables in one vectorized pass.

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
    pos = 0
    got: dict[str, tuple[str, list[int], Any]] = {}
    for inp in req["inputs"]:
        name, dt, shape, data, pos = _tensor(inp, binary, pos)
        if name in got:
            raise BadRequest(f"input '{name}' is given twice")
        got[name] = (dt, shape, data)
    unknown = [k for k in got if k not in spec.known]
    if unknown:
        hint = f", {RAW_INPUT}" if spec.raw else ""
        raise BadRequest(f"input '{min(unknown)}' is not an input of model {spec.name} (inputs: {DENSE_INPUT}, "
                         f"{spec.features[0]}..{spec.features[-1]} with .lengths{hint}; GET /v2/models/{spec.name})")
    F = len(spec.features)
    if RAW_INPUT in got:
        if len(got) > 1:
            raise BadRequest(f"input '{RAW_INPUT}' (raw lines) replaces every other input; also got "
                             f"{sorted(set(got) - {RAW_INPUT})}")
        lines = _want(RAW_INPUT, got[RAW_INPUT], "BYTES", 1)
        if not lines:
            raise BadRequest(f"input '{RAW_INPUT}': no lines")
        assert transform is not None
        dense, ids = transform(lines)
        n = dense.shape[0]
        return Rows(dense, np.ascontiguousarray(ids.T, np.int64).reshape(-1), np.ones((F, n), np.int64), None), req
    if DENSE_INPUT not in got:
        raise BadRequest(f"input '{DENSE_INPUT}' (FP32 [B, {spec.num_dense}]) is missing"
                         + (f" (or send raw lines as '{RAW_INPUT}')" if spec.raw else ""))
    dense = _want(DENSE_INPUT, got[DENSE_INPUT], "FP32", 2)
    shape = got[DENSE_INPUT][1]
    if shape[1] != spec.num_dense or shape[0] < 1:
        raise BadRequest(f"input '{DENSE_INPUT}': shape must be [B >= 1, {spec.num_dense}], got {shape}")
    if not np.isfinite(dense).all():
        raise BadRequest(f"input '{DENSE_INPUT}': holds NaN or infinity")
    B = shape[0]
    ids_l: list[np.ndarray] = []
    lengths: np.ndarray | None = None  # [F, B], made at the first .lengths input
    uniform = True
    for j, f in enumerate(spec.features):
        t = got.get(f)
        if t is None:
            raise BadRequest(f"input '{f}' (INT64 ids, [N]) is missing")
        ids = _want(f, t, "INT64", 1)
        lk = spec.length_names[j]
        if lk in got:
            ln = _want(lk, got[lk], "INT64", 1)
            if ln.shape[0] != B:
                raise BadRequest(f"input '{lk}': shape must be [{B}] (one bag length per row of '{DENSE_INPUT}'), "
                                 f"got {got[lk][1]}")
            if (ln < 0).any():
                raise BadRequest(f"input '{lk}': a negative bag length")
            if int(ln.sum()) != ids.size:
                raise BadRequest(f"input '{f}': {ids.size} ids but '{lk}' sums to {int(ln.sum())}")
            if lengths is None:
                lengths = np.ones((F, B), np.int64)
            lengths[j] = ln
        elif ids.size != B:
            raise BadRequest(f"input '{f}': {ids.size} ids for {B} rows; give one id per row or '{f}.lengths'")
        uniform = uniform and ids.size == B
        ids_l.append(ids)
    values = np.concatenate(ids_l) if F else np.zeros(0, np.int64)
    counts = None if uniform else np.array([a.size for a in ids_l], np.int64)
    if spec.on_invalid_id == "error" and values.size:
        v = values.reshape(F, B) if uniform else values
        lim = spec.limits[:, None] if uniform else np.repeat(spec.limits, counts)
        bad = np.flatnonzero((v < 0) | (v >= lim))
        if bad.size:
            k = int(bad[0])
            j = k // B if uniform else int(np.searchsorted(np.cumsum(counts), k, side="right"))
            at = k - (j * B if uniform else int(counts[:j].sum()))
            f, top = spec.features[j], int(spec.limits[j])
            raise BadRequest(f"input '{f}': id {int(values[k])} at position {at} is outside the table's "
                             f"{top} rows (ids 0..{top - 1}; the model's on_invalid_id is 'error')")
    weights = None
    if spec.weighted:
        ws = []
        for j, f in enumerate(spec.features):
            if f in spec.weighted:
                wk = f"{f}.weights"
                if wk not in got:
                    raise BadRequest(f"input '{wk}' (FP32 [N], one per id of '{f}') is missing: {f} is a weighted feature")
                w = _want(wk, got[wk], "FP32", 1)
                if w.size != ids_l[j].size:
                    raise BadRequest(f"input '{wk}': shape must be [{ids_l[j].size}] (one per id), got {got[wk][1]}")
                ws.append(w)
            else:
                ws.append(np.ones(ids_l[j].size, np.float32))
        weights = np.concatenate(ws).astype(np.float32, copy=False)
    if lengths is None:
        lengths = np.ones((F, B), np.int64)
    return Rows(dense, values.astype(np.int64, copy=False), lengths, weights, counts), req


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
            self._q.append(_Item(rows, fut))
            self._queued += rows.n
            self.metrics.queue_rows.set(self._queued)
            # wake a forward thread only when it has something to do: the first request (it starts the
            # delay) or a full batch; not once per request while it waits out the delay
            if len(self._q) == 1 or self._queued >= self.max_batch_rows:
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
            z = self.forward(*merge([b.rows for b in batch], self.features, self.weighted)).cpu().numpy().astype(np.float32, copy=False)
        except Exception as e:  # noqa: BLE001 - isolate the culprit: each request on its own
            if len(batch) == 1:
                batch[0].future.set_exception(e)
                return
            for b in batch:
                self._score([b])
            return
        p = torch.sigmoid(torch.from_numpy(z)).numpy()  # once per batch; as dlrmctl predict
        self.metrics.forward.observe(time.perf_counter() - t0)
        self.metrics.batch_rows.observe(len(z))
        s = 0
        for b in batch:
            b.future.set_result((p[s:s + b.rows.n], z[s:s + b.rows.n]))
            s += b.rows.n


# ----------------------------------------------------------------------------- the app
def _infer_response(req: dict, name: str, scores: np.ndarray, logits: np.ndarray) -> tuple[bytes, bytes]:
    """``(body, content-type + inference-header-content-length headers as raw bytes lines)`` of an
    infer answer: JSON, or binary outputs when the request asks (``parameters.binary_data_output``
    or an output's ``parameters.binary_data``).  ``scores``, ``logits``: ``[B]`` float32, this
    request's slices of its batch's outputs."""
    outs = {"score": scores, "logit": logits}
    asked = req.get("outputs") or []
    wanted = [o.get("name") for o in asked if isinstance(o, dict)] or list(outs)
    for w in wanted:
        if w not in outs:
            raise BadRequest(f"output '{w}' is not an output of model {name} (outputs: score, logit)")
    par = req.get("parameters")
    all_bin = bool(par.get("binary_data_output")) if isinstance(par, dict) else False
    per = {o.get("name"): bool((o.get("parameters") or {}).get("binary_data", all_bin))
           for o in asked if isinstance(o, dict)}
    res: dict = {"model_name": name, "model_version": "1", "outputs": []}
    if req.get("id") is not None:
        res["id"] = req["id"]
    blobs = []
    for w in wanted:
        a = outs[w]
        o: dict = {"name": w, "datatype": "FP32", "shape": [int(a.shape[0])]}
        if per.get(w, all_bin):
            b = a.astype("<f4", copy=False).tobytes()
            o["parameters"] = {"binary_data_size": len(b)}
            blobs.append(b)
        else:
            o["data"] = a.tolist()
        res["outputs"].append(o)
    head = json.dumps(res, separators=(",", ":")).encode()
    if not blobs:
        return head, [(b"content-type", b"application/json")]
    return head + b"".join(blobs), [(b"content-type", b"application/octet-stream"),
                                    (b"inference-header-content-length", str(len(head)).encode())]


def _json_error(msg: str) -> bytes:
    return json.dumps({"error": msg}, ensure_ascii=False, separators=(",", ":")).encode()


class App:
    """The ASGI app of :func:`build_app`: ``POST .../infer`` is answered here, as raw ASGI (no
    per-request routing, validation or response classes); every other path and the lifespan go to
    the FastAPI app :attr:`api`.

    Attributes:
        api: the FastAPI app (health, metadata, metrics; its lifespan runs the batcher).
        state: ``api.state``: ``metrics`` (:class:`Metrics`) and ``spec`` (:class:`ModelSpec`).
    """

    _PREFIX = "/v2/models/"

    def __init__(self, api: Any, infer: Callable[..., Any]) -> None:
        self.api, self.state, self._infer = api, api.state, infer

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        """ASGI 3 entry point."""
        path = scope.get("path", "")
        if scope["type"] == "http" and path.endswith("/infer") and path.startswith(self._PREFIX):
            parts = path[len(self._PREFIX):-len("/infer")].split("/")
            if len(parts) == 1 or (len(parts) == 3 and parts[1] == "versions"):
                if scope["method"] != "POST":
                    await _send(send, 405, _json_error(f"{path} takes POST"), [(b"allow", b"POST")])
                    return
                await self._infer(parts[0], scope, receive, send)
                return
        await self.api(scope, receive, send)


async def _send(send: Callable, code: int, body: bytes, headers: list | None = None) -> None:
    """One whole HTTP answer (JSON unless ``headers`` give a content-type)."""
    h = [(b"content-length", str(len(body)).encode())]
    if not any(k == b"content-type" for k, _ in headers or ()):
        h.append((b"content-type", b"application/json"))
    await send({"type": "http.response.start", "status": code, "headers": h + list(headers or ())})
    await send({"type": "http.response.body", "body": body})


def build_app(model: Any, name: str, max_batch_rows: int = 4096, max_delay_ms: float = 2.0,
              max_queue_rows: int = 65536, workers: int = 1, process: str = "1 of 1",
              max_request_mb: float = 64.0) -> App:
    """The ASGI app (:class:`App`) serving ``model`` (an :class:`~dlrmctl.inference.export.ExportedModel`) as ``name``.

    An infer request body over ``max_request_mb`` MiB is refused with 413 before it is read whole
    (a body is held twice while it is decoded: without a bound a few large posts exhaust memory).

    The batcher starts with the app's lifespan and drains on its shutdown.  ``app.state.metrics``
    holds the :class:`Metrics`; ``process`` labels this server process in ``dlrmctl_serve_process_info``.
    """
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    spec = ModelSpec.of(model, name)
    max_body = int(max_request_mb * 2**20)
    metrics = Metrics(max_batch_rows)
    metrics.process.labels(str(os.getpid()), process).set(1)
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

    api = FastAPI(title="dlrmctl serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    api.state.metrics = metrics
    api.state.spec = spec

    def err(code: int, msg: str, headers: dict | None = None) -> JSONResponse:
        return JSONResponse({"error": msg}, status_code=code, headers=headers)

    def no_model(n: str) -> str:
        return f"model '{n}' is not served here (this server serves '{name}')"

    @api.get("/v2/health/live")
    async def live():
        return {"live": True}

    @api.get("/v2/health/ready")
    async def ready():
        ok = bool(state.get("ready"))
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @api.get("/v2")
    async def server_meta():
        from dlrmctl import __version__

        return {"name": "dlrmctl", "version": __version__, "extensions": ["binary_tensor_data"]}

    @api.get("/v2/models/{model_name}")
    @api.get("/v2/models/{model_name}/versions/{version}")
    async def model_meta(model_name: str, version: str | None = None):
        if model_name != name:
            return err(404, no_model(model_name))
        return spec.metadata(f"pytorch_{model.artifact}")

    @api.get("/v2/models/{model_name}/ready")
    @api.get("/v2/models/{model_name}/versions/{version}/ready")
    async def model_ready(model_name: str, version: str | None = None):
        if model_name != name:
            return err(404, no_model(model_name))
        ok = bool(state.get("ready"))
        return JSONResponse({"name": name, "ready": ok}, status_code=200 if ok else 503)

    @api.get("/metrics")
    async def prom():
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    requests_ok, latency, rows_total = metrics.requests.labels("200"), metrics.latency, metrics.rows

    async def infer(model_name: str, scope: dict, receive: Callable, send: Callable) -> None:
        """``POST /v2/models/{model_name}[/versions/{v}]/infer``: read the body, decode, queue, answer."""
        t0 = time.perf_counter()
        code, reason, body, answered = 200, None, b"", False
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
                body = _json_error(f"the request body is over {max_request_mb:g} MiB (--max-request-mb); "
                                   "send its rows in several requests")
                return
            data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            if model_name != name:
                code, reason, body = 404, "unknown_model", _json_error(no_model(model_name))
                return
            hl = None
            for k, v in scope["headers"]:
                if k == b"inference-header-content-length":
                    hl = v
            try:
                hlen = None if hl is None else int(hl)
            except ValueError:
                hlen = -1
            try:
                rows, req = decode_request(data, hlen, spec, transform)
                fut = state["batcher"].submit(rows)
            except BadRequest as e:
                code, reason, body = 400, "bad_request", _json_error(str(e))
                return
            except RecursionError:  # json.loads of (or a walk over) arrays nested thousands deep
                code, reason, body = 400, "bad_request", _json_error("the request JSON is nested too deeply")
                return
            except QueueFull as e:
                code, reason, body = 503, "queue_full", _json_error(f"{e}; retry after 1 s")
                return
            try:
                scores, logits = await asyncio.wrap_future(fut)
            except Exception as e:  # noqa: BLE001 - the model refused this request's rows
                from dlrmctl.inference.export import ExportError

                if isinstance(e, ExportError):
                    code, reason, body = 400, "bad_request", _json_error(str(e).split(": bad model input: ", 1)[-1])
                    return
                log.exception("forward failed")
                code, reason = 500, "model_error"
                body = _json_error(f"the model failed on this request: {type(e).__name__}: {e}")
                return
            try:
                out, headers = _infer_response(req, name, scores, logits)
            except BadRequest as e:
                code, reason, body = 400, "bad_request", _json_error(str(e))
                return
            rows_total.inc(rows.n)
            answered = True
            await _send(send, 200, out, headers)
        except Exception as e:  # noqa: BLE001 - a bug (or the client went away): logged, the server keeps serving
            log.exception("infer failed")
            code, reason, body = 500, "server_error", _json_error(f"internal error: {type(e).__name__}: {e}")
        finally:
            if code != 200 and code != 499 and not answered:
                await _send(send, code, body, [(b"retry-after", b"1")] if code == 503 else None)
            (requests_ok if code == 200 else metrics.requests.labels(str(code))).inc()
            if reason:
                metrics.errors.labels(reason).inc()
            latency.observe(time.perf_counter() - t0)

    return App(api, infer)


# ----------------------------------------------------------------------------- running
def http_stack() -> tuple[str, str]:
    """uvicorn's ``(http, loop)`` implementations: ``httptools`` and ``uvloop`` where importable
    (the ``serve`` extra installs both; several times cheaper per request), else ``h11`` and ``asyncio``."""
    try:
        import httptools  # noqa: F401

        http = "httptools"
    except ImportError:
        http = "h11"
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    return http, loop


def bind(host: str, port: int, reuse_port: bool = False, join: bool = False) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one the OS picks) whose accepted
    connections have ``TCP_NODELAY`` set.

    The protocol is given as ``IPPROTO_TCP`` (not 0): asyncio sets ``TCP_NODELAY`` on an accepted
    connection only when its socket says so, and without it an answer written in two segments
    (uvicorn writes the headers, then the body) waits for the client's delayed ACK (about 40 ms
    on Linux) on every request of a kept-alive connection after its first.  ``TCP_NODELAY`` is
    also set on the listening socket (Linux passes it on to accepted connections).

    ``reuse_port``: ``SO_REUSEPORT``, so that the other server processes of ``--processes`` bind the
    same port and the kernel spreads new connections over them.  Unless ``join`` (one of those other
    processes), the port must be free first: ``SO_REUSEPORT`` alone would let this server share a
    port another ``--processes`` server of the same user listens on, each answering some requests.

    Raises:
        ServeError: the address cannot be bound (in use, not local), naming it; ``reuse_port`` where
            the platform has no ``SO_REUSEPORT``.
    """
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    if reuse_port and not hasattr(socket, "SO_REUSEPORT"):
        raise ServeError("--processes above 1 needs SO_REUSEPORT, which this platform lacks; use --processes 1")
    if reuse_port and not join and port != 0:  # free? (a plain bind fails where any listener holds it)
        bind(host, port).close()
    sock = socket.socket(fam, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
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


def start_processes(count: int, model_dir: str, name: str, host: str, port: int, threads: int,
                    options: dict) -> list:
    """Start ``count`` more server processes (``multiprocessing`` spawn) on ``host:port``: each loads
    the model from ``model_dir``, binds the port with ``SO_REUSEPORT`` (the first one's socket must
    have it too, :func:`bind`), reports back and serves with ``options`` (:func:`serve`'s keyword
    arguments) and ``threads`` intra-op threads.  Returns once every one is listening; each ends when
    the process that started it does (SIGTERM from :func:`serve`, or on its death).

    Raises:
        ServeError: a process could not load the model or bind (its message), or did not report
            within 10 minutes; the others are stopped.
    """
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    procs, conns = [], []
    try:
        for i in range(count):
            here, there = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_serve_child, name=f"dlrmctl-serve-process-{i + 2}", daemon=False,
                            args=(there, model_dir, name, host, port, threads, f"{i + 2} of {count + 1}", options))
            p.start()
            there.close()
            procs.append(p)
            conns.append(here)
        for p, c in zip(procs, conns):
            if not c.poll(600):
                raise ServeError(f"server {p.name} did not start within 10 minutes")
            try:
                msg = c.recv()
            except EOFError:
                msg = f"exited with code {p.join(5) or p.exitcode} while starting"
            if msg:
                raise ServeError(f"server {p.name}: {msg}")
    except BaseException:
        stop_processes(procs)
        raise
    finally:
        for c in conns:
            c.close()
    return procs


def stop_processes(procs: list, sig: int | None = signal.SIGTERM, wait: float = 90.0) -> list[int]:
    """Send ``sig`` (None: none, they were told already) to each live process of :func:`start_processes`,
    wait up to ``wait`` seconds for them (they drain), kill any left; returns their exit codes."""
    for p in procs:
        if sig is not None and p.is_alive():
            try:
                os.kill(p.pid, sig)
            except ProcessLookupError:
                pass
    end = time.monotonic() + wait
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs]


def _serve_child(conn: Any, model_dir: str, name: str, host: str, port: int, threads: int, process: str,
                 options: dict) -> None:
    """One extra server process of :func:`start_processes`."""
    try:  # end with the parent, whatever kills it (Linux)
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent sends SIGTERM
    torch.set_num_threads(threads)
    try:
        from dlrmctl.inference.export import load_exported

        model = load_exported(model_dir)
        sock = bind(host, port, reuse_port=True, join=True)
    except Exception as e:  # noqa: BLE001 - reported by the parent as one line
        conn.send(str(e) or type(e).__name__)
        conn.close()
        return
    conn.send("")
    conn.close()
    serve(model, name, sock, process=process, child=True, **options)


def serve(model: Any, name: str, sock: socket.socket, max_batch_rows: int, max_delay_ms: float, max_queue_rows: int,
          workers: int, process: str = "1 of 1", others: list | None = None, child: bool = False,
          max_request_mb: float = 64.0) -> str | None:
    """Run the server on ``sock`` (from :func:`bind`; connections made before this starts wait in its
    backlog) until SIGTERM / SIGINT; every request received is answered first.

    Args:
        process: this process's label (``"1 of 2"``) in ``dlrmctl_serve_process_info``.
        others: the processes of :func:`start_processes` serving the same port: sent SIGTERM as soon as
            this one is asked to stop (each drains its own requests), waited for before returning.
        child: one of ``others`` of another process: SIGINT (Ctrl-C reaches the whole process group)
            does not stop it, its parent sends SIGTERM; a SIGTERM after it stopped is ignored.

    Returns:
        the name of the signal that stopped it (``SIGTERM``), or None.

    Raises:
        ServeError: one of ``others`` did not exit cleanly (some of its requests may be unanswered).
    """
    import uvicorn

    app = build_app(model, name, max_batch_rows, max_delay_ms, max_queue_rows, workers, process, max_request_mb)
    http, loop = http_stack()
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", http=http, loop=loop,
                            timeout_graceful_shutdown=60, backlog=2048)
    stopping: list[int] = []

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if child and sig == signal.SIGINT:
                return
            if others and not stopping:
                stopping.append(sig)
                for p in others:
                    if p.is_alive():
                        try:
                            os.kill(p.pid, signal.SIGTERM)
                        except ProcessLookupError:
                            pass
            super().handle_exit(sig, frame)

    server = Server(config)
    caught: list[int] = []

    def after(sig, frame):  # uvicorn re-raises the signal it drained on: note it, do not die by it
        if child and sig == signal.SIGINT:
            return
        caught.append(sig)
        server.should_exit = True  # one before uvicorn's own handlers are in: it stops right after starting

    old = {s: signal.signal(s, after) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        if not child:  # a child keeps `after`: its parent's late SIGTERM must not kill it while it exits
            for s, h in old.items():
                signal.signal(s, h)
        sock.close()
        codes = stop_processes(others, None if stopping else signal.SIGTERM) if others else []
    bad = [(p.name, c) for p, c in zip(others or [], codes) if c != 0]
    if bad:
        raise ServeError(f"server {bad[0][0]} exited with code {bad[0][1]}; requests it held may be unanswered")
    return signal.Signals(caught[0]).name if caught else None
