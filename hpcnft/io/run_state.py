"""A checkpoint's copy of run.h5 (CHECKPOINT/run_state.h5), and run.h5 rebuilt from one.

At every checkpoint rank 0 copies the run file's content up to the checkpoint's step (root
attributes with the run id, metric rows, RNG snapshots, topology, attempts, events) into the
checkpoint's folder before it gets its final name, so a run.h5 that is deleted, damaged or
replaced later can be rebuilt without losing a row. The copy is an ordinary run file of the
same schema (runfile.read_run validates it), written object by object: only the schema's groups,
datasets and attributes are copied, never a link, so a planted file can add nothing else.
"""
from __future__ import annotations

import os
import time
import uuid

import h5py
import numpy as np

from hpcnft.io.runfile import (EVENT_DTYPE, MAX_ROWS, RNG_NAME, RunFileError, error_line, event_row, last_train_step,
                               read_run)

RUN_STATE = "run_state.h5"
RUN_ID = "run_id"  # root attribute: a random id created with the run file, kept by every copy
MAX_RNG_BYTES = 1 << 24  # an RNG state is ~12 KB
METRIC_CHUNKS, EVENT_CHUNKS = (256, 2), (64,)  # the writer's layouts: a rebuilt file takes appends


def new_run_id() -> str:
    return uuid.uuid4().hex


def run_state_path(ckpt_dir: str) -> str:
    return os.path.join(ckpt_dir, RUN_STATE)


def _members(group: h5py.Group, where: str):
    """(name, object) of a group's hard links; a soft or external link is refused, not followed."""
    for name in group:
        if not isinstance(group.get(name, getlink=True), h5py.HardLink):
            raise RunFileError(f"{where}/{name} is a link")
        yield name, group[name]


def _copy_attrs(src, dst) -> None:
    for key, value in src.attrs.items():
        dst.attrs[key] = value


def _copy_metrics(src: h5py.Group, dst: h5py.Group, where: str) -> None:
    for name, obj in _members(src, where):
        if isinstance(obj, h5py.Group):
            _copy_metrics(obj, dst.require_group(name), f"{where}/{name}")
            continue
        if not (isinstance(obj, h5py.Dataset) and obj.ndim == 2 and obj.shape[1] == 2 and obj.dtype.kind == "f"
                and obj.shape[0] <= MAX_ROWS):
            raise RunFileError(f"{where}/{name} is not a metric dataset")
        dst.create_dataset(name, data=obj[()], maxshape=(None, 2), chunks=METRIC_CHUNKS, dtype=obj.dtype)


def _copy_rng(src: h5py.Group, dst: h5py.Group) -> None:
    for step_name, step_group in _members(src, "rng"):
        if RNG_NAME.match(step_name) is None or not isinstance(step_group, h5py.Group):
            raise RunFileError(f"rng/{step_name} is not an RNG snapshot")
        out = dst.create_group(step_name)
        for rank_name, ds in _members(step_group, f"rng/{step_name}"):
            if not (rank_name.startswith("rank_") and rank_name[5:].isdigit() and isinstance(ds, h5py.Dataset)
                    and ds.ndim == 1 and ds.dtype == np.uint8 and ds.shape[0] <= MAX_RNG_BYTES):
                raise RunFileError(f"rng/{step_name}/{rank_name} is not an RNG state")
            out.create_dataset(rank_name, data=ds[()])


def copy_run(src: h5py.File, dst: h5py.File) -> None:
    """Copy a run file's content, object by object, into an empty file open for writing.
    Raises RunFileError when `src` holds something the schema does not."""
    _copy_attrs(src, dst)
    for name, obj in _members(src, ""):
        if name == "metrics" and isinstance(obj, h5py.Group):
            _copy_metrics(obj, dst.create_group("metrics"), "metrics")
        elif name == "rng" and isinstance(obj, h5py.Group):
            _copy_rng(obj, dst.create_group("rng"))
        elif name == "topology" and isinstance(obj, h5py.Group):
            _copy_attrs(obj, dst.create_group("topology"))
        elif name == "attempts" and isinstance(obj, h5py.Group):
            out = dst.create_group("attempts")
            for n, attempt in _members(obj, "attempts"):
                if not isinstance(attempt, h5py.Group):
                    raise RunFileError(f"attempts/{n} is not a group")
                _copy_attrs(attempt, out.create_group(n))
        elif name == "events" and isinstance(obj, h5py.Dataset) and obj.ndim == 1 \
                and obj.dtype.names == EVENT_DTYPE.names and obj.shape[0] <= MAX_ROWS:
            dst.create_dataset("events", data=obj[()].astype(EVENT_DTYPE), maxshape=(None,), chunks=EVENT_CHUNKS)
        else:
            raise RunFileError(f"unexpected {name!r} in a run file")


