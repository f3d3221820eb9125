"""JSON tensor data without Python lists: the numeric ``"data"`` arrays of an infer request are cut
out of the body before ``json.loads`` (:func:`cut_numeric_arrays`) and parsed by NumPy's C text
parser straight into int64 / float64 (:func:`parse_numbers`).

A JSON id as a Python ``int`` in a list costs 36 bytes and ~0.1 µs to build, then more to check and
convert; 16M ids in a 30 MB body took the server to GBs.  Here an id costs its 8 bytes and is parsed
in C; the JSON left for ``json.loads`` is the request's small skeleton (names, datatypes, shapes).
An array that is not plain numbers (``true``, strings, empty elements, unbalanced brackets) is left
in place and decoded as before, so the result equals ``json.loads``'s for every valid body.
:func:`numeric_inputs` decodes a request's INT64 and FP32 inputs, each kind together (short lists
and cut-out arrays).
"""

import math
import re
import warnings

import numpy as np

#: ``"data": [...]`` whose text is only numbers, signs, exponents, commas, whitespace and brackets
_DATA = re.compile(rb'"data"\s*:\s*(\[[-+0-9.eE,\s\[\]]*\])')
#: the whitespace a cut-out array may hold (``\s`` of :data:`_DATA`: JSON's four and ``\f``, ``\v``);
#: an empty element, ``1, ,2``, is two commas with only these between (NumPy reads 0, JSON refuses it)
_WHITESPACE = (b" ", b"\t", b"\n", b"\r", b"\f", b"\v")
#: after a ``"data"`` key: the colon and an array's opening bracket
_KEY_TAIL = re.compile(rb"\s*:\s*\[")
#: what a flat numeric array holds between its brackets (:data:`_DATA`'s characters but the brackets)
_FLAT = b"-+0123456789.eE," + b"".join(_WHITESPACE)
#: the longest flat array checked by ``bytes.translate`` (a copy of the text while it runs)
_TRANSLATE_BYTES = 1 << 16
_UNBRACKET = bytes.maketrans(b"[]", b"  ")
#: the placeholder key of a cut-out array: ``{"\u0000": k}`` (no valid tensor data is an object)
SPAN_KEY = "\x00"
#: arrays shorter than this stay in the JSON (json.loads is as fast for a handful of numbers)
MIN_BYTES = 64
#: float text at least this long is parsed by Arrow (below, its fixed cost per call exceeds what it saves)
ARROW_BYTES = 2048
#: numbers parsed per NumPy call of a long array: another thread (the event loop) runs in between
CHUNK_BYTES = 1 << 20


def _has_empty(text: bytes) -> bool:
    """Whether the numbers ``text`` (brackets removed) has an empty element: ``1, ,2``, ``1,``,
    ``,1``: two commas with only whitespace between, or a comma at either end (with the whitespace
    deleted first, a plain substring search: 3x a regex over the text)."""
    if any(c in text for c in _WHITESPACE):
        text = text.translate(None, b"".join(_WHITESPACE))
    return text.startswith(b",") or text.endswith(b",") or b",," in text


def _balanced(span: bytes) -> bool:
    """Whether the brackets of ``span`` (``[`` first, ``]`` last) nest as one array: the depth
    never returns to 0 before the end (``[1],[2]`` is two arrays, not one)."""
    if span.count(b"[") == 1:
        return span.count(b"]") == 1
    a = np.frombuffer(span, np.uint8)
    at = a[(a == 91) | (a == 93)]
    depth = np.cumsum(np.where(at == 91, 1, -1))
    return bool(depth[-1] == 0 and (depth[:-1] > 0).all())


