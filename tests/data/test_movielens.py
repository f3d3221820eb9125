"""MovieLens preprocessing: every release layout from hand-written files, bad-line errors
naming file:line, the per-user time-ordered split, train-only statistics, and an end-to-end
run on the real ml-latest-small (skipped when ../shared/data is absent)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from dlrmctl.data.columnar import DataError, open_split, read_meta
from dlrmctl.data.movielens import (
    MovieLensOptions,
    detect_release,
    preprocess_movielens,
    read_movielens,
    time_ordered_split,
)

from tests.conftest import REPO, SHARED_DATA, require_shared

# real-data fixture next to the checkout: ../shared/data (not in the repository, see PROVENANCE.md)
ML_LATEST_SMALL = SHARED_DATA / "movielens" / "ml-latest-small"


def _write(path: Path, data: str | bytes, encoding: str = "utf-8") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode(encoding))
    return path


def _read_split(out: Path, split: str) -> dict[str, np.ndarray]:
    s = open_split(out, split)
    sh = s.shards[0]
    loc = sh.locate(np.arange(s.rows, dtype=np.int64))
    cols = {}
    for name in sh.columns:
        if sh._kind[name] == "list":
            cols[name] = sh.take_list(name, loc)
        else:
            cols[name] = sh.take(name, loc)
    return cols


# ---------------------------------------------------------------------------------- fixtures
def make_ml100k(d: Path) -> Path:
    # 3 users x 5 ratings; tab separated; u.item latin-1 with 19 genre flags
    lines = []
    t = 880000000
    for u in (1, 2, 3):
        for k, m in enumerate((10, 20, 30, 10 + u * 0, 40)[:4] + (50,)):
            lines.append(f"{u}\t{m if k != 3 else 40}\t{(u + k) % 5 + 1}\t{t + 100 * k + u}")
    _write(d / "u.data", "\n".join(lines) + "\n")
    flags = ["0"] * 19

    def item(mid: int, title: str, date: str, genres: list[int]) -> bytes:
        f = list(flags)
        for g in genres:
            f[g] = "1"
        return f"{mid}|{title}|{date}||http://x|{'|'.join(f)}\n".encode("latin-1")

    _write(d / "u.item", b"".join([
        item(10, "Caf\xe9 Society (1996)", "01-Jan-1996", [5, 8]),
        item(20, "Heat (1995)", "15-Dec-1995", [1]),
        item(30, "unknown", "", [0]),
        item(40, "Alien (1979)", "01-Jan-1979", [1, 11, 15]),
        item(50, "Fargo (1996)", "14-Feb-1997", [6, 8, 16]),
    ]))
    _write(d / "u.user", "1|24|M|technician|85711\n2|53|F|other|94043\n3|17|M|writer|T8H1N\n")
    return d


def make_ml1m(d: Path) -> Path:
    _write(d / "ratings.dat", "1::1::5::978300760\n1::2::3::978302109\n1::3::4::978301968\n"
                              "2::1::4::978300275\n2::3::2::978824291\n")
    # latin-1 byte in a title, a title with a single ':' and one ending in ':' (':::' before genres)
    _write(d / "movies.dat", b"1::Star Wars: Episode IV - A New Hope (1977)::Action|Adventure|Sci-Fi\n"
                             b"2::Cit\xe9 des enfants perdus, La (1995)::Adventure|Sci-Fi\n"
                             b"3::What Is It?: (2005)::Drama\n")
    _write(d / "users.dat", "1::F::1::10::48067\n2::M::56::16::70072-1234\n")
    return d


def make_csv(d: Path) -> Path:
    crlf = "\r\n"
    ratings = ["userId,movieId,rating,timestamp"]
    t = 1_500_000_000
    for u in (1, 2):
        for k, m in enumerate((1, 2, 3, 4, 5, 6, 7, 8, 9, 10)):
            ratings.append(f"{u},{m},{(0.5 + (u * 3 + k) % 10 * 0.5):.1f},{t + 1000 * k + u}")
    _write(d / "ratings.csv", crlf.join(ratings) + crlf)
    movies = ["movieId,title,genres", '1,"American President, The (1995)",Comedy|Drama|Romance',
              "2,Amélie (Fabuleux destin d'Amélie Poulain Le) (2001),Comedy|Romance",
              "3,Cosmos,(no genres listed)"] + [f"{m},Movie {m} ({1990 + m}),Drama" for m in range(4, 11)]
    _write(d / "movies.csv", crlf.join(movies) + crlf)
    # tag by user 1 on movie 1 early (train-visible), and a late one (after user 1's train cutoff)
    tags = ["userId,movieId,tag,timestamp",
            f"1,1,Politics,{t}", f"2,1,politics,{t + 5}", f"1,2,  Paris ,{t}", f"2,2,paris,{t}",
            f'1,3,"space, stars",{t + 10**7}', f'2,3,"space, stars",{t + 10**7}']
    _write(d / "tags.csv", crlf.join(tags) + crlf)
    return d


# ---------------------------------------------------------------------------------- detection
def test_detect_release_by_files(tmp_path):
    assert detect_release(make_ml100k(tmp_path / "a"))[0] == "ml-100k"
    assert detect_release(make_ml1m(tmp_path / "b"))[0] == "ml-1m"
    rel, files = detect_release(make_csv(tmp_path / "c"))
    assert rel == "ml-latest" and set(files) == {"ratings", "movies", "tags"}


def test_mixed_releases_in_one_directory_is_an_error(tmp_path):
    d = make_csv(tmp_path / "x")
    _write(d / "u.data", "1\t1\t5\t1\n")
    with pytest.raises(DataError, match=r"mixed MovieLens releases.*u\.data.*ratings\.csv"):
        detect_release(d)


def test_ml1m_without_ratings_dat_explains_what_is_missing(tmp_path):
    d = make_ml1m(tmp_path / "m")
    (d / "ratings.dat").unlink()
    with pytest.raises(DataError, match="movies.dat is here but ratings.dat is not"):
        detect_release(d)


# ---------------------------------------------------------------------------------- formats
def test_ml100k_tab_and_pipe_files_latin1_titles_and_user_features(tmp_path):
    d = make_ml100k(tmp_path / "in")
    data = read_movielens(d)
    assert data.movies[10][0] == "Caf\u00e9 Society (1996)"
    assert data.movies[10][1] == ["Comedy", "Drama"] and data.movies[10][2] == 1996
    assert data.movies[50][2] == 1997  # from the release date field, not the title
    assert data.movies[30][2] is None
    assert data.users[1]["age"] == 18 and data.users[2]["age"] == 50 and data.users[3]["age"] == 1
    out = tmp_path / "out"
    preprocess_movielens(d, out, MovieLensOptions(val_ratio=0.2, test_ratio=0.2))
    meta = read_meta(out)
    names = [f["name"] for f in meta["sparse_features"]]
    assert names == ["user_id", "item_id", "gender", "age", "occupation", "zip_prefix", "genres"]
    assert meta["vocabularies"]["zip_prefix"] == ["857", "940", "T8H"]
    assert meta["vocabularies"]["age"] == [1, 18, 50]
    assert {s: meta["splits"][s]["rows"] for s in ("train", "val", "test")} == {"train": 9, "val": 3, "test": 3}
    g = next(f for f in meta["sparse_features"] if f["name"] == "genres")
    assert g["multi_hot"] is True and g["num_embeddings"] == len(meta["vocabularies"]["genres"])


def test_ml1m_double_colon_titles_with_colons_and_latin1_bytes(tmp_path):
    d = make_ml1m(tmp_path / "in")
    data = read_movielens(d)
    assert data.movies[1] == ("Star Wars: Episode IV - A New Hope (1977)", ["Action", "Adventure", "Sci-Fi"], 1977)
    assert data.movies[2][0] == "Cit\u00e9 des enfants perdus, La (1995)"
    assert data.movies[3] == ("What Is It?: (2005)", ["Drama"], 2005)
    assert data.users[2]["zip"] == "70072-1234" and data.users[1]["age"] == 1
    out = tmp_path / "out"
    preprocess_movielens(d, out, MovieLensOptions(val_ratio=0.0, test_ratio=0.34))
    cols = _read_split(out, "test")
    # user 1 (3 ratings -> 1 test): its latest is movie 2 (3 stars, a negative);
    # user 2 (2 ratings -> floor(0.68) = 0 test) stays in train
    assert cols["item_id"].tolist() == [1] and cols["label"].tolist() == [0.0]
    assert cols["user_id"].tolist() == [0]
    meta = read_meta(out)
    assert meta["vocabularies"]["gender"] == ["F", "M"]
    assert meta["vocabularies"]["occupation"] == ["10", "16"]


def test_csv_release_crlf_quoted_titles_and_train_visible_tags(tmp_path):
    d = make_csv(tmp_path / "in")
    data = read_movielens(d)
    assert data.movies[1] == ("American President, The (1995)", ["Comedy", "Drama", "Romance"], 1995)
    assert data.movies[2][0].startswith("Am\u00e9lie") and data.movies[3] == ("Cosmos", [], None)
    assert len(data.user) == 20 and data.tags[2][4] == "space, stars"
    out = tmp_path / "out"
    preprocess_movielens(d, out)  # 10 ratings per user -> 8 train, 1 val, 1 test
    meta = read_meta(out)
    # 'space, stars' is after both users' last train rating: not train-visible, dropped
    assert meta["vocabularies"]["tags"] == ["paris", "politics"]
    assert meta["splits"]["train"]["rows"] == 16
    cols = _read_split(out, "train")
    tag_vals, tag_lens = cols["tags"]
    item = cols["item_id"]
    starts = np.r_[0, np.cumsum(tag_lens)[:-1]]
    bags = {int(i): tag_vals[s:s + n].tolist() for i, s, n in zip(item, starts, tag_lens)}
    assert bags[0] == [1] and bags[1] == [0] and bags[2] == []
    g_vals, g_lens = cols["genres"]
    assert dict(zip(item.tolist(), g_lens.tolist()))[2] == 0  # (no genres listed) -> empty bag


# ---------------------------------------------------------------------------------- errors
def test_bad_rating_value_names_file_and_line(tmp_path):
    d = make_csv(tmp_path / "in")
    p = d / "ratings.csv"
    lines = p.read_bytes().split(b"\r\n")
    lines[3] = b"1,3,four,1500002001"
    p.write_bytes(b"\r\n".join(lines))
    with pytest.raises(DataError, match=r"ratings\.csv:4: field rating: expected a number, got 'four'"):
        read_movielens(d)


def test_rating_out_of_range_names_file_and_line(tmp_path):
    d = make_ml1m(tmp_path / "in")
    _write(d / "ratings.dat", "1::1::5::978300760\n\n1::2::7::978302109\n")
    with pytest.raises(DataError, match=r"ratings\.dat:3: field rating: rating 7 is outside"):
        read_movielens(d)


def test_pipe_separated_u_data_is_rejected_at_line_1(tmp_path):
    d = make_ml100k(tmp_path / "in")
    _write(d / "u.data", "1|10|5|881250949\n")
    with pytest.raises(DataError, match=r"u\.data:1: expected 4 '\\t'-separated fields"):
        read_movielens(d)


def test_movies_dat_with_missing_field_names_line(tmp_path):
    d = make_ml1m(tmp_path / "in")
    _write(d / "movies.dat", b"1::Toy Story (1995)::Animation\n2::Jumanji (1995)\n")
    with pytest.raises(DataError, match=r"movies\.dat:2: expected 3 '::'-separated fields"):
        read_movielens(d)


def test_swapped_csv_files_are_recognised_by_header(tmp_path):
    d = make_csv(tmp_path / "in")
    ratings = (d / "ratings.csv").read_bytes()
    (d / "ratings.csv").write_bytes((d / "movies.csv").read_bytes())
    (d / "movies.csv").write_bytes(ratings)
    with pytest.raises(DataError, match=r"ratings\.csv:1: .*header of movies\.csv: files mixed up"):
        read_movielens(d)


def test_rated_movie_missing_from_movies_file_names_ratings_line(tmp_path):
    d = make_ml1m(tmp_path / "in")
    _write(d / "ratings.dat", "1::1::5::978300760\n1::99::3::978302109\n")
    with pytest.raises(DataError, match=r"ratings\.dat:2: field movieId: movie id 99 is not in movies\.dat"):
        read_movielens(d)


def test_a_rater_missing_from_the_users_file_names_the_ratings_line(tmp_path):
    d = make_ml1m(tmp_path / "in")
    _write(d / "ratings.dat", "1::1::5::978300760\n2::2::3::978302109\n7::3::4::978301968\n")
    with pytest.raises(DataError, match=r"ratings\.dat:3: field userId: user id 7 is not in users\.dat "
                                        r"\(1 ratings refer to unknown users"):
        read_movielens(d)


def test_csv_movies_and_tags_lines_with_a_wrong_field_count_name_the_line_and_the_fields(tmp_path):
    d = make_csv(tmp_path / "in")
    movies = (d / "movies.csv").read_text().replace("3,Cosmos,(no genres listed)", "3,Cosmos")
    (d / "movies.csv").write_text(movies)
    with pytest.raises(DataError, match=r"movies\.csv:4: expected 3 comma-separated fields \(movieId, title, "
                                        r"genres\), got 2"):
        read_movielens(d)
    d = make_csv(tmp_path / "in2")
    (d / "tags.csv").write_text((d / "tags.csv").read_text().replace("1,1,Politics,", "1,1,"))
    with pytest.raises(DataError, match=r"tags\.csv:2: expected 4 comma-separated fields \(userId, movieId, tag, "
                                        r"timestamp\), got 3"):
        read_movielens(d)


def test_bad_user_line_names_field(tmp_path):
    d = make_ml100k(tmp_path / "in")
    _write(d / "u.user", "1|24|M|technician|85711\n2|fifty|F|other|94043\n3|17|M|writer|T8H1N\n")
    with pytest.raises(DataError, match=r"u\.user:2: field age: expected an integer, got 'fifty'"):
        read_movielens(d)


def test_options_out_of_range_name_the_cli_option(tmp_path):
    with pytest.raises(ValueError, match="--val-ratio"):
        preprocess_movielens(make_ml1m(tmp_path / "in"), tmp_path / "o", MovieLensOptions(val_ratio=1.5))


# ---------------------------------------------------------------------------------- split
def test_time_ordered_split_counts_and_never_puts_the_past_in_val_or_test():
    rng = np.random.default_rng(0)
    n = 5000
    user = rng.integers(0, 60, n)
    ts = rng.integers(0, 50, n)  # many ties
    item = rng.permutation(n)
    codes = time_ordered_split(user, ts, 0.1, 0.2, tiebreak=item)
    for u in np.unique(user):
        m = user == u
        c, t, it = codes[m], ts[m], item[m]
        k = int(m.sum())
        assert (c == 2).sum() == int(np.floor(k * 0.2 + 1e-9)) and (c == 1).sum() == int(np.floor(k * 0.1 + 1e-9))
        key = t * n + it  # (timestamp, tiebreak) total order
        if (c == 1).any():
            assert key[c == 0].max() < key[c == 1].min()
            assert t[c == 0].max() <= t[c == 1].min()
        if (c == 2).any():
            assert key[c <= 1].max() < key[c == 2].min()


def test_time_ordered_split_hand_example():
    user = np.array([7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 3, 3])
    ts = np.array([9, 1, 8, 2, 7, 3, 6, 4, 5, 0, 1, 0])
    # user 7: 10 ratings -> 1 test (ts 9), 1 val (ts 8); user 3: 2 ratings -> all train
    assert time_ordered_split(user, ts, 0.1, 0.1).tolist() == [2, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]


def test_dense_statistics_come_from_train_only(tmp_path):
    d = make_ml1m(tmp_path / "in")
    # movie 3 is only rated as each user's last rating -> test only: popularity must be 0
    _write(d / "ratings.dat", "1::1::5::100\n1::2::3::200\n1::3::4::300\n2::1::4::100\n2::2::2::150\n2::3::2::400\n")
    out = tmp_path / "out"
    preprocess_movielens(d, out, MovieLensOptions(val_ratio=0.0, test_ratio=0.34))
    test = _read_split(out, "test")
    train = _read_split(out, "train")
    assert test["item_id"].tolist() == [2, 2] and np.all(test["item_popularity"] == 0.0)
    assert np.allclose(train["item_popularity"], np.log1p(2.0))
    assert np.allclose(test["user_activity"], np.log1p(2.0))
    meta = read_meta(out)
    # release years of train rows: 1977, 1977, 1995, 1995 -> mean 1986
    assert meta["transforms"]["dense"]["release_year"]["mean"] == pytest.approx(1986.0)


# ---------------------------------------------------------------------------------- model / CLI
def test_output_feeds_an_embedding_bag_collection_and_dcn_dlrm(tmp_path):
    from dlrmctl.config import ExperimentConfig, resolve_tables
    from dlrmctl.modules.dlrm import DLRM
    from dlrmctl.modules.embedding_modules import EmbeddingBagCollection
    from dlrmctl.modules.interactions import build_interaction
    from dlrmctl.sparse import KeyedJaggedTensor

    out = tmp_path / "out"
    preprocess_movielens(make_ml100k(tmp_path / "in"), out)
    meta = read_meta(out)
    cfg = ExperimentConfig()
    cfg.data.path = str(out)
    cfg.model.embedding_dim = 8
    cfg.model.interaction = "dcn"
    cfg.model.dcn_low_rank_dim = 4
    tables = resolve_tables(cfg, meta)
    cols = _read_split(out, "train")
    B = len(cols["label"])
    vals, lens = [], []
    for f in meta["sparse_features"]:
        if f["multi_hot"]:
            v, l = cols[f["name"]]
        else:
            v, l = cols[f["name"]], np.ones(B, dtype=np.int64)
        vals.append(v)
        lens.append(l)
    kjt = KeyedJaggedTensor([f["name"] for f in meta["sparse_features"]], torch.from_numpy(np.concatenate(vals)),
                            lengths=torch.from_numpy(np.concatenate(lens)))
    dense = torch.from_numpy(np.stack([cols[n] for n in meta["dense_features"]], axis=1))
    F = len(meta["sparse_features"])
    ebc = EmbeddingBagCollection(tables, compute_kernel="dense")
    model = DLRM(ebc, len(meta["dense_features"]), [16, 8], [8, 1], F, 8, interaction=build_interaction(cfg.model, F, 8))
    logits = model(dense, kjt)
    assert logits.shape == (B, 1) and torch.isfinite(logits).all()


def test_cli_command_preprocesses_and_reports_errors(tmp_path):
    from dlrmctl.cli import app  # through the CLI: cli.report_failure prints the error line and sets the exit code

    runner = CliRunner()
    out = tmp_path / "out"
    r = runner.invoke(app, ["preprocess", "movielens", "--input", str(make_csv(tmp_path / "in")), "--out", str(out),
                            "--positive-threshold", "3"])
    assert r.exit_code == 0, r.output
    assert "train" in r.output and (out / "meta.json").is_file()
    assert read_meta(out)["transforms"]["label"]["positive_threshold"] == 3.0
    r = runner.invoke(app, ["preprocess", "movielens", "--input", str(tmp_path / "nowhere"), "--out", str(out)])
    assert r.exit_code == 2 and "not a directory" in r.output


# ---------------------------------------------------------------------------------- real data
def test_end_to_end_on_ml_latest_small(tmp_path):
    require_shared(ML_LATEST_SMALL / "ratings.csv")
    src = ML_LATEST_SMALL
    out = tmp_path / "ml"
    rep = preprocess_movielens(src, out)
    meta = read_meta(out)
    assert meta["num_ratings"] == 100836 and meta["num_users"] == 610 and meta["num_items"] == 9742
    assert sum(meta["splits"][s]["rows"] for s in ("train", "val", "test")) == 100836
    assert [f["name"] for f in meta["sparse_features"]] == ["user_id", "item_id", "genres", "tags"]
    assert 0.3 < rep.ctr["train"] < 0.7
    # per user: no val/test rating older than a train one (recomputed from the raw data)
    data = read_movielens(src)
    codes = time_ordered_split(data.user, data.timestamp, 0.1, 0.1, tiebreak=data.item)
    order = np.lexsort((data.timestamp, data.user))
    u, t, c = data.user[order], data.timestamp[order], codes[order]
    bounds = np.flatnonzero(np.r_[True, u[1:] != u[:-1], True])
    for s, e in zip(bounds[:-1], bounds[1:]):
        tt, cc = t[s:e], c[s:e]
        assert tt[cc == 0].max() <= tt[cc > 0].min()
    assert int((codes == 1).sum()) == meta["splits"]["val"]["rows"]
    val = _read_split(out, "val")
    assert val["label"].dtype == np.float32 and set(np.unique(val["label"]).tolist()) == {0.0, 1.0}
    assert json.loads((out / "meta.json").read_text())["dataset"] == "movielens"


def test_movielens_config_trains_end_to_end_on_a_preprocessed_fixture(tmp_path):
    from dlrmctl.cli import app

    out = tmp_path / "ml"
    preprocess_movielens(make_ml100k(tmp_path / "in"), out, MovieLensOptions(val_ratio=0.2, test_ratio=0.2))
    cfg = REPO / "configs" / "movielens.yaml"
    r = CliRunner().invoke(app, ["train", str(cfg), "--set", f"data.path={out}", "--set",
                                 f"train.run_dir={tmp_path / 'runs'}", "--set", "data.batch_size=4"])
    assert r.exit_code == 0, r.output
    assert "val" in r.output and "AUC" in r.output
    assert (tmp_path / "runs" / "movielens").is_dir()


# ---------------------------------------------------------------------------------- CSV quoting
def _requote(src: Path, dst: Path, quoting: int) -> Path:
    """Rewrite every CSV file of ``src`` into ``dst`` with Python's csv writer and ``quoting``
    (QUOTE_NONNUMERIC: numbers unquoted, as the writer does for int / float values)."""
    import csv
    import io

    dst.mkdir(parents=True)
    for f in src.iterdir():
        rows = list(csv.reader(io.StringIO(f.read_text(encoding="utf-8"), newline="")))

        def num(v: str):
            for t in (int, float):
                try:
                    return t(v)
                except ValueError:
                    pass
            return v

        buf = io.StringIO(newline="")
        w = csv.writer(buf, quoting=quoting)
        for i, r in enumerate(rows):
            w.writerow(r if i == 0 or quoting != csv.QUOTE_NONNUMERIC else [num(v) for v in r])
        (dst / f.name).write_text(buf.getvalue(), encoding="utf-8", newline="")
    return dst


@pytest.mark.parametrize("quoting", ["QUOTE_ALL", "QUOTE_NONNUMERIC"])
def test_csv_files_with_every_field_quoted_preprocess_like_the_plain_ones(tmp_path, quoting):
    """Issue 23 item 19: a ratings.csv written with csv.QUOTE_ALL was refused with a header mismatch
    that was not real ("userId" quoted); movies.csv / tags.csv quoted the same way must read alike."""
    import csv

    from dlrmctl.cli import app

    plain = make_csv(tmp_path / "plain")
    quoted = _requote(plain, tmp_path / "quoted", getattr(csv, quoting))
    assert (quoted / "ratings.csv").read_text().startswith('"userId","movieId","rating","timestamp"')
    runner = CliRunner()
    for src, out in ((plain, tmp_path / "o_plain"), (quoted, tmp_path / "o_quoted")):
        r = runner.invoke(app, ["preprocess", "movielens", "--input", str(src), "--out", str(out)])
        assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    a, b = read_meta(tmp_path / "o_plain"), read_meta(tmp_path / "o_quoted")
    assert a["vocabularies"] == b["vocabularies"] and a["splits"] == b["splits"]
    for split in ("train", "val", "test"):
        x, y = _read_split(tmp_path / "o_plain", split), _read_split(tmp_path / "o_quoted", split)
        assert x.keys() == y.keys()
        for k in x:
            xs, ys = (x[k], y[k]) if isinstance(x[k], tuple) else ((x[k],), (y[k],))
            assert all(np.array_equal(p, q) for p, q in zip(xs, ys)), (split, k)
    # a bad value in a quoted file is still named by file, line and field
    p = quoted / "ratings.csv"
    lines = p.read_bytes().split(b"\r\n")
    lines[3] = b'"1","3","four","1500002001"'
    p.write_bytes(b"\r\n".join(lines))
    with pytest.raises(DataError, match=r"ratings\.csv:4: field rating: expected a number, got 'four'"):
        read_movielens(quoted)


def test_quoted_ml_latest_small_reads_like_the_original(tmp_path):
    import csv

    require_shared(ML_LATEST_SMALL / "ratings.csv")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("ratings.csv", "movies.csv", "tags.csv"):
        (src / name).write_bytes((ML_LATEST_SMALL / name).read_bytes())
    a, b = read_movielens(src), read_movielens(_requote(src, tmp_path / "q", csv.QUOTE_ALL))
    assert np.array_equal(a.user, b.user) and np.array_equal(a.rating, b.rating) and a.movies == b.movies
    assert np.array_equal(a.timestamp, b.timestamp) and a.tags[2] == b.tags[2]
