"""SOURCES: a data source's name -> what ``--data`` says to reach it. Nothing else lives here.

The source itself is ``paratrain.data.sources.<name>.SOURCE`` (a :class:`~paratrain.data.
sources.base.SourceKind`: the prefix of ``--data`` it answers to, the folders it
recognises, how to open it), loaded by ``base.kind``. ``--data`` is offered to each in this
order; the image folder, last, takes any folder the others do not. Adding one is its module
and one line here. Nothing here imports numpy, torch or a source's package.
"""

from __future__ import annotations

SOURCES: dict[str, str] = {
    "hf": "hf:NAME (the hub), or a folder save_to_disk wrote or of parquet files",
    "wds": "wds:PATTERN: WebDataset tar shards, local or any URL fsspec opens",
    "csv": "csv:FILE.csv: image paths (beside the file) and their classes, one row each",
    "folder": "DIR/<class>/* or DIR/{train,val}/<class>/*",
}
