"""Another algorithm's path as a bench stack, measured beside DiffusionNFT's in the same process
(`hpcnft bench --algo nft,NAME`): the package's own code with algo.name = NAME and the values its
SD3.5-M recipe gives the algorithm (its spec's bench_overrides: Flow-GRPO's CFG 4.5 in the
rollout and the trained forward, its KL to the base, 2 updates a step), at the shapes' sizes and
with the stack's levers but those the algorithm refuses (its spec's refused_levers). Phases: the
train pairs (its trainer's step on `mb` samples x TRAIN_K trained steps, one update) and the whole
iteration (its rollout, decode, reward, its updates)."""
from __future__ import annotations

from hpcnft.algo.registry import spec_of
from hpcnft.bench.stack import HpcnftStack

GUIDANCE = "rollout.guidance_scale"


def algorithm_overrides(name: str, overrides: dict, family: str) -> dict:
    spec = spec_of(name)
    out = {k: v for k, v in overrides.items() if k not in spec.refused_levers}
    out.update({"algo.name": name, **spec.bench_overrides})
    if family == "flux" and GUIDANCE in spec.bench_overrides:  # FLUX.1-dev embeds its guidance: the NFT recipe's value
        out.pop(GUIDANCE)
    return out


class AlgorithmStack(HpcnftStack):
    def __init__(self, key: str, label: str, S, dev, overrides: dict, name: str):
        super().__init__(key, label, S, dev, algorithm_overrides(name, overrides, S.family))
