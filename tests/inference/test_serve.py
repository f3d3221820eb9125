"""`dlrmctl serve`: the exported model behind the Open Inference Protocol, checked with an
independent client (tritonclient HTTP) against `dlrmctl predict`, bad inputs, a full queue, dynamic
batching and a drain on SIGTERM.  Every server is a `dlrmctl serve --port 0` subprocess on 127.0.0.1,
stopped by the test."""

import csv
import http.client
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
        p.startup_line = line
        m = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        assert m, line + p.stderr.read()
        url = f"127.0.0.1:{m.group(1)}"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://{url}/v2/health/ready", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:  # refused, reset, 503 or no answer within 5 s yet (a loaded machine)
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
    # a fixed 50 ms delay: a Python client sends its 64 requests one by one, and the adaptive delay would
    # (rightly) run each at once on an idle machine; merging of requests that arrive together is
    # tested in test_serve_batcher.py
    with server(model, "--max-delay-ms", "50", "--min-delay-ms", "50") as (url, _):
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
            "short raw line": ({"inputs": [{"name": "raw", "datatype": "BYTES", "shape": [2],
                                            "data": [lines[0].decode(), "1\t2\t3"]}]},
                               "input 'raw' element 1: expected 40 tab-separated fields, got 3 (the first missing: I3)"),
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
    # the first request is held 15 s in the queue: the window in which the test must see it queued and
    # send the second one, however slowly a loaded machine answers the metrics and the requests
    with server(model, "--max-queue-rows", "64", "--max-delay-ms", "15000", "--min-delay-ms", "15000") as (url, _):
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
        t.join(60)
        assert first["r"][0] == 200 and len(first["r"][1]["outputs"][0]["data"]) == 64
        assert _metric(url, "dlrmctl_serve_errors_total")['dlrmctl_serve_errors_total{reason="queue_full"}'] == 1


def test_sigterm_drains_requests_in_flight(model):
    lines = RAW100.read_text().splitlines()
    from dlrmctl.inference.export import load_exported

    # held 10 s: the window in which all 8 requests must be seen queued, on a loaded machine too
    with server(model, "--max-delay-ms", "10000", "--min-delay-ms", "10000") as (url, p):
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
            t.join(60)
        assert p.wait(60) == 0
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
    r = CliRunner().invoke(app, ["serve", str(model), "--processes", "0"])
    assert r.exit_code == 2 and "--processes must be" in r.output
    r = CliRunner().invoke(app, ["serve", str(model), "--min-delay-ms", "5"])
    assert r.exit_code == 2 and "--min-delay-ms must be a finite number >= 0 and <= 2 (milliseconds (at most --max-delay-ms)), got 5.0" in r.output, r.output
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

    from dlrmctl.inference.serve.processes import bind

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


# ----------------------------------------------------------------------------- the per-request cost, as kinds
def _spec(weighted=()):
    from dlrmctl.inference.serve.protocol import ModelSpec

    return ModelSpec(name="m", num_dense=2, features=["a", "b", "c"], weighted=list(weighted),
                     rows={"a": 10, "b": 20, "c": 30}, on_invalid_id="error", raw=False)


def _body(rng, B, multi, weighted, binary):
    """(body, header length or None, per-feature (ids, lengths, weights) as the request means them)."""
    ins, blobs, want = [], [], {}

    def add(name, dt, arr):
        arr = np.ascontiguousarray(arr)
        d = {"name": name, "datatype": dt, "shape": list(arr.shape)}
        if binary:
            b = arr.tobytes()
            d["parameters"] = {"binary_data_size": len(b)}
            blobs.append(b)
        else:
            d["data"] = arr.tolist()
        ins.append(d)

    dense = rng.random((B, 2), dtype=np.float32)
    add("dense", "FP32", dense)
    for f in "abc":
        ln = rng.integers(0, 3, B) if multi and f != "a" else np.ones(B, np.int64)
        ids = rng.integers(0, 10, int(ln.sum()))
        add(f, "INT64", ids)
        if multi and f != "a":
            add(f"{f}.lengths", "INT64", ln)
        w = rng.random(ids.size, dtype=np.float32) if f in weighted else np.ones(ids.size, np.float32)
        if f in weighted:
            add(f"{f}.weights", "FP32", w)
        want[f] = (ids, ln, w)
    head = json.dumps({"inputs": ins}).encode()
    return (head + b"".join(blobs), len(head), dense, want) if binary else (head, None, dense, want)


