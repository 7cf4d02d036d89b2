"""The launcher, run inside a Python session (paratrain.train(nproc=2) from a notebook):
the session is left as it was."""

from __future__ import annotations

import os
import signal
import time

import pytest

from paratrain.distributed.launch import launch


def test_a_launch_leaves_the_sessions_signal_handlers_and_environment_as_they_were():
    """torch's launcher installs handlers for SIGTERM, SIGINT, SIGHUP and SIGQUIT and
    leaves them; after a launch here Ctrl-C is still a KeyboardInterrupt, and the
    workers' thread count is not left behind for the session's later runs."""
    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    before = {sig: signal.getsignal(sig) for sig in signals}
    omp = os.environ.pop("OMP_NUM_THREADS", None)
    try:
        assert launch(2, ["--version"]) == 0
        assert {sig: signal.getsignal(sig) for sig in signals} == before
        assert "OMP_NUM_THREADS" not in os.environ
    finally:
        if omp is not None:
            os.environ["OMP_NUM_THREADS"] = omp
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)  # delivered before it ends
