"""KeyedJaggedTensor: several sparse features of one batch in one key-major jagged layout, with
TorchRec's variable batch per key (:mod:`dlrmctl.sparse.jagged_tensor` has the layouts and the
checks; the constructors from other containers are :mod:`dlrmctl.sparse.kjt_constructors`')."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from dlrmctl.sparse.jagged import JaggedFields, JaggedTensor
from dlrmctl.sparse.jagged_checks import (
    SparseInputError,
    check_caches,
    cumsum,
    host_to_device,
    resolve_lengths,
    resolve_variable_batch,
    validate_contents,
)
from dlrmctl.sparse.kjt_constructors import KeyedJaggedConstructors


class KeyedJaggedTensor(KeyedJaggedConstructors, JaggedFields):
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
        spkpr, stride, stride_per_key = resolve_variable_batch(who, nk, stride, stride_per_key_per_rank,
                                                               stride_per_key, inverse_indices)
        lengths, offsets, stride, given_lengths, given_offsets, per_key_stride = resolve_lengths(
            who, self._keys, values, weights, lengths, offsets, stride, stride_per_key, spkpr)
        lpk, inverse_indices = check_caches(who, self._keys, values, per_key_stride, stride, length_per_key,
                                            offset_per_key, inverse_indices, lengths_offset_per_key,
                                            index_per_key, jt_dict)

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
        per_key = validate_contents(
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

    def copy_(self, kjt: "KeyedJaggedTensor", non_blocking: bool = False) -> "KeyedJaggedTensor":
        """In-place copy of ``kjt``'s tensors (same keys and shapes) into this one's; returns self."""
        self._copy_tensors(kjt, non_blocking)
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
            self._offset_per_key = cumsum(self.length_per_key())
        return self._offset_per_key

    def offset_per_key_or_none(self) -> list[int] | None:
        return self._offset_per_key

    def lengths_offset_per_key(self) -> list[int]:
        """Start of each key's lengths: ``[0, B, 2B, ..., F*B]`` (cumsum of :meth:`stride_per_key`)."""
        return cumsum(self._per_key_stride)

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
