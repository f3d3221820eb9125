"""The Open Inference Protocol as `dlrmctl serve` speaks it, against hostile or careless clients:
model versions in the path, the model list, the binary extension's header and trailing bytes, and
model names that cannot be served.  Driven straight through the ASGI app with a fake model (no
fbgemm, no socket); the `--name` refusal at the CLI."""

import json

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from dlrmctl.inference.serve.app import build_app  # noqa: E402
from dlrmctl.inference.serve.protocol import ServeError, check_model_name  # noqa: E402
from tests.inference.test_serve_batcher import FakeModel, infer_body, post, run_app  # noqa: E402


def binary_body(trailing: bytes = b"") -> tuple[bytes, int]:
    """A 2-row request in the binary tensor extension: (body, JSON header length)."""
    blobs = [np.array([[0.25], [0.5]], "<f4").tobytes(), np.array([1, 2], "<i8").tobytes(), np.array([3, 4], "<i8").tobytes()]
    ins = [{"name": n, "datatype": dt, "shape": shape, "parameters": {"binary_data_size": len(b)}}
           for (n, dt, shape), b in zip((("dense", "FP32", [2, 1]), ("a", "INT64", [2]), ("b", "INT64", [2])), blobs)]
    head = json.dumps({"inputs": ins}).encode()
    return head + b"".join(blobs) + trailing, len(head)


def test_versions_in_the_path_the_model_list_and_the_binary_header_are_checked():
    model = FakeModel()
    app = build_app(model, "m", max_delay_ms=0)

    async def check():
        # version 1 is served; any other is a 404 naming the versions served (infer, metadata, ready)
        code, out = await post(app, infer_body(0.5), "/v2/models/m/versions/1/infer")
        assert code == 200 and out["model_version"] == "1"
        for path, method in (("/v2/models/m/versions/999/infer", "POST"), ("/v2/models/m/versions/999", "GET"),
                             ("/v2/models/m/versions/2/ready", "GET")):
            code, out = await post(app, infer_body(0.5) if method == "POST" else b"", path, method=method)
            assert code == 404 and "has no version" in out["error"] and "(versions served: 1)" in out["error"], (path, out)
        code, out = await post(app, b"", "/v2/models/m/versions/1", method="GET")
        assert code == 200 and out["versions"] == ["1"]
        # GET /v2/models lists what is served; the repository index as Triton's extension has it
        code, out = await post(app, b"", "/v2/models", method="GET")
        assert code == 200 and out == {"models": [{"name": "m", "versions": ["1"], "platform": "pytorch_pt2",
                                                   "state": "READY"}]}
        code, out = await post(app, b"", "/v2/repository/index")
        assert code == 200 and out == [{"name": "m", "version": "1", "state": "READY"}]
        # the binary extension: a good request, then a non-numeric header length and trailing bytes
        body, hl = binary_body()
        code, out = await post(app, body, headers=[("inference-header-content-length", str(hl))])
        assert code == 200 and out["outputs"][1]["data"] == [0.25, 0.5], out
        for bad in ("abc", "-5", "1e3", ""):
            code, out = await post(app, body, headers=[("inference-header-content-length", bad)])
            assert code == 400 and f"Inference-Header-Content-Length must be the JSON header's length in bytes " \
                                   f"(a non-negative integer), got {bad!r}" in out["error"], (bad, out)
        body, hl = binary_body(b"\0" * 7)
        code, out = await post(app, body, headers=[("inference-header-content-length", str(hl))])
        assert code == 400 and out["error"].startswith("7 bytes follow the binary tensors"), out
        assert model.batches == [1, 2]  # nothing refused reached a forward

    run_app(app, check)


@pytest.mark.parametrize("name", ["a/b", "", ".hidden", "-x", "with space", "é", "x" * 129, "a?b", "a%2Fb"])
def test_a_model_name_that_cannot_be_one_path_segment_is_refused(name):
    with pytest.raises(ServeError, match="--name: model name .* cannot be served as /v2/models/"):
        check_model_name(name)


@pytest.mark.parametrize("name", ["tiny", "criteo_sample", "m-1.2", "A_b-C.d", "x" * 128])
def test_model_names_of_letters_digits_dots_dashes_underscores_are_served(name):
    assert check_model_name(name) == name


def test_serve_name_with_a_slash_is_refused_before_the_model_is_loaded(tmp_path):
    from typer.testing import CliRunner

    from dlrmctl.cli import app

    r = CliRunner().invoke(app, ["serve", str(tmp_path / "absent"), "--name", "a/b"])
    assert r.exit_code == 2, r.output
    assert r.output.startswith("error: --name: model name 'a/b' cannot be served as /v2/models/{name}"), r.output
    assert len(r.output.strip().splitlines()) == 1


