"""Checksums of a preprocessed dataset's files, and the paths meta.json may name.

``preprocess`` records in meta.json, for every file a split or a vocabulary names, its size and
SHA-256 (FIPS 180-4)::

    "checksums": {"parts/synthetic/train.arrow": {"bytes": 645386, "sha256": "9f2c..."}, ...}

(:func:`file_checksums`, called by :func:`dlrmctl.data.columnar.write_meta`).  Every reader of
the shards (:class:`~dlrmctl.data.columnar.SplitData`: training, evaluation, ``--resume``) and the
data fingerprint check (:func:`dlrmctl.data.fingerprint.check_run_data`: ``evaluate``,
``train --resume``) verify each file it opens against them (:func:`verify_file`): a size
mismatch at once, else the SHA-256 of the bytes, once per process per file version (path, size,
mtime, inode; about 1 s per GB on one core).  A dataset made before checksums has none and is
read as before.

:func:`check_meta_paths` refuses a meta.json whose file names leave the dataset directory (an
absolute path, ``..``), so an edited meta.json never makes dlrmctl read or trust another file.

Torch-free.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path, PurePosixPath
from typing import Any, Iterable

#: meta.json key of the per-file checksums
CHECKSUMS_KEY = "checksums"

#: (path, size, mtime_ns, inode) -> sha256 of the file versions this process already verified
_verified: dict[tuple[str, int, int, int], str] = {}


def sha256_file(path: str | os.PathLike) -> str:
    """The SHA-256 (hex) of a file's bytes, read in 4 MiB chunks.

    Raises:
        OSError: the file cannot be read.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def meta_files(meta: dict) -> list[str]:
    """Every file (relative to the dataset) that meta.json names: the splits' shards, then the
    vocabulary files."""
    out: list[str] = []
    for info in (meta.get("splits") or {}).values():
        out += [f for f in ((info or {}).get("files") or []) if isinstance(f, str)]
    out += [f for f in (meta.get("vocab_files") or {}).values() if isinstance(f, str)]
    return list(dict.fromkeys(out))


def file_checksums(data_dir: str | os.PathLike, files: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``{relative path: {"bytes", "sha256"}}`` of ``files`` under ``data_dir`` (those that exist).

    Raises:
        OSError: a file cannot be read.
    """
    out = {}
    for rel in files:
        p = Path(data_dir) / rel
        if p.is_file():
            out[rel] = {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
            _remember(p, out[rel]["sha256"])
    return out


def _key(p: Path) -> tuple[str, int, int, int]:
    st = p.stat()
    return (os.path.realpath(p), st.st_size, st.st_mtime_ns, st.st_ino)


def _remember(p: Path, digest: str) -> None:
    try:
        _verified[_key(p)] = digest
    except OSError:
        pass


def verify_file(data_dir: str | os.PathLike, rel: str, expected: Any, error: type[Exception]) -> None:
    """Check ``data_dir/rel`` against its recorded ``{"bytes", "sha256"}`` (``expected``; None:
    nothing recorded, nothing checked).  Hashed once per process per file version.

    Raises:
        error: (the caller's one-line error class, called with the message) the size or the
            SHA-256 differs, naming the file, both values and the remedy.
    """
    if not isinstance(expected, dict):
        return
    p = Path(data_dir) / rel
    try:
        key = _key(p)
    except OSError as e:
        raise error(f"{p}: cannot be read ({e.strerror}); meta.json records it: re-run preprocessing") from None
    if "bytes" in expected and key[1] != expected["bytes"]:
        raise error(f"{p}: {key[1]:,} bytes, but meta.json records {int(expected['bytes']):,} (the file changed "
                    "after preprocessing: damaged, truncated or edited); re-run preprocessing")
    got = _verified.get(key)
    if got is None:
        got = sha256_file(p)
    if got != expected.get("sha256"):
        raise error(f"{p}: SHA-256 {got[:16]}... differs from the {str(expected.get('sha256'))[:16]}... meta.json "
                    "records (the file changed after preprocessing: damaged or edited); re-run preprocessing")
    _verified[key] = got


def verify_files(data_dir: str | os.PathLike, meta: dict, files: Iterable[str] | None, error: type[Exception]) -> None:
    """:func:`verify_file` for each of ``files`` (None: every file meta.json names) that meta.json
    has a checksum for."""
    sums = meta.get(CHECKSUMS_KEY) or {}
    if not isinstance(sums, dict):
        return
    for rel in meta_files(meta) if files is None else files:
        verify_file(data_dir, rel, sums.get(rel), error)


def check_meta_paths(meta: dict) -> str | None:
    """Why meta.json's file names are not acceptable (None when they are): each is a relative
    path inside the dataset (no absolute path, no ``..``, no empty name); the splits are an
    object of ``{"rows": int >= 0, "files": [str, ...]}``."""
    splits = meta.get("splits")
    if not isinstance(splits, dict):
        return "'splits' must be an object of split name -> {rows, files}"
    for name, info in splits.items():
        if not isinstance(info, dict) or not isinstance(info.get("files"), list):
            return f"splits.{name} must be an object with a 'files' list"
        rows = info.get("rows")
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
            return f"splits.{name}.rows must be an integer >= 0, got {rows!r}"
    vocab = meta.get("vocab_files")
    if vocab is not None and not isinstance(vocab, dict):
        return "'vocab_files' must be an object of feature -> file"
    for info_files, where in [(v["files"], f"splits.{k}.files") for k, v in splits.items()] + \
                             [(list((vocab or {}).values()), "vocab_files")]:
        for f in info_files:
            if not isinstance(f, str) or not f or f.startswith(("/", "\\")) or ".." in PurePosixPath(f).parts \
                    or os.path.isabs(f):
                return f"{where}: {f!r} is not a path inside the dataset directory (relative, without '..')"
    sums = meta.get(CHECKSUMS_KEY)
    if sums is not None and not (isinstance(sums, dict) and all(
            isinstance(v, dict) and isinstance(v.get("sha256"), str) and isinstance(v.get("bytes"), int)
            for v in sums.values())):
        return f"'{CHECKSUMS_KEY}' must map each file to {{\"bytes\": int, \"sha256\": str}}"
    return None


def record_checksums(data_dir: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """Record anew in ``data_dir/meta.json`` the checksums of the files it names, as they are now
    (after a deliberate edit of a shard: a test's planted bad value, a hand-repaired file).
    Returns them.

    Raises:
        DataError: meta.json is missing or invalid; OSError: a file cannot be read or meta.json written.
    """
    from dlrmctl.data.columnar import read_meta, write_json_atomic

    meta = read_meta(data_dir)
    meta[CHECKSUMS_KEY] = file_checksums(data_dir, meta_files(meta))
    write_json_atomic(Path(data_dir) / "meta.json", meta)
    return meta[CHECKSUMS_KEY]
