"""Checkpoint integrity and safety (format dcp-v2, ``dlrmctl.train.checkpoint``), without fbgemm:

- a save writes every file once (nothing in the checkpoint is opened for reading) and records
  block CRC-32s computed from the bytes as they were written;
- a reader reads, and verifies, only the rows of the saved chunks it loads (counted in bytes);
  a damaged block is refused naming the file, the byte range and the entry; other rows still load;
- non-tensor entries (trainer state, RNG states, data position) are JSON: they load with pickle
  and ``torch.load`` disabled; ``.metadata`` goes through a restricted unpickler that refuses
  any other global; the previous format (pickled entries) is refused naming its version;
- an offline reshard of a 2-rank checkpoint to 3 ranks reads at most 1.2x the checkpoint and
  copies every row exactly.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import pickle
import random
import zlib

import numpy as np
import pytest
import torch

try:
    from tests.dist_utils import run_multiprocess
except ImportError:  # pragma: no cover - tests run as a plain directory
    from dist_utils import run_multiprocess
from dlrmctl.train import checkpoint as ckpt
from dlrmctl.train.checkpoint import format as ckpt_format
from dlrmctl.train.checkpoint import integrity

ROWS, DIM = 4096, 64  # 1 MiB of float32


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(ckpt_format, "BLOCK_BYTES", 4096)
    return 4096


def _table(seed=0):
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(seed))


def _save(run, w, step=1, extra=None):
    st = {"emb/t/weight": ckpt.Blocks([ROWS, DIM], [((0, 0), w)]), "dense/x": torch.arange(7.0),
          "meta/trainer": ckpt.pack({"step": step, "best": float("-inf"), "data": {"epoch": 0, "pos": (1, 2)}}),
          "rank/0": ckpt.pack({"rng": ckpt.rng_state()}), **(extra or {})}
    return ckpt.save_checkpoint(run, step, st)


def _rows(path, r0, n, counter=None):
    out = torch.zeros(n, DIM)
    ckpt.load_checkpoint(path, {"emb/t/weight": ckpt.Blocks([ROWS, DIM], [((r0, 0), out)])}, counter=counter)
    return out


def test_a_reader_reads_and_verifies_only_the_rows_it_loads(tmp_path, small_blocks):
    w = _table()
    path = _save(str(tmp_path), w)
    meta = ckpt.load_checkpoint_meta(path)
    data = meta["files"]["__0_0.distcp"]
    assert data["block_bytes"] == small_blocks and data["bytes"] > ROWS * DIM * 4
    md_bytes = meta["files"][".metadata"]["bytes"]
    c: dict = {}
    np.testing.assert_array_equal(_rows(path, 1000, 100, c).numpy(), w[1000:1100].numpy())
    want = 100 * DIM * 4
    # .metadata once, the 100 rows rounded out to whole 4 KiB blocks (at most one more at each end)
    assert want + md_bytes <= c["bytes_read"] <= want + 2 * small_blocks + md_bytes, c
    c = {}
    _rows(path, 0, ROWS, c)
    assert c["bytes_read"] <= ROWS * DIM * 4 + 2 * small_blocks + md_bytes < data["bytes"] + md_bytes


def test_a_chunk_is_read_slab_by_slab_into_its_target_never_whole(tmp_path, small_blocks, monkeypatch):
    """Rows go from the file into the target in slabs of READ_SLAB_BYTES (export loads a 10M-row table
    without a second whole-table buffer): values exact, column narrowing per slab, every slab's
    buffer bounded."""
    w = _table(3)
    path = _save(str(tmp_path), w)
    slab = 5 * DIM * 4 + 100  # 5 rows per slab, not a multiple of the block size
    monkeypatch.setattr(ckpt_format, "READ_SLAB_BYTES", slab)
    sizes = []
    real = integrity.CheckedFile.read

    def spy(self, start, end, what=""):
        sizes.append(end - start)
        return real(self, start, end, what)

    monkeypatch.setattr(integrity.CheckedFile, "read", spy)
    np.testing.assert_array_equal(_rows(path, 7, 23).numpy(), w[7:30].numpy())
    data_reads = [n for n in sizes if n <= slab]
    assert len(data_reads) == 5 and max(data_reads) == 5 * DIM * 4, sizes  # 23 rows: 5 + 5 + 5 + 5 + 3
    # a column slice of the rows (a column_wise target) through the same slabs
    out = torch.zeros(23, 16)
    ckpt.load_checkpoint(path, {"emb/t/weight": ckpt.Blocks([ROWS, DIM], [((7, 32), out)])})
    np.testing.assert_array_equal(out.numpy(), w[7:30, 32:48].numpy())


def test_a_damaged_chunk_is_refused_naming_the_file_and_bytes_and_other_rows_still_load(tmp_path, small_blocks):
    w = _table(1)
    path = _save(str(tmp_path), w)
    f = os.path.join(path, "__0_0.distcp")
    raw = bytearray(open(f, "rb").read())
    at = raw.find(w[3000].numpy().tobytes())
    assert at > 0
    raw[at + 5] ^= 0xFF
    with open(f, "wb") as h:
        h.write(raw)
    np.testing.assert_array_equal(_rows(path, 0, 2000).numpy(), w[:2000].numpy())  # not read: not checked
    with pytest.raises(ckpt.CheckpointError) as e:
        _rows(path, 2990, 20)
    msg = str(e.value)
    blk = (at + 5) // small_blocks
    assert f in msg and f"bytes {blk * small_blocks}-{(blk + 1) * small_blocks} (block {blk} of" in msg
    assert "'emb/t/weight' chunk at [0, 0]" in msg and "CRC-32" in msg and "corrupted" in msg
    with open(f, "wb") as h:  # truncated: refused before any read, naming the file
        h.write(raw[: at])
    with pytest.raises(ckpt.CheckpointError, match=f"{f}: {at} bytes, expected {len(raw)}.*truncated"):
        _rows(path, 0, 10)


def test_save_writes_each_file_once_and_never_reads_the_checkpoint_back(tmp_path, monkeypatch):
    root = os.path.join(str(tmp_path), "checkpoints")
    opened: list[tuple[str, str]] = []
    real = builtins.open

    def spy(file, mode="r", *a, **k):
        if isinstance(file, (str, os.PathLike)) and os.path.abspath(str(file)).startswith(root + os.sep):
            opened.append((os.path.relpath(str(file), root), mode))
        return real(file, mode, *a, **k)

    monkeypatch.setattr(builtins, "open", spy)
    monkeypatch.setattr(io, "open", spy)
    path = _save(str(tmp_path), _table())
    monkeypatch.undo()
    names = [n for n, _ in opened]
    assert all("r" not in m for _, m in opened), opened
    data = [n for n in names if n.endswith(".distcp")]
    assert data == [os.path.join(".step_00000001.tmp", "__0_0.distcp")], opened  # one file, opened once
    files = ckpt.load_checkpoint_meta(path)["files"]
    assert set(files) == {"__0_0.distcp", ".metadata"}
    assert os.path.getsize(os.path.join(path, "__0_0.distcp")) == files["__0_0.distcp"]["bytes"]


def test_non_tensor_entries_are_json_and_load_with_pickle_and_torch_load_disabled(tmp_path, monkeypatch):
    torch.manual_seed(5)
    np.random.seed(5)
    random.seed(5)
    w = _table(2)
    path = _save(str(tmp_path), w)
    rng_before = ckpt.rng_state()
    torch.rand(3), np.random.rand(3), random.random()  # move every generator on

    def refuse(*a, **k):
        raise AssertionError("pickle / torch.load called while loading a checkpoint")

    for mod, name in [(pickle, "loads"), (pickle, "load"), (torch, "load")]:
        monkeypatch.setattr(mod, name, refuse)
    st = {"meta/trainer": None, "rank/0": None, "dense/x": torch.zeros(7)}
    ckpt.load_checkpoint(path, st)
    out = _rows(path, 0, ROWS)
    monkeypatch.undo()
    assert ckpt.unpack(st["meta/trainer"]) == {"step": 1, "best": float("-inf"), "data": {"epoch": 0, "pos": (1, 2)}}
    json.loads(st["meta/trainer"].numpy().tobytes())  # the entry's bytes are plain JSON
    assert torch.equal(out, w) and torch.equal(st["dense/x"], torch.arange(7.0))
    ckpt.set_rng_state(ckpt.unpack(st["rank/0"])["rng"])  # RNG states restored exactly
    assert torch.equal(torch.get_rng_state(), rng_before["torch"]) and random.getstate() == rng_before["python"]
    a, b = np.random.get_state(), rng_before["numpy"]
    assert a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2:] == b[2:]


def test_pack_round_trips_json_values_and_refuses_other_objects():
    obj = {"step": 3, "f": 0.1, "nan": float("nan"), "t": (1, (2.5, None)), 7: [True, "x"], "__tuple__": 1,
           "ten": torch.arange(6, dtype=torch.int16).reshape(2, 3), "arr": np.arange(4, dtype=np.uint32),
           "bf": torch.tensor([1.5], dtype=torch.bfloat16), "np": np.float64(2.25), "empty": torch.empty(0, 3)}
    got = ckpt.unpack(ckpt.pack(obj))
    assert got["step"] == 3 and got["f"] == 0.1 and np.isnan(got["nan"]) and got["t"] == (1, (2.5, None))
    assert got[7] == [True, "x"] and got["__tuple__"] == 1 and got["np"] == 2.25
    assert torch.equal(got["ten"], obj["ten"]) and got["ten"].dtype == torch.int16
    assert torch.equal(got["bf"], obj["bf"]) and got["empty"].shape == (0, 3)
    assert got["arr"].dtype == np.uint32 and np.array_equal(got["arr"], obj["arr"])
    # every array / tensor keeps its shape, dtype (byte order included) and values, whatever its rank and layout
    shaped = [np.array(5.0), np.zeros((0, 2)), np.arange(3, dtype=">i4"), np.array([1 + 2j]),
              np.arange(12, dtype=np.int16).reshape(3, 4).T, np.arange(6.0).reshape(2, 3)[:, ::2],
              torch.tensor(3), torch.arange(6.0).reshape(2, 3).t(), torch.zeros(2, 0, 1)]
    for a, b in zip(shaped, ckpt.unpack(ckpt.pack(shaped))):
        if isinstance(a, torch.Tensor):
            assert b.shape == a.shape and b.dtype == a.dtype and torch.equal(a, b)
        else:
            assert b.shape == np.shape(a) and b.dtype == a.dtype and np.array_equal(a, b), (a, b)
    with pytest.raises(TypeError, match=r"meta/x\.cfg: a .*SimpleNamespace cannot be stored"):
        from types import SimpleNamespace
        ckpt.pack({"cfg": SimpleNamespace(a=1)}, "meta/x")
    with pytest.raises(ckpt.CheckpointError, match="pickled entries"):
        ckpt.unpack(pickle.dumps({"step": 1}))
    with pytest.raises(TypeError, match="'meta/x': a bytes would be pickled"):
        ckpt.save_checkpoint("/nonexistent", 1, {"meta/x": b"raw"})


def _rewrite_metadata(path, raw):
    """Replace .metadata and its recorded size / block CRCs (as if written so)."""
    with open(os.path.join(path, ".metadata"), "wb") as h:
        h.write(raw)
    meta = json.load(open(os.path.join(path, "meta.json")))
    B = meta["files"][".metadata"]["block_bytes"]
    crcs = [zlib.crc32(raw[i:i + B]) for i in range(0, len(raw), B)]
    meta["files"][".metadata"].update(bytes=len(raw), crc32=integrity.crcs_to_text(crcs))
    meta["files_crc32"] = integrity.files_crc(meta["files"])
    json.dump(meta, open(os.path.join(path, "meta.json"), "w"))


class _Evil:
    def __reduce__(self):
        return (os.getcwd, ())


def test_metadata_is_unpickled_with_dcp_classes_only_and_old_formats_are_refused(tmp_path):
    path = _save(str(tmp_path), _table())
    md = ckpt.read_metadata(path)
    assert md.state_dict_metadata["emb/t/weight"].size == torch.Size([ROWS, DIM])
    _rewrite_metadata(path, pickle.dumps(_Evil()))
    with pytest.raises(ckpt.CheckpointError, match=r"\.metadata: cannot be read .*global '(posix|nt)\.getcwd' is not "
                                                   "one of DCP's metadata classes"):
        ckpt.read_metadata(path)
    meta = json.load(open(os.path.join(path, "meta.json")))
    meta["format"] = "dcp-v1"
    json.dump(meta, open(os.path.join(path, "meta.json"), "w"))
    with pytest.raises(ckpt.CheckpointError, match="format 'dcp-v1' is older than 'dcp-v2' and is not loaded.*pickled"):
        ckpt.load_checkpoint_meta(path)



def test_a_damaged_meta_json_is_refused_as_a_checkpoint_error_naming_the_field(tmp_path):
    path = _save(str(tmp_path), _table())
    mp = os.path.join(path, "meta.json")
    good = json.load(open(mp))
    data = next(f for f in good["files"] if f != ".metadata")

    def with_(fn):
        m = json.loads(json.dumps(good))
        fn(m)
        return json.dumps(m)

    cases = [
        ("[]", "a JSON list, expected an object"),
        ("null", "a JSON NoneType, expected an object"),
        (b"\xff\xfe{", "corrupted"),
        (with_(lambda m: m.pop("files")), "'files' must map each checkpoint file"),
        (with_(lambda m: m["files"].pop(".metadata")), "'files' must map each checkpoint file, .metadata included"),
        (with_(lambda m: m["files"].__setitem__(data, [])), f"file '{data}': a JSON list"),
        (with_(lambda m: m["files"][data].pop("bytes")), "'bytes' is None, expected an integer >= 0"),
        (with_(lambda m: m["files"][data].__setitem__("bytes", "12")), "'bytes' is '12'"),
        (with_(lambda m: m["files"][data].__setitem__("block_bytes", 0)), "'block_bytes' is 0, expected an integer >= 1"),
        (with_(lambda m: m["files"][data].__setitem__("crc32", 5)), "'crc32' is a int, expected base64 text"),
        (with_(lambda m: m["files"][data].__setitem__("tensors", None)), "'tensors' must map item offsets"),
        (with_(lambda m: m["files"][data].__setitem__("tensors", {"0": "704"})), "'tensors' must map item offsets"),
        (with_(lambda m: m.__setitem__("format", ["dcp-v2"])), r"format \['dcp-v2'\] .*damaged"),
    ]
    for text, msg in cases:
        with open(mp, "wb") as f:
            f.write(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(ckpt.CheckpointError, match=r"meta\.json: .*" + msg):
            _rows(path, 0, 3)
    # well-formed but wrong values in the file table (e.g. one digit of a raw data offset: the rows
    # of another place, whose block CRCs pass) are caught by the table's own CRC-32
    key = next(iter(good["files"][data]["tensors"]))
    for fn in (lambda m: m["files"][data]["tensors"].__setitem__(key, m["files"][data]["tensors"][key] + 4),
               lambda m: m["files"][data]["tensors"].clear(),
               lambda m: m["files"][".metadata"].__setitem__("block_bytes", 64)):
        open(mp, "w").write(with_(fn))
        with pytest.raises(ckpt.CheckpointError, match=r"meta\.json: corrupted: its file table .* does not match "
                                                       "its CRC-32 files_crc32"):
            _rows(path, 0, 3)
    # a meta.json without files_crc32 (written before it) still loads; an offset past its item is refused
    open(mp, "w").write(with_(lambda m: m.pop("files_crc32")))
    assert torch.equal(_rows(path, 0, 3), _table()[:3])
    big = max(good["files"][data]["tensors"], key=lambda k: -int(k))  # the first item: the table
    open(mp, "w").write(with_(lambda m: (m.pop("files_crc32"), m["files"][data]["tensors"].__setitem__(big, 10 ** 7))))
    with pytest.raises(ckpt.CheckpointError, match=r"raw bytes at offset 10000000 of an item of \d+ bytes: .*meta\.json "
                                                   "is corrupted"):
        _rows(path, 0, 3)
    json.dump(good, open(mp, "w"))
    assert torch.equal(_rows(path, 5, 3), _table()[5:8])


# ------------------------------------------------------- 2 -> 3 reshard
RESHARD = {"t0": (20000, 32), "t1": (10000, 32)}


def _full(name):
    R, D = RESHARD[name]
    return torch.arange(R * D, dtype=torch.float32).reshape(R, D) + (1e6 if name == "t1" else 0)


def _save_two_rank_job(env, run):
    """A 2-rank checkpoint (3.9 MB): t0 row-wise over both ranks, t1 table-wise on rank 1, each with a
    [rows] moment (default block sizes: ~1/4096 of each rank's file)."""
    from dlrmctl.train import checkpoint as c

    r = env.rank
    R0, _ = RESHARD["t0"]
    half = R0 // 2
    w0 = _full("t0")[r * half:(r + 1) * half].clone()
    st = {"emb/t0/weight": c.Blocks(list(RESHARD["t0"]), [((r * half, 0), w0)]),
          "emb/t0/state0": c.Blocks([R0], [((r * half,), w0[:, 0].clone())]),
          "emb/t1/weight": c.Blocks(list(RESHARD["t1"]), [((0, 0), _full("t1"))] if r == 1 else []),
          "emb/t1/state0": c.Blocks([RESHARD["t1"][0]], [((0,), _full("t1")[:, 0].clone())] if r == 1 else []),
          "dense/x": torch.arange(5.0), "meta/trainer": c.pack({"step": 9}), f"rank/{r}": c.pack({"rng": c.rng_state()})}
    c.save_checkpoint(run, 9, st, r, 2, env.pg, extra_meta={"tables": {k: list(v) for k, v in RESHARD.items()},
                                                            "plan": None})
    return r


def test_reshard_2_to_3_ranks_reads_at_most_1_2x_the_checkpoint_and_is_exact(tmp_path):
    from types import SimpleNamespace

    from typer.testing import CliRunner

    from dlrmctl.cli import app
    from dlrmctl.distributed.model_parallel import plan_from_types

    run = str(tmp_path / "run")
    run_multiprocess(_save_two_rank_job, 2, run, timeout_s=120)
    tables = [SimpleNamespace(name=n, num_embeddings=r, embedding_dim=d) for n, (r, d) in RESHARD.items()]
    plan3 = plan_from_types(tables, "row_wise", 3)
    plan3.save(str(tmp_path / "plan3.yaml"))
    r = CliRunner().invoke(app, ["checkpoint", "reshard", run, "--nproc", "3", "--plan", str(tmp_path / "plan3.yaml"),
                                 "--out", str(tmp_path / "r3")], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    path = ckpt.latest_checkpoint(str(tmp_path / "r3"))
    src = ckpt.load_checkpoint_meta(path)["resharded_from"]
    print(f"reshard 2 -> 3: read {src['bytes_read']:,} of {src['bytes']:,} bytes "
          f"({src['bytes_read'] / src['bytes']:.3f}x; per rank {src['bytes_read_per_rank']})")
    assert f"read {src['bytes_read']:,} bytes of the {src['bytes']:,}-byte source checkpoint" in r.output
    assert len(src["bytes_read_per_rank"]) == 3 and src["bytes_read"] <= 1.2 * src["bytes"]
    for name, (R, D) in RESHARD.items():
        w, m = torch.zeros(R, D), torch.zeros(R)
        ckpt.load_checkpoint(path, {f"emb/{name}/weight": w, f"emb/{name}/state0": m})
        assert torch.equal(w, _full(name)) and torch.equal(m, _full(name)[:, 0]), name


class _FakeGPUs:
    """torch.cuda with ``n`` visible GPUs, each generator a 16-byte state; the all-GPU calls fail."""

    def __init__(self, monkeypatch, n: int) -> None:
        self.n = n
        self.states = {i: torch.full((16,), i, dtype=torch.uint8) for i in range(n)}
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.n)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_rng_state", self.get)
        monkeypatch.setattr(torch.cuda, "set_rng_state", self.set)

        def every_gpu(*a, **k):
            raise AssertionError("the RNG state of every visible GPU was touched")

        monkeypatch.setattr(torch.cuda, "get_rng_state_all", every_gpu)
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", every_gpu)

    def _index(self, device) -> int:
        i = torch.device(device).index
        if not 0 <= i < self.n:
            raise RuntimeError(f"CUDA error: invalid device ordinal {i} ({self.n} visible)")
        return i

    def get(self, device="cuda"):
        return self.states[self._index(device)].clone()

    def set(self, state, device="cuda"):
        self.states[self._index(device)] = state.clone()


def test_rng_state_holds_only_this_ranks_gpu_and_resumes_with_fewer_visible_gpus(tmp_path, monkeypatch):
    """Item 10: a rank saves the CPU generators and its own CUDA device's (one state, no per-GPU list)
    and restores only its own device's, so a job saved on 8 GPUs resumes on a machine with 2."""
    gpus = _FakeGPUs(monkeypatch, 8)
    st = ckpt.rng_state(torch.device("cuda", 5))  # rank 5 of an 8-GPU node
    assert isinstance(st["cuda"], torch.Tensor) and torch.equal(st["cuda"], gpus.states[5])
    assert ckpt.rng_state("cpu").keys() == {"torch", "numpy", "python"}  # a CPU rank saves no CUDA state
    saved = ckpt.unpack(ckpt.pack({"rng": st}))["rng"]  # as a checkpoint stores it
    assert not isinstance(saved["cuda"], (list, tuple))
    fewer = _FakeGPUs(monkeypatch, 2)  # the resume: 2 visible GPUs, this rank on cuda:1
    ckpt.set_rng_state(saved, torch.device("cuda", 1))
    assert torch.equal(fewer.states[1], gpus.states[5]) and torch.equal(fewer.states[0], torch.zeros(16, dtype=torch.uint8))
    ckpt.set_rng_state(saved, "cpu")  # a CPU resume of a GPU run: the CUDA state is not applied
    # a checkpoint of the previous layout (every visible GPU's state from every rank): own entry only
    old = dict(saved, cuda=[torch.full((16,), 10 + i, dtype=torch.uint8) for i in range(8)])
    ckpt.set_rng_state(old, torch.device("cuda", 1))
    assert torch.equal(fewer.states[1], old["cuda"][1])
    ckpt.set_rng_state(dict(old, cuda=old["cuda"][:1]), torch.device("cuda", 1))  # none for this device: skipped
    assert torch.equal(fewer.states[1], old["cuda"][1])
