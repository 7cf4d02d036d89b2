"""A cache's trust: the manifest written last (each file's size, a CRC-32 for every 64 MB
block), the cheap checks a ready cache passes at start (manifest, index, sizes), and the
blocks' checksums read in the background while training runs; damage stops the run,
named, with the manifest removed so the next start builds it again (``read.agree_intact``).
"""

from __future__ import annotations

import hashlib
import json
import threading
import zlib
from pathlib import Path

from paratrain.data.cache.base import BLOCK, CACHE_FORMAT, MANIFEST, kind
from paratrain.files import write_atomic


class CacheCheck(threading.Thread):
    """Reads every block of the cache's files once, in order, comparing its CRC-32 with
    the manifest's (zlib releases the GIL while it sums, so training runs meanwhile);
    ``problem`` names the first block that differs."""

    def __init__(self, directory: Path, manifest: dict):
        super().__init__(name="paratrain-cache-check", daemon=True)
        self.directory, self.manifest = directory, manifest
        self.problem: str | None = None
        self.blocks_read = 0

    def run(self) -> None:
        for part in self.manifest["parts"]:
            try:
                with open(self.directory / part["name"], "rb") as handle:
                    for block, expected in enumerate(part["blocks"]):
                        if zlib.crc32(handle.read(BLOCK)) != expected:
                            self.problem = (
                                f"block {block} of {part['name']} (bytes {block * BLOCK:,} to "
                                f"{(block + 1) * BLOCK:,}) differs from its checksum"
                            )
                            return
                        self.blocks_read += 1
            except OSError as exc:
                self.problem = f"{part['name']} cannot be read ({exc.strerror or exc})"
                return


def _checksums(path: Path) -> list[int]:
    sums = []
    with open(path, "rb") as handle:
        while True:
            block = handle.read(BLOCK)
            sums.append(zlib.crc32(block))
            if len(block) < BLOCK:
                return sums


def write_manifest(directory: Path, kind_name: str, images: int, short: int, bad: list) -> None:
    index = directory / "index.npy"
    parts = [
        {
            "name": name,
            "bytes": (directory / name).stat().st_size,
            "blocks": _checksums(directory / name),
        }
        for name in kind(kind_name).part_names(directory)
    ]
    manifest = {
        "format": CACHE_FORMAT,
        "kind": kind_name,
        "images": images,
        "short_side": short,
        **kind(kind_name).manifest_fields(),
        "index_sha256": hashlib.sha256(index.read_bytes()).hexdigest(),
        "block_bytes": BLOCK,
        "parts": parts,
        "bad": bad,
    }
    write_atomic(directory / MANIFEST, json.dumps(manifest) + "\n")


def verify(directory: Path, images: int, short: int, kind: str) -> str | None:
    """None when ``directory`` looks like a whole cache of ``images`` images at ``short``
    by what is cheap to check (the manifest, the index's hash, every file's size); else
    what is wrong with it (so the run can say why it builds again). The blocks'
    checksums are checked while training runs (``read.DecodedCache.start_check``)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        return "it has no manifest (an interrupted build, or damage found before)"
    except (OSError, ValueError) as exc:
        return f"its manifest cannot be read ({type(exc).__name__})"
    if not isinstance(manifest, dict) or manifest.get("format") != CACHE_FORMAT:
        return "it is of another format"
    if (manifest.get("images"), manifest.get("short_side"), manifest.get("kind")) != (
        images,
        short,
        kind,
    ):
        return "it holds other images"
    try:
        index = (directory / "index.npy").read_bytes()
        sizes = {
            part["name"]: (directory / part["name"]).stat().st_size for part in manifest["parts"]
        }
    except OSError as exc:
        return f"a file of it is missing ({exc.strerror})"
    if hashlib.sha256(index).hexdigest() != manifest.get("index_sha256"):
        return "its index differs from its manifest"
    for part in manifest["parts"]:
        if sizes[part["name"]] != part["bytes"]:
            return (
                f"its file {part['name']} has {sizes[part['name']]} bytes, its manifest says "
                f"{part['bytes']}"
            )
        if len(part["blocks"]) != part["bytes"] // BLOCK + 1:
            return "its checksums do not cover its data"
    return None
