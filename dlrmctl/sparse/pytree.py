"""``JaggedTensor``, ``KeyedJaggedTensor`` and ``KeyedTensor`` as pytree nodes.

Registered when :mod:`dlrmctl.sparse` is imported (as TorchRec registers its own types), so
``torch.export.export`` / ``torch.compile`` / ``torch.utils._pytree`` see through them: a
program may take or return them, and their tensors become the graph's flat inputs/outputs.

Flattening (children, in order; ``None`` for an absent tensor; context = the static part):

* ``JaggedTensor``: ``[values, weights, lengths, offsets]``, context ``None``;
* ``KeyedJaggedTensor``: ``[values, weights, lengths, offsets]``, context the keys (the batch size
  is recomputed from ``len(lengths) / len(keys)``, so it may be a dynamic dimension).  A
  variable-batch (VBE) KJT is not flattenable: :class:`~dlrmctl.sparse.SparseInputError`;
* ``KeyedTensor``: ``[values]``, context ``(keys, length_per_key, key_dim)``.

Unflattening skips the content checks (``validate=False``): the tensors come from a flatten of a
checked object, or from inside a traced program where contents are symbolic.
"""

from __future__ import annotations

import json
from typing import Any

import torch.utils._pytree as pytree

from dlrmctl.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor, SparseInputError

_JT_FIELDS = ("values", "weights", "lengths", "offsets")


def _jt_flatten(jt: JaggedTensor) -> tuple[list[Any], None]:
    return [jt._values, jt._weights, jt._lengths, jt._offsets], None


def _jt_unflatten(children: list[Any], context: None) -> JaggedTensor:
    v, w, ln, off = children
    return JaggedTensor(v, weights=w, lengths=ln, offsets=off, validate=False)


def _kjt_flatten(kjt: KeyedJaggedTensor) -> tuple[list[Any], list[str]]:
    if kjt.variable_stride_per_key():
        raise SparseInputError("KeyedJaggedTensor with a variable batch per key (VBE) cannot be flattened as a "
                               "pytree; call to_uniform_stride() first")
    return [kjt._values, kjt._weights, kjt._lengths, kjt._offsets], list(kjt._keys)


def _kjt_unflatten(children: list[Any], keys: list[str]) -> KeyedJaggedTensor:
    v, w, ln, off = children
    return KeyedJaggedTensor(keys, v, weights=w, lengths=ln, offsets=off, validate=False)


def _kt_flatten(kt: KeyedTensor) -> tuple[list[Any], tuple[list[str], list[int], int]]:
    return [kt._values], (list(kt._keys), list(kt._length_per_key), int(kt._key_dim))


def _kt_unflatten(children: list[Any], context: tuple[list[str], list[int], int]) -> KeyedTensor:
    keys, lpk, key_dim = context
    return KeyedTensor(keys, lpk, children[0], key_dim=key_dim)


def _with_keys(flatten, names):
    def fn(obj):
        children, ctx = flatten(obj)
        return [(pytree.GetAttrKey(n), c) for n, c in zip(names, children)], ctx
    return fn


def _kt_context_from_json(ctx: Any) -> tuple[list[str], list[int], int]:
    keys, lpk, key_dim = ctx
    return list(keys), [int(n) for n in lpk], int(key_dim)


def register() -> None:
    """Register the three types with ``torch.utils._pytree`` (idempotent).  Their contexts (keys,
    lengths per key) are JSON, so a saved program's tree spec loads under ``torch.export.load``'s
    weights-only unpickler; the three classes are also allowed to that unpickler
    (``torch.serialization.add_safe_globals``), since a saved program keeps its example inputs."""
    import torch.serialization

    torch.serialization.add_safe_globals([JaggedTensor, KeyedJaggedTensor, KeyedTensor])
    for cls, flat, unflat, names, from_json in (
        (JaggedTensor, _jt_flatten, _jt_unflatten, _JT_FIELDS, lambda c: None),
        (KeyedJaggedTensor, _kjt_flatten, _kjt_unflatten, _JT_FIELDS, lambda c: [str(k) for k in c]),
        (KeyedTensor, _kt_flatten, _kt_unflatten, ("values",), _kt_context_from_json),
    ):
        if cls in pytree.SUPPORTED_NODES:
            continue
        pytree.register_pytree_node(cls, flat, unflat, serialized_type_name=f"dlrmctl.sparse.{cls.__name__}",
                                    to_dumpable_context=lambda c: json.dumps(c),
                                    from_dumpable_context=lambda s, _f=from_json: _f(json.loads(s)),
                                    flatten_with_keys_fn=_with_keys(flat, names))


register()
