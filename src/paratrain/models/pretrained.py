"""Weights by name: torchvision's weights registry and timm's pretrained configs,
fetched once per machine into the caches their libraries use, and the preprocessing
the weights were trained with.

``--weights DEFAULT`` (or ``IMAGENET1K_V2``, ``ResNet50_Weights.IMAGENET1K_V2``) for a
torchvision model resolves through ``torchvision.models.get_model_weights``; the file
lies where ``torch.hub.load_state_dict_from_url`` keeps it (``TORCH_HOME``'s
hub/checkpoints). ``--weights pretrained`` (or a tag: ``a1_in1k``,
``timm/resnet50.a1_in1k``) for a ``timm/<name>`` model resolves through timm's
pretrained config; the file lies in the Hugging Face hub cache (``HF_HOME``), laid out
as ``huggingface_hub`` lays it out. One process per machine fetches (a file lock; the
others wait, then read); offline, the file absent is one line saying where to put it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
import torchvision

from paratrain.config.train import TrainConfig, as_text
from paratrain.config.words import INTERPOLATIONS, TIMM_PREFIX
from paratrain.errors import UserError
from paratrain.log import get_logger

PRETRAINED = ("pretrained", "default")  # the model's default weights, whichever library
HF_FILES = ("model.safetensors", "pytorch_model.bin")  # what timm reads from the hub
HASH_PREFIX_LENGTH = 8  # torch.hub's convention: <name>-<sha256 prefix>.pth


@dataclass(frozen=True)
class NamedWeights:
    """Weights a name resolved to: where they come from, where they lie once fetched,
    and the preprocessing they were trained with."""

    label: str  # ResNet50_Weights.IMAGENET1K_V2, timm/resnet50.a1_in1k
    url: str
    preprocessing: dict[str, Any] = field(default_factory=dict)
    file: Path | None = None  # a torch hub checkpoint's place
    repo: str | None = None  # a Hugging Face hub repository (timm)

    def fetch(self) -> Path:
        """The weights file on this machine, fetched first where it is absent, and
        checked against its recorded hash whatever put it there."""
        if self.repo is not None:
            found = _fetch_from_hf(self)
            return _verified(found, _hf_recorded_hash(found))
        assert self.file is not None
        return _verified(_fetch_url(self), _hash_prefix(self.file))


def timm_module():
    """timm, or one line saying how to install it."""
    try:
        import timm
    except ImportError:
        from paratrain.version import install_extra

        raise UserError(
            f"--model timm/...: timm is not installed ({install_extra('timm')})"
        ) from None
    return timm


def offline() -> bool:
    """HF_HUB_OFFLINE asks every hub client on the machine not to reach the network."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve(model: str, weights: str) -> NamedWeights:
    """The weights ``weights`` names for ``model``; a name that does not exist for it is
    one line listing those that do."""
    if model.startswith(TIMM_PREFIX):
        return _timm_weights(model, weights)
    return _torchvision_weights(model, weights)


def preprocessing(values: Mapping[str, Any]) -> dict[str, Any]:
    """What the named weights in ``values`` (the settings resolved so far) bring: the
    training crop, the validation resize (the weights' ratio to their crop, applied to
    the crop in use), interpolation, mean and std. The provider of config's "weights"
    preset."""
    return _preset(resolve(values.get("model") or TrainConfig.model, values["weights"]), values)


def _preset(named: NamedWeights, values: Mapping[str, Any]) -> dict[str, Any]:
    prep = dict(named.preprocessing)
    crop, resize = prep.pop("crop"), prep.pop("resize")
    chosen = values.get("val_crop") or values.get("image_size") or crop
    return {"image_size": crop, "val_resize": int(round(chosen * resize / crop)), **prep}


def _interpolation(mode: str) -> dict[str, str]:
    mode = mode.lower()
    return {"interpolation": mode} if mode in INTERPOLATIONS else {}


# ------------------------------------------------------------------------ torchvision


