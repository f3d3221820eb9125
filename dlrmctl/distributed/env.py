"""Process group, device and rank of one training process.

:func:`init_distributed` reads the variables ``torchrun`` (and ``dlrmctl
launch``) set — ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` / ``MASTER_PORT`` — and returns a :class:`ShardingEnv`:

* CPU: backend ``gloo``, device ``cpu``;
* CUDA: backend ``nccl``, ``torch.cuda.set_device(local_rank)``, device ``cuda:<local_rank>``;
* ``WORLD_SIZE`` unset: a single-process env (``pg=None``, no collectives).

``local_world_size`` (ranks per host) groups ranks into hosts for
``table_row_wise`` / ``table_column_wise``; it may be smaller than the real one
so that one machine can pretend to be several hosts (4 ranks = 2 "hosts" x 2).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class ShardingEnv:
    """Where this process sits in the job.

    Attributes:
        rank: global rank.
        world_size: number of ranks.
        local_world_size: ranks per host (hosts are ``rank // local_world_size``).
        pg: the process group of all ranks (``None`` when ``world_size == 1``
            and no group was created).
        device: device of this rank's tables and activations.
    """

    rank: int
    world_size: int
    local_world_size: int
    pg: dist.ProcessGroup | None
    device: torch.device

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        if self.local_world_size <= 0 or self.world_size % self.local_world_size:
            raise ValueError(
                f"local_world_size {self.local_world_size} must be > 0 and divide world_size {self.world_size}"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} out of range for world_size {self.world_size}")

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_world_size

    @property
    def host(self) -> int:
        """Index of this rank's host (group of ``local_world_size`` consecutive ranks)."""
        return self.rank // self.local_world_size

    @property
    def num_hosts(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def backend(self) -> str | None:
        return None if self.pg is None else dist.get_backend(self.pg)

    @property
    def is_distributed(self) -> bool:
        return self.pg is not None and self.world_size > 1

    @staticmethod
    def single(device: torch.device | str = "cpu") -> "ShardingEnv":
        """One process, no process group."""
        return ShardingEnv(0, 1, 1, None, torch.device(device))

    @staticmethod
    def from_process_group(
        pg: dist.ProcessGroup | None = None,
        local_world_size: int | None = None,
        device: torch.device | str | None = None,
    ) -> "ShardingEnv":
        """Env of an already initialised process group (default: the world group)."""
        pg = pg if pg is not None else dist.group.WORLD
        rank, ws = dist.get_rank(pg), dist.get_world_size(pg)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(pg) == "nccl" else torch.device("cpu")
        return ShardingEnv(rank, ws, local_world_size or ws, pg, torch.device(device))


def init_distributed(
    backend: str | None = None,
    local_world_size: int | None = None,
    timeout_s: float = 1800.0,
) -> ShardingEnv:
    """Initialise ``torch.distributed`` from torchrun's environment variables.

    Args:
        backend: ``gloo`` | ``nccl`` | ``None`` (``nccl`` if CUDA is available, else ``gloo``).
        local_world_size: ranks per host; default ``LOCAL_WORLD_SIZE`` (or
            ``world_size``).  A smaller value makes one machine act as several
            hosts for the ``table_*_wise`` sharding types.
        timeout_s: collective timeout.

    Returns:
        The env; a single-process one (no process group) when ``WORLD_SIZE`` is
        unset or 1 and no process group exists yet.

    Raises:
        ValueError: ``nccl`` without CUDA, or an inconsistent local world size.
    """
    ws = int(os.environ.get("WORLD_SIZE", "1"))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA; use 'gloo' on CPU")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    if ws == 1 and not dist.is_initialized():
        return ShardingEnv(0, 1, 1, None, device)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            rank=int(os.environ["RANK"]),
            world_size=ws,
            timeout=datetime.timedelta(seconds=timeout_s),
            **({"device_id": device} if backend == "nccl" else {}),
        )
    lws = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", str(ws)))
    return ShardingEnv(dist.get_rank(), dist.get_world_size(), lws, dist.group.WORLD, device)
