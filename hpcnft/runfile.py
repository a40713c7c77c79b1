"""The HDF5 run file (RUN_DIR/run.h5): one per run, written by rank 0 only.

Schema 1 (architecture.md §6):
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

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from typing import Mapping

import h5py
import numpy as np

SCHEMA = 1

ROLLOUT_KEYS = [f"rollout/reward/raw_{s}" for s in ("mean", "std", "min", "max", "median", "num_samples")]
TRAIN_KEYS = [
    f"train/{s}"
    for s in (
        "nft_loss", "nft_loss_per_pair", "nft_pos_loss", "nft_neg_loss", "nft_r_mean", "nft_adv_mean",
        "adv_abs_mean", "nft_t_mean", "nft_num_timesteps", "grad_norm", "lr", "loss_scale", "step_skipped",
    )
]
KL_KEYS = ["train/kl_loss"]
EMA_KEYS = ["ema/decay"]
EVAL_KEYS = ["eval/pickscore_mean", "eval/pickscore_std"]
PERF_KEYS = [
    f"perf/{s}"
    for s in ("rollout_s", "reward_s", "reward_wait_s", "train_s", "iteration_s", "images_per_s",
              "mfu_rollout", "mfu_train")
]
# Keys written every step (eval/* only at eval steps; kl only when the KL term is on).
PER_STEP_KEYS = ROLLOUT_KEYS + TRAIN_KEYS + EMA_KEYS + PERF_KEYS
ALL_KEYS = ROLLOUT_KEYS + TRAIN_KEYS + KL_KEYS + EMA_KEYS + EVAL_KEYS + PERF_KEYS

EVENT_KINDS = ("start", "resume", "checkpoint", "signal", "requeue", "error", "truncate", "done", "eval")
EVENT_DTYPE = np.dtype([("step", "<i8"), ("time", "<f8"), ("kind", "S16"), ("text", "S1024")])


class RunFileError(Exception):
    """A run file that is missing, unreadable or not in this schema (one-line message)."""


def is_perf_key(key: str) -> bool:
    return key.startswith("perf/")


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
    with h5py.File(path, "r", libver="latest", swmr=True) as src, h5py.File(tmp, "w", libver="latest") as dst:
        for k, v in src.attrs.items():
            dst.attrs[k] = v
        for name in src:
            src.copy(src[name], dst, name=name)
    os.replace(tmp, path)


class RunFileWriter:
    """Rank 0's writer. Opens (or creates) RUN_DIR/run.h5 and keeps it in SWMR mode."""

    def __init__(self, path: str, config_json: str, version: str):
        self.path = path
        existed = os.path.exists(path)
        if existed:
            self._f = self._open_existing()
            stored = self._f.attrs.get("schema")
            if stored != SCHEMA:
                self._f.close()
                raise RunFileError(f"{path}: schema {stored!r}, this hpcnft writes schema {SCHEMA}")
            self._f.attrs["config"] = config_json
        else:
            self._f = h5py.File(path, "w", libver="latest")
            self._f.attrs["schema"] = SCHEMA
            self._f.attrs["hpcnft_version"] = version
            self._f.attrs["config"] = config_json
            self._f.attrs["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self._ensure_structure()
        self._f.flush()
        self._f.swmr_mode = True

    def _open_existing(self) -> h5py.File:
        try:
            return h5py.File(self.path, "a", libver="latest")
        except OSError as e:
            if "already open for write" not in str(e):
                raise RunFileError(f"{self.path}: cannot open run file for writing: {e}") from None
        _clear_swmr_flags(self.path)
        return h5py.File(self.path, "a", libver="latest")

    def _ensure_structure(self) -> None:
        f = self._f
        for key in ALL_KEYS:
            name = f"metrics/{key}"
            if name not in f:
                f.create_dataset(name, shape=(0, 2), maxshape=(None, 2), chunks=(256, 2), dtype="<f8")
        if "events" not in f:
            f.create_dataset("events", shape=(0,), maxshape=(None,), chunks=(64,), dtype=EVENT_DTYPE)
        for g in ("rng", "attempts", "topology"):
            f.require_group(g)

    # -- structural changes (leave SWMR briefly) ---------------------------------------
    def _restructure(self):
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

    def set_topology(self, attrs: Mapping[str, object]) -> None:
        self._restructure()
        topo = self._f["topology"]
        for k in list(topo.attrs):
            del topo.attrs[k]
        for k, v in attrs.items():
            topo.attrs[k] = _attr_value(v)
        self._resume_swmr()

    def add_attempt(self, attrs: Mapping[str, object]) -> int:
        self._restructure()
        att = self._f["attempts"]
        n = len(att)
        g = att.create_group(str(n))
        for k, v in attrs.items():
            g.attrs[k] = _attr_value(v)
        self._resume_swmr()
        return n

    def write_rng(self, step: int, states: Mapping[int, bytes]) -> None:
        self._restructure()
        name = f"rng/step_{step}"
        if name in self._f:
            del self._f[name]
        g = self._f.create_group(name)
        for rank, blob in sorted(states.items()):
            g.create_dataset(f"rank_{rank}", data=np.frombuffer(blob, dtype=np.uint8))
        self._resume_swmr()

    def drop_rng_after(self, step: int) -> None:
        later = [n for n in self._f["rng"] if int(n.split("_")[1]) > step]
        if not later:
            return
        self._restructure()
        for n in later:
            del self._f[f"rng/{n}"]
        self._resume_swmr()

    # -- appends (SWMR-safe) -------------------------------------------------------------
    def append_metrics(self, step: int, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            ds = self._f[f"metrics/{key}"]
            n = ds.shape[0]
            ds.resize((n + 1, 2))
            ds[n] = (float(step), float(value))
            ds.flush()
        self._f.flush()

    def event(self, step: int, kind: str, text: str) -> None:
        assert kind in EVENT_KINDS, kind
        ds = self._f["events"]
        n = ds.shape[0]
        ds.resize((n + 1,))
        ds[n] = (step, time.time(), kind.encode(), text.encode("utf-8")[:1024])
        ds.flush()
        self._f.flush()

    def truncate_after(self, step: int, inclusive_keys: tuple[str, ...] = ()) -> int:
        """Drop metric rows with step > `step` (>= `step` for `inclusive_keys`); returns how
        many rows were dropped."""
        dropped = 0
        for key in ALL_KEYS:
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

    def last_step(self) -> int:
        ds = self._f["metrics/train/nft_loss"]
        return int(ds[-1, 0]) if ds.shape[0] else 0

    def close(self) -> None:
        if self._f.id.valid:
            self._f.flush()
            self._f.close()


def _attr_value(v):
    if isinstance(v, (list, tuple, dict)):
        return json.dumps(v)
    if v is None:
        return ""
    if isinstance(v, str):
        return str(v)  # plain str: h5py refuses str subclasses such as torch's version string
    return v


# -- reading ----------------------------------------------------------------------------
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
    if not os.path.exists(path):
        raise RunFileError(f"{path}: no such run file")
    try:
        # No file lock: a reader must never block the writer's brief reopen (SWMR needs none).
        return h5py.File(path, "r", libver="latest", swmr=True, locking=False)
    except OSError:
        pass
    try:
        return h5py.File(path, "r", locking=False)
    except OSError as e:
        raise RunFileError(f"{path}: not an HDF5 run file ({str(e).splitlines()[0]})") from None


def _walk_metrics(group: h5py.Group, prefix: str, out: dict[str, np.ndarray]) -> None:
    for name, obj in group.items():
        key = f"{prefix}{name}"
        if isinstance(obj, h5py.Group):
            _walk_metrics(obj, key + "/", out)
        else:
            if obj.ndim != 2 or obj.shape[1] != 2 or obj.dtype.kind != "f":
                raise RunFileError(f"metric {key!r} has shape {obj.shape} dtype {obj.dtype}, expected (n, 2) float")
            obj.refresh() if hasattr(obj, "refresh") else None
            out[key] = np.asarray(obj[()], dtype=np.float64)


def read_run(path: str) -> RunData:
    """Read a whole run file, validating it against the schema; raises RunFileError."""
    if os.path.isdir(path):
        path = os.path.join(path, "run.h5")
    f = open_for_reading(path)
    try:
        attrs = {k: _decode(v) for k, v in f.attrs.items()}
        if attrs.get("schema") != SCHEMA:
            raise RunFileError(f"{path}: not an hpcnft run file of schema {SCHEMA} (schema={attrs.get('schema')!r})")
        try:
            config = json.loads(attrs.get("config", "{}"))
        except (json.JSONDecodeError, TypeError):
            raise RunFileError(f"{path}: root attribute 'config' is not valid JSON") from None
        if "metrics" not in f or not isinstance(f["metrics"], h5py.Group):
            raise RunFileError(f"{path}: no 'metrics' group")
        metrics: dict[str, np.ndarray] = {}
        _walk_metrics(f["metrics"], "", metrics)
        topology = {k: _decode(v) for k, v in f["topology"].attrs.items()} if "topology" in f else {}
        attempts = []
        if "attempts" in f:
            for name in sorted(f["attempts"], key=lambda s: int(s) if s.isdigit() else 1 << 30):
                attempts.append({"n": name, **{k: _decode(v) for k, v in f["attempts"][name].attrs.items()}})
        events = []
        if "events" in f:
            ds = f["events"]
            ds.refresh() if hasattr(ds, "refresh") else None
            if ds.dtype.names != EVENT_DTYPE.names:
                raise RunFileError(f"{path}: 'events' has fields {ds.dtype.names}, expected {EVENT_DTYPE.names}")
            for row in ds[()]:
                events.append({"step": int(row["step"]), "time": float(row["time"]),
                               "kind": row["kind"].decode(errors="replace"),
                               "text": row["text"].decode(errors="replace")})
        rng_steps = sorted(int(n.split("_")[1]) for n in f["rng"]) if "rng" in f else []
    except RunFileError:
        raise
    except (OSError, KeyError, ValueError, TypeError) as e:
        raise RunFileError(f"{path}: unreadable run file ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    finally:
        f.close()
    return RunData(path, attrs, config, metrics, topology, attempts, events, rng_steps)


def read_rng(path: str, step: int) -> dict[int, bytes]:
    with open_for_reading(path) as f:
        g = f.get(f"rng/step_{step}")
        if g is None:
            raise RunFileError(f"{path}: no RNG states for step {step}")
        return {int(n.split("_")[1]): bytes(g[n][()]) for n in g}


def _decode(v):
    if isinstance(v, bytes):
        return v.decode(errors="replace")
    if isinstance(v, np.generic):
        return v.item()
    return v

