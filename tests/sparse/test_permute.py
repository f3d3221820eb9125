"""Segment permutation (dlrmctl.sparse.permute): FBGEMM's kernel and the torch path give the same
bits as a plain loop, on segments with zero lengths, repeats, dropped segments and empty data."""

import pytest
import torch

from dlrmctl.sparse import permute
from dlrmctl.sparse.permute import SegmentPermutation, fbgemm_permute_available


def _loop(perm, lengths, data):
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    parts = [data[starts[p]: starts[p + 1]] for p in perm]
    return torch.cat(parts) if parts else data[:0]


PATHS = ["torch"] + (["fbgemm"] if fbgemm_permute_available() else [])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_segment_permutation_matches_a_loop(path, dtype, monkeypatch):
    monkeypatch.setattr(permute, "USE_FBGEMM", path == "fbgemm")
    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        S = int(torch.randint(1, 12, (1,), generator=g))
        lengths = torch.randint(0, 5, (S,), generator=g)
        lengths[torch.rand(S, generator=g) < 0.3] = 0  # empty segments (empty bags, zero-length features)
        if trial % 5 == 0:
            lengths.zero_()  # no data at all
        data = torch.randint(-2**31, 2**31 - 1, (int(lengths.sum()),), generator=g).to(dtype)
        # repeats (a feature sent to every column shard) and dropped segments
        perm = torch.randint(0, S, (int(torch.randint(0, 2 * S, (1,), generator=g)),), generator=g).tolist()
        want = _loop(perm, lengths.tolist(), data)
        sp = SegmentPermutation(perm, S, "cpu")
        got = sp.apply(lengths, data, int(lengths[perm].sum()) if perm else 0)
        assert got.dtype == dtype and torch.equal(got, want), (perm, lengths.tolist())


def test_identity_returns_the_data_and_bad_permutations_are_refused():
    data = torch.arange(5)
    sp = SegmentPermutation([0, 1], 2, "cpu")
    assert sp.identity and sp.apply(torch.tensor([2, 3]), data, 5) is data
    with pytest.raises(ValueError, match="out of range"):
        SegmentPermutation([0, 2], 2, "cpu")


@pytest.mark.skipif(not fbgemm_permute_available(), reason="needs FBGEMM's permute_1D_sparse_data")
def test_the_switch_picks_the_kernel(monkeypatch):
    calls = []
    real = permute.segment_gather_index
    monkeypatch.setattr(permute, "segment_gather_index", lambda *a: calls.append(1) or real(*a))
    sp = SegmentPermutation([1, 0], 2, "cpu")
    lengths, data = torch.tensor([1, 2]), torch.tensor([7, 8, 9])
    monkeypatch.setattr(permute, "USE_FBGEMM", True)
    a = sp.apply(lengths, data, 3)
    assert calls == []
    monkeypatch.setattr(permute, "USE_FBGEMM", False)
    b = sp.apply(lengths, data, 3)
    assert calls == [1] and torch.equal(a, b) and a.tolist() == [8, 9, 7]