# ----------------------------------------------------------------------------- JSON tensors without lists
@pytest.mark.parametrize("data", [
    list(range(-40, 40)), [float(x) / 7 for x in range(-30, 30)], [[1.5, -2e-3, 3E+2, 4] * 5, [5, 6, 7, 8] * 5],
    [[[1, 2], [3, 4]] * 10, [[5, 6], [7, 8]] * 10], [9223372036854775807, -9223372036854775808] * 10,
])
def test_numeric_arrays_cut_from_the_json_parse_to_what_json_loads_gives(data):
    from dlrmctl.inference.serve.json_tensors import SPAN_KEY, cut_numeric_arrays, parse_numbers

    body = json.dumps({"id": 'x "data": [1, 2]', "inputs": [{"name": "a", "shape": [1], "data": data}]}).encode()
    text, arrays = cut_numeric_arrays(body)
    req = json.loads(text)
    assert req["id"] == 'x "data": [1, 2]' and len(arrays) == 1 and req["inputs"][0]["data"] == {SPAN_KEY: 0}
    want = np.array(data, dtype=object).reshape(-1)
    integer = all(type(x) is int for x in want)
    got = parse_numbers(arrays[0], integer=integer)
    assert got.dtype == (np.int64 if integer else np.float64)
    np.testing.assert_array_equal(got, np.array(want.tolist(), dtype=got.dtype))


@pytest.mark.parametrize("span", [b"[1, ,2" + b", 3" * 30 + b"]", b"[1,2" + b", 3" * 30 + b",]", b"[[],[1" + b", 3" * 30 + b"]]",
                                  b"[1.5" + b", 3" * 30 + b"]"])
def test_arrays_that_are_not_plain_integers_are_left_to_json(span):
    from dlrmctl.inference.serve.json_tensors import parse_numbers

    assert parse_numbers(span, integer=True) is None


def test_json_tensors_decode_as_before_and_bad_data_is_named():
    """Through decode_request: JSON ids and dense values (cut-out arrays) equal the binary request's;
    a float among INT64 ids, an INT32 out of range, a trailing comma and a forged placeholder are 400s."""
    from dlrmctl.inference.serve.protocol import BadRequest, ModelSpec, decode_request

    spec = ModelSpec("m", 1, ["a", "b"], [], {"a": 1000, "b": 1000}, "error", False)
    rng = np.random.default_rng(0)
    dense, a, b = rng.random((50, 1), dtype=np.float32), rng.integers(0, 1000, 50), rng.integers(0, 1000, 50)

    def body(a_data, dt="INT64"):
        return json.dumps({"inputs": [{"name": "dense", "datatype": "FP32", "shape": [50, 1], "data": dense.tolist()},
                                      {"name": "a", "datatype": dt, "shape": [50], "data": a_data},
                                      {"name": "b", "datatype": "INT64", "shape": [50], "data": b.tolist()}]}).encode()

    rows, _ = decode_request(body(a.tolist()), None, spec, None)
    np.testing.assert_array_equal(rows.dense, dense)
    np.testing.assert_array_equal(rows.values, np.concatenate([a, b]))
    for bad, dt, msg in ((a.tolist()[:-1] + [1.5], "INT64", "input 'a': data is not a list of INT64 numbers"),
                         (a.tolist()[:-1] + [1 << 40], "INT32", "input 'a': data is not a list of INT32 numbers")):
        with pytest.raises(BadRequest, match=msg):
            decode_request(body(bad, dt), None, spec, None)
    with pytest.raises(BadRequest, match="not JSON"):
        decode_request(body(a.tolist()).replace(b"]}, {\"name\": \"b\"", b",]}, {\"name\": \"b\""), None, spec, None)
    forged = body(a.tolist()).replace(json.dumps(a.tolist()).encode(), b'{"\\u0000": 7}')
    with pytest.raises(BadRequest, match="must be a \\(nested\\) list"):
        decode_request(forged, None, spec, None)


