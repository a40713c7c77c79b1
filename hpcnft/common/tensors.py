"""Small torch helpers shared by the trainer and the perf levers: sharded parameters (FSDP2
DTensors), module lists cached on a module tree, and swapping a module's class for a while."""
from __future__ import annotations

import contextlib

import torch


def local_shard(p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter (FSDP2 holds them as DTensors)."""
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole of a (possibly sharded) tensor."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def module_list(root, key: str, find):
    """`find(root)`, computed once per module tree and kept on it: the DiT's modules do not change
    once the Policy is built, and walking its ~3,000 modules at every entry of a no-grad pass left
    the GPU waiting (the rollout's and v_old's entries, each iteration)."""
    cache = root.__dict__.setdefault("_hpcnft_module_lists", {})
    if key not in cache:
        cache[key] = find(root)
    return cache[key]


def linear_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype F.linear(x, ...) gives: the autocast dtype where autocast is on, else x's (for
    the levers that replace a linear by their own GEMMs)."""
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


_MIXED: dict = {}


@contextlib.contextmanager
def mixed_in(modules, mixin, prefix: str):
    """While inside, each module's class is a subclass of (mixin, its class), named prefix +
    its class's name and made once per class, so isinstance and super().forward still hold; on
    exit the classes are put back. How the levers swap a module's forward without copying it."""
    originals = [type(m) for m in modules]
    try:
        for m, cls in zip(modules, originals):
            if (mixin, cls) not in _MIXED:
                _MIXED[mixin, cls] = type(prefix + cls.__name__, (mixin, cls), {})
            m.__class__ = _MIXED[mixin, cls]
        yield
    finally:
        for m, cls in zip(modules, originals):
            m.__class__ = cls
