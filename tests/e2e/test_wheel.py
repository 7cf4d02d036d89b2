"""The package as a user installs it: a wheel built from this checkout, installed into a
fresh virtual environment, runs `paratrain --version` and the embedded digits' dry run,
and ships its data (the recipes, the digits).

The environment is new and sees none of this checkout: its own site-packages hold the
wheel, and a path file lends it the installed dependencies (torch is 5 GB) without
running their folder's own path files, so the editable install of this checkout stays
out of sight (checked: paratrain is imported from the environment)."""

from __future__ import annotations

import site
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

import paratrain

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _run(*command, cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
    return done


def test_the_wheel_installs_into_a_fresh_environment_and_runs(tmp_path):
    dist = tmp_path / "dist"
    _run(
        sys.executable, "-m", "build", "--wheel", "--no-isolation",
        "--outdir", str(dist), str(ROOT), cwd=tmp_path,
    )  # fmt: skip
    [wheel] = dist.glob("paratrain-*.whl")
    assert wheel.name.startswith(f"paratrain-{paratrain.__version__}-")
    with zipfile.ZipFile(wheel) as packed:
        names = set(packed.namelist())
    assert {"paratrain/data/digits.npz", "paratrain/recipes/fine-tune.yaml"} <= names
    env = tmp_path / "env"
    venv.EnvBuilder(with_pip=True).create(env)
    python = env / "bin" / "python"
    purelib = Path(
        _run(
            python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
            cwd=tmp_path,
        ).stdout.strip()
    )  # fmt: skip
    lent = {sysconfig.get_paths()["purelib"], *site.getsitepackages()}
    (purelib / "lent-dependencies.pth").write_text("".join(f"{p}\n" for p in sorted(lent)))
    _run(python, "-m", "pip", "install", "--no-deps", "--no-index", str(wheel), cwd=tmp_path)
    where = _run(python, "-c", "import paratrain; print(paratrain.__file__)", cwd=tmp_path)
    assert Path(where.stdout.strip()).is_relative_to(env)  # the wheel's, not the checkout's
    version = _run(env / "bin" / "paratrain", "--version", cwd=tmp_path)
    assert paratrain.__version__ in version.stdout
    dry = _run(
        env / "bin" / "paratrain", "train", "--dry-run", "--cache-dir", str(tmp_path / "c"),
        cwd=tmp_path,
    )  # fmt: skip
    assert "the embedded digits set" in dry.stdout
    shipped = _run(env / "bin" / "paratrain", "recipes", cwd=tmp_path)
    assert "fine-tune: " in shipped.stdout
