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
