"""Read what a wandb offline run wrote (`wandb/offline-run-*/run-<id>.wandb`), for the tests.

The file is wandb's record log: a 7-byte header (":W&B", magic, version), then 32 KiB blocks of
LevelDB-log records (crc32c 4 bytes, length 2 bytes little endian, type 1 byte: full, first,
middle or last fragment) whose payloads are `wandb_internal_pb2.Record` protobufs. wandb 0.31 reads
it in its Go core only, so the few lines here parse it for the checks the tests make.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[bytes]:
    """The payloads of every record in a `.wandb` file, fragments joined."""
    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a wandb record log")
    out, pending, pos = [], b"", HEADER
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        if kind == 0 and length == 0:  # zero padding at the end of a block
            pos += left
            continue
        payload = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == FULL:
            out.append(payload)
        elif kind == FIRST:
            pending = payload
        elif kind == MIDDLE:
            pending += payload
        elif kind == LAST:
            out.append(pending + payload)
            pending = b""
    return out


def offline_run_facts(run_dir: Path) -> dict:
    """`{"id", "group", "job_type", "summary": {key: value}}` of one offline run folder (the summary
    as its last summary record left it)."""
    from wandb.proto import wandb_internal_pb2 as pb

    facts = {"summary": {}}
    for payload in records(next(Path(run_dir).glob("run-*.wandb"))):
        rec = pb.Record()
        rec.ParseFromString(payload)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            facts.update(id=rec.run.run_id, group=rec.run.run_group, job_type=rec.run.job_type)
        elif kind == "summary":
            for item in rec.summary.update:
                facts["summary"][item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind == "history":  # offline runs may keep the summary only as the last history values
            for item in rec.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    facts["summary"].setdefault("_history", {})[key] = json.loads(item.value_json)
    return facts
