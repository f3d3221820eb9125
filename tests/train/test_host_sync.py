"""Host-sync budget of the training step, counted in the training thread over 20 steps of
2-rank sharded training (evaluation and checkpointing excluded): calls that read a tensor's
value on the host (``.item()``, ``.tolist()``, ``int()``, ``float()``, ``bool()``, and ``.cpu()`` /
``.numpy()`` of a tensor on the training device), and ``torch.tensor(data, device=...)`` of host
data (on CUDA a copy from pageable memory, which waits for the device; ``host_to_device`` stages
in pinned memory instead).

On CUDA each of these calls blocks the host until the device catches up, so the pipeline can
no longer run ahead.  The budget, per step (docs/distributed.md, "Host-sync budget"):

* 1: the input_dist size exchange (one ``tolist`` of the sizes every rank sends; it sizes the
  buffers of the id all-to-all); none with an all-data_parallel plan;
* +1 only when a data_parallel table is larger than 8 MiB (its sparse-gradient row counts);
* +1 on the steps that read the loss (every ``train.log_every`` steps), +1 per epoch (the
  ranks agree on the number of steps).

So at most 2 per step without a large data_parallel table, 3 on a logging step with one.
"""

import os
import sys
import threading

import pytest
import torch

from tests.conftest import REPO
from tests.dist_utils import run_multiprocess

#: budget named in docs/distributed.md ("Host-sync budget")
SYNC_BUDGET_PER_STEP = 2
STEPS = 20
LOG_EVERY = 10


def package_dir() -> str:
    """The directory of the imported ``dlrmctl`` package (symlinks resolved)."""
    import dlrmctl

    return os.path.realpath(os.path.dirname(dlrmctl.__file__))


def owned_by_dlrmctl(filename: str, pkg_dir: str | None = None) -> bool:
    """Whether code of ``filename`` (a frame's ``co_filename``) is dlrmctl's own: the file lies inside
    the imported package's directory ``pkg_dir`` (default :func:`package_dir`).  Decided by ownership,
    not by a substring of the path: torch's and FBGEMM's files in a venv inside a clone called
    ``dlrmctl`` (``.../dlrmctl/.venv/lib/.../fbgemm_gpu/...``) are not dlrmctl's."""
    pkg = pkg_dir or package_dir()
    return os.path.realpath(filename).startswith(pkg + os.sep)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    from dlrmctl.data.synthetic import generate_synthetic

    d = tmp_path_factory.mktemp("sync")
    # t_C26 has 300,000 rows x dim 8 = 9.6 MB: a data_parallel table above the 8 MiB densify limit
    generate_synthetic(d, rows=6000, seed=1, num_embeddings=[60] * 25 + [300_000])
    return str(d)


class SyncCounter:
    """Counts host reads of tensor values made by dlrmctl's code in one thread while
    ``active`` (torch's own, e.g. an optimizer reading its CPU step counter, and the
    loader thread's work on CPU batches are not device syncs)."""

    METHODS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")
    #: reads of a tensor counted when it lies on the training device (``device``)
    DEVICE_METHODS = ("cpu", "numpy")

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.calls: dict[str, int] = {}
        self.active = False
        self._thread = threading.get_ident()
        self._orig = {}
        self._pkg = package_dir()
        self._owned: dict[str, bool] = {}  # co_filename -> owned_by_dlrmctl (realpath once per file)

    def owns(self, filename: str) -> bool:
        """:func:`owned_by_dlrmctl`, memoised per file."""
        if filename not in self._owned:
            self._owned[filename] = owned_by_dlrmctl(filename, self._pkg)
        return self._owned[filename]

    def _count(self, what: str) -> None:
        if self.active and threading.get_ident() == self._thread:
            caller = sys._getframe(2)
            if self.owns(caller.f_code.co_filename):
                key = f"{what} at {os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}"
                self.calls[key] = self.calls.get(key, 0) + 1

    def __enter__(self):
        for m in self.METHODS + self.DEVICE_METHODS:
            orig = getattr(torch.Tensor, m)
            self._orig[m] = orig
            on_device = m in self.DEVICE_METHODS

            def wrap(t, *a, _m=m, _o=orig, _d=on_device, **kw):
                if not _d or t.device == self.device:
                    self._count(_m)
                return _o(t, *a, **kw)

            setattr(torch.Tensor, m, wrap)
        orig_tensor = torch.tensor
        self._orig_tensor = orig_tensor

        def tensor(data, *a, **kw):
            if kw.get("device") is not None and not torch.is_tensor(data):
                self._count("torch.tensor(host data, device=)")
            return orig_tensor(data, *a, **kw)

        torch.tensor = tensor
        return self

    def __exit__(self, *exc):
        for m, o in self._orig.items():
            setattr(torch.Tensor, m, o)
        torch.tensor = self._orig_tensor

    @property
    def total(self) -> int:
        return sum(self.calls.values())