def _torchvision_weights(model: str, weights: str) -> NamedWeights:
    try:
        enum = torchvision.models.get_model_weights(model)
    except (ValueError, KeyError):
        raise UserError(
            f"--weights {weights}: torchvision has no weights for --model {model} "
            "(give a weights file instead)"
        ) from None
    names = list(enum.__members__)
    owner, _, member = weights.rpartition(".")
    if owner and owner != enum.__name__:
        raise UserError(
            f"--weights {weights}: {owner} are not {model}'s weights ({enum.__name__}); "
            f"its names: {', '.join(names)}"
        )
    wanted = "DEFAULT" if member.lower() in PRETRAINED else member
    chosen = {name.upper(): name for name in names}.get(wanted.upper())
    if chosen is None:
        raise UserError(
            f"--weights {weights}: no such weights for {model}; its names: "
            f"{', '.join(names)} (or a weights file)"
        )
    entry = enum[chosen]
    preset = entry.transforms()
    return NamedWeights(
        label=f"{enum.__name__}.{entry.name}",
        url=entry.url,
        preprocessing={
            "crop": int(preset.crop_size[0]),
            "resize": int(preset.resize_size[0]),
            **_interpolation(preset.interpolation.value),
            "mean": as_text(preset.mean),
            "std": as_text(preset.std),
        },
        file=Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(entry.url).path),
    )


def _hash_prefix(file: Path) -> str | None:
    """The SHA-256 prefix torch.hub file names carry (resnet50-11ad3fa6.pth), checked on
    fetching."""
    stem = file.name.split(".")[0]
    tail = stem.rsplit("-", 1)[-1] if "-" in stem else ""
    hexdigits = set("0123456789abcdef")
    return tail if len(tail) >= HASH_PREFIX_LENGTH and set(tail) <= hexdigits else None


def _verified(file: Path, expected: str | None) -> Path:
    """``file`` once its SHA-256 starts with ``expected`` (a torch hub name's prefix, or
    the whole hash a hub blob is named by; None: nothing recorded to check). A file
    already checked at its size and modification time is not hashed again."""
    if not expected:
        return file
    import hashlib
    import json

    stat = file.stat()
    seen = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "expected": expected}
    where = str(file.resolve()).encode()
    record = (
        Path(torch.hub.get_dir())
        / "paratrain-verified"
        / (hashlib.sha256(where).hexdigest()[:24] + ".json")
    )
    try:
        if json.loads(record.read_text()) == seen:
            return file
    except (OSError, ValueError):
        pass
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        while chunk := handle.read(8 << 20):
            digest.update(chunk)
    actual = digest.hexdigest()
    if not actual.startswith(expected):
        raise UserError(
            f"the weights file {file} is damaged: its SHA-256 is {actual[:16]}..., its "
            f"recorded hash {expected[:16]}...; delete it and it is fetched again"
        )
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(seen))
    except OSError:  # a read-only cache: checked again next time
        pass
    return file


def _hf_recorded_hash(file: Path) -> str | None:
    """The SHA-256 huggingface_hub recorded for a cached file: its blob's name, for a
    file stored in LFS (a git blob's 40-hex name is no SHA-256 of the contents)."""
    blob = file.resolve().name
    hexdigits = set("0123456789abcdef")
    return blob if len(blob) == 64 and set(blob) <= hexdigits else None


def _fetch_url(named: NamedWeights) -> Path:
    from filelock import FileLock

    file = named.file
    assert file is not None
    if file.is_file():
        return file
    file.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(file) + ".lock"):
        if file.is_file():  # another process fetched it while this one waited
            return file
        if offline():
            raise UserError(_absent(named, "HF_HUB_OFFLINE is set"))
        get_logger().info(f"fetching the weights {named.label} from {named.url} into {file}")
        try:
            torch.hub.download_url_to_file(
                named.url, str(file), _hash_prefix(file), progress=sys.stderr.isatty()
            )
        except Exception as exc:  # URLError, timeouts, a hash that does not match
            raise UserError(_absent(named, _reason(exc))) from None
    return file


def _absent(named: NamedWeights, why: str) -> str:
    return (
        f"the weights {named.label} are not on this machine and cannot be fetched ({why}): "
        f"put {named.url} at {named.file} (folder {named.file.parent if named.file else '?'}), "
        "or give the file as --weights FILE"
    )


def _reason(exc: BaseException) -> str:
    text = str(getattr(exc, "reason", "") or exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:160]


# ------------------------------------------------------------------------------- timm


