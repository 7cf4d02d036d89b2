"""The installed version of paratrain (pyproject.toml's, through the package metadata)."""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("paratrain")
except metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"


def install_extra(extra: str) -> str:
    """The command that installs paratrain's optional part ``extra`` where it is
    installed: from the folder it was installed from (a clone: ``pip install -e
    '/path/to/clone[onnx]'``), else from the package index (``pip install
    'paratrain[onnx]'``, which only finds a published paratrain)."""
    import json
    from urllib.parse import unquote, urlparse

    try:
        found = json.loads(metadata.distribution("paratrain").read_text("direct_url.json") or "{}")
    except (metadata.PackageNotFoundError, ValueError):
        found = {}
    url = found.get("url", "")
    index = f" --extra-index-url {EXTRA_INDEXES[extra]}" if extra in EXTRA_INDEXES else ""
    if url.startswith("file://") and "dir_info" in found:
        editable = "-e " if found["dir_info"].get("editable") else ""
        return f"pip install {editable}'{unquote(urlparse(url).path)}[{extra}]'{index}"
    return f"pip install 'paratrain[{extra}]'{index}"


# extras whose packages live on another index than PyPI
EXTRA_INDEXES = {"dali": "https://pypi.nvidia.com"}
