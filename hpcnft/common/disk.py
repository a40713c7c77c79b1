"""Sizes on disk, standard library only (the spawner, the tools and the ranks use it alike)."""
from __future__ import annotations

import os


def folder_bytes(path: str) -> int:
    """The bytes of every file below `path` (a checkpoint, a model folder)."""
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)
