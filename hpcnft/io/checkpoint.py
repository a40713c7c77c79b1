"""Checkpoints on torch.distributed.checkpoint (DCP), committed atomically.

RUN_DIR/checkpoints/step_000020/
    .metadata, __*_*.distcp   DCP shards of every train rank: trained params, the old policy
                              (EMA shadow), the evaluation EMA (eval.policy="ema") and the
                              optimizer, resharded on load if the number of train ranks changed
    trainer_state.json        step, prompt cursor, loss scaler
    config.json               the resolved config the run was started with
    rng/rank_<r>.bin          every rank's global RNG states (the reward rank writes its own)
    run_state.h5              run.h5's content up to this step (io.run_state): what a lost or
                              damaged run.h5 is rebuilt from
    COMPLETE                  written last, before the directory gets its final name

A checkpoint is written as step_XXXXXX.partial and renamed when complete; one without COMPLETE,
or whose metadata names a shard file that is missing, is never loaded.
"""
from __future__ import annotations

import io
import json
import os
import warnings
import pickle  # only through AllowListUnpickler
import shutil
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions

from hpcnft.common import determinism
from hpcnft.common.errors import first_line, one_line
from hpcnft.common.safe_pickle import AllowListUnpickler
from hpcnft.io.checkpoint_dirs import (COMPLETE, STEP_DIR, checkpoint_root, file_problems,  # noqa: F401 (the
                                       list_checkpoints, partial_dir, prunable, read_best, read_json,  # checkpoint
                                       step_dir, write_best)  # API)

MODEL_OPTIONS = StateDictOptions(ignore_frozen_params=True)
LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)  # frozen weights come from disk


class CheckpointError(Exception):
    pass


# DCP's .metadata is a pickle: it is read with only the classes checkpoint metadata is made of.
_METADATA_MODULES = {"torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"}
_METADATA_NAMES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                   ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset")}


def _metadata_global(module: str, name: str) -> bool:
    return module in _METADATA_MODULES or (module, name) in _METADATA_NAMES or (
        module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))


class _WeightsOnlyBytes:
    """The load planner as DCP's reader sees it, except that non-tensor items (optimizer
    hyper-parameters) load weights-only: DefaultLoadPlanner.load_bytes unpickles them with
    weights_only=False, so a planted shard could run code."""

    def __init__(self, planner):
        self._planner = planner

    def __getattr__(self, name):
        return getattr(self._planner, name)

    def load_bytes(self, read_item, value) -> None:
        from torch.distributed.checkpoint._traverse import set_element
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        p = self._planner
        if type(p) is not DefaultLoadPlanner:
            raise CheckpointError(f"cannot load non-tensor items safely through {type(p).__name__}")
        obj = torch.load(value, weights_only=True)
        if p.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes does, minus the code execution
            set_element(p.original_state_dict, p.mappings[read_item.dest_index.fqn], obj)
        else:
            p.state_dict[read_item.dest_index.fqn] = obj


class SafeReader(dcp.FileSystemReader):
    """FileSystemReader that executes nothing: the metadata is read with an allow-list
    unpickler, tensors load weights-only (as in DCP) and so do non-tensor items."""

    def read_data(self, plan, planner):
        return super().read_data(plan, _WeightsOnlyBytes(planner))

    def read_metadata(self, *args, **kwargs):
        with open(os.path.join(self.path, ".metadata"), "rb") as f:
            metadata = AllowListUnpickler(f, _metadata_global, "refusing {} in checkpoint metadata").load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def rng_path(ckpt_dir: str, rank: int) -> str:
    return os.path.join(ckpt_dir, "rng", f"rank_{rank}.bin")


