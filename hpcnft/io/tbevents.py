"""TensorBoard event files of a run's metrics, written by TensorBoard's own event writer (the
optional `tensorboard` extra; no torch needed)."""
from __future__ import annotations

import os
import time
from typing import Mapping

import numpy as np


class TensorBoardMissing(ImportError):
    """The `tensorboard` package is not installed."""


def write_tensorboard(metrics: Mapping[str, np.ndarray], logdir: str) -> str:
    """One event file in `logdir` with every row as a scalar (tag = key); returns its path."""
    try:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError as e:
        raise TensorBoardMissing(f"TensorBoard export needs the tensorboard package "
                                 f"(pip install 'hpcnft[tensorboard]'): {e}") from None
    by_step: dict[int, list[tuple[str, float]]] = {}
    for key, rows in metrics.items():
        for step, value in rows.tolist():
            by_step.setdefault(int(step), []).append((key, value))
    now = time.time()
    before = set(os.listdir(logdir)) if os.path.isdir(logdir) else set()
    writer = EventFileWriter(logdir, filename_suffix=".hpcnft")
    try:
        for step in sorted(by_step):
            values = [Summary.Value(tag=key, simple_value=value) for key, value in by_step[step]]
            writer.add_event(Event(wall_time=now, step=step, summary=Summary(value=values)))
    finally:
        writer.close()
    (name,) = [n for n in os.listdir(logdir) if n not in before and n.endswith(".hpcnft")]  # the writer's new file
    return os.path.join(logdir, name)