def _count_syncs(env, data, run_root, plan_types, log_every, embedding_opt=None, fp16=False, count_ops=False):
    """Per-step host syncs of 2-rank sharded training.  ``fp16``: a GradScaler on this CPU trainer (fp16
    autocast is CUDA-only; the scaling path is device-agnostic), and the scaler's own host read (torch's
    ``grad_scaler.py``) counted too.  ``count_ops``: :class:`OpSyncCounter` (ops that size their output
    on the host), with the dense-kernel optimizer's sync-free pass that a CUDA device takes."""
    from dlrmctl.config import config_from_dict
    from dlrmctl.distributed.env import RunEnv
    from dlrmctl.train.trainer import Trainer

    raw = {
        "name": "sync",
        "data": {"path": data, "batch_size": 128, "eval_batch_size": 4096},
        "model": {"embedding_dim": 8, "dense_arch_layer_sizes": [16, 8], "over_arch_layer_sizes": [16, 1]},
        "optimizer": {"embedding": embedding_opt or {}},
        "train": {"epochs": 1, "max_steps": STEPS, "log_every": log_every, "seed": 0, "run_dir": run_root,
                  "pipeline": "sparse_dist", "progress": False, "eval_every": 0, "checkpoint_every": 0},
        "sharding": {"tables": {t: {"sharding_type": st, **({"compute_kernel": "dense"} if st == "data_parallel" else {})}
                                for t, st in plan_types.items()}},
    }
    cfg = config_from_dict(raw)
    run = os.path.join(run_root, cfg.name)
    os.makedirs(run, exist_ok=True)
    tr = Trainer(cfg, RunEnv(env.rank, env.world_size, env.local_world_size, env.device, env), run)
    counter = (OpSyncCounter if count_ops else SyncCounter)(env.device)
    if count_ops:
        from dlrmctl.optim import rows

        rows.SYNC_FREE_ROWS_ON_CPU = True  # this worker process only
    if fp16:
        import torch.amp.grad_scaler as gs

        tr.amp.scaler = torch.amp.GradScaler("cpu")
        scaler_file = os.path.realpath(gs.__file__)
        owns = counter.owns
        counter.owns = lambda f: owns(f) or os.path.realpath(f) == scaler_file
    per_step = _syncs_per_step(tr, counter)
    return tr.step, counter.total, counter.calls, per_step


def _syncs_per_step(tr, counter) -> list[int]:
    """Train ``tr`` under ``counter``: the syncs from the start of each step to the start of the next
    (the last: to the end of training, its last loss read); evaluation and checkpoint saves, wrapped
    on this trainer instance, are not counted."""
    def paused(fn):
        def run_paused(*a, **kw):
            counter.active = False
            try:
                return fn(*a, **kw)
            finally:
                counter.active = True
        return run_paused

    tr.evaluator.validate, tr.checkpointer.save = paused(tr.evaluator.validate), paused(tr.checkpointer.save)
    marks: list[int] = []
    orig_step = tr.run_step

    def marked_step(*a, **kw):
        marks.append(counter.total)
        return orig_step(*a, **kw)

    tr.run_step = marked_step
    with counter:
        counter.active = True
        tr.train()
        marks.append(counter.total)
        counter.active = False
    return [b - a for a, b in zip(marks, marks[1:])]