# -- discovery ------------------------------------------------------------------------
def _reason(e: BaseException) -> str:
    """One line for a failure; for a DCP CheckpointException, the first rank's own error."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        e = first[0] if isinstance(first, tuple) and first else e
    return one_line(e)


MAX_RNG_BYTES = 1 << 24  # an RNG state file is ~12 KB


def _shard_problems(path: str, meta) -> str | None:
    """Shards that are missing, shorter than the metadata says, outside the checkpoint, or whose
    non-tensor items are not weights-only data (those are unpickled on load)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    byte_items = {fqn for fqn, md in (meta.state_dict_metadata or {}).items() if isinstance(md, BytesStorageMetadata)}
    sizes: dict[str, int] = {}
    for index, storage in (meta.storage_data or {}).items():
        rel = storage.relative_path
        if not isinstance(rel, str) or os.path.basename(rel) != rel or rel.startswith("."):
            return f"metadata names a shard outside the checkpoint ({str(rel)[:80]!r})"
        if rel not in sizes:
            if not os.path.isfile(os.path.join(path, rel)):
                return f"shard {rel} is missing"
            sizes[rel] = os.path.getsize(os.path.join(path, rel))
        offset, length = int(storage.offset), int(storage.length)
        if offset < 0 or length < 0 or offset + length > sizes[rel]:
            return f"shard {rel} is shorter than its metadata says"
        if index.fqn in byte_items:
            with open(os.path.join(path, rel), "rb") as f:
                f.seek(offset)
                blob = f.read(length)
            try:
                with warnings.catch_warnings():  # a planted blob's pickle protocol is no news to the user
                    warnings.simplefilter("ignore")
                    torch.load(io.BytesIO(blob), weights_only=True)
            except Exception as e:  # noqa: BLE001
                return f"shard {rel}: item {index.fqn} is not weights-only data ({type(e).__name__})"
    return None


def _rng_problems(path: str) -> str | None:
    rng_dir = os.path.join(path, "rng")
    if not os.path.isdir(rng_dir):
        return None
    for name in sorted(os.listdir(rng_dir)):
        file = os.path.join(rng_dir, name)
        if not os.path.isfile(file) or os.path.getsize(file) > MAX_RNG_BYTES:
            return f"rng/{name} is not an RNG state file"
        with open(file, "rb") as f:
            blob = f.read()
        try:
            determinism.load_rng_state(blob)
        except pickle.UnpicklingError as e:
            return f"rng/{name}: {first_line(e, 'not an RNG state')}"
    return None


def problems(path: str) -> str | None:
    """Why the checkpoint at `path` must not be loaded, or None when it is complete. Reading
    it executes nothing: the metadata goes through an allow-list unpickler, the non-tensor
    items of the shards and the RNG states through weights-only / allow-list loaders."""
    why = file_problems(path)
    if why:
        return why
    try:
        meta = SafeReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - any unreadable metadata disqualifies it
        return f"unreadable DCP metadata ({type(e).__name__})"
    try:
        why = _shard_problems(path, meta) or _rng_problems(path)
    except Exception as e:  # noqa: BLE001 - metadata of the wrong shape, unreadable files
        why = f"unreadable checkpoint ({_reason(e)})"
    return why or None


def latest_usable(run_dir: str, warn) -> tuple[int, str] | None:
    """The newest complete checkpoint; every newer one that is not usable gets a warning."""
    for step, path in reversed(list_checkpoints(run_dir)):
        why = problems(path)
        if why is None:
            return step, path
        warn(f"skipping checkpoint {path}: {why}")
    return None


# -- what is saved -------------------------------------------------------------------
@dataclass
class TrainState:
    step: int  # the prompt cursor is a function of the step (PromptStream)
    scaler: dict


def save(run_dir: str, step: int, parts: dict, train_group, is_writer: bool, rank: int, rng_blob: bytes) -> str:
    """Collective over the train ranks: the Stateful `parts` (name -> part) as DCP shards. The
    caller has the reward ranks write their RNG files into partial_dir() before the commit."""
    tmp = partial_dir(run_dir, step)
    try:
        if is_writer:
            if os.path.exists(tmp):
                shutil.rmtree(tmp)
            os.makedirs(os.path.join(tmp, "rng"), mode=0o700)
        dist.barrier(group=train_group) if train_group is not None else None
        with open(rng_path(tmp, rank), "wb") as f:
            f.write(rng_blob)
        dcp.save(dict(parts), checkpoint_id=tmp, process_group=train_group)
    except (OSError, dcp.CheckpointException) as e:  # a full disk, a read-only file system
        reason = _space_note(run_dir) + _reason(e)  # every rank's line says it: any may be the one printed
        if is_writer:
            discard_partial(run_dir, step)
        raise CheckpointError(f"{tmp}: cannot write the checkpoint ({reason})") from None
    return tmp


