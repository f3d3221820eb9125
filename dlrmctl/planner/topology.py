"""The machine a plan is for: :class:`Topology` (TorchRec's name), every number per rank, built
from a device preset or a topology file (:mod:`dlrmctl.planner.devices`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dlrmctl.distributed.types import PlanError
from dlrmctl.planner.devices import (
    DEFAULT_FIXED_US,
    DEFAULT_LLC_MB,
    DEVICE_PRESETS,
    GB,
    MiB,
    DevicePreset,
    detect_llc_bytes,
    host_memory_bytes,
    load_topology_file,
)

__all__ = ["BWD_COMPUTE_MULTIPLIER", "Topology"]

#: lookup backward / forward time when nothing is calibrated (TorchRec planner/constants.py
#: ``BWD_COMPUTE_MULTIPLIER``): the Topology default
BWD_COMPUTE_MULTIPLIER = 2.0


@dataclass
class Topology:
    """The machine a plan is for (TorchRec ``Topology``), all numbers per rank.

    Attributes:
        world_size: ranks in the job.
        local_world_size: ranks per host (must divide ``world_size``).
        compute_device: ``cuda`` (tables in HBM) or ``cpu`` (tables in DDR).
        hbm_cap: device memory per rank, bytes (0 on cpu).
        ddr_cap: host memory per rank, bytes.
        hbm_mem_bw, ddr_mem_bw: memory bandwidths, bytes/s.
        intra_host_bw: one-direction bandwidth between ranks of one host, bytes/s.
        inter_host_bw: one-direction bandwidth of a rank to other hosts, bytes/s.
        device: preset name (``h100`` ...) or topology file, for the report.
        topology_file: the topology file the hardware was read from (None: a preset); the
            report then names the file instead of a device.
        calibrated: that file was written by ``dlrmctl plan --calibrate`` (its ``source``).
        kernel_launch_s: seconds of one kernel launch / op dispatch.
        collective_latency_s: seconds of one small collective within a host.
        inter_host_collective_latency_s: seconds of one small collective across hosts.
        lookup_fixed_s: seconds one sharding group costs per step whatever its ids
            (host-side routing, lookup call and output combine, forward + backward).
        kernel_efficiency: ``{"fused": f, "dense": f}``: fraction of ``mem_bw`` each
            lookup kernel reaches (missing keys: ``perf.KERNEL_EFFICIENCY``).
        bwd_compute_multiplier: lookup backward time / forward time (TorchRec: 2.0).
        dense_bwd_compute_multiplier: the same for the dense kernel (``None``: ``bwd_compute_multiplier``).
        fused_bwd_id_s: seconds the fused kernel's backward spends per looked-up id whatever the
            row width (``DevicePreset.fused_bwd_id_ns``; 0 = not modelled).
        fused_fwd_id_s: the same for the fused kernel's forward (``DevicePreset.fused_fwd_id_ns``).
        fused_fwd_bag_s, fused_bwd_bag_s: seconds per bag (pooled row) of the fused forward /
            backward (``DevicePreset.fused_fwd_bag_ns`` / ``fused_bwd_bag_ns``; 0 = not modelled).
        llc_bytes: last-level cache of one cache domain, bytes (:meth:`cache_domain`:
            a host on cpu, a rank on cuda); 0 = no cache modelled (every lookup at the DRAM /
            HBM rate).  :meth:`from_preset` fills it in.
        cache_speedup: ``{"fused": s, "dense": s}``: step-time ratio DRAM / in-cache of a lookup
            kernel (missing keys: ``cache.DEFAULT_CACHE_SPEEDUP``).
        input_dist_bw: bytes/s at which the whole input dist (route, pack, all-to-all, unpack)
            handles the id all-to-all bytes a rank receives (``DevicePreset.input_dist_bw_gbps``);
            0 = not calibrated: the input dist is charged its wire bytes at :attr:`comm_bw`.
        output_dist_bw: bytes/s of pooled-embedding bytes leaving a rank through the whole output
            dist, forward and backward each (``DevicePreset.output_dist_bw_gbps``); 0 = :attr:`comm_bw`
            (:attr:`output_bw`).

    The fixed costs default (``None``) to :data:`DEFAULT_FIXED_US` of the compute device.
    """

    world_size: int
    local_world_size: int
    compute_device: str
    hbm_cap: int
    ddr_cap: int
    hbm_mem_bw: float
    ddr_mem_bw: float
    intra_host_bw: float
    inter_host_bw: float
    device: str = "custom"
    kernel_launch_s: float | None = None
    collective_latency_s: float | None = None
    inter_host_collective_latency_s: float | None = None
    lookup_fixed_s: float | None = None
    kernel_efficiency: dict[str, float] = field(default_factory=dict)
    bwd_compute_multiplier: float = BWD_COMPUTE_MULTIPLIER
    dense_bwd_compute_multiplier: float | None = None
    fused_bwd_id_s: float = 0.0
    fused_fwd_id_s: float = 0.0
    fused_fwd_bag_s: float = 0.0
    fused_bwd_bag_s: float = 0.0
    llc_bytes: int = 0
    cache_speedup: dict[str, float] = field(default_factory=dict)
    input_dist_bw: float = 0.0
    output_dist_bw: float = 0.0
    topology_file: str | None = None
    calibrated: bool = False

    def __post_init__(self) -> None:
        if self.world_size <= 0:
            raise PlanError(f"world size must be > 0, got {self.world_size}")
        if self.local_world_size <= 0 or self.world_size % self.local_world_size:
            raise PlanError(
                f"ranks per host ({self.local_world_size}) must divide the world size ({self.world_size})"
            )
        if self.compute_device not in ("cuda", "cpu"):
            raise PlanError(f"compute device must be cuda or cpu, got {self.compute_device!r}")
        d = DEFAULT_FIXED_US[self.compute_device]
        for attr, key in (("kernel_launch_s", "kernel_launch_us"), ("collective_latency_s", "collective_us"),
                          ("inter_host_collective_latency_s", "inter_host_collective_us"),
                          ("lookup_fixed_s", "lookup_fixed_us")):
            if getattr(self, attr) is None:
                setattr(self, attr, d[key] * 1e-6)
            elif getattr(self, attr) < 0:
                raise PlanError(f"{attr} must be >= 0 seconds, got {getattr(self, attr)}")
        if self.bwd_compute_multiplier <= 0:
            raise PlanError(f"bwd_compute_multiplier must be > 0, got {self.bwd_compute_multiplier}")
        if self.fused_bwd_id_s < 0:
            raise PlanError(f"fused_bwd_id_s must be >= 0 seconds, got {self.fused_bwd_id_s}")
        for name in ("fused_fwd_id_s", "fused_fwd_bag_s", "fused_bwd_bag_s"):
            if getattr(self, name) < 0:
                raise PlanError(f"{name} must be >= 0 seconds, got {getattr(self, name)}")
        if self.llc_bytes < 0:
            raise PlanError(f"llc_bytes must be >= 0, got {self.llc_bytes}")
        for name, off in (("input_dist_bw", "the wire model"), ("output_dist_bw", "the link bandwidth")):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise PlanError(f"{name} must be a finite number >= 0 bytes/s (0: {off}), got {v}")
        bad = {k: v for k, v in self.cache_speedup.items() if not v > 0}
        if bad:
            raise PlanError(f"cache_speedup must be > 0, got {bad}")

    def cache_domain(self, rank: int) -> int:
        """Index of the last-level cache ``rank``'s lookups use: its host on cpu (one LLC shared by
        the host's ranks), the rank itself on cuda (each GPU's own L2)."""
        return rank // self.local_world_size if self.compute_device == "cpu" else rank

    @property
    def num_cache_domains(self) -> int:
        """Number of distinct last-level caches: hosts on cpu, ranks on cuda."""
        return self.num_hosts if self.compute_device == "cpu" else self.world_size

    @property
    def collective_s(self) -> float:
        """Fixed seconds of one collective over all ranks: the inter-host figure once there are several hosts."""
        return self.inter_host_collective_latency_s if self.num_hosts > 1 else self.collective_latency_s  # type: ignore[return-value]

    @property
    def num_hosts(self) -> int:
        """Number of hosts = world_size / local_world_size."""
        return self.world_size // self.local_world_size

    def host_ranks(self, host: int) -> list[int]:
        """Global ranks of ``host`` (contiguous blocks of ``local_world_size``, as torchrun numbers them)."""
        return list(range(host * self.local_world_size, (host + 1) * self.local_world_size))

    @property
    def mem_bw(self) -> float:
        """Bandwidth of the memory the tables live in, bytes/s (HBM on cuda, DDR on cpu)."""
        return self.hbm_mem_bw if self.compute_device == "cuda" else self.ddr_mem_bw

    @property
    def table_mem_cap(self) -> int:
        """Capacity of the memory the tables live in, bytes per rank."""
        return self.hbm_cap if self.compute_device == "cuda" else self.ddr_cap

    @property
    def table_mem_name(self) -> str:
        """``HBM`` or ``DDR``: where the tables live."""
        return "HBM" if self.compute_device == "cuda" else "DDR"

    @property
    def comm_bw(self) -> float:
        """Bandwidth of an all-to-all over all ranks, bytes/s: inter-host once there is more than one host.

        As TorchRec's ``EmbeddingPerfEstimator``: ``inter_host_bw if world_size >
        local_world_size else intra_host_bw`` (the slowest link bounds the collective).
        """
        return self.inter_host_bw if self.num_hosts > 1 else self.intra_host_bw

    @property
    def output_bw(self) -> float:
        """Bandwidth the pooled output dist's bytes are charged at, bytes/s: the calibrated
        :attr:`output_dist_bw` (the whole path, packing included), never above :attr:`comm_bw`;
        :attr:`comm_bw` when not calibrated."""
        return min(self.output_dist_bw, self.comm_bw) if self.output_dist_bw > 0 else self.comm_bw

    @property
    def hardware(self) -> str:
        """What the hardware is: ``device h100 (cuda)``, or ``topology FILE (calibrated cpu)`` when it
        was read from a topology file."""
        if self.topology_file is not None:
            return f"topology {self.topology_file} ({'calibrated ' if self.calibrated else ''}{self.compute_device})"
        return f"device {self.device} ({self.compute_device})"

    def describe(self) -> str:
        """One line: ranks, hosts, hardware (:attr:`hardware`), memory and bandwidths (GB, GB/s), fixed costs (us)."""
        mem = (
            f"HBM {self.hbm_cap / GB:.0f} GB @ {self.hbm_mem_bw / GB:.0f} GB/s"
            if self.compute_device == "cuda"
            else f"DDR {self.ddr_cap / GB:.1f} GB @ {self.ddr_mem_bw / GB:.1f} GB/s"
        )
        return (
            f"{self.world_size} ranks = {self.num_hosts} host(s) x {self.local_world_size}, {self.hardware}; per rank {mem}; intra-host {self.intra_host_bw / GB:.3g} GB/s, "
            f"inter-host {self.inter_host_bw / GB:.3g} GB/s; fixed: collective {self.collective_s * 1e6:.3g} us, "
            f"kernel launch {self.kernel_launch_s * 1e6:.3g} us, sharding group {self.lookup_fixed_s * 1e6:.3g} us"
        )

    @staticmethod
    def from_device_or_file(
        device: str,
        topology_file: str | None,
        world_size: int,
        local_world_size: int | None = None,
        hbm_gb: float | None = None,
        ddr_gb: float | None = None,
        shown_as: str | None = None,
    ) -> "Topology":
        """The topology of ``topology_file`` (a ``dlrmctl plan --calibrate`` file,
        :func:`load_topology_file`) when given, else of the ``device`` preset
        (:meth:`from_preset`); ``shown_as``: how the report names the file (default: as given).

        Raises:
            PlanError: an unknown device, a bad or unreadable file (named), inconsistent sizes.
        """
        if not topology_file:
            return Topology.from_preset(device, world_size, local_world_size, hbm_gb, ddr_gb)
        shown = shown_as or topology_file
        return Topology.from_preset(load_topology_file(topology_file), world_size, local_world_size, hbm_gb, ddr_gb,
                                    name=shown, topology_file=shown)

    @staticmethod
    def from_preset(
        device: "str | DevicePreset",
        world_size: int,
        local_world_size: int | None = None,
        hbm_gb: float | None = None,
        ddr_gb: float | None = None,
        name: str | None = None,
        topology_file: str | None = None,
    ) -> "Topology":
        """Build a topology from a :data:`DEVICE_PRESETS` entry or a :class:`DevicePreset`
        (e.g. one read by :func:`load_topology_file`).

        Args:
            device: ``h100`` | ``a100`` | ``h200`` | ``cpu``, or a DevicePreset.
            name: what the report calls the device (default: the preset name, or ``custom``).
            world_size: ranks.
            local_world_size: ranks per host; default ``min(world_size, 8)`` for GPU
                presets (one 8-GPU node), ``world_size`` for cpu (one machine).
            hbm_gb, ddr_gb: per-rank capacity overrides in GB (1e9 bytes).
            topology_file: the file ``device`` was read from (:func:`load_topology_file`), for
                the report (:attr:`Topology.hardware`).

        Raises:
            PlanError: unknown device or inconsistent sizes.
        """
        if isinstance(device, DevicePreset):
            p, device = device, name or "custom"
        else:
            try:
                p = DEVICE_PRESETS[device]
            except KeyError:
                raise PlanError(f"unknown device {device!r}; expected one of {sorted(DEVICE_PRESETS)}") from None
        if local_world_size is None:
            local_world_size = world_size if p.default_gpus_per_host is None else min(world_size, p.default_gpus_per_host)
            if world_size % local_world_size:
                local_world_size = math.gcd(world_size, local_world_size)
        if ddr_gb is None:
            ddr = int(p.ddr_gb * GB) if p.ddr_gb is not None else host_memory_bytes() // max(1, local_world_size)
        else:
            ddr = int(ddr_gb * GB)
        hbm = int((p.hbm_gb if hbm_gb is None else hbm_gb) * GB)
        if p.compute_device == "cpu":
            hbm = 0
        if p.llc_mb is not None:
            llc = int(p.llc_mb * MiB)
        else:
            llc = (detect_llc_bytes() if p.compute_device == "cpu" else None) or int(
                DEFAULT_LLC_MB[p.compute_device] * MiB)
        return Topology(
            world_size=world_size,
            local_world_size=local_world_size,
            compute_device=p.compute_device,
            hbm_cap=hbm,
            ddr_cap=ddr,
            hbm_mem_bw=p.hbm_bw_gbps * GB,
            ddr_mem_bw=p.ddr_bw_gbps * GB,
            intra_host_bw=p.intra_host_bw_gbps * GB,
            inter_host_bw=p.inter_host_bw_gbps * GB,
            device=device,
            kernel_launch_s=None if p.kernel_launch_us is None else p.kernel_launch_us * 1e-6,
            collective_latency_s=None if p.collective_us is None else p.collective_us * 1e-6,
            inter_host_collective_latency_s=None if p.inter_host_collective_us is None else p.inter_host_collective_us * 1e-6,
            lookup_fixed_s=None if p.lookup_fixed_us is None else p.lookup_fixed_us * 1e-6,
            kernel_efficiency={k: v for k, v in (("fused", p.fused_efficiency), ("dense", p.dense_efficiency))
                               if v is not None},
            bwd_compute_multiplier=(BWD_COMPUTE_MULTIPLIER if p.bwd_compute_multiplier is None
                                    else p.bwd_compute_multiplier),
            dense_bwd_compute_multiplier=p.dense_bwd_compute_multiplier,
            fused_bwd_id_s=0.0 if p.fused_bwd_id_ns is None else p.fused_bwd_id_ns * 1e-9,
            fused_fwd_id_s=0.0 if p.fused_fwd_id_ns is None else p.fused_fwd_id_ns * 1e-9,
            fused_fwd_bag_s=0.0 if p.fused_fwd_bag_ns is None else p.fused_fwd_bag_ns * 1e-9,
            fused_bwd_bag_s=0.0 if p.fused_bwd_bag_ns is None else p.fused_bwd_bag_ns * 1e-9,
            llc_bytes=llc,
            cache_speedup={k: v for k, v in (("fused", p.fused_cache_speedup), ("dense", p.dense_cache_speedup))
                           if v is not None},
            input_dist_bw=0.0 if p.input_dist_bw_gbps is None else p.input_dist_bw_gbps * GB,
            output_dist_bw=0.0 if p.output_dist_bw_gbps is None else p.output_dist_bw_gbps * GB,
            topology_file=topology_file,
            calibrated=topology_file is not None and str(p.source or "").startswith("dlrmctl plan --calibrate"),
        )
