"""LineLimit: every line shorter than the limit passes byte for byte, in reads of exactly the size
asked; each longer one is replaced by what the caller gives for its physical line number."""

import io

import numpy as np
import pytest

from dlrmctl.data.long_lines import LineLimit


def _lines(seed: int, n: int, limit: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, limit - 1, n)
    lens[rng.random(n) < 0.1] = limit + rng.integers(0, 3 * limit, 1)[0]  # some longer than a block
    return [b"y" * int(k) for k in lens]


@pytest.mark.parametrize("seed,read,last_newline", [(0, 7, True), (1, 64, False), (2, 1000, True), (3, 33, False)])
def test_short_lines_pass_unchanged_and_long_ones_are_replaced_by_line_number(seed, read, last_newline):
    limit = 50
    lines = _lines(seed, 300, limit)
    text = b"\n".join(lines) + (b"\n" if last_newline else b"")
    seen = []

    def replace(ln: int) -> bytes:
        seen.append(ln)
        return b"#%d" % ln

    f = LineLimit(lambda: io.BytesIO(text), limit, replace)
    out = []
    while True:
        b = f.read(read)
        out.append(b)
        if len(b) < read:
            break
    assert all(len(b) == read for b in out[:-1])  # exactly what was asked until the end
    want = [ln if len(ln) < limit else b"#%d" % (i + 1) for i, ln in enumerate(lines)]
    assert b"".join(out) == b"\n".join(want) + (b"\n" if last_newline else b"")
    assert seen == [i + 1 for i, ln in enumerate(lines) if len(ln) >= limit] and seen


def test_a_line_of_limit_bytes_is_the_first_one_refused():
    got = LineLimit(lambda: io.BytesIO(b"a" * 9 + b"\n" + b"b" * 10 + b"\nc"), 10, lambda ln: b"<%d>" % ln).read()
    assert got == b"a" * 9 + b"\n<2>\nc"


def test_the_replacement_may_raise():
    def refuse(ln: int) -> bytes:
        raise ValueError(f"line {ln}")

    with pytest.raises(ValueError, match="line 3"):
        LineLimit(lambda: io.BytesIO(b"a\nb\n" + b"c" * 100), 10, refuse).read()


@pytest.mark.parametrize("last_newline", [True, False])
def test_json_lines_of_a_block_or_more_are_named_by_line_or_skipped_wherever_they_stand(last_newline):
    import json

    import pyarrow as pa

    from dlrmctl.data.columnar import DataError
    from dlrmctl.data.logs.read_json import iter_json_lines

    block = 64
    rows = [{"k": i, "s": "x" * (block if i in (3, 4, 17, 29) else i % 7)} for i in range(30)]
    text = "\n".join(json.dumps(r) for r in rows).encode() + (b"\n" if last_newline else b"")

    def read(on_bad_line):
        got = list(iter_json_lines("t.jsonl", ["k", "s"], on_bad_line, block, lambda: pa.BufferReader(text),
                                   lambda cols, keys, bad: (cols["k"].to_pylist(), keys.tolist(), bad)))
        return [k for g in got for k in g[0]], [k for g in got for k in g[1]], sum(g[2] for g in got)

    values, lines, skipped = read("skip")
    assert values == [i for i in range(30) if i not in (3, 4, 17, 29)] and skipped == 4
    assert lines == [v + 1 for v in values]  # each row keeps its physical line number
    with pytest.raises(DataError, match=r"t.jsonl:4: a line of 64 bytes or more"):
        read("error")