def _array_at(body: bytes, key: int) -> tuple[int, int, bytes] | None:
    """``(start, end, text)`` of the numeric array that is the value of the ``"data"`` key at ``key``
    (as :data:`_DATA` matches it there; the text copied once), or None.  A flat array (the common case) is found by a search
    for its ``]`` and its text checked by one ``bytes.translate``, not the regex's character loop
    (up to :data:`_TRANSLATE_BYTES`: ``translate`` holds a second copy while it runs); a longer or
    nested one by the regex, its brackets balanced (:func:`_balanced`)."""
    m = _KEY_TAIL.match(body, key + 6)
    if m is None:
        return None
    a = m.end() - 1
    b = body.find(b"]", a) + 1
    if 0 < b - a <= _TRANSLATE_BYTES and body.find(b"[", a + 1, b) < 0:  # flat: numbers, signs, commas, spaces
        span = body[a:b]
        return None if span.translate(None, _FLAT) != b"[]" else (a, b, span)
    m = _DATA.match(body, key)
    if m is None:
        return None
    span = m.group(1)
    return (m.start(1), m.end(1), span) if _balanced(span) else None


def cut_numeric_arrays(body: bytes) -> tuple[bytes, list[bytes]]:
    """``(json text, arrays)``: each numeric ``"data"`` array of ``body`` (at least :data:`MIN_BYTES`
    long) replaced by ``{"\\u0000": k}``, ``arrays[k]`` its text (brackets included).

    Only a real key is cut (its opening quote not escaped: in valid JSON an unescaped ``"data"``
    followed by ``:`` is an object key), and only a balanced array; anything else is left to ``json.loads``.
    """
    pieces, arrays, pos = [], [], 0
    key = body.find(b'"data"')
    while key >= 0:
        nxt = key + 6
        span = _array_at(body, key)
        if span is not None and len(span[2]) >= MIN_BYTES:
            a, b, text = span
            slashes = 0
            while key - slashes > 0 and body[key - slashes - 1] == 92:  # backslashes before the key's quote
                slashes += 1
            if not slashes % 2:
                pieces += [body[pos:a], b'{"\\u0000":%d}' % len(arrays)]
                arrays.append(text)
                pos = nxt = b
        key = body.find(b'"data"', nxt)
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


