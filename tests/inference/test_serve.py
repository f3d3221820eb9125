"""`dlrmctl serve`: the exported model behind the Open Inference Protocol, checked with an
independent client (tritonclient HTTP) against `dlrmctl predict`, bad inputs, a full queue, dynamic
batching and a drain on SIGTERM.  Every server is a `dlrmctl serve --port 0` subprocess on 127.0.0.1,
stopped by the test."""

import csv
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import numpy as np
import pytest
import yaml

from dlrmctl import HAS_FBGEMM

from tests.conftest import CRITEO_10K, REPO, SHARED_DATA, require_shared

pytestmark = [pytest.mark.skipif(not HAS_FBGEMM, reason="export needs fbgemm_gpu"), pytest.mark.slow]
th = pytest.importorskip("tritonclient.http", reason="the serve tests need the serve/test extras (tritonclient)")
pytest.importorskip("fastapi")

RAW100 = SHARED_DATA / "criteo" / "criteo_kaggle_sample_100.tsv"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """An int8 export (what `dlrmctl export` writes by default) of a run trained on the 100-line sample."""
    require_shared(RAW100)
    from typer.testing import CliRunner

    from dlrmctl.cli import app
    from dlrmctl.data.criteo.parse import CriteoOptions
    from dlrmctl.data.criteo.preprocess import preprocess_criteo

    root = tmp_path_factory.mktemp("serve")
    preprocess_criteo(RAW100, root / "data", CriteoOptions(frequency_threshold=2, val_ratio=0.3), progress=False)
    cfg = {"name": "tiny", "data": {"path": str(root / "data"), "batch_size": 16, "eval_batch_size": 64, "prefetch": 0},
           "model": {"embedding_dim": 8, "dense_arch_layer_sizes": [16, 8], "over_arch_layer_sizes": [16, 1]},
           "train": {"epochs": 1, "run_dir": str(root / "runs"), "progress": False, "pipeline": "none", "device": "cpu"}}
    (root / "tiny.yaml").write_text(yaml.safe_dump(cfg))
    r = CliRunner().invoke(app, ["train", str(root / "tiny.yaml")])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["export", str(root / "runs" / "tiny"), "--int8", "--out", str(root / "m")])
    assert r.exit_code == 0, r.output
    return root / "m"


