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

Last, the floor of 1-row requests here: the same client at the highest concurrency against a *free*
server (uvicorn on ``dlrmctl serve``'s HTTP stack answering a canned 1-row response, no model), whose
client CPU per request bounds what any server can reach with this client on this machine.

Side by side with the reference server (``--versus-kserve``)::

    python scripts/bench_serve.py MODEL_DIR --input RAW.tsv --versus-kserve [--seconds 8] [--rounds 2]

``dlrmctl serve`` (its defaults) and KServe's own Python ``ModelServer`` (``scripts/kserve_peer.py``)
serve the same ``model.pt2`` with the same work per request (JSON tensors ``dense`` ``[B, D]`` + one
INT64 ``[B]`` tensor per feature -> the program -> ``score``), checked first to answer equal scores.
The load is ``wrk`` (C, one thread, ``--wrk``; Debian's ``apt-get install wrk``) with a Lua script
cycling through 32 different request bodies, for ``--seconds`` a cell at rows/request 1 and 64 x
concurrency 1 and 64.  Each of ``--rounds`` rounds starts both servers afresh and keeps them up side
by side; every cell runs on one server and at once on the other, which goes first alternating by
cell and by round, so a cell's two figures are taken seconds apart under the same load from other
jobs (the ratio column pairs them round by round).  Both listen on 127.0.0.1 only and get
``--threads`` (1) intra-op threads.  KServe runs in its own virtual environment (``--kserve-venv``,
default ``.venv-kserve``, git-ignored), created on first use with ``python -m venv`` and ``pip
install kserve==0.21.0 torch==<this torch's version>`` (KServe pins its own FastAPI, uvicorn,
pydantic...; the same torch loads the same program); nothing is downloaded once it exists.  Prints
the date, CPU model and ``uptime`` at start and end, then a Markdown table: rows/s of each server (the
range over the rounds), the ratio, p50 and p99 latency, each server's CPU per request (``/proc``),
the 1-minute load average before and after a cell and the CPUs other jobs kept busy during it
(``/proc/stat`` less the server's and wrk's own CPU time).
"""

import argparse
import json
import os
import re
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from bench_machine import cpu_model, uptime  # scripts/ is sys.path[0]

REPO = Path(__file__).resolve().parents[1]


def offline_rows_per_s(model_dir: str, raw: Path, repeats: int = 3) -> tuple[float, float]:
    """``dlrmctl predict``'s scoring loop (transform + forward, 65,536-row batches): ``(rows/s, CPU µs
    per row)``, each the best of ``repeats`` (the CPU time of every thread of this process)."""
    from dlrmctl.inference.export import load_exported
    from dlrmctl.inference.predict import iter_scores

    m = load_exported(model_dir)
    best, cpu = 0.0, float("inf")
    for _ in range(repeats):
        t, c = time.perf_counter(), client_cpu_s()
        n = sum(len(s) for s, _ in iter_scores(m, raw))
        best, cpu = max(best, n / (time.perf_counter() - t)), min(cpu, 1e6 * (client_cpu_s() - c) / n)
    return best, cpu


def inputs(model_dir: str, raw: Path):
    from dlrmctl.inference.export import load_exported
    from dlrmctl.inference.predict import raw_transformer

    m = load_exported(model_dir)
    tr, cols = raw_transformer(m)
    (dense, ids, _), = list(tr.file(raw, 1 << 22))
    return dense, ids[:, [cols.index(f) for f in m.feature_names]], m.feature_names


def canned_server() -> None:
    """A free server: uvicorn on ``dlrmctl serve``'s HTTP stack and socket answering every request
    with a canned 1-row infer response (binary outputs), no model; SIGTERM stops it."""
    import json

    import uvicorn

    from dlrmctl.inference.serve.processes import bind, http_stack

    head = json.dumps({"model_name": "canned", "model_version": "1", "outputs": [
        {"name": o, "datatype": "FP32", "shape": [1], "parameters": {"binary_data_size": 4}} for o in ("score", "logit")]},
        separators=(",", ":")).encode()
    body = head + np.zeros(2, np.float32).tobytes()
    answer = [(b"content-type", b"application/octet-stream"), (b"content-length", str(len(body)).encode()),
              (b"inference-header-content-length", str(len(head)).encode())]

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                m = await receive()
                await send({"type": m["type"] + ".complete"})
                if m["type"] == "lifespan.shutdown":
                    return
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": answer})
        await send({"type": "http.response.body", "body": body})

    sock = bind("127.0.0.1", 0)
    http, loop = http_stack()
    print(f"serving a canned answer at http://127.0.0.1:{sock.getsockname()[1]}/v2/models/canned (HTTP {http} on {loop})",
          flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", http=http, loop=loop, lifespan="on")).run(sockets=[sock])


def start(model_dir: str, *args: str, cmd: list[str] | None = None):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = cmd or [sys.executable, "-m", "dlrmctl.cli", "serve", model_dir, "--host", "127.0.0.1", "--port", "0", *args]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
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


def stop(p: subprocess.Popen) -> None:
    """SIGTERM a server started by :func:`start` (it drains), killed if it has not exited within 60 s."""
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(60)
    except subprocess.TimeoutExpired:
        p.kill()


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


# ---------------------------------------------------------------- side by side with KServe, loaded by wrk
KSERVE_VERSION = "0.21.0"


def ensure_kserve_venv(venv: str) -> str:
    """Create ``venv`` with ``kserve`` and this process's torch version if it lacks them; return its python.

    Raises:
        SystemExit(2): a step failed (named, with the tail of its output), or ``import kserve, torch``
            fails in the venv afterwards.
    """
    from importlib.metadata import version

    venv = os.path.abspath(venv)
    py = os.path.join(venv, "bin", "python")

    def ok() -> bool:
        return os.path.exists(py) and subprocess.run([py, "-c", "import kserve, torch"], capture_output=True,
                                                     cwd="/").returncode == 0

    if ok():
        return py
    steps = [] if os.path.exists(py) else [[sys.executable, "-m", "venv", venv]]
    steps.append([py, "-m", "pip", "install", f"kserve=={KSERVE_VERSION}", f"torch=={version('torch').split('+')[0]}"])
    for cmd in steps:
        print(f"[bench_serve] {' '.join(cmd)}", file=sys.stderr, flush=True)
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"bench_serve: cannot create the KServe venv {venv!r}: `{' '.join(cmd)}` exited "
                             f"{p.returncode}:\n{(p.stdout + p.stderr)[-3000:]}")
    if not ok():
        raise SystemExit(f"bench_serve: the venv {venv!r} was created but `import kserve, torch` fails in it")
    return py


def json_bodies(dense, ids, features, rows: int, count: int = 32) -> list[bytes]:
    """``count`` infer bodies of ``rows`` consecutive rows each (JSON tensors, the ``score`` output asked)."""
    out = []
    for k in range(count):
        s = (k * rows) % (len(dense) - rows)
        ins = [{"name": "dense", "datatype": "FP32", "shape": [rows, int(dense.shape[1])],
                "data": dense[s:s + rows].reshape(-1).tolist()}]
        ins += [{"name": f, "datatype": "INT64", "shape": [rows], "data": ids[s:s + rows, j].tolist()}
                for j, f in enumerate(features)]
        out.append(json.dumps({"inputs": ins, "outputs": [{"name": "score"}]}, separators=(",", ":")).encode())
    return out


def post_scores(url: str, name: str, body: bytes) -> np.ndarray:
    req = urllib.request.Request(f"http://{url}/v2/models/{name}/infer", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        out = json.loads(r.read())
    return np.array(next(o for o in out["outputs"] if o["name"] == "score")["data"], np.float64)


WRK_LUA = """
bodies = {%s}
local i = 0
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
request = function()
  i = i %% #bodies + 1
  return wrk.format(nil, "%s", nil, bodies[i])
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("RESULT %%d %%d %%d %%d %%d %%d\\n", summary.requests, summary.duration,
    latency:percentile(50), latency:percentile(99), e.status, e.connect + e.read + e.write + e.timeout))
