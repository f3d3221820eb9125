"""KeyedTensor: pooled embeddings of several keys side by side, and their expansion back to the
full batch after a variable-batch lookup (TorchRec's VBE)."""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch

from dlrmctl.sparse.jagged_checks import SparseInputError, cumsum


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
            if opk != cumsum(self._length_per_key):
                raise SparseInputError(
                    f"KeyedTensor: offset_per_key {opk} != cumsum of length_per_key {cumsum(self._length_per_key)}"
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
            self._offset_per_key = cumsum(self._length_per_key)
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