def arrow_floats(text: bytes) -> np.ndarray | None:
    """float64 numbers of ``text`` (comma separated, no brackets) by Arrow's string -> double cast
    (the fast_float parser, correctly rounded as ``json.loads``), or None where Arrow refuses it
    (a number JSON or Arrow does not read: the caller falls back to NumPy's parser)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    try:
        parts = pc.split_pattern(pa.scalar(text.decode("ascii")), ",")
        return pc.cast(parts.values, pa.float64()).to_numpy(zero_copy_only=False)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, UnicodeDecodeError):
        return None


def parse_flat_spans(spans: list[bytes], integer: bool) -> list[np.ndarray] | None:
    """The numbers of several flat cut-out arrays (``[1,2,3]``, no nesting) parsed by one call over
    their joined text, one view per span: int64 (``integer``) by NumPy's C parser, float64 by
    Arrow's (3x NumPy's float parser; whitespace after a comma, as ``json.dumps`` writes, is
    dropped first; NumPy's where Arrow refuses the text).  None when any span is nested or empty,
    the joined text is over :data:`CHUNK_BYTES`, or a number is not plain (the caller then parses
    each span with :func:`parse_numbers`, which says why)."""
    if not spans or any(sp.count(b"[") != 1 for sp in spans):
        return None
    inner = [sp[1:-1] for sp in spans]
    if any(not t.strip() for t in inner):
        return None
    text = b",".join(inner)
    if len(text) > CHUNK_BYTES or _has_empty(text):
        return None
    counts = [t.count(b",") + 1 for t in inner]
    nums = None
    if not integer and len(text) >= ARROW_BYTES:
        tight = text.replace(b", ", b",")
        if not any(c in tight for c in _WHITESPACE):
            nums = arrow_floats(tight)
    if nums is None:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            try:
                nums = np.fromstring(text, dtype=np.int64 if integer else np.float64, sep=",")
            except (ValueError, DeprecationWarning):
                return None
    if nums.size != sum(counts):
        return None
    out, start = [], 0
    for n in counts:
        out.append(nums[start:start + n])
        start += n
    return out


#: the JSON datatypes :func:`numeric_inputs` decodes (the model's inputs: ids and bag lengths INT64,
#: dense features and per-id weights FP32) -> their numpy dtype
_KINDS = {"INT64": np.int64, "FP32": np.float32}


def _plain(raw: list, integer: bool) -> bool:
    """Whether ``raw`` is a flat list of Python ints (and floats unless ``integer``): no bools, no
    nested lists, no strings: what one NumPy conversion reads exactly as ``json.loads`` gave it."""
    if integer:
        return all(type(x) is int for x in raw)
    return all(type(x) is float or type(x) is int for x in raw)


def numeric_inputs(inputs: list, arrays: list[bytes]) -> tuple[dict[str, tuple[str, list[int], np.ndarray]], list]:
    """``(decoded, the other inputs)``: the JSON decoder of a request's numeric inputs.

    Every ``INT64`` or ``FP32`` input (any shape) whose ``data`` is a flat list of as many plain
    numbers as its shape holds (a small request's inputs) or a flat array cut out of the body
    (``arrays``: :func:`cut_numeric_arrays`) is decoded to ``(datatype, shape, array)``: int64 /
    float32 of that shape.  The inputs of one kind are converted together: the lists by one NumPy
    conversion, the cut-out arrays by one parse over their joined text (:func:`parse_flat_spans`),
    not one call (and its checks) per input.  The rest go through the protocol's per-input decoding,
    which reports what is wrong: other datatypes, binary data, nested or non-numeric lists, a count
    other than the shape's, a repeated name (its later inputs), and every input of a kind whose
    joint conversion fails (an int beyond int64, a number NumPy does not read)."""
    # int lists, float lists, int cut-out arrays, float cut-out arrays: [(input, name, datatype, shape, count, data)]
    groups: tuple[list, list, list, list] = ([], [], [], [])
    names: set = set()
    rest = []
    for inp in inputs:
        if type(inp) is dict and "parameters" not in inp:
            dt, name, shape = inp.get("datatype"), inp.get("name"), inp.get("shape")
            if (dt == "INT64" or dt == "FP32") and type(name) is str and type(shape) is list and name not in names:
                if len(shape) == 1:
                    n = shape[0]
                    ok = type(n) is int and n >= 0
                else:
                    ok = all(type(x) is int and x >= 0 for x in shape)
                    n = math.prod(shape) if ok else 0
                if ok:
                    raw, kind = inp.get("data"), 0 if dt == "INT64" else 1
                    if type(raw) is list:
                        if len(raw) == n:
                            groups[kind].append((inp, name, dt, shape, n, raw))
                            names.add(name)
                            continue
                    elif type(raw) is dict:
                        at = raw.get(SPAN_KEY)
                        if type(at) is int and 0 <= at < len(arrays):
                            groups[kind + 2].append((inp, name, dt, shape, n, arrays[at]))
                            names.add(name)
                            continue
        rest.append(inp)
    out: dict[str, tuple[str, list[int], np.ndarray]] = {}
    for kind, group in enumerate(groups):
        if not group:
            continue
        integer = kind % 2 == 0
        dtype = np.int64 if integer else np.float32
        if kind < 2:  # lists: one check and one conversion over all of them; per input where that fails
            flat: list = []
            for g in group:
                flat += g[5]
            if not _plain(flat, integer):
                rest += [g[0] for g in group if not _plain(g[5], integer)]
                group = [g for g in group if _plain(g[5], integer)]
                flat = [x for g in group for x in g[5]]
            try:
                values = np.array(flat, dtype)
            except OverflowError:
                rest += [g[0] for g in group]
                continue
            parsed = []
            start = 0
            for g in group:
                parsed.append(values[start:start + g[4]])
                start += g[4]
        else:
            parsed = parse_flat_spans([g[5] for g in group], integer) or [None] * len(group)
        for (inp, name, dt, shape, n, _), a in zip(group, parsed):
            if a is None or a.size != n:
                rest.append(inp)
                continue
            if a.dtype != dtype:
                a = a.astype(dtype)
            out[name] = (dt, shape, a if len(shape) == 1 else a.reshape(shape))
    return out, rest
