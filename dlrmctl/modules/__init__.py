"""Model modules.  ``EmbeddingBagCollection``, ``EmbeddingBagConfig``, ``EmbeddingCollection``,
``EmbeddingConfig``, ``PoolingType`` and ``DataType`` import from here as from ``torchrec.modules`` (loaded on first access)."""

_NAMES = {
    "EmbeddingBagCollection": "dlrmctl.modules.embedding_modules",
    "EmbeddingBagConfig": "dlrmctl.modules.embedding_configs",
    "EmbeddingCollection": "dlrmctl.modules.sequence_embeddings",
    "EmbeddingConfig": "dlrmctl.modules.embedding_configs",
    "PoolingType": "dlrmctl.modules.embedding_configs",
    "DataType": "dlrmctl.modules.embedding_configs",
}


def __getattr__(name: str):  # PEP 562
    mod = _NAMES.get(name)
    if mod is None:
        raise AttributeError(f"module 'dlrmctl.modules' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(mod), name)


__all__ = list(_NAMES)
