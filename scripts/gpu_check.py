"""The device checks of dlrmctl in one call (``bash scripts/gpu_check.sh``, which runs this file), built for
a short GPU slot on a fixed image (no network, no fbgemm_gpu, no torchx) that may end in a kill.

What comes back is at most 8 files under ``--out``: ``gpu_check.json`` (the summary: the last record of
every step), ``steps.jsonl`` (one JSON record per line, appended and fsync'ed as each step starts and
ends, so a kill leaves the finished steps' records and marks the one that was running as ``started``)
and at most 6 logs, one per group of steps (``logs/<group>.log``).

Groups (one process each: a torch import costs seconds, 13 s of wall time on a loaded 2-core machine) and
their steps, with per-step limits that add up to 465 s (``--limit-scale`` multiplies them, for a loaded CPU
machine):

  device  env (25 s): versions, device, fbgemm; data (20 s): a synthetic Criteo-schema data set;
          demo (50 s): ``dlrmctl train configs/demo.yaml``, 50 steps, one device, and its timing line
          (samples/s of the kernel that ran, host syncs per step counted by
          ``torch.cuda.set_sync_debug_mode``, peak memory); bf16 (30 s): 20 steps under
          ``train.precision: bf16``; fp16 (30 s): 20 steps under fp16 + GradScaler (CUDA only);
          resume (40 s): ``--resume`` of the demo run from its checkpoint written on the device;
          pt2 (30 s): the demo run exported (``model.pt2``) and evaluated with ``evaluate --device``;
          serve (30 s): ``dlrmctl serve --device`` of that export answers one infer request.  Each of
          the last two is skipped, with the reason, where this checkout's command has no ``--device``
          (on CUDA) or the serve extra is not installed
  parity  parity (90 s): ``pipeline: none`` vs ``sparse_dist`` on the sharded path (one-rank group, nccl
          on CUDA / gloo on CPU), 30 steps, both under ``torch.use_deterministic_algorithms(True)``
          (``CUBLAS_WORKSPACE_CONFIG=:4096:8``; warn-only: the ops without a deterministic kernel are
          listed in the record).  Passes when the per-step losses agree within 1e-6 relative; whether
          they are bit-identical is recorded too
  pytest  pytest (120 s): tests/modules/test_cuda.py, the CUDA variants; skipped without CUDA

On the CPU the training steps take a quarter of the demo config's rows a step (the same code; the
device runs the config's batches, whose timing line is the figure that matters there).  Each record
has the step's wall and CPU seconds.

A failed env or data step skips everything after it; a failed demo skips resume, pt2 and serve; other
failures do not stop the later steps.  A step over its limit is killed after Python's faulthandler
dumps every thread's stack into the group's log, and recorded as ``timeout``; the group's steps after
it run in a new process.  Collectives time out
after 120 s (``DLRMCTL_COLLECTIVE_TIMEOUT_S``).  On a CPU-only machine the same steps run on the CPU
(gloo), the CUDA-only ones are skipped, exit 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

GROUPS: list[tuple[str, list[tuple[str, int]]]] = [
    ("device", [("env", 25), ("data", 20), ("demo", 50), ("bf16", 30), ("fp16", 30), ("resume", 40), ("pt2", 30),
                ("serve", 30)]),
    ("parity", [("parity", 90)]),
    ("pytest", [("pytest", 120)]),
]
#: a failure of one of these skips the steps named after it
NEEDED_BY = {"env": "*", "data": "*", "demo": ("resume", "pt2", "serve")}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Records:
    """``steps.jsonl`` (appended, fsync'ed per record) and ``gpu_check.json`` (last record per step)."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.jsonl = os.path.join(out, "steps.jsonl")

    def add(self, step: str, status: str, seconds: float = 0.0, limit_s: float = 0, **fig) -> None:
        rec = {"step": step, "status": status, "seconds": round(seconds, 2), "limit_s": limit_s, **fig}
        with open(self.jsonl, "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        steps = self.steps()
        tmp = os.path.join(self.out, ".gpu_check.json.tmp")
        with open(tmp, "w") as f:
            json.dump({"steps": steps}, f, indent=1, default=str)
        os.replace(tmp, os.path.join(self.out, "gpu_check.json"))

    def steps(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        if os.path.exists(self.jsonl):
            with open(self.jsonl) as f:
                for line in f:
                    try:
                        r = json.loads(line)
                    except ValueError:  # a line cut by a kill
                        continue
                    out[r["step"]] = r
        return out


# ----------------------------------------------------------------------------------------- the steps
class Ctx:
    def __init__(self, work: str) -> None:
        self.work = work
        self.data = os.path.join(work, "data")
        self.runs = os.path.join(work, "runs")
        self.export = os.path.join(work, "export")
        import torch

        self.cuda = torch.cuda.is_available()
        self.dev = "cuda" if self.cuda else "cpu"
        # the CPU dry run checks the same code with a quarter of the rows a step (the device's batches
        # are the demo config's: its timing line is the figure that matters there)
        self.batch_scale = 1 if self.cuda else 4

    def batch(self, rows: int) -> list[str]:
        return ["--set", f"data.batch_size={rows // self.batch_scale}"]

    def common(self) -> list[str]:
        return ["--set", f"data.path={self.data}", "--set", f"train.run_dir={self.runs}", "--set",
                "train.progress=false", "--set", "train.eval_every=0", "--set", f"train.device={self.dev}",
                "--set", "train.epochs=100",  # max_steps ends each run (the CPU data set is small)
                *([] if self.cuda else self.batch(1024))]  # 1024: configs/demo.yaml's batch


class Skip(Exception):
    """The step cannot run here; its message is the reason."""


def _cli(*args: str) -> None:
    from dlrmctl.cli import app

    rc = app(list(args), standalone_mode=False)  # a one-line error is printed and returns its code
    if rc:
        raise RuntimeError(f"dlrmctl {' '.join(args[:2])} exited {rc} (its error line is above)")


def _train_figs(run: str) -> dict:
    recs = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    train = [r for r in recs if r["kind"] == "train"]
    steps = json.load(open(os.path.join(run, "summary.json")))["steps"]
    import math

    last = train[-1]["loss"] if train else None
    if last is None or not math.isfinite(last):
        raise RuntimeError(f"{run}: last logged loss {last}")
    return {"steps": steps, "last_loss": last, "samples_per_s": train[-1].get("samples_per_s")}


def _kernel() -> str:
    from dlrmctl import _fbgemm

    return "fused (FBGEMM TBE)" if _fbgemm.HAS_FBGEMM else "dense fallback (no fbgemm_gpu)"


def step_env(c: Ctx) -> dict:
    import platform

    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cuda_available": c.cuda, "device_name": torch.cuda.get_device_name(0) if c.cuda else None,
            "fbgemm": _kernel()}


def step_data(c: Ctx) -> dict:
    from dlrmctl.data.synthetic import generate_synthetic

    rows = 200_000 if c.cuda else 20_000
    generate_synthetic(c.data, rows=rows, seed=0)
    return {"rows": rows}


def step_demo(c: Ctx) -> dict:
    """50 steps of the demo config; the timing line: samples/s, host syncs per step, peak memory."""
    import resource
    import warnings

    import torch

    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if c.cuda:
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.set_sync_debug_mode("warn")  # a warning per synchronizing CUDA call
        try:
            _cli("train", "configs/demo.yaml", *c.common(), "--set", "name=gpu_demo", "--set", "train.max_steps=50",
                 "--set", "train.log_every=10", "--set", "train.checkpoint_every=50", "--overwrite")
        finally:
            if c.cuda:
                torch.cuda.set_sync_debug_mode(0)
                torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    fig = _train_figs(os.path.join(c.runs, "gpu_demo"))
    syncs = sum("synchronizing" in str(w.message) for w in caught)
    kernel = _kernel()
    fig.update(kernel=kernel, samples_per_s_label=f"samples/s of the {kernel}",
               host_syncs_per_step=(syncs / fig["steps"]) if c.cuda else None,
               host_syncs_note=("torch.cuda.set_sync_debug_mode warnings over the whole run (set-up, checkpoint "
                                "and loss reads included) / steps" if c.cuda else "counted on CUDA only"),
               peak_memory_mib=(torch.cuda.max_memory_allocated() / 2**20 if c.cuda
                                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
               peak_memory_label="torch.cuda.max_memory_allocated" if c.cuda else "peak RSS of the process",
               step_s_synchronized=wall / max(fig["steps"], 1),
               step_s_note="whole run (build, data, steps, checkpoint) / steps, after torch.cuda.synchronize")
    print("timing:", {k: fig[k] for k in ("samples_per_s", "host_syncs_per_step", "peak_memory_mib")})
    return fig


def _precision(c: Ctx, precision: str) -> dict:
    if precision == "fp16" and not c.cuda:
        raise Skip("fp16 + GradScaler needs CUDA (train.precision: fp16 is refused on the CPU)")
    _cli("train", "configs/demo.yaml", *c.common(), "--set", f"name=gpu_{precision}", "--set",
         f"train.precision={precision}", "--set", "train.max_steps=20", "--set", "train.log_every=5",
         "--set", "train.checkpoint_every=0", "--overwrite")
    return _train_figs(os.path.join(c.runs, f"gpu_{precision}"))


def step_bf16(c: Ctx) -> dict:
    return _precision(c, "bf16")


def step_fp16(c: Ctx) -> dict:
    return _precision(c, "fp16")


def step_resume(c: Ctx) -> dict:
    _cli("train", "configs/demo.yaml", *c.common(), "--set", "name=gpu_demo", "--set", "train.max_steps=60",
         "--set", "train.log_every=5", "--set", "train.checkpoint_every=0", "--resume")
    fig = _train_figs(os.path.join(c.runs, "gpu_demo"))
    if fig["steps"] != 60:
        raise RuntimeError(f"resumed run ended at step {fig['steps']}, expected 60")
    return fig


def step_parity(c: Ctx) -> dict:
    import warnings

    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    losses = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for p in ("none", "sparse_dist"):
            _cli("train", "configs/demo.yaml", *c.common(), "--set", "sharding.force=true", "--set",
                 "train.max_steps=30", "--set", "train.log_every=1", *c.batch(512),
                 "--set", "train.checkpoint_every=0", "--set", f"name=parity_{p}", "--set", f"train.pipeline={p}",
                 "--overwrite")
            with open(os.path.join(c.runs, f"parity_{p}", "metrics.jsonl")) as f:
                losses[p] = [r["loss"] for r in map(json.loads, f) if r["kind"] == "train"]
    a, b = losses["none"], losses["sparse_dist"]
    rel = max((abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b)), default=0.0)
    nondet = sorted({str(w.message).split("\n")[0][:200] for w in caught if "deterministic" in str(w.message)})
    fig = {"steps": len(a), "identical": a == b, "max_rel_diff": rel, "tolerance_rel": 1e-6,
           "mode": "torch.use_deterministic_algorithms(True, warn_only=True)", "nondeterministic_ops": nondet,
           "first_differing_step": next((i + 1 for i, (x, y) in enumerate(zip(a, b)) if x != y), None),
           "kernel": _kernel(), "losses": losses}
    if len(a) != 30 or len(b) != 30 or rel > 1e-6:
        raise RuntimeError(f"pipeline none vs sparse_dist: max relative loss difference {rel:.3g} over "
                           f"{len(a)}/{len(b)} steps (tolerance 1e-6)", fig)
    return fig


def _has_device_option(command: str) -> bool:
    import typer.main

    from dlrmctl.cli import app

    cmd = typer.main.get_command(app).commands[command]
    return any("--device" in p.opts for p in cmd.params)


def _ensure_export(c: Ctx) -> None:
    if not os.path.exists(os.path.join(c.export, "model.pt2")):
        _cli("export", os.path.join(c.runs, "gpu_demo"), "--fp32", "--out", c.export, "--force")


def step_pt2(c: Ctx) -> dict:
    dev = _has_device_option("evaluate")
    if c.cuda and not dev:
        raise Skip("this checkout's `evaluate` has no --device: the .pt2 program loads on the CPU only")
    _ensure_export(c)
    out = os.path.join(c.work, "pt2_eval.json")
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        _cli("evaluate", c.export, "--data", c.data, "--json", *(["--device", c.dev] if dev else []))
    text = buf.getvalue()
    print(text)
    with open(out, "w") as f:
        f.write(text)
    metrics = json.loads(text[text.index("{"):])
    return {"device": c.dev if dev else "cpu", "metrics": metrics}


def step_serve(c: Ctx) -> dict:
    import importlib.util
    import re
    import urllib.request

    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise Skip(f"the serve extra is not installed ({', '.join(missing)} missing)")
    dev = _has_device_option("serve")
    if c.cuda and not dev:
        raise Skip("this checkout's `serve` has no --device: it serves on the CPU only")
    _ensure_export(c)
    cmd = [sys.executable, "-c", "import sys; sys.argv[0] = 'dlrmctl'; from dlrmctl.cli import main; main()",
           "serve", c.export, "--port", "0", "--name", "gpu", *(["--device", c.dev] if dev else [])]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        port, seen = None, []
        while port is None:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError("serve exited before listening: " + "".join(seen[-20:]))
            seen.append(line)
            print(line, end="")
            m = re.search(r"http://[^:\s]+:(\d+)", line)
            port = int(m.group(1)) if m else None
        import numpy as np

        rng = np.random.default_rng(0)
        B = 4
        inputs = [{"name": "dense", "datatype": "FP32", "shape": [B, 13], "data": rng.random(B * 13).tolist()}]
        inputs += [{"name": f"C{i}", "datatype": "INT64", "shape": [B], "data": [0, 1, 2, 3]} for i in range(1, 27)]
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/gpu/infer", method="POST",
                                     data=json.dumps({"inputs": inputs}).encode(),
                                     headers={"Content-Type": "application/json"})
        deadline = time.time() + 20
        while True:
            try:
                body = json.loads(urllib.request.urlopen(req, timeout=10).read())
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.5)
        score = next(o for o in body["outputs"] if o["name"] == "score")["data"]
        if len(score) != B or not all(0.0 <= s <= 1.0 for s in score):
            raise RuntimeError(f"bad scores {score}")
        return {"device": c.dev if dev else "cpu", "scores": score}
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


