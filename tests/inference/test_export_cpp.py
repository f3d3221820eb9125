"""Build scripts/cpp_inference and check that C++ libtorch scores an exported model like Python.

Skipped cleanly when cmake or a C++ compiler is absent.  The build directory is cached under
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

pytestmark = [
    pytest.mark.skipif(not HAS_FBGEMM, reason="export needs fbgemm_gpu"),
    pytest.mark.skipif(shutil.which("cmake") is None or (shutil.which("c++") or shutil.which("g++")) is None,
                       reason="cmake and a C++ compiler are needed to build the C++ example"),
]


def _fbgemm_dir() -> str:
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


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_cpp_scores_match_python_to_1e5(cpp_binary, tmp_path, dtype):
    from dlrmctl.inference.export import export_model, load_exported
    from dlrmctl.inference.predict import read_cpp_output, write_cpp_input

    export_model(_model(), tmp_path / "m", dtype, quantize_dense=(dtype == "int4"), artifact="torchscript")
    dense, values, lengths = _inputs(257, seed=1)
    py = load_exported(tmp_path / "m").score(dense, values, lengths).numpy()
    assert float(py.std()) > 1e-3  # not a constant output
    write_cpp_input(tmp_path / "in.bin", dense, values, lengths)
    r = subprocess.run([str(cpp_binary), str(tmp_path / "m" / "model.pt"), str(tmp_path / "in.bin"),
                        str(tmp_path / "out.bin"), _fbgemm_dir()], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "scored 257 samples" in r.stdout
    cpp = read_cpp_output(tmp_path / "out.bin")
    assert cpp.shape == (257,)
    np.testing.assert_allclose(cpp, py, rtol=0, atol=1e-5)


def test_cpp_reports_bad_input_and_out_of_range_ids(cpp_binary, tmp_path):
    from dlrmctl.inference.export import export_model
    from dlrmctl.inference.predict import write_cpp_input

    export_model(_model(), tmp_path / "m", "int8", artifact="torchscript")
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


def test_cpp_scores_a_weighted_model_with_its_weights(cpp_binary, tmp_path):
    """The weighted-features setup (T0 row i = [i]*4, ids [1, 2], weights [10, 100]): pooled
    [210]*4, logit 2.1, in Python and in C++ (DLRMIN02 input); without weights it is refused."""
    import math

    from dlrmctl.inference.export import export_model, load_exported
    from dlrmctl.inference.predict import read_cpp_output, write_cpp_input

    from tests.modules.test_weighted_features import LOGIT, setup_dlrm, setup_inputs

    export_model(setup_dlrm(), tmp_path / "m", "int8", artifact="torchscript")
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
