"""The ``torch.export`` inference program of a DLRM (``model.pt2``, ``dlrmctl export``'s default).

:class:`InferenceProgram` is an ``nn.Module`` made only of operators that ship with torch (ATen
and its ``quantized::`` embedding-bag ops), so ``torch.export.export`` traces it with a dynamic
batch and id count, ``torch.export.load`` runs it in any process with torch (no dlrmctl, no
fbgemm_gpu) and AOTInductor compiles it for C++.

``forward(dense, values, lengths[, weights]) -> (scores [B], logits [B])`` float32:

* ``dense`` ``[B, D_in]`` float32 (transformed as in training, e.g. log(x+1)); the model's
  standardisation (``model.dense_standardize``) is inside the program;
* ``values`` ``[N]`` int64 raw ids of all bags, key-major in ``manifest["sparse_features"]`` order;
  a feature trained with an on-the-fly multi-hot expansion (``data.multi_hot_sizes``) takes its
  one-hot ids: the program expands each into its bag (:func:`dlrmctl.data.multi_hot.multi_hot_expand`);
* ``lengths`` ``[F*B]`` int64, key-major;
* ``weights`` ``[N]`` float32, only for a model with weighted features (entries of unweighted
  features ignored).

All inputs on one device; every tensor the program creates is made on the inputs' device
(``*_like`` ops and buffers, no device baked into the graph), so the loaded program moved with
``.to("cuda")`` runs on CUDA inputs.

The on-invalid-id policy is inside: ``error`` fails the call (``RuntimeError`` naming the table,
the feature and the valid range), ``zero`` drops the id from its bag.  The checks are gathered
into one small tensor copied to the host once per call and asserted there
(``aten._assert_async`` on a CPU tensor raises at once), so a bad request fails alone and never
trips a device-side assert that would poison a CUDA context.  A multi-hot feature's one-hot id
is checked against its expansion's rows first (``error``: fails naming the feature; ``zero``: the
id is dropped with its whole expanded bag), then each expanded id against its table, as
training's loader + EBC do.

Dense part: :class:`dlrmctl.inference.dense_head.DotHead` for the dot interaction (per-table
projections, first-order term and pairwise dots in one operator each), else the exported dense
part on the pooled columns.

Embedding lookup: :class:`dlrmctl.inference.lookups.FusedLookups` -- tables grouped by width
into stacked buffers, one fused embedding-bag call per group (ATen's ``quantized::`` row-wise
int8/int4 kernels, ``embedding_bag`` for fp32; a float32 gather-and-add for fp16), every dim.
Ids that are dropped (``zero``) or that would fail the call (``error``) read an all-zero row, so no
id out of range ever reaches a kernel.  Pooling is a float32 sum (times the id's weight for
weighted features); mean pooling divides by the bag's valid ids.  The int4 op has no meta kernel
in torch; :func:`export_program` registers one for tracing only (the saved program needs none).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import nn

from dlrmctl.inference.dense_head import DotHead
from dlrmctl.inference.lookups import FusedLookups, cast, register_int4_meta
from dlrmctl.inference.quantize import QuantizedTable

__all__ = ["InferenceProgram", "export_program"]


class InferenceProgram(nn.Module):
    """``(dense, values, lengths[, weights]) -> (scores, logits)``, both ``[B]`` float32 (module doc).

    Args:
        tables: the quantized tables (all of one storage dtype), table order; an int4 table of odd
            dim holds one pad code per row (``data`` ``[R, (D+1)/2]``, ``embedding_dim`` the real D).
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
            (:class:`~dlrmctl.inference.raw_id_remap.RawIdRemap`), run on the ids after the
            multi-hot expansion (as in training: the loader expands, the model remaps); their
            ``values`` are raw ids.
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
        F = self.num_features = len(feature_names)
        self.feature_names = [str(f) for f in feature_names]
        self.num_dense = int(num_dense)
        self.zero_invalid = on_invalid_id == "zero"
        self.lookup_names = [tuple(n) for n in lookup_names]
        self.lookup_rows = [int(tables[t].num_embeddings) for t in lookup_table]  # python ints: messages
        self.lookup_table = [int(t) for t in lookup_table]
        self.lookup_src = [int(s) for s in lookup_src]
        self.lookup_mean = [bool(m) for m in lookup_mean]
        self.lookup_dim = [int(tables[t].embedding_dim) for t in lookup_table]
        self.num_lookups = len(self.lookup_table)
        # a feature feeding K tables is looked up K times: its k-th lookup reads the ids checked against
        # (and dropped to the zero row of) the k-th table's rows; f_rows [K, F] (0: no k-th lookup)
        per_f = [[i for i, s in enumerate(self.lookup_src) if s == f] for f in range(F)]
        K = self.k_max = max((len(p) for p in per_f), default=1) or 1
        self.lookup_slot = [per_f[s].index(i) for i, s in enumerate(self.lookup_src)]
        for k in range(K):  # per slot k, per feature: its k-th table's rows (0: none) and whether it has one
            self.register_buffer(f"f_rows_{k}", torch.tensor([self.lookup_rows[p[k]] if k < len(p) else 0 for p in per_f],
                                                             dtype=torch.int64).reshape(F))
            self.register_buffer(f"f_has_{k}", torch.tensor([k < len(p) for p in per_f], dtype=torch.bool).reshape(F))
        self.has_all = [all(k < len(p) for p in per_f) for k in range(K)]
        self.register_buffer("f_index", torch.arange(F, dtype=torch.int64))
        fw = [bool(x) for x in feature_weighted] if feature_weighted is not None else [False] * F
        self.is_weighted = any(fw)
        self.all_weighted = all(fw)
        self.register_buffer("f_weighted", torch.tensor(fw, dtype=torch.bool))
        self.lookups = FusedLookups(tables, self.lookup_table, self.lookup_src, self.lookup_slot, F, K)
        # mean pooling: per block, which of its feature rows are mean-pooled lookups
        self.any_mean = any(self.lookup_mean)
        self.block_mean = []
        for b, members in enumerate(self.lookups.block_members):
            mask = torch.zeros(F, dtype=torch.bool)
            for f, i in members:
                mask[f] = self.lookup_mean[i]
            self.register_buffer(f"mean_{b}", mask)
            self.block_mean.append(bool(mask.any()))
        #: the dot interaction's fused dense head over the blocks (:class:`DotHead`), or None: the
        #: dense part runs on the EBC's pooled columns
        self.head = DotHead.build(dense_part, self.lookups, self.lookup_dim, F)
        if self.head is not None:  # its weights live in the head (none kept unused in the program)
            self.dense_part = None
        mh = list(multi_hot) if multi_hot is not None else [None] * F
        sizes = [1 if m is None else int(m[1].shape[1]) + 1 for m in mh]
        self.s_max = max(sizes, default=1)
        if self.s_max > 1:
            off = torch.zeros(F, 1024, self.s_max - 1, dtype=torch.int64)
            for f, m in enumerate(mh):
                if m is not None:
                    off[f, :, : m[1].shape[1]] = torch.as_tensor(m[1], dtype=torch.int64)
            self.register_buffer("mh_offsets", off)
            self.register_buffer("mh_size", torch.tensor(sizes, dtype=torch.int64))
            self.register_buffer("mh_rows", torch.tensor([1 if m is None else int(m[0]) for m in mh], dtype=torch.int64))
            self.register_buffer("mh_slot", torch.arange(self.s_max, dtype=torch.int64))
            self.mh_limits = [None if m is None else int(m[0]) for m in mh]  # python ints: messages

    def forward(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                weights: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        B = dense.size(0)
        blocks = self.pooled_blocks(values, lengths, weights, B, remap=True)
        if self.head is not None:
            logits = self.head(dense, blocks)
        else:
            logits = self.dense_part(dense, self.lookups.columns(blocks, B)).reshape(-1)
        return torch.sigmoid(logits), logits

    def pooled(self, values: torch.Tensor, lengths: torch.Tensor, weights: Optional[torch.Tensor],
               B: int) -> torch.Tensor:
        """Pooled embeddings ``[B, sum of lookup dims]`` float32 (lookup order: the EBC's output)."""
        return self.lookups.columns(self.pooled_blocks(values, lengths, weights, B), B)

    def pooled_blocks(self, values: torch.Tensor, lengths: torch.Tensor, weights: Optional[torch.Tensor],
                      B: int, remap: bool = False) -> list[torch.Tensor]:
        """Pooled (sum, or mean) embeddings per block of :class:`FusedLookups`, each ``[F, B, W_g]``.
        ``remap``: the managed-collision features' raw ids -> rows (``self.remap``), after the
        multi-hot expansion, as training's loader expands the ids before the model's remapper.

        Per-feature values reach the ids by ``repeat_interleave`` over each feature's id count
        (the ids are key-major), not by indexing with a per-id feature vector: one op each."""
        F, N = self.num_features, values.size(0)
        counts = lengths.view(F, B).sum(1)  # [F] ids per feature
        _fail_unless((counts.sum() == N) & (lengths >= 0).all(),
                     "lengths must be [F*B] key-major bag lengths of the values: >= 0, summing to len(values)")
        starts = lengths.cumsum(0) - lengths  # [F*B] first id of each bag

        def per_id(v: torch.Tensor) -> torch.Tensor:
            return torch.repeat_interleave(v, counts, output_size=N)

        w: Optional[torch.Tensor] = None
        if self.is_weighted:
            assert weights is not None, "this model has weighted features: pass weights [N] float32"
            w = weights if self.all_weighted else torch.where(per_id(self.f_weighted), weights, torch.ones_like(weights))
        bags = torch.repeat_interleave(lengths, output_size=N) if self.lookups.dtype == "fp16" else None
        ids, valid, bag_len = values, None, lengths
        if self.s_max > 1:
            feat = per_id(self.f_index)
            ids, valid, feat, w, n_oh = self.expand_multi_hot(values, feat, w)
            starts, bag_len = starts * self.s_max, lengths * self.s_max
            bags = None if bags is None else bags.repeat_interleave(self.s_max)

            def per_id(v: torch.Tensor) -> torch.Tensor:  # noqa: F811 (per expanded id)
                return v[feat]

            if not self.zero_invalid:
                for f, lim in enumerate(self.mh_limits):
                    if lim is not None:
                        _fail_unless(n_oh[f] == 0, f"feature '{self.feature_names[f]}': a one-hot id is out of range "
                                                   f"of its multi-hot expansion; expected 0 <= id < {lim}")
        if remap and self.remap is not None:
            ids = self.remap.rows(ids, per_id(self.f_index))
        oks = self.checked_ids(ids, valid, per_id)
        blocks = self.lookups(ids, oks, starts, w, bags, per_id, B)
        if self.any_mean:
            blocks = self.mean_pooled(blocks, oks, starts, bag_len, B)
        return blocks

    @property
    def range_message(self) -> str:
        """The ``error`` policy's message for an id outside its table (every lookup's range: one
        check per call; :class:`~dlrmctl.inference.export.ExportedModel` names the id and sample)."""
        return ("an id is out of range; expected 0 <= id < rows of its table: "
                + "; ".join(f"table '{t}', feature '{f}': {r}" for (t, f), r in zip(self.lookup_names, self.lookup_rows)))

    def mean_pooled(self, blocks: list[torch.Tensor], oks: list[Optional[torch.Tensor]], starts: torch.Tensor,
                    bag_len: torch.Tensor, B: int) -> list[torch.Tensor]:
        """``blocks`` (sum-pooled ``[F, B, W_g]``) with each mean-pooled lookup's rows divided by
        its bag's valid ids (an empty bag stays 0)."""
        F = self.num_features
        cnt = []
        for ok in oks:
            if ok is None:  # every id of a bag counts
                cnt.append(bag_len)
            else:  # valid ids before each position: a bag's count is a difference
                c = torch.cat([torch.zeros_like(starts[:1]), cast(ok, torch.int64).cumsum(0)])
                cnt.append(c[starts + bag_len] - c[starts])
        out = []
        for b, ((_, k), x) in enumerate(zip(self.lookups.blocks, blocks)):
            if not self.block_mean[b]:
                out.append(x)
                continue
            per = cast(cnt[k].clamp(min=1), torch.float32).view(F, B, 1)
            out.append(torch.where(getattr(self, f"mean_{b}").view(F, 1, 1), x / per, x))
        return out

    def expand_multi_hot(self, ids: torch.Tensor, feat: torch.Tensor, w: Optional[torch.Tensor]
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        """Multi-hot expansion of one-hot ids ``[N]``: ``S`` slots per id (``ids`` ``[N*S]``, those
        past the feature's size not ``valid``), ``feat`` and ``w`` repeated, and per feature the
        count ``[F]`` of one-hot ids outside its expansion's rows.

        A one-hot id outside ``[0, rows)`` of its expansion has no bag: ``error`` fails the call
        (the training loader raises on it too), ``zero`` drops the id with its whole bag (no slot of
        it counts, for mean pooling neither).  The expanded ids then meet the tables' check, as the
        expanded bags meet the EBC's in training.
        """
        S = self.s_max
        rows = self.mh_rows[feat]
        out = (ids < 0) | (ids >= rows)
        oh_bad = (self.mh_size[feat] > 1) & out
        n_oh = torch.zeros_like(self.f_index).index_add(0, feat, cast(oh_bad, torch.int64))
        base = torch.where(out, torch.zeros_like(ids), ids)
        more = (base[:, None] + self.mh_offsets[feat, base % 1024]) % rows[:, None]  # [N, S-1]
        ids = torch.cat([ids[:, None], more], 1).reshape(-1)
        valid = ((self.mh_slot[None, :] < self.mh_size[feat][:, None]) & ~oh_bad[:, None]).reshape(-1)
        return ids, valid, feat.repeat_interleave(S), None if w is None else w.repeat_interleave(S), n_oh

    def checked_ids(self, ids: torch.Tensor, valid: Optional[torch.Tensor],
                    per_id: Callable[[torch.Tensor], torch.Tensor]) -> list[Optional[torch.Tensor]]:
        """Per lookup slot ``k`` a mask ``[M]`` bool: the id is ``valid`` and inside its k-th table's
        rows; None where that holds for every id (``error`` policy: the call failed otherwise).
        Under ``error`` an id outside them fails the call (one check for all lookups)."""
        oks: list[Optional[torch.Tensor]] = []
        checks = []
        for k in range(self.k_max):
            has = per_id(getattr(self, f"f_has_{k}")) if not self.has_all[k] else None
            live = valid if has is None else (has if valid is None else valid & has)
            good = (ids >= 0) & (ids < per_id(getattr(self, f"f_rows_{k}")))
            if self.zero_invalid:
                oks.append(good if live is None else live & good)
                continue
            checks.append(good if live is None else good | ~live)
            oks.append(live)
        if checks:
            _fail_unless(checks[0] if len(checks) == 1 else torch.cat(checks), self.range_message)
        return oks


def _fail_unless(ok: torch.Tensor, message: str) -> None:
    """Fail the call with ``message`` unless every element of ``ok`` (bool, any device) is True.
    ``ok`` is reduced and copied to the host, and asserted there: a CPU ``_assert_async`` raises a
    ``RuntimeError`` at once, never a device-side assert (which would poison a CUDA context)."""
    # an explicit copy: ``.to("cpu")`` of a CPU tensor traces to an alias guarded to stay on the CPU
    # (a 0-d ``ok`` is asserted as it is: one operator less per call)
    torch._assert_async(torch.ops.aten._to_copy(ok if ok.dim() == 0 else ok.all(), device="cpu"), message)


def export_program(program: InferenceProgram, num_dense: int, max_batch: int = 1 << 24,
                   max_ids: int = 1 << 31) -> torch.export.ExportedProgram:
    """``torch.export.export`` of ``program`` with a dynamic batch ``B`` (1..``max_batch``, lengths
    ``F*B``) and a dynamic id count ``N`` (0..``max_ids``, weights ``N`` too).

    Raises:
        torch._dynamo.exc.UserError / RuntimeError: the dense part cannot be exported (message from
            torch.export).
    """
    if program.dtype == "int4":
        register_int4_meta()
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
