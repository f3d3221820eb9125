"""The constructors of :class:`~dlrmctl.sparse.keyed_jagged.KeyedJaggedTensor` that build one
from other containers or from nothing (TorchRec's ``from_lengths_sync``, ``from_offsets_sync``,
``from_jt_dict``, ``concat``, ``empty``, ``empty_like``), as classmethods of its base."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

import torch

from dlrmctl.sparse.jagged import JaggedTensor
from dlrmctl.sparse.jagged_checks import SparseInputError, VariableBatchNotSupportedError

if TYPE_CHECKING:
    from dlrmctl.sparse.keyed_jagged import KeyedJaggedTensor


class KeyedJaggedConstructors:
    """The constructors of :class:`~dlrmctl.sparse.keyed_jagged.KeyedJaggedTensor` (``cls`` is it)."""

    @classmethod
    def from_lengths_sync(
        cls,
        keys: Sequence[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None = None,
        stride: int | None = None,
        stride_per_key_per_rank: Sequence[Sequence[int]] | None = None,
        inverse_indices: tuple[list[str], torch.Tensor] | None = None,
    ) -> "KeyedJaggedTensor":
        """KJT from lengths, per-key lengths computed now (TorchRec's ``sync()``)."""
        return cls(keys, values, weights=weights, lengths=lengths, stride=stride,
                   stride_per_key_per_rank=stride_per_key_per_rank,
                   inverse_indices=inverse_indices).sync()

    from_lengths = from_lengths_sync

    @classmethod
    def from_offsets_sync(
        cls,
        keys: Sequence[str],
        values: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None = None,
        stride: int | None = None,
        stride_per_key_per_rank: Sequence[Sequence[int]] | None = None,
        inverse_indices: tuple[list[str], torch.Tensor] | None = None,
    ) -> "KeyedJaggedTensor":
        """KJT from offsets, per-key lengths computed now (TorchRec's ``sync()``)."""
        return cls(keys, values, weights=weights, offsets=offsets, stride=stride,
                   stride_per_key_per_rank=stride_per_key_per_rank,
                   inverse_indices=inverse_indices).sync()

    @classmethod
    def from_jt_dict(cls, jt_dict: Mapping[str, JaggedTensor]) -> "KeyedJaggedTensor":
        """Concatenate per-key JaggedTensors in dict order; keys with different batch sizes give
        a variable-batch KJT (``stride_per_key_per_rank = [[B_k]]``, no inverse indices), as in TorchRec.

        Raises:
            SparseInputError: some keys weighted and others not (TorchRec would misalign the weights).
        """
        keys = list(jt_dict)
        jts = [jt_dict[k] for k in keys]
        if not jts:
            return cls.empty()
        per_key = [jt.lengths().numel() for jt in jts]
        strides = set(per_key)
        has_w = [jt.weights_or_none() is not None for jt in jts]
        if any(has_w) and not all(has_w):
            raise SparseInputError("from_jt_dict: either all or none of the keys must have weights")
        return cls(
            keys,
            torch.cat([jt.values() for jt in jts]),
            weights=torch.cat([jt.weights() for jt in jts]) if all(has_w) else None,
            lengths=torch.cat([jt.lengths() for jt in jts]),
            length_per_key=[jt.values().size(0) for jt in jts],
            validate=False,
            **({"stride": strides.pop()} if len(strides) == 1 else {"stride_per_key_per_rank": [[n] for n in per_key]}),
        )

    @classmethod
    def concat(cls, kjt_list: Sequence["KeyedJaggedTensor"]) -> "KeyedJaggedTensor":
        """Keys of all KJTs side by side (same batch size), in list order.

        Raises:
            ValueError: empty list.  SparseInputError: weighted mixed with
            unweighted, or a key in more than one KJT.  VariableBatchNotSupportedError:
            different strides (TorchRec builds a VBE KJT).
        """
        kjts = list(kjt_list)
        if not kjts:
            raise ValueError("Can't concat empty KJT list")
        weighted = kjts[0].weights_or_none() is not None
        if any((k.weights_or_none() is not None) != weighted for k in kjts):
            raise SparseInputError("KeyedJaggedTensor.concat: can't merge weighted KJT with unweighted KJT")
        if any(k.variable_stride_per_key() for k in kjts):
            raise VariableBatchNotSupportedError("KeyedJaggedTensor.concat of variable-batch KJTs is not supported")
        strides = [k.stride() for k in kjts if k.keys()]
        if len(set(strides)) > 1:
            raise VariableBatchNotSupportedError(
                f"KeyedJaggedTensor.concat: strides {strides} differ (variable batch per key is not supported yet)"
            )
        keys = [key for k in kjts for key in k.keys()]
        dup = sorted({key for key in keys if keys.count(key) > 1})
        if dup:
            raise SparseInputError(f"KeyedJaggedTensor.concat: keys {dup} appear in more than one KJT")
        lpks = [k.length_per_key_or_none() for k in kjts]
        return cls(
            keys,
            torch.cat([k.values() for k in kjts], dim=0),
            weights=torch.cat([k.weights() for k in kjts], dim=0) if weighted else None,
            lengths=torch.cat([k.lengths() for k in kjts], dim=0),
            stride=strides[0] if strides else kjts[0].stride(),
            length_per_key=[x for lpk in lpks for x in lpk] if all(lpk is not None for lpk in lpks) else None,
            validate=False,
        )

    @classmethod
    def empty(
        cls,
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        values_dtype: torch.dtype | None = None,
        weights_dtype: torch.dtype | None = None,
        lengths_dtype: torch.dtype = torch.int32,
    ) -> "KeyedJaggedTensor":
        """A KJT with no keys and stride 0 (TorchRec defaults: values of the torch
        default dtype when ``values_dtype`` is None, int32 lengths)."""
        return cls(
            [],
            torch.empty(0, dtype=values_dtype, device=device),
            weights=torch.empty(0, dtype=weights_dtype, device=device) if is_weighted else None,
            lengths=torch.empty(0, dtype=lengths_dtype, device=device),
            stride=0,
            validate=False,
        )

    @classmethod
    def empty_like(cls, kjt: "KeyedJaggedTensor", device: torch.device | str | None = None) -> "KeyedJaggedTensor":
        """TorchRec semantics: with ``device=None`` a KJT with no keys, ``kjt``'s stride
        and ``kjt``'s dtypes and device; with a ``device``, ``kjt``'s keys and stride with
        uninitialised tensors of its shapes there (to be filled with :meth:`copy_`).

        Raises:
            VariableBatchNotSupportedError: a variable-batch KJT.
        """
        if kjt.variable_stride_per_key():
            raise VariableBatchNotSupportedError("KeyedJaggedTensor.empty_like of a variable-batch KJT")
        if device is None:
            dev = kjt.device()
            return cls(
                [],
                kjt._values.new_empty((0,) + tuple(kjt._values.shape[1:])),
                weights=None if kjt._weights is None else torch.empty(0, dtype=kjt._weights.dtype, device=dev),
                lengths=torch.empty(0, dtype=kjt._lengths.dtype, device=dev),
                stride=kjt._stride,
                validate=False,
            )
        return cls(
            kjt._keys,
            torch.empty_like(kjt._values, device=device),
            weights=None if kjt._weights is None else torch.empty_like(kjt._weights, device=device),
            lengths=torch.empty_like(kjt._lengths, device=device),
            offsets=None if kjt._offsets is None else torch.empty_like(kjt._offsets, device=device),
            stride=kjt._stride,
            length_per_key=kjt._length_per_key,
            validate=False,
        )
