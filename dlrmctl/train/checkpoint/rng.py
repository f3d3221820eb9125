"""RNG states saved per rank in a checkpoint (``rank/<r>``: ``rng``)."""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch


log = logging.getLogger("dlrmctl.checkpoint")


def _cuda_device(device: torch.device | str | None) -> torch.device | None:
    """``device`` when it is a CUDA device (index resolved), else None."""
    if device is None:
        return None
    d = torch.device(device)
    if d.type != "cuda":
        return None
    return d if d.index is not None else torch.device("cuda", torch.cuda.current_device())


def rng_state(device: torch.device | str | None = None) -> dict[str, Any]:
    """This rank's RNG states: ``torch`` (CPU generator, ``uint8`` tensor), ``numpy``, ``python`` and,
    when ``device`` is a CUDA device (the one this rank trains on), ``cuda``: that device's
    generator state only (one ``uint8`` tensor; no other GPU is touched, so a checkpoint resumes
    on a machine with another number of GPUs)."""
    st = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    d = _cuda_device(device)
    if d is not None:
        st["cuda"] = torch.cuda.get_rng_state(d)
    return st


def set_rng_state(st: dict[str, Any], device: torch.device | str | None = None) -> None:
    """Restore :func:`rng_state` output.  The ``cuda`` state goes to ``device`` only (this rank's CUDA
    device; ignored when it trains on the CPU).  A per-GPU list (checkpoints written before the
    state was per rank) gives ``device`` its own entry (by index) when the list has one.

    Raises:
        KeyError: ``st`` lacks the ``torch`` / ``numpy`` / ``python`` entries.
    """
    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    random.setstate(st["python"])
    d = _cuda_device(device)
    cuda = st.get("cuda")
    if d is None or cuda is None:
        return
    if isinstance(cuda, (list, tuple)):  # older checkpoints: every visible GPU of the saving rank
        if d.index >= len(cuda):
            log.warning("checkpoint holds CUDA RNG states of %d GPU(s), none for %s: its generator is not restored",
                        len(cuda), d)
            return
        cuda = cuda[d.index]
    torch.cuda.set_rng_state(cuda, d)
