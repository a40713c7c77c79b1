"""A run's checkpoint folders as files, without torch: where they are, which are committed (the
COMPLETE marker written last, the JSON files whole), and their JSON. The starting process reads
them to answer before any rank starts (a finished run, a config a resume must refuse);
io.checkpoint adds what only torch can check (the DCP metadata and shards)."""
from __future__ import annotations

import json
import os
import re

COMPLETE = "COMPLETE"
STEP_DIR = re.compile(r"^step_(\d{6,})$")
JSON_FILES = ("trainer_state.json", "config.json")


def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def step_dir(run_dir: str, step: int) -> str:
    return os.path.join(checkpoint_root(run_dir), f"step_{step:06d}")


def partial_dir(run_dir: str, step: int) -> str:
    return step_dir(run_dir, step) + ".partial"


def list_checkpoints(run_dir: str) -> list[tuple[int, str]]:
    root = checkpoint_root(run_dir)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = STEP_DIR.match(name)
        if m:
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found)


def read_json(path: str, name: str) -> dict:
    with open(os.path.join(path, name)) as f:
        return json.load(f)


def file_problems(path: str) -> str | None:
    """Why checkpoint `path` is not committed as files (its marker, its JSON), or None."""
    if not os.path.exists(os.path.join(path, COMPLETE)):
        return "no COMPLETE marker"
    for name in (*JSON_FILES, ".metadata"):
        if not os.path.isfile(os.path.join(path, name)):
            return f"{name} is missing"
    for name in JSON_FILES:
        try:
            doc = read_json(path, name)
        except (OSError, ValueError, RecursionError):
            return f"{name} is unreadable"
        if not isinstance(doc, dict):
            return f"{name} is not a JSON object"
    ts = read_json(path, "trainer_state.json")
    if not (isinstance(ts.get("step"), int) and isinstance(ts.get("scaler"), dict)):
        return "trainer_state.json lacks step or scaler"
    return None


def newest_committed(run_dir: str) -> tuple[int, str] | None:
    """The newest checkpoint committed as files (io.checkpoint.latest_usable checks the rest)."""
    for step, path in reversed(list_checkpoints(run_dir)):
        if file_problems(path) is None:
            return step, path
    return None


BEST = "BEST"  # checkpoints/BEST: checkpoint.keep_best's best checkpoint, {"step", "metric", "value"}


def read_best(run_dir: str) -> dict | None:
    """The best checkpoint's record (None: none was kept, or the record is unreadable)."""
    try:
        doc = read_json(checkpoint_root(run_dir), BEST)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("step"), int) else None


def write_best(run_dir: str, step: int, metric: str, value: float) -> None:
    """Name checkpoint `step` the best by `metric` (written whole, then renamed into place)."""
    path = os.path.join(checkpoint_root(run_dir), BEST)
    with open(path + ".tmp", "w") as f:
        json.dump({"step": step, "metric": metric, "value": value}, f)
    os.replace(path + ".tmp", path)


def prunable(run_dir: str, keep: int) -> list[str]:
    """The committed checkpoints pruning deletes: all but the newest `keep` and the best one."""
    best = read_best(run_dir)
    older = list_checkpoints(run_dir)[:-keep]
    return [path for step, path in older if best is None or step != best["step"]]
