"""Weights by name, offline: files placed where torchvision's and timm's names resolve
(a torch hub cache, a Hugging Face cache laid out as huggingface_hub lays it out), the
preprocessing they bring, one fetch per machine, and the one-line offline message."""

from __future__ import annotations

import hashlib
import http.server
import multiprocessing
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torchvision
from safetensors.torch import save_file

from paratrain.config import resolve_train
from paratrain.data.loaders import validation_loader
from paratrain.data.transforms import Augment, TrainAugment
from paratrain.errors import UserError
from paratrain.log import setup_logging
from paratrain.models import pretrained
from paratrain.models.registry import build_model


def _hub_file(monkeypatch, tmp_path: Path, model: str = "resnet18", seed: int = 1) -> Path:
    """A weights file where torchvision's DEFAULT weights of ``model`` resolve to, in a
    torch hub cache of this test's own."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    # a stand-in under torchvision's own file name, whose hash prefix no stand-in can
    # have: the name's check is left out here (test_a_damaged_cached_file_is_refused...)
    monkeypatch.setattr(pretrained, "_hash_prefix", lambda file: None)
    url = torchvision.models.get_model_weights(model).DEFAULT.url
    file = tmp_path / "torch" / "hub" / "checkpoints" / os.path.basename(url)
    file.parent.mkdir(parents=True)
    torch.manual_seed(seed)
    torch.save(torchvision.models.get_model(model, num_classes=1000).state_dict(), file)
    return file


@pytest.mark.parametrize(
    "name", ["DEFAULT", "IMAGENET1K_V1", "ResNet18_Weights.IMAGENET1K_V1", "pretrained"]
)
def test_a_torchvision_name_loads_the_file_torch_hub_keeps_and_replaces_the_head(
    name, monkeypatch, tmp_path, capsys
):
    file = _hub_file(monkeypatch, tmp_path)
    source = torch.load(file, weights_only=True)
    cfg = resolve_train({"model": "resnet18", "weights": name, "image_size": 32})
    setup_logging()  # to this test's stdout
    model = build_model(cfg, num_classes=5)
    assert torch.equal(model.conv1.weight, source["conv1.weight"])
    assert torch.equal(model.layer4[1].bn2.running_var, source["layer4.1.bn2.running_var"])
    assert model.fc.out_features == 5  # the new head, sized to the data
    assert not torch.equal(model.fc.weight[:5], source["fc.weight"][:5])
    told = capsys.readouterr().out
    assert "weights ResNet18_Weights.IMAGENET1K_V1: loaded 120 tensors, skipped 2" in told
    assert "new head `fc` with 5 outputs" in told and "1000-output head left out" in told


def test_a_name_that_does_not_exist_lists_those_that_do():
    with pytest.raises(UserError) as wrong:
        resolve_train({"model": "resnet50", "weights": "IMAGENET1K_V3"})
    assert str(wrong.value) == (
        "--weights IMAGENET1K_V3: no such weights for resnet50; its names: IMAGENET1K_V1, "
        "IMAGENET1K_V2, DEFAULT (or a weights file)"
    )
    with pytest.raises(UserError, match="VGG16_Weights are not resnet50's weights"):
        pretrained.resolve("resnet50", "VGG16_Weights.IMAGENET1K_V1")
    with pytest.raises(UserError, match="its tags: pretrained, a1_in1k, a2_in1k"):
        pretrained.resolve("timm/resnet18", "in22k")


def test_the_preprocessing_follows_the_weights_unless_the_user_sets_it():
    v2 = resolve_train({"model": "resnet50", "weights": "IMAGENET1K_V2"})
    assert (v2.image_size, v2.eval_resize, v2.interpolation) == (224, 232, "bilinear")
    v1 = resolve_train({"model": "resnet50", "weights": "IMAGENET1K_V1"})
    assert v1.eval_resize == 256
    mine = resolve_train(
        {"model": "resnet50", "weights": "IMAGENET1K_V2", "image_size": 160, "mean": "0.5,0.5,0.5"}
    )
    assert (mine.image_size, mine.eval_resize) == (160, 166)  # the weights' 232/224 ratio
    assert mine.norm_mean == (0.5, 0.5, 0.5) and mine.norm_std == (0.229, 0.224, 0.225)
    vit = resolve_train(
        {"model": "timm/vit_tiny_patch16_224", "weights": "augreg_in21k_ft_in1k"}
    )  # timm's pretrained_cfg: mean and std 0.5, bicubic, crop_pct 0.9
    assert (vit.norm_mean, vit.norm_std) == ((0.5,) * 3, (0.5,) * 3)
    assert (vit.interpolation, vit.image_size, vit.eval_resize) == ("bicubic", 224, 248)
    plain = resolve_train(
        {"model": "resnet50", "data": "d"}
    )  # no weights: ImageNet's, bilinear, 256/224
    assert (plain.norm_mean, plain.interpolation, plain.eval_resize) == (
        (0.485, 0.456, 0.406),
        "bilinear",
        256,
    )


def test_the_transforms_normalise_with_the_weights_statistics(image_folder):
    cfg = resolve_train(
        {
            "data": str(image_folder),
            "model": "timm/vit_tiny_patch16_224",
            "weights": "pretrained",
            "image_size": 32,
            "cache": "off",
        }
    )
    augment = TrainAugment(Augment.of(cfg))
    assert torch.allclose(augment.mean.flatten(), torch.tensor([127.5] * 3))
    white = torch.full((3, 40, 40), 255, dtype=torch.uint8)
    assert torch.allclose(augment(white), torch.ones(3, 32, 32))  # (1 - 0.5) / 0.5
    samples = [(str(p), 0) for p in sorted(image_folder.rglob("*.jpg"))[:2]]
    loader = validation_loader(samples, cfg, 2, 0, 0, 1)
    normalize = loader.dataset.transform.transforms[-1]
    assert (normalize.mean, normalize.std) == ([0.5] * 3, [0.5] * 3)
    assert loader.dataset.transform.transforms[0].interpolation.value == "bicubic"


def _hf_cache(root: Path, repo: str, state: dict[str, torch.Tensor]) -> Path:
    """A Hugging Face hub cache holding ``repo``'s model.safetensors, as huggingface_hub
    lays it out: refs/main names the snapshot, the snapshot links to the blob."""
    folder = root / "hub" / f"models--{repo.replace('/', '--')}"
    revision = "0123456789abcdef0123456789abcdef01234567"
    blobs, snapshot = folder / "blobs", folder / "snapshots" / revision
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    staging = blobs / "staging"
    save_file({k: v.contiguous() for k, v in state.items()}, str(staging))
    blob = blobs / hashlib.sha256(staging.read_bytes()).hexdigest()  # an LFS blob's name
    staging.rename(blob)
    (snapshot / "model.safetensors").symlink_to(os.path.relpath(blob, snapshot))
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(revision)
    return snapshot / "model.safetensors"


def test_timm_pretrained_loads_from_the_hugging_face_cache(monkeypatch, tmp_path, capsys):
    import timm

    torch.manual_seed(2)
    source = timm.create_model("resnet18", num_classes=1000).state_dict()
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    _hf_cache(tmp_path / "hf", "timm/resnet18.a1_in1k", source)
    cfg = resolve_train({"model": "timm/resnet18", "weights": "pretrained", "image_size": 32})
    assert cfg.interpolation == "bicubic" and cfg.eval_resize == 34  # crop_pct 0.95
    setup_logging()
    model = build_model(cfg, num_classes=3)
    assert torch.equal(model.conv1.weight, source["conv1.weight"])
    assert model.fc.out_features == 3
    assert "weights timm/resnet18.a1_in1k: loaded" in capsys.readouterr().out
    same = build_model(
        resolve_train({"model": "timm/resnet18", "weights": "timm/resnet18.a1_in1k"}), 3
    )
    assert torch.equal(same.conv1.weight, source["conv1.weight"])


def test_offline_without_the_file_is_one_line_naming_file_url_and_folder(
    monkeypatch, tmp_path, image_folder
):
    env = {**os.environ, "TORCH_HOME": str(tmp_path / "empty"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "paratrain", "train", "--data", str(image_folder)]
        + ["--weights", "DEFAULT", "--model", "resnet18", "--nproc", "2", "--epochs", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    file = tmp_path / "empty" / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    assert "https://download.pytorch.org/models/resnet18-f37072fd.pth" in lines[0]
    assert f"at {file} (folder {file.parent})" in lines[0]
    assert "HF_HUB_OFFLINE" in lines[0]
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-empty"))
    with pytest.raises(UserError) as absent:
        pretrained.resolve("timm/resnet18", "a1_in1k").fetch()
    text = str(absent.value)
    assert "\n" not in text
    assert "https://huggingface.co/timm/resnet18.a1_in1k/resolve/main/model.safetensors" in text
    assert str(tmp_path / "hf-empty" / "hub" / "models--timm--resnet18.a1_in1k") in text


def test_no_network_is_the_same_one_line_with_the_reason(monkeypatch, tmp_path):
    from urllib.error import URLError

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "t"))
    monkeypatch.delenv("HF_HUB_OFFLINE")

    def unreachable(*args, **kwargs):
        raise URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(torch.hub, "download_url_to_file", unreachable)
    with pytest.raises(UserError) as absent:
        pretrained.resolve("resnet18", "DEFAULT").fetch()
    assert "cannot be fetched ([Errno -3] Temporary failure in name resolution)" in str(
        absent.value
    )
    assert not (tmp_path / "t" / "hub" / "checkpoints" / "resnet18-f37072fd.pth").exists()


class _Counting(http.server.SimpleHTTPRequestHandler):
    served: list[str] = []

    def do_GET(self):  # noqa: N802 (the handler's own name)
        _Counting.served.append(self.path)
        super().do_GET()

    def log_message(self, *args):
        pass


def _fetch(named: pretrained.NamedWeights) -> str:
    return hashlib.sha256(named.fetch().read_bytes()).hexdigest()


def test_one_process_fetches_while_the_others_wait_then_read(monkeypatch, tmp_path):
    """Four processes ask for the same weights at once: the server sees one download,
    every process reads the same file, checked against its name's hash prefix."""
    served = tmp_path / "served"
    served.mkdir()
    body = torch.arange(200_000, dtype=torch.float32)
    staging = served / "staging.pth"
    torch.save({"w": body}, staging)
    digest = hashlib.sha256(staging.read_bytes()).hexdigest()
    name = f"tiny-{digest[:8]}.pth"
    staging.rename(served / name)
    handler = lambda *a, **k: _Counting(*a, directory=str(served), **k)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/{name}"
        named = pretrained.NamedWeights("tiny", url, file=tmp_path / "hub" / name)
        with multiprocessing.get_context("spawn").Pool(4) as pool:
            digests = pool.map(_fetch, [named] * 4)
        assert digests == [digest] * 4
        assert _Counting.served == [f"/{name}"]
        left = sorted(p.name for p in (tmp_path / "hub").iterdir())
        assert left == [name, name + ".lock"]  # no partial download left behind
        wrong = pretrained.NamedWeights(
            "wrong", url, file=tmp_path / "other" / f"tiny-{'0' * 8}.pth"
        )
        with pytest.raises(UserError, match="cannot be fetched"):
            wrong.fetch()  # the download's hash is not its name's: refused, nothing kept
        assert not wrong.file.exists()
    finally:
        server.shutdown()


