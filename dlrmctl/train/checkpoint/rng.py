"""RNG states saved per rank in a checkpoint (``rank/<r>``: ``rng``)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


# ------------------------------------------------------------------ RNG
def rng_state() -> dict[str, Any]:
    st = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])

