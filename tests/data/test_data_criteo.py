"""Criteo preprocessing: transforms, inputs, vocab, splits, bad lines, resume, multi-hot."""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from dlrmctl.data.columnar import DataError, MappedShard, read_meta
from dlrmctl.data.criteo.parallel import Progress, run_tasks
from dlrmctl.data.criteo.parse import CriteoOptions, decode_hex8, dense_log1p, hex_to_uint32
from dlrmctl.data.criteo.preprocess import preprocess_criteo
from dlrmctl.data.multi_hot import multi_hot_expand

from tests.conftest import SHARED_DATA, require_shared

SHARED = SHARED_DATA / "criteo"
HASH = CriteoOptions(num_embeddings=[1000] * 26)


def line(label="0", dense=None, cats=None) -> str:
    dense = dense if dense is not None else [""] * 13
    cats = cats if cats is not None else ["00000001"] * 26
    return "\t".join([label, *dense, *cats]) + "\n"


def read_split(out: Path, split: str) -> dict[str, np.ndarray]:
    meta = read_meta(out)
    cols: dict[str, list] = {}
    for f in meta["splits"][split]["files"]:
        t = ipc.open_file(pa.memory_map(str(out / f))).read_all()
        for name in t.column_names:
            cols.setdefault(name, []).append(t.column(name).to_numpy() if not pa.types.is_list(t.schema.field(name).type)
                                             else np.array(t.column(name).to_pylist(), dtype=object))
    return {k: np.concatenate(v) if v else np.array([]) for k, v in cols.items()}


# ------------------------------------------------------------------ kernels
def test_a_short_pass_without_a_terminal_prints_only_its_final_progress_line(capsys):
    """Not a terminal (capsys): a pass over in well under the 10 s interval prints one line, the
    final one with every file done, never a `files 0/N` start line before it."""
    prog = Progress("logs pass 1 (count)", 2, enabled=True)
    assert run_tasks(lambda t: t * 2, [1, 2], 1, prog) == [2, 4]
    prog.add(5)
    prog.show(final=True)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("logs pass 1 (count): 5 rows |"), lines
    assert "files 2/2" in lines[0], lines


def test_hex_decode_matches_int_base16_for_random_values_and_every_single_byte_corruption():
    rng = np.random.default_rng(0)
    vals = rng.integers(0, 2**32, 5000)
    strs = [b"%08x" % v for v in vals] + [b"%08X" % v for v in vals[:100]]
    h, present, bad = hex_to_uint32(pa.array(strs + [b""], pa.binary()))
    assert bad is None and present[:-1].all() and not present[-1]
    assert [int(x) for x in h[:-1]] == [int(s, 16) for s in strs]
    valid = set(b"0123456789abcdefABCDEF")
    for pos in range(8):
        for c in range(256):
            b = bytearray(b"0a1B2c3D")
            b[pos] = c
            x, badm = decode_hex8(np.frombuffer(bytes(b), np.uint8).copy())
            assert bool(badm[0]) == (c not in valid), (pos, c)
            if c in valid:
                assert int(x[0]) == int(bytes(b), 16)


def test_dense_transform_clamps_negatives_and_is_log_x_plus_1():
    out = dense_log1p(np.array([-3, 0, 9, -1, 2**40], dtype=np.int64))
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, [0.0, 0.0, math.log(10), 0.0, math.log(2**40 + 1)], rtol=1e-6)
    assert np.isfinite(out).all()


def test_multi_hot_expand_gives_exact_sizes_in_range_and_is_deterministic():
    ids = np.array([0, 5, 999, 5, 123], dtype=np.int64)
    for dist in ("uniform", "pareto"):
        v, ln = multi_hot_expand(ids, 1000, 7, dist, seed=3)
        assert ln.tolist() == [7] * 5 and v.shape == (35,) and v.dtype == np.int64
        assert v.min() >= 0 and v.max() < 1000
        bags = v.reshape(5, 7)
        assert (bags[:, 0] == ids).all()  # the one-hot id leads its bag
        assert (bags[1] == bags[3]).all()  # same id -> same bag
        v2, _ = multi_hot_expand(ids, 1000, 7, dist, seed=3)
        assert (v == v2).all()
    v3, _ = multi_hot_expand(ids, 1000, 7, "uniform", seed=4)
    assert not (v3 == multi_hot_expand(ids, 1000, 7, "uniform", seed=3)[0]).all()
    v1, l1 = multi_hot_expand(ids, 1000, 1)
    assert (v1 == ids).all() and (l1 == 1).all()
    with pytest.raises(ValueError, match="ids must be in"):
        multi_hot_expand(np.array([1000]), 1000, 3)