def test_the_sync_counter_counts_host_copies_and_device_reads():
    def dlrmctl_like_code():  # counted only for code owned by dlrmctl: run it from a dlrmctl frame
        t = torch.ones(3)
        torch.tensor([1, 2], device="cpu")
        torch.tensor([1, 2])  # a host tensor: no copy to a device
        torch.tensor(t, device="cpu")  # a tensor argument: not host data
        t.cpu()
        t.numpy()
        t.tolist()

    with SyncCounter("cpu") as c:
        c.owns = lambda filename: filename == __file__
        c.active = True
        dlrmctl_like_code()
    kinds = sorted(k.split(" at ")[0] for k in c.calls)
    assert kinds == ["cpu", "numpy", "tolist", "torch.tensor(host data, device=)"] and c.total == 4
    with SyncCounter("meta") as c:  # .cpu() / .numpy() of a tensor on another device than training's
        c.owns = lambda filename: filename == __file__
        c.active = True
        dlrmctl_like_code()
    assert c.total == 2


OPTIMIZERS = {"adam": {"type": "adam", "lr": 0.01}, "weight_decay": {"type": "exact_rowwise_adagrad", "weight_decay": 1e-4},
              "sgd_weight_decay": {"type": "exact_sgd", "weight_decay": 1e-4}}


@pytest.mark.multiprocess
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_the_adam_family_and_weight_decay_stay_within_the_host_sync_budget(tiny_data, tmp_path, opt):
    # data_parallel tables under Adam / weight decay took the sparse path (a tolist, host->device
    # copies) every step; now they are densified with a lookup count per row
    kinds = ["row_wise", "table_wise", "data_parallel"]
    types = {f"t_C{i + 1}": kinds[i % len(kinds)] for i in range(25)}
    types["t_C26"] = "row_wise"
    res = run_multiprocess(_count_syncs, 2, tiny_data, str(tmp_path), types, LOG_EVERY, OPTIMIZERS[opt], timeout_s=240)
    for steps, total, calls, per_step in res:
        print(f"{opt}: {total} host syncs in {steps} steps, per step {per_step}: {calls}")
        assert steps == STEPS and len(per_step) == STEPS
        assert max(per_step) <= SYNC_BUDGET_PER_STEP, (per_step, calls)
        assert total <= SYNC_BUDGET_PER_STEP * STEPS + 1, calls


@pytest.mark.multiprocess
@pytest.mark.parametrize("plan", ["table_row_mix", "with_small_data_parallel", "with_large_data_parallel",
                                  "only_data_parallel"])
