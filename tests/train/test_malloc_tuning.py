"""``train.malloc_tuning`` (issue 17): glibc ``mallopt`` for the training process, so freed step
tensors are reused instead of being unmapped and page-faulted in again every step."""

from __future__ import annotations

import ctypes
import platform

import pytest

from dlrmctl.config import config_from_dict
from dlrmctl.train import malloc_tuning, trainer
from dlrmctl.distributed.env import RunEnv
from dlrmctl.train.trainer import Trainer
from dlrmctl.train.run_dir import prepare_run_dir

from tests.conftest import tiny_synthetic


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_synthetic(tmp_path_factory, "tiny_malloc", rows=1500, seed=3)


def test_tuning_applies_on_glibc_once():
    r = malloc_tuning.tune_glibc_malloc()
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert r is True
        assert malloc_tuning.tune_glibc_malloc() is True  # idempotent
    else:
        assert r is False


def test_another_c_library_is_left_alone(monkeypatch):
    """No gnu_get_libc_version (musl, macOS): False, mallopt never called, no exception; a C
    library that cannot be loaded: False too."""
    monkeypatch.setattr(malloc_tuning, "_done", False)

    class NotGlibc:
        def __getattr__(self, name):
            if name == "mallopt":
                raise AssertionError("mallopt called on a non-glibc C library")
            raise AttributeError(name)

    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: NotGlibc())
    assert malloc_tuning.tune_glibc_malloc() is False

    def unloadable(*a, **k):
        raise OSError("no C library")

    monkeypatch.setattr(ctypes, "CDLL", unloadable)
    assert malloc_tuning.tune_glibc_malloc() is False


def test_the_trainer_calls_it_only_when_the_key_is_on(tiny, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(trainer, "tune_glibc_malloc", lambda: calls.append(1))
    for on in (True, False):
        cfg = config_from_dict({
            "name": f"mt_{on}", "data": {"path": tiny, "batch_size": 256},
            "model": {"embedding_dim": 8, "dense_arch_layer_sizes": [32, 8], "over_arch_layer_sizes": [32, 1]},
            "train": {"run_dir": str(tmp_path), "progress": False, "malloc_tuning": on},
        })
        Trainer(cfg, RunEnv(), prepare_run_dir(cfg, resume=False, overwrite=False))
    assert calls == [1]
