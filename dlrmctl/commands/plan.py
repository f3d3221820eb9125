"""``dlrmctl plan``: compute a sharding plan for a config on a (possibly imaginary) cluster.

Planning is arithmetic only (no GPU, no tensors of table size): it prints which
hardware preset it plans for, the report, and
writes the plan (:meth:`ShardingPlan.save`; ``--out``, by default
``<train.run_dir>/<name>_plan.yaml`` beside the run it plans) and the report next to it
(``<plan name>_report.txt``: ``plan_report.txt`` for ``plan.yaml``); an existing plan
file is replaced only with ``--force``, and only when dlrmctl wrote it.
``--gpus N`` without ``--device`` / ``--topology`` plans the config's ``sharding.device``
(or ``sharding.topology_file``); when that is the ``cpu`` preset it is refused (``--gpus``
means GPUs: ask for ``--device cpu`` to plan CPU processes).  A plan that does not fit then
says which hardware the config gave and how to plan another.
Errors are one ``error: ...`` line (a plan that does not fit: the planner's explanation of the
largest table that cannot be placed and the remedies), exit code 2.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from dlrmctl.planner.types import DEVICE_PRESETS


#: the GPU presets, for messages that ask for --device
_GPU_PRESETS = sorted(k for k, v in DEVICE_PRESETS.items() if v.compute_device == "cuda")


def _lws(gpus: int, hosts: Optional[int], gpus_per_host: Optional[int], cfg_lws: Optional[int]) -> Optional[int]:
    """Ranks per host from ``--hosts`` / ``--gpus-per-host`` / ``sharding.local_world_size`` (None: preset default)."""
    if hosts is not None and gpus_per_host is not None:
        if hosts * gpus_per_host != gpus:
            raise ValueError(f"--hosts {hosts} x --gpus-per-host {gpus_per_host} != --gpus {gpus}")
        return gpus_per_host
    if hosts is not None:
        if hosts <= 0 or gpus % hosts:
            raise ValueError(f"--hosts {hosts} must divide --gpus {gpus}")
        return gpus // hosts
    if gpus_per_host is not None:
        if gpus_per_host <= 0 or gpus % gpus_per_host:
            raise ValueError(f"--gpus-per-host {gpus_per_host} must divide --gpus {gpus}")
        return gpus_per_host
    return cfg_lws


#: the report's line when this environment has no fbgemm_gpu (the plan is the dense kernel's)
NO_FBGEMM_LINE = ("Kernel: dense for every table: fbgemm_gpu is not installed here, so train here runs "
                  "torch.nn.EmbeddingBag and the plan is costed for it (install fbgemm_gpu and plan again for the "
                  "fused FBGEMM TBE kernel)")

#: the first words of every report (:meth:`PlanResult.report`): an existing file that starts
#: otherwise is not replaced without --force
_REPORT_HEAD = "Sharding plan:"


def _check_out(out: Path, force: bool, example: str, inputs: tuple = ()) -> None:
    """``--out`` names a file that may be written: not a directory, and not an existing file
    unless ``--force`` and it is a plan or topology file dlrmctl wrote
    (:func:`dlrmctl.outputs.check_file_replaceable`), never one of ``inputs``.

    Raises:
        ValueError: naming the option, the path and what to do (``example``: a file name to suggest).
    """
    from dlrmctl import outputs
    from dlrmctl.commands._common import show_path

    if out.is_dir() and not out.is_symlink():
        raise ValueError(f"--out {show_path(out)} is a directory; give a file path, e.g. "
                         f"--out {show_path(out / example)}")
    try:
        outputs.check_file_replaceable(out, "plan or topology file", _written_by_plan, force=force, option="--out",
                                       inputs=inputs)
    except outputs.OutputError as e:
        raise ValueError(str(e)) from None


def _written_by_plan(path: Path) -> bool:
    """``path`` is a plan file or topology file that ``dlrmctl plan`` (``--calibrate``) wrote: a
    YAML mapping with their keys (a config, a data file or anything else: False)."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 20)
        import yaml

        doc = yaml.safe_load(head.decode("utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        return False
    # a ShardingPlan.to_dict, or a save_topology_file (a DevicePreset)
    return isinstance(doc, dict) and ({"world_size", "tables"} <= set(doc)
                                      or {"compute_device", "hbm_gb", "intra_host_bw_gbps"} <= set(doc))


def _is_plan_report(path: Path) -> bool:
    """True when ``path`` starts like a report ``dlrmctl plan`` wrote (unreadable: False)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(len(_REPORT_HEAD)) == _REPORT_HEAD
    except OSError:
        return False


def plan_command(
    config: Optional[Path] = typer.Argument(None, help="experiment YAML (configs/*.yaml); not with --calibrate"),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="ranks in the job (GPUs, or processes with --device cpu)"),
    hosts: Optional[int] = typer.Option(None, "--hosts", help="hosts (ranks per host = gpus / hosts)"),
    gpus_per_host: Optional[int] = typer.Option(None, "--gpus-per-host", help="ranks per host"),
    device: Optional[str] = typer.Option(
        None, "--device", help=f"hardware preset: {' | '.join(sorted(DEVICE_PRESETS))} (default: sharding.device)"
    ),
    topology: Optional[Path] = typer.Option(
        None, "--topology", help="topology file (from --calibrate) instead of a preset (default: sharding.topology_file)"
    ),
    calibrate: bool = typer.Option(
        False, "--calibrate", help="measure this machine (CPU, 2 gloo ranks; 10-20 s on a 2-core machine, at most 60 s) and write a "
                                "topology file to --out"
    ),
    hbm_gb: Optional[float] = typer.Option(None, "--hbm-gb", help="device memory per rank, GB (overrides the preset)"),
    ddr_gb: Optional[float] = typer.Option(None, "--ddr-gb", help="host memory per rank, GB (overrides the preset)"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="GLOBAL batch (default: data.batch_size)"),
    weights_precision: Optional[str] = typer.Option(
        None, "--weights-precision", help="fp32 | fp16 (default: the config's model.embedding_precision)"),
    out: Optional[Path] = typer.Option(
        None, "--out", metavar="PATH", help="where to write the plan (default <train.run_dir>/<name>_plan.yaml, "
                                            "e.g. runs/demo_plan.yaml; with --calibrate: topology.yaml)"
    ),
    report: Optional[Path] = typer.Option(None, "--report", help="report file (default: <plan name>_report.txt next to --out, e.g. plan_report.txt)"),
    force: bool = typer.Option(False, "--force", help="replace an existing plan file"),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="config override KEY=VALUE (repeatable)"),
) -> None:
    """Plan how the config's embedding tables are sharded over GPUS ranks; print the report and write the plan.

    With --calibrate: measure this machine and write a topology file instead (no config)."""
    from dlrmctl.commands._common import check_number, echo, fail, show_path
    from dlrmctl.config import INT_LIMITS
    from dlrmctl.planner.types import TOPOLOGY_VALUE_MAX

    # every numeric option before anything else: finite, > 0, and no larger than the config key it stands for
    check_number("--gpus", gpus, maximum=INT_LIMITS["ranks"][0], what="ranks in the job")
    check_number("--hosts", hosts, maximum=INT_LIMITS["ranks"][0], what="hosts")
    check_number("--gpus-per-host", gpus_per_host, maximum=INT_LIMITS["ranks"][0], what="ranks per host")
    check_number("--hbm-gb", hbm_gb, maximum=TOPOLOGY_VALUE_MAX, what="device memory per rank, GB")
    check_number("--ddr-gb", ddr_gb, maximum=TOPOLOGY_VALUE_MAX, what="host memory per rank, GB")
    check_number("--batch-size", batch_size, maximum=INT_LIMITS["batch_size"][0], what="samples per global batch")
    if calibrate:
        _calibrate(config, gpus, topology, device, out or Path("topology.yaml"), force)
        return
    from dlrmctl.config import ConfigError, ShardingConfig, load_config, read_data_meta, resolve_tables
    from dlrmctl.distributed.types import PlanError
    from dlrmctl.planner.planner import plan_config
    from dlrmctl.planner.types import Topology

    if config is None:
        fail("plan needs a config file (or --calibrate)")
    if gpus is None:
        fail("plan needs --gpus N (ranks in the job)")
    defaulted = device is None and topology is None  # the hardware comes from the config
    preset = topo_file = None
    try:
        if device is not None and topology is not None:
            raise ValueError("--device and --topology both give the hardware: pass one")
        if device is not None and device not in DEVICE_PRESETS:  # before the tables (which import torch)
            raise ValueError(f"--device: unknown device {device!r}; expected one of {sorted(DEVICE_PRESETS)}")
        if weights_precision is not None and weights_precision not in ("fp32", "fp16"):
            raise ValueError(f"--weights-precision must be fp32 or fp16, got {weights_precision!r}")
        cfg = load_config(config, set_ or [])
        # by default next to the run it plans (train.run_dir/<name>_plan.yaml), not in the working directory
        out = out or Path(cfg.train.run_dir) / f"{cfg.name}_plan.yaml"
        # the report is named after the plan (plan.yaml -> plan_report.txt, tw.yaml -> tw_report.txt):
        # two plans written to one directory keep their own reports
        rpath = report or Path(os.path.abspath(out)).with_name(f"{Path(out).stem}_report.txt")
        meta = read_data_meta(cfg)
        resolve_tables(cfg, meta)  # the data's errors (no meta.json, a feature missing) before the hardware's
        lws = _lws(gpus, hosts, gpus_per_host, cfg.sharding.local_world_size)
        topo_file = str(topology) if topology is not None else (None if device else cfg.sharding.topology_file)
        preset = device or cfg.sharding.device  # (a topology file, when given, replaces the preset)
        gpu = None  # (preset, hbm_gb, name) of the visible GPU a CUDA-trained config is planned for
        if defaulted and topo_file is None and getattr(DEVICE_PRESETS.get(preset), "compute_device", "") == "cpu":
            gpu = _training_gpu(cfg, config)
            if gpu is not None:
                preset = gpu[0]
        if (defaulted and gpu is None and topo_file is None
                and getattr(DEVICE_PRESETS.get(preset), "compute_device", "") == "cpu"):
            # --gpus means GPUs: planning GPUS CPU processes (tables in host memory) must be asked for
            raise ValueError(
                f"--gpus {gpus} without --device: {show_path(config)} gives sharding.device '{preset}'"
                f"{' (its default)' if preset == ShardingConfig.device else ''}, which plans {gpus} CPU processes "
                f"with the tables in host memory; pass --device "
                f"{' | '.join(_GPU_PRESETS)} to plan {gpus} GPUs, or --device {preset} for CPU processes")
        topo = Topology.from_device_or_file(
            preset, topo_file, gpus, lws,
            hbm_gb if hbm_gb is not None else cfg.sharding.hbm_gb if cfg.sharding.hbm_gb is not None
            else gpu[1] if gpu else None,
            ddr_gb if ddr_gb is not None else cfg.sharding.ddr_gb,
            shown_as=show_path(topo_file) if topo_file else None,
        )
        # the outputs once every input is known good (a bad --device is named before an existing plan.yaml)
        _check_out(out, force, "plan.yaml", (config, topo_file))
        if rpath.is_dir():
            raise ValueError(f"--report {show_path(rpath)} is a directory; give a file path, e.g. "
                             f"--report {show_path(rpath / 'plan_report.txt')}")
        # realpath: a --report symlink (dangling too) or a symlinked directory naming the plan file
        if os.path.realpath(rpath) == os.path.realpath(out):
            raise ValueError(f"--report {show_path(rpath)} is the plan file itself; give another --report")
        from dlrmctl import outputs

        try:  # a report of ours is rewritten with its plan (as its plan is with --force); never anything else
            outputs.check_file_replaceable(rpath, "plan report", _is_plan_report, force=force or _is_plan_report(rpath)
                                           and not os.path.islink(rpath), option="--report",
                                           inputs=(config, topo_file))
        except outputs.OutputError as e:
            raise ValueError(str(e)) from None
        from dlrmctl import _fbgemm
        from dlrmctl.config import check_managed_collision_sharding, managed_collision_tables

        # managed-collision tables: the ranks must divide their buckets, as train and reshard require
        check_managed_collision_sharding(cfg, meta, topo.world_size)
        # the kernel train runs here: without fbgemm_gpu every table is planned and costed on the dense one
        fused = _fbgemm.fused_kernel_available()
        res = plan_config(cfg, topo, meta, batch_size,
                          None if weights_precision is None else 2 if weights_precision == "fp16" else 4,
                          fused_available=fused)
        mc_names = set(managed_collision_tables(cfg, meta))
        managed = [t for t in res.tables if t.name in mc_names]
        if managed:  # planned row_wise; laid out by zone of their buckets exactly as train lays them out
            from dlrmctl.distributed.sharded_mc import managed_collision_plan

            res.plan = managed_collision_plan(res.plan, managed, cfg.model.compute_kernel)
        # the plan must be what train --nproc will accept (the first import of torch: every error
        # about the arguments, the config, the data and the hardware came before it)
        from dlrmctl.modules.embedding_configs import EmbeddingBagConfig

        res.plan.validate(
            [EmbeddingBagConfig(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim)
             for t in res.tables],
            topo.world_size,
        )
    except PlanError as e:
        # a plan that does not fit: when the hardware came from the config, say so and how to plan another
        hint = ""
        if defaulted and preset is not None:
            src = (f"sharding.topology_file {show_path(topo_file)}" if topo_file
                   else f"the '{preset}' preset of sharding.device")
            hint = (f"\n  (planned for {src} in {show_path(config)}; --device {' | '.join(_GPU_PRESETS)} or "
                    f"--topology FILE plans other hardware)")
        raise PlanError(f"{e}{hint}") from None
    except ConfigError:
        raise
    except ValueError as e:
        fail(str(e))
    origin = ("--topology" if topology is not None else "--device" if device
              else f"sharding.topology_file in {show_path(config)}" if topo_file
              else f"the visible GPU {gpu[2]}, which train.device {cfg.train.device} in {show_path(config)} trains on, "
                   f"with its {gpu[1]:.1f} GB" if gpu
              else f"sharding.device in {show_path(config)}")
    # where the hardware comes from, once ("Preset: h100 (--device)", "Topology (--topology): FILE"); what it
    # is (ranks, memory, bandwidths) once too, in the report's first line ("Sharding plan: ... on <describe>")
    echo(f"Topology ({origin}): {show_path(topo_file)}" if topo_file else f"Preset: {preset} ({origin})")
    text = res.report()
    if not fused:  # after the report's first line ("Sharding plan: ...", what marks a report as ours)
        head, _, rest = text.partition("\n")
        text = f"{head}\n{NO_FBGEMM_LINE}\n{rest}"
    echo(text.rstrip("\n"))
    res.plan.save(out)  # makes the plan's directory
    try:  # and --report's, as the plan's (a --report in a new directory died after the plan was written)
        from dlrmctl.fileio import write_text_atomic

        write_text_atomic(rpath, text)
    except OSError as e:
        fail(f"wrote {show_path(out)}, but not the report --report {show_path(rpath)}: {e.strerror or e}")
    hosts = res.plan.world_size // res.plan.local_world_size  # --nproc is ranks per node, as train takes it
    ranks = f"--nproc {res.plan.local_world_size} --nnodes {hosts}" if hosts > 1 else f"--nproc {gpus}"
    echo(f"wrote {show_path(out)} and {show_path(rpath)}; train with it: dlrmctl train {show_path(config)} "
         f"{ranks} --plan {show_path(out)}")


def _training_gpu(cfg, config: Path) -> Optional[tuple[str, float, str]]:
    """``(preset, hbm_gb, device name)`` of the GPU ``dlrmctl train`` would plan on
    (:func:`dlrmctl.distributed.env.device_planning_preset` of ``cuda``), when the config trains on
    CUDA (``train.device`` ``cuda``, or ``auto`` with a GPU visible) and names no GPU preset itself;
    None when it trains on the CPU.

    Raises:
        ValueError: ``train.device: cuda`` and no GPU is visible here: plan needs ``--device``.
    """
    import torch

    from dlrmctl.commands._common import show_path

    if cfg.train.device == "cpu" or (cfg.train.device == "auto" and not torch.cuda.is_available()):
        return None
    if not torch.cuda.is_available():
        raise ValueError(f"{show_path(config)} trains on CUDA (train.device cuda), but no GPU is visible here to plan "
                         f"for; pass --device {' | '.join(_GPU_PRESETS)} (the GPU training will run on)")
    from dlrmctl.distributed.env import device_planning_preset

    preset, hbm = device_planning_preset(torch.device("cuda"))
    return preset, hbm, torch.cuda.get_device_name(torch.device("cuda"))


def _calibrate(config: Optional[Path], gpus: Optional[int], topology: Optional[Path], device: Optional[str],
               out: Path, force: bool) -> None:
    """``plan --calibrate``: measure this machine (:mod:`dlrmctl.planner.calibrate`) and write ``out``."""
    from dlrmctl.commands._common import echo, fail, show_path

    if config is not None or gpus is not None or topology is not None or device is not None:
        fail("--calibrate measures this machine: it takes no config, --gpus, --device or --topology "
             "(then plan with --topology FILE)")
    try:  # before the measurements, not when writing after them
        _check_out(out, force, "topology.yaml")
    except ValueError as e:
        fail(str(e))
    try:  # the file's directory, made before the measurements (as `plan --out` makes the plan's)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    except OSError as e:
        fail(f"--out {show_path(out)}: cannot create its directory ({e.strerror})")
    from dlrmctl.planner.calibrate import TIME_BUDGET_S, calibrate, spread_summary
    from dlrmctl.planner.types import save_topology_file

    echo(f"Calibrating this machine (CPU, gloo on 2 spawned ranks, 1 thread per rank; under {TIME_BUDGET_S:.0f} s)")
    try:
        preset, measured = calibrate(lambda m: echo("  " + m))
    except RuntimeError as e:
        fail(str(e))
    save_topology_file(out, preset, measured,
                       header=f"{preset.source}\nload with: dlrmctl plan CONFIG --gpus N --topology {show_path(out)}"
                              f"\nor the config key sharding.topology_file\n{spread_summary(measured)}")
    echo(f"wrote {show_path(out)} (plan with --topology {show_path(out)} or sharding.topology_file)")


def register(app: typer.Typer) -> None:
    """Add the ``plan`` command to the main ``dlrmctl`` app."""
    app.command("plan", short_help="Plan the sharding of the embedding tables over GPUS ranks")(plan_command)


#: a one-command app for tests (``CliRunner().invoke(app, [...])``) and ``python -m dlrmctl.commands.plan``
app = typer.Typer(add_completion=False, help="Plan embedding sharding")
register(app)

if __name__ == "__main__":  # pragma: no cover
    app()
