"""Load benchmark of ``dlrmctl serve`` with an independent Open Inference Protocol client
(``tritonclient.http``), against ``predict``'s offline rows/s on the same machine as the ceiling.

    python scripts/bench_serve.py MODEL_DIR --input RAW.tsv [--seconds 5] [--max-requests 20000]

For each server setting (dynamic batching: the defaults, 4096 rows / 2 ms; without: ``--max-batch-rows 1``)
it starts ``dlrmctl serve MODEL_DIR --port 0`` on 127.0.0.1, and for concurrency 1, 8, 64 and requests
of 1 and 64 rows runs that many client threads (one ``InferenceServerClient`` each, the model's
tensor inputs in the binary extension) for ``--seconds`` or ``--max-requests`` requests, whichever
comes first; prints rows/s, p50/p99 request latency and the CPU time per request of the client
process (``getrusage``, all its threads) and of the server (its processes' ``utime + stime`` from
``/proc``), then stops the server (SIGTERM).  From those two it prints the bound of the cell: the
requests/s that the machine's CPUs could carry if client and server used every one of them
(``cpus / (client + server CPU per request)``), as rows/s.  Traffic goes to 127.0.0.1 only.

``--serve-args "--processes 2"``: extra ``dlrmctl serve`` options for every setting.
"""

import argparse
import os
import re
import resource
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def offline_rows_per_s(model_dir: str, raw: Path, repeats: int = 3) -> float:
    """``dlrmctl predict``'s scoring loop (transform + forward, 65,536-row batches) rows/s, best of ``repeats``."""
    from dlrmctl.inference.export import load_exported
    from dlrmctl.inference.predict import iter_scores

    m = load_exported(model_dir)
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        n = sum(len(s) for s, _ in iter_scores(m, raw))
        best = max(best, n / (time.perf_counter() - t))
    return best


def inputs(model_dir: str, raw: Path):
    from dlrmctl.inference.export import load_exported
    from dlrmctl.inference.predict import raw_transformer

    m = load_exported(model_dir)
    tr, cols = raw_transformer(m)
    (dense, ids, _), = list(tr.file(raw, 1 << 22))
    return dense, ids[:, [cols.index(f) for f in m.feature_names]], m.feature_names


def start(model_dir: str, *args: str):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.Popen([sys.executable, "-m", "dlrmctl.cli", "serve", model_dir, "--host", "127.0.0.1", "--port", "0",
                          *args], stdout=subprocess.PIPE, text=True, env=env)
    line = p.stdout.readline()
    m = re.search(r"http://127\.0\.0\.1:(\d+)/v2/models/(\S+) ", line)
    if not m:
        p.kill()
        raise SystemExit(f"server did not start: {line}")
    url = f"127.0.0.1:{m.group(1)}"
    for _ in range(600):
        try:
            if urllib.request.urlopen(f"http://{url}/v2/health/ready", timeout=5).status == 200:
                return p, url, m.group(2)
        except OSError:
            time.sleep(0.1)
    p.kill()
    raise SystemExit("server not ready after 60 s")


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` and its live child processes (Linux ``/proc``)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
            f = stat[stat.rindex(")") + 2:].split()
            total += (int(f[11]) + int(f[12])) / tick
            for t in Path(f"/proc/{p}/task").iterdir():
                todo.extend(int(c) for c in (t / "children").read_text().split())
        except (OSError, ValueError):
            continue
    return total


def client_cpu_s() -> float:
    """CPU seconds (user + system) of this process, all threads."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def load(url: str, name: str, dense, ids, features, rows: int, conc: int, seconds: float, max_requests: int):
    """``conc`` client threads -> (rows/s, p50 ms, p99 ms, requests, client CPU s)."""
    import tritonclient.http as th

    lat: list[float] = []
    lock = threading.Lock()
    count = [0]
    stop_at = time.monotonic() + seconds
    errors: list[str] = []

    def worker(k: int):
        c = th.InferenceServerClient(url, network_timeout=60)
        rng = np.random.default_rng(k)
        mine = []
        while time.monotonic() < stop_at:
            with lock:
                if count[0] >= max_requests:
                    break
                count[0] += 1
            s = int(rng.integers(0, len(dense) - rows))
            ins = [th.InferInput("dense", [rows, dense.shape[1]], "FP32")]
            ins[0].set_data_from_numpy(dense[s:s + rows])
            for j, f in enumerate(features):
                x = th.InferInput(f, [rows], "INT64")
                x.set_data_from_numpy(np.ascontiguousarray(ids[s:s + rows, j]))
                ins.append(x)
            t = time.perf_counter()
            try:
                r = c.infer(name, ins)
                assert r.as_numpy("score").shape == (rows,)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(str(e))
                continue
            mine.append(time.perf_counter() - t)
        with lock:
            lat.extend(mine)
        c.close()

    t0, c0 = time.perf_counter(), client_cpu_s()
    ts = [threading.Thread(target=worker, args=(k,)) for k in range(conc)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall, ccpu = time.perf_counter() - t0, client_cpu_s() - c0
    if errors:
        print(f"  {len(errors)} errors, first: {errors[0]}", file=sys.stderr)
    a = np.array(lat) * 1000
    return len(a) * rows / wall, float(np.percentile(a, 50)), float(np.percentile(a, 99)), len(a), ccpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--input", required=True, type=Path, help="raw lines (the rows sent, and predict's offline input)")
    ap.add_argument("--seconds", type=float, default=5.0, help="per cell, at most")
    ap.add_argument("--max-requests", type=int, default=20000, help="per cell, at most")
    ap.add_argument("--concurrency", default="1,8,64")
    ap.add_argument("--rows", default="1,64")
    ap.add_argument("--serve-args", default="", help="extra dlrmctl serve options, e.g. '--processes 2'")
    a = ap.parse_args()
    extra = shlex.split(a.serve_args)
    cpus = len(os.sched_getaffinity(0))
    dense, ids, features = inputs(a.model_dir, a.input)
    ceiling = offline_rows_per_s(a.model_dir, a.input)
    print(f"predict offline: {ceiling:,.0f} rows/s ({len(dense):,} rows of {a.input.name}); {cpus} CPUs; "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| batching | concurrency | rows/request | rows/s | % of predict | p50 ms | p99 ms | requests "
          "| client CPU ms/req | server CPU ms/req | bound rows/s (% of predict) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, args in (("dynamic (4096 rows / 2 ms)", ()), ("off (--max-batch-rows 1)", ("--max-batch-rows", "1"))):
        p, url, name = start(a.model_dir, *args, *extra)
        try:
            for rows in (int(x) for x in a.rows.split(",")):
                for conc in (int(x) for x in a.concurrency.split(",")):
                    s0 = process_cpu_s(p.pid)
                    rps, p50, p99, n, ccpu = load(url, name, dense, ids, features, rows, conc, a.seconds, a.max_requests)
                    scpu = process_cpu_s(p.pid) - s0
                    cm, sm = 1000 * ccpu / max(n, 1), 1000 * scpu / max(n, 1)
                    bound = cpus * 1000 / max(cm + sm, 1e-9) * rows
                    print(f"| {label} | {conc} | {rows} | {rps:,.0f} | {100 * rps / ceiling:.1f}% | {p50:.2f} | {p99:.2f} | {n:,} "
                          f"| {cm:.2f} | {sm:.2f} | {bound:,.0f} ({100 * bound / ceiling:.0f}%) |", flush=True)
        finally:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()
