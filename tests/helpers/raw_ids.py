"""Criteo-format lines whose categorical values follow a Zipf law (raw-id / managed-collision tests)."""

from __future__ import annotations

import pathlib

import numpy as np


def write_zipf_criteo_lines(path: pathlib.Path, rows: int, alpha: float, seed: int) -> pathlib.Path:
    """Write ``rows`` tab-separated Criteo lines to ``path``: a 0/1 label, 13 dense integers in
    [0, 20) and 26 categorical values ``%08x`` of a Zipf(``alpha``) rank scattered over 32 bits
    (multiplicative hashing by 2654435761), all from ``numpy.random.default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(rows):
        cats = ["%08x" % (int(rng.zipf(alpha)) * 2654435761 % 2**32) for _ in range(26)]
        dense = [str(int(x)) for x in rng.integers(0, 20, 13)]
        lines.append("\t".join([str(int(rng.integers(2)))] + dense + cats))
    path.write_text("\n".join(lines) + "\n")
    return path