def _space_note(run_dir: str) -> str:
    """'file system full: ' when under 1 MiB is left (torch's writers turn ENOSPC into errors
    such as "unexpected pos"), else ''."""
    try:
        st = os.statvfs(checkpoint_root(run_dir))
    except OSError:
        return ""
    free = st.f_bavail * st.f_frsize
    return f"file system full, {free >> 10} KiB free: " if free < (1 << 20) else ""


def write_rng(run_dir: str, step: int, rank: int, blob: bytes) -> None:
    """Rank `rank`'s RNG file into the checkpoint of `step` being written (a reward rank's, asked
    by the train ranks during their save); CheckpointError naming the file where it cannot be
    written (a write's own OSError names no file)."""
    path = rng_path(partial_dir(run_dir, step), rank)
    try:
        with open(path, "wb") as f:
            f.write(blob)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot write the checkpoint ({_space_note(run_dir)}{_reason(e)})") from None


def discard_partial(run_dir: str, step: int) -> None:
    """Remove what a failed checkpoint wrote (best effort); older checkpoints stay as they are."""
    shutil.rmtree(partial_dir(run_dir, step), ignore_errors=True)


def commit(run_dir: str, step: int, train_state: TrainState, config_json: str, keep: int,
           write_run_state: Callable[[str], None] | None = None) -> str:
    """Rank 0, after every rank's files are in place: state, config, the run file's copy
    (write_run_state(path), rank 0's writer), COMPLETE, rename, prune."""
    tmp, final = partial_dir(run_dir, step), step_dir(run_dir, step)
    try:
        if write_run_state is not None:
            write_run_state(os.path.join(tmp, "run_state.h5"))
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump({"step": train_state.step, "scaler": train_state.scaler}, f, indent=2)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            f.write(config_json)
        with open(os.path.join(tmp, COMPLETE), "w") as f:
            f.write(f"{step}\n")
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
    except Exception as e:  # noqa: BLE001 - OSError, or the run file copy's RunFileError
        reason = _space_note(run_dir) + _reason(e)
        discard_partial(run_dir, step)
        raise CheckpointError(f"{tmp}: cannot write the checkpoint ({reason})") from None
    prune(run_dir, keep)
    return final


def prune(run_dir: str, keep: int) -> None:
    """Delete the committed checkpoints beyond the newest `keep`, but the best (checkpoint.keep_best)."""
    for old in prunable(run_dir, keep):
        shutil.rmtree(old, ignore_errors=True)


def load(path: str, parts: dict, train_group) -> TrainState:
    """Collective over the train ranks: the Stateful `parts` loaded in place (each lays out what
    it reads, then takes it: resharded where the number of train ranks changed)."""
    try:
        dcp.load(dict(parts), storage_reader=SafeReader(path), process_group=train_group)
    except (OSError, dcp.CheckpointException) as e:  # CheckpointException is a BaseException
        raise CheckpointError(f"{path}: cannot load the checkpoint ({_reason(e)})") from None
    except CheckpointError as e:  # a part that does not match what it is loaded into
        raise CheckpointError(f"{path}: {e}") from None
    ts = read_json(path, "trainer_state.json")
    return TrainState(int(ts["step"]), dict(ts["scaler"]))


def read_rng(path: str, rank: int) -> bytes | None:
    p = rng_path(path, rank)
    if not os.path.isfile(p):
        return None
    with open(p, "rb") as f:
        return f.read()
