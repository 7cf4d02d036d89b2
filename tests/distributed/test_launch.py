"""The launcher, run inside a Python session (paratrain.train(nproc=2) from a notebook):
the session is left as it was."""

from __future__ import annotations

import os
import signal
import time

import pytest

from paratrain.distributed.launch import launch


def test_a_launch_leaves_the_sessions_signal_handlers_and_environment_as_they_were():
    """torch's launcher installs handlers for SIGTERM, SIGINT, SIGHUP, SIGQUIT (and
    SIGUSR1, which paratrain has it handle) and leaves them; after a launch here Ctrl-C is still a KeyboardInterrupt, and the
    workers' thread count is not left behind for the session's later runs."""
    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)
    # a session as a notebook's or a terminal's is: Ctrl-C raises KeyboardInterrupt (a
    # pytest-xdist worker ignores SIGINT, so the test sets it, and puts its own back)
    worker = signal.signal(signal.SIGINT, signal.default_int_handler)
    before = {sig: signal.getsignal(sig) for sig in signals}
    omp = os.environ.pop("OMP_NUM_THREADS", None)
    try:
        assert launch(2, ["--version"]) == 0
        assert {sig: signal.getsignal(sig) for sig in signals} == before
        assert "OMP_NUM_THREADS" not in os.environ
        assert "TORCHELASTIC_SIGNALS_TO_HANDLE" not in os.environ
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # delivered before it ends
    finally:
        signal.signal(signal.SIGINT, worker)
        if omp is not None:
            os.environ["OMP_NUM_THREADS"] = omp


def test_the_readme_lists_the_preemption_signals_the_launcher_and_the_ranks_handle():
    """Every signal a rank takes as preemption is one the launcher handles and passes
    on (SIGUSR1 used to end the launcher at once), and the docs say which."""
    import re
    from pathlib import Path

    from paratrain.distributed.launch import LAUNCHER_SIGNALS
    from paratrain.engine.run.preempt import SIGNALS

    names = [signal.Signals(sig).name for sig in SIGNALS]
    assert set(names) <= set(LAUNCHER_SIGNALS)
    readme = (Path(__file__).parents[2] / "docs" / "failures.md").read_text()
    line = re.search(r"\* \*\*Preemption\*\*: (.*?) saves a checkpoint", readme)
    assert line is not None and re.findall(r"SIG[A-Z0-9]+", line.group(1)) == names
