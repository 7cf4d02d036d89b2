"""`python -m paratrain <args>` for the tests, forked from one waiting interpreter that has
already imported what every run imports (torch, torchvision, paratrain's engine): the
5 s of imports that each run of the command otherwise starts with, on 2 cores.

The forked child becomes the command as a new interpreter would run it: the caller's
working folder and environment, ``sys.argv``, a process title that is the command line
(``pgrep -af`` finds it, and its workers, by their flags), standard input from
/dev/null, standard output and error to pipes the caller reads until every process
holding them has ended (as ``Popen.communicate`` does). Its clock starts at the fork:
the seconds a run tells leave the imports out. The waiting interpreter is made in each
test process the first time it is needed, touches no tensor (a fork must find no
thread pool: paratrain's own launcher forks its workers on the same rule), and ends
when that process does. ``PARATRAIN_TEST_FRESH=1`` starts every run as a new
interpreter instead.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

FRESH = "PARATRAIN_TEST_FRESH"


def command(
    args: list[str], cwd: Path, env: dict[str, str], timeout: float
) -> tuple[subprocess.CompletedProcess, bool]:
    """Run the command to its end (the last process holding its output gone), or until
    ``timeout``, when its processes print their stacks to its standard error (a hang
    shows where it stood) and it is killed with every process below it. Returns (the
    finished process, whether it timed out)."""
    argv = [sys.executable, "-m", "paratrain", *args]
    if os.environ.get(FRESH) == "1":
        return _fresh(argv, cwd, env, timeout)
    waiting = _waiting()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    request = {"args": list(args), "cwd": str(cwd), "env": env}
    socket.send_fds(waiting, [json.dumps(request).encode()], [out_w, err_w])
    os.close(out_w)
    os.close(err_w)
    pid = _reply(waiting)["pid"]
    (stdout, stderr), timed_out = _read(out_r, err_r, time.monotonic() + timeout, pid)
    code = _reply(waiting)["code"]
    return subprocess.CompletedProcess(argv, code, stdout, stderr), timed_out


def _fresh(argv, cwd, env, timeout) -> tuple[subprocess.CompletedProcess, bool]:
    process = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        kill_tree(process.pid)
        stdout, stderr = process.communicate()
        timed_out = True
    return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr), timed_out


def _read(out_r: int, err_r: int, deadline: float, pid: int) -> tuple[list[str], bool]:
    """Both pipes read to their end; past ``deadline`` the child's tree prints its stacks
    (``ask_stacks``) and is killed, and reading ends 30 s after that at the latest."""
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    open_ = [out_r, err_r]
    timed_out = killed = False
    while open_:
        left = deadline - time.monotonic()
        if left <= 0 and not timed_out:  # what every process is doing, then the kill
            timed_out, deadline = True, time.monotonic() + (STACKS_S if ask_stacks(pid) else 0)
            continue
        if left <= 0 and not killed:
            kill_tree(pid)
            killed, deadline = True, time.monotonic() + 30
            continue
        if left <= 0:  # killed, and something it started still holds a pipe
            break
        ready, _, _ = select.select(open_, [], [], max(left, 0.0))
        for fd in ready:
            data = os.read(fd, 1 << 16)
            if data:
                chunks[fd].append(data)
            else:
                open_.remove(fd)
                os.close(fd)
    for fd in open_:
        os.close(fd)
    text = [b"".join(chunks[fd]).decode(errors="replace") for fd in (out_r, err_r)]
    return text, timed_out


STACKS = signal.SIGUSR2  # a forked run prints every thread's stack on it (_become)
STACKS_S = 3.0  # how long the stacks are read before the kill


def ask_stacks(pid: int) -> bool:
    """Send ``STACKS`` to ``pid`` and every process below it that catches it (the run's
    launcher, its forked workers and their loader workers inherit faulthandler's handler;
    a process started afresh would be ended by it, and is left to the kill): whether any
    was asked."""
    asked = False
    for each in [pid, *_descendants(pid)]:
        if _catches(each, STACKS):
            with contextlib.suppress(ProcessLookupError):
                os.kill(each, STACKS)
                asked = True
    return asked


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (SigCgt of /proc/PID/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(
        (line.split()[1] for line in status.splitlines() if line.startswith("SigCgt")), "0"
    )
    return bool(int(caught, 16) >> (sig - 1) & 1)


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it (torchrun's workers are in sessions of
    their own, so a process group would miss them)."""
    for each in [*_descendants(pid), pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(each, signal.SIGKILL)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``, deepest first."""
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    children = [int(child) for child in found.split()]
    return [below for child in children for below in [*_descendants(child), child]]


def _reply(waiting: socket.socket) -> dict:
    message = waiting.recv(1 << 16)
    if not message:
        raise RuntimeError("the interpreter that forks the test's runs has ended")
    return json.loads(message)


_WAITING: socket.socket | None = None


def _waiting() -> socket.socket:
    """This process's waiting interpreter (started the first time): the socket to it."""
    global _WAITING
    if _WAITING is None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        here = str(Path(__file__).parent)
        subprocess.Popen(
            [sys.executable, "-c", f"import zygote; zygote.serve({theirs.fileno()})"],
            pass_fds=[theirs.fileno()],
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])),
                "PYTHONUNBUFFERED": "1",
            },  # fmt: skip
            stdin=subprocess.DEVNULL,
            cwd=here,  # not a test's folder, removed while it waits
        )
        theirs.close()
        _WAITING = ours
    return _WAITING


def serve(fd: int) -> None:
    """The waiting interpreter: import, then fork one child a request, tell its pid, wait
    for it and tell its exit code; end when the tests' process closes its side."""
    import paratrain.api
    import paratrain.cli  # noqa: F401

    paratrain.api._worker_imports()
    tests = socket.socket(fileno=fd)
    while True:
        message, fds, _, _ = socket.recv_fds(tests, 1 << 20, 2)
        if not message:
            return
        pid = os.fork()
        if pid == 0:
            tests.close()
            _become(json.loads(message), fds)
        for each in fds:
            os.close(each)
        tests.send(json.dumps({"pid": pid}).encode())
        status = os.waitpid(pid, 0)[1]
        tests.send(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode())


def _become(request: dict, fds: list[int]) -> None:
    """In the forked child: become `python -m paratrain <args>`, and end with its code."""
    try:
        import tempfile

        from setproctitle import setproctitle

        import paratrain

        null = os.open(os.devnull, os.O_RDONLY)
        for target, source in zip((0, 1, 2), (null, *fds), strict=True):
            os.dup2(source, target)
            os.close(source)
        # the title before the environment: setproctitle finds the room it writes in
        # (the process's first arguments, and the environment after them) by environ
        setproctitle(" ".join([sys.executable, "-m", "paratrain", *request["args"]]))
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # found again from this environment's TMPDIR
        # a run that outlives its test's timeout shows where each process stood (ask_stacks)
        faulthandler.register(STACKS, all_threads=True)
        sys.argv = [str(Path(paratrain.__file__).parent / "__main__.py"), *request["args"]]
        from paratrain.cli import run

        run()  # ends the process with the command's exit code
    finally:
        os._exit(70)
