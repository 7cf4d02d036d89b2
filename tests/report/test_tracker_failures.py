"""A tracker that cannot be reached, or that dies during the run: one line before the
launch (or a warning and a run without it), never a hang, never a stopped run.

The server here is a few lines of MLflow's REST API (the calls its client makes for
paratrain: the experiment by name, a run created, metrics logged in batches, the run
ended), started and stopped by the test on this machine's loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from imagefolders import make_image_folder

pytestmark = pytest.mark.slow
FAST = ["--model", "resnet18", "--image-size", "16", "--batch-size", "4", "--workers", "0"]


class _FakeMlflow(BaseHTTPRequestHandler):
    """MLflow's tracking API, enough for one run; counts the metric batches it took."""

    batches = 0
    artifacts = ""

    def _answer(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _run(self) -> dict:
        info = {
            "run_id": "r1",
            "run_uuid": "r1",
            "experiment_id": "1",
            "status": "RUNNING",
            "start_time": int(time.time() * 1000),
            "lifecycle_stage": "active",
            "artifact_uri": _FakeMlflow.artifacts,
        }
        return {"run": {"info": info, "data": {}}}

    def do_GET(self):  # noqa: N802 (the handler's own name)
        if "experiments/get-by-name" in self.path:
            experiment = {"experiment_id": "1", "name": "paratrain", "lifecycle_stage": "active"}
            self._answer({"experiment": experiment})
        else:
            self._answer({})

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path.endswith("runs/create"):
            self._answer(self._run())
        elif self.path.endswith("runs/update"):
            self._answer({"run_info": self._run()["run"]["info"]})
        else:
            if self.path.endswith("runs/log-batch"):
                _FakeMlflow.batches += 1
            self._answer({})

    def log_message(self, *args):
        pass


def _train(data: Path, out: Path, env: dict, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "paratrain", "train", "--data", str(data), *FAST]
    command += ["--output-dir", str(out), "--name", "t", "--logger", "mlflow", *extra]
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=300, cwd=out.parent
    )


def _env(uri: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    return {**env, "MLFLOW_TRACKING_URI": uri, "no_proxy": "127.0.0.1,localhost"}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("data") / "d", classes=3, per_class=10)


def test_a_server_that_dies_mid_run_never_stops_training(data, tmp_path):
    """The server takes the settings and the first metric batches, then goes away: the
    run says so once, trains to the end and keeps every epoch in metrics.jsonl."""
    _FakeMlflow.batches, _FakeMlflow.artifacts = 0, (tmp_path / "artifacts").as_uri()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeMlflow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    uri = f"http://127.0.0.1:{server.server_address[1]}"
    settings_batches = 0

    def stop_after_first_metrics():
        nonlocal settings_batches
        while _FakeMlflow.batches == 0:
            time.sleep(0.01)
        settings_batches = _FakeMlflow.batches
        while _FakeMlflow.batches < settings_batches + 2:  # two batches of metrics
            time.sleep(0.01)
        server.shutdown()
        server.server_close()

    killer = threading.Thread(target=stop_after_first_metrics, daemon=True)
    killer.start()
    try:
        done = _train(data, tmp_path / "runs", _env(uri), "--epochs", "3")
    finally:
        killer.join(timeout=5)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not killer.is_alive()  # the server did die during the run
    told = [line for line in done.stdout.splitlines() if "--logger mlflow failed" in line]
    assert len(told) == 1, done.stdout  # said once
    assert "training goes on without it" in told[0] and "Traceback" not in done.stderr
    epochs = (tmp_path / "runs/t/metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in epochs] == [1, 2, 3]


def test_an_unreachable_server_is_one_line_before_the_launch(data, tmp_path):
    """Nothing listens: one line naming the server and the choice, exit 2, at once."""
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started = time.monotonic()
    refused = _train(data, tmp_path / "runs", _env(f"http://127.0.0.1:{port}"), "--nproc", "2")
    assert refused.returncode == 2
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, refused.stderr
    assert f"--logger mlflow: http://127.0.0.1:{port}/health" in lines[0]
    assert "--on-tracker-error warn" in lines[0]
    assert time.monotonic() - started < 60  # not MLflow's minutes of retries
    assert not (tmp_path / "runs" / "t").exists()


def test_a_server_that_never_answers_is_waited_for_tracker_timeout_only(data, tmp_path):
    """A server that takes the connection and says nothing: --tracker-timeout bounds the
    wait; with --on-tracker-error warn the run trains without the tracker."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepted by the kernel, never answered
    uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
    try:
        started = time.monotonic()
        warned = _train(
            data, tmp_path / "runs", _env(uri), "--epochs", "1",
            "--tracker-timeout", "1", "--on-tracker-error", "warn",
        )  # fmt: skip
        took = time.monotonic() - started
    finally:
        silent.close()
    assert warned.returncode == 0, warned.stderr[-2000:]
    assert "--logger mlflow: " in warned.stdout + warned.stderr
    assert "training without it" in warned.stdout + warned.stderr
    assert (tmp_path / "runs/t/metrics.jsonl").read_text().count("\n") == 1
    assert took < 60


def test_a_file_uri_the_user_gives_is_honoured(data, tmp_path):
    """MLflow 3 refuses a file store unless MLFLOW_ALLOW_FILE_STORE is set; a file: URI
    given on purpose is written, not a traceback."""
    store = tmp_path / "store"
    done = _train(data, tmp_path / "runs", _env(store.as_uri()), "--epochs", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert any(store.rglob("meta.yaml"))  # the experiment and its run, in the store