end
"""


def wrk_cell(wrk: str, url: str, path: str, bodies: list[bytes], conc: int, seconds: float) -> dict:
    """``wrk -t1 -c{conc}`` posting ``bodies`` in turn to ``url + path`` for ``seconds``:
    requests, rows/s (by the caller), p50 / p99 ms, non-2xx answers and socket errors."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(WRK_LUA % (",".join(f"[==[{b.decode()}]==]" for b in bodies), path))
    try:
        p = subprocess.run([wrk, "-t1", f"-c{conc}", f"-d{max(1, round(seconds))}s", "--timeout", "30s", "-s", f.name,
                            f"http://{url}"], capture_output=True, text=True, timeout=seconds + 120)
    finally:
        os.unlink(f.name)
    m = re.search(r"RESULT (\d+) (\d+) (\d+) (\d+) (\d+) (\d+)", p.stdout)
    if p.returncode != 0 or not m:
        raise SystemExit(f"bench_serve: wrk failed ({p.returncode}): {(p.stdout + p.stderr)[-2000:]}")
    n, us, p50, p99, bad, sock = (int(x) for x in m.groups())
    return {"requests": n, "seconds": us / 1e6, "p50": p50 / 1000, "p99": p99 / 1000, "non_2xx": bad, "socket_errors": sock}


