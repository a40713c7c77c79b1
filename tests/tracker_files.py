"""Reading what the live trackers wrote, with the trackers' own formats: TensorBoard's
EventAccumulator, and wandb's offline run files (`run-<id>.wandb`: wandb's protobuf records in
the LevelDB log framing that wandb's datastore writes; wandb 0.31 ships no Python reader)."""
from __future__ import annotations

import glob
import json
import os
import re
import struct
import zlib

WANDB_BLOCK = 32768
WANDB_HEADER = 7  # ":W&B", magic 0xBEE1, version 0
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def tensorboard_reader(logdir: str):
    """TensorBoard's own reader of a log dir, every event kept, orphaned steps purged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir, size_guidance={"scalars": 0, "images": 0}, purge_orphaned_data=True)
    acc.Reload()
    return acc


def tensorboard_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    acc = tensorboard_reader(logdir)
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_records(path: str):
    """The wandb Record protobufs of one .wandb file, each record's CRC checked."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", path
    pos, parts = WANDB_HEADER, b""
    while pos + 7 <= len(data):
        left = WANDB_BLOCK - pos % WANDB_BLOCK
        if left < 7:  # block trailer
            pos += left
            continue
        crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding at the end of a block
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + n]
        assert zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF == crc, f"{path}: bad record at {pos}"
        pos += 7 + n
        parts += chunk
        if kind in (FULL, LAST):
            rec = pb.Record()
            rec.ParseFromString(parts)
            parts = b""
            yield rec


def wandb_offline_runs(run_dir: str) -> list[str]:
    """The offline run folders of RUN_DIR/wandb, oldest first (wandb names them by start time)."""
    return sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*")))


def wandb_history(run_folder: str) -> tuple[str, list[dict]]:
    """(run id, history rows) of one offline run folder; a row is {key: value} with `_step`, an
    image as its {"_type": "image-file", "path": ...} summary. The run id is the one wandb names
    the folder and its file by (offline-run-DATE-ID[-N]/run-ID.wandb: what `wandb sync` uploads as);
    every run record that carries an id must carry that one."""
    (path,) = glob.glob(os.path.join(run_folder, "run-*.wandb"))
    run_id = os.path.basename(path)[len("run-"):-len(".wandb")]
    folder = os.path.basename(run_folder)  # a second start within the same second gets a "-N" suffix
    assert re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(run_id)}(-\d+)?", folder), run_folder
    rows = []
    for rec in wandb_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":  # the run's record, and later updates of it that may leave the id unset
            assert rec.run.run_id in ("", run_id), (path, rec.run.run_id)
        elif kind == "history":
            row: dict = {}
            for item in rec.history.item:
                key = item.key or "/".join(item.nested_key)
                value = json.loads(item.value_json)
                head, _, field = key.rpartition("/")
                if head == "samples":  # an image is logged as samples/{_type,path,width,...}
                    row.setdefault("samples", {})[field] = value
                else:
                    row[key] = value
            rows.append(row)
    return run_id, rows