def test_a_body_of_a_million_ids_for_one_row_is_refused_before_its_data_is_read():
    """1 row with 1M ids (3 MB of JSON): a 400 naming --max-ids-per-row, decided from the shapes, with
    memory of the order of the body (Python lists of the ids took ~150x the body)."""
    import tracemalloc

    from dlrmctl.inference.serve.protocol import BadRequest, ModelSpec, decode_request

    spec = ModelSpec("m", 1, ["a"], [], {"a": 10}, "error", False)
    ids = np.arange(1_000_000) % 10
    body = json.dumps({"inputs": [{"name": "dense", "datatype": "FP32", "shape": [1, 1], "data": [0.5]},
                                  {"name": "a", "datatype": "INT64", "shape": [ids.size], "data": ids.tolist()},
                                  {"name": "a.lengths", "datatype": "INT64", "shape": [1], "data": [ids.size]}]}).encode()
    tracemalloc.start()
    try:
        with pytest.raises(BadRequest) as e:
            decode_request(body, None, spec, None)
        assert str(e.value) == ("the request has 1,000,000 ids for 1 row(s): more than 1,024 per row (all features "
                                "together; --max-ids-per-row); split it or raise the bound")
        assert tracemalloc.get_traced_memory()[1] < 2 * len(body)
        # allowed by a larger bound: parsed in C, 8 bytes an id (no list of Python ints)
        tracemalloc.reset_peak()
        rows, _ = decode_request(body, None, ModelSpec("m", 1, ["a"], [], {"a": 10}, "error", False, 1 << 20), None)
        np.testing.assert_array_equal(rows.values, ids)
        assert tracemalloc.get_traced_memory()[1] < 3 * len(body) + 40 * ids.size  # lists: ~150x the body
    finally:
        tracemalloc.stop()


def test_a_large_body_is_decoded_off_the_event_loop(monkeypatch):
    import threading

    import dlrmctl.inference.serve.app as app_module

    threads = []
    real = app_module.decode_request

    def spy(*args):
        threads.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(app_module, "decode_request", spy)
    model = FakeModel()
    app = build_app(model, "m", max_delay_ms=0)
    n = 40_000  # ~0.4 MB of JSON
    big = json.dumps({"inputs": [{"name": "dense", "datatype": "FP32", "shape": [n, 1], "data": [0.5] * n},
                                 {"name": "a", "datatype": "INT64", "shape": [n], "data": [1] * n},
                                 {"name": "b", "datatype": "INT64", "shape": [n], "data": [2] * n}]}).encode()
    assert len(big) >= app.OFF_LOOP_BYTES

    async def check():
        assert (await post(app, infer_body(0.5)))[0] == 200
        code, out = await post(app, big)
        assert code == 200 and len(out["outputs"][0]["data"]) == n

    run_app(app, check)
    assert threads[0] == "MainThread" and threads[1].startswith("dlrmctl-serve-decode"), threads


# ----------------------------------------------------------------------------- --device
def test_serve_device_auto_cuda_and_cpu_with_a_fake_gpu(monkeypatch, tmp_path):
    """--device auto loads on cuda where torch sees a GPU (faked here) and on cpu where it does not;
    --device cuda without one, or a CUDA index beyond those seen, is one error line before loading."""
    import torch
    from typer.testing import CliRunner

    import dlrmctl.inference.export as export
    from dlrmctl.cli import app
    from dlrmctl.commands.serve import serve_device

    loaded = []

    def fake_load(model_dir, device="cpu", artifact=None):
        loaded.append(device if artifact is None else (device, artifact))
        raise export.ExportError(f"{model_dir}: stopped by the test after choosing {device}")

    monkeypatch.setattr(export, "load_exported", fake_load)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert serve_device("auto") == "cuda" and serve_device("cuda:1") == "cuda:1"
    r = CliRunner().invoke(app, ["serve", str(tmp_path), "--device", "auto"])
    assert r.exit_code == 2 and loaded == ["cuda"] and "stopped by the test after choosing cuda" in r.output, r.output
    r = CliRunner().invoke(app, ["serve", str(tmp_path), "--device", "cuda:2"])
    assert r.exit_code == 2 and "error: --device cuda:2: torch sees 2 CUDA device(s)" in r.output, r.output
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert serve_device("auto") == "cpu"
    r = CliRunner().invoke(app, ["serve", str(tmp_path), "--device", "cuda"])
    assert r.exit_code == 2 and "error: --device cuda: torch sees 0 CUDA device(s)" in r.output, r.output
    r = CliRunner().invoke(app, ["serve", str(tmp_path), "--device", "tpu"])
    assert r.exit_code == 2 and "error: --device must be cpu, cuda, cuda:N or auto, got 'tpu'" in r.output, r.output
    r = CliRunner().invoke(app, ["serve", str(tmp_path), "--artifact", "pt2"])  # the named format is loaded
    assert r.exit_code == 2 and loaded == ["cuda", ("cpu", "pt2")], (r.output, loaded)