@contextmanager
def server(model_dir, *args):
    """`dlrmctl serve MODEL_DIR --port 0 ARGS` -> (url, process); always stopped (SIGTERM, then kill)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "-m", "dlrmctl.cli", "serve", str(model_dir), "--port", "0", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = p.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        assert m, line + p.stderr.read()
        url = f"127.0.0.1:{m.group(1)}"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://{url}/v2/health/ready", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert time.monotonic() < deadline and p.poll() is None, "server did not become ready"
            time.sleep(0.1)
        yield url, p
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        p.stdout.close()
        p.stderr.close()


def _post(url, body: dict, path="/v2/models/tiny/infer"):
    """(status, JSON body, headers) of a POST with the standard library."""
    req = urllib.request.Request(f"http://{url}{path}", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read()), r.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers


def _metric(url, name):
    text = urllib.request.urlopen(f"http://{url}/metrics", timeout=10).read().decode()
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line.startswith(name)}


def _tensor_inputs(dense, ids, features, binary=True):
    ins = [th.InferInput("dense", list(dense.shape), "FP32")]
    ins[0].set_data_from_numpy(dense, binary_data=binary)
    for j, f in enumerate(features):
        x = th.InferInput(f, [ids.shape[0]], "INT64")
        x.set_data_from_numpy(np.ascontiguousarray(ids[:, j]), binary_data=binary)
        ins.append(x)
    return ins


def _raw_input(lines, binary=True):
    x = th.InferInput("raw", [len(lines)], "BYTES")
    x.set_data_from_numpy(np.array(lines, dtype=np.object_), binary_data=binary)
    return x


def _predict(model_dir, lines_file, tmp_path):
    from typer.testing import CliRunner

    from dlrmctl.cli import app

    r = CliRunner().invoke(app, ["predict", str(model_dir), "--input", str(lines_file), "--output", str(tmp_path / "p.csv")])
    assert r.exit_code == 0, r.output
    with open(tmp_path / "p.csv") as f:
        return np.array([float(row["score"]) for row in csv.DictReader(f)])


def _model_inputs(model_dir, lines_file):
    """(dense [n, 13] float32, ids [n, 26] int64 in the model's feature order) through predict's transform."""
    from dlrmctl.inference.export import load_exported
    from dlrmctl.inference.predict import raw_transformer

    m = load_exported(model_dir)
    tr, cols = raw_transformer(m)
    (dense, ids, _), = list(tr.file(lines_file, 1 << 20))
    return dense, ids[:, [cols.index(f) for f in m.feature_names]], m.feature_names


def test_serve_scores_1000_rows_like_predict_bad_inputs_and_batching(model, tmp_path):
    require_shared(CRITEO_10K)
    lines_file = tmp_path / "rows.tsv"
    lines = CRITEO_10K.read_bytes().splitlines()[:1000]
    lines_file.write_bytes(b"\n".join(lines) + b"\n")
    want = _predict(model, lines_file, tmp_path)
    dense, ids, features = _model_inputs(model, lines_file)
    assert len(want) == 1000
    with server(model, "--max-delay-ms", "50") as (url, _):
        c = th.InferenceServerClient(url, concurrency=64, network_timeout=60)
        assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("tiny")
        meta = c.get_model_metadata("tiny")
        names = {i["name"]: (i["datatype"], i["shape"]) for i in meta["inputs"]}
        assert names["dense"] == ("FP32", [-1, 13]) and names["C1"] == ("INT64", [-1]) and names["raw"][0] == "BYTES"
        # 1,000 rows as the model's tensors (binary extension) and as raw lines (JSON), 100 rows a request
        got_t, got_r = [], []
        for s in range(0, 1000, 100):
            got_t.append(c.infer("tiny", _tensor_inputs(dense[s:s + 100], ids[s:s + 100], features)).as_numpy("score"))
            got_r.append(c.infer("tiny", [_raw_input(lines[s:s + 100], binary=False)]).as_numpy("score"))
        np.testing.assert_allclose(np.concatenate(got_t), want, atol=1e-6, rtol=0)
        np.testing.assert_allclose(np.concatenate(got_r), want, atol=1e-6, rtol=0)

        # dynamic batching: 64 concurrent single-row requests, each answered with its own row
        before = _metric(url, "dlrmctl_serve_batch_rows")
        reqs = [c.async_infer("tiny", _tensor_inputs(dense[i:i + 1], ids[i:i + 1], features)) for i in range(64)]
        got = np.array([float(r.get_result().as_numpy("score")[0]) for r in reqs])
        np.testing.assert_allclose(got, want[:64], atol=1e-6, rtol=0)
        after = _metric(url, "dlrmctl_serve_batch_rows")
        batches = after["dlrmctl_serve_batch_rows_count"] - before["dlrmctl_serve_batch_rows_count"]
        rows = after["dlrmctl_serve_batch_rows_sum"] - before["dlrmctl_serve_batch_rows_sum"]
        assert rows == 64 and batches < 64, (rows, batches)  # some forward merged > 1 request
        assert after['dlrmctl_serve_batch_rows_bucket{le="1.0"}'] - before['dlrmctl_serve_batch_rows_bucket{le="1.0"}'] < batches

        # every bad-input class: 400, one line naming the input; the server keeps serving
        one = {"name": "dense", "datatype": "FP32", "shape": [1, 13], "data": dense[0].tolist()}
        ids1 = [{"name": f, "datatype": "INT64", "shape": [1], "data": [int(ids[0, j])]} for j, f in enumerate(features)]
        cases = {
            "malformed": (b"{not json", "not JSON"),
            "wrong dtype": ({"inputs": [dict(one, datatype="FP64")] + ids1}, "input 'dense': datatype must be FP32, got FP64"),
            "wrong shape": ({"inputs": [dict(one, shape=[1, 12], data=dense[0, :12].tolist())] + ids1},
                            "input 'dense': shape must be [B >= 1, 13], got [1, 12]"),
            "data/shape mismatch": ({"inputs": [dict(one, shape=[2, 13])] + ids1}, "input 'dense': 13 values for shape [2, 13]"),
            "unknown feature": ({"inputs": [one] + ids1 + [{"name": "C99", "datatype": "INT64", "shape": [1], "data": [0]}]},
                                "input 'C99' is not an input of model tiny"),
            "missing feature": ({"inputs": [one] + ids1[1:]}, "input 'C1' (INT64 ids, [N]) is missing"),
            "out-of-range id": ({"inputs": [one] + ids1[:2] + [dict(ids1[2], data=[10 ** 9])] + ids1[3:]},
                                f"input '{features[2]}': id 1000000000 at position 0 is outside the table's"),
            "ids/lengths mismatch": ({"inputs": [one] + ids1 + [{"name": "C1.lengths", "datatype": "INT64", "shape": [1], "data": [2]}]},
                                     "input 'C1': 1 ids but 'C1.lengths' sums to 2"),
            "bad raw line": ({"inputs": [{"name": "raw", "datatype": "BYTES", "shape": [2],
                                          "data": [lines[0].decode(), lines[1].decode().replace("\t", "\tx", 1)]}]},
                             "input 'raw' element 1: field I1: expected an integer"),
            "raw with tensors": ({"inputs": [one, {"name": "raw", "datatype": "BYTES", "shape": [1], "data": [lines[0].decode()]}]},
                                 "input 'raw' (raw lines) replaces every other input"),
        }
        for what, (body, msg) in cases.items():
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            req = urllib.request.Request(f"http://{url}/v2/models/tiny/infer", data=data, method="POST")
            with pytest.raises(urllib.error.HTTPError) as ei:
                urllib.request.urlopen(req, timeout=30)
            err = json.loads(ei.value.read())["error"]
            assert ei.value.code == 400 and msg in err and "\n" not in err, (what, err)
        # the out-of-range id through the independent client too, then a good request still scores
        bad = ids[:1].copy()
        bad[0, 5] = -1
        with pytest.raises(th.InferenceServerException, match=rf"input '{features[5]}': id -1 at position 0"):
            c.infer("tiny", _tensor_inputs(dense[:1], bad, features))
        assert float(c.infer("tiny", _tensor_inputs(dense[:1], ids[:1], features)).as_numpy("score")[0]) == pytest.approx(want[0], abs=1e-6)
        m = _metric(url, "dlrmctl_serve_errors_total")
        assert m['dlrmctl_serve_errors_total{reason="bad_request"}'] == len(cases) + 1
        assert _post(url, {"inputs": [one]}, "/v2/models/other/infer")[0] == 404
        c.close()


def test_full_queue_is_503_with_a_retry_hint(model):
    row = {"name": "raw", "datatype": "BYTES", "shape": [64], "data": [RAW100.read_text().splitlines()[0]] * 64}
    with server(model, "--max-queue-rows", "64", "--max-delay-ms", "3000") as (url, _):
        first: dict = {}
        t = threading.Thread(target=lambda: first.update(r=_post(url, {"inputs": [row]})))
        t.start()
        deadline = time.monotonic() + 30
        while _metric(url, "dlrmctl_serve_queue_rows").get("dlrmctl_serve_queue_rows") != 64:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        code, body, headers = _post(url, {"inputs": [dict(row, shape=[1], data=row["data"][:1])]})
        assert code == 503 and headers["Retry-After"] == "1"
        assert "the queue is full (64 of 64 rows waiting, --max-queue-rows); retry after 1 s" == body["error"]
        # a request that can never fit is a 400 naming the limit, not a 503 forever
        code, body, _ = _post(url, {"inputs": [dict(row, shape=[65], data=(row["data"] * 2)[:65])]})
        assert code == 400 and "65 rows, more than the queue holds (--max-queue-rows 64)" in body["error"]
        t.join(30)
        assert first["r"][0] == 200 and len(first["r"][1]["outputs"][0]["data"]) == 64
        assert _metric(url, "dlrmctl_serve_errors_total")['dlrmctl_serve_errors_total{reason="queue_full"}'] == 1


def test_sigterm_drains_requests_in_flight(model):
    lines = RAW100.read_text().splitlines()
    from dlrmctl.inference.export import load_exported

    with server(model, "--max-delay-ms", "1500") as (url, p):
        out: list = [None] * 8

        def send(i):
            out[i] = _post(url, {"inputs": [{"name": "raw", "datatype": "BYTES", "shape": [4], "data": lines[4 * i:4 * i + 4]}]})

        ts = [threading.Thread(target=send, args=(i,)) for i in range(8)]
        for t in ts:
            t.start()
        deadline = time.monotonic() + 30
        while _metric(url, "dlrmctl_serve_queue_rows").get("dlrmctl_serve_queue_rows") != 32:  # all 8 queued
            assert time.monotonic() < deadline
            time.sleep(0.02)
        p.send_signal(signal.SIGTERM)
        for t in ts:
            t.join(30)
        assert p.wait(30) == 0
        assert "stopped (SIGTERM): every request received was answered" in p.stdout.read()
    assert [o[0] for o in out] == [200] * 8  # none lost
    tr_scores = np.concatenate([o[1]["outputs"][0]["data"] for o in out])
    assert tr_scores.shape == (32,) and ((tr_scores > 0) & (tr_scores < 1)).all()
    assert load_exported(model).manifest["sparse_features"]  # the artifact is untouched


def test_serve_cli_errors(model, tmp_path):
    from typer.testing import CliRunner

    from dlrmctl.cli import app

    r = CliRunner().invoke(app, ["serve", str(tmp_path / "nope")])
    assert r.exit_code == 2 and "not an exported model" in r.output
    r = CliRunner().invoke(app, ["serve", str(model), "--max-batch-rows", "0"])
    assert r.exit_code == 2 and "--max-batch-rows must be" in r.output
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    port = s.getsockname()[1]
    try:
        r = CliRunner().invoke(app, ["serve", str(model), "--port", str(port)])
    finally:
        s.close()
    assert r.exit_code == 2 and f"error: cannot listen on 127.0.0.1:{port}" in r.output, r.output


def test_accepted_connections_have_tcp_nodelay():
    """`bind`'s socket under asyncio's `create_server(sock=...)` (how uvicorn runs it): every accepted
    connection has TCP_NODELAY, so an answer written as two segments (headers, then body) is not held
    back by Nagle until the client's delayed ACK (~40 ms on every kept-alive request after the first)."""
    import asyncio
    import socket

    from dlrmctl.inference.serve import bind

    sock = bind("127.0.0.1", 0)
    got: list[int] = []

    class Probe(asyncio.Protocol):
        def connection_made(self, transport):
            got.append(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def main():
        srv = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(*sock.getsockname()), 10)
            await asyncio.wait_for(reader.read(), 10)  # the server closes it
            writer.close()
        finally:
            srv.close()
            await srv.wait_closed()

    asyncio.run(main())
    assert len(got) == 1 and got[0] != 0
