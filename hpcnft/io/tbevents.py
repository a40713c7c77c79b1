"""TensorBoard event files, written without TensorFlow or protobuf.

An event file is a TFRecord file of `Event` protocol buffers; scalars need only a handful of
fields, encoded here by hand:
  Event:   1 wall_time (double), 2 step (int64), 3 file_version (string), 5 summary (Summary)
  Summary: 1 value (repeated Value)
  Value:   1 tag (string), 2 simple_value (float)
TFRecord: uint64 length, masked CRC-32C of the length, data, masked CRC-32C of the data.
"""
from __future__ import annotations

import os
import socket
import struct
import time
from typing import Mapping

import numpy as np


def write_tensorboard(metrics: Mapping[str, np.ndarray], logdir: str) -> str:
    """One event file in `logdir` with every row as a scalar (tag = key); returns its path."""
    by_step: dict[int, list[tuple[str, float]]] = {}
    for key, rows in metrics.items():
        for step, value in rows.tolist():
            by_step.setdefault(int(step), []).append((key, value))
    now = time.time()
    path = os.path.join(logdir, f"events.out.tfevents.{int(now)}.{socket.gethostname()}.hpcnft")
    os.makedirs(logdir, exist_ok=True)
    with open(path, "wb") as f:
        f.write(_tfrecord(_event(now, 0, file_version="brain.Event:2")))
        for step in sorted(by_step):
            f.write(_tfrecord(_event(now, step, scalars=by_step[step])))
    return path


def _event(wall_time: float, step: int, file_version: str | None = None,
           scalars: list[tuple[str, float]] = ()) -> bytes:
    msg = b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step)
    if file_version is not None:
        msg += _field_bytes(3, file_version.encode())
    if scalars:
        values = b"".join(_field_bytes(1, _field_bytes(1, tag.encode()) + b"\x15" + _float32(value))
                          for tag, value in scalars)
        msg += _field_bytes(5, values)
    return msg


def _float32(x: float) -> bytes:
    with np.errstate(over="ignore"):  # beyond float32 range becomes +-inf, as TensorBoard would show it
        return np.float32(x).astype("<f4").tobytes()


def _field_bytes(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int64 as two's complement
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _tfrecord(data: bytes) -> bytes:
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", _masked_crc(header)) + data + struct.pack("<I", _masked_crc(data))


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC32C_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
