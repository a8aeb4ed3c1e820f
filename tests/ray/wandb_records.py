"""Read an offline W&B run file (`run-<id>.wandb`) back: history keys and config keys.

wandb >= 0.2x writes records in a LevelDB-log framing (32 KiB blocks; each chunk has a
7-byte header: crc32c, little-endian length, type FULL/FIRST/MIDDLE/LAST) after a 7-byte
file header (":W&B", magic, version). Each payload is a `wandb_internal_pb2.Record`.
"""

from __future__ import annotations

import struct
from pathlib import Path

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def raw_records(path: str | Path):
    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B run file (header {data[:7]!r})")
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        chunk = data[pos:pos + length]
        pos += length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
            pending = b""


def read_run(path: str | Path) -> tuple[set[str], set[str], int]:
    """(history metric names, config keys, number of history rows)."""
    from wandb.proto import wandb_internal_pb2 as pb

    history, config, rows = set(), set(), 0
    for raw in raw_records(path):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            rows += 1
            history |= {i.key or "/".join(i.nested_key) for i in rec.history.item}
        elif kind == "run":
            config |= {i.key or "/".join(i.nested_key) for i in rec.run.config.update}
        elif kind == "config":
            config |= {i.key or "/".join(i.nested_key) for i in rec.config.update}
    return history, config, rows


def history_rows(path: str | Path) -> list[dict[str, str]]:
    """Every history row as {metric name: its JSON-encoded value} (exact, as logged)."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for raw in raw_records(path):
        rec = pb.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): i.value_json
                         for i in rec.history.item})
    return rows
