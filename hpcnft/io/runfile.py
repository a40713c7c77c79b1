"""The HDF5 run file (RUN_DIR/run.h5): one per run, written by rank 0 only.

Schema 1 (docs/run_file.md#the-run-file-runh5):
  root attrs      schema, hpcnft_version, config (JSON), created
  metrics/<key>   float64 (n, 2) rows of (step, value), resizable, chunked
  rng/step_<k>/rank_<r>   uint8 bytes of each rank's RNG states after step k
  topology        group whose attrs describe the job's ranks
  attempts/<n>    one group per start or resume (attrs)
  events          compound rows (step, time, kind, text)

Every metric dataset is created up front so that the file can sit in SWMR mode for the
whole run (HDF5 does not support creating objects while SWMR writing). Rare structural
changes (an RNG snapshot, an attempt) briefly leave SWMR mode and re-enter it.
"""
from __future__ import annotations

import ctypes
import functools
import json
import os
import time
import re
from dataclasses import dataclass, field

import h5py
import numpy as np

from hpcnft.common.errors import one_line

SCHEMA = 1

ROLLOUT_KEYS = [f"rollout/reward/raw_{s}" for s in ("mean", "std", "min", "max", "median", "num_samples")]
# The train keys every algorithm writes, meaning the same in each; an algorithm's own (its loss first)
# come from its spec (hpcnft.algo.spec: metric_keys), and the run file names its loss (LOSS_ATTR).
TRAIN_KEYS = [f"train/{s}" for s in ("adv_abs_mean", "grad_norm", "lr", "loss_scale", "step_skipped")]
LOSS_ATTR = "loss_key"
KL_KEYS = ["train/kl_loss"]
EMA_KEYS = ["ema/decay"]
EVAL_KEYS = ["eval/pickscore_mean", "eval/pickscore_std"]
PERF_KEYS = [
    f"perf/{s}"
    for s in ("rollout_s", "reward_s", "reward_wait_s", "train_s", "iteration_s", "images_per_s",
              "mfu_rollout", "mfu_train")
]
# Keys written every step (eval/* only at eval steps; kl only when the KL term is on), beside the
# algorithm's own.
PER_STEP_KEYS = ROLLOUT_KEYS + TRAIN_KEYS + EMA_KEYS + PERF_KEYS
ALL_KEYS = ROLLOUT_KEYS + TRAIN_KEYS + KL_KEYS + EMA_KEYS + EVAL_KEYS + PERF_KEYS



def last_train_step(metrics) -> int:
    """The last step with training rows (0 when none): train/* rows are written only for a
    finished step, all of them together. `metrics` maps keys to (n, 2) arrays or datasets."""
    ends = [int(rows[-1, 0]) for key, rows in metrics.items() if key.startswith("train/") and len(rows)]
    return max(ends, default=0)


def reward_term_keys(rollout_terms: list[str], eval_terms: list[str]) -> list[str]:
    """The metric keys of configured reward terms: each training term's rollout mean and std,
    each term's evaluation mean and std (eval/pickscore_* is one of ALL_KEYS already)."""
    keys = [f"rollout/reward/{name}/{s}" for name in rollout_terms for s in ("mean", "std")]
    keys += [f"eval/{name}_{s}" for name in eval_terms for s in ("mean", "std")]
    return [k for k in keys if k not in ALL_KEYS]


def watch_keys(diversity: bool, drift: bool, lora: bool) -> list[str]:
    """The metric keys of [watch]'s measures a run has on: the rollout's diversity every step,
    the evaluation's drift from the base and (LoRA) the adapters' norm."""
    return (["rollout/diversity"] if diversity else []) + (["eval/drift"] if drift else []) + \
        (["eval/lora_norm"] if drift and lora else [])


EVENT_KINDS = ("start", "resume", "layout", "checkpoint", "signal", "requeue", "error", "truncate", "done", "eval",
               "warning", "guard", "best")
EVENT_DTYPE = np.dtype([("step", "<i8"), ("time", "<f8"), ("kind", "S16"), ("text", "S1024")])