@pytest.mark.parametrize("weighted", [(), ("b",)])
def test_decode_and_merge_match_a_per_request_reference(weighted):
    """Requests of one id per row, multi-id bags (some of 0 ids), weighted features, JSON and binary,
    merged in one forward's key-major order (feature, then request, then row) exactly as a
    per-request, per-feature reference builds it."""
    import torch

    from dlrmctl.inference.serve.batcher import merge
    from dlrmctl.inference.serve.protocol import decode_request

    rng = np.random.default_rng(0)
    spec = _spec(weighted)
    for trial in range(40):
        reqs = [_body(rng, int(rng.integers(1, 5)), bool(rng.integers(0, 2)) and trial % 4 != 0, weighted,
                      bool(rng.integers(0, 2))) for _ in range(int(rng.integers(1, 6)))]
        rows = [decode_request(b, h, spec, None)[0] for b, h, _, _ in reqs]
        dense, values, lengths, w = merge(rows, 3, bool(weighted))
        np.testing.assert_array_equal(dense.numpy(), np.concatenate([d for _, _, d, _ in reqs]))
        np.testing.assert_array_equal(values.numpy(), np.concatenate([r[3][f][0] for f in "abc" for r in reqs]))
        np.testing.assert_array_equal(lengths.numpy(), np.concatenate([r[3][f][1] for f in "abc" for r in reqs]))
        if weighted:
            np.testing.assert_array_equal(w.numpy(), np.concatenate([r[3][f][2] for f in "abc" for r in reqs]))
        else:
            assert w is None
        assert values.dtype == lengths.dtype == torch.int64 and dense.is_contiguous()


def test_an_id_outside_its_table_is_named_with_its_feature_and_position():
    """The one vectorized range check over every feature's ids names the same feature and position
    as a per-feature check: one id per row, and multi-id bags."""
    from dlrmctl.inference.serve.protocol import BadRequest, decode_request

    spec = _spec()
    base = [{"name": "dense", "datatype": "FP32", "shape": [2, 2], "data": [1, 2, 3, 4]},
            {"name": "a", "datatype": "INT64", "shape": [2], "data": [1, 2]}]
    one = base + [{"name": "b", "datatype": "INT64", "shape": [2], "data": [3, 4]},
                  {"name": "c", "datatype": "INT64", "shape": [2], "data": [5, 30]}]
    bags = base + [{"name": "b", "datatype": "INT64", "shape": [3], "data": [1, 20, 2]},
                   {"name": "b.lengths", "datatype": "INT64", "shape": [2], "data": [1, 2]},
                   {"name": "c", "datatype": "INT64", "shape": [2], "data": [-1, 3]}]
    for inputs, msg in ((one, "input 'c': id 30 at position 1 is outside the table's 30 rows (ids 0..29;"),
                        (bags, "input 'b': id 20 at position 1 is outside the table's 20 rows (ids 0..19;")):
        with pytest.raises(BadRequest) as e:
            decode_request(json.dumps({"inputs": inputs}).encode(), None, spec, None)
        assert str(e.value).startswith(msg), str(e.value)


