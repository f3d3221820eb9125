"""Issue 16: scripts/criteo_cv.py — DLRM vs the logistic regression over K row-hash splits, the
paired test difference with its standard error, pooled test AUC."""

import json
import math

import numpy as np
import pytest

from tests.conftest import CRITEO_10K, REPO, require_shared
from tests.helpers.scripts import load_script

pytest.importorskip("sklearn", reason="scikit-learn is the bench/test extra: pip install -e '.[test]'")

# a small, fast DLRM for the 2-split run: the comparison's mechanics, not its figures
FAST = ["train.epochs=1", "train.eval_every=5", "train.early_stopping_patience=2", "data.batch_size=256"]


def _script():
    return load_script("criteo_cv")


@pytest.fixture(scope="module")
def head_tsv(tmp_path_factory):
    """The first 3,000 lines of the real 10k sample (skipped when ../shared is absent)."""
    src = require_shared(CRITEO_10K)
    out = tmp_path_factory.mktemp("cv_in") / "head3k.tsv"
    with open(src) as f, open(out, "w") as g:
        for i, line in enumerate(f):
            if i == 3000:
                break
            g.write(line)
    return out


def test_paired_stats_mean_and_standard_error():
    cv = _script()
    mean, se = cv.paired_stats([0.01, 0.03])
    assert mean == pytest.approx(0.02)
    assert se == pytest.approx(np.std([0.01, 0.03], ddof=1) / math.sqrt(2)) and se == pytest.approx(0.01)
    with pytest.raises(ValueError, match=">= 2"):
        cv.paired_stats([0.01])


def test_two_splits_pair_dlrm_and_lr_on_the_same_test_rows(head_tsv, tmp_path, capsys):
    cv = _script()
    out = tmp_path / "res" / "cv.md"
    argv = ["--input", str(head_tsv), "--config", str(REPO / "configs" / "criteo_sample.yaml"), "--splits", "2",
            "--first-seed", "3", "--work", str(tmp_path / "work"), "--out", str(out), "--C", "0.03,0.3"]
    for o in FAST:
        argv += ["--set", o]
    res = cv.main(argv)
    printed = capsys.readouterr().out
    rows, s = res["rows"], res["summary"]
    assert [r["seed"] for r in rows] == [3, 4]
    # the two splits are different row sets (the seed moves the hash split)
    from dlrmctl.data.columnar import read_meta

    metas = [read_meta(str(tmp_path / "work" / f"data_{k}")) for k in (3, 4)]
    assert [m["splits"]["test"]["rows"] for m in metas] == [r["test_rows"] for r in rows]
    assert [m["transforms"]["split"]["seed"] for m in metas] == [3, 4]
    # DLRM: the best-on-val checkpoint scored on test = `dlrmctl evaluate RUN --split test`
    from dlrmctl.train.reload import evaluate_run

    for r in rows:
        run = tmp_path / "work" / "runs" / f"split_{r['seed']}"
        assert r["dlrm_test_auc"] == pytest.approx(evaluate_run(str(run), "test")["auc"], abs=1e-12)
        best = json.loads((run / "summary.json").read_text())["best"]
        assert r["dlrm_val_auc"] == pytest.approx(best["auc"], abs=1e-12)
    # LR: what scripts/criteo_baselines.py reports on the same directory
    cb = load_script("criteo_baselines")
    lr = cb.run(str(tmp_path / "work" / "data_4"), cs=(0.03, 0.3), out=lambda s: None, log=lambda s: None)
    assert rows[1]["lr_test_auc"] == pytest.approx(lr["logistic_regression"]["test"]["auc"], abs=1e-12)
    assert rows[1]["C"] == lr["C"]
    # the summary: mean and SE of the per-split differences, pooled rows = all test rows
    d = [r["dlrm_test_auc"] - r["lr_test_auc"] for r in rows]
    assert s["diff_mean"] == pytest.approx(np.mean(d), abs=1e-12)
    assert s["diff_se"] == pytest.approx(np.std(d, ddof=1) / math.sqrt(2), abs=1e-12)
    assert s["pooled_test_rows"] == sum(r["test_rows"] for r in rows)
    assert 0.6 < s["lr_pooled_test_auc"] < 0.9 and 0.5 < s["dlrm_pooled_test_auc"] < 0.9
    assert f"{s['diff_mean']:+.4f} ± {s['diff_se']:.4f}" in printed
    # written through temp files: the table and the JSON, no .tmp left behind
    assert out.read_text() in printed
    assert json.loads(out.with_suffix(".json").read_text())["summary"]["diff_mean"] == pytest.approx(s["diff_mean"])
    # the recorded command carries every option that changes the figures, quoted
    import shlex

    cmd = shlex.split(json.loads(out.with_suffix(".json").read_text())["command"])
    opts = dict(zip(cmd[2::2], cmd[3::2]))
    assert opts["--first-seed"] == "3" and opts["--C"] == "0.03,0.3" and opts["--splits"] == "2"
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"] == list(FAST)
    assert sorted(p.name for p in out.parent.iterdir()) == ["cv.json", "cv.md"]


