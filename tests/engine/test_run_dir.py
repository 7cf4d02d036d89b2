"""The locks that say who writes a run folder or builds a cache (files.try_lock): an
flock where the file system has one, a lock file where it has not (some NFS and Lustre
mounts); either way a second process is refused without waiting, and a holder that is
killed lets go."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from paratrain.engine.checkpointing import run_dir
from paratrain.errors import UserError

HOLD = textwrap.dedent(
    """
    import errno, fcntl, sys, time, warnings
    if sys.argv[2] == "lock-file":
        def no_flock(*args):
            raise OSError(errno.ENOSYS, "Function not implemented")
        fcntl.flock = no_flock
    warnings.simplefilter("ignore")
    from paratrain.engine.checkpointing.run_dir import hold
    hold(__import__("pathlib").Path(sys.argv[1]))
    print("held", flush=True)
    time.sleep(60)
    """
)


@pytest.fixture(params=["flock", "lock-file"])
def kind(request, monkeypatch):
    if request.param == "lock-file":
        import errno
        import fcntl

        def no_flock(*args):
            raise OSError(errno.ENOSYS, "Function not implemented")

        monkeypatch.setattr(fcntl, "flock", no_flock)
    yield request.param
    run_dir.release_all()


@pytest.mark.filterwarnings("ignore:flock not supported:UserWarning")  # filelock says so
def test_a_held_run_folder_is_refused_and_a_killed_holder_lets_go(tmp_path, kind):
    folder = tmp_path / "runs" / "r"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder), kind], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match="is in use by a run still going") as refused:
            run_dir.hold(folder)
        if kind == "flock":  # the holder named in its lock file
            assert f"pid {holder.pid}" in str(refused.value)
        else:  # the lock file is filelock's record of its holder: the pid is in it
            assert str(holder.pid) in (folder / run_dir.LOCK).read_text()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    deadline = time.monotonic() + 10
    while True:  # a lock file's dead holder is recovered from; an flock is gone at once
        try:
            run_dir.hold(folder)
            break
        except UserError:
            assert time.monotonic() < deadline, "a killed holder kept the run folder"
            time.sleep(0.2)
    assert folder.resolve() in run_dir._held
