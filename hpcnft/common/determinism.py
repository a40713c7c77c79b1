"""Deterministic mode and stable-hash seeds (docs/architecture.md, "Contracts the code keeps").

No draw uses process-global RNG: every random stream is a generator seeded with
stable_hash(purpose, seed, ...), never Python's salted `hash`, and never keyed by rank, so which
rank produces a sample does not change it.
"""
from __future__ import annotations

import hashlib
import os
import pickle  # only to serialise our own RNG states into bytes; never used to load foreign data
import random

import numpy as np
import torch

from hpcnft.common import safe_pickle
from hpcnft.common.errors import one_line


def stable_hash(*parts) -> int:
    """blake2b-64 of the ':'-joined parts, masked to 63 bits (a valid torch seed)."""
    digest = hashlib.blake2b(":".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def enable(enabled: bool, cpu_threads: int, device_type: str) -> None:
    """Set deterministic mode. The environment variables must be set before CUDA/NCCL start,
    so the launcher also exports them (see distributed.spawn_env)."""
    torch.set_num_threads(cpu_threads)
    if not enabled:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NCCL_DETERMINISTIC", "1")
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def seed_globals(seed: int) -> None:
    """Seed the process-global RNGs for anything a library draws (ours never do)."""
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


def capture_rng_state() -> bytes:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state().numpy(),
        "cuda": [s.numpy() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
    }
    return pickle.dumps(state, protocol=4)


def load_rng_state(blob: bytes) -> dict:
    """The states captured by `capture_rng_state`, read without executing anything;
    pickle.UnpicklingError (one line) for bytes that are anything else."""
    try:
        state = safe_pickle.loads(blob, lambda *g: g in _RNG_GLOBALS, "refusing to load {} from an RNG state")
    except pickle.UnpicklingError:
        raise
    except Exception as e:  # noqa: BLE001 - truncated or random bytes
        raise pickle.UnpicklingError(f"not an RNG state ({one_line(e)})") from None
    if not isinstance(state, dict) or set(state) != {"python", "numpy", "torch", "cuda"}:
        raise pickle.UnpicklingError("not an RNG state (unexpected content)")
    return state


def restore_rng_state(blob: bytes) -> None:
    """Restore states captured by `capture_rng_state` in this run (our own bytes only)."""
    state = load_rng_state(blob)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(torch.from_numpy(state["torch"]))
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.from_numpy(s) for s in state["cuda"]])


# The plain containers and numpy arrays an RNG state is made of.
_RNG_GLOBALS = {("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
                ("numpy._core.multiarray", "_reconstruct"), ("builtins", "tuple"), ("builtins", "list")}