def test_bad_splits_and_missing_input_are_one_line_errors(tmp_path, capsys):
    cv = _script()
    with pytest.raises(SystemExit) as e:
        cv.main(["--input", str(tmp_path / "nope.tsv"), "--splits", "3", "--work", str(tmp_path / "w")])
    assert e.value.code == 2 and "nope.tsv: no such file" in capsys.readouterr().err
    tsv = tmp_path / "x.tsv"
    tsv.write_text("0\t" + "\t" * 38 + "\n")
    with pytest.raises(SystemExit) as e:
        cv.main(["--input", str(tsv), "--splits", "1", "--work", str(tmp_path / "w")])
    assert e.value.code == 2 and "--splits must be >= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cv.main(["--input", str(tsv), "--splits", "2", "--set", "model.no_such_key=1", "--work", str(tmp_path / "w")])
    assert e.value.code == 2 and "no_such_key" in capsys.readouterr().err
    # --out cv.json: the JSON copy (out.with_suffix(".json")) would overwrite the Markdown table
    with pytest.raises(SystemExit) as e:
        cv.main(["--input", str(tsv), "--splits", "2", "--out", str(tmp_path / "cv.json"), "--work", str(tmp_path / "w")])
    assert e.value.code == 2 and "--out" in (err := capsys.readouterr().err) and "cv.md" in err
    assert not (tmp_path / "w").exists()  # nothing preprocessed before the errors


def test_an_ensemble_scores_the_mean_logit_of_its_seeds(head_tsv, tmp_path, capsys):
    cv = _script()
    argv = ["--input", str(head_tsv), "--config", str(REPO / "configs" / "criteo_sample.yaml"), "--splits", "2",
            "--ensemble", "2", "--work", str(tmp_path / "work"), "--C", "0.1"]
    for o in FAST:
        argv += ["--set", o]
    rows = cv.main(argv)["rows"]
    assert "--ensemble 2" in capsys.readouterr().out
    from dlrmctl.train.reload import run_config, run_logits
    from dlrmctl.metrics import compute_metrics_from_logits

    for r in rows:
        runs = [tmp_path / "work" / "runs" / f"split_{r['seed']}_m{m}" for m in (0, 1)]
        assert [run_config(str(p)).train.seed for p in runs] == [0, 1]  # the config's seed + 0, 1
        for split, key in (("val", "dlrm_val_auc"), ("test", "dlrm_test_auc")):
            (z0, y), (z1, _) = (run_logits(str(p), split) for p in runs)
            want = compute_metrics_from_logits((z0.astype(np.float64) + z1) / 2, y)["auc"]
            assert r[key] == pytest.approx(want, abs=1e-12)
            assert r[key] != pytest.approx(compute_metrics_from_logits(z0, y)["auc"], abs=1e-9)
    with pytest.raises(SystemExit) as e:
        cv.main(["--input", str(head_tsv), "--ensemble", "0", "--work", str(tmp_path / "w2")])
    assert e.value.code == 2 and "--ensemble must be >= 1" in capsys.readouterr().err


@pytest.fixture(scope="module")
def head_100(tmp_path_factory):
    """The first 100 lines of the real 10k sample (skipped when ../shared is absent)."""
    src = require_shared(CRITEO_10K)
    out = tmp_path_factory.mktemp("cv_in100") / "head100.tsv"
    with open(src) as f:
        out.write_text("".join(line for _, line in zip(range(100), f)))
    return out