def event_row(step: int, kind: str, text: str) -> tuple:
    """One row of the events dataset, stamped now; the text cut to the field's 1024 bytes."""
    assert kind in EVENT_KINDS, kind
    return (step, time.time(), kind.encode(), text.encode("utf-8")[:1024])


class RunFileError(Exception):
    """A run file that is missing, unreadable or not in this schema (one-line message)."""


RNG_NAME = re.compile(r"^step_(\d+)$")
# A SWMR reader retries a metadata read that fails its checksum (the writer may be mid-flush).
# HDF5's default, 100 attempts backing off towards an hour in all, turns a damaged file into a
# hang; 30 attempts back off for about a second.
SWMR_READ_ATTEMPTS = 30
MAX_ROWS = 10_000_000  # per metric or event table: far more than any run writes, far less than RAM


def error_line(e: BaseException) -> str:
    """The first line of an error; for HDF5's multi-line write errors, the system's reason."""
    reason = re.search(r"error message = '([^']*)'", str(e))
    if reason:
        return f"{type(e).__name__}: {reason.group(1)}"
    return one_line(e)


@functools.lru_cache(maxsize=None)
def _hdf5_c_function(name: str):
    """A function of the HDF5 library that h5py runs on (found through /proc/self/maps), or None."""
    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "libhdf5" in line and "hdf5_hl" not in line}
        for lib in sorted(libs):
            fn = getattr(ctypes.CDLL(lib), name, None)  # already loaded: the same library h5py uses
            if fn is not None:
                fn.argtypes, fn.restype = [ctypes.c_int64, ctypes.c_uint], ctypes.c_int
                return fn
    except OSError:
        pass
    return None


def open_swmr_reader(path: str) -> h5py.File:
    """Open for SWMR reading without a file lock and with a bounded number of metadata read
    attempts (where the HDF5 library can be reached), so that a damaged file fails fast."""
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_LATEST, h5py.h5f.LIBVER_LATEST)
    fapl.set_file_locking(False, True)
    set_attempts = _hdf5_c_function("H5Pset_metadata_read_attempts")
    if set_attempts is not None:
        set_attempts(fapl.id, SWMR_READ_ATTEMPTS)
    return h5py.File(h5py.h5f.open(os.fsencode(path), h5py.h5f.ACC_RDONLY | h5py.h5f.ACC_SWMR_READ, fapl=fapl))


def is_perf_key(key: str) -> bool:
    return key.startswith("perf/")


@dataclass
class RunData:
    path: str
    attrs: dict
    config: dict
    metrics: dict[str, np.ndarray]  # key -> (n, 2) float64
    topology: dict
    attempts: list[dict]
    events: list[dict]
    rng_steps: list[int] = field(default_factory=list)


def open_for_reading(path: str) -> h5py.File:
    """Open a run file read-only, without a file lock (a reader must never block the writer's
    brief reopen): a plain read when the file is closed, a SWMR read while a writer has it."""
    if not os.path.exists(path):
        raise RunFileError(f"{path}: no such run file")
    if not os.path.isfile(path):
        raise RunFileError(f"{path}: not a regular file")  # a FIFO would block the reader
    try:
        return h5py.File(path, "r", locking=False)
    except Exception as e:  # noqa: BLE001
        first = error_line(e)
    if "already open for write" in first:
        try:
            return open_swmr_reader(path)
        except Exception as e:  # noqa: BLE001
            first = error_line(e)
    raise RunFileError(f"{path}: not an HDF5 run file ({first})")


def _walk_metrics(group: h5py.Group, prefix: str, out: dict[str, np.ndarray], path: str) -> None:
    for name, obj in group.items():
        key = f"{prefix}{name}"
        if isinstance(obj, h5py.Group):
            _walk_metrics(obj, key + "/", out, path)
        elif isinstance(obj, h5py.Dataset):
            if obj.ndim != 2 or obj.shape[1] != 2 or obj.dtype.kind != "f":
                raise RunFileError(f"{path}: metric {key!r} has shape {obj.shape} dtype {obj.dtype}, "
                                   "expected (n, 2) float")
            if obj.shape[0] > MAX_ROWS:
                raise RunFileError(f"{path}: metric {key!r} has {obj.shape[0]} rows, more than {MAX_ROWS}")
            _refresh(obj)
            out[key] = np.asarray(obj[()], dtype=np.float64)
        else:
            raise RunFileError(f"{path}: metric {key!r} is not a dataset")


