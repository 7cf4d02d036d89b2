"""A built cache read: ``DecodedCache`` (an entry's pixels by row, memory-mapped once per
loader process) and the datasets over it (training's augmentation on cached uint8,
evaluation's transform giving the decode path's very tensors)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from torchvision.transforms import v2

from paratrain.data.cache.base import MANIFEST, kind
from paratrain.data.cache.verify import CacheCheck
from paratrain.data.samples import Samples
from paratrain.data.transforms import IMAGENET_MEAN, IMAGENET_STD, AugmentedSamples
from paratrain.distributed import comm
from paratrain.errors import AgreedUserError


class DecodedCache:
    """A built cache: ``image(row)`` gives an entry's pixels, ``slots(samples)`` the rows
    of samples of the data set it was built from."""

    def __init__(self, directory: Path, samples: Samples | None = None):
        self.directory = directory
        self.manifest = json.loads((directory / MANIFEST).read_text())
        self.kind: str = self.manifest["kind"]
        self._kind = kind(self.kind)
        self.parts: list[str] = [part["name"] for part in self.manifest["parts"]]
        self.index = np.load(directory / "index.npy")  # rows: part, offset, bytes, height, width
        self.ids = samples.ids if samples is not None else np.arange(len(self.index))
        self._maps: dict[int, np.memmap] = {}  # opened lazily, once per loader process
        self.check: CacheCheck | None = None  # the background checksum pass, where run

    @property
    def lossless(self) -> bool:
        """Whether its pixels are bit for bit the decode path's (validation may read them)."""
        return self._kind.lossless

    @property
    def bad(self) -> list[tuple[str, str]]:
        """(key, reason) of every entry the build could not decode (not stored)."""
        return [(str(key), str(why)) for key, why in self.manifest["bad"]]

    @property
    def nbytes(self) -> int:
        """Bytes the cache's files hold."""
        return int(sum(part["bytes"] for part in self.manifest["parts"]))

    def slots(self, samples: Samples) -> np.ndarray:
        """The row of each of ``samples`` (a subset of what the cache was built from)."""
        order = np.argsort(self.ids, kind="stable")
        found = np.searchsorted(self.ids[order], samples.ids)
        rows = order[np.minimum(found, max(len(order) - 1, 0))]
        if len(rows) and not np.array_equal(self.ids[rows], samples.ids):
            raise KeyError("samples the cache was not built from")
        return rows

    def _part(self, number: int) -> np.memmap:
        if number not in self._maps:
            path = self.directory / self.parts[number]
            self._maps[number] = np.memmap(path, dtype=np.uint8, mode="r")
        return self._maps[number]

    def image(self, row: int) -> torch.Tensor:
        """The stored image of ``row`` as a CHW uint8 tensor."""
        part, offset, nbytes, height, width = (int(v) for v in self.index[row])
        stored = self._part(part)[offset : offset + nbytes]
        pixels = self._kind.pixels(stored, height, width)
        return torch.from_numpy(pixels).permute(2, 0, 1)

    def stored(self, row: int) -> tuple[torch.Tensor, bool, tuple[int, int]]:
        """``row`` as stored, for the device path: (CHW pixels, or a packed entry's JPEG
        bytes for the device to decode; whether encoded; (height, width))."""
        if not self._kind.encoded:
            pixels = self.image(row)
            return pixels, False, (pixels.shape[-2], pixels.shape[-1])
        part, offset, nbytes, height, width = (int(v) for v in self.index[row])
        raw = bytearray(self._part(part)[offset : offset + nbytes])
        return torch.frombuffer(raw, dtype=torch.uint8), True, (height, width)

    def start_check(self) -> None:
        """Check every block's checksum in a thread of this process, from now on."""
        self.check = CacheCheck(self.directory, self.manifest)
        self.check.start()

    def damage(self, wait: bool = False) -> str | None:
        """What the background check found wrong so far (``wait``: once it has read
        everything); None while nothing is."""
        if self.check is None:
            return None
        if wait:
            self.check.join()
        return self.check.problem

    def __getstate__(self) -> dict:  # loader workers open their own maps
        return {**self.__dict__, "_maps": {}, "check": None}


def agree_intact(cache: DecodedCache | None, wait: bool = False) -> None:
    """Every rank together: stop, named, when a node's background check found its cache
    damaged (after removing that cache's manifest, so the next start rebuilds it).
    ``wait``: for the checks to finish first (at the end of training)."""
    if cache is None:
        return
    mine = cache.damage(wait)
    if mine is not None:
        (cache.directory / MANIFEST).unlink(missing_ok=True)
        mine = f"{cache.directory}: {mine}"
    found = [problem for problem in comm.all_gather_object(mine) if problem]
    if found:
        raise AgreedUserError(
            f"the decoded-image cache is damaged: {found[0]}; its manifest is removed, so "
            "the next start builds it again (resume from the last checkpoint)"
        )


class CachedImages(AugmentedSamples):
    """Samples read from the cache, each from the row its entry was stored in."""

    def __init__(self, samples, cache: DecodedCache, transform: Callable | None = None):
        super().__init__(samples, transform)
        self.cache = cache
        self.rows = cache.slots(self.samples)

    def load(self, index: int) -> torch.Tensor:
        """The sample's pixels from the cache instead of its file."""
        return self.cache.image(int(self.rows[index]))


def _to_float(image: torch.Tensor) -> torch.Tensor:
    return image.float().div(255)  # as ToTensor does, so both paths agree bit for bit


def cached_eval_transform(
    size: int, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The evaluation transform on cached uint8 images: the same tensors as the decode path's."""
    return v2.Compose([v2.CenterCrop(size), _to_float, v2.Normalize(list(mean), list(std))])
