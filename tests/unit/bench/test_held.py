"""bench.held: what still holds a freed stack's tensors, named by the chain of referrers (the
bench records it where memory stays allocated after a stack is freed)."""
from __future__ import annotations

import functools
import gc
import weakref

import torch

from hpcnft.bench.held import held_summary, held_tensors, referrer_chain


class _Rope(torch.nn.Module):
    """A submodule whose method caches on `self` at class level, as diffusers' Qwen-Image RoPE does."""

    def __init__(self, numel: int):
        super().__init__()
        self.freqs = torch.nn.Parameter(torch.zeros(numel))

    @functools.lru_cache(maxsize=None)  # noqa: B019 - the leak under test
    def table(self, n: int) -> int:
        return n


class _Dit(torch.nn.Module):
    def __init__(self, numel: int):
        super().__init__()
        self.pos_embed = _Rope(numel)
        self.proj = torch.nn.Linear(2, 2)


def test_a_parameter_kept_by_a_class_level_cache_names_the_cache_and_the_class():
    dit = _Dit(7_654_321)  # a size no other live tensor of the test process has
    dit.pos_embed.table(3)
    param = dit.pos_embed.freqs
    del dit
    chain = referrer_chain(param)
    del param
    assert chain[:3] == ["dict['freqs']", "dict['_parameters']", f"{__name__}._Rope"], chain
    assert "functools._lru_cache_wrapper" in chain and chain[-1] == f"class {__name__}._Rope", chain

    big = _Dit(1 << 26)  # 256 MiB (untouched zeros: no memory is written): the process's largest tensor
    big.pos_embed.table(5)
    gone = weakref.ref(big.pos_embed.freqs)
    del big
    try:
        (largest,) = held_tensors("cpu", top=1)["largest"]
    finally:
        _Rope.table.cache_clear()
    assert largest["shape"] == [1 << 26] and largest["gib"] == 0.25 and largest["dtype"] == "torch.float32", largest
    assert largest["held_by"][:3] == chain[:3] and largest["held_by"][-1] == chain[-1], largest
    assert gone() is None  # the cache was all that held it


def test_objects_gc_froze_are_walked_too_and_stay_frozen():
    """A fork server freezes what it imported (gc.freeze), which gc.get_referrers skips."""
    dit = _Dit(5_432_101)
    dit.pos_embed.table(4)
    param = dit.pos_embed.freqs
    del dit
    gc.freeze()
    try:
        chain = referrer_chain(param)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        _Rope.table.cache_clear()
    assert "functools._lru_cache_wrapper" in chain and chain[-1] == f"class {__name__}._Rope", chain


def test_a_tensor_held_only_by_its_own_frame_has_no_chain_and_the_summary_says_who_holds_the_largest():
    t = torch.zeros(3)
    assert referrer_chain(t, skip=(__import__("sys")._getframe(),)) == []
    held = {"python_held_gib": 38.12, "largest": [{"gib": 38.0, "shape": [3072], "held_by": ["dict['w']", "class X"]}]}
    assert held_summary(held) == ("38.12 GiB held by Python objects; the largest (38.00 GiB, [3072]) by: "
                                  "dict['w'] <- class X")
    assert "C++" in held_summary({"python_held_gib": 0.0, "largest": []})
