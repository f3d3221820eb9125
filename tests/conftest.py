import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
CRITEO_10K = SHARED_DATA / "criteo" / "criteo_kaggle_sample_10k.tsv"


def require_shared(path: pathlib.Path) -> pathlib.Path:
    """Skip the calling test when a ../shared/data fixture is absent."""
    if not path.exists():
        pytest.skip(f"real-data fixture {path} is absent (../shared/data is not next to this checkout)")
    return path


@pytest.fixture(autouse=True)
def _torch_threads():
    import torch

    torch.manual_seed(0)
    yield
