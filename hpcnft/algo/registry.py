"""The RL algorithms by name (algo.name), one line each: the module of its AlgorithmSpec
(hpcnft.algo.spec; torch-free), in the algorithm's own folder. A new algorithm is a folder under
hpcnft/algo/ and a line here."""
from __future__ import annotations

import importlib
from functools import cache

from hpcnft.algo.spec import AlgorithmSpec

ALGORITHMS = {
    "nft": "hpcnft.algo.nft.spec",
    "flow_grpo": "hpcnft.algo.flow_grpo.spec",
    "mixgrpo": "hpcnft.algo.mixgrpo.spec",
}


@cache
def spec_of(name: str) -> AlgorithmSpec:
    return importlib.import_module(ALGORITHMS[name]).SPEC


def specs() -> list[AlgorithmSpec]:
    return [spec_of(name) for name in ALGORITHMS]


def algorithm_for(cfg):
    """algo.name's Algorithm (hpcnft.algo.protocol) for this config: imports its folder's torch code."""
    module, _, cls = spec_of(cfg.algo.name).implementation.partition(":")
    return getattr(importlib.import_module(module), cls)(cfg)
