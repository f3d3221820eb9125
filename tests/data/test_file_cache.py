"""dlrmctl.data.file_cache: one load per file version, a rewritten file loaded again, the limits."""

import os

import pytest

from dlrmctl.data.file_cache import FileCache


def _counting_loader():
    loads = []

    def load(path):
        loads.append(path.name)
        return path.read_text()

    return loads, load


def test_a_file_is_loaded_once_per_version_and_again_when_rewritten(tmp_path):
    loads, load = _counting_loader()
    cache = FileCache(load)
    f = tmp_path / "v.txt"
    f.write_text("one")
    assert cache.get(f) == "one" and cache.get(str(f)) == "one"
    assert loads == ["v.txt"]
    f.write_text("two!")  # another size
    assert cache.get(f) == "two!"
    st = f.stat()
    f.write_text("six!")  # the same size: the modification time tells
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert cache.get(f) == "six!"
    assert loads == ["v.txt"] * 3


def test_the_limit_drops_the_oldest_and_clear_drops_all(tmp_path):
    loads, load = _counting_loader()
    cache = FileCache(load, limit=2)
    files = [tmp_path / f"{i}.txt" for i in range(3)]
    for i, f in enumerate(files):
        f.write_text(str(i))
        cache.get(f)
    assert len(cache) == 2
    cache.get(files[2])
    cache.get(files[1])
    assert loads == ["0.txt", "1.txt", "2.txt"]
    cache.get(files[0])  # dropped as the oldest: loaded again
    assert loads[-1] == "0.txt"
    cache.clear()
    assert len(cache) == 0


def test_one_dir_keeps_the_files_of_one_directory(tmp_path):
    loads, load = _counting_loader()
    cache = FileCache(load, one_dir=True)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for d in ("a", "b"):
        for n in ("x", "y"):
            (tmp_path / d / n).write_text(d + n)
    cache.get(tmp_path / "a" / "x")
    cache.get(tmp_path / "a" / "y")
    assert len(cache) == 2
    assert cache.get(tmp_path / "b" / "x") == "bx"
    assert len(cache) == 1


def test_a_failed_load_or_a_missing_file_keeps_nothing(tmp_path):
    def load(path):
        raise ValueError(f"not readable: {path.name}")

    cache = FileCache(load)
    f = tmp_path / "bad"
    f.write_text("?")
    with pytest.raises(ValueError, match="not readable: bad"):
        cache.get(f)
    with pytest.raises(FileNotFoundError):
        cache.get(tmp_path / "missing")
    assert len(cache) == 0
    with pytest.raises(ValueError, match="limit"):
        FileCache(load, limit=0)


def test_threads_asking_for_one_file_together_load_it_once_and_share_the_value(tmp_path):
    import threading
    import time

    f = tmp_path / "v.txt"
    f.write_text("one")
    loads, started = [], threading.Event()

    def load(path):
        loads.append(path.name)
        started.set()
        time.sleep(0.2)  # (widens the window in which the others ask: not a timing assertion)
        return [path.read_text()]

    cache = FileCache(load)
    got, errors = [], []

    def ask():
        try:
            got.append(cache.get(f))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    first = threading.Thread(target=ask)
    first.start()
    started.wait()
    others = [threading.Thread(target=ask) for _ in range(8)]
    for t in others:
        t.start()
    for t in [first, *others]:
        t.join()
    assert not errors and loads == ["v.txt"] and len(got) == 9 and all(g is got[0] for g in got)


def test_threads_over_many_files_keep_the_limit_and_lose_no_value(tmp_path):
    import threading

    files = []
    for k in range(12):
        files.append(tmp_path / f"{k}.txt")
        files[-1].write_text(str(k))
    cache = FileCache(lambda p: p.read_text(), limit=3)
    errors = []

    def ask(seed):
        try:
            for i in range(200):
                f = files[(seed * 7 + i) % len(files)]
                assert cache.get(f) == f.read_text()
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(cache) <= 3


def test_a_failed_load_is_kept_by_no_thread_and_tried_again(tmp_path):
    f = tmp_path / "v.txt"
    f.write_text("one")
    calls = []

    def load(path):
        calls.append(1)
        if len(calls) == 1:
            raise OSError("disk")
        return path.read_text()

    cache = FileCache(load)
    with pytest.raises(OSError, match="disk"):
        cache.get(f)
    assert cache.get(f) == "one" and len(calls) == 2 and len(cache) == 1
