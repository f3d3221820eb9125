"""The Open Inference Protocol (KServe v2) as this server reads and writes it: the model's contract
(:class:`ModelSpec`), one request decoded and checked (:func:`decode_request` -> :class:`Rows`), raw
log lines through ``dlrmctl predict``'s transform (:class:`RawTransform`) and the infer answer
(:func:`infer_response`, JSON or Triton's binary tensor extension)."""

import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from dlrmctl.errors import UserError, quoted
from dlrmctl.inference.serve.json_tensors import SPAN_KEY, cut_numeric_arrays, numeric_inputs, parse_numbers


#: Open Inference Protocol datatype -> numpy dtype (the ones this server reads)
_NP = {"FP32": np.float32, "FP64": np.float64, "INT64": np.int64, "INT32": np.int32, "BOOL": np.bool_}
RAW_INPUT = "raw"
DENSE_INPUT = "dense"


class ServeError(RuntimeError, UserError):
    """A server that cannot start (bad option, port in use, model not loadable as served)."""


class BadRequest(ValueError):
    """A request the model cannot score: answered 400 with this one-line message (naming the input)."""




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
        raw: whether raw lines can be scored (the manifest records the preprocessing, and its raw rows
            carry per-id weights for every weighted feature).
        max_ids_per_row: ids a request may carry per row of ``dense`` on average, all features together
            (``--max-ids-per-row``): checked on the declared shapes before any data is parsed.
    """

    name: str
    num_dense: int
    features: list[str]
    weighted: list[str]
    rows: dict[str, int]
    on_invalid_id: str
    raw: bool
    max_ids_per_row: int = 1024
    known: frozenset = field(init=False, repr=False)
    length_names: list[str] = field(init=False, repr=False)
    feature_set: frozenset = field(init=False, repr=False)
    limits: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        #: every input name a request may carry; ``f.lengths`` per feature; ``[F]`` int64 table rows per
        #: feature (ids must be below; int64's maximum where no table is known)
        self.length_names = [f"{f}.lengths" for f in self.features]
        self.known = frozenset({DENSE_INPUT, *self.features, *self.length_names,
                                *(f"{f}.weights" for f in self.weighted)} | ({RAW_INPUT} if self.raw else set()))
        self.feature_set = frozenset(self.features)
        self.limits = np.array([self.rows.get(f, np.iinfo(np.int64).max) for f in self.features], np.int64)

    @classmethod
    def of(cls, model: Any, name: str, max_ids_per_row: int = 1024) -> "ModelSpec":
        """From an :class:`~dlrmctl.inference.export.ExportedModel`."""
        m = model.manifest
        rows: dict[str, int] = {}
        for t in m.get("tables") or []:
            if t.get("ids") == "raw":  # managed collision: raw 64-bit ids, mapped to rows by the program
                continue
            for f in t.get("features") or []:
                rows[f] = min(rows.get(f, 1 << 62), int(t["num_embeddings"]))
        return cls(name=name, num_dense=model.num_dense, features=list(model.feature_names),
                   weighted=list(model.weighted_features), rows=rows,
                   on_invalid_id=str(m.get("on_invalid_id", "error")),
                   raw=_has_raw_transform(m, model.weighted_features), max_ids_per_row=max_ids_per_row)

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
        return {"name": self.name, "versions": list(VERSIONS), "platform": platform, "inputs": inputs,
                "outputs": [{"name": "score", "datatype": "FP32", "shape": [-1]},
                            {"name": "logit", "datatype": "FP32", "shape": [-1]}],
                "parameters": {"on_invalid_id": self.on_invalid_id}}


#: the model versions this server serves (one artifact, version "1"), as ``/v2/models/{name}/versions/{v}`` names them
VERSIONS = ("1",)
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


def check_model_name(name: str, where: str = "--name") -> str:
    """``name`` if it can be one segment of ``/v2/models/{name}/infer``: letters, digits, ``_``, ``.``
    and ``-``, not starting with ``.`` or ``-``, at most 128 characters (a ``/`` would make every
    path of the model unreachable).

    Raises:
        ServeError: naming ``where`` (the option, or where the default name came from) and the name.
    """
    if not (0 < len(name) <= 128 and set(name) <= _NAME_CHARS and name[0] not in ".-"):
        raise ServeError(f"{where}: model name {name!r} cannot be served as /v2/models/{{name}}: use 1-128 letters, "
                         "digits, '_', '.' or '-', not starting with '.' or '-'")
    return name


def no_version(name: str, version: str) -> str:
    """The 404 message for a version of ``name`` this server does not serve."""
    return f"model '{name}' has no version {quoted(version)} here (versions served: {', '.join(VERSIONS)})"


def _has_raw_transform(manifest: dict, weighted: list[str] | tuple = ()) -> bool:
    """Whether raw lines of the model's dataset can be preprocessed here (the ``raw`` input): a
    manifest with its training preprocessing, of a dataset :data:`~dlrmctl.inference.predict.RAW_TRANSFORMS`
    knows (Criteo, a schema's log), whose raw rows carry per-id weights for each of the ``weighted``
    features (a schema's weight column); a synthetic or MovieLens model is served from tensors only."""
    from dlrmctl.inference.predict import RAW_TRANSFORMS, raw_weighted_features

    pre = manifest.get("preprocessing")
    return (isinstance(pre, dict) and pre.get("dataset") in RAW_TRANSFORMS
            and set(weighted) <= raw_weighted_features(manifest))


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


def _tensor(inp: Any, binary: memoryview | None, pos: int,
            arrays: list[bytes]) -> tuple[str, str, list[int], np.ndarray | list, int]:
    """``(name, datatype, shape, data, pos after it)`` of one request input (JSON ``data`` or the
    binary chunk at ``pos``: a zero-copy ``np.frombuffer`` view)."""
    if not isinstance(inp, dict):
        raise BadRequest("each element of 'inputs' must be an object with name, datatype, shape, data")
    name = inp.get("name")
    if not isinstance(name, str):
        raise BadRequest("an input has no 'name'")
    dt, shape = inp.get("datatype"), inp.get("shape")
    if not isinstance(dt, str):
        raise BadRequest(f"input {quoted(name)}: no 'datatype'")
    if type(shape) is list and len(shape) == 1 and type(shape[0]) is int and shape[0] >= 0:  # most inputs
        count = shape[0]
    elif isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape):
        count = math.prod(shape)
    else:
        raise BadRequest(f"input {quoted(name)}: 'shape' must be a list of non-negative integers, got {quoted(shape)}")
    par = inp.get("parameters")
    size = par.get("binary_data_size") if isinstance(par, dict) else None
    if size is not None:
        if binary is None or type(size) is not int or size < 0 or pos + size > len(binary):
            raise BadRequest(f"input {quoted(name)}: binary_data_size {quoted(size)} does not fit the binary part of the request")
        end = pos + size
        if dt == "BYTES":
            chunk, out, off = binary[pos:end], [], 0
            while off < len(chunk):
                if off + 4 > len(chunk):
                    raise BadRequest(f"input {quoted(name)}: truncated BYTES element")
                (ln,) = struct.unpack_from("<I", chunk, off)
                out.append(bytes(chunk[off + 4:off + 4 + ln]))
                off += 4 + ln
            data: Any = out
        else:
            item = _ITEM.get(dt)
            if item is None:
                raise BadRequest(f"input {quoted(name)}: datatype {dt} is not read by this server")
            if size != count * item:
                raise BadRequest(f"input {quoted(name)}: {size} bytes of binary data for shape {shape} {dt} "
                                 f"(expected {count * item})")
            data = np.frombuffer(binary, _LE[dt], count, pos)
            if len(shape) != 1:
                data = data.reshape(shape)
            return name, dt, shape, data, end
        pos = end
    else:
        raw = inp.get("data")
        if raw is None:
            raise BadRequest(f"input {quoted(name)}: no 'data' (and no binary_data_size)")
        fast = None
        if type(raw) is dict and SPAN_KEY in raw:  # a numeric array cut out of the JSON (json_tensors)
            k = raw[SPAN_KEY]
            if type(k) is not int or not 0 <= k < len(arrays):
                raise BadRequest("tensor 'data' must be a (nested) list")
            span = arrays[k]
            if dt == "BYTES":
                raise BadRequest(f"input {quoted(name)}: BYTES data must be strings")
            fast = parse_numbers(span, integer=not dt.startswith("FP"))
            if fast is None:  # not plain numbers: decoded as JSON, refused or read below
                try:
                    raw = json.loads(span)
                except ValueError as e:
                    raise BadRequest(f"the request body is not JSON: input {quoted(name)} data: {e}") from None
        if fast is not None:
            if dt not in _NP:
                raise BadRequest(f"input {quoted(name)}: datatype {dt} is not read by this server")
            info = np.iinfo(_NP[dt]) if dt.startswith("INT") else None
            if info is not None and fast.size and (fast.min() < info.min or fast.max() > info.max):
                raise BadRequest(f"input {quoted(name)}: data is not a list of {dt} numbers")
            data = fast.astype(_NP[dt], copy=False)
        elif dt == "BYTES":
            flat = _flatten(raw)
            if not all(isinstance(x, str) for x in flat):
                raise BadRequest(f"input {quoted(name)}: BYTES data must be strings")
            data = [x.encode() for x in flat]
        else:
            if dt not in _NP:
                raise BadRequest(f"input {quoted(name)}: datatype {dt} is not read by this server")
            try:
                arr = np.asarray(_flatten(raw), dtype=np.float64 if dt.startswith("FP") else object)
                if dt.startswith("FP"):
                    data = arr.astype(_NP[dt])
                else:
                    if not all(isinstance(x, int) and not isinstance(x, bool) for x in arr.tolist()) and dt != "BOOL":
                        raise ValueError("not integers")
                    data = np.asarray(arr.tolist(), dtype=_NP[dt])
            except (ValueError, TypeError, OverflowError):
                raise BadRequest(f"input {quoted(name)}: data is not a list of {dt} numbers") from None
    got = data.size if isinstance(data, np.ndarray) else len(data)
    if got != count:
        raise BadRequest(f"input {quoted(name)}: {got} values for shape {shape} ({count} expected)")
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
        raise BadRequest(f"input {quoted(name)}: datatype must be {datatype}, got {dt}")
    if len(shape) != ndim:
        raise BadRequest(f"input {quoted(name)}: shape must have {ndim} dimension(s), got {shape}")
    return data


def _check_id_count(inputs: list, spec: ModelSpec) -> None:
    """Refuse a request whose declared id shapes exceed ``spec.max_ids_per_row`` per row of ``dense``
    (1 row when ``dense`` is absent or malformed), before any data is parsed or copied.

    Raises:
        BadRequest: naming the ids, the rows and the bound.
    """
    rows, ids = 1, 0
    features = spec.feature_set
    for inp in inputs:
        shape = inp.get("shape") if type(inp) is dict else None
        if type(shape) is not list:
            continue
        name = inp.get("name")
        if len(shape) == 1:  # most inputs
            n = shape[0]
            if type(n) is not int or n < 0:
                continue
        elif all(type(x) is int and x >= 0 for x in shape):
            n = math.prod(shape)
        else:
            continue
        if name in features:
            ids += n
        elif name == DENSE_INPUT and shape:
            rows = max(shape[0], 1)
    if ids > rows * spec.max_ids_per_row:
        raise BadRequest(f"the request has {ids:,} ids for {rows:,} row(s): more than {spec.max_ids_per_row:,} per row "
                         "(all features together; --max-ids-per-row); split it or raise the bound")


def decode_request(body: bytes, header_length: int | None, spec: ModelSpec,
                   transform: Callable[[list[bytes]], Rows] | None) -> tuple[Rows, dict]:
    """Decode and check one ``/infer`` body against the model's contract.

    The JSON header is parsed once; each binary tensor is a zero-copy view of the body; the ids of
    all features are checked against their tables in one vectorized pass.

    Args:
        body: the HTTP body: JSON, or (``header_length`` given) a JSON header of that many bytes
            followed by the binary tensor data.
        spec: the model's contract.
        transform: raw lines -> their :class:`Rows` in ``spec.features`` order (None: the model
            cannot score raw lines).

    Returns:
        ``(rows, request JSON)``.

    Raises:
        BadRequest: naming the input and what was expected.
    """
    if header_length is not None and not 0 <= header_length <= len(body):
        raise BadRequest(f"Inference-Header-Content-Length {header_length} is outside the body's {len(body)} bytes")
    head = body if header_length is None else body[:header_length]
    binary = None if header_length is None else memoryview(body)[header_length:]
    head, arrays = cut_numeric_arrays(head)
    try:
        req = json.loads(head)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not JSON: {e}") from None
    if not isinstance(req, dict) or not isinstance(req.get("inputs"), list) or not req["inputs"]:
        raise BadRequest("the request must be a JSON object with a non-empty 'inputs' list")
    _check_id_count(req["inputs"], spec)
    pos = 0
    got, rest = numeric_inputs(req["inputs"], arrays)
    for inp in rest:
        name, dt, shape, data, pos = _tensor(inp, binary, pos, arrays)
        if name in got:
            raise BadRequest(f"input {quoted(name)} is given twice")
        got[name] = (dt, shape, data)
    if binary is not None and pos != len(binary):
        raise BadRequest(f"{len(binary) - pos} bytes follow the binary tensors: the inputs' binary_data_size add up "
                         f"to {pos} of the {len(binary)} bytes after the JSON header (Inference-Header-Content-Length)")
    unknown = [k for k in got if k not in spec.known]
    if unknown:
        hint = f", {RAW_INPUT}" if spec.raw else ""
        raise BadRequest(f"input {quoted(min(unknown))} is not an input of model {spec.name} (inputs: {DENSE_INPUT}, "
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
        return transform(lines), req
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



def infer_response(req: dict, name: str, scores: np.ndarray, logits: np.ndarray) -> tuple[bytes, bytes]:
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
    res: dict = {"model_name": name, "model_version": VERSIONS[0], "outputs": []}
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


def json_error(msg: str) -> bytes:
    return json.dumps({"error": msg}, ensure_ascii=False, separators=(",", ":")).encode()


