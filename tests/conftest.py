import os
import pathlib

import pytest
# imported here, under pytest's capture, never first inside a test's in-process CLI run (CliRunner):
# torch's loggers keep the stderr they find at import, and CliRunner's is closed when its run ends;
# every later torch warning then wrote "--- Logging error ---" and a traceback into whichever
# in-process run was current (which test failed depended on the order of the tests)
import torch  # noqa: F401

REPO = pathlib.Path(__file__).resolve().parents[1]
#: the real-data samples: ``$DLRMCTL_SHARED_DATA`` when set, else ``../shared/data`` next to this
#: checkout (whatever the checkout's directory is called or wherever it lives)
SHARED_DATA = pathlib.Path(os.environ.get("DLRMCTL_SHARED_DATA") or REPO.parent / "shared" / "data").resolve()
CRITEO_10K = SHARED_DATA / "criteo" / "criteo_kaggle_sample_10k.tsv"


def require_shared(path: pathlib.Path) -> pathlib.Path:
    """Skip the calling test when a real-data fixture under :data:`SHARED_DATA` is absent."""
    if not path.exists():
        pytest.skip(f"real-data fixture {path} is absent (../shared/data is not next to this checkout; "
                    "point DLRMCTL_SHARED_DATA at it)")
    return path


@pytest.fixture(autouse=True, scope="session")
def _cwd_is_the_repository():
    """Tests name files relative to the repository (``configs/demo.yaml``): run them from its root,
    whatever directory pytest was started in (tests that need another cwd use ``monkeypatch.chdir``)."""
    before = os.getcwd()
    os.chdir(REPO)
    yield
    os.chdir(before)


def tiny_synthetic(tmp_path_factory, name: str, rows: int = 3000, seed: int = 2) -> str:
    """A small synthetic Criteo-schema dataset (26 tables of 40 ids) in a fresh temp directory
    ``name``: what the Trainer-level tests of one module share (call it from a module fixture)."""
    from dlrmctl.data.synthetic import generate_synthetic

    d = tmp_path_factory.mktemp(name)
    generate_synthetic(d, rows=rows, seed=seed, num_embeddings=[40] * 26)
    return str(d)


@pytest.fixture(autouse=True)
def _torch_threads():
    """Each test starts from seed 0 and the session's intra-op thread count: a verb run in-process
    (``train``, ``serve``, ``plan --calibrate``) sets the count from the machine's load at that
    moment, which would otherwise carry over into the tests after it (their float sums split
    differently, so what they compute would depend on the order and the load)."""
    import torch

    threads = torch.get_num_threads()
    torch.manual_seed(0)
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def one_error_line(args, *names) -> str:
    """Run ``dlrmctl ARGS`` in-process: exit 2, one ``error:`` line on stderr naming every one of
    ``names``, no traceback; on stdout nothing but the verb's step lines (``[export] 0.0 s ...``,
    :func:`dlrmctl.console.stage`) that came before the failure; returns the error line."""
    import re

    from typer.testing import CliRunner

    from dlrmctl.cli import app

    r = CliRunner().invoke(app, [str(a) for a in args])
    out, err = r.output.strip(), r.stderr.strip()
    assert r.exit_code == 2, (args, r.exit_code, out, r.exception)
    assert "Traceback" not in out and len(err.splitlines()) == 1, out
    assert err.startswith("error: "), out
    assert all(re.match(r"\[[\w-]+\] \d+\.\d s ", line) for line in r.stdout.strip().splitlines()), out
    for n in names:
        assert str(n) in err, (n, out)
    return err


class OnDevice:
    """A model output left on an accelerator: ``.numpy()`` refuses (as torch does for a CUDA
    tensor) until ``.cpu()`` brought it to the host."""

    def __init__(self, t):
        self.t = t

    def detach(self):
        return self

    def cpu(self):
        return self.t

    def numpy(self):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                        "to host memory first.")