def test_the_batcher_wakes_its_forward_thread_once_per_batch_not_per_request(monkeypatch):
    """Requests that join a batch while its forward thread waits out --max-delay-ms do not each wake
    that thread (a thread switch per request)."""
    import torch

    from dlrmctl.inference.serve.batcher import Batcher, Metrics
    from dlrmctl.inference.serve.protocol import Rows

    wakes = []

    class Counting(threading.Condition):
        def notify(self, n=1):
            wakes.append(n)
            super().notify(n)

    def fwd(dense, values, lengths, weights):
        return dense[:, 0].clone()

    monkeypatch.setattr(threading, "Condition", Counting)  # the Batcher's own condition
    b = Batcher(fwd, 1, False, max_batch_rows=64, max_delay_ms=200, max_queue_rows=1024, workers=1, metrics=Metrics(64))
    monkeypatch.undo()
    assert isinstance(b._cond, Counting)
    futs = [b.submit(Rows(np.full((1, 1), float(i), np.float32), np.zeros(1, np.int64), np.ones((1, 1), np.int64), None))
            for i in range(20)]
    got = [f.result(30) for f in futs]
    b.stop()
    assert [float(s[1][0]) for s in got] == list(range(20))  # (scores, logits), each its own row
    assert float(got[3][0][0]) == pytest.approx(float(torch.sigmoid(torch.tensor(3.0))))
    assert len(wakes) <= 3, wakes  # the first request (and the stop), not 20


def _asgi(app, method, path, body=b"", headers=()):
    """(status, headers dict, body) of one request driven straight through an ASGI app."""
    import asyncio

    from tests.helpers.asgi import asgi_request

    return asyncio.get_event_loop().run_until_complete(asgi_request(app, method, path, body, headers))


def test_infer_is_answered_without_the_fastapi_stack(model):
    """POST .../infer is a raw ASGI route: with the FastAPI app (routing, validation, middleware)
    replaced by one that fails, infer still scores (binary and JSON), answers bad requests with
    their one line, and a GET on it is a 405."""
    import asyncio

    from dlrmctl.inference.export import load_exported
    from dlrmctl.inference.serve.app import build_app

    m = load_exported(model)
    app = build_app(m, "tiny", max_delay_ms=0)
    lines = RAW100.read_text().splitlines()[:3]
    dense, ids, features = _model_inputs(model, RAW100)
    ins = _tensor_inputs(dense[:3], ids[:3], features)
    from tritonclient.http._utils import _get_inference_request

    body, hl = _get_inference_request(ins, None, None, None, None, None, None, None, None)
    import torch

    want = torch.sigmoid(m.logits(torch.from_numpy(dense[:3]), torch.from_numpy(np.ascontiguousarray(ids[:3].T).reshape(-1)),
                                  torch.ones(3 * len(features), dtype=torch.int64))).numpy()

    async def boom(scope, receive, send):
        raise AssertionError(f"FastAPI reached for {scope['type']} {scope.get('path')}")

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        cm = app.api.router.lifespan_context(app.api)
        loop.run_until_complete(cm.__aenter__())
        api, app.api = app.api, boom
        try:
            code, hdr, out = _asgi(app, "POST", "/v2/models/tiny/infer", body, [("inference-header-content-length", str(hl))])
            assert code == 200 and hdr["content-type"] == "application/octet-stream", (code, out)
            n = int(hdr["inference-header-content-length"])
            res = json.loads(out[:n])
            assert [o["name"] for o in res["outputs"]] == ["score", "logit"]
            np.testing.assert_allclose(np.frombuffer(out[n:n + 12], "<f4"), want, atol=1e-6, rtol=0)
            raw = {"inputs": [{"name": "raw", "datatype": "BYTES", "shape": [3], "data": lines}]}
            code, hdr, out = _asgi(app, "POST", "/v2/models/tiny/versions/1/infer", json.dumps(raw).encode())
            assert code == 200 and hdr["content-type"] == "application/json"
            np.testing.assert_allclose(json.loads(out)["outputs"][0]["data"], want, atol=1e-6, rtol=0)
            code, _, out = _asgi(app, "POST", "/v2/models/tiny/infer", b"{nope")
            assert code == 400 and json.loads(out)["error"].startswith("the request body is not JSON")
            code, hdr, _ = _asgi(app, "GET", "/v2/models/tiny/infer")
            assert code == 405 and hdr["allow"] == "POST"
            # arrays nested 100,000 deep: a RecursionError in json.loads was a 500 and a logged traceback
            code, _, out = _asgi(app, "POST", "/v2/models/tiny/infer", b"[" * 100000 + b"]" * 100000)
            assert code == 400 and "nested too deeply" in json.loads(out)["error"], out
            # a body over --max-request-mb: 413 (it was buffered whole, twice, before any check)
            small = build_app(m, "tiny", max_request_mb=0.001)
            small.api = boom
            code, _, out = _asgi(small, "POST", "/v2/models/tiny/infer", b" " * 2000)
            assert code == 413 and "--max-request-mb" in json.loads(out)["error"], out
            code, _, out = _asgi(small, "POST", "/v2/models/tiny/infer", b"", [("content-length", "999999999")])
            assert code == 413, out
            code, _, out = _asgi(app, "POST", "/v2/models/other/infer", body, [("inference-header-content-length", str(hl))])
            assert code == 404 and "this server serves 'tiny'" in json.loads(out)["error"]
        finally:
            app.api = api
            loop.run_until_complete(cm.__aexit__(None, None, None))
    finally:
        loop.close()
        asyncio.set_event_loop(None)


