"""How paratrain says to install one of its extras: from wherever it was installed.

`pip install 'paratrain[onnx]'` only finds a published paratrain; installed from a clone
(editable or not), the extra comes from that folder, as pip's record says."""

from __future__ import annotations

import json

import pytest

from paratrain import version


class _Installed:
    def __init__(self, record: dict | None):
        self.record = record

    def read_text(self, name: str) -> str | None:
        assert name == "direct_url.json"
        return None if self.record is None else json.dumps(self.record)


@pytest.mark.parametrize(
    ("record", "command"),
    [
        (
            {"url": "file:///home/me/src/paratrain", "dir_info": {"editable": True}},
            "pip install -e '/home/me/src/paratrain[onnx]'",
        ),
        (
            {"url": "file:///opt/para%20train", "dir_info": {}},
            "pip install '/opt/para train[onnx]'",
        ),
        (None, "pip install 'paratrain[onnx]'"),  # from an index
        (
            {"url": "file:///tmp/paratrain-0.1.0-py3-none-any.whl", "archive_info": {}},
            "pip install 'paratrain[onnx]'",  # a wheel file: its extras come from an index
        ),
    ],
    ids=["editable clone", "clone", "index", "wheel file"],
)
def test_an_extra_is_installed_from_where_paratrain_came_from(monkeypatch, record, command):
    monkeypatch.setattr(version.metadata, "distribution", lambda name: _Installed(record))
    assert version.install_extra("onnx") == command


def test_this_checkouts_own_hint_names_its_folder():
    """The suite runs from an editable install of a clone: the hint names that clone."""
    from pathlib import Path

    import paratrain

    checkout = Path(paratrain.__file__).resolve().parents[2]
    hint = version.install_extra("timm")
    assert hint in (f"pip install -e '{checkout}[timm]'", f"pip install '{checkout}[timm]'")
