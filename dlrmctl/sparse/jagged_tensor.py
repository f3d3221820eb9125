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
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch


class SparseInputError(ValueError):
    """A sparse input (keys / lengths / offsets / values / weights) is inconsistent."""


class VariableBatchNotSupportedError(SparseInputError, NotImplementedError):
    """An operation not available for variable-batch-per-key KJTs (``concat``, ``empty_like``)."""


_INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
_ORDER_HINT = (
    "; note the argument order is TorchRec's: KeyedJaggedTensor(keys, values, weights, lengths, offsets) / "
    "JaggedTensor(values, weights, lengths, offsets) -- pass lengths= and weights= by keyword"
)


def host_to_device(values: Sequence[int] | Sequence[float], dtype: torch.dtype,
                   device: torch.device | str) -> torch.Tensor:
    """A small host list as a tensor on ``device`` without blocking the host: on CUDA it is
    staged in pinned memory and copied with ``non_blocking`` (``torch.tensor(list, device=cuda)``
    copies from pageable memory, which waits for the device)."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(list(values), dtype=dtype).to(device)  # (host memory: a no-op move)
    return torch.tensor(list(values), dtype=dtype).pin_memory().to(device, non_blocking=True)


def _to_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """``[N]`` lengths -> ``[N+1]`` offsets (exclusive cumsum), same dtype."""
    out = torch.empty(lengths.numel() + 1, dtype=lengths.dtype, device=lengths.device)
    out[:1].zero_()  # only the leading 0: the cumsum writes the rest (no fill of the whole buffer)
    torch.cumsum(lengths, dim=0, out=out[1:])
    return out


def _to_lengths(offsets: torch.Tensor) -> torch.Tensor:
    return offsets[1:] - offsets[:-1]


def _cumsum(xs: Sequence[int]) -> list[int]:
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out


def _check_values(values: torch.Tensor, who: str) -> None:
    if not isinstance(values, torch.Tensor):
        raise SparseInputError(f"{who}: values must be a torch.Tensor, got {type(values).__name__}")
    if values.dim() == 0:
        raise SparseInputError(f"{who}: values must be at least 1-D ([N] or [N, ...]), got a 0-d tensor")


def _index_tensor(t: torch.Tensor | None, what: str, who: str) -> torch.Tensor | None:
    """Check a lengths / offsets argument: a 1-D integer tensor (an empty one of any dtype is accepted,
    as in TorchRec, and becomes int64)."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise SparseInputError(f"{who}: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise SparseInputError(f"{who}: {what} must be 1-D, got shape {tuple(t.shape)}")
    if t.dtype not in _INT_DTYPES:
        if t.numel() == 0:
            return t.to(torch.int64)
        raise SparseInputError(f"{who}: {what} must be an integer tensor, got {t.dtype}{_ORDER_HINT}")
    if t.dtype in (torch.int8, torch.uint8, torch.int16):
        return t.to(torch.int32)  # their cumsum (offsets) would overflow
    return t


def _check_weights(weights: torch.Tensor | None, values: torch.Tensor, who: str) -> None:
    if weights is None:
        return
    if not isinstance(weights, torch.Tensor):
        raise SparseInputError(f"{who}: weights must be a torch.Tensor, got {type(weights).__name__}")
    if not weights.is_floating_point():
        raise SparseInputError(
            f"{who}: weights must be floating point (per-id weights), got {weights.dtype}{_ORDER_HINT}"
        )
    if weights.dim() == 0 or weights.size(0) != values.size(0):
        n_w = weights.size(0) if weights.dim() else 0
        raise SparseInputError(
            f"{who}: len(weights)={n_w} != len(values)={values.size(0)}; weights are one per id"
        )


def _pad_jagged(x: torch.Tensor, lengths: torch.Tensor, offsets: torch.Tensor, n: int, pad: float) -> torch.Tensor:
    """Jagged ``x [total, ...]`` -> ``[B, n, ...]``: bag ``b`` in row ``b``, truncated / padded to ``n``.

    No host sync: rows past ``n`` are written to a scratch slot that is dropped.
    """
    b = lengths.numel()
    rest = tuple(x.shape[1:])
    flat = x.new_full((b * n + 1,) + rest, pad)
    total = x.size(0)
    if total and b and n:
        dev = x.device
        row = torch.repeat_interleave(torch.arange(b, device=dev), lengths.long(), output_size=total)
        pos = torch.arange(total, device=dev) - offsets[:-1].long()[row]
        idx = torch.where(pos < n, row * n + pos, torch.full_like(pos, b * n))
        flat.index_copy_(0, idx, x)
    return flat[: b * n].view((b, n) + rest)


