"""Server CPU per `/infer` request of `dlrmctl serve`'s app, in-process (no HTTP, no socket).

JSON tensor requests (``dense`` FP32 ``[rows, 13]`` + one INT64 ``[rows]`` input per feature, the
common client's form) are driven straight through the ASGI app, ``concurrency`` at a time, with
the app's dynamic batcher running; the process's CPU time (``time.process_time``, which other
processes' load does not inflate) over ``n`` requests, three runs each, and ``decode_request`` on
its own.  What the HTTP layer adds is measured by ``scripts/bench_serve.py``.

    python scripts/bench_serve_request.py MODEL_DIR [--artifact pt2] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time


async def _request(app, body: bytes) -> int:
    """Status of one ``POST /v2/models/m/infer`` driven through the ASGI ``app``."""
    sent, chunks = [], [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return chunks.pop(0) if chunks else {"type": "http.disconnect"}

    async def send(msg):
        sent.append(msg)

    scope = {"type": "http", "method": "POST", "path": "/v2/models/m/infer",
             "headers": [(b"content-type", b"application/json")], "query_string": b"", "asgi": {"version": "3.0"},
             "http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 1), "client": ("127.0.0.1", 2),
             "root_path": ""}
    await app(scope, receive, send)
    return int(sent[0]["status"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--artifact", help="format to run (default: the fastest the directory holds)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--cells", default="1x1,1x64,64x1,64x64", help="rows x concurrency, comma separated")
    args = ap.parse_args(argv)

    import numpy as np
    import torch

    from dlrmctl.inference.export import load_exported
    from dlrmctl.inference.serve.app import build_app
    from dlrmctl.inference.serve.protocol import ModelSpec, decode_request

    torch.set_num_threads(args.threads)
    m = load_exported(args.model_dir, artifact=args.artifact)
    spec = ModelSpec.of(m, "m")
    g = np.random.default_rng(0)
    app = build_app(m, "m")
    loop = asyncio.new_event_loop()
    lifespan = app.api.router.lifespan_context(app.api)
    loop.run_until_complete(lifespan.__aenter__())
    print(f"{m.description}; torch {torch.__version__}, {args.threads} thread(s)")
    for cell in args.cells.split(","):
        rows, conc = (int(x) for x in cell.split("x"))
        inputs = [{"name": "dense", "datatype": "FP32", "shape": [rows, m.num_dense],
                   "data": g.random(rows * m.num_dense).round(3).tolist()}]
        limits = {t["name"]: int(t["num_embeddings"]) for t in m.manifest["tables"]}
        for lk in m.manifest["lookups"]:
            inputs.append({"name": lk["feature"], "datatype": "INT64", "shape": [rows],
                           "data": g.integers(0, limits[lk["table"]], rows).tolist()})
        body = json.dumps({"inputs": inputs, "outputs": [{"name": "score"}]}).encode()

        async def burst(n: int) -> None:
            for _ in range(n // conc):
                codes = await asyncio.gather(*[_request(app, body) for _ in range(conc)])
                if any(c != 200 for c in codes):
                    raise SystemExit(f"a request failed: {codes}")

        loop.run_until_complete(burst(2 * conc))
        n = 640 if rows == 1 else 256
        runs = []
        for _ in range(3):
            t = time.process_time()
            loop.run_until_complete(burst(n))
            runs.append((time.process_time() - t) / n * 1e3)
        dec = []
        for _ in range(5):
            t = time.process_time()
            for _ in range(200):
                decode_request(body, None, spec, None)
            dec.append((time.process_time() - t) / 200 * 1e3)
        print(f"rows {rows} concurrency {conc}: server CPU {statistics.median(runs):.3f} ms/request "
              f"(3 runs {min(runs):.3f}-{max(runs):.3f}); decode_request {statistics.median(dec):.3f} ms "
              f"({len(body):,} bytes)", flush=True)
    loop.run_until_complete(lifespan.__aexit__(None, None, None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
