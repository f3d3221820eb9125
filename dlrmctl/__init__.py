"""dlrmctl: train, shard, plan and ship DLRM recommendation models.

Importing the package is light (no torch: ``dlrmctl --help`` starts fast).  The
first use of anything that needs torch checks that the installed ``torch`` /
``fbgemm_gpu`` pair loads together (see :mod:`dlrmctl._fbgemm`; reading
``dlrmctl.HAS_FBGEMM`` runs it).  A missing ``fbgemm_gpu`` is not an error: the
``dense`` embedding kernel (``torch.nn.EmbeddingBag``) is used instead.  An
installed but ABI-incompatible ``fbgemm_gpu`` *is* an error, raised by that check
with both versions and the pair to install.

Coming from TorchRec, these names import from ``dlrmctl`` as from ``torchrec``
(same signatures and argument order): ``JaggedTensor``, ``KeyedJaggedTensor``,
``KeyedTensor``, ``EmbeddingBagCollection``, ``EmbeddingBagConfig``,
``EmbeddingCollection``, ``EmbeddingConfig``, ``PoolingType``, ``DataType``; so do the modules
``dlrmctl.sparse.jagged_tensor``, ``dlrmctl.modules.embedding_configs`` and
``dlrmctl.modules.embedding_modules``.  They load on first access (``import
dlrmctl`` stays light).
"""

__version__ = "0.1.0"

def _torchrec_names() -> dict[str, str]:
    """Name -> defining module: the sparse types, and ``dlrmctl.modules``' own lazy table (no torch import)."""
    from dlrmctl.modules import _NAMES as modules

    sparse = dict.fromkeys(("JaggedTensor", "KeyedJaggedTensor", "KeyedTensor"), "dlrmctl.sparse.jagged_tensor")
    return {**sparse, **modules}


def __getattr__(name: str):  # PEP 562: TorchRec-compatible names, imported on first use
    if name == "HAS_FBGEMM":  # runs the torch / fbgemm_gpu check once (imports torch)
        from dlrmctl import _fbgemm

        return _fbgemm.HAS_FBGEMM
    mod = _torchrec_names().get(name)
    if mod is None:
        raise AttributeError(f"module 'dlrmctl' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


__all__ = ["HAS_FBGEMM", "__version__", *_torchrec_names()]