TINY = ["train.epochs=1", "data.batch_size=32"]


def _argv(tsv, work, *extra):
    argv = ["--input", str(tsv), "--config", str(REPO / "configs" / "criteo_sample.yaml"), "--splits", "2",
            "--work", str(work), "--C", "0.1"]
    for o in TINY:
        argv += ["--set", o]
    return argv + list(extra)


def _one_error_line(capsys, e) -> str:
    """The run exited 2 with exactly one stderr line, ``error: ...`` (no usage text, no traceback)."""
    captured = capsys.readouterr()
    assert e.value.code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    return lines[0]


def test_a_trainer_error_is_one_line_naming_the_split_and_the_setting(head_100, tmp_path, capsys):
    cv = _script()
    with pytest.raises(SystemExit) as e:
        cv.main(_argv(head_100, tmp_path / "w", "--first-seed", "4", "--set", "train.precision=fp16"))
    line = _one_error_line(capsys, e)
    assert "split 4" in line and "--set train.precision=fp16" in line and "needs CUDA" in line
    assert "split_4.log" in line and (tmp_path / "w" / "logs" / "split_4.log").is_file()


def test_every_argument_is_checked_before_any_work(tmp_path, capsys):
    """Bad ratios, seeds, threads, --C: one ``error:`` line, and nothing under --work (no split preprocessed)."""
    cv = _script()
    tsv = tmp_path / "x.tsv"
    tsv.write_text("0\t" + "\t" * 38 + "\n")
    work = tmp_path / "w"
    bad = [(["--val-ratio", "0"], "--val-ratio must be in (0, 1)"),
           (["--test-ratio", "0"], "--test-ratio must be in (0, 1)"),
           (["--val-ratio", "0.6", "--test-ratio", "0.5"], "--val-ratio + --test-ratio must be < 1"),
           (["--first-seed", "-1"], "--first-seed must be >= 0"),
           (["--threads", "0"], "--threads must be >= 1"),
           (["--C", "0,1"], "--C: expected finite numbers > 0"),
           (["--C", "a"], "--C: expected comma-separated numbers")]
    for extra, msg in bad:
        with pytest.raises(SystemExit) as e:
            cv.main(_argv(tsv, work, *extra))
        assert msg in _one_error_line(capsys, e)
    assert not work.exists()


@pytest.mark.parametrize("sets,ensemble,key", [
    (["data.path=/elsewhere"], "1", "data.path"),
    (["train.run_dir=/tmp/r"], "1", "train.run_dir"),
    (["name=mine"], "1", "name"),
    (["train.progress=true"], "1", "train.progress"),
    (["train.seed=7"], "2", "train.seed"),
    (["train={seed: 7, epochs: 1}"], "2", "train.seed"),  # a whole section holding the key
    (["data={path: /elsewhere}"], "1", "data.path"),
])
def test_overrides_of_keys_the_script_sets_are_refused(tmp_path, capsys, sets, ensemble, key):
    cv = _script()
    tsv = tmp_path / "x.tsv"
    tsv.write_text("0\t" + "\t" * 38 + "\n")
    argv = _argv(tsv, tmp_path / "w", "--ensemble", ensemble)
    for o in sets:
        argv += ["--set", o]
    with pytest.raises(SystemExit) as e:
        cv.main(argv)
    assert f"the script sets {key} itself" in _one_error_line(capsys, e)
    assert not (tmp_path / "w").exists()


