"""What still holds a freed stack's memory: the live tensors of a device, largest storages
first, each with the chain of Python objects that refers to it, up to a root (a module, a
class, a function's closure). The bench records it where memory stays allocated after a stack
is freed, so one run on the device names the holder."""
from __future__ import annotations

import contextlib
import gc
import sys
import types
import warnings

ROOTS = (types.ModuleType, type)


@contextlib.contextmanager
def unfrozen():
    """gc's frozen objects (gc.freeze: a fork server's, hpcnft.common.collector's) back in its
    generations for the walk: gc.get_objects and gc.get_referrers skip the frozen ones."""
    frozen = gc.get_freeze_count()
    if frozen:
        gc.unfreeze()
    try:
        yield
    finally:
        if frozen:
            gc.freeze()


def describe(obj, child=None) -> str:
    """A short name for one link of a chain (a dict's: the key that holds `child`)."""
    if isinstance(obj, dict):
        key = next((k for k, v in obj.items() if v is child or k is child), None)
        return f"dict[{key!r}]" if isinstance(key, str) else f"dict of {len(obj)}"
    if isinstance(obj, types.FunctionType):
        return f"function {obj.__module__}.{obj.__qualname__}"
    if isinstance(obj, types.CellType):
        return "closure cell"
    if isinstance(obj, types.FrameType):
        return f"frame {obj.f_code.co_filename}:{obj.f_lineno} {obj.f_code.co_name}"
    if isinstance(obj, types.ModuleType):
        return f"module {obj.__name__}"
    if isinstance(obj, type):
        return f"class {obj.__module__}.{obj.__qualname__}"
    if isinstance(obj, (list, tuple, set)):
        return f"{type(obj).__name__} of {len(obj)}"
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def referrer_chain(obj, depth: int = 14, skip: tuple = ()) -> list[str]:
    """The objects that keep `obj` alive, nearest first: a breadth-first walk up gc's referrers
    to the first root (a module, a class, an object nothing tracked refers to), described.
    `skip`: the caller's own objects that refer to `obj` (its frame, its containers)."""
    parent: dict[int, object | None] = {id(obj): None}
    keep = {id(obj): obj}
    ignore = {id(sys._getframe()), id(skip), id(parent), id(keep), *map(id, skip)}
    level, end = [obj], None
    with unfrozen():
        for _ in range(depth):
            ignore.add(id(level))
            nxt: list = []
            ignore.add(id(nxt))
            for o in level:
                refs = gc.get_referrers(o)
                ignore.add(id(refs))
                refs = [r for r in refs if id(r) not in ignore and id(r) not in parent]
                ignore.add(id(refs))
                if not refs or isinstance(o, ROOTS):
                    end = o
                    break
                for r in refs:
                    parent[id(r)] = o
                    keep[id(r)] = r
                    nxt.append(r)
            if end is not None or not nxt:
                break
            level = nxt
    end = level[-1] if end is None else end
    chain = []
    while end is not None:
        below = parent.get(id(end))
        chain.append(describe(end, below))
        end = below
    return chain[-2::-1]  # from the nearest holder up; the object itself left out


def held_tensors(device_type: str, top: int = 3, depth: int = 14) -> dict:
    """The tensors alive on `device_type` that Python objects hold: their storages' total GiB
    and, for the `top` largest storages, their shape, dtype and referrer chain."""
    import torch

    gc.collect()
    by_storage: dict[int, torch.Tensor] = {}
    with warnings.catch_warnings(), unfrozen():  # isinstance on a deprecated torch class warns
        warnings.simplefilter("ignore")
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    t = None
    for t in objects:
        if t.device.type == device_type and not t.is_meta:
            try:
                by_storage.setdefault(t.untyped_storage().data_ptr(), t)
            except RuntimeError:  # a tensor without a storage (a subclass's wrapper)
                pass
    del objects, t
    sizes = {ptr: t.untyped_storage().nbytes() for ptr, t in by_storage.items()}
    largest = sorted(sizes, key=sizes.get, reverse=True)[:top]
    out = {"python_held_gib": round(sum(sizes.values()) / 2**30, 3), "largest": []}
    for ptr in largest:
        t = by_storage[ptr]
        out["largest"].append({"gib": round(sizes[ptr] / 2**30, 3), "shape": list(t.shape), "dtype": str(t.dtype),
                               "held_by": referrer_chain(t, depth, skip=(by_storage, sys._getframe()))})
    return out


def held_summary(held: dict) -> str:
    """One line of held_tensors' finding: how much Python holds, and the largest storage's holders."""
    if not held["largest"]:
        return "no tensor that Python holds: C++ (the autograd graph, an extension) holds it"
    top = held["largest"][0]
    return (f"{held['python_held_gib']:.2f} GiB held by Python objects; the largest ({top['gib']:.2f} GiB, "
            f"{top['shape']}) by: " + " <- ".join(top["held_by"]))