def test_processes_share_the_port_each_with_the_model_and_drain(model):
    """--processes 2: two server processes on one port (SO_REUSEPORT), both answering (their pids
    in dlrmctl_serve_process_info over fresh connections), scores right from either; the startup
    line names the HTTP stack; SIGTERM stops both, each answering what it received."""
    from dlrmctl.inference.serve.processes import http_stack

    lines = RAW100.read_text().splitlines()
    with server(model, "--processes", "2", "--max-delay-ms", "0") as (url, p):
        pids, scores = set(), []
        for i in range(40):  # a fresh connection each: the kernel hashes each onto one of the two sockets
            text = urllib.request.urlopen(f"http://{url}/metrics", timeout=10).read().decode()
            pids |= set(re.findall(r'dlrmctl_serve_process_info\{pid="(\d+)",process="\d of 2"\} 1\.0', text))
            code, body, _ = _post(url, {"inputs": [{"name": "raw", "datatype": "BYTES", "shape": [2], "data": lines[:2]}]})
            assert code == 200
            scores.append(body["outputs"][0]["data"])
        assert len(pids) == 2 and str(p.pid) in pids, pids
        np.testing.assert_allclose(np.array(scores), np.array(scores[:1] * 40), atol=1e-6, rtol=0)
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0
        out = p.startup_line + p.stdout.read()
    http, loop = http_stack()
    assert "2 processes x 1 worker(s)" in out and f"HTTP {http} on {loop}" in out, out
    assert "stopped (SIGTERM): every request received was answered" in out
    child = int(next(x for x in pids if x != str(p.pid)))
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)  # ended and reaped with its parent


def test_http_stack_falls_back_to_h11_and_asyncio(monkeypatch):
    """httptools and uvloop where importable (the serve extra), h11 and asyncio otherwise."""
    from dlrmctl.inference.serve.processes import http_stack

    for mod in ("httptools", "uvloop"):
        monkeypatch.setitem(sys.modules, mod, None)  # import raises ImportError
    assert http_stack() == ("h11", "asyncio")
    monkeypatch.undo()
    pytest.importorskip("httptools")
    pytest.importorskip("uvloop")
    assert http_stack() == ("httptools", "uvloop")