def test_train_seed_is_free_without_an_ensemble_and_logs_go_to_work(head_100, tmp_path, capsys):
    """One progress line per split on the console; each run's training output in WORK/logs/<run>.log;
    ``--verbose`` puts it back on the console."""
    cv = _script()
    work = tmp_path / "w"
    rows = cv.main(_argv(head_100, work, "--set", "train.seed=3"))["rows"]
    cap = capsys.readouterr()
    from dlrmctl.train.reload import run_config

    assert run_config(str(work / "runs" / "split_0")).train.seed == 3
    # one line per split; logged warnings (e.g. a 100-line split whose test rows are all one class,
    # printed once a console log handler exists) may come in between
    lines = [ln for ln in cap.err.strip().splitlines() if not ln.startswith("WARNING ")]
    assert [ln.split(":")[0] for ln in lines] == ["split 0", "split 1"]
    assert "best val AUC" not in cap.out + cap.err and "epoch 1/1" not in cap.out + cap.err
    for r in rows:
        log = (work / "logs" / f"split_{r['seed']}.log").read_text()
        assert "epoch 1/1" in log and "best val AUC" in log
    cv.main(_argv(head_100, tmp_path / "w2", "--verbose"))
    cap = capsys.readouterr()
    assert (cap.out + cap.err).count("best val AUC") == 2 and not (tmp_path / "w2" / "logs").exists()


def test_help_describes_the_script_whole_and_shows_defaults(capsys):
    cv = _script()
    with pytest.raises(SystemExit):
        cv.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "the paired test-AUC difference DLRM - LR with its standard error." in text
    assert "(default: configs/criteo_sample.yaml)" in text and "(default: runs/criteo_cv)" in text


# ---------------------------------------------------------------------------- --train-rows (learning curve)
def test_train_rows_parse_sorted_once_all_last_and_bad_values_refused():
    cv = _script()
    assert cv.parse_train_rows(None) == [None]
    assert cv.parse_train_rows(["5000,2500", "all,10000", "2500"]) == [2500, 5000, 10000, None]
    assert cv.parse_train_rows(["ALL"]) == [None]
    for bad, msg in (("0", ">= 1 train row"), ("-5", ">= 1 train row"), ("2.5k", "expected comma-separated integers"),
                     ("100,", "expected comma-separated integers")):
        with pytest.raises(ValueError, match=msg):
            cv.parse_train_rows([bad])


def _table(data_dir, split):
    import pyarrow as pa
    import pyarrow.ipc as ipc

    from dlrmctl.data.columnar import read_meta

    meta = read_meta(str(data_dir))
    return pa.concat_tables([ipc.open_file(pa.memory_map(str(data_dir / f))).read_all()
                             for f in meta["splits"][split]["files"]]), meta


def _vocab_values(data_dir, meta, name):
    import pyarrow as pa
    import pyarrow.ipc as ipc

    return ipc.open_file(pa.memory_map(str(data_dir / meta["vocab_files"][name]))).read_all()


def test_a_train_subsample_is_exact_nested_keeps_val_test_and_rebuilds_the_vocabulary(head_tsv, tmp_path):
    """N of a split's train rows (the first N of a permutation seeded by the split seed): exactly N,
    the smaller a subset of the larger, val/test rows unchanged, the vocabulary the one the kept rows
    alone would build (count >= threshold, ranked by count then value) with every split's ids mapped."""
    cv = _script()
    src = tmp_path / "data_3"
    cv.preprocess_split(str(head_tsv), src, 3, 0.15, 0.15)
    full, meta = _table(src, "train")
    rows = full.num_rows
    dense = ["label"] + meta["dense_features"]
    small, big = cv.subsample_indices(rows, 300, 3), cv.subsample_indices(rows, 900, 3)
    assert len(small) == 300 and len(np.unique(small)) == 300 and set(small) <= set(big)
    assert not np.array_equal(small, cv.subsample_indices(rows, 300, 4))  # the seed moves it
    t_thr = meta["transforms"]["sparse"]["frequency_threshold"]
    for n, idx in ((300, small), (900, big)):
        dst = tmp_path / f"data_3_n{n}"
        assert cv.derive_train_subsample(src, dst, n, 3) == {"rows": n, "of": rows}
        sub, smeta = _table(dst, "train")
        assert sub.num_rows == smeta["splits"]["train"]["rows"] == n
        assert smeta["transforms"]["train_subsample"]["rows"] == n
        for c in dense:  # the kept rows, in the file's order
            assert np.array_equal(sub.column(c).to_numpy(), full.column(c).to_numpy()[idx])
        for split in ("val", "test"):
            a, _ = _table(src, split)
            b, _ = _table(dst, split)
            assert smeta["splits"][split] == {"rows": a.num_rows, "files": smeta["splits"][split]["files"]}
            for c in dense:
                assert np.array_equal(a.column(c).to_numpy(), b.column(c).to_numpy())
        for f_old, f_new in zip(meta["sparse_features"], smeta["sparse_features"]):
            name = f_old["name"]
            old_values = _vocab_values(src, meta, name).column("value").to_numpy()
            kept_ids = full.column(name).to_numpy()[idx]
            inv = kept_ids[kept_ids < f_old["oov_id"]]
            vals, counts = np.unique(old_values[inv], return_counts=True)
            want = vals[counts >= t_thr]
            want_counts = counts[counts >= t_thr]
            want = want[np.lexsort((want, -want_counts))]
            got = _vocab_values(dst, smeta, name)
            assert np.array_equal(got.column("value").to_numpy(), want), name
            nv = len(want)
            assert (f_new["oov_id"], f_new["missing_id"], f_new["num_embeddings"]) == (nv, nv + 1, nv + 2)
            # every split's ids: a kept value keeps its value, the rest is oov, missing stays missing
            lookup = {v: i for i, v in enumerate(want)}
            for split in ("train", "val", "test"):
                a = (full if split == "train" else _table(src, split)[0]).column(name).to_numpy()
                if split == "train":
                    a = a[idx]
                b = _table(dst, split)[0].column(name).to_numpy()
                exp = np.array([nv + 1 if i == f_old["missing_id"] else
                                lookup.get(old_values[i], nv) if i < f_old["oov_id"] else nv for i in a])
                assert np.array_equal(b, exp), (name, split)
    with pytest.raises(ValueError, match=f"1 <= n <= {rows}"):
        cv.derive_train_subsample(src, tmp_path / "too_many", rows + 1, 3)
    assert not (tmp_path / "too_many").exists()


