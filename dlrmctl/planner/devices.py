"""Per-rank hardware numbers of a device kind (:class:`DevicePreset`), the presets and where each
number comes from, this machine's memory and last-level cache, and topology files (a preset
measured by ``dlrmctl plan --calibrate``).

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

Last-level cache (``llc_mb``, MiB; :func:`dlrmctl.planner.cache.cache_hit_fractions` uses it):

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
:data:`dlrmctl.planner.cache.DEFAULT_CACHE_SPEEDUP`.

All of these presets are literature / datasheet numbers; ``dlrmctl plan
--calibrate`` measures this machine and writes a topology file
(:func:`save_topology_file`, loaded by :func:`load_topology_file`,
``plan --topology FILE`` or ``sharding.topology_file``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from dlrmctl.distributed.types import PlanError
from dlrmctl.fileio import write_text_atomic

__all__ = [
    "DEFAULT_FIXED_US",
    "DEFAULT_LLC_MB",
    "DEVICE_PRESETS",
    "GB",
    "GiB",
    "MiB",
    "TOPOLOGY_DIVISOR_MIN",
    "TOPOLOGY_FILE_KEYS",
    "TOPOLOGY_VALUE_MAX",
    "DevicePreset",
    "detect_llc_bytes",
    "host_memory_bytes",
    "load_topology_file",
    "save_topology_file",
]

GB = 1e9  #: bytes in a (decimal, datasheet) gigabyte
GiB = float(1 << 30)  #: bytes in a gibibyte
MiB = float(1 << 20)


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
            practice; ``None`` = :data:`dlrmctl.planner.cache.DEFAULT_CACHE_SPEEDUP`.
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