def test_a_model_of_data_without_a_raw_transform_is_served_from_tensors(tmp_path_factory, tmp_path):
    """`serve` of a model trained on synthetic (or MovieLens) data stopped at start with `raw lines can
    be scored for datasets ['criteo']`: every exported manifest has a preprocessing record, and the
    server took that for a raw-line transform."""
    from typer.testing import CliRunner

    from dlrmctl.cli import app
    from tests.conftest import tiny_synthetic

    data = tiny_synthetic(tmp_path_factory, "serve_synth", rows=2000)
    r = CliRunner().invoke(app, ["train", "configs/demo.yaml", "--set", f"data.path={data}", "--set",
                                 f"train.run_dir={tmp_path}", "--set", "name=syn", "--set", "train.max_steps=5",
                                 "--set", "train.progress=false", "--set", "data.batch_size=256"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["export", str(tmp_path / "syn"), "--fp32", "--out", str(tmp_path / "m")])
    assert r.exit_code == 0, r.output
    with server(tmp_path / "m") as (url, _):
        with urllib.request.urlopen(f"http://{url}/v2/models/syn", timeout=10) as resp:
            meta = json.loads(resp.read())
        names = [i["name"] for i in meta["inputs"]]
        assert "raw" not in names and "dense" in names
        features = [n for n in names if n.startswith("C") and "." not in n]
        rng = np.random.default_rng(0)
        dense = rng.random((3, 13), dtype=np.float32)
        body = {"inputs": [{"name": "dense", "datatype": "FP32", "shape": [3, 13], "data": dense.ravel().tolist()}]
                + [{"name": f, "datatype": "INT64", "shape": [3], "data": [0, 1, 2]} for f in features]}
        code, out, _ = _post(url, body, "/v2/models/syn/infer")
        assert code == 200 and len(out["outputs"][0]["data"]) == 3, out
        code, out, _ = _post(url, {"inputs": [{"name": "raw", "datatype": "BYTES", "shape": [1], "data": ["x"]}]},
                             "/v2/models/syn/infer")
        assert code == 400 and "raw" in out["error"], out


def test_a_second_processes_server_cannot_share_a_port_in_use():
    """Two `--processes 2` servers on one port both bound it (SO_REUSEPORT, same user) and answered
    each other's requests; the second must be refused as a port in use, while the first's own
    processes still join it."""
    from dlrmctl.inference.serve.processes import bind
    from dlrmctl.inference.serve.protocol import ServeError

    first = bind("127.0.0.1", 0, reuse_port=True)
    port = first.getsockname()[1]
    try:
        with pytest.raises(ServeError, match="Address already in use"):
            bind("127.0.0.1", port, reuse_port=True)
        bind("127.0.0.1", port, reuse_port=True, join=True).close()
    finally:
        first.close()


def _child_pid(url: str, parent: int) -> int:
    """The pid of a server process of `--processes 2` other than ``parent`` (from fresh connections'
    dlrmctl_serve_process_info)."""
    for _ in range(200):
        try:
            text = urllib.request.urlopen(f"http://{url}/metrics", timeout=10).read().decode()
        except OSError:  # a connection the killed process had taken into its backlog
            continue
        pids = {int(x) for x in re.findall(r'dlrmctl_serve_process_info\{pid="(\d+)"', text)} - {parent}
        if pids:
            return pids.pop()
    raise AssertionError("no other server process answered")


def _ready(url: str) -> tuple[int, dict]:
    """(status, body) of GET /v2/health/ready; (0, {}) for a connection the dead process had taken
    into its backlog (reset)."""
    try:
        with urllib.request.urlopen(f"http://{url}/v2/health/ready", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except OSError:
        return 0, {}


def test_a_dead_server_process_is_reported_restarted_and_readiness_says_so(model):
    """--processes 2: a server process killed while serving is noticed at once (not at shutdown):
    one line on stderr, readiness 503 with the reason until its restart listens, then 200 and a
    new process on the port."""
    with server(model, "--processes", "2", "--max-delay-ms", "0") as (url, p):
        child = _child_pid(url, p.pid)
        os.kill(child, signal.SIGKILL)
        codes, deadline = [], time.monotonic() + 120
        while time.monotonic() < deadline:
            code, body = _ready(url)
            codes.append(code)
            if code == 503:
                assert body["reason"] == "server dlrmctl-serve-process-2 was killed by SIGKILL", body
            if code == 200 and 503 in codes:
                break
            time.sleep(0.05)
        assert 503 in codes and codes[-1] == 200, codes
        assert _child_pid(url, p.pid) != child
        p.send_signal(signal.SIGTERM)
        rc = p.wait(60)
        err = p.stderr.read()
        assert rc == 0, err
    assert ("warning: server dlrmctl-serve-process-2 was killed by SIGKILL; starting it again "
            "(restart 1 of at most 3)") in err, err


def test_a_stopped_server_process_is_reported_unready_and_a_sigterm_still_stops_the_server_cleanly(model):
    """--processes 2: a SIGSTOPped process was never noticed (its share of probes timed out, nothing
    on stderr), and a SIGTERM of the server then waited 90 s and ended in "exited with code -9"."""
    with server(model, "--processes", "2", "--max-delay-ms", "0") as (url, p):
        child = _child_pid(url, p.pid)
        os.kill(child, signal.SIGSTOP)
        deadline, body = time.monotonic() + 120, {}
        while time.monotonic() < deadline:
            code, body = _ready(url)
            if code == 503:
                break
            time.sleep(0.05)
        assert body.get("reason", "").startswith(f"server dlrmctl-serve-process-2 (pid {child}) is stopped "
                                                 "(SIGSTOP / SIGTSTP)"), body
        p.send_signal(signal.SIGTERM)  # the process is still stopped: it is continued, drains and exits
        rc = p.wait(120)
        err = p.stderr.read()
        assert rc == 0, err
    assert f"warning: server dlrmctl-serve-process-2 (pid {child}) is stopped (SIGSTOP / SIGTSTP)" in err, err
    assert "error:" not in err, err


def test_a_server_process_told_to_stop_right_after_it_reported_listening_exits_cleanly(model):
    """A SIGTERM that reaches an extra server process between its "listening" report and the
    installation of its server's signal handlers (importing uvicorn, building the app: a restart
    stopped at once, or a server stopped right after starting) is a clean stop, exit code 0, not a
    death by SIGTERM."""
    from dlrmctl.inference.serve.processes import bind, start_processes, stop_processes

    first = bind("127.0.0.1", 0, reuse_port=True)
    try:
        options = dict(max_batch_rows=64, max_delay_ms=0.0, max_queue_rows=1024, workers=1)
        procs = start_processes(1, str(model), "tiny", "127.0.0.1", first.getsockname()[1], 1, options)
        assert stop_processes(procs, signal.SIGTERM, wait=120) == [0]
    finally:
        first.close()


def test_a_server_process_that_exits_past_the_restarts_allowed_stops_the_server_in_one_line(model):
    with server(model, "--processes", "2", "--max-restarts", "0") as (url, p):
        os.kill(_child_pid(url, p.pid), signal.SIGKILL)
        assert p.wait(60) == 2
        err = p.stderr.read().strip()
    assert err.splitlines() == ["error: server dlrmctl-serve-process-2 was killed by SIGKILL, after 0 restart(s) "
                                "of the server processes; server stopped"], err


def test_sigterm_answers_the_requests_waiting_in_the_accept_backlog(model):
    """Connections the kernel accepted while the server was busy (here: stopped) and requests they
    sent before the SIGTERM are answered, not reset when the listening socket closes."""
    lines = RAW100.read_text().splitlines()
    body = {"inputs": [{"name": "raw", "datatype": "BYTES", "shape": [1], "data": lines[:1]}]}
    with server(model, "--max-delay-ms", "0") as (url, p):
        assert _post(url, body)[0] == 200
        results: list = []
        sent = threading.Semaphore(0)

        def client():
            host, port = url.split(":")
            conn = http.client.HTTPConnection(host, int(port), timeout=60)
            try:
                conn.request("POST", "/v2/models/tiny/infer", json.dumps(body), {"Content-Type": "application/json"})
            except OSError as e:  # refused while the server is stopped: the kernel's backlog is full
                results.append(repr(e))
                return
            finally:
                sent.release()
            try:
                results.append(conn.getresponse().status)
            except OSError as e:  # reset: the bug
                results.append(repr(e))
            finally:
                conn.close()

        os.kill(p.pid, signal.SIGSTOP)
        try:
            threads = [threading.Thread(target=client) for _ in range(16)]
            for t in threads:
                t.start()
            for _ in threads:  # every connection in the backlog, every request in its socket (not a sleep: a
                assert sent.acquire(timeout=60)  # loaded machine may take seconds to run 16 threads)
            p.send_signal(signal.SIGTERM)
        finally:
            os.kill(p.pid, signal.SIGCONT)
        for t in threads:
            t.join(60)
        assert p.wait(60) == 0
    assert results == [200] * 16, results