def test_training_step_stays_within_the_host_sync_budget(tiny_data, tmp_path, plan):
    kinds = ["row_wise", "table_wise", "column_wise", "table_row_wise", "table_column_wise"]
    if plan == "with_small_data_parallel":
        kinds.append("data_parallel")
    if plan == "only_data_parallel":  # no input_dist: the global batch size is all-reduced on the device
        kinds = ["data_parallel"]
    types = {f"t_C{i + 1}": kinds[i % len(kinds)] for i in range(25)}
    types["t_C26"] = "data_parallel" if plan in ("with_large_data_parallel", "only_data_parallel") else "row_wise"
    large_dp = types["t_C26"] == "data_parallel"
    res = run_multiprocess(_count_syncs, 2, tiny_data, str(tmp_path), types, LOG_EVERY, timeout_s=240)
    for steps, total, calls, per_step in res:
        print(f"{plan}: {total} host syncs in {steps} steps, per step {per_step}: {calls}")
        assert steps == STEPS and len(per_step) == STEPS
        for i, n in enumerate(per_step):
            step = i + 1
            budget = SYNC_BUDGET_PER_STEP + (1 if large_dp and step % LOG_EVERY == 0 else 0)
            assert n <= budget, f"step {step}: {n} host syncs (budget {budget}); all steps {per_step}: {calls}"
        # + 1: the ranks agree on the epoch's number of steps before the first one
        assert total <= SYNC_BUDGET_PER_STEP * STEPS + 1 + (STEPS // LOG_EVERY if large_dp else 0), calls


@pytest.mark.multiprocess
def test_table_row_wise_across_hosts_stays_within_the_host_sync_budget(tiny_data, tmp_path):
    """4 ranks as 2 hosts x 2: table_row_wise takes its two-level output dist (no host read of its
    own: the split sizes come from the size exchange), beside table_wise and row_wise tables."""
    kinds = ["table_row_wise", "table_wise", "row_wise"]
    types = {f"t_C{i + 1}": kinds[i % len(kinds)] for i in range(25)}
    types["t_C26"] = "row_wise"
    res = run_multiprocess(_count_syncs, 4, tiny_data, str(tmp_path), types, LOG_EVERY, local_world_size=2,
                           timeout_s=300)
    for steps, total, calls, per_step in res:
        assert steps == STEPS and len(per_step) == STEPS
        assert max(per_step) <= SYNC_BUDGET_PER_STEP, (per_step, calls)
        assert total <= SYNC_BUDGET_PER_STEP * STEPS + 1, calls


class OpSyncCounter(SyncCounter):
    """:class:`SyncCounter`, plus the torch ops whose output size the host must read on CUDA (a
    device sync inside the op): ``coalesce``, ``unique`` / ``unique_consecutive``, ``nonzero``,
    ``masked_select``, and ``repeat_interleave`` of tensor repeats without ``output_size``.  On the
    CPU they cost nothing, so this counts what the same code would wait for on a GPU."""

    TENSOR_OPS = ("coalesce", "unique", "unique_consecutive", "nonzero", "masked_select")
    TORCH_OPS = ("unique", "unique_consecutive", "nonzero", "masked_select", "repeat_interleave")

    def __enter__(self):
        super().__enter__()
        self._orig_ops = []
        for owner, names in ((torch.Tensor, self.TENSOR_OPS), (torch, self.TORCH_OPS)):
            for m in names:
                orig = getattr(owner, m)
                self._orig_ops.append((owner, m, orig))

                def wrap(*a, _m=m, _o=orig, **kw):
                    if _m != "repeat_interleave" or (len(a) > 1 and torch.is_tensor(a[1])
                                                     and kw.get("output_size") is None):
                        self._count(_m)
                    return _o(*a, **kw)

                setattr(owner, m, wrap)
        return self

    def __exit__(self, *exc):
        for owner, m, orig in self._orig_ops:
            setattr(owner, m, orig)
        return super().__exit__(*exc)


def test_the_op_sync_counter_counts_ops_that_size_their_output_on_the_host():
    def dlrmctl_like_code():
        g = torch.sparse_coo_tensor(torch.tensor([[3, 1, 3]]), torch.ones(3, 2), (5, 2))
        g.coalesce()
        torch.unique_consecutive(torch.tensor([1, 1, 2]))
        torch.nonzero(torch.tensor([0, 1]))
        torch.repeat_interleave(torch.ones(2), torch.tensor([1, 2]))
        torch.repeat_interleave(torch.ones(2), torch.tensor([1, 2]), output_size=3)  # sized: no sync

    with OpSyncCounter("meta") as c:
        c.owns = lambda filename: filename == __file__
        c.active = True
        dlrmctl_like_code()
    assert sorted(k.split(" at ")[0] for k in c.calls) == ["coalesce", "nonzero", "repeat_interleave",
                                                            "unique_consecutive"]


def _dense_kernel_syncs(data, run_root, num_tables, opt):
    """Per-step host syncs (:class:`OpSyncCounter` on the training device) of ``num_tables`` tables on
    the ``dense`` kernel, one process (no process group): the dense fallback a GPU without
    fbgemm_gpu runs."""
    from dlrmctl.config import config_from_dict
    from dlrmctl.distributed.env import RunEnv
    from dlrmctl.train.trainer import Trainer

    tables = [{"name": f"t_C{i + 1}", "feature_names": [f"C{i + 1}"]} for i in range(num_tables)]
    raw = {
        "name": f"dense{num_tables}_{opt}",
        "data": {"path": data, "batch_size": 128, "eval_batch_size": 4096},
        "model": {"embedding_dim": 8, "dense_arch_layer_sizes": [16, 8], "over_arch_layer_sizes": [16, 1],
                  "compute_kernel": "dense", "tables": tables},
        "optimizer": {"embedding": OPTIMIZERS.get(opt, {"type": opt})},
        "train": {"epochs": 1, "max_steps": STEPS, "log_every": LOG_EVERY, "seed": 0, "run_dir": run_root,
                  "pipeline": "sparse_dist", "progress": False, "eval_every": 0, "checkpoint_every": 0},
    }
    cfg = config_from_dict(raw)
    run = os.path.join(run_root, cfg.name)
    os.makedirs(run, exist_ok=True)
    tr = Trainer(cfg, RunEnv(device=torch.device("cpu")), run)
    assert tr.optimizers.embedding_dense is not None and not tr.optimizers.fused.optimizer_steps()
    counter = OpSyncCounter("cpu")
    per_step = _syncs_per_step(tr, counter)
    return tr.step, per_step, counter.calls


@pytest.mark.parametrize("opt", ["exact_rowwise_adagrad", "exact_adagrad", "sgd_weight_decay", "adam"])
def test_the_dense_kernel_step_syncs_do_not_grow_with_the_number_of_tables(tiny_data, tmp_path, opt, monkeypatch):
    from dlrmctl.optim import rows as optim

    monkeypatch.setattr(optim, "SYNC_FREE_ROWS_ON_CPU", True)  # the pass a CUDA device takes
    # the dense fallback ran a coalesce() (or unique_consecutive) per table per step in the embedding
    # optimizer: 26 device syncs a step for the demo's 26 tables on a GPU without fbgemm_gpu
    res = {n: _dense_kernel_syncs(tiny_data, str(tmp_path), n, opt) for n in (2, 26)}
    for n, (steps, per_step, calls) in res.items():
        print(f"{opt}, {n} dense tables: per step {per_step}: {calls}")
        assert steps == STEPS and len(per_step) == STEPS
        # the embedding optimizer step (dlrmctl/optim/): none
        optim_files = {f.name for f in (REPO / "dlrmctl" / "optim").glob("[!_]*.py")}
        assert not [k for k in calls if k.split(" at ")[1].split(":")[0] in optim_files], calls
    assert res[2][1] == res[26][1], (res[2][2], res[26][2])


@pytest.mark.multiprocess
@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
def test_large_data_parallel_tables_and_fp16_stay_within_the_host_sync_budget_counting_sized_ops(
        tiny_data, tmp_path, fp16):
    """Counted with :class:`OpSyncCounter` (the ops whose output size the host reads on CUDA) and the
    dense-kernel optimizer's CUDA pass: a data_parallel table above 8 MiB costs one sync per step for
    all such tables together (its row counts), not a ``unique`` per table; fp16 adds one, the
    GradScaler's inf check in ``scaler.step`` (counted in torch's own file), and no read of dlrmctl's."""
    kinds = ["row_wise", "table_wise", "data_parallel"]
    types = {f"t_C{i + 1}": kinds[i % len(kinds)] for i in range(25)}
    types["t_C26"] = "data_parallel"
    res = run_multiprocess(_count_syncs, 2, tiny_data, str(tmp_path), types, LOG_EVERY, None, fp16, True,
                           timeout_s=300)
    for steps, total, calls, per_step in res:
        print(f"fp16={fp16}: {total} host syncs in {steps} steps, per step {per_step}: {calls}")
        assert steps == STEPS and len(per_step) == STEPS
        assert not [k for k in calls if "unique" in k or "coalesce" in k], calls
        for i, n in enumerate(per_step):
            step = i + 1
            budget = SYNC_BUDGET_PER_STEP + (1 if fp16 else 0) + (1 if step % LOG_EVERY == 0 else 0)
            assert n <= budget, f"step {step}: {n} host syncs (budget {budget}); all steps {per_step}: {calls}"
        if fp16:
            scaler_reads = sum(v for k, v in calls.items() if "grad_scaler.py" in k)
            assert scaler_reads == STEPS, calls  # exactly the scaler's one inf check per step
            assert not [k for k in calls if "amp.py" in k], calls
