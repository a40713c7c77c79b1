"""Checkpoints on torch.distributed.checkpoint (DCP), committed atomically.

RUN_DIR/checkpoints/step_000020/
    .metadata, __*_*.distcp   DCP shards of every train rank: trained params, the old policy
                              (EMA shadow) and the optimizer, resharded on load if the number
                              of train ranks changed
    trainer_state.json        step, prompt cursor, loss scaler
    config.json               the resolved config the run was started with
    rng/rank_<r>.bin          every rank's global RNG states (the reward rank writes its own)
    COMPLETE                  written last, before the directory gets its final name

A checkpoint is written as step_XXXXXX.partial and renamed when complete; one without COMPLETE,
or whose metadata names a shard file that is missing, is never loaded.
"""
from __future__ import annotations

import json
import os
import pickle  # only through _MetadataUnpickler
import re
import shutil
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor

COMPLETE = "COMPLETE"
STEP_DIR = re.compile(r"^step_(\d{6,})$")
MODEL_OPTIONS = StateDictOptions(ignore_frozen_params=True)
LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)  # frozen weights come from disk


class CheckpointError(Exception):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata is a pickle: read it with only the classes checkpoint metadata is made
    of, so a planted file cannot run code."""

    MODULES = {"torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"}
    NAMES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
             ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset")}

    def find_class(self, module, name):
        allowed = module in self.MODULES or (module, name) in self.NAMES or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        if not allowed:
            raise pickle.UnpicklingError(f"refusing {module}.{name} in checkpoint metadata")
        return super().find_class(module, name)


class SafeReader(dcp.FileSystemReader):
    """FileSystemReader whose metadata load executes nothing (shards load weights-only)."""

    def read_metadata(self, *args, **kwargs):
        with open(os.path.join(self.path, ".metadata"), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def step_dir(run_dir: str, step: int) -> str:
    return os.path.join(checkpoint_root(run_dir), f"step_{step:06d}")


def partial_dir(run_dir: str, step: int) -> str:
    return step_dir(run_dir, step) + ".partial"


def rng_path(ckpt_dir: str, rank: int) -> str:
    return os.path.join(ckpt_dir, "rng", f"rank_{rank}.bin")


# -- discovery ------------------------------------------------------------------------
def problems(path: str) -> str | None:
    """Why the checkpoint at `path` must not be loaded, or None when it is complete."""
    if not os.path.exists(os.path.join(path, COMPLETE)):
        return "no COMPLETE marker"
    for name in ("trainer_state.json", "config.json", ".metadata"):
        if not os.path.isfile(os.path.join(path, name)):
            return f"{name} is missing"
    try:
        meta = SafeReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - any unreadable metadata disqualifies it
        return f"unreadable DCP metadata ({type(e).__name__})"
    for storage in (meta.storage_data or {}).values():
        rel = getattr(storage, "relative_path", None)
        if rel and not os.path.isfile(os.path.join(path, rel)):
            return f"shard {rel} is missing"
    try:
        with open(os.path.join(path, "trainer_state.json")) as f:
            json.load(f)
    except (OSError, json.JSONDecodeError):
        return "trainer_state.json is unreadable"
    return None


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


def latest_usable(run_dir: str, warn) -> tuple[int, str] | None:
    """The newest complete checkpoint; every newer one that is not usable gets a warning."""
    for step, path in reversed(list_checkpoints(run_dir)):
        why = problems(path)
        if why is None:
            return step, path
        warn(f"skipping checkpoint {path}: {why}")
    return None


def read_json(path: str, name: str) -> dict:
    with open(os.path.join(path, name)) as f:
        return json.load(f)


# -- what is saved -------------------------------------------------------------------
@dataclass
class TrainState:
    step: int
    prompt_cursor: int
    scaler: dict


def _shadow_state(policy) -> dict[str, torch.Tensor]:
    """The old-policy shadow as DTensors laid out like the live parameters."""
    out = {}
    for name, p, s in zip(policy.trainable_names, policy.trainable, policy.shadow):
        out[name] = (DTensor.from_local(s, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                     if isinstance(p, DTensor) else s)
    return out


def _state(policy, optimizer) -> dict:
    model = policy.transformer
    return {"model": get_model_state_dict(model, options=MODEL_OPTIONS),
            "old_policy": _shadow_state(policy),
            "optim": get_optimizer_state_dict(model, optimizer, options=MODEL_OPTIONS)}


def save(run_dir: str, step: int, policy, optimizer, train_group, is_writer: bool, rank: int,
         rng_blob: bytes) -> str:
    """Collective over the train ranks. The caller has the reward ranks write their RNG files
    into partial_dir() before the commit."""
    tmp = partial_dir(run_dir, step)
    if is_writer:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(os.path.join(tmp, "rng"), mode=0o700)
    dist.barrier(group=train_group) if train_group is not None else None
    with open(rng_path(tmp, rank), "wb") as f:
        f.write(rng_blob)
    dcp.save(_state(policy, optimizer), checkpoint_id=tmp, process_group=train_group)
    return tmp


def commit(run_dir: str, step: int, train_state: TrainState, config_json: str, keep: int) -> str:
    """Rank 0, after every rank's files are in place: state, config, COMPLETE, rename, prune."""
    tmp, final = partial_dir(run_dir, step), step_dir(run_dir, step)
    with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
        json.dump({"step": train_state.step, "prompt_cursor": train_state.prompt_cursor,
                   "scaler": train_state.scaler}, f, indent=2)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        f.write(config_json)
    with open(os.path.join(tmp, COMPLETE), "w") as f:
        f.write(f"{step}\n")
        f.flush()
        os.fsync(f.fileno())
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    for _, old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load(path: str, policy, optimizer, train_group) -> TrainState:
    """Collective over the train ranks: load params, shadow and optimizer in place."""
    model = policy.transformer
    state = _state(policy, optimizer)
    dcp.load(state, storage_reader=SafeReader(path), process_group=train_group)
    result = set_model_state_dict(model, state["model"], options=LOAD_OPTIONS)
    trained = set(policy.trainable_names)
    missing = [k for k in result.missing_keys if k in trained]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"{path}: does not match the model (missing {missing[:3]}, "
                              f"unexpected {list(result.unexpected_keys)[:3]})")
    set_optimizer_state_dict(model, optimizer, state["optim"], options=MODEL_OPTIONS)
    with torch.no_grad():
        for s, loaded in zip(policy.shadow, state["old_policy"].values()):
            s.copy_(loaded.to_local() if isinstance(loaded, DTensor) else loaded)
    ts = read_json(path, "trainer_state.json")
    return TrainState(int(ts["step"]), int(ts["prompt_cursor"]), dict(ts["scaler"]))


def read_rng(path: str, rank: int) -> bytes | None:
    p = rng_path(path, rank)
    if not os.path.isfile(p):
        return None
    with open(p, "rb") as f:
        return f.read()
