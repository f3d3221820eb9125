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
