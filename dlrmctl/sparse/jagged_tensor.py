"""Sparse input containers: JaggedTensor, KeyedJaggedTensor, KeyedTensor.

Layouts follow TorchRec (``torchrec.sparse.jagged_tensor``) so that a TorchRec
user recognises them:

* ``KeyedJaggedTensor`` is *key-major*: for keys ``[f0, f1]`` and batch size
  ``B`` the lengths are ``[f0_b0 .. f0_b{B-1}, f1_b0 .. f1_b{B-1}]`` and the
  values of all bags of ``f0`` come before those of ``f1``.
  ``stride() == len(lengths) // len(keys) == B``.
* ``KeyedTensor`` holds pooled embeddings of several keys side by side:
  ``values() [B, sum(length_per_key)]``.

All index tensors (lengths, offsets) are int64 unless given otherwise; values
are int64 ids; weights are float32.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch


class SparseInputError(ValueError):
    """A sparse input (lengths / values / weights) is inconsistent."""


def _to_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """``[N]`` lengths -> ``[N+1]`` offsets (exclusive cumsum), same dtype."""
    out = torch.zeros(lengths.numel() + 1, dtype=lengths.dtype, device=lengths.device)
    torch.cumsum(lengths, dim=0, out=out[1:])
    return out


def _to_lengths(offsets: torch.Tensor) -> torch.Tensor:
    return offsets[1:] - offsets[:-1]


class JaggedTensor:
    """One feature's bags: ``values [N]`` split by ``lengths [B]``.

    Args:
        values: ``[N]`` ids (int64) or any 1-D tensor.
        lengths: ``[B]`` non-negative int, ``sum(lengths) == N``.
        weights: optional ``[N]`` float per-id weights.

    Raises:
        SparseInputError: negative lengths, ``sum(lengths) != len(values)``,
            or weights not matching values.
    """

    def __init__(
        self,
        values: torch.Tensor,
        lengths: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
    ) -> None:
        if lengths is None and offsets is None:
            raise SparseInputError("JaggedTensor needs lengths or offsets")
        if lengths is None:
            lengths = _to_lengths(offsets)
        if (lengths < 0).any():
            raise SparseInputError(f"JaggedTensor lengths must be >= 0, got {lengths.tolist()[:16]}")
        if int(lengths.sum()) != values.numel():
            raise SparseInputError(
                f"JaggedTensor: sum(lengths)={int(lengths.sum())} != len(values)={values.numel()}"
            )
        if weights is not None and weights.numel() != values.numel():
            raise SparseInputError(
                f"JaggedTensor: len(weights)={weights.numel()} != len(values)={values.numel()}"
            )
        self._values = values
        self._lengths = lengths
        self._offsets = offsets
        self._weights = weights

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        if self._offsets is None:
            self._offsets = _to_offsets(self._lengths)
        return self._offsets

    def weights(self) -> torch.Tensor:
        if self._weights is None:
            raise SparseInputError("JaggedTensor has no weights")
        return self._weights

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def to_dense(self) -> list[torch.Tensor]:
        """List of ``B`` tensors, one per bag."""
        return list(torch.split(self._values, self._lengths.tolist()))

    def __repr__(self) -> str:
        return f"JaggedTensor(values={self._values}, lengths={self._lengths}, weights={self._weights})"


class KeyedJaggedTensor:
    """Several sparse features of one batch in one key-major jagged layout.

    Args:
        keys: feature names, ``F`` of them.
        values: ``[N]`` int64 ids of all bags, key-major.
        lengths: ``[F * B]`` bag lengths, key-major (or give ``offsets``).
        offsets: ``[F * B + 1]`` exclusive cumsum of lengths.
        weights: optional ``[N]`` float32 per-id weights (weighted features).
        stride: batch size ``B``; inferred as ``len(lengths) // F``.
        validate: check the invariants below (reads lengths on the host: a device sync on CUDA).
        length_per_key: ``[F]`` host ints, ids per key, when already known (the loader, an
            input_dist size exchange): :meth:`length_per_key` then never reads the device.
            Checked against the lengths when ``validate``.

    Raises:
        SparseInputError: if ``len(lengths)`` is not a multiple of ``len(keys)``,
            a length is negative, ``sum(lengths) != len(values)``, or
            ``len(weights) != len(values)``; each message names what was expected.
    """

    def __init__(
        self,
        keys: Sequence[str],
        values: torch.Tensor,
        lengths: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
        stride: int | None = None,
        validate: bool = True,
        length_per_key: list[int] | None = None,
    ) -> None:
        self._keys = list(keys)
        if lengths is None and offsets is None:
            raise SparseInputError("KeyedJaggedTensor needs lengths or offsets")
        if lengths is None:
            lengths = _to_lengths(offsets)
        self._values = values
        self._lengths = lengths
        self._offsets = offsets
        self._weights = weights
        nk = len(self._keys)
        if stride is None:
            stride = lengths.numel() // nk if nk else 0
        self._stride = stride
        # host ints; when given (e.g. by the loader, or from an input_dist size exchange)
        # length_per_key() / offset_per_key() never read the device
        self._length_per_key: list[int] | None = None if length_per_key is None else list(length_per_key)
        if validate:
            self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Check the invariants listed in the class docstring."""
        nk = len(self._keys)
        n_len = self._lengths.numel()
        if nk == 0:
            if n_len != 0 or self._values.numel() != 0:
                raise SparseInputError("KeyedJaggedTensor with no keys must have empty lengths and values")
            return
        if n_len % nk != 0:
            raise SparseInputError(
                f"KeyedJaggedTensor: number of lengths ({n_len}) is not a multiple of the number of "
                f"keys ({nk}: {self._keys}); expected len(lengths) == num_keys * batch_size"
            )
        if self._stride * nk != n_len:
            raise SparseInputError(
                f"KeyedJaggedTensor: stride {self._stride} * {nk} keys != {n_len} lengths"
            )
        if n_len and bool((self._lengths < 0).any()):
            bad = int(torch.nonzero(self._lengths < 0)[0])
            raise SparseInputError(
                f"KeyedJaggedTensor: negative length {int(self._lengths[bad])} for key "
                f"'{self._keys[bad // max(self._stride, 1)]}', sample {bad % max(self._stride, 1)}"
            )
        total = int(self._lengths.sum()) if n_len else 0
        if total != self._values.numel():
            raise SparseInputError(
                f"KeyedJaggedTensor: sum(lengths)={total} != len(values)={self._values.numel()}"
            )
        if self._length_per_key is not None:
            actual = self.lengths_2d().sum(dim=1).tolist() if n_len else [0] * nk
            if list(self._length_per_key) != actual:
                raise SparseInputError(
                    f"KeyedJaggedTensor: length_per_key {self._length_per_key} does not match the lengths "
                    f"(ids per key {actual})"
                )
        if self._weights is not None and self._weights.numel() != self._values.numel():
            raise SparseInputError(
                f"KeyedJaggedTensor: len(weights)={self._weights.numel()} != "
                f"len(values)={self._values.numel()}; weights are one per id"
            )

    # ------------------------------------------------------------ constructors
    @staticmethod
    def from_lengths_sync(
        keys: Sequence[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None = None,
        stride: int | None = None,
    ) -> "KeyedJaggedTensor":
        return KeyedJaggedTensor(keys, values, lengths=lengths, weights=weights, stride=stride)

    from_lengths = from_lengths_sync

    @staticmethod
    def from_offsets_sync(
        keys: Sequence[str],
        values: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None = None,
        stride: int | None = None,
    ) -> "KeyedJaggedTensor":
        return KeyedJaggedTensor(keys, values, offsets=offsets, weights=weights, stride=stride)

    @staticmethod
    def from_jt_dict(jt_dict: dict[str, JaggedTensor]) -> "KeyedJaggedTensor":
        """Concatenate per-key JaggedTensors (all with the same batch size)."""
        keys = list(jt_dict)
        jts = [jt_dict[k] for k in keys]
        if not jts:
            return KeyedJaggedTensor.empty()
        strides = {jt.lengths().numel() for jt in jts}
        if len(strides) != 1:
            raise SparseInputError(f"from_jt_dict: keys have different batch sizes {sorted(strides)}")
        has_w = [jt.weights_or_none() is not None for jt in jts]
        if any(has_w) and not all(has_w):
            raise SparseInputError("from_jt_dict: either all or none of the keys must have weights")
        return KeyedJaggedTensor(
            keys,
            torch.cat([jt.values() for jt in jts]),
            lengths=torch.cat([jt.lengths() for jt in jts]),
            weights=torch.cat([jt.weights() for jt in jts]) if all(has_w) else None,
        )

    @staticmethod
    def empty(device: torch.device | str | None = None, stride: int = 0) -> "KeyedJaggedTensor":
        z = torch.zeros(0, dtype=torch.int64, device=device)
        return KeyedJaggedTensor([], z, lengths=z.clone(), stride=stride, validate=False)

    # --------------------------------------------------------------- accessors
    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        if self._offsets is None:
            self._offsets = _to_offsets(self._lengths)
        return self._offsets

    def weights(self) -> torch.Tensor:
        if self._weights is None:
            raise SparseInputError("KeyedJaggedTensor has no weights (unweighted features)")
        return self._weights

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def stride(self) -> int:
        """Batch size ``B``."""
        return self._stride

    def device(self) -> torch.device:
        return self._values.device

    def lengths_2d(self) -> torch.Tensor:
        """``[F, B]`` view of the lengths."""
        return self._lengths.view(len(self._keys), self._stride)

    def length_per_key(self) -> list[int]:
        """Number of ids of each key in this batch (host ints; syncs on CUDA)."""
        if self._length_per_key is None:
            if not self._keys:
                self._length_per_key = []
            else:
                self._length_per_key = self.lengths_2d().sum(dim=1).tolist()
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        out = [0]
        for n in self.length_per_key():
            out.append(out[-1] + n)
        return out

    def __getitem__(self, key: str) -> JaggedTensor:
        try:
            i = self._keys.index(key)
        except ValueError:
            raise KeyError(f"KeyedJaggedTensor has no key '{key}'; keys are {self._keys}") from None
        opk = self.offset_per_key()
        s, e = opk[i], opk[i + 1]
        return JaggedTensor(
            self._values[s:e],
            lengths=self._lengths[i * self._stride : (i + 1) * self._stride],
            weights=None if self._weights is None else self._weights[s:e],
        )

    def to_dict(self) -> dict[str, JaggedTensor]:
        return {k: self[k] for k in self._keys}

    # ------------------------------------------------------------- transforms
    def permute(self, indices: Sequence[int]) -> "KeyedJaggedTensor":
        """Reorder (or select / repeat) keys: new key ``j`` is old key ``indices[j]``."""
        opk = self.offset_per_key()
        lpk = self.length_per_key()
        B = self._stride
        vals, lens, ws = [], [], []
        for i in indices:
            vals.append(self._values[opk[i] : opk[i + 1]])
            lens.append(self._lengths[i * B : (i + 1) * B])
            if self._weights is not None:
                ws.append(self._weights[opk[i] : opk[i + 1]])
        dev = self._values.device
        return KeyedJaggedTensor(
            [self._keys[i] for i in indices],
            torch.cat(vals) if vals else torch.zeros(0, dtype=self._values.dtype, device=dev),
            lengths=torch.cat(lens) if lens else torch.zeros(0, dtype=self._lengths.dtype, device=dev),
            weights=(torch.cat(ws) if ws else self._weights[:0]) if self._weights is not None else None,
            stride=B,
            validate=False,
            length_per_key=[lpk[i] for i in indices],
        )

    def select_keys(self, keys: Sequence[str]) -> "KeyedJaggedTensor":
        """Sub-KJT with only ``keys`` (in that order)."""
        idx = []
        for k in keys:
            if k not in self._keys:
                raise KeyError(f"KeyedJaggedTensor has no key '{k}'; keys are {self._keys}")
            idx.append(self._keys.index(k))
        return self.permute(idx)

    def split(self, segments: Sequence[int]) -> list["KeyedJaggedTensor"]:
        """Split keys into consecutive groups of ``segments[i]`` keys each."""
        if sum(segments) != len(self._keys):
            raise SparseInputError(
                f"KeyedJaggedTensor.split: segments {list(segments)} sum to {sum(segments)}, "
                f"expected the number of keys {len(self._keys)}"
            )
        out = []
        start = 0
        for n in segments:
            out.append(self.permute(list(range(start, start + n))) if n else
                       KeyedJaggedTensor([], self._values[:0], lengths=self._lengths[:0],
                                         weights=None if self._weights is None else self._weights[:0],
                                         stride=self._stride, validate=False))
            start += n
        return out

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "KeyedJaggedTensor":
        return KeyedJaggedTensor(
            self._keys,
            self._values.to(device, non_blocking=non_blocking),
            lengths=self._lengths.to(device, non_blocking=non_blocking),
            offsets=None if self._offsets is None else self._offsets.to(device, non_blocking=non_blocking),
            weights=None if self._weights is None else self._weights.to(device, non_blocking=non_blocking),
            stride=self._stride,
            validate=False,
            length_per_key=self._length_per_key,
        )

    def pin_memory(self) -> "KeyedJaggedTensor":
        return KeyedJaggedTensor(
            self._keys,
            self._values.pin_memory(),
            lengths=self._lengths.pin_memory(),
            offsets=None if self._offsets is None else self._offsets.pin_memory(),
            weights=None if self._weights is None else self._weights.pin_memory(),
            stride=self._stride,
            validate=False,
            length_per_key=self._length_per_key,
        )

    def record_stream(self, stream: "torch.cuda.Stream") -> None:
        for t in (self._values, self._lengths, self._offsets, self._weights):
            if t is not None:
                t.record_stream(stream)

    def __repr__(self) -> str:
        return (
            f"KeyedJaggedTensor(keys={self._keys}, stride={self._stride}, values={self._values}, "
            f"lengths={self._lengths}, weights={self._weights})"
        )


class KeyedTensor:
    """Pooled embeddings of several keys, concatenated along ``key_dim``.

    Args:
        keys: names, one per block.
        length_per_key: width (embedding dim) of each key's block.
        values: ``[B, sum(length_per_key)]`` float tensor (``key_dim=1``).
    """

    def __init__(
        self, keys: Sequence[str], length_per_key: Sequence[int], values: torch.Tensor, key_dim: int = 1
    ) -> None:
        self._keys = list(keys)
        self._length_per_key = list(length_per_key)
        if len(self._keys) != len(self._length_per_key):
            raise SparseInputError(
                f"KeyedTensor: {len(self._keys)} keys but {len(self._length_per_key)} lengths"
            )
        if values.size(key_dim) != sum(self._length_per_key):
            raise SparseInputError(
                f"KeyedTensor: values.size({key_dim})={values.size(key_dim)} != "
                f"sum(length_per_key)={sum(self._length_per_key)}"
            )
        self._values = values
        self._key_dim = key_dim

    @staticmethod
    def from_tensor_list(keys: Sequence[str], tensors: Iterable[torch.Tensor], key_dim: int = 1) -> "KeyedTensor":
        ts = list(tensors)
        return KeyedTensor(keys, [t.size(key_dim) for t in ts], torch.cat(ts, dim=key_dim), key_dim)

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def length_per_key(self) -> list[int]:
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        out = [0]
        for n in self._length_per_key:
            out.append(out[-1] + n)
        return out

    def key_dim(self) -> int:
        return self._key_dim

    def __getitem__(self, key: str) -> torch.Tensor:
        i = self._keys.index(key)
        o = self.offset_per_key()
        return self._values.narrow(self._key_dim, o[i], o[i + 1] - o[i])

    def to_dict(self) -> dict[str, torch.Tensor]:
        return {k: self[k] for k in self._keys}

    def __repr__(self) -> str:
        return f"KeyedTensor(keys={self._keys}, length_per_key={self._length_per_key}, values={tuple(self._values.shape)})"