def test_train_rows_trains_dlrm_and_lr_on_the_same_subsample(head_tsv, tmp_path, capsys):
    cv = _script()
    work, out = tmp_path / "work", tmp_path / "res" / "curve.md"
    argv = ["--input", str(head_tsv), "--config", str(REPO / "configs" / "criteo_sample.yaml"), "--splits", "2",
            "--work", str(work), "--out", str(out), "--C", "0.1", "--train-rows", "all,400"]
    for o in FAST:
        argv += ["--set", o]
    res = cv.main(argv)
    printed = capsys.readouterr().out
    from dlrmctl.data.columnar import read_meta
    from dlrmctl.train.reload import evaluate_run, run_config

    cb = load_script("criteo_baselines")
    rows = res["rows"]
    assert [(r["seed"], r["size"]) for r in rows] == [(0, "400"), (0, "all"), (1, "400"), (1, "all")]
    for r in rows:
        n = None if r["size"] == "all" else 400
        data = work / (f"data_{r['seed']}" + ("" if n is None else "_n400"))
        run = work / "runs" / cv.run_name(r["seed"], n)
        full = read_meta(str(work / f"data_{r['seed']}"))
        meta = read_meta(str(data))
        assert r["train_rows"] == meta["splits"]["train"]["rows"] == (400 if n else full["splits"]["train"]["rows"])
        assert meta["splits"]["test"]["rows"] == full["splits"]["test"]["rows"] == r["test_rows"]
        # DLRM trained on that directory; the LR is criteo_baselines on the same one
        assert run_config(str(run)).data.path == str(data)
        assert r["dlrm_test_auc"] == pytest.approx(evaluate_run(str(run), "test")["auc"], abs=1e-12)
        lr = cb.run(str(data), cs=(0.1,), out=lambda s: None, log=lambda s: None)
        assert r["lr_test_auc"] == pytest.approx(lr["logistic_regression"]["test"]["auc"], abs=1e-12)
    # one section per size, then the learning curve; the command records the sizes
    assert [c["size"] for c in res["curve"]] == ["400", "all"]
    assert "### learning curve" in printed and "| 400 | " in printed and "--train-rows 400,all" in printed
    s400 = res["curve"][0]["summary"]
    d = [r["dlrm_test_auc"] - r["lr_test_auc"] for r in rows if r["size"] == "400"]
    assert s400["diff_mean"] == pytest.approx(np.mean(d), abs=1e-12) and s400["train_rows_min"] == 400
    assert f"{s400['diff_mean']:+.4f} ± {s400['diff_se']:.4f}" in printed
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["partial"] is False and [c["size"] for c in saved["curve"]] == ["400", "all"]
    assert out.read_text() in printed