def test_a_named_weights_value_is_not_taken_for_a_missing_file(tmp_path):
    from paratrain.config.schema import looks_like_file

    assert not looks_like_file("DEFAULT") and not looks_like_file("timm/resnet50.a1_in1k")
    assert looks_like_file("resnet34-b627a593.pth") and looks_like_file("./w")
    with pytest.raises(UserError, match="--weights file does not exist: nope.pth"):
        resolve_train({"weights": "nope.pth"}).check_paths()


def _flip(file: Path, keep_time: bool = False) -> None:
    """64 bytes in the middle of ``file`` inverted, its size kept."""
    before = file.stat()
    data = bytearray(file.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(255 - b for b in data[middle : middle + 64])
    file.write_bytes(bytes(data))
    if keep_time:
        os.utime(file, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_a_damaged_cached_file_is_refused_whatever_put_it_there(tmp_path):
    """A torch hub file is checked against its name's hash prefix each time it is taken
    from the cache, not only on download; the verdict is kept by size and modification
    time, so an unchanged file is hashed once."""
    hub = tmp_path / "hub"
    hub.mkdir()
    staging = hub / "staging.pth"
    torch.save({"w": torch.arange(50_000, dtype=torch.float32)}, staging)
    file = hub / f"tiny-{hashlib.sha256(staging.read_bytes()).hexdigest()[:8]}.pth"
    staging.rename(file)
    named = pretrained.NamedWeights("tiny", "http://127.0.0.1:9/never", file=file)
    assert named.fetch() == file  # intact: taken from the cache, nothing fetched
    _flip(file, keep_time=True)  # same size and time: the kept verdict stands (no hash)
    assert named.fetch() == file
    os.utime(file)  # what a real change does to its time
    with pytest.raises(UserError) as damaged:
        named.fetch()
    message = str(damaged.value)
    assert message.startswith(f"the weights file {file} is damaged")
    assert "delete it and it is fetched again" in message and "\n" not in message


def test_a_damaged_hugging_face_blob_is_refused(monkeypatch, tmp_path):
    import timm

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    source = timm.create_model("resnet18", num_classes=1000).state_dict()
    snapshot_file = _hf_cache(tmp_path / "hf", "timm/resnet18.a1_in1k", source)
    cfg = resolve_train({"model": "timm/resnet18", "weights": "pretrained", "image_size": 32})
    build_model(cfg, num_classes=3)  # intact
    _flip(snapshot_file.resolve())
    with pytest.raises(UserError, match=r"the weights file .*model.safetensors is damaged"):
        build_model(cfg, num_classes=3)
