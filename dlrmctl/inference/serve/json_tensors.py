"""JSON tensor data without Python lists: the numeric ``"data"`` arrays of an infer request are cut
out of the body before ``json.loads`` (:func:`cut_numeric_arrays`) and parsed by NumPy's C text
parser straight into int64 / float64 (:func:`parse_numbers`).

A JSON id as a Python ``int`` in a list costs 36 bytes and ~0.1 µs to build, then more to check and
convert; 16M ids in a 30 MB body took the server to GBs.  Here an id costs its 8 bytes and is parsed
in C; the JSON left for ``json.loads`` is the request's small skeleton (names, datatypes, shapes).
An array that is not plain numbers (``true``, strings, empty elements, unbalanced brackets) is left
in place and decoded as before, so the result equals ``json.loads``'s for every valid body.
:func:`int_inputs` decodes the id inputs of a request together (short lists and cut-out arrays).
"""

import re
import warnings

import numpy as np

#: ``"data": [...]`` whose text is only numbers, signs, exponents, commas, whitespace and brackets
_DATA = re.compile(rb'"data"\s*:\s*(\[[-+0-9.eE,\s\[\]]*\])')
#: an empty element inside (``1, ,2``): NumPy reads whitespace as 0; JSON refuses it
_EMPTY_MID = re.compile(rb",\s*,")
_UNBRACKET = bytes.maketrans(b"[]", b"  ")
#: the placeholder key of a cut-out array: ``{"\u0000": k}`` (no valid tensor data is an object)
SPAN_KEY = "\x00"
#: arrays shorter than this stay in the JSON (json.loads is as fast for a handful of numbers)
MIN_BYTES = 64
#: numbers parsed per NumPy call of a long array: another thread (the event loop) runs in between
CHUNK_BYTES = 1 << 20


def _has_empty(text: bytes) -> bool:
    """Whether the numbers ``text`` (brackets removed) has an empty element: ``1, ,2``, ``1,``,
    ``,1`` (a scan for two commas apart, and the two ends: a regex anchored at ``$`` tries every comma)."""
    t = text.strip()
    return t.startswith(b",") or t.endswith(b",") or _EMPTY_MID.search(t) is not None


def _balanced(span: bytes) -> bool:
    """Whether the brackets of ``span`` (``[`` first, ``]`` last) nest as one array: the depth
    never returns to 0 before the end (``[1],[2]`` is two arrays, not one)."""
    if span.count(b"[") == 1:
        return span.count(b"]") == 1
    a = np.frombuffer(span, np.uint8)
    at = a[(a == 91) | (a == 93)]
    depth = np.cumsum(np.where(at == 91, 1, -1))
    return bool(depth[-1] == 0 and (depth[:-1] > 0).all())


def cut_numeric_arrays(body: bytes) -> tuple[bytes, list[bytes]]:
    """``(json text, arrays)``: each numeric ``"data"`` array of ``body`` (at least :data:`MIN_BYTES`
    long) replaced by ``{"\\u0000": k}``, ``arrays[k]`` its text (brackets included).

    Only a real key is cut (its opening quote not escaped: in valid JSON an unescaped ``"data"``
    followed by ``:`` is an object key), and only a balanced array; anything else is left to ``json.loads``.
    """
    pieces, arrays, pos = [], [], 0
    for m in _DATA.finditer(body):
        a, b = m.span(1)
        if b - a < MIN_BYTES:
            continue
        q, slashes = m.start(), 0
        while q - slashes > 0 and body[q - slashes - 1] == 92:  # backslashes before the key's quote
            slashes += 1
        if slashes % 2 or not _balanced(body[a:b]):
            continue
        pieces += [body[pos:a], b'{"\\u0000":%d}' % len(arrays)]
        arrays.append(body[a:b])
        pos = b
    if not arrays:
        return body, []
    pieces.append(body[pos:])
    return b"".join(pieces), arrays


