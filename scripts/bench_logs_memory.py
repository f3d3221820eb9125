#!/usr/bin/env python
"""Peak memory of ``dlrmctl preprocess logs`` against the number of rows.

For each ``--rows N`` a click log of N rows is generated in ``--workdir`` (CSV with a header:
``click`` 0/1, ``ts`` a time, ``price`` (10 % empty) and ``age`` dense, ``user`` a string with
Zipf(1.2) ids over 100,000 values, ``site`` an integer with Zipf(1.3) ids, ``tags`` a
``"|"``-delimited bag of 0-2 values; about 36 bytes a row), preprocessed with the schema below
(one worker, ``--val-ratio 0.1``) while the peak RSS of its process tree is sampled every 0.1 s
from ``/proc/<pid>/status`` (anonymous and file-backed apart), and deleted with its output.
``--copies 2`` gives the same file twice (two inputs) for ``2 N`` rows.

    python scripts/bench_logs_memory.py --rows 1000000 10000000 --workdir /tmp/logs_mem

Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

SCHEMA = """name: bench
label: click
time: ts
dense:
  - {name: price, transform: log1p, fill: 0}
  - {name: age, transform: standardize}
categorical:
  - {name: user, vocab: {min_count: 2}}
  - {name: site, hash: 100000}
  - {name: tags, hash: 10000, multi: {delimiter: "|", max_len: 2}}
"""


def generate(n: int, out: Path, seed: int = 0) -> None:
    """``n`` rows of the log above into ``out``, written 1M rows at a time."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.csv as pcsv

    rng = np.random.default_rng(seed)
    with open(out, "wb") as f:
        for s in range(0, n, 1_000_000):
            m = min(1_000_000, n - s)
            user = rng.zipf(1.2, m) % 100_000
            site = rng.zipf(1.3, m) % 1_000_000
            k = rng.integers(0, 4, m)
            tagv = rng.integers(0, 5000, (m, 3)).astype(str)  # (the third column unused)
            tags = np.where(k == 0, "", np.char.add(np.char.add("t", tagv[:, 0]),
                                                    np.where(k > 1, np.char.add("|t", tagv[:, 1]), "")))
            price = np.round(rng.gamma(2.0, 20.0, m), 2).astype(str)
            price[rng.random(m) < 0.1] = ""
            t = pa.table({"click": (rng.random(m) < 0.2).astype(np.int8), "ts": 1_700_000_000 + s + np.arange(m),
                          "price": pa.array(price), "age": rng.integers(18, 80, m),
                          "user": pa.array(np.char.add("u", user.astype(str))), "site": site,
                          "tags": pa.array(tags)})
            buf = pa.BufferOutputStream()
            pcsv.write_csv(t, buf, pcsv.WriteOptions(include_header=s == 0, quoting_style="none"))
            f.write(buf.getvalue().to_pybytes())


def _tree(pid: int) -> list[int]:
    out = [pid]
    try:
        for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            out += _tree(int(c))
    except OSError:
        pass
    return out


def peak_rss(cmd: list[str]) -> tuple[dict[str, int], float, int]:
    """Run ``cmd``: ``({VmRSS, RssAnon, RssFile: peak MiB of its largest process}, seconds, exit code)``."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd)
    peak = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
    while p.poll() is None:
        for pid in _tree(p.pid):
            try:
                st = dict(ln.split(":", 1) for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in ln)
            except OSError:
                continue
            for k in peak:
                peak[k] = max(peak[k], int(st.get(k, "0 kB").split()[0]) // 1024)
        time.sleep(0.1)
    return peak, time.perf_counter() - t0, p.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--copies", type=int, default=1, help="inputs: the generated file this many times")
    ap.add_argument("--workdir", required=True, help="where the log and the output are made (then deleted)")
    a = ap.parse_args()
    wd = Path(a.workdir)
    wd.mkdir(parents=True, exist_ok=True)
    (wd / "schema.yaml").write_text(SCHEMA)
    for n in a.rows:
        logs = [wd / f"log_{n}_{i}.csv" for i in range(a.copies)]
        generate(n, logs[0])
        for extra in logs[1:]:
            shutil.copyfile(logs[0], extra)
        out = wd / f"out_{n}"
        shutil.rmtree(out, ignore_errors=True)
        cmd = [sys.executable, "-m", "dlrmctl.cli", "preprocess", "logs", "--schema", str(wd / "schema.yaml"),
               "--out", str(out), "--val-ratio", "0.1", "-q"]
        for f in logs:
            cmd += ["--input", str(f)]
        load = Path("/proc/loadavg").read_text().split()[:3]
        peak, secs, rc = peak_rss(cmd)
        print(f"rows {n * a.copies:,} ({a.copies} input(s), {sum(f.stat().st_size for f in logs) / 1e6:,.0f} MB): "
              f"peak RSS {peak['VmRSS']} MiB (anonymous {peak['RssAnon']}, file {peak['RssFile']}), {secs:.0f} s, "
              f"exit {rc}, load {' '.join(load)}", flush=True)
        shutil.rmtree(out, ignore_errors=True)
        for f in logs:
            f.unlink()


if __name__ == "__main__":
    main()
