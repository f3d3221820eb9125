"""Planner vocabulary: the machine (:class:`Topology`), the problem (:class:`TableSpec`)
and the candidate answers (:class:`ShardingOption` made of :class:`Shard`).

Names follow ``torchrec.distributed.planner.types`` (Topology, ShardingOption,
Shard, Storage, Perf).  Units are explicit in every attribute name or docstring:
bytes for memory, bytes/s for bandwidths, seconds for :class:`Perf` (the report
prints milliseconds).

Device presets (:data:`DEVICE_PRESETS`) and where each number comes from:

* ``h100``: NVIDIA H100 SXM5 80GB datasheet — 80 GB HBM3 at 3.35 TB/s; NVLink 4
  through NVSwitch, 900 GB/s bidirectional per GPU = 450 GB/s per direction;
  inter-host one ConnectX-7 400 Gb/s NIC per GPU (DGX H100 user guide) = 50 GB/s;
  host memory 2 TB per 8-GPU DGX H100 = 256 GB per rank, DDR5-4800 x 8 channels x
  2 sockets = 614 GB/s per node = 76.8 GB/s per rank.
* ``a100``: NVIDIA A100 80GB SXM datasheet — 80 GB HBM2e at 2.039 TB/s; NVLink 3,
  600 GB/s bidirectional = 300 GB/s per direction; inter-host one ConnectX-6
  HDR 200 Gb/s NIC per GPU (DGX A100 user guide) = 25 GB/s; host memory 2 TB per
  DGX A100 = 256 GB per rank, DDR4-3200 x 8 channels x 2 sockets = 409.6 GB/s per
  node = 51.2 GB/s per rank.
* ``h200``: NVIDIA H200 SXM datasheet — 141 GB HBM3e at 4.8 TB/s; NVLink 4,
  450 GB/s per direction; ConnectX-7 400 Gb/s per GPU (DGX H200) = 50 GB/s; host
  memory 2 TB per node = 256 GB per rank, 76.8 GB/s per rank (as DGX H100).
* ``cpu``: what ``dlrmctl train --nproc N`` runs on (gloo, no accelerator): no
  HBM; every byte lives in DDR.  Memory bandwidth 18.8 GB/s per rank, measured on
  the 2-core development VM with a 256 MiB ``numpy.copyto`` (read + write bytes /
  time); FBGEMM TBE CPU forward reached 2.8 GB/s of looked-up rows and
  ``torch.nn.functional.embedding_bag`` 3.6 GB/s on 1M x 128 fp32 random rows,
  single thread, hence the kernel efficiencies in :mod:`dlrmctl.planner.perf`.
  Intra-host bandwidth 2 GB/s: an estimate (not measured) for gloo collectives
  over loopback TCP.  DDR capacity: physical memory of this machine
  (``os.sysconf``) divided by the ranks per host, unless ``--ddr-gb`` is given.

Fixed per-op costs (:class:`DevicePreset` ``*_us`` fields; they do not scale with
bytes, so the bandwidth model misses them; see :func:`dlrmctl.planner.perf.step_latency`):

* ``kernel_launch_us``: one kernel launch / op dispatch.  CUDA 5 us (host-side
  launch of a small kernel, the order NVIDIA's launch-overhead figures give);
  CPU 10 us (PyTorch eager per-op dispatch).
* ``collective_us`` / ``inter_host_collective_us``: one collective call of a small
  message.  NCCL 20 us within an NVLink host, 40 us across hosts (nccl-tests
  small-message latencies); gloo over loopback TCP 100 us.
* ``lookup_fixed_us``: host-side cost of one sharding group per step (its
  input_dist routing, lookup call, output combine, forward and backward) that
  does not scale with ids.  CUDA 50 us, CPU 300 us: orders of magnitude, not
  measured on those machines.

Last-level cache (``llc_mb``, MiB; :func:`dlrmctl.planner.perf.cache_hit_fractions` uses it):

* ``h100`` / ``h200``: 50 MB L2 per GPU (NVIDIA H100 Tensor Core GPU Architecture
  whitepaper: 50 MB L2 on H100 SXM5; H200 is the same GH100 die); ``a100``: 40 MB L2 per
  GPU (NVIDIA A100 Tensor Core GPU Architecture whitepaper).  A GPU's L2 serves its own
  rank only.
* ``cpu``: this machine's last-level cache (:func:`detect_llc_bytes`: the highest cache
  level under ``/sys/devices/system/cpu/cpu0/cache``, times the number of its instances,
  what ``lscpu`` prints), else 32 MiB (the dev VM's L3: ``lscpu`` ``L3 cache: 32 MiB
  (1 instance)``).  On a CPU the ranks of one host share it.

How much faster a lookup + update step runs when its rows are in that cache
(``fused_cache_speedup`` / ``dense_cache_speedup``) defaults to
:data:`dlrmctl.planner.perf.DEFAULT_CACHE_SPEEDUP`.

All of these presets are literature / datasheet numbers; ``dlrmctl plan
--calibrate`` measures this machine and writes a topology file
(:func:`save_topology_file`, loaded by :func:`load_topology_file`,
``plan --topology FILE`` or ``sharding.topology_file``).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from dataclasses import dataclass, field
from typing import Sequence

from dlrmctl.distributed.types import ComputeKernel, PlanError, ShardingType
from dlrmctl.fileio import write_text_atomic
from dlrmctl.optim.registry import OPTIMIZER_ALIASES

GB = 1e9  #: bytes in a (decimal, datasheet) gigabyte
GiB = float(1 << 30)  #: bytes in a gibibyte
MiB = float(1 << 20)


#: sharding types of an unpooled (EmbeddingCollection) table: what
#: ``dlrmctl.distributed.sharded_ec.SEQUENCE_SHARDING_CLASSES`` implements
UNPOOLED_SHARDING_TYPES: tuple[ShardingType, ...] = (
    ShardingType.TABLE_WISE,
    ShardingType.ROW_WISE,
    ShardingType.COLUMN_WISE,
)


#: lookup backward / forward time when nothing is calibrated (TorchRec planner/constants.py
#: ``BWD_COMPUTE_MULTIPLIER``): the Topology default
BWD_COMPUTE_MULTIPLIER = 2.0


#: the former name of :class:`dlrmctl.distributed.types.PlanError` (one class: a plan that cannot be
#: made, read or applied); kept while other branches move to the one name
PlannerError = PlanError


@dataclass(frozen=True)
class DevicePreset:
    """Per-rank hardware numbers of one device kind (see the module docstring for sources).

    Attributes:
        compute_device: ``cuda`` or ``cpu``.
        hbm_gb: device memory per rank (GB = 1e9 bytes); 0 for cpu.
        ddr_gb: host memory per rank (GB); ``None`` = detect this machine's.
        hbm_bw_gbps: device memory bandwidth (GB/s).
        ddr_bw_gbps: host memory bandwidth per rank (GB/s).
        intra_host_bw_gbps: per-rank bandwidth to ranks of the same host, one direction (GB/s).
        inter_host_bw_gbps: per-rank bandwidth to other hosts, one direction (GB/s).
        default_gpus_per_host: ranks per host when neither ``--hosts`` nor ``--gpus-per-host`` is given.
        source: one-line citation.
        kernel_launch_us, collective_us, inter_host_collective_us, lookup_fixed_us: fixed
            per-op costs in microseconds (see the module docstring); ``None`` = the
            defaults of the compute device (:data:`DEFAULT_FIXED_US`).
        fused_efficiency, dense_efficiency: fraction of the memory bandwidth the fused
            (FBGEMM TBE) / dense (``nn.EmbeddingBag``) lookup reaches; ``None`` = the
            defaults in :data:`dlrmctl.planner.perf.KERNEL_EFFICIENCY`.
        bwd_compute_multiplier: backward (with the fused optimizer) time / forward time of a
            lookup; ``None`` = TorchRec's 2.0.
        dense_bwd_compute_multiplier: the same for the dense kernel (sparse gradient + the
            torch optimizer step); ``None`` = ``bwd_compute_multiplier``.
        fused_bwd_id_ns: nanoseconds the fused kernel's backward spends per looked-up id
            whatever the row width (FBGEMM's CPU TBE backward sorts the ids by row, csr2csc,
            and runs the optimizer's per-row prologue per unique row); it adds
            ``ids * fused_bwd_id_ns`` to a fused shard's backward and
            ``bwd_compute_multiplier`` then covers only the bytes.  ``None`` = 0 (TorchRec
            has no such term; ``plan --calibrate`` measures it).
        fused_fwd_id_ns: nanoseconds the fused kernel's forward spends per looked-up id whatever
            the row width (offsets, index loads, the bag loop; ``plan --calibrate`` splits the
            forward of two widths over the same ids: on the dev VM ~8 ns per id, about 80 % of a
            64-wide fp32 forward); it adds ``ids * fused_fwd_id_ns`` to a fused shard's forward
            and ``fused_efficiency`` then covers only the bytes.  ``None`` = 0 (TorchRec's model
            is bytes only).
        fused_fwd_bag_ns, fused_bwd_bag_ns: nanoseconds the fused kernel's forward / backward
            spends per bag (pooled output row: offsets, the bag loop, the output row's gradient
            read per bag); added as ``bags * ...`` (``plan --calibrate`` fits them from a lookup
            of the same ids in bags of one).  ``None`` = 0.
        llc_mb: last-level cache in MiB (2^20 bytes): per host on cpu (the ranks of a host
            share it), per GPU on cuda (L2, private to its rank); ``None`` = the default
            (module docstring; :data:`DEFAULT_LLC_MB`, or this machine's on cpu).
        fused_cache_speedup, dense_cache_speedup: (lookup + backward + update step time of a
            table in DRAM / HBM) / (the same ids on a table that fits ``llc_mb``), >= 1 in
            practice; ``None`` = :data:`dlrmctl.planner.perf.DEFAULT_CACHE_SPEEDUP`.
        input_dist_bw_gbps: GB/s (1e9 bytes) at which dlrmctl's whole input dist handles the
            bytes of the id all-to-all a rank *receives* (lengths + ids of every source, its
            own included): routing and packing the ids, the all-to-all, the int32/int64 casts
            and the unpacking into the lookup KJT (``ShardedEmbeddingBagCollection.input_dist``
            then ``wait()``).  ``plan --calibrate`` times it on 2 gloo ranks (dev VM: 1.4-2.1 GB/s
            against the 2.0-2.7 GB/s at which the wire model charges the same bytes).  When set, a shard's
            input dist costs ``input bytes / input_dist_bw`` instead of ``(W-1)/W * input bytes
            / link bandwidth`` (``perf`` module docstring); ``None`` = the wire model.
        output_dist_bw_gbps: GB/s (1e9 bytes) of pooled-embedding bytes *leaving* a rank through
            dlrmctl's output dist, ``comm.pooled_all_to_all`` forward and backward with its
            packing (the send-buffer cast / copy, the asynchronous all-to-all and its wait, the
            split of the receive buffer, the gradient copy into the backward send buffer):
            ``plan --calibrate`` times it on 2 gloo ranks (dev VM: 0.55-0.75 GB/s where a bare
            8 MiB ``all_to_all_single`` reaches 1.0-1.4).  When set, the output dist's bytes are
            charged at ``min(output_dist_bw, link bandwidth)``; the other collectives (the
            data_parallel gradient sync) keep the link bandwidth.  ``None`` = the link bandwidth.
    """

    compute_device: str
    hbm_gb: float
    ddr_gb: float | None
    hbm_bw_gbps: float
    ddr_bw_gbps: float
    intra_host_bw_gbps: float
    inter_host_bw_gbps: float
    default_gpus_per_host: int | None
    source: str
    kernel_launch_us: float | None = None
    collective_us: float | None = None
    inter_host_collective_us: float | None = None
    lookup_fixed_us: float | None = None
    fused_efficiency: float | None = None
    dense_efficiency: float | None = None
    bwd_compute_multiplier: float | None = None
    dense_bwd_compute_multiplier: float | None = None
    fused_bwd_id_ns: float | None = None
    fused_fwd_id_ns: float | None = None
    fused_fwd_bag_ns: float | None = None
    fused_bwd_bag_ns: float | None = None
    llc_mb: float | None = None
    fused_cache_speedup: float | None = None
    dense_cache_speedup: float | None = None
    input_dist_bw_gbps: float | None = None
    output_dist_bw_gbps: float | None = None


#: last-level cache per cache domain in MiB when a preset / topology file gives none: cuda is the smallest
#: L2 of the GPU presets (A100, 40 MB); cpu is used only where :func:`detect_llc_bytes` finds nothing
#: (the dev VM's 32 MiB L3)
DEFAULT_LLC_MB: dict[str, float] = {"cuda": 40.0, "cpu": 32.0}


def detect_llc_bytes() -> int | None:
    """This machine's last-level CPU cache in bytes, all instances together, or ``None`` if unknown.

    Reads ``/sys/devices/system/cpu/cpu*/cache/index*/{level,type,size,shared_cpu_list}``
    (what ``lscpu`` reports): the highest level of a data / unified cache, its size times the
    number of distinct ``shared_cpu_list`` (instances: one per socket or CCX).  Falls back
    to ``os.sysconf("SC_LEVEL3_CACHE_SIZE")`` (glibc), then ``None``.
    """
    import glob

    best: dict[int, dict[str, int]] = {}  # level -> {shared_cpu_list: bytes}
    for d in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/cache/index[0-9]*"):
        try:
            with open(f"{d}/type") as f:
                if f.read().strip() not in ("Unified", "Data"):
                    continue
            with open(f"{d}/level") as f:
                level = int(f.read().strip())
            with open(f"{d}/size") as f:
                size = f.read().strip()
            with open(f"{d}/shared_cpu_list") as f:
                shared = f.read().strip()
        except (OSError, ValueError):
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:].upper(), 1)
        try:
            nbytes = int(size.rstrip("KMGkmg")) * mult
        except ValueError:
            continue
        best.setdefault(level, {})[shared] = nbytes
    if best:
        return int(sum(best[max(best)].values()))
    try:
        v = int(os.sysconf("SC_LEVEL3_CACHE_SIZE"))
        return v if v > 0 else None
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-glibc
        return None


#: fixed per-op costs in microseconds per compute device (sources in the module docstring):
#: kernel launch, collective within a host, collective across hosts, one sharding group per step
DEFAULT_FIXED_US: dict[str, dict[str, float]] = {
    "cuda": {"kernel_launch_us": 5.0, "collective_us": 20.0, "inter_host_collective_us": 40.0, "lookup_fixed_us": 50.0},
    "cpu": {"kernel_launch_us": 10.0, "collective_us": 100.0, "inter_host_collective_us": 100.0, "lookup_fixed_us": 300.0},
}


DEVICE_PRESETS: dict[str, DevicePreset] = {
    "h100": DevicePreset("cuda", 80.0, 256.0, 3350.0, 76.8, 450.0, 50.0, 8,
                         "H100 SXM5 80GB datasheet; DGX H100 user guide (NVLink4 900 GB/s bidir, CX-7 400 Gb/s)",
                         llc_mb=50.0),
    "a100": DevicePreset("cuda", 80.0, 256.0, 2039.0, 51.2, 300.0, 25.0, 8,
                         "A100 80GB SXM datasheet; DGX A100 user guide (NVLink3 600 GB/s bidir, CX-6 200 Gb/s)",
                         llc_mb=40.0),
    "h200": DevicePreset("cuda", 141.0, 256.0, 4800.0, 76.8, 450.0, 50.0, 8,
                         "H200 SXM datasheet; DGX H200 (NVLink4 900 GB/s bidir, CX-7 400 Gb/s)", llc_mb=50.0),
    "cpu": DevicePreset("cpu", 0.0, None, 0.0, 18.8, 2.0, 1.0, None,
                        "measured numpy copy 18.8 GB/s on the dev VM; gloo loopback ~2 GB/s (estimate)"),
}


def host_memory_bytes() -> int:
    """Physical memory of this machine in bytes (``SC_PAGE_SIZE * SC_PHYS_PAGES``); 16 GB if unknown."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return int(16 * GB)


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
            kernel (missing keys: ``perf.DEFAULT_CACHE_SPEEDUP``).
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


#: keys of a topology file (:func:`load_topology_file`): the :class:`DevicePreset` fields
TOPOLOGY_FILE_KEYS = tuple(f.name for f in dataclasses.fields(DevicePreset))


#: smallest bandwidth (GB/s), efficiency or speedup a topology file may give (1 kB/s)
TOPOLOGY_DIVISOR_MIN = 1e-6
#: largest number a topology file may give (GB, GB/s, us: no machine is near it)
TOPOLOGY_VALUE_MAX = 1e9


def load_topology_file(path: "str | os.PathLike") -> DevicePreset:
    """Read a topology file (YAML, written by ``dlrmctl plan --calibrate``) as a :class:`DevicePreset`.

    Keys: the :class:`DevicePreset` fields (``compute_device``, ``hbm_gb``, ``ddr_gb``,
    ``hbm_bw_gbps``, ``ddr_bw_gbps``, ``intra_host_bw_gbps``, ``inter_host_bw_gbps``,
    ``default_gpus_per_host``, ``source`` and the optional fixed costs / kernel
    efficiencies, ``llc_mb`` and the cache speedups); ``measured`` (the raw figures and
    their spread over the repeats) is allowed and ignored.  A file written before a key
    was added (e.g. without ``llc_mb``, ``fused_cache_speedup``) loads with that key's
    default (the optional keys are ``None`` = the preset default).

    Raises:
        PlanError: unreadable file, not a mapping, unknown or missing key, or a value of
            the wrong type or range (the message names the file and the key): every number
            finite, >= 0 and <= :data:`TOPOLOGY_VALUE_MAX`; the bandwidths the planner divides by
            (``ddr_bw_gbps``, ``intra_host_bw_gbps``, ``inter_host_bw_gbps``, ``hbm_bw_gbps`` on
            cuda, the dist rates) and the kernel efficiencies / cache speedups
            >= :data:`TOPOLOGY_DIVISOR_MIN`; ``default_gpus_per_host`` an integer >= 1 or null.
    """
    from dlrmctl.yaml_file import read_yaml_mapping

    lines: dict[str, int] = {}
    d = read_yaml_mapping(path, PlanError, "topology file", f"keys {', '.join(TOPOLOGY_FILE_KEYS)}", lines)

    def at(key: str | None = None) -> str:  # "topology file FILE:LINE" of a key's line (FILE alone: no key)
        return f"topology file {path}:{lines[key]}" if key in lines else f"topology file {path}"

    d = {k: v for k, v in d.items() if k != "measured"}
    unknown = sorted(set(d) - set(TOPOLOGY_FILE_KEYS))
    if unknown:
        raise PlanError(f"{at(unknown[0])}: unknown key(s) {unknown}; expected {list(TOPOLOGY_FILE_KEYS)}")
    required = [f.name for f in dataclasses.fields(DevicePreset) if f.default is dataclasses.MISSING]
    missing = [k for k in required if k not in d]
    if missing:
        raise PlanError(f"topology file {path}: missing key(s) {missing}")
    if d["compute_device"] not in ("cuda", "cpu"):
        raise PlanError(f"{at('compute_device')}: compute_device must be cuda or cpu, got {d['compute_device']!r}")
    if not isinstance(d["source"], str):
        raise PlanError(f"{at('source')}: source must be a string (a one-line citation), got {d['source']!r}")
    # the planner divides by these (bytes / bandwidth, bandwidth * efficiency): they must be > 0
    divisors = {"ddr_bw_gbps", "intra_host_bw_gbps", "inter_host_bw_gbps", "fused_efficiency", "dense_efficiency",
                "fused_cache_speedup", "dense_cache_speedup", "input_dist_bw_gbps",
                "output_dist_bw_gbps"}
    if d["compute_device"] == "cuda":
        divisors.add("hbm_bw_gbps")
    for k, v in d.items():
        if k in ("compute_device", "source"):
            continue
        optional = k in ("ddr_gb", "default_gpus_per_host") or k not in required
        if v is None and optional:
            continue
        if k == "default_gpus_per_host":
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PlanError(f"{at(k)}: default_gpus_per_host must be an integer >= 1 (ranks per "
                                   f"host) or null, got {v!r}")
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (
                k in divisors and v == 0):
            raise PlanError(f"{at(k)}: {k} must be a finite number "
                               f"{'> 0' if k in divisors else '>= 0'}, got {v!r}")
        # the planner scales these (GB -> bytes, us -> s) and divides by the divisors: a value that
        # would overflow or underflow there is a typo, not a machine
        lo, hi = (TOPOLOGY_DIVISOR_MIN, TOPOLOGY_VALUE_MAX) if k in divisors else (0.0, TOPOLOGY_VALUE_MAX)
        if not lo <= v <= hi:
            raise PlanError(f"{at(k)}: {k} must be between {lo:g} and {hi:g}, got {v!r}")
    return DevicePreset(**d)


def save_topology_file(path: "str | os.PathLike", preset: DevicePreset, measured: dict | None = None,
                       header: str = "") -> None:
    """Write ``preset`` (and the raw ``measured`` figures) as a topology file (YAML).

    Written to a temporary file next to ``path`` and renamed, so an existing file is
    either fully replaced or untouched.  ``header`` lines are written as ``#`` comments.
    """
    import yaml

    d = dataclasses.asdict(preset)
    if measured:
        d["measured"] = measured
    text = "".join(f"# {line}\n" for line in header.splitlines()) + yaml.safe_dump(d, sort_keys=False)
    write_text_atomic(path, text)


@dataclass
class TableSpec:
    """One table as the planner sees it (the problem, not the answer).

    Attributes:
        name: table name.
        num_embeddings: rows.
        embedding_dim: columns.
        pooling_factors: mean ids per sample of each feature looked up in this
            table (TorchRec ``ParameterConstraints.pooling_factors``); their sum
            is the ids per sample, their count the pooled outputs per sample.
        optimizer: embedding optimizer: a name of :data:`dlrmctl.optim.registry.EMBEDDING_OPTIMIZERS`
            or one of its aliases (``rowwise_adagrad``, ``adagrad``, ``sgd``).
        weight_bytes: bytes per weight (4 fp32, 2 fp16).
        sharding_types: allowed sharding types (None: all).
        compute_kernels: allowed kernels (None: all).
        ranks: ranks the table's shards may be placed on (None: any).
        min_column_shard_dim: narrowest column shard (None: 32, or 4 when dim < 64).
        fixed: a hand-given sharding (``sharding.tables.<name>``) the planner must
            keep: ``(sharding_type, compute_kernel, ranks or None, column_sizes or None)``.
        is_pooled: True for an EmbeddingBagCollection table (one pooled embedding
            per feature and sample); False for an EmbeddingCollection table (one
            embedding row per id: output / comm bytes scale with the pooling
            factor; only :data:`UNPOOLED_SHARDING_TYPES` are enumerated).
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    pooling_factors: list[float] = field(default_factory=lambda: [1.0])
    optimizer: str = "exact_rowwise_adagrad"
    weight_bytes: int = 4
    sharding_types: list[ShardingType] | None = None
    compute_kernels: list[ComputeKernel] | None = None
    ranks: list[int] | None = None
    min_column_shard_dim: int | None = None
    fixed: tuple[ShardingType, ComputeKernel, list[int] | None, list[int] | None] | None = None
    is_pooled: bool = True

    @property
    def ids_per_sample(self) -> float:
        """Sum of the features' pooling factors: ids looked up per sample."""
        return float(sum(self.pooling_factors))

    @property
    def num_poolings(self) -> int:
        """Pooled embeddings per sample (one per feature)."""
        return len(self.pooling_factors)

    @property
    def output_rows_per_sample(self) -> float:
        """Embedding rows the lookups output per sample: one per feature when pooled
        (:attr:`num_poolings`), one per id when not (:attr:`ids_per_sample`)."""
        return float(self.num_poolings) if self.is_pooled else self.ids_per_sample

    @property
    def weight_bytes_total(self) -> int:
        """Bytes of the full weight matrix: rows * dim * weight_bytes."""
        return self.num_embeddings * self.embedding_dim * self.weight_bytes


@dataclass
class Storage:
    """Bytes of one shard (or one rank) in device memory (``hbm``) and host memory (``ddr``)."""

    hbm: int = 0
    ddr: int = 0

    def __add__(self, o: "Storage") -> "Storage":
        return Storage(self.hbm + o.hbm, self.ddr + o.ddr)


@dataclass
class Perf:
    """Estimated time of one shard per training step, seconds (TorchRec ``Perf``).

    ``total = fwd_compute + fwd_comms + bwd_compute + bwd_comms``.
    """

    fwd_compute: float = 0.0
    fwd_comms: float = 0.0
    bwd_compute: float = 0.0
    bwd_comms: float = 0.0

    @property
    def total(self) -> float:
        """Sum of the four parts, seconds."""
        return self.fwd_compute + self.fwd_comms + self.bwd_compute + self.bwd_comms


@dataclass(slots=True)
class Shard:
    """One block of a table in a candidate plan.

    Attributes:
        size: ``[rows, cols]``.
        offset: ``[row, col]`` in the full table.
        storage: bytes it occupies on its rank (weights + optimizer state + dist buffers).
        perf: estimated time it adds to its rank per step (seconds).
        input_bytes: bytes of ids it receives per step (input_dist).
        output_bytes: bytes of pooled embeddings it sends per step (output_dist).
        weights_bytes, optimizer_bytes: parts of ``storage`` (for error messages).
        rank: where it is placed; ``None`` until partitioned (fixed types set it).
        time: ``perf.total`` (seconds), filled in by the enumerator.
        mem: ``storage.hbm + storage.ddr`` (bytes), filled in by the enumerator.
    """

    size: list[int]
    offset: list[int]
    storage: Storage
    perf: Perf
    input_bytes: int
    output_bytes: int
    weights_bytes: int
    optimizer_bytes: int
    rank: int | None = None
    time: float = 0.0
    mem: int = 0


@dataclass
class ShardingOption:
    """One way to shard one table (TorchRec ``ShardingOption``).

    Attributes:
        table: the table.
        sharding_type, compute_kernel: the choice.
        shards: its shards (ranks set for placement-free types: row_wise and
            data_parallel; set by the partitioner for the others).
        host_bound: TWRW / TWCW — every shard on one host (the partitioner picks it).

    Shards are not modified after construction, so the aggregates below are
    computed once: ``total_perf`` (sum of shard times, seconds: the work this
    option adds to the job), ``max_shard_perf`` (slowest shard, seconds: a lower
    bound on the critical path with this option), ``max_shard_storage`` (bytes of
    the largest shard), ``total_storage`` (bytes of all shards), ``placed``
    (every shard's rank is already known: row_wise, data_parallel, pinned).
    """

    table: TableSpec
    sharding_type: ShardingType
    compute_kernel: ComputeKernel
    shards: list[Shard]
    host_bound: bool = False
    total_perf: float = field(init=False, default=0.0)
    max_shard_perf: float = field(init=False, default=0.0)
    max_shard_storage: int = field(init=False, default=0)
    total_storage: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        times = [s.time for s in self.shards]
        mems = [s.mem for s in self.shards]
        self.total_perf = sum(times)
        self.max_shard_perf = max(times)
        self.max_shard_storage = max(mems)
        self.total_storage = sum(mems)
        self.initial_ranks = [s.rank for s in self.shards]
        self.placed = all(r is not None for r in self.initial_ranks)
        self._placed_vecs = None

    def placed_vectors(self, world_size: int):
        """For an option whose shard ranks are all known: per-rank (time seconds, memory bytes) as numpy arrays, cached."""
        if self._placed_vecs is None:
            import numpy as np

            t, m = np.zeros(world_size), np.zeros(world_size, dtype=np.int64)
            for s in self.shards:
                t[s.rank] += s.time
                m[s.rank] += s.mem
            self._placed_vecs = (t, m)
        return self._placed_vecs

    @property
    def ranks(self) -> list[int]:
        """Ranks of the shards in shard order (after partitioning)."""
        return [s.rank for s in self.shards]  # type: ignore[misc]

    @property
    def is_pooled(self) -> bool:
        """The table's lookups pool (EmbeddingBagCollection) or not (EmbeddingCollection)."""
        return self.table.is_pooled

    def label(self) -> str:
        """Short name, e.g. ``column_wise/fused x4``."""
        n = len(self.shards)
        return f"{self.sharding_type.value}/{self.compute_kernel.value}" + (f" x{n}" if n > 1 else "")


def fmt_bytes(n: float) -> str:
    """Human bytes in GiB / MiB / KiB (binary units, as memory is allocated)."""
    if n >= GiB:
        return f"{n / GiB:.1f} GiB"
    if n >= MiB:
        return f"{n / MiB:.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def optimizer_name(name: str) -> str:
    """Canonical optimizer name (``rowwise_adagrad`` -> ``exact_rowwise_adagrad`` ...).

    Raises:
        PlanError: unknown optimizer.
    """
    try:
        return OPTIMIZER_ALIASES[name]
    except KeyError:
        raise PlanError(
            f"unknown embedding optimizer {name!r}; expected one of {sorted(OPTIMIZER_ALIASES)}"
        ) from None


def _enum_values(names: Sequence[str] | None, kind: type[enum.Enum], what: str) -> list | None:
    """``names`` as members of ``kind`` (None stays None).

    Raises:
        PlanError: an unknown name (``unknown <what> in [...]; expected [...]``).
    """
    if names is None:
        return None
    try:
        return [kind(n) for n in names]
    except ValueError:
        raise PlanError(f"unknown {what} in {list(names)}; expected {[k.value for k in kind]}") from None


def sharding_types_of(names: Sequence[str] | None) -> list[ShardingType] | None:
    """Parse sharding type names (None stays None).  Raises PlanError on an unknown name."""
    return _enum_values(names, ShardingType, "sharding type")


def compute_kernels_of(names: Sequence[str] | None) -> list[ComputeKernel] | None:
    """Parse compute kernel names (None stays None).  Raises PlanError on an unknown name."""
    return _enum_values(names, ComputeKernel, "compute kernel")
