"""The argument checks of the sparse containers (:mod:`dlrmctl.sparse.jagged_tensor` describes what
is checked, always or with ``validate``), their errors, and the small helpers they share
(offsets from lengths and back, padding a jagged tensor, a host list copied to the device without
blocking)."""

from __future__ import annotations

from typing import Sequence

import torch


class SparseInputError(ValueError):
    """A sparse input (keys / lengths / offsets / values / weights) is inconsistent."""


class VariableBatchNotSupportedError(SparseInputError, NotImplementedError):
    """An operation not available for variable-batch-per-key KJTs (``concat``, ``empty_like``)."""


INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
ORDER_HINT = (
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


def to_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """``[N]`` lengths -> ``[N+1]`` offsets (exclusive cumsum), same dtype."""
    out = torch.empty(lengths.numel() + 1, dtype=lengths.dtype, device=lengths.device)
    out[:1].zero_()  # only the leading 0: the cumsum writes the rest (no fill of the whole buffer)
    torch.cumsum(lengths, dim=0, out=out[1:])
    return out


def to_lengths(offsets: torch.Tensor) -> torch.Tensor:
    return offsets[1:] - offsets[:-1]


def cumsum(xs: Sequence[int]) -> list[int]:
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out


def check_values(values: torch.Tensor, who: str) -> None:
    if not isinstance(values, torch.Tensor):
        raise SparseInputError(f"{who}: values must be a torch.Tensor, got {type(values).__name__}")
    if values.dim() == 0:
        raise SparseInputError(f"{who}: values must be at least 1-D ([N] or [N, ...]), got a 0-d tensor")


def index_tensor(t: torch.Tensor | None, what: str, who: str) -> torch.Tensor | None:
    """Check a lengths / offsets argument: a 1-D integer tensor (an empty one of any dtype is accepted,
    as in TorchRec, and becomes int64)."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise SparseInputError(f"{who}: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise SparseInputError(f"{who}: {what} must be 1-D, got shape {tuple(t.shape)}")
    if t.dtype not in INT_DTYPES:
        if t.numel() == 0:
            return t.to(torch.int64)
        raise SparseInputError(f"{who}: {what} must be an integer tensor, got {t.dtype}{ORDER_HINT}")
    if t.dtype in (torch.int8, torch.uint8, torch.int16):
        return t.to(torch.int32)  # their cumsum (offsets) would overflow
    return t


def check_weights(weights: torch.Tensor | None, values: torch.Tensor, who: str) -> None:
    if weights is None:
        return
    if not isinstance(weights, torch.Tensor):
        raise SparseInputError(f"{who}: weights must be a torch.Tensor, got {type(weights).__name__}")
    if not weights.is_floating_point():
        raise SparseInputError(
            f"{who}: weights must be floating point (per-id weights), got {weights.dtype}{ORDER_HINT}"
        )
    if weights.dim() == 0 or weights.size(0) != values.size(0):
        n_w = weights.size(0) if weights.dim() else 0
        raise SparseInputError(
            f"{who}: len(weights)={n_w} != len(values)={values.size(0)}; weights are one per id"
        )


def pad_jagged(x: torch.Tensor, lengths: torch.Tensor, offsets: torch.Tensor, n: int, pad: float) -> torch.Tensor:
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


def validate_contents(
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
            parts.append((to_lengths(offsets) != lengths).any().view(1).long())
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
                k = next(i for i, e in enumerate(cumsum(segments)[1:]) if bad < e)
                raise SparseInputError(
                    f"{who}: negative length {int(lengths[bad])} for key '{keys[k]}', "
                    f"sample {bad - cumsum(segments)[k]}"
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
            bad = int(torch.nonzero(to_lengths(offsets) != lengths)[0])
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


def resolve_variable_batch(who: str, nk: int, stride, stride_per_key_per_rank, stride_per_key, inverse_indices):
    """A KeyedJaggedTensor's variable batch per key (TorchRec's VBE) from its arguments (see
    :class:`~dlrmctl.sparse.keyed_jagged.KeyedJaggedTensor`): ``(stride_per_key_per_rank as lists
    or None, stride, stride_per_key)``; with VBE the stride is the largest per-key batch and
    ``stride_per_key`` is consumed (None).

    Raises:
        SparseInputError: per-rank sizes not one non-negative list per key, disagreeing with
            ``stride_per_key`` or ``stride``, or inverse indices without a variable batch.
    """
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
    return spkpr, stride, stride_per_key


def resolve_lengths(who: str, keys: list[str], values: torch.Tensor, weights: torch.Tensor | None,
                    lengths: torch.Tensor | None, offsets: torch.Tensor | None, stride, stride_per_key,
                    spkpr: list[list[int]] | None):
    """A KeyedJaggedTensor's lengths, offsets and stride from its arguments, checked without reading
    tensor contents: ``(lengths [L], offsets [L + 1] or None, stride, lengths given, offsets given,
    bags per key)`` (``L`` the number of bags, ``F * B`` without VBE).

    Raises:
        SparseInputError: as listed in :class:`~dlrmctl.sparse.keyed_jagged.KeyedJaggedTensor`
            (lengths / offsets / weights of the wrong kind or count, values without lengths).
    """
    nk = len(keys)
    check_values(values, who)
    lengths = index_tensor(lengths, "lengths", who)
    offsets = index_tensor(offsets, "offsets", who)
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
        lengths = to_lengths(offsets)
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
                f"keys ({nk}: {keys}); expected len(lengths) == num_keys * batch_size"
            )
        if stride * nk != n_len:
            raise SparseInputError(
                f"{who}: stride {stride} * {nk} keys != {n_len} lengths; expected {stride * nk} lengths "
                f"(one per key and sample, key-major) for keys {keys}"
            )
    if no_lengths and n_val != 0:
        raise SparseInputError(
            f"{who}: {n_val} values but no lengths or offsets (every bag empty); pass lengths= or offsets="
            f"{ORDER_HINT if weights is not None else ''}"
        )
    check_weights(weights, values, who)
    return lengths, offsets, stride, given_lengths, given_offsets, per_key_stride


def check_caches(who: str, keys: list[str], values: torch.Tensor, per_key_stride: list[int], stride,
                 length_per_key, offset_per_key, inverse_indices, lengths_offset_per_key, index_per_key,
                 jt_dict) -> tuple[list[int] | None, tuple[list[str], torch.Tensor] | None]:
    """TorchRec's host-side caches of a KeyedJaggedTensor checked against its keys, stride and
    values (no sync): ``(length_per_key or None, inverse_indices as (keys list, tensor) or None)``.

    Raises:
        SparseInputError: a cache of the wrong length or disagreeing with the rest, inverse indices
            of the wrong keys, shape, dtype or device.
    """
    nk = len(keys)
    n_val = values.size(0)
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
        if list(ikeys) != keys:
            raise SparseInputError(f"{who}: inverse_indices keys {list(ikeys)} != keys {keys}")
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
        want = cumsum(per_key_stride)
        if lopk != want:
            raise SparseInputError(f"{who}: lengths_offset_per_key {lopk} != {want} (stride {stride})")
    if index_per_key is not None:
        want_idx = {k: i for i, k in enumerate(keys)}
        if dict(index_per_key) != want_idx:
            raise SparseInputError(f"{who}: index_per_key {dict(index_per_key)} != {want_idx}")
    if jt_dict is not None and set(jt_dict) != set(keys):
        raise SparseInputError(f"{who}: jt_dict keys {sorted(jt_dict)} != keys {sorted(keys)}")
    return lpk, inverse_indices
