"""Sparse inputs: JaggedTensor, KeyedJaggedTensor (key-major), KeyedTensor."""

from dlrmctl.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor, SparseInputError

__all__ = ["JaggedTensor", "KeyedJaggedTensor", "KeyedTensor", "SparseInputError"]