def test_raw_ids_of_a_managed_collision_table_are_accepted_as_tensors_and_index_ids_still_checked():
    """A managed-collision table takes raw 64-bit ids (the program maps them to rows): the request's
    ids are not bounded by its N + 1 rows; an ordinary table's ids still are."""
    from dlrmctl.inference.serve.protocol import BadRequest, ModelSpec, decode_request

    class Model(FakeModel):
        manifest = {"tables": [{"name": "mc", "num_embeddings": 513, "features": ["a"], "ids": "raw"},
                               {"name": "t", "num_embeddings": 10, "features": ["b"], "ids": "index"}],
                    "on_invalid_id": "error"}

    spec = ModelSpec.of(Model(), "m")

    def body(a: int, b: int) -> bytes:
        return json.dumps({"inputs": [{"name": "dense", "datatype": "FP32", "shape": [1, 1], "data": [0.5]},
                                      {"name": "a", "datatype": "INT64", "shape": [1], "data": [a]},
                                      {"name": "b", "datatype": "INT64", "shape": [1], "data": [b]}]}).encode()

    raw = 2069144152969877096  # a raw id far beyond the managed table's 513 rows
    rows, _ = decode_request(body(raw, 3), None, spec, None)
    assert rows.values.tolist() == [raw, 3]
    with pytest.raises(BadRequest, match="input 'b': id 10 .* outside the table's 10 rows"):
        decode_request(body(raw, 10), None, spec, None)
    with pytest.raises(BadRequest, match="input 'a': id -1"):
        decode_request(body(-1, 3), None, spec, None)


def test_values_a_client_sent_are_quoted_in_errors_at_most_80_characters():
    """A 5 MB bad value was echoed back whole in the 400 answer; every quoted value is cut."""
    app = build_app(FakeModel(), "m", max_delay_ms=0)
    big = "x" * (5 << 20)

    async def check():
        bad = [(json.dumps({"inputs": [{"name": big, "datatype": "INT64", "shape": [1], "data": [1]}]}).encode(),
                "/v2/models/m/infer", [], "input 'xxxx"),
               (infer_body(0.5), f"/v2/models/m/versions/{'9' * 100_000}/infer", [], "has no version '9999"),
               (infer_body(0.5), "/v2/models/m/infer", [("inference-header-content-length", big)],
                "Inference-Header-Content-Length")]
        for body, path, headers, needle in bad:
            code, out = await post(app, body, path, headers=headers)
            assert code in (400, 404) and needle in out["error"] and len(out["error"]) < 400, (code, out["error"][:500])
            assert "…'" in out["error"] and "characters)" in out["error"], out["error"]

    run_app(app, check)


@pytest.mark.parametrize("rows", [1, 3, 50])
def test_ids_of_all_features_decode_in_one_pass_as_each_alone_and_odd_inputs_keep_their_errors(rows):
    """Short id lists (left in the JSON) and long ones (cut out) of every feature are converted
    together: the same values as one input at a time; a repeated input, a bool or a float among
    ids, an id beyond int64, a count other than the shape's and an empty element keep their 400s."""
    from dlrmctl.inference.serve.protocol import BadRequest, ModelSpec, decode_request

    spec = ModelSpec("m", 1, ["a", "b", "c"], [], {"a": 1000, "b": 1000, "c": 1000}, "error", False)
    rng = np.random.default_rng(rows)
    ids = {f: rng.integers(0, 1000, rows).tolist() for f in "abc"}

    def body(**data):
        inputs = [{"name": "dense", "datatype": "FP32", "shape": [rows, 1], "data": [0.5] * rows}]
        inputs += [{"name": f, "datatype": "INT64", "shape": [rows], "data": data.get(f, ids[f])} for f in "abc"]
        return json.dumps({"inputs": inputs + data.get("extra", [])}).encode()

    rows_out, _ = decode_request(body(), None, spec, None)
    np.testing.assert_array_equal(rows_out.values, np.concatenate([ids[f] for f in "abc"]))
    assert rows_out.values.dtype == np.int64
    bad = [({"extra": [{"name": "b", "datatype": "INT64", "shape": [rows], "data": ids["b"]}]}, "given twice"),
           ({"b": ids["b"][:-1] + [True]}, "not a list of INT64 numbers"),
           ({"b": ids["b"][:-1] + [2.0]}, "not a list of INT64 numbers"),
           ({"c": ids["c"][:-1] + [1 << 70]}, "not a list of INT64 numbers|outside the table"),
           ({"a": ids["a"] + [1]}, f"{rows + 1} values for shape \\[{rows}\\]")]
    for data, msg in bad:
        with pytest.raises(BadRequest, match=msg):
            decode_request(body(**data), None, spec, None)
    spaced = body(a=ids["a"] + [7] * 40).replace(b"7, 7", b"7, , 7", 1)
    with pytest.raises(BadRequest):
        decode_request(spaced, None, spec, None)


