"""Build scripts/cpp_inference and check that C++ libtorch scores an exported model like Python:
the AOTInductor package of ``export --aot`` (AOTIModelPackageLoader, no fbgemm_gpu) and the
TorchScript model of ``--torchscript`` (torch::jit::load + FBGEMM), picked from the manifest.

Skipped cleanly when cmake or a C++ compiler is absent (the TorchScript tests also without fbgemm_gpu).  The build directory is cached under
pytest's temp root (``<basetemp>/../dlrmctl-cpp-<hash>``), keyed by the sources and the torch
version, so only the first run pays the ~30 s compile.
"""

import hashlib
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from dlrmctl import HAS_FBGEMM

from tests.conftest import REPO

SRC = REPO / "scripts" / "cpp_inference"

needs_fbgemm = pytest.mark.skipif(not HAS_FBGEMM, reason="the TorchScript artifact needs fbgemm_gpu")
pytestmark = [
    pytest.mark.slow,  # a C++ build (cmake + libtorch) on a fresh machine, then several processes
    pytest.mark.skipif(shutil.which("cmake") is None or (shutil.which("c++") or shutil.which("g++")) is None,
                       reason="cmake and a C++ compiler are needed to build the C++ example"),
]


def _fbgemm_dir() -> str:
    if not HAS_FBGEMM:
        return "/nonexistent-fbgemm_gpu"
    return os.path.dirname(importlib.util.find_spec("fbgemm_gpu").origin)


@pytest.fixture(scope="module")
def cpp_binary(tmp_path_factory) -> Path:
    key = hashlib.sha256()
    for f in ("CMakeLists.txt", "main.cpp", "build.sh"):
        key.update((SRC / f).read_bytes())
    key.update(torch.__version__.encode())
    build = tmp_path_factory.getbasetemp().parent / f"dlrmctl-cpp-{key.hexdigest()[:12]}"
    exe = build / "dlrm_infer"
    if not exe.exists():
        env = dict(os.environ, PYTHON=str(Path(os.sys.executable)))
        r = subprocess.run(["bash", str(SRC / "build.sh"), str(build)], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, f"C++ build failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert exe.exists()
    return exe


def _model():
    from dlrmctl.modules.dlrm import DLRM
    from dlrmctl.modules.embedding_configs import EmbeddingBagConfig
    from dlrmctl.modules.embedding_modules import EmbeddingBagCollection

    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name="t0", num_embeddings=100, embedding_dim=16, feature_names=["f0", "f1"]),
              EmbeddingBagConfig(name="t1", num_embeddings=40, embedding_dim=16, feature_names=["f2"], pooling="mean")]
    ebc = EmbeddingBagCollection(tables, compute_kernel="fused", seed=3)
    with torch.no_grad():  # spread the weights so scores differ visibly between samples
        for w in ebc.embedding_weights().values():
            w.mul_(20)
    return DLRM(ebc, 13, [32, 16], [32, 1], 3, 16).eval()


def _inputs(B: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 5, (3 * B,), generator=g)
    n01, n2 = int(lengths[: 2 * B].sum()), int(lengths[2 * B:].sum())
    values = torch.cat([torch.randint(0, 100, (n01,), generator=g), torch.randint(0, 40, (n2,), generator=g)])
    return torch.randn(B, 13, generator=g), values, lengths


