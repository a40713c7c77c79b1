"""Rank 0's writer of the run file (schema: io.runfile), kept in SWMR mode for the whole run so
that `hpcnft watch` can follow it; a failed write is one RunFileError naming the file."""
from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import subprocess
import time
import traceback
from typing import Mapping

import h5py
import numpy as np

from hpcnft.io import run_state
from hpcnft.io.room import NoRoom, Room
from hpcnft.io.runfile import (ALL_KEYS, EVENT_DTYPE, LOSS_ATTR, SCHEMA, RunFileError, decode_attr, error_line,
                               event_row, open_swmr_reader, read_run)


def _clear_swmr_flags(path: str) -> None:
    """Recover a file left flagged by a killed SWMR writer (hpc_notes.md §6): h5clear -s -i
    when available, else copy every object to a fresh file through a SWMR reader."""
    try:
        r = subprocess.run(["h5clear", "-s", "-i", path], capture_output=True, timeout=60)
        if r.returncode == 0:
            h5py.File(path, "a", libver="latest").close()
            return
    except (FileNotFoundError, subprocess.TimeoutExpired, OSError):
        pass
    tmp = path + ".recover"
    with open_swmr_reader(path) as src, h5py.File(tmp, "w", libver="latest") as dst:
        for k, v in src.attrs.items():
            dst.attrs[k] = v
        for name in src:
            src.copy(src[name], dst, name=name)
    os.replace(tmp, path)


def _writes(method):
    """A write: refused whole where the file may not grow (io.room: free space, the file size
    limit, the reserve a quota would leave untaken), the reserve given back for the write and
    taken again after it; a failed write (full disk, read-only file system, damaged file) is a
    RunFileError naming the file; rows written before it stay readable."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        self._room.release()
        try:
            _room_for(self)
            return _named(self, method, *args, **kwargs)
        finally:
            try:
                self._room.take()
            except NoRoom:  # this write is done; the next is refused up front
                pass

    return wrapper


def _reads(method):
    """A read of the open file: a failure is a RunFileError naming the file."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        return _named(self, method, *args, **kwargs)

    return wrapper


def _named(self, method, *args, **kwargs):
    try:
        return method(self, *args, **kwargs)
    except (RunFileError, AssertionError):
        raise
    except Exception as e:  # noqa: BLE001 - h5py raises OSError, RuntimeError, KeyError, ...
        self._failed = True
        _release_quietly(e)
        raise RunFileError(f"{self.path}: cannot write the run file ({error_line(e)})") from None


def _room_for(self, nbytes: int = 0) -> None:
    try:
        self._room.check(nbytes)
    except NoRoom as e:
        raise RunFileError(f"{self.path}: cannot write the run file ({e})") from None


def _release_quietly(e: BaseException) -> None:
    """Free what the failed call held (its frames' h5py objects) now, with stderr captured:
    after a failed write h5py reports every object it cannot release on stderr, a traceback
    each, and the RunFileError has said it already."""
    with contextlib.redirect_stderr(io.StringIO()):
        traceback.clear_frames(e.__traceback__)


def _check_space(path: str, nbytes: int) -> None:
    """Another file's room (a checkpoint's copy of the run file): io.room's checks, no reserve."""
    try:
        Room(path, reserve=False).check(nbytes)
    except NoRoom as e:
        raise RunFileError(f"{path}: cannot write the run file ({e})") from None


