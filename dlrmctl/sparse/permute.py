"""Segment permutation: reorder (select, repeat) the variable-length segments of a flat tensor
in one pass — the kernel behind the sharded input dist's send and receive buffers.

A flat ``data [N]`` is cut into consecutive segments of ``seg_lengths [S]`` elements; the
result is the concatenation of segments ``perm[0], perm[1], ...`` (a segment may appear
several times or not at all).  With FBGEMM loaded this is ``fbgemm::permute_1D_sparse_data``
(a segment = a bag); without it, the same bits from one ``index_select`` whose gather index
is built on the device from the lengths (``cumsum`` + ``repeat_interleave``, given the output
size so that nothing is read back to the host).  The permutation is a plan constant: build it
once with :class:`SegmentPermutation` and apply it every step.

:data:`USE_FBGEMM` switches the kernel for the whole process (tests force the torch path with
it; the GPU machine may have no FBGEMM at all and then always takes the torch path).
"""

from __future__ import annotations

from typing import Sequence

import torch

#: use ``fbgemm::permute_1D_sparse_data`` when FBGEMM is loaded (False: always the torch path)
USE_FBGEMM = True

_HAS_OP: bool | None = None


def fbgemm_permute_available() -> bool:
    """FBGEMM is loaded (``dlrmctl._fbgemm``) and registers ``permute_1D_sparse_data``."""
    global _HAS_OP
    if _HAS_OP is None:
        from dlrmctl import _fbgemm

        try:
            ok = _fbgemm.ensure_checked()
        except Exception:  # a broken install is reported elsewhere (the TBE modules); here: torch path
            ok = False
        _HAS_OP = bool(ok and hasattr(torch.ops.fbgemm, "permute_1D_sparse_data"))
    return _HAS_OP


class SegmentPermutation:
    """A fixed permutation of segments, applied to data of varying segment lengths.

    Args:
        perm: source segment index of each output segment (ints in ``[0, num_segments)``,
            repeats allowed).
        num_segments: ``S``, the number of source segments.
        device: where the data lives.
    """

    def __init__(self, perm: Sequence[int], num_segments: int, device: torch.device | str) -> None:
        perm = list(map(int, perm))
        if any(not 0 <= p < num_segments for p in perm):
            raise ValueError(f"segment permutation {perm} out of range for {num_segments} segments")
        self.num_segments = num_segments
        self.perm = perm
        #: int64 for the torch path's gathers, int32 for FBGEMM's kernel
        self.perm64 = torch.tensor(perm, dtype=torch.int64, device=device)
        self.perm32 = self.perm64.to(torch.int32)
        #: the identity (nothing to move: :meth:`apply` returns ``data`` itself)
        self.identity = perm == list(range(num_segments))

    def __len__(self) -> int:
        return len(self.perm)

    def apply(self, seg_lengths: torch.Tensor, data: torch.Tensor, out_size: int) -> torch.Tensor:
        """The permuted segments of ``data``.

        Args:
            seg_lengths: ``[num_segments]`` integer lengths, on ``data``'s device.
            data: ``[N]``, ``N = sum(seg_lengths)``, any dtype.
            out_size: ``sum(seg_lengths[perm])`` (a host int: no device read).

        Returns:
            ``[out_size]``, ``data``'s dtype and device.
        """
        if self.identity:
            return data
        if out_size == 0:
            return data[:0]
        if USE_FBGEMM and fbgemm_permute_available():
            return torch.ops.fbgemm.permute_1D_sparse_data(self.perm32, seg_lengths, data, None, out_size)[1]
        return data.index_select(0, segment_gather_index(self.perm64, seg_lengths, out_size))


def segment_gather_index(perm: torch.Tensor, seg_lengths: torch.Tensor, out_size: int) -> torch.Tensor:
    """``idx [out_size]`` int64 with ``data[idx]`` = the segments ``perm`` of ``data`` (torch ops only).

    Args:
        perm: ``[S_out]`` int64 source segment of each output segment.
        seg_lengths: ``[S]`` integer segment lengths.
        out_size: ``sum(seg_lengths[perm])``.
    """
    lens = seg_lengths.to(torch.int64)
    starts = torch.cumsum(lens, 0) - lens
    out_lens = lens.index_select(0, perm)
    out_starts = torch.cumsum(out_lens, 0) - out_lens
    shift = torch.repeat_interleave(starts.index_select(0, perm) - out_starts, out_lens, output_size=out_size)
    return torch.arange(out_size, dtype=torch.int64, device=lens.device) + shift