def write_snapshot(src: h5py.File, path: str, extra_event: tuple[int, str, str] | None = None) -> None:
    """Write the content of the open run file `src` (flushed by the caller) to `path`, plus one
    event row (step, kind, text) that `src` gets only later (the checkpoint's own)."""
    with h5py.File(path, "w", libver="latest") as dst:
        copy_run(src, dst)
        if extra_event is not None:
            events = dst["events"]
            n = events.shape[0]
            events.resize((n + 1,))
            events[n] = event_row(*extra_event)


def problems(ckpt_dir: str, step: int) -> str | None:
    """Why the checkpoint's run_state.h5 cannot rebuild run.h5, or None: missing, not a regular
    file, not a run file of this schema, or not ending at the checkpoint's step."""
    path = run_state_path(ckpt_dir)
    if not os.path.lexists(path):
        return f"{RUN_STATE} is missing"
    if os.path.islink(path) or not os.path.isfile(path):
        return f"{RUN_STATE} is not a regular file"
    try:
        with h5py.File(path, "r", locking=False) as f, h5py.File(_scratch(), "w", driver="core",
                                                                 backing_store=False) as scratch:
            copy_run(f, scratch)  # first: links are refused before anything follows them
        run = read_run(path)
    except RunFileError as e:
        return f"{RUN_STATE}: {str(e).replace(path + ': ', '')}"
    except Exception as e:  # noqa: BLE001 - a damaged file raises anything from h5py
        return f"{RUN_STATE}: unreadable ({error_line(e)})"
    if not isinstance(run.attrs.get(RUN_ID), str):
        return f"{RUN_STATE} has no run id"
    last = last_step(run)
    if last != step:
        return f"{RUN_STATE} ends at step {last}, not at the checkpoint's step {step}"
    return None


def _scratch() -> str:
    return f"run-state-check-{uuid.uuid4().hex}"  # the name of an in-memory file


def last_step(run) -> int:
    """The last step with training rows in a RunData (0 when none)."""
    return last_train_step(run.metrics)


def set_aside(path: str, why: str) -> str:
    """Rename `path` to `path.<why>-<UTC time>` (never deleted); returns the new name."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = f"{path}.{why}-{stamp}"
    n = 1
    while os.path.lexists(aside):
        n += 1
        aside = f"{path}.{why}-{stamp}-{n}"
    os.rename(path, aside)
    return aside


def rebuild(run_h5: str, ckpt_dir: str) -> None:
    """Write run.h5 anew from the checkpoint's run_state.h5 (through a temporary file, renamed
    into place). The caller has set any existing run.h5 aside."""
    tmp = run_h5 + ".rebuild"
    try:
        with h5py.File(run_state_path(ckpt_dir), "r", locking=False) as src, \
                h5py.File(tmp, "w", libver="latest") as dst:
            copy_run(src, dst)
        os.replace(tmp, run_h5)
    except Exception as e:  # noqa: BLE001
        if os.path.lexists(tmp):
            os.remove(tmp)
        why = str(e) if isinstance(e, RunFileError) else error_line(e)
        raise RunFileError(f"{run_h5}: cannot rebuild from {run_state_path(ckpt_dir)} ({why})") from None


def run_file_trouble(path: str, run_id: str | None, step: int) -> tuple[str, str]:
    """(why run.h5 cannot carry on from checkpoint `step`, the tag it is set aside with), or
    ("", "") when it can. `run_id` is the checkpoints' run id (None: unknown, not compared)."""
    if not os.path.lexists(path):
        return "is missing", ""
    try:
        run = read_run(path)
    except RunFileError as e:
        return f"is damaged ({str(e).replace(path + ': ', '')})", "damaged"
    theirs = run.attrs.get(RUN_ID)
    if run_id is not None and theirs != run_id:
        return f"belongs to another run (run id {theirs or 'none'}, the checkpoints' {run_id})", "other-run"
    last = last_step(run)
    if last < step:
        return f"ends at step {last}, before the checkpoint of step {step}", "stale"
    return "", ""