STEP_FUNCS = {"env": step_env, "data": step_data, "demo": step_demo, "bf16": step_bf16, "fp16": step_fp16,
              "resume": step_resume, "parity": step_parity, "pt2": step_pt2, "serve": step_serve}


def _needing(step: str, steps: list[str]) -> list[str]:
    """The steps of ``steps`` that a failure of ``step`` skips (:data:`NEEDED_BY`)."""
    need = NEEDED_BY.get(step) or ()
    return [s for s in steps if s != step] if need == "*" else [s for s in need if s in steps]


def _cpu_s() -> float:
    """CPU seconds of this process and of its children that ended (a step's serve process)."""
    import resource

    self_, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return self_.ru_utime + self_.ru_stime + kids.ru_utime + kids.ru_stime


def run_group(group: str, steps: list[tuple[str, int]], work: str, recs: Records, scale: float,
              skip: dict[str, str]) -> None:
    """The child process of one group: each step recorded as it starts and ends; a step over its limit
    dumps every thread's stack (faulthandler) and ends this process (the driver records the timeout)."""
    import faulthandler
    import traceback

    os.chdir(REPO)
    c = Ctx(work)
    for step, limit in steps:
        if step in skip:
            recs.add(step, "skipped", 0, limit, reason=skip[step])
            continue
        lim = limit * scale
        recs.add(step, "started", 0, lim)
        print(f"=== gpu_check: {step} (limit {lim:.0f}s)", flush=True)
        faulthandler.dump_traceback_later(lim, exit=True)
        t0 = time.perf_counter()
        cpu0 = _cpu_s()
        try:
            fig = STEP_FUNCS[step](c)
            recs.add(step, "passed", time.perf_counter() - t0, lim, cpu_s=round(_cpu_s() - cpu0, 2), **fig)
        except Skip as e:
            recs.add(step, "skipped", time.perf_counter() - t0, lim, reason=str(e))
        except Exception as e:  # noqa: BLE001 (every failure becomes the step's record)
            traceback.print_exc()
            fig = e.args[1] if len(e.args) > 1 and isinstance(e.args[1], dict) else {}
            recs.add(step, "failed", time.perf_counter() - t0, lim, error=f"{type(e).__name__}: {e.args[0] if e.args else e}"[:500], **fig)
            for later in _needing(step, [s for s, _ in steps]):
                skip.setdefault(later, f"after {step} failed")
        finally:
            faulthandler.cancel_dump_traceback_later()
        print(f"=== gpu_check: {step} {recs.steps()[step]['status']} in {time.perf_counter() - t0:.1f}s", flush=True)
    # the steps this child skipped because of a failure are passed on through the records


