"""Reading back what the experiment trackers wrote, as their users' tools would."""

from __future__ import annotations

import struct
from pathlib import Path


def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def tensorboard_texts(directory: Path) -> dict[str, list[tuple[int, str]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"tensors": 0})
    events.Reload()
    return {
        tag.removesuffix("/text_summary"): [
            (e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors(tag)
        ]
        for tag in events.Tags()["tensors"]
    }


def wandb_history(run_file: Path) -> list[dict[str, str]]:
    """The history rows of an offline W&B run (`run-<id>.wandb`), each {key: JSON value}.

    Written by hand because wandb's Python package no longer ships a reader for its own run files
    (the service that writes them is Go); the format is a 7-byte W&B header, then LevelDB's log
    format (32 KiB blocks of records with a 7-byte header: CRC, length, type) around protobuf
    `Record`s, which wandb's package does ship.
    """
    from wandb.proto import wandb_internal_pb2

    data, block, position, pending, rows = run_file.read_bytes(), 32768, 7, b"", []
    while position + 7 <= len(data):
        if block - position % block < 7:  # the block's trailer: padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): item.value_json for item in record.history.item})
    return rows