@needs_fbgemm
@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_cpp_scores_match_python_to_1e5(cpp_binary, tmp_path, dtype):
    from dlrmctl.inference.export import ExportOptions, export_model, load_exported
    from dlrmctl.inference.predict import read_cpp_output, write_cpp_input

    export_model(_model(), tmp_path / "m",
                 ExportOptions(dtype, quantize_dense=(dtype == "int4"), artifact="torchscript"))
    dense, values, lengths = _inputs(257, seed=1)
    py = load_exported(tmp_path / "m").score(dense, values, lengths).numpy()
    assert float(py.std()) > 1e-3  # not a constant output
    write_cpp_input(tmp_path / "in.bin", dense, values, lengths)
    # the model directory: its manifest ("artifact": "torchscript") picks torch::jit::load
    r = subprocess.run([str(cpp_binary), str(tmp_path / "m"), str(tmp_path / "in.bin"),
                        str(tmp_path / "out.bin"), _fbgemm_dir()], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "scored 257 samples" in r.stdout and "TorchScript" in r.stdout
    cpp = read_cpp_output(tmp_path / "out.bin")
    assert cpp.shape == (257,)
    np.testing.assert_allclose(cpp, py, rtol=0, atol=1e-5)


@needs_fbgemm
def test_cpp_reports_bad_input_and_out_of_range_ids(cpp_binary, tmp_path):
    from dlrmctl.inference.export import ExportOptions, export_model
    from dlrmctl.inference.predict import write_cpp_input

    export_model(_model(), tmp_path / "m", ExportOptions("int8", artifact="torchscript"))
    dense, values, lengths = _inputs(4, seed=2)
    write_cpp_input(tmp_path / "in.bin", dense, values, lengths)
    data = (tmp_path / "in.bin").read_bytes()
    (tmp_path / "short.bin").write_bytes(data[:-8])
    run = [str(cpp_binary), str(tmp_path / "m" / "model.pt")]
    r = subprocess.run(run + [str(tmp_path / "short.bin"), str(tmp_path / "o.bin"), _fbgemm_dir()], capture_output=True, text=True)
    assert r.returncode == 3 and "truncated" in r.stderr
    bad = values.clone()
    bad[0] = 1000
    write_cpp_input(tmp_path / "bad.bin", dense, bad, lengths)
    r = subprocess.run(run + [str(tmp_path / "bad.bin"), str(tmp_path / "o.bin"), _fbgemm_dir()], capture_output=True, text=True)
    assert r.returncode == 4 and "is out of range" in r.stderr
    assert "table 't0'" in r.stderr  # bad[0] is an id of f0 or f1, both in table t0


@needs_fbgemm
def test_cpp_scores_a_weighted_model_with_its_weights(cpp_binary, tmp_path):
    """The weighted-features setup (T0 row i = [i]*4, ids [1, 2], weights [10, 100]): pooled
    [210]*4, logit 2.1, in Python and in C++ (DLRMIN02 input); without weights it is refused."""
    import math

    from dlrmctl.inference.export import ExportOptions, export_model, load_exported
    from dlrmctl.inference.predict import read_cpp_output, write_cpp_input

    from tests.modules.test_weighted_features import LOGIT, setup_dlrm, setup_inputs

    export_model(setup_dlrm(), tmp_path / "m", ExportOptions("int8", artifact="torchscript"))
    dense, values, lengths, weights = setup_inputs()
    py = load_exported(tmp_path / "m").score(dense, values, lengths, weights).numpy()
    np.testing.assert_allclose(py, [1 / (1 + math.exp(-LOGIT))], rtol=0, atol=1e-6)
    write_cpp_input(tmp_path / "in.bin", dense, values, lengths, weights)
    run = [str(cpp_binary), str(tmp_path / "m" / "model.pt")]
    r = subprocess.run(run + [str(tmp_path / "in.bin"), str(tmp_path / "out.bin"), _fbgemm_dir()],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    np.testing.assert_allclose(read_cpp_output(tmp_path / "out.bin"), py, rtol=0, atol=1e-6)
    write_cpp_input(tmp_path / "plain.bin", dense, values, lengths)
    r = subprocess.run(run + [str(tmp_path / "plain.bin"), str(tmp_path / "o.bin"), _fbgemm_dir()],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 4 and "has weighted features ['f0']" in r.stderr, r.stderr


@needs_fbgemm
def test_cpp_refuses_a_model_file_whose_bytes_differ_from_the_manifests_sha256(cpp_binary, tmp_path):
    """One flipped bit gave other scores with exit 0 (Python refuses the same file): the C++ loader
    checks the SHA-256 the manifest records before loading, and a manifest without one is refused."""
    import json

    from dlrmctl.inference.export import ExportOptions, export_model
    from dlrmctl.inference.predict import write_cpp_input

    export_model(_model(), tmp_path / "m", ExportOptions("int8", artifact="torchscript"))
    dense, values, lengths = _inputs(4, seed=3)
    write_cpp_input(tmp_path / "in.bin", dense, values, lengths)
    run = [str(cpp_binary), str(tmp_path / "m"), str(tmp_path / "in.bin"), str(tmp_path / "o.bin"), _fbgemm_dir()]
    assert subprocess.run(run, capture_output=True, text=True, timeout=120).returncode == 0
    manifest = json.loads((tmp_path / "m" / "manifest.json").read_text())
    f = tmp_path / "m" / manifest["model_file"]
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0x01
    f.write_bytes(bytes(b))
    r = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "SHA-256" in r.stderr and manifest["model_file"] in r.stderr, r.stderr
    assert not (tmp_path / "o2.bin").exists()
    manifest.pop("model_sha256", None)
    manifest["files"] = {}
    (tmp_path / "m" / "manifest.json").write_text(json.dumps(manifest))
    r = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "records no SHA-256" in r.stderr, r.stderr


def test_aot_package_runs_in_cpp_like_the_python_program(cpp_binary, tmp_path, capsys):
    """export --aot: the compile is announced as a step, the AOTInductor package is hashed in the
    manifest, and the C++ example (picking
    AOTIModelPackageLoader from the manifest, no fbgemm_gpu) scores batches of 1 and 257 like the
    Python torch.export program within 1e-5, rejecting an out-of-range id with the program's
    message; a plain .pt2 artifact (no package) is refused with the remedy."""
    import json

    from dlrmctl.inference.export import ExportError, ExportOptions, export_model, load_exported
    from dlrmctl.inference.predict import read_cpp_output, write_cpp_input

    from dlrmctl.console import stages

    model = _model()
    with stages("export"):  # as the verb runs it: a line per step
        export_model(model, tmp_path / "m", ExportOptions("int8", aot=True))  # one AOTInductor compile (tens of seconds)
    steps = [line.split(" s ", 1)[1] for line in capsys.readouterr().out.splitlines() if line.startswith("[export] ")]
    assert steps[-1].startswith("compiling the AOTInductor package model_aoti.pt2"), steps
    man = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert man["aoti_package"] == "model_aoti.pt2" and set(man["files"]) == {"model.pt2", "model_aoti.pt2"}
    pkg = tmp_path / "m" / "model_aoti.pt2"
    assert man["files"]["model_aoti.pt2"]["bytes"] == pkg.stat().st_size
    assert man["files"]["model_aoti.pt2"]["sha256"] == hashlib.sha256(pkg.read_bytes()).hexdigest()
    m = load_exported(tmp_path / "m", artifact="pt2")
    aoti = load_exported(tmp_path / "m")  # the fastest the export holds, in Python too
    assert aoti.runner == "aoti" and aoti.description == "model_aoti.pt2 (AOTInductor package) on cpu"
    assert load_exported(tmp_path / "m", bulk=True).runner == "pt2"  # predict / evaluate: the program first
    run = [str(cpp_binary), str(tmp_path / "m")]  # no FBGEMM_GPU_DIR: the package needs none
    for B, seed in ((1, 5), (257, 1)):
        dense, values, lengths = _inputs(B, seed)
        py = m.score(dense, values, lengths).numpy()
        np.testing.assert_allclose(aoti.score(dense, values, lengths).numpy(), py, rtol=0, atol=1e-5)
        write_cpp_input(tmp_path / "in.bin", dense, values, lengths)
        r = subprocess.run(run + [str(tmp_path / "in.bin"), str(tmp_path / "out.bin")], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert f"scored {B} samples" in r.stdout and "AOTInductor package" in r.stdout
        cpp = read_cpp_output(tmp_path / "out.bin")
        assert cpp.shape == (B,)
        np.testing.assert_allclose(cpp, py, rtol=0, atol=1e-5)
    assert float(py.std()) > 1e-3  # not a constant output
    bad = values.clone()
    bad[-1] = 40  # the last id is f2's (table t1, 40 rows)
    assert int(lengths[2 * 257:].sum()) > 0
    write_cpp_input(tmp_path / "bad.bin", dense, bad, lengths)
    r = subprocess.run(run + [str(tmp_path / "bad.bin"), str(tmp_path / "o.bin")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 4, r.stderr
    assert "an id is out of range; expected 0 <= id < rows of its table: " in r.stderr
    assert "table 't1', feature 'f2': 40" in r.stderr
    with pytest.raises(ExportError, match=r"table 't1', feature 'f2', sample \d+: id 40 is out of range; "
                                          r"expected 0 <= id < 40"):  # the Python runner names the id
        aoti.score(dense, bad, lengths)

    export_model(model, tmp_path / "plain", ExportOptions("int8"))  # no --aot: nothing C++ can run
    r = subprocess.run([str(cpp_binary), str(tmp_path / "plain"), str(tmp_path / "in.bin"), str(tmp_path / "o.bin")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--aot" in r.stderr and "aoti_package is null" in r.stderr, r.stderr