class RunFileWriter:
    """Rank 0's writer. Opens (or creates) RUN_DIR/run.h5 and keeps it in SWMR mode. An existing
    file is validated against the schema (read_run) before anything is written to it. The file
    carries a random run id (created with it, or given to a file of an older version that has
    none), which every checkpoint's copy keeps: a run.h5 of another run is told apart by it."""

    def __init__(self, path: str, config_json: str, version: str, extra_keys: tuple[str, ...] = (),
                 loss_key: str | None = None):
        """EXTRA_KEYS: the algorithm's train keys (LOSS_KEY, its loss, first; named in the file's
        attributes for readers such as `hpcnft watch`) and the reward terms' keys."""
        self.path = path
        self.keys = ALL_KEYS + [k for k in extra_keys if k not in ALL_KEYS]
        self._f = None
        self._failed = False
        self._room = Room(path)
        try:
            _room_for(self)
            self._room.take()  # a quota with no room left is found before the file is touched
            self._room.release()
            if os.path.lexists(path):
                read_run(path)  # RunFileError for anything but a readable run file of this schema
                self._f = self._open_existing()
                self._f.attrs["config"] = config_json
            else:
                self._f = h5py.File(path, "w", libver="latest")
                self._f.attrs["schema"] = SCHEMA
                self._f.attrs["hpcnft_version"] = version
                self._f.attrs["config"] = config_json
                self._f.attrs["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            if loss_key is not None:
                self._f.attrs[LOSS_ATTR] = loss_key
            if not isinstance(self._f.attrs.get(run_state.RUN_ID), str):
                self._f.attrs[run_state.RUN_ID] = run_state.new_run_id()
            self._ensure_structure()
            self._f.flush()
            self._f.swmr_mode = True
            self._room.take()  # held until the next write
        except Exception as e:  # noqa: BLE001
            if self._f is not None:
                try:
                    self._f.close()
                except Exception:  # noqa: BLE001
                    pass
            if isinstance(e, RunFileError):
                raise
            if isinstance(e, NoRoom):
                raise RunFileError(f"{path}: cannot open the run file for writing ({e})") from None
            _release_quietly(e)
            raise RunFileError(f"{path}: cannot open the run file for writing ({error_line(e)})") from None

    def _open_existing(self) -> h5py.File:
        try:
            return h5py.File(self.path, "a", libver="latest")
        except OSError as e:
            if "already open for write" not in str(e):
                raise RunFileError(f"{self.path}: cannot open run file for writing: {error_line(e)}") from None
        _clear_swmr_flags(self.path)
        return h5py.File(self.path, "a", libver="latest")

    def _ensure_structure(self) -> None:
        f = self._f
        for key in self.keys:
            name = f"metrics/{key}"
            if name not in f:
                f.create_dataset(name, shape=(0, 2), maxshape=(None, 2), chunks=(256, 2), dtype="<f8")
        if "events" not in f:
            f.create_dataset("events", shape=(0,), maxshape=(None,), chunks=(64,), dtype=EVENT_DTYPE)
        for g in ("rng", "attempts", "topology"):
            f.require_group(g)

    # -- structural changes (leave SWMR briefly) ---------------------------------------
    def _restructure(self, nbytes: int = 0):
        _room_for(self, nbytes)
        self._f.flush()
        self._f.close()
        for attempt in range(50):  # a reader that took a lock (h5dump, say) holds it briefly
            try:
                self._f = h5py.File(self.path, "a", libver="latest")
                return
            except BlockingIOError:
                time.sleep(0.1)
        self._f = h5py.File(self.path, "a", libver="latest")

    def _resume_swmr(self):
        self._f.flush()
        self._f.swmr_mode = True

    @_writes
    def set_topology(self, attrs: Mapping[str, object]) -> dict:
        """This start's topology in place of the last start's, which it returns (decoded)."""
        self._restructure()
        topo = self._f["topology"]
        before = {k: decode_attr(v) for k, v in topo.attrs.items()}
        for k in list(topo.attrs):
            del topo.attrs[k]
        for k, v in attrs.items():
            topo.attrs[k] = _attr_value(v)
        self._resume_swmr()
        return before

    @_writes
    def add_attempt(self, attrs: Mapping[str, object]) -> int:
        self._restructure()
        att = self._f["attempts"]
        n = len(att)
        g = att.create_group(str(n))
        for k, v in attrs.items():
            g.attrs[k] = _attr_value(v)
        self._resume_swmr()
        return n

    @_writes
    def write_rng(self, step: int, states: Mapping[int, bytes]) -> None:
        self._restructure(sum(len(b) for b in states.values()))
        name = f"rng/step_{step}"
        if name in self._f:
            del self._f[name]
        g = self._f.create_group(name)
        for rank, blob in sorted(states.items()):
            g.create_dataset(f"rank_{rank}", data=np.frombuffer(blob, dtype=np.uint8))
        self._resume_swmr()

    @_writes
    def drop_rng_after(self, step: int) -> None:
        later = [n for n in self._f["rng"] if int(n.split("_")[1]) > step]
        if not later:
            return
        self._restructure()
        for n in later:
            del self._f[f"rng/{n}"]
        self._resume_swmr()

    def snapshot(self, path: str, extra_event: tuple[int, str, str] | None = None) -> None:
        """A copy of everything written so far (a checkpoint's run_state.h5), read through this
        handle after a flush; `extra_event` goes into the copy only. A failure (a full disk) is a
        RunFileError naming `path`; run.h5 itself is left as it was."""
        try:
            _check_space(path, os.path.getsize(self.path))
            self._f.flush()
            run_state.write_snapshot(self._f, path, extra_event)
        except Exception as e:  # noqa: BLE001
            if os.path.lexists(path):
                os.remove(path)
            if isinstance(e, RunFileError):
                raise
            _release_quietly(e)
            raise RunFileError(f"{path}: cannot write the copy of the run file ({error_line(e)})") from None

    # -- appends (SWMR-safe) -------------------------------------------------------------
    @_writes
    def append_metrics(self, step: int, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            ds = self._f[f"metrics/{key}"]
            n = ds.shape[0]
            ds.resize((n + 1, 2))
            ds[n] = (float(step), float(value))
            ds.flush()
        self._f.flush()

    @_writes
    def event(self, step: int, kind: str, text: str) -> None:
        row = event_row(step, kind, text)
        ds = self._f["events"]
        n = ds.shape[0]
        ds.resize((n + 1,))
        ds[n] = row
        ds.flush()
        self._f.flush()

    @_writes
    def truncate_after(self, step: int, inclusive_keys: tuple[str, ...] = ()) -> int:
        """Drop metric rows with step > `step` (>= `step` for `inclusive_keys`); returns how
        many rows were dropped."""
        dropped = 0
        for key in self.keys:
            ds = self._f[f"metrics/{key}"]
            if ds.shape[0] == 0:
                continue
            steps = ds[:, 0]
            keep = int(np.searchsorted(steps, step, side="left" if key in inclusive_keys else "right"))
            if keep < ds.shape[0]:
                dropped += ds.shape[0] - keep
                ds.resize((keep, 2))
                ds.flush()
        self._f.flush()
        return dropped

    @_reads
    def rows_between(self, after: int, through: int) -> dict[int, dict[str, float]]:
        """{step: {key: value}} of the rows with after < step <= through."""
        out: dict[int, dict[str, float]] = {}
        for key in self.keys:
            for step, value in self._f[f"metrics/{key}"][()].tolist():
                if after < step <= through:
                    out.setdefault(int(step), {})[key] = value
        return dict(sorted(out.items()))

    @_reads
    def last_step(self) -> int:
        """The last step with training rows (0 when none): train/* rows are written only for a
        finished step, all of them together."""
        train = self._f.get("metrics/train")
        ends = [int(ds[-1, 0]) for ds in (train.values() if train is not None else ()) if ds.shape[0]]
        return max(ends, default=0)

    def close(self) -> None:
        self._room.release()  # room for the last flush; no reserve is left behind
        if self._f is None or not self._f.id.valid:
            return
        try:
            self._f.flush()
        except Exception as e:  # noqa: BLE001 - closing still releases the file
            self._failed = True
            _release_quietly(e)
            raise RunFileError(f"{self.path}: cannot write the run file ({error_line(e)})") from None
        finally:
            with contextlib.redirect_stderr(io.StringIO()) if self._failed else contextlib.nullcontext():
                try:
                    self._f.close()
                except Exception:  # noqa: BLE001
                    pass


def _attr_value(v):
    if isinstance(v, (list, tuple, dict)):
        return json.dumps(v)
    if v is None:
        return ""
    if isinstance(v, str):
        return str(v)  # plain str: h5py refuses str subclasses such as torch's version string
    return v
