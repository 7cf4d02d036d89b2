"""The decoded-image cache survives what sweeps and clusters do to it: a damaged cache is
found by its manifest and rebuilt, runs started together build once, a folder that
cannot be written is said in one line (or the run decodes instead), and there must be
room for it first."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import multiprocessing
import shutil
import zlib
from unittest import mock

import pytest

from imagefolders import make_image_folder
from paratrain.data.cache import verify as cache_module
from paratrain.data.cache.base import MANIFEST
from paratrain.data.cache.build import prepare
from paratrain.data.cache.read import agree_intact
from paratrain.data.folder import build_split
from paratrain.errors import AgreedUserError, UserError
from paratrain.log import get_logger


@pytest.fixture
def samples(tmp_path):
    split = build_split(make_image_folder(tmp_path / "data", classes=2, per_class=6))
    return split.train + split.val


@contextlib.contextmanager
def _said():
    """What paratrain's logger says meanwhile."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger, handler = get_logger(), Keep()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _digest(cache) -> str:
    digest = hashlib.sha256()
    for part in cache.parts:
        digest.update((cache.directory / part).read_bytes())
    return digest.hexdigest()


@pytest.mark.parametrize("damage", ["truncated", "emptied", "no manifest"])
def test_a_damaged_cache_is_rebuilt_and_the_run_says_why(samples, tmp_path, damage):
    root = str(tmp_path / "cache")
    first = prepare(samples, 24, "on", 1.0, root, workers=0)
    good = _digest(first)
    data = first.directory / "data.u8"
    if damage == "truncated":
        data.write_bytes(data.read_bytes()[:100])
    elif damage == "emptied":
        data.write_bytes(b"")
    else:
        (first.directory / MANIFEST).unlink()
    with _said() as lines:
        again = prepare(samples, 24, "on", 1.0, root, workers=0)
    assert _digest(again) == good
    assert any("building it again" in line for line in lines), lines


@pytest.mark.parametrize("kind", ["raw", "packed"])
def test_garbled_blocks_are_found_while_training_runs_and_named(samples, tmp_path, kind):
    """A ready cache is opened without reading its data; the background check then
    finds the garbled block, the run stops naming it, and the next start rebuilds."""
    root = str(tmp_path / "cache")
    first = prepare(samples, 24, kind, 1.0, root, workers=0)
    assert first.damage(wait=True) is None  # a whole cache passes
    agree_intact(first, wait=True)
    good = _digest(first)
    data = first.directory / first.parts[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    sums = []
    real = zlib.crc32
    with mock.patch.object(cache_module.zlib, "crc32", lambda b, *a: sums.append(1) or real(b, *a)):
        opened = prepare(samples, 24, kind, 1.0, root, workers=0, check=False)
    assert opened is not None and sums == []  # started without a checksum
    opened.start_check()
    assert f"block 0 of {first.parts[0]}" in opened.damage(wait=True)
    with pytest.raises(AgreedUserError, match="cache is damaged: .*block 0 of .*differs"):
        agree_intact(opened, wait=True)
    assert not (opened.directory / MANIFEST).exists()  # so the next start builds it again
    again = prepare(samples, 24, kind, 1.0, root, workers=0)
    assert _digest(again) == good


def _build_at_once(root: str, paths: list, start, out, flock: bool) -> None:
    samples = [(p, label) for p, label in paths]
    if not flock:  # a file system without flock (some NFS, Lustre): a lock file instead
        mock.patch.object(fcntl, "flock", _no_flock).start()
    start.wait()
    with _said() as lines:
        cache = prepare(samples, 24, "on", 1.0, root, workers=0)
    out.put((_digest(cache), any("waiting for it" in line for line in lines)))


def _no_flock(*args):
    raise OSError(errno.ENOSYS, "Function not implemented")


@pytest.mark.parametrize("flock", [True, False], ids=["flock", "lock-file"])
def test_runs_started_together_build_once_and_read_the_same_bytes(samples, tmp_path, flock):
    context = multiprocessing.get_context("fork")
    start, out = context.Barrier(2), context.Queue()
    root = str(tmp_path / "cache")
    procs = [
        context.Process(target=_build_at_once, args=(root, samples, start, out, flock))
        for _ in range(2)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
    assert [proc.exitcode for proc in procs] == [0, 0]
    results = [out.get(timeout=5) for _ in procs]
    assert results[0][0] == results[1][0]  # identical bytes
    built = list((tmp_path / "cache" / "decoded").glob("*/" + MANIFEST))
    assert len(built) == 1 and not list((tmp_path / "cache" / "decoded").glob(".*tmp*"))
    # an flock keeps its (empty) file for the next; a lock file goes when let go
    assert len(list((tmp_path / "cache" / "decoded").glob("*.lock"))) == (1 if flock else 0)


def test_a_cache_folder_that_cannot_be_written(samples):
    root = "/proc/paratrain-cannot-write-here"
    with _said() as lines:
        assert prepare(samples, 24, "auto", 1.0, root, workers=0) is None  # decodes instead
    assert any("cannot write to" in line and "decoding every epoch" in line for line in lines)
    with pytest.raises(UserError, match="--cache on: cannot write to /proc"):
        prepare(samples, 24, "on", 1.0, root, workers=0)


def test_free_space_is_checked_before_writing(samples, tmp_path, monkeypatch):
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    root = str(tmp_path / "cache")
    with pytest.raises(UserError, match="needs .* GB and .* has 0.00 GB free"):
        prepare(samples, 24, "on", 1.0, root, workers=0)
    with _said() as lines:
        assert prepare(samples, 24, "auto", 1.0, root, workers=0) is None
    assert any("GB free" in line for line in lines)


def test_builds_left_by_dead_processes_are_removed_and_live_ones_kept(samples, tmp_path):
    import os
    import socket
    import subprocess

    root = str(tmp_path / "cache")
    base = tmp_path / "cache" / "decoded"
    base.mkdir(parents=True)
    dead = subprocess.Popen(["true"])  # its pid is free once it has ended
    dead.wait()
    host = socket.gethostname()
    stale = base / f".abc.tmp-{host}-{dead.pid}"
    live = base / f".def.tmp-{host}-{os.getpid()}"
    elsewhere = base / f".ghi.tmp-otherhost-{dead.pid}"
    for folder in (stale, live, elsewhere):
        folder.mkdir()
        (folder / "data.bin").write_bytes(b"x" * 1000)
    assert prepare(samples, 24, "on", 1.0, root, workers=0) is not None
    assert not stale.exists() and live.exists() and elsewhere.exists()