class _JaggedFields:
    """The accessors :class:`JaggedTensor` and :class:`KeyedJaggedTensor` share over their
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
            self._offsets = _to_offsets(self._lengths)
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


class JaggedTensor(_JaggedFields):
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
        _check_values(values, who)
        lengths = _index_tensor(lengths, "lengths", who)
        offsets = _index_tensor(offsets, "offsets", who)
        if lengths is None and offsets is None:
            raise SparseInputError(f"{who} needs lengths or offsets{_ORDER_HINT if weights is not None else ''}")
        if offsets is not None and offsets.numel() == 0:
            # TorchRec's empty(): offsets=[] for zero bags
            if lengths is not None and lengths.numel() != 0:
                raise SparseInputError(f"{who}: offsets is empty but there are {lengths.numel()} lengths")
            lengths = offsets if lengths is None else lengths
            offsets = None
        given_offsets = offsets is not None
        given_lengths = lengths is not None
        if lengths is None:
            lengths = _to_lengths(offsets)
        elif offsets is not None and offsets.numel() != lengths.numel() + 1:
            raise SparseInputError(
                f"{who}: len(offsets)={offsets.numel()} != len(lengths)+1={lengths.numel() + 1}"
            )
        _check_weights(weights, values, who)
        self._values = values
        self._weights = weights
        self._lengths = lengths
        self._offsets = offsets
        if validate:
            _validate_contents(who, values.size(0), lengths, offsets if given_offsets else None, given_lengths)

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
        self._values.copy_(jt._values, non_blocking=non_blocking)
        self._lengths.copy_(jt._lengths, non_blocking=non_blocking)
        if self._weights is not None and jt._weights is not None:
            self._weights.copy_(jt._weights, non_blocking=non_blocking)
        if self._offsets is not None:
            self._offsets.copy_(jt.offsets(), non_blocking=non_blocking)
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
        lengths = _index_tensor(lengths, "lengths", who)
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
        return _pad_jagged(self._values, self._lengths, self.offsets(), n, padding_value)

    def to_padded_dense_weights(
        self, desired_length: int | None = None, padding_value: float = 0.0
    ) -> torch.Tensor | None:
        """Like :meth:`to_padded_dense` for the weights; None without weights."""
        if self._weights is None:
            return None
        n = self._padded_length(desired_length)
        return _pad_jagged(self._weights, self._lengths, self.offsets(), n, padding_value)

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


def _validate_contents(
    who: str,
    n_values: int,
    lengths: torch.Tensor,
    offsets: torch.Tensor | None,
    lengths_given: bool,
    nk: int = 0,
    stride: int = 0,
    keys: Sequence[str] = (),
    segments: Sequence[int] | None = None,
) -> list[int] | None:
    """The checks that read tensor contents, with one host sync.

    Returns the per-key lengths (``nk > 0``) so the caller can cache them.
    """
    parts = []
    n_len = lengths.numel()
    if n_len:
        parts.append((lengths < 0).any().view(1).long())
        if nk and segments is not None:  # variable batch per key: key k owns segments[k] bags
            key_of_bag = torch.repeat_interleave(
                torch.arange(nk, device=lengths.device), torch.tensor(list(segments), device=lengths.device),
                output_size=n_len)
            parts.append(torch.zeros(nk, dtype=torch.long, device=lengths.device)
                         .index_add_(0, key_of_bag, lengths.long()))
        elif nk:
            parts.append(lengths.view(nk, stride).sum(dim=1).long())
        else:
            parts.append(lengths.sum().view(1).long())
    if offsets is not None:
        parts.append(offsets[:1].long())
        if lengths_given:
            parts.append((_to_lengths(offsets) != lengths).any().view(1).long())
    stats = torch.cat(parts).tolist() if parts else []
    i = 0
    per_key: list[int] = [0] * nk
    total = 0
    if n_len:
        neg = stats[0]
        sums = stats[1 : 1 + (nk or 1)]
        i = 1 + (nk or 1)
        if neg:
            bad = int(torch.nonzero(lengths < 0)[0])
            if offsets is not None and not lengths_given:
                raise SparseInputError(
                    f"{who}: offsets decrease at position {bad} ({int(offsets[bad])} -> {int(offsets[bad + 1])}); "
                    "offsets must be non-decreasing"
                )
            if nk and segments is not None:
                k = next(i for i, e in enumerate(_cumsum(segments)[1:]) if bad < e)
                raise SparseInputError(
                    f"{who}: negative length {int(lengths[bad])} for key '{keys[k]}', "
                    f"sample {bad - _cumsum(segments)[k]}"
                )
            if nk:
                raise SparseInputError(
                    f"{who}: negative length {int(lengths[bad])} for key '{keys[bad // max(stride, 1)]}', "
                    f"sample {bad % max(stride, 1)}"
                )
            raise SparseInputError(f"{who}: lengths must be >= 0, got {int(lengths[bad])} at position {bad}")
        total = sum(sums)
        if nk:
            per_key = sums
    if offsets is not None:
        first = stats[i]
        if first != 0:
            raise SparseInputError(f"{who}: offsets must start at 0, got {first}")
        if lengths_given and stats[i + 1]:
            bad = int(torch.nonzero(_to_lengths(offsets) != lengths)[0])
            where = f"position {bad}"
            if nk and segments is None and stride:
                where += f" (key '{keys[bad // stride]}', sample {bad % stride})"
            raise SparseInputError(
                f"{who}: offsets and lengths disagree first at {where}: lengths[{bad}] = {int(lengths[bad])} but "
                f"offsets[{bad + 1}] - offsets[{bad}] = {int(offsets[bad + 1]) - int(offsets[bad])}"
            )
    if total != n_values:
        what = "offsets[-1]" if offsets is not None and not lengths_given else "sum(lengths)"
        raise SparseInputError(f"{who}: {what}={total} != len(values)={n_values}")
    return per_key if nk else None


class KeyedJaggedTensor(_JaggedFields):
    """Several sparse features of one batch in one key-major jagged layout.

    Same signature and argument order as ``torchrec.KeyedJaggedTensor``; the
    arguments after ``stride`` are TorchRec's caches (``length_per_key`` ...),
    accepted and checked against the rest.

    Args:
        keys: feature names, ``F`` of them.
        values: ``[N]`` ids of all bags, key-major (or ``[N, ...]`` rows).
        weights: optional ``[N]`` floating-point per-id weights (weighted features).
        lengths: ``[F * B]`` integer bag lengths, key-major.
        offsets: ``[F * B + 1]`` exclusive cumsum of lengths.  Give lengths,
            offsets, both (they must agree), or neither: then every bag is
            empty -- ``stride`` bags per key, ``stride`` defaulting to 0 as in
            TorchRec -- and values must be empty.
        stride: batch size ``B``; default as TorchRec: 0 without keys, else
            ``(len(offsets) - 1) // F`` or ``len(lengths) // F``.
        stride_per_key_per_rank: variable batch per key (TorchRec's VBE): per
            key, the number of bags coming from each rank (one entry on a single
            process); key ``k`` then has ``sum(stride_per_key_per_rank[k])`` bags,
            the lengths are the keys' bags one key after the other, and
            ``stride`` is the largest per-key batch size.
        stride_per_key: bags per key; all equal, or different (a VBE KJT on one rank).
        length_per_key: number of values of each key (``F`` ints).
        lengths_offset_per_key: ``[0, B, 2B, ..., F*B]`` if given.
        offset_per_key: ``[0, cumsum(length_per_key)...]`` (``F + 1`` ints).
        index_per_key: ``{key: position}``.
        jt_dict: cached :meth:`to_dict` result (its keys must be ``keys``).
        inverse_indices: VBE only: ``(keys, [F, B_full] int tensor)``: row of key
            ``k`` (``< stride_per_key[k]``) holding sample ``b`` of the full batch;
            :class:`~dlrmctl.modules.embedding_modules.EmbeddingBagCollection` and the
            sharded EBC expand their pooled output back to ``B_full`` rows with it.
        validate: (keyword-only, dlrmctl) also check tensor contents (one host
            sync on CUDA).  Pass False on hot paths whose producer guarantees
            the invariants; construction then never syncs.

    Raises:
        SparseInputError: ``len(lengths)`` is not ``len(keys) * stride`` (the message
            names the stride and the expected count when ``stride`` is given);
            lengths/offsets not integer tensors; a negative length;
            ``sum(lengths) != len(values)``; offsets inconsistent; weights not
            floating point or ``len(weights) != len(values)``; a cache argument
            inconsistent.  Each message names what was expected.  TorchRec
            accepts all of these silently.
        SparseInputError (VBE): lengths not adding up to the per-key batch sizes,
            inverse indices of the wrong shape / keys / device or (``validate``) out of
            a key's range.
    """

    _NO_WEIGHTS = "KeyedJaggedTensor has no weights (unweighted features)"

    def __init__(
        self,
        keys: Sequence[str],
        values: torch.Tensor,
        weights: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
        stride: int | None = None,
        stride_per_key_per_rank: Sequence[Sequence[int]] | torch.Tensor | None = None,
        stride_per_key: Sequence[int] | None = None,
        length_per_key: Sequence[int] | None = None,
        lengths_offset_per_key: Sequence[int] | None = None,
        offset_per_key: Sequence[int] | None = None,
        index_per_key: Mapping[str, int] | None = None,
        jt_dict: Mapping[str, JaggedTensor] | None = None,
        inverse_indices: tuple[list[str], torch.Tensor] | None = None,
        *,
        validate: bool = True,
    ) -> None:
        who = "KeyedJaggedTensor"
        self._keys = list(keys)
        nk = len(self._keys)
        spkpr: list[list[int]] | None = None
        if stride_per_key_per_rank is not None:
            rows = stride_per_key_per_rank.tolist() if torch.is_tensor(stride_per_key_per_rank) \
                else stride_per_key_per_rank
            spkpr = [[int(x) for x in r] for r in rows]
            if len(spkpr) != nk or any(x < 0 for r in spkpr for x in r):
                raise SparseInputError(
                    f"{who}: stride_per_key_per_rank needs one list of non-negative per-rank batch sizes per key "
                    f"({nk} keys), got {spkpr}"
                )
        elif stride_per_key is not None and len({int(x) for x in stride_per_key}) > 1:
            spkpr = [[int(x)] for x in stride_per_key]  # different strides per key: VBE on one rank
        if inverse_indices is not None and spkpr is None:
            raise SparseInputError(f"{who}: inverse_indices need stride_per_key_per_rank (variable batch per key)")
        if spkpr is not None:
            vspk = [sum(r) for r in spkpr]
            if stride_per_key is not None and [int(x) for x in stride_per_key] != vspk:
                raise SparseInputError(f"{who}: stride_per_key {list(stride_per_key)} != sums of "
                                       f"stride_per_key_per_rank {vspk}")
            if stride is not None and vspk and int(stride) != max(vspk):
                raise SparseInputError(f"{who}: stride {stride} != the largest per-key batch size {max(vspk)} (VBE)")
            stride = max(vspk) if vspk else 0
            stride_per_key = None
        _check_values(values, who)
        lengths = _index_tensor(lengths, "lengths", who)
        offsets = _index_tensor(offsets, "offsets", who)
        if offsets is not None and offsets.numel() == 0:
            if lengths is not None and lengths.numel() != 0:
                raise SparseInputError(f"{who}: offsets is empty but there are {lengths.numel()} lengths")
            lengths = offsets if lengths is None else lengths
            offsets = None
        if stride_per_key is not None:
            spk = [int(s) for s in stride_per_key]
            if len(spk) != nk:
                raise SparseInputError(f"{who}: {len(spk)} stride_per_key entries for {nk} keys")
            if spk and stride is not None and int(stride) != spk[0]:
                raise SparseInputError(f"{who}: stride {stride} != stride_per_key {spk}")
            if spk and stride is None:
                stride = spk[0]
        stride_given = stride is not None
        if stride is None:
            if nk == 0:
                stride = 0
            elif offsets is not None:
                stride = (offsets.numel() - 1) // nk
            elif lengths is not None:
                stride = lengths.numel() // nk
            else:
                stride = 0
        if not isinstance(stride, torch.SymInt):  # a symbolic batch size (torch.export) stays symbolic
            stride = int(stride)
        if stride < 0:
            raise SparseInputError(f"{who}: stride must be >= 0, got {stride}")
        given_lengths = lengths is not None
        given_offsets = offsets is not None
        no_lengths = not given_lengths and not given_offsets
        per_key_stride = [sum(r) for r in spkpr] if spkpr is not None else [stride] * nk
        n_bags = sum(per_key_stride)
        if no_lengths:
            # TorchRec accepts keys + values alone (stride 0 unless given): every bag is empty.
            lengths = torch.zeros(n_bags, dtype=torch.int64, device=values.device)
        elif lengths is None:
            lengths = _to_lengths(offsets)
        elif offsets is not None and offsets.numel() != lengths.numel() + 1:
            raise SparseInputError(
                f"{who}: len(offsets)={offsets.numel()} != len(lengths)+1={lengths.numel() + 1}"
            )
        n_len = lengths.numel()
        n_val = values.size(0)
        if nk == 0:
            if n_len != 0 or n_val != 0:
                raise SparseInputError(f"{who} with no keys must have empty lengths and values")
        elif spkpr is not None:
            if n_len != n_bags:
                raise SparseInputError(f"{who}: {n_len} lengths but the per-key batch sizes {per_key_stride} "
                                       f"add up to {n_bags} (variable batch per key: one length per bag)")
        else:
            if not stride_given and n_len % nk != 0:
                raise SparseInputError(
                    f"{who}: number of lengths ({n_len}) is not a multiple of the number of "
                    f"keys ({nk}: {self._keys}); expected len(lengths) == num_keys * batch_size"
                )
            if stride * nk != n_len:
                raise SparseInputError(
                    f"{who}: stride {stride} * {nk} keys != {n_len} lengths; expected {stride * nk} lengths "
                    f"(one per key and sample, key-major) for keys {self._keys}"
                )
        if no_lengths and n_val != 0:
            raise SparseInputError(
                f"{who}: {n_val} values but no lengths or offsets (every bag empty); pass lengths= or offsets="
                f"{_ORDER_HINT if weights is not None else ''}"
            )
        _check_weights(weights, values, who)

        # ---- TorchRec's host-side caches: checked against keys / stride / values (no sync)
        lpk = None if length_per_key is None else [int(x) for x in length_per_key]
        if lpk is not None:
            if len(lpk) != nk:
                raise SparseInputError(f"{who}: {len(lpk)} length_per_key entries for {nk} keys")
            if any(x < 0 for x in lpk) or sum(lpk) != n_val:
                raise SparseInputError(
                    f"{who}: length_per_key {lpk} must be >= 0 and sum to len(values)={n_val}"
                )
        if offset_per_key is not None:
            opk = [int(x) for x in offset_per_key]
            if len(opk) != nk + 1 or opk[0] != 0 or opk[-1] != n_val or any(b < a for a, b in zip(opk, opk[1:])):
                raise SparseInputError(
                    f"{who}: offset_per_key {opk} must be {nk + 1} non-decreasing ints from 0 to len(values)={n_val}"
                )
            from_opk = [b - a for a, b in zip(opk, opk[1:])]
            if lpk is not None and lpk != from_opk:
                raise SparseInputError(f"{who}: offset_per_key {opk} disagrees with length_per_key {lpk}")
            lpk = from_opk
        if inverse_indices is not None:
            ikeys, inv = inverse_indices
            if list(ikeys) != self._keys:
                raise SparseInputError(f"{who}: inverse_indices keys {list(ikeys)} != keys {self._keys}")
            if (not torch.is_tensor(inv) or inv.dim() != 2 or inv.size(0) != nk or inv.is_floating_point()
                    or inv.dtype == torch.bool):
                raise SparseInputError(
                    f"{who}: inverse_indices must be an integer tensor [num_keys={nk}, batch_size], got "
                    f"{tuple(inv.shape) if torch.is_tensor(inv) else type(inv).__name__}"
                )
            if inv.device != values.device:
                raise SparseInputError(f"{who}: inverse_indices on {inv.device}, values on {values.device}")
            inverse_indices = (list(ikeys), inv)
        if lengths_offset_per_key is not None:
            lopk = [int(x) for x in lengths_offset_per_key]
            want = _cumsum(per_key_stride)
            if lopk != want:
                raise SparseInputError(f"{who}: lengths_offset_per_key {lopk} != {want} (stride {stride})")
        if index_per_key is not None:
            want_idx = {k: i for i, k in enumerate(self._keys)}
            if dict(index_per_key) != want_idx:
                raise SparseInputError(f"{who}: index_per_key {dict(index_per_key)} != {want_idx}")
        if jt_dict is not None and set(jt_dict) != set(self._keys):
            raise SparseInputError(f"{who}: jt_dict keys {sorted(jt_dict)} != keys {sorted(self._keys)}")

        self._values = values
        self._weights = weights
        self._lengths = lengths
        self._offsets = offsets
        self._stride = stride
        self._spkpr = spkpr
        self._per_key_stride = per_key_stride
        self._inverse_indices = inverse_indices
        self._length_per_key: list[int] | None = lpk
        self._offset_per_key: list[int] | None = None
        self._index_per_key: dict[str, int] | None = None
        self._jt_dict: dict[str, JaggedTensor] | None = None if jt_dict is None else dict(jt_dict)
        if validate:
            self._validate(given_lengths, offsets if given_offsets else None)

    # ------------------------------------------------------------------ checks
    def _validate(self, lengths_given: bool, offsets: torch.Tensor | None) -> None:
        nk = len(self._keys)
        if nk == 0:
            return
        per_key = _validate_contents(
            "KeyedJaggedTensor", self._values.size(0), self._lengths, offsets, lengths_given,
            nk=nk, stride=self._stride, keys=self._keys,
            segments=self._per_key_stride if self._spkpr is not None else None,
        )
        if self._inverse_indices is not None and self._inverse_indices[1].numel():
            inv = self._inverse_indices[1]
            lo = inv.min(dim=1).values.tolist()
            hi = inv.max(dim=1).values.tolist()
            for k, (a, b, n) in enumerate(zip(lo, hi, self._per_key_stride)):
                if a < 0 or b >= n:
                    raise SparseInputError(
                        f"KeyedJaggedTensor: inverse_indices of key '{self._keys[k]}' must be in [0, {n}) "
                        f"(its batch size), got [{a}, {b}]"
                    )
        if self._length_per_key is not None and self._length_per_key != per_key:
            raise SparseInputError(
                f"KeyedJaggedTensor: length_per_key {self._length_per_key} disagrees with the lengths "
                f"(per-key sums {per_key})"
            )
        self._length_per_key = per_key

    def validate(self) -> None:
        """Check the invariants listed in the class docstring (reads tensor contents)."""
        self._validate(True, self._offsets)

    # ------------------------------------------------------------ constructors
    @staticmethod
    def from_lengths_sync(
        keys: Sequence[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None = None,
        stride: int | None = None,
        stride_per_key_per_rank: Sequence[Sequence[int]] | None = None,
        inverse_indices: tuple[list[str], torch.Tensor] | None = None,
    ) -> "KeyedJaggedTensor":
        """KJT from lengths, per-key lengths computed now (TorchRec's ``sync()``)."""
        return KeyedJaggedTensor(keys, values, weights=weights, lengths=lengths, stride=stride,
                                 stride_per_key_per_rank=stride_per_key_per_rank,
                                 inverse_indices=inverse_indices).sync()

    from_lengths = from_lengths_sync

    @staticmethod
    def from_offsets_sync(
        keys: Sequence[str],
        values: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None = None,
        stride: int | None = None,
        stride_per_key_per_rank: Sequence[Sequence[int]] | None = None,
        inverse_indices: tuple[list[str], torch.Tensor] | None = None,
    ) -> "KeyedJaggedTensor":
        """KJT from offsets, per-key lengths computed now (TorchRec's ``sync()``)."""
        return KeyedJaggedTensor(keys, values, weights=weights, offsets=offsets, stride=stride,
                                 stride_per_key_per_rank=stride_per_key_per_rank,
                                 inverse_indices=inverse_indices).sync()

    @staticmethod
    def from_jt_dict(jt_dict: Mapping[str, JaggedTensor]) -> "KeyedJaggedTensor":
        """Concatenate per-key JaggedTensors in dict order; keys with different batch sizes give
        a variable-batch KJT (``stride_per_key_per_rank = [[B_k]]``, no inverse indices), as in TorchRec.

        Raises:
            SparseInputError: some keys weighted and others not (TorchRec would misalign the weights).
        """
        keys = list(jt_dict)
        jts = [jt_dict[k] for k in keys]
        if not jts:
            return KeyedJaggedTensor.empty()
        per_key = [jt.lengths().numel() for jt in jts]
        strides = set(per_key)
        has_w = [jt.weights_or_none() is not None for jt in jts]
        if any(has_w) and not all(has_w):
            raise SparseInputError("from_jt_dict: either all or none of the keys must have weights")
        return KeyedJaggedTensor(
            keys,
            torch.cat([jt.values() for jt in jts]),
            weights=torch.cat([jt.weights() for jt in jts]) if all(has_w) else None,
            lengths=torch.cat([jt.lengths() for jt in jts]),
            length_per_key=[jt.values().size(0) for jt in jts],
            validate=False,
            **({"stride": strides.pop()} if len(strides) == 1 else {"stride_per_key_per_rank": [[n] for n in per_key]}),
        )

    @staticmethod
    def concat(kjt_list: Sequence["KeyedJaggedTensor"]) -> "KeyedJaggedTensor":
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
        return KeyedJaggedTensor(
            keys,
            torch.cat([k.values() for k in kjts], dim=0),
            weights=torch.cat([k.weights() for k in kjts], dim=0) if weighted else None,
            lengths=torch.cat([k.lengths() for k in kjts], dim=0),
            stride=strides[0] if strides else kjts[0].stride(),
            length_per_key=[x for lpk in lpks for x in lpk] if all(lpk is not None for lpk in lpks) else None,
            validate=False,
        )

    @staticmethod
    def empty(
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        values_dtype: torch.dtype | None = None,
        weights_dtype: torch.dtype | None = None,
        lengths_dtype: torch.dtype = torch.int32,
    ) -> "KeyedJaggedTensor":
        """A KJT with no keys and stride 0 (TorchRec defaults: values of the torch
        default dtype when ``values_dtype`` is None, int32 lengths)."""
        return KeyedJaggedTensor(
            [],
            torch.empty(0, dtype=values_dtype, device=device),
            weights=torch.empty(0, dtype=weights_dtype, device=device) if is_weighted else None,
            lengths=torch.empty(0, dtype=lengths_dtype, device=device),
            stride=0,
            validate=False,
        )

    @staticmethod
    def empty_like(kjt: "KeyedJaggedTensor", device: torch.device | str | None = None) -> "KeyedJaggedTensor":
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
            return KeyedJaggedTensor(
                [],
                kjt._values.new_empty((0,) + tuple(kjt._values.shape[1:])),
                weights=None if kjt._weights is None else torch.empty(0, dtype=kjt._weights.dtype, device=dev),
                lengths=torch.empty(0, dtype=kjt._lengths.dtype, device=dev),
                stride=kjt._stride,
                validate=False,
            )
        return KeyedJaggedTensor(
            kjt._keys,
            torch.empty_like(kjt._values, device=device),
            weights=None if kjt._weights is None else torch.empty_like(kjt._weights, device=device),
            lengths=torch.empty_like(kjt._lengths, device=device),
            offsets=None if kjt._offsets is None else torch.empty_like(kjt._offsets, device=device),
            stride=kjt._stride,
            length_per_key=kjt._length_per_key,
            validate=False,
        )

    def copy_(self, kjt: "KeyedJaggedTensor", non_blocking: bool = False) -> "KeyedJaggedTensor":
        """In-place copy of ``kjt``'s tensors (same keys and shapes) into this one's; returns self."""
        self._values.copy_(kjt._values, non_blocking=non_blocking)
        self._lengths.copy_(kjt._lengths, non_blocking=non_blocking)
        if self._weights is not None and kjt._weights is not None:
            self._weights.copy_(kjt._weights, non_blocking=non_blocking)
        if self._offsets is not None:
            self._offsets.copy_(kjt.offsets(), non_blocking=non_blocking)
        self._length_per_key = kjt._length_per_key
        self._offset_per_key = kjt._offset_per_key
        self._jt_dict = None
        return self

    # --------------------------------------------------------------- accessors
    def keys(self) -> list[str]:
        return self._keys

    def stride(self) -> int:
        """Batch size ``B``; with variable batch per key, the largest per-key batch size (TorchRec)."""
        return self._stride

    def stride_per_key(self) -> list[int]:
        """Bags of each key: ``[B] * F``, or each key's own batch size (variable batch per key)."""
        return list(self._per_key_stride)

    def stride_per_key_per_rank(self) -> list[list[int]]:
        """Per key, the batch size coming from each rank (VBE); ``[]`` for a fixed-stride KJT (TorchRec)."""
        return [] if self._spkpr is None else [list(r) for r in self._spkpr]

    def variable_stride_per_key(self) -> bool:
        """True for a variable-batch-per-key KJT (TorchRec's VBE: ``stride_per_key_per_rank`` given)."""
        return self._spkpr is not None

    def inverse_indices(self) -> tuple[list[str], torch.Tensor]:
        """``(keys, [F, B_full] int tensor)``: for each key and each sample of the full batch, the
        row (bag) of that key holding it (TorchRec's VBE).

        Raises:
            SparseInputError: this KJT has none.
        """
        if self._inverse_indices is None:
            raise SparseInputError("KeyedJaggedTensor has no inverse_indices (not a variable-batch KJT)")
        return self._inverse_indices

    def inverse_indices_or_none(self) -> tuple[list[str], torch.Tensor] | None:
        return self._inverse_indices

    def _vbe_kwargs(self, keys_idx: Sequence[int] | None = None, device: torch.device | str | None = None) -> dict:
        """Constructor arguments that carry the variable-batch metadata (for keys ``keys_idx``)."""
        if self._spkpr is None:
            return {"stride": self._stride}
        idx = list(range(len(self._keys))) if keys_idx is None else list(keys_idx)
        out: dict = {"stride_per_key_per_rank": [list(self._spkpr[i]) for i in idx]}
        if self._inverse_indices is not None:
            inv = self._inverse_indices[1]
            if keys_idx is not None:
                inv = inv[host_to_device(idx, torch.long, inv.device)] if idx else inv[:0]
            if device is not None:
                inv = inv.to(device)
            out["inverse_indices"] = ([self._keys[i] for i in idx], inv)
        return out

    def to_uniform_stride(self) -> "KeyedJaggedTensor":
        """A fixed-stride copy of a variable-batch KJT: each key padded with empty bags to
        :meth:`stride` (the largest per-key batch size); values and weights are shared, the
        inverse indices dropped.  Key ``k``'s bag ``i < stride_per_key()[k]`` keeps its row.
        A fixed-stride KJT is returned as is.  No host sync."""
        if self._spkpr is None:
            return self
        nk, B = len(self._keys), self._stride
        pos = [k * B + i for k, n in enumerate(self._per_key_stride) for i in range(n)]
        lengths = torch.zeros(nk * B, dtype=self._lengths.dtype, device=self._lengths.device)
        lengths[host_to_device(pos, torch.long, lengths.device)] = self._lengths
        return KeyedJaggedTensor(self._keys, self._values, weights=self._weights, lengths=lengths, stride=B,
                                 length_per_key=self._length_per_key, validate=False)

    def device(self) -> torch.device:
        return self._values.device

    def size_in_bytes(self) -> int:
        """Bytes held by values, weights, lengths, (if materialised) offsets and inverse indices."""
        inv = None if self._inverse_indices is None else self._inverse_indices[1]
        return sum(t.element_size() * t.numel()
                   for t in (self._values, self._weights, self._lengths, self._offsets, inv) if t is not None)

    def lengths_2d(self) -> torch.Tensor:
        """``[F, B]`` view of the lengths.

        Raises:
            SparseInputError: a variable-batch KJT (use :meth:`to_uniform_stride` first).
        """
        if self._spkpr is not None:
            raise SparseInputError("KeyedJaggedTensor.lengths_2d: keys have different batch sizes "
                                   f"{self._per_key_stride}; call to_uniform_stride() first")
        return self._lengths.view(len(self._keys), self._stride)

    def _key_lengths(self, i: int) -> torch.Tensor:
        """Lengths of key ``i``'s bags."""
        lo = sum(self._per_key_stride[:i])
        return self._lengths[lo : lo + self._per_key_stride[i]]

    def length_per_key(self) -> list[int]:
        """Number of values of each key in this batch (host ints; syncs on CUDA unless cached)."""
        if self._length_per_key is None:
            if not self._keys:
                self._length_per_key = []
            elif self._spkpr is not None:
                sums = [seg.sum() for seg in torch.split(self._lengths, self._per_key_stride)]
                self._length_per_key = [int(x) for x in torch.stack(sums).tolist()]
            else:
                self._length_per_key = [int(x) for x in self.lengths_2d().sum(dim=1).tolist()]
        return self._length_per_key

    def length_per_key_or_none(self) -> list[int] | None:
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        """``[0, cumsum(length_per_key)...]`` (``F + 1`` host ints)."""
        if self._offset_per_key is None:
            self._offset_per_key = _cumsum(self.length_per_key())
        return self._offset_per_key

    def offset_per_key_or_none(self) -> list[int] | None:
        return self._offset_per_key

    def lengths_offset_per_key(self) -> list[int]:
        """Start of each key's lengths: ``[0, B, 2B, ..., F*B]`` (cumsum of :meth:`stride_per_key`)."""
        return _cumsum(self._per_key_stride)

    def index_per_key(self) -> dict[str, int]:
        """``{key: position}``."""
        if self._index_per_key is None:
            self._index_per_key = {k: i for i, k in enumerate(self._keys)}
        return self._index_per_key

    _key_indices = index_per_key

    def sync(self) -> "KeyedJaggedTensor":
        """Compute and cache ``length_per_key`` / ``offset_per_key`` now; returns self."""
        self.length_per_key()
        self.offset_per_key()
        return self

    def unsync(self) -> "KeyedJaggedTensor":
        """Drop the cached ``length_per_key`` / ``offset_per_key``; returns self."""
        self._length_per_key = None
        self._offset_per_key = None
        return self

    def _key_index(self, key: str) -> int:
        try:
            return self.index_per_key()[key]
        except KeyError:
            raise KeyError(f"KeyedJaggedTensor has no key '{key}'; keys are {self._keys}") from None

    def __getitem__(self, key: str) -> JaggedTensor:
        i = self._key_index(key)
        opk = self.offset_per_key()
        s, e = opk[i], opk[i + 1]
        return JaggedTensor(
            self._values[s:e],
            weights=None if self._weights is None else self._weights[s:e],
            lengths=self._key_lengths(i),
            validate=False,
        )

    def to_dict(self, compute_offsets: bool = True) -> dict[str, JaggedTensor]:
        """``{key: JaggedTensor}`` in key order (cached, as in TorchRec).

        Args:
            compute_offsets: also build each JaggedTensor's offsets now (one
                batched cumsum); otherwise they are computed on first use.
        """
        if self._jt_dict is not None:
            return self._jt_dict
        if not self._keys:
            return {}
        if self._spkpr is not None:
            self._jt_dict = {k: self[k] for k in self._keys}
            if compute_offsets:
                for jt in self._jt_dict.values():
                    jt.offsets()
            return self._jt_dict
        lpk = self.length_per_key()
        vals = torch.split(self._values, lpk)
        ws = torch.split(self._weights, lpk) if self._weights is not None else [None] * len(lpk)
        lens2d = self.lengths_2d()
        offs = None
        if compute_offsets:
            offs = torch.zeros(len(self._keys), self._stride + 1, dtype=lens2d.dtype, device=lens2d.device)
            torch.cumsum(lens2d, dim=1, out=offs[:, 1:])
        self._jt_dict = {
            k: JaggedTensor(vals[i], weights=ws[i], lengths=lens2d[i],
                            offsets=None if offs is None else offs[i], validate=False)
            for i, k in enumerate(self._keys)
        }
        return self._jt_dict

    # ------------------------------------------------------------- transforms
    def permute(self, indices: Sequence[int], indices_tensor: torch.Tensor | None = None) -> "KeyedJaggedTensor":
        """Reorder (or select / repeat) keys: new key ``j`` is old key ``indices[j]``.

        ``indices_tensor`` (TorchRec's device copy of ``indices``) is accepted and unused.
        """
        lpk = self.length_per_key()
        opk = self.offset_per_key()
        vals, lens, ws = [], [], []
        for i in indices:
            vals.append(self._values[opk[i] : opk[i + 1]])
            lens.append(self._key_lengths(i))
            if self._weights is not None:
                ws.append(self._weights[opk[i] : opk[i + 1]])
        return KeyedJaggedTensor(
            [self._keys[i] for i in indices],
            torch.cat(vals) if vals else self._values[:0],
            weights=(torch.cat(ws) if ws else self._weights[:0]) if self._weights is not None else None,
            lengths=torch.cat(lens) if lens else self._lengths[:0],
            length_per_key=[lpk[i] for i in indices],
            validate=False,
            **self._vbe_kwargs(indices),
        )

    def select_keys(self, keys: Sequence[str]) -> "KeyedJaggedTensor":
        """Sub-KJT with only ``keys`` (in that order).  Raises KeyError naming a missing key."""
        return self.permute([self._key_index(k) for k in keys])

    def split(self, segments: Sequence[int]) -> list["KeyedJaggedTensor"]:
        """Split keys into consecutive groups of ``segments[i]`` keys each.

        Raises:
            SparseInputError: the segments do not add up to the number of keys.
        """
        if sum(segments) != len(self._keys):
            raise SparseInputError(
                f"KeyedJaggedTensor.split: segments {list(segments)} sum to {sum(segments)}, "
                f"expected the number of keys {len(self._keys)}"
            )
        out = []
        start = 0
        for n in segments:
            if n:
                out.append(self.permute(list(range(start, start + n))))
            else:
                out.append(KeyedJaggedTensor([], self._values[:0], lengths=self._lengths[:0],
                                             weights=None if self._weights is None else self._weights[:0],
                                             stride=self._stride, validate=False))
            start += n
        return out

    def flatten_lengths(self) -> "KeyedJaggedTensor":
        """Same KJT with 1-D lengths (they always are here)."""
        return KeyedJaggedTensor(self._keys, self._values, weights=self._weights, lengths=self._lengths.view(-1),
                                 length_per_key=self._length_per_key, validate=False, **self._vbe_kwargs())

    def to(
        self, device: torch.device | str, non_blocking: bool = False, dtype: torch.dtype | None = None
    ) -> "KeyedJaggedTensor":
        """Copy to ``device``; ``dtype`` (as in TorchRec) converts the weights only."""
        mv = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        w = self._weights
        if w is not None:
            w = w.to(device=device, dtype=dtype, non_blocking=non_blocking) if dtype is not None else mv(w)
        return KeyedJaggedTensor(
            self._keys, mv(self._values), weights=w, lengths=mv(self._lengths), offsets=mv(self._offsets),
            length_per_key=self._length_per_key, validate=False, **self._vbe_kwargs(device=device),
        )

    def pin_memory(self) -> "KeyedJaggedTensor":
        pin = lambda t: None if t is None else t.pin_memory()  # noqa: E731
        vbe = self._vbe_kwargs()
        if "inverse_indices" in vbe:
            vbe["inverse_indices"] = (vbe["inverse_indices"][0], vbe["inverse_indices"][1].pin_memory())
        return KeyedJaggedTensor(
            self._keys, pin(self._values), weights=pin(self._weights), lengths=pin(self._lengths),
            offsets=pin(self._offsets), length_per_key=self._length_per_key, validate=False, **vbe,
        )

    def record_stream(self, stream: "torch.cuda.Stream") -> None:
        inv = None if self._inverse_indices is None else self._inverse_indices[1]
        for t in (self._values, self._lengths, self._offsets, self._weights, inv):
            if t is not None:
                t.record_stream(stream)

    def __repr__(self) -> str:
        vbe = "" if self._spkpr is None else f", stride_per_key_per_rank={self._spkpr}"
        return (
            f"KeyedJaggedTensor(keys={self._keys}, stride={self._stride}{vbe}, values={self._values}, "
            f"lengths={self._lengths}, weights={self._weights})"
        )


class KeyedTensor:
    """Pooled embeddings of several keys, concatenated along ``key_dim``.

    Same signature and argument order as ``torchrec.KeyedTensor``.

    Args:
        keys: names, one per block.
        length_per_key: width of each key's block along ``key_dim``.
        values: e.g. ``[B, sum(length_per_key)]`` float (``key_dim=1``).
        key_dim: the dimension the blocks are concatenated along.
        offset_per_key: ``[0, cumsum(length_per_key)...]`` if given (TorchRec's cache).
        index_per_key: ``{key: position}`` if given (TorchRec's cache).

    Raises:
        SparseInputError: keys and length_per_key differ in number,
            ``values.size(key_dim) != sum(length_per_key)``, ``key_dim`` out of
            range, or a cache argument inconsistent (TorchRec checks none).
    """

    def __init__(
        self,
        keys: Sequence[str],
        length_per_key: Sequence[int],
        values: torch.Tensor,
        key_dim: int = 1,
        offset_per_key: Sequence[int] | None = None,
        index_per_key: Mapping[str, int] | None = None,
    ) -> None:
        self._keys = list(keys)
        self._length_per_key = list(length_per_key)
        if len(self._keys) != len(self._length_per_key):
            raise SparseInputError(
                f"KeyedTensor: {len(self._keys)} keys but {len(self._length_per_key)} lengths"
            )
        if not -values.dim() <= key_dim < values.dim():
            raise SparseInputError(f"KeyedTensor: key_dim {key_dim} out of range for values of shape {tuple(values.shape)}")
        if values.size(key_dim) != sum(self._length_per_key):
            raise SparseInputError(
                f"KeyedTensor: values.size({key_dim})={values.size(key_dim)} != "
                f"sum(length_per_key)={sum(self._length_per_key)}"
            )
        self._offset_per_key: list[int] | None = None
        if offset_per_key is not None:
            opk = list(offset_per_key)
            if opk != _cumsum(self._length_per_key):
                raise SparseInputError(
                    f"KeyedTensor: offset_per_key {opk} != cumsum of length_per_key {_cumsum(self._length_per_key)}"
                )
            self._offset_per_key = opk
        self._index_per_key: dict[str, int] | None = None
        if index_per_key is not None:
            want = {k: i for i, k in enumerate(self._keys)}
            if dict(index_per_key) != want:
                raise SparseInputError(f"KeyedTensor: index_per_key {dict(index_per_key)} != {want}")
            self._index_per_key = want
        self._values = values
        self._key_dim = key_dim

    @staticmethod
    def from_tensor_list(
        keys: Sequence[str], tensors: Iterable[torch.Tensor], key_dim: int = 1, cat_dim: int = 1
    ) -> "KeyedTensor":
        """Concatenate ``tensors`` along ``cat_dim``; key ``i``'s width is ``tensors[i].shape[key_dim]``."""
        ts = list(tensors)
        return KeyedTensor(keys, [t.shape[key_dim] for t in ts], torch.cat(ts, dim=cat_dim), key_dim)

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def length_per_key(self) -> list[int]:
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        if self._offset_per_key is None:
            self._offset_per_key = _cumsum(self._length_per_key)
        return self._offset_per_key

    def key_dim(self) -> int:
        return self._key_dim

    def device(self) -> torch.device:
        return self._values.device

    def size_in_bytes(self) -> int:
        return self._values.element_size() * self._values.numel()

    def _key_indices(self) -> dict[str, int]:
        if self._index_per_key is None:
            self._index_per_key = {k: i for i, k in enumerate(self._keys)}
        return self._index_per_key

    def __getitem__(self, key: str) -> torch.Tensor:
        try:
            i = self._key_indices()[key]
        except KeyError:
            raise KeyError(f"KeyedTensor has no key '{key}'; keys are {self._keys}") from None
        o = self.offset_per_key()
        return self._values.narrow(self._key_dim, o[i], o[i + 1] - o[i])

    def to_dict(self) -> dict[str, torch.Tensor]:
        parts = self._values.split(self._length_per_key, dim=self._key_dim)
        return {k: parts[i] for k, i in self._key_indices().items()}

    @staticmethod
    def regroup(keyed_tensors: Sequence["KeyedTensor"], groups: Sequence[Sequence[str]]) -> list[torch.Tensor]:
        """One tensor per group: the named keys' blocks concatenated along ``key_dim``.

        Args:
            keyed_tensors: KeyedTensors with the same ``key_dim`` (and other dims).
            groups: lists of keys; a key may appear in several groups.

        Returns:
            ``[B, sum of the group's widths]`` per group (``key_dim=1``).

        Raises:
            KeyError: a key in no KeyedTensor.  SparseInputError: a key in more
            than one KeyedTensor (TorchRec silently takes the last), or
            different ``key_dim``.
        """
        kts = list(keyed_tensors)
        groups = [list(g) for g in groups]
        if not groups:
            return []
        if not kts:
            raise SparseInputError("KeyedTensor.regroup: no KeyedTensors")
        key_dim = kts[0].key_dim()
        if any(kt.key_dim() != key_dim for kt in kts):
            raise SparseInputError(f"KeyedTensor.regroup: key_dims differ {[kt.key_dim() for kt in kts]}")
        if len(kts) == len(groups) and all(kt.keys() == g for kt, g in zip(kts, groups)):
            return [kt.values() for kt in kts]
        where: dict[str, tuple[int, int]] = {}
        for j, kt in enumerate(kts):
            for i, k in enumerate(kt.keys()):
                if k in where and where[k][0] != j:
                    raise SparseInputError(f"KeyedTensor.regroup: key '{k}' is in more than one KeyedTensor")
                where[k] = (j, i)
        pieces: list[torch.Tensor] = []
        widths: list[int] = []
        for g in groups:
            w = 0
            for k in g:
                if k not in where:
                    raise KeyError(f"KeyedTensor.regroup: no KeyedTensor has key '{k}'")
                j, i = where[k]
                kt = kts[j]
                o = kt.offset_per_key()
                pieces.append(kt.values().narrow(key_dim, o[i], o[i + 1] - o[i]))
                w += o[i + 1] - o[i]
            widths.append(w)
        if not pieces:
            empty = kts[0].values().narrow(key_dim, 0, 0)
            return [empty for _ in groups]
        return list(torch.cat(pieces, dim=key_dim).split(widths, dim=key_dim))

    @staticmethod
    def regroup_as_dict(
        keyed_tensors: Sequence["KeyedTensor"], groups: Sequence[Sequence[str]], keys: Sequence[str]
    ) -> dict[str, torch.Tensor]:
        """:meth:`regroup` with group ``i`` returned under ``keys[i]``.

        Raises:
            SparseInputError: ``len(groups) != len(keys)`` (TorchRec: AssertionError), or as :meth:`regroup`.
        """
        if len(groups) != len(keys):
            raise SparseInputError(f"KeyedTensor.regroup_as_dict: {len(groups)} groups but {len(keys)} keys")
        return dict(zip(keys, KeyedTensor.regroup(keyed_tensors, groups)))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "KeyedTensor":
        return KeyedTensor(self._keys, self._length_per_key, self._values.to(device, non_blocking=non_blocking),
                           self._key_dim)

    def record_stream(self, stream: "torch.cuda.Stream") -> None:
        self._values.record_stream(stream)

    def __repr__(self) -> str:
        return f"KeyedTensor(keys={self._keys}, length_per_key={self._length_per_key}, values={tuple(self._values.shape)})"


def expand_by_inverse_indices(kt: KeyedTensor, inverse_indices: tuple[Sequence[str], torch.Tensor]) -> KeyedTensor:
    """Pooled embeddings of a variable-batch lookup back to the full batch (TorchRec's VBE).

    Args:
        kt: ``[B_max, sum(dims)]`` pooled rows; row ``i`` of key ``k`` is key ``k``'s bag ``i``
            (``key_dim=1``).
        inverse_indices: ``(keys, [F, B_full] int)``: for each key of ``kt`` (by name), the row
            holding each sample of the full batch.

    Returns:
        ``KeyedTensor [B_full, sum(dims)]`` (same keys); one ``gather``, whose backward sums the
        gradients of the samples that share a row.

    Raises:
        SparseInputError: a key of ``kt`` missing from the inverse indices.
    """
    ikeys, inv = inverse_indices
    pos = {k: i for i, k in enumerate(ikeys)}
    missing = [k for k in kt.keys() if k not in pos]
    if missing:
        raise SparseInputError(f"expand_by_inverse_indices: keys {missing} have no inverse indices (have {list(ikeys)})")
    values = kt.values()
    inv = inv.to(device=values.device, dtype=torch.long)
    opk = kt.offset_per_key()
    # one index_select per key (its backward is an index_add into that key's rows)
    parts = [values[:, opk[j] : opk[j + 1]].index_select(0, inv[pos[k]]) for j, k in enumerate(kt.keys())]
    out = torch.cat(parts, dim=1) if parts else values.new_zeros(inv.shape[1], 0)
    return KeyedTensor(kt.keys(), kt.length_per_key(), out)


def split_variable_batch(
    kjt: KeyedJaggedTensor,
) -> tuple[KeyedJaggedTensor, tuple[list[str], torch.Tensor] | None]:
    """``(fixed-stride KJT, inverse indices or None)``: a variable-batch KJT padded with
    :meth:`KeyedJaggedTensor.to_uniform_stride`, with the inverse indices that expand its
    pooled output back to the full batch; a fixed-stride KJT is returned as is with ``None``.

    Raises:
        SparseInputError: a variable-batch KJT without inverse indices (the full batch would be unknown).
    """
    if not kjt.variable_stride_per_key():
        return kjt, None
    inv = kjt.inverse_indices_or_none()
    if inv is None:
        raise SparseInputError(
            "a variable-batch KeyedJaggedTensor (stride_per_key_per_rank) needs inverse_indices to map its "
            "per-key rows back to the batch; pass inverse_indices=(keys, [num_keys, batch_size] tensor)"
        )
    return kjt.to_uniform_stride(), inv
