"""Sparse input containers: JaggedTensor, KeyedJaggedTensor, KeyedTensor.

Signatures (argument names *and* positional order) and method semantics follow
TorchRec's ``torchrec.sparse.jagged_tensor``, so TorchRec code runs unchanged,
whether it passes arguments by keyword or by position::

    JaggedTensor(values, weights=None, lengths=None, offsets=None)
    KeyedJaggedTensor(keys, values, weights=None, lengths=None, offsets=None, stride=None, ...)
    KeyedTensor(keys, length_per_key, values, key_dim=1, ...)

dlrmctl-only arguments (``validate``) are keyword-only, after TorchRec's.

Layouts:

* ``KeyedJaggedTensor`` is *key-major*: for keys ``[f0, f1]`` and batch size
  ``B`` the lengths are ``[f0_b0 .. f0_b{B-1}, f1_b0 .. f1_b{B-1}]`` and the
  values of all bags of ``f0`` come before those of ``f1``.
  ``stride() == len(lengths) // len(keys) == B``.
* ``values`` is ``[N]`` (ids) or ``[N, ...]`` (e.g. ``[N, D]`` dense sequence
  values); lengths count rows of ``values`` (its first dimension).  ``weights``
  has one entry per row: ``[N]`` (or the shape of ``values``), floating point.
* ``KeyedTensor`` holds pooled embeddings of several keys side by side:
  ``values() [B, sum(length_per_key)]`` (``key_dim=1``).

Index tensors (lengths, offsets) may be any integer dtype; dlrmctl's own
producers (the data loader) make int64.

Validation -- where dlrmctl is stricter than TorchRec.  TorchRec validates
nothing ("you should always pass in the valid lengths, offsets"), so an
inconsistent input is silently accepted and fails later, or worse, computes
garbage.  dlrmctl raises :class:`SparseInputError` naming the problem:

* always (host metadata only, no device sync): lengths/offsets not integer
  tensors (the usual symptom of arguments given in another order),
  ``len(lengths)`` not ``len(keys) * stride``, ``len(offsets) != len(lengths) + 1``,
  weights not floating point or not one per value row, ``length_per_key`` /
  ``offset_per_key`` / ``index_per_key`` / ``stride_per_key`` /
  ``lengths_offset_per_key`` inconsistent with the keys, stride or values;
* unless ``validate=False`` (these read tensor contents: one host sync on
  CUDA): negative lengths, ``sum(lengths) != len(values)``, offsets not
  starting at 0 / decreasing / not ending at ``len(values)`` / disagreeing with
  lengths, ``length_per_key`` disagreeing with the lengths.

``validate=False`` is for producers that already guarantee the invariants (the
loader, KJT transforms): construction then never synchronises with the device.

The classes live one per module (:mod:`dlrmctl.sparse.jagged`, :mod:`dlrmctl.sparse.keyed_jagged`,
:mod:`dlrmctl.sparse.keyed_tensor`; the checks in :mod:`dlrmctl.sparse.jagged_checks`); this module
re-exports them under TorchRec's module name.
"""

from dlrmctl.sparse.jagged import JaggedTensor
from dlrmctl.sparse.jagged_checks import SparseInputError, VariableBatchNotSupportedError, host_to_device
from dlrmctl.sparse.keyed_jagged import KeyedJaggedTensor, split_variable_batch
from dlrmctl.sparse.keyed_tensor import KeyedTensor, expand_by_inverse_indices

__all__ = ["JaggedTensor", "KeyedJaggedTensor", "KeyedTensor", "SparseInputError", "VariableBatchNotSupportedError",
           "expand_by_inverse_indices", "host_to_device", "split_variable_batch"]
