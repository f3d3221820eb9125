"""JaggedTensor (one feature's bags) and the accessors it shares with KeyedJaggedTensor
(:mod:`dlrmctl.sparse.jagged_tensor` has the layouts and the checks)."""

from __future__ import annotations

from typing import Sequence

import torch

from dlrmctl.sparse.jagged_checks import (
    ORDER_HINT,
    SparseInputError,
    check_values,
    check_weights,
    index_tensor,
    pad_jagged,
    to_lengths,
    to_offsets,
    validate_contents,
)


class JaggedFields:
    """The accessors :class:`JaggedTensor` and :class:`~dlrmctl.sparse.keyed_jagged.KeyedJaggedTensor` share over their
    ``_values``, ``_lengths``, ``_offsets`` (made from the lengths on first use) and ``_weights``.
    Shapes: ``N`` values; ``L`` bags (a JaggedTensor's ``B``, a KeyedJaggedTensor's ``F * B``,
    key-major)."""

    _values: torch.Tensor
    _lengths: torch.Tensor
    _offsets: torch.Tensor | None
    _weights: torch.Tensor | None
    #: the error of :meth:`weights` when there are none
    _NO_WEIGHTS: str = "no weights"

    def values(self) -> torch.Tensor:
        """``[N]`` (or ``[N, ...]``) values (a KeyedJaggedTensor's key-major)."""
        return self._values

    def lengths(self) -> torch.Tensor:
        """``[L]`` bag lengths."""
        return self._lengths

    def lengths_or_none(self) -> torch.Tensor | None:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        """``[L + 1]`` offsets (computed from lengths on first use, same dtype)."""
        if self._offsets is None:
            self._offsets = to_offsets(self._lengths)
        return self._offsets

    def offsets_or_none(self) -> torch.Tensor | None:
        return self._offsets

    def weights(self) -> torch.Tensor:
        """``[N]`` per-value weights.

        Raises:
            SparseInputError: there are none (unweighted features).
        """
        if self._weights is None:
            raise SparseInputError(self._NO_WEIGHTS)
        return self._weights

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def _copy_tensors(self, other: "JaggedFields", non_blocking: bool) -> None:
        """Copy ``other``'s values, lengths, weights (when both have them) and offsets (when this one
        has them) into this one's tensors, in place (same shapes)."""
        self._values.copy_(other._values, non_blocking=non_blocking)
        self._lengths.copy_(other._lengths, non_blocking=non_blocking)
        if self._weights is not None and other._weights is not None:
            self._weights.copy_(other._weights, non_blocking=non_blocking)
        if self._offsets is not None:
            self._offsets.copy_(other.offsets(), non_blocking=non_blocking)