def busy_cpu_s() -> float:
    """CPU seconds every CPU of the machine has spent busy so far (``/proc/stat``: all but idle and iowait)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")  # user..steal; guest is inside user


def children_cpu_s() -> float:
    """CPU seconds of this process's waited-for children (wrk, once it has exited)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_cell(wrk: str, pid: int, url: str, path: str, bodies: list[bytes], rows: int, conc: int,
                 seconds: float) -> dict:
    """One :func:`wrk_cell` against the server process ``pid``, with rows/s, the server's CPU ms per
    request (``/proc``), the 1-minute load average before and after, and ``others``: the CPUs that
    other jobs kept busy during the cell (the machine's busy time less the server's and wrk's)."""
    s0, l0, b0, w0, t0 = process_cpu_s(pid), os.getloadavg()[0], busy_cpu_s(), children_cpu_s(), time.monotonic()
    cell = wrk_cell(wrk, url, path, bodies, conc, seconds)
    scpu = process_cpu_s(pid) - s0
    cell["others"] = max(0.0, busy_cpu_s() - b0 - scpu - (children_cpu_s() - w0)) / (time.monotonic() - t0)
    cell["server_cpu_ms"] = 1000 * scpu / max(cell["requests"], 1)
    cell["rows_s"] = cell["requests"] * rows / cell["seconds"]
    cell["load"] = (l0, os.getloadavg()[0])
    return cell


