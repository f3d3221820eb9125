"""The ``torch.export`` inference program of a DLRM (``model.pt2``, ``dlrmctl export``'s default).

:class:`InferenceProgram` is an ``nn.Module`` made only of ATen ops, so ``torch.export.export``
traces it with a dynamic batch and id count, ``torch.export.load`` runs it in any process with
torch (no dlrmctl, no fbgemm_gpu) and AOTInductor compiles it for C++.

``forward(dense, values, lengths[, weights]) -> (scores [B], logits [B])`` float32:

* ``dense`` ``[B, D_in]`` float32 (transformed as in training, e.g. log(x+1)); the model's
  standardisation (``model.dense_standardize``) is inside the program;
* ``values`` ``[N]`` int64 raw ids of all bags, key-major in ``manifest["sparse_features"]`` order;
  a feature trained with an on-the-fly multi-hot expansion (``data.multi_hot_sizes``) takes its
  one-hot ids: the program expands each into its bag (:func:`dlrmctl.data.multi_hot.multi_hot_expand`);
* ``lengths`` ``[F*B]`` int64, key-major;
* ``weights`` ``[N]`` float32, only for a model with weighted features (entries of unweighted
  features ignored).

The on-invalid-id policy is inside: ``error`` fails the call (``RuntimeError`` naming the table,
the feature and the valid range, from ``aten._assert_async``), ``zero`` drops the id from its bag.
A multi-hot feature's one-hot id is checked against its expansion's rows first (``error``: fails
naming the feature; ``zero``: the id is dropped with its whole expanded bag), then each expanded
id against its table, as training's loader + EBC do.

Embedding lookup (why plain ATen ops, measured in docs/export.md): every table lives in one flat
buffer of its storage type -- fp32, fp16, int8 codes or int4 packed codes (two per byte, low nibble
first), int8/int4 with a float32 ``(scale, bias)`` per row taken exactly from the fp16 values the
quantizer stores (:mod:`dlrmctl.inference.quantize`).  Each id gathers its row's ``D_max`` elements
(masked past its table's dim), dequantizes ``q * scale + bias`` in float32 and is summed into its
bag with ``index_add`` (times its weight; divided by the number of valid ids for mean pooling).
There is no alignment requirement, so every dim works; an odd int4 row is stored padded by one
code (the row's minimum, so its scale and bias are the unpadded row's) and the pad is never read.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from dlrmctl.inference.quantize import QuantizedTable

__all__ = ["InferenceProgram", "export_program"]

_BITS = {"int8": 8, "int4": 4}


class InferenceProgram(nn.Module):
    """``(dense, values, lengths[, weights]) -> (scores, logits)``, both ``[B]`` float32 (module doc).

    Args:
        tables: the quantized tables (all of one storage dtype), table order.
        lookup_table: per lookup (one per (table, feature), the EBC's output order) its table index.
        lookup_src: per lookup the input feature index it reads.
        lookup_mean: per lookup, mean pooling.
        lookup_names: per lookup ``(table, feature)`` names (error messages).
        dense_part: ``(dense [B, D_in], pooled [B, sum of lookup dims]) -> logits [B, 1]`` (eager).
        feature_names: input features (``F``).
        num_dense: ``D_in``.
        on_invalid_id: ``error`` | ``zero``.
        feature_weighted: per input feature, its weights are used (default none: no weights input).
        multi_hot: per input feature ``(rows, offsets [1024, size-1] int64)`` of its on-the-fly
            multi-hot expansion, or None (absent: no expansion).
        remap: the raw id -> row step of managed-collision features
            (:class:`~dlrmctl.modules.managed_collision.RawIdRemap`), run before everything else;
            their ``values`` are raw ids.
    """

    def __init__(
        self,
        tables: Sequence[QuantizedTable],
        lookup_table: Sequence[int],
        lookup_src: Sequence[int],
        lookup_mean: Sequence[bool],
        lookup_names: Sequence[tuple[str, str]],
        dense_part: nn.Module,
        feature_names: Sequence[str],
        num_dense: int,
        on_invalid_id: str = "error",
        feature_weighted: Sequence[bool] | None = None,
        multi_hot: Sequence[tuple[int, torch.Tensor] | None] | None = None,
        remap: nn.Module | None = None,
    ) -> None:
        super().__init__()
        #: raw id -> row of the managed-collision features (a RawIdRemap), run first; None: none
        self.remap = remap
        dtypes = {q.dtype for q in tables}
        if len(dtypes) != 1:
            raise ValueError(f"all tables must share one storage dtype, got {sorted(dtypes)}")
        self.dtype = dtypes.pop()
        self.dense_part = dense_part
        self.num_features = len(feature_names)
        self.feature_names = [str(f) for f in feature_names]
        self.num_dense = int(num_dense)
        self.zero_invalid = on_invalid_id == "zero"
        self.lookup_names = [tuple(n) for n in lookup_names]
        self.lookup_rows = [int(tables[t].num_embeddings) for t in lookup_table]  # python ints: messages
        L = len(lookup_table)
        self.num_lookups = L
        # flat storage: element base and row stride of every table (int4: bytes, two codes each)
        flat, elem_base, row_base, strides = [], [], [], []
        e = r = 0
        for q in tables:
            data = q.data.contiguous()
            stride = data.shape[1] if data.dim() == 2 else 0
            flat.append(data.reshape(-1))
            elem_base.append(e)
            row_base.append(r)
            strides.append(stride)
            e += data.numel()
            r += q.num_embeddings
        self.register_buffer("data", torch.cat(flat) if flat else torch.zeros(0))
        if self.dtype in _BITS:
            self.register_buffer("scale_bias", torch.cat(
                [torch.stack([q.scale.float(), q.bias.float()], 1) for q in tables]).contiguous())
        dims = [tables[t].embedding_dim for t in lookup_table]
        self.d_max = max(dims) if dims else 0
        self.width = sum(dims)
        col = [sum(dims[:i]) for i in range(L)]
        lk = torch.tensor(list(lookup_table), dtype=torch.int64)
        self.register_buffer("l_elem", torch.tensor(elem_base, dtype=torch.int64)[lk] if L else lk)
        self.register_buffer("l_row", torch.tensor(row_base, dtype=torch.int64)[lk] if L else lk)
        self.register_buffer("l_stride", torch.tensor(strides, dtype=torch.int64)[lk] if L else lk)
        self.register_buffer("l_rows", torch.tensor([tables[t].num_embeddings for t in lookup_table], dtype=torch.int64))
        self.register_buffer("l_dim", torch.tensor(dims, dtype=torch.int64))
        self.register_buffer("l_col", torch.tensor(col, dtype=torch.int64))
        self.any_mean = any(lookup_mean)
        self.register_buffer("col_mean", torch.tensor([bool(m) for m, d in zip(lookup_mean, dims) for _ in range(d)],
                                                      dtype=torch.bool))
        self.register_buffer("col_lookup", torch.tensor([i for i, d in enumerate(dims) for _ in range(d)],
                                                        dtype=torch.int64))
        # feature -> its lookups ([F, K], -1 padded): a feature feeding K tables is looked up K times
        per_f = [[i for i, s in enumerate(lookup_src) if s == f] for f in range(self.num_features)]
        self.k_max = max((len(p) for p in per_f), default=1) or 1
        self.register_buffer("f_lookups", torch.tensor([p + [-1] * (self.k_max - len(p)) for p in per_f],
                                                       dtype=torch.int64).reshape(self.num_features, self.k_max))
        fw = [bool(x) for x in feature_weighted] if feature_weighted is not None else [False] * self.num_features
        self.is_weighted = any(fw)
        self.register_buffer("f_weighted", torch.tensor(fw, dtype=torch.bool))
        mh = list(multi_hot) if multi_hot is not None else [None] * self.num_features
        sizes = [1 if m is None else int(m[1].shape[1]) + 1 for m in mh]
        self.s_max = max(sizes, default=1)
        if self.s_max > 1:
            off = torch.zeros(self.num_features, 1024, self.s_max - 1, dtype=torch.int64)
            for f, m in enumerate(mh):
                if m is not None:
                    off[f, :, : m[1].shape[1]] = torch.as_tensor(m[1], dtype=torch.int64)
            self.register_buffer("mh_offsets", off)
            self.register_buffer("mh_size", torch.tensor(sizes, dtype=torch.int64))
            self.register_buffer("mh_rows", torch.tensor([1 if m is None else int(m[0]) for m in mh], dtype=torch.int64))
            self.mh_limits = [None if m is None else int(m[0]) for m in mh]  # python ints: messages

    def forward(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                weights: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.remap is not None:
            values = self.remap(values, lengths, dense.size(0))
        logits = self.dense_part(dense, self.pooled(values, lengths, weights, dense.size(0))).reshape(-1)
        return torch.sigmoid(logits), logits

    def pooled(self, values: torch.Tensor, lengths: torch.Tensor, weights: Optional[torch.Tensor],
               B: int) -> torch.Tensor:
        """Pooled embeddings ``[B, sum of lookup dims]`` float32 (lookup order)."""
        F, L, W = self.num_features, self.num_lookups, self.width
        N = values.size(0)
        torch._assert_async(lengths.sum() == N, "sum(lengths) != len(values): lengths must be [F*B] key-major "
                                                "bag lengths of the values")
        torch._assert_async((lengths >= 0).all(), "lengths must be >= 0")
        bag = torch.repeat_interleave(torch.arange(F * B, dtype=torch.int64, device=values.device), lengths,
                                      output_size=N)
        feat = bag // B
        sample = bag - feat * B
        w = torch.ones(N, dtype=torch.float32, device=values.device)
        if self.is_weighted:
            assert weights is not None, "this model has weighted features: pass weights [N] float32"
            w = torch.where(self.f_weighted[feat], weights, w)
        ids = values
        valid = torch.ones(N, dtype=torch.bool, device=values.device)
        if self.s_max > 1:  # multi-hot expansion of one-hot ids: S slots per id, those past its size masked
            # A one-hot id outside [0, rows) of its expansion has no bag: ``error`` fails the call (the
            # training loader raises on it too), ``zero`` drops the id with its whole bag (no slot of it
            # counts, for mean pooling neither).  The expanded ids then meet the tables' check below,
            # as the expanded bags meet the EBC's in training.
            S = self.s_max
            rows = self.mh_rows[feat]
            oh_bad = (self.mh_size[feat] > 1) & ((ids < 0) | (ids >= rows))
            if not self.zero_invalid:
                n_oh = torch.zeros(F, dtype=torch.int64, device=values.device).index_add_(0, feat, oh_bad.to(torch.int64))
                for f in range(F):
                    lim = self.mh_limits[f]
                    if lim is not None:
                        torch._assert_async(n_oh[f] == 0, f"feature '{self.feature_names[f]}': a one-hot id is out "
                                                          f"of range of its multi-hot expansion; expected 0 <= id < {lim}")
            base = torch.where(oh_bad | (ids < 0) | (ids >= rows), torch.zeros_like(ids), ids)
            off = self.mh_offsets[feat, base % 1024]  # [N, S-1]
            more = (base[:, None] + off) % rows[:, None]
            ids = torch.cat([ids[:, None], more], 1).reshape(-1)
            slot = torch.arange(S, dtype=torch.int64, device=values.device)
            valid = ((slot[None, :] < self.mh_size[feat][:, None]) & ~oh_bad[:, None]).reshape(-1)
            feat, sample, w = feat.repeat_interleave(S), sample.repeat_interleave(S), w.repeat_interleave(S)
        K = self.k_max
        lk = self.f_lookups[feat]  # [M, K]
        if K > 1:
            valid = (valid[:, None] & (lk >= 0)).reshape(-1)
            ids, sample, w = ids.repeat_interleave(K), sample.repeat_interleave(K), w.repeat_interleave(K)
        lk = lk.reshape(-1).clamp(min=0)
        bad = valid & ((ids < 0) | (ids >= self.l_rows[lk]))
        if not self.zero_invalid:
            n_bad = torch.zeros(L, dtype=torch.int64, device=values.device).index_add_(0, lk, bad.to(torch.int64))
            for i in range(L):
                t, f = self.lookup_names[i]
                torch._assert_async(n_bad[i] == 0, f"table '{t}', feature '{f}': an id is out of range; expected "
                                                   f"0 <= id < {self.lookup_rows[i]}")
        valid = valid & ~bad
        ids = torch.where(valid, ids, torch.zeros_like(ids))
        kk = torch.arange(self.d_max, dtype=torch.int64, device=values.device)
        kmask = kk[None, :] < self.l_dim[lk][:, None]  # [M, D_max]
        rowp = self.l_elem[lk] + ids * self.l_stride[lk]
        if self.dtype == "int4":
            pos = torch.where(kmask, rowp[:, None] + kk // 2, torch.zeros_like(kmask, dtype=torch.int64))
            q = (self.data[pos].to(torch.int32) >> ((kk % 2) * 4).to(torch.int32)) & 15
        else:
            pos = torch.where(kmask, rowp[:, None] + kk, torch.zeros_like(kmask, dtype=torch.int64))
            q = self.data[pos]
        if self.dtype in _BITS:
            sb = self.scale_bias[self.l_row[lk] + ids]
            rowv = q.to(torch.float32) * sb[:, 0:1] + sb[:, 1:2]
        else:
            rowv = q.to(torch.float32)
        contrib = rowv * torch.where(valid, w, torch.zeros_like(w))[:, None]
        contrib = torch.where(kmask, contrib, torch.zeros_like(contrib))
        dst = (sample * W + self.l_col[lk])[:, None] + kk
        dst = torch.where(kmask, dst, torch.zeros_like(dst))
        out = torch.zeros(B * W, dtype=torch.float32, device=values.device)
        out = out.index_add(0, dst.reshape(-1), contrib.reshape(-1)).view(B, W)
        if self.any_mean:
            cnt = torch.zeros(B * L, dtype=torch.float32, device=values.device).index_add(
                0, sample * L + lk, valid.to(torch.float32)).view(B, L)
            div = cnt[:, self.col_lookup].clamp(min=1.0)
            out = torch.where(self.col_mean, out / div, out)
        return out


def export_program(program: InferenceProgram, num_dense: int, max_batch: int = 1 << 24,
                   max_ids: int = 1 << 31) -> torch.export.ExportedProgram:
    """``torch.export.export`` of ``program`` with a dynamic batch ``B`` (1..``max_batch``, lengths
    ``F*B``) and a dynamic id count ``N`` (0..``max_ids``, weights ``N`` too).

    Raises:
        torch._dynamo.exc.UserError / RuntimeError: the dense part cannot be exported (message from
            torch.export).
    """
    F = program.num_features
    g = torch.Generator().manual_seed(0)
    Bx = 3
    lengths = torch.full((F * Bx,), 2, dtype=torch.int64)
    n = int(lengths.sum())
    values = torch.zeros(n, dtype=torch.int64)
    args: tuple = (torch.randn(Bx, num_dense, generator=g), values, lengths)
    batch = torch.export.Dim("batch", min=1, max=max_batch)
    ids = torch.export.Dim("ids", min=0, max=max_ids)
    shapes: tuple = ({0: batch}, {0: ids}, {0: F * batch})
    if program.is_weighted:
        args += (torch.ones(n),)
        shapes += ({0: ids},)
    with torch.no_grad():
        return torch.export.export(program.eval(), args, dynamic_shapes=shapes)