def pytest_cuda_variants() -> int:
    """tests/modules/test_cuda.py, only the tests whose parameter id holds ``cuda`` (a ``-k`` would also
    match the module's name and run the CPU variants, which CI runs)."""
    import re

    import pytest

    class OnlyCuda:
        def pytest_collection_modifyitems(self, config, items):
            keep = [i for i in items if re.search(r"(^|-)cuda(-|$)", getattr(getattr(i, "callspec", None), "id", ""))]
            config.hook.pytest_deselected(items=[i for i in items if i not in keep])
            items[:] = keep

    os.chdir(REPO)
    return int(pytest.main(["tests/modules/test_cuda.py", "-v", "-p", "no:cacheprovider"], plugins=[OnlyCuda()]))


def _run_child(cmd: list[str], log: str, limit: float) -> int:
    """Run ``cmd`` in its own session, its output appended to ``log``; killed ``limit`` + 15 s on."""
    with open(log, "ab") as lf:
        p = subprocess.Popen(cmd, cwd=REPO, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return p.wait(limit + 15)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGABRT)
            time.sleep(2)
            os.killpg(p.pid, signal.SIGKILL)
            return p.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--limit-scale", type=float, default=float(os.environ.get("GPU_CHECK_LIMIT_SCALE", "1")))
    ap.add_argument("--child", default=None)
    ap.add_argument("--steps", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--skip", default="{}")
    ap.add_argument("--pytest-cuda", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.pytest_cuda:
        return pytest_cuda_variants()
    recs = Records(a.out)
    if a.child:
        steps = dict(GROUPS)[a.child]
        if a.steps is not None:
            steps = [(s, lim) for s, lim in steps if s in json.loads(a.steps)]
        run_group(a.child, steps, a.work, recs, a.limit_scale, json.loads(a.skip))
        return 0
    os.makedirs(os.path.join(a.out, "logs"), exist_ok=True)
    skip: dict[str, str] = {}
    every = [s for _, ss in GROUPS for s, _ in ss]
    for group, steps in GROUPS:
        limits = dict(steps)
        log = os.path.join(a.out, "logs", f"{group}.log")
        if group == "pytest":
            if "pytest" not in skip and not recs.steps().get("env", {}).get("cuda_available"):
                skip["pytest"] = "no CUDA (the CPU variants run in CI)"
            if "pytest" in skip:
                recs.add("pytest", "skipped", 0, limits["pytest"], reason=skip["pytest"])
                continue
            limit = limits["pytest"] * a.limit_scale
            recs.add("pytest", "started", 0, limit)
            t0 = time.perf_counter()
            rc = _run_child([sys.executable, os.path.abspath(__file__), "--out", a.out, "--work", a.work,
                             "--pytest-cuda"], log, limit)
            recs.add("pytest", "passed" if rc == 0 else "failed", time.perf_counter() - t0, limit, returncode=rc)
            continue
        # one process runs the group's steps; a step that ends it (over its limit, a crash) is recorded,
        # and the steps after it run in a new process
        todo = [s for s, _ in steps]
        while todo:
            for s in [s for s in todo if s in skip]:
                recs.add(s, "skipped", 0, limits[s], reason=skip[s])
            todo = [s for s in todo if s not in skip]
            if not todo:  # nothing to run: no process (a torch import) for it
                break
            t0 = time.perf_counter()
            rc = _run_child([sys.executable, os.path.abspath(__file__), "--out", a.out, "--work", a.work,
                             "--limit-scale", str(a.limit_scale), "--child", group, "--steps", json.dumps(todo),
                             "--skip", json.dumps(skip)], log, sum(limits[s] for s in todo) * a.limit_scale)
            seen = recs.steps()
            ended = None  # the step its process ended in
            for step in todo:
                r = seen.get(step)
                if r is not None and r["status"] == "started":
                    ended = step
                    over = time.perf_counter() - t0 >= r["limit_s"]
                    recs.add(step, "timeout" if over else "failed", time.perf_counter() - t0, r["limit_s"],
                             error=f"the group's process ended (exit {rc}) during the step; its log has the stacks")
                if step == ended or (r is not None and r["status"] in ("failed", "timeout")):
                    for later in _needing(step, every):
                        skip.setdefault(later, f"after {step} failed")
            left = [s for s in todo if s not in recs.steps()]  # (the skipped ones are recorded above)
            if ended is None:  # it ended before a step started: do not start that step again
                for s in left:
                    if s not in skip:
                        recs.add(s, "skipped", 0, limits[s], reason=f"its group's process ended (exit {rc}) before it")
                left = [s for s in left if s in skip]
            todo = left
    final = recs.steps()
    bad = [s for s, r in final.items() if r["status"] in ("failed", "timeout")]
    print(f"gpu_check: records {recs.jsonl}, summary {os.path.join(a.out, 'gpu_check.json')}, logs {a.out}/logs")
    for s, r in final.items():
        print(f"  {s:8s} {r['status']:8s} {r['seconds']:7.1f}s  {r.get('reason') or r.get('error') or ''}")
    if bad:
        print(f"gpu_check: FAILED: {', '.join(bad)}")
        return 1
    print("gpu_check: all steps passed or skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