def _refresh(ds: h5py.Dataset) -> None:
    if ds.file.swmr_mode:
        ds.refresh()


def _group(f: h5py.File, name: str, path: str) -> h5py.Group | None:
    """f[name] when it is a group, None when absent; RunFileError when it is something else."""
    if name not in f:
        return None
    obj = f[name]
    if not isinstance(obj, h5py.Group):
        raise RunFileError(f"{path}: {name!r} is not a group")
    return obj


def read_run(path: str) -> RunData:
    """Read a whole run file, validating it against the schema; raises RunFileError."""
    if os.path.isdir(path):
        path = os.path.join(path, "run.h5")
    f = open_for_reading(path)
    try:
        attrs = {k: decode_attr(v) for k, v in f.attrs.items()}
        schema = attrs.get("schema")
        if not (isinstance(schema, int) and schema == SCHEMA):
            raise RunFileError(f"{path}: not an hpcnft run file of schema {SCHEMA} (schema={schema!r})"[:300])
        try:
            config = json.loads(attrs.get("config", "{}"))
        except (json.JSONDecodeError, TypeError, RecursionError):
            raise RunFileError(f"{path}: root attribute 'config' is not valid JSON") from None
        if not isinstance(config, dict):
            raise RunFileError(f"{path}: root attribute 'config' is not a JSON object")
        metrics_group = _group(f, "metrics", path)
        if metrics_group is None:
            raise RunFileError(f"{path}: no 'metrics' group")
        metrics: dict[str, np.ndarray] = {}
        _walk_metrics(metrics_group, "", metrics, path)
        topo = _group(f, "topology", path)
        topology = {k: decode_attr(v) for k, v in topo.attrs.items()} if topo is not None else {}
        attempts = []
        att = _group(f, "attempts", path)
        for name in sorted(att or [], key=lambda s: int(s) if s.isdigit() else 1 << 30):
            attempts.append({"n": name, **{k: decode_attr(v) for k, v in att[name].attrs.items()}})
        events = []
        if "events" in f:
            ds = f["events"]
            if not isinstance(ds, h5py.Dataset) or ds.ndim != 1 or ds.dtype.names != EVENT_DTYPE.names:
                raise RunFileError(f"{path}: 'events' is not a table of {EVENT_DTYPE.names}")
            if ds.shape[0] > MAX_ROWS:
                raise RunFileError(f"{path}: 'events' has {ds.shape[0]} rows, more than {MAX_ROWS}")
            _refresh(ds)
            for row in ds[()]:
                events.append({"step": int(row["step"]), "time": float(row["time"]),
                               "kind": row["kind"].decode(errors="replace"),
                               "text": row["text"].decode(errors="replace")})
        rng = _group(f, "rng", path)
        rng_steps = []
        for name in rng or []:
            m = RNG_NAME.match(name)
            if m is None:
                raise RunFileError(f"{path}: unexpected {'rng/' + name!r}"[:300])
            rng_steps.append(int(m.group(1)))
        rng_steps.sort()
    except RunFileError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged file raises anything from h5py
        raise RunFileError(f"{path}: unreadable run file ({error_line(e)})"[:500]) from None
    finally:
        f.close()
    return RunData(path, attrs, config, metrics, topology, attempts, events, rng_steps)


def read_rng(path: str, step: int) -> dict[int, bytes]:
    with open_for_reading(path) as f:
        g = f.get(f"rng/step_{step}")
        if g is None:
            raise RunFileError(f"{path}: no RNG states for step {step}")
        return {int(n.split("_")[1]): bytes(g[n][()]) for n in g}


def decode_attr(v):
    if isinstance(v, bytes):
        return v.decode(errors="replace")
    if isinstance(v, np.generic):
        return v.item()
    return v

