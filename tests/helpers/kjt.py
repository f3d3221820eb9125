"""KeyedJaggedTensor helpers shared by the tests."""

from __future__ import annotations

import torch

from dlrmctl.sparse import KeyedJaggedTensor


def slice_kjt(kjt: KeyedJaggedTensor, s: int, e: int) -> KeyedJaggedTensor:
    """Samples ``[s, e)`` of every key of a uniform-stride KJT (a rank's part of a global batch),
    weights included when the KJT has them."""
    B = kjt.stride()
    offs = kjt.offsets()
    vals, ws = [], []
    for f in range(len(kjt.keys())):
        a, b = int(offs[f * B + s]), int(offs[f * B + e])
        vals.append(kjt.values()[a:b])
        if kjt.weights_or_none() is not None:
            ws.append(kjt.weights()[a:b])
    return KeyedJaggedTensor(kjt.keys(), torch.cat(vals), lengths=kjt.lengths_2d()[:, s:e].reshape(-1),
                             weights=torch.cat(ws) if ws else None, stride=e - s)