def parse_numbers(span: bytes, integer: bool) -> np.ndarray | None:
    """The numbers of one cut-out array, flattened (nested arrays read row-major, as the JSON
    nesting lists them): int64 (``integer``; a decimal point or exponent refuses it) or float64.
    None when the text is not a plain list of numbers (the caller decodes it with ``json.loads``
    and reports what is wrong).  An integer beyond int64 saturates to int64's bound (an id outside
    every table either way)."""
    text = span.translate(_UNBRACKET) if span.count(b"[") > 1 else span[1:-1]
    if not text.strip():
        return np.zeros(0, np.int64 if integer else np.float64)
    if _has_empty(text):
        return None
    dt = np.int64 if integer else np.float64
    parts = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "could not be read to its end": a bad number
        start = 0
        while start < len(text):
            end = len(text) if len(text) - start <= CHUNK_BYTES else text.find(b",", start + CHUNK_BYTES)
            end = len(text) if end < 0 else end
            try:
                parts.append(np.fromstring(text[start:end], dtype=dt, sep=","))
            except (ValueError, DeprecationWarning):
                return None
            start = end + 1
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def parse_flat_int_spans(spans: list[bytes]) -> list[np.ndarray] | None:
    """The int64 numbers of several flat cut-out arrays (``[1,2,3]``, no nesting) parsed by one NumPy
    call over their joined text, one view per span; None when any span is nested, empty or not
    plain integers (the caller then parses each with :func:`parse_numbers`, which says why)."""
    if not spans or any(sp.count(b"[") != 1 for sp in spans):
        return None
    inner = [sp[1:-1] for sp in spans]
    if any(not t.strip() for t in inner):
        return None
    text = b",".join(inner)
    if len(text) > CHUNK_BYTES or _has_empty(text):
        return None
    counts = [t.count(b",") + 1 for t in inner]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            ids = np.fromstring(text, dtype=np.int64, sep=",")
        except (ValueError, DeprecationWarning):
            return None
    if ids.size != sum(counts):
        return None
    out, start = [], 0
    for n in counts:
        out.append(ids[start:start + n])
        start += n
    return out


def int_inputs(inputs: list, arrays: list[bytes]) -> tuple[dict[str, tuple[str, list[int], np.ndarray]], list]:
    """``(decoded, the other inputs)``: the ``INT64`` ``[n]`` inputs whose JSON ``data`` is either a
    flat list of ``n`` ints (a small request's ids) or a flat numeric array cut out of the body
    (``arrays``: :func:`cut_numeric_arrays`), each ``(datatype, shape, int64 view)``: the lists
    checked in one pass and converted by one NumPy call, the cut-out arrays parsed by one NumPy
    call over their joined text, instead of one call (and its checks) per input.  The rest go
    through the protocol's per-input decoding; anything unusual (a repeated name, a non-int
    element, an int beyond int64, a count other than the shape's) leaves every input to it, which
    reports it."""
    names: list[str] = []
    sizes: list[int] = []
    flat: list = []
    span_names: list[str] = []
    spans: list[bytes] = []
    rest = []
    for inp in inputs:
        if type(inp) is dict:
            raw, shape, name = inp.get("data"), inp.get("shape"), inp.get("name")
            if (type(name) is str and inp.get("datatype") == "INT64" and type(shape) is list and len(shape) == 1
                    and type(shape[0]) is int and "parameters" not in inp):
                if type(raw) is list and shape[0] == len(raw):
                    names.append(name)
                    sizes.append(len(raw))
                    flat += raw
                    continue
                if type(raw) is dict and type(raw.get(SPAN_KEY)) is int and 0 <= raw[SPAN_KEY] < len(arrays):
                    span_names.append(name)
                    spans.append(arrays[raw[SPAN_KEY]])
                    continue
        rest.append(inp)
    if not names and not spans:
        return {}, rest
    if len(set(names + span_names)) != len(names) + len(span_names) or not all(type(x) is int for x in flat):
        return {}, inputs
    out: dict[str, tuple[str, list[int], np.ndarray]] = {}
    if names:
        try:
            ids = np.array(flat, np.int64)
        except OverflowError:
            return {}, inputs
        start = 0
        for name, n in zip(names, sizes):
            out[name] = ("INT64", [n], ids[start:start + n])
            start += n
    if spans:
        parsed = parse_flat_int_spans(spans)
        if parsed is None:
            return {}, inputs
        for inp_name, a in zip(span_names, parsed):
            out[inp_name] = ("INT64", [a.size], a)
        shapes = {inp.get("name"): inp["shape"][0] for inp in inputs if type(inp) is dict and inp.get("name") in out}
        if any(shapes[k] != v[1][0] for k, v in out.items()):
            return {}, inputs
    return out, rest


def plain_numbers(raw: list, real: bool) -> bool:
    """Whether ``raw`` is a flat list of Python ints (and floats when ``real``), no bools or
    nested lists: what ``np.array`` converts exactly as the slow path would."""
    if real:
        return all(type(x) is float or type(x) is int for x in raw)
    return all(type(x) is int for x in raw)
