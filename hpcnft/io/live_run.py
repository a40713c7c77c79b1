"""Following a run file that another process is writing (used by `hpcnft watch`)."""
from __future__ import annotations

import math
import os

import h5py

from hpcnft.io import runfile
from hpcnft.io.compare import format_step

# Shown per step: the reward, the algorithm's loss (the key the file names, runfile.LOSS_ATTR) and
# the gradient norm, which every algorithm writes.
REWARD_KEY, GRAD_KEY = "rollout/reward/raw_mean", "train/grad_norm"


def columns_of(f: h5py.File) -> tuple[dict[str, str], str]:
    """(label -> metric key, the label of the column that says a step was written) of an open run file."""
    loss = f.attrs.get(runfile.LOSS_ATTR)
    if isinstance(loss, str) and loss.startswith("train/") and f"metrics/{loss}" in f:
        label = loss[len("train/"):]
        return {"reward": REWARD_KEY, label: loss, "grad_norm": GRAD_KEY}, label
    return {"reward": REWARD_KEY, "grad_norm": GRAD_KEY}, "grad_norm"  # a file that names no loss
END_KINDS = ("done", "error")


class RunFollower:
    """Incremental SWMR reader of a run file that another process may be writing.

    Opened without file locking: a locking reader would make the writer's brief non-SWMR
    reopen (new attempt, RNG snapshot) fail. While the file is missing, being created or
    between SWMR sessions, a poll simply finds nothing new.
    """

    def __init__(self, path: str):
        self.path = path
        self.seen_file = False
        self.last_step: float | None = None  # the last step printed
        self._events_seen = 0
        self._end: str | None = None
        self._f: h5py.File | None = None
        self.columns: dict[str, str] = {}
        self.loss = ""  # the label of the column that says a step was written: the algorithm's loss

    def poll(self) -> tuple[list[str], str | None]:
        """New lines since the last poll, and the end kind ('done'/'error') once the run ended."""
        f = self._file()
        if f is None:
            return [], None
        try:
            # Events first: metrics written before a 'done' event are then visible too.
            events = self._new_events(f)
            for e in events:  # a resumed run: only an end after its latest start counts
                if e["kind"] == "start":
                    self._end = None
                elif e["kind"] in END_KINDS:
                    self._end = e["kind"]
            end = self._end
            lines = self._new_step_lines(f, flush_all=end is not None)
        except (OSError, KeyError, ValueError, RuntimeError):
            self.close()  # the writer is between SWMR sessions; reopen on the next poll
            return [], None
        self._events_seen += len(events)
        event_lines = [(e["step"], f"event step {e['step']}: {e['kind']}: {e['text']}") for e in events]
        # In step order, an event after the line of its step (sorted() is stable).
        return [text for _, text in sorted(lines + event_lines, key=lambda x: x[0])], end

    def _file(self) -> h5py.File | None:
        if self._f is not None:
            return self._f
        if not os.path.exists(self.path):
            return None
        self.seen_file = True
        if os.path.getsize(self.path) > 0 and not h5py.is_hdf5(self.path):
            raise runfile.RunFileError(f"{self.path}: not an HDF5 run file")
        try:
            f = h5py.File(self.path, "r", libver="latest", swmr=True, locking=False)
        except OSError:
            return None  # being created, or open for non-SWMR writing right now
        schema = f.attrs.get("schema")
        if schema is not None and schema != runfile.SCHEMA:
            f.close()
            raise runfile.RunFileError(
                f"{self.path}: not an hpcnft run file of schema {runfile.SCHEMA} (schema={schema!r})")
        if schema is None or "events" not in f or f"metrics/{GRAD_KEY}" not in f:
            f.close()
            return None  # the writer has not laid out the file yet
        self.columns, self.loss = columns_of(f)
        self._f = f
        return f

    def _new_events(self, f: h5py.File) -> list[dict]:
        ds = f["events"]
        ds.refresh()
        rows = ds[self._events_seen:]
        return [{"step": int(r["step"]), "kind": r["kind"].decode(errors="replace"),
                 "text": r["text"].decode(errors="replace")} for r in rows]

    def _new_step_lines(self, f: h5py.File, flush_all: bool) -> list[tuple[float, str]]:
        columns: dict[str, dict[float, float]] = {}
        # the loss first: whatever was appended before its newest row is then visible too.
        loss, shown = self.loss, self.columns
        for name in sorted(shown, key=lambda name: name != loss):
            ds = f.get(f"metrics/{shown[name]}")
            if ds is not None:
                ds.refresh()
                columns[name] = dict(ds[()].tolist())
        steps = sorted(s for s in columns[loss] if self.last_step is None or s > self.last_step)
        # Appends are not atomic: a step is shown once every column has reached it, or once the
        # writer has moved on to a later step (a cell still missing then stays missing).
        reached = min(max(c, default=-math.inf) for c in columns.values())
        newest = max(columns[loss], default=-math.inf)
        lines = []
        for step in steps:
            if not (flush_all or step <= reached or step < newest):
                break
            cells = (f"{name} {columns[name][step]:.6g}" if step in columns.get(name, {}) else f"{name} -"
                     for name in shown)
            lines.append((step, f"step {format_step(step)}  " + "  ".join(cells)))
            self.last_step = step
        return lines

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
