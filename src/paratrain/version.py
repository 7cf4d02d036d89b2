"""The installed version of paratrain (pyproject.toml's, through the package metadata)."""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("paratrain")
except metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
