"""The contract every reward term keeps (their tiny models go to models.tiny_cache).

A term is a callable `term(prompts, images) -> scores`: prompts[i] is scored against images[i]
(uint8 [n, H, W, 3] on the CPU, numpy or torch), scores are float32 [n] on the CPU. A term does
its own preprocessing (the reference's, bit for bit where the reference runs here) and holds no
state between calls, so that a chunk's scores do not depend on which rank or batch scored it.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np
import torch


class RewardTerm(Protocol):
    def __call__(self, prompts: list[str], images: np.ndarray | torch.Tensor) -> torch.Tensor: ...


def as_uint8_numpy(images: np.ndarray | torch.Tensor) -> np.ndarray:
    """[n, H, W, 3] uint8 as a C-contiguous numpy array (the PIL paths' input)."""
    if isinstance(images, torch.Tensor):
        images = images.cpu().numpy()
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"reward terms take uint8 images [n, H, W, 3], got {images.dtype} {tuple(images.shape)}")
    return np.ascontiguousarray(images)