# ------------------------------------------------------------------ preprocessing
def test_hand_written_tsv_empty_fields_negatives_hex_mod_n_and_missing_id(tmp_path):
    dense = ["-3", "9"] + [""] * 11
    cats = ["05db9164", ""] + ["ffffffff"] * 24
    f = tmp_path / "train.txt"
    f.write_text(line("1", dense, cats) + line("0"))
    out = tmp_path / "out"
    rep = preprocess_criteo(f, out, HASH, progress=False)
    assert rep.rows == {"train": 2, "val": 0, "test": 0}
    cols = read_split(out, "train")
    assert cols["label"].tolist() == [1.0, 0.0]
    assert cols["I1"][0] == 0.0  # -3 -> 0
    assert cols["I2"][0] == pytest.approx(2.302585, abs=1e-6)  # log(10)
    assert cols["I3"].tolist() == [0.0, 0.0]  # empty -> 0
    assert cols["C1"][0] == 0x05DB9164 % 1000 == 684
    assert cols["C2"][0] == 1000  # missing id = N (last row)
    assert cols["C3"][0] == 4294967295 % 1000 == 295
    assert cols["C1"][1] == 1
    meta = read_meta(out)
    assert [s["num_embeddings"] for s in meta["sparse_features"]] == [1001] * 26
    assert meta["sparse_features"][1]["missing_fraction"] == 0.5
    assert meta["ctr"]["train"] == 0.5
    assert meta["transforms"]["dense"]["transform"] == "log(x+1)"



def test_raw_ids_are_the_one_hash_of_the_lowercase_hex_text_missing_is_0_and_meta_counts_distinct(tmp_path):
    from dlrmctl.data.criteo.raw_transform import transform_raw_file
    from dlrmctl.data.ids import raw_id_of

    cats = ["05DB9164", ""] + ["ffffffff"] * 24
    f = tmp_path / "train.txt"
    f.write_text(line("1", None, cats) + line("0") + line("0", None, ["05db9164"] * 26))
    out = tmp_path / "out"
    preprocess_criteo(f, out, CriteoOptions(raw_ids=True), progress=False)
    cols = read_split(out, "train")
    assert cols["C1"].tolist() == [raw_id_of("05db9164"), raw_id_of("00000001"), raw_id_of("05db9164")]
    assert cols["C2"][0] == 0 and cols["C3"][0] == raw_id_of("ffffffff")
    meta = read_meta(out)
    from dlrmctl.data.columnar import is_raw_feature
    assert all(is_raw_feature(s) for s in meta["sparse_features"])
    assert [s["num_embeddings"] for s in meta["sparse_features"][:3]] == [2, 3, 3]
    assert meta["transforms"]["sparse"]["mode"] == "raw"
    chunks = list(transform_raw_file(f, meta, out))  # predict's raw lines: the same ids
    assert np.array_equal(np.concatenate([c[1] for c in chunks])[:, 0], cols["C1"])


@pytest.mark.parametrize("bad", [dict(num_embeddings=[10] * 26), dict(frequency_threshold=2),
                                 dict(multi_hot_sizes=[2] * 26)], ids=["hash", "vocab", "multi_hot"])
def test_raw_ids_with_another_id_mode_or_multi_hot_is_refused_naming_both_options(bad):
    with pytest.raises(ValueError, match="--raw-ids"):
        CriteoOptions(raw_ids=True, **bad).validate()


@pytest.mark.parametrize("opts", [HASH, CriteoOptions(frequency_threshold=1, workers=2),
                                  CriteoOptions(frequency_threshold=1, split_by_day=True)], ids=["hash", "vocab", "by_day"])
def test_day_files_with_no_lines_next_to_others_give_empty_parts(tmp_path, opts):
    # an empty plain file and an empty .gz member among non-empty day files (one of a single line)
    d = tmp_path / "in"
    d.mkdir()
    (d / "day_0").write_text(line("1", cats=["00000000"] + ["ffffffff"] * 25) + line("0"))
    (d / "day_1").write_text("")
    with gzip.open(d / "day_2.gz", "wb"):
        pass
    (d / "day_3").write_text(line("1"))
    (d / "day_4").write_text(line("0") + line("1"))
    out = tmp_path / "out"
    rep = preprocess_criteo(d, out, opts, progress=False)
    assert sum(rep.rows.values()) == 5
    if opts.split_by_day:
        assert rep.rows == {"train": 3, "val": 1, "test": 1}
    meta = read_meta(out)
    for name in ("day_1", "day_2.gz"):
        for split in ("train", "val", "test"):
            assert MappedShard(out / f"parts/{name}/{split}.arrow").rows == 0
    cols = read_split(out, "train")
    if opts.mode == "vocab":  # 0 and 2^32 - 1 are ordinary values: ids below V, not OOV / missing
        v = [f["num_embeddings"] - 2 for f in meta["sparse_features"]]
        assert cols["C1"][0] < v[0] and cols["C2"][0] < v[1] and cols["C1"][0] != cols["C1"][1]
    else:
        assert cols["C1"][0] == 0 and cols["C2"][0] == 4294967295 % 1000


