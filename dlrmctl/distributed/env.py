"""Process group, device and rank of one training process.

:func:`init_distributed` reads the variables ``torchrun`` (and ``dlrmctl
launch``) set — ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` / ``MASTER_PORT`` — and returns a :class:`ShardingEnv`:

* CPU: backend ``gloo``, device ``cpu``;
* CUDA: backend ``nccl``, ``torch.cuda.set_device(local_rank)``, device ``cuda:<local_rank>``;
* ``WORLD_SIZE`` unset: a single-process env (``pg=None``, no collectives), or
  with ``single_rank_group=True`` a real process group of ONE rank (gloo on CPU,
  nccl on CUDA) so that the whole sharded path — DistributedModelParallel,
  every collective, the sparse-dist pipeline — runs on one process / one GPU.

This module and :mod:`dlrmctl.distributed.comm` are the only places that call
``torch.distributed`` (creation / teardown here, collectives there).  Each
group serves one device type: gloo <-> CPU tensors, nccl <-> this rank's CUDA
device (see comm's docstring).

``local_world_size`` (ranks per host) groups ranks into hosts for
``table_row_wise`` / ``table_column_wise``; it may be smaller than the real one
so that one machine can pretend to be several hosts (4 ranks = 2 "hosts" x 2).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


class ShardingEnv:
    """Where this process sits in the job (TorchRec's ``ShardingEnv``: same argument order).

    Args:
        world_size: number of ranks.
        rank: global rank.
        pg: the process group of all ranks (``None``: a plain single process, no
            collectives).  Also readable as :attr:`process_group` (TorchRec's name).
        local_world_size: (keyword-only, dlrmctl) ranks per host (hosts are
            ``rank // local_world_size``); default ``world_size`` (one host).
        device: (keyword-only, dlrmctl) device of this rank's tables and activations;
            default ``cpu``.

    Raises:
        ValueError: rank out of range, or a local world size that does not divide the world.
    """

    def __init__(self, world_size: int, rank: int, pg: dist.ProcessGroup | None = None, *,
                 local_world_size: int | None = None, device: torch.device | str = "cpu") -> None:
        self.world_size = int(world_size)
        self.rank = int(rank)
        self.pg = pg
        self.local_world_size = int(local_world_size or world_size)
        self.device = torch.device(device)
        if self.local_world_size <= 0 or self.world_size % self.local_world_size:
            raise ValueError(
                f"local_world_size {self.local_world_size} must be > 0 and divide world_size {self.world_size}"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} out of range for world_size {self.world_size}")

    def __repr__(self) -> str:
        return (f"ShardingEnv(world_size={self.world_size}, rank={self.rank}, pg={self.pg}, "
                f"local_world_size={self.local_world_size}, device={self.device})")

    @staticmethod
    def from_local(world_size: int, rank: int) -> "ShardingEnv":
        """TorchRec's constructor for an env without a process group (e.g. for planning)."""
        return ShardingEnv(world_size, rank, None)

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
        """A process group exists: collectives run (also with one rank)."""
        return self.pg is not None

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """TorchRec's name for :attr:`pg`."""
        return self.pg

    @staticmethod
    def single(device: torch.device | str = "cpu") -> "ShardingEnv":
        """One process, no process group."""
        return ShardingEnv(1, 0, None, device=device)

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
        return ShardingEnv(ws, rank, pg, local_world_size=local_world_size or ws, device=device)


def default_backend(device: torch.device | str | None = None) -> str:
    """``nccl`` for a CUDA device (or, with no device given, when CUDA is available), else ``gloo``."""
    if device is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def host_rendezvous(timeout_s: float = 600.0) -> "dist.TCPStore":
    """The rendezvous store of local helper ranks, served by the process that starts them, on a
    port the kernel picks as it binds (``store.port``): no free port is looked up first and bound
    later, so another process cannot take it in between (an ``Address already in use`` of a rank
    on a busy machine).  Keep the store alive until the ranks are done."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def init_process_group_tcp(rank: int, world_size: int, port: int, backend: str = "gloo",
                           device: torch.device | str | None = None, timeout_s: float = 600.0,
                           local_world_size: int | None = None) -> ShardingEnv:
    """Join a group rendezvousing at the store served on ``127.0.0.1:<port>`` by the process that
    started the ranks (:func:`host_rendezvous`; helper processes of one host, e.g. ``dlrmctl
    checkpoint reshard``); returns the rank's env."""
    device = torch.device(device or ("cuda" if backend == "nccl" else "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s),
        **({"device_id": device} if backend == "nccl" else {}),
    )
    return ShardingEnv(world_size, rank, dist.group.WORLD, local_world_size=local_world_size or world_size,
                       device=device)


def destroy_distributed() -> None:
    """Tear down the default process group if one exists (safe to call twice)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def init_distributed(
    backend: str | None = None,
    local_world_size: int | None = None,
    timeout_s: float | None = None,
    single_rank_group: bool = False,
    device: torch.device | str | None = None,
) -> ShardingEnv:
    """Initialise ``torch.distributed`` from torchrun's environment variables.

    Args:
        backend: ``gloo`` | ``nccl`` | ``None`` (``nccl`` if CUDA is available, else ``gloo``).
        local_world_size: ranks per host; default ``LOCAL_WORLD_SIZE`` (or
            ``world_size``).  A smaller value makes one machine act as several
            hosts for the ``table_*_wise`` sharding types.
        timeout_s: collective timeout (default: ``$DLRMCTL_COLLECTIVE_TIMEOUT_S``, else 1800 s;
            ``scripts/gpu_check.sh`` sets 120 so a hung collective fails inside its slot).
        single_rank_group: with ``WORLD_SIZE`` unset or 1, still create a group
            (of one rank, in-process store, no ports) so every collective runs.
        device: the rank's device (default: ``cuda:<LOCAL_RANK>`` for nccl, else cpu).

    Returns:
        The env; a single-process one (no process group) when ``WORLD_SIZE`` is
        unset or 1, no process group exists yet and ``single_rank_group`` is off.

    Raises:
        ValueError: ``nccl`` without CUDA, or an inconsistent local world size.
    """
    if timeout_s is None:
        timeout_s = float(os.environ.get("DLRMCTL_COLLECTIVE_TIMEOUT_S", "1800"))
    ws = int(os.environ.get("WORLD_SIZE", "1"))
    if backend is None:
        backend = default_backend(device)
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA; use 'gloo' on CPU")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    if (backend == "nccl") != (device.type == "cuda"):
        raise ValueError(f"backend {backend!r} does not serve device {device}: use nccl for CUDA, gloo for CPU")
    if backend == "nccl":
        torch.cuda.set_device(device)
    if ws == 1 and not dist.is_initialized():
        if not single_rank_group:
            return ShardingEnv(1, 0, None, device=device)
        dist.init_process_group(
            backend=backend, store=dist.HashStore(), rank=0, world_size=1,
            timeout=datetime.timedelta(seconds=timeout_s),
            **({"device_id": device} if backend == "nccl" else {}),
        )
        return ShardingEnv(1, 0, dist.group.WORLD, device=device)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            rank=int(os.environ["RANK"]),
            world_size=ws,
            timeout=datetime.timedelta(seconds=timeout_s),
            **({"device_id": device} if backend == "nccl" else {}),
        )
    lws = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", str(ws)))
    return ShardingEnv(dist.get_world_size(), dist.get_rank(), dist.group.WORLD, local_world_size=lws, device=device)


@dataclass
class RunEnv:
    """Where one training process runs: rank, world, device and (world > 1, or a one-rank group
    under ``sharding.force``) the :class:`ShardingEnv` whose process group the sharded model uses.

    Kept beside :class:`ShardingEnv` rather than merged into it: a plain single process has no
    ShardingEnv at all (``sharding_env`` None: the model is not wrapped), which is what
    :attr:`sharded` tells the trainer."""

    rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    #: ShardingEnv: with world_size > 1, or a one-rank group (sharding.force)
    sharding_env: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def pg(self) -> Any:
        """The process group (``None`` for a plain single process)."""
        return getattr(self.sharding_env, "pg", None)

    @property
    def sharded(self) -> bool:
        """The model runs through DistributedModelParallel (several ranks, or one rank with a group)."""
        return self.world_size > 1 or self.pg is not None

    def barrier(self) -> None:
        """Wait for every rank (no-op without a group)."""
        from dlrmctl.distributed import comm

        comm.barrier(self.pg)

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        """SUM ``x`` over the ranks in place (on ``x``'s device); returns ``x``."""
        from dlrmctl.distributed import comm

        comm.all_reduce(x, self.pg)
        return x


#: substrings of ``torch.cuda.get_device_name`` -> the planner preset of that GPU
_GPU_PRESET_BY_NAME = (("H200", "h200"), ("H100", "h100"), ("A100", "a100"))


def device_planning_preset(device: torch.device) -> tuple[str, float | None] | None:
    """The planner preset for training on ``device``: ``None`` for a CPU device; for a CUDA
    device ``(preset, hbm_gb)``: the preset whose GPU name matches ``torch.cuda.get_device_name``
    (``h200`` / ``h100`` / ``a100``, else ``h100``'s bandwidths) and the device's own memory in GB
    (1e9 bytes, from ``torch.cuda.get_device_properties``), so a plan never assumes more HBM
    than the GPU has.  The one place the planner's view of a GPU is read (CUDA-specific code
    lives in this module)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    preset = next((p for key, p in _GPU_PRESET_BY_NAME if key in name), "h100")
    return preset, torch.cuda.get_device_properties(device).total_memory / 1e9


def apply_matmul_precision(device: torch.device | str, tf32: bool) -> str | None:
    """``train.tf32``: let fp32 GEMMs and convolutions of training on ``device`` use TF32 tensor cores.

    On a CUDA device: ``torch.set_float32_matmul_precision("high")`` (fp32 matmuls, i.e. the
    MLPs' and DCN's Linear layers, on TF32 tensor cores: 10-bit mantissa inputs, fp32
    accumulation) and ``torch.backends.cudnn.allow_tf32 = True`` with ``tf32``; ``"highest"``
    and ``False`` without (plain fp32 cores).  The setting is process-wide.  On any other device
    nothing is changed (TF32 is a CUDA tensor-core format) and ``None`` is returned.

    Args:
        device: the training device.
        tf32: allow TF32.

    Returns:
        the float32 matmul precision now in force on CUDA (``"high"`` | ``"highest"``), else ``None``.
    """
    if torch.device(device).type != "cuda":
        return None
    precision = "high" if tf32 else "highest"
    torch.set_float32_matmul_precision(precision)
    torch.backends.cudnn.allow_tf32 = bool(tf32)
    return precision


@contextlib.contextmanager
def full_fp32_matmul(device: torch.device | str):
    """Inside the block, fp32 GEMMs on a CUDA ``device`` run at full fp32 precision (``"highest"``,
    cuDNN without TF32), whatever :func:`apply_matmul_precision` set; restored on exit.  The
    evaluation during training uses it, so its metrics are those ``dlrmctl evaluate`` computes.
    No-op on other devices."""
    if torch.device(device).type != "cuda":
        yield
        return
    before, cudnn_before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)
        torch.backends.cudnn.allow_tf32 = cudnn_before