def _timm_weights(model: str, weights: str) -> NamedWeights:
    timm = timm_module()
    arch = model[len(TIMM_PREFIX) :]
    arch, _, model_tag = arch.partition(".")
    name = weights[len(TIMM_PREFIX) :] if weights.startswith(TIMM_PREFIX) else weights
    if name.lower() in PRETRAINED:
        tag = model_tag
    elif "." in name:
        named_arch, _, tag = name.partition(".")
        if named_arch != arch:
            raise UserError(f"--weights {weights}: weights of {named_arch}, not of {arch}")
    else:
        tag = name
    tags = [t.partition(".")[2] for t in timm.list_pretrained(f"{arch}.*")]
    if not tags:
        raise UserError(f"--weights {weights}: timm has no pretrained weights for {arch}")
    if tag and tag not in tags:
        raise UserError(
            f"--weights {weights}: no such weights for timm/{arch}; its tags: "
            f"pretrained, {', '.join(tags[:12])}" + (" ..." if len(tags) > 12 else "")
        )
    cfg = timm.models.get_pretrained_cfg(f"{arch}.{tag}" if tag else arch)
    channels, height, _ = cfg.input_size
    prep = {
        "crop": int(height),
        "resize": int(height / cfg.crop_pct) if cfg.crop_pct else int(height),
        **_interpolation(cfg.interpolation or "bilinear"),
        "mean": as_text(cfg.mean),
        "std": as_text(cfg.std),
    }
    label = f"{TIMM_PREFIX}{arch}.{cfg.tag}"
    if cfg.hf_hub_id:
        repo = cfg.hf_hub_id
        url = f"https://huggingface.co/{repo}/resolve/main/{cfg.hf_hub_filename or HF_FILES[0]}"
        return NamedWeights(label, url, prep, repo=repo)
    if not cfg.url:
        raise UserError(f"--weights {weights}: timm gives no place to fetch {label} from")
    file = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(cfg.url).path)
    return NamedWeights(label, cfg.url, prep, file=file)


def hf_cache() -> Path:
    """The Hugging Face hub cache, as huggingface_hub finds it (read now, not at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def _cached_hf(repo: str, cache: Path) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    for filename in HF_FILES:
        found = try_to_load_from_cache(repo, filename, cache_dir=str(cache))
        if isinstance(found, str):
            return Path(found)
    return None


def _fetch_from_hf(named: NamedWeights) -> Path:
    from filelock import FileLock

    repo, cache = named.repo, hf_cache()
    assert repo is not None
    found = _cached_hf(repo, cache)
    if found is not None:
        return found
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache / f".{repo.replace('/', '--')}.paratrain.lock")):
        found = _cached_hf(repo, cache)
        if found is not None:  # another process fetched it while this one waited
            return found
        folder = cache / f"models--{repo.replace('/', '--')}"
        if offline():
            raise UserError(_hf_absent(named, folder, "HF_HUB_OFFLINE is set"))
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError

        get_logger().info(f"fetching the weights {named.label} from the hub ({repo}) into {cache}")
        problem = "not found"
        for filename in HF_FILES:
            try:
                return Path(hf_hub_download(repo, filename, cache_dir=str(cache)))
            except EntryNotFoundError:
                continue  # older repositories hold pytorch_model.bin alone
            except Exception as exc:  # no network, a proxy, an HTTP error
                problem = _reason(exc)
                break
        raise UserError(_hf_absent(named, folder, problem))


def _hf_absent(named: NamedWeights, folder: Path, why: str) -> str:
    return (
        f"the weights {named.label} are not in the Hugging Face cache and cannot be fetched "
        f"({why}): fetch {named.url} where there is a network (`hf download {named.repo}`) "
        f"into {folder} (or set HF_HOME to a cache that has it), or give the file as "
        "--weights FILE"
    )


# ---------------------------------------------------------------------------- loading


def adapt(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Named weights' tensors as ``model`` names them: passed through the timm model's
    own checkpoint filter where it has one (it renames and resamples, e.g. a ViT's
    position embeddings for another image size)."""
    origin = type(model).__module__
    filter_fn = getattr(sys.modules.get(origin), "checkpoint_filter_fn", None)
    if filter_fn is not None and origin.startswith("timm."):
        try:
            state = dict(filter_fn(state, model))
        except Exception:  # a filter written for other checkpoints: keep them as read
            pass
    return state
