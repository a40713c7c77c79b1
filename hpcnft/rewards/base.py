"""The contract every reward term keeps, and the tiny-model cache the terms share.

A term is a callable `term(prompts, images) -> scores`: prompts[i] is scored against images[i]
(uint8 [n, H, W, 3] on the CPU, numpy or torch), scores are float32 [n] on the CPU. A term does
its own preprocessing (the reference's, bit for bit where the reference runs here) and holds no
state between calls, so that a chunk's scores do not depend on which rank or batch scored it.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from typing import Callable, Protocol

import numpy as np
import torch

from hpcnft.models.tiny_cache import DONE_MARKER, cache_dir


class RewardTerm(Protocol):
    def __call__(self, prompts: list[str], images: np.ndarray | torch.Tensor) -> torch.Tensor: ...


def as_uint8_numpy(images: np.ndarray | torch.Tensor) -> np.ndarray:
    """[n, H, W, 3] uint8 as a C-contiguous numpy array (the PIL paths' input)."""
    if isinstance(images, torch.Tensor):
        images = images.cpu().numpy()
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"reward terms take uint8 images [n, H, W, 3], got {images.dtype} {tuple(images.shape)}")
    return np.ascontiguousarray(images)


def tiny_cache(cfg) -> str:
    """Where the terms' tiny models are built: models.tiny_cache, else the default cache."""
    return cfg.models.tiny_cache or cache_dir()


def ensure_tiny(cache_dir: str, name: str, build: Callable[[str], None]) -> str:
    """CACHE/NAME built by `build(folder)` on first use. Ranks that start together take a file
    lock so that exactly one builds; a build is moved into place whole, then marked done."""
    final = os.path.join(cache_dir, name)
    done = os.path.join(final, DONE_MARKER)
    if os.path.exists(done):
        return final
    os.makedirs(cache_dir, exist_ok=True)
    with open(os.path.join(cache_dir, f".{name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(done):
            with tempfile.TemporaryDirectory(dir=cache_dir, prefix=f".build-{name}-") as tmp:
                built = os.path.join(tmp, name)
                os.makedirs(built)
                build(built)
                if os.path.exists(final):
                    shutil.rmtree(final)
                os.replace(built, final)
            with open(done, "w") as f:
                f.write("built\n")
    return final