def versus_kserve(a: argparse.Namespace) -> None:
    """The side-by-side table (module doc)."""
    wrk = shutil.which(a.wrk) or a.wrk
    if not os.path.exists(wrk):
        raise SystemExit(f"bench_serve: {a.wrk!r} not found: install wrk (Debian: apt-get install wrk) or pass --wrk PATH")
    kpy = ensure_kserve_venv(a.kserve_venv)
    dense, ids, features = inputs(a.model_dir, a.input)
    rows_list = [int(x) for x in a.rows.split(",")]
    concs = [int(x) for x in a.concurrency.split(",")]
    bodies = {r: json_bodies(dense, ids, features, r) for r in rows_list}
    peers = {"dlrmctl": lambda: start(a.model_dir, *shlex.split(a.serve_args)),
             "KServe": lambda: start(a.model_dir, cmd=[kpy, str(Path(__file__).resolve().parent / "kserve_peer.py"),
                                                       a.model_dir, str(free_port()), "kserve_peer"])}
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # both servers' intra-op threads
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; {cpu_model()}; uptime at start: {uptime()}; "
          f"wrk {wrk}; KServe {KSERVE_VERSION} in {kpy}; {a.threads} intra-op thread(s) each", flush=True)
    res: dict = {}
    want: dict = {}
    for rnd in range(a.rounds):
        # both servers started afresh each round and left up side by side (an idle one costs no CPU); each cell
        # runs on one then at once on the other, the first alternating by cell and round, so the two figures of
        # a cell are measured seconds apart under the same load from other jobs
        up: dict = {}
        try:
            for who in peers:
                up[who] = peers[who]()
            for r in rows_list:  # same scores from both servers (the same work), then the load
                for who, (p, url, name) in up.items():
                    got = post_scores(url, name, bodies[r][0])
                    ref = want.setdefault(r, got)
                    if got.shape != (r,) or not np.allclose(got, ref, atol=1e-5, rtol=0):
                        raise SystemExit(f"bench_serve: {who} scores differ from the other server's: {got[:4]} vs {ref[:4]}")
            k = 0
            for r in rows_list:
                for c in concs:
                    order = list(up) if (k + rnd) % 2 == 0 else list(up)[::-1]
                    k += 1
                    for who in order:
                        p, url, name = up[who]
                        cell = measure_cell(wrk, p.pid, url, f"/v2/models/{name}/infer", bodies[r], r, c, a.seconds)
                        res.setdefault((who, r, c), []).append(cell)
                        print(f"  round {rnd + 1} {who}: {r} rows x concurrency {c}: {cell['rows_s']:,.0f} rows/s, "
                              f"p50 {cell['p50']:.2f} ms, {cell['non_2xx']} non-2xx, {cell['socket_errors']} socket errors; "
                              f"load average {cell['load'][0]:.2f} -> {cell['load'][1]:.2f}, other jobs "
                              f"{cell['others']:.2f} CPUs", file=sys.stderr, flush=True)
        finally:
            for p, _, _ in up.values():
                stop(p)
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; uptime at end: {uptime()}")

    def rng(v: list[float], fmt: str) -> str:
        lo, hi = min(v), max(v)
        return format(lo, fmt) if f"{lo:{fmt}}" == f"{hi:{fmt}}" else f"{lo:{fmt}}–{hi:{fmt}}"

    print("| rows / request | concurrency | dlrmctl rows/s | KServe rows/s | ratio | p50 ms dlrmctl / KServe "
          "| p99 ms dlrmctl / KServe | server CPU ms/req dlrmctl / KServe | non-2xx + socket errors "
          "| 1-min load average before -> after a cell | other jobs' CPUs during a cell |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows_list:
        for c in concs:
            d, k = res[("dlrmctl", r, c)], res[("KServe", r, c)]
            ratio = [x["rows_s"] / max(y["rows_s"], 1e-9) for x, y in zip(d, k)]
            errs = sum(x["non_2xx"] + x["socket_errors"] for x in d + k)
            print(f"| {r} | {c} | {rng([x['rows_s'] for x in d], ',.0f')} | {rng([x['rows_s'] for x in k], ',.0f')} "
                  f"| {rng(ratio, '.2f')}× | {rng([x['p50'] for x in d], '.2f')} / {rng([x['p50'] for x in k], '.2f')} "
                  f"| {rng([x['p99'] for x in d], '.1f')} / {rng([x['p99'] for x in k], '.1f')} "
                  f"| {rng([x['server_cpu_ms'] for x in d], '.2f')} / {rng([x['server_cpu_ms'] for x in k], '.2f')} | {errs} "
                  f"| {rng([x['load'][0] for x in d + k], '.1f')} -> {rng([x['load'][1] for x in d + k], '.1f')} "
                  f"| {rng([x['others'] for x in d + k], '.2f')} |")


def main() -> None:
    if sys.argv[1:] == ["--canned-server"]:
        canned_server()
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--input", required=True, type=Path, help="raw lines (the rows sent, and predict's offline input)")
    ap.add_argument("--seconds", type=float, default=5.0, help="per cell, at most")
    ap.add_argument("--max-requests", type=int, default=20000, help="per cell, at most")
    ap.add_argument("--concurrency", default="1,8,64")
    ap.add_argument("--rows", default="1,64")
    ap.add_argument("--serve-args", default="", help="extra dlrmctl serve options, e.g. '--processes 2'")
    ap.add_argument("--skip-floor", action="store_true", help="no free-server cell at the end")
    ap.add_argument("--versus-kserve", action="store_true", help="side by side with KServe's ModelServer, loaded by wrk "
                    "(concurrency default 1,64)")
    ap.add_argument("--rounds", type=int, default=2, help="--versus-kserve: each server's runs, alternated")
    ap.add_argument("--kserve-venv", default=str(REPO / ".venv-kserve"), help="KServe's venv (created if missing)")
    ap.add_argument("--wrk", default="wrk", help="the wrk executable")
    ap.add_argument("--threads", type=int, default=1, help="--versus-kserve: intra-op threads of each server (OMP_NUM_THREADS)")
    a = ap.parse_args()
    if a.versus_kserve:
        if a.concurrency == "1,8,64":
            a.concurrency = "1,64"
        versus_kserve(a)
        return
    extra = shlex.split(a.serve_args)
    cpus = len(os.sched_getaffinity(0))
    dense, ids, features = inputs(a.model_dir, a.input)
    ceiling, per_row = offline_rows_per_s(a.model_dir, a.input)
    print(f"predict offline: {ceiling:,.0f} rows/s, {per_row:.1f} µs CPU per row ({len(dense):,} rows of "
          f"{a.input.name}); {cpus} CPUs; load average {os.getloadavg()[0]:.1f}")
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
            stop(p)
    if a.skip_floor:
        return
    conc = max(int(x) for x in a.concurrency.split(","))
    p, url, name = start(a.model_dir, cmd=[sys.executable, str(Path(__file__).resolve()), "--canned-server"])
    try:
        s0 = process_cpu_s(p.pid)
        rps, p50, p99, n, ccpu = load(url, name, dense, ids, features, 1, conc, a.seconds, a.max_requests)
        cm, sm = 1000 * ccpu / max(n, 1), 1000 * (process_cpu_s(p.pid) - s0) / max(n, 1)
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(60)
    print(f"free server (canned 1-row answer, no model), concurrency {conc}, 1 row/request: {rps:,.0f} rows/s, "
          f"p50 {p50:.2f} ms; client CPU {cm:.2f} ms/req, server CPU {sm:.2f} ms/req; bound with any server: "
          f"{cpus} CPUs / client CPU = {cpus * 1000 / cm:,.0f} rows/s ({100 * cpus * 1000 / cm / ceiling:.0f}% of predict), "
          f"one client process (its GIL): {1000 / cm:,.0f} rows/s ({100 * 1000 / cm / ceiling:.0f}%); per CPU-second, "
          f"1-row requests (client + free server) score {1000 / (cm + sm):,.0f} rows, predict {1e6 / per_row:,.0f} "
          f"({100 * per_row / 1000 / (cm + sm):.1f}%)")


if __name__ == "__main__":
    main()
