"""Sparse inputs: JaggedTensor, KeyedJaggedTensor (key-major), KeyedTensor.

All three are pytree nodes (:mod:`dlrmctl.sparse.pytree`): ``torch.export`` programs may take
or return them.

Same names, signatures and argument order as ``torchrec.sparse.jagged_tensor``
(``from dlrmctl.sparse.jagged_tensor import KeyedJaggedTensor`` works as the
TorchRec import does).
"""

from dlrmctl.sparse.jagged_tensor import (
    JaggedTensor,
    KeyedJaggedTensor,
    KeyedTensor,
    SparseInputError,
    VariableBatchNotSupportedError,
)
from dlrmctl.sparse import pytree as _pytree  # noqa: F401  (registers the three types as pytree nodes)

__all__ = ["JaggedTensor", "KeyedJaggedTensor", "KeyedTensor", "SparseInputError", "VariableBatchNotSupportedError"]
