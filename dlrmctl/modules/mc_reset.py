"""The values a managed-collision row takes when a new id takes it
(:mod:`dlrmctl.modules.managed_collision`): ``U(low, high)`` per column from a counter-based
generator (SplitMix64) keyed by ``(seed, id, column)``, so every rank and device draws the same
row for the same id, whoever held the row before.  :mod:`dlrmctl.modules.managed_collision`
re-exports both functions."""

from __future__ import annotations

import hashlib

import torch


_MASK = (1 << 64) - 1


def _i64(c: int) -> int:
    """A 64-bit constant as the signed int64 of the same bits."""
    c &= _MASK
    return c - (1 << 64) if c >= 1 << 63 else c


def _lshr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser (Steele, Lea, Flood 2014, "Fast splittable pseudorandom number
    generators"; the constants of Vigna's ``splitmix64.c``) on int64 bits, wrapping."""
    z = x + _i64(0x9E3779B97F4A7C15)
    z = (z ^ _lshr(z, 30)) * _i64(0xBF58476D1CE4E5B9)
    z = (z ^ _lshr(z, 27)) * _i64(0x94D049BB133111EB)
    return z ^ _lshr(z, 31)


def reset_uniform(ids: torch.Tensor, dim: int, seed: int, low: float, high: float) -> torch.Tensor:
    """The values a row takes when a new id ``ids[i]`` gets it: ``U(low, high)`` per column from a
    counter-based generator keyed by ``(seed, id, column)`` — the same on every rank and device,
    whoever held the row before.

    Args:
        ids: ``[n]`` int64 raw ids.
        dim: columns.
        seed: ``train.seed`` (mixed with the table's name by the caller).
        low, high: the table's init bounds.

    Returns:
        ``[n, dim]`` float32 on ``ids.device``.
    """
    key = _splitmix64(ids.to(torch.int64) ^ _i64(seed))
    cols = torch.arange(dim, dtype=torch.int64, device=ids.device)
    z = _splitmix64(key[:, None] + cols[None, :])
    u = _lshr(z, 11).to(torch.float64) * (1.0 / (1 << 53))
    return (low + (high - low) * u).to(torch.float32)


def table_reset_key(seed: int, table: str) -> int:
    """The :func:`reset_uniform` seed of a table: ``train.seed`` mixed with the table's name
    (the first 8 bytes of SHA-256 of ``"<seed>:<table>"``, as int64)."""
    return _i64(int.from_bytes(hashlib.sha256(f"{seed}:{table}".encode()).digest()[:8], "little"))
