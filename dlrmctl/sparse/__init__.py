"""Sparse inputs: JaggedTensor, KeyedJaggedTensor (key-major), KeyedTensor.

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

__all__ = ["JaggedTensor", "KeyedJaggedTensor", "KeyedTensor", "SparseInputError", "VariableBatchNotSupportedError"]