@pytest.mark.parametrize("style", ["compact", "spaced", "newlines", "exponents"])
def test_long_float_inputs_decode_to_what_json_loads_gives_in_any_spacing(style, monkeypatch):
    """Dense values long enough for the joined float parser (Arrow's) equal ``json.loads``'s, rounded
    to float32, whatever the spacing a client writes (one space after a comma is Arrow's, other
    whitespace NumPy's); ints among them are read as floats."""
    import dlrmctl.inference.serve.json_tensors as jt
    from dlrmctl.inference.serve.json_tensors import ARROW_BYTES

    arrow = []
    real = jt.arrow_floats
    monkeypatch.setattr(jt, "arrow_floats", lambda text: arrow.append(real(text)) or arrow[-1])
    from dlrmctl.inference.serve.protocol import ModelSpec, decode_request

    rows = 200
    spec = ModelSpec("m", 13, ["a"], [], {"a": 1000}, "error", False)
    rng = np.random.default_rng(7)
    dense = np.log1p(rng.integers(0, 5000, rows * 13)).tolist()
    dense[::17] = [int(x) for x in rng.integers(-3, 3, len(dense[::17]))]
    if style == "exponents":
        dense[1::5] = [float(x) for x in rng.standard_normal(len(dense[1::5])) * 1e-7]
        dense[2::5] = [float(x) for x in rng.standard_normal(len(dense[2::5])) * 1e12]
    inputs = [{"name": "dense", "datatype": "FP32", "shape": [rows, 13], "data": dense},
              {"name": "a", "datatype": "INT64", "shape": [rows], "data": rng.integers(0, 1000, rows).tolist()}]
    body = json.dumps({"inputs": inputs}, separators=(",", ":") if style == "compact" else None,
                      indent=1 if style == "newlines" else None).encode()
    assert len(json.dumps(dense)) >= ARROW_BYTES
    rows_out, _ = decode_request(body, None, spec, None)
    want = np.array(json.loads(body)["inputs"][0]["data"], np.float64).astype(np.float32).reshape(rows, 13)
    assert rows_out.dense.dtype == np.float32
    np.testing.assert_array_equal(rows_out.dense, want)
    assert len(arrow) == (0 if style == "newlines" else 1) and all(a is not None for a in arrow)


def test_cut_out_arrays_put_back_give_what_json_loads_gives_for_random_bodies():
    """Random valid bodies (flat and nested arrays, short and long, numbers, strings holding
    ``"data": [...]``, any spacing): the JSON left after the cut, each placeholder replaced by its
    array's ``json.loads``, equals ``json.loads`` of the body."""
    import random

    from dlrmctl.inference.serve.json_tensors import SPAN_KEY, cut_numeric_arrays

    rnd = random.Random(0)

    def value(depth=0):
        k = rnd.random()
        if k < 0.3 and depth < 3:
            return [value(depth + 1) for _ in range(rnd.randint(0, 30))]
        if k < 0.5:
            return rnd.randint(-10**6, 10**6)
        if k < 0.6:
            return rnd.random() * 10 ** rnd.randint(-8, 8)
        return rnd.choice([True, None, "x", 'a "data": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]', "]["])

    def data():
        k = rnd.random()
        if k < 0.4:
            return [rnd.randint(-10**5, 10**5) for _ in range(rnd.randint(0, 80))]
        if k < 0.6:
            return [[rnd.random() for _ in range(rnd.randint(0, 6))] for _ in range(rnd.randint(0, 15))]
        return value()

    def put_back(x, arrays):
        if isinstance(x, dict):
            if set(x) == {SPAN_KEY}:
                return json.loads(arrays[x[SPAN_KEY]])
            return {k: put_back(v, arrays) for k, v in x.items()}
        return [put_back(v, arrays) for v in x] if isinstance(x, list) else x

    cut = 0
    for _ in range(1000):
        obj = {"inputs": [{"name": f"x{j}", "data": data(), rnd.choice(["shape", "data2", 'da"ta']): value()}
                          for j in range(rnd.randint(1, 4))]}
        body = json.dumps(obj, **rnd.choice([{}, {"separators": (",", ":")}, {"indent": rnd.randint(0, 2)}])).encode()
        text, arrays = cut_numeric_arrays(body)
        assert put_back(json.loads(text), arrays) == json.loads(body)
        cut += len(arrays)
    assert cut > 500  # the bodies did have arrays to cut
