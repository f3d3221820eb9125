"""Issue 16 item 2: scripts/criteo_baselines.py — the CTR prior and a scikit-learn logistic
regression (C chosen on val) scored on the test split of `dlrmctl preprocess criteo` output."""

import math
import re

import numpy as np
import pytest

from tests.conftest import CRITEO_10K, require_shared
from tests.helpers.scripts import load_script

pytest.importorskip("sklearn", reason="scikit-learn is the bench/test extra: pip install -e '.[test]'")


def _script():
    return load_script("criteo_baselines")


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    from dlrmctl.data.criteo import CriteoOptions, preprocess_criteo

    out = tmp_path_factory.mktemp("criteo3")
    preprocess_criteo(str(require_shared(CRITEO_10K)), out, CriteoOptions(val_ratio=0.15, test_ratio=0.15),
                      progress=False)
    return out


def test_prior_and_lr_on_the_test_split_with_c_chosen_on_val(sample, capsys):
    res = _script().main([str(sample), "--C", "0.001,0.03,10"])
    cap = capsys.readouterr()
    lines = cap.out.splitlines()
    assert [ln.split(" AUC")[0].split() for ln in lines] == [
        ["CTR", "prior", "val"], ["CTR", "prior", "test"], ["logistic", "regression", "val"],
        ["logistic", "regression", "test"]]
    # the prior: AUC 0.5 (all ties), log loss = cross-entropy of the test labels under the train CTR
    from dlrmctl.data.columnar import read_meta

    meta = read_meta(str(sample))
    p, q = meta["ctr"]["train"], meta["ctr"]["test"]
    assert res["prior"]["test"]["auc"] == 0.5
    assert res["prior"]["test"]["logloss"] == pytest.approx(-(q * math.log(p) + (1 - q) * math.log(1 - p)), abs=1e-9)
    # C: the best validation AUC of the three tried (read from the per-C log on stderr)
    tried = {float(c): float(a) for c, a in re.findall(r"C=([\d.e-]+): val AUC ([\d.]+)", cap.err)}
    assert sorted(tried) == [0.001, 0.03, 10.0]
    assert res["C"] == max(tried, key=tried.get)
    assert res["logistic_regression"]["val"]["auc"] == pytest.approx(tried[res["C"]], abs=5e-5)
    # a linear model on these features is far from chance on unseen rows, and beats the prior's log loss
    t = res["logistic_regression"]["test"]
    assert t["auc"] > 0.70 and t["logloss"] < res["prior"]["test"]["logloss"]
    assert t["num_samples"] == meta["splits"]["test"]["rows"]


def test_design_matrix_one_hot_columns_and_bad_ids():
    import baselines_common as bc  # noqa: F401  (scripts/ is on sys.path once the script is loaded)

    meta = {"dense_features": ["I1"], "sparse_features": [{"name": "C1", "num_embeddings": 3},
                                                          {"name": "C2", "num_embeddings": 2}]}
    d = {"label": np.array([0, 1], np.float32), "dense": np.array([[1.0], [3.0]], np.float32),
         "sparse": {"C1": (np.array([2, 0]), np.array([1, 1])), "C2": (np.array([1, 1]), np.array([1, 1]))}}
    x = bc.design_matrix(d, meta, *bc.dense_stats(d)).toarray()
    np.testing.assert_array_equal(x, [[0, 0, 1, 0, 1, -1], [1, 0, 0, 0, 1, 1]])
    d["sparse"]["C2"] = (np.array([1, 2]), np.array([1, 1]))
    with pytest.raises(ValueError, match=r"feature C2: ids must be in \[0, 2\)"):
        bc.design_matrix(d, meta, *bc.dense_stats(d))


_script()  # puts scripts/ on sys.path for baselines_common


@pytest.mark.parametrize("script", ["criteo_baselines.py", "movielens_baselines.py"])
@pytest.mark.parametrize("args, msg", [
    (["--C", "0"], "--C: expected finite numbers > 0"), (["--C", "nan"], "--C: expected finite numbers > 0"),
    (["--C", ","], "--C: expected finite numbers > 0"), (["--C", "abc"], "--C: expected comma-separated numbers"),
    (["--test-split", "val"], "--test-split 'val' is the split C is chosen on"),
    (["--val-split", "nope"], "unknown split 'nope'"),
])
def test_bad_arguments_are_a_usage_error_not_a_traceback(tmp_path, capsys, script, args, msg):
    """--C 0 / nan / empty was a ValueError or scikit-learn traceback, a missing split a DataError
    traceback, and --test-split equal to --val-split reported the split C was chosen on as test."""
    from dlrmctl.data.synthetic import generate_synthetic

    generate_synthetic(tmp_path / "d", rows=300, seed=0, num_embeddings=[7] * 26)
    mod = load_script(script[:-3])
    with pytest.raises(SystemExit) as e:
        mod.main([str(tmp_path / "d"), *args])
    err = capsys.readouterr().err
    if script.startswith("movielens") and args[0] == "--val-split":  # synthetic data is refused first, cleanly
        msg = "not `dlrmctl preprocess movielens` output"
    assert e.value.code == 2 and msg in err, err
    with pytest.raises(SystemExit) as e:
        mod.main([str(tmp_path / "absent")])
    assert e.value.code == 2 and "meta.json: not found" in capsys.readouterr().err