class JaggedTensor(JaggedFields):
    """One feature's bags: ``values [N, ...]`` split into ``B`` bags by ``lengths [B]``.

    Same signature and argument order as ``torchrec.JaggedTensor``.

    Args:
        values: ``[N]`` ids (any dtype) or ``[N, ...]`` rows, e.g. ``[N, D]``
            dense sequence values; lengths count rows.
        weights: optional ``[N]`` floating-point per-row weights.
        lengths: ``[B]`` integer bag lengths, ``sum(lengths) == N``.
        offsets: ``[B + 1]`` integer offsets (exclusive cumsum of lengths,
            ``offsets[0] == 0``, ``offsets[-1] == N``).  Give lengths, offsets
            or both (then they must agree).
        validate: (keyword-only, dlrmctl) check tensor contents too (one host
            sync on CUDA); shape / dtype checks always run.

    Raises:
        SparseInputError: neither lengths nor offsets; lengths/offsets not
            integer; negative lengths; ``sum(lengths) != N``; offsets not
            consistent with lengths / values; weights not floating point or
            not one per row.  (TorchRec accepts all of these silently.)
    """

    _NO_WEIGHTS = "JaggedTensor has no weights"

    def __init__(
        self,
        values: torch.Tensor,
        weights: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
        *,
        validate: bool = True,
    ) -> None:
        who = "JaggedTensor"
        check_values(values, who)
        lengths = index_tensor(lengths, "lengths", who)
        offsets = index_tensor(offsets, "offsets", who)
        if lengths is None and offsets is None:
            raise SparseInputError(f"{who} needs lengths or offsets{ORDER_HINT if weights is not None else ''}")
        if offsets is not None and offsets.numel() == 0:
            # TorchRec's empty(): offsets=[] for zero bags
            if lengths is not None and lengths.numel() != 0:
                raise SparseInputError(f"{who}: offsets is empty but there are {lengths.numel()} lengths")
            lengths = offsets if lengths is None else lengths
            offsets = None
        given_offsets = offsets is not None
        given_lengths = lengths is not None
        if lengths is None:
            lengths = to_lengths(offsets)
        elif offsets is not None and offsets.numel() != lengths.numel() + 1:
            raise SparseInputError(
                f"{who}: len(offsets)={offsets.numel()} != len(lengths)+1={lengths.numel() + 1}"
            )
        check_weights(weights, values, who)
        self._values = values
        self._weights = weights
        self._lengths = lengths
        self._offsets = offsets
        if validate:
            validate_contents(who, values.size(0), lengths, offsets if given_offsets else None, given_lengths)

    # --------------------------------------------------------------- accessors
    def device(self) -> torch.device:
        return self._values.device

    def size_in_bytes(self) -> int:
        """Bytes held by values, weights, lengths and (if materialised) offsets."""
        return sum(t.element_size() * t.numel() for t in (self._values, self._weights, self._lengths, self._offsets)
                   if t is not None)

    # ------------------------------------------------------------ constructors
    @staticmethod
    def empty(
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        values_dtype: torch.dtype | None = None,
        weights_dtype: torch.dtype | None = None,
        lengths_dtype: torch.dtype = torch.int32,
    ) -> "JaggedTensor":
        """A JaggedTensor with no bags (TorchRec defaults: values of the torch default
        dtype when ``values_dtype`` is None, int32 lengths)."""
        return JaggedTensor(
            torch.empty(0, dtype=values_dtype, device=device),
            weights=torch.empty(0, dtype=weights_dtype, device=device) if is_weighted else None,
            lengths=torch.empty(0, dtype=lengths_dtype, device=device),
            validate=False,
        )

    @staticmethod
    def empty_like(jt: "JaggedTensor", device: torch.device | str | None = None) -> "JaggedTensor":
        """TorchRec semantics: with ``device=None`` a JaggedTensor with no bags and the
        dtypes (and trailing value dims) of ``jt``; with a ``device``, uninitialised
        tensors of ``jt``'s shapes there (to be filled with :meth:`copy_`)."""
        if device is None:
            dev = jt.device()
            return JaggedTensor(
                jt._values.new_empty((0,) + tuple(jt._values.shape[1:])),
                weights=None if jt._weights is None else jt._weights.new_empty((0,) + tuple(jt._weights.shape[1:])),
                lengths=torch.empty(0, dtype=jt._lengths.dtype, device=dev),
                validate=False,
            )
        return JaggedTensor(
            torch.empty_like(jt._values, device=device),
            weights=None if jt._weights is None else torch.empty_like(jt._weights, device=device),
            lengths=torch.empty_like(jt._lengths, device=device),
            offsets=None if jt._offsets is None else torch.empty_like(jt._offsets, device=device),
            validate=False,
        )

    def copy_(self, jt: "JaggedTensor", non_blocking: bool = False) -> "JaggedTensor":
        """In-place copy of ``jt``'s tensors into this one's (same shapes); returns self."""
        self._copy_tensors(jt, non_blocking)
        return self

    @staticmethod
    def from_dense_lengths(
        values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None = None
    ) -> "JaggedTensor":
        """Bag ``b`` is the first ``lengths[b]`` rows of ``values[b]``.

        Args:
            values: ``[B, N, ...]`` padded values.
            lengths: ``[B]`` integer, ``0 <= lengths[b] <= N``.
            weights: optional ``[B, N]`` weights, masked the same way.

        Raises:
            SparseInputError: shapes disagree, or a length is negative or larger
                than ``N`` (TorchRec silently builds an inconsistent JaggedTensor).
        """
        who = "JaggedTensor.from_dense_lengths"
        if values.dim() < 2:
            raise SparseInputError(f"{who}: values must be [B, N, ...], got shape {tuple(values.shape)}")
        lengths = index_tensor(lengths, "lengths", who)
        b, n = values.size(0), values.size(1)
        if lengths.numel() != b:
            raise SparseInputError(f"{who}: {lengths.numel()} lengths for {b} rows of values")
        if weights is not None and tuple(weights.shape[:2]) != (b, n):
            raise SparseInputError(f"{who}: weights shape {tuple(weights.shape)} does not start with [B, N]=[{b}, {n}]")
        if b:
            lo, hi = (int(x) for x in torch.stack([lengths.min(), lengths.max()]).tolist())
            if lo < 0 or hi > n:
                bad = lo if lo < 0 else hi
                raise SparseInputError(f"{who}: length {bad} outside [0, N={n}]")
        mask = torch.arange(n, device=values.device).expand(b, n) < lengths.unsqueeze(-1)
        return JaggedTensor(values[mask], weights=None if weights is None else weights[mask], lengths=lengths,
                            validate=False)

    @staticmethod
    def from_dense(values: Sequence[torch.Tensor], weights: Sequence[torch.Tensor] | None = None) -> "JaggedTensor":
        """One bag per tensor of ``values`` (each ``[n_b, ...]``); lengths int32 as in TorchRec.

        Raises:
            SparseInputError: no tensors, or ``weights`` not one tensor per bag with one weight per row.
        """
        who = "JaggedTensor.from_dense"
        values = list(values)
        if not values:
            raise SparseInputError(f"{who}: needs at least one tensor (the bags' dtype comes from them)")
        vals = torch.cat(values, dim=0)
        lengths = torch.tensor([v.size(0) for v in values], dtype=torch.int32, device=vals.device)
        w = None
        if weights is not None:
            weights = list(weights)
            if len(weights) != len(values) or any(wi.size(0) != vi.size(0) for wi, vi in zip(weights, values)):
                raise SparseInputError(
                    f"{who}: weights must be one tensor per bag with one weight per value, got lengths "
                    f"{[int(wi.size(0)) for wi in weights]} for bags of {[int(vi.size(0)) for vi in values]}"
                )
            w = torch.cat(weights, dim=0)
        return JaggedTensor(vals, weights=w, lengths=lengths, validate=False)

    # ------------------------------------------------------------- conversions
    def to_dense(self) -> list[torch.Tensor]:
        """List of ``B`` tensors, one per bag (``[lengths[b], ...]``)."""
        return list(torch.split(self._values, self._lengths.tolist()))

    def to_dense_weights(self) -> list[torch.Tensor] | None:
        """List of ``B`` weight tensors, one per bag; None without weights."""
        if self._weights is None:
            return None
        return list(torch.split(self._weights, self._lengths.tolist()))

    def _padded_length(self, desired_length: int | None) -> int:
        if desired_length is not None:
            if desired_length < 0:
                raise SparseInputError(f"desired_length must be >= 0, got {desired_length}")
            return int(desired_length)
        return int(self._lengths.max()) if self._lengths.numel() else 0

    def to_padded_dense(self, desired_length: int | None = None, padding_value: float = 0.0) -> torch.Tensor:
        """``[B, L, ...]``: bag ``b`` in row ``b``, padded with ``padding_value`` or truncated
        to ``L = desired_length`` (default: the longest bag; one host sync on CUDA)."""
        n = self._padded_length(desired_length)
        return pad_jagged(self._values, self._lengths, self.offsets(), n, padding_value)

    def to_padded_dense_weights(
        self, desired_length: int | None = None, padding_value: float = 0.0
    ) -> torch.Tensor | None:
        """Like :meth:`to_padded_dense` for the weights; None without weights."""
        if self._weights is None:
            return None
        n = self._padded_length(desired_length)
        return pad_jagged(self._weights, self._lengths, self.offsets(), n, padding_value)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "JaggedTensor":
        mv = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return JaggedTensor(mv(self._values), weights=mv(self._weights), lengths=mv(self._lengths),
                            offsets=mv(self._offsets), validate=False)

    def record_stream(self, stream: "torch.cuda.Stream") -> None:
        for t in (self._values, self._weights, self._lengths, self._offsets):
            if t is not None:
                t.record_stream(stream)

    def __repr__(self) -> str:
        return f"JaggedTensor(values={self._values}, lengths={self._lengths}, weights={self._weights})"
