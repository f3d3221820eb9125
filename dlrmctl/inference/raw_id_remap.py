"""The frozen raw-id remap of an inference program: the held ids and rows of every managed-collision
feature (:mod:`dlrmctl.modules.managed_collision`) as of the end of training, looked up with ATen
ops only, so ``torch.export`` traces it (the ``.pt2`` program) and TorchScript scripts it.  An id
the remapper did not hold maps to its table's default row, as in evaluation."""

from __future__ import annotations

import torch
from torch import nn


def raw_id_remap(mc, feature_names: list[str]) -> "RawIdRemap":
    """The remap step of an exported program: a copy of what ``mc`` (a
    :class:`~dlrmctl.modules.managed_collision.ManagedCollisionCollection`) holds for every managed
    feature among the program's input features ``feature_names``
    (:meth:`~dlrmctl.modules.managed_collision.ManagedCollisionCollection.held_rows`)."""
    return RawIdRemap(mc.held_rows(feature_names), len(feature_names))


class RawIdRemap(nn.Module):
    """Raw ids -> rows for the managed features of an inference program, with ATen ops only
    (``repeat_interleave``, ``searchsorted``, ``where``): what training's last state held, frozen.
    An id the remapper did not hold maps to its table's default row (module docstring).
    Traceable by ``torch.export`` (the ``.pt2`` program) and scriptable (the TorchScript artifact).

    ``forward(values [N] int64, lengths [F*B] int64 key-major, B) -> values [N] int64``: the
    values of each managed feature replaced by rows; the other features' values unchanged.

    Args:
        per_feature: ``(feature index, sorted ids [S], their rows [S], default row)`` per managed feature.
        num_features: ``F``, the program's input features.
    """

    def __init__(self, per_feature: list[tuple[int, torch.Tensor, torch.Tensor, int]], num_features: int) -> None:
        super().__init__()
        self.num_features = int(num_features)
        self.per_feature = nn.ModuleList(_FeatureRemap(f, ids, rows, d) for f, ids, rows, d in per_feature)

    def forward(self, values: torch.Tensor, lengths: torch.Tensor, batch: int) -> torch.Tensor:
        feat = torch.repeat_interleave(torch.arange(self.num_features * batch, dtype=torch.int64,
                                                    device=values.device), lengths,
                                       output_size=values.size(0)) // batch
        return self.rows(values, feat)

    def rows(self, values: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        """``values [N]`` int64 with ``feat [N]`` int64 (each id's input feature index) -> ``[N]``
        int64: the managed features' ids replaced by their rows, the others unchanged."""
        out = values
        for m in self.per_feature:
            out = m(values, feat, out)
        return out


class _FeatureRemap(nn.Module):
    """One managed feature of :class:`RawIdRemap`: ``(values [N], feat [N], out [N]) -> out [N]``
    with the values of feature ``feature`` (``feat == feature``) replaced by their rows.

    Args:
        feature: the feature's input index.
        ids: the held raw ids ``[S]`` int64, sorted ascending.
        rows: their rows ``[S]`` int64.
        default: the row of an id not held.
    """

    def __init__(self, feature: int, ids: torch.Tensor, rows: torch.Tensor, default: int) -> None:
        super().__init__()
        self.feature = int(feature)
        self.default = int(default)
        self.empty = int(ids.numel()) == 0
        self.register_buffer("ids", ids.to(torch.int64).contiguous())
        self.register_buffer("rows", rows.to(torch.int64).contiguous())

    def forward(self, values: torch.Tensor, feat: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.empty:  # nothing held: every id takes the default row
            mapped = torch.full_like(values, self.default)
        else:
            pos = torch.searchsorted(self.ids, values).clamp(max=self.ids.size(0) - 1)
            mapped = torch.where(self.ids[pos] == values, self.rows[pos], self.default)
        return torch.where(feat == self.feature, mapped, out)
