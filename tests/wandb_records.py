"""What a W&B offline run recorded: its run-*.wandb file read back.

The file is W&B's record log (LevelDB's log format: 32 KiB blocks of records, each a
CRC-32, a length and a kind before its bytes, a record longer than a block's room split
into first/middle/last pieces) after a 7-byte ":W&B" header; each whole record is one
``wandb_internal_pb2.Record``. wandb 0.20+ no longer ships a reader for it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK, HEADER, FULL, FIRST, MIDDLE, LAST = 32768, 7, 1, 2, 3, 4


def records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    raw = path.read_bytes()
    assert raw[:4] == b":W&B", f"{path} is not a W&B record log"
    found, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(raw):
        room = BLOCK - pos % BLOCK
        if room < HEADER:  # a block's tail too short for a header is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos : pos + HEADER])
        piece, pos = raw[pos + HEADER : pos + HEADER + length], pos + HEADER + length
        if kind in (FULL, FIRST):
            pending = piece
        elif kind in (MIDDLE, LAST):
            pending += piece
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            found.append(record)
    return found


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)  # "train/loss" is kept as a nested key


def recorded(path: Path) -> dict:
    """The run's id, name and config, its history rows and its summary, as values."""
    run, history, summary = None, [], {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "history":
            history.append({_key(i): json.loads(i.value_json) for i in record.history.item})
        elif kind == "summary":
            summary.update({_key(i): json.loads(i.value_json) for i in record.summary.update})
    assert run is not None, f"{path} holds no run record"
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    return {
        "id": run.run_id,
        "name": run.display_name,
        "project": run.project,
        "config": {k: v.get("value", v) if isinstance(v, dict) else v for k, v in config.items()},
        "history": history,
        "summary": summary,
    }