def test_gz_input_gives_the_same_shards_as_plain(tmp_path):
    text = "".join(line(str(i % 2), [str(i)] * 13, ["%08x" % (i * 7919)] * 26) for i in range(50))
    (tmp_path / "a.txt").write_text(text)
    with gzip.open(tmp_path / "b.txt.gz", "wt") as g:
        g.write(text)
    preprocess_criteo(tmp_path / "a.txt", tmp_path / "o1", HASH, progress=False)
    preprocess_criteo(tmp_path / "b.txt.gz", tmp_path / "o2", HASH, progress=False)
    a, b = read_split(tmp_path / "o1", "train"), read_split(tmp_path / "o2", "train")
    assert len(a["label"]) == 50
    for k in a:
        assert (a[k] == b[k]).all(), k


def test_directory_and_glob_inputs_take_every_file(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    for j in range(3):
        (d / f"part{j}.tsv").write_text("".join(line(dense=[str(j)] * 13) for _ in range(4 + j)))
    (d / ".hidden").write_text("junk")
    r1 = preprocess_criteo(d, tmp_path / "o1", HASH, progress=False)
    r2 = preprocess_criteo(str(d / "part*.tsv"), tmp_path / "o2", HASH, progress=False)
    assert r1.rows["train"] == r2.rows["train"] == 4 + 5 + 6
    assert len(read_meta(tmp_path / "o1")["splits"]["train"]["files"]) == 3
    with pytest.raises(DataError, match="no such file"):
        preprocess_criteo(str(d / "nothing*.tsv"), tmp_path / "o3", HASH, progress=False)



def test_one_file_listed_under_several_spellings_counts_once_and_two_names_of_it_are_refused(tmp_path, monkeypatch):
    from dlrmctl.data.criteo.parse import expand_inputs

    d = tmp_path / "in"
    d.mkdir()
    (d / "day_0").write_text(line("1") * 3)
    (d / "day_1").write_text(line("0") * 2)
    monkeypatch.chdir(tmp_path)
    # relative, absolute, with "..": one input (was: "share the base name ... rename them")
    files = expand_inputs(["in/day_0", str(d / "day_0"), "in/../in/day_0", "in/day_1"])
    assert files == [d / "day_0", d / "day_1"]
    rep = preprocess_criteo(["in/day_0", str(d / "day_0"), str(d)], tmp_path / "o", HASH, progress=False)
    assert rep.rows["train"] == 5
    # a second name of one file (a link) would read its rows twice
    (d / "day_2").symlink_to(d / "day_0")
    with pytest.raises(DataError, match=r"day_0 and .*day_2 are the same file \(a link or another name\); its rows "
                                        "would be read twice"):
        preprocess_criteo(d, tmp_path / "o2", HASH, progress=False)


def test_vocabulary_with_frequency_threshold_shares_rare_ids_and_is_saved(tmp_path):
    vals = ["0000000a"] * 3 + ["0000000b"] * 2 + ["0000000c"] + [""]
    f = tmp_path / "t.tsv"
    f.write_text("".join(line(cats=[v] + ["00000001"] * 25) for v in vals))
    out = tmp_path / "out"
    preprocess_criteo(f, out, CriteoOptions(frequency_threshold=2), progress=False)
    meta = read_meta(out)
    c1 = meta["sparse_features"][0]
    assert c1["num_embeddings"] == 4 and c1["oov_id"] == 2 and c1["missing_id"] == 3
    assert read_split(out, "train")["C1"].tolist() == [0, 0, 0, 1, 1, 2, 3]
    vocab = ipc.open_file(pa.memory_map(str(out / meta["vocab_files"]["C1"]))).read_all()
    assert vocab.column("value").to_pylist() == [10, 11] and vocab.column("count").to_pylist() == [3, 2]


def _many_lines(n: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    return "".join(line(str(int(rng.integers(2))), [str(int(x)) for x in rng.integers(-2, 100, 13)],
                        ["%08x" % int(x) for x in rng.integers(0, 2**32, 26)]) for _ in range(n))


def test_ratio_split_is_deterministic_per_row_and_independent_of_block_size(tmp_path):
    f = tmp_path / "train.txt"
    f.write_text(_many_lines(3000))
    opts = dict(num_embeddings=[1000] * 26, val_ratio=0.2, test_ratio=0.1, seed=7)
    preprocess_criteo(f, tmp_path / "a", CriteoOptions(**opts), progress=False)
    preprocess_criteo(f, tmp_path / "b", CriteoOptions(**opts, block_size=20_000), progress=False)
    preprocess_criteo(f, tmp_path / "c", CriteoOptions(**{**opts, "seed": 8}), progress=False)
    a, b, c = (read_split(tmp_path / x, "val") for x in "abc")
    assert (a["C1"] == b["C1"]).all() and (a["I1"] == b["I1"]).all()
    assert not np.array_equal(a["C1"], c["C1"])
    rows = read_meta(tmp_path / "a")["splits"]
    assert sum(rows[s]["rows"] for s in rows) == 3000
    assert abs(rows["val"]["rows"] - 600) < 90 and abs(rows["test"]["rows"] - 300) < 70


def test_split_by_day_last_day_halves_go_to_val_then_test(tmp_path):
    for d, n in ((0, 4), (1, 3), (2, 5)):
        (tmp_path / f"day_{d}").write_text("".join(line(dense=[str(d * 10 + i)] * 13) for i in range(n)))
    out = tmp_path / "out"
    preprocess_criteo(str(tmp_path / "day_*"), out, CriteoOptions(num_embeddings=[10] * 26, split_by_day=True),
                      progress=False)
    meta = read_meta(out)
    assert {s: meta["splits"][s]["rows"] for s in meta["splits"]} == {"train": 7, "val": 3, "test": 2}
    assert np.allclose(read_split(out, "val")["I1"], np.log1p([20, 21, 22]))
    assert np.allclose(read_split(out, "test")["I1"], np.log1p([23, 24]))


def test_bad_line_errors_name_file_line_and_field(tmp_path):
    good = line()
    cases = [
        (good + line(cats=["05db9164", "00000001", "xyz"] + ["00000001"] * 23),
         "bad.tsv:2: field C3: expected 8 hex digits, got 'xyz'"),
        (good + good + "1\t2\t3\n", "bad.tsv:3: expected 40 tab-separated fields, got 3 (the first missing: I3)"),
        (good + line(dense=["1", "2", "3", "abc"] + [""] * 9), "bad.tsv:2: field I4: expected an integer, got 'abc'"),
        (line(label="2"), "bad.tsv:1: field label: expected 0 or 1, got '2'"),
        (good + line(cats=["0000000g"] + ["00000001"] * 25), "bad.tsv:2: field C1: expected 8 hex digits, got '0000000g'"),
    ]
    # hashing parses in its one pass; vocabulary mode in pass 1 (which keeps the decoded rows)
    for mode, opts in (("hash", HASH), ("vocab", CriteoOptions(frequency_threshold=1))):
        for i, (text, msg) in enumerate(cases):
            f = tmp_path / f"{mode}{i}" / "bad.tsv"
            f.parent.mkdir()
            f.write_text(text)
            with pytest.raises(DataError) as ei:
                preprocess_criteo(f, tmp_path / f"out{mode}{i}", opts, progress=False)
            assert str(ei.value).endswith(msg), (mode, str(ei.value))
            assert str(f) in str(ei.value)
            assert not list((tmp_path / f"out{mode}{i}").rglob("*.tmp"))  # nothing half-written left


def test_on_bad_line_skip_counts_and_keeps_good_rows_with_their_line_numbers(tmp_path):
    f = tmp_path / "t.tsv"
    rows = [line(dense=["1"] * 13), "1\t2\n", line(dense=["x"] + ["2"] * 12), line(dense=["3"] * 13),
            line(cats=["zz"] + ["00000001"] * 25), line(dense=["4"] * 13)]
    f.write_text("".join(rows))
    rep = preprocess_criteo(f, tmp_path / "o", CriteoOptions(num_embeddings=[10] * 26, on_bad_line="skip"),
                            progress=False)
    assert rep.bad_lines == 3
    assert rep.rows["train"] == 3
    assert np.allclose(read_split(tmp_path / "o", "train")["I1"], np.log1p([1, 3, 4]))
    assert read_meta(tmp_path / "o")["bad_lines_skipped"] == 3


def test_resume_skips_finished_files_after_a_crash(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.tsv").write_text(_many_lines(20, 1))
    (d / "b.tsv").write_text(_many_lines(5, 2) + "broken\n")
    out = tmp_path / "out"
    with pytest.raises(DataError, match="b.tsv:6"):
        preprocess_criteo(d, out, HASH, progress=False)
    done_a = out / "parts" / "a.tsv" / "done.json"
    assert done_a.is_file() and not (out / "parts" / "b.tsv").exists()
    assert not list((out / "parts").glob("*.tmp"))  # the crashed part left nothing behind
    mtime = done_a.stat().st_mtime_ns
    (d / "b.tsv").write_text(_many_lines(5, 2))
    rep = preprocess_criteo(d, out, HASH, progress=False)
    assert (rep.files_processed, rep.files_skipped) == (1, 1)
    assert done_a.stat().st_mtime_ns == mtime
    assert rep.rows["train"] == 25
    # different options invalidate the finished part
    rep2 = preprocess_criteo(d, out, CriteoOptions(num_embeddings=[7] * 26), progress=False)
    assert rep2.files_skipped == 0 and read_split(out, "train")["C1"].max() <= 7


def test_parallel_workers_give_the_same_output_as_one(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    for j in range(2):
        (d / f"p{j}.tsv").write_text(_many_lines(300, j))
    opts = dict(num_embeddings=[100] * 26, val_ratio=0.3)
    preprocess_criteo(d, tmp_path / "one", CriteoOptions(**opts), progress=False)
    preprocess_criteo(d, tmp_path / "two", CriteoOptions(**opts, workers=2), progress=False)
    for split in ("train", "val"):
        a, b = read_split(tmp_path / "one", split), read_split(tmp_path / "two", split)
        assert all((a[k] == b[k]).all() for k in a)


def test_multi_hot_sizes_materialise_list_columns_with_exact_bag_sizes(tmp_path):
    f = tmp_path / "t.tsv"
    f.write_text(_many_lines(40))
    sizes = [3, 2] + [1] * 24
    out = tmp_path / "o"
    preprocess_criteo(f, out, CriteoOptions(num_embeddings=[50] * 26, multi_hot_sizes=sizes), progress=False)
    meta = read_meta(out)
    assert meta["sparse_features"][0]["multi_hot"] and meta["sparse_features"][0]["mean_pooling_factor"] == 3.0
    assert not meta["sparse_features"][2]["multi_hot"]
    shard = MappedShard(out / meta["splits"]["train"]["files"][0])
    rows = np.arange(shard.rows)
    vals, lens = shard.take_list("C1", shard.locate(rows))
    assert (lens == 3).all() and vals.max() <= 50
    one_hot = np.array([int(l.split("\t")[14], 16) % 50 for l in f.read_text().splitlines()])
    assert (vals.reshape(-1, 3)[:, 0] == one_hot).all()


def test_real_kaggle_sample_preprocesses_with_val_ratio_via_the_cli(tmp_path):
    sample = SHARED / "criteo_kaggle_sample_10k.tsv"
    require_shared(sample)
    import typer
    from typer.testing import CliRunner

    from dlrmctl.commands import preprocess

    root = typer.Typer()
    root.add_typer(preprocess.app, name="preprocess")
    out = tmp_path / "criteo_sample"
    res = CliRunner().invoke(root, ["preprocess", "criteo", "--input", str(sample), "--out", str(out),
                                    "--val-ratio", "0.2", "--quiet"])
    assert res.exit_code == 0, res.output
    meta = read_meta(out)
    rows = {s: meta["splits"][s]["rows"] for s in ("train", "val", "test")}
    assert sum(rows.values()) == 10000 and abs(rows["val"] - 2000) < 150 and rows["test"] == 0
    assert 0.22 < meta["ctr"]["train"] < 0.28
    # 25,570 of 130,000 integer cells are empty (PROVENANCE.md): dense is finite and >= 0
    dense = np.stack([read_split(out, "train")[f"I{i}"] for i in range(1, 14)])
    assert np.isfinite(dense).all() and dense.min() == 0.0
    res = CliRunner().invoke(root, ["preprocess", "criteo", "--input", str(sample), "--out", str(out),
                                    "--num-embeddings", "1,2"])
    assert res.exit_code != 0 and "26" in res.output


@pytest.mark.parametrize("vocab", [False, True])
def test_transform_raw_file_reproduces_the_preprocessed_rows(tmp_path, vocab):
    from dlrmctl.data.criteo.raw_transform import transform_raw_file

    f = tmp_path / "t.tsv"
    f.write_text(_many_lines(200, 5))
    out = tmp_path / "o"
    opts = CriteoOptions(frequency_threshold=1) if vocab else HASH
    preprocess_criteo(f, out, opts, progress=False)
    meta = read_meta(out)
    chunks = list(transform_raw_file(f, meta, out, batch_rows=64))
    assert [len(c[0]) for c in chunks] == [64, 64, 64, 8]
    dense = np.concatenate([c[0] for c in chunks])
    ids = np.concatenate([c[1] for c in chunks])
    cols = read_split(out, "train")
    assert np.array_equal(dense[:, 0], cols["I1"]) and np.array_equal(ids[:, 25], cols["C26"])
    assert np.array_equal(np.concatenate([c[2] for c in chunks]), cols["label"])


# ------------------------------------------------------------------ vocabulary at scale
def _reference_vocab(texts: dict[str, str], threshold: int, seed: int, val_ratio: float) -> list[tuple[list, list]]:
    """The original algorithm, written out plainly: count every train row's raw value of each
    feature over all files together, keep count >= threshold, order by (-count, value)."""
    from collections import Counter

    from dlrmctl.data.criteo.parse import row_split_codes

    counts = [Counter() for _ in range(26)]
    for name, text in texts.items():
        rows = text.splitlines()
        codes = row_split_codes(np.arange(1, len(rows) + 1), name, seed, val_ratio, 0.0)
        for r, code in zip(rows, codes):
            if code != 0:
                continue
            for f, v in enumerate(r.split("\t")[14:]):
                if v:
                    counts[f][int(v, 16)] += 1
    out = []
    for c in counts:
        kept = sorted(((n, v) for v, n in c.items() if n >= threshold), key=lambda t: (-t[0], t[1]))
        out.append(([v for _, v in kept], [n for n, _ in kept]))
    return out


def _zipf_lines(n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        cats = []
        for f in range(26):
            card = 5 + 40 * f  # a range of vocabulary sizes, many values below the threshold
            v = int(rng.zipf(1.3)) % card
            cats.append("" if rng.random() < 0.1 else "%08x" % ((v * 2654435761 + f) % 2**32))
        out.append(line(str(int(rng.integers(2))), [str(int(x)) for x in rng.integers(-1, 50, 13)], cats))
    return "".join(out)


def test_vocabulary_built_feature_by_feature_equals_the_reference_on_many_files_and_workers(tmp_path, monkeypatch):
    from dlrmctl.data.criteo import vocab

    monkeypatch.setattr(vocab, "MERGE_FAN_IN", 2)  # 3 count files: merged in two rounds
    d = tmp_path / "in"
    d.mkdir()
    texts = {f"part{j}.tsv": _zipf_lines(700 + 150 * j, 10 + j) for j in range(3)}
    for name, text in texts.items():
        (d / name).write_text(text)
    opts = CriteoOptions(frequency_threshold=3, val_ratio=0.25, seed=5, workers=2, block_size=30_000)
    out = tmp_path / "out"
    preprocess_criteo(d, out, opts, progress=False)
    ref = _reference_vocab(texts, 3, 5, 0.25)
    meta = read_meta(out)
    for f, sf in enumerate(meta["sparse_features"]):
        vt = ipc.open_file(pa.memory_map(str(out / meta["vocab_files"][sf["name"]]))).read_all()
        assert vt.column("value").to_pylist() == ref[f][0], sf["name"]
        assert vt.column("count").to_pylist() == ref[f][1], sf["name"]
        size = len(ref[f][0])
        assert (sf["num_embeddings"], sf["oov_id"], sf["missing_id"]) == (size + 2, size, size + 1)
    assert any(len(r[0]) > 20 for r in ref) and any(len(r[0]) < 10 for r in ref)
    # every written id is the reference id of the raw value (OOV: V, empty: V + 1), in every split
    from dlrmctl.data.criteo.parse import row_split_codes

    ids_of = [{v: i for i, v in enumerate(r[0])} for r in ref]
    for split in ("train", "val"):
        expect = [[] for _ in range(26)]
        for name, text in texts.items():
            rows = text.splitlines()
            codes = row_split_codes(np.arange(1, len(rows) + 1), name, 5, 0.25, 0.0)
            for r, code in zip(rows, codes):
                if code != ("train", "val").index(split):
                    continue
                for f, v in enumerate(r.split("\t")[14:]):
                    size = len(ref[f][0])
                    expect[f].append(size + 1 if not v else ids_of[f].get(int(v, 16), size))
        cols = read_split(out, split)
        oov_seen = False
        for f in range(26):
            assert cols[f"C{f + 1}"].tolist() == expect[f], (split, f)
            oov_seen |= len(ref[f][0]) in expect[f]
        assert oov_seen


def test_hash_lookup_matches_a_dict_for_hits_misses_and_extreme_values():
    from dlrmctl.data.criteo.vocab import HashLookup

    rng = np.random.default_rng(3)
    values = np.unique(rng.integers(0, 2**32, 50_000)).astype(np.int64)
    values = np.concatenate([values[values != 0][:-1], [0, 2**32 - 1]])
    rng.shuffle(values)
    table = HashLookup(values)
    queries = np.concatenate([values, rng.integers(0, 2**32, 20_000), [0, 2**32 - 1]]).astype(np.uint64)
    pos = {int(v): i for i, v in enumerate(values)}
    expect = [pos.get(int(q), len(values)) for q in queries]
    assert table.lookup(queries).tolist() == expect
    assert HashLookup(np.zeros(0, np.int64)).lookup(queries[:5]).tolist() == [0] * 5
    with pytest.raises(ValueError, match="32-bit"):
        HashLookup(np.array([2**32], np.int64))
    with pytest.raises(ValueError, match="duplicate"):
        HashLookup(np.array([7, 9, 7], np.int64))


def test_a_damaged_vocabulary_file_is_a_data_error_naming_it(tmp_path):
    # a vocabulary file with a duplicate or a value beyond 32 bits raised a bare ValueError (no file named)
    from dlrmctl.data.criteo.vocab import VocabSet, clear_cache

    for values, why in (([7, 9, 7], "duplicate vocabulary value 7"), ([1, 2**32], r"32-bit")):
        d = tmp_path / why[:3]
        d.mkdir()
        for n in [f"C{i}" for i in range(1, 27)]:
            t = pa.table({"value": pa.array(values if n == "C3" else [1, 2], pa.int64())})
            with pa.OSFile(str(d / f"{n}.arrow"), "wb") as sink, ipc.new_file(sink, t.schema) as w:
                w.write_table(t)
        vs = VocabSet.of_dir(d)
        assert vs[0].lookup(np.array([2], np.uint64)).tolist() == [1]
        with pytest.raises(DataError, match=rf"C3\.arrow: not a vocabulary: .*{why}"):
            vs[2]
        clear_cache()


# ------------------------------------------------------------------ one parse per file (vocabulary mode)
def test_decoded_rows_round_trip_with_missing_values_within_the_documented_bytes_per_row(tmp_path):
    from dlrmctl.data.criteo.decoded import BYTES_PER_ROW, DecodedWriter, read_decoded

    rng = np.random.default_rng(0)
    path = tmp_path / "d.arrow"
    w = DecodedWriter(path, labelled=True)
    blocks = []
    for n in (1, 1000, 37):
        codes = rng.integers(0, 3, n).astype(np.int8)
        label = rng.integers(0, 2, n).astype(np.float32)
        dense = [rng.random(n).astype(np.float32) for _ in range(13)]
        present = [rng.random(n) < (0.0 if f == 0 else 1.0 if f == 1 else 0.7) for f in range(26)]
        h = [np.where(p, rng.integers(0, 2**32, n, dtype=np.uint64), 0).astype(np.uint64) for p in present]
        h[2][:1] = 2**32 - 1  # the extreme value survives the uint32 column
        present[2][:1] = True
        w.write(codes, label, dense, h, present)
        blocks.append((codes, label, dense, h, present))
    w.close()
    assert not (tmp_path / "d.arrow.tmp").exists()
    got = list(read_decoded(path, labelled=True))
    assert len(got) == 3  # one record batch per written block
    for b, (codes, label, dense, h, present) in zip(got, blocks):
        assert (b.codes == codes).all() and (b.label == label).all()
        assert all((x == y).all() for x, y in zip(b.dense, dense))
        assert all((x == y).all() for x, y in zip(b.sparse_present, present))
        assert all((x.astype(np.uint64) == y).all() for x, y in zip(b.sparse_h, h))
    rows = 1038
    assert path.stat().st_size <= BYTES_PER_ROW * rows + 3 * 1024 + 8192  # + per-batch padding, schema, footer
    with pytest.raises(DataError, match="schema"):
        next(read_decoded(path, labelled=False))


def _count_parses(monkeypatch) -> list[str]:
    """The names of the input files parsed (one entry per pass over a file's lines), appended as it happens."""
    from dlrmctl.data.criteo import parse

    calls: list[str] = []
    real = parse.BlockReader.__iter__

    def counting(self):
        calls.append(self.path.name)
        return real(self)

    monkeypatch.setattr(parse.BlockReader, "__iter__", counting)
    return calls


def test_vocabulary_mode_parses_each_file_once_and_removes_its_decoded_rows(tmp_path, monkeypatch):
    calls = _count_parses(monkeypatch)
    d = tmp_path / "in"
    d.mkdir()
    for j in range(2):
        (d / f"p{j}.tsv").write_text(_zipf_lines(300, j))
    out = tmp_path / "o"
    preprocess_criteo(d, out, CriteoOptions(frequency_threshold=2, val_ratio=0.3), progress=False)
    assert sorted(calls) == ["p0.tsv", "p1.tsv"]
    assert not (out / ".decoded").exists()
    assert read_meta(out)["splits"]["val"]["rows"] > 0


def test_vocabulary_resume_after_a_crash_in_either_pass_reparses_only_what_is_stale(tmp_path, monkeypatch):
    from dlrmctl.data.criteo import preprocess

    calls = _count_parses(monkeypatch)
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.tsv").write_text(_zipf_lines(200, 1))
    (d / "b.tsv").write_text(_zipf_lines(150, 2) + "broken\n")
    opts = CriteoOptions(frequency_threshold=2, val_ratio=0.2)
    out = tmp_path / "out"
    # 1. pass 1 fails on b: a's counts and decoded rows stay, nothing of b
    with pytest.raises(DataError, match="b.tsv:151"):
        preprocess_criteo(d, out, opts, progress=False)
    assert (out / ".decoded" / "a.tsv.arrow").is_file() and not list((out / ".decoded").glob("b.tsv*"))
    (d / "b.tsv").write_text(_zipf_lines(150, 2))
    # 2. pass 2 fails on b (after a's part is written): only b's decoded rows remain
    calls.clear()
    real_pf = preprocess.process_file

    def failing(task):
        if task.part == "b.tsv":
            raise RuntimeError("crash in pass 2")
        return real_pf(task)

    monkeypatch.setattr(preprocess, "process_file", failing)
    with pytest.raises(RuntimeError, match="crash in pass 2"):
        preprocess_criteo(d, out, opts, progress=False)
    assert calls == ["b.tsv"]  # a was parsed by the first run
    assert (out / "parts" / "a.tsv" / "done.json").is_file()
    assert sorted(p.name for p in (out / ".decoded").iterdir()) == ["b.tsv.arrow", "b.tsv.json"]
    # 3. the resumed run parses nothing: a's part is done, b's rows are read from .decoded
    monkeypatch.setattr(preprocess, "process_file", real_pf)
    calls.clear()
    rep = preprocess_criteo(d, out, opts, progress=False)
    assert calls == [] and (rep.files_processed, rep.files_skipped) == (1, 1)
    assert not (out / ".decoded").exists()
    ref = tmp_path / "ref"
    preprocess_criteo(d, ref, opts, progress=False)
    for split in ("train", "val"):
        assert (out / "parts" / "b.tsv" / f"{split}.arrow").read_bytes() == \
            (ref / "parts" / "b.tsv" / f"{split}.arrow").read_bytes()
        assert (out / "parts" / "a.tsv" / f"{split}.arrow").read_bytes() == \
            (ref / "parts" / "a.tsv" / f"{split}.arrow").read_bytes()
    # 4. b changes: the vocabulary changes, so a's finished part is stale and a is parsed again
    (d / "b.tsv").write_text(_zipf_lines(180, 3))
    calls.clear()
    rep = preprocess_criteo(d, out, opts, progress=False)
    assert sorted(calls) == ["a.tsv", "b.tsv"] and rep.files_processed == 2
    ref2 = tmp_path / "ref2"
    preprocess_criteo(d, ref2, opts, progress=False)
    for f in ("a.tsv", "b.tsv"):
        for split in ("train", "val"):
            assert (out / "parts" / f / f"{split}.arrow").read_bytes() == \
                (ref2 / "parts" / f / f"{split}.arrow").read_bytes()
    assert not (out / ".decoded").exists()


def test_a_line_longer_than_a_block_is_named_by_its_line_or_skipped_and_counted(tmp_path):
    f = tmp_path / "long.tsv"
    rows = [line(dense=[str(i)] * 13) for i in range(300)]
    rows[120] = line(cats=["0" * 30_000] + ["00000001"] * 25)  # one field longer than the 20 kB block
    f.write_text("".join(rows))
    for mode, opts in (("hash", dict(num_embeddings=[10] * 26)), ("vocab", dict(frequency_threshold=1))):
        with pytest.raises(DataError, match=r"long.tsv:121: a line of 20000 bytes or more"):
            preprocess_criteo(f, tmp_path / f"e{mode}", CriteoOptions(**opts, block_size=20_000), progress=False)
        rep = preprocess_criteo(f, tmp_path / f"s{mode}", CriteoOptions(**opts, block_size=20_000,
                                                                       on_bad_line="skip"), progress=False)
        assert rep.bad_lines == 1 and rep.rows["train"] == 299
        kept = [i for i in range(300) if i != 120]
        assert np.allclose(read_split(tmp_path / f"s{mode}", "train")["I1"], np.log1p(kept))