def test_train_rows_out_of_range_is_one_line_before_any_work(head_100, tmp_path, capsys):
    cv = _script()
    work = tmp_path / "w"
    have = cv.expected_train_rows(str(head_100), range(0, 2), 0.15, 0.15)
    for extra, msg in ((["--train-rows", "0"], ">= 1 train row"),
                       (["--train-rows", "10,abc"], "expected comma-separated integers"),
                       (["--train-rows", str(min(have.values()) + 1)],
                        f"split {min(have, key=have.get)} has only {min(have.values())} train rows")):
        with pytest.raises(SystemExit) as e:
            cv.main(_argv(head_100, work, *extra))
        assert msg in _one_error_line(capsys, e)
    assert not work.exists()
    # the rule's count is the preprocessor's (no bad lines here)
    cv.preprocess_split(str(head_100), tmp_path / "d0", 0, 0.15, 0.15)
    from dlrmctl.data.columnar import read_meta

    assert read_meta(str(tmp_path / "d0"))["splits"]["train"]["rows"] == have[0]


def test_a_run_stopped_early_leaves_the_table_of_its_finished_splits(tmp_path, capsys, monkeypatch):
    """With --out, after each split from the second on the splits done so far are written (marked
    partial): a run that fails (or is stopped) at split 2 of 3 leaves the table of splits 0 and 1."""
    cv = _script()
    tsv = tmp_path / "x.tsv"
    tsv.write_text("".join(f"{i % 2}\t" + "\t" * 38 + "\n" for i in range(400)))
    rng = np.random.default_rng(0)

    def fake_split(config, overrides, input_file, work, seed, *a, train_rows=None, **k):
        if seed == 2:
            raise ValueError("stopped here")
        y = rng.integers(0, 2, 50).astype(np.float64)
        return {"seed": seed, "size": cv.size_label(train_rows), "train_rows": train_rows or 280, "test_rows": 50,
                "dlrm_val_auc": 0.7, "dlrm_test_auc": 0.7 + seed / 100, "lr_val_auc": 0.7, "lr_test_auc": 0.7,
                "C": 0.1, "dlrm_test_logits": rng.normal(size=50), "lr_test_logits": rng.normal(size=50),
                "test_labels": y}

    monkeypatch.setattr(cv, "run_split", fake_split)
    out = tmp_path / "cv.md"
    with pytest.raises(SystemExit) as e:
        cv.main(_argv(tsv, tmp_path / "w", "--splits", "3", "--train-rows", "100,all", "--out", str(out)))
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress lines of splits 0, 1
    assert last.startswith("error: split 2, --train-rows 100") and "stopped here" in last
    text = out.read_text()
    assert "**partial**: 2 of 3 splits" in text and "### learning curve" in text
    assert "| 100 | 0.7050 ± 0.0050 | 0.7000 ± 0.0000 | +0.0050 ± 0.0050 | 2 |" in text
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["partial"] is True and [(r["seed"], r["size"]) for r in saved["rows"]] == [
        (0, "100"), (0, "all"), (1, "100"), (1, "all")]


def test_a_failed_subsample_leaves_no_partial_copy(head_100, tmp_path):
    """A source whose vocabulary disagrees with its meta.json: one ValueError naming the file, and
    neither the copy nor its temp directory left behind."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    cv = _script()
    src = tmp_path / "data_0"
    cv.preprocess_split(str(head_100), src, 0, 0.15, 0.15)
    vt = pa.table({"value": pa.array([], pa.int64()), "count": pa.array([], pa.int64())})
    with pa.OSFile(str(src / "vocab" / "C2.arrow"), "wb") as sink, ipc.new_file(sink, vt.schema) as w:
        w.write_table(vt)
    with pytest.raises(ValueError, match="C2.arrow: 0 values.*re-run preprocessing"):
        cv.derive_train_subsample(src, tmp_path / "data_0_n10", 10, 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data_0"]
