"""--strategy dp: DataParallel on CUDA, a clear error elsewhere."""

from __future__ import annotations

import pytest
import torch

from paratrain.cli import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only message")
def test_dp_on_cpu_is_one_clear_error(image_folder, tmp_path, capsys):
    runs = tmp_path / "runs"
    code = main(
        ["train", "--data", str(image_folder), "--strategy", "dp", "--output-dir", str(runs)]
    )
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--strategy dp needs CUDA devices" in err[0]
    assert "--nproc N" in err[0]
    assert not runs.exists()  # refused before any run directory is made


def test_dp_with_nproc_is_refused(image_folder, capsys):
    assert main(["train", "--data", str(image_folder), "--strategy", "dp", "--nproc", "2"]) == 2
    assert "it drives every GPU from one process" in capsys.readouterr().err
