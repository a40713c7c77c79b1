"""Train ranks of one host take turns while their base transformer sits in host memory, from the
folder's load until Policy moves it (a LoRA run's in the compute dtype, FLUX.1-dev's 22 GiB in
bf16; a full fine-tune's in fp32, 44 GiB), so that two ranks loading at once do not take a node. `layout.stagger_loads = "auto"` takes turns only
where all of them at once would pass STAGGER_FRACTION of the memory available when the ranks start;
a turn is an exclusive lock on a host-local file named after the run dir."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import math
import os
import tempfile

STAGGER_FRACTION = 0.8


def read_bytes(path: str, itemsize: int = 4, subfolder: str = "transformer") -> int:
    """The part's parameters x `itemsize` bytes, from its safetensors headers (no weights read)."""
    from hpcnft.models.folder_check import read_header, weight_files

    return itemsize * sum(math.prod(shape) for rel in weight_files("", path, subfolder)
                   for shape in read_header("", path, rel).values())


def turns_needed(setting: str, per_rank: int, ranks_on_host: int, available: int) -> bool:
    """Whether the host's train ranks load one at a time (pure: the decision alone)."""
    if setting != "auto":
        return setting == "always" and ranks_on_host > 1
    return ranks_on_host > 1 and per_rank * ranks_on_host > STAGGER_FRACTION * available


def lock_path(run_dir: str) -> str:
    digest = hashlib.sha1(os.path.abspath(run_dir).encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"hpcnft-load-{digest}.lock")


@contextlib.contextmanager
def load_turn(run_dir: str, take: bool):
    """Hold this host's loading turn for the run while the block runs (no-op unless `take`)."""
    if not take:
        yield
        return
    with open(lock_path(run_dir), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
